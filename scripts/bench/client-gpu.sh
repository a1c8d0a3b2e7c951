#!/usr/bin/env bash
# The Python client's GPU tests (clients/python/tests/test_cuda.py: CUDA shared memory) on a GPU
# machine, which has torch and transformers but no registry: .device/py.tar.xz carries grpcio,
# protobuf, pytest and the epserve package built here for its Python (3.12), .device/bin.tar.xz
# the service (scripts/gpu-check.sh). From the repository root:
#   bash scripts/bench/client-gpu.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__)"
[ -x .device/bin/epserve ] || tar xJf .device/bin.tar.xz -C .device
mkdir -p /tmp/py && tar xJf .device/py.tar.xz -C /tmp/py
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TMPDIR=/dev/shm
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
PYTHONPATH=/tmp/py/py EPSERVE_BIN=$PWD/.device/bin/epserve timeout 400 \
  python3 -m pytest -v -p no:cacheprovider clients/python/tests/test_cuda.py 2>&1 | tee "$out/client-cuda.log" | tail -25
