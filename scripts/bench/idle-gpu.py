# Does a GPU run the same work slower after it has idled? #54's steps over 1.1x came after
# 1.5 ms or more of GPU idle (docs/benchmarks.md "Load balance"); this times a fixed GEMM and a
# fixed device copy (CUDA events) after host-made idle gaps, and again with one spinning thread
# block (torch.cuda._sleep) keeping the GPU busy through each gap; and a captured graph of many
# small kernels around the GEMM, as a step is, also between small page-locked copies in and out.
# usage (GPU machine): python3 scripts/bench/idle-gpu.py [REPS [NAME]] (NAME: the work whose name has it)
import sys, time, statistics, torch

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 150
only = sys.argv[2] if len(sys.argv) > 2 else ""
dev = torch.device("cuda")
a = torch.randn(4096, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
src = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
dst = torch.empty_like(src)
work = {"gemm 4096x8192x8192 bf16": lambda: torch.mm(a, b), "copy 1 GiB": lambda: dst.copy_(src)}
# A captured graph like a step's: many small kernels around the GEMM, replayed.
x = torch.randn(1 << 20, device=dev)
def small_then_gemm():
    for _ in range(48): x.mul_(1.0001)
    torch.mm(a, b, out=c)
    for _ in range(48): x.add_(1e-4)
c = torch.empty(4096, 8192, device=dev, dtype=torch.bfloat16)
cap = torch.cuda.Stream()
with torch.cuda.stream(cap):
    for _ in range(3): small_then_gemm()
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    small_then_gemm()
work["graph: 96 small kernels + the gemm"] = g.replay
# As a step is timed: small copies in from page-locked memory, the graph, counts copied out
# (`cuda/rank`: the span from `launched` to `ended`), so the copy engines too.
h_in, d_in = torch.zeros(1024, pin_memory=True), torch.zeros(1024, device=dev)
h_out, d_out = torch.zeros(4096, pin_memory=True), torch.zeros(4096, device=dev)
def step_like():
    d_in.copy_(h_in, non_blocking=True)
    g.replay()
    h_out.copy_(d_out, non_blocking=True)
work["copy in, the graph, copy out"] = step_like
side = torch.cuda.Stream()
try:
    hz = torch.cuda.clock_rate() * 1e6
except Exception:
    hz = 1.98e9  # H200's boost clock: the spin's length only needs to cover the gap
print(torch.cuda.get_device_name(), "reps", reps)

def spin(s):  # a host busy-wait: time.sleep may overshoot a sub-millisecond gap
    end = time.perf_counter() + s
    while time.perf_counter() < end: pass

for name, f in work.items():
    if only not in name: continue
    for _ in range(20): f()
    torch.cuda.synchronize()
    base = None
    for warm in (False, True):
        for gap_ms in (0, 0.3, 0.6, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0):
            ts = []
            for _ in range(reps):
                if warm and gap_ms:
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(int(gap_ms * 1e-3 * hz))
                spin(gap_ms * 1e-3)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); f(); e.record(); e.synchronize()
                ts.append(s.elapsed_time(e) * 1e3)
            med = statistics.median(ts)
            base = base or med
            over = sum(t > 1.1 * base for t in ts)
            print("%-34s %-11s gap %5.1f ms: median %7.1f us (%.3fx of gap 0), p90 %.3fx, max %.3fx, over 1.1x %d of %d" % (
                name, "kept busy" if warm else "idle", gap_ms, med, med / base,
                sorted(ts)[int(0.9 * reps)] / base, max(ts) / base, over, reps))
