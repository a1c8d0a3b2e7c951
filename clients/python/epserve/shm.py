"""Shared memory for a co-located client, over KServe v2's shared-memory API and ModelInfer on
`layer-<L>` (which takes any float type and answers in it); the tensors skip the message
(protobuf encoding, the socket, grpcio's buffers). System memory (`SystemRegions`): two POSIX
regions in /dev/shm, one copy in, one copy out. CUDA memory (`CudaRegions`, for torch tensors on
a GPU): two device buffers this process allocates, registered by CUDA IPC handle; the service's
GPU rank reads and writes them, and the tensors never touch the host.

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
from .errors import EpserveError
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
    """Two /dev/shm regions, registered."""

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
        views = [(n, t, tensors.byte_view(t)) for n, t in parts(x, topk_ids, topk_weights)]
        offsets, end = layout([v.nbytes for _, _, v in views])
        out_bytes = answer_bytes(x)
        with self.lock:
            rin, rout = self._ensure("in", end), self._ensure("out", out_bytes)
            buf = np.frombuffer(rin.map, np.uint8)
            for (_, _, v), off in zip(views, offsets):
                buf[off:off + v.nbytes] = v
            infer(self.client, self.stub, layer, x, [(n, t) for n, t, _ in views], (rin.name, 0, offsets),
                  (rout.name, 0, out_bytes), deadline)
            # The region is reused by the next request: the answer is copied out of it.
            data = bytearray(np.frombuffer(rout.map, np.uint8, out_bytes))
        return tensors.from_buffer(data, tensors.dtype_name(x), list(x.shape), x)


class CudaRegions:
    """Two device buffers on one GPU, registered by IPC handle. torch's caching allocator may
    place a buffer inside a larger allocation: the handle names the allocation, so the region is
    registered from its start and the buffer addressed at its offset in it."""

    def __init__(self, client, device):
        import torch

        self.torch, self.client, self.device = torch, client, device
        self.stub = kpb_grpc.GRPCInferenceServiceStub(client.channel)
        self.lock = threading.Lock()
        self.regions = {"in": None, "out": None}

    @classmethod
    def open(cls, client, device, required):
        s = cls(client, device)
        try:
            s._ensure("in", 1 << 20)
            s._ensure("out", 1 << 20)
        except grpc.RpcError as e:
            s.close()
            if required:
                raise tensors_error(e, "the service does not take client CUDA shared memory") from None
            return None
        return s

    def _ensure(self, which, size):
        """(name, buffer, offset of the buffer in its registered region), at least `size` bytes."""
        r = self.regions[which]
        if r is not None and r[1].numel() >= size:
            return r
        if r is not None:
            self._unregister(which)
        grown = 1 << max(20, (size - 1).bit_length())
        buf = self.torch.empty(grown, dtype=self.torch.uint8, device=self.device)
        _, handle, _, offset = buf.untyped_storage()._share_cuda_()[:4]
        handle = _ipc_handle(handle)
        name = f"epserve-cuda-{os.getpid()}-{next(_SEQ)}-{which}"
        self.regions[which] = (name, buf, offset)
        self.stub.CudaSharedMemoryRegister(
            kpb.CudaSharedMemoryRegisterRequest(name=name, raw_handle=handle, device_id=buf.device.index,
                                                byte_size=offset + grown),
            timeout=self.client.timeout)
        return self.regions[which]

    def _unregister(self, which):
        r = self.regions[which]
        self.regions[which] = None
        if r is None:
            return
        try:
            self.stub.CudaSharedMemoryUnregister(kpb.CudaSharedMemoryUnregisterRequest(name=r[0]),
                                                 timeout=min(5.0, self.client.timeout))
        except grpc.RpcError:
            pass

    def close(self):
        for which in ("in", "out"):
            self._unregister(which)

    def forward(self, x, layer, topk_ids, topk_weights, deadline):
        torch = self.torch
        items = [(n, t.detach().to(self.device).contiguous()) for n, t in parts(x, topk_ids, topk_weights)]
        sizes = [t.numel() * t.element_size() for _, t in items]
        offsets, end = layout(sizes)
        out_bytes = answer_bytes(x)
        with self.lock:
            (nin, bin_, oin), (nout, bout, oout) = self._ensure("in", end), self._ensure("out", out_bytes)
            for (_, t), off, n in zip(items, offsets, sizes):
                bin_[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            # The service reads the region on its own stream: our copies must have landed.
            torch.cuda.synchronize(self.device)
            infer(self.client, self.stub, layer, x, items, (nin, oin, offsets), (nout, oout, out_bytes), deadline)
            out = bout[:out_bytes].clone()
        return out.view(x.dtype).reshape(x.shape)


# torch prefixes the 64-byte cudaIpcMemHandle_t with its own bytes (a version, then the kind of
# allocation: b"c" for cudaMalloc); only cudaMalloc'd memory has an IPC handle of its own.
_IPC_HANDLE = 64


def _ipc_handle(shared):
    if len(shared) == _IPC_HANDLE:
        return shared
    if len(shared) > _IPC_HANDLE and shared[-_IPC_HANDLE - 1:-_IPC_HANDLE] == b"c":
        return shared[-_IPC_HANDLE:]
    raise ValueError("torch's allocation has no CUDA IPC handle of its own (expandable segments?): "
                     "run without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or shared_memory='system'")


def parts(x, topk_ids, topk_weights):
    p = [("hidden_states", x)]
    if topk_ids is not None:
        p += [("topk_ids", topk_ids), ("topk_weights", topk_weights)]
    return p


def layout(sizes):
    """Each tensor's offset in a region (64-byte aligned), and the bytes the region needs."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end = _align(end + n)
    return offsets, end


def answer_bytes(x):
    return x.shape[0] * x.shape[1] * tensors.WIRE[tensors.dtype_name(x)][2]


def infer(client, stub, layer, x, items, into, out, deadline):
    """ModelInfer of `items` (name, tensor) at `into` = (region, base offset, each offset), the
    answer into `out` = (region, base offset, bytes); checks the answer's type and shape."""
    (rin, base, offsets), (rout, obase, out_bytes) = into, out
    request = kpb.ModelInferRequest(model_name=f"layer-{layer}")
    for (n, t), off in zip(items, offsets):
        nbytes = t.shape[0] * t.shape[1] * tensors.WIRE[tensors.dtype_name(t)][2]
        i = request.inputs.add(name=n, datatype=tensors.WIRE[tensors.dtype_name(t)][1], shape=list(t.shape))
        i.parameters["shared_memory_region"].string_param = rin
        i.parameters["shared_memory_offset"].int64_param = base + off
        i.parameters["shared_memory_byte_size"].int64_param = nbytes
    o = request.outputs.add(name="output")
    o.parameters["shared_memory_region"].string_param = rout
    o.parameters["shared_memory_offset"].int64_param = obase
    o.parameters["shared_memory_byte_size"].int64_param = out_bytes
    answer = client._call(stub.ModelInfer, request, None, deadline)
    got, name = answer.outputs[0], tensors.dtype_name(x)
    if got.datatype != tensors.WIRE[name][1] or list(got.shape) != list(x.shape):
        raise ValueError(f"answer {got.datatype} {list(got.shape)} where {name} {list(x.shape)} was asked")


def tensors_error(e, what):
    return EpserveError(e.code(), f"{what}: {e.details()}")
