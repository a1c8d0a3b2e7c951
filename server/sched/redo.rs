//! Rows of the steps a lost rank ended (`--on-rank-loss continue`): the executor hands them
//! back, the batcher runs them again before anything queued after them, and the most tokens a
//! step may carry shrinks with the ranks left (each has buffers for its share of a full step).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use tokio::sync::Notify;

use super::job::Segment;

pub struct Redo {
    rows: Mutex<Vec<Segment>>,
    pub(super) wake: Notify,
    cap: AtomicUsize,
}

impl Redo {
    pub fn new(cap: usize) -> Self {
        Self {
            rows: Mutex::default(),
            wake: Notify::new(),
            cap: AtomicUsize::new(cap),
        }
    }

    /// Rows to run again, oldest first.
    pub fn give(&self, mut segs: Vec<Segment>) {
        if segs.is_empty() {
            return;
        }
        self.rows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .append(&mut segs);
        self.wake.notify_one();
    }

    pub(super) fn take(&self) -> Vec<Segment> {
        std::mem::take(&mut *self.rows.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Most tokens of a step now.
    pub fn cap(&self) -> usize {
        self.cap.load(Ordering::Acquire)
    }

    pub fn set_cap(&self, tokens: usize) {
        self.cap.store(tokens, Ordering::Release);
        self.wake.notify_one();
    }
}
