//! `epserve bench`: the GPU step and each of its phases timed with CUDA events on every GPU of
//! the machine (one thread and NCCL rank per GPU), graphs on, for named configs; plus dense cuBLAS
//! GEMMs of the same shapes in the same run, so the grouped GEMM has a yardstick.

use serde::Serialize;

use crate::config::BenchArgs;

/// A named benchmark shape.
#[derive(Clone, Debug, Serialize)]
pub struct BenchConfig {
    pub name: String,
    pub tokens_per_rank: usize,
    pub hidden: usize,
    pub inter: usize,
    pub top_k: usize,
    pub experts: usize,
    /// One shared expert of this intermediate size over every token (0: none).
    pub shared_inter: usize,
    /// How the experts' weights are held and computed.
    pub expert_dtype: crate::model::ExpertDtype,
}

impl BenchConfig {
    /// The model the config times: one MoE layer with softmax top-k routing (renormalised).
    pub fn spec(&self) -> crate::model::MoeSpec {
        crate::model::MoeSpec {
            architecture: "bench".into(),
            hidden: self.hidden,
            intermediate: self.inter,
            num_experts: self.experts,
            top_k: self.top_k,
            moe_layers: vec![0],
            routing: crate::model::Routing::SoftmaxTopK { renormalize: true },
            shared_intermediate: self.shared_inter,
            num_shared_experts: usize::from(self.shared_inter > 0),
        }
    }
}

pub fn config(name: &str) -> anyhow::Result<BenchConfig> {
    let c = |tokens, hidden, inter, experts| BenchConfig {
        name: name.to_string(),
        tokens_per_rank: tokens,
        hidden,
        inter,
        top_k: 8,
        experts,
        shared_inter: 0,
        expert_dtype: crate::model::ExpertDtype::Bf16,
    };
    Ok(match name {
        // DeepSeek-V3 shapes (its routed experts; the figures).
        "decode" => c(128, 7168, 2048, 256),
        // The same with DeepSeek-V3's shared expert, as the service runs the model.
        "decode-shared" => BenchConfig {
            shared_inter: 2048,
            ..c(128, 7168, 2048, 256)
        },
        // A large decode batch: experts of 32 rows on average on 2 ranks, 64 on 4.
        "decode-512" => c(512, 7168, 2048, 256),
        "prefill" => c(4096, 7168, 2048, 256),
        "prefill-shared" => BenchConfig {
            shared_inter: 2048,
            ..c(4096, 7168, 2048, 256)
        },
        // One EP4 rank's expert work on one GPU: DeepSeek-V3's experts, 64 of them (256 over 4
        // ranks); top-8 gives each 16 rows at decode and 512 at prefill, as at EP4.
        "decode-rank" => c(128, 7168, 2048, 64),
        "prefill-rank" => c(4096, 7168, 2048, 64),
        // Qwen3-30B-A3B shapes.
        "small" => c(1024, 2048, 768, 128),
        other => {
            anyhow::bail!(
                "unknown bench config '{other}' (decode, decode-shared, decode-512, prefill, prefill-shared, decode-rank, prefill-rank, small)"
            )
        }
    })
}

/// One rank's medians for one config (microseconds, bytes, rows).
#[derive(Clone, Debug, Default, Serialize)]
pub struct RankResult {
    pub rank: usize,
    pub step_us: f64,
    pub gating_us: f64,
    pub prepare_us: f64,
    pub dispatch_us: f64,
    pub experts_us: f64,
    pub combine_us: f64,
    /// Rows this rank's experts received from other ranks, and from itself.
    pub recv_rows_remote: usize,
    pub recv_rows_self: usize,
    /// Rows of this rank's tokens computed on other ranks (what combine brings back).
    pub combine_rows_remote: usize,
    /// Bytes the fixed-slot exchange moves to or from other ranks, each way (0: not known, as
    /// for NCCL EP).
    pub wire_bytes: usize,
    pub dense_us: f64,
    pub dense_rows: usize,
}

#[derive(Debug, Serialize)]
pub struct ConfigResult {
    pub config: BenchConfig,
    /// `nccl` or `nccl-ep`.
    pub backend: String,
    pub world: usize,
    pub iters: usize,
    pub ranks: Vec<RankResult>,
    pub summary: Summary,
}

/// Means over ranks of the per-rank medians (step: the slowest rank).
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub step_us: f64,
    pub gating_us: f64,
    pub prepare_us: f64,
    pub dispatch_us: f64,
    pub experts_us: f64,
    pub combine_us: f64,
    pub dispatch_gbps: f64,
    pub combine_gbps: f64,
    pub dispatch_wire_gbps: f64,
    pub expert_tflops: f64,
    /// This rank's expert weights read once per step, over the experts phase: the bound that
    /// matters when experts get few rows (decode).
    pub expert_weight_gbps: f64,
    pub dense_tflops: f64,
    pub tokens_per_s_per_gpu: f64,
}

pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

pub fn summarize(c: &BenchConfig, ranks: &[RankResult]) -> Summary {
    let n = ranks.len().max(1) as f64;
    let mean = |f: &dyn Fn(&RankResult) -> f64| ranks.iter().map(f).sum::<f64>() / n;
    let row = (c.hidden * 2) as f64;
    let gbps = |bytes: f64, us: f64| bytes / (us * 1e-6) / 1e9;
    let flops_per_row = 2.0 * (3 * c.hidden * c.inter) as f64;
    let step_us = ranks.iter().map(|r| r.step_us).fold(0.0, f64::max);
    Summary {
        step_us,
        gating_us: mean(&|r| r.gating_us),
        prepare_us: mean(&|r| r.prepare_us),
        dispatch_us: mean(&|r| r.dispatch_us),
        experts_us: mean(&|r| r.experts_us),
        combine_us: mean(&|r| r.combine_us),
        dispatch_gbps: mean(&|r| gbps(r.recv_rows_remote as f64 * row, r.dispatch_us)),
        combine_gbps: mean(&|r| gbps(r.combine_rows_remote as f64 * row, r.combine_us)),
        dispatch_wire_gbps: match ranks.iter().all(|r| r.wire_bytes > 0) {
            true => mean(&|r| gbps(r.wire_bytes as f64, r.dispatch_us)),
            false => f64::NAN,
        },
        expert_tflops: mean(&|r| {
            (r.recv_rows_remote + r.recv_rows_self) as f64 * flops_per_row
                / (r.experts_us * 1e-6)
                / 1e12
        }),
        expert_weight_gbps: mean(&|r| {
            let local = (c.experts / ranks.len().max(1)) as f64;
            let d = c.expert_dtype;
            let bytes = d.weight_bytes(2 * c.inter, c.hidden) + d.weight_bytes(c.hidden, c.inter);
            gbps(local * bytes as f64, r.experts_us)
        }),
        dense_tflops: mean(&|r| r.dense_rows as f64 * flops_per_row / (r.dense_us * 1e-6) / 1e12),
        tokens_per_s_per_gpu: c.tokens_per_rank as f64 / (step_us * 1e-6),
    }
}

pub fn table(results: &[ConfigResult]) -> String {
    let mut s = String::from(
        "| config | backend | experts | ranks | tokens/rank | step µs | gating | prepare | dispatch | experts | combine | dispatch GB/s (payload / wire) | combine GB/s | expert TFLOP/s | expert weights GB/s | dense bf16 cuBLAS TFLOP/s | tokens/s/GPU |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        let m = &r.summary;
        s += &format!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} / {} | {:.1} | {:.1} | {:.0} | {:.1} | {:.0} |\n",
            r.config.name,
            r.backend,
            r.config.expert_dtype.name(),
            r.world,
            r.config.tokens_per_rank,
            m.step_us,
            m.gating_us,
            m.prepare_us,
            m.dispatch_us,
            m.experts_us,
            m.combine_us,
            m.dispatch_gbps,
            match m.dispatch_wire_gbps.is_finite() {
                true => format!("{:.1}", m.dispatch_wire_gbps),
                false => "–".into(),
            },
            m.combine_gbps,
            m.expert_tflops,
            m.expert_weight_gbps,
            m.dense_tflops,
            m.tokens_per_s_per_gpu
        );
    }
    s
}

/// `epserve bench`: the configs checked here, timed by the GPU backend (a build without CUDA
/// refuses), reported here.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let configs = plan(&args)?;
    let results = crate::backend::gpu::bench(&args, &configs)?;
    println!("{}", table(&results));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
        tracing::info!("wrote {}", path.display());
    }
    Ok(())
}

/// The named configs, each once per `--expert-dtype`, once the arguments are known to be sound.
fn plan(args: &BenchArgs) -> anyhow::Result<Vec<BenchConfig>> {
    if args.iters == 0 {
        anyhow::bail!("--iters must be at least 1");
    }
    if let Some(b) = args
        .backends
        .iter()
        .find(|b| !["nccl", "nccl-ep"].contains(&b.as_str()))
    {
        anyhow::bail!("unknown bench backend '{b}' (nccl, nccl-ep)");
    }
    let dtypes = args
        .expert_dtype
        .iter()
        .map(|d| {
            d.asked()
                .ok_or_else(|| anyhow::anyhow!("bench --expert-dtype takes fp8 and bf16, not auto"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut out = Vec::new();
    for name in &args.configs {
        let c = config(name)?;
        out.extend(dtypes.iter().map(|&expert_dtype| BenchConfig {
            expert_dtype,
            ..c.clone()
        }));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_shared_is_decode_with_deepseek_v3s_shared_expert() {
        let (d, s) = (config("decode").unwrap(), config("decode-shared").unwrap());
        assert_eq!(d.spec().num_shared_experts, 0);
        let ds3 = crate::model::synthetic::preset("deepseek-v3").unwrap();
        let spec = s.spec();
        assert_eq!(
            (spec.shared_intermediate, spec.num_shared_experts),
            (ds3.shared_intermediate, ds3.num_shared_experts)
        );
        assert_eq!(
            (s.hidden, s.inter, s.experts, s.top_k, s.tokens_per_rank),
            (d.hidden, d.inter, d.experts, d.top_k, d.tokens_per_rank)
        );
        assert!(config("nope").is_err());
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }

    #[test]
    fn summary_rates_follow_from_the_rank_figures() {
        let c = config("small").unwrap();
        let r = RankResult {
            rank: 0,
            step_us: 100.0,
            dispatch_us: 10.0,
            combine_us: 20.0,
            experts_us: 50.0,
            recv_rows_remote: 1000,
            recv_rows_self: 24,
            combine_rows_remote: 500,
            wire_bytes: 8_000_000,
            dense_us: 25.0,
            dense_rows: 1024,
            ..RankResult::default()
        };
        let s = summarize(&c, &[r]);
        // 1000 rows x 2048 x 2 B in 10 µs = 409.6 GB/s.
        assert!((s.dispatch_gbps - 409.6).abs() < 1e-6);
        assert!((s.combine_gbps - 500.0 * 4096.0 / 20e-6 / 1e9).abs() < 1e-6);
        assert!((s.dispatch_wire_gbps - 800.0).abs() < 1e-6);
        let flops = 1024.0 * 2.0 * 3.0 * 2048.0 * 768.0;
        assert!((s.expert_tflops - flops / 50e-6 / 1e12).abs() < 1e-6);
        assert!((s.dense_tflops - 2.0 * s.expert_tflops).abs() < 1e-6);
        assert!((s.tokens_per_s_per_gpu - 1024.0 / 100e-6).abs() < 1e-3);
        assert!(table(&[]).starts_with("| config"));
        // Weights read once: 2 bytes a weight in bf16; 1 and a scale per 128x128 block in FP8.
        let weights = 128.0 * 3.0 * 2048.0 * 768.0;
        assert!((s.expert_weight_gbps - 2.0 * weights / 50e-6 / 1e9).abs() < 1e-6);
        let fp8 = BenchConfig {
            expert_dtype: crate::model::ExpertDtype::Fp8,
            ..c
        };
        let q = summarize(
            &fp8,
            &[RankResult {
                experts_us: 50.0,
                ..RankResult::default()
            }],
        );
        let scales = 128.0 * 4.0 * (12.0 * 16.0 + 16.0 * 6.0);
        assert!((q.expert_weight_gbps - (weights + scales) / 50e-6 / 1e9).abs() < 1e-6);
    }
}
