# session 65 call 8 (2x H200), #54: serving's one-bucket load (nccl-ep bf16, 2,048-token steps, one
# layer, no placement) from 16 clients against 1 (one request in flight: no step ever beside
# another), alternating; phase times on.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
one() { # key clients
  local d=$O/$1; mkdir -p $d
  EPSERVE_STEP_PHASE_TIMES=on OUT=$d RANKS=2 MOVE_EVERY=0 DURATION=20 MOVES_BACKEND=nccl-ep \
    MOVES_EXPERTS=bf16 MOVES_LAYERS=1 CONCURRENCY=$2 MOVES_MAX_TOKENS=2048 \
    timeout 110 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $1 clients $2 (total $((SECONDS - t0))s)"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "tokens/s|latency ms" $d/report.txt | head -2
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "medians by" | cut -c1-200
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "causes of the steps over" | cut -c1-300
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m3 "idle on rank 0"
}
one a-16 16
one b-1 1
one c-16 16
one d-1 1
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
