# session 56 call 2: the next step's rows behind this step's small copies (B) against before (A), 1 GPU, alternated; NCCL after idle (probe v2)
source scripts/bench/device-env.sh
O=$out
timeout 100 python3 -m torch.distributed.run --nproc_per_node 2 scripts/bench/nccl-after-idle.py 120 16 > $O/nccl-after-idle.txt 2>&1
grep -v "^W\|warn\|\*\*\*\|OMP" $O/nccl-after-idle.txt | tail -22
i=0
for v in a b b a; do
  i=$((i+1)); B=.device/bin/epserve; [ $v = a ] && B=.device/bin/epserve-a
  EPSERVE=$B OUT=$O/$i-$v RANKS=1 MOVE_EVERY=0 DURATION=25 timeout 120 bash scripts/bench/eplb-gpu.sh moves > $O/$i-$v-report.txt 2>&1
  echo "== run $i build $v"; grep -E "over 1.1x:|after 1500" $O/$i-$v-report.txt | sed -n '3p;6p;7p'
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
