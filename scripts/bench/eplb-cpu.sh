#!/usr/bin/env bash
# Load balance on the cpu backend (#54): one skewed load against three groups, one after the
# other on this machine: contiguous blocks, EPLB (one redundant slot per rank, a placement
# every 2 s), and the same load unskewed. Each row: loadtest's figures and rank 0's /eplb.
# Usage: scripts/bench/eplb-cpu.sh [OUT_DIR]   (release builds of epserve and epserve-loadtest)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/eplb-cpu}
mkdir -p "$out/shm"
bin=target/release/epserve
lt=target/release/epserve-loadtest
model=synthetic:small-deepseek
run() {
  local name=$1 skew=$2; shift 2
  "$bin" launch --ranks 4 --model "$model" --listen 127.0.0.1:50151 --metrics-listen 127.0.0.1:9550 \
    --http-listen off --shm-dir "$out/shm" --max-tokens-per-step 256 "$@" > "$out/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do grep -q "serving gRPC on" "$out/$name.log" && break; sleep 0.1; done
  "$lt" --target 127.0.0.1:50151 --concurrency 8 --tokens 64 --dtype f32 --warmup 3s --duration 10s \
    --skew "$skew" --skew-model "$model" --json "$out/$name.json" > "$out/$name.loadtest.txt" 2>&1
  curl -s http://127.0.0.1:9550/eplb > "$out/$name.eplb.json"
  kill -TERM $pid; wait $pid || true
  python3 - "$name" "$out" <<'PY'
import json, sys
name, out = sys.argv[1], sys.argv[2]
r = json.load(open(f"{out}/{name}.json"))
e = json.load(open(f"{out}/{name}.eplb.json"))
ratios = [round(l["rank_load_ratio"], 2) for l in e["layers"]]
print(f"| {name} | {r['tokens_per_s']:.0f} | {r['latency_ms']['p50']:.1f} | {r['ok']} of {r['sent']} | {e['epoch']} | {ratios} |")
PY
}
echo "| group | tokens/s | p50 ms | OK | placements | rows per rank max/mean (window, per layer) |"
echo "|---|---|---|---|---|---|"
run contiguous 1.5
run eplb 1.5 --redundant-experts 4 --eplb-interval 2s --eplb-window 400
run balanced 0
