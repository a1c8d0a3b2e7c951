//! Waits that cannot be trusted to end: a step on a device, or collective setup, can hang inside a
//! library that ignores every timeout we give it (a stopped peer leaves NCCL kernels spinning, and
//! `ncclCommAbort` waits on NCCL EP's kernels). The watchdogs here never wait on such a call: they
//! watch it from another thread and, past its bound, break the group or end the process.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Whether a step is running, and since when (read by the liveness probe and the watchdogs).
pub struct Progress {
    base: Instant,
    /// Microseconds since `base` when the running step began, plus one; 0 when idle.
    busy_since: AtomicU64,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            base: Instant::now(),
            busy_since: AtomicU64::new(0),
        }
    }
}

impl Progress {
    pub fn begin(&self) {
        self.begin_at(Instant::now());
    }
    /// The oldest step in flight began at `at` (the next one, once the oldest completes).
    pub fn begin_at(&self, at: Instant) {
        let since = at.saturating_duration_since(self.base).as_micros() as u64;
        self.busy_since.store(since + 1, Ordering::Release);
    }
    pub fn end(&self) {
        self.busy_since.store(0, Ordering::Release);
    }
    /// How long the running step has run (None while idle).
    pub fn running_for(&self) -> Option<Duration> {
        match self.busy_since.load(Ordering::Acquire) {
            0 => None,
            t => Some(
                self.base
                    .elapsed()
                    .saturating_sub(Duration::from_micros(t - 1)),
            ),
        }
    }
    /// Past `limit`: how long the running step has run.
    pub fn overdue(&self, limit: Duration) -> Option<Duration> {
        self.running_for().filter(|d| *d > limit)
    }
}

/// How long past --step-timeout a step may go before its rank stops waiting for it: the step's own
/// bounded waits normally end it at the timeout; this catches the ones that cannot end.
pub const STUCK_GRACE: Duration = Duration::from_millis(250);

/// Breaks the group with the given reason if the thread holding it unwinds, so a bug fails fast
/// instead of leaving clients waiting.
pub struct AbortOnPanic(
    pub std::sync::Arc<crate::lifecycle::Abort>,
    pub &'static str,
);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.trigger(self.1);
        }
    }
}

/// Ends the process at once with `code`, running no destructors or exit handlers (a thread may be
/// stuck in a driver call that teardown would wait on). The kernel then reclaims the devices, as
/// for `kill -9`.
pub fn exit_now(code: i32, why: &str) -> ! {
    tracing::error!("exiting without teardown: {why}");
    eprintln!("epserve: exiting without teardown: {why}");
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    crate::sys::exit_immediately(code)
}

/// Ends the process if the setup it guards has not finished by `deadline` (collective setup that
/// takes no timeout of its own, e.g. NCCL EP group creation and graph capture).
pub struct SetupDeadline {
    done: Option<mpsc::Sender<()>>,
}

impl SetupDeadline {
    pub fn new(what: &'static str, deadline: Instant) -> Self {
        let (tx, rx) = mpsc::channel::<()>();
        let spawned = std::thread::Builder::new()
            .name("setup-deadline".into())
            .spawn(move || {
                let left = deadline.saturating_duration_since(Instant::now());
                if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(left) {
                    exit_now(
                        1,
                        &format!("{what} did not finish within --rendezvous-timeout"),
                    );
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no deadline on {what}: {e}");
        }
        Self { done: Some(tx) }
    }
}

impl Drop for SetupDeadline {
    fn drop(&mut self) {
        // A send ends the watcher; so would the sender's drop. Either way it never fires.
        if let Some(tx) = self.done.take() {
            let _ = tx.send(());
        }
    }
}

/// Calls `stuck` once, from its own thread, if one step runs past `limit` + `STUCK_GRACE`.
pub fn watch_steps(
    progress: std::sync::Arc<Progress>,
    limit: Duration,
    stuck: impl FnOnce(Duration) + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("step-watchdog".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_millis(50));
            if let Some(d) = progress.overdue(limit + STUCK_GRACE) {
                stuck(d);
                return;
            }
        })
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_step_past_its_limit_is_reported_once() {
        let p = Arc::new(Progress::default());
        assert_eq!(p.running_for(), None);
        let (tx, rx) = mpsc::channel();
        watch_steps(p.clone(), Duration::from_millis(10), move |d| {
            tx.send(d).unwrap()
        })
        .unwrap();
        p.begin();
        std::thread::sleep(Duration::from_millis(100));
        p.end();
        assert_eq!(
            rx.recv_timeout(Duration::from_millis(700)),
            Err(mpsc::RecvTimeoutError::Timeout)
        );
        p.begin();
        let d = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(d > Duration::from_millis(10) + STUCK_GRACE, "{d:?}");
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
    }
}
