//! Launchers of layout.cuh's kernels outside the slot exchange: each entry's expert-major position,
//! rows gathered into expert order and combined back, and the grouped GEMMs' blocks in NCCL EP's
//! layouts.

use cudarc::driver::{CudaSlice, DriverError, PushKernelArg};
use half::bf16;

use crate::backend::cuda::kernels::hopper;
use crate::backend::cuda::Gpu;

impl Gpu {
    /// counts [e] (zeroed here), offsets [e + 1], and the expert-major position of every entry:
    /// `pos_of [n_cap * k]` and its inverse `entry_of [n_cap * k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn layout(
        &self,
        ids: &CudaSlice<i32>,
        n: &CudaSlice<i32>,
        n_cap: usize,
        k: usize,
        e: usize,
        counts: &mut CudaSlice<i32>,
        offsets: &mut CudaSlice<i32>,
        pos_of: &mut CudaSlice<i32>,
        entry_of: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        self.count_experts(ids, n, n_cap, k, counts)?;
        let (ki, ei) = (k as i32, e as i32);
        let mut b = self.stream.launch_builder(&self.k.exclusive_scan);
        b.arg(&*counts).arg(&ei).arg(&mut *offsets);
        // SAFETY: counts holds e entries, offsets e + 1; the kernel needs exactly 256 threads.
        unsafe { b.launch(Self::cfg((1, 1), 256, 0)) }?;
        let mut b = self.stream.launch_builder(&self.k.assign_positions);
        b.arg(ids)
            .arg(n)
            .arg(&ki)
            .arg(&*offsets)
            .arg(pos_of)
            .arg(entry_of);
        // SAFETY: one 256-thread block per expert, as the kernel's block scan requires.
        unsafe { b.launch(Self::cfg((e as u32, 1), 256, 0)) }.map(drop)
    }

    /// counts [e] (zeroed here) of the first *n rows of `ids [n_cap, k]` (ids < e, or -1).
    pub fn count_experts(
        &self,
        ids: &CudaSlice<i32>,
        n: &CudaSlice<i32>,
        n_cap: usize,
        k: usize,
        counts: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        self.stream.memset_zeros(counts)?;
        let ki = k as i32;
        let mut b = self.stream.launch_builder(&self.k.count_experts);
        b.arg(ids).arg(n).arg(&ki).arg(counts);
        // SAFETY: ids holds n_cap * k entries, counts e (ids are < e or -1).
        unsafe { b.launch(Self::cfg(((n_cap * k).div_ceil(256) as u32, 1), 256, 0)) }.map(drop)
    }

    /// `out[j] = map[ids[j]]` for the first `count` entries (-1 stays -1): slots to NCCL EP's
    /// expert numbers in a group of fewer ranks.
    pub fn renumber(
        &self,
        ids: &CudaSlice<i32>,
        map: &CudaSlice<i32>,
        count: usize,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        assert!(ids.len() >= count && out.len() >= count, "renumber");
        let c = count as i32;
        let mut b = self.stream.launch_builder(&self.k.renumber);
        b.arg(ids).arg(map).arg(out).arg(&c);
        // SAFETY: ids and out hold `count` entries (asserted); every entry is -1 or a slot below
        // map's length (the slot table's values).
        unsafe { b.launch(Self::rows_cfg(count)) }.map(drop)
    }

    /// `out[r] = x[entry_of[r] / k]` for r < *rows, up to `rows_cap` rows of `h` (h % 8 == 0).
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows(
        &self,
        x: &CudaSlice<bf16>,
        entry_of: &CudaSlice<i32>,
        rows: &CudaSlice<i32>,
        rows_cap: usize,
        k: usize,
        h: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        let (k, h32) = (k as i32, h as i32);
        let mut b = self.stream.launch_builder(&self.k.gather_rows);
        b.arg(x).arg(entry_of).arg(rows).arg(&k).arg(&h32).arg(out);
        // SAFETY: out holds rows_cap rows of h; entry_of values index x's rows times k.
        unsafe { b.launch(Self::cfg((rows_cap as u32, 1), 128, 0)) }.map(drop)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn combine(
        &self,
        y: &CudaSlice<bf16>,
        pos_of: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        n: &CudaSlice<i32>,
        n_cap: usize,
        k: usize,
        h: usize,
        shared: Option<&CudaSlice<bf16>>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), DriverError> {
        let (k, h32) = (k as i32, h as i32);
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(&self.k.combine);
        b.arg(y).arg(pos_of).arg(weights).arg(n).arg(&k).arg(&h32);
        match shared {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(out);
        // SAFETY: pos_of indexes y's rows; a null `shared` is a 64-bit zero device pointer.
        unsafe { b.launch(Self::cfg((n_cap as u32, 1), 256, 0)) }.map(drop)
    }

    /// The grouped GEMM's blocks in NCCL EP's low-latency layout: local expert e's `counts[e]`
    /// rows (e < `l`) start at row e * `stride`; `bounds [2l]` gets the starts, then the ends,
    /// and `masked` (`hopper::MAX_GROUPS`) the counts, clamped to `stride`, for the Hopper GEMM.
    pub fn ll_bounds(
        &self,
        counts: &CudaSlice<i32>,
        l: usize,
        stride: usize,
        bounds: &mut CudaSlice<i32>,
        masked: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        let groups = hopper::MAX_GROUPS;
        assert!(
            counts.len() >= l && bounds.len() >= 2 * l && masked.len() >= groups && l <= groups,
            "ll_bounds"
        );
        let (l32, s32, g32) = (l as i32, stride as i32, groups as i32);
        let mut b = self.stream.launch_builder(&self.k.ll_bounds);
        b.arg(counts)
            .arg(&l32)
            .arg(&s32)
            .arg(&g32)
            .arg(bounds)
            .arg(masked);
        // SAFETY: counts holds at least l ints, bounds 2l, masked MAX_GROUPS (asserted).
        unsafe { b.launch(Self::cfg((1, 1), 256, 0)) }.map(drop)
    }

    /// Two-batch overlap's token counts: of the step's `n` (one int), micro-batch A takes the
    /// first `half` rows (`na`: min(n, half)) and B the rest (`nb`: n - half, at most half,
    /// at least 0).
    pub fn split_count(
        &self,
        n: &CudaSlice<i32>,
        half: usize,
        na: &mut CudaSlice<i32>,
        nb: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        assert!(
            !n.is_empty() && !na.is_empty() && !nb.is_empty(),
            "split_count"
        );
        let h32 = half as i32;
        let mut b = self.stream.launch_builder(&self.k.split_count);
        b.arg(n).arg(&h32).arg(na).arg(nb);
        // SAFETY: n, na and nb hold at least one int each (asserted); one thread reads n[0]
        // and writes na[0] and nb[0].
        unsafe { b.launch(Self::cfg((1, 1), 1, 0)) }.map(drop)
    }

    /// The Hopper GEMM's psum layout (`hopper::MAX_GROUPS` ends) from expert-major
    /// `offsets [L]` and per-expert `counts [L]`. The offsets must be the `hopper::ALIGN`-aligned
    /// running sum of the counts (as NCCL EP's per-expert alignment writes them): the kernel
    /// starts each block at the aligned end of the one before.
    pub fn psum_ends(
        &self,
        offsets: &CudaSlice<i32>,
        counts: &CudaSlice<i32>,
        ends: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        let l = counts.len();
        let groups = hopper::MAX_GROUPS;
        assert!(
            l > 0 && offsets.len() >= l && ends.len() >= groups && l <= groups,
            "psum_ends"
        );
        let (l32, a32, g32) = (l as i32, hopper::ALIGN as i32, groups as i32);
        let mut b = self.stream.launch_builder(&self.k.psum_ends);
        b.arg(offsets)
            .arg(counts)
            .arg(&l32)
            .arg(&a32)
            .arg(&g32)
            .arg(ends);
        // SAFETY: offsets and counts hold at least l ints, ends MAX_GROUPS (asserted).
        unsafe { b.launch(Self::cfg((1, 1), 256, 0)) }.map(drop)
    }

    /// The psum ends (`hopper::MAX_GROUPS`) of NCCL EP's expert-major blocks of the rank's `l`
    /// slots at `offsets [l + 1]` (the padded total last), each slot's rows counted from the
    /// all-gathered routing (`gathered [world][world * l]`, this rank's slots from `rank * l`)
    /// instead of NCCL EP's counts, which are padded to the alignment: what runs on the blocks
    /// skips the padding.
    pub fn routed_ends(
        &self,
        gathered: &CudaSlice<i32>,
        (rank, world): (usize, usize),
        l: usize,
        offsets: &CudaSlice<i32>,
        ends: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        let groups = hopper::MAX_GROUPS;
        assert!(
            l > 0
                && offsets.len() > l
                && rank < world
                && gathered.len() >= world * world * l
                && ends.len() >= groups
                && l <= groups,
            "routed_ends"
        );
        let (r32, w32, l32, g32) = (rank as i32, world as i32, l as i32, groups as i32);
        let mut b = self.stream.launch_builder(&self.k.routed_ends);
        b.arg(gathered)
            .arg(&r32)
            .arg(&w32)
            .arg(&l32)
            .arg(offsets)
            .arg(&g32)
            .arg(ends);
        // SAFETY: gathered holds world x world x l ints, offsets at least l + 1, ends MAX_GROUPS
        // (asserted).
        unsafe { b.launch(Self::cfg((1, 1), 256, 0)) }.map(drop)
    }
}
