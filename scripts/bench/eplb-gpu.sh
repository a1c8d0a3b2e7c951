#!/usr/bin/env bash
# #54's GPU half: the slot test, `epserve bench --skew --eplb` on 2 GPUs and a rebalance under
# serving load, as run for docs/benchmarks.md ("Load balance"). On the GPU machine, from the
# repository root, with .device/bin.tar.xz (scripts/gpu-check.sh and epserve-loadtest, packed)
# and .device/nccl230.tar.xz carried:
#   bash scripts/bench/eplb-gpu.sh test test-ep prefill prefill2 decode serve moves regress
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && { [ -f /tmp/nccl230/env.sh ] || tar xJf .device/nccl230.tar.xz -C /tmp/nccl230; }
B=${EPSERVE:-.device/bin/epserve}  # EPSERVE: another build to compare
# serve and moves: the load generators' API (API=kserve-shm: rows through system shared memory,
# less host work a request), clients a layer (CONCURRENCY) and seconds of load (DURATION, 40).
# A placement's copies whole: EPSERVE_EPLB_STEP_COPIES=layer (the flag's env; default 32MiB parts).
api=${API:-unary}; client_shm=(); [ "$api" = kserve-shm ] && client_shm=(--allow-client-shm)
# SERVE_CPUS / LOAD_CPUS (taskset lists, e.g. 0-15 and 16-31): the server and the load generators
# on cores of their own, as clients on other machines would be; default: shared.
on_serve=(); [ -n "${SERVE_CPUS:-}" ] && on_serve=(taskset -c "$SERVE_CPUS")
on_load=(); [ -n "${LOAD_CPUS:-}" ] && on_load=(taskset -c "$LOAD_CPUS")
bench() { # name limit args...
  local name=$1 lim=$2; shift 2
  (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN &&
    run "$name" "$lim" $B bench --ranks 2 --iters 30 --warmup 5 --json "$out/$name.json" "$@")
}
for part in "$@"; do
case "$part" in
test) # nccl only (the system NCCL: nccl-ep is skipped with its reason)
  run gpu_placement 200 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 \
    a_placement_applied_between_graph_replays
  ;;
test-ep)
  (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN &&
    run gpu_placement_ep 400 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 \
      a_placement_applied_between_graph_replays)
  ;;
regress) # the slotless path after the gate's change: as before
  run gpu_kernels 120 .device/bin/gpu_kernels --ignored --test-threads 1
  run gpu_serve_regress 420 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 \
    graph_replays_are_bitwise fp8_experts_match_the_f64_reference --skip nccl_ep
  ;;
serve) # a rebalance under serving load: 4 layers, 4 skewed loads, every step's time on rank 0
  for mode in ${SERVE_MODES:-contiguous eplb}; do
    extra=(); [ $mode = eplb ] && extra=(--redundant-experts 2 --eplb-interval 10s --eplb-window 300)
    shm=$(mktemp -d -p /dev/shm)
    RUST_LOG=info,epserve::step_times=trace "${on_serve[@]}" $B launch --ranks 2 --backend nccl \
      --model synthetic:qwen3-30b-a3b --layers 4 --max-tokens-per-step 8192 \
      --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --shm-dir "$shm" \
      "${extra[@]}" "${client_shm[@]}" >"$out/serve-$mode.log" 2>&1 &
    pid=$!
    addr=""
    for _ in $(seq 1 600); do
      addr=$(sed -n 's/.*serving gRPC on \([0-9.:]*\).*/\1/p' "$out/serve-$mode.log" | head -1)
      [ -n "$addr" ] && break; sleep 0.2
    done
    echo "== serve $mode at '$addr' after $((SECONDS - t0))s"
    for l in 0 1 2 3; do
      "${on_load[@]}" .device/bin/epserve-loadtest --target "$addr" --layer $l --api $api --concurrency ${CONCURRENCY:-4} --tokens 2048 \
        --client-routing --skew 1 --warmup 2s --duration ${DURATION:-40}s --timeout 20s --json "$out/load-$mode-$l.json" \
        >"$out/load-$mode-$l.log" 2>&1 &
    done
    date +%T.%N
    wait $(jobs -p | grep -v "^$pid$") 2>/dev/null
    date +%T.%N
    m0=$(sed -n 's/.* 0 metrics on \(http:[^ ]*\).*/\1/p' "$out/serve-$mode.log" | head -1)
    curl -s "$m0" | grep -E "^epserve_requests_total.method=.Forward|^epserve_eplb_rebalances_total|^epserve_rank_load_ratio" | grep -v " 0$"
    sleep 1; kill $pid; wait $pid 2>/dev/null
    tail -n 12 "$out"/load-$mode-*.log
    grep -E "placement|copies" "$out/serve-$mode.log" | grep -v step_times | tail -8
    python3 scripts/bench/eplb-steps.py "$out/serve-$mode.log"
  done
  (cd "$out" && tar cJf serve-logs.tar.xz serve-*.log load-* && rm -f serve-*.log load-*)
  ;;
moves) # placements applied under serving load, one every MOVE_EVERY s (default 6; 0: none), alternating
  # two files in which every slot but the replicas changes expert (SIGHUP re-reads --placement)
  shm=$(mktemp -d -p /dev/shm); pl=$(mktemp -p /dev/shm placement.XXXX.json)
  # RANKS (default 2): 1 runs the same load and placements on one GPU.
  w=${RANKS:-2}
  place() { python3 -c "import json,sys; b=sys.argv[1]=='b'; W=int(sys.argv[2]); p=128//W; x=[5,77]
blk=lambda r: list(range(((r+1)%W)*p,((r+1)%W+1)*p))[::-1] if b else list(range(r*p,(r+1)*p))
print(json.dumps({'phy2log': [sum((blk(r)+x[r*2//W:(r+1)*2//W] for r in range(W)),[])]*int(sys.argv[3])}))" $1 $w ${MOVES_LAYERS:-4} > "$pl"; }
  place a
  # MOVES_BACKEND (default nccl; nccl-ep runs on the carried NCCL 2.30), MOVES_EXPERTS (bf16, fp8; default auto).
  backend=${MOVES_BACKEND:-nccl}; [ "$backend" = nccl-ep ] && source /tmp/nccl230/env.sh
  RUST_LOG=info,epserve::step_times=trace,epserve::staging=trace \
    "${on_serve[@]}" $B launch --ranks $w --backend $backend --expert-dtype ${MOVES_EXPERTS:-auto} \
    --model synthetic:qwen3-30b-a3b --layers ${MOVES_LAYERS:-4} --max-tokens-per-step ${MOVES_MAX_TOKENS:-8192} --placement "$pl" \
    --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --shm-dir "$shm" \
    "${client_shm[@]}" >"$out/serve-moves.log" 2>&1 &
  pid=$!; addr=""
  for _ in $(seq 1 600); do
    addr=$(sed -n 's/.*serving gRPC on \([0-9.:]*\).*/\1/p' "$out/serve-moves.log" | head -1)
    [ -n "$addr" ] && break; sleep 0.2
  done
  r0=""; for c in $(pgrep -P $pid); do tr '\0' ' ' </proc/$c/cmdline | grep -qE -- "--rank 0( |$)" && r0=$c; done
  echo "== serve moves at '$addr' (rank 0 pid '$r0') after $((SECONDS - t0))s"
  loads=()
  # MOVES_LAYERS (default 4): the model's layers, one load generator each. MOVES_MAX_TOKENS
  # (default 8192): the serving steps' largest bucket.
  for l in $(seq 0 $((${MOVES_LAYERS:-4} - 1))); do
    "${on_load[@]}" .device/bin/epserve-loadtest --target "$addr" --layer $l --api $api --concurrency ${CONCURRENCY:-4} --tokens 2048 \
      --client-routing --warmup 2s --duration ${DURATION:-40}s --timeout 20s --json "$out/load-moves-$l.json" \
      >"$out/load-moves-$l.log" 2>&1 & loads+=($!)
  done
  sleep 4; n=0
  while kill -0 ${loads[0]} 2>/dev/null; do
    # MOVE_EVERY=0: the same load with no placement, for the steps' own spread.
    [ "${MOVE_EVERY:-6}" = 0 ] && { sleep 1; continue; }
    n=$((n + 1)); [ $((n % 2)) = 1 ] && place b || place a
    kill -HUP $r0; sleep ${MOVE_EVERY:-6}
  done
  wait "${loads[@]}"
  m0=$(sed -n 's/.* 0 metrics on \(http:[^ ]*\).*/\1/p' "$out/serve-moves.log" | head -1)
  curl -s "$m0" | grep -E "^epserve_requests_total.method=.Forward|^epserve_eplb_rebalances_total" | grep -v " 0$"
  sleep 1; kill $pid; wait $pid 2>/dev/null
  tail -n 12 "$out"/load-moves-*.log
  grep -E "placement|copies" "$out/serve-moves.log" | grep -v step_times | grep "rank=0" | tail -30
  python3 scripts/bench/eplb-steps.py "$out/serve-moves.log"
  (cd "$out" && tar cJf moves-logs.tar.xz serve-moves.log load-moves-* && rm -f serve-moves.log load-moves-*)
  ;;
ep-replicas) # nccl-ep HT with redundant slots (numbered as the next power of two), against none
  bench ep-r0 180 --configs prefill --backends nccl-ep --ep-modes ht --expert-dtype bf16,fp8 \
    --skew 0,0.7 --eplb off,on --redundant-experts 0
  bench ep-r2 130 --configs prefill --backends nccl-ep --ep-modes ht --expert-dtype bf16,fp8 \
    --skew 0,0.7 --eplb on --redundant-experts 2
  ;;
prefill) # nccl with a replica per rank; nccl-ep rearranged only (before ep-replicas)
  bench prefill-nccl 240 --configs prefill --backends nccl --expert-dtype bf16,fp8 \
    --skew 0,1 --eplb off,on --redundant-experts 2
  bench prefill-ep 240 --configs prefill --backends nccl-ep --ep-modes ht --expert-dtype bf16,fp8 \
    --skew 0,1 --eplb off,on --redundant-experts 0
  ;;
prefill2)
  bench prefill2-nccl 200 --configs prefill --backends nccl --expert-dtype bf16,fp8 \
    --skew 0,0.5,0.7 --eplb off,on --redundant-experts 2
  bench prefill2-ep 200 --configs prefill --backends nccl-ep --ep-modes ht --expert-dtype bf16,fp8 \
    --skew 0,0.5,0.7 --eplb off,on --redundant-experts 0
  ;;
replicas) # more redundant slots: does the skewed EPLB step close on the balanced one?
  # nccl: 8 and 32 extra slots; nccl-ep: 256 extra (256 slots per rank, the next power of two)
  for r in 8 32; do
    bench prefill-nccl-r$r 200 --configs prefill --backends nccl --expert-dtype bf16,fp8 \
      --skew 0,1 --eplb on --redundant-experts $r
  done
  bench prefill-ep-r256 300 --configs prefill --backends nccl-ep --ep-modes ht --expert-dtype bf16,fp8 \
    --skew 0,0.7 --eplb off,on --redundant-experts 256
  ;;
decode)
  bench decode-nccl 150 --configs decode --backends nccl --expert-dtype bf16,fp8 \
    --skew 0,1 --eplb off,on --redundant-experts 2
  bench decode-ep 150 --configs decode --backends nccl-ep --ep-modes ll --expert-dtype bf16,fp8 \
    --skew 0,1 --eplb off,on --redundant-experts 0
  ;;
esac
done
