//! The MoE model: one `MoeSpec` for every source, the weights a rank holds, and routing.

pub mod hf;
pub mod routing;
pub mod synthetic;

use std::ops::Range;

/// How a token picks its experts.
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// Softmax over all experts, then top-k; `renormalize` rescales the k weights to sum to one
    /// (Mixtral always, Qwen3-MoE with `norm_topk_prob`).
    SoftmaxTopK { renormalize: bool },
    /// DeepSeek-V3: sigmoid scores, a per-expert correction bias used only for the choice,
    /// group-limited top-k (best `topk_group` of `n_group` groups by the sum of their top-2), then
    /// optional renormalisation and a routed scaling factor.
    SigmoidGroupTopK {
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
        scaling: f32,
    },
}

impl Routing {
    pub fn name(&self) -> &'static str {
        match self {
            Routing::SoftmaxTopK { .. } => "softmax_topk",
            Routing::SigmoidGroupTopK { .. } => "sigmoid_group_topk",
        }
    }

    pub fn renormalize(&self) -> bool {
        match self {
            Routing::SoftmaxTopK { renormalize }
            | Routing::SigmoidGroupTopK { renormalize, .. } => *renormalize,
        }
    }

    fn describe(&self) -> String {
        match self {
            Routing::SoftmaxTopK { renormalize } => format!("softmax_topk(renorm={renormalize})"),
            Routing::SigmoidGroupTopK {
                n_group,
                topk_group,
                renormalize,
                scaling,
            } => format!(
                "sigmoid_group_topk(groups={n_group},topk_group={topk_group},renorm={renormalize},scale={scaling})"
            ),
        }
    }
}

/// Everything about the MoE layers that every rank must agree on.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
    /// `mixtral`, `qwen3_moe` or `deepseek_v3` (the Hugging Face `model_type` whose semantics apply).
    pub architecture: String,
    pub hidden: usize,
    /// Intermediate size of one routed expert.
    pub intermediate: usize,
    pub num_experts: usize,
    pub top_k: usize,
    /// The model's own indices of its MoE layers, ascending.
    pub moe_layers: Vec<u32>,
    pub routing: Routing,
    /// Intermediate size of the shared expert block (0 = none).
    pub shared_intermediate: usize,
    pub num_shared_experts: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Unsupported(String),
    #[error("invalid model config: {0}")]
    Invalid(String),
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: String, msg: String },
}

impl MoeSpec {
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Invalid(m));
        if self.hidden == 0 || self.intermediate == 0 || self.num_experts == 0 {
            return bad(format!(
                "hidden ({}), intermediate ({}) and experts ({}) must be positive",
                self.hidden, self.intermediate, self.num_experts
            ));
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            return bad(format!(
                "top_k {} must be in 1..={}",
                self.top_k, self.num_experts
            ));
        }
        if self.moe_layers.is_empty() {
            return bad("the model has no MoE layers".into());
        }
        if let Routing::SigmoidGroupTopK {
            n_group,
            topk_group,
            ..
        } = self.routing
        {
            if n_group == 0 || self.num_experts % n_group != 0 {
                return bad(format!(
                    "{} experts do not split into {n_group} groups",
                    self.num_experts
                ));
            }
            if self.num_experts / n_group < 2 {
                return bad("group-limited routing needs at least 2 experts per group".into());
            }
            if topk_group == 0 || topk_group > n_group {
                return bad(format!("topk_group {topk_group} must be in 1..={n_group}"));
            }
            if self.top_k > topk_group * (self.num_experts / n_group) {
                return bad(format!(
                    "top_k {} exceeds the experts in {topk_group} groups",
                    self.top_k
                ));
            }
        }
        Ok(())
    }

    /// Position of a model layer index in `moe_layers`.
    pub fn layer_slot(&self, layer: u32) -> Option<usize> {
        self.moe_layers.binary_search(&layer).ok()
    }

    /// Keep only the first `n` MoE layers (`--layers`).
    pub fn cap_layers(&mut self, n: Option<usize>) {
        if let Some(n) = n {
            self.moe_layers.truncate(n.max(1));
        }
    }

    /// Fields compared across ranks at rendezvous, in a fixed order.
    pub fn fingerprint(&self) -> Vec<(String, String)> {
        vec![
            ("architecture".into(), self.architecture.clone()),
            ("hidden_size".into(), self.hidden.to_string()),
            ("intermediate_size".into(), self.intermediate.to_string()),
            ("num_experts".into(), self.num_experts.to_string()),
            ("top_k".into(), self.top_k.to_string()),
            ("moe_layers".into(), format!("{:?}", self.moe_layers)),
            ("routing".into(), self.routing.describe()),
            (
                "shared_intermediate_size".into(),
                self.shared_intermediate.to_string(),
            ),
        ]
    }
}

/// Contiguous blocks of E/W experts per rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub num_experts: usize,
    pub world: usize,
}

impl Placement {
    pub fn new(num_experts: usize, world: usize) -> Result<Self, ModelError> {
        if world == 0 || num_experts % world != 0 {
            return Err(ModelError::Invalid(format!(
                "{num_experts} experts cannot be split evenly over {world} ranks (experts must be divisible by the world size)"
            )));
        }
        Ok(Self { num_experts, world })
    }
    pub fn per_rank(&self) -> usize {
        self.num_experts / self.world
    }
    pub fn experts_of(&self, rank: usize) -> Range<usize> {
        let n = self.per_rank();
        rank * n..(rank + 1) * n
    }
    pub fn owner(&self, expert: usize) -> usize {
        expert / self.per_rank()
    }
}

/// One SwiGLU FFN: `down(silu(gate x) * up x)`.
#[derive(Clone, Debug)]
pub struct Ffn {
    /// `[2 * inter, hidden]`: the gate rows, then the up rows (one GEMM computes both).
    pub gate_up: Vec<f32>,
    /// `[hidden, inter]`.
    pub down: Vec<f32>,
    pub inter: usize,
}

impl Ffn {
    pub fn from_parts(gate: Vec<f32>, up: Vec<f32>, down: Vec<f32>, inter: usize) -> Self {
        let mut gate_up = gate;
        gate_up.extend_from_slice(&up);
        Self {
            gate_up,
            down,
            inter,
        }
    }
    pub fn bytes(&self) -> usize {
        (self.gate_up.len() + self.down.len()) * 4
    }
}

/// One MoE layer as one rank holds it: the full router, its own experts only.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// `[num_experts, hidden]`.
    pub router: Vec<f32>,
    /// DeepSeek-V3 `e_score_correction_bias`, `[num_experts]`.
    pub bias: Option<Vec<f32>>,
    /// This rank's experts, in order.
    pub experts: Vec<Ffn>,
    pub shared: Option<Ffn>,
}

/// The weights one rank holds, one entry per MoE layer.
pub struct RankWeights {
    pub layers: Vec<LayerWeights>,
    pub experts: Range<usize>,
}

impl RankWeights {
    pub fn expert_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.experts.iter())
            .map(Ffn::bytes)
            .sum()
    }
}

/// Where the weights come from (`--model`).
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    Synthetic { preset: String, seed: u64 },
    HuggingFace(std::path::PathBuf),
}

impl ModelSource {
    pub fn parse(s: &str, seed: u64) -> Result<Self, ModelError> {
        if let Some(name) = s.strip_prefix("synthetic:") {
            synthetic::preset(name)?;
            return Ok(ModelSource::Synthetic {
                preset: name.to_string(),
                seed,
            });
        }
        let path = std::path::PathBuf::from(s);
        if path.join("config.json").is_file() {
            return Ok(ModelSource::HuggingFace(path));
        }
        Err(ModelError::Unsupported(format!(
            "unknown model '{s}': expected synthetic:NAME ({}) or a directory with a Hugging Face config.json and *.safetensors (architectures: {})",
            synthetic::PRESETS.join(", "),
            hf::SUPPORTED.join(", ")
        )))
    }

    pub fn describe(&self) -> String {
        match self {
            ModelSource::Synthetic { preset, seed } => format!("synthetic:{preset}#seed={seed}"),
            ModelSource::HuggingFace(p) => p.display().to_string(),
        }
    }

    /// What identifies the weights for the rendezvous fingerprint: ranks that load different
    /// files under the same path must not form a group. Synthetic weights are their seed.
    pub fn identity(&self) -> Result<String, ModelError> {
        match self {
            ModelSource::Synthetic { .. } => Ok(self.describe()),
            ModelSource::HuggingFace(dir) => hf::identity(dir),
        }
    }

    /// The spec, before `--layers` capping.
    pub fn spec(&self) -> Result<MoeSpec, ModelError> {
        match self {
            ModelSource::Synthetic { preset, .. } => synthetic::preset(preset),
            ModelSource::HuggingFace(dir) => hf::load_spec(dir).map(|(spec, _)| spec),
        }
    }

    /// The weights of `experts` (and all routers) for every layer of `spec`.
    pub fn load(&self, spec: &MoeSpec, experts: Range<usize>) -> Result<RankWeights, ModelError> {
        match self {
            ModelSource::Synthetic { seed, .. } => Ok(RankWeights {
                layers: spec
                    .moe_layers
                    .iter()
                    .map(|&l| synthetic::layer(spec, *seed, l, experts.clone()))
                    .collect(),
                experts,
            }),
            ModelSource::HuggingFace(dir) => hf::load_weights(dir, spec, experts),
        }
    }
}
