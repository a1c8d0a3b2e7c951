#!/usr/bin/env bash
# Serving-path benchmark on this machine (CPU backend): for each config, starts a group, runs the
# loadtest with the echo ceiling in the same run REPEATS times, prints the median row, and sweeps
# the offered rate once. Usage: scripts/bench/serving-bench.sh [OUTDIR] (default docs/results/serving)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-docs/results/serving}
repeats=${REPEATS:-3}
mkdir -p "$out"
# BIN=dir: binaries built elsewhere (a machine without cargo, e.g. the GPU host's many cores).
if [ -n "${BIN:-}" ]; then
  bin=$BIN
else
  cargo build --release --quiet --bin epserve -p epserve
  cargo build --release --quiet -p epserve-loadtest
  bin=target/release
fi
lt=$bin/epserve-loadtest

run_group() { # name model ranks extra-serve-flags -- loadtest flags
  local name=$1 model=$2 ranks=$3; shift 3
  local serve=(); while [ "$1" != "--" ]; do serve+=("$1"); shift; done; shift
  local shm; shm=$(mktemp -d)
  local log; log=$(mktemp)
  $bin/epserve launch --ranks "$ranks" --model "$model" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
    --shm-dir "$shm" "${serve[@]}" 2>"$log" &
  local pid=$!
  local addr=""
  for _ in $(seq 1 600); do
    addr=$(sed -n 's/.*serving gRPC on \([0-9.:]*\).*/\1/p' "$log" | head -1)
    [ -n "$addr" ] && break; sleep 0.2
  done
  [ -n "$addr" ] || { cat "$log"; kill $pid; exit 1; }
  for i in $(seq 1 "$repeats"); do
    $lt --target "$addr" --echo --json "$out/$name-$i.json" "$@" >/dev/null
  done
  if [ "${SWEEP:-}" = "$name" ]; then
    $lt --target "$addr" --sweep --svg "$out/$name-sweep.svg" --json "$out/$name-sweep.json" \
      --warmup 1s --duration 3s --sweep-start "${SWEEP_START:-200}" --tokens 16 --dtype bf16 >"$out/$name-sweep.txt"
  fi
  kill -TERM $pid; wait $pid || true
  rm -rf "$shm" "$log"
  python3 - "$out" "$name" "$repeats" <<'PY'
import json, sys, statistics as st
out, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = [json.load(open(f"{out}/{name}-{i}.json")) for i in range(1, n + 1)]
def med(f): return st.median(f(r) for r in runs)
s = lambda r: r["service"]; e = lambda r: r["echo"]
print(f"| {name} | {med(lambda r: s(r)['requests_per_s']):.0f} | {med(lambda r: s(r)['tokens_per_s']):.0f} | "
      f"{med(lambda r: s(r)['latency_ms']['p50']):.2f} / {med(lambda r: s(r)['latency_ms']['p99']):.2f} | "
      f"{med(lambda r: e(r)['requests_per_s']):.0f} | {med(lambda r: e(r)['latency_ms']['p50']):.2f} / {med(lambda r: e(r)['latency_ms']['p99']):.2f} | "
      f"{med(lambda r: r['requests_per_s_ratio']):.3f} | "
      f"{sum(s(r)['sent'] for r in runs)} sent, {sum(s(r)['ok'] for r in runs)} OK |")
PY
}

echo "| config | req/s | tokens/s | p50 / p99 ms | echo req/s | echo p50 / p99 ms | service/echo throughput | counts |"
echo "|---|---|---|---|---|---|---|---|"
common=(--warmup 1s --duration 5s --tokens 16 --dtype bf16)
run_group tiny-unary-c16 synthetic:tiny 2 -- --concurrency 16 --api unary "${common[@]}"
run_group tiny-stream-c16 synthetic:tiny 2 -- --concurrency 16 --api stream "${common[@]}"
run_group tiny-open-1000 synthetic:tiny 2 -- --rate 1000 --api unary "${common[@]}"
run_group qwen3-l1-unary-c8 synthetic:qwen3-30b-a3b 2 --layers 1 --max-tokens-per-step 128 -- --concurrency 8 --api unary "${common[@]}"
