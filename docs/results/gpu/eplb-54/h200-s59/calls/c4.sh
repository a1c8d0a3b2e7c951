# session 59 call 4 (one H200): a048a25. `epserve bench --eplb on` on one GPU: with no redundant
# slot its first move writes staged slots (write_group); with 2 (258 slots a rank) it is refused.
source scripts/bench/device-env.sh
O=$out
for r in 0 2; do
  run bench_eplb_r$r 100 .device/bin/epserve bench --ranks 1 --iters 10 --warmup 3 --configs prefill --backends nccl \
    --expert-dtype bf16,fp8 --skew 1 --eplb off,on --redundant-experts $r --json $O/bench_eplb_r$r.json
  grep -iE "cannot run|error|panicked" $O/bench_eplb_r$r.log | head -4
done
python3 - $O/bench_eplb_r0.json <<'PY'
import json,sys
t=open(sys.argv[1]).read().strip()
rs=json.loads(t) if t.startswith('[') else [json.loads(l) for l in t.splitlines() if l.strip()]
for r in rs:
    s=r.get('summary',{}); flat={**{k:v for k,v in r.items() if not isinstance(v,(dict,list))},**s}
    print({k:flat.get(k) for k in ('expert_dtype','skew','eplb','step_us','experts_us','load_ratio','moved_bytes','move_us','step_with_move_us') if k in flat})
PY
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
