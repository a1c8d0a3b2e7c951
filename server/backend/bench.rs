//! What `epserve bench` asks of a backend and gets back: the shapes it times, what to run them
//! on, each rank's medians and their summary (plain numbers, tested without a GPU). The command
//! itself (named configs, the table, JSON) is `crate::bench`; the GPU timing is
//! `backend::cuda::bench`.

use serde::{Deserialize, Serialize};

use super::ep_settings::EpMode;

/// What to time each config on: `nccl` and/or `nccl-ep` (each of `ep_modes` and `zero_copy`,
/// LL only up to `ep_ll_max_tokens` tokens per rank), over `ranks` GPUs (None: all), `iters`
/// timed steps after `warmup`.
#[derive(Clone, Debug)]
pub struct Plan {
    pub backends: Vec<String>,
    pub ep_modes: Vec<EpMode>,
    pub zero_copy: Vec<bool>,
    /// `--overlap` settings, each backend run once per setting.
    pub overlap: Vec<bool>,
    /// `--two-batch` settings, each backend run once per setting.
    pub two_batch: Vec<bool>,
    pub ep_ll_max_tokens: usize,
    pub ranks: Option<usize>,
    pub iters: usize,
    pub warmup: usize,
    /// `--gap-us`: host idle before each timed step, the ranks not lined up.
    pub gap_us: Option<u64>,
    /// `--gap-spread-us`: each rank's further idle, drawn from 0 to this, µs.
    pub gap_spread_us: u64,
    /// `--gap-copies`: the rows and small values moved around each timed step as serving does.
    pub gap_copies: bool,
    /// `--gap-poll`: each timed step waited for as a serving rank waits.
    pub gap_poll: bool,
    /// `--rank-processes`: each rank a process of its own.
    pub processes: bool,
    /// Set in such a process: the one rank of the one run it measures.
    pub child: Option<Child>,
}

/// One rank of one run, measured by a process of its own (`--rank-processes`).
#[derive(Clone, Debug, PartialEq)]
pub struct Child {
    /// The run's index among the bench's runs (configs, backends and settings, in order).
    pub run: usize,
    pub rank: usize,
    /// The group's NCCL id.
    pub id: Vec<u8>,
    /// The launch clock's zero, µs since the Unix epoch: one clock for every rank's process.
    pub clock_us: u64,
    /// Where the rank's result goes, as JSON.
    pub file: std::path::PathBuf,
}

impl Child {
    /// `RUN:RANK:ID:CLOCK:FILE` (the id in hex), as `spec` writes it.
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || format!("--bench-child {s:?}: not RUN:RANK:ID:CLOCK:FILE");
        let [run, rank, hex, clock, file] = s.splitn(5, ':').collect::<Vec<_>>()[..] else {
            return Err(bad());
        };
        let id = (hex.len() % 2 == 0)
            .then(|| {
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
                    .collect::<Option<Vec<u8>>>()
            })
            .flatten()
            .filter(|v| !v.is_empty())
            .ok_or_else(bad)?;
        Ok(Self {
            run: run.parse().map_err(|_| bad())?,
            rank: rank.parse().map_err(|_| bad())?,
            id,
            clock_us: clock.parse().map_err(|_| bad())?,
            file: Some(file).filter(|f| !f.is_empty()).ok_or_else(bad)?.into(),
        })
    }

    pub fn spec(&self) -> String {
        let hex: String = self.id.iter().map(|b| format!("{b:02x}")).collect();
        let (run, rank, clock) = (self.run, self.rank, self.clock_us);
        format!("{run}:{rank}:{hex}:{clock}:{}", self.file.display())
    }
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
    /// Each token's experts drawn on the host, their popularity a Zipf law of this exponent
    /// (`skewed_routing`); None: the router's top-k over random rows.
    pub skew: Option<f64>,
    /// Slots placed by DeepSeek's EPLB from the drawn routing's counts, with this many redundant
    /// slots (`eplb_slots`); None: contiguous blocks, no slot table.
    pub eplb: Option<usize>,
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

/// Rank `rank`'s routing under `c.skew` (`[tokens][k]` logical experts and weights 1/k): each
/// token's k distinct experts drawn by `eplb::skew::Zipf`, the hottest first, so under
/// contiguous blocks rank 0 holds them.
pub fn skewed_routing(c: &BenchConfig, rank: usize) -> (Vec<i32>, Vec<f32>) {
    let z = crate::eplb::skew::Zipf::new(c.experts, c.skew.unwrap_or(0.0));
    let mut draws = crate::model::synthetic::SplitMix(0x5eed ^ ((rank as u64) << 32));
    let mut ids = Vec::with_capacity(c.tokens_per_rank * c.top_k);
    for _ in 0..c.tokens_per_rank {
        let picked = z.distinct(c.top_k, || draws.unit());
        ids.extend(picked.into_iter().map(|g| g as i32));
    }
    let w = vec![1.0 / c.top_k as f32; ids.len()];
    (ids, w)
}

/// The slots `c.eplb` asks for over `world` ranks: DeepSeek's EPLB over the rows every rank's
/// `skewed_routing` sends each expert (the counts the service's window would hold), renamed to
/// keep the contiguous blocks' slots where it can. None without `c.eplb`.
pub fn eplb_slots(c: &BenchConfig, world: usize) -> Result<Option<crate::eplb::SlotMap>, String> {
    use crate::eplb::{policy, SlotMap};
    let Some(redundant) = c.eplb else {
        return Ok(None);
    };
    let mut weight = vec![0.0; c.experts];
    for r in 0..world {
        for g in skewed_routing(c, r).0 {
            weight[g as usize] += 1.0;
        }
    }
    let start = SlotMap::contiguous(c.experts, world, redundant, 1)?;
    let old: Vec<usize> = start
        .layer(0)
        .phy2log()
        .iter()
        .map(|&g| g as usize)
        .collect();
    let next = policy::rebalance(&weight, c.experts + redundant, 1, 1, world);
    let kept = policy::keep(&old, &next, world);
    let table = kept.into_iter().map(|g| g as u32).collect();
    SlotMap::from_tables(c.experts, world, vec![table]).map(Some)
}

/// JSON has no NaN (serde_json writes null): a rank's process sends what it did not measure
/// as null, and the parent reads NaN back.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Option::<f64>::deserialize(d).map(|v| v.unwrap_or(f64::NAN))
}

/// One rank's medians for one config (microseconds, bytes, rows).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RankResult {
    pub rank: usize,
    #[serde(deserialize_with = "nan_if_null")]
    pub step_us: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub gating_us: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub prepare_us: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub dispatch_us: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub experts_us: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub combine_us: f64,
    /// Rows this rank's experts received from other ranks, and from itself.
    pub recv_rows_remote: usize,
    pub recv_rows_self: usize,
    /// Rows of this rank's tokens computed on other ranks (what combine brings back).
    pub combine_rows_remote: usize,
    /// Bytes the fixed-slot exchange moves to or from other ranks, each way (0: not known, as
    /// for NCCL EP).
    pub wire_bytes: usize,
    #[serde(deserialize_with = "nan_if_null")]
    pub dense_us: f64,
    pub dense_rows: usize,
    /// With `eplb`: this rank's slots the placement rewrites against contiguous blocks (the
    /// first move the balancer makes), their bytes, the median time to copy them in on the
    /// step's stream, and a step with that copy before it.
    pub moved_slots: usize,
    pub moved_bytes: usize,
    #[serde(deserialize_with = "nan_if_null")]
    pub move_us: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub step_with_move_us: f64,
    /// With `--gap-us`: every timed step's time, in order (step i is the same exchange on
    /// every rank).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub step_samples_us: Vec<f64>,
    /// With `--gap-us`: each timed step's launch on the host, µs from one clock that every
    /// rank reads (how late each rank came to the step).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub launch_at_us: Vec<f64>,
    /// With `--gap-us`: each timed step's host time from its first event's record to its
    /// launch's return (what of the step's time may be the GPU waiting for the host).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub enqueue_us: Vec<f64>,
    /// With `--gap-us`: the phases timed apart (gating, prepare, dispatch, experts, combine),
    /// every step's, and those steps' launches.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub phase_samples_us: Vec<Vec<f64>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub phase_launch_at_us: Vec<f64>,
}

#[derive(Debug, Serialize)]
pub struct ConfigResult {
    pub config: BenchConfig,
    /// `nccl` or `nccl-ep`.
    pub backend: String,
    /// The FP8 shared expert under the exchange (`--overlap`).
    pub overlap: bool,
    /// Two micro-batches a step, one's rows moving while the other's experts compute
    /// (`--two-batch`).
    pub two_batch: bool,
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
    /// Rows the busiest rank's slots received over the mean (1: balanced).
    pub load_ratio: f64,
    /// The slowest rank's experts phase: what a skewed load makes every rank wait for.
    pub experts_max_us: f64,
    /// With `eplb`: bytes every rank copies in for the first move, the slowest rank's copy,
    /// and the slowest step with the copy before it.
    pub moved_bytes: usize,
    pub move_us: f64,
    pub step_with_move_us: f64,
    /// With `--gap-us`: the group's steps, each its least time over the ranks (a rank that
    /// waited for a late peer is not the step's own time).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_gap: Option<GroupSteps>,
}

/// The group's steps after a host gap: their median, 99th percentile and worst, and how many
/// of them ran over 1.1x the median (#54's serving line).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GroupSteps {
    pub steps: usize,
    pub median_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub over_1_1: usize,
}

impl GroupSteps {
    /// Step i's least time over the ranks' samples (ranks of fewer samples bound the steps);
    /// None without samples.
    pub fn of(ranks: &[&[f64]]) -> Option<GroupSteps> {
        let n = ranks.iter().map(|r| r.len()).min().filter(|&n| n > 0)?;
        let mut least: Vec<f64> = (0..n)
            .map(|i| ranks.iter().map(|r| r[i]).fold(f64::INFINITY, f64::min))
            .collect();
        let median_us = median(&mut least);
        // `median` sorted them.
        let p99_us = least[((n as f64 * 0.99).ceil() as usize).clamp(1, n) - 1];
        Some(GroupSteps {
            steps: n,
            median_us,
            p99_us,
            max_us: least[n - 1],
            over_1_1: least.iter().filter(|&&t| t > 1.1 * median_us).count(),
        })
    }
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
            let slots = c.experts + c.eplb.unwrap_or(0);
            let local = (slots / ranks.len().max(1)) as f64;
            let d = c.expert_dtype;
            let bytes = d.weight_bytes(2 * c.inter, c.hidden) + d.weight_bytes(c.hidden, c.inter);
            gbps(local * bytes as f64, r.experts_us)
        }),
        dense_tflops: mean(&|r| r.dense_rows as f64 * flops_per_row / (r.dense_us * 1e-6) / 1e12),
        tokens_per_s_per_gpu: c.tokens_per_rank as f64 / (step_us * 1e-6),
        load_ratio: {
            let rows: Vec<f64> = (ranks.iter())
                .map(|r| (r.recv_rows_remote + r.recv_rows_self) as f64)
                .collect();
            crate::eplb::policy::imbalance(&rows)
        },
        experts_max_us: ranks.iter().map(|r| r.experts_us).fold(0.0, f64::max),
        moved_bytes: ranks.iter().map(|r| r.moved_bytes).sum(),
        move_us: ranks.iter().map(|r| r.move_us).fold(0.0, f64::max),
        step_with_move_us: ranks
            .iter()
            .map(|r| r.step_with_move_us)
            .fold(0.0, f64::max),
        after_gap: GroupSteps::of(
            &ranks
                .iter()
                .map(|r| r.step_samples_us.as_slice())
                .collect::<Vec<_>>(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eplb::policy::{imbalance, rank_loads};

    fn deepseek(skew: f64, eplb: Option<usize>) -> BenchConfig {
        BenchConfig {
            skew: Some(skew),
            eplb,
            ..crate::bench::config("prefill").unwrap()
        }
    }

    #[test]
    fn a_rank_process_reads_back_the_spec_it_was_given() {
        let c = Child {
            run: 3,
            rank: 1,
            id: vec![0, 0xab, 0x7f, 0xff],
            clock_us: 1_764_000_000_123_456,
            file: "/tmp/a:b/r1.json".into(),
        };
        assert_eq!(c.spec(), "3:1:00ab7fff:1764000000123456:/tmp/a:b/r1.json");
        assert_eq!(Child::parse(&c.spec()), Ok(c));
        // What it sends back: NaN (not measured) travels as null and returns as NaN.
        let r = RankResult {
            rank: 1,
            step_us: 671.5,
            move_us: f64::NAN,
            step_samples_us: vec![670.0, 702.5],
            ..RankResult::default()
        };
        let back: RankResult = serde_json::from_slice(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!((back.rank, back.step_us), (1, 671.5));
        assert!(back.move_us.is_nan() && back.step_with_move_us == 0.0);
        assert_eq!(back.step_samples_us, r.step_samples_us);
        assert!(back.launch_at_us.is_empty());
        for bad in [
            "",
            "3:1:00ab:5",
            "3:1:00ab:5:",
            "x:1:00ab:5:/f",
            "3:1:0ab:5:/f",
            "3:1:zz:5:/f",
            "3:1::5:/f",
            "3:1:00:-5:/f",
        ] {
            let e = Child::parse(bad).unwrap_err();
            assert!(e.contains("RUN:RANK:ID:CLOCK:FILE"), "{bad:?}: {e}");
        }
    }

    /// Rows per rank under `phy2log` for every rank's drawn routing.
    fn loads(c: &BenchConfig, phy2log: &[usize], world: usize) -> Vec<f64> {
        let mut weight = vec![0.0; c.experts];
        for r in 0..world {
            skewed_routing(c, r)
                .0
                .iter()
                .for_each(|&g| weight[g as usize] += 1.0);
        }
        rank_loads(&weight, phy2log, world)
    }

    #[test]
    fn skewed_routing_draws_k_distinct_experts_and_loads_rank_0() {
        let c = deepseek(1.0, None);
        let (ids, w) = skewed_routing(&c, 1);
        assert_eq!(ids.len(), c.tokens_per_rank * c.top_k);
        assert!((w.iter().sum::<f32>() - c.tokens_per_rank as f32).abs() < 1e-2);
        for t in ids.chunks(c.top_k) {
            let mut s = t.to_vec();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), c.top_k, "{t:?}");
        }
        assert_ne!(ids, skewed_routing(&c, 0).0, "ranks draw their own tokens");
        let contiguous: Vec<usize> = (0..c.experts).collect();
        let flat = deepseek(0.0, None);
        assert!(imbalance(&loads(&flat, &contiguous, 2)) < 1.05);
        assert!(imbalance(&loads(&c, &contiguous, 2)) > 1.3);
    }

    /// Rank 0's rows per slot, in slot order, for `scripts/probes/skew_gemm.cu`: the bench's
    /// routing over 2 ranks at `skew` with `eplb`, each row on the replica the GPU's gating
    /// picks (`SlotMap::replica_table`: token t of rank r takes `(t + r) % count`).
    fn rank0_rows_per_slot(skew: f64, eplb: Option<usize>) -> Vec<usize> {
        let (c, world) = (deepseek(skew, eplb), 2);
        let map = match eplb_slots(&c, world).unwrap() {
            Some(m) => m,
            None => crate::eplb::SlotMap::contiguous(c.experts, world, 0, 1).unwrap(),
        };
        // Room for every replica the bench places (2 of the hottest experts at most).
        const WIDTH: usize = 8;
        let (table, count) = &map.replica_table(&[true; 2], WIDTH)[0];
        let mut rows = vec![0; map.per_rank()];
        for r in 0..world {
            for (i, &g) in skewed_routing(&c, r).0.iter().enumerate() {
                let (t, g) = (i / c.top_k, g as usize);
                let slot = table[g * WIDTH + (t + r) % count[g] as usize] as usize;
                if slot < rows.len() {
                    rows[slot] += 1;
                }
            }
        }
        rows
    }

    /// The probe's input is what the bench runs: regenerate it with
    /// `EPSERVE_WRITE_PROBE_COUNTS=1 cargo test --lib skew_probe` when the routing or the
    /// policy changes.
    #[test]
    fn the_skew_probes_counts_are_the_benchs_rows_per_slot() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/probes/skew_counts.txt"
        );
        let mut want = String::new();
        for (name, skew, eplb) in [
            ("s0", 0.0, None),
            ("s1_r2", 1.0, Some(2)),
            ("s07_r0", 0.7, Some(0)),
            ("s1_r0", 1.0, Some(0)),
        ] {
            let rows = rank0_rows_per_slot(skew, eplb);
            let total: usize = rows.iter().sum();
            assert!((30_000..36_000).contains(&total), "{name}: {total} rows");
            let line: Vec<String> = rows.iter().map(usize::to_string).collect();
            want += &format!("{name} {}\n", line.join(" "));
        }
        if std::env::var_os("EPSERVE_WRITE_PROBE_COUNTS").is_some() {
            std::fs::write(path, &want).unwrap();
        }
        let got = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            got == want,
            "{path} is not the bench's rows per slot: regenerate it"
        );
    }

    #[test]
    fn group_steps_take_each_steps_least_time_over_the_ranks() {
        assert_eq!(GroupSteps::of(&[]), None);
        assert_eq!(GroupSteps::of(&[&[], &[1.0]]), None);
        // Step 1: rank 0 waited for rank 1 (300), rank 1's own time is 100. Step 3 is slow on
        // both ranks (150 and 160). The ranks' extra samples past the shorter are not steps.
        let r0 = [100.0, 300.0, 104.0, 150.0, 98.0, 101.0];
        let r1 = [102.0, 100.0, 99.0, 160.0, 97.0, 100.0, 500.0];
        let g = GroupSteps::of(&[&r0, &r1]).unwrap();
        // Least: 100, 100, 99, 150, 97, 100.
        assert_eq!(g.steps, 6);
        assert_eq!(g.median_us, 100.0);
        assert_eq!(g.max_us, 150.0);
        assert_eq!(g.p99_us, 150.0);
        assert_eq!(g.over_1_1, 1);
        let even = GroupSteps::of(&[&[10.0; 200]]).unwrap();
        assert_eq!((even.over_1_1, even.p99_us), (0, 10.0));
    }

    #[test]
    fn eplb_slots_balance_the_drawn_load() {
        let c = deepseek(1.0, Some(2));
        let m = eplb_slots(&c, 2).unwrap().unwrap();
        assert_eq!(m.slots(), c.experts + 2);
        let p: Vec<usize> = m.layer(0).phy2log().iter().map(|&g| g as usize).collect();
        let after = imbalance(&loads(&c, &p, 2));
        assert!(after < 1.05, "{after}");
        assert!(eplb_slots(&deepseek(1.0, None), 2).unwrap().is_none());
        // 256 experts + 1 slot do not split over 2 ranks: said, not run as contiguous.
        assert!(eplb_slots(&deepseek(1.0, Some(1)), 2).is_err());
    }
}
