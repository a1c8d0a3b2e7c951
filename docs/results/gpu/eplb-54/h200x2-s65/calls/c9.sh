# session 65 call 9 (2x H200), #54: serving's one-bucket load (nccl-ep bf16, 2,048-token steps,
# one layer, 16 clients, no placement), server on cores 0-15 and load generators on 16-31, with
# each rank's step-executor thread on a core of its own (0, 1: the leader's step-executor thread, a
# worker's main thread; the server's other threads moved to 4-15 after startup) against not, alternating; phase times on.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
pin() { # dir: once the ranks serve, each step-executor on a core of its own, the rest on 4-15
  for i in $(seq 1 400); do grep -q "serving gRPC" $1/serve-moves.log 2>/dev/null && break; sleep 0.1; done
  local n=0
  # the leader steps on its step-executor thread, a worker on its main thread
  for p in $(pgrep -f "epserve launch"); do for c in $(pgrep -P $p); do
    ex=$c; for t in /proc/$c/task/*; do [ "$(cat $t/comm)" = step-executor ] && ex=${t##*/}; done
    for t in /proc/$c/task/*; do
      if [ ${t##*/} = $ex ]; then echo "executor $ex of $c"; taskset -p -c $n $ex; n=$((n + 1)); else taskset -p -c 4-15 ${t##*/}; fi
    done
  done; done > $1/pin.txt 2>&1
}
one() { # key pinned
  [ $((SECONDS - t0)) -gt 165 ] && { echo "#### $1 skipped: no time"; return; }
  local d=$O/$1; mkdir -p $d
  [ $2 = yes ] && { pin $d & }
  EPSERVE_STEP_PHASE_TIMES=on SERVE_CPUS=0-15 LOAD_CPUS=16-31 OUT=$d RANKS=2 MOVE_EVERY=0 DURATION=15 MOVES_BACKEND=nccl-ep \
    MOVES_EXPERTS=bf16 MOVES_LAYERS=1 CONCURRENCY=16 MOVES_MAX_TOKENS=2048 \
    timeout 90 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  wait
  echo "#### $1 pinned $2 (total $((SECONDS - t0))s)"; grep -A1 "^executor" $d/pin.txt 2>/dev/null | head -4; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "tokens/s" $d/report.txt | head -1
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "causes of the steps over" | cut -c1-300
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m3 "idle on rank 0"
  tar cJf $O/$1.tar.xz -C $O $1 && rm -rf $d
}
one a-free no
one b-pinned yes
one c-free no
one d-pinned yes
