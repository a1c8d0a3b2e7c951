#!/usr/bin/env bash
# KServe v2 against epserve.v1 on the same group, same load, same run: for each config, REPEATS
# pairs, alternating which API goes first, and the median of KServe's throughput over Forward's.
# Usage: scripts/bench/kserve-bench.sh [OUTDIR] (default docs/results/serving)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-docs/results/serving}
repeats=${REPEATS:-4}
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

shm=$(mktemp -d)
log=$(mktemp)
$bin/epserve launch --ranks 2 --model synthetic:tiny --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
  --shm-dir "$shm" 2>"$log" &
pid=$!
addr=""
for _ in $(seq 1 600); do
  addr=$(sed -n 's/.*serving gRPC on \([0-9.:]*\).*/\1/p' "$log" | head -1)
  [ -n "$addr" ] && break; sleep 0.2
done
[ -n "$addr" ] || { cat "$log"; kill $pid; exit 1; }

pair() { # name kserve-api v1-api loadtest flags...
  local name=$1 k=$2 v=$3; shift 3
  for i in $(seq 1 "$repeats"); do
    if [ $((i % 2)) = 1 ]; then
      $lt --target "$addr" --api "$k" --compare-api "$v" --json "$out/kserve-$name-$i.json" "$@" >/dev/null
    else
      $lt --target "$addr" --api "$v" --compare-api "$k" --json "$out/kserve-$name-$i.json" "$@" >/dev/null
    fi
  done
  python3 - "$out" "$name" "$repeats" <<'PY'
import json, sys, statistics as st
out, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
for i in range(1, n + 1):
    r = json.load(open(f"{out}/kserve-{name}-{i}.json"))
    k, v = (r["service"], r["echo"]) if r["service"]["api"].startswith("kserve") else (r["echo"], r["service"])
    rows.append((k, v))
med = lambda f: st.median(f(k, v) for k, v in rows)
sent = sum(k["sent"] + v["sent"] for k, v in rows); ok = sum(k["ok"] + v["ok"] for k, v in rows)
print(f"| {name} | {med(lambda k, v: k['requests_per_s']):.0f} | {med(lambda k, v: k['latency_ms']['p50']):.2f} / {med(lambda k, v: k['latency_ms']['p99']):.2f} | "
      f"{med(lambda k, v: v['requests_per_s']):.0f} | {med(lambda k, v: v['latency_ms']['p50']):.2f} / {med(lambda k, v: v['latency_ms']['p99']):.2f} | "
      f"{med(lambda k, v: k['requests_per_s'] / v['requests_per_s']):.3f} | {sent} sent, {ok} OK |")
PY
}

echo "| config | KServe req/s | KServe p50 / p99 ms | Forward req/s | Forward p50 / p99 ms | KServe/Forward throughput | counts |"
echo "|---|---|---|---|---|---|---|"
common=(--warmup 1s --duration 5s --dtype bf16)
pair unary-c16-t16 kserve unary --concurrency 16 --tokens 16 "${common[@]}"
pair stream-c16-t16 kserve-stream stream --concurrency 16 --tokens 16 "${common[@]}"
pair unary-c16-t256 kserve unary --concurrency 16 --tokens 256 "${common[@]}"
kill -TERM $pid; wait $pid || true
rm -rf "$shm" "$log"
