//! The weights a rank holds: each layer's router and its experts, as values or FP8 blocks.

use std::borrow::Cow;

use rayon::prelude::*;

use super::fp8;
use super::spec::{ModelError, MoeSpec};

/// How a rank holds and computes its experts (`--expert-dtype`, resolved by `ExpertDtype::resolve`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpertDtype {
    /// Weights as values: f32 on the CPU backend, bf16 on the GPU ones; an FP8 checkpoint is
    /// dequantized at load.
    Bf16,
    /// DeepSeek-V3's recipe (`fp8`): FP8 weights in 128x128 blocks, activations quantized per
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
                    "--expert-dtype auto: the checkpoint ships FP8, dequantized to bf16 ({})",
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

    /// Every value as f32 (FP8 dequantized), for a path that computes in another format.
    pub fn values(&self) -> Cow<'_, [f32]> {
        match self {
            Matrix::F32(v) => Cow::Borrowed(v),
            Matrix::Fp8(b) => Cow::Owned(b.dequantize()),
        }
    }

    /// As FP8 blocks (`[rows, cols]`): kept if already, quantized if values.
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
        Self::from_gate_up(gate_up, down, inter)
    }

    /// From gate and up already stacked, `[2 * inter, hidden]`.
    pub fn from_gate_up(gate_up: Vec<f32>, down: Vec<f32>, inter: usize) -> Self {
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

    /// Both matrices as FP8 blocks (values quantized by 128x128 block).
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
    /// This rank's experts, one per slot, in slot order.
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
            // Quantized on the load pool's threads, one expert each.
            experts: self
                .experts
                .into_par_iter()
                .map(|f| f.into_fp8(hidden))
                .collect(),
            shared: self.shared.map(|f| f.into_fp8(hidden)),
            ..self
        }
    }
}

/// The weights one rank holds, one entry per MoE layer.
pub struct RankWeights {
    /// Per MoE layer; a layer's `experts` are the rank's slots, in order.
    pub layers: Vec<LayerWeights>,
    pub dtype: ExpertDtype,
}

impl RankWeights {
    /// Bytes of routed and shared experts, as held (f32 or FP8 with its scales).
    pub fn expert_bytes(&self) -> usize {
        self.layers.iter().map(LayerWeights::expert_bytes).sum()
    }
}
