//! FP8 experts on Hopper, DeepSeek-V3's recipe (`model::fp8`): the activation quantization
//! kernels (`kernels/fp8.cu`: rows, and SwiGLU's output, per 128 channels) and DeepGEMM's SM90
//! FP8 m-grouped GEMM with 1x128 activation and 128x128 weight scales, compiled ahead of time by
//! build.rs from the pinned headers (`kernels/hopper_fp8.cu`; which tiles: `HOPPER_FP8_TILES`).
//! The layouts are the bf16 kernels' (`hopper::Layout`): per-expert row counts stay on the
//! device, so a captured step graph stays valid whatever the routing.

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

use crate::backend::cuda::kernels::hopper::{
    tensor_map, tensor_map_2d, Elem, Instance, Layout, Sms, Tile, ALIGN,
};
use crate::backend::cuda::Alloc;
use crate::model::fp8::BLOCK;

mod tiles {
    use super::Tile;
    // GROUPS, then PSUM, PSUM_SHARE, PSUM_SOLO, PSUM_SHARE_SOLO, MASKED, V3_GATE_UP and
    // V3_DOWN: build.rs's HOPPER_FP8_TILES.
    include!(concat!(env!("OUT_DIR"), "/hopper_fp8_tiles.rs"));
}

/// Psum instances of fixed shapes, DeepSeek-V3's gate/up and down (N and K compiled in, at most
/// 64 experts: build.rs's HOPPER_FP8_TILES), each taken before the general one where it fits.
const FIXED: [Tile; 2] = [tiles::V3_GATE_UP, tiles::V3_DOWN];

static QUANTIZE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fp8_kernels.fatbin"));
static GEMM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/hopper_fp8_kernels.fatbin"));

/// The most experts one launch takes; `sizes` arrays have this many entries.
pub const MAX_GROUPS: usize = tiles::GROUPS;
/// The masked instance's row tile: a masked stride must be a multiple.
pub const MASKED_ROWS: usize = tiles::MASKED.block_m as usize;
/// The largest K the instances' shared memory is sized for (its weight scales are staged whole).
const MAX_K: usize = 32768;
/// Warps of one quantization block, one row's 128-channel groups in turn (`kernels/fp8.cu`'s
/// kWarps).
const QUANT_WARPS: usize = 4;

/// Rows of E4M3 values with their scales, an FP8 GEMM's A operand: `q [cap, k]`, `sf` per 128
/// channels, MN-major (`[k / 128][ld]`, ld = cap rounded up to 4; in the masked layout each
/// expert's `[k / 128][stride]` block in turn).
pub struct Fp8Rows {
    pub q: CudaSlice<u8>,
    pub sf: CudaSlice<f32>,
    pub cap: usize,
    pub k: usize,
}

impl Fp8Rows {
    pub fn zeros(a: &mut Alloc, cap: usize, k: usize) -> Result<Self, DriverError> {
        Ok(Self {
            q: a.zeros(cap * k)?,
            sf: a.zeros(k / BLOCK * cap.next_multiple_of(4))?,
            cap,
            k,
        })
    }

    /// Rows of the scales' leading dimension.
    pub fn ld(&self) -> usize {
        self.cap.next_multiple_of(4)
    }
}

/// Experts' weights in FP8 as checkpoints ship them: `q [groups][n][k]` and one f32 scale per
/// 128x128 block, `sf [groups][n / 128][k / 128]`. The psum GEMM instance that runs them is
/// chosen with their shape, once (`new`), not at each launch.
pub struct Fp8Weights {
    pub q: CudaSlice<u8>,
    pub sf: CudaSlice<f32>,
    pub groups: usize,
    pub n: usize,
    pub k: usize,
    /// Which psum instance runs them on every SM (beside an exchange: `Psum::Fixed`'s too take
    /// the general one of CTA pairs).
    psum: Psum,
}

/// The psum instances that take a shape: a fixed-shape one (its place in `FIXED`), else the
/// general ones of CTA pairs, else those without clusters (`Tile::takes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Psum {
    Fixed(u8),
    Pairs,
    Solo,
}

impl Psum {
    fn of(groups: usize, n: usize, k: usize) -> Self {
        let pairs = [tiles::PSUM, tiles::PSUM_SHARE];
        match FIXED.iter().position(|t| t.takes(groups, n, k)) {
            Some(i) => Psum::Fixed(i as u8),
            None if pairs.iter().all(|t| t.takes(groups, n, k)) => Psum::Pairs,
            None => Psum::Solo,
        }
    }
}

impl Fp8Weights {
    pub fn new(q: CudaSlice<u8>, sf: CudaSlice<f32>, groups: usize, n: usize, k: usize) -> Self {
        Self {
            q,
            sf,
            groups,
            n,
            k,
            psum: Psum::of(groups, n, k),
        }
    }

    pub fn bytes(&self) -> usize {
        self.q.len() + 4 * self.sf.len()
    }
}

/// Which rows a quantization pass writes: those below the device count (the shared expert's
/// bucket), each expert's rows of the psum layout (`ends`, `groups` <= `MAX_GROUPS` of them,
/// each block from the end before it rounded up to `hopper::ALIGN`: its padding rows are
/// skipped), or each expert's `counts[e]` rows of its `stride` (masked).
#[derive(Clone, Copy)]
pub enum Live<'a> {
    Upto(&'a CudaSlice<i32>),
    Psum {
        ends: &'a CudaSlice<i32>,
        groups: usize,
    },
    Masked {
        counts: &'a CudaSlice<i32>,
        stride: usize,
    },
}

/// `kernels/fp8.cu`'s `Live`, field for field (a null pointer: not this layout).
#[repr(C)]
struct LiveRows {
    n_rows: sys::CUdeviceptr,
    ends: sys::CUdeviceptr,
    counts: sys::CUdeviceptr,
    groups: i32,
    align: i32,
    stride: i32,
}

// SAFETY: LiveRows is plain data laid out as the kernels' `Live` (three device pointers, three
// ints, repr(C)), passed by value.
unsafe impl DeviceRepr for LiveRows {}

/// Shared memory of an FP8 tile, as the kernel lays it out: D tile; each stage's A and B tiles;
/// each stage's A scales (128-byte aligned); the weight scales of one column block (a row of
/// K / 128, or two where a column tile can straddle two 128-column scale blocks); two barriers
/// (8 bytes each) per stage.
fn fp8_smem(t: &Tile) -> u32 {
    let d = (t.block_m * t.block_n * 2).next_multiple_of(1024);
    let stage = (t.block_m + t.block_n) * BLOCK as u32;
    let sfa = (t.block_m * 4).next_multiple_of(128);
    let sfb_rows = if BLOCK as u32 % t.block_n == 0 { 1 } else { 2 };
    let sfb = ((MAX_K / BLOCK) as u32 * sfb_rows * 4).next_multiple_of(8);
    d + t.stages * (stage + sfa) + sfb + t.stages * 16
}

pub struct Fp8 {
    k: super::Fp8Kernels,
    psum: Instance,
    /// psum on fewer CTAs, for experts that run beside the exchange (`Sms::BesideExchange`);
    /// it stands in for the fixed-shape ones too.
    psum_share: Instance,
    /// The two above without clusters, for N of an odd count of column tiles.
    psum_solo: Instance,
    psum_share_solo: Instance,
    /// `FIXED`'s, in its order.
    fixed: Vec<Instance>,
    masked: Instance,
}

impl Fp8 {
    /// Random E4M3 codes (never NaN) in `q`, for `epserve bench`'s weights: timing, not
    /// numerics.
    pub fn fill_random(
        &self,
        q: &mut CudaSlice<u8>,
        seed: u64,
        stream: &CudaStream,
    ) -> Result<(), DriverError> {
        let n = q.len() as u64;
        let mut b = stream.launch_builder(&self.k.fp8_fill_random);
        b.arg(q).arg(&n).arg(&seed);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(4 * 256).clamp(1, 65535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel writes q[0..n) only (a grid-stride loop).
        unsafe { b.launch(cfg) }.map(drop)
    }

    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, DriverError> {
        let q = ctx.load_module(Ptx::from_binary(QUANTIZE.to_vec()))?;
        let m = ctx.load_module(Ptx::from_binary(GEMM.to_vec()))?;
        // The contiguous layout aligns each expert's block to the bf16 psum tile.
        let general = [
            &tiles::PSUM,
            &tiles::PSUM_SHARE,
            &tiles::PSUM_SOLO,
            &tiles::PSUM_SHARE_SOLO,
        ];
        for t in FIXED.iter().chain(general) {
            assert_eq!(t.block_m as usize, ALIGN, "FP8 psum tile");
        }
        let load = |t: &Tile| Instance::load(&m, *t, fp8_smem(t));
        Ok(Self {
            k: super::Fp8Kernels::load(&q)?,
            psum: load(&tiles::PSUM)?,
            psum_share: load(&tiles::PSUM_SHARE)?,
            psum_solo: load(&tiles::PSUM_SOLO)?,
            psum_share_solo: load(&tiles::PSUM_SHARE_SOLO)?,
            fixed: FIXED.iter().map(load).collect::<Result<_, _>>()?,
            masked: load(&tiles::MASKED)?,
        })
    }

    /// Which psum instance runs `groups` experts of `n x k` weights on every SM: a fixed-shape
    /// one's name where one takes them, else "PSUM", or "PSUM_SOLO" where CTA pairs do not
    /// take N.
    pub fn psum_tile(groups: usize, n: usize, k: usize) -> &'static str {
        match Psum::of(groups, n, k) {
            Psum::Fixed(i) => FIXED[i as usize].name,
            Psum::Pairs => tiles::PSUM.name,
            Psum::Solo => tiles::PSUM_SOLO.name,
        }
    }

    /// The psum instance that takes `w` on `sms`: the one of fewer CTAs beside an exchange,
    /// else the one `w` was given when it was made.
    fn psum_instance(&self, w: &Fp8Weights, sms: Sms) -> &Instance {
        match (sms, w.psum) {
            (Sms::BesideExchange, Psum::Solo) => &self.psum_share_solo,
            (Sms::BesideExchange, _) => &self.psum_share,
            (Sms::All, Psum::Fixed(i)) => &self.fixed[i as usize],
            (Sms::All, Psum::Pairs) => &self.psum,
            (Sms::All, Psum::Solo) => &self.psum_solo,
        }
    }

    /// Whether the FP8 GEMM takes this shape and layout.
    pub fn fits(layout: Layout, groups: usize, n: usize, k: usize) -> bool {
        let layout_ok = match layout {
            Layout::Psum => true,
            Layout::Masked { stride, .. } => {
                stride > 0 && stride % tiles::MASKED.block_m as usize == 0
            }
        };
        layout_ok && groups <= MAX_GROUPS && k % BLOCK == 0 && k <= MAX_K && n % BLOCK == 0
    }

    /// One block a row (its warps take the row's groups in turn).
    fn quant_cfg(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (32 * QUANT_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `out` = `x [rows, out.k]` (bf16) quantized, the `live` rows of the first `rows`.
    pub fn quantize(
        &self,
        x: &CudaSlice<bf16>,
        rows: usize,
        live: Live,
        out: &mut Fp8Rows,
        stream: &CudaStream,
    ) -> Result<(), DriverError> {
        assert!(
            x.len() >= rows * out.k && rows <= out.cap && out.k % BLOCK == 0,
            "FP8 quantization of {rows} rows ({} values) into [{}, {}]",
            x.len(),
            out.cap,
            out.k
        );
        let (k, ld) = (out.k as i32, out.ld() as i32);
        let live = live_rows(live, rows, stream);
        let mut b = stream.launch_builder(&self.k.fp8_quantize_rows);
        b.arg(x)
            .arg(&live)
            .arg(&k)
            .arg(&ld)
            .arg(&mut out.q)
            .arg(&mut out.sf);
        // SAFETY: x holds `rows` rows of k, q cap >= rows rows of k bytes, sf k / 128 rows of
        // ld (or, masked, rows / stride blocks of k / 128 rows of stride, no more); `live`
        // points into the slices `live_rows` checked, which the caller holds on this stream.
        unsafe { b.launch(Self::quant_cfg(rows)) }.map(drop)
    }

    /// `q [rows, k]` and `sf [rows, k / 128]` (token-major, as NCCL EP forwards a row's scales
    /// beside its codes) = `x [rows, k]` (bf16) quantized, the `live` rows of the first `rows`.
    pub fn quantize_tokens(
        &self,
        x: &CudaSlice<bf16>,
        (rows, k): (usize, usize),
        live: Live,
        (q, sf): (&mut CudaSlice<u8>, &mut CudaSlice<f32>),
        stream: &CudaStream,
    ) -> Result<(), DriverError> {
        assert!(
            k % BLOCK == 0
                && x.len() >= rows * k
                && q.len() >= rows * k
                && sf.len() >= rows * (k / BLOCK),
            "FP8 token quantization of {rows} rows of {k} ({} values) into {} codes, {} scales",
            x.len(),
            q.len(),
            sf.len()
        );
        let k32 = k as i32;
        let live = live_rows(live, rows, stream);
        let mut b = stream.launch_builder(&self.k.fp8_quantize_tokens);
        b.arg(x).arg(&live).arg(&k32).arg(q).arg(sf);
        // SAFETY: x holds `rows` rows of k, q as many rows of k bytes, sf rows x k / 128 floats
        // (asserted); `live` as in `quantize`.
        unsafe { b.launch(Self::quant_cfg(rows)) }.map(drop)
    }

    /// `out.sf` = the token-major scales `sf` of the first `rows` rows, laid out MN-major as the
    /// FP8 GEMM reads them in `layout` (psum: `[k / 128][out.ld()]`; masked: each expert's
    /// `[k / 128][stride]` in turn).
    pub fn scales_mn(
        &self,
        sf: &CudaSlice<f32>,
        rows: usize,
        layout: Layout,
        out: &mut Fp8Rows,
        stream: &CudaStream,
    ) -> Result<(), DriverError> {
        let g = out.k / BLOCK;
        let (blocks, rows, ld) = match layout {
            Layout::Psum => (1, rows, out.ld()),
            Layout::Masked { stride, .. } => {
                assert!(
                    stride > 0 && rows % stride == 0,
                    "masked scales of {rows} rows in strides of {stride}"
                );
                (rows / stride, stride, stride)
            }
        };
        assert!(
            blocks > 0
                && blocks * rows <= out.cap
                && sf.len() >= blocks * rows * g
                && out.sf.len() >= blocks * g * ld,
            "FP8 scales of {blocks} x {rows} rows into [{}, {}]",
            out.cap,
            out.k
        );
        let (rows32, g32, ld32) = (rows as i32, g as i32, ld as i32);
        let mut b = stream.launch_builder(&self.k.fp8_scales_mn);
        b.arg(sf).arg(&rows32).arg(&g32).arg(&ld32).arg(&mut out.sf);
        let cfg = LaunchConfig {
            grid_dim: (
                rows.div_ceil(32).max(1) as u32,
                g.div_ceil(32) as u32,
                blocks as u32,
            ),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads sf[blocks][rows][g] and writes out.sf[blocks][g][ld], both
        // within their slices (asserted).
        unsafe { b.launch(cfg) }.map(drop)
    }

    /// `out` = SwiGLU of `gu [rows, 2 * out.k]` (gate, then up; times `weights[r]` where
    /// given), quantized, the `live` rows of the first `rows`.
    pub fn swiglu_quantize(
        &self,
        gu: &CudaSlice<bf16>,
        rows: usize,
        live: Live,
        weights: Option<&CudaSlice<f32>>,
        out: &mut Fp8Rows,
        stream: &CudaStream,
    ) -> Result<(), DriverError> {
        assert!(
            gu.len() >= rows * 2 * out.k
                && rows <= out.cap
                && out.k % BLOCK == 0
                && weights.is_none_or(|w| w.len() >= rows),
            "FP8 SwiGLU of {rows} rows ({} values) into [{}, {}]",
            gu.len(),
            out.cap,
            out.k
        );
        let (i, ld) = (out.k as i32, out.ld() as i32);
        let none = 0u64;
        let live = live_rows(live, rows, stream);
        let mut b = stream.launch_builder(&self.k.fp8_swiglu_quantize);
        b.arg(gu).arg(&live).arg(&i);
        match weights {
            Some(w) => b.arg(w),
            None => b.arg(&none),
        };
        b.arg(&ld).arg(&mut out.q).arg(&mut out.sf);
        // SAFETY: gu holds `rows` rows of 2k, q cap >= rows rows of k bytes, sf as in
        // `quantize`, weights (or a null pointer) `rows` floats, `live` as in `quantize`.
        unsafe { b.launch(Self::quant_cfg(rows)) }.map(drop)
    }

    /// `y[rows of e] = dequant(x[rows of e]) . dequant(w_e)^T` for every expert e over the
    /// first `rows` rows, `y [rows, w.n]` bf16; `sizes` (`MAX_GROUPS` ints) are `ends` (psum)
    /// or `counts` (masked); `sms`: the SMs a psum launch takes. Rows of an expert's last tile
    /// past its count are written too, never another expert's rows.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        x: &Fp8Rows,
        rows: usize,
        w: &Fp8Weights,
        (layout, sms): (Layout, Sms),
        sizes: &CudaSlice<i32>,
        y: &mut CudaSlice<bf16>,
        stream: &CudaStream,
    ) -> Result<(), DriverError> {
        let (n, k, groups) = (w.n, w.k, w.groups);
        assert!(
            Self::fits(layout, groups, n, k) && x.k == k && rows <= x.cap,
            "the FP8 GEMM does not take n {n} k {k} (rows of {}) over {groups} groups in {layout:?}",
            x.k
        );
        assert!(
            y.len() >= rows * n
                && w.q.len() >= groups * n * k
                && w.sf.len() >= groups * (n / BLOCK) * (k / BLOCK)
                && sizes.len() >= MAX_GROUPS,
            "FP8 GEMM operands smaller than their shapes"
        );
        let (inst, shape_m, sf_dims) = match layout {
            Layout::Psum => (self.psum_instance(w, sms), 0, [x.ld(), k / BLOCK]),
            Layout::Masked { stride, .. } => {
                assert!(stride * groups <= rows, "masked rows past the buffer");
                (&self.masked, stride as u32, [stride, groups * (k / BLOCK)])
            }
        };
        let no_swizzle = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE;
        let swizzle = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
        let box_k = BLOCK as u32;
        let a = tensor_map_2d(
            x.q.device_ptr(stream).0,
            Elem::Fp8,
            [k, rows],
            [box_k, inst.block_m],
            swizzle,
        )?;
        let b = tensor_map_2d(
            w.q.device_ptr(stream).0,
            Elem::Fp8,
            [k, groups * n],
            [box_k, inst.block_n],
            swizzle,
        )?;
        let d = tensor_map(y.device_ptr_mut(stream).0, n, rows, inst.block_m)?;
        let sfa = tensor_map_2d(
            x.sf.device_ptr(stream).0,
            Elem::F32,
            sf_dims,
            [inst.block_m, 1],
            no_swizzle,
        )?;
        let (mut n32, mut k32, mut shape_m) = (n as u32, k as u32, shape_m);
        let (mut sfb, mut sizes) = (w.sf.device_ptr(stream).0, sizes.device_ptr(stream).0);
        let (mut a, mut b, mut d, mut sfa) = (a, b, d, sfa);
        let mut params = [
            (&raw mut sfb).cast(),
            (&raw mut sizes).cast(),
            (&raw mut shape_m).cast(),
            (&raw mut n32).cast(),
            (&raw mut k32).cast(),
            (&raw mut a).cast(),
            (&raw mut b).cast(),
            (&raw mut d).cast(),
            (&raw mut sfa).cast(),
        ];
        // SAFETY: the parameters are the kernel's (float* sfb, int* grouped_layout, uint32 m, n,
        // k, then the A, B, D and SFA tensor maps by value), in order; the tensor maps span x
        // (rows x k bytes, its scales), w (groups x n x k bytes) and y (rows x n), each checked
        // above; w.sf holds groups x n/128 x k/128 floats and `sizes` MAX_GROUPS ints, as the
        // instances read.
        unsafe { inst.launch_clusters(stream, &mut params) }
    }
}

/// The kernels' `Live` of `live` over `cap` rows, its arrays checked against what the kernel
/// reads.
fn live_rows(live: Live, cap: usize, stream: &CudaStream) -> LiveRows {
    let ptr = |s: &CudaSlice<i32>| s.device_ptr(stream).0;
    let mut l = LiveRows {
        n_rows: 0,
        ends: 0,
        counts: 0,
        groups: 0,
        align: ALIGN as i32,
        stride: 1,
    };
    match live {
        Live::Upto(n) => {
            assert!(!n.is_empty(), "a live-row count");
            l.n_rows = ptr(n);
        }
        Live::Psum { ends, groups } => {
            assert!(
                groups > 0 && groups <= MAX_GROUPS && ends.len() >= groups,
                "psum rows: {groups} experts, {} ends",
                ends.len()
            );
            l.ends = ptr(ends);
            l.groups = groups as i32;
        }
        Live::Masked { counts, stride } => {
            assert!(
                stride > 0 && cap % stride == 0 && counts.len() >= cap / stride,
                "masked rows: {cap} in strides of {stride}, {} counts",
                counts.len()
            );
            l.counts = ptr(counts);
            l.stride = stride as i32;
        }
    }
    l
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CTA pairs take N only in an even count of 192-column tiles; the fixed-shape instances
    /// keep DeepSeek-V3's shapes (22 and 38 tiles).
    #[test]
    fn an_odd_count_of_column_tiles_runs_without_clusters() {
        assert_eq!(Psum::of(64, 2 * 768, 2048), Psum::Pairs); // Qwen3's gate/up: 8 tiles
        assert_eq!(Psum::of(64, 2048, 768), Psum::Solo); // its down: 11
        assert_eq!(Psum::of(128, 3 * 192, 1024), Psum::Solo);
        assert_eq!(Psum::of(128, 4 * 192, 1024), Psum::Pairs);
        assert_eq!(Psum::of(64, 4096, 7168), Psum::Fixed(0));
        assert_eq!(Psum::of(64, 7168, 2048), Psum::Fixed(1));
        assert_eq!(Psum::of(129, 4096, 7168), Psum::Pairs);
        assert_eq!(Fp8::psum_tile(64, 2048, 768), "PSUM_SOLO");
    }
}
