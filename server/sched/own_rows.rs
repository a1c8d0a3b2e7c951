//! `--ingress all`, a worker's side of the pipeline (`pipeline`): a packer thread puts each of
//! this rank's offers into its rows of the cell the leader names (`IngressOrder::Pack`, while the
//! step before runs), the step takes it from there, and the delivery thread answers its requests
//! after the step.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::job::Step;
use super::pipeline::{Delivery, Share};
use super::rows::{copy_threads, out_bufs};
use crate::metric_names;
use crate::request::Failure;
use crate::step::ring::Ring;
use crate::step::{StepDesc, StepKey};

/// This rank's offers the leader has not yet put in a step, oldest first (the leader takes
/// each rank's in this order).
pub type Offered = Arc<Mutex<VecDeque<Step>>>;

/// A lock whose holder panicking leaves the data usable (every critical section here is a
/// push, pop or flag flip).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Which ring cells still hold this rank's rows of a step being answered.
struct CellGate {
    busy: Mutex<Vec<bool>>,
    freed: Condvar,
}

impl CellGate {
    fn new(cells: usize) -> Self {
        Self {
            busy: Mutex::new(vec![false; cells]),
            freed: Condvar::new(),
        }
    }

    fn hold(&self, cell: usize) {
        lock(&self.busy)[cell] = true;
    }

    fn free(&self, cell: usize) {
        lock(&self.busy)[cell] = false;
        self.freed.notify_all();
    }

    /// Waits, at most `limit`, until the cell's last answers are out.
    fn wait_free(&self, cell: usize, limit: Duration) -> bool {
        let busy = lock(&self.busy);
        let (busy, _) = self
            .freed
            .wait_timeout_while(busy, limit, |b| b[cell])
            .unwrap_or_else(|e| e.into_inner());
        !busy[cell]
    }
}

/// Why this rank's rows of a step are not there: the leader and this rank disagree, or a wait
/// ran out. Either way the group breaks.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RowsError {
    #[error("the leader took an offer this rank did not make")]
    NotOffered,
    #[error(
        "the leader took {want} rows of {want_key:?}, this rank offered {have} of {have_key:?}"
    )]
    Mismatch {
        want: usize,
        want_key: StepKey,
        have: usize,
        have_key: StepKey,
    },
    #[error("ring cell {cell} of {cells}")]
    NoCell { cell: usize, cells: usize },
    #[error("cell {cell} not packed within {after:?}")]
    NotPacked { cell: usize, after: Duration },
    #[error("cell {cell}'s answers not out within {after:?}")]
    NotDelivered { cell: usize, after: Duration },
}

impl RowsError {
    fn mismatch(want: usize, want_key: StepKey, step: &Step) -> Self {
        RowsError::Mismatch {
            want,
            want_key,
            have: step.tokens(),
            have_key: step.key(),
        }
    }
}

/// `IngressOrder::Pack`: the cell of the step that takes this rank's next offer.
pub struct PackOrder {
    pub cell: usize,
    pub key: StepKey,
    pub homes: Vec<u32>,
}

/// Offers packed into their cells, waiting for their step's descriptor.
struct Packed {
    cells: Mutex<Vec<Option<Result<Step, RowsError>>>>,
    ready: Condvar,
}

/// The step loop's share of this rank's clients.
pub struct OwnRows {
    rank: usize,
    packed: Arc<Packed>,
    gate: Arc<CellGate>,
    orders: Option<std::sync::mpsc::Sender<PackOrder>>,
    delivery: Option<Delivery>,
    /// Bound on waiting for a cell to be packed.
    wait: Duration,
}

impl OwnRows {
    pub fn start(
        ring: Arc<Ring>,
        rank: usize,
        offered: Offered,
        permits: Arc<Semaphore>,
        wait: Duration,
    ) -> anyhow::Result<Self> {
        let cells = ring.shape.cells;
        let base = rank * ring.shape.home_stride();
        let gate = Arc::new(CellGate::new(cells));
        let packed = Arc::new(Packed {
            cells: Mutex::new((0..cells).map(|_| None).collect()),
            ready: Condvar::new(),
        });
        let (orders, orders_rx) = std::sync::mpsc::channel::<PackOrder>();
        {
            let (ring, packed) = (ring.clone(), packed.clone());
            std::thread::Builder::new()
                .name("step-pack".into())
                .spawn(move || {
                    let threads = copy_threads();
                    for order in orders_rx {
                        let cell = order.cell;
                        // Not this rank's rows; or out of range: the step's descriptor fails
                        // on it (`before`).
                        let mine = order.homes.get(rank).is_some_and(|&n| n > 0);
                        if !mine || cell >= cells {
                            continue;
                        }
                        let r = pack_offer(&order, rank, &offered, &permits);
                        if let Ok(step) = &r {
                            Share::Own { base }.pack(&ring, step, cell, threads);
                        }
                        lock(&packed.cells)[cell] = Some(r);
                        packed.ready.notify_all();
                    }
                })?;
        }
        let delivery = {
            let (gate, bufs) = (gate.clone(), out_bufs(&ring));
            Delivery::start(
                ring,
                Share::Own { base },
                bufs,
                move |cell| gate.free(cell),
                None,
            )?
        };
        Ok(Self {
            rank,
            packed,
            gate,
            orders: Some(orders),
            delivery: Some(delivery),
            wait,
        })
    }

    /// Where the leader's `IngressOrder::Pack` orders go.
    pub fn orders(&self) -> Option<std::sync::mpsc::Sender<PackOrder>> {
        self.orders.clone()
    }

    /// Before `desc` runs: the offer it takes from this rank, packed into its rows already.
    pub fn before(&mut self, desc: &StepDesc) -> Result<Option<Step>, RowsError> {
        let n = desc.homes.get(self.rank).copied().unwrap_or(0) as usize;
        if n == 0 {
            return Ok(None);
        }
        let cell = desc.cell as usize;
        let cells = lock(&self.packed.cells);
        if cell >= cells.len() {
            let cells = cells.len();
            return Err(RowsError::NoCell { cell, cells });
        }
        let (mut cells, _) = self
            .packed
            .ready
            .wait_timeout_while(cells, self.wait, |s| s[cell].is_none())
            .unwrap_or_else(|e| e.into_inner());
        let after = self.wait;
        let step = cells[cell]
            .take()
            .ok_or(RowsError::NotPacked { cell, after })??;
        drop(cells);
        let why = if step.key() != desc.key() || step.tokens() != n {
            RowsError::mismatch(n, desc.key(), &step)
        } else if !self.gate.wait_free(cell, self.wait) {
            // The step writes its output rows where the last step in this cell left its own.
            RowsError::NotDelivered { cell, after }
        } else {
            return Ok(Some(step));
        };
        step.fail(&Failure::unavailable("broken", why.to_string()));
        Err(why)
    }

    /// After the step ran: its requests are answered on the delivery thread.
    pub fn after(&mut self, step: Step, cell: usize) {
        self.gate.hold(cell);
        if let Some(d) = &self.delivery {
            d.send(step, cell);
        }
    }
}

/// The packer's part of an `IngressOrder::Pack`: this rank's oldest offer, checked against the order. Its
/// input rows may go in at once: the leader reuses a cell only once every rank's step in it is
/// done (the output rows are `before`'s to wait for).
fn pack_offer(
    order: &PackOrder,
    rank: usize,
    offered: &Offered,
    permits: &Semaphore,
) -> Result<Step, RowsError> {
    let n = order.homes[rank] as usize;
    let step = lock(offered).pop_front().ok_or(RowsError::NotOffered)?;
    permits.add_permits(1);
    metrics::gauge!(metric_names::OFFERS_PENDING).decrement(1.0);
    if step.key() == order.key && step.tokens() == n {
        return Ok(step);
    }
    let why = RowsError::mismatch(n, order.key, &step);
    step.fail(&Failure::unavailable("broken", why.to_string()));
    Err(why)
}

impl Drop for OwnRows {
    /// Answers every finished step before the rank goes on to stop; packed rows that no step
    /// will take are refused.
    fn drop(&mut self) {
        self.orders.take();
        // Answers every step handed over before it returns.
        self.delivery.take();
        for s in lock(&self.packed.cells).iter_mut() {
            if let Some(Ok(step)) = s.take() {
                step.fail(&Failure::unavailable("broken", "the EP group stopped"));
            }
        }
    }
}
