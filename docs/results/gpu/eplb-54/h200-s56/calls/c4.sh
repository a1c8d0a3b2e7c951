# session 56 call 4, the final build: placements under load (2 GPUs, 60 s, phases timed); GPU tests: phase times bitwise, graph replays bitwise, nccl against the cpu backend, a placement between graph replays
source scripts/bench/device-env.sh
O=$out
EPSERVE_STEP_PHASE_TIMES=on OUT=$O/moves RANKS=2 MOVE_EVERY=6 DURATION=60 timeout 130 bash scripts/bench/eplb-gpu.sh moves > $O/moves-report.txt 2>&1
grep -A3 "group, least" $O/moves-report.txt | grep -v "over: step" | cut -c1-200; grep -E "every step beside|their causes" $O/moves-report.txt | head -4
run phase_times 60 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 step_phase_times_leave_outputs_bitwise
grep -E "rank [0-9]: " $O/phase_times.log | cut -c1-250
run nccl_vs_cpu 150 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 nccl_backend_matches_the_cpu_backend
EPSERVE_PLACEMENT_CASES=nccl/bf16/auto run gpu_placement 220 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 a_placement_applied_between_graph_replays
tail -4 $O/gpu_placement.log | cut -c1-400
cd $O && tar cJf /tmp/all.tar.xz . && rm -rf ./* && mv /tmp/all.tar.xz .
