# session 56 call 5, the final build: placements under load on nccl-ep with FP8 experts (2 GPUs, 40 s, phases timed)
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
EPSERVE_STEP_PHASE_TIMES=on MOVES_BACKEND=nccl-ep MOVES_EXPERTS=fp8 OUT=$O/moves-ep RANKS=2 MOVE_EVERY=6 DURATION=40 timeout 200 bash scripts/bench/eplb-gpu.sh moves > $O/moves-ep-report.txt 2>&1
echo "exit $?"
grep -A3 "group, least" $O/moves-ep-report.txt | grep -v "over: step" | cut -c1-200; grep -E "every step beside|their causes" $O/moves-ep-report.txt | head -4
tail -5 $O/moves-ep-report.txt | cut -c1-300
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
