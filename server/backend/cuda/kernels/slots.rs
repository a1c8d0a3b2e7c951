//! The `nccl` slot exchange's kernels (layout.cuh): packing rows into their peers' slots, the
//! received rows' map, and the scatters and gathers by it.

use cudarc::driver::{CudaFunction, CudaSlice, DriverError, PushKernelArg};
use half::bf16;

use crate::backend::cuda::kernels::fp8::Fp8Rows;
use crate::backend::cuda::shape::Slots;
use crate::backend::cuda::{Gpu, MAX_EXPERTS};
use crate::model::fp8;

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
