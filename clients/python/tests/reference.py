"""An f64 reference of a Mixtral MoE block, straight from the checkpoint's tensors (not from
transformers' modules): softmax over the router's logits, top-2, renormalised; each expert
w2(silu(w1 x) * w3 x)."""

import os

import numpy as np
from safetensors.numpy import load_file

TOP_K = 2
# A token whose 2nd and 3rd router logits are this close may be routed either way by an f32
# gate: its error says nothing of the service, so it is left out (and counted).
TIE = 1e-5


class Mixtral64:
    def __init__(self, directory):
        self.w = {k: v.astype(np.float64) for k, v in load_file(os.path.join(directory, "model.safetensors")).items()}

    def __call__(self, layer, x, ids=None, weights=None):
        """(output [tokens, hidden], mask of the tokens routed without a near tie)."""
        x = np.asarray(x, np.float64)
        p = f"model.layers.{layer}.block_sparse_moe."
        clear = np.ones(len(x), bool)
        if ids is None:
            logits = x @ self.w[p + "gate.weight"].T
            order = np.argsort(-logits, axis=1)
            ranked = np.take_along_axis(logits, order, 1)
            clear = ranked[:, TOP_K - 1] - ranked[:, TOP_K] > TIE * np.maximum(1.0, np.abs(ranked[:, 0]))
            probs = np.exp(logits - ranked[:, :1])
            probs /= probs.sum(1, keepdims=True)
            ids = order[:, :TOP_K]
            weights = np.take_along_axis(probs, ids, 1)
            weights /= weights.sum(1, keepdims=True)
        ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
        out = np.zeros_like(x)
        for e in range(self.w[p + "gate.weight"].shape[0]):
            rows, k = np.nonzero(ids == e)
            if len(rows) == 0:
                continue
            q = f"{p}experts.{e}."
            a, b = x[rows] @ self.w[q + "w1.weight"].T, x[rows] @ self.w[q + "w3.weight"].T
            h = a / (1 + np.exp(-a)) * b
            np.add.at(out, rows, weights[rows, k][:, None] * (h @ self.w[q + "w2.weight"].T))
        return out, clear
