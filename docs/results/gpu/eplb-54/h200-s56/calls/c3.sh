# session 56 call 3: 2 GPUs, the next step's rows behind this step's small copies (B) against before (A), alternated, phases timed; B under placements; NCCL after idle (probe v3)
source scripts/bench/device-env.sh
O=$out
timeout 90 python3 -m torch.distributed.run --nproc_per_node 2 scripts/bench/nccl-after-idle.py 100 16 > $O/nccl-after-idle.txt 2>&1
grep -v "^W\|warn\|\*\*\*\|OMP" $O/nccl-after-idle.txt | tail -22
export EPSERVE_STEP_PHASE_TIMES=on
i=0
for v in a b b a p; do
  i=$((i+1)); B=.device/bin/epserve; [ $v = a ] && B=.device/bin/epserve-a
  mv=0; [ $v = p ] && mv=6
  EPSERVE=$B OUT=$O/$i-$v RANKS=2 MOVE_EVERY=$mv DURATION=25 timeout 120 bash scripts/bench/eplb-gpu.sh moves > $O/$i-$v-report.txt 2>&1
  echo "== run $i build $v"; grep -E "over 1.1x:|after 1500|causes|every step beside" $O/$i-$v-report.txt | sed -n '3,4p;7p;/beside/p'
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
