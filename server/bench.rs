//! `epserve bench`: the GPU step and each of its phases timed with CUDA events on every GPU of
//! the machine (one NCCL rank per GPU, a thread each or with `--rank-processes` a process each),
//! graphs on, for named configs; plus dense cuBLAS GEMMs of the same shapes in the same run, so
//! the grouped GEMM has a yardstick.

use crate::backend::bench::{BenchConfig, Child, ConfigResult, Plan};
use crate::config::BenchArgs;
use crate::flags::OnOff;

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
        skew: None,
        eplb: None,
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
        // Half and twice prefill's tokens: a two-batch micro-batch of it, and a step whose
        // micro-batches are prefill's size (#57's two-batch overlap).
        "prefill-2k" => c(2048, 7168, 2048, 256),
        "prefill-8k" => c(8192, 7168, 2048, 256),
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
                "unknown bench config '{other}' (decode, decode-shared, decode-512, prefill, prefill-2k, prefill-8k, prefill-shared, decode-rank, prefill-rank, small)"
            )
        }
    })
}

pub fn table(results: &[ConfigResult]) -> String {
    let mut s = String::from(
        "| config | backend | experts | ranks | tokens/rank | step µs | gating | prepare | dispatch | experts | combine | dispatch GB/s (payload / wire) | combine GB/s | expert TFLOP/s | expert weights GB/s | dense bf16 cuBLAS TFLOP/s | tokens/s/GPU | rank load max/mean | slowest experts µs |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    // A row's first cells: which config, exchange and experts.
    let head = |r: &ConfigResult| {
        let c = &r.config;
        format!("| {} | {} | {} |", c.name, r.backend, c.expert_dtype.name())
    };
    for r in results {
        let m = &r.summary;
        s += &format!(
            "{} {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} / {} | {:.1} | {:.1} | {:.0} | {:.1} | {:.0} | {:.2} | {:.1} |\n",
            head(r),
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
            m.tokens_per_s_per_gpu,
            m.load_ratio,
            m.experts_max_us
        );
    }
    let gaps: Vec<_> = (results.iter())
        .filter_map(|r| r.summary.after_gap.map(|g| (r, g)))
        .collect();
    if !gaps.is_empty() {
        s += "\nAfter `--gap-us` (each step's least time over the ranks):\n\n| config | backend | experts | steps | median µs | p99 | max | over 1.1x the median |\n|---|---|---|---|---|---|---|---|\n";
        for (r, g) in gaps {
            s += &format!(
                "{} {} | {:.1} | {:.1} | {:.1} | {} |\n",
                head(r),
                g.steps,
                g.median_us,
                g.p99_us,
                g.max_us,
                g.over_1_1
            );
        }
    }
    s
}

/// `epserve bench`: the configs checked here, timed by the GPU backend (a build without CUDA
/// refuses), reported here.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let configs = plan(&args)?;
    let asked = Plan {
        backends: args.backends.clone(),
        ep_modes: args.ep_modes.clone(),
        zero_copy: args.zero_copy.iter().map(|&z| z == OnOff::On).collect(),
        overlap: args.overlap.iter().map(|&z| z == OnOff::On).collect(),
        two_batch: args.two_batch.iter().map(|&z| z == OnOff::On).collect(),
        ep_ll_max_tokens: args.ep_ll_max_tokens,
        ranks: args.ranks,
        iters: args.iters,
        warmup: args.warmup,
        gap_us: args.gap_us,
        gap_spread_us: args.gap_spread_us,
        gap_copies: args.gap_copies,
        gap_poll: args.gap_poll,
        processes: args.rank_processes,
        child: (args.bench_child.as_deref())
            .map(Child::parse)
            .transpose()
            .map_err(|e| anyhow::anyhow!(e))?,
    };
    let results = crate::backend::gpu::bench(&asked, &configs)?;
    if asked.child.is_some() {
        // A rank's process: its result went to its file, the report is the parent's.
        return Ok(());
    }
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
    if args.skew.iter().any(|s| !s.is_finite() || *s < 0.0) {
        anyhow::bail!("--skew takes exponents >= 0");
    }
    let eplb = args.eplb.contains(&OnOff::On);
    if eplb && args.skew.is_empty() {
        anyhow::bail!("--eplb on places slots from the drawn routing's counts: give --skew");
    }
    let world = args.ranks.unwrap_or_else(crate::backend::gpu::device_count);
    let redundant = args.redundant_experts.unwrap_or(world);
    // Each skew once per --eplb setting; no --skew: the router's routing, contiguous blocks.
    let mut routings: Vec<(Option<f64>, Option<usize>)> = Vec::new();
    for &s in &args.skew {
        for &e in &args.eplb {
            routings.push((Some(s), (e == OnOff::On).then_some(redundant)));
        }
    }
    if routings.is_empty() {
        routings.push((None, None));
    }
    let mut out = Vec::new();
    for name in &args.configs {
        let c = config(name)?;
        for &(skew, eplb) in &routings {
            let name = match (skew, eplb) {
                (None, _) => c.name.clone(),
                (Some(s), None) => format!("{} skew={s}", c.name),
                (Some(s), Some(r)) => format!("{} skew={s} eplb+{r}", c.name),
            };
            out.extend(dtypes.iter().map(|&expert_dtype| BenchConfig {
                name: name.clone(),
                expert_dtype,
                skew,
                eplb,
                ..c.clone()
            }));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::bench::{median, summarize, ConfigResult, RankResult};

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
    fn gap_steps_reach_the_summary_and_the_table() {
        use clap::Parser;
        let parse =
            |v: &str| crate::config::Cli::try_parse_from(["epserve", "bench", "--gap-us", v]);
        assert!(parse("1000001").is_err(), "a gap over 1 s is refused");
        let Ok(crate::config::Cli {
            command: crate::config::Command::Bench(a),
            ..
        }) = parse("2000")
        else {
            panic!("--gap-us 2000 parses to bench's arguments");
        };
        assert_eq!((a.gap_us, a.gap_spread_us), (Some(2000), 0));
        let flags = |v: &[&str]| {
            crate::config::Cli::try_parse_from([&["epserve", "bench"], v].concat())
                .ok()
                .map(|c| match c.command {
                    crate::config::Command::Bench(a) => (
                        a.gap_us,
                        a.gap_spread_us,
                        a.gap_copies,
                        a.gap_poll,
                        a.rank_processes,
                    ),
                    _ => panic!("bench parses to bench's arguments"),
                })
        };
        assert!(
            flags(&["--gap-spread-us", "100"]).is_none(),
            "a spread needs a gap"
        );
        assert!(
            flags(&["--gap-copies"]).is_none(),
            "the copies are timed after a gap"
        );
        assert_eq!(
            flags(&["--gap-us", "0", "--gap-copies"]),
            Some((Some(0), 0, true, false, false))
        );
        assert!(
            flags(&["--gap-poll"]).is_none(),
            "polling is timed after a gap"
        );
        assert_eq!(
            flags(&["--gap-us", "0", "--gap-poll", "--rank-processes"]),
            Some((Some(0), 0, false, true, true))
        );
        assert!(flags(&["--gap-us", "0", "--gap-spread-us", "1000001"]).is_none());
        assert_eq!(
            flags(&["--gap-us", "500", "--gap-spread-us", "100"]),
            Some((Some(500), 100, false, false, false))
        );
        let c = config("small").unwrap();
        let rank = |v: Vec<f64>| RankResult {
            step_samples_us: v,
            ..RankResult::default()
        };
        let result = |ranks: Vec<RankResult>| ConfigResult {
            config: c.clone(),
            backend: "nccl-ep LL".into(),
            overlap: false,
            two_batch: false,
            world: ranks.len(),
            iters: 4,
            summary: summarize(&c, &ranks),
            ranks,
        };
        let plain = result(vec![rank(vec![]), rank(vec![])]);
        assert!(plain.summary.after_gap.is_none());
        assert!(!table(&[plain]).contains("--gap-us"));
        // Step 2 is slow on both ranks: 130 against a median of 100.
        let gap = result(vec![
            rank(vec![100.0, 180.0, 130.0, 99.0]),
            rank(vec![150.0, 101.0, 140.0, 100.0]),
        ]);
        let g = gap.summary.after_gap.unwrap();
        assert_eq!((g.steps, g.over_1_1, g.max_us), (4, 1, 130.0));
        let t = table(&[gap]);
        assert!(t.contains("After `--gap-us`"), "{t}");
        assert!(
            t.contains("| small | nccl-ep LL | bf16 | 4 | 100.5 | 130.0 | 130.0 | 1 |"),
            "{t}"
        );
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
