//! A GPU rank going on without lost ranks (#55): its communicator shrinks without them
//! (`ncclCommShrink` with NCCL_SHRINK_ABORT, which ends the steps a halt left waiting on them:
//! `ncclCommAbort` never returns on a captured kernel that waits for a gone peer, measured in
//! docs/benchmarks.md "Losing a rank"), and it captures its graphs again on the new one. A rank
//! coming back: every rank joins a new communicator with it (`grow`, on a thread, while steps
//! go on over the old one), and at the roster that has it live they all take it and capture
//! their graphs again, the newcomer its first. NCCL EP's groups are made anew over each new
//! communicator (a rank coming back: on the same thread, after its init, as the newcomer makes
//! them in its setup), numbering the members' slots among them; the old ones go with the old
//! communicator, off the step path (LL groups over a lost rank left allocated: their destroy is
//! a barrier it never joins, which held a rank coming back, docs/benchmarks.md "Losing a rank").

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use nccl_sys::ncclUniqueId;

use super::{wait_event, GpuRank};
use crate::backend::cuda::exchange::Exchange;
use crate::backend::cuda::step::exchange;
use crate::backend::cuda::step::{HomeDtype, Variant};
use crate::backend::cuda::sys::nccl::{init_apart, Comm};
use crate::backend::cuda::{Alloc, GpuError};

/// How long the roster waits for a communicator with a rank coming back. Every rank began
/// joining it before the newcomer joined (its bring-up, which ended before the roster), so NCCL
/// init has completed everywhere or is about to.
const GROWN_WITHIN: Duration = Duration::from_secs(30);

/// A communicator joined with a rank coming back, and NCCL EP's groups over it (if any).
type Grown = (Comm, Option<Box<dyn Exchange>>);

/// A communicator being joined with a rank coming back.
pub(super) struct Growing {
    rank: usize,
    comm: Receiver<Result<Grown, GpuError>>,
    started: Instant,
}

impl GpuRank {
    /// Lost `rank` restarted: begins joining the communicator of this one's members and it
    /// (`nccl_id`, the leader's) on a thread of its own; `regroup` takes it.
    pub(super) fn grow(&mut self, rank: usize, nccl_id: Option<&[u8]>) -> Result<(), GpuError> {
        let c =
            (self.core.as_ref()).ok_or_else(|| GpuError::Config("the GPU rank failed".into()))?;
        let id: &[u8; 128] = (nccl_id.and_then(|b| b.try_into().ok())).ok_or_else(|| {
            GpuError::Config(format!("no NCCL unique id to take rank {rank} back with"))
        })?;
        let id = ncclUniqueId::from_bytes(id);
        let (world, me, shape) = (c.shape.world, c.shape.rank, c.shape);
        let members = c.comm.members();
        let out: Vec<u32> = (0..world)
            .filter(|r| *r != rank && !members.contains(r))
            .map(|r| r as u32)
            .collect();
        let rx = init_apart(c.g.ctx.clone(), id, (world, me), out, move |ctx, comm| {
            // With the newcomer's, in its setup: on a stream of this thread's own, idle once
            // they are made.
            let ex = match shape.ep {
                Some(_) => {
                    let stream = ctx.new_stream()?;
                    let ex = exchange(&comm, &shape, &mut Alloc::new(stream.clone()))?;
                    stream.synchronize()?;
                    Some(ex)
                }
                None => None,
            };
            Ok::<_, GpuError>((comm, ex))
        })
        .map_err(|e| GpuError::Config(format!("a thread for NCCL init: {e}")))?;
        // A rank that came back before and failed to rejoin left its init here: dropped, its
        // thread ends once that init does.
        self.growing = Some(Growing {
            rank,
            comm: rx,
            started: Instant::now(),
        });
        Ok(())
    }

    /// The group goes on without `lost` (every rank left calls this at once, between steps):
    /// where ranks of the communicator are among them, it shrinks without them, which ends the
    /// steps a halt left waiting for them; where live ranks are not in it (they came back), it
    /// takes the communicator `grow` joined with them. Either way this rank then warms up and
    /// captures its graphs again on the new one, as does a rank coming back, for the first
    /// time. Else what a halt ended finishes on its own (every peer runs it).
    pub(super) fn regroup_now(&mut self, lost: &[u32]) -> Result<(), GpuError> {
        let c =
            (self.core.as_mut()).ok_or_else(|| GpuError::Config("the GPU rank failed".into()))?;
        c.g.ctx.bind_to_thread()?;
        let members = c.comm.members();
        let gone: Vec<usize> = (members.iter().copied())
            .filter(|&r| lost.contains(&(r as u32)))
            .collect();
        let back: Vec<usize> = (0..c.shape.world)
            .filter(|r| !lost.contains(&(*r as u32)) && !members.contains(r))
            .collect();
        if (!gone.is_empty() || !back.is_empty()) && !self.flight.is_empty() {
            return Err(GpuError::Config(
                "steps in flight while the group regroups".into(),
            ));
        }
        if !gone.is_empty() {
            return self.shrink_now(lost, &gone);
        }
        if !back.is_empty() {
            return self.grow_now(&back);
        }
        self.drain_stuck()?;
        if !self.primed {
            let t0 = Instant::now();
            self.prime()?;
            tracing::info!(
                graphs = self.graphs.len(),
                graphs_ms = t0.elapsed().as_millis() as u64,
                "the GPU rank is back in the group: warmed up and captured its steps"
            );
        }
        Ok(())
    }

    /// NCCL EP compiles its kernels for a group size at their first use (nvcc: a first regroup
    /// from 2 ranks to 1 spent 14.6 s capturing its graphs, 2x H100). A group that goes on
    /// without a lost rank compiles those of one rank fewer at startup instead: the ranks but
    /// the last make that group once (a communicator shrunk without it, NCCL EP's groups over
    /// it) and run each bucket's step through it, uncaptured; NCCL EP's JIT cache then has them
    /// when a rank is lost. The last rank takes no part. Its output is never read.
    pub(in crate::backend::cuda) fn warm_shrunk(&mut self) -> Result<(), GpuError> {
        let c =
            (self.core.as_mut()).ok_or_else(|| GpuError::Config("the GPU rank failed".into()))?;
        let (world, rank) = (c.shape.world, c.shape.rank);
        if c.shape.ep.is_none() || world < 2 || rank == world - 1 {
            return Ok(());
        }
        let t0 = Instant::now();
        let sub = c.comm.shrink(&[world - 1], false)?;
        let ex = exchange(&sub, &c.shape, &mut Alloc::new(c.g.stream.clone()))?;
        let made = t0.elapsed();
        let comm = std::mem::replace(&mut c.comm, sub);
        let ex = std::mem::replace(&mut c.ex, ex);
        // Its steps run whole: the twin's exchange is over the full communicator.
        let twin = c.twin.take();
        // The last rank's counts never come: none.
        c.g.stream.memset_zeros(&mut c.b.m)?;
        let mut ran = Ok(());
        for bucket in self.buckets.clone() {
            ran = self.eager(0, 0, bucket, Variant::new(HomeDtype::Bf16, false));
            ran = ran.and_then(|()| self.finish(Instant::now(), Duration::from_secs(120)));
            if ran.is_err() {
                break;
            }
        }
        let c = self.core.as_mut().expect("checked above");
        let sub = std::mem::replace(&mut c.comm, comm);
        let sub_ex = std::mem::replace(&mut c.ex, ex);
        c.twin = twin;
        // Collective over the members, in the same order on each: the groups, then the
        // communicator.
        drop(sub_ex);
        drop(sub);
        c.g.stream.memset_zeros(&mut c.b.m)?;
        ran?;
        tracing::info!(
            world = world - 1,
            groups_ms = made.as_millis() as u64,
            ms = t0.elapsed().as_millis() as u64,
            "NCCL EP's kernels for a group of one rank fewer compiled"
        );
        Ok(())
    }

    /// The steps a halt ended run out (on whatever a lost peer left: their output is never
    /// read).
    fn drain_stuck(&mut self) -> Result<(), GpuError> {
        for f in std::mem::take(&mut self.stuck) {
            wait_event(&self.done[f.set], Instant::now(), self.step_timeout, None)?;
        }
        Ok(())
    }

    /// `next` replaces the communicator (and `ex` the exchange, NCCL EP's groups over it), the
    /// streams idle; the old ones are torn down off the step path, the exchange first (its
    /// windows are the communicator's), and the graphs captured on them go. Where a member of
    /// the old communicator is not in `next` (lost), what cannot be torn down without it stays
    /// allocated (`Exchange::abandon`: NCCL EP's LL groups, whose destroy waited for the lost
    /// rank forever and then held the next group's setup on the device: a rank coming back
    /// stalled).
    fn swap_comm(&mut self, next: Comm, ex: Option<Box<dyn Exchange>>) -> Result<(), GpuError> {
        self.finish(Instant::now(), self.step_timeout)?;
        self.graphs.clear();
        let c = self.core.as_mut().expect("checked by the caller");
        let lost = (c.comm.members().iter()).any(|m| !next.members().contains(m));
        let mut old = std::mem::replace(&mut c.comm, next);
        // Two-batch overlap's second exchange: NCCL EP's is over the old communicator and is
        // not remade, so steps run whole from here (the slot exchange's holds no communicator).
        let mut old_twin = ex.as_ref().and_then(|_| c.twin.take());
        let old_ex = ex.map(|ex| std::mem::replace(&mut c.ex, ex));
        if old_twin.is_some() {
            tracing::warn!("two-batch overlap off after the regroup");
        }
        let ctx = c.g.ctx.clone();
        let _ = std::thread::Builder::new()
            .name("nccl-old".into())
            .spawn(move || {
                let t = Instant::now();
                // NCCL EP's groups go first (their windows are the communicator's), on the
                // device bound here.
                if let Some(mut ex) = old_ex {
                    if let Err(e) = ctx.bind_to_thread() {
                        tracing::warn!("the old NCCL EP groups' device: {e}");
                    }
                    let mut left = if lost { ex.abandon() } else { 0 };
                    if let Some(tw) = old_twin.as_mut().filter(|_| lost) {
                        left += tw.abandon();
                    }
                    drop(old_twin);
                    drop(ex);
                    tracing::info!(
                        ms = t.elapsed().as_millis() as u64,
                        left_mib = left >> 20,
                        "the old NCCL EP groups gone (those over a lost rank left allocated)"
                    );
                }
                old.abort();
                tracing::debug!(
                    ms = t.elapsed().as_millis() as u64,
                    "the old communicator aborted"
                );
            });
        Ok(())
    }

    fn shrink_now(&mut self, lost: &[u32], gone: &[usize]) -> Result<(), GpuError> {
        let t0 = Instant::now();
        let c = self.core.as_mut().expect("checked by the caller");
        let next = c.comm.shrink(gone, true)?;
        let shrunk = t0.elapsed();
        // Released: the steps the halt ended run out, and the streams are idle.
        self.drain_stuck()?;
        let drained = t0.elapsed();
        // NCCL EP's groups over the members left (every one makes them here, at once).
        let c = self.core.as_mut().expect("checked by the caller");
        let ex = match c.shape.ep {
            Some(_) => Some(exchange(
                &next,
                &c.shape,
                &mut Alloc::new(c.g.stream.clone()),
            )?),
            None => None,
        };
        let remade = t0.elapsed();
        self.swap_comm(next, ex)?;
        let c = self.core.as_mut().expect("checked by the caller");
        // Nothing writes a lost rank's counts any more: none.
        c.g.stream.memset_zeros(&mut c.b.m)?;
        let swapped = t0.elapsed();
        self.prime()?;
        tracing::info!(
            ?lost,
            shrink_ms = shrunk.as_millis() as u64,
            drain_ms = (drained - shrunk).as_millis() as u64,
            exchange_ms = (remade - drained).as_millis() as u64,
            graphs_ms = (t0.elapsed() - swapped).as_millis() as u64,
            graphs = self.graphs.len(),
            "the GPU rank goes on over a shrunk communicator"
        );
        Ok(())
    }

    fn grow_now(&mut self, back: &[usize]) -> Result<(), GpuError> {
        let t0 = Instant::now();
        let g = (self.growing.take())
            .filter(|g| back == [g.rank])
            .ok_or_else(|| {
                GpuError::Config(format!(
                    "ranks {back:?} are back without a communicator joined with them"
                ))
            })?;
        let (next, ex) = (g.comm.recv_timeout(GROWN_WITHIN)).map_err(|_| {
            GpuError::Config(format!(
                "the communicator with rank {} was not joined within {GROWN_WITHIN:?}",
                g.rank
            ))
        })??;
        let joined = t0.elapsed();
        self.drain_stuck()?;
        self.swap_comm(next, ex)?;
        let swapped = t0.elapsed();
        self.prime()?;
        tracing::info!(
            rank = g.rank,
            since_rejoin_ms = g.started.elapsed().as_millis() as u64,
            init_wait_ms = joined.as_millis() as u64,
            graphs_ms = (t0.elapsed() - swapped).as_millis() as u64,
            graphs = self.graphs.len(),
            "the GPU rank goes on over a communicator with rank {} back",
            g.rank
        );
        Ok(())
    }
}
