//! The `nccl` exchange: fixed-size slots over plain NCCL send/recv. Every rank sends each peer one
//! slot sized for the bucket's worst case (a token reaches at most min(k, local) of a peer's
//! experts), so the exchange is one capturable group whatever the routing. Received rows are
//! scattered into expert-major blocks aligned to the Hopper GEMM's row tile; combine gathers the
//! outputs back into the slots, sends them home, and sums each token's k rows by its weights.
//! With FP8 experts the rows go out quantized (`StepShape::fp8_slots`): half the bytes on the
//! wire and in both copies, and the FFN reads them as they land (no quantization pass of its
//! own); the outputs come back in bf16.

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DriverError, PushKernelArg};
use half::bf16;

use super::exchange::{Exchange, ExpertRows, Home};
use super::fp8::Fp8Rows;
use super::nccl::{Comm, NcclError, NcclType};
use super::shape::{Slots, StepShape};
use super::{hopper, Alloc, Gpu, GpuError, MAX_EXPERTS};
use crate::model::fp8;

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
    pub fn pack_slots(
        &self,
        x: &CudaSlice<bf16>,
        p: Pack,
        send: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        let sc = p.scalars();
        let mut b = self.stream.launch_builder(&self.k.pack_slots);
        b.arg(x);
        p.push(&mut b, &sc);
        b.arg(&sc[5]).arg(send);
        // SAFETY: rows < offsets[E] <= rows_cap; slot indices stay below slot_rows by construction
        // (a peer gets at most min(k, local) rows per token); send holds world slots.
        unsafe { b.launch(Self::cfg((p.rows_cap as u32, 1), 128, 0)) }.map(drop)
    }

    /// `pack_slots` with each row quantized on the way (DeepSeek-V3's rule, as
    /// `Fp8::quantize`): a slot row is `row_bytes` (`StepShape::slot_row_bytes`), the h E4M3
    /// codes then h / 128 f32 scales.
    pub fn pack_slots_fp8(
        &self,
        x: &CudaSlice<bf16>,
        p: Pack,
        row_bytes: usize,
        send: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        assert!(
            p.h % fp8::BLOCK == 0
                && row_bytes % 16 == 0
                && row_bytes >= p.h + p.h / fp8::BLOCK * 4
                && send.len() * 2 >= p.slots.world * p.slots.slot_rows * row_bytes,
            "FP8 slot rows of {row_bytes} bytes for hidden {}",
            p.h
        );
        let (sc, r) = (p.scalars(), row_bytes as i32);
        let mut b = self.stream.launch_builder(&self.k.pack_slots_fp8);
        b.arg(x);
        p.push(&mut b, &sc);
        b.arg(&r).arg(&sc[5]).arg(send);
        // SAFETY: as `pack_slots`, with each slot row `row_bytes` (asserted to hold the codes and
        // scales) and send at least world slots of them.
        unsafe { b.launch(Self::cfg((p.rows_cap as u32, 1), 128, 0)) }.map(drop)
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

    /// `pack_slots_fp8`'s rows (`src`, `rows` slot rows of `row_bytes`) into `xq`: row
    /// `map[q]` gets slot row q's codes and scales (where map[q] >= 0).
    pub fn scatter_fp8_by_map(
        &self,
        src: &CudaSlice<bf16>,
        map: &CudaSlice<i32>,
        rows: usize,
        row_bytes: usize,
        xq: &mut Fp8Rows,
    ) -> Result<(), DriverError> {
        assert!(
            src.len() * 2 >= rows * row_bytes
                && map.len() >= rows
                && row_bytes >= xq.k + xq.k / fp8::BLOCK * 4,
            "FP8 scatter of {rows} slot rows of {row_bytes} bytes"
        );
        let (h, r, ld) = (xq.k as i32, row_bytes as i32, xq.ld() as i32);
        let mut b = self.stream.launch_builder(&self.k.scatter_fp8_by_map);
        b.arg(src)
            .arg(map)
            .arg(&h)
            .arg(&r)
            .arg(&ld)
            .arg(&mut xq.q)
            .arg(&mut xq.sf);
        // SAFETY: `rows` slot rows of row_bytes in src (asserted); map values index xq's rows
        // (the expert-major side is sized as `xe`, which xq mirrors) or are -1, skipped.
        unsafe { b.launch(Self::cfg((rows as u32, 1), 128, 0)) }.map(drop)
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

/// What places an expert-major row in its peer's slot (`pack_slots`' arguments but the rows):
/// each row's (token, k) entry, the expert-major offsets `[experts + 1]`, the slots' shape, and
/// the most expert-major rows (`bucket * k`).
#[derive(Clone, Copy)]
pub struct Pack<'a> {
    pub entry_of: &'a CudaSlice<i32>,
    pub offsets: &'a CudaSlice<i32>,
    pub slots: Slots,
    pub k: usize,
    pub h: usize,
    pub rows_cap: usize,
}

impl<'a> Pack<'a> {
    /// `E, L, K, H, C, rows_cap` as the kernels take them.
    fn scalars(&self) -> [i32; 6] {
        let s = self.slots;
        [
            s.experts,
            s.local,
            self.k,
            self.h,
            s.slot_rows,
            self.rows_cap,
        ]
        .map(|v| v as i32)
    }

    /// Pushes `entry_of, offsets, E, L, K, H, C` (the scalars from `scalars`).
    fn push<'b>(&self, b: &mut cudarc::driver::LaunchArgs<'b>, sc: &'b [i32; 6])
    where
        'a: 'b,
    {
        b.arg(self.entry_of).arg(self.offsets);
        for v in &sc[..5] {
            b.arg(v);
        }
    }
}
