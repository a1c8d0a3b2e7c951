"""The client against the service (a Mixtral checkpoint on 2 cpu ranks): answers over grpcio's
4 MiB default, batches over the service's message limit, streams, deadlines, retries (a fake
service scripts the failures; a real one is restarted under load) and shared memory. Every
answer is checked per token against the model's own MoE block run in f64."""

import os
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

import epserve
from epserve._proto import epserve_pb2 as pb
from epserve._proto import epserve_pb2_grpc as pb_grpc
from conftest import SHM_PREFIX, Service, free_port
from reference import Mixtral64

H = 64


def reference(ref, layer, x, ids=None, weights=None):
    """`ref` (the checkpoint's f64 block) on `x`: (output, tokens routed without a near tie)."""
    n = lambda t: None if t is None else np.asarray(t.float() if t.dtype == torch.bfloat16 else t)
    return ref(layer, n(x), n(ids), n(weights))


def worst(got, want):
    """The largest per-token error, each token's max |got - want| over its own max |want|,
    over the tokens `want` (a reference's pair) routes without a near tie (at most 1 in 1000)."""
    got = np.asarray(got.float() if isinstance(got, torch.Tensor) else got, np.float64)
    if isinstance(want, tuple):
        want, clear = want
        assert (~clear).sum() <= max(1, len(clear) // 1000), f"{(~clear).sum()} near ties of {len(clear)}"
    else:
        want, clear = np.asarray(want.float() if isinstance(want, torch.Tensor) else want, np.float64), slice(None)
    err = np.abs(got - want).max(1) / np.maximum(np.abs(want).max(1), 1e-30)
    return err[clear].max()


def rand(n, seed, dtype=torch.float32):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_answers_over_4_mib_and_batches_over_the_message_limit(mixtral):
    model, s = mixtral
    # 20,000 tokens in f32: a 5.1 MB answer, over grpcio's default receive limit.
    x = rand(20_000, 1)
    plain = pb_grpc.MoeServiceStub(grpc.insecure_channel(s.addr))
    with pytest.raises(grpc.RpcError) as e:
        plain.Forward(pb.ForwardRequest(layer=0, hidden_states=pb.Tensor(
            dtype=pb.F32, shape=[20_000, H], data=x.numpy().tobytes())), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    with epserve.Client(s.addr) as c:
        assert c.max_request_bytes == 8 << 20
        y = c.forward(x, 0)
        assert y.shape == (20_000, H) and y.dtype == torch.float32
        assert worst(y, reference(model, 0, x)) <= 1e-5
        # 40,000 tokens (10 MB) go as several requests, answered in order.
        x = rand(40_000, 2)
        assert c.rows_per_request(x) < 40_000
        y = c.forward(x, 1)
        assert worst(y, reference(model, 1, x)) <= 1e-5
        # bf16 in, bf16 out (and f32 out when asked), against f64 on the same bf16 values.
        xb = rand(3_000, 3, torch.bfloat16)
        yb = c.forward(xb, 1)
        assert yb.dtype == torch.bfloat16 and worst(yb, reference(model, 1, xb)) <= 1e-2
        yf = c.forward(xb, 1, output_dtype=torch.float32)
        assert yf.dtype == torch.float32 and worst(yf, reference(model, 1, xb)) <= 1e-5
        # numpy in, numpy out; client routing.
        ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(500)])
        w = torch.rand(500, 2, generator=torch.Generator().manual_seed(4))
        xr = rand(500, 5)
        yr = c.forward(xr.numpy(), 0, topk_ids=ids.int().numpy(), topk_weights=w.numpy())
        assert isinstance(yr, np.ndarray)
        assert worst(yr, reference(model, 0, xr, ids, w)) <= 1e-5


def test_stream_answers_in_order(mixtral):
    model, s = mixtral
    sizes = [1 + (37 * k) % 300 for k in range(30)]
    items = [(k % 2, rand(n, 100 + k)) for k, n in enumerate(sizes)]
    with epserve.Client(s.addr) as c:
        outs = list(c.stream(iter(items)))
    assert len(outs) == len(items)
    for (layer, x), y in zip(items, outs):
        assert y.shape == x.shape and worst(y, reference(model, layer, x)) <= 1e-5
    with epserve.Client(s.addr) as c, pytest.raises(ValueError, match="not served"):
        list(c.stream([(7, rand(2, 0))]))


def test_deadlines_bound_every_call(mixtral):
    model, s = mixtral
    x = rand(40_000, 6)
    with epserve.Client(s.addr) as c:
        t = time.monotonic()
        with pytest.raises(epserve.EpserveError) as e:
            c.forward(x, 0, timeout=0.005)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t < 2.0
        # The service is none the worse.
        assert worst(c.forward(x[:100], 0), reference(model, 0, x[:100])) <= 1e-5


class Scripted(pb_grpc.MoeServiceServicer):
    """A fake service for the retry policy alone: Forward fails with the scripted codes, then
    echoes its input; GetModelInfo describes a 4-wide layer 0."""

    def __init__(self, codes, sleep=0.0):
        self.codes, self.sleep, self.calls = list(codes), sleep, 0

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(hidden_size=4, moe_layers=[0], top_k=1, max_request_bytes=1 << 20,
                            max_tokens_per_step=256)

    def Forward(self, request, context):
        self.calls += 1
        time.sleep(self.sleep)
        if self.codes:
            context.abort(self.codes.pop(0), "scripted")
        return pb.ForwardResponse(id=request.id, output=request.hidden_states)


@pytest.mark.parametrize("codes,retries,calls,raised", [
    ([grpc.StatusCode.UNAVAILABLE] * 2, 4, 3, None),
    ([grpc.StatusCode.UNAVAILABLE] * 9, 3, 4, grpc.StatusCode.UNAVAILABLE),
    ([grpc.StatusCode.INVALID_ARGUMENT], 4, 1, grpc.StatusCode.INVALID_ARGUMENT),
    ([grpc.StatusCode.RESOURCE_EXHAUSTED], 4, 1, grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_only_unavailable_is_retried(codes, retries, calls, raised):
    fake = Scripted(codes)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_MoeServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        with epserve.Client(f"127.0.0.1:{port}", retries=retries, backoff=0.01) as c:
            if raised is None:
                assert np.array_equal(c.forward(x, 0), x)
            else:
                with pytest.raises(epserve.EpserveError) as e:
                    c.forward(x, 0)
                assert e.value.code == raised
        assert fake.calls == calls
    finally:
        server.stop(0)


def test_retries_stop_at_the_deadline():
    fake = Scripted([grpc.StatusCode.UNAVAILABLE] * 100)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_MoeServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with epserve.Client(f"127.0.0.1:{port}", retries=100, backoff=0.05, max_backoff=0.2) as c:
            t = time.monotonic()
            with pytest.raises(epserve.EpserveError) as e:
                c.forward(np.zeros((1, 4), np.float32), 0, timeout=0.6)
            took = time.monotonic() - t
        assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        # Bounded by the deadline (0.6 s), with room for a busy 2-core CI machine; unbounded
        # retries would take 100 x 0.1-0.2 s.
        assert took < 1.5 and 2 <= fake.calls < 100, (took, fake.calls)
        # A slow answer past the deadline is DEADLINE_EXCEEDED, not retried.
        fake.codes, fake.sleep, fake.calls = [], 1.0, 0
        with epserve.Client(f"127.0.0.1:{port}") as c:
            with pytest.raises(epserve.EpserveError) as e:
                c.forward(np.zeros((1, 4), np.float32), 0, timeout=0.3)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and fake.calls == 1
    finally:
        server.stop(0)


def test_a_restarted_service_costs_no_call(checkpoints):
    """The client made before the service is up waits for it; the service stopped and started
    again on its port under a steady load of calls: every call is answered, and correctly."""
    _, d = checkpoints["mixtral"]
    model = Mixtral64(d)
    listen = f"127.0.0.1:{free_port()}"
    made = {}
    t = threading.Thread(target=lambda: made.update(c=epserve.Client(listen, retries=60, max_backoff=0.25)))
    t.start()
    time.sleep(0.5)
    s = Service("--model", d, "--ranks", "2", listen=listen)
    t.join(30)
    c = made["c"]
    # A call crossed the outage if it began while the service was going down or away, or if it
    # was in flight when the old process had exited (`outages` bumps once s.stop() returns).
    down, during, answered, failures, outages = threading.Event(), [], [0], [], [0]
    stop = threading.Event()

    def load():
        k = 0
        while not stop.is_set():
            x = rand(16, 1000 + k)
            was_down, seen = down.is_set(), outages[0]
            try:
                y = c.forward(x, k % 2, timeout=60)
                assert worst(y, reference(model, k % 2, x)) <= 1e-5
                answered[0] += 1
                during.append(was_down or outages[0] != seen)
            except Exception as e:  # counted, reported below
                failures.append(repr(e))
            k += 1

    loader = threading.Thread(target=load)
    loader.start()
    try:
        time.sleep(1.0)
        down.set()
        s.stop()
        outages[0] += 1
        s = Service("--model", d, "--ranks", "2", listen=listen)
        time.sleep(0.5)
        down.clear()
        time.sleep(1.0)
    finally:
        stop.set()
        loader.join(120)
        c.close()
        s.stop()
    assert not failures, failures[:3]
    assert any(during), "no call began or was in flight while the service was down"
    assert answered[0] > 10


def test_shared_memory(mixtral, checkpoints):
    model, s = mixtral
    x = rand(3_000, 7)
    with epserve.Client(s.addr) as wire, epserve.Client(s.addr, shared_memory="system") as c:
        assert c.shared_memory
        names = [n for n in os.listdir("/dev/shm") if n.startswith(f"{SHM_PREFIX}{os.getpid()}-")]
        assert len(names) == 2, names
        y = c.forward(x, 0)
        assert worst(y, reference(model, 0, x)) <= 1e-5 and worst(y, wire.forward(x, 0)) <= 1e-6
        # A larger request grows the regions; bf16 and client routing go the same way.
        big = rand(30_000, 8)
        assert worst(c.forward(big, 1), reference(model, 1, big)) <= 1e-5
        xb = rand(700, 9, torch.bfloat16)
        assert c.forward(xb, 1).dtype == torch.bfloat16
        assert worst(c.forward(xb, 1), reference(model, 1, xb)) <= 1e-2
        ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(64)])
        w = torch.rand(64, 2, generator=torch.Generator().manual_seed(10))
        xr = rand(64, 11)
        assert worst(c.forward(xr, 0, topk_ids=ids, topk_weights=w), reference(model, 0, xr, ids, w)) <= 1e-5
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"{SHM_PREFIX}{os.getpid()}-")]
    assert left == [], f"regions left behind: {left}"
    # A service that does not allow it: "auto" falls back to the wire, "system" refuses.
    _, d = checkpoints["mixtral"]
    plain = Service("--model", d, "--ranks", "1")
    try:
        with epserve.Client(plain.addr, shared_memory="auto") as c:
            assert not c.shared_memory
            assert worst(c.forward(x, 0), reference(model, 0, x)) <= 1e-5
        with pytest.raises(epserve.EpserveError) as e:
            epserve.Client(plain.addr, shared_memory="system")
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        plain.stop()
