"""A transformers model of each architecture the service reads generates the same tokens with
its MoE blocks served by `epserve launch` (cpu backend, 2 ranks) as it does alone: greedy, 32
new tokens, every step's logits within f32 tolerance of the local ones."""

import copy

import pytest
import torch

import epserve
from conftest import Service, tiny_model


def moe_blocks(model):
    return [i for i, l in enumerate(model.model.layers) if isinstance(l.mlp, epserve.EpserveMoE)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_generates_the_same_tokens(checkpoints, arch):
    model, d = checkpoints[arch]
    s = Service("--model", d, "--ranks", "2")
    try:
        prompt = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
        kw = dict(do_sample=False, max_new_tokens=32, min_new_tokens=32, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            alone = model.generate(prompt, **kw)
            served = epserve.offload_moe(copy.deepcopy(model), s.addr)
            assert moe_blocks(served) == list(epserve.Client(s.addr).info.moe_layers)
            if arch == "deepseek_v3":
                assert moe_blocks(served) == [1, 2]  # layer 0 is dense and stays local
            remote = served.generate(prompt, **kw)
        assert remote.sequences.shape == (2, 12 + 32)
        assert torch.equal(remote.sequences, alone.sequences)
        for step, (a, b) in enumerate(zip(alone.logits, remote.logits)):
            err = ((a - b).abs().amax(-1) / a.abs().amax(-1)).max().item()
            assert err <= 1e-4, f"step {step}: logits differ by {err:.2e}"
    finally:
        s.stop()


def test_a_service_of_another_checkpoint_is_refused(checkpoints):
    _, d = checkpoints["qwen3_moe"]
    s = Service("--model", d, "--ranks", "1")
    try:
        with pytest.raises(ValueError, match="another checkpoint"):
            epserve.offload_moe(tiny_model("qwen3_moe", seed=1), s.addr)
        with pytest.raises(ValueError, match="serves"):
            epserve.offload_moe(tiny_model("mixtral"), s.addr)
    finally:
        s.stop()
