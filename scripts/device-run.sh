#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, what scripts/gpu-check.sh built into
# .device/bin: the GPU tests, then `epserve bench`. Logs and the bench JSON go to $OUT (or ./out).
#   usage: bash scripts/device-run.sh [tests] [ep] [drill] [bench] [torch] [cpu] [serve] [ingress] | all
#   (copy .device beside the checkout there first; 4 GPUs for the multi-rank runs)
# `serve` loads `epserve launch` (nccl-ep, the deepseek-v3 layer) with .device/bin/epserve-loadtest
# and its bare echo in the same run, for each binary in SERVE_BINS (default: the one built).
set -uo pipefail
what=" ${*:-all} "
# Parts asked for: any of tests, ep, drill, bench (or all).
want() { [[ "$what" == *" $1 "* || "$what" == *" all "* ]]; }
out=${OUT:-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# NVLink multicast stays off on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPSERVE_BIN=$PWD/.device/bin/epserve
# The load generator (and its echo) of the cpu, serve and ingress parts; LOADTEST names another
# build's, to compare with the one it came with.
loadtest=${LOADTEST:-.device/bin/epserve-loadtest}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
status=0
run() {
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - t0))s"; tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
  return $rc
}
# A metric's value on a Prometheus endpoint.
metric() { curl -s "$1" | awk -v m="$2" '$1 == m {print $2}'; }
# Rank 0's steps, its pack and deliver seconds and counts, and its requests answered OK.
copy_times() {
  curl -s "$1" | awk '
    $1 == "epserve_steps_total{kind=\"work\"}" {s = $2}
    $1 == "epserve_step_pack_seconds_sum" {ps = $2} $1 == "epserve_step_pack_seconds_count" {pc = $2}
    $1 == "epserve_step_deliver_seconds_sum" {ds = $2} $1 == "epserve_step_deliver_seconds_count" {dc = $2}
    $1 ~ /^epserve_requests_total\{.*status="OK"/ {r += $2}
    END {print s + 0, ps + 0, pc + 0, ds + 0, dc + 0, r + 0}'
}
# A process's CPU seconds and minor page faults so far.
proc_use() { awk '{print ($14 + $15) / 100, $10}' "/proc/$1/stat"; }
# Its threads' CPU seconds so far, by thread name (threads that ended are not counted).
thread_use() {
  for t in /proc/"$1"/task/*; do
    # The name may hold spaces: it sits between the first "(" and the last ")".
    sed -E 's/^[0-9]+ \((.*)\) (.*)$/\1|\2/' "$t/stat" 2>/dev/null
  done | awk -F'|' '{split($2, f, " "); cpu[$1] += (f[12] + f[13]) / 100} END {for (n in cpu) print n "|" cpu[n]}'
}
# The address a group's log says it serves gRPC on, once it does (polling LOG up to N times).
serving_addr() {
  local a=""
  for _ in $(seq 1 "$2"); do
    a=$(sed -n 's/.*serving gRPC on \([0-9.:]*\).*/\1/p' "$1" | head -1)
    [ -n "$a" ] && break; sleep 0.2
  done
  echo "$a"
}
if want tests; then
  run gpu_kernels .device/bin/gpu_kernels --ignored --test-threads 1
  run gpu_fp8 .device/bin/gpu_fp8 --ignored --test-threads 1
  run gpu_nccl .device/bin/gpu_nccl --ignored --test-threads 1
  run gpu_ep .device/bin/gpu_ep --ignored --nocapture --test-threads 1
  # TMPDIR on tmpfs: the tests' step rings can be registered with the driver there.
  # nccl-ep's tests run in the ep part, on the carried NCCL 2.30.
  TMPDIR=/dev/shm run gpu_serve .device/bin/gpu_serve --ignored --nocapture --test-threads 1 --skip matches_the_nccl_backend --skip fault_drill --skip nccl_ep_
fi
if want drill; then
  # A rank stopped and killed under load, on both GPU backends (nccl-ep on the carried NCCL 2.30).
  run drill_nccl timeout 300 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 nccl_fault_drill
  grep -E "^(test |fault drill)" "$out/drill_nccl.log" || true
  if [ -f .device/nccl230.tar.xz ]; then
    mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
    (source /tmp/nccl230/env.sh &&
      run drill_nccl_ep timeout 300 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 nccl_ep_fault_drill) || status=1
    grep -E "^(test |fault drill)" "$out/drill_nccl_ep.log" || true
  fi
fi
if want ep; then
  # NCCL 2.30.7 + NCCL EP, packed as .device/nccl230.tar.xz (the image
  # has NCCL 2.28): unpacked and used in a subshell, so the other runs keep the image's NCCL.
  if [ -f .device/nccl230.tar.xz ]; then
    mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
    # NCCL_DEBUG=WARN: NCCL EP says why it refuses a call only in NCCL's log.
    (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN &&
      run gpu_nccl_ep timeout 300 .device/bin/gpu_nccl_ep --ignored --nocapture --test-threads 1) || status=1
    grep -E "^(test |NCCL|[0-9]+ GPUs|LL|step)" "$out/gpu_nccl_ep.log" || true
    # nccl_ep_fp8 alone takes about 400 s on one GPU (two models): run `ep` in a call of its own.
    (source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN &&
      run gpu_serve_ep timeout 590 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 matches_the_nccl_backend nccl_ep_two_steps_in_flight nccl_ep_fp8) || status=1
    grep -E "^(test |nccl-ep)" "$out/gpu_serve_ep.log" || true
  else
    echo "== gpu_nccl_ep: skipped (no .device/nccl230.tar.xz)"
  fi
fi
if want bench; then
  # Each binary in BENCH_BINS (default: the one built) in the same call; BENCH_CONFIGS,
  # BENCH_BACKENDS and BENCH_ZERO_COPY narrow the matrix. nccl-ep needs the carried NCCL 2.30.
  backends=${BENCH_BACKENDS:-nccl}
  if [ -f .device/nccl230.tar.xz ]; then
    mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
    backends=${BENCH_BACKENDS:-nccl,nccl-ep}
  fi
  for bin in ${BENCH_BINS:-$EPSERVE_BIN}; do
    name=$(basename "$bin")
    (if [ -f /tmp/nccl230/env.sh ]; then source /tmp/nccl230/env.sh; fi
      run "bench-$name" "$bin" bench --configs "${BENCH_CONFIGS:-decode,small,prefill}" \
        --backends "$backends" --ep-modes ht,ll --zero-copy "${BENCH_ZERO_COPY:-on,off}" \
        --iters "${BENCH_ITERS:-100}" --json "$out/bench-$name.json") || status=1
  done
fi
if want torch; then
  # The PyTorch peers of the bench (torch._grouped_mm, dense cuBLAS, the all_to_all EP layer).
  run torch python3 -m torch.distributed.run --nproc_per_node "$(nvidia-smi -L | wc -l)" \
    scripts/bench/torch-peers.py --json "$out/torch.json"
fi
if want cpu; then
  # The CPU backend on this host's cores (synthetic:tiny, 2 ranks, 16-token bf16 requests), each
  # load against the bare echo in the same run, for each binary in CPU_BINS (default: the one
  # built). CPU_CONFIGS: "api:clients ..."; CPU_FLAGS: more launch flags (e.g. --cpu-threads 1).
  # Busy: the leader's step seconds over the 6 s loaded.
  for bin in ${CPU_BINS:-$EPSERVE_BIN}; do
    shm=$(mktemp -d -p /dev/shm)
    "$bin" launch --ranks 2 --backend cpu --model synthetic:tiny --listen 127.0.0.1:0 \
      --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --shm-dir "$shm" --allow-client-shm \
      ${CPU_FLAGS:-} >"$out/cpu.log" 2>&1 &
    pid=$!
    addr=$(serving_addr "$out/cpu.log" 300)
    if [ -z "$addr" ]; then tail -20 "$out/cpu.log"; kill $pid; status=1; continue; fi
    m0=$(sed -n 's/.* 0 metrics on \(http:[^ ]*\).*/\1/p' "$out/cpu.log" | head -1)
    for cfg in ${CPU_CONFIGS:-unary:16 stream:16 unary:256 stream:256}; do
      set -- ${cfg/:/ }
      s0=$(metric "$m0" epserve_step_duration_seconds_sum); k0=$(metric "$m0" epserve_step_tokens_sum)
      n0=$(metric "$m0" epserve_step_duration_seconds_count); curl -s "$m0" >"$out/cpu-m0.txt"
      "$loadtest" --target "$addr" --echo --api "$1" --concurrency "$2" --tokens 16 \
        --dtype bf16 --warmup 1s --duration 5s >"$out/cpu-run.txt" 2>&1
      s1=$(metric "$m0" epserve_step_duration_seconds_sum); k1=$(metric "$m0" epserve_step_tokens_sum)
      n1=$(metric "$m0" epserve_step_duration_seconds_count); curl -s "$m0" >"$out/cpu-m1.txt"
      echo "== cpu $(basename "$bin") $1 c$2 (nproc $(nproc)): busy $(python3 -c "print(round(($s1 - $s0) / 6, 3))"), the step alone $(python3 -c "print(round(($k1 - $k0) / ($s1 - $s0)))") tokens/s, $(python3 -c "print(round(($k1 - $k0) / max($n1 - $n0, 1), 1))") tokens and $(python3 -c "print(round(($s1 - $s0) / max($n1 - $n0, 1) * 1e6, 1))") us a step"
      # The leader's own phases, µs per step (its share of each step; waits on peers included).
      for p in gating prepare dispatch experts combine; do
        a=$(awk -v m="epserve_step_phase_seconds_sum{phase=\"$p\"}" '$1 == m {print $2}' "$out/cpu-m0.txt")
        b=$(awk -v m="epserve_step_phase_seconds_sum{phase=\"$p\"}" '$1 == m {print $2}' "$out/cpu-m1.txt")
        printf '   %s %s us' "$p" "$(python3 -c "print(round(((${b:-0}) - (${a:-0})) / max($n1 - $n0, 1) * 1e6, 1))")"
      done; echo
      grep -E "requests/s|latency|/ echo|sent" "$out/cpu-run.txt"
    done
    kill -TERM $pid; wait $pid
    rm -rf "$shm" "$out/cpu-run.txt" "$out/cpu-m0.txt" "$out/cpu-m1.txt"
  done
fi
if want serve; then
  if [ -f .device/nccl230.tar.xz ]; then
    mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
    # shellcheck disable=SC1091
    source /tmp/nccl230/env.sh
  fi
  # Each binary with the default HTTP/2 settings, and with SERVE_HYPER=1 also with hyper's own
  # (1 MiB windows, 16 KiB frames) on the service and the loadtest alike. A SERVE_BINS entry
  # may carry launch flags after the path, joined by '+' (e.g. .device/bin/epserve+--steps-ahead+0).
  # SERVE_RANKS, SERVE_BACKEND and SERVE_MODEL default to the issue's 4, nccl-ep, deepseek-v3.
  variants=("default:")
  [ -n "${SERVE_HYPER:-}" ] && variants+=("hyper:--http2-stream-window 1048576 --http2-connection-window 1048576 --http2-max-frame-size 16384")
  round=0
  for entry in ${SERVE_BINS:-$EPSERVE_BIN}; do
   round=$((round + 1))
   IFS=+ read -r -a parts <<<"$entry"
   bin=${parts[0]}; flags=("${parts[@]:1}")
   for variant in "${variants[@]}"; do
    vname=${variant%%:*}; read -r -a h2 <<<"${variant#*:}"
    # The entry's place in SERVE_BINS too: the same binary may be run in several rounds.
    name=$round-$(basename "$bin")$(printf '%s' "${flags[@]}" | tr -d -)-$vname
    shm=$(mktemp -d -p /dev/shm)
    "$bin" launch --ranks "${SERVE_RANKS:-4}" --backend "${SERVE_BACKEND:-nccl-ep}" \
      --model "synthetic:${SERVE_MODEL:-deepseek-v3}" --layers 1 \
      --max-tokens-per-step 4096 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --shm-dir "$shm" \
      --allow-client-shm "${h2[@]}" "${flags[@]}" >"$out/serve-$name.log" 2>&1 &
    pid=$!
    addr=$(serving_addr "$out/serve-$name.log" 900)
    if [ -z "$addr" ]; then tail -20 "$out/serve-$name.log"; kill $pid; status=1; continue; fi
    m0=$(sed -n 's/.* 0 metrics on \(http:[^ ]*\).*/\1/p' "$out/serve-$name.log" | head -1)
    r0=$(pgrep -P $pid -f -- '--rank 0 ' | head -1)
    # SERVE_CONFIGS: "clients:tokens ..." (default 64 clients of 128 tokens, 16 of 2048).
    # SERVE_APIS: the loadtest's --api values, each run in turn (default unary); kserve-shm
    # (system shared memory, same host) runs without the echo, which has no shared memory.
    for cfg_api in $(for c in ${SERVE_CONFIGS:-64:128 16:2048}; do for a in ${SERVE_APIS:-unary}; do echo "$c:$a"; done; done); do
      IFS=: read -r clients tokens api <<<"$cfg_api"
      set -- "$clients" "$tokens"
      echo_flag=(--echo); [ "$api" = kserve-shm ] && echo_flag=()
      tag="$name-c$1-t$2$([ "$api" = unary ] || echo "-$api")"
      s0=$(metric "$m0" epserve_step_duration_seconds_sum); k0=$(metric "$m0" epserve_step_tokens_sum)
      read -r -a copies0 <<<"$(copy_times "$m0")"; read -r -a use0 <<<"$(proc_use "$r0")"
      thread_use "$r0" >"$out/threads0.txt"
      t0=$(date +%s.%N)
      "$loadtest" --target "$addr" --api "$api" "${echo_flag[@]}" --concurrency "$1" --tokens "$2" --dtype bf16 \
        --warmup 2s --duration 8s "${h2[@]}" --json "$out/serve-$tag.json" >"$out/serve-$tag.txt" 2>&1
      s1=$(metric "$m0" epserve_step_duration_seconds_sum); k1=$(metric "$m0" epserve_step_tokens_sum)
      t1=$(date +%s.%N)
      read -r -a copies1 <<<"$(copy_times "$m0")"; read -r -a use1 <<<"$(proc_use "$r0")"
      thread_use "$r0" >"$out/threads1.txt"
      # Cores each kind of thread kept busy over the service's 10 s, busiest first.
      awk -F'|' 'NR == FNR {a[$1] = $2; next} {printf "%s=%.2f\n", $1, ($2 - a[$1]) / 10}' \
        "$out/threads0.txt" "$out/threads1.txt" | sort -t= -k2 -rn | head -12 | paste -sd' ' |
        sed 's/^/== leader threads, cores: /'
      rm -f "$out/threads0.txt" "$out/threads1.txt"
      # The leader's copies per step (ms), and its CPU cores and page faults per request.
      python3 - "${copies0[@]}" "${copies1[@]}" "${use0[@]}" "${use1[@]}" <<'PY'
import sys
a = [float(x) for x in sys.argv[1:]]
c0, c1, (u0, f0, u1, f1) = a[0:6], a[6:12], a[12:16]
steps, reqs = c1[0] - c0[0], c1[5] - c0[5]
per = lambda i: round(1e3 * (c1[i] - c0[i]) / max(c1[i + 1] - c0[i + 1], 1), 3)
print(f"== leader: {steps:.0f} steps, pack {per(1)} ms and deliver {per(3)} ms per step; "
      f"{(u1 - u0) / 10:.2f} cores busy over the service's 10 s, "
      f"{(f1 - f0) / max(reqs, 1):.0f} minor faults per request")
PY
      # GPU busy: step seconds over the service's 10 s; the step alone: its tokens over its seconds.
      echo "== serve $tag: leader step seconds $s0 -> $s1, step tokens $k0 -> $k1 over $(python3 -c "print(round($t1 - $t0, 1))") s of wall (the service part is 10 s of it): busy $(python3 -c "print(round(($s1 - $s0) / 10, 3))"), the step alone $(python3 -c "print(round(($k1 - $k0) / ($s1 - $s0)))") tokens/s"
      cat "$out/serve-$tag.txt"
      # Latency at 70% of the closed loop's throughput, open loop (Poisson arrivals); SERVE_OPEN=0
      # skips it.
      [ "${SERVE_OPEN:-1}" = 0 ] && continue
      rate=$(python3 -c "import json; print(round(0.7 * json.load(open('$out/serve-$tag.json'))['service']['requests_per_s'], 1))")
      "$loadtest" --target "$addr" --api "$api" "${echo_flag[@]}" --rate "$rate" --tokens "$2" --dtype bf16 \
        --warmup 2s --duration 8s "${h2[@]}" --json "$out/serve-$tag-open70.json" >"$out/serve-$tag-open70.txt" 2>&1
      echo "== serve $tag: open loop at $rate req/s (70% of the closed loop), then the echo at the same rate"
      cat "$out/serve-$tag-open70.txt"
    done
    # Where a request's time went (queue, in step, whole call), per rank-0 histogram.
    curl -s "$m0" | grep -E '^epserve_(request|step|steps|ingress|egress|partial)' >"$out/serve-$name-metrics.txt"
    echo "== serve $name: steps started ahead $(metric "$m0" epserve_steps_submitted_ahead_total), partial steps formed behind another $(metric "$m0" epserve_partial_steps_behind_total)"
    kill -TERM $pid; wait $pid
    rm -rf "$shm"
   done
  done
  # Fewer, larger files travel back more easily: the runs' JSON and text go back as one archive.
  tar czf "$out/serve.tgz" -C "$out" $(cd "$out" && ls serve-*) && (cd "$out" && rm -f serve-*)
fi
# `ingress`: the same layer on every GPU (or INGRESS_RANKS) under --ingress leader and --ingress
# all, loaded with 2048-token requests through 1, 2, 4 ... ingress ranks at once: one loadtest
# process per rank, INGRESS_CLIENTS clients each (default 8), so the load generator scales with
# the ranks too. Rank r serves on port 50100 + r. INGRESS_BINS: binaries to compare in the same
# run (default the one built); INGRESS_MODES: default "leader all".
if want ingress; then
  mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
  # shellcheck disable=SC1091
  source /tmp/nccl230/env.sh
  clients=${INGRESS_CLIENTS:-8}
  ranks=${INGRESS_RANKS:-$(nvidia-smi -L | wc -l)}
  for bin in ${INGRESS_BINS:-$EPSERVE_BIN}; do
   for mode in ${INGRESS_MODES:-leader all}; do
    name=$(basename "$bin")-$mode
    shm=$(mktemp -d -p /dev/shm)
    "$bin" launch --ranks "$ranks" --backend nccl-ep --model synthetic:deepseek-v3 --layers 1 \
      --max-tokens-per-step 4096 --ingress $mode --listen 127.0.0.1:50100 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
      --shm-dir "$shm" >"$out/ingress-$name.log" 2>&1 &
    pid=$!
    want_lines=$([ $mode = all ] && echo "$ranks" || echo 1)
    for _ in $(seq 1 900); do
      [ "$(grep -c 'serving gRPC on' "$out/ingress-$name.log")" -ge "$want_lines" ] && break; sleep 0.2
    done
    m0=$(sed -n 's/.* 0 metrics on \(http:[^ ]*\).*/\1/p' "$out/ingress-$name.log" | head -1)
    # "n:c": n ingress ranks loaded, c clients each. The leader alone is also loaded with as
    # many clients as all ranks together get.
    counts=$([ $mode = all ] && python3 -c "print(*[f'{n}:$clients' for n in (1, 2, 4, 8) if n <= $ranks])" || echo "1:$clients 1:$((clients * ranks))")
    for nc in $counts; do
      n=${nc%%:*}; c=${nc#*:}
      tag="ingress-$name-n$n-c$c"
      s0=$(metric "$m0" epserve_step_duration_seconds_sum)
      pids=()
      for r in $(seq 0 $((n - 1))); do
        echo_flag=$([ $mode = leader ] && echo --echo || true)
        "$loadtest" --target 127.0.0.1:$((50100 + r)) $echo_flag --concurrency "$c" \
          --tokens 2048 --dtype bf16 --warmup 2s --duration 8s --json "$out/$tag-r$r.json" >"$out/$tag-r$r.txt" 2>&1 &
        pids+=($!)
      done
      wait "${pids[@]}"
      s1=$(metric "$m0" epserve_step_duration_seconds_sum)
      echo "== $tag: $n ingress rank(s), $c clients each; leader step seconds $s0 -> $s1 (busy $(python3 -c "print(round(($s1 - $s0) / 10, 3))") of the 10 s service window)"
      for r in $(seq 0 $((n - 1))); do cat "$out/$tag-r$r.txt"; done
      python3 - "$out" "$tag" "$n" "$ranks" <<'PY'
import json, sys
out, tag, n, gpus = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rs = [json.load(open(f"{out}/{tag}-r{r}.json")) for r in range(n)]
svc = [r.get("service", r) for r in rs]
tok = sum(s["tokens_per_s"] for s in svc)
p50 = max(s["latency_ms"]["p50"] for s in svc); p99 = max(s["latency_ms"]["p99"] for s in svc)
bad = {k: v for s in svc for k, v in s["statuses"].items() if k != "OK"}
print(f"== {tag}: end-to-end {tok:.0f} tokens/s ({tok / gpus:.0f} per GPU), p50 {p50:.0f} ms, p99 {p99:.0f} ms (worst rank), not OK {bad}")
PY
    done
    curl -s "$m0" | grep -E '^epserve_(request|step|steps|ingress|egress|offers)' >"$out/ingress-$name-metrics.txt"
    kill -TERM $pid; wait $pid
    rm -rf "$shm"
   done
  done
  tar czf "$out/ingress.tgz" -C "$out" $(cd "$out" && ls ingress-*) && (cd "$out" && rm -f ingress-*)
fi
exit $status
