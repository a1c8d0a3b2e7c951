"""epserve's Python client: call MoE layers served by epserve from a model.

    import epserve
    c = epserve.Client("127.0.0.1:50051")
    y = c.forward(x, layer=0)                   # x: [tokens, hidden], torch or numpy

    model = epserve.offload_moe(model, "127.0.0.1:50051")   # a transformers model's MoE blocks
"""

from .client import Client
from .errors import EpserveError

__all__ = ["Client", "EpserveError", "EpserveMoE", "offload_moe"]


def __getattr__(name):
    # torch is optional: the module-level names that need it load it when first used.
    if name in ("EpserveMoE", "offload_moe"):
        from . import moe

        return getattr(moe, name)
    raise AttributeError(name)
