# session 56 calls 7 and 8 (each a fresh machine): which part of nccl-ep + FP8 + a placement file + client routing
# hangs the first 2,048-token step of qwen3 (call 7), then on nccl too? on nccl-ep at 1024 (call 8)?
# Call 7's try() had `--backend nccl-ep --max-tokens-per-step 8192` in its launch line; its three lines are
# written here with those flags.
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; source /tmp/nccl230/env.sh
python3 -c "import json; p=[list(range(0,64))+[5], list(range(64,128))+[77]]; print(json.dumps({'phy2log': [p[0]+p[1]]*4}))" > /dev/shm/pl.json
try() { # name loadflags -- launch flags
  local name=$1 lf=$2; shift 2
  .device/bin/epserve launch --ranks 2 --model synthetic:qwen3-30b-a3b --layers 4 \
    --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 "$@" > $O/$name.log 2>&1 & local pid=$!
  local addr=""; for _ in $(seq 1 300); do addr=$(sed -n 's/.*serving gRPC on \([0-9.:]*\).*/\1/p' $O/$name.log | head -1); [ -n "$addr" ] && break; sleep 0.2; done
  timeout 30 .device/bin/epserve-loadtest --target "$addr" --layer 0 --concurrency 2 --tokens ${TOK:-2048} $lf --duration 3s --timeout 12s > $O/$name-load.log 2>&1
  echo "== $name ($*) $lf: $(grep -E '^  (OK|UNAVAILABLE|DEADLINE|CANCELLED)' $O/$name-load.log | tr -s ' ' | tr '\n' ';')"
  grep -E "ERROR" $O/$name.log | head -1 | cut -c1-200
  kill $pid 2>/dev/null; sleep 1; pkill -f "epserve launch" ; pkill -f "epserve serve"; wait $pid 2>/dev/null; sleep 1
}
if [ "${CALL:-8}" = 7 ]; then
try fp8-noplace --client-routing --backend nccl-ep --max-tokens-per-step 8192 --expert-dtype fp8
try bf16-place --client-routing --backend nccl-ep --max-tokens-per-step 8192 --expert-dtype bf16 --placement /dev/shm/pl.json
try fp8-place-gate "" --backend nccl-ep --max-tokens-per-step 8192 --expert-dtype fp8 --placement /dev/shm/pl.json
else
try nccl-fp8-8192 --client-routing --backend nccl --expert-dtype fp8 --max-tokens-per-step 8192
TOK=1024 try ep-fp8-1024 --client-routing --backend nccl-ep --expert-dtype fp8 --max-tokens-per-step 1024
fi
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
