//! A GPU rank going on without lost ranks (#55): its communicator shrinks without them
//! (`ncclCommShrink` with NCCL_SHRINK_ABORT, which ends the steps a halt left waiting on them:
//! `ncclCommAbort` never returns on a captured kernel that waits for a gone peer, measured in
//! docs/benchmarks.md "Losing a rank"), and it captures its graphs again on the new one.

use std::time::Instant;

use super::{wait_event, GpuRank};
use crate::backend::cuda::GpuError;

impl GpuRank {
    /// The group goes on without `lost` (every rank left calls this at once, between steps):
    /// where ranks of the communicator are among them, it shrinks without them, which ends the
    /// steps a halt left waiting for them; then this rank warms up and captures its graphs again
    /// on the new one. Else what a halt ended finishes on its own (every peer runs it).
    pub(super) fn regroup_now(&mut self, lost: &[u32]) -> Result<(), GpuError> {
        let t0 = Instant::now();
        let bound = self.step_timeout;
        let c =
            (self.core.as_mut()).ok_or_else(|| GpuError::Config("the GPU rank failed".into()))?;
        c.g.ctx.bind_to_thread()?;
        let gone: Vec<usize> = (c.comm.members().iter().copied())
            .filter(|&r| lost.contains(&(r as u32)))
            .collect();
        if gone.is_empty() {
            for f in std::mem::take(&mut self.stuck) {
                wait_event(&self.done[f.set], Instant::now(), bound, None)?;
            }
            return Ok(());
        }
        if c.shape.ep.is_some() {
            return Err(GpuError::Config(
                "the nccl-ep exchange cannot go on without a rank".into(),
            ));
        }
        if !self.flight.is_empty() {
            return Err(GpuError::Config(
                "steps in flight while the group regroups".into(),
            ));
        }
        let next = c.comm.shrink(&gone)?;
        let mut old = std::mem::replace(&mut c.comm, next);
        let shrunk = t0.elapsed();
        // Released: the steps the halt ended run out (on whatever a lost peer left: their
        // output is never read), and the streams are idle.
        for f in std::mem::take(&mut self.stuck) {
            wait_event(&self.done[f.set], Instant::now(), bound, None)?;
        }
        self.finish(Instant::now(), bound)?;
        self.graphs.clear();
        // The old communicator is torn down off the step path.
        let _ = std::thread::Builder::new()
            .name("nccl-old".into())
            .spawn(move || {
                let t = Instant::now();
                old.abort();
                tracing::debug!(
                    ms = t.elapsed().as_millis() as u64,
                    "the old communicator aborted"
                );
            });
        let c = self.core.as_mut().expect("checked above");
        // Nothing writes a lost rank's counts any more: none.
        c.g.stream.memset_zeros(&mut c.b.m)?;
        let drained = t0.elapsed();
        self.prime()?;
        tracing::info!(
            ?lost,
            shrink_ms = shrunk.as_millis() as u64,
            drain_ms = (drained - shrunk).as_millis() as u64,
            graphs_ms = (t0.elapsed() - drained).as_millis() as u64,
            graphs = self.graphs.len(),
            "the GPU rank goes on over a shrunk communicator"
        );
        Ok(())
    }
}
