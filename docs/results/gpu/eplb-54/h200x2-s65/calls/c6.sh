# session 65 call 6 (2x H200), #54: how long cuMemGetInfo takes here, and serving with the device
# memory gauge read after every step (the build before, epserve-old) against at most once a
# second (this build), alternating; then gpu_serve's no-allocation test on this build.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
python3 - > $O/memgetinfo.txt 2>&1 <<'PY'
import time, torch
torch.cuda.init(); x = torch.ones(1 << 20, device="cuda"); torch.cuda.synchronize()
def lat(n=2000):
    t = []
    for _ in range(n):
        a = time.perf_counter_ns(); torch.cuda.mem_get_info(); t.append((time.perf_counter_ns() - a) / 1e3)
    t.sort(); return "p50 %.1f p90 %.1f p99 %.1f max %.1f us" % (t[n // 2], t[9 * n // 10], t[99 * n // 100], t[-1])
print("idle GPU:", lat())
a = torch.randn(8192, 8192, device="cuda")
for _ in range(200): a = a @ a; a /= a.norm()
print("busy GPU:", lat())
torch.cuda.synchronize()
PY
cat $O/memgetinfo.txt
one() { # key binary
  local d=$O/$1; mkdir -p $d
  EPSERVE=$2 EPSERVE_STEP_PHASE_TIMES=off OUT=$d RANKS=2 MOVE_EVERY=0 DURATION=20 MOVES_BACKEND=nccl-ep \
    MOVES_EXPERTS=bf16 MOVES_LAYERS=1 CONCURRENCY=16 MOVES_MAX_TOKENS=2048 \
    timeout 110 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $1 $2 (total $((SECONDS - t0))s)"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "tokens/s|latency ms" $d/report.txt | head -2
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "medians by" | cut -c1-200
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "causes of the steps over" | cut -c1-300
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m3 "idle on rank 0"
}
one a-old .device/bin/epserve-old
one b-new .device/bin/epserve
one c-old .device/bin/epserve-old
one d-new .device/bin/epserve
NCCL_DEBUG=WARN run gpu_serve-alloc 200 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 graph_replays_are_bitwise_identical_and_steps_allocate_nothing
grep -E "GPUs:" $O/gpu_serve-alloc.log | cut -c1-400
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
