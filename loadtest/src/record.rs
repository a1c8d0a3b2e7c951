//! What a run records: its plan, and the counts and latencies of the requests started inside
//! the measured window.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;

use crate::config::Api;

#[derive(Clone, Copy, Debug)]
pub enum Mode {
    Closed(usize),
    Open(f64),
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub http2: epserve::transport::Http2,
    pub mode: Mode,
    pub api: Api,
    pub warmup: Duration,
    pub duration: Duration,
    pub timeout: Duration,
    pub connections: usize,
    pub max_in_flight: usize,
}

/// Counts and latencies of the requests started inside the window.
pub struct Recorder {
    warm_end: Instant,
    end: Instant,
    hist: Mutex<Histogram<u64>>,
    statuses: Mutex<BTreeMap<String, u64>>,
    pub sent: AtomicU64,
    pub not_sent: AtomicU64,
    /// OK answers that arrived inside the window (whenever sent): the throughput.
    completed: AtomicU64,
    completed_tokens: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
}

impl Recorder {
    pub(crate) fn new(warm_end: Instant, end: Instant) -> Self {
        Self {
            warm_end,
            end,
            hist: Mutex::new(
                Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram bounds"),
            ),
            statuses: Mutex::new(BTreeMap::new()),
            sent: AtomicU64::new(0),
            not_sent: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            completed_tokens: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
        }
    }
    pub(crate) fn counted(&self, started: Instant) -> bool {
        started >= self.warm_end && started < self.end
    }
    pub(crate) fn sent(&self, started: Instant, bytes: usize) {
        if self.counted(started) {
            self.sent.fetch_add(1, Ordering::Relaxed);
            self.bytes_out.fetch_add(bytes as u64, Ordering::Relaxed);
        }
    }
    pub(crate) fn done(&self, started: Instant, status: &str, tokens: usize, bytes_in: usize) {
        let now = Instant::now();
        if status == "OK" && now >= self.warm_end && now < self.end {
            self.completed.fetch_add(1, Ordering::Relaxed);
            self.completed_tokens
                .fetch_add(tokens as u64, Ordering::Relaxed);
        }
        if !self.counted(started) {
            return;
        }
        *self
            .statuses
            .lock()
            .unwrap()
            .entry(status.to_string())
            .or_default() += 1;
        if status == "OK" {
            let us = started.elapsed().as_micros().max(1) as u64;
            self.hist.lock().unwrap().saturating_record(us);
            self.bytes_in.fetch_add(bytes_in as u64, Ordering::Relaxed);
        }
    }
}

/// What the report reads out of the recorder.
pub struct Parts {
    pub completed: u64,
    pub completed_tokens: u64,
    pub statuses: BTreeMap<String, u64>,
    pub hist: Histogram<u64>,
    pub bytes_out: u64,
    pub bytes_in: u64,
}

impl Recorder {
    /// What the report reads.
    pub fn parts(&self) -> Parts {
        Parts {
            completed: self.completed.load(Ordering::Relaxed),
            completed_tokens: self.completed_tokens.load(Ordering::Relaxed),
            statuses: self.statuses.lock().unwrap().clone(),
            hist: self.hist.lock().unwrap().clone(),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
        }
    }
}
