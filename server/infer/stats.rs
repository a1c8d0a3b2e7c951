//! Per-layer request statistics as Triton's ModelStatistics reports them: counts and total
//! nanoseconds, cumulative since start. Taken from the same instants as the Prometheus
//! histograms (`epserve_request_queue_seconds`, `epserve_request_in_step_seconds`), so the two
//! agree; kept here because Triton's tools want totals per model, which histograms do not give.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::dtype::Dtype;
use crate::sched::Timings;

/// The model a request is counted under, so that each request counts once: the KServe model it
/// named (`layer-<L>`, a typed `-bf16`/`-fp16` one, each also `-gated`); epserve.v1's Forward
/// counts under `layer-<L>`, the model that takes any float type as Forward does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tally {
    /// The typed model's float type; None for `layer-<L>`.
    pub float: Option<Dtype>,
    pub gated: bool,
}

impl Tally {
    pub const FORWARD: Tally = Tally {
        float: None,
        gated: false,
    };
    /// Models per layer.
    pub const PER_LAYER: usize = 6;

    pub fn slot(self) -> usize {
        let float = match self.float {
            None => 0,
            Some(Dtype::Bf16) => 1,
            Some(_) => 2,
        };
        2 * float + usize::from(self.gated)
    }
}

/// A count and the total time of what it counts.
#[derive(Default)]
pub struct Total {
    count: AtomicU64,
    ns: AtomicU64,
}

impl Total {
    fn add(&self, d: Duration) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// (count, nanoseconds).
    pub fn get(&self) -> (u64, u64) {
        (
            self.count.load(Ordering::Relaxed),
            self.ns.load(Ordering::Relaxed),
        )
    }
}

/// One model's statistics (a layer, as one of its KServe models: `Tally`).
#[derive(Default)]
pub struct LayerStats {
    /// Answered requests, admission to answer.
    pub success: Total,
    /// Requests that failed once they reached the entry (validation onwards), or whose caller
    /// left before the answer.
    pub fail: Total,
    /// Admission to the first step carrying one of the request's rows.
    pub queue: Total,
    /// Copying the rows of the request's steps into the step ring (each step's whole copy).
    pub compute_input: Total,
    /// The first step to the last row delivered, less the copies in and out.
    pub compute_infer: Total,
    /// Copying the rows of the request's steps out of the ring.
    pub compute_output: Total,
    /// Steps of this layer, each counted by the request whose rows led it.
    pub executions: AtomicU64,
    /// Milliseconds since the epoch of the last answered request.
    pub last_answer_ms: AtomicU64,
}

impl LayerStats {
    pub fn answered(&self, took: Duration, t: &Timings) {
        self.success.add(took);
        if let Some(q) = t.queue {
            self.queue.add(q);
        }
        // Triton's tools want the three counted alike: one each per answered request.
        if let Some(c) = t.in_step {
            self.compute_input.add(t.input);
            self.compute_infer.add(c.saturating_sub(t.input + t.output));
            self.compute_output.add(t.output);
        }
        self.executions
            .fetch_add(t.led_steps as u64, Ordering::Relaxed);
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        self.last_answer_ms
            .store(now.as_millis() as u64, Ordering::Relaxed);
    }

    /// A failed request; `t` if it was admitted (its steps still ran).
    pub fn failed(&self, took: Duration, t: Option<&Timings>) {
        self.fail.add(took);
        if let Some(t) = t {
            self.executions
                .fetch_add(t.led_steps as u64, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_add_counts_and_nanoseconds_and_steps_count_once() {
        let s = LayerStats::default();
        let t = Timings {
            queue: Some(Duration::from_micros(3)),
            in_step: Some(Duration::from_micros(10)),
            input: Duration::from_micros(1),
            output: Duration::from_micros(2),
            led_steps: 2,
        };
        s.answered(Duration::from_micros(20), &t);
        s.answered(Duration::from_micros(30), &Timings::default());
        s.failed(Duration::from_micros(5), None);
        s.failed(Duration::from_micros(7), Some(&t));
        assert_eq!(s.success.get(), (2, 50_000));
        assert_eq!(s.queue.get(), (1, 3_000));
        assert_eq!(s.compute_input.get(), (1, 1_000));
        assert_eq!(s.compute_infer.get(), (1, 7_000));
        assert_eq!(s.compute_output.get(), (1, 2_000));
        assert_eq!(s.fail.get(), (2, 12_000));
        assert_eq!(s.executions.load(Ordering::Relaxed), 4);
        assert!(s.last_answer_ms.load(Ordering::Relaxed) > 1_700_000_000_000);
    }
}
