# session 56 call 6: nccl-ep fp8 under the moves load hung at its first work step (call 5): which change? new build phases off; build A (inbox_free as before) phases on; build A phases off
source scripts/bench/device-env.sh
O=$out
mkdir -p /tmp/nccl230 && tar xJf .device/nccl230.tar.xz -C /tmp/nccl230
for v in new:off a:on a:off; do
  IFS=: read b pt <<<"$v"; B=.device/bin/epserve; [ $b = a ] && B=.device/bin/epserve-a
  EPSERVE=$B EPSERVE_STEP_PHASE_TIMES=$pt MOVES_BACKEND=nccl-ep MOVES_EXPERTS=fp8 OUT=$O/$b-$pt RANKS=2 MOVE_EVERY=0 DURATION=5 timeout 90 bash scripts/bench/eplb-gpu.sh moves > $O/$b-$pt-report.txt 2>&1
  echo "== build $b phases $pt: exit $?"; grep -hE "^  (OK|UNAVAIL)" $O/$b-$pt-report.txt | head -4
  mkdir -p /tmp/x && tar xJf $O/$b-$pt/moves-logs.tar.xz -C /tmp/x && grep -E "ERROR" /tmp/x/serve-moves.log | head -2 | cut -c1-200; rm -rf /tmp/x
done
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
