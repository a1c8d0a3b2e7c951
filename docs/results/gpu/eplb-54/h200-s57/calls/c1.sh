# session 57 call 1 (one H200): does the odd-tile FP8 fix (5ea5376) end the hang of 2,048-token FP8 steps
# on qwen3? The same launch with the binary before the fix (epserve-old, 7abbfb8) and after, one rank;
# then the FP8 GEMM tests (gpu_fp8) and the FP8 serving tests (gpu_serve, one GPU).
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; source /tmp/nccl230/env.sh
try() { # name bin backend
  local name=$1 bin=$2 be=$3
  .device/bin/$bin launch --ranks 1 --model synthetic:qwen3-30b-a3b --layers 4 --backend $be --expert-dtype fp8 \
    --max-tokens-per-step 8192 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 > $O/$name.log 2>&1 & local pid=$!
  local addr=""; for _ in $(seq 1 300); do addr=$(sed -n 's/.*serving gRPC on \([0-9.:]*\).*/\1/p' $O/$name.log | head -1); [ -n "$addr" ] && break; sleep 0.2; done
  timeout 30 .device/bin/epserve-loadtest --target "$addr" --layer 0 --concurrency 4 --tokens 2048 --client-routing --duration 5s --timeout 12s > $O/$name-load.log 2>&1
  echo "== $name: $(grep -E '^  (OK|UNAVAILABLE|DEADLINE|CANCELLED|INTERNAL)' $O/$name-load.log | tr -s ' ' | tr '\n' ';')"
  grep -E "tokens/s|p50" $O/$name-load.log | head -3
  grep -E "ERROR" $O/$name.log | head -1 | cut -c1-200
  kill $pid 2>/dev/null; sleep 1; pkill -f "epserve.* launch"; pkill -f "epserve.* serve"; wait $pid 2>/dev/null; sleep 1
}
try old-nccl epserve-old nccl
try new-nccl epserve nccl
try new-ncclep epserve nccl-ep
run gpu_fp8 200 .device/bin/gpu_fp8 --ignored --test-threads 1
run gpu_serve_fp8 150 .device/bin/gpu_serve --ignored --test-threads 1 fp8
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
