"""`Client`: epserve.v1 over grpcio, with what a model runner needs around it.

- Message limits come from the service: GetModelInfo says the largest request it takes
  (`max_request_bytes`); the channel's receive limit is set from it (grpcio's default of 4 MiB
  would refuse a DeepSeek-V3 answer of ~300 tokens), and a larger batch is sent as several
  requests, in flight together, its answer put back in order.
- Deadlines: every call has one (`timeout`, the Client's by default); retries never pass it.
- Retries: only UNAVAILABLE (the service not reachable, or restarting), with exponential backoff
  and jitter, at most `retries` times. Forward is a pure function, so a retry is safe. The
  channel reconnects on the same schedule: grpcio's own (1 s growing to 120 s) would leave a
  restarted service unreached for seconds after it is back, every retry failing meanwhile.
- Shared memory (`shared_memory="system"`, `"cuda"` or `"auto"`): on the same host, the tensors go
  through POSIX shared memory, or for torch tensors on a GPU through CUDA memory, over KServe v2
  instead of the message (see `shm.py`)."""

import collections
import queue
import random
import threading
import time

import grpc

from . import tensors
from .errors import EpserveError
from ._proto import epserve_pb2 as pb
from ._proto import epserve_pb2_grpc as pb_grpc

# What a request carries beside its tensors' bytes (id, shapes, framing), kept free of the limit.
OVERHEAD = 64 << 10
# A service that predates max_request_bytes in ModelInfo takes this (its default).
DEFAULT_LIMIT = 64 << 20
# Pieces of one large forward in flight at once: at most WINDOW, and no more than QUEUED steps'
# worth of tokens (the service refuses what its queue, --max-queued-tokens, cannot hold).
WINDOW = 4
QUEUED = 8


def _error(e):
    return EpserveError(e.code(), e.details())


class Client:
    """A connection to an epserve service (`host:port`).

    `timeout`: seconds each call may take, retries included (a call's own `timeout` overrides).
    `retries`, `backoff`, `max_backoff`: UNAVAILABLE is tried again up to `retries` times, after
    `backoff * 2**attempt` seconds (at most `max_backoff`, jittered down to half).
    `shared_memory`: "off", "system" (tensors through /dev/shm; the service must run with
    --allow-client-shm on this host), "cuda" (torch tensors on a GPU through CUDA IPC memory, the
    answer a tensor on that GPU; others through /dev/shm) or "auto" (each where the service allows
    it, else the wire).
    """

    def __init__(self, target, *, timeout=60.0, retries=4, backoff=0.05, max_backoff=2.0,
                 shared_memory="off", shm_prefix="epserve-client-", channel_options=()):
        if shared_memory not in ("off", "system", "cuda", "auto"):
            raise ValueError(f"shared_memory={shared_memory!r}: one of 'off', 'system', 'cuda', 'auto'")
        self.target, self.timeout = target, timeout
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self._options = list(channel_options)
        given = {k for k, _ in self._options}
        reconnect = {"grpc.initial_reconnect_backoff_ms": backoff,
                     "grpc.max_reconnect_backoff_ms": max_backoff}
        self._options += [(k, max(1, int(s * 1000))) for k, s in reconnect.items() if k not in given]
        # GetModelInfo is small: grpcio's defaults read it; the service's limits then size the channel.
        boot = grpc.insecure_channel(target, options=self._options)
        try:
            self.info = self._call(pb_grpc.MoeServiceStub(boot).GetModelInfo, pb.GetModelInfoRequest(), None)
        finally:
            boot.close()
        self.max_request_bytes = self.info.max_request_bytes or DEFAULT_LIMIT
        # An answer in f32 to a 16-bit request is twice the request.
        receive = 2 * self.max_request_bytes + OVERHEAD
        self.channel = grpc.insecure_channel(target, options=self._options + [
            ("grpc.max_receive_message_length", receive),
            ("grpc.max_send_message_length", self.max_request_bytes),
        ])
        self._stub = pb_grpc.MoeServiceStub(self.channel)
        self._shm, self._cuda, self._mode = None, {}, shared_memory
        if shared_memory != "off":
            from .shm import SystemRegions

            self._shm = SystemRegions.open(self, shm_prefix, required=shared_memory in ("system", "cuda"))

    # -- lifecycle

    def close(self):
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        for regions in self._cuda.values():
            if regions is not None:
                regions.close()
        self._cuda = {}
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def shared_memory(self):
        """Whether tensors in host memory go through shared memory."""
        return self._shm is not None

    def _cuda_regions(self, x):
        """The CUDA regions of `x`'s GPU (made at its first tensor there), or None: not asked
        for, not a GPU tensor, or (auto) refused by the service."""
        if self._mode not in ("cuda", "auto") or tensors.torch is None:
            return None
        if not (isinstance(x, tensors.torch.Tensor) and x.is_cuda):
            return None
        if x.device not in self._cuda:
            from .shm import CudaRegions

            self._cuda[x.device] = CudaRegions.open(self, x.device, required=self._mode == "cuda")
        return self._cuda[x.device]

    # -- calls

    def _deadline(self, timeout):
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _pause(self, attempt, deadline, e):
        """Sleeps before retry `attempt + 1` of a call that failed with `e`, or raises it."""
        if e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
            raise _error(e) from None
        pause = min(self.max_backoff, self.backoff * 2 ** attempt) * random.uniform(0.5, 1.0)
        if time.monotonic() + pause >= deadline:
            raise EpserveError(e.code(), f"{e.details()} (after {attempt + 1} attempts; "
                                         "another would pass the deadline)") from None
        time.sleep(pause)

    def _call(self, method, request, timeout, deadline=None):
        """`method(request)` with retries, by the deadline."""
        deadline = deadline or self._deadline(timeout)
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EpserveError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the call")
            try:
                return method(request, timeout=left)
            except grpc.RpcError as e:
                self._pause(attempt, deadline, e)
                attempt += 1

    def _call_many(self, method, requests, deadline, window):
        """Every request's answer, in order; up to `window` in flight, each retried as `_call` does."""
        answers, attempts = [None] * len(requests), [0] * len(requests)
        waiting, done, flying = collections.deque(range(len(requests))), queue.Queue(), {}
        try:
            while waiting or flying:
                while waiting and len(flying) < window:
                    i = waiting.popleft()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise EpserveError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                    f = method.future(requests[i], timeout=left)
                    flying[i] = f
                    f.add_done_callback(lambda f, i=i: done.put(i))
                i = done.get()
                f = flying.pop(i)
                try:
                    answers[i] = f.result()
                except grpc.RpcError as e:
                    self._pause(attempts[i], deadline, e)
                    attempts[i] += 1
                    waiting.appendleft(i)
        finally:
            for f in flying.values():
                f.cancel()
        return answers

    def model_info(self):
        """GetModelInfo, now (the placement and its epoch change as the balancer moves experts)."""
        return self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), None)

    def probe(self, timeout=None):
        """Seconds for one token through the queue and a step on every rank."""
        return self._call(self._stub.Probe, pb.ProbeRequest(), timeout).seconds

    def _check(self, x, layer, topk_ids, topk_weights):
        if layer not in self.info.moe_layers:
            raise ValueError(f"layer {layer} is not served (MoE layers: {list(self.info.moe_layers)})")
        if len(x.shape) != 2 or x.shape[1] != self.info.hidden_size:
            raise ValueError(f"hidden states of shape {tuple(x.shape)}: expected (tokens, {self.info.hidden_size})")
        if (topk_ids is None) != (topk_weights is None):
            raise ValueError("topk_ids and topk_weights go together")
        for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if t is not None and tuple(t.shape) != (x.shape[0], self.info.top_k):
                raise ValueError(f"{name} of shape {tuple(t.shape)}: expected ({x.shape[0]}, {self.info.top_k})")

    def rows_per_request(self, x, topk_ids=None, topk_weights=None):
        """Most tokens of `x` one request carries under the service's message limit."""
        row = sum(t.shape[1] * tensors.WIRE[tensors.dtype_name(t)][2]
                  for t in (x, topk_ids, topk_weights) if t is not None)
        return max(1, (self.max_request_bytes - OVERHEAD) // row)

    def forward(self, hidden_states, layer, *, topk_ids=None, topk_weights=None, output_dtype=None,
                timeout=None):
        """The MoE layer `layer` on `hidden_states` [tokens, hidden] (torch or numpy; bf16, f16 or
        f32): its output without the residual, as a tensor of the same kind, in `output_dtype`
        (default: the input's). Optional client routing: `topk_ids` [tokens, top_k] (int32 or
        int64) with `topk_weights` (float). Any number of tokens: a batch over the service's
        message limit goes as several requests."""
        x = hidden_states
        self._check(x, layer, topk_ids, topk_weights)
        out_name = tensors.dtype_name(x) if output_dtype is None else _dtype_name(output_dtype)
        n = x.shape[0]
        if n == 0:
            return tensors.from_buffer(b"", out_name, [0, self.info.hidden_size], x)
        deadline = self._deadline(timeout)
        if out_name == tensors.dtype_name(x) and n <= self.rows_per_request(x, topk_ids, topk_weights):
            cuda = self._cuda_regions(x)
            if cuda is not None:
                return cuda.forward(x, layer, topk_ids, topk_weights, deadline)
            if self._shm is not None:
                return self._shm.forward(x, layer, topk_ids, topk_weights, deadline)
        rows = self.rows_per_request(x, topk_ids, topk_weights)
        out_dtype = tensors.WIRE[out_name][0]
        requests = []
        for k, start in enumerate(range(0, n, rows)):
            part = slice(start, min(n, start + rows))
            r = pb.ForwardRequest(id=str(k), layer=layer, hidden_states=tensors.to_proto(x[part]),
                                  output_dtype=out_dtype if output_dtype is not None else pb.DTYPE_UNSPECIFIED)
            if topk_ids is not None:
                r.topk_ids.CopyFrom(tensors.to_proto(topk_ids[part]))
                r.topk_weights.CopyFrom(tensors.to_proto(topk_weights[part]))
            requests.append(r)
        if len(requests) == 1:
            return tensors.from_proto(self._call(self._stub.Forward, requests[0], None, deadline).output, x)
        window = max(1, min(WINDOW, QUEUED * self.info.max_tokens_per_step // rows))
        answers = self._call_many(self._stub.Forward, requests, deadline, window)
        outs = [tensors.from_proto(a.output, x) for a in answers]
        return _concat(outs)

    def stream(self, items, *, timeout=None):
        """Many forwards on one ForwardStream: `items` yields `(layer, hidden_states)` pairs (each
        within the message limit); the outputs come back in the items' order, each as soon as it
        and those before it are answered. A failed item raises EpserveError where it falls. No
        retries: the stream's deadline (`timeout`) covers all of it."""
        likes, bad = {}, []

        def requests():
            for k, (layer, x) in enumerate(items):
                try:
                    self._check(x, layer, None, None)
                    r = pb.ForwardRequest(id=str(k), layer=layer, hidden_states=tensors.to_proto(x))
                except Exception as e:  # grpcio would log it and fail the call UNKNOWN
                    bad.append(e)
                    return
                likes[str(k)] = x
                yield r

        deadline = self._deadline(timeout)
        call = self._stub.ForwardStream(requests(), timeout=max(0.0, deadline - time.monotonic()))
        held, nxt = {}, 0
        try:
            for r in call:
                held[r.id] = r
                while str(nxt) in held:
                    a = held.pop(str(nxt))
                    if a.HasField("error") and a.error.code != 0:
                        raise EpserveError(_status(a.error.code), a.error.message)
                    yield tensors.from_proto(a.output, likes.pop(str(nxt)))
                    nxt += 1
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()
        if bad:
            raise bad[0]
        if likes:
            raise EpserveError(grpc.StatusCode.INTERNAL, f"the stream ended with {len(likes)} items unanswered")


def _status(n):
    """The grpc.StatusCode of a google.rpc.Code number."""
    return next((c for c in grpc.StatusCode if c.value[0] == n), grpc.StatusCode.UNKNOWN)


def _dtype_name(d):
    s = str(d).removeprefix("torch.")
    s = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16", "half": "float16", "f32": "float32",
         "fp32": "float32", "float": "float32"}.get(s, s)
    if s not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"output_dtype {d}: one of bfloat16, float16, float32")
    return s


def _concat(parts):
    if tensors.torch is not None and isinstance(parts[0], tensors.torch.Tensor):
        return tensors.torch.cat(parts)
    import numpy as np

    return np.concatenate(parts)
