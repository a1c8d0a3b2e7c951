# session 57 call 5 (one H200; x2 still not lent): FP8 serving against f64 on the build that lands
# (the server launched is .device/bin/epserve; the test binary's reference is 083c1b2's, whose
# encode the new one matches bit for bit).
source scripts/bench/device-env.sh
run gpu_serve_fp8 430 .device/bin/gpu_serve --ignored --nocapture --test-threads 1 fp8_experts_match_the_f64_reference --exact
