//! `--log-stats-interval`: one `stats` line per interval with what a dashboard shows, for an
//! operator who has only the logs. Each figure covers the interval just ended: requests answered
//! and failed, tokens/s answered, steps run here with their mean time, the share of the interval
//! this rank spent in steps (`busy`: on the GPU backends, its GPU), and the queue now.
//! The tallies are plain atomics bumped beside the Prometheus counters (the exporter keeps no
//! values this process can read back cheaply).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

struct Tally {
    answered: AtomicU64,
    failed: AtomicU64,
    tokens: AtomicU64,
    steps: AtomicU64,
    step_nanos: AtomicU64,
    queue_requests: AtomicU64,
    queue_tokens: AtomicU64,
}

static TALLY: Tally = Tally {
    answered: AtomicU64::new(0),
    failed: AtomicU64::new(0),
    tokens: AtomicU64::new(0),
    steps: AtomicU64::new(0),
    step_nanos: AtomicU64::new(0),
    queue_requests: AtomicU64::new(0),
    queue_tokens: AtomicU64::new(0),
};

/// A request finished: answered with `tokens`, or failed.
pub fn request(ok: bool, tokens: u64) {
    match ok {
        true => {
            TALLY.answered.fetch_add(1, Relaxed);
            TALLY.tokens.fetch_add(tokens, Relaxed);
        }
        false => {
            TALLY.failed.fetch_add(1, Relaxed);
        }
    }
}

/// A work step ran here for `d`.
pub fn step(d: Duration) {
    TALLY.steps.fetch_add(1, Relaxed);
    TALLY.step_nanos.fetch_add(d.as_nanos() as u64, Relaxed);
}

/// What waits for a step now.
pub fn queue(requests: usize, tokens: usize) {
    TALLY.queue_requests.store(requests as u64, Relaxed);
    TALLY.queue_tokens.store(tokens as u64, Relaxed);
}

/// The counters at one instant.
#[derive(Clone, Copy, Default)]
struct Snapshot {
    answered: u64,
    failed: u64,
    tokens: u64,
    steps: u64,
    step_nanos: u64,
}

impl Snapshot {
    fn now() -> Self {
        Self {
            answered: TALLY.answered.load(Relaxed),
            failed: TALLY.failed.load(Relaxed),
            tokens: TALLY.tokens.load(Relaxed),
            steps: TALLY.steps.load(Relaxed),
            step_nanos: TALLY.step_nanos.load(Relaxed),
        }
    }
}

/// One interval's figures, rounded for reading.
#[derive(Debug, PartialEq)]
struct Line {
    answered: u64,
    failed: u64,
    tokens_per_s: f64,
    steps: u64,
    step_ms: f64,
    busy: f64,
}

fn line(a: Snapshot, b: Snapshot, over: Duration) -> Line {
    let secs = over.as_secs_f64().max(1e-9);
    let steps = b.steps - a.steps;
    let nanos = (b.step_nanos - a.step_nanos) as f64;
    let round = |v: f64, places: i32| (v * 10f64.powi(places)).round() / 10f64.powi(places);
    Line {
        answered: b.answered - a.answered,
        failed: b.failed - a.failed,
        tokens_per_s: round((b.tokens - a.tokens) as f64 / secs, 0),
        steps,
        step_ms: round(
            if steps == 0 {
                0.0
            } else {
                nanos / steps as f64 / 1e6
            },
            3,
        ),
        busy: round((nanos / 1e9 / secs).min(1.0), 3),
    }
}

/// Logs a `stats` line every `every` for the life of the process (0: never).
pub fn spawn(every: Duration) -> std::io::Result<()> {
    if every.is_zero() {
        return Ok(());
    }
    std::thread::Builder::new()
        .name("stats-log".into())
        .spawn(move || {
            let (mut before, mut t) = (Snapshot::now(), Instant::now());
            loop {
                std::thread::sleep(every);
                let (now, at) = (Snapshot::now(), Instant::now());
                let l = line(before, now, at - t);
                tracing::info!(
                    requests = l.answered,
                    failed = l.failed,
                    tokens_per_s = l.tokens_per_s,
                    steps = l.steps,
                    step_ms = l.step_ms,
                    busy = l.busy,
                    queue_requests = TALLY.queue_requests.load(Relaxed),
                    queue_tokens = TALLY.queue_tokens.load(Relaxed),
                    interval_seconds = every.as_secs_f64(),
                    "stats"
                );
                (before, t) = (now, at);
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_covers_its_interval_only() {
        let a = Snapshot {
            answered: 10,
            failed: 1,
            tokens: 1000,
            steps: 5,
            step_nanos: 5_000_000,
        };
        let b = Snapshot {
            answered: 14,
            failed: 3,
            tokens: 5000,
            steps: 9,
            step_nanos: 5_000_000 + 4 * 250_000_000,
        };
        let l = line(a, b, Duration::from_secs(2));
        let want = Line {
            answered: 4,
            failed: 2,
            tokens_per_s: 2000.0,
            steps: 4,
            step_ms: 250.0,
            busy: 0.5,
        };
        assert_eq!(l, want);
        // No steps: no mean to divide by; busy never reads above 1.
        assert_eq!(line(a, a, Duration::from_secs(1)).step_ms, 0.0);
        let mut c = b;
        c.step_nanos += 10_000_000_000;
        assert_eq!(line(a, c, Duration::from_secs(2)).busy, 1.0);
    }
}
