#!/usr/bin/env bash
# #57's serving line: `epserve launch --ranks 2 (RANKS) --backend nccl-ep --expert-dtype fp8 --ingress all`
# (the synthetic DeepSeek-V3 layer, NCCL 2.30's env sourced first: ../shared/tools/device-nccl230.sh)
# under epserve-loadtest at 2048-token requests spread over every rank, with `--overlap` set to
# each of SETTINGS in turn (default "off on on off": each twice, in both orders), one group at a
# time (FLAG=--two-batch sets that flag instead; EXTRA adds flags, e.g. EXTRA="--max-tokens-per-step
# 8192": the default steps, 128 tokens a rank, never split). Prints each run's tokens/s and latency; JSON
# under $OUT. On the GPU machine, from the
# repository root, with .device/bin.tar.xz (scripts/gpu-check.sh, packed) carried:
#   bash scripts/bench/overlap-serve.sh
RUN_LINES='^test |error'
source scripts/bench/device-env.sh
B=.device/bin/epserve
flag=${FLAG:---overlap}
i=0
for o in ${SETTINGS:-off on on off}; do
  i=$((i + 1))
  shm=$(mktemp -d -p /dev/shm)
  log="$out/serve-$i${flag#-}-$o.log"
  RUST_LOG=info $B launch --ranks ${RANKS:-2} --backend nccl-ep --model synthetic:deepseek-v3 --layers 1 \
    --expert-dtype fp8 --ingress all "$flag" "$o" ${EXTRA:-} --listen 127.0.0.1:0 --metrics-listen off \
    --http-listen off --shm-dir "$shm" >"$log" 2>&1 &
  pid=$!
  addrs=""
  for _ in $(seq 1 1500); do
    addrs=$(sed -n 's/.*serving gRPC on \([0-9.:]*\).*/\1/p' "$log" | sort -u | paste -sd, -)
    [ "$(echo "$addrs" | tr ',' '\n' | grep -c .)" -ge ${RANKS:-2} ] && break; sleep 0.2
  done
  echo "== run $i, $flag $o, at '$addrs' after $((SECONDS - t0))s"
  if [ -z "$addrs" ]; then tail -20 "$log"; kill $pid; wait $pid; continue; fi
  .device/bin/epserve-loadtest --target "$addrs" --layer 3 --concurrency 16 --tokens 2048 \
    --warmup 3s --duration "${DURATION:-15s}" --timeout 30s --json "$out/load-$i${flag#-}-$o.json" \
    >"$out/load-$i${flag#-}-$o.log" 2>&1
  grep -E "OK |tokens/s|latency" "$out/load-$i${flag#-}-$o.log"
  kill -INT $pid; wait $pid 2>/dev/null
done
# The device tool returns eight files a call: the logs go back as one.
(cd "$out" && tar cJf logs.tar.xz ./*.log && rm -f ./*.log)
