# session 64 call 1 (4 GPUs): NCCL EP's expert-major modes and HT knobs, prefill at EP4 (build 2995e46).
RUN_LINES="^\| prefill|rror|panicked"; source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230 && source /tmp/nccl230/env.sh
export NCCL_EP_ENV_VERBOSE=1
b() { # name dtype zero-copy [env...]
  local n=$1 d=$2 z=$3; shift 3
  run $n 100 env "$@" .device/bin/epserve bench --ranks 4 --configs prefill --backends nccl-ep --ep-modes ht \
    --expert-dtype $d --zero-copy $z --iters 30 --warmup 5 --json $out/$n.json
  grep -iE "env\]|zero-copy|permute|_dup|mutually" $out/$n.log | sort | uniq -c | head -8
}
b fp8-default fp8 on NCCL_EP_DEBUG=1
b fp8-nvlinkdup fp8 on NCCL_EP_HT_EM_NVLINK_DUP=1
b fp8-localdup fp8 on NCCL_EP_HT_EM_LOCAL_DUP=1
b fp8-zcoff fp8 off X=1
b fp8-pre32 fp8 on NCCL_EP_PREPROCESS_NUM_SMS=32
b fp8-chunk128 fp8 on NCCL_EP_TOKENS_PER_CHUNK=128
b fp8-chunk256 fp8 on NCCL_EP_TOKENS_PER_CHUNK=256
b fp8-default2 fp8 on X=1
b bf16-default bf16 on NCCL_EP_DEBUG=1
b bf16-localdup bf16 on NCCL_EP_HT_EM_LOCAL_DUP=1
b bf16-zcoff bf16 off X=1
cd $out && tar czf /tmp/c1.tgz . && rm -f *.log *.json && mv /tmp/c1.tgz .
