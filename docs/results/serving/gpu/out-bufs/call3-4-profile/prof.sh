#!/usr/bin/env bash
# Profiles rank 0 under 16 clients of 2048-token bf16 requests (1 GPU, qwen3 layer, nccl).
set -u
cd "$(dirname "$0")"
P=$PWD/perf/perf
if command -v perf >/dev/null && perf --version >/dev/null 2>&1; then P=perf; else
  tar xJf perf.tar.xz; export LD_LIBRARY_PATH=$PWD/perf/lib:$LD_LIBRARY_PATH; fi
echo "perf: $P"; $P --version; cat /proc/sys/kernel/perf_event_paranoid; id -u
shm=$(mktemp -d -p /dev/shm)
./epserve-sym launch --ranks 1 --backend nccl --model synthetic:qwen3-30b-a3b --layers 1 \
  --max-tokens-per-step 4096 --listen 127.0.0.1:50051 --metrics-listen 127.0.0.1:0 --shm-dir "$shm" \
  >"$OUT/serve.log" 2>&1 &
pid=$!
for _ in $(seq 300); do grep -q "serving gRPC" "$OUT/serve.log" && break; sleep 0.3; done
r0=$(pgrep -P $pid -f -- '--rank 0 ' | head -1)
for cfg in "16 2048" "64 128"; do
  set -- $cfg
  ./epserve-loadtest --target 127.0.0.1:50051 --concurrency "$1" --tokens "$2" --dtype bf16 \
    --warmup 2s --duration 8s >"$OUT/lt-$2.txt" 2>&1 &
  lt=$!
  sleep 3
  $P record -F 999 -p "$r0" -o /dev/shm/perf-$2.data -- sleep 5 >"$OUT/rec-$2.txt" 2>&1
  $P record -F 999 -p "$lt" -o /dev/shm/perf-lt-$2.data -- sleep 2 >>"$OUT/rec-$2.txt" 2>&1
  wait $lt
  $P report -i /dev/shm/perf-$2.data --no-children --sort comm,dso,symbol --stdio 2>&1 | grep -v "^$" | head -120 >"$OUT/perf-$2.txt"
  $P report -i /dev/shm/perf-$2.data --no-children --sort symbol --stdio 2>&1 | grep -v "^$" | head -80 >"$OUT/perf-sym-$2.txt"
  $P report -i /dev/shm/perf-lt-$2.data --no-children --sort comm,symbol --stdio 2>&1 | grep -v "^$" | head -60 >"$OUT/perf-lt-$2.txt"
  grep -E "requests/s" "$OUT/lt-$2.txt"
done
kill -TERM $pid; wait $pid; rm -rf "$shm"
