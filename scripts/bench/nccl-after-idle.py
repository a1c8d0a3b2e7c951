# Does an NCCL exchange run longer after the GPUs or their links have idled? #54's slow steps
# on 2 GPUs were mostly a combine that ran 80-260 us long on both ranks, after idle
# (docs/benchmarks.md "Load balance", session 55). This times an all-to-all (NCCL send/recv, as
# the `nccl` backend's exchange) and, for contrast, a GEMM, each timed by CUDA events that the
# host enqueues while a spinning thread block (torch.cuda._sleep) holds the stream, so no host
# time is in the figure:
# - behind itself: right behind the same work (the links busy until then);
# - behind a spin of G ms: the GPU busy, the links idle for G ms;
# - after G ms idle: the GPU idle for G ms (host sleep), then a spin of SPIN ms (default 0.5:
#   a 0.1 ms spin left the host's enqueue in the figure on a VM), then the work; against
#   "behind a spin" of SPIN ms, what idle leaves behind that long after the GPU woke.
# Every rank runs the same shuffled order; a pair's time is the least over the ranks (the rank
# that started last: no wait for a late peer), as eplb-steps.py's group measure.
# usage (GPU machine, 2 GPUs):
#   python3 -m torch.distributed.run --nproc_per_node 2 scripts/bench/nccl-after-idle.py [REPS [MIB]]
import os, sys, time, random, statistics, torch, torch.distributed as dist

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
mib = int(sys.argv[2]) if len(sys.argv) > 2 else 16
hold = float(os.environ.get("SPIN", "0.5"))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
dev = torch.device("cuda", rank)
# MIB to each peer (and to itself), bf16, as a combine sends its rows back.
src = torch.randn(world * mib << 19, device=dev, dtype=torch.bfloat16)
dst = torch.empty_like(src)
a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
b = torch.randn(2048, 8192, device=dev, dtype=torch.bfloat16)
work = {"all-to-all": lambda: dist.all_to_all_single(dst, src), "gemm": lambda: torch.mm(a, b)}
# Cycles a ms of spinning takes (one thread block), measured.
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record(); torch.cuda._sleep(10_000_000); e1.record(); torch.cuda.synchronize()
per_ms = 10_000_000 / e0.elapsed_time(e1)
spin = lambda ms: torch.cuda._sleep(int(per_ms * ms))
for _ in range(20):
    for f in work.values(): f()
torch.cuda.synchronize()
cells = [(w, "behind itself", 0.0) for w in work] + [
    (w, how, g) for w in work for how, gaps in (("behind a spin", sorted({0.3, hold, 1.0, 3.0})),
                                                ("after idle", (0.3, 1.0, 3.0))) for g in gaps]
order = cells * reps
random.Random(0).shuffle(order)
times = []
for w, how, g in order:
    torch.cuda.synchronize()
    if how == "after idle":
        time.sleep(g / 1e3)
        spin(hold)  # holds the stream while the host enqueues the events and the work
    elif how == "behind a spin":
        spin(g)
    else:
        spin(hold); work[w]()
    e0.record(); work[w](); e1.record()
    torch.cuda.synchronize()
    times.append(e0.elapsed_time(e1) * 1e3)
every = [None] * world
dist.all_gather_object(every, times)
if rank == 0:
    name = torch.cuda.get_device_name(0)
    print("%s x%d, %d MiB a peer, %d reps a cell, %.1f ms spin after idle; µs, the least over the ranks" % (name, world, mib, reps, hold))
    group = [min(t[i] for t in every) for i in range(len(order))]
    for w in work:
        base = statistics.median(x for (ww, how, g), x in zip(order, group) if ww == w and how == "behind itself")
        print("%s:" % w)
        for ww, how, g in cells:
            if ww != w: continue
            xs = sorted(x for c, x in zip(order, group) if c == (ww, how, g))
            print("  %-13s %3.1f ms: median %.1f p90 %.1f p99 %.1f max %.1f; over 1.1x behind itself: %d of %d" % (
                how, g, statistics.median(xs), xs[int(.9 * len(xs))],
                xs[min(len(xs) - 1, int(.99 * len(xs)))], xs[-1], sum(x > 1.1 * base for x in xs), len(xs)))
dist.destroy_process_group()
