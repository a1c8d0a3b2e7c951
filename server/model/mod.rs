//! The MoE model: one `MoeSpec` for every source, the weights a rank holds, and routing.

pub mod fp8;
pub mod hf;
pub mod routing;
mod spec;
pub mod synthetic;
mod weights;

pub use spec::{ModelError, MoeSpec, Routing};
pub use weights::{ExpertDtype, Ffn, LayerWeights, Matrix, RankWeights};

use rayon::prelude::*;

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

    /// The weights of every MoE layer of `spec` for one rank: `experts[i]` lists the routed
    /// experts of layer `i` in its slots' order (`eplb::SlotMap::experts_of`), with all routers.
    /// Experts held as `dtype` says: FP8 blocks as shipped or quantized at load, or values.
    /// `loaded` sees each layer as it is read (progress).
    pub fn load(
        &self,
        spec: &MoeSpec,
        experts: &[Vec<usize>],
        dtype: ExpertDtype,
        loaded: &mut dyn FnMut(&LayerWeights),
    ) -> Result<RankWeights, ModelError> {
        match self {
            ModelSource::Synthetic { seed, .. } => Ok(RankWeights {
                layers: (spec.moe_layers.iter().zip(experts))
                    .map(|(&l, mine)| {
                        let w = synthetic::layer(spec, *seed, l, mine.iter().copied());
                        let w = match dtype {
                            ExpertDtype::Fp8 => w.into_fp8(spec.hidden),
                            ExpertDtype::Bf16 => w,
                        };
                        loaded(&w);
                        w
                    })
                    .collect(),
                dtype,
            }),
            ModelSource::HuggingFace(dir) => hf::load_weights(dir, spec, experts, dtype, loaded),
        }
    }

    /// Routed experts `(layer index, expert)` alone, exactly as `load` holds them (the weights a
    /// placement change moves into a slot), made or read in parallel on the load pool, as `load`
    /// makes them: one thread quantized a batch of 8 synthetic FP8 Qwen3 experts in 1.3 s (one
    /// H200 host), and a placement of every slot on one rank took 88 s to stage. A staging pool
    /// of 4 threads cost the serving beside it no fewer tokens/s than the load pool's 16 did,
    /// and landed fewer placements (docs/benchmarks.md, session 57).
    pub fn load_experts(
        &self,
        spec: &MoeSpec,
        wanted: &[(usize, usize)],
        dtype: ExpertDtype,
    ) -> Result<Vec<Ffn>, ModelError> {
        match self {
            ModelSource::Synthetic { seed, .. } => Ok(wanted
                .par_iter()
                .map(|&(i, e)| {
                    let f = synthetic::expert(spec, *seed, spec.moe_layers[i], e);
                    match dtype {
                        ExpertDtype::Fp8 => f.into_fp8(spec.hidden),
                        ExpertDtype::Bf16 => f,
                    }
                })
                .collect()),
            ModelSource::HuggingFace(dir) => hf::load_experts(dir, spec, wanted, dtype),
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
        // fp8: quantized at load where nothing ships FP8; refused where the recipe cannot apply.
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
        // bf16: always, FP8 checkpoints dequantized.
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
        // gate/up stacked then quantized = each quantized then stacked (128-row blocks).
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
