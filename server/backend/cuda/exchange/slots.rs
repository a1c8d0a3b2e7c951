//! The `nccl` exchange: fixed-size slots over plain NCCL send/recv. Every rank sends each peer one
//! slot sized for the bucket's worst case (a token reaches at most min(k, local) of a peer's
//! experts), so the exchange is one capturable group whatever the routing. Received rows are
//! scattered into expert-major blocks aligned to the Hopper GEMM's row tile; combine gathers the
//! outputs back into the slots, sends them home, and sums each token's k rows by its weights.
//! With FP8 experts the rows go out quantized (`StepShape::fp8_slots`): half the bytes on the
//! wire and in both copies, and the FFN reads them as they land (no quantization pass of its
//! own); the outputs come back in bf16.

use cudarc::driver::{CudaSlice, CudaStream, DriverError};
use half::bf16;

use crate::backend::cuda::exchange::{Exchange, ExpertRows, Home};
use crate::backend::cuda::kernels::fp8::Fp8Rows;
use crate::backend::cuda::kernels::hopper;
use crate::backend::cuda::kernels::slots::Pack;
use crate::backend::cuda::shape::StepShape;
use crate::backend::cuda::sys::nccl::{Comm, NcclError, NcclType};
use crate::backend::cuda::{Alloc, Gpu, GpuError};

/// One rank's slot exchange: its send-side layout, slots and expert rows, sized for the largest
/// bucket.
pub struct SlotExchange {
    shape: StepShape,
    /// Expert-major offsets of the home rows `[experts + 1]`, each (token, k)'s position there
    /// and its inverse (`[T * k]` each).
    offsets: CudaSlice<i32>,
    pos_of: CudaSlice<i32>,
    entry_of: CudaSlice<i32>,
    /// Slots out and in `[world][slot_rows][hidden]`; reused by the return trip.
    send: CudaSlice<bf16>,
    recv: CudaSlice<bf16>,
    /// Slot row -> expert-major row.
    map: CudaSlice<i32>,
    /// Local experts' block offsets `[local + 1]`, ends (`hopper::MAX_GROUPS`) and padded total.
    local_off: CudaSlice<i32>,
    ends: CudaSlice<i32>,
    total: CudaSlice<i32>,
    /// Expert-major received rows; the expert outputs overwrite them.
    xe: CudaSlice<bf16>,
    /// With `fp8_slots`: the received rows as the FP8 GEMM's operand (expert-major as `xe`,
    /// which then holds only the outputs).
    xq: Option<Fp8Rows>,
    /// Where each (token, k)'s output comes back: its slot row in `recv`.
    idx: CudaSlice<i32>,
}

impl SlotExchange {
    pub fn new(s: &StepShape, a: &mut Alloc) -> Result<Self, DriverError> {
        let (t, k, e, l) = (s.max_home, s.top_k, s.experts, s.local());
        let slots = s.slot_space(t);
        assert!(
            s.slot_row_bytes() <= 2 * s.hidden,
            "an FP8 slot row fits a bf16 one"
        );
        Ok(Self {
            shape: *s,
            offsets: a.zeros(e + 1)?,
            pos_of: a.zeros(t * k)?,
            entry_of: a.zeros(t * k)?,
            send: a.zeros(slots * s.hidden)?,
            recv: a.zeros(slots * s.hidden)?,
            map: a.zeros(slots)?,
            local_off: a.zeros(l + 1)?,
            ends: a.zeros(hopper::MAX_GROUPS)?,
            total: a.zeros(1)?,
            xe: a.zeros(s.recv_rows(t) * s.hidden)?,
            xq: match s.fp8_slots() {
                true => Some(Fp8Rows::zeros(a, s.recv_rows(t), s.hidden)?),
                false => None,
            },
            idx: a.zeros(t * k)?,
        })
    }
}

impl Exchange for SlotExchange {
    fn count(
        &mut self,
        g: &Gpu,
        home: &Home,
        bucket: usize,
        counts: &mut CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        let s = &self.shape;
        g.layout(
            home.ids,
            home.n,
            bucket,
            s.top_k,
            s.experts,
            counts,
            &mut self.offsets,
            &mut self.pos_of,
            &mut self.entry_of,
        )?;
        Ok(())
    }

    fn prepare(&mut self, _g: &Gpu, _home: &Home, _bucket: usize) -> Result<(), GpuError> {
        Ok(())
    }

    /// Home rows into per-peer slots (quantized with `fp8_slots`), one grouped send/recv,
    /// received rows into expert-major blocks.
    fn dispatch(
        &mut self,
        g: &Gpu,
        comm: &Comm,
        home: &Home,
        bucket: usize,
    ) -> Result<(), GpuError> {
        let s = &self.shape;
        let sl = s.slots(bucket);
        let pack = Pack {
            entry_of: &self.entry_of,
            offsets: &self.offsets,
            slots: sl,
            k: s.top_k,
            h: s.hidden,
            rows_cap: bucket * s.top_k,
        };
        match &self.xq {
            None => g.pack_slots(home.x, pack, &mut self.send)?,
            Some(_) => g.pack_slots_fp8(home.x, pack, s.slot_row_bytes(), &mut self.send)?,
        }
        // FP8 rows are whole bf16 pairs (`slot_row_bytes` is even): send/recv only copies bytes.
        let slot = sl.slot_rows * s.slot_row_bytes() / 2;
        comm.exchange_slots(&self.send, &mut self.recv, slot, &g.stream)?;
        g.recv_map(
            home.gathered,
            sl,
            hopper::ALIGN,
            &mut self.map,
            &mut self.local_off,
            &mut self.total,
            &mut self.ends,
        )?;
        let rows = s.slot_space(bucket);
        match &mut self.xq {
            None => g.scatter_by_map(&self.recv, &self.map, rows, s.hidden, &mut self.xe)?,
            Some(xq) => {
                g.scatter_fp8_by_map(&self.recv, &self.map, rows, s.slot_row_bytes(), xq)?
            }
        }
        Ok(())
    }

    fn expert_rows(&mut self, _g: &Gpu, bucket: usize) -> Result<ExpertRows<'_>, GpuError> {
        // `recv_map` laid the rows out aligned and wrote their ends.
        Ok(ExpertRows::Blocks {
            x: &mut self.xe,
            cap: self.shape.recv_rows(bucket),
            offsets: &self.local_off,
            ends: &self.ends,
            total: &self.total,
            weights: None,
            fp8: self.xq.as_ref(),
        })
    }

    fn combine(
        &mut self,
        g: &Gpu,
        comm: &Comm,
        home: &Home,
        bucket: usize,
        shared: Option<&CudaSlice<bf16>>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = &self.shape;
        let (h, k, sl) = (s.hidden, s.top_k, s.slots(bucket));
        g.gather_by_map(&self.xe, &self.map, s.slot_space(bucket), h, &mut self.send)?;
        comm.exchange_slots(&self.send, &mut self.recv, sl.slot_rows * h, &g.stream)?;
        g.slot_index(
            home.ids,
            &self.pos_of,
            &self.offsets,
            home.n,
            bucket,
            k,
            sl,
            &mut self.idx,
        )?;
        g.combine(
            &self.recv, &self.idx, home.w, home.n, bucket, k, h, shared, out,
        )?;
        Ok(())
    }
}

impl Comm {
    /// The expert-parallel exchange: slot p of `send` (`slot` elements) goes to rank p, and rank
    /// p's slot for us lands in slot p of `recv`; one group, so it is a single capturable step.
    /// A lost rank's slots stay where they are: the routing sends it nothing, and from it
    /// nothing is counted.
    pub fn exchange_slots<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        slot: usize,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        self.group(|| {
            for &p in self.members() {
                self.send(send, p * slot, slot, p, stream)?;
                self.recv(recv, p * slot, slot, p, stream)?;
            }
            Ok(())
        })
    }
}
