//! Launchers of ffn.cuh's kernels: the tiled bf16 grouped GEMM, SwiGLU over its three row layouts,
//! and gate weights applied to expert rows.

use cudarc::driver::{CudaSlice, CudaView, DriverError, PushKernelArg};
use half::bf16;

use crate::backend::cuda::Gpu;

/// Rows per grouped-GEMM tile (the kernel's `kTile`).
pub const GEMM_TILE: usize = 64;
/// Output columns per tile of the wide grouped GEMM (`kWideN`), used when N is a multiple.
pub const GEMM_WIDE_N: usize = 128;

/// Where each expert's rows are, for the grouped GEMM.
#[derive(Clone, Copy)]
pub enum Blocks<'a> {
    /// Packed, contiguous blocks: expert e's rows are `[offsets[e], offsets[e + 1])`.
    Offsets(&'a CudaSlice<i32>),
    /// Blocks that need not touch (NCCL EP's LL layout): `[bounds[e], bounds[E + e])`, as
    /// `ll_bounds` writes them; x and y are indexed by row number, so they span the last block.
    Bounds(&'a CudaSlice<i32>),
}

impl<'a> Blocks<'a> {
    fn starts_ends(self, e: usize) -> (CudaView<'a, i32>, CudaView<'a, i32>) {
        match self {
            Blocks::Offsets(o) => (o.slice(..e), o.slice(1..=e)),
            Blocks::Bounds(b) => (b.slice(..e), b.slice(e..2 * e)),
        }
    }
}

/// Most tiles the grouped GEMM can have: one per 64 rows, plus a partial tile per expert.
pub fn max_tiles(rows_cap: usize, experts: usize) -> usize {
    rows_cap.div_ceil(GEMM_TILE) + experts
}

impl Gpu {
    /// `y[rows of e] = x[rows of e] . w_e^T` for every local expert e (`w [e][n][kd]`), over
    /// `blocks` of at most `rows_cap` rows in all. `tiles` holds 2 * max_tiles ints, `n_tiles` one.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_gemm(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        blocks: Blocks,
        e: usize,
        rows_cap: usize,
        n: usize,
        kd: usize,
        tiles: &mut CudaSlice<i32>,
        n_tiles: &mut CudaSlice<i32>,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        assert!(
            n % GEMM_TILE == 0 && kd % 32 == 0,
            "grouped_gemm needs n % 64 == 0 and kd % 32 == 0"
        );
        let (starts, ends) = blocks.starts_ends(e);
        let max_tiles = max_tiles(rows_cap, e);
        assert!(tiles.len() >= 2 * max_tiles, "grouped_gemm tile list");
        let ei = e as i32;
        let mut b = self.stream.launch_builder(&self.k.build_tiles);
        b.arg(&starts)
            .arg(&ends)
            .arg(&ei)
            .arg(&mut *tiles)
            .arg(&mut *n_tiles);
        // SAFETY: tiles has room for max_tiles entries (one per 64 rows of each expert's block).
        unsafe { b.launch(Self::cfg((1, 1), 32, 0)) }?;
        let (n32, kd32) = (n as i32, kd as i32);
        // 64 x 128 tiles with a cp.async pipeline where N allows, else 64 x 64.
        let (func, width, threads) = match n % GEMM_WIDE_N {
            0 => (&self.k.grouped_gemm_wide, GEMM_WIDE_N, 256),
            _ => (&self.k.grouped_gemm, GEMM_TILE, 128),
        };
        let mut b = self.stream.launch_builder(func);
        b.arg(x)
            .arg(w)
            .arg(&ends)
            .arg(&*tiles)
            .arg(&*n_tiles)
            .arg(&n32)
            .arg(&kd32)
            .arg(y);
        // SAFETY: x holds rows_cap rows of kd, y rows_cap rows of n, w e matrices of n x kd.
        unsafe {
            b.launch(Self::cfg(
                ((n / width) as u32, max_tiles as u32),
                threads,
                0,
            ))
        }
        .map(drop)
    }

    pub fn swiglu(
        &self,
        gu: &CudaSlice<bf16>,
        rows: &CudaSlice<i32>,
        rows_cap: usize,
        inter: usize,
        weights: Option<&CudaSlice<f32>>,
        act: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        let i = inter as i32;
        assert!(
            weights.is_none_or(|w| w.len() >= rows_cap),
            "swiglu weights"
        );
        let mut b = self.stream.launch_builder(&self.k.swiglu);
        let none = 0u64;
        b.arg(gu).arg(rows).arg(&i);
        match weights {
            Some(w) => b.arg(w),
            None => b.arg(&none),
        };
        b.arg(act);
        // SAFETY: gu holds rows_cap rows of 2 * inter, act rows_cap rows of inter, weights (or
        // a null pointer) rows_cap floats.
        unsafe { b.launch(Self::cfg((rows_cap as u32, 1), 256, 0)) }.map(drop)
    }

    /// SwiGLU over the masked layout's rows: expert e's `counts[e]` rows from row e * `stride`
    /// of `gu [.., 2 * inter]` into `act [.., inter]`, for `e` experts.
    pub fn swiglu_masked(
        &self,
        gu: &CudaSlice<bf16>,
        counts: &CudaSlice<i32>,
        e: usize,
        stride: usize,
        inter: usize,
        act: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        assert!(
            counts.len() >= e
                && gu.len() >= e * stride * 2 * inter
                && act.len() >= e * stride * inter,
            "swiglu_masked"
        );
        let (s32, i32_) = (stride as i32, inter as i32);
        let mut b = self.stream.launch_builder(&self.k.swiglu_masked);
        b.arg(gu).arg(counts).arg(&s32).arg(&i32_).arg(act);
        // Blocks per expert: decode's experts get a few rows each, one block per row.
        let per_expert = stride.clamp(1, 32) as u32;
        // SAFETY: the kernel clamps counts to stride, so every row lies in gu and act (asserted
        // to span e * stride rows).
        unsafe { b.launch(Self::cfg((e as u32, per_expert), 256, 0)) }.map(drop)
    }

    /// SwiGLU over the rows of the tiles the last grouped GEMM built (`max_tiles` of them at
    /// most), for blocks that need not touch; `ends` as for `grouped_gemm_ranges`.
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu_tiles(
        &self,
        gu: &CudaSlice<bf16>,
        tiles: &CudaSlice<i32>,
        n_tiles: &CudaSlice<i32>,
        bounds: &CudaSlice<i32>,
        e: usize,
        max_tiles: usize,
        inter: usize,
        act: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        let ends = bounds.slice(e..2 * e);
        let i = inter as i32;
        let mut b = self.stream.launch_builder(&self.k.swiglu_tiles);
        b.arg(gu)
            .arg(tiles)
            .arg(n_tiles)
            .arg(&ends)
            .arg(&i)
            .arg(act);
        // SAFETY: the tiles' rows lie inside gu (2 * inter per row) and act (inter per row).
        unsafe { b.launch(Self::cfg((max_tiles as u32, 1), 256, 0)) }.map(drop)
    }

    /// `y[r] *= w[r]` for r < *rows, over `rows_cap` rows of `h`.
    pub fn scale_rows(
        &self,
        y: &mut CudaSlice<bf16>,
        w: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        rows_cap: usize,
        h: usize,
    ) -> Result<(), DriverError> {
        let h32 = h as i32;
        let mut b = self.stream.launch_builder(&self.k.scale_rows);
        b.arg(y).arg(w).arg(rows).arg(&h32);
        // SAFETY: y holds rows_cap rows of h, w rows_cap weights; rows past *rows are skipped.
        unsafe { b.launch(Self::cfg((rows_cap as u32, 1), 256, 0)) }.map(drop)
    }
}
