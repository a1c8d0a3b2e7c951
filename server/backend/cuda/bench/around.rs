//! `epserve bench --gap-copies`: a timed step's way in and out as a serving rank runs it
//! (`rank::GpuRank::launch`): its rows from page-locked host memory on a copy stream before
//! it, its count (and a client's routing) in on its own stream inside its time, its counts out
//! behind its graph, and its rows out on another copy stream after it. Without it the bench's
//! step is its graph alone, on rows already on the GPU.

use cudarc::driver::DriverError;
use half::bf16;

use crate::backend::cuda::step::{GpuStep, Variant};
use crate::backend::cuda::sys::memory::{dtoh, htod, Pinned};
use crate::backend::cuda::transfer::{pack_rows, unpack_rows, Copies, Staging};
use crate::dtype::Dtype;

pub(super) struct Around {
    copies: Copies,
    st: Staging,
    rows_in: Pinned<bf16>,
    rows_out: Pinned<bf16>,
    /// The step's tokens on this rank.
    tokens: usize,
    variant: Variant,
}

impl Around {
    /// The rows now in `xb` become the host's, sent again before each step; `routing` is a
    /// client's (ids, weights), copied in each step as serving copies them.
    pub fn new(
        c: &mut GpuStep,
        t: usize,
        variant: Variant,
        routing: Option<(&[i32], &[f32])>,
    ) -> Result<Self, DriverError> {
        let rows = t * c.shape.hidden;
        let (mut rows_in, rows_out) = (Pinned::new(rows)?, Pinned::new(rows)?);
        let s = c.g.stream.clone();
        dtoh(&c.b.xb, rows, &mut rows_in, &s)?;
        s.synchronize()?;
        let mut st = Staging::new(&c.shape)?;
        st.n.as_mut_slice()[0] = t as i32;
        if let Some((ids, w)) = routing {
            st.ids.as_mut_slice()[..ids.len()].copy_from_slice(ids);
            st.w.as_mut_slice()[..w.len()].copy_from_slice(w);
        }
        Ok(Self {
            copies: Copies::new(c)?,
            st,
            rows_in,
            rows_out,
            tokens: t,
            variant,
        })
    }

    /// The rows in, on the copy-in stream; the step's stream waits for them and unpacks them.
    pub fn rows_in(&mut self, c: &mut GpuStep) -> Result<(), DriverError> {
        let (cp, s) = (&self.copies, c.g.stream.clone());
        htod(
            &self.rows_in,
            0..self.rows_in.as_slice().len(),
            &mut c.b.inbox,
            &cp.h2d,
        )?;
        cp.inbox_full.record(&cp.h2d)?;
        s.wait(&cp.inbox_full)?;
        unpack_rows(c, self.tokens, Dtype::Bf16)
    }

    /// Inside the step's time: its count and routing in before `graph`, its counts out after.
    pub fn step(
        &mut self,
        c: &mut GpuStep,
        graph: impl FnOnce() -> Result<(), DriverError>,
    ) -> Result<(), DriverError> {
        self.st.copy_in(c, self.tokens, self.variant)?;
        graph()?;
        self.st.copy_out(c, self.tokens)
    }

    /// The rows out, on the copy-out stream behind the step.
    pub fn rows_out(&mut self, c: &mut GpuStep) -> Result<(), DriverError> {
        let (cp, s) = (&self.copies, c.g.stream.clone());
        pack_rows(c, self.tokens, Dtype::Bf16)?;
        cp.outbox_full.record(&s)?;
        cp.d2h.wait(&cp.outbox_full)?;
        let n = self.rows_out.as_slice().len();
        dtoh(&c.b.outbox, n, &mut self.rows_out, &cp.d2h)
    }

    /// Waits for the rows out (the step's stream is synchronised by the caller).
    pub fn synchronize(&self) -> Result<(), DriverError> {
        self.copies.d2h.synchronize()
    }
}
