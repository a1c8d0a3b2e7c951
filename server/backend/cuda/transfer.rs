//! The rows' and the small per-step values' way between the host and the GPU: page-locked
//! staging, the step ring registered with the driver, and the inbox/outbox copies on streams of
//! their own, so that a GPU rank's next step comes in and its last one goes out while one runs.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, DriverError};

use crate::backend::cuda::shape::StepShape;
use crate::backend::cuda::step::{GpuStep, Variant};
use crate::backend::cuda::sys::memory::{dtod, dtoh, htod, Pinned};
use crate::dtype::Dtype;

/// The home rows from the inbox into the step's own buffers: bf16 rows as they are into `xb`
/// (`Rows::Bf16`), f32 rows into `x`, f16 ones through a widening kernel into `x`.
pub(super) fn unpack_rows(c: &mut GpuStep, n: usize, d: Dtype) -> Result<(), DriverError> {
    let (h, s) = (c.shape.hidden, c.g.stream.clone());
    match d {
        Dtype::Bf16 => dtod(&c.b.inbox, &mut c.b.xb, n * h * 2, &s),
        Dtype::F32 => dtod(&c.b.inbox, &mut c.b.x, n * h * 4, &s),
        _ => {
            c.g.widen_rows(&c.b.inbox, d == Dtype::F16, n, h, &mut c.b.x)
        }
    }
}

/// The step's output rows into the outbox in `d`: f32 as they are, 16-bit ones narrowed.
pub(super) fn pack_rows(c: &mut GpuStep, n: usize, d: Dtype) -> Result<(), DriverError> {
    let (h, s) = (c.shape.hidden, c.g.stream.clone());
    match d {
        Dtype::F32 => dtod(&c.b.out, &mut c.b.outbox, n * h * 4, &s),
        _ => {
            c.g.narrow_rows(&c.b.out, d == Dtype::F16, n, h, &mut c.b.outbox)
        }
    }
}

/// The rows' way between the ring and the step, on copy streams of their own, so that step N+1's
/// rows come in and step N-1's go out while step N computes. The events hand each box from one
/// stream to the other; each wait takes the latest record, which the submit order makes the
/// right one.
pub(super) struct Copies {
    pub h2d: Arc<CudaStream>,
    pub d2h: Arc<CudaStream>,
    /// The inbox holds the next step's rows / the step has taken them out and its small
    /// copies in are done (the next rows must not hold a copy engine ahead of them).
    pub inbox_full: CudaEvent,
    pub inbox_free: CudaEvent,
    /// The outbox holds a step's output / it has reached the ring.
    pub outbox_full: CudaEvent,
    pub outbox_free: CudaEvent,
}

impl Copies {
    pub(super) fn new(c: &GpuStep) -> Result<Self, DriverError> {
        let ctx = &c.g.ctx;
        Ok(Self {
            h2d: ctx.new_stream()?,
            d2h: ctx.new_stream()?,
            inbox_full: ctx.new_event(None)?,
            inbox_free: ctx.new_event(None)?,
            outbox_full: ctx.new_event(None)?,
            outbox_free: ctx.new_event(None)?,
        })
    }
}

/// Steps a GPU rank holds submitted at once: each has its own staging set and completion event.
pub(super) const DEPTH: usize = 2;

/// Pinned staging of one step's small inputs and outputs (the rows go through the ring), one set
/// per step in flight.
pub(super) struct Staging {
    pub ids: Pinned<i32>,
    pub w: Pinned<f32>,
    /// `[n, 0, n]`: the home count and the shared expert's offsets.
    pub n: Pinned<i32>,
    /// Per exchange the step ran (two where it split into micro-batches: `GpuStep::tallies`).
    pub tallies: Vec<Tallied>,
}

/// One exchange's copies home after a step.
pub(super) struct Tallied {
    /// The all-gathered counts the rows were routed by.
    pub m: Pinned<i32>,
    /// NCCL EP's per-local-expert receive counts and HT padded total, for the overflow check.
    pub recv: Pinned<i32>,
    pub total: Pinned<i32>,
    /// The step's rows a rank, as this exchange ran them; 0: unused by the last step.
    pub bucket: usize,
}

impl Staging {
    pub(super) fn new(s: &StepShape) -> Result<Self, DriverError> {
        let (t, k) = (s.max_home, s.top_k);
        let tally = || -> Result<Tallied, DriverError> {
            Ok(Tallied {
                m: Pinned::new(s.world * s.experts)?,
                recv: Pinned::new(s.local())?,
                total: Pinned::new(1)?,
                bucket: 0,
            })
        };
        Ok(Self {
            ids: Pinned::new(t * k)?,
            w: Pinned::new(t * k)?,
            n: Pinned::new(1)?,
            tallies: vec![tally()?, tally()?],
        })
    }

    /// The step's count (and the client's routing) onto the device, on the step's stream. Outside
    /// the graph: the set differs between the steps in flight.
    pub(super) fn copy_in(
        &self,
        c: &mut GpuStep,
        bucket: usize,
        v: Variant,
    ) -> Result<(), DriverError> {
        let (s, k) = (c.g.stream.clone(), c.shape.top_k);
        htod(&self.n, 0..1, &mut c.b.n, &s)?;
        if v.client {
            htod(&self.ids, 0..bucket * k, &mut c.b.ids, &s)?;
            htod(&self.w, 0..bucket * k, &mut c.b.w, &s)?;
        }
        Ok(())
    }

    /// The routing counts (and NCCL EP's receipts) back, before the next step can overwrite them:
    /// each exchange's that a step of `bucket` runs.
    pub(super) fn copy_out(&mut self, c: &GpuStep, bucket: usize) -> Result<(), DriverError> {
        let s = c.g.stream.clone();
        for (st, t) in self.tallies.iter_mut().zip(c.tallies(bucket)) {
            let Some(t) = t else {
                st.bucket = 0;
                continue;
            };
            st.bucket = t.bucket;
            dtoh(t.m, t.m.len(), &mut st.m, &s)?;
            if let Some((counts, total)) = t.ex.receipts() {
                // The rank's slots' (NCCL EP may number more experts a rank: `ep_local`).
                let n = st.recv.as_slice().len();
                dtoh(counts, n, &mut st.recv, &s)?;
                dtoh(total, 1, &mut st.total, &s)?;
            }
        }
        Ok(())
    }
}
