"""The stock `tritonclient.grpc.InferenceServerClient` against `epserve launch`, with no glue:
liveness and readiness, metadata and Triton's model configuration of every model, the
repository index and statistics, FP32 and BF16 inference equal to epserve.v1 Forward on random
data (per token), the typed models, gzip and deflate requests, client routing, streaming (with
Triton's final-response flag), and the statuses of bad requests, after each of which the service
keeps serving. Then `tritonclient.http` (sync and asyncio) against the REST port: the same
catalogue calls, binary and JSON inference (gzip, deflate), system shared memory, equal per token
to Forward. First, every message and field epserve declares of Triton's protocol is checked
against the pinned tritonclient's own descriptors. Usage: check.py path/to/epserve
"""

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import ml_dtypes
import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
passed = 0


def check(cond, what):
    global passed
    if not cond:
        raise AssertionError(what)
    passed += 1


def epserve_v1():
    """epserve.v1 stubs, compiled from proto/ into a temporary directory."""
    from grpc_tools import protoc
    out = tempfile.mkdtemp(prefix="epserve-v1-")
    rc = protoc.main(["protoc", f"-I{ROOT}/proto", f"--python_out={out}",
                      f"--grpc_python_out={out}", f"{ROOT}/proto/epserve.proto"])
    assert rc == 0, "protoc failed"
    sys.path.insert(0, out)
    import epserve_pb2
    import epserve_pb2_grpc
    return epserve_pb2, epserve_pb2_grpc


def same_schema_as_tritonclient():
    """Each message, enum and field of proto/inference.proto and proto/model_config.proto has
    the name, number, type and label of tritonclient's own (a subset may be declared)."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_tools import protoc
    from tritonclient.grpc import service_pb2
    out = tempfile.mkdtemp(prefix="epserve-kserve-")
    fds = os.path.join(out, "kserve.pb")
    rc = protoc.main(["protoc", f"-I{ROOT}/proto", "--include_imports",
                      f"--descriptor_set_out={fds}", f"{ROOT}/proto/inference.proto"])
    assert rc == 0, "protoc failed"
    ours = descriptor_pool.DescriptorPool()
    with open(fds, "rb") as f:
        for file in descriptor_pb2.FileDescriptorSet.FromString(f.read()).file:
            ours.Add(file)
    theirs = service_pb2.DESCRIPTOR.pool
    compared = 0

    def messages(m):
        yield m
        for n in m.nested_types:
            yield from messages(n)

    for fname in ("inference.proto", "model_config.proto"):
        f = ours.FindFileByName(fname)
        for top in f.message_types_by_name.values():
            for m in messages(top):
                t = theirs.FindMessageTypeByName(m.full_name)
                for fd in m.fields:
                    tf = t.fields_by_name.get(fd.name)
                    check(tf is not None, f"{m.full_name}.{fd.name} is not Triton's")
                    mine = (fd.number, fd.type, fd.is_repeated, fd.message_type and fd.message_type.full_name,
                            fd.enum_type and fd.enum_type.full_name)
                    want = (tf.number, tf.type, tf.is_repeated, tf.message_type and tf.message_type.full_name,
                            tf.enum_type and tf.enum_type.full_name)
                    check(mine == want, f"{m.full_name}.{fd.name}: ours {mine}, Triton's {want}")
                    compared += 1
        for e in f.enum_types_by_name.values():
            te = theirs.FindEnumTypeByName(e.full_name)
            for v in e.values:
                check(te.values_by_name[v.name].number == v.number, f"{e.full_name}.{v.name}")
        for svc in f.services_by_name.values():
            ts = theirs.FindServiceByName(svc.full_name)
            for m in svc.methods:
                tm = ts.methods_by_name[m.name]
                check((m.input_type.full_name, m.output_type.full_name, m.server_streaming)
                      == (tm.input_type.full_name, tm.output_type.full_name, tm.server_streaming),
                      f"rpc {m.name}")
    check(compared > 60, f"only {compared} fields compared")


# The CPU group this check serves from (tests/tritonclient/cuda_shm.py passes its GPU one).
CPU_GROUP = [
    "--ranks", "2", "--max-request-bytes", "1048576", "--max-queued-tokens", "1000",
    "--allow-client-shm",
]


def launch(binary, shm, group=CPU_GROUP):
    args = [binary, "launch", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
            "--http-listen", "127.0.0.1:0", "--shm-dir", shm, *group]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    end = time.time() + 120
    http = None
    while time.time() < end:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            check(proc.poll() is None, "epserve exited before serving")
            continue
        m = re.search(r"KServe REST on http://(\S+)/v2", line)
        if m:
            http = m.group(1)
        m = re.search(r"serving gRPC on (\S+)", line)
        if m:
            check(http is not None, "the REST port came up before gRPC serves")
            return proc, m.group(1), http
    raise AssertionError("epserve did not come up")


def forward_v1(pb, v1, layer, x, dtype, ids=None, w=None):
    """epserve.v1 Forward of `x` (optionally with client routing), as float32."""
    t = pb.Tensor(dtype=dtype, shape=list(x.shape), data=x.tobytes())
    r = pb.ForwardRequest(id="f", layer=layer, hidden_states=t)
    if ids is not None:
        r.topk_ids.CopyFrom(pb.Tensor(dtype=pb.I32, shape=list(ids.shape), data=ids.tobytes()))
        r.topk_weights.CopyFrom(pb.Tensor(dtype=pb.F32, shape=list(w.shape), data=w.tobytes()))
    out = v1.Forward(r).output
    np_dtype = {pb.F32: np.float32, pb.BF16: ml_dtypes.bfloat16, pb.F16: np.float16}[out.dtype]
    return np.frombuffer(out.data, np_dtype).reshape(list(out.shape)).astype(np.float32)


def row_errors(a, b):
    """Max |a - b| / max |b| of each token's row."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.maximum(np.abs(b).max(axis=1), 1e-30)
    return np.abs(a - b).max(axis=1) / scale


def main(binary):
    same_schema_as_tritonclient()
    pb, pb_grpc = epserve_v1()
    shm = tempfile.mkdtemp(prefix="epserve-shm-")
    proc, addr, http = launch(binary, shm)
    try:
        run(addr, pb, pb_grpc)
        rest(http, addr, pb, pb_grpc)
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    check(rc == 0, f"epserve exited {rc} after SIGINT")
    print(f"tritonclient: {passed} checks passed, 0 failed")


def run(addr, pb, pb_grpc):
    c = triton.InferenceServerClient(addr)
    v1 = pb_grpc.MoeServiceStub(grpc.insecure_channel(addr))
    info = v1.GetModelInfo(pb.GetModelInfoRequest())
    H, K, E = info.hidden_size, info.top_k, info.num_experts

    check(c.is_server_live(), "server live")
    check(c.is_server_ready(), "server ready")
    meta = c.get_server_metadata()
    check(meta.name == "epserve" and meta.version == info.version, f"server metadata {meta}")
    for layer in info.moe_layers:
        name = f"layer-{layer}"
        check(c.is_model_ready(name) and c.is_model_ready(name, "1"), f"{name} ready")
        m = c.get_model_metadata(name)
        got = [(t.name, t.datatype, list(t.shape)) for t in list(m.inputs) + list(m.outputs)]
        want = [("hidden_states", "FP32", [-1, H]), ("topk_ids", "INT32", [-1, K]),
                ("topk_weights", "FP32", [-1, K]), ("output", "FP32", [-1, H])]
        check(m.name == name and list(m.versions) == ["1"] and got == want, f"{name}: {m}")
    check(not c.is_model_ready("layer-999"), "an unknown model is not ready")

    # Triton's catalogue calls: every model (per layer a plain FP32 one, a BF16 and an FP16 one,
    # and each of them -gated, without the routing inputs) in the index, each configuration
    # with the routing inputs optional.
    names = [f"layer-{l}{s}{g}" for l in info.moe_layers for g in ("", "-gated")
             for s in ("", "-bf16", "-fp16")]
    index = c.get_model_repository_index(as_json=True)["models"]
    check([m["name"] for m in index] == names and all(m["state"] == "READY" for m in index),
          f"repository index {index}")
    for name in names:
        gated = name.endswith("-gated")
        float_type = {"bf16": "BF16", "fp16": "FP16"}.get(
            name.removesuffix("-gated").rsplit("-", 1)[-1], "FP32")
        cfg = c.get_model_config(name, as_json=True)["config"]
        got = [(i["name"], i["data_type"], i["dims"], i.get("optional", False)) for i in cfg["input"]]
        want = [("hidden_states", f"TYPE_{float_type}", [str(-1), str(H)], False),
                ("topk_ids", "TYPE_INT32", ["-1", str(K)], True),
                ("topk_weights", "TYPE_FP32", ["-1", str(K)], True)]
        check(got == (want[:1] if gated else want), f"{name} config inputs {got}")
        check(cfg.get("max_batch_size", 0) == 0 and cfg["output"][0]["data_type"] == f"TYPE_{float_type}",
              f"{name} config {cfg}")
        m = c.get_model_metadata(name)
        check(m.inputs[0].datatype == float_type and m.outputs[0].datatype == float_type,
              f"{name} metadata {m}")

    def forward(layer, x, dtype, ids=None, w=None):
        return forward_v1(pb, v1, layer, x, dtype, ids, w)

    rng = np.random.default_rng(15)
    for layer in info.moe_layers:
        model = f"layer-{layer}"
        # 300 rows of FP32 answer 76.8 KB, which leave spliced after the rest of the message
        # (server/api/unary.rs); 1 and 7 rows leave in one piece.
        for n in (1, 7, 300):
            x = rng.uniform(-1, 1, (n, H)).astype(np.float32)
            # FP32: equal to Forward per token (the same f32 backend).
            i = triton.InferInput("hidden_states", [n, H], "FP32")
            i.set_data_from_numpy(x)
            r = c.infer(model, [i], request_id=f"{model}-{n}-fp32",
                        outputs=[triton.InferRequestedOutput("output")])
            out = r.as_numpy("output")
            check(r.get_response().id == f"{model}-{n}-fp32", "the id comes back")
            check(out.dtype == np.float32 and out.shape == (n, H), f"fp32 output {out.shape}")
            err = row_errors(out, forward(layer, x, pb.F32))
            check(err.max() <= 1e-6, f"{model} n={n} FP32 vs Forward: worst token {err.max():.3e}")
            # BF16 in and out, as Triton sends it: equal to Forward (the same rows, rounded alike).
            xb = x.astype(ml_dtypes.bfloat16)
            i = triton.InferInput("hidden_states", [n, H], "BF16")
            i.set_data_from_numpy(xb)
            out = c.infer(model, [i]).as_numpy("output")
            check(out.dtype == ml_dtypes.bfloat16, f"bf16 output dtype {out.dtype}")
            err = row_errors(out.astype(np.float32), forward(layer, xb, pb.BF16))
            check(err.max() <= 1e-6, f"{model} n={n} BF16 vs Forward: worst token {err.max():.3e}")
            # Client routing skips gating.
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
            w = rng.uniform(0.05, 1, (n, K)).astype(np.float32)
            inputs = [triton.InferInput("hidden_states", [n, H], "FP32"),
                      triton.InferInput("topk_ids", [n, K], "INT32"),
                      triton.InferInput("topk_weights", [n, K], "FP32")]
            for t, v in zip(inputs, (x, ids, w)):
                t.set_data_from_numpy(v)
            out = c.infer(model, inputs).as_numpy("output")
            err = row_errors(out, forward(layer, x, pb.F32, ids, w))
            check(err.max() <= 1e-6, f"{model} n={n} routed vs Forward: worst token {err.max():.3e}")

    def good():
        i = triton.InferInput("hidden_states", [2, H], "FP32")
        i.set_data_from_numpy(rng.uniform(-1, 1, (2, H)).astype(np.float32))
        return i

    def refused(code, fragment, model, inputs, **kw):
        try:
            c.infer(model, inputs, **kw)
        except InferenceServerException as e:
            check(e.status() == f"StatusCode.{code}", f"{fragment}: {e.status()} {e.message()}")
            check(fragment in e.message(), f"want '{fragment}' in '{e.message()}'")
        else:
            raise AssertionError(f"{fragment}: accepted")
        check(c.infer("layer-0", [good()]).as_numpy("output").shape == (2, H),
              "a valid request after a bad one")

    model = f"layer-{info.moe_layers[0]}"
    bad = triton.InferInput("hidden_states", [2, H + 1], "FP32")
    bad.set_data_from_numpy(np.zeros((2, H + 1), np.float32))
    refused("INVALID_ARGUMENT", f"does not match the model's {H}", model, [bad])
    flat = triton.InferInput("hidden_states", [2 * H], "FP32")
    flat.set_data_from_numpy(np.zeros(2 * H, np.float32))
    refused("INVALID_ARGUMENT", f"must be [n, {H}]", model, [flat])
    nan = triton.InferInput("hidden_states", [1, H], "FP32")
    nan.set_data_from_numpy(np.full((1, H), np.nan, np.float32))
    refused("INVALID_ARGUMENT", "non-finite value at row 0, column 0", model, [nan])
    refused("NOT_FOUND", "unknown model", "layer-999", [good()])
    # A 100 KB name is quoted cut short: grpcio drops a status message over 16 KiB.
    refused("NOT_FOUND", "(100000 bytes) (models:", "m" * 100_000, [good()])
    refused("NOT_FOUND", "has no version", model, [good()], model_version="7")
    refused("INVALID_ARGUMENT", "unknown output", model, [good()],
            outputs=[triton.InferRequestedOutput("logits")])
    # Triton's pass-through parameters (priority, a sequence, custom keys): answered as without.
    g = good()
    passed = c.infer(model, [g], priority=3, sequence_id=7, sequence_start=True,
                     parameters={"my_tag": "x", "my_weight": 0.5}).as_numpy("output")
    check(np.array_equal(passed, c.infer(model, [g]).as_numpy("output")),
          "priority, sequence fields and custom parameters answered as without them")
    refused("INVALID_ARGUMENT", "is not valid here", model, [good()], parameters={"output_datatype": 5})
    big = triton.InferInput("hidden_states", [1001, H], "FP32")
    big.set_data_from_numpy(np.zeros((1001, H), np.float32))
    refused("RESOURCE_EXHAUSTED", "exceeds --max-queued-tokens", model, [big])

    # The typed models answer in their type; gzip and deflate requests as plain ones.
    x = rng.uniform(-1, 1, (4, H)).astype(np.float32)
    for name, np_dtype, dt, v1_dtype in (("bf16", ml_dtypes.bfloat16, "BF16", pb.BF16),
                                          ("fp16", np.float16, "FP16", pb.F16)):
        i = triton.InferInput("hidden_states", [4, H], dt)
        i.set_data_from_numpy(x.astype(np_dtype))
        out = c.infer(f"{model}-{name}", [i]).as_numpy("output")
        check(out.dtype == np_dtype, f"{model}-{name} answers {out.dtype}")
        err = row_errors(out.astype(np.float32), forward(info.moe_layers[0], x.astype(np_dtype), v1_dtype))
        check(err.max() <= 1e-6, f"{model}-{name} vs Forward: worst token {err.max():.3e}")
    i = triton.InferInput("hidden_states", [4, H], "FP32")
    i.set_data_from_numpy(x)
    plain = c.infer(model, [i]).as_numpy("output")
    for algorithm in ("gzip", "deflate"):
        z = c.infer(model, [i], compression_algorithm=algorithm).as_numpy("output")
        check(np.array_equal(z, plain), f"{algorithm} request answered as the plain one")

    # System shared memory, as tritonclient's own helpers make it: the hidden states from one
    # region, the output into another, equal per token to the same request over the wire.
    import tritonclient.utils.shared_memory as shm
    n = 9
    x = rng.uniform(-1, 1, (n, H)).astype(np.float32)
    regions = [shm.create_shared_memory_region(name, f"/epserve-check-{os.getpid()}-{name}", x.nbytes)
               for name in ("in", "out")]
    try:
        shm.set_shared_memory_region(regions[0], [x])
        for name in ("in", "out"):
            c.register_system_shared_memory(name, f"/epserve-check-{os.getpid()}-{name}", x.nbytes)
        status = c.get_system_shared_memory_status(as_json=True)["regions"]
        check(sorted(status) == ["in", "out"], f"shared-memory status {status}")
        i = triton.InferInput("hidden_states", [n, H], "FP32")
        i.set_shared_memory("in", x.nbytes)
        o = triton.InferRequestedOutput("output")
        o.set_shared_memory("out", x.nbytes)
        r = c.infer(model, [i], outputs=[o])
        got = r.get_output("output")
        check(list(got.shape) == [n, H] and list(r.get_response().raw_output_contents) == [b""]
              and got.parameters["shared_memory_region"].string_param == "out",
              f"the output is in region out, not the response: {got}")
        out = shm.get_contents_as_numpy(regions[1], np.float32, [n, H])
        err = row_errors(out, forward(info.moe_layers[0], x, pb.F32))
        check(err.max() <= 1e-6, f"shared memory vs Forward: worst token {err.max():.3e}")
        try:
            c.register_system_shared_memory("in", f"/epserve-check-{os.getpid()}-in", x.nbytes)
        except InferenceServerException as e:
            check("already registered" in e.message(), f"registered twice: {e.message()}")
        else:
            raise AssertionError("a region registered twice")
        c.unregister_system_shared_memory()
        check(c.get_system_shared_memory_status(as_json=True).get("regions", {}) == {},
              "every region unregistered")
    finally:
        for h in regions:
            shm.destroy_shared_memory_region(h)

    # Statistics: what was answered above is counted, with its queue and compute times.
    stats = {m["name"]: m for m in c.get_inference_statistics(as_json=True)["model_stats"]}
    check(list(stats) == names, f"statistics of {list(stats)}")
    s0 = stats[model]["inference_stats"]
    success = int(s0["success"]["count"])
    check(success >= 10 and int(stats[model]["inference_count"]) == success, f"{model} stats {s0}")
    for k in ("queue", "compute_input", "compute_infer", "compute_output"):
        check(int(s0[k]["count"]) == success, f"{model} {k} counted per answered request: {s0}")
    check(int(s0["compute_infer"]["ns"]) > 0, f"{model} compute time {s0}")
    check(int(s0["fail"]["count"]) >= 3, f"{model} refused requests counted: {s0}")

    # Streaming: every request answered with its id, a bad one with its error, and the stream
    # carries on.
    results = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    sent = {}
    for k in range(6):
        rid = f"s{k}"
        if k == 3:
            c.async_stream_infer(model, [bad], request_id=rid)
            sent[rid] = None
        else:
            x = rng.uniform(-1, 1, (k + 1, H)).astype(np.float32)
            i = triton.InferInput("hidden_states", [k + 1, H], "FP32")
            i.set_data_from_numpy(x)
            c.async_stream_infer(model, [i], request_id=rid,
                                 enable_empty_final_response=(k % 2 == 0))
            sent[rid] = x
    ok = errors = 0
    for _ in sent:
        result, error = results.get(timeout=30)
        if error is not None:
            check("INVALID_ARGUMENT" in error.message() and "does not match" in error.message(),
                  f"stream error: {error.message()}")
            errors += 1
            continue
        rid = result.get_response().id
        final = result.get_response().parameters.get("triton_final_response")
        want_final = int(rid[1:]) % 2 == 0
        check((final is not None and final.bool_param) == want_final,
              f"stream {rid}: triton_final_response {final}")
        err = row_errors(result.as_numpy("output"), forward(0 + info.moe_layers[0], sent[rid], pb.F32))
        check(err.max() <= 1e-6, f"stream {rid}: worst token {err.max():.3e}")
        ok += 1
    c.stop_stream()
    check((ok, errors) == (5, 1), f"stream answers {ok} ok, {errors} errors")
    check(c.is_server_ready(), "still ready after everything")


def rest(http, addr, pb, pb_grpc):
    """tritonclient.http against the REST port: what `run` checks over gRPC, REST's way."""
    import asyncio
    import tritonclient.http as th
    import tritonclient.http.aio as th_aio
    import tritonclient.utils.shared_memory as shm
    c = th.InferenceServerClient(http)
    v1 = pb_grpc.MoeServiceStub(grpc.insecure_channel(addr))
    info = v1.GetModelInfo(pb.GetModelInfoRequest())
    H, K, E = info.hidden_size, info.top_k, info.num_experts
    layer = info.moe_layers[0]
    model = f"layer-{layer}"

    def forward(x, dtype, ids=None, w=None):
        return forward_v1(pb, v1, layer, x, dtype, ids, w)

    check(c.is_server_live() and c.is_server_ready(), "REST: live and ready")
    meta = c.get_server_metadata()
    check(meta["name"] == "epserve" and "binary_tensor_data" in meta["extensions"], f"REST: {meta}")
    check(c.is_model_ready(model) and not c.is_model_ready("layer-999"), "REST: model readiness")
    m = c.get_model_metadata(model)
    check([(t["name"], t["datatype"], t["shape"]) for t in m["inputs"]][0] == ("hidden_states", "FP32", [-1, H]),
          f"REST metadata {m}")
    cfg = c.get_model_config(model)
    check([i.get("optional", False) for i in cfg["input"]] == [False, True, True]
          and cfg["input"][1]["dims"] == [-1, K] and cfg["max_batch_size"] == 0, f"REST config {cfg}")
    index = c.get_model_repository_index()
    check(len(index) == 6 * len(info.moe_layers) and all(m["state"] == "READY" for m in index),
          f"REST index {index}")

    rng = np.random.default_rng(16)
    for n in (1, 7, 300):
        x = rng.uniform(-1, 1, (n, H)).astype(np.float32)
        want = forward(x, pb.F32)
        for binary in (True, False):
            i = th.InferInput("hidden_states", [n, H], "FP32")
            i.set_data_from_numpy(x, binary_data=binary)
            o = th.InferRequestedOutput("output", binary_data=binary)
            r = c.infer(model, [i], outputs=[o], request_id=f"rest-{n}-{binary}")
            check(r.get_response()["id"] == f"rest-{n}-{binary}", "REST: the id comes back")
            err = row_errors(r.as_numpy("output"), want)
            check(err.max() <= 1e-6, f"REST n={n} binary={binary} vs Forward: worst token {err.max():.3e}")
        xb = x.astype(ml_dtypes.bfloat16)
        i = th.InferInput("hidden_states", [n, H], "BF16")
        i.set_data_from_numpy(xb)
        out = c.infer(f"{model}-bf16", [i]).as_numpy("output")
        check(out.dtype == ml_dtypes.bfloat16, f"REST bf16 output dtype {out.dtype}")
        err = row_errors(out.astype(np.float32), forward(xb, pb.BF16))
        check(err.max() <= 1e-6, f"REST n={n} BF16 vs Forward: worst token {err.max():.3e}")
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
        w = rng.uniform(0.05, 1, (n, K)).astype(np.float32)
        inputs = [th.InferInput("hidden_states", [n, H], "FP32"),
                  th.InferInput("topk_ids", [n, K], "INT32"),
                  th.InferInput("topk_weights", [n, K], "FP32")]
        for t, v, b in zip(inputs, (x, ids, w), (True, False, False)):
            t.set_data_from_numpy(v, binary_data=b)
        out = c.infer(model, inputs).as_numpy("output")
        err = row_errors(out, forward(x, pb.F32, ids, w))
        check(err.max() <= 1e-6, f"REST n={n} routed vs Forward: worst token {err.max():.3e}")
        for algorithm in ("gzip", "deflate"):
            i = th.InferInput("hidden_states", [n, H], "FP32")
            i.set_data_from_numpy(x)
            z = c.infer(model, [i], request_compression_algorithm=algorithm).as_numpy("output")
            check(np.array_equal(z, c.infer(model, [i]).as_numpy("output")),
                  f"REST {algorithm} request answered as the plain one")

    def refused(http_code, fragment, name, inputs, **kw):
        try:
            c.infer(name, inputs, **kw)
        except InferenceServerException as e:
            check(e.status() == str(http_code), f"{fragment}: {e.status()} {e.message()}")
            check(fragment in e.message(), f"want '{fragment}' in '{e.message()}'")
        else:
            raise AssertionError(f"{fragment}: accepted")
        ok = th.InferInput("hidden_states", [2, H], "FP32")
        ok.set_data_from_numpy(rng.uniform(-1, 1, (2, H)).astype(np.float32))
        check(c.infer(model, [ok]).as_numpy("output").shape == (2, H), "REST: valid after a bad one")

    bad = th.InferInput("hidden_states", [2, H + 1], "FP32")
    bad.set_data_from_numpy(np.zeros((2, H + 1), np.float32))
    refused(400, f"does not match the model's {H}", model, [bad])
    refused(404, "unknown model", "layer-999", [bad])
    nan = th.InferInput("hidden_states", [1, H], "FP32")
    nan.set_data_from_numpy(np.full((1, H), np.nan, np.float32))
    refused(400, "non-finite value at row 0, column 0", model, [nan])
    big = th.InferInput("hidden_states", [1001, H], "FP32")
    big.set_data_from_numpy(np.zeros((1001, H), np.float32))
    refused(429, "exceeds --max-queued-tokens", model, [big])
    huge = th.InferInput("hidden_states", [5000, H], "FP32")
    huge.set_data_from_numpy(np.zeros((5000, H), np.float32))
    refused(429, "exceed --max-request-bytes", model, [huge])

    # System shared memory through the REST calls.
    n = 9
    x = rng.uniform(-1, 1, (n, H)).astype(np.float32)
    keys = {name: f"/epserve-rest-{os.getpid()}-{name}" for name in ("in", "out")}
    regions = [shm.create_shared_memory_region(name, key, x.nbytes) for name, key in keys.items()]
    try:
        shm.set_shared_memory_region(regions[0], [x])
        for name, key in keys.items():
            c.register_system_shared_memory(name, key, x.nbytes)
        status = c.get_system_shared_memory_status()
        check(sorted(r["name"] for r in status) == ["in", "out"], f"REST shared-memory status {status}")
        i = th.InferInput("hidden_states", [n, H], "FP32")
        i.set_shared_memory("in", x.nbytes)
        o = th.InferRequestedOutput("output")
        o.set_shared_memory("out", x.nbytes)
        r = c.infer(model, [i], outputs=[o])
        got = r.get_output("output")
        check(got["parameters"]["shared_memory_region"] == "out" and "data" not in got,
              f"REST: the output is in region out: {got}")
        out = shm.get_contents_as_numpy(regions[1], np.float32, [n, H])
        err = row_errors(out, forward(x, pb.F32))
        check(err.max() <= 1e-6, f"REST shared memory vs Forward: worst token {err.max():.3e}")
        try:
            c.register_system_shared_memory("in", keys["in"], x.nbytes)
        except InferenceServerException as e:
            check(e.status() == "409" and "already registered" in e.message(), f"twice: {e}")
        else:
            raise AssertionError("REST: a region registered twice")
        c.unregister_system_shared_memory()
        check(c.get_system_shared_memory_status() == [], "REST: every region unregistered")
    finally:
        for h in regions:
            shm.destroy_shared_memory_region(h)

    stats = c.get_inference_statistics(model)["model_stats"][0]
    check(stats["inference_count"] > 0 and stats["inference_stats"]["success"]["ns"] > 0,
          f"REST statistics {stats}")

    async def aio():
        a = th_aio.InferenceServerClient(http)
        try:
            x = rng.uniform(-1, 1, (5, H)).astype(np.float32)
            i = th_aio.InferInput("hidden_states", [5, H], "FP32")
            i.set_data_from_numpy(x)
            outs = await asyncio.gather(*(a.infer(model, [i]) for _ in range(4)))
            want = forward(x, pb.F32)
            for r in outs:
                check(row_errors(r.as_numpy("output"), want).max() <= 1e-6, "REST asyncio vs Forward")
        finally:
            await a.close()

    asyncio.run(aio())


if __name__ == "__main__":
    main(sys.argv[1])
