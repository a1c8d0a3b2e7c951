# How much does a placement's device copy slow a step it runs beside? #54's steps beside a
# layer's copies (604 MB a rank of Qwen3-30B-A3B's experts, bf16) ran up to 1.24x their median
# (docs/benchmarks.md "Load balance"). This times one rank's experts phase of that layer (64
# experts, hidden 2048, intermediate 768: gate/up, SwiGLU, down as batched GEMMs) alone and with
# BYTES of slot copies (9.4 MB a slot, its two matrices one device copy each, as
# `DeviceFfn::write_group` does) enqueued on a stream of their own just before it, at several
# rows per expert (128: a 2048-token group step; 512: 8192 tokens).
# usage (GPU machine): python3 scripts/bench/copy-beside.py [REPS]
import sys, statistics, torch

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
dev = torch.device("cuda")
E, H, I = 64, 2048, 768
bf = torch.bfloat16
w1 = torch.randn(E, H, 2 * I, device=dev, dtype=bf) * 0.02
w2 = torch.randn(E, I, H, device=dev, dtype=bf) * 0.02
# The staged slots a placement copies from, and the slots it writes (not the ones the GEMM reads:
# the numbers would not matter, the traffic does).
src1, src2 = torch.empty_like(w1), torch.empty_like(w2)
dst1, dst2 = torch.empty_like(w1), torch.empty_like(w2)
slot = (w1[0].numel() + w2[0].numel()) * 2
side = torch.cuda.Stream()
print(torch.cuda.get_device_name(), "reps", reps, "slot %.1f MB" % (slot / 1e6))


def experts(x):
    gu = torch.bmm(x, w1)
    a = torch.nn.functional.silu(gu[..., :I]) * gu[..., I:]
    return torch.bmm(a, w2)


def copies(n):
    with torch.cuda.stream(side):
        for j in range(n):
            dst1[j].copy_(src1[j])
            dst2[j].copy_(src2[j])


def timed(x, n):
    side.wait_stream(torch.cuda.current_stream())
    copies(n)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    experts(x)
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3


# Copies alone: their rate.
for n in (8, 64):
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            s.record(side)
            copies(n)
            e.record(side)
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    med = statistics.median(ts)
    print("copies alone: %2d slots %6.1f MB in %7.1f us, %.0f GB/s" % (n, n * slot / 1e6, med, n * slot / med / 1e3))

for rows in (128, 512):
    x = torch.randn(E, rows, H, device=dev, dtype=bf)
    for _ in range(10):
        experts(x)
    torch.cuda.synchronize()
    base = None
    for n in (0, 2, 4, 8, 16, 32, 64):
        ts = [timed(x, n) for _ in range(reps)]
        med = statistics.median(ts)
        base = base or med
        over = sum(t > 1.1 * base for t in ts)
        print("rows/expert %4d, copies beside %6.1f MB (%2d slots): median %7.1f us (%.3fx alone), max %.3fx, over 1.1x %3d of %d" % (
            rows, n * slot / 1e6, n, med, med / base, max(ts) / base, over, reps))
