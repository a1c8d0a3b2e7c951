//! When a partial step may be formed behind another one. A partial step waits to fill, so it
//! should be formed as late as it can and still be packed by the time the ranks are free. Formed
//! only once the pipeline is empty, it leaves the ranks idle while the step before is delivered
//! and it is packed (measured on 2x H200 at 128 tokens: busy 59-65% of the time). So it is formed
//! once every step before it has finished on the ranks, or once the one still running there is
//! due to end within a packing time.
//!
//! The batcher counts the steps it forms; the packer and the executor report the rest.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
// The batcher's clock (paused in its tests); the std clock on the executor's threads.
use tokio::time::Instant;

pub struct Pace {
    base: Instant,
    /// Steps the batcher formed, the executor submitted to the ranks, and the ranks finished.
    formed: AtomicU64,
    submitted: AtomicU64,
    finished: AtomicU64,
    /// Microseconds since `base`: the last step submitted, and the last one finished.
    submitted_at: AtomicU64,
    finished_at: AtomicU64,
    /// Moving averages, in microseconds: a step's time on the ranks, and its packing.
    step_us: AtomicU64,
    pack_us: AtomicU64,
    /// Told on every report, so the batcher looks again.
    pub changed: Notify,
}

impl Default for Pace {
    fn default() -> Self {
        Self {
            base: Instant::now(),
            formed: AtomicU64::new(0),
            submitted: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            submitted_at: AtomicU64::new(0),
            finished_at: AtomicU64::new(0),
            step_us: AtomicU64::new(0),
            pack_us: AtomicU64::new(0),
            changed: Notify::new(),
        }
    }
}

/// An eighth of each new sample: steps of one load settle within a few dozen.
fn average(into: &AtomicU64, sample: Duration) {
    let new = sample.as_micros() as u64;
    let old = into.load(Ordering::Relaxed);
    let avg = if old == 0 {
        new
    } else {
        old - old / 8 + new / 8
    };
    into.store(avg, Ordering::Relaxed);
}

impl Pace {
    fn now_us(&self) -> u64 {
        self.base.elapsed().as_micros() as u64
    }

    /// The batcher formed a step.
    pub fn formed(&self) {
        self.formed.fetch_add(1, Ordering::AcqRel);
    }

    /// The packer packed a step in `took` (one thread writes this average).
    pub fn packed(&self, took: Duration) {
        average(&self.pack_us, took);
    }

    /// The executor sent a formed step to the ranks.
    pub fn submitted(&self) {
        self.submitted_at.store(self.now_us(), Ordering::Release);
        self.submitted.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_one();
    }

    /// The ranks finished a formed step, busy for `busy` (one thread writes this average).
    pub fn finished(&self, busy: Duration) {
        average(&self.step_us, busy);
        self.finished_at.store(self.now_us(), Ordering::Release);
        self.finished.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_one();
    }

    /// How long until a partial step formed now would be packed just as the ranks are free:
    /// zero when every formed step has finished on the ranks; the time left to the running
    /// step's expected end, less a packing time and `slack`, when one step is on the ranks.
    /// None (look again on `changed`) while a formed step is still being packed, two are ahead,
    /// no step has finished yet, or the running one has run twice as long as steps do: a
    /// stalled step is waited for, so the requests behind it stay in the queue, where they can
    /// still be cancelled. The batcher forms a partial step once the pipeline is empty in any
    /// case, so a step that never reports (the group broke) holds nothing up.
    pub fn partial_in(&self, slack: Duration) -> Option<Duration> {
        let finished = self.finished.load(Ordering::Acquire);
        let submitted = self.submitted.load(Ordering::Acquire);
        let formed = self.formed.load(Ordering::Acquire);
        if formed <= finished {
            return Some(Duration::ZERO);
        }
        if formed > finished + 1 || submitted < formed {
            return None;
        }
        // The one step ahead is on the ranks: busy since it was sent or since the one before
        // it finished, whichever came later.
        let since = self
            .submitted_at
            .load(Ordering::Acquire)
            .max(self.finished_at.load(Ordering::Acquire));
        let step_us = self.step_us.load(Ordering::Relaxed);
        let (ends, now) = (since + step_us, self.now_us());
        if step_us == 0 || now > ends + step_us {
            return None;
        }
        let lead = self.pack_us.load(Ordering::Relaxed) + slack.as_micros() as u64;
        Some(Duration::from_micros(
            ends.saturating_sub(lead).saturating_sub(now),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_step_is_due_a_packing_time_before_the_running_one_ends() {
        let p = Pace::default();
        assert_eq!(p.partial_in(Duration::ZERO), Some(Duration::ZERO), "idle");
        // One step formed, not yet on the ranks: look again once it is.
        p.formed();
        assert_eq!(p.partial_in(Duration::ZERO), None);
        p.packed(Duration::from_millis(2));
        p.submitted();
        // No step has finished yet, so no step time is known: not before it ends.
        assert_eq!(p.partial_in(Duration::ZERO), None);
        p.finished(Duration::from_millis(10));
        assert_eq!(
            p.partial_in(Duration::ZERO),
            Some(Duration::ZERO),
            "all done"
        );
        // A second step on the ranks: due 10 - 2 - 1 ms after it was sent.
        p.formed();
        p.submitted();
        let due = p.partial_in(Duration::from_millis(1)).unwrap();
        assert!(
            due > Duration::from_millis(6) && due <= Duration::from_millis(7),
            "{due:?}"
        );
        // Two formed steps ahead: not before one of them finishes.
        p.formed();
        assert_eq!(p.partial_in(Duration::ZERO), None);
        p.finished(Duration::from_millis(10));
        assert!(
            p.partial_in(Duration::ZERO).is_none(),
            "the next is being packed"
        );
        p.submitted();
        p.finished(Duration::from_millis(10));
        assert_eq!(p.partial_in(Duration::ZERO), Some(Duration::ZERO));
    }

    #[test]
    fn a_step_running_twice_as_long_as_steps_do_is_waited_for() {
        let p = Pace::default();
        p.formed();
        p.submitted();
        p.finished(Duration::from_millis(200));
        p.formed();
        p.submitted();
        assert!(p.partial_in(Duration::ZERO).is_some_and(|d| !d.is_zero()));
        std::thread::sleep(Duration::from_millis(401));
        assert_eq!(p.partial_in(Duration::ZERO), None, "stalled");
        p.finished(Duration::from_millis(401));
        assert_eq!(p.partial_in(Duration::ZERO), Some(Duration::ZERO));
    }

    #[test]
    fn the_averages_follow_new_samples_by_an_eighth() {
        let p = Pace::default();
        p.finished(Duration::from_micros(8000));
        assert_eq!(p.step_us.load(Ordering::Relaxed), 8000);
        p.finished(Duration::from_micros(16000));
        assert_eq!(p.step_us.load(Ordering::Relaxed), 9000);
    }
}
