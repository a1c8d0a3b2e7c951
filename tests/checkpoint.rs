//! Hugging Face-layout checkpoints written by the test from random weights (real tensor names,
//! dense layers, several files, bf16 / f32 / block-scaled FP8) give the same outputs as the same
//! weights held in memory; and a rank's memory follows its own experts.

mod common;

use std::collections::HashMap;

use common::reference::{compare, compare_tokens, RefFfn, RefLayer};
use common::*;
use epserve::model::{MoeSpec, Routing};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Tensors to write: name → (dtype, shape, bytes).
#[derive(Default)]
struct Ckpt(Vec<(String, Dtype, Vec<usize>, Vec<u8>)>);

impl Ckpt {
    /// bf16 tensor of uniform values; returns the values as stored (bf16-rounded), in f64.
    fn bf16(
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
    fn f32(&mut self, rng: &mut ChaCha8Rng, name: String, shape: &[usize], scale: f64) -> Vec<f64> {
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
    fn fp8(
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
    fn write(&self, dir: &std::path::Path, files: usize) {
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

struct Arch {
    model_type: &'static str,
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
    layers: u32,
    dense: Vec<u32>,
    fp8_block: Option<usize>,
}

/// Writes a checkpoint of `a` and returns (spec as the test expects it, reference layers).
fn write_model(dir: &std::path::Path, a: &Arch, seed: u64) -> (MoeSpec, Vec<RefLayer>) {
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
fn fp8_reference(refs: &mut [RefLayer], a: &Arch) {
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

async fn check(a: Arch, seed: u64) {
    check_as(a, seed, &[], "bf16").await;
}

/// Serves the checkpoint with `extra` flags, expecting experts of `dtype`, and checks every
/// token of each MoE layer against the reference of that dtype.
async fn check_as(a: Arch, seed: u64, extra: &[&str], dtype: &str) {
    let dir = TempDir::new(a.model_type);
    let (spec, mut refs) = write_model(&dir.0, &a, seed);
    if dtype == "fp8" {
        fp8_reference(&mut refs, &a);
    }
    let mut args = vec!["--max-tokens-per-step", "32"];
    args.extend_from_slice(extra);
    let group = Group::launch(2, &dir.0.display().to_string(), &args);
    let mut c = group.client().await;
    let info = c
        .get_model_info(epserve::proto::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            info.moe_layers.clone(),
            info.architecture.as_str(),
            info.expert_dtype.as_str()
        ),
        (spec.moe_layers.clone(), a.model_type, dtype)
    );
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
    for (slot, &layer) in spec.moe_layers.iter().enumerate() {
        let n = 45;
        let x: Vec<f32> = (0..n * spec.hidden)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let out = c
            .forward(request("ck", layer, f32_tensor(&x, [n, spec.hidden])))
            .await
            .unwrap()
            .into_inner();
        let xs: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let out = decode(out.output.as_ref().unwrap());
        let (err, excluded) = compare(&spec, &refs[slot], &xs, &out, None);
        assert!(
            err <= 1e-5 && excluded <= 1,
            "{} layer {layer}: error {err:.3e}, {excluded} near-ties",
            a.model_type
        );
        let (err, token, _) = compare_tokens(&spec, &refs[slot], &xs, &out, None);
        assert!(
            err <= 1e-5,
            "{} layer {layer}: token {token} is {err:.3e} from the reference",
            a.model_type
        );
    }
    for dense in &a.dense {
        let e = c
            .forward(request(
                "d",
                *dense,
                f32_tensor(&vec![0.1; spec.hidden], [1, spec.hidden]),
            ))
            .await
            .unwrap_err();
        assert!(e.message().contains("is not an MoE layer"), "{e:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_moe_checkpoint() {
    check(
        Arch {
            model_type: "qwen3_moe",
            hidden: 64,
            inter: 48,
            experts: 8,
            top_k: 2,
            layers: 3,
            dense: vec![0],
            fp8_block: None,
        },
        21,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v3_checkpoint_with_fp8_experts() {
    check(
        Arch {
            model_type: "deepseek_v3",
            hidden: 64,
            inter: 48,
            experts: 16,
            top_k: 4,
            layers: 3,
            dense: vec![0],
            fp8_block: Some(16),
        },
        22,
    )
    .await;
}

/// DeepSeek-V3 as it ships: FP8 experts in 128x128 blocks, served as FP8 by default (`auto`),
/// the routed experts' bytes as shipped and the bf16 shared expert quantized at load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v3_fp8_checkpoint_served_fp8() {
    check_as(deepseek_fp8_128(), 24, &[], "fp8").await;
}

/// The same checkpoint with `--expert-dtype bf16`: dequantized at load, as before FP8 experts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v3_fp8_checkpoint_dequantized_on_request() {
    check_as(deepseek_fp8_128(), 25, &["--expert-dtype", "bf16"], "bf16").await;
}

fn deepseek_fp8_128() -> Arch {
    Arch {
        model_type: "deepseek_v3",
        hidden: 256,
        inter: 128,
        experts: 16,
        top_k: 4,
        layers: 2,
        dense: vec![0],
        fp8_block: Some(128),
    }
}

/// A bf16 Mixtral checkpoint with `--expert-dtype fp8`: quantized in 128x128 blocks at load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixtral_checkpoint_quantized_to_fp8_at_load() {
    let a = Arch {
        model_type: "mixtral",
        hidden: 128,
        inter: 256,
        experts: 8,
        top_k: 2,
        layers: 2,
        dense: vec![],
        fp8_block: None,
    };
    check_as(a, 26, &["--expert-dtype", "fp8"], "fp8").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixtral_checkpoint() {
    check(
        Arch {
            model_type: "mixtral",
            hidden: 64,
            inter: 96,
            experts: 8,
            top_k: 2,
            layers: 2,
            dense: vec![],
            fp8_block: None,
        },
        23,
    )
    .await;
}

/// Resident memory of a process, less its shared-memory mappings (the exchange buffers).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = |key: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap()
            .parse()
            .unwrap()
    };
    (kb("VmRSS:") - kb("RssShmem:")) * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_memory_follows_its_own_experts() {
    let dir = TempDir::new("rss");
    let a = Arch {
        model_type: "qwen3_moe",
        hidden: 256,
        inter: 512,
        experts: 16,
        top_k: 2,
        layers: 2,
        dense: vec![],
        fp8_block: None,
    };
    write_model(&dir.0, &a, 31);
    let expert_bytes = (a.layers as usize * a.experts * 3 * a.hidden * a.inter * 4) as u64; // as f32 in memory
    let model = dir.0.display().to_string();
    let mut rss = HashMap::new();
    for world in [1usize, 4] {
        let group = Group::launch(world, &model, &["--max-tokens-per-step", "8"]);
        let pids = group.proc.children();
        assert_eq!(pids.len(), world);
        rss.insert(world, pids.iter().map(|&p| rss_bytes(p)).max().unwrap());
    }
    // One rank of four holds a quarter of the experts: at least half of the model less than a
    // single rank that holds them all.
    assert!(
        rss[&4] + expert_bytes / 2 < rss[&1],
        "rss: 1 rank {} B, 4 ranks {} B each at most; experts {expert_bytes} B",
        rss[&1],
        rss[&4]
    );
}

/// `epserve serve` of one rank on `dir`: its exit status and log, once it has exited.
fn serve_exit(dir: &std::path::Path) -> (std::process::ExitStatus, String) {
    let shm = TempDir::new("shm");
    let model = dir.display().to_string();
    let mut p = Proc::spawn(&serve_args(&shm, &["--model", &model]));
    let status = p
        .wait_exit(std::time::Duration::from_secs(60))
        .expect("the rank exits");
    (status, p.log_text())
}

/// Checkpoints that once panicked a rank (an FP8 tensor that is not 2-D, read as a weight) or
/// wrapped a layer count (2^32 + 1 layers served one): each refused at startup with exit 1,
/// naming the tensor or the key.
#[test]
fn a_1d_fp8_tensor_and_a_wrapping_layer_count_are_refused_by_name() {
    let dir = TempDir::new("fp8-1d");
    let (h, e) = (128usize, 16usize);
    let config = serde_json::json!({"model_type": "deepseek_v3", "hidden_size": h,
        "n_routed_experts": e, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "first_k_dense_replace": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}});
    std::fs::write(dir.0.join("config.json"), config.to_string()).unwrap();
    let router = vec![0u8; e * h * 2];
    let bias = vec![0x38u8; e];
    let views = vec![
        (
            "model.layers.1.mlp.gate.weight".to_string(),
            TensorView::new(Dtype::BF16, vec![e, h], &router).unwrap(),
        ),
        (
            "model.layers.1.mlp.gate.e_score_correction_bias".to_string(),
            TensorView::new(Dtype::F8_E4M3, vec![e], &bias).unwrap(),
        ),
    ];
    std::fs::write(
        dir.0.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let (status, log) = serve_exit(&dir.0);
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains(
            "tensor 'model.layers.1.mlp.gate.e_score_correction_bias' is F8_E4M3 with shape [16]"
        ),
        "{log}"
    );
    assert!(!log.contains("panicked"), "{log}");

    let config = serde_json::json!({"model_type": "mixtral", "num_hidden_layers": 4294967297u64});
    std::fs::write(dir.0.join("config.json"), config.to_string()).unwrap();
    let (status, log) = serve_exit(&dir.0);
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("'num_hidden_layers' is 4294967297, expected at most 65536"),
        "{log}"
    );
}
