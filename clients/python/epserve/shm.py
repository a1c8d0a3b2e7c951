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


class _Regions:
    """Two regions ("in": the request's tensors, "out": the answer), registered with the service
    and grown (re-registered at the next power of two, 1 MiB at least) when a request needs more;
    one request at a time uses them. A kind of memory says how a region is made (`_make`), named
    to the service (`_register`, `_unregister`) and let go (`_free`)."""

    WHAT = "shared memory"

    def __init__(self, client):
        self.client = client
        self.stub = kpb_grpc.GRPCInferenceServiceStub(client.channel)
        self.lock = threading.Lock()
        self.regions = {"in": None, "out": None}

    @classmethod
    def open(cls, client, *args, required):
        """Regions registered with the service, or None where it refuses them and not `required`."""
        s = cls(client, *args)
        try:
            s._ensure("in", 1 << 20)
            s._ensure("out", 1 << 20)
        except grpc.RpcError as e:
            s.close()
            if required:
                raise EpserveError(e.code(), f"the service does not take client {cls.WHAT}: {e.details()}") from None
            return None
        return s

    def _name(self, which):
        return f"{self.prefix}{os.getpid()}-{next(_SEQ)}-{which}"

    def _ensure(self, which, size):
        """The region `which`, at least `size` bytes, registered."""
        r = self.regions[which]
        if r is not None and r.size >= size:
            return r
        self._drop(which)
        r = self._make(which, 1 << max(20, (size - 1).bit_length()))
        self.regions[which] = r
        self._register(r)
        return r

    def _drop(self, which):
        r, self.regions[which] = self.regions[which], None
        if r is None:
            return
        try:
            self._unregister(r)
        except grpc.RpcError:
            pass  # the service gone: nothing holds the name there
        finally:
            self._free(r)

    def close(self):
        for which in ("in", "out"):
            self._drop(which)

    def _free(self, r):
        pass


class SystemRegions(_Regions):
    """Two /dev/shm regions."""

    def __init__(self, client, prefix):
        super().__init__(client)
        self.prefix = prefix

    def _make(self, which, size):
        return Region(self._name(which), size)

    def _register(self, r):
        self.stub.SystemSharedMemoryRegister(
            kpb.SystemSharedMemoryRegisterRequest(name=r.name, key="/" + r.name, offset=0, byte_size=r.size),
            timeout=self.client.timeout)

    def _unregister(self, r):
        self.stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest(name=r.name),
                                               timeout=min(5.0, self.client.timeout))

    def _free(self, r):
        r.close()

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


class DeviceRegion:
    """A device buffer, and where it starts in the allocation its IPC handle names."""

    def __init__(self, name, buf, offset, handle):
        self.name, self.buf, self.offset, self.handle = name, buf, offset, handle
        self.size = buf.numel()


class CudaRegions(_Regions):
    """Two device buffers on one GPU, registered by IPC handle. torch's caching allocator may
    place a buffer inside a larger allocation: the handle names the allocation, so the region is
    registered from its start and the buffer addressed at its offset in it."""

    WHAT = "CUDA shared memory"

    def __init__(self, client, device):
        import torch

        super().__init__(client)
        self.torch, self.device, self.prefix = torch, device, "epserve-cuda-"

    def _make(self, which, size):
        buf = self.torch.empty(size, dtype=self.torch.uint8, device=self.device)
        _, handle, _, offset = buf.untyped_storage()._share_cuda_()[:4]
        return DeviceRegion(self._name(which), buf, offset, _ipc_handle(handle))

    def _register(self, r):
        self.stub.CudaSharedMemoryRegister(
            kpb.CudaSharedMemoryRegisterRequest(name=r.name, raw_handle=r.handle, device_id=r.buf.device.index,
                                                byte_size=r.offset + r.size),
            timeout=self.client.timeout)

    def _unregister(self, r):
        self.stub.CudaSharedMemoryUnregister(kpb.CudaSharedMemoryUnregisterRequest(name=r.name),
                                             timeout=min(5.0, self.client.timeout))

    def forward(self, x, layer, topk_ids, topk_weights, deadline):
        torch = self.torch
        items = [(n, t.detach().to(self.device).contiguous()) for n, t in parts(x, topk_ids, topk_weights)]
        sizes = [t.numel() * t.element_size() for _, t in items]
        offsets, end = layout(sizes)
        out_bytes = answer_bytes(x)
        with self.lock:
            rin, rout = self._ensure("in", end), self._ensure("out", out_bytes)
            for (_, t), off, n in zip(items, offsets, sizes):
                rin.buf[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            # The service reads the region on its own stream: our copies must have landed.
            torch.cuda.synchronize(self.device)
            infer(self.client, self.stub, layer, x, items, (rin.name, rin.offset, offsets),
                  (rout.name, rout.offset, out_bytes), deadline)
            out = rout.buf[:out_bytes].clone()
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
