//! Going on without a lost rank (`--on-rank-loss continue`). A closed control connection, a
//! rank's failure report, or a step past its deadline halts the group: every rank ends its steps
//! in flight and says so (`Halted`); a rank that does not within `HALT_WITHIN` is stopped, and is
//! lost too. The lost ranks are fenced (their connections shut, their processes killed where
//! they share a node with a survivor), their experts move into redundant slots of the ranks left
//! (`SlotMap::survive`, weights staged from the model source), and the steps that were in flight
//! go back to the batcher to run again: each request is answered once, none fails.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Executor, ExecutorError, FreeCells, SentStep};
use crate::group::Order;
use crate::metric_names;
use crate::nodes::Roster;
use crate::sched::redo::Redo;
use crate::step::{Backend, StepError};

/// How long a live rank has to end its steps in flight once halted: its waits end at once, so
/// a rank silent this long is stopped (SIGSTOP, a hung host), and lost.
pub const HALT_WITHIN: Duration = Duration::from_secs(1);

/// Halts in a row with every rank alive and no step finished, before the group breaks.
const FRUITLESS_HALTS: u32 = 3;

/// How long every rank left has to stage the lost ranks' experts (a read of a checkpoint).
const STAGE_WITHIN: Duration = Duration::from_secs(60);

/// What a control reader hears that the executor acts on.
#[derive(Debug)]
pub enum Heard {
    /// The rank disconnected or failed.
    Lost(usize, String),
    /// The rank ended its steps in flight for halt `epoch`.
    Halted(usize, u32),
    /// A step failed on the rank for want of a peer; it waits for the halt.
    StepFailed(usize, String),
    /// The rank mapped the segment of a rejoining rank (or could not, and why).
    Rejoined(usize, usize, Option<String>),
}

/// The leader's state for going on without lost ranks.
pub struct Loss {
    redo: Arc<Redo>,
    heard: Receiver<Heard>,
    /// For a rejoining rank's control reader.
    pub heard_tx: std::sync::mpsc::Sender<Heard>,
    /// Restarted ranks at the rendezvous port (`Executor::open_door`), and the group's id
    /// their welcome names.
    pub comers: Option<Receiver<crate::group::rejoin::Comer>>,
    pub group: String,
    pub roster: Roster,
    /// Ranks out of the group, ascending.
    pub lost: Vec<u32>,
    /// One more at every halt (and every rank back).
    pub epoch: u32,
    /// Halts in a row that found no rank lost, with no step finished since: past
    /// `FRUITLESS_HALTS` the group breaks rather than run the same failing steps forever.
    pub fruitless: u32,
    /// (epoch, lost) as GetModelInfo reads them.
    view: Arc<std::sync::Mutex<(u32, Vec<u32>)>>,
}

impl Loss {
    pub fn new(
        redo: Arc<Redo>,
        (heard_tx, heard): (std::sync::mpsc::Sender<Heard>, Receiver<Heard>),
        roster: Roster,
    ) -> Self {
        Self {
            redo,
            heard,
            heard_tx,
            comers: None,
            group: String::new(),
            roster,
            lost: Vec::new(),
            epoch: 0,
            fruitless: 0,
            view: Arc::default(),
        }
    }

    /// The group's epoch and the ranks out of it, as they change.
    pub fn view(&self) -> RosterView {
        let v = self.view.clone();
        Arc::new(move || v.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Whether the group is without `rank` now (read off the executor's thread).
    pub fn lost_now(&self) -> Arc<dyn Fn(usize) -> bool + Send + Sync> {
        let v = self.view.clone();
        Arc::new(move |r| (v.lock().unwrap_or_else(|e| e.into_inner()).1).contains(&(r as u32)))
    }

    /// Most tokens of a step the ranks left have room for.
    pub fn cap(&self) -> usize {
        self.redo.cap()
    }

    pub fn set_cap(&self, tokens: usize) {
        self.redo.set_cap(tokens);
    }

    /// Rows to run again in a later step.
    pub fn give_back(&self, rows: Vec<crate::sched::job::Segment>) {
        self.redo.give(rows);
    }

    pub fn publish(&self) {
        *self.view.lock().unwrap_or_else(|e| e.into_inner()) = (self.epoch, self.lost.clone());
    }
}

/// Reads the group's epoch and the ranks out of it now (GetModelInfo).
pub type RosterView = Arc<dyn Fn() -> (u32, Vec<u32>) + Send + Sync>;

/// The group's series from the start, whether or not it may go on without a rank: every
/// rank live, epoch 0.
pub fn export_roster(world: usize) {
    metrics::gauge!(metric_names::GROUP_RANKS, "state" => "live").set(world as f64);
    metrics::gauge!(metric_names::GROUP_RANKS, "state" => "lost").set(0.0);
    metrics::gauge!(metric_names::GROUP_EPOCH).set(0.0);
    metrics::counter!(metric_names::RANK_LOSSES_TOTAL).increment(0);
}

/// Whether the group may go on after `e`: a lost or stopped peer, not a wrong result or a
/// device that failed.
fn recoverable(e: &ExecutorError) -> bool {
    match e {
        ExecutorError::Step(s) => matches!(
            s,
            StepError::Wait { .. } | StepError::Timeout { .. } | StepError::DataLink { .. }
        ),
        ExecutorError::Group(_) | ExecutorError::Halted(_) | ExecutorError::Output { .. } => true,
        ExecutorError::Broken(_) => false,
    }
}

impl<B: Backend> Executor<B> {
    /// After a failed step: halts the group, finds who is lost, moves their experts and gives
    /// the steps in flight back to the batcher. Err: the group cannot go on (not this mode, a
    /// wrong result, no room for the lost experts); the caller breaks it.
    pub(super) fn recover(
        &mut self,
        e: ExecutorError,
        flight: &mut VecDeque<SentStep>,
        free: &FreeCells,
        in_flight: &tokio::sync::Semaphore,
    ) -> Result<(), ExecutorError> {
        if self.loss.is_none() || self.abort.reason().is_some() || !recoverable(&e) {
            return Err(e);
        }
        let t0 = Instant::now();
        self.abort.halt(e.to_string());
        let epoch = {
            let loss = self.loss.as_mut().expect("checked");
            loss.epoch += 1;
            loss.epoch
        };
        tracing::warn!(epoch, cause = %e, "halting the group");
        metrics::gauge!(metric_names::GROUP_EPOCH).set(f64::from(epoch));
        // A send that fails names a lost rank: its reader says so too.
        let _ = self.link.broadcast(&Order::Halt { epoch });
        let own = self.driver.abandon();
        let mut newly = self.gather_halted(epoch);
        let loss = self.loss.as_mut().expect("checked");
        // A node's first rank receives the node's step input and data: without it, its node's
        // other ranks cannot go on either.
        for r in newly.clone() {
            newly.extend(loss.roster.lost_with(r));
        }
        newly.sort_unstable();
        newly.dedup();
        newly.retain(|&r| !loss.lost.contains(&(r as u32)));
        match newly.is_empty() {
            true => loss.fruitless += 1,
            false => loss.fruitless = 0,
        }
        if loss.fruitless > FRUITLESS_HALTS {
            return Err(ExecutorError::Broken(format!(
                "{FRUITLESS_HALTS} halts in a row found every rank alive and no step finished: {e}"
            )));
        }
        let halted = t0.elapsed();
        // Their rows run again first; their cells and permits come back.
        let mut rows = Vec::new();
        for f in flight.drain(..) {
            free.put(f.cell);
            if f.heartbeat.is_none() {
                rows.extend(f.step.segments);
                in_flight.add_permits(1);
                metrics::gauge!(metric_names::STEPS_IN_FLIGHT).decrement(1.0);
            }
        }
        let redone: usize = rows.iter().map(|s| s.rows.len()).sum();
        let loss = self.loss.as_mut().expect("checked");
        loss.redo.give(rows);
        if !newly.is_empty() {
            for &r in &newly {
                self.abort.fence(r);
                self.link.lose(r);
                if let Some(said) = loss.roster.fence(0, r) {
                    tracing::warn!("{said}");
                }
            }
            loss.lost.extend(newly.iter().map(|&r| r as u32));
            loss.lost.sort_unstable();
            let lost = loss.lost.clone();
            let live = loss.roster.world() - lost.len();
            loss.redo.set_cap(live * self.ring.shape.home_stride());
            metrics::gauge!(metric_names::GROUP_RANKS, "state" => "live").set(live as f64);
            metrics::gauge!(metric_names::GROUP_RANKS, "state" => "lost").set(lost.len() as f64);
            metrics::counter!(metric_names::RANK_LOSSES_TOTAL).increment(newly.len() as u64);
        }
        // The ranks left regroup first, every one at once: a GPU rank's communicator shrinks
        // without the lost ones, which ends the steps still waiting on them on its device
        // (before that, anything that waits for the device, a weight copy, could hang).
        let lost = self.loss.as_ref().expect("checked").lost.clone();
        self.link
            .broadcast(&Order::Roster {
                epoch,
                lost: lost.clone(),
            })
            .map_err(|e| ExecutorError::Broken(format!("resuming the group: {e}")))?;
        let t1 = Instant::now();
        (self.driver.backend.regroup(&lost))
            .map_err(|e| ExecutorError::Broken(format!("going on without {lost:?}: {e}")))?;
        let regrouped = t1.elapsed();
        // Then the lost experts move; the next step runs on their new slots.
        let t2 = Instant::now();
        if !newly.is_empty() {
            self.move_experts(epoch, &newly)?;
        }
        let moved = t2.elapsed();
        self.abort.resume();
        self.loss.as_ref().expect("checked").publish();
        let total = t0.elapsed();
        metrics::histogram!(metric_names::RECOVERY_SECONDS).record(total.as_secs_f64());
        tracing::warn!(
            epoch,
            ?newly,
            ?lost,
            halt_ms = ms(halted),
            regroup_ms = ms(regrouped),
            experts_ms = ms(moved),
            total_ms = ms(total),
            steps_ended = own,
            tokens_again = redone,
            "the group goes on"
        );
        Ok(())
    }

    /// The next report a control reader passes on, within `within` (None: none came).
    pub(super) fn next_heard(&mut self, within: Duration) -> Option<Heard> {
        let loss = self.loss.as_mut()?;
        loss.heard.recv_timeout(within).ok()
    }

    /// Waits (within `HALT_WITHIN`) for every rank in the group to report `Halted` for
    /// `epoch`: the ranks lost meanwhile, and those that stay silent, are the newly lost.
    fn gather_halted(&mut self, epoch: u32) -> Vec<usize> {
        let loss = self.loss.as_mut().expect("checked");
        let world = loss.roster.world();
        let mut state: Vec<Option<bool>> = (0..world)
            .map(|r| match r == 0 || loss.lost.contains(&(r as u32)) {
                true => Some(true),
                false => None,
            })
            .collect();
        let mut lost = vec![false; world];
        let deadline = Instant::now() + HALT_WITHIN;
        while state.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            match loss.heard.recv_timeout(left) {
                Ok(Heard::Halted(r, e)) if e == epoch && r < world => {
                    state[r].get_or_insert(true);
                }
                Ok(Heard::Lost(r, why)) if r < world && !loss.lost.contains(&(r as u32)) => {
                    tracing::warn!(rank = r, "rank {r} is lost: {why}");
                    state[r] = Some(false);
                    lost[r] = true;
                }
                Ok(Heard::StepFailed(r, why)) => tracing::info!(rank = r, "{why}"),
                Ok(other) => tracing::debug!(?other, "stale"),
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        for (r, s) in state.iter().enumerate() {
            if s.is_none() {
                tracing::warn!(
                    rank = r,
                    "rank {r} did not halt within {HALT_WITHIN:?}: it is lost"
                );
                lost[r] = true;
            }
        }
        (0..world).filter(|&r| lost[r]).collect()
    }

    /// The lost ranks' experts into redundant slots of the ranks left: every rank stages the
    /// weights of its rewritten slots, and the next step applies the placement.
    fn move_experts(&mut self, _epoch: u32, newly: &[usize]) -> Result<(), ExecutorError> {
        let (_, map) = self.balance.current();
        let lost: Vec<u32> = newly.iter().map(|&r| r as u32).collect();
        let next = map.survive(&lost).map_err(|e| {
            ExecutorError::Broken(format!(
                "ranks {newly:?} are lost and the group cannot go on: {e}"
            ))
        })?;
        let link = self.link.clone();
        let tell = |epoch: u32, map: &crate::eplb::SlotMap| {
            let order = Order::Placement {
                epoch,
                phy2log: map.to_file().phy2log,
                lost: map.lost().to_vec(),
            };
            link.broadcast(&order).map_err(|e| e.to_string())
        };
        let balance = self.balance.clone();
        let driver = &mut self.driver;
        let mut own = |epoch: u32, next: Arc<crate::eplb::SlotMap>| {
            let b = balance.clone();
            let done = Box::new(move |r| b.staged(0, epoch, r));
            driver.stage(epoch, (*next).clone(), done);
        };
        self.balance
            .recover(next, &tell, &mut own, STAGE_WITHIN)
            .map(drop)
            .map_err(|e| {
                ExecutorError::Broken(format!(
                    "ranks {newly:?} are lost and their experts could not move: {e}"
                ))
            })
    }
}

pub(super) fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}
