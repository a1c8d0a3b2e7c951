//! Hugging Face checkpoints: `config.json` + `*.safetensors`, memory-mapped; a rank copies out only
//! the routers and its own experts, so its resident memory follows its share of the experts.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::{Ffn, LayerWeights, ModelError, MoeSpec, RankWeights, Routing};

pub const SUPPORTED: &[&str] = &[
    "mixtral (MixtralForCausalLM)",
    "qwen3_moe (Qwen3MoeForCausalLM)",
    "deepseek_v3 (DeepseekV3ForCausalLM)",
];

fn invalid(msg: impl Into<String>) -> ModelError {
    ModelError::Invalid(msg.into())
}

struct Cfg<'a>(&'a Value);

impl Cfg<'_> {
    fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.0
            .get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| invalid(format!("config.json: missing or non-integer '{key}'")))
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.usize(key),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> bool {
        self.0.get(key).and_then(Value::as_bool).unwrap_or(default)
    }
    fn f32_or(&self, key: &str, default: f32) -> f32 {
        self.0
            .get(key)
            .and_then(Value::as_f64)
            .map_or(default, |v| v as f32)
    }
    fn str_or<'b>(&'b self, key: &str, default: &'b str) -> &'b str {
        self.0.get(key).and_then(Value::as_str).unwrap_or(default)
    }
}

/// FP8 block quantisation (DeepSeek-V3's `quantization_config`).
#[derive(Clone, Copy, Debug)]
pub struct Fp8Blocks {
    rows: usize,
    cols: usize,
}

/// Reads `dir/config.json` into a spec.
pub fn load_spec(dir: &Path) -> Result<(MoeSpec, Option<Fp8Blocks>), ModelError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))?;
    let c = Cfg(&v);
    let model_type = c.str_or("model_type", "");
    let hidden = c.usize("hidden_size")?;
    let layers = c.usize("num_hidden_layers")? as u32;
    let spec = match model_type {
        "mixtral" => MoeSpec {
            architecture: "mixtral".into(),
            hidden,
            intermediate: c.usize("intermediate_size")?,
            num_experts: c.usize("num_local_experts")?,
            top_k: c.usize("num_experts_per_tok")?,
            moe_layers: (0..layers).collect(),
            routing: Routing::SoftmaxTopK { renormalize: true },
            shared_intermediate: 0,
            num_shared_experts: 0,
        },
        "qwen3_moe" => {
            let step = c.usize_or("decoder_sparse_step", 1)?.max(1) as u32;
            let dense: Vec<u32> = v
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64().map(|x| x as u32))
                        .collect()
                })
                .unwrap_or_default();
            MoeSpec {
                architecture: "qwen3_moe".into(),
                hidden,
                intermediate: c.usize("moe_intermediate_size")?,
                num_experts: c.usize("num_experts")?,
                top_k: c.usize("num_experts_per_tok")?,
                moe_layers: (0..layers)
                    .filter(|i| !dense.contains(i) && (i + 1) % step == 0)
                    .collect(),
                routing: Routing::SoftmaxTopK {
                    renormalize: c.bool_or("norm_topk_prob", false),
                },
                shared_intermediate: 0,
                num_shared_experts: 0,
            }
        }
        "deepseek_v3" => {
            if c.str_or("scoring_func", "sigmoid") != "sigmoid" {
                return Err(ModelError::Unsupported(
                    "deepseek_v3 with scoring_func other than sigmoid".into(),
                ));
            }
            let first_dense = c.usize_or("first_k_dense_replace", 0)? as u32;
            let freq = c.usize_or("moe_layer_freq", 1)?.max(1) as u32;
            let inter = c.usize("moe_intermediate_size")?;
            let shared = c.usize_or("n_shared_experts", 0)?;
            MoeSpec {
                architecture: "deepseek_v3".into(),
                hidden,
                intermediate: inter,
                num_experts: c.usize("n_routed_experts")?,
                top_k: c.usize("num_experts_per_tok")?,
                moe_layers: (first_dense..layers).filter(|i| i % freq == 0).collect(),
                routing: Routing::SigmoidGroupTopK {
                    n_group: c.usize_or("n_group", 1)?,
                    topk_group: c.usize_or("topk_group", 1)?,
                    renormalize: c.bool_or("norm_topk_prob", true),
                    scaling: c.f32_or("routed_scaling_factor", 1.0),
                },
                shared_intermediate: shared * inter,
                num_shared_experts: shared,
            }
        }
        other => {
            return Err(ModelError::Unsupported(format!(
                "unsupported architecture '{other}' in {} (supported: {})",
                path.display(),
                SUPPORTED.join(", ")
            )))
        }
    };
    spec.validate()?;
    let fp8 = v.get("quantization_config").and_then(|q| {
        let block = q.get("weight_block_size")?.as_array()?;
        Some(Fp8Blocks {
            rows: block.first()?.as_u64()? as usize,
            cols: block.get(1)?.as_u64()? as usize,
        })
    });
    Ok((spec, fp8))
}

enum Part {
    Gate,
    Up,
    Down,
}

fn expert_name(arch: &str, layer: u32, expert: usize, part: Part) -> String {
    if arch == "mixtral" {
        let w = match part {
            Part::Gate => "w1",
            Part::Up => "w3",
            Part::Down => "w2",
        };
        format!("model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight")
    } else {
        format!(
            "model.layers.{layer}.mlp.experts.{expert}.{}.weight",
            proj(part)
        )
    }
}

fn proj(part: Part) -> &'static str {
    match part {
        Part::Gate => "gate_proj",
        Part::Up => "up_proj",
        Part::Down => "down_proj",
    }
}

fn router_name(arch: &str, layer: u32) -> String {
    if arch == "mixtral" {
        format!("model.layers.{layer}.block_sparse_moe.gate.weight")
    } else {
        format!("model.layers.{layer}.mlp.gate.weight")
    }
}

/// The mapped safetensors files of one checkpoint, and which file holds which tensor.
struct Checkpoint {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    index: HashMap<String, usize>,
    fp8: Option<Fp8Blocks>,
}

impl Checkpoint {
    fn open(dir: &Path, fp8: Option<Fp8Blocks>) -> Result<Self, ModelError> {
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| ModelError::Io { path, source }
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Checkpoint {
                path: dir.display().to_string(),
                msg: "no *.safetensors files".into(),
            });
        }
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(io(&path))?;
            // SAFETY: the checkpoint is read-only input; the map lives only while loading, and a
            // file truncated underneath us is the operator's error (it would fault, not corrupt).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(&path))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| ModelError::Checkpoint {
                path: path.display().to_string(),
                msg: e.to_string(),
            })?;
            for name in st.names() {
                index.insert(name.to_string(), maps.len());
            }
            maps.push((path, map));
        }
        Ok(Self { maps, index, fp8 })
    }

    /// Copies one tensor out as f32, checking its shape.
    fn read(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (path, map) = self
            .index
            .get(name)
            .map(|&i| &self.maps[i])
            .ok_or_else(|| ModelError::Checkpoint {
                path: "checkpoint".into(),
                msg: format!("tensor '{name}' not found"),
            })?;
        let err = |msg: String| ModelError::Checkpoint {
            path: path.display().to_string(),
            msg,
        };
        let st = SafeTensors::deserialize(map).map_err(|e| err(e.to_string()))?;
        let t = st.tensor(name).map_err(|e| err(e.to_string()))?;
        if t.shape() != shape {
            return Err(err(format!(
                "tensor '{name}' has shape {:?}, expected {shape:?}",
                t.shape()
            )));
        }
        let d = t.data();
        let out: Vec<f32> = match t.dtype() {
            Dtype::F32 => d
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => d
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => d
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F8_E4M3 => {
                let blocks = self.fp8.ok_or_else(|| {
                    err(format!(
                        "tensor '{name}' is F8_E4M3 but config.json has no quantization_config.weight_block_size"
                    ))
                })?;
                let (r, c) = (shape[0], shape[1]);
                let (br, bc) = (r.div_ceil(blocks.rows), c.div_ceil(blocks.cols));
                let scale = self.read(&format!("{name}_scale_inv"), &[br, bc])?;
                d.iter()
                    .enumerate()
                    .map(|(i, &b)| {
                        let (row, col) = (i / c, i % c);
                        fp8_e4m3(b) * scale[(row / blocks.rows) * bc + col / blocks.cols]
                    })
                    .collect()
            }
            other => {
                return Err(err(format!(
                    "tensor '{name}' has unsupported dtype {other:?}"
                )))
            }
        };
        Ok(out)
    }

    fn ffn(&self, names: [String; 3], hidden: usize, inter: usize) -> Result<Ffn, ModelError> {
        let [g, u, d] = names;
        Ok(Ffn::from_parts(
            self.read(&g, &[inter, hidden])?,
            self.read(&u, &[inter, hidden])?,
            self.read(&d, &[hidden, inter])?,
            inter,
        ))
    }
}

/// OCP FP8 E4M3FN (no infinities; 0x7F/0xFF are NaN).
pub fn fp8_e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0xF);
    let man = f32::from(b & 0x7);
    if exp == 0xF && b & 0x7 == 0x7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

pub fn load_weights(
    dir: &Path,
    spec: &MoeSpec,
    experts: Range<usize>,
) -> Result<RankWeights, ModelError> {
    let (_, fp8) = load_spec(dir)?;
    let ckpt = Checkpoint::open(dir, fp8)?;
    let (h, arch) = (spec.hidden, spec.architecture.as_str());
    let mut layers = Vec::with_capacity(spec.moe_layers.len());
    for &l in &spec.moe_layers {
        let router = ckpt.read(&router_name(arch, l), &[spec.num_experts, h])?;
        let bias = match spec.routing {
            Routing::SigmoidGroupTopK { .. } => Some(ckpt.read(
                &format!("model.layers.{l}.mlp.gate.e_score_correction_bias"),
                &[spec.num_experts],
            )?),
            Routing::SoftmaxTopK { .. } => None,
        };
        let experts = experts
            .clone()
            .map(|e| {
                let names = [Part::Gate, Part::Up, Part::Down].map(|p| expert_name(arch, l, e, p));
                ckpt.ffn(names, h, spec.intermediate)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let shared = if spec.shared_intermediate > 0 {
            let names = [Part::Gate, Part::Up, Part::Down]
                .map(|p| format!("model.layers.{l}.mlp.shared_experts.{}.weight", proj(p)));
            Some(ckpt.ffn(names, h, spec.shared_intermediate)?)
        } else {
            None
        };
        layers.push(LayerWeights {
            router,
            bias,
            experts,
            shared,
        });
    }
    Ok(RankWeights { layers, experts })
}

#[cfg(test)]
mod tests {
    use super::fp8_e4m3;

    #[test]
    fn fp8_e4m3_known_values() {
        assert_eq!(fp8_e4m3(0x38), 1.0); // exp 7, man 0
        assert_eq!(fp8_e4m3(0xB8), -1.0);
        assert_eq!(fp8_e4m3(0x7E), 448.0); // largest finite
        assert_eq!(fp8_e4m3(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(fp8_e4m3(0x3C), 1.5);
        assert!(fp8_e4m3(0x7F).is_nan());
    }
}
