//! A new placement staged on one rank, whatever holds its weights: which of the rank's slots it
//! rewrites, their weights loaded on a thread of their own (off the step path), and handed to the
//! step that applies it. A newer placement asked for supersedes a slower load of an older one.
//!
//! The load runs in Linux's SCHED_IDLE class, on its thread and on the load pool (`background`):
//! background work beside the serving threads. On one 2x H100 host, two ranks staging at the
//! serving threads' priority stopped the pipeline for 30-80 ms 27-40 times a run, each gap beside
//! a batch's load or upload (docs/benchmarks.md "Load balance", session 48). Nice 10 cut that to
//! 1-2 gaps a run, but staging still cost the serving beside it 8.8% of its tokens/s on one H200
//! (bf16 on nccl-ep): a nice-10 thread still gets its turns on a busy core. SCHED_IDLE's share of
//! a busy core is 36x smaller (weight 3 against 110), and a waking serving thread takes its core
//! at once: the loss fell to 4.6% in the same call, and a placement took 1.2-1.7x as long to
//! stage ("Staging in SCHED_IDLE").

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Once};

use super::SlotMap;

/// The slots of `rank` that `next` rewrites against `cur`: each one's (layer, index on the rank)
/// and the (layer, logical expert) whose weights it takes.
pub fn rewritten(
    cur: &SlotMap,
    next: &SlotMap,
    rank: usize,
) -> Vec<((usize, usize), (usize, usize))> {
    let first = cur.slots_of(rank).start;
    let mut out = Vec::new();
    for (l, slots) in cur.changed(next, rank).into_iter().enumerate() {
        for slot in slots {
            out.push((
                (l, slot - first),
                (l, next.layer(l).phy2log()[slot] as usize),
            ));
        }
    }
    out
}

/// A placement whose weights are loaded: its epoch, its map, and what the backend holds them in.
pub struct Loaded<T> {
    pub epoch: u32,
    pub map: Arc<SlotMap>,
    pub weights: T,
}

/// At most one placement staged, until a step takes it.
pub struct Stager<T> {
    held: Arc<Mutex<Option<Loaded<T>>>>,
    /// The newest epoch asked for.
    asked: Arc<AtomicU32>,
}

impl<T> Default for Stager<T> {
    fn default() -> Self {
        Self {
            held: Arc::default(),
            asked: Arc::default(),
        }
    }
}

impl<T: Send + 'static> Stager<T> {
    /// Runs `load` (the weights and the bytes read) on a thread of its own for `epoch`; `done`
    /// hears the bytes once they are held, or why not.
    pub fn stage(
        &self,
        epoch: u32,
        map: Arc<SlotMap>,
        load: impl FnOnce() -> Result<(T, u64), String> + Send + 'static,
        done: impl FnOnce(Result<u64, String>) + Send + 'static,
    ) {
        let (held, asked) = (self.held.clone(), self.asked.clone());
        asked.store(epoch, Ordering::Release);
        let spawned = std::thread::Builder::new()
            .name("eplb-stage".into())
            .spawn(move || {
                background();
                let (weights, bytes) = match load() {
                    Ok(v) => v,
                    Err(e) => return done(Err(e)),
                };
                let mut h = held.lock().unwrap_or_else(|e| e.into_inner());
                if asked.load(Ordering::Acquire) != epoch {
                    drop(h);
                    return done(Err(format!("placement epoch {epoch} was superseded")));
                }
                *h = Some(Loaded {
                    epoch,
                    map,
                    weights,
                });
                drop(h);
                done(Ok(bytes));
            });
        if let Err(e) = spawned {
            // `done` moved into the closure that failed to spawn: the proposal times out.
            tracing::warn!(epoch, "could not start staging a placement: {e}");
        }
    }

    /// The placement staged for `epoch` on `rank`, to apply now.
    pub fn take(&self, epoch: u32, rank: usize) -> Result<Loaded<T>, String> {
        match self.held.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(s) if s.epoch == epoch => Ok(s),
            other => Err(format!(
                "placement epoch {epoch} is not staged on rank {rank} (staged: {:?})",
                other.map(|s| s.epoch)
            )),
        }
    }
}

/// Nice steps below the serving threads where the OS refuses SCHED_IDLE.
const STAGE_NICE: i32 = 10;

/// The calling thread, and once per process the load pool's threads (rayon's global pool, on
/// which loading and converting run in parallel; after startup only staging uses it), moved to
/// staging's class (`sys::idle_thread`), or lowered by `STAGE_NICE` where the OS refuses that.
/// A warning where it refuses both.
fn background() {
    let lower = || {
        let Err(idle) = crate::sys::idle_thread() else {
            return;
        };
        if let Err(e) = crate::sys::lower_thread_priority(STAGE_NICE) {
            tracing::warn!("staging runs at the serving threads' priority: {idle}; {e}");
        }
    };
    static POOL: Once = Once::new();
    POOL.call_once(|| {
        rayon::broadcast(|_| lower());
    });
    lower();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn a_newer_placement_supersedes_a_slower_load_and_take_checks_the_epoch() {
        let m = Arc::new(SlotMap::contiguous(8, 2, 2, 1).unwrap());
        let s: Stager<u32> = Stager::default();
        let (tx, rx) = channel();
        let (gate_tx, gate_rx) = channel::<()>();
        let tx1 = tx.clone();
        s.stage(
            1,
            m.clone(),
            move || {
                gate_rx.recv().unwrap();
                Ok((10, 1))
            },
            move |r| tx1.send((1, r)).unwrap(),
        );
        let tx2 = tx.clone();
        s.stage(
            2,
            m.clone(),
            || Ok((20, 2)),
            move |r| tx2.send((2, r)).unwrap(),
        );
        assert_eq!(rx.recv().unwrap(), (2, Ok(2)));
        gate_tx.send(()).unwrap();
        let (e, r) = rx.recv().unwrap();
        assert_eq!(e, 1);
        assert!(r.unwrap_err().contains("superseded"));
        assert!(s.take(3, 0).err().unwrap().contains("not staged on rank 0"));
        // A wrong epoch consumed what was held: nothing is left for 2.
        assert!(s.take(2, 0).is_err());
        s.stage(4, m, || Ok((40, 4)), move |r| tx.send((4, r)).unwrap());
        assert_eq!(rx.recv().unwrap(), (4, Ok(4)));
        assert_eq!(s.take(4, 1).unwrap().weights, 40);
    }

    #[test]
    fn a_placement_loads_below_the_serving_threads_priority() {
        use rayon::prelude::*;
        let m = Arc::new(SlotMap::contiguous(8, 2, 2, 1).unwrap());
        let s: Stager<Vec<bool>> = Stager::default();
        let (tx, rx) = channel();
        assert!(
            !crate::sys::thread_is_idle().unwrap(),
            "the test's own thread"
        );
        // The staging thread's class, then each of its parallel work's threads'.
        let load = || {
            let mut idle = vec![crate::sys::thread_is_idle().unwrap()];
            let work: Vec<bool> = (0..64)
                .into_par_iter()
                .map(|_| crate::sys::thread_is_idle().unwrap())
                .collect();
            idle.extend(work);
            Ok((idle, 1))
        };
        s.stage(1, m, load, move |r| tx.send(r).unwrap());
        assert_eq!(rx.recv().unwrap(), Ok(1));
        let seen = s.take(1, 0).unwrap().weights;
        assert!(
            seen.iter().all(|&idle| idle),
            "staging's threads in SCHED_IDLE: {seen:?}"
        );
        assert!(
            !crate::sys::thread_is_idle().unwrap(),
            "the test's own thread"
        );
    }

    #[test]
    fn rewritten_lists_the_rank_s_changed_slots_and_their_new_experts() {
        let cur = SlotMap::contiguous(4, 2, 0, 1).unwrap();
        let next = SlotMap::from_tables(4, 2, vec![vec![0, 3, 2, 1]]).unwrap();
        assert_eq!(rewritten(&cur, &next, 0), vec![((0, 1), (0, 3))]);
        assert_eq!(rewritten(&cur, &next, 1), vec![((0, 1), (0, 1))]);
    }
}
