//! Hugging Face-layout checkpoints written from random weights: real tensor names, dense layers,
//! several files, bf16 / f32 / block-scaled FP8, with the f64 reference of what they hold.

use std::collections::HashMap;

use epserve::model::{MoeSpec, Routing};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::reference::{RefFfn, RefLayer};

/// Tensors to write: name → (dtype, shape, bytes).
#[derive(Default)]
pub struct Ckpt(Vec<(String, Dtype, Vec<usize>, Vec<u8>)>);

impl Ckpt {
    /// bf16 tensor of uniform values; returns the values as stored (bf16-rounded), in f64.
    pub fn bf16(
        &mut self,
        rng: &mut ChaCha8Rng,
        name: String,
        shape: &[usize],
        scale: f64,
    ) -> Vec<f64> {
        let n: usize = shape.iter().product();
        let v: Vec<half::bf16> = (0..n)
            .map(|_| half::bf16::from_f64(rng.random_range(-scale..scale)))
            .collect();
        self.0.push((
            name,
            Dtype::BF16,
            shape.to_vec(),
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
        v.iter().map(|x| x.to_f64()).collect()
    }
    pub fn f32(
        &mut self,
        rng: &mut ChaCha8Rng,
        name: String,
        shape: &[usize],
        scale: f64,
    ) -> Vec<f64> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| rng.random_range(-scale..scale) as f32)
            .collect();
        self.0.push((
            name,
            Dtype::F32,
            shape.to_vec(),
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
        v.iter().map(|&x| f64::from(x)).collect()
    }
    /// FP8 E4M3 values built from their fields (so no decoder is shared with the server), with a
    /// per-block f32 `weight_scale_inv`; returns the dequantized values.
    pub fn fp8(
        &mut self,
        rng: &mut ChaCha8Rng,
        name: String,
        shape: [usize; 2],
        block: usize,
        scale: f64,
    ) -> Vec<f64> {
        let (r, c) = (shape[0], shape[1]);
        let (br, bc) = (r.div_ceil(block), c.div_ceil(block));
        let scales: Vec<f32> = (0..br * bc)
            .map(|_| (scale * rng.random_range(0.5..1.5)) as f32)
            .collect();
        let mut bytes = Vec::with_capacity(r * c);
        let mut vals = Vec::with_capacity(r * c);
        for i in 0..r * c {
            let (sign, exp, man) = (
                rng.random_range(0..2u8),
                rng.random_range(4..=8u8),
                rng.random_range(0..8u8),
            );
            bytes.push(sign << 7 | exp << 3 | man);
            let v = (1.0 + f64::from(man) / 8.0)
                * 2f64.powi(i32::from(exp) - 7)
                * if sign == 1 { -1.0 } else { 1.0 };
            vals.push(v * f64::from(scales[(i / c / block) * bc + (i % c) / block]));
        }
        self.0
            .push((name.clone(), Dtype::F8_E4M3, shape.to_vec(), bytes));
        self.0.push((
            format!("{name}_scale_inv"),
            Dtype::F32,
            vec![br, bc],
            scales.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
        vals
    }
    /// Writes the tensors round-robin into `files` safetensors files.
    pub fn write(&self, dir: &std::path::Path, files: usize) {
        for f in 0..files {
            let views: Vec<(String, TensorView)> = self
                .0
                .iter()
                .enumerate()
                .filter(|(i, _)| i % files == f)
                .map(|(_, (n, d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
                .collect();
            let bytes = safetensors::serialize(views, None).unwrap();
            std::fs::write(
                dir.join(format!("model-{:05}-of-{files:05}.safetensors", f + 1)),
                bytes,
            )
            .unwrap();
        }
    }
}

pub struct Arch {
    pub model_type: &'static str,
    pub hidden: usize,
    pub inter: usize,
    pub experts: usize,
    pub top_k: usize,
    pub layers: u32,
    pub dense: Vec<u32>,
    pub fp8_block: Option<usize>,
}

impl Arch {
    /// DeepSeek-V3 as it ships, at test size: FP8 experts in 128x128 blocks, 16 experts of which
    /// each token takes 4, layer 0 dense, then `layers - 1` MoE layers.
    pub fn deepseek_fp8_128(layers: u32) -> Self {
        Self {
            model_type: "deepseek_v3",
            hidden: 256,
            inter: 128,
            experts: 16,
            top_k: 4,
            layers,
            dense: vec![0],
            fp8_block: Some(128),
        }
    }
}

/// Writes a checkpoint of `a` and returns (spec as the test expects it, reference layers).
pub fn write_model(dir: &std::path::Path, a: &Arch, seed: u64) -> (MoeSpec, Vec<RefLayer>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (h, i, e) = (a.hidden, a.inter, a.experts);
    let s_in = (3.0 / h as f64).sqrt();
    let s_mid = (3.0 / i as f64).sqrt();
    let mut ck = Ckpt::default();
    ck.bf16(&mut rng, "model.embed_tokens.weight".into(), &[32, h], 1.0);
    let mut refs = Vec::new();
    for l in 0..a.layers {
        ck.bf16(
            &mut rng,
            format!("model.layers.{l}.self_attn.q_proj.weight"),
            &[h, h],
            s_in,
        );
        if a.dense.contains(&l) {
            for (p, shape) in [
                ("gate_proj", [i * 4, h]),
                ("up_proj", [i * 4, h]),
                ("down_proj", [h, i * 4]),
            ] {
                ck.bf16(
                    &mut rng,
                    format!("model.layers.{l}.mlp.{p}.weight"),
                    &shape,
                    s_in,
                );
            }
            continue;
        }
        let mixtral = a.model_type == "mixtral";
        let pre = if mixtral {
            format!("model.layers.{l}.block_sparse_moe")
        } else {
            format!("model.layers.{l}.mlp")
        };
        let router = ck.bf16(&mut rng, format!("{pre}.gate.weight"), &[e, h], s_in);
        let bias = (a.model_type == "deepseek_v3").then(|| {
            ck.f32(
                &mut rng,
                format!("{pre}.gate.e_score_correction_bias"),
                &[e],
                0.05,
            )
        });
        let names = if mixtral {
            ["w1", "w3", "w2"]
        } else {
            ["gate_proj", "up_proj", "down_proj"]
        };
        let mut experts = Vec::new();
        for x in 0..e {
            let mut w = |name: &str, shape: [usize; 2], scale: f64| {
                let full = format!("{pre}.experts.{x}.{name}.weight");
                match a.fp8_block {
                    Some(b) => ck.fp8(&mut rng, full, shape, b, scale / 2.0),
                    None => ck.bf16(&mut rng, full, &shape, scale),
                }
            };
            experts.push(RefFfn {
                gate: w(names[0], [i, h], s_in),
                up: w(names[1], [i, h], s_in),
                down: w(names[2], [h, i], s_mid),
                inter: i,
            });
        }
        let shared = (a.model_type == "deepseek_v3").then(|| {
            let mut w = |p: &str, shape: [usize; 2], s| {
                ck.bf16(
                    &mut rng,
                    format!("{pre}.shared_experts.{p}.weight"),
                    &shape,
                    s,
                )
            };
            RefFfn {
                gate: w("gate_proj", [i, h], s_in),
                up: w("up_proj", [i, h], s_in),
                down: w("down_proj", [h, i], s_mid),
                inter: i,
            }
        });
        refs.push(RefLayer {
            router,
            bias,
            experts,
            shared,
            fp8: false,
        });
    }
    ck.write(dir, 2);
    let moe_layers: Vec<u32> = (0..a.layers).filter(|l| !a.dense.contains(l)).collect();
    let mut cfg: HashMap<&str, serde_json::Value> = HashMap::new();
    cfg.insert("model_type", a.model_type.into());
    cfg.insert("hidden_size", h.into());
    cfg.insert("num_hidden_layers", a.layers.into());
    cfg.insert("num_experts_per_tok", a.top_k.into());
    let routing = match a.model_type {
        "mixtral" => {
            cfg.insert("num_local_experts", e.into());
            cfg.insert("intermediate_size", i.into());
            Routing::SoftmaxTopK { renormalize: true }
        }
        "qwen3_moe" => {
            cfg.insert("num_experts", e.into());
            cfg.insert("moe_intermediate_size", i.into());
            cfg.insert("norm_topk_prob", true.into());
            cfg.insert("mlp_only_layers", serde_json::json!(a.dense));
            Routing::SoftmaxTopK { renormalize: true }
        }
        _ => {
            cfg.insert("n_routed_experts", e.into());
            cfg.insert("moe_intermediate_size", i.into());
            cfg.insert("n_shared_experts", 1.into());
            cfg.insert("n_group", 4.into());
            cfg.insert("topk_group", 2.into());
            cfg.insert("routed_scaling_factor", 2.5.into());
            cfg.insert("norm_topk_prob", true.into());
            cfg.insert("first_k_dense_replace", a.dense.len().into());
            cfg.insert("scoring_func", "sigmoid".into());
            if let Some(b) = a.fp8_block {
                cfg.insert("quantization_config", serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [b, b]}));
            }
            Routing::SigmoidGroupTopK {
                n_group: 4,
                topk_group: 2,
                renormalize: true,
                scaling: 2.5,
            }
        }
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .unwrap();
    let shared = usize::from(a.model_type == "deepseek_v3");
    let spec = MoeSpec {
        architecture: a.model_type.into(),
        hidden: h,
        intermediate: i,
        num_experts: e,
        top_k: a.top_k,
        moe_layers,
        routing,
        shared_intermediate: shared * i,
        num_shared_experts: shared,
    };
    (spec, refs)
}

/// The FP8 recipe's reference of a checkpoint: experts it ships in FP8 as they are (their values
/// are the dequantized FP8), every other expert matrix quantized in 128x128 blocks.
pub fn fp8_reference(refs: &mut [RefLayer], a: &Arch) {
    for r in refs {
        match a.fp8_block {
            Some(_) => {
                if let Some(f) = r.shared.as_mut() {
                    f.quantize(a.hidden);
                }
                r.fp8 = true;
            }
            None => r.quantize_experts(a.hidden),
        }
    }
}
