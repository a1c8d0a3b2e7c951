#!/usr/bin/env bash
# Builds, here, what the GPU machine runs: the release binary, the load generator and the GPU
# test binaries with --features cuda, stripped, into .device/bin (git-ignored; no cargo is needed there).
# Then, with .device copied beside the checkout on the GPU machine:
#   export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH
#   .device/bin/gpu_kernels --ignored --test-threads 1 2>&1 | tee $OUT/gpu_kernels.log
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/cuda-toolchain.sh)"
mkdir -p .device/bin
cargo build --release --locked --features cuda --bin epserve
cp target/release/epserve .device/bin/
cargo build --release --locked -p epserve-loadtest
cp target/release/epserve-loadtest .device/bin/
for t in gpu_kernels gpu_fp8 gpu_nccl gpu_ep gpu_serve gpu_nccl_ep gpu_rank_loss; do
  exe=$(cargo test --release --locked --features cuda --test "$t" --no-run --message-format json |
    T=$t python3 -c 'import json,os,sys; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("executable") and j["target"]["name"] == os.environ["T"] and "test" in j["target"]["kind"]][-1])')
  cp "$exe" ".device/bin/$t"
done
strip .device/bin/*
ls -la .device/bin
