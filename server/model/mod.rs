//! The MoE model: one `MoeSpec` for every source, the weights a rank holds, and routing.

pub mod fp8;
pub mod hf;
pub mod routing;
pub mod synthetic;

use std::borrow::Cow;
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

/// How a rank holds and computes its experts (`--expert-dtype`, resolved by `ExpertDtype::resolve`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpertDtype {
    /// Weights as values: f32 on the CPU backend, bf16 on the GPU ones; an FP8 checkpoint is
    /// dequantised at load.
    Bf16,
    /// DeepSeek-V3's recipe (`fp8`): FP8 weights in 128x128 blocks, activations quantised per
    /// token per 128 channels before each expert GEMM.
    Fp8,
}

impl ExpertDtype {
    pub fn name(self) -> &'static str {
        match self {
            ExpertDtype::Bf16 => "bf16",
            ExpertDtype::Fp8 => "fp8",
        }
    }

    /// Device bytes of a `rows x cols` weight matrix held this way (FP8: its block scales too).
    pub fn weight_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            ExpertDtype::Bf16 => 2 * rows * cols,
            ExpertDtype::Fp8 => {
                rows * cols + 4 * rows.div_ceil(fp8::BLOCK) * cols.div_ceil(fp8::BLOCK)
            }
        }
    }

    /// What `asked` (None: auto) means for `spec` loaded from a checkpoint that ships FP8 in
    /// `shipped` blocks (None: it does not). Auto keeps FP8 where it ships and the recipe applies
    /// (128x128 blocks, sizes in multiples of 128), else bf16, with a note saying why; `fp8` where
    /// the recipe does not apply is refused with the sizes that stop it.
    pub fn resolve(
        asked: Option<ExpertDtype>,
        spec: &MoeSpec,
        shipped: Option<(usize, usize)>,
    ) -> Result<(ExpertDtype, Option<String>), ModelError> {
        let b = fp8::BLOCK;
        let mut stops: Vec<String> = [
            ("hidden size", spec.hidden),
            ("intermediate size", spec.intermediate),
            ("shared intermediate size", spec.shared_intermediate),
        ]
        .into_iter()
        .filter(|&(_, n)| n % b != 0)
        .map(|(what, n)| format!("{what} {n}"))
        .collect();
        if let Some((r, c)) = shipped.filter(|&blocks| blocks != (b, b)) {
            stops.push(format!("the checkpoint's {r}x{c} FP8 blocks"));
        }
        let why = || {
            format!(
                "FP8 experts need {b}x{b} weight blocks and sizes in multiples of {b}: {}",
                stops.join(", ")
            )
        };
        match (asked, shipped) {
            (Some(ExpertDtype::Bf16), _) => Ok((ExpertDtype::Bf16, None)),
            (Some(ExpertDtype::Fp8), _) if !stops.is_empty() => Err(ModelError::Unsupported(
                format!("--expert-dtype fp8: {}", why()),
            )),
            (Some(ExpertDtype::Fp8), _) => Ok((ExpertDtype::Fp8, None)),
            (None, Some(_)) if !stops.is_empty() => Ok((
                ExpertDtype::Bf16,
                Some(format!(
                    "--expert-dtype auto: the checkpoint ships FP8, dequantised to bf16 ({})",
                    why()
                )),
            )),
            (None, Some(_)) => Ok((ExpertDtype::Fp8, None)),
            (None, None) => Ok((ExpertDtype::Bf16, None)),
        }
    }
}

/// One weight matrix as a rank holds it.
#[derive(Clone, Debug, PartialEq)]
pub enum Matrix {
    F32(Vec<f32>),
    Fp8(fp8::Blocks),
}

impl Matrix {
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::F32(v) => 4 * v.len(),
            Matrix::Fp8(b) => b.bytes(),
        }
    }

    /// Every value as f32 (FP8 dequantised), for a path that computes in another format.
    pub fn values(&self) -> Cow<'_, [f32]> {
        match self {
            Matrix::F32(v) => Cow::Borrowed(v),
            Matrix::Fp8(b) => Cow::Owned(b.dequantize()),
        }
    }

    /// As FP8 blocks (`[rows, cols]`): kept if already, quantised if values.
    fn into_fp8(self, rows: usize, cols: usize) -> fp8::Blocks {
        match self {
            Matrix::F32(v) => fp8::Blocks::quantize(&v, rows, cols),
            Matrix::Fp8(b) => b,
        }
    }
}

/// One SwiGLU FFN: `down(silu(gate x) * up x)`.
#[derive(Clone, Debug)]
pub struct Ffn {
    /// `[2 * inter, hidden]`: the gate rows, then the up rows (one GEMM computes both).
    pub gate_up: Matrix,
    /// `[hidden, inter]`.
    pub down: Matrix,
    pub inter: usize,
}

impl Ffn {
    pub fn from_parts(gate: Vec<f32>, up: Vec<f32>, down: Vec<f32>, inter: usize) -> Self {
        let mut gate_up = gate;
        gate_up.extend_from_slice(&up);
        Self {
            gate_up: Matrix::F32(gate_up),
            down: Matrix::F32(down),
            inter,
        }
    }

    /// From FP8 blocks as a checkpoint ships them: gate and up `[inter, hidden]`, down
    /// `[hidden, inter]`.
    pub fn from_fp8(gate: fp8::Blocks, up: fp8::Blocks, down: fp8::Blocks, inter: usize) -> Self {
        Self {
            gate_up: Matrix::Fp8(gate.stack(up)),
            down: Matrix::Fp8(down),
            inter,
        }
    }

    pub fn bytes(&self) -> usize {
        self.gate_up.bytes() + self.down.bytes()
    }

    /// Both matrices as FP8 blocks (values quantised by 128x128 block).
    pub fn into_fp8(self, hidden: usize) -> Self {
        let i = self.inter;
        Self {
            gate_up: Matrix::Fp8(self.gate_up.into_fp8(2 * i, hidden)),
            down: Matrix::Fp8(self.down.into_fp8(hidden, i)),
            inter: i,
        }
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

impl LayerWeights {
    /// Bytes of this layer's routed and shared experts, as held.
    pub fn expert_bytes(&self) -> usize {
        self.experts
            .iter()
            .chain(&self.shared)
            .map(Ffn::bytes)
            .sum()
    }

    /// Routed and shared experts as FP8 blocks; the router stays as it is.
    pub fn into_fp8(self, hidden: usize) -> Self {
        Self {
            experts: self
                .experts
                .into_iter()
                .map(|f| f.into_fp8(hidden))
                .collect(),
            shared: self.shared.map(|f| f.into_fp8(hidden)),
            ..self
        }
    }
}

/// The weights one rank holds, one entry per MoE layer.
pub struct RankWeights {
    pub layers: Vec<LayerWeights>,
    pub experts: Range<usize>,
    pub dtype: ExpertDtype,
}

impl RankWeights {
    /// Bytes of routed and shared experts, as held (f32 or FP8 with its scales).
    pub fn expert_bytes(&self) -> usize {
        self.layers.iter().map(LayerWeights::expert_bytes).sum()
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

    /// The FP8 block size the checkpoint ships its weights in, if it ships FP8.
    pub fn shipped_fp8(&self) -> Result<Option<(usize, usize)>, ModelError> {
        match self {
            ModelSource::Synthetic { .. } => Ok(None),
            ModelSource::HuggingFace(dir) => Ok(hf::load_spec(dir)?.1.map(|b| (b.rows, b.cols))),
        }
    }

    /// The weights of `experts` (and all routers) for every layer of `spec`, experts held as
    /// `dtype` says: FP8 blocks as shipped or quantised at load, or values. `loaded` sees each
    /// layer as it is read (progress).
    pub fn load(
        &self,
        spec: &MoeSpec,
        experts: Range<usize>,
        dtype: ExpertDtype,
        loaded: &mut dyn FnMut(&LayerWeights),
    ) -> Result<RankWeights, ModelError> {
        match self {
            ModelSource::Synthetic { seed, .. } => Ok(RankWeights {
                layers: spec
                    .moe_layers
                    .iter()
                    .map(|&l| {
                        let w = synthetic::layer(spec, *seed, l, experts.clone());
                        let w = match dtype {
                            ExpertDtype::Fp8 => w.into_fp8(spec.hidden),
                            ExpertDtype::Bf16 => w,
                        };
                        loaded(&w);
                        w
                    })
                    .collect(),
                experts,
                dtype,
            }),
            ModelSource::HuggingFace(dir) => hf::load_weights(dir, spec, experts, dtype, loaded),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_dtype_auto_keeps_shipped_fp8_where_the_recipe_applies() {
        let v3 = synthetic::preset("small-deepseek").unwrap();
        let tiny = synthetic::preset("tiny").unwrap();
        let (fp8, bf16) = (Some(ExpertDtype::Fp8), Some(ExpertDtype::Bf16));
        let r = |asked, spec: &MoeSpec, shipped| ExpertDtype::resolve(asked, spec, shipped);
        // auto: FP8 as shipped in 128x128 blocks, else bf16 with the reason.
        assert_eq!(
            r(None, &v3, Some((128, 128))).unwrap(),
            (ExpertDtype::Fp8, None)
        );
        assert_eq!(r(None, &v3, None).unwrap(), (ExpertDtype::Bf16, None));
        let (d, note) = r(None, &v3, Some((64, 64))).unwrap();
        assert_eq!(d, ExpertDtype::Bf16);
        assert!(note.unwrap().contains("the checkpoint's 64x64 FP8 blocks"));
        let (d, note) = r(None, &tiny, Some((128, 128))).unwrap();
        assert_eq!(d, ExpertDtype::Bf16);
        assert!(note.unwrap().contains("hidden size 64"));
        // fp8: quantised at load where nothing ships FP8; refused where the recipe cannot apply.
        assert_eq!(r(fp8, &v3, None).unwrap(), (ExpertDtype::Fp8, None));
        let e = r(fp8, &tiny, None).unwrap_err().to_string();
        assert!(
            e.contains("hidden size 64") && !e.contains("intermediate size"),
            "{e}"
        );
        let mut odd = v3.clone();
        odd.intermediate = 96;
        odd.shared_intermediate = 96;
        let e = r(fp8, &odd, Some((128, 64))).unwrap_err().to_string();
        assert!(
            e.contains("intermediate size 96, shared intermediate size 96, the checkpoint's 128x64 FP8 blocks"),
            "{e}"
        );
        // bf16: always, FP8 checkpoints dequantised.
        assert_eq!(
            r(bf16, &v3, Some((128, 128))).unwrap(),
            (ExpertDtype::Bf16, None)
        );
        assert_eq!(r(bf16, &tiny, None).unwrap(), (ExpertDtype::Bf16, None));
    }

    #[test]
    fn fp8_weights_hold_a_quarter_of_f32_and_survive_stacking() {
        let spec = synthetic::preset("small-deepseek").unwrap();
        let w = synthetic::layer(&spec, 3, 1, 0..2);
        let f32_bytes: usize = w.experts.iter().chain(&w.shared).map(Ffn::bytes).sum();
        let q = w.clone().into_fp8(spec.hidden);
        let fp8_bytes: usize = q.experts.iter().chain(&q.shared).map(Ffn::bytes).sum();
        // One byte a weight and one f32 scale per 16384 weights, against four bytes a weight.
        assert_eq!(fp8_bytes * 4 * 16384, f32_bytes * (16384 + 4));
        // gate/up stacked then quantised = each quantised then stacked (128-row blocks).
        let (h, i) = (spec.hidden, spec.intermediate);
        let Matrix::F32(gu) = &w.experts[0].gate_up else {
            panic!()
        };
        let apart = fp8::Blocks::quantize(&gu[..i * h], i, h).stack(fp8::Blocks::quantize(
            &gu[i * h..],
            i,
            h,
        ));
        assert_eq!(q.experts[0].gate_up, Matrix::Fp8(apart));
        assert_eq!(q.router, w.router, "the router stays as it is");
    }
}
