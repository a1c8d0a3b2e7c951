//! The GPU layer (`--features cuda`): one context and compute stream per rank, the kernels
//! compiled by build.rs and embedded in the binary, typed launchers for them (and cuBLAS for the
//! router GEMM), the one device allocator (`Alloc`) and the GPU error type.

pub mod bench;
mod blas;
pub mod decode_gemm;
pub mod ep;
pub mod exchange;
pub mod fp8;
mod fp8_ffn;
pub mod hopper;
pub mod ipc;
pub mod nccl;
pub mod rank;
mod router;
pub mod setup;
pub mod shape;
pub mod slots;
pub mod step;
mod transfer;

pub use router::{sigmoid_group_in_regs, Logits, ROUTER_PIECES, TOPK_REGS_EXPERTS};

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtrMut, DeviceRepr,
    DriverError, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

/// `kernels/epserve.cu` (its parts: routing, layout, ffn, convert), compiled for sm_90a (plus
/// compute_90a PTX).
pub static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/epserve_kernels.fatbin"));

/// Rows per grouped-GEMM tile (the kernel's `kTile`).
pub const GEMM_TILE: usize = 64;
/// Output columns per tile of the wide grouped GEMM (`kWideN`), used when N is a multiple.
pub const GEMM_WIDE_N: usize = 128;
/// cuBLAS's workspace, set once so that captured graphs never make it allocate (32 MiB, as
/// cuBLAS suggests for Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;
/// `recv_map` keeps an int per expert in 48 KiB of shared memory.
pub const MAX_EXPERTS: usize = 12 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("CUDA: {0}")]
    Driver(#[from] DriverError),
    #[error("NCCL: {0}")]
    Nccl(#[from] nccl::NcclError),
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("{0}")]
    Config(String),
    /// The step's completion event did not fire within this bound.
    #[error("the GPU step did not finish within {0:?} (a peer is gone or stuck)")]
    Timeout(std::time::Duration),
}

/// The only way the GPU backend allocates device memory: counted (`epserve_device_allocations_total`,
/// all at startup), and zero-filled.
pub struct Alloc {
    stream: Arc<CudaStream>,
    pub bytes: usize,
}

impl Alloc {
    pub fn new(stream: Arc<CudaStream>) -> Self {
        Self { stream, bytes: 0 }
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn count<T>(&mut self, n: usize) {
        self.bytes += n * std::mem::size_of::<T>();
        metrics::counter!("epserve_device_allocations_total").increment(1);
    }
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &mut self,
        n: usize,
    ) -> Result<CudaSlice<T>, DriverError> {
        self.count::<T>(n.max(1));
        self.stream.alloc_zeros(n.max(1))
    }
    pub fn upload<T: DeviceRepr>(&mut self, host: &[T]) -> Result<CudaSlice<T>, DriverError> {
        self.count::<T>(host.len());
        self.stream.clone_htod(host)
    }
}

pub struct Kernels {
    topk_softmax: CudaFunction,
    topk_sigmoid_group: CudaFunction,
    topk_softmax_regs: CudaFunction,
    topk_sigmoid_group_regs: CudaFunction,
    count_experts: CudaFunction,
    exclusive_scan: CudaFunction,
    assign_positions: CudaFunction,
    gather_rows: CudaFunction,
    swiglu: CudaFunction,
    combine: CudaFunction,
    build_tiles: CudaFunction,
    grouped_gemm: CudaFunction,
    grouped_gemm_wide: CudaFunction,
    f32_to_bf16: CudaFunction,
    widen_rows: CudaFunction,
    narrow_rows: CudaFunction,
    pack_slots: CudaFunction,
    pack_slots_fp8: CudaFunction,
    recv_map: CudaFunction,
    scatter_by_map: CudaFunction,
    scatter_fp8_by_map: CudaFunction,
    gather_by_map: CudaFunction,
    slot_index: CudaFunction,
    fill_uniform_bf16: CudaFunction,
    fill_uniform_f32: CudaFunction,
    scale_rows: CudaFunction,
    widen_add: CudaFunction,
    ll_bounds: CudaFunction,
    psum_ends: CudaFunction,
    swiglu_masked: CudaFunction,
    swiglu_tiles: CudaFunction,
    bf16_pieces: CudaFunction,
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub k: Kernels,
    /// The Hopper grouped GEMM (DeepGEMM's kernels).
    pub hopper: hopper::Hopper,
    /// FP8 experts: activation quantisation and DeepGEMM's FP8 grouped GEMM.
    pub fp8: fp8::Fp8,
    /// Decode's expert GEMM (experts of a few rows, the masked layout).
    pub decode: decode_gemm::DecodeGemm,
    /// cuBLAS on `stream` (the router GEMM), then the workspace it owns (dropped after it).
    blas: CudaBlas,
    _blas_workspace: CudaSlice<u8>,
}

/// Number of CUDA devices (0 when no driver is present).
pub fn device_count() -> usize {
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

impl Gpu {
    pub fn new(ordinal: usize) -> Result<Self, GpuError> {
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: called before the first allocation on this context: cudarc's per-allocation
        // events would otherwise be recorded into captured graphs. Streams are ordered by hand.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let module = ctx.load_module(Ptx::from_binary(FATBIN.to_vec()))?;
        let f = |name: &str| module.load_function(name);
        let k = Kernels {
            topk_softmax: f("topk_softmax")?,
            topk_sigmoid_group: f("topk_sigmoid_group")?,
            topk_softmax_regs: f("topk_softmax_regs")?,
            topk_sigmoid_group_regs: f("topk_sigmoid_group_regs")?,
            count_experts: f("count_experts")?,
            exclusive_scan: f("exclusive_scan")?,
            assign_positions: f("assign_positions")?,
            gather_rows: f("gather_rows")?,
            swiglu: f("swiglu")?,
            combine: f("combine")?,
            build_tiles: f("build_tiles")?,
            grouped_gemm: f("grouped_gemm")?,
            grouped_gemm_wide: f("grouped_gemm_wide")?,
            f32_to_bf16: f("f32_to_bf16")?,
            widen_rows: f("widen_rows")?,
            narrow_rows: f("narrow_rows")?,
            pack_slots: f("pack_slots")?,
            pack_slots_fp8: f("pack_slots_fp8")?,
            recv_map: f("recv_map")?,
            scatter_by_map: f("scatter_by_map")?,
            scatter_fp8_by_map: f("scatter_fp8_by_map")?,
            gather_by_map: f("gather_by_map")?,
            slot_index: f("slot_index")?,
            fill_uniform_bf16: f("fill_uniform_bf16")?,
            fill_uniform_f32: f("fill_uniform_f32")?,
            scale_rows: f("scale_rows")?,
            widen_add: f("widen_add")?,
            ll_bounds: f("ll_bounds")?,
            psum_ends: f("psum_ends")?,
            swiglu_masked: f("swiglu_masked")?,
            swiglu_tiles: f("swiglu_tiles")?,
            bf16_pieces: f("bf16_pieces")?,
        };
        let hopper = hopper::Hopper::load(&ctx)?;
        let fp8 = fp8::Fp8::load(&ctx)?;
        // Through `Alloc`, as every device allocation, so it is counted.
        let mut a = Alloc::new(stream.clone());
        let decode = decode_gemm::DecodeGemm::load(&ctx, &module, &mut a)?;
        let blas = CudaBlas::new(stream.clone())?;
        let mut workspace = a.zeros::<u8>(BLAS_WORKSPACE)?;
        let ws = workspace.device_ptr_mut(&stream).0;
        // SAFETY: the workspace is a live device allocation of BLAS_WORKSPACE bytes, kept in
        // `self` and dropped after the handle.
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ws as *mut _, BLAS_WORKSPACE)
        }
        .result()?;
        Ok(Self {
            ctx,
            stream,
            k,
            hopper,
            fp8,
            decode,
            blas,
            _blas_workspace: workspace,
        })
    }

    fn cfg(grid: (u32, u32), block: u32, shared: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (grid.0.max(1), grid.1.max(1), 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
        }
    }

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
}

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

impl Gpu {
    pub fn f32_to_bf16(
        &self,
        x: &CudaSlice<f32>,
        n: &CudaSlice<i32>,
        n_cap: usize,
        h: usize,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        let h32 = h as i32;
        let mut b = self.stream.launch_builder(&self.k.f32_to_bf16);
        b.arg(x).arg(n).arg(&h32).arg(y);
        // SAFETY: both buffers hold n_cap rows of h.
        unsafe { b.launch(Self::cfg(((n_cap * h).div_ceil(256) as u32, 1), 256, 0)) }.map(drop)
    }

    /// `x[..n * h]` from 16-bit rows `src` (bf16, or f16 when `f16`).
    pub fn widen_rows(
        &self,
        src: &CudaSlice<bf16>,
        f16: bool,
        n: usize,
        h: usize,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), DriverError> {
        assert!(n * h <= src.len() && n * h <= x.len(), "widen_rows bounds");
        let (f, n32, h32) = (i32::from(f16), n as i32, h as i32);
        let mut b = self.stream.launch_builder(&self.k.widen_rows);
        b.arg(src).arg(&f).arg(&n32).arg(&h32).arg(x);
        // SAFETY: both buffers hold at least n rows of h (asserted); the grid-stride loop stays
        // below n * h.
        unsafe { b.launch(Self::rows_cfg(n * h)) }.map(drop)
    }

    /// 16-bit rows `out[..n * h]` (bf16, or f16 when `f16`) from `x`, rounded to nearest even.
    pub fn narrow_rows(
        &self,
        x: &CudaSlice<f32>,
        f16: bool,
        n: usize,
        h: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        assert!(n * h <= x.len() && n * h <= out.len(), "narrow_rows bounds");
        let (f, n32, h32) = (i32::from(f16), n as i32, h as i32);
        let mut b = self.stream.launch_builder(&self.k.narrow_rows);
        b.arg(x).arg(&f).arg(&n32).arg(&h32).arg(out);
        // SAFETY: as in `widen_rows`.
        unsafe { b.launch(Self::rows_cfg(n * h)) }.map(drop)
    }

    /// A grid-stride launch over `elems` values: enough blocks to fill the GPU, no more.
    fn rows_cfg(elems: usize) -> LaunchConfig {
        Self::cfg((elems.div_ceil(256).clamp(1, 132 * 16) as u32, 1), 256, 0)
    }
}

/// Most tiles the grouped GEMM can have: one per 64 rows, plus a partial tile per expert.
pub fn max_tiles(rows_cap: usize, experts: usize) -> usize {
    rows_cap.div_ceil(GEMM_TILE) + experts
}

impl Gpu {
    /// `x[i] = scale * U[-1, 1)` from (seed, i): benchmark weights made on the GPU.
    pub fn fill_uniform_bf16(
        &self,
        x: &mut CudaSlice<bf16>,
        seed: u64,
        scale: f32,
    ) -> Result<(), DriverError> {
        let n = x.len();
        let mut b = self.stream.launch_builder(&self.k.fill_uniform_bf16);
        b.arg(x).arg(&n).arg(&seed).arg(&scale);
        // SAFETY: a grid-stride loop over the buffer's n elements.
        unsafe { b.launch(Self::cfg((1024, 1), 256, 0)) }.map(drop)
    }

    pub fn fill_uniform_f32(
        &self,
        x: &mut CudaSlice<f32>,
        seed: u64,
        scale: f32,
    ) -> Result<(), DriverError> {
        let n = x.len();
        let mut b = self.stream.launch_builder(&self.k.fill_uniform_f32);
        b.arg(x).arg(&n).arg(&seed).arg(&scale);
        // SAFETY: as in `fill_uniform_bf16`.
        unsafe { b.launch(Self::cfg((1024, 1), 256, 0)) }.map(drop)
    }
}

impl Gpu {
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

    /// The grouped GEMM's blocks in NCCL EP's low-latency layout: local expert e's `counts[e]`
    /// rows start at row e * `stride`; `bounds [2L]` gets the starts, then the ends, and
    /// `masked` (`hopper::MAX_GROUPS`) the counts, clamped to `stride`, for the Hopper GEMM.
    pub fn ll_bounds(
        &self,
        counts: &CudaSlice<i32>,
        stride: usize,
        bounds: &mut CudaSlice<i32>,
        masked: &mut CudaSlice<i32>,
    ) -> Result<(), DriverError> {
        let l = counts.len();
        let groups = hopper::MAX_GROUPS;
        assert!(
            bounds.len() >= 2 * l && masked.len() >= groups && l <= groups,
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
        // SAFETY: counts holds l ints, bounds 2l, masked MAX_GROUPS (asserted).
        unsafe { b.launch(Self::cfg((1, 1), 256, 0)) }.map(drop)
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

    /// `out[t] = x[t] (+ shared[t])` in f32 for t < *n, over `n_cap` rows of `h`.
    pub fn widen_add(
        &self,
        x: &CudaSlice<bf16>,
        shared: Option<&CudaSlice<bf16>>,
        n: &CudaSlice<i32>,
        n_cap: usize,
        h: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), DriverError> {
        assert!(h % 8 == 0, "widen_add takes rows of 8-column steps");
        let (h32, null) = (h as i32, 0u64);
        let mut b = self.stream.launch_builder(&self.k.widen_add);
        b.arg(x);
        match shared {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(n).arg(&h32).arg(out);
        let cols = h.div_ceil(8 * 256) as u32;
        // SAFETY: x, shared and out hold n_cap rows of h (h % 8 == 0: every 16-byte step is in
        // the row and aligned); a null `shared` is a zero pointer.
        unsafe { b.launch(Self::cfg((n_cap as u32, cols), 256, 0)) }.map(drop)
    }
}
