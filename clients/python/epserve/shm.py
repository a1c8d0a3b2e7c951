"""System shared memory for a co-located client: two POSIX regions in /dev/shm (the request's
tensors, the answer), registered with the service through KServe v2's shared-memory API and used
by ModelInfer on `layer-<L>`, which takes any float type and answers in it. The tensors skip
the message (protobuf encoding, the socket, grpcio's buffers): one copy in, one copy out.

The service must allow it (`--allow-client-shm`, regions under `--shm-regions-prefix`); a region
grows (re-registered at the next power of two) when a request needs more. One request at a time
uses a client's regions; others wait for them."""

import itertools
import mmap
import os
import threading

import grpc
import numpy as np

from . import tensors
from ._proto import inference_pb2 as kpb
from ._proto import inference_pb2_grpc as kpb_grpc

DIR = "/dev/shm"
_SEQ = itertools.count()


def _align(n, a=64):
    return (n + a - 1) // a * a


class Region:
    """A file in /dev/shm, mapped, unlinked when closed."""

    def __init__(self, name, size):
        self.name, self.size = name, size
        self.path = os.path.join(DIR, name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)

    def close(self):
        self.map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SystemRegions:
    def __init__(self, client, prefix):
        self.client, self.prefix = client, prefix
        self.stub = kpb_grpc.GRPCInferenceServiceStub(client.channel)
        self.lock = threading.Lock()
        self.regions = {"in": None, "out": None}

    @classmethod
    def open(cls, client, prefix, required):
        """Regions registered with the service, or None where it refuses them and not `required`."""
        s = cls(client, prefix)
        try:
            s._ensure("in", 1 << 20)
            s._ensure("out", 1 << 20)
        except grpc.RpcError as e:
            s.close()
            if required:
                raise tensors_error(e, "the service does not take client shared memory") from None
            return None
        return s

    def _region_name(self, which):
        return f"{self.prefix}{os.getpid()}-{next(_SEQ)}-{which}"

    def _ensure(self, which, size):
        """The region `which`, at least `size` bytes, registered."""
        r = self.regions[which]
        if r is not None and r.size >= size:
            return r
        if r is not None:
            self._unregister(which)
        grown = 1 << max(20, (size - 1).bit_length())
        r = Region(self._region_name(which), grown)
        self.regions[which] = r
        self.stub.SystemSharedMemoryRegister(
            kpb.SystemSharedMemoryRegisterRequest(name=r.name, key="/" + r.name, offset=0, byte_size=r.size),
            timeout=self.client.timeout)
        return r

    def _unregister(self, which):
        r = self.regions[which]
        self.regions[which] = None
        if r is None:
            return
        try:
            self.stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest(name=r.name),
                                                   timeout=min(5.0, self.client.timeout))
        except grpc.RpcError:
            pass  # the service gone: nothing holds the name there
        finally:
            r.close()

    def close(self):
        for which in ("in", "out"):
            self._unregister(which)

    def forward(self, x, layer, topk_ids, topk_weights, deadline):
        name = tensors.dtype_name(x)
        parts = [("hidden_states", x)]
        if topk_ids is not None:
            parts += [("topk_ids", topk_ids), ("topk_weights", topk_weights)]
        views = [(n, t, tensors.byte_view(t)) for n, t in parts]
        offsets, end = [], 0
        for _, _, v in views:
            offsets.append(end)
            end = _align(end + v.nbytes)
        out_bytes = x.shape[0] * x.shape[1] * tensors.WIRE[name][2]
        with self.lock:
            rin, rout = self._ensure("in", end), self._ensure("out", out_bytes)
            buf = np.frombuffer(rin.map, np.uint8)
            request = kpb.ModelInferRequest(model_name=f"layer-{layer}")
            for (n, t, v), off in zip(views, offsets):
                buf[off:off + v.nbytes] = v
                i = request.inputs.add(name=n, datatype=tensors.WIRE[tensors.dtype_name(t)][1], shape=list(t.shape))
                i.parameters["shared_memory_region"].string_param = rin.name
                i.parameters["shared_memory_offset"].int64_param = off
                i.parameters["shared_memory_byte_size"].int64_param = v.nbytes
            o = request.outputs.add(name="output")
            o.parameters["shared_memory_region"].string_param = rout.name
            o.parameters["shared_memory_byte_size"].int64_param = out_bytes
            answer = self.client._call(self.stub.ModelInfer, request, None, deadline)
            got = answer.outputs[0]
            if got.datatype != tensors.WIRE[name][1] or list(got.shape) != list(x.shape):
                raise ValueError(f"answer {got.datatype} {list(got.shape)} where {name} {list(x.shape)} was asked")
            # The region is reused by the next request: the answer is copied out of it.
            data = bytearray(np.frombuffer(rout.map, np.uint8, out_bytes))
        return tensors.from_buffer(data, name, list(x.shape), x)


def tensors_error(e, what):
    from .client import EpserveError

    return EpserveError(e.code(), f"{what}: {e.details()}")
