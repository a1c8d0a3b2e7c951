#!/usr/bin/env bash
# On one GPU (with .device/cs and .device/pa copied beside the checkout, built by scripts/gpu-check.sh
# and tests/tritonclient/perf_analyzer.py): the CUDA shared-memory GPU test, then Triton's
# perf_analyzer against one nccl rank serving the deepseek-v3 layer, 2048-token BF16 requests
# from 32 concurrent requests over the wire, system shared memory and CUDA shared memory, and
# the step alone (`epserve bench`) in the same call. Logs and results under $OUT.
#   bash scripts/bench/cuda-shm-bench.sh .device/cs .device/pa
# With PA=skip, the tests only: the Rust GPU test and, given TC (a folder of Python packages:
# tritonclient, ml_dtypes, protobuf 6, python-rapidjson, and epserve_pb2*.py from
# proto/epserve.proto), Triton's own CUDA shared-memory client (tests/tritonclient/cuda_shm.py).
set -uo pipefail
bins=$1; pa=${2:-}; out=${OUT:-/tmp/out}; mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L | tee "$out/gpu.txt"
if [ -z "${SKIP_TEST:-}" ]; then
  EPSERVE_BIN=$bins/epserve timeout 300 "$bins/gpu_serve" --ignored --test-threads 1 --nocapture \
    cuda_shared_memory_round_trip_equals_forward >"$out/gpu_serve_cuda_shm.log" 2>&1
  echo "gpu_serve cuda shm test: exit $?"; tail -3 "$out/gpu_serve_cuda_shm.log"
fi
if [ -n "${TC:-}" ]; then
  PYTHONPATH=$TC timeout 400 python3 tests/tritonclient/cuda_shm.py "$bins/epserve" >"$out/tritonclient_cuda_shm.log" 2>&1
  echo "tritonclient cuda shm: exit $?"; tail -4 "$out/tritonclient_cuda_shm.log"
fi
[ "${PA:-}" = skip ] && exit 0
shm=$(mktemp -d -p /dev/shm)
"$bins/epserve" serve --backend nccl --model synthetic:deepseek-v3 --layers 1 \
  --max-tokens-per-step 4096 --listen 127.0.0.1:50151 --metrics-listen 127.0.0.1:0 \
  --http-listen 127.0.0.1:0 --shm-dir "$shm" \
  --max-request-bytes 128MiB --rendezvous 127.0.0.1:0 --allow-client-shm >"$out/epserve.log" 2>&1 &
pid=$!
for _ in $(seq 1 900); do grep -q "serving gRPC on" "$out/epserve.log" && break; sleep 1; done
grep -q "serving gRPC on" "$out/epserve.log" || { tail -20 "$out/epserve.log"; kill $pid; exit 1; }
model=$(python3 - <<'PY'
import json, urllib.request, re
log = open(__import__("os").environ.get("OUT", "/tmp/out") + "/epserve.log").read()
http = re.search(r"KServe REST on http://(\S+)/v2", log).group(1)
req = urllib.request.Request(f"http://{http}/v2/repository/index", data=b"{}", method="POST")
print([m["name"] for m in json.load(urllib.request.urlopen(req)) if m["name"].endswith("-bf16-gated")][0])
PY
)
echo "model $model"
python3 - "$out/rows.json" <<'PY'
import base64, json, sys, torch
torch.manual_seed(0)
rows = [{"hidden_states": {"b64": base64.b64encode(
    torch.randn(2048, 7168).bfloat16().view(torch.int16).numpy().tobytes()).decode(),
    "shape": [2048, 7168]}} for _ in range(2)]
json.dump({"data": rows}, open(sys.argv[1], "w"))
PY
export LD_LIBRARY_PATH=$pa/lib:$LD_LIBRARY_PATH
for mode in wire system cuda; do
  extra=()
  [ "$mode" != wire ] && extra=(--shared-memory "$mode" --output-shared-memory-size $((2048 * 7168 * 2)))
  timeout 240 "$pa/bin/perf_analyzer" -m "$model" -u 127.0.0.1:50151 -i grpc --input-data "$out/rows.json" \
    --concurrency-range 32 --measurement-interval 4000 --max-trials 8 --stability-percentage 30 "${extra[@]}" \
    >"$out/pa-$mode.txt" 2>&1
  echo "perf_analyzer $mode: exit $?"; grep -E "Throughput|Avg request latency|error|Error" "$out/pa-$mode.txt" | head -5
done
kill -INT $pid; wait $pid
"$bins/epserve" bench --configs prefill --ranks 1 --backends nccl \
  >"$out/bench.txt" 2>&1
echo "bench: exit $?"; tail -15 "$out/bench.txt"
