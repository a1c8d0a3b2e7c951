# session 61 call 5 (4 GPUs): #57's FP8 EP4 lines on today's build (0b4d366, slot tables since session 51's b1d09ce):
# the same bench as session 51, FP8 only.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230 && source /tmp/nccl230/env.sh
run ep4-fp8 420 .device/bin/epserve bench --ranks 4 --configs decode,prefill --backends nccl,nccl-ep --expert-dtype fp8 \
  --ep-modes ll,ht --iters 30 --warmup 5 --json $out/ep4-fp8.json
grep -vE "INFO|DEBUG" $out/ep4-fp8.log | tail -30
