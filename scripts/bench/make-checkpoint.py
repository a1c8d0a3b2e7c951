"""A Hugging Face checkpoint of random bf16 weights in a real model's MoE shape, for load-rate
measurements (docs/benchmarks.md "Load"): the routers and experts epserve reads, in shards of
about 4 GiB with an index, as transformers writes them. Attention and dense weights are left
out (epserve does not read them).

    python3 make-checkpoint.py DIR [--preset qwen3-30b|deepseek-v3] [--layers N]

qwen3-30b: Qwen3-30B-A3B's MoE layers (2048 wide, 128 experts of 768). deepseek-v3: DeepSeek-V3's
(7168 wide, 256 experts of 2048, a shared expert, FP8 not applied: bf16 values)."""

import argparse
import json
import os

import torch
from safetensors.torch import save_file

PRESETS = {
    "qwen3-30b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                      moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "deepseek-v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168,
                        moe_intermediate_size=2048, intermediate_size=18432, n_routed_experts=256,
                        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
                        num_hidden_layers=61),
}
SHARD = 4 << 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--preset", default="qwen3-30b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=4, help="MoE layers written (the config says as many)")
    a = ap.parse_args()
    cfg = dict(PRESETS[a.preset])
    os.makedirs(a.dir, exist_ok=True)
    first = cfg.get("first_k_dense_replace", 0)
    cfg["num_hidden_layers"] = first + a.layers
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts = cfg.get("num_experts") or cfg["n_routed_experts"]
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.rand(*shape, generator=g) * 0.02 - 0.01).to(torch.bfloat16)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(a.dir, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    def put(name, t):
        nonlocal size
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= SHARD:
            flush()

    for l in range(first, first + a.layers):
        p = f"model.layers.{l}.mlp."
        put(p + "gate.weight", rand(experts, h))
        if cfg["model_type"] == "deepseek_v3":
            put(p + "gate.e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))
            for part, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                put(p + f"shared_experts.{part}.weight", rand(*shape))
        for e in range(experts):
            for part, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                put(p + f"experts.{e}.{part}.weight", rand(*shape))
    flush()
    with open(os.path.join(a.dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(a.dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    total = sum(os.path.getsize(os.path.join(a.dir, x)) for x in set(weight_map.values()))
    print(f"{a.dir}: {a.preset}, {a.layers} MoE layers, {n} shards, {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
