//! What a rank records after each step: its Prometheus step series (names described in
//! `crate::metrics`) and the stats line's step time.

use std::time::Duration;

use metrics::{counter, gauge, histogram};

use crate::eplb::SlotMap;
use crate::metric_names;

/// Wall time of one step on this rank, and of each phase where the backend times them: the CPU
/// backend runs them one by one on the host; a GPU step's graph records events between them
/// with `--step-phase-times` (else `epserve bench` times them).
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseTimes {
    pub phased: bool,
    /// Rows the backend computed beyond the step's tokens (bucket padding).
    pub padding: usize,
    /// A GPU step's gating counts from its small copies in: on an idle GPU it holds the
    /// graph's launch too.
    pub gating: Duration,
    pub prepare: Duration,
    pub dispatch: Duration,
    pub experts: Duration,
    pub combine: Duration,
    pub total: Duration,
    /// A GPU step's time on its stream, from its first wait to its output (events around it:
    /// no host queueing, no other step in flight); None on other backends.
    pub device: Option<Duration>,
    /// Of `device`, the time before the step's graph: the stream waiting for the host to
    /// enqueue it, or for a placement's copies (`Mover::before`).
    pub device_wait: Option<Duration>,
    /// Of `device`, the step's small copies in (its routing, ahead of its graph) and out (its
    /// counts, behind it); on an idle GPU also the host's time to enqueue them.
    pub device_in: Option<Duration>,
    pub device_out: Option<Duration>,
    /// The host's time from enqueueing the step's start event to its graph launched and its
    /// counts' copies enqueued behind it.
    pub enqueue: Option<Duration>,
    /// The host's context switches while it enqueued the step (voluntary, involuntary).
    pub enqueue_switches: Option<(u64, u64)>,
    /// Of `enqueue`, the host's time in each of its parts: where a stalled host stalled.
    pub enqueue_parts: Option<EnqueueParts>,
}

/// A GPU step's enqueue in its parts, host time each: its start event and a placement's wait
/// (`before`), its small copies in, its graph's launch (or eager kernels), its copies out.
#[derive(Clone, Copy, Debug, Default)]
pub struct EnqueueParts {
    pub before: Duration,
    pub copy_in: Duration,
    pub graph: Duration,
    pub copy_out: Duration,
}

impl std::fmt::Display for EnqueueParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = |d: Duration| d.as_micros();
        write!(
            f,
            "{},{},{},{}",
            us(self.before),
            us(self.copy_in),
            us(self.graph),
            us(self.copy_out)
        )
    }
}

/// Per-step figures a rank records after each step.
pub struct StepRecord<'a> {
    /// The step's number, the same on every rank (joins the ranks' traces).
    pub step: u64,
    pub layer: u32,
    pub tokens: usize,
    pub heartbeat: bool,
    pub times: &'a PhaseTimes,
    /// `[world, slots]` token rows routed from each source rank to each expert slot.
    pub routed: &'a [u32],
    /// The placement the step ran on, and its layer's index in it.
    pub slots: &'a SlotMap,
    pub layer_index: usize,
    pub world: usize,
    pub rank: usize,
    pub per_expert: bool,
}

/// The five phases' times, µs, comma-separated (gating, prepare, dispatch, experts, combine).
fn phase_list(t: &PhaseTimes) -> String {
    [t.gating, t.prepare, t.dispatch, t.experts, t.combine]
        .map(|d| d.as_micros().to_string())
        .join(",")
}

pub fn record_step(r: &StepRecord) {
    let kind = if r.heartbeat { "heartbeat" } else { "work" };
    counter!(metric_names::STEPS_TOTAL, "kind" => kind).increment(1);
    if r.heartbeat {
        return;
    }
    let layer = r.layer.to_string();
    histogram!(metric_names::STEP_TOKENS).record(r.tokens as f64);
    counter!(metric_names::STEP_TOKENS_TOTAL, "layer" => layer.clone()).increment(r.tokens as u64);
    counter!(metric_names::STEP_PADDING_TOKENS_TOTAL).increment(r.times.padding as u64);
    histogram!(metric_names::STEP_DURATION_SECONDS).record(r.times.total.as_secs_f64());
    crate::stats_log::step(r.times.total);
    // Every step's time, for a distribution the histogram's buckets are too coarse for
    // (RUST_LOG=epserve::step_times=trace; off by default).
    tracing::trace!(target: "epserve::step_times", step = r.step, layer = r.layer, tokens = r.tokens,
        us = r.times.total.as_micros() as u64,
        device_us = r.times.device.map(|d| d.as_micros() as u64),
        wait_us = r.times.device_wait.map(|d| d.as_micros() as u64),
        enqueue_us = r.times.enqueue.map(|d| d.as_micros() as u64),
        switches = r.times.enqueue_switches.map(|(v, i)| tracing::field::display(format!("{v}/{i}"))),
        parts_us = r.times.enqueue_parts.map(tracing::field::display),
        in_us = r.times.device_in.map(|d| d.as_micros() as u64),
        out_us = r.times.device_out.map(|d| d.as_micros() as u64),
        phases_us = r.times.phased.then(|| tracing::field::display(phase_list(r.times))), "step");
    let phases = if r.times.phased { 5 } else { 0 };
    for (phase, d) in [
        ("gating", r.times.gating),
        ("prepare", r.times.prepare),
        ("dispatch", r.times.dispatch),
        ("experts", r.times.experts),
        ("combine", r.times.combine),
    ]
    .into_iter()
    .take(phases)
    {
        histogram!(metric_names::STEP_PHASE_SECONDS, "phase" => phase).record(d.as_secs_f64());
    }
    let slots = r.slots.slots();
    if slots == 0 || r.routed.len() != r.world * slots || r.layer_index >= r.slots.layers().len() {
        return;
    }
    let per_slot: Vec<u64> = (0..slots)
        .map(|s| {
            (0..r.world)
                .map(|src| u64::from(r.routed[src * slots + s]))
                .sum()
        })
        .collect();
    let phy2log = r.slots.layer(r.layer_index).phy2log();
    let experts = r.slots.experts;
    let mut per_expert = vec![0u64; experts];
    for (s, &n) in per_slot.iter().enumerate() {
        per_expert[phy2log[s] as usize] += n;
    }
    let local = r.slots.per_rank();
    let per_rank: Vec<u64> = per_slot.chunks(local).map(|c| c.iter().sum()).collect();
    histogram!(metric_names::RANK_RECEIVED_TOKENS).record(per_rank[r.rank] as f64);
    let total: u64 = per_expert.iter().sum();
    if total > 0 {
        let max_rank = *per_rank.iter().max().unwrap_or(&1) as f64;
        let max_expert = *per_expert.iter().max().unwrap_or(&1) as f64;
        let mean_rank = total as f64 / r.world as f64;
        let mean_expert = total as f64 / experts as f64;
        gauge!(metric_names::EXPERT_BALANCE_RATIO, "layer" => layer.clone())
            .set(mean_rank / max_rank);
        gauge!(metric_names::EXPERT_SKEW_RATIO, "layer" => layer.clone())
            .set(max_expert / mean_expert);
    }
    if r.per_expert {
        for s in r.slots.slots_of(r.rank) {
            let e = phy2log[s];
            counter!(metric_names::EXPERT_TOKENS_TOTAL, "layer" => layer.clone(), "expert" => e.to_string()).increment(per_slot[s]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `parts_us` is read by scripts/bench/eplb-steps.py in this order (its `PARTS`).
    #[test]
    fn enqueue_parts_print_in_the_order_the_trace_reader_names_them() {
        let us = Duration::from_micros;
        let p = EnqueueParts {
            before: us(6),
            copy_in: us(13),
            graph: us(1_250),
            copy_out: us(7),
        };
        assert_eq!(p.to_string(), "6,13,1250,7");
    }
}
