//! What `epserve bench` asks of a backend and gets back: the shapes it times, what to run them
//! on, each rank's medians and their summary (plain numbers, tested without a GPU). The command
//! itself (named configs, the table, JSON) is `crate::bench`; the GPU timing is
//! `backend::cuda::bench`.

use serde::Serialize;

use super::ep_settings::EpMode;

/// What to time each config on: `nccl` and/or `nccl-ep` (each of `ep_modes` and `zero_copy`,
/// LL only up to `ep_ll_max_tokens` tokens per rank), over `ranks` GPUs (None: all), `iters`
/// timed steps after `warmup`.
#[derive(Clone, Debug)]
pub struct Plan {
    pub backends: Vec<String>,
    pub ep_modes: Vec<EpMode>,
    pub zero_copy: Vec<bool>,
    pub ep_ll_max_tokens: usize,
    pub ranks: Option<usize>,
    pub iters: usize,
    pub warmup: usize,
}

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
