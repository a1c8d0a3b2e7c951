# session 65 call 1 (2x H200), #54: serving's host enqueue on an idle GPU. One layer, one bucket
# (2,048-token steps), 16 clients, nccl-ep bf16, no placement; phase times on (as sessions 55-64
# measured) against off, and the load generators on cores of their own; then the bench's enqueue.
source scripts/bench/device-env.sh
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
O=$out
(uname -r; nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA"; lscpu -e | head -40) > $O/host.txt 2>&1
one() { # key phase serve_cpus load_cpus
  local d=$O/$1; mkdir -p $d
  EPSERVE_STEP_PHASE_TIMES=$2 SERVE_CPUS=$3 LOAD_CPUS=$4 OUT=$d RANKS=2 MOVE_EVERY=0 DURATION=20 MOVES_BACKEND=nccl-ep \
    MOVES_EXPERTS=bf16 MOVES_LAYERS=1 CONCURRENCY=16 MOVES_MAX_TOKENS=2048 \
    timeout 110 bash scripts/bench/eplb-gpu.sh moves > $d/report.txt 2>&1
  echo "#### $1 phase=$2 serve=$3 load=$4 (total $((SECONDS - t0))s)"; grep -E "^  (sent|OK) " $d/report.txt | awk '{a[$1]+=$2} END {print "  sent", a["sent"], "OK", a["OK"]}'
  grep -E "tokens/s" $d/report.txt | head -2
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "medians by" | cut -c1-200
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "all steps /" | cut -c1-160
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m1 "causes of the steps over" | cut -c1-300
  awk '/group, least device time/{f=1} f' $d/report.txt | grep -m3 "idle on rank 0"
}
one a on "" ""
one b off "" ""
one c off 0-15 16-31
one d on 0-15 16-31
one e off "" ""
(source /tmp/nccl230/env.sh && export NCCL_DEBUG=WARN && run bench-gap 120 .device/bin/epserve bench --ranks 2 --configs small \
  --backends nccl-ep --ep-modes ht --expert-dtype bf16 --iters 1500 --warmup 20 --gap-us 2000 --json $O/bench-gap.json)
python3 scripts/bench/gap-steps.py $O/bench-gap.json > $O/bench-gap.txt 2>&1; tail -5 $O/bench-gap.txt
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
