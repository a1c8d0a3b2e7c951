//! What every rank must agree on about the MoE layers, whatever the source: shapes, routing,
//! and which experts a rank holds.

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
