#!/usr/bin/env bash
# #55's GPU half, as run for docs/benchmarks.md ("Losing a rank"). On the GPU machine, from the
# repository root, with .device/bin.tar.xz (scripts/gpu-check.sh, packed) carried:
#   bash scripts/bench/rank-loss-gpu.sh test serve
# test:  the GPU tests (a communicator without a lost rank; kill -9 / SIGSTOP of rank 1 under
#        the f64-checked load of tests/gpu_rank_loss.rs, FP8 and bf16).
# serve: `epserve launch` (each of BACKENDS, default nccl; nccl-ep needs NCCL 2.30's env sourced
#        first: ../shared/tools/device-nccl230.sh) of the DeepSeek-V3 layer (synthetic, 256 experts, every
#        rank holding all of them on 2 GPUs: --redundant-experts 256) on RANKS GPUs (default 2)
#        under epserve-loadtest; rank 1 is killed (kill -9) 10 s into a run of DURATION
#        (default 90 s: a restarted rank loads the layer's weights again, 35-45 s), and `launch`
#        starts it again (--rank-restarts 1): it rejoins under the load. The load's statuses
#        and latencies, the leader's recovery and rejoin lines and each phase of the GPU's, per
#        expert dtype (DTYPES, default fp8 bf16).
RUN_LINES='^test |test result|skipped|GPUs, |lost by|panicked|error'
source scripts/bench/device-env.sh
B=.device/bin/epserve
for part in "$@"; do
case "$part" in
test)
  run gpu_nccl 120 .device/bin/gpu_nccl --ignored --nocapture --test-threads 1
  run gpu_rank_loss 400 .device/bin/gpu_rank_loss --ignored --nocapture --test-threads 1
  ;;
serve)
  for backend in ${BACKENDS:-nccl}; do
  for dtype in ${DTYPES:-fp8 bf16}; do
    shm=$(mktemp -d -p /dev/shm)
    tag=$backend-$dtype-${RANKS:-2}
    log="$out/serve-$tag.log"
    # nccl-ep goes on with every bucket low-latency (its kernels mask a lost peer after
    # --step-timeout; HT's cannot end a step whose peer is gone).
    extra="--step-timeout 5s"; [ "$backend" = nccl-ep ] && extra="--ep-mode ll --step-timeout 2s"
    # shellcheck disable=SC2086
    RUST_LOG=info $B launch --ranks "${RANKS:-2}" --backend "$backend" $extra --model synthetic:deepseek-v3 --layers 1 \
      --expert-dtype "$dtype" --redundant-experts 256 --rank-restarts 1 \
      --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
      --shm-dir "$shm" >"$log" 2>&1 &
    pid=$!
    addr=""
    for _ in $(seq 1 1500); do
      addr=$(sed -n 's/.*serving gRPC on \([0-9.:]*\).*/\1/p' "$log" | head -1)
      [ -n "$addr" ] && break; sleep 0.2
    done
    echo "== serve $tag at '$addr' after $((SECONDS - t0))s"
    grep -E "on rank loss|GPU step ready" "$log" | head -4
    if [ -z "$addr" ]; then tail -20 "$log"; kill $pid; wait $pid; continue; fi
    .device/bin/epserve-loadtest --target "$addr" --layer 3 --concurrency 16 --tokens 128 \
      --warmup 2s --duration "${DURATION:-90s}" --timeout 30s --json "$out/load-$tag.json" \
      >"$out/load-$tag.log" 2>&1 &
    lt=$!
    sleep 10
    r1=$(pgrep -f -- "--rank 1 " | head -1)
    echo "kill -9 rank 1 (pid $r1) at $(date +%T.%N)"
    kill -9 "$r1"
    wait $lt
    m0=$(sed -n 's/.* 0 metrics on \(http:[^ ]*\).*/\1/p' "$log" | head -1)
    curl -s "$m0" | grep -E "^epserve_group_ranks|^epserve_group_epoch|^epserve_rank_losses_total|^epserve_recovery_seconds_(sum|count)|^epserve_requests_total.*Forward"
    # The leader's lines (the other ranks say the same).
    grep -E "halting the group|the group goes on|communicator|NCCL EP groups|cannot go on|started again|rejoin|back in the group|GPU step ready|ERROR" "$log" |
      grep -v "^rank=[1-9]" | head -24
    tail -n 16 "$out/load-$tag.log"
    kill $pid; wait $pid 2>/dev/null
  done
  done
  # The device tool returns eight files a call: the serve logs go back as one.
  (cd "$out" && tar cJf serve-logs.tar.xz ./serve-*.log && rm -f ./serve-*.log)
  ;;
esac
done
