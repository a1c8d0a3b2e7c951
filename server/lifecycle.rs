//! A group's life as every part of a rank sees it: `Abort`, the group broken (set once, by
//! whoever sees it first; sync waiters poll it, async ones await it), and `nap`, the wait between
//! polls of what has no wake-up of its own. A leaf: every layer imports it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Why a group-wide wait ended early: set once by whoever sees the group break first. Sync
/// waiters poll `reason`; async ones await `broken`.
#[derive(Default)]
pub struct Abort {
    set: AtomicBool,
    reason: Mutex<Option<String>>,
    /// The step's output cannot be trusted (not merely lost): its requests get INTERNAL.
    corrupt: AtomicBool,
    token: tokio_util::sync::CancellationToken,
    /// A halt (`--on-rank-loss continue`): the steps in flight end, the group is not broken,
    /// and the waits run again once `resume` clears it.
    halt: Mutex<Option<String>>,
    halted: AtomicBool,
    /// Ranks the group went on without: nothing they send is applied here any more.
    fenced: Mutex<Vec<usize>>,
    any_fenced: AtomicBool,
}

impl Abort {
    pub fn trigger(&self, reason: impl Into<String>) {
        self.set_first(reason.into(), false);
    }
    /// Breaks the group because a step computed something wrong (the first cause wins).
    pub fn trigger_corrupt(&self, reason: impl Into<String>) {
        self.set_first(reason.into(), true);
    }
    fn set_first(&self, reason: String, corrupt: bool) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(reason);
            self.corrupt.store(corrupt, Ordering::Release);
        }
        self.set.store(true, Ordering::Release);
        self.token.cancel();
    }
    pub fn reason(&self) -> Option<String> {
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    /// The group broke because a step's output was wrong, not because a rank was lost.
    pub fn corrupt(&self) -> bool {
        self.corrupt.load(Ordering::Acquire)
    }
    /// Ends every wait of the steps in flight without breaking the group (a lost rank the
    /// group goes on without); the first reason is kept until `resume`.
    pub fn halt(&self, reason: impl Into<String>) {
        let mut h = self.halt.lock().unwrap_or_else(|e| e.into_inner());
        if h.is_none() {
            *h = Some(reason.into());
        }
        self.halted.store(true, Ordering::Release);
    }
    /// Steps may wait again (the group has its new roster).
    pub fn resume(&self) {
        *self.halt.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.halted.store(false, Ordering::Release);
    }
    /// Why the steps in flight are being ended, while they are.
    pub fn halting(&self) -> Option<String> {
        if !self.halted.load(Ordering::Acquire) {
            return None;
        }
        self.halt.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    /// `rank` is out of the group: its data connections' frames are dropped from now on (a
    /// stopped rank that wakes must not write into this rank's memory).
    pub fn fence(&self, rank: usize) {
        let mut f = self.fenced.lock().unwrap_or_else(|e| e.into_inner());
        if !f.contains(&rank) {
            f.push(rank);
        }
        self.any_fenced.store(true, Ordering::Release);
    }
    /// `rank` is back in the group.
    pub fn unfence(&self, rank: usize) {
        let mut f = self.fenced.lock().unwrap_or_else(|e| e.into_inner());
        f.retain(|&r| r != rank);
        self.any_fenced.store(!f.is_empty(), Ordering::Release);
    }
    /// Whether `rank` is out of the group.
    pub fn is_fenced(&self, rank: usize) -> bool {
        self.any_fenced.load(Ordering::Acquire)
            && (self.fenced.lock().unwrap_or_else(|e| e.into_inner())).contains(&rank)
    }
    /// Why a step's wait must end now: the group broke, or it is halting.
    pub fn stop_reason(&self) -> Option<String> {
        self.reason().or_else(|| self.halting())
    }
    /// Resolves once the group is broken, with the reason.
    pub async fn broken(&self) -> String {
        self.token.cancelled().await;
        self.reason().unwrap_or_default()
    }
}

/// Between polls of something with no wake-up to wait on (a device event, or a step in flight
/// while the channel that may bring the next one is watched too): spins first, since the end is
/// often microseconds away, then naps.
pub fn nap(polls: &mut u32) {
    *polls += 1;
    match *polls < 2000 {
        true => std::hint::spin_loop(),
        false => std::thread::sleep(Duration::from_micros(20)),
    }
}
