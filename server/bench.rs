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
            shared_intermediate: 0,
            num_shared_experts: 0,
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
    };
    Ok(match name {
        // DeepSeek-V3 shapes.
        "decode" => c(128, 7168, 2048, 256),
        "prefill" => c(4096, 7168, 2048, 256),
        // Qwen3-30B-A3B shapes.
        "small" => c(1024, 2048, 768, 128),
        other => anyhow::bail!("unknown bench config '{other}' (decode, prefill, small)"),
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
            gbps(local * (3 * c.hidden * c.inter * 2) as f64, r.experts_us)
        }),
        dense_tflops: mean(&|r| r.dense_rows as f64 * flops_per_row / (r.dense_us * 1e-6) / 1e12),
        tokens_per_s_per_gpu: c.tokens_per_rank as f64 / (step_us * 1e-6),
    }
}

pub fn table(results: &[ConfigResult]) -> String {
    let mut s = String::from(
        "| config | backend | ranks | tokens/rank | step µs | gating | prepare | dispatch | experts | combine | dispatch GB/s (payload / wire) | combine GB/s | expert TFLOP/s | expert weights GB/s | dense cuBLAS TFLOP/s | tokens/s/GPU |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        let m = &r.summary;
        s += &format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} / {} | {:.1} | {:.1} | {:.0} | {:.1} | {:.0} |\n",
            r.config.name,
            r.backend,
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

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let configs = args
        .configs
        .iter()
        .map(|c| config(c))
        .collect::<anyhow::Result<Vec<_>>>()?;
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
    #[cfg(feature = "cuda")]
    {
        let results = gpu::run(&args, &configs)?;
        println!("{}", table(&results));
        if let Some(path) = &args.json {
            std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
            tracing::info!("wrote {}", path.display());
        }
        Ok(())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = configs;
        anyhow::bail!("epserve bench times the GPU step: build with --features cuda")
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::time::{Duration, Instant};

    use anyhow::Context;
    use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
    use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
    use cudarc::driver::{CudaEvent, CudaGraph};
    use half::bf16;

    use super::{median, summarize, BenchConfig, ConfigResult, RankResult};
    use crate::backend::cuda::setup::{self, Device};
    use crate::backend::cuda::step::GpuStep;
    use crate::backend::cuda::{device_count, GpuError};
    use crate::config::{BenchArgs, EpMode, EpSettings, OnOff, EP_LL_MAX_TOKENS};

    /// Each backend of `--backends` as run: `nccl`, and `nccl-ep` once per mode and zero-copy
    /// setting, each resolved as the service resolves `--ep-mode` for one bucket of the config's
    /// tokens per rank (auto: the service's default threshold).
    fn variants(
        args: &BenchArgs,
        c: &BenchConfig,
    ) -> anyhow::Result<Vec<(String, Option<EpSettings>)>> {
        let mut v = Vec::new();
        for b in &args.backends {
            if b == "nccl" {
                v.push((b.clone(), None));
                continue;
            }
            for &mode in &args.ep_modes {
                for &zc in &args.zero_copy {
                    let t = c.tokens_per_rank;
                    if mode == EpMode::Ll && t > args.ep_ll_max_tokens {
                        tracing::info!(config = %c.name, "LL skipped: {t} tokens per rank > --ep-ll-max-tokens");
                        continue;
                    }
                    let (e, note) = EpSettings::resolve(
                        mode,
                        EP_LL_MAX_TOKENS,
                        &[t],
                        zc == OnOff::On,
                        c.hidden,
                    )
                    .map_err(|e| anyhow::anyhow!("{}: {e}", c.name))?;
                    if let Some(n) = note {
                        tracing::info!(config = %c.name, "{n}");
                    }
                    let ll = e.ll_max > 0;
                    // NCCL EP 0.2 has no zero-copy LL in the expert-major layout (LL stages).
                    let label = format!(
                        "nccl-ep {}{}",
                        if ll { "LL" } else { "HT" },
                        if e.zero_copy && !ll {
                            ", zero-copy"
                        } else {
                            ""
                        }
                    );
                    if !v.iter().any(|(l, _)| *l == label) {
                        v.push((label, Some(e)));
                    }
                }
            }
        }
        Ok(v)
    }

    pub fn run(args: &BenchArgs, configs: &[BenchConfig]) -> anyhow::Result<Vec<ConfigResult>> {
        let world = args.ranks.unwrap_or_else(device_count);
        if world == 0 || world > device_count() {
            anyhow::bail!("{world} ranks asked, {} GPUs visible", device_count());
        }
        setup::available().map_err(|e| anyhow::anyhow!(e))?;
        if args.backends.iter().any(|b| b == "nccl-ep") {
            setup::ep_gates(world)
                .map_err(|why| anyhow::anyhow!("nccl-ep cannot run here: {why}"))?;
        }
        let mut runs = Vec::new();
        for c in configs {
            runs.extend(variants(args, c)?.into_iter().map(|v| (c, v)));
        }
        let mut out = Vec::new();
        for (c, (backend, ep)) in runs {
            if c.experts % world != 0 {
                anyhow::bail!("{}: {} experts over {world} ranks", c.name, c.experts);
            }
            let id = setup::new_unique_id()?;
            let threads: Vec<_> = (0..world)
                .map(|rank| {
                    let (id, c, a) = (id.clone(), c.clone(), args.clone());
                    std::thread::spawn(move || rank_main(&id, world, rank, &c, &a, ep))
                })
                .collect();
            let mut ranks = Vec::new();
            for t in threads {
                let r = t
                    .join()
                    .map_err(|_| anyhow::anyhow!("a bench rank panicked"))?;
                ranks.push(r.with_context(|| format!("config {}", c.name))?);
            }
            let summary = summarize(c, &ranks);
            tracing::info!(config = %c.name, %backend, ?summary, "measured");
            out.push(ConfigResult {
                config: c.clone(),
                backend,
                world,
                iters: args.iters,
                ranks,
                summary,
            });
        }
        Ok(out)
    }

    type Phase = fn(&mut GpuStep, usize) -> Result<(), GpuError>;

    fn capture(core: &mut GpuStep, t: usize, f: Phase) -> anyhow::Result<CudaGraph> {
        let s = core.g.stream.clone();
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let r = f(core, t);
        let g = s.end_capture(CUgraphInstantiate_flags(0));
        r?;
        let g = g?.ok_or_else(|| anyhow::anyhow!("empty capture"))?;
        g.upload()?;
        Ok(g)
    }

    /// One rank, brought up as the service brings its ranks up (`setup::Device`), with random
    /// weights: GPU `rank`, one bucket of the config's tokens per rank.
    fn rank_main(
        id: &[u8],
        world: usize,
        rank: usize,
        c: &BenchConfig,
        args: &BenchArgs,
        ep: Option<EpSettings>,
    ) -> anyhow::Result<RankResult> {
        let dev = Device::random(rank, &c.spec(), 7, world, rank, c.tokens_per_rank, ep)?;
        let deadline = Instant::now() + Duration::from_secs(300);
        let (mut core, mut a) = dev.connect(id, deadline)?;
        let shape = core.shape;
        let t = c.tokens_per_rank;
        let s = core.g.stream.clone();
        s.memcpy_htod(&[t as i32], &mut core.b.n)?;
        core.g
            .fill_uniform_f32(&mut core.b.x, 1000 + rank as u64, 1.0)?;
        for _ in 0..args.warmup.max(1) {
            core.run(0, t, false)?;
        }
        s.synchronize()?;

        let phases: [Phase; 5] = [
            |c, t| c.gate(0, t),
            |c, t| c.prepare(t),
            |c, t| c.dispatch(t),
            |c, t| c.experts(0, t),
            |c, t| c.combine(0, t),
        ];
        let step = capture(&mut core, t, |c, t| c.run(0, t, false))?;
        let graphs = phases
            .iter()
            .map(|&f| capture(&mut core, t, f))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let ctx = core.g.ctx.clone();
        let ev = (0..6)
            .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<Result<Vec<CudaEvent>, _>>()?;
        let us = |a: &CudaEvent, b: &CudaEvent| -> anyhow::Result<f64> {
            Ok(f64::from(a.elapsed_ms(b)?) * 1e3)
        };
        for _ in 0..args.warmup {
            step.launch()?;
        }
        let mut steps = Vec::with_capacity(args.iters);
        for _ in 0..args.iters {
            ev[0].record(&s)?;
            step.launch()?;
            ev[1].record(&s)?;
            s.synchronize()?;
            steps.push(us(&ev[0], &ev[1])?);
        }
        let mut per_phase: Vec<Vec<f64>> = (0..5).map(|_| Vec::with_capacity(args.iters)).collect();
        for _ in 0..args.iters {
            ev[0].record(&s)?;
            for (i, g) in graphs.iter().enumerate() {
                g.launch()?;
                ev[i + 1].record(&s)?;
            }
            s.synchronize()?;
            for (i, v) in per_phase.iter_mut().enumerate() {
                v.push(us(&ev[i], &ev[i + 1])?);
            }
        }

        // What moved: from the all-gathered counts of the last step.
        let m = s.clone_dtoh(&core.b.m)?;
        let (e, l) = (c.experts, c.experts / world);
        let mine = rank * l..(rank + 1) * l;
        let from = |src: usize| -> usize { mine.clone().map(|x| m[src * e + x] as usize).sum() };
        let recv_rows_self = from(rank);
        let recv_rows_remote: usize = (0..world).filter(|&r| r != rank).map(from).sum();
        let combine_rows_remote = (0..e)
            .filter(|x| !mine.contains(x))
            .map(|x| m[rank * e + x] as usize)
            .sum();
        // The slots move their worst case; what NCCL EP moves is its own (not counted: 0).
        let wire_bytes = match ep {
            Some(_) => 0,
            None => (world - 1) * shape.slot_rows(t) * c.hidden * 2,
        };

        // Dense cuBLAS: the same FFN FLOPs as one expert over all the rows this rank received,
        // on random data scaled as the layer's (tensor cores on zeros draw less power and clock
        // higher, which would flatter the yardstick).
        let rows: usize = (recv_rows_remote + recv_rows_self).max(1);
        let (h, i) = (c.hidden, c.inter);
        let mut x = a.zeros::<bf16>(rows * h)?;
        let mut w1 = a.zeros::<bf16>(2 * i * h)?;
        let mut w2 = a.zeros::<bf16>(h * i)?;
        core.g.fill_uniform_bf16(&mut x, 2000 + rank as u64, 1.0)?;
        core.g
            .fill_uniform_bf16(&mut w1, 3000 + rank as u64, (3.0 / h as f32).sqrt())?;
        core.g
            .fill_uniform_bf16(&mut w2, 4000 + rank as u64, (3.0 / i as f32).sqrt())?;
        let mut y1 = a.zeros::<bf16>(rows * 2 * i)?;
        let mut y2 = a.zeros::<bf16>(rows * h)?;
        let blas = CudaBlas::new(s.clone())?;
        // Row-major Y [rows, n] = X [rows, k] . W [n, k]^T, as column-major Y^T = W^T' . X^T.
        let cfg = |n: usize, k: usize| GemmConfig {
            transa: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
            transb: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: rows as i32,
            k: k as i32,
            alpha: bf16::ONE,
            lda: k as i32,
            ldb: k as i32,
            beta: bf16::ZERO,
            ldc: n as i32,
        };
        let mut dense = Vec::with_capacity(args.iters);
        for it in 0..args.warmup + args.iters {
            ev[0].record(&s)?;
            // SAFETY: buffer sizes match the configs (rows x h, 2i x h, rows x 2i; then the down
            // projection over the first i columns' worth of the same buffers).
            unsafe {
                blas.gemm(cfg(2 * i, h), &w1, &x, &mut y1)?;
                blas.gemm(cfg(h, i), &w2, &y1, &mut y2)?;
            }
            ev[1].record(&s)?;
            s.synchronize()?;
            if it >= args.warmup {
                dense.push(us(&ev[0], &ev[1])?);
            }
        }
        drop((step, graphs));
        let mut p = per_phase.into_iter().map(|mut v| median(&mut v));
        let mut next = || p.next().unwrap_or(f64::NAN);
        Ok(RankResult {
            rank,
            step_us: median(&mut steps),
            gating_us: next(),
            prepare_us: next(),
            dispatch_us: next(),
            experts_us: next(),
            combine_us: next(),
            recv_rows_remote,
            recv_rows_self,
            combine_rows_remote,
            wire_bytes,
            dense_us: median(&mut dense),
            dense_rows: rows,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
