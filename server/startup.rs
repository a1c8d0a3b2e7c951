//! Startup, stage by stage. A real checkpoint loads for minutes and NCCL EP's JIT and graph
//! capture add more, so each stage is logged as it begins and exported: an operator (or an alert
//! that must not page during a slow start) sees where a rank is and how long each stage took.
//! - `epserve_startup_stage{stage}`: 1 for the stage this rank is in, 0 for the others;
//! - `epserve_startup_seconds{stage}`: how long each finished stage took.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::metric_names;

/// A rank's stages, in order; a worker skips `WarmUp` (the leader drives that step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Reading this rank's experts and placing them where they compute.
    Load,
    /// Waiting for every rank to join.
    Rendezvous,
    /// Exchange buffers, the communicator, graph capture, in lockstep with the group.
    BringUp,
    /// One step through every rank before the first request.
    WarmUp,
    /// Ready: taking requests or steps.
    Ready,
}

pub const STAGES: [Stage; 5] = [
    Stage::Load,
    Stage::Rendezvous,
    Stage::BringUp,
    Stage::WarmUp,
    Stage::Ready,
];

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Load => "load",
            Stage::Rendezvous => "rendezvous",
            Stage::BringUp => "bringup",
            Stage::WarmUp => "warmup",
            Stage::Ready => "ready",
        }
    }

    fn doing(self) -> &'static str {
        match self {
            Stage::Load => "loading weights",
            Stage::Rendezvous => "waiting for every rank to join",
            Stage::BringUp => "setting up the exchange and the step (graphs) with the group",
            Stage::WarmUp => "running the warm-up step",
            Stage::Ready => "ready",
        }
    }
}

/// The stage this process is in and since when (one rank per process).
static CURRENT: Mutex<Option<(Stage, Instant)>> = Mutex::new(None);

/// Every stage at 0, so the series exist from the first scrape.
pub fn zero_series() {
    for s in STAGES {
        metrics::gauge!(metric_names::STARTUP_STAGE, "stage" => s.name()).set(0.0);
    }
}

/// This rank enters `stage`: the one before is timed, and the change is logged.
pub fn enter(stage: Stage) {
    let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    let took = cur.take().map(|(before, since)| {
        let d = since.elapsed();
        metrics::gauge!(metric_names::STARTUP_STAGE, "stage" => before.name()).set(0.0);
        metrics::gauge!(metric_names::STARTUP_SECONDS, "stage" => before.name())
            .set(d.as_secs_f64());
        (before, d)
    });
    metrics::gauge!(metric_names::STARTUP_STAGE, "stage" => stage.name()).set(1.0);
    match took {
        Some((before, d)) => tracing::info!(
            stage = stage.name(),
            after = before.name(),
            after_seconds = secs(d),
            "startup: {}",
            stage.doing()
        ),
        None => tracing::info!(stage = stage.name(), "startup: {}", stage.doing()),
    }
    *cur = Some((stage, Instant::now()));
}

/// Until this rank is ready, logs `startup: still <stage>` every `every` that a stage has lasted
/// longer than `every`: a stage with no progress of its own (the weights' upload to the GPU,
/// NCCL EP's first-use JIT, graph capture) still shows it is alive and for how long.
pub fn watch(every: Duration) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("startup-watch".into())
        .spawn(move || loop {
            std::thread::sleep(every);
            let cur = *CURRENT.lock().unwrap_or_else(|e| e.into_inner());
            match still(cur, every) {
                Still::Ready => return,
                Still::Quiet => {}
                Still::For(stage, d) => tracing::info!(
                    stage = stage.name(),
                    seconds = secs(d),
                    "startup: still {}",
                    stage.doing()
                ),
            }
        })?;
    Ok(())
}

#[derive(Debug, PartialEq)]
enum Still {
    Ready,
    /// No stage yet, or the current one is younger than the interval.
    Quiet,
    For(Stage, Duration),
}

fn still(cur: Option<(Stage, Instant)>, every: Duration) -> Still {
    match cur {
        Some((Stage::Ready, _)) => Still::Ready,
        Some((stage, since)) if since.elapsed() >= every => Still::For(stage, since.elapsed()),
        _ => Still::Quiet,
    }
}

/// Seconds to the millisecond, for logs.
pub fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e3).round() / 1e3
}

/// Progress of a long stage, logged at most every `every` (and at the end): how far, how many
/// bytes, at what rate.
pub struct Progress {
    what: &'static str,
    total: usize,
    done: usize,
    bytes: u64,
    t0: Instant,
    last: Instant,
    every: Duration,
}

impl Progress {
    pub fn new(what: &'static str, total: usize, every: Duration) -> Self {
        let now = Instant::now();
        Self {
            what,
            total,
            done: 0,
            bytes: 0,
            t0: now,
            last: now,
            every,
        }
    }

    /// One more of `total` done, `bytes` in it; true when this call logged.
    pub fn tick(&mut self, bytes: u64) -> bool {
        self.done += 1;
        self.bytes += bytes;
        let end = self.done == self.total;
        if !end && self.last.elapsed() < self.every {
            return false;
        }
        self.last = Instant::now();
        let s = self.t0.elapsed().as_secs_f64().max(1e-9);
        tracing::info!(
            done = self.done,
            of = self.total,
            bytes = self.bytes,
            seconds = secs(self.t0.elapsed()),
            mib_per_s = (self.bytes as f64 / s / (1 << 20) as f64).round(),
            "{}",
            self.what
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_stage_is_said_until_ready() {
        let every = Duration::from_millis(50);
        let long_ago = Instant::now() - Duration::from_secs(3);
        assert_eq!(still(None, every), Still::Quiet);
        assert_eq!(
            still(Some((Stage::Load, Instant::now())), every),
            Still::Quiet
        );
        match still(Some((Stage::BringUp, long_ago)), every) {
            Still::For(Stage::BringUp, d) => assert!(d >= Duration::from_secs(3)),
            other => panic!("{other:?}"),
        }
        assert_eq!(still(Some((Stage::Ready, long_ago)), every), Still::Ready);
    }

    #[test]
    fn progress_logs_at_the_interval_and_at_the_end() {
        let mut p = Progress::new("layers loaded", 3, Duration::from_secs(3600));
        assert!(!p.tick(10), "the first of three, long before the interval");
        assert!(!p.tick(10));
        assert!(p.tick(10), "the last always logs");
        let mut p = Progress::new("layers loaded", 3, Duration::ZERO);
        assert!(p.tick(1) && p.tick(1) && p.tick(1));
        assert_eq!(p.bytes, 3);
    }
}
