//! A lost rank back (`--on-rank-loss continue`), between steps, none in flight: the restarted
//! process (same flags, same rank) said hello at the rendezvous port (`group::rejoin`). It gets
//! the group's welcome and makes its segment (or loads its GPU's weights); every rank in the
//! group maps it, or begins joining a communicator with it (`Order::Rejoin`); it maps theirs (or
//! joins); then it stages the placement the group runs on, with its own slots back in the
//! table, and the next `Roster` has it live again: every rank regroups at it (a GPU rank takes
//! the new communicator and captures its graphs again, the newcomer with them). No step
//! includes it before every rank has its segment (or communicator) and weights.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::recover::Heard;
use super::{Executor, ExecutorError, Watch};
use crate::group::rejoin::{Comer, Door};
use crate::group::{send, Bringup, Order};
use crate::metric_names;
use crate::step::Backend;

/// How long a rejoining rank has for its bring-up, and the ranks in the group to map it.
const REJOIN_WITHIN: Duration = Duration::from_secs(60);

impl<B: Backend> Executor<B> {
    /// Keeps the rendezvous port open for lost ranks that restart.
    pub fn open_door(
        &mut self,
        listener: std::net::TcpListener,
        door: Door,
        group: &str,
    ) -> std::io::Result<()> {
        let Some(loss) = self.loss.as_mut() else {
            return Ok(());
        };
        loss.group = group.to_string();
        let (tx, rx) = std::sync::mpsc::channel();
        crate::group::rejoin::keep_open(listener, door, loss.lost_now(), tx)?;
        loss.comers = Some(rx);
        Ok(())
    }

    /// A rank waiting at the door, if any (never while the group halts).
    pub(super) fn comer(&self) -> Option<Comer> {
        if self.abort.halting().is_some() {
            return None;
        }
        self.loss.as_ref()?.comers.as_ref()?.try_recv().ok()
    }

    /// Brings `c` back; Err: it stays lost (its connection closed), the group goes on as it was.
    pub(super) fn rejoin(&mut self, mut c: Comer) -> Result<(), ExecutorError> {
        let t0 = Instant::now();
        let rank = c.rank;
        let deadline = t0 + REJOIN_WITHIN;
        let broken = |what: &str, e: &dyn std::fmt::Display| {
            ExecutorError::Broken(format!("rank {rank} rejoining: {what}: {e}"))
        };
        let nccl_id =
            (self.driver.backend.rejoin_id()).map_err(|e| broken("a communicator", &e))?;
        let loss = self.loss.as_mut().expect("a door only with a loss");
        loss.roster.0[rank] = c.seat.clone();
        let welcome = Bringup::Welcome {
            group: loss.group.clone(),
            seats: loss.roster.0.clone(),
            nccl_id: nccl_id.clone(),
            go_on: true,
            rejoining: Some(
                loss.lost
                    .iter()
                    .copied()
                    .filter(|&r| r as usize != rank)
                    .collect(),
            ),
        };
        send(&mut c.stream, &welcome).map_err(|e| broken("welcome", &e))?;
        c.expect(Bringup::Created { rank }, deadline)
            .map_err(|e| broken("its segment", &e))?;
        // Every rank in the group maps its new segment (or begins joining a communicator with
        // it); so does this one.
        let pid = c.seat.pid;
        let order = Order::Rejoin {
            rank,
            pid,
            nccl_id: nccl_id.clone(),
        };
        (self.link.broadcast(&order)).map_err(|e| broken("telling the ranks", &e))?;
        (self.driver.rejoin(rank, nccl_id.as_deref()))
            .map_err(|e| broken("taking it back here", &e))?;
        self.gather_rejoined(rank, deadline)?;
        send(&mut c.stream, &Bringup::Map).map_err(|e| broken("map", &e))?;
        c.expect(Bringup::Mapped { rank }, deadline)
            .map_err(|e| broken("mapping the segments", &e))?;
        send(&mut c.stream, &Bringup::Go).map_err(|e| broken("go", &e))?;
        let mapped = t0.elapsed();
        // Its reports reach the balancer (staged) from here on.
        let loss = self.loss.as_ref().expect("checked");
        let watch = Watch {
            rank,
            stride: self.ring.shape.home_stride(),
            events: None,
            balance: self.balance.clone(),
            heard: Some(loss.heard_tx.clone()),
        };
        watch
            .spawn(&c.stream, self.abort.clone(), self.closing.clone())
            .map_err(|e| broken("its control reader", &e))?;
        // The placement the group runs on, its slots in the table again: it stages the slots
        // its restart did not load as they are now; the others have them already.
        let lost: Vec<u32> = (loss.lost.iter().copied())
            .filter(|&r| r as usize != rank)
            .collect();
        let (_, map) = self.balance.current();
        let next = (*map)
            .clone()
            .with_lost(lost.clone())
            .map_err(|e| broken("the placement", &e))?;
        let link = self.link.clone();
        let newcomer = std::sync::Mutex::new(
            c.stream
                .try_clone()
                .map_err(|e| broken("its control connection", &e))?,
        );
        let tell = |epoch: u32, map: &crate::eplb::SlotMap| {
            let order = Order::Placement {
                epoch,
                phy2log: map.to_file().phy2log,
                lost: map.lost().to_vec(),
            };
            link.broadcast(&order).map_err(|e| e.to_string())?;
            let mut s = newcomer.lock().unwrap_or_else(|e| e.into_inner());
            send(&mut *s, &order).map_err(|e| e.to_string())
        };
        let balance = self.balance.clone();
        let driver = &mut self.driver;
        let mut own = |epoch: u32, next: Arc<crate::eplb::SlotMap>| {
            let b = balance.clone();
            driver.stage(
                epoch,
                (*next).clone(),
                Box::new(move |r| b.staged(0, epoch, r)),
            );
        };
        self.balance
            .recover(next, &tell, &mut own, REJOIN_WITHIN)
            .map_err(|e| broken("staging its experts", &e))?;
        // In the group from the next step.
        self.link
            .readmit(rank, c.stream)
            .map_err(|e| broken("its control connection", &e))?;
        self.abort.unfence(rank);
        let loss = self.loss.as_mut().expect("checked");
        loss.lost = lost.clone();
        loss.epoch += 1;
        let epoch = loss.epoch;
        let live = loss.roster.world() - lost.len();
        loss.set_cap(live * self.ring.shape.home_stride());
        self.link
            .broadcast(&Order::Roster {
                epoch,
                lost: lost.clone(),
            })
            .map_err(|e| broken("resuming", &e))?;
        // Every rank regroups at the roster (a GPU rank onto the communicator with it): past
        // the roster a rank cannot stay out, so a failure here breaks the group.
        let t1 = Instant::now();
        if let Err(e) = self.driver.backend.regroup(&lost) {
            let why = format!("taking rank {rank} back: {e}");
            self.abort.trigger(why.clone());
            return Err(ExecutorError::Broken(why));
        }
        // Whole again once every rank runs over it (GetModelInfo, the metrics).
        self.loss.as_ref().expect("checked").publish();
        metrics::gauge!(metric_names::GROUP_RANKS, "state" => "live").set(live as f64);
        metrics::gauge!(metric_names::GROUP_RANKS, "state" => "lost").set(lost.len() as f64);
        metrics::gauge!(metric_names::GROUP_EPOCH).set(f64::from(epoch));
        tracing::warn!(
            rank,
            epoch,
            ?lost,
            mapped_ms = super::recover::ms(mapped),
            regroup_ms = super::recover::ms(t1.elapsed()),
            total_ms = super::recover::ms(t0.elapsed()),
            "rank {rank} rejoined the group"
        );
        Ok(())
    }

    /// Waits for every rank in the group but this one to have mapped `rank`'s segment.
    fn gather_rejoined(&mut self, rank: usize, deadline: Instant) -> Result<(), ExecutorError> {
        let loss = self.loss.as_ref().expect("checked");
        let mut waiting: Vec<usize> = (1..loss.roster.world())
            .filter(|&r| r != rank && !loss.lost.contains(&(r as u32)))
            .collect();
        while !waiting.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ExecutorError::Broken(format!(
                    "rank {rank} rejoining: ranks {waiting:?} did not map its segment in time"
                )));
            }
            match self.next_heard(left) {
                Some(Heard::Rejoined(r, of, None)) if of == rank => waiting.retain(|&w| w != r),
                Some(Heard::Rejoined(r, of, Some(e))) if of == rank => {
                    return Err(ExecutorError::Broken(format!(
                        "rank {rank} rejoining: rank {r} could not map its segment: {e}"
                    )))
                }
                Some(other) => tracing::debug!(?other, "while a rank rejoins"),
                None => {}
            }
        }
        Ok(())
    }
}
