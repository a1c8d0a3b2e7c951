# session 64 call 2 (4 GPUs): NCCL EP's SM and pipeline knobs (environment), prefill and decode at EP4 (build 2995e46).
RUN_LINES="^\| (prefill|decode)|rror|panicked"; source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230 && source /tmp/nccl230/env.sh
export NCCL_EP_ENV_VERBOSE=1
b() { # name dtype configs ep-modes [env...]
  local n=$1 d=$2 c=$3 m=$4; shift 4
  run $n 100 env "$@" .device/bin/epserve bench --ranks 4 --configs $c --backends nccl-ep --ep-modes $m \
    --expert-dtype $d --iters 30 --warmup 5 --json $out/$n.json
  grep -E "num_blocks=|_SMS  |PIPELINES =|STAGES" $out/$n.log | grep -v unset | sort | uniq -c | head -6
}
P="fp8 prefill ht"
b p-default $P X=1
b p-pre64 $P NCCL_EP_PREPROCESS_NUM_SMS=64
b p-pre128 $P NCCL_EP_PREPROCESS_NUM_SMS=128
b p-shuf32 $P NCCL_EP_SHUFFLE_SMS=32
b p-shuf64 $P NCCL_EP_SHUFFLE_SMS=64
b p-shuf128 $P NCCL_EP_SHUFFLE_SMS=128
b p-dpipe3 $P NCCL_EP_DISPATCH_NUM_PIPELINES=3
b p-dpipe4 $P NCCL_EP_DISPATCH_NUM_PIPELINES=4 NCCL_EP_DISPATCH_NUM_STAGES=8
b p-cpipe4 $P NCCL_EP_COMBINE_NUM_PIPELINES=4 NCCL_EP_COMBINE_NUM_STAGES_G2S=6
b p-comm32 $P NCCL_EP_COMM_SMS=32
b p-all $P NCCL_EP_PREPROCESS_NUM_SMS=64 NCCL_EP_SHUFFLE_SMS=64 NCCL_EP_COMM_SMS=32
b p-default2 $P X=1
b d-default fp8 decode ht,ll X=1
b d-pre64 fp8 decode ht,ll NCCL_EP_PREPROCESS_NUM_SMS=64
b d-pre128 fp8 decode ht,ll NCCL_EP_PREPROCESS_NUM_SMS=128
b pb-default bf16 prefill ht X=1
b pb-pre64 bf16 prefill ht NCCL_EP_PREPROCESS_NUM_SMS=64
cd $out && tar czf /tmp/c2.tgz . && rm -f *.log *.json && mv /tmp/c2.tgz .
