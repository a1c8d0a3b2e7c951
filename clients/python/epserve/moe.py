"""A transformers model's MoE blocks served by epserve: `EpserveMoE` stands in for one block
(`model.model.layers[i].mlp`) and sends its hidden states to the service's layer `i`;
`offload_moe` swaps every MoE block of a model (dense layers stay local).

The service returns what the Hugging Face block returns (routed experts plus shared ones,
without the residual), so the decoder layer around it is unchanged. Inference only: no
gradient flows through the service. Needs transformers 5 (its MoE blocks return the hidden
states alone)."""

import torch

from .client import Client


class EpserveMoE(torch.nn.Module):
    """The MoE block of layer `layer`, computed by the service at `target` (or through `client`)."""

    def __init__(self, target=None, layer=0, *, client=None, **client_kwargs):
        super().__init__()
        if (target is None) == (client is None):
            raise ValueError("give a target or a client")
        self.client = client or Client(target, **client_kwargs)
        if layer not in self.client.info.moe_layers:
            raise ValueError(f"layer {layer} is not an MoE layer of the service "
                             f"(its MoE layers: {list(self.client.info.moe_layers)})")
        self.layer = layer

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.detach().reshape(-1, shape[-1])
        y = self.client.forward(x, self.layer)
        return y.to(hidden_states.device).reshape(shape)

    def extra_repr(self):
        return f"target={self.client.target}, layer={self.layer}"


def _layers(model):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.model.layers or model.layers")
    return layers


def _is_moe(block):
    return hasattr(block, "experts") and hasattr(block, "gate")


def _num_experts(config):
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(config, key, None) is not None:
            return getattr(config, key)
    return None


def offload_moe(model, target=None, *, client=None, verify=True, **client_kwargs):
    """Replaces every MoE block of `model` with an EpserveMoE on the service's same layer, in
    place, and returns the model. The service must serve this model: the architecture, hidden
    size, expert count and MoE layers are checked, and with `verify` each block's output on a few
    random tokens is compared with the service's before it is replaced (a service loaded from
    another checkpoint is refused)."""
    if (target is None) == (client is None):
        raise ValueError("give a target or a client")
    client = client or Client(target, **client_kwargs)
    info, config = client.info, model.config
    mine = (getattr(config, "model_type", None), config.hidden_size, _num_experts(config))
    theirs = (info.architecture, info.hidden_size, info.num_experts)
    if mine != theirs:
        raise ValueError(f"the model is (architecture, hidden, experts) = {mine}; the service at "
                         f"{client.target} serves {theirs} ({info.model})")
    layers = _layers(model)
    moe = {i for i, layer in enumerate(layers) if _is_moe(getattr(layer, "mlp", None))}
    if moe != set(info.moe_layers):
        raise ValueError(f"the model's MoE layers {sorted(moe)} are not the service's {list(info.moe_layers)}")
    for i in sorted(moe):
        block = layers[i].mlp
        served = EpserveMoE(layer=i, client=client)
        if verify:
            _verify(block, served, i)
        layers[i].mlp = served
    return model


@torch.no_grad()
def _verify(block, served, i, tokens=8):
    p = next(block.parameters())
    if p.device.type == "meta":
        return  # nothing local to compare with
    g = torch.Generator().manual_seed(i)
    x = torch.randn(1, tokens, served.client.info.hidden_size, generator=g).to(p.dtype).to(p.device)
    want, got = block(x).float(), served(x).float()
    # bf16 holds 8 bits of mantissa: a block computed in another order differs by a few of its steps.
    tol = 1e-4 if p.dtype == torch.float32 else 3e-2
    err = ((want - got).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-30)).max().item()
    if err > tol:
        raise ValueError(f"layer {i}: the service's MoE output differs from the model's by {err:.2e} "
                         f"of a token's largest value (> {tol:g}): is it serving another checkpoint?")
