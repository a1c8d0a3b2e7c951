"""Tensors on the wire: torch tensors and numpy arrays to epserve.v1 / KServe v2 bytes and back.

Sending copies a tensor's bytes once (into the message, or into a shared-memory region); an
answer comes back as a tensor over the answer's own buffer, not a copy of it."""

import warnings

import numpy as np

from ._proto import epserve_pb2 as pb

try:
    import torch
except ImportError:  # the client works on numpy arrays without torch
    torch = None

try:
    import ml_dtypes

    _NP_BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    _NP_BF16 = None

# (epserve.v1 DType, KServe v2 datatype, bytes per element) by name.
WIRE = {
    "bfloat16": (pb.BF16, "BF16", 2),
    "float16": (pb.F16, "FP16", 2),
    "float32": (pb.F32, "FP32", 4),
    "int32": (pb.I32, "INT32", 4),
    "int64": (pb.I64, "INT64", 8),
}
_BY_ENUM = {v[0]: k for k, v in WIRE.items()}
_BY_KSERVE = {v[1]: k for k, v in WIRE.items()}


def _np_dtype(name):
    if name == "bfloat16":
        if _NP_BF16 is None:
            raise TypeError("bfloat16 as numpy needs ml_dtypes (pip install ml_dtypes), or pass a torch tensor")
        return _NP_BF16
    return np.dtype(name)


def dtype_name(x):
    """'bfloat16', 'float16', 'float32', 'int32' or 'int64' for a tensor or array."""
    if torch is not None and isinstance(x, torch.Tensor):
        name = str(x.dtype).removeprefix("torch.")
    elif isinstance(x, np.ndarray):
        name = "bfloat16" if _NP_BF16 is not None and x.dtype == _NP_BF16 else x.dtype.name
    else:
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if name not in WIRE:
        raise TypeError(f"dtype {name} is not sent (one of {', '.join(WIRE)})")
    return name


def byte_view(x):
    """A flat uint8 numpy view of the tensor's bytes: no copy for a contiguous CPU tensor (a copy
    to make it contiguous or to bring it from a GPU otherwise)."""
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.contiguous()
        if x.numel() == 0:
            return np.zeros(0, np.uint8)
        return x.reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def to_proto(x):
    """An epserve.v1 Tensor holding `x`."""
    name = dtype_name(x)
    return pb.Tensor(dtype=WIRE[name][0], shape=list(x.shape), data=byte_view(x).tobytes())


def from_buffer(buf, name, shape, like):
    """A tensor of `like`'s kind (torch or numpy) over `buf` (no copy)."""
    if torch is not None and isinstance(like, torch.Tensor):
        if len(buf) == 0:
            return torch.zeros(shape, dtype=getattr(torch, name))
        with warnings.catch_warnings():
            # A tensor over an answer's bytes: the answer is ours alone, nothing else reads it.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buf, dtype=getattr(torch, name)).reshape(shape)
    return np.frombuffer(buf, _np_dtype(name)).reshape(shape)


def from_proto(t, like):
    """`t` (an epserve.v1 Tensor) as a tensor of `like`'s kind."""
    if t.dtype not in _BY_ENUM:
        raise ValueError(f"answer has dtype {t.dtype}, which this client does not know")
    return from_buffer(t.data, _BY_ENUM[t.dtype], list(t.shape), like)


def name_of_kserve(datatype):
    return _BY_KSERVE[datatype]
