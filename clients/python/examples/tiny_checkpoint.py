"""A small random Hugging Face checkpoint of an architecture epserve serves, to try the client on:

    python3 tiny_checkpoint.py mixtral ./tiny-mixtral        # or qwen3_moe, deepseek_v3

64 wide, 8 experts, top-2 (DeepSeek-V3: one dense layer first, a shared expert, grouped sigmoid
routing with a correction bias); random weights from a fixed seed. The client's tests use it."""

import sys

import torch
import transformers as tf

ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")


def tiny_config(arch):
    common = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                  num_experts_per_tok=2, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    if arch == "mixtral":
        return tf.MixtralConfig(intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
                                num_local_experts=8, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                                 num_key_value_heads=2, num_experts=8, head_dim=16, norm_topk_prob=True,
                                 **common)
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                                   first_k_dense_replace=1, num_key_value_heads=4, n_routed_experts=8,
                                   n_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=32,
                                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                   **common)
    raise ValueError(arch)


def tiny_model(arch, seed=0):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers initialises a router's correction bias to zeros: give it values, so
            # that a service ignoring it would route otherwise.
            if name.endswith("e_score_correction_bias"):
                p.uniform_(-0.05, 0.05)
    return model



if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ARCHS:
        sys.exit(f"usage: tiny_checkpoint.py {{{'|'.join(ARCHS)}}} DIR")
    tiny_model(sys.argv[1]).save_pretrained(sys.argv[2])
    print(f"wrote {sys.argv[2]}")
