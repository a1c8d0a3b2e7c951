//! The `nccl` exchange: fixed-size slots over plain NCCL send/recv. Every rank sends each peer one
//! slot sized for the bucket's worst case (a token reaches at most min(k, local) of a peer's
//! experts), so the exchange is one capturable group whatever the routing. Received rows are
//! scattered into expert-major blocks aligned to the Hopper GEMM's row tile; combine gathers the
//! outputs back into the slots, sends them home, and sums each token's k rows by its weights.

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DriverError, PushKernelArg};
use half::bf16;

use super::exchange::{Exchange, ExpertRows, Home};
use super::nccl::{Comm, NcclError, NcclType};
use super::shape::{Slots, StepShape};
use super::{hopper, Alloc, Gpu, GpuError, MAX_EXPERTS};

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
    /// Where each (token, k)'s output comes back: its slot row in `recv`.
    idx: CudaSlice<i32>,
}

impl SlotExchange {
    pub fn new(s: &StepShape, a: &mut Alloc) -> Result<Self, DriverError> {
        let (t, k, e, l) = (s.max_home, s.top_k, s.experts, s.local());
        let slots = s.slot_space(t);
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

    /// Home rows into per-peer slots, one grouped send/recv, received rows into expert-major
    /// blocks.
    fn dispatch(
        &mut self,
        g: &Gpu,
        comm: &Comm,
        home: &Home,
        bucket: usize,
    ) -> Result<(), GpuError> {
        let s = &self.shape;
        let sl = s.slots(bucket);
        g.pack_slots(
            home.x,
            &self.entry_of,
            &self.offsets,
            sl,
            s.top_k,
            s.hidden,
            bucket * s.top_k,
            &mut self.send,
        )?;
        comm.exchange_slots(
            &self.send,
            &mut self.recv,
            sl.slot_rows * s.hidden,
            &g.stream,
        )?;
        g.recv_map(
            home.gathered,
            sl,
            hopper::ALIGN,
            &mut self.map,
            &mut self.local_off,
            &mut self.total,
            &mut self.ends,
        )?;
        g.scatter_by_map(
            &self.recv,
            &self.map,
            s.slot_space(bucket),
            s.hidden,
            &mut self.xe,
        )?;
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
    pub fn exchange_slots<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        slot: usize,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        self.group(|| {
            for p in 0..self.world {
                self.send(send, p * slot, slot, p, stream)?;
                self.recv(recv, p * slot, slot, p, stream)?;
            }
            Ok(())
        })
    }
}

/// The slot exchange's kernels.
impl Gpu {
    /// Packs each expert-major row into its peer's send slot (`send [world][slot_rows][h]`).
    #[allow(clippy::too_many_arguments)]
    pub fn pack_slots(
        &self,
        x: &CudaSlice<bf16>,
        entry_of: &CudaSlice<i32>,
        offsets: &CudaSlice<i32>,
        s: Slots,
        k: usize,
        h: usize,
        rows_cap: usize,
        send: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        let (e, l, k, h32, c, cap) = (
            s.experts as i32,
            s.local as i32,
            k as i32,
            h as i32,
            s.slot_rows as i32,
            rows_cap as i32,
        );
        let mut b = self.stream.launch_builder(&self.k.pack_slots);
        b.arg(x)
            .arg(entry_of)
            .arg(offsets)
            .arg(&e)
            .arg(&l)
            .arg(&k)
            .arg(&h32)
            .arg(&c)
            .arg(&cap)
            .arg(send);
        // SAFETY: rows < offsets[E] <= rows_cap; slot indices stay below slot_rows by construction
        // (a peer gets at most min(k, local) rows per token); send holds world slots.
        unsafe { b.launch(Self::cfg((rows_cap as u32, 1), 128, 0)) }.map(drop)
    }

    /// From the all-gathered counts `m [world][experts]`: the slot-row -> expert-major map, the
    /// local experts' offsets `[local + 1]` and the received row count.
    #[allow(clippy::too_many_arguments)]
    pub fn recv_map(
        &self,
        m: &CudaSlice<i32>,
        s: Slots,
        align: usize,
        map: &mut CudaSlice<i32>,
        local_offsets: &mut CudaSlice<i32>,
        rows: &mut CudaSlice<i32>,
        ends: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        assert!(
            s.experts <= MAX_EXPERTS,
            "recv_map keeps one int per expert in shared memory (at most {MAX_EXPERTS} experts)"
        );
        let groups = ends.len();
        assert!(
            map.len() >= s.world * s.slot_rows
                && local_offsets.len() > s.local
                && groups >= s.local,
            "recv_map outputs"
        );
        let (rank, w, e, l, c) = (
            s.rank as i32,
            s.world as i32,
            s.experts as i32,
            s.local as i32,
            s.slot_rows as i32,
        );
        let (a, g) = (align as i32, groups as i32);
        let mut b = self.stream.launch_builder(&self.k.recv_map);
        b.arg(m)
            .arg(&rank)
            .arg(&w)
            .arg(&e)
            .arg(&l)
            .arg(&c)
            .arg(&a)
            .arg(&g)
            .arg(map)
            .arg(local_offsets)
            .arg(rows)
            .arg(ends);
        // SAFETY: map holds world * slot_rows entries, local_offsets local + 1, rows one, ends
        // at least local (asserted); the dynamic shared memory holds local * world = experts
        // ints (under 48 KiB, asserted).
        unsafe { b.launch(Self::cfg((1, 1), 256, (s.experts * 4) as u32)) }.map(drop)
    }

    /// `dst[map[q]] = src[q]` (slots to expert-major) over `world * slot_rows` rows of `h`.
    pub fn scatter_by_map(
        &self,
        src: &CudaSlice<bf16>,
        map: &CudaSlice<i32>,
        rows: usize,
        h: usize,
        dst: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        self.by_map(&self.k.scatter_by_map, src, map, rows, h, dst)
    }

    /// `dst[q] = src[map[q]]` (expert-major back to slots).
    pub fn gather_by_map(
        &self,
        src: &CudaSlice<bf16>,
        map: &CudaSlice<i32>,
        rows: usize,
        h: usize,
        dst: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        self.by_map(&self.k.gather_by_map, src, map, rows, h, dst)
    }

    /// One of the two row-map kernels (same arguments, opposite directions), a block per slot row.
    fn by_map(
        &self,
        kernel: &CudaFunction,
        src: &CudaSlice<bf16>,
        map: &CudaSlice<i32>,
        rows: usize,
        h: usize,
        dst: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        let h32 = h as i32;
        let mut b = self.stream.launch_builder(kernel);
        b.arg(src).arg(map).arg(&h32).arg(dst);
        // SAFETY: `rows` slot rows; map values index the expert-major side's rows (or are -1,
        // skipped), so both sides stay inside their buffers.
        unsafe { b.launch(Self::cfg((rows as u32, 1), 128, 0)) }.map(drop)
    }

    /// Where each (token, k)'s expert output returns: `peer * slot_rows + slot`.
    #[allow(clippy::too_many_arguments)]
    pub fn slot_index(
        &self,
        ids: &CudaSlice<i32>,
        pos_of: &CudaSlice<i32>,
        offsets: &CudaSlice<i32>,
        n: &CudaSlice<i32>,
        n_cap: usize,
        k: usize,
        s: Slots,
        idx: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        let (k32, l, c) = (k as i32, s.local as i32, s.slot_rows as i32);
        let mut b = self.stream.launch_builder(&self.k.slot_index);
        b.arg(ids)
            .arg(pos_of)
            .arg(offsets)
            .arg(n)
            .arg(&k32)
            .arg(&l)
            .arg(&c)
            .arg(idx);
        // SAFETY: ids, pos_of and idx hold n_cap * k entries.
        unsafe { b.launch(Self::cfg(((n_cap * k).div_ceil(256) as u32, 1), 256, 0)) }.map(drop)
    }
}
