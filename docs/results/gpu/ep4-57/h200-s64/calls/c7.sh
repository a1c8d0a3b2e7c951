# session 64 call 7 (2 GPUs): where the process dies after NCCL EP refuses its dispatch config (build 7e77e7a's bench code).
tar xJf .device/bin-dbg.tar.xz -C .device; source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230 && source /tmp/nccl230/env.sh
which gdb; gdb --version | head -1
export NCCL_EP_DISPATCH_NUM_PIPELINES=4 NCCL_EP_DISPATCH_NUM_STAGES=8 RUST_BACKTRACE=1
cmd=(.device/bin/epserve bench --ranks 2 --configs small --backends nccl-ep --ep-modes ht --iters 5 --warmup 2)
timeout 60 "${cmd[@]}" > $out/plain.log 2>&1; echo "plain exit $?"; grep -vE "INFO|DEBUG" $out/plain.log | tail -8
if which gdb >/dev/null; then
  timeout 120 gdb -q -batch -ex run -ex "info threads" -ex "thread apply all bt 25" --args "${cmd[@]}" > $out/gdb.log 2>&1
  echo "gdb exit $?"; grep -nE "SIGSEGV|signal|^#|^Thread" $out/gdb.log | head -80
fi
