//! Seeded synthetic models: every tensor is generated from (seed, layer, tensor, expert) alone, so
//! each rank generates only its own experts and any process can regenerate any tensor.

use std::ops::Range;

use rayon::prelude::*;

use super::spec::{ModelError, MoeSpec, Routing};
use super::weights::{Ffn, LayerWeights};

pub const PRESETS: &[&str] = &[
    "tiny",
    "tiny-qwen3",
    "tiny-deepseek",
    "small-deepseek",
    "qwen3-30b-a3b",
    "mixtral-8x7b",
    "deepseek-v3",
];

pub fn preset(name: &str) -> Result<MoeSpec, ModelError> {
    let softmax = |renormalize| Routing::SoftmaxTopK { renormalize };
    let spec =
        |arch: &str, hidden, inter, experts, k, layers: Range<u32>, routing, shared| MoeSpec {
            architecture: arch.into(),
            hidden,
            intermediate: inter,
            num_experts: experts,
            top_k: k,
            moe_layers: layers.collect(),
            routing,
            shared_intermediate: shared * inter,
            num_shared_experts: shared,
        };
    let deepseek = |renormalize| Routing::SigmoidGroupTopK {
        n_group: 8,
        topk_group: 4,
        renormalize,
        scaling: 2.5,
    };
    // DeepSeek-V3's routing over 16 experts: 4 groups, the best 2.
    let deepseek_small = Routing::SigmoidGroupTopK {
        n_group: 4,
        topk_group: 2,
        renormalize: true,
        scaling: 2.5,
    };
    Ok(match name {
        // Mixtral semantics at toy size.
        "tiny" => spec("mixtral", 64, 128, 8, 2, 0..2, softmax(true), 0),
        // Qwen3-MoE semantics without renormalisation (norm_topk_prob = false).
        "tiny-qwen3" => spec("qwen3_moe", 64, 96, 16, 4, 0..2, softmax(false), 0),
        // DeepSeek-V3 semantics: groups, bias, scaling, one shared expert; layer 0 is dense.
        "tiny-deepseek" => spec("deepseek_v3", 64, 64, 16, 4, 1..3, deepseek_small, 1),
        // tiny-deepseek at the sizes FP8 blocks take (multiples of 128).
        "small-deepseek" => spec("deepseek_v3", 256, 128, 16, 4, 1..3, deepseek_small, 1),
        "qwen3-30b-a3b" => spec("qwen3_moe", 2048, 768, 128, 8, 0..48, softmax(true), 0),
        "mixtral-8x7b" => spec("mixtral", 4096, 14336, 8, 2, 0..32, softmax(true), 0),
        "deepseek-v3" => spec("deepseek_v3", 7168, 2048, 256, 8, 3..61, deepseek(true), 1),
        other => {
            return Err(ModelError::Unsupported(format!(
                "unknown synthetic preset '{other}' (presets: {})",
                PRESETS.join(", ")
            )))
        }
    })
}

/// SplitMix64: tiny, fast and fixed forever, so a preset's weights never change with a crate bump
/// (and `epserve bench --skew` draws the same routing on every machine).
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    /// A value in [0, 1) from the next 53 bits.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Router = 1,
    Bias = 2,
    Gate = 3,
    Up = 4,
    Down = 5,
}

/// Uniform values in [-scale, scale) for one tensor.
fn tensor(seed: u64, layer: u32, kind: Kind, expert: u64, len: usize, scale: f32) -> Vec<f32> {
    let mut key = SplitMix(seed ^ 0x5EED);
    key.0 ^= (u64::from(layer) << 40) ^ ((kind as u64) << 32) ^ expert;
    let mut rng = SplitMix(key.next());
    (0..len)
        .map(|_| ((rng.next() >> 40) as f32 * (1.0 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale)
        .collect()
}

/// Uniform weights with unit-ish output variance: scale = sqrt(3 / fan_in).
fn ffn(spec_hidden: usize, inter: usize, seed: u64, layer: u32, expert: u64) -> Ffn {
    let a_in = (3.0 / spec_hidden as f32).sqrt();
    let a_mid = (3.0 / inter as f32).sqrt();
    Ffn::from_parts(
        tensor(seed, layer, Kind::Gate, expert, inter * spec_hidden, a_in),
        tensor(seed, layer, Kind::Up, expert, inter * spec_hidden, a_in),
        tensor(seed, layer, Kind::Down, expert, spec_hidden * inter, a_mid),
        inter,
    )
}

/// Routed expert `e` of model layer `layer`, as any rank generates it.
pub fn expert(spec: &MoeSpec, seed: u64, layer: u32, e: usize) -> Ffn {
    ffn(spec.hidden, spec.intermediate, seed, layer, e as u64)
}

/// The expert id used for the shared expert's tensors.
const SHARED: u64 = u64::MAX >> 33;

/// One layer: the router for all experts, and `experts` only, in the order given.
pub fn layer(
    spec: &MoeSpec,
    seed: u64,
    layer: u32,
    experts: impl IntoIterator<Item = usize>,
) -> LayerWeights {
    let h = spec.hidden;
    let a_router = (3.0 / h as f32).sqrt();
    let bias = matches!(spec.routing, Routing::SigmoidGroupTopK { .. })
        .then(|| tensor(seed, layer, Kind::Bias, 0, spec.num_experts, 0.05));
    LayerWeights {
        router: tensor(seed, layer, Kind::Router, 0, spec.num_experts * h, a_router),
        bias,
        // Each expert from its own seed: made on the load pool's threads, the same values.
        experts: experts
            .into_iter()
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|e| expert(spec, seed, layer, e))
            .collect(),
        shared: (spec.shared_intermediate > 0)
            .then(|| ffn(h, spec.shared_intermediate, seed, layer, SHARED)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_experts_are_independent_of_the_range() {
        for p in PRESETS {
            preset(p).unwrap().validate().unwrap();
        }
        let spec = preset("tiny").unwrap();
        let all = layer(&spec, 7, 1, 0..8);
        let part = layer(&spec, 7, 1, 4..6);
        assert_eq!(all.router, part.router);
        assert_eq!(all.experts[5].gate_up, part.experts[1].gate_up);
        assert_ne!(all.experts[4].gate_up, all.experts[5].gate_up);
        assert_ne!(layer(&spec, 8, 1, 0..1).router, all.router);
    }
}
