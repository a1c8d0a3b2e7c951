//! Hugging Face checkpoints: `config.json` + `*.safetensors`, memory-mapped; a rank copies out only
//! the routers and its own experts, so its resident memory follows its share of the experts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::fp8;
use super::spec::{ModelError, MoeSpec, Routing};
use super::weights::{ExpertDtype, Ffn, LayerWeights, RankWeights};

pub const SUPPORTED: &[&str] = &[
    "mixtral (MixtralForCausalLM)",
    "qwen3_moe (Qwen3MoeForCausalLM)",
    "deepseek_v3 (DeepseekV3ForCausalLM)",
];

fn invalid(msg: impl Into<String>) -> ModelError {
    ModelError::Invalid(msg.into())
}

/// config.json as one transformers config class reads it: its keys, the aliases of its
/// `attribute_map` (either name may be saved), and its defaults for absent keys.
struct Cfg<'a> {
    v: &'a serde_json::Map<String, Value>,
    /// (alias, key) pairs: one setting under two names.
    aliases: &'static [(&'static str, &'static str)],
}

fn wrong(key: &str, v: &Value, want: &str) -> ModelError {
    invalid(format!("config.json: '{key}' is {v}, expected {want}"))
}

impl Cfg<'_> {
    /// The value of `key` or of its alias; both present and different is an error.
    fn get(&self, key: &str) -> Result<Option<&Value>, ModelError> {
        let mut found = self.v.get(key).map(|v| (key, v));
        for &(alias, canon) in self.aliases {
            let other = match key {
                k if k == canon => alias,
                k if k == alias => canon,
                _ => continue,
            };
            let Some(v) = self.v.get(other) else { continue };
            match found {
                Some((k, f)) if f != v => {
                    return Err(invalid(format!(
                        "config.json: '{k}' = {f} and '{other}' = {v} name one setting and disagree"
                    )))
                }
                Some(_) => {}
                None => found = Some((other, v)),
            }
        }
        Ok(found.map(|(_, v)| v))
    }
    /// A non-negative integer up to `limit(key)`; `default` when absent (None: required).
    fn usize(&self, key: &str, default: Option<usize>) -> Result<usize, ModelError> {
        let max = limit(key);
        match self.get(key)? {
            None => default.ok_or_else(|| invalid(format!("config.json: '{key}' is missing"))),
            Some(v) => {
                let n = v
                    .as_u64()
                    .ok_or_else(|| wrong(key, v, "a non-negative integer"))?;
                usize::try_from(n)
                    .ok()
                    .filter(|&n| n <= max)
                    .ok_or_else(|| wrong(key, v, &format!("at most {max}")))
            }
        }
    }
    fn bool(&self, key: &str, default: bool) -> Result<bool, ModelError> {
        match self.get(key)? {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| wrong(key, v, "true or false")),
        }
    }
    fn f32(&self, key: &str, default: f32) -> Result<f32, ModelError> {
        match self.get(key)? {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(|x| x as f32)
                .ok_or_else(|| wrong(key, v, "a number")),
        }
    }
    fn str(&self, key: &str, default: &'static str) -> Result<String, ModelError> {
        match self.get(key)? {
            None => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| wrong(key, v, "a string")),
        }
    }
    /// A list of layer indices; null or absent is empty (as transformers' `mlp_only_layers`).
    fn layers(&self, key: &str) -> Result<Vec<u32>, ModelError> {
        match self.get(key)? {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(v) => v
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                        .collect::<Option<Vec<u32>>>()
                })
                .ok_or_else(|| wrong(key, v, "a list of layer indices")),
        }
    }
    /// One of `allowed` (the first is the default); anything else is refused by name.
    fn one_of(&self, key: &str, allowed: &[&'static str], what: &str) -> Result<(), ModelError> {
        let v = self.str(key, allowed[0])?;
        if allowed.contains(&v.as_str()) {
            return Ok(());
        }
        Err(ModelError::Unsupported(format!(
            "config.json: {key} '{v}' is not supported ({what}: {})",
            allowed.join(", ")
        )))
    }
}

/// The largest value an integer of config.json may take: far past any released model, and small
/// enough that nothing derived from it wraps (layer indices are u32) or is built a billion times
/// over (the MoE layers are listed one by one).
fn limit(key: &str) -> usize {
    match key {
        "num_hidden_layers"
        | "first_k_dense_replace"
        | "moe_layer_freq"
        | "decoder_sparse_step" => 1 << 16,
        "hidden_size" | "intermediate_size" | "moe_intermediate_size" => 1 << 20,
        _ => 1 << 16,
    }
}

/// FP8 block quantization (DeepSeek-V3's `quantization_config`).
#[derive(Clone, Copy, Debug)]
pub struct Fp8Blocks {
    pub rows: usize,
    pub cols: usize,
}

/// `quantization_config`: none, or FP8 with a block size (as DeepSeek-V3 ships).
fn quantization(v: &serde_json::Map<String, Value>) -> Result<Option<Fp8Blocks>, ModelError> {
    let Some(q) = v.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    let q = q
        .as_object()
        .ok_or_else(|| wrong("quantization_config", q, "an object"))?;
    let c = Cfg { v: q, aliases: &[] };
    c.one_of("quant_method", &["fp8"], "supported quantization")?;
    c.one_of("fmt", &["e4m3"], "supported FP8 formats")?;
    let block = q.get("weight_block_size");
    let pair = block
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
        .filter(|&(r, c)| r > 0 && c > 0);
    match pair {
        Some((r, c)) => Ok(Some(Fp8Blocks {
            rows: r as usize,
            cols: c as usize,
        })),
        None => Err(wrong(
            "quantization_config.weight_block_size",
            block.unwrap_or(&Value::Null),
            "two positive integers",
        )),
    }
}

/// Reads `dir/config.json` into a spec, as transformers' config class of its `model_type` would:
/// absent keys take that class's defaults; a wrong type or an unsupported setting is an error.
pub fn load_spec(dir: &Path) -> Result<(MoeSpec, Option<Fp8Blocks>), ModelError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))?;
    let v = v
        .as_object()
        .ok_or_else(|| invalid(format!("{}: not a JSON object", path.display())))?;
    let model_type = Cfg { v, aliases: &[] }.str("model_type", "")?;
    // transformers' attribute_map of each class (MixtralConfig, Qwen3MoeConfig, DeepseekV3Config).
    let aliases: &'static [(&str, &str)] = match model_type.as_str() {
        "mixtral" | "qwen3_moe" => &[("num_experts", "num_local_experts")],
        "deepseek_v3" => &[("num_local_experts", "n_routed_experts")],
        _ => &[],
    };
    let c = Cfg { v, aliases };
    c.one_of("hidden_act", &["silu", "swish"], "experts are SwiGLU")?;
    let spec = match model_type.as_str() {
        "mixtral" => MoeSpec {
            architecture: "mixtral".into(),
            hidden: c.usize("hidden_size", Some(4096))?,
            intermediate: c.usize("intermediate_size", Some(14336))?,
            num_experts: c.usize("num_local_experts", Some(8))?,
            top_k: c.usize("num_experts_per_tok", Some(2))?,
            moe_layers: (0..c.usize("num_hidden_layers", Some(32))? as u32).collect(),
            routing: Routing::SoftmaxTopK { renormalize: true },
            shared_intermediate: 0,
            num_shared_experts: 0,
        },
        "qwen3_moe" => {
            let layers = c.usize("num_hidden_layers", Some(24))? as u32;
            let step = c.usize("decoder_sparse_step", Some(1))?.max(1) as u32;
            let dense = c.layers("mlp_only_layers")?;
            MoeSpec {
                architecture: "qwen3_moe".into(),
                hidden: c.usize("hidden_size", Some(2048))?,
                intermediate: c.usize("moe_intermediate_size", Some(768))?,
                num_experts: c.usize("num_experts", Some(128))?,
                top_k: c.usize("num_experts_per_tok", Some(8))?,
                moe_layers: (0..layers)
                    .filter(|i| !dense.contains(i) && (i + 1) % step == 0)
                    .collect(),
                routing: Routing::SoftmaxTopK {
                    renormalize: c.bool("norm_topk_prob", false)?,
                },
                shared_intermediate: 0,
                num_shared_experts: 0,
            }
        }
        "deepseek_v3" => {
            // DeepSeek's own config.json names these; transformers' modeling always runs them.
            c.one_of("scoring_func", &["sigmoid"], "supported scoring functions")?;
            c.one_of("topk_method", &["noaux_tc"], "supported top-k methods")?;
            let layers = c.usize("num_hidden_layers", Some(61))? as u32;
            let first_dense = c.usize("first_k_dense_replace", Some(3))? as u32;
            let freq = c.usize("moe_layer_freq", Some(1))?.max(1) as u32;
            let inter = c.usize("moe_intermediate_size", Some(2048))?;
            let shared = c.usize("n_shared_experts", Some(1))?;
            MoeSpec {
                architecture: "deepseek_v3".into(),
                hidden: c.usize("hidden_size", Some(7168))?,
                intermediate: inter,
                num_experts: c.usize("n_routed_experts", Some(256))?,
                top_k: c.usize("num_experts_per_tok", Some(8))?,
                moe_layers: (first_dense..layers).filter(|i| i % freq == 0).collect(),
                routing: Routing::SigmoidGroupTopK {
                    n_group: c.usize("n_group", Some(8))?,
                    topk_group: c.usize("topk_group", Some(4))?,
                    renormalize: c.bool("norm_topk_prob", true)?,
                    scaling: c.f32("routed_scaling_factor", 2.5)?,
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
    Ok((spec, quantization(v)?))
}

/// A cheap identity of a checkpoint: config.json, the index and every safetensors file's name,
/// size and header (tensor names, shapes, dtypes, offsets), hashed. Weights differing only in
/// values inside equal headers are not told apart; reading them all would cost minutes.
pub fn identity(dir: &Path) -> Result<String, ModelError> {
    use std::io::Read;
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| ModelError::Io { path, source }
    };
    let mut h = Fnv::default();
    for name in ["config.json", INDEX] {
        if let Ok(bytes) = std::fs::read(dir.join(name)) {
            h.add(name.as_bytes());
            h.add(&bytes);
        }
    }
    for path in safetensors_files(dir, index_map(dir)?.as_ref())? {
        let mut f = std::fs::File::open(&path).map_err(io(&path))?;
        let len = f.metadata().map_err(io(&path))?.len();
        let mut n = [0u8; 8];
        f.read_exact(&mut n).map_err(io(&path))?;
        let n = u64::from_le_bytes(n)
            .min(len.saturating_sub(8))
            .min(100 << 20);
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).map_err(io(&path))?;
        h.add(path.file_name().unwrap_or_default().as_encoded_bytes());
        h.add(&len.to_le_bytes());
        h.add(&header);
    }
    Ok(format!("{:016x}", h.0))
}

/// FNV-1a, 64 bit: the same on every rank and build.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn add(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
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
    /// Each file's header, parsed once at open (DeepSeek-V3's shards list thousands of tensors:
    /// parsing a header per tensor read cost more than the read), and where its data starts.
    headers: Vec<(safetensors::tensor::Metadata, usize)>,
    index: HashMap<String, usize>,
    fp8: Option<Fp8Blocks>,
    /// Bytes of tensor data read so far (the load rate's numerator).
    read: std::sync::atomic::AtomicU64,
}

/// transformers' index of a sharded checkpoint: which file holds which tensor.
const INDEX: &str = "model.safetensors.index.json";

/// The checkpoint's safetensors files, sorted: those the index (`index_map`) names when there is
/// one, else every `*.safetensors` in the directory.
fn safetensors_files(
    dir: &Path,
    index: Option<&HashMap<String, String>>,
) -> Result<Vec<PathBuf>, ModelError> {
    let bad = |msg: String| ModelError::Checkpoint {
        path: dir.join(INDEX).display().to_string(),
        msg,
    };
    let mut files: Vec<PathBuf> = match index {
        Some(map) => {
            let mut names: Vec<&str> = map.values().map(String::as_str).collect();
            names.sort_unstable();
            names.dedup();
            names
                .into_iter()
                .map(|n| match Path::new(n).file_name() {
                    // A bare file name: nothing outside the checkpoint directory is read.
                    Some(f) if f == n => Ok(dir.join(n)),
                    _ => Err(bad(format!("'{n}' is not a file name in the checkpoint"))),
                })
                .collect::<Result<_, _>>()?
        }
        None => std::fs::read_dir(dir)
            .map_err(|source| ModelError::Io {
                path: dir.display().to_string(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect(),
    };
    files.sort();
    if files.is_empty() {
        return Err(ModelError::Checkpoint {
            path: dir.display().to_string(),
            msg: "no *.safetensors files".into(),
        });
    }
    Ok(files)
}

/// The index's `weight_map` (tensor name → file name), when the checkpoint has an index.
fn index_map(dir: &Path) -> Result<Option<HashMap<String, String>>, ModelError> {
    let path = dir.join(INDEX);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ModelError::Io {
                path: path.display().to_string(),
                source,
            })
        }
    };
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let index: Index = serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint {
        path: path.display().to_string(),
        msg: format!("not a safetensors index ({e})"),
    })?;
    Ok(Some(index.weight_map))
}

impl Checkpoint {
    fn open(dir: &Path, fp8: Option<Fp8Blocks>) -> Result<Self, ModelError> {
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| ModelError::Io { path, source }
        };
        let listed = index_map(dir)?;
        let files = safetensors_files(dir, listed.as_ref())?;
        let (mut maps, mut headers) = (Vec::new(), Vec::new());
        let mut index: HashMap<String, usize> = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(io(&path))?;
            // Read-only input, mapped only while loading.
            let map = crate::sys::map_file(&file).map_err(io(&path))?;
            let err = |msg: String| ModelError::Checkpoint {
                path: path.display().to_string(),
                msg,
            };
            let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| err(e.to_string()))?;
            let file_name = path.file_name().unwrap_or_default().to_string_lossy();
            for name in meta.offset_keys() {
                let name = name.as_str();
                // With an index, a file's tensor that the index places elsewhere is not ours.
                if listed
                    .as_ref()
                    .is_some_and(|m| m.get(name).is_none_or(|f| *f != file_name))
                {
                    continue;
                }
                if let Some(&other) = index.get(name) {
                    return Err(err(format!(
                        "tensor '{name}' is also in {}: which one to load is ambiguous",
                        maps_path(&maps, other)
                    )));
                }
                index.insert(name.to_string(), maps.len());
            }
            maps.push((path, map));
            headers.push((meta, 8 + n));
        }
        if let Some(m) = &listed {
            if let Some((name, file)) = m.iter().find(|(n, _)| !index.contains_key(*n)) {
                return Err(ModelError::Checkpoint {
                    path: dir.join(INDEX).display().to_string(),
                    msg: format!("tensor '{name}' is listed in {file}, which does not hold it"),
                });
            }
        }
        Ok(Self {
            maps,
            headers,
            index,
            fp8,
            read: Default::default(),
        })
    }

    /// One tensor's view and the file it is in.
    fn tensor(
        &self,
        name: &str,
    ) -> Result<(&Path, safetensors::tensor::TensorView<'_>), ModelError> {
        let i = *self.index.get(name).ok_or_else(|| ModelError::Checkpoint {
            path: "checkpoint".into(),
            msg: format!("tensor '{name}' not found"),
        })?;
        let ((path, map), (meta, start)) = (&self.maps[i], &self.headers[i]);
        let bad = |msg: String| ModelError::Checkpoint {
            path: path.display().to_string(),
            msg,
        };
        let info = meta
            .info(name)
            .ok_or_else(|| bad(format!("tensor '{name}' not in its file's header")))?;
        // read_metadata checked every tensor's offsets against the file's length.
        let (a, b) = info.data_offsets;
        let data = map
            .get(start + a..start + b)
            .ok_or_else(|| bad(format!("tensor '{name}' lies past the end of the file")))?;
        let t = safetensors::tensor::TensorView::new(info.dtype, info.shape.clone(), data)
            .map_err(|e| bad(format!("tensor '{name}': {e}")))?;
        self.read
            .fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok((path, t))
    }

    /// Copies one tensor out as f32, checking its shape.
    fn read(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (path, t) = self.tensor(name)?;
        self.values((path, &t), name, shape)
    }

    /// `read`, appended to `out` (gate and up into one matrix, with no copy of the first).
    fn read_into(&self, name: &str, shape: &[usize], out: &mut Vec<f32>) -> Result<(), ModelError> {
        let (path, t) = self.tensor(name)?;
        self.values_into((path, &t), name, shape, out)
    }

    /// `read`, of a tensor already found.
    fn values(
        &self,
        found: (&Path, &safetensors::tensor::TensorView<'_>),
        name: &str,
        shape: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::new();
        self.values_into(found, name, shape, &mut out)?;
        Ok(out)
    }

    /// `values`, appended to `out`.
    fn values_into(
        &self,
        (path, t): (&Path, &safetensors::tensor::TensorView<'_>),
        name: &str,
        shape: &[usize],
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let err = |msg: String| ModelError::Checkpoint {
            path: path.display().to_string(),
            msg,
        };
        if t.shape() != shape {
            return Err(err(format!(
                "tensor '{name}' has shape {:?}, expected {shape:?}",
                t.shape()
            )));
        }
        let d = t.data();
        match t.dtype() {
            Dtype::F32 => out.extend(
                d.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            Dtype::BF16 => out.extend(
                d.chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            Dtype::F16 => out.extend(
                d.chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            Dtype::F8_E4M3 => out.extend(self.read_dequantized((path, t), name, shape)?),
            other => {
                return Err(err(format!(
                    "tensor '{name}' has unsupported dtype {other:?}"
                )))
            }
        }
        Ok(())
    }

    /// An F8_E4M3 weight's bytes, its `weight_scale_inv` and their block size, checked: 2-D
    /// only, every byte a finite E4M3 value, every scale finite and not negative.
    fn fp8_parts(
        &self,
        (path, t): (&Path, &safetensors::tensor::TensorView<'_>),
        name: &str,
        shape: &[usize],
    ) -> Result<(Vec<u8>, Vec<f32>, Fp8Blocks), ModelError> {
        let err = |msg: String| ModelError::Checkpoint {
            path: path.display().to_string(),
            msg,
        };
        let (&[r, c], &[_, _]) = (shape, t.shape()) else {
            return Err(err(format!(
                "tensor '{name}' is F8_E4M3 with shape {:?}: FP8 is read only for 2-D weights with block scales",
                t.shape()
            )));
        };
        if t.shape() != shape {
            return Err(err(format!(
                "tensor '{name}' has shape {:?}, expected {shape:?}",
                t.shape()
            )));
        }
        let blocks = self.fp8.ok_or_else(|| {
            err(format!(
                "tensor '{name}' is F8_E4M3 but config.json has no quantization_config.weight_block_size"
            ))
        })?;
        let q = t.data().to_vec();
        if let Some(i) = q.iter().position(|&b| b & 0x7F == 0x7F) {
            return Err(err(format!(
                "tensor '{name}' holds an FP8 NaN at row {}, column {}",
                i / c,
                i % c
            )));
        }
        let (br, bc) = (r.div_ceil(blocks.rows), c.div_ceil(blocks.cols));
        let scale_name = format!("{name}_scale_inv");
        let scales = self.read(&scale_name, &[br, bc])?;
        if let Some(i) = scales.iter().position(|s| !s.is_finite() || *s < 0.0) {
            return Err(err(format!(
                "tensor '{scale_name}' holds {} at block ({}, {}): scales must be finite and not negative",
                scales[i],
                i / bc,
                i % bc
            )));
        }
        Ok((q, scales, blocks))
    }

    /// An F8_E4M3 weight dequantized (`q * scale` of its block), any block size.
    fn read_dequantized(
        &self,
        tensor: (&Path, &safetensors::tensor::TensorView<'_>),
        name: &str,
        shape: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        let (q, scales, blocks) = self.fp8_parts(tensor, name, shape)?;
        let c = shape[1];
        let bc = c.div_ceil(blocks.cols);
        Ok(q.iter()
            .enumerate()
            .map(|(i, &b)| {
                let (row, col) = (i / c, i % c);
                fp8::decode(b) * scales[(row / blocks.rows) * bc + col / blocks.cols]
            })
            .collect())
    }

    /// A weight as FP8 blocks: an F8_E4M3 tensor as shipped (128x128 blocks: `ExpertDtype::
    /// resolve` keeps FP8 for no other), any other dtype quantized at load.
    fn read_fp8(&self, name: &str, shape: [usize; 2]) -> Result<fp8::Blocks, ModelError> {
        let (path, t) = self.tensor(name)?;
        if t.dtype() != Dtype::F8_E4M3 {
            return Ok(fp8::Blocks::quantize(
                &self.values((path, &t), name, &shape)?,
                shape[0],
                shape[1],
            ));
        }
        let (q, scales, blocks) = self.fp8_parts((path, &t), name, &shape)?;
        if (blocks.rows, blocks.cols) != (fp8::BLOCK, fp8::BLOCK) {
            return Err(ModelError::Checkpoint {
                path: path.display().to_string(),
                msg: format!(
                    "tensor '{name}' has {}x{} FP8 blocks; FP8 experts take {b}x{b}",
                    blocks.rows,
                    blocks.cols,
                    b = fp8::BLOCK
                ),
            });
        }
        Ok(fp8::Blocks {
            rows: shape[0],
            cols: shape[1],
            q,
            scales,
        })
    }

    /// One FFN from its gate, up and down tensors, held as `dtype` says.
    fn ffn(
        &self,
        names: [String; 3],
        hidden: usize,
        inter: usize,
        dtype: ExpertDtype,
    ) -> Result<Ffn, ModelError> {
        let [g, u, d] = names;
        Ok(match dtype {
            ExpertDtype::Bf16 => {
                let mut gate_up = Vec::with_capacity(2 * inter * hidden);
                self.read_into(&g, &[inter, hidden], &mut gate_up)?;
                self.read_into(&u, &[inter, hidden], &mut gate_up)?;
                Ffn::from_gate_up(gate_up, self.read(&d, &[hidden, inter])?, inter)
            }
            ExpertDtype::Fp8 => Ffn::from_fp8(
                self.read_fp8(&g, [inter, hidden])?,
                self.read_fp8(&u, [inter, hidden])?,
                self.read_fp8(&d, [hidden, inter])?,
                inter,
            ),
        })
    }
}

fn maps_path(maps: &[(PathBuf, memmap2::Mmap)], i: usize) -> String {
    maps[i].0.display().to_string()
}

/// `experts[i]`: the routed experts to load of MoE layer `i`, in slot order.
pub fn load_weights(
    dir: &Path,
    spec: &MoeSpec,
    experts: &[Vec<usize>],
    dtype: ExpertDtype,
    loaded: &mut dyn FnMut(&LayerWeights),
) -> Result<RankWeights, ModelError> {
    let (_, fp8) = load_spec(dir)?;
    let t0 = std::time::Instant::now();
    let ckpt = Checkpoint::open(dir, fp8)?;
    let (h, arch) = (spec.hidden, spec.architecture.as_str());
    let mut layers = Vec::with_capacity(spec.moe_layers.len());
    for (&l, mine) in spec.moe_layers.iter().zip(experts) {
        let router = ckpt.read(&router_name(arch, l), &[spec.num_experts, h])?;
        let bias = match spec.routing {
            Routing::SigmoidGroupTopK { .. } => Some(ckpt.read(
                &format!("model.layers.{l}.mlp.gate.e_score_correction_bias"),
                &[spec.num_experts],
            )?),
            Routing::SoftmaxTopK { .. } => None,
        };
        // Experts on the load pool's threads: several ranges of the files read (page faults
        // served) and converted at once. (Asking the kernel for the pages ahead, MADV_WILLNEED
        // or MADV_POPULATE_READ, measured no faster warm and slower cold: docs/benchmarks.md.)
        let names: Vec<[String; 3]> = mine
            .iter()
            .map(|&e| [Part::Gate, Part::Up, Part::Down].map(|p| expert_name(arch, l, e, p)))
            .collect();
        let experts = names
            .into_par_iter()
            .map(|names| ckpt.ffn(names, h, spec.intermediate, dtype))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = if spec.shared_intermediate > 0 {
            let names = [Part::Gate, Part::Up, Part::Down]
                .map(|p| format!("model.layers.{l}.mlp.shared_experts.{}.weight", proj(p)));
            Some(ckpt.ffn(names, h, spec.shared_intermediate, dtype)?)
        } else {
            None
        };
        let layer = LayerWeights {
            router,
            bias,
            experts,
            shared,
        };
        loaded(&layer);
        layers.push(layer);
    }
    let (bytes, secs) = (
        ckpt.read.load(std::sync::atomic::Ordering::Relaxed),
        t0.elapsed().as_secs_f64(),
    );
    tracing::info!(
        bytes,
        seconds = format!("{secs:.2}"),
        gb_per_s = format!("{:.2}", bytes as f64 / secs.max(1e-9) / 1e9),
        threads = rayon::current_num_threads(),
        "checkpoint read"
    );
    Ok(RankWeights { layers, dtype })
}

/// Routed experts `(layer index, expert)` alone, as `load_weights` reads them (a move's
/// weights, read again from the checkpoint).
pub fn load_experts(
    dir: &Path,
    spec: &MoeSpec,
    wanted: &[(usize, usize)],
    dtype: ExpertDtype,
) -> Result<Vec<Ffn>, ModelError> {
    let (_, fp8) = load_spec(dir)?;
    let ckpt = Checkpoint::open(dir, fp8)?;
    let arch = spec.architecture.as_str();
    wanted
        .par_iter()
        .map(|&(i, e)| {
            let l = spec.moe_layers[i];
            let names = [Part::Gate, Part::Up, Part::Down].map(|p| expert_name(arch, l, e, p));
            ckpt.ffn(names, spec.hidden, spec.intermediate, dtype)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory holding `config` as config.json.
    fn dir_with(tag: &str, config: &Value) -> PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("epserve-hf-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.json"), config.to_string()).unwrap();
        d
    }

    fn spec(config: Value) -> Result<MoeSpec, ModelError> {
        let d = dir_with("cfg", &config);
        let r = load_spec(&d).map(|(s, _)| s);
        std::fs::remove_dir_all(&d).unwrap();
        r
    }

    fn err(config: Value) -> String {
        spec(config).unwrap_err().to_string()
    }

    #[test]
    fn absent_keys_take_the_transformers_class_defaults() {
        let m = spec(serde_json::json!({"model_type": "mixtral"})).unwrap();
        assert_eq!(
            (
                m.hidden,
                m.intermediate,
                m.num_experts,
                m.top_k,
                m.moe_layers.len()
            ),
            (4096, 14336, 8, 2, 32)
        );
        let q =
            spec(serde_json::json!({"model_type": "qwen3_moe", "mlp_only_layers": null})).unwrap();
        assert_eq!(
            (
                q.hidden,
                q.intermediate,
                q.num_experts,
                q.top_k,
                q.moe_layers.len()
            ),
            (2048, 768, 128, 8, 24)
        );
        assert_eq!(q.routing, Routing::SoftmaxTopK { renormalize: false });
        let d = spec(serde_json::json!({"model_type": "deepseek_v3"})).unwrap();
        assert_eq!(
            (
                d.hidden,
                d.intermediate,
                d.num_experts,
                d.top_k,
                d.num_shared_experts
            ),
            (7168, 2048, 256, 8, 1)
        );
        assert_eq!(d.moe_layers, (3..61).collect::<Vec<u32>>());
        assert_eq!(
            d.routing,
            Routing::SigmoidGroupTopK {
                n_group: 8,
                topk_group: 4,
                renormalize: true,
                scaling: 2.5
            }
        );
    }

    #[test]
    fn attribute_map_aliases_are_read_and_must_agree() {
        let small = |t: &str, key: &str| {
            serde_json::json!({"model_type": t, "hidden_size": 64, key: 16, "num_experts_per_tok": 2,
                "num_hidden_layers": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 0})
        };
        // Qwen3MoeConfig saves its expert count as num_local_experts.
        assert_eq!(
            spec(small("qwen3_moe", "num_local_experts"))
                .unwrap()
                .num_experts,
            16
        );
        assert_eq!(
            spec(small("mixtral", "num_experts")).unwrap().num_experts,
            16
        );
        assert_eq!(
            spec(small("deepseek_v3", "num_local_experts"))
                .unwrap()
                .num_experts,
            16
        );
        let mut both = small("deepseek_v3", "num_local_experts");
        both["n_routed_experts"] = 32.into();
        let e = err(both);
        assert!(e.contains("name one setting and disagree"), "{e}");
    }

    #[test]
    fn wrong_types_and_unsupported_settings_are_refused_by_name() {
        let cases = [
            (
                serde_json::json!({"model_type": "mixtral", "hidden_size": "4096"}),
                "'hidden_size' is \"4096\", expected a non-negative integer",
            ),
            (
                serde_json::json!({"model_type": "mixtral", "num_local_experts": 8.5}),
                "'num_local_experts' is 8.5",
            ),
            (
                serde_json::json!({"model_type": "qwen3_moe", "norm_topk_prob": 1}),
                "'norm_topk_prob' is 1, expected true or false",
            ),
            (
                serde_json::json!({"model_type": "qwen3_moe", "mlp_only_layers": "0"}),
                "expected a list of layer indices",
            ),
            (
                serde_json::json!({"model_type": "deepseek_v3", "routed_scaling_factor": "2.5"}),
                "'routed_scaling_factor' is \"2.5\", expected a number",
            ),
            (
                serde_json::json!({"model_type": "deepseek_v3", "n_group": null}),
                "'n_group' is null",
            ),
            (
                serde_json::json!({"model_type": "mixtral", "hidden_act": "gelu"}),
                "hidden_act 'gelu' is not supported",
            ),
            (
                serde_json::json!({"model_type": "deepseek_v3", "topk_method": "greedy"}),
                "topk_method 'greedy' is not supported",
            ),
            (
                serde_json::json!({"model_type": "deepseek_v3", "scoring_func": "softmax"}),
                "scoring_func 'softmax' is not supported",
            ),
            (
                serde_json::json!({"model_type": "mixtral", "quantization_config": {"quant_method": "gptq"}}),
                "quant_method 'gptq' is not supported",
            ),
            (
                serde_json::json!({"model_type": "mixtral", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}),
                "weight_block_size",
            ),
            (serde_json::json!({"model_type": 3}), "'model_type' is 3"),
            // Counts that wrapped as u32 (2^32 + 1 layers served one) or allocated without end.
            (
                serde_json::json!({"model_type": "mixtral", "num_hidden_layers": 4294967297u64}),
                "'num_hidden_layers' is 4294967297, expected at most 65536",
            ),
            (
                serde_json::json!({"model_type": "qwen3_moe", "num_hidden_layers": 1_000_000_000_000u64}),
                "'num_hidden_layers' is 1000000000000, expected at most 65536",
            ),
            (
                serde_json::json!({"model_type": "deepseek_v3", "first_k_dense_replace": 4294967295u64}),
                "'first_k_dense_replace' is 4294967295",
            ),
            (
                serde_json::json!({"model_type": "deepseek_v3", "moe_layer_freq": 4294967296u64}),
                "'moe_layer_freq' is 4294967296",
            ),
            (
                serde_json::json!({"model_type": "mixtral", "hidden_size": 1u64 << 40}),
                "'hidden_size' is 1099511627776, expected at most 1048576",
            ),
        ];
        for (config, want) in cases {
            let e = err(config.clone());
            assert!(e.contains(want), "{config}: '{e}' lacks '{want}'");
        }
        // The defaults DeepSeek ships are accepted.
        let ok = serde_json::json!({"model_type": "deepseek_v3", "hidden_act": "silu",
            "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}});
        spec(ok).unwrap();
    }

    fn write_tensors(path: &Path, names: &[&str]) {
        let data = vec![0u8; 8];
        let views: Vec<(String, safetensors::tensor::TensorView)> = names
            .iter()
            .map(|n| {
                let v = safetensors::tensor::TensorView::new(Dtype::F32, vec![2], &data).unwrap();
                (n.to_string(), v)
            })
            .collect();
        std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
    }

    #[test]
    fn the_index_is_honoured_and_a_tensor_in_two_files_is_refused() {
        let d = dir_with("index", &serde_json::json!({}));
        write_tensors(&d.join("a.safetensors"), &["x", "y"]);
        write_tensors(&d.join("b.safetensors"), &["y", "z"]);
        let e = Checkpoint::open(&d, None).err().unwrap().to_string();
        assert!(e.contains("tensor 'y' is also in"), "{e}");
        // The index says where each tensor is: b's copy of y is not read; a file it does not
        // name (an old shard left beside) is not read at all.
        write_tensors(&d.join("old.safetensors"), &["x", "z"]);
        let index = |map: Value| {
            std::fs::write(
                d.join(INDEX),
                serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
            )
            .unwrap();
        };
        index(
            serde_json::json!({"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}),
        );
        let c = Checkpoint::open(&d, None).unwrap();
        assert_eq!(c.maps.len(), 2);
        assert_eq!(c.maps[c.index["y"]].0, d.join("a.safetensors"));
        assert_eq!(c.maps[c.index["z"]].0, d.join("b.safetensors"));
        // The identity follows the files: a changed index changes it.
        let before = identity(&d).unwrap();
        index(
            serde_json::json!({"x": "a.safetensors", "y": "a.safetensors", "z": "old.safetensors"}),
        );
        assert_ne!(identity(&d).unwrap(), before);
        index(serde_json::json!({"x": "a.safetensors", "w": "b.safetensors"}));
        let e = Checkpoint::open(&d, None).err().unwrap().to_string();
        assert!(e.contains("tensor 'w' is listed in b.safetensors"), "{e}");
        index(serde_json::json!({"x": "../a.safetensors"}));
        let e = Checkpoint::open(&d, None).err().unwrap().to_string();
        assert!(e.contains("not a file name in the checkpoint"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// One F8_E4M3 tensor `w` (`shape`, `bytes`) with its `w_scale_inv` (`scales`, `[r, c]`).
    fn fp8_checkpoint(
        shape: Vec<usize>,
        bytes: Vec<u8>,
        scales: (&[f32], [usize; 2]),
        block: usize,
    ) -> (PathBuf, Checkpoint) {
        let d = dir_with("fp8", &serde_json::json!({}));
        let s: Vec<u8> = scales.0.iter().flat_map(|x| x.to_le_bytes()).collect();
        let views = vec![
            (
                "w".to_string(),
                safetensors::tensor::TensorView::new(Dtype::F8_E4M3, shape, &bytes).unwrap(),
            ),
            (
                "w_scale_inv".to_string(),
                safetensors::tensor::TensorView::new(Dtype::F32, scales.1.to_vec(), &s).unwrap(),
            ),
        ];
        std::fs::write(
            d.join("m.safetensors"),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
        let blocks = Fp8Blocks {
            rows: block,
            cols: block,
        };
        let c = Checkpoint::open(&d, Some(blocks)).unwrap();
        (d, c)
    }

    #[test]
    fn fp8_weights_are_kept_as_shipped_and_bad_ones_refused_by_name() {
        // As shipped: 128x128 blocks, the bytes and scales kept; a value reads as q * scale.
        let bytes: Vec<u8> = (0..256 * 128).map(|i| (i % 0x7E) as u8).collect();
        let (d, c) = fp8_checkpoint(vec![256, 128], bytes.clone(), (&[0.5, 2.0], [2, 1]), 128);
        let b = c.read_fp8("w", [256, 128]).unwrap();
        assert_eq!((b.q, b.scales.clone()), (bytes, vec![0.5, 2.0]));
        let v = c.read("w", &[256, 128]).unwrap();
        assert_eq!(
            v[200 * 128 + 3],
            fp8::decode(((200 * 128 + 3) % 0x7E) as u8) * 2.0
        );
        std::fs::remove_dir_all(&d).unwrap();
        // Other block sizes are read as values, never kept as FP8 experts.
        let (d, c) = fp8_checkpoint(vec![32, 32], vec![0x38; 1024], (&[1.0; 4], [2, 2]), 16);
        assert_eq!(c.read("w", &[32, 32]).unwrap(), vec![1.0; 1024]);
        let e = c.read_fp8("w", [32, 32]).unwrap_err().to_string();
        assert!(
            e.contains("has 16x16 FP8 blocks; FP8 experts take 128x128"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
        // Not 2-D (a 1-D bias stored in FP8): refused by name, no panic.
        let (d, c) = fp8_checkpoint(vec![16], vec![0x38; 16], (&[1.0], [1, 1]), 128);
        let e = c.read("w", &[16]).unwrap_err().to_string();
        assert!(
            e.contains("tensor 'w' is F8_E4M3 with shape [16]: FP8 is read only for 2-D"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
        // A NaN byte, and a negative or non-finite scale.
        let mut nan = vec![0x38u8; 128 * 128];
        nan[130] = 0xFF;
        let (d, c) = fp8_checkpoint(vec![128, 128], nan, (&[1.0], [1, 1]), 128);
        let e = c.read("w", &[128, 128]).unwrap_err().to_string();
        assert!(e.contains("holds an FP8 NaN at row 1, column 2"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
        for bad in [-1.0, f32::INFINITY, f32::NAN] {
            let (d, c) =
                fp8_checkpoint(vec![128, 128], vec![0x38; 128 * 128], (&[bad], [1, 1]), 128);
            let e = c.read_fp8("w", [128, 128]).unwrap_err().to_string();
            assert!(
                e.contains("tensor 'w_scale_inv' holds") && e.contains("at block (0, 0)"),
                "{e}"
            );
            std::fs::remove_dir_all(&d).unwrap();
        }
    }
}
