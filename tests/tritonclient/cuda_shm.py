"""Triton's own CUDA shared-memory client (tritonclient.utils.cuda_shared_memory) against
`epserve launch --ranks 1 --backend nccl`, on a machine with a GPU: hidden states and output in
regions the client allocates and registers by raw IPC handle, equal to epserve.v1 Forward per
token, in FP32, FP16 and BF16, each direction alone and both; a non-finite value in a region is
refused by row and column. Prints one line per check; exits non-zero on the first failure.

    python3 tests/tritonclient/cuda_shm.py EPSERVE_BINARY

Needs tritonclient (grpc), cuda-python's cuda.bindings, ml_dtypes and epserve.v1's Python stubs
(epserve_pb2*.py, from proto/epserve.proto) on the path: the GPU machine has no registry, so
scripts/bench/cuda-shm-bench.sh puts them there from a folder built beside the checkout.
"""

import os
import re
import signal
import sys
import tempfile

import grpc
import ml_dtypes
import numpy as np
import tritonclient.grpc as triton
import tritonclient.utils.cuda_shared_memory as cudashm
from tritonclient.utils import InferenceServerException

import epserve_pb2 as pb
import epserve_pb2_grpc as pb_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check as common  # noqa: E402  (its helpers; it imports grpc_tools only where it compiles)


def check(cond, what):
    common.check(cond, what)
    print(f"ok: {what}", flush=True)


NP = {"FP32": np.float32, "FP16": np.float16, "BF16": ml_dtypes.bfloat16}
PB = {"FP32": pb.F32, "FP16": pb.F16, "BF16": pb.BF16}


def forward(v1, layer, x, dtype):
    return common.forward_v1(pb, v1, layer, x, PB[dtype])


def worst_token(a, b):
    return common.row_errors(a, b).max()


def main(binary):
    shm = tempfile.mkdtemp(prefix="epserve-shm-", dir="/dev/shm")
    proc, addr, _ = common.launch(binary, shm, ["--ranks", "1", "--backend", "nccl", "--allow-client-shm"])
    try:
        run(addr)
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    check(rc == 0, f"epserve exited {rc} after SIGINT")
    print(f"cuda shared memory: {common.passed} checks passed, 0 failed")


def run(addr):
    c = triton.InferenceServerClient(addr)
    big = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
    v1 = pb_grpc.MoeServiceStub(grpc.insecure_channel(addr, options=big))
    check("cuda_shared_memory" in c.get_server_metadata().extensions, "the extension is listed")
    models = [m.name for m in c.get_model_repository_index().models]
    base = next(m for m in models if re.fullmatch(r"layer-\d+", m))
    layer = int(base.split("-")[1])
    hidden = int(c.get_model_metadata(base).inputs[0].shape[1])
    rng = np.random.default_rng(7)
    for dtype, model in [("FP32", base), ("FP16", f"{base}-fp16"), ("BF16", f"{base}-bf16")]:
        for n in (1, 77, 1024):
            x = rng.uniform(-1, 1, (n, hidden)).astype(NP[dtype])
            want = forward(v1, layer, x, dtype)
            size = x.nbytes
            regions = {}
            for name in ("in", "out"):
                h = cudashm.create_shared_memory_region(f"{name}-{dtype}-{n}", size, 0)
                c.register_cuda_shared_memory(f"{name}-{dtype}-{n}", cudashm.get_raw_handle(h), 0, size)
                regions[name] = h
            cudashm.set_shared_memory_region(regions["in"], [x])
            for placed in ("both", "input", "output"):
                t = triton.InferInput("hidden_states", list(x.shape), dtype)
                if placed in ("both", "input"):
                    t.set_shared_memory(f"in-{dtype}-{n}", size)
                else:
                    t.set_data_from_numpy(x)
                o = triton.InferRequestedOutput("output")
                if placed in ("both", "output"):
                    cudashm.set_shared_memory_region(regions["out"], [np.zeros_like(x)])
                    o.set_shared_memory(f"out-{dtype}-{n}", size)
                r = c.infer(model, [t], outputs=[o])
                if placed in ("both", "output"):
                    got = cudashm.get_contents_as_numpy(regions["out"], NP[dtype], list(x.shape))
                else:
                    got = r.as_numpy("output")
                err = worst_token(got.astype(np.float64), want)
                check(err <= 1e-6, f"{dtype} n={n} {placed} in CUDA memory vs Forward: worst token {err:.3e}")
            c.unregister_cuda_shared_memory(f"in-{dtype}-{n}")
            c.unregister_cuda_shared_memory(f"out-{dtype}-{n}")
            for h in regions.values():
                cudashm.destroy_shared_memory_region(h)
    # A non-finite value in the client's memory: refused before admission, by row and column.
    x = rng.uniform(-1, 1, (16, hidden)).astype(np.float32)
    x[9, 3] = np.inf
    h = cudashm.create_shared_memory_region("bad", x.nbytes, 0)
    cudashm.set_shared_memory_region(h, [x])
    c.register_cuda_shared_memory("bad", cudashm.get_raw_handle(h), 0, x.nbytes)
    t = triton.InferInput("hidden_states", list(x.shape), "FP32")
    t.set_shared_memory("bad", x.nbytes)
    try:
        c.infer(base, [t])
        check(False, "a non-finite value in CUDA memory is refused")
    except InferenceServerException as e:
        check(e.status() == "StatusCode.INVALID_ARGUMENT" and "non-finite value at row 9, column 3" in e.message(),
              f"a non-finite value in CUDA memory is refused: {e.message()}")
    c.unregister_cuda_shared_memory("bad")
    cudashm.destroy_shared_memory_region(h)
    check(not c.get_cuda_shared_memory_status().regions, "no region is left registered")


if __name__ == "__main__":
    main(sys.argv[1])
