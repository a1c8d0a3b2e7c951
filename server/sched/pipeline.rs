//! The pack -> step -> deliver pipeline, one for both sides: the leader packs every rank's rows
//! of the steps it forms (`executor`), a worker under `--ingress all` packs only its own clients'
//! rows of the steps the leader names (`own_rows`). Both copy rows into the ring with `pack` and
//! answer from it on a delivery thread (`Delivery`), then release the cell their side's way.

use std::ops::Range;
use std::sync::Arc;

use super::job::Step;
use super::rows::{copy_threads, deliver, leader_rows, pack};
use crate::step::ring::Ring;
use crate::transport::bufs::Bufs;
use crate::watchdog::AbortOnPanic;

/// Which of a step's rows this process copies, and which of them its own GPU rank loads itself.
#[derive(Clone, Copy, Debug)]
pub enum Share {
    /// The leader: every rank's rows (cell rows from 0); its own rank loads its home rows.
    Leader,
    /// A worker's own clients' rows, from `base` (its home in the cell); its rank loads them all.
    Own { base: usize },
}

impl Share {
    /// Where the step's rows start in the cell, and the ones this process's rank loads itself.
    fn rows(self, step: &Step, world: usize) -> (usize, Range<usize>) {
        match self {
            Share::Leader => (0, leader_rows(step, world)),
            Share::Own { base } => (base, base..base + step.tokens()),
        }
    }

    /// Copies the share's rows of `step` into ring cell `cell`, on up to `threads` threads.
    pub fn pack(self, ring: &Ring, step: &Step, cell: usize, threads: usize) {
        let (base, own) = self.rows(step, ring.shape.world);
        pack(ring, step, cell, base, threads, own);
    }
}

/// The delivery thread: answers each finished step's requests from its cell, then hands the cell
/// back (`release`). Dropping it answers every step sent so far before it returns.
pub struct Delivery {
    tx: Option<std::sync::mpsc::SyncSender<(Step, usize)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Delivery {
    /// `guard`: what to break if the thread panics (the leader's group; None on a worker, whose
    /// step loop finds out from the step after).
    pub fn start(
        ring: Arc<Ring>,
        share: Share,
        bufs: Arc<Bufs>,
        release: impl Fn(usize) + Send + 'static,
        guard: Option<AbortOnPanic>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<(Step, usize)>(ring.shape.cells);
        let thread = std::thread::Builder::new()
            .name("step-deliver".into())
            .spawn(move || {
                let _guard = guard;
                let threads = copy_threads();
                for (step, cell) in rx {
                    let (base, own) = share.rows(&step, ring.shape.world);
                    deliver(&ring, &step, cell, base, threads, &bufs, own);
                    release(cell);
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Hands a finished step (in `cell`) to the thread.
    pub fn send(&self, step: Step, cell: usize) {
        if let Some(tx) = &self.tx {
            // The thread ends only when this value is dropped.
            let _ = tx.send((step, cell));
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
