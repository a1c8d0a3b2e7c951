//! Decode's expert GEMM (`kernels/decode_gemm.cuh`): experts of a few rows each in the masked
//! layout, where the GEMM is a read of the weights. The weights are the MMA's A operand and the
//! rows its narrow B tiles, so no weight tile streams with 16 to 48 padding rows (DeepGEMM's
//! masked tiles are 32 or 64 rows); the gate/up form writes SwiGLU's output directly. Counts stay
//! on the device, so a captured step graph serves any routing. Measured against DeepGEMM:
//! docs/benchmarks.md, "A decode GEMM of our own". Its FP8 form (E4M3 rows and weights with
//! their block scales, `fp8`) streams half the bytes through the same pipeline.

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg,
};
use half::bf16;

use crate::backend::cuda::kernels::fp8::{Fp8Rows, Fp8Weights};
use crate::backend::cuda::kernels::hopper::{
    tensor_map, tensor_map_2d, Elem, Gemm, Layout, MAX_GROUPS,
};
use crate::backend::cuda::Alloc;
use crate::model::fp8::BLOCK;

/// Rows of an expert one pass over its weights takes (the kernel's `kChunk`). An expert of more
/// reads its weights once more per 32 rows.
pub const CHUNK_ROWS: usize = 32;
/// The most rows per expert on average this kernel takes; DeepGEMM's 64-row masked tile takes
/// more. On one H200 at deepseek-v3's shapes (`scripts/probes/decode_gemm.cu`, both GEMMs) this
/// kernel leads at 16 and 24 rows on average (1,328 and 1,385 µs against DeepGEMM's 1,400 and
/// 1,406 plus SwiGLU) and trails at 32 (1,687 against 1,393): many experts then pass 32 rows
/// and read their weights twice, and its mma.sync math starts to show.
pub const MAX_MEAN_ROWS: usize = 24;
// The kernel's constants: weight rows per TMA box, stages, math warps plus the TMA warp, and its
// dynamic shared memory (the stages of two weight boxes and a chunk's box, their barriers, 1 KB
// of alignment slack).
const BOX_ROWS: usize = 128;
const BOX_K: usize = 64;
const STAGES: u32 = 5;
const THREADS: u32 = (8 + 1) * 32;
const SMEM: u32 = STAGES * ((2 * BOX_ROWS + CHUNK_ROWS) * BOX_K * 2) as u32 + STAGES * 16 + 1024;
/// Experts one launch takes (the kernel's `kMaxGroups`, its units' prefix in shared memory).
const KERNEL_GROUPS: usize = 1024;
// One SM holds it: 227 KB on sm_90, with the units' prefix as static shared memory.
const _: () = assert!(SMEM as usize + (KERNEL_GROUPS + 1) * 4 <= 227 * 1024);

/// Where each expert's rows are, for the FP8 form.
#[derive(Clone, Copy, Debug)]
pub enum Spans<'a> {
    /// Expert e's first `counts[e]` rows of `[e * stride, (e + 1) * stride)` (the masked layout).
    Strided {
        stride: usize,
        counts: &'a CudaSlice<i32>,
    },
    /// Expert e's rows `[offsets[e], ends[e])` (contiguous blocks, DeepGEMM's psum layout).
    Blocks {
        offsets: &'a CudaSlice<i32>,
        ends: &'a CudaSlice<i32>,
    },
}

/// What the kernel writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    /// `y [rows, n]`.
    Plain,
    /// `n` is gate then up (`2 * inter`): `y [rows, inter] = silu(gate) * up`, each rounded to
    /// bf16 first as the unfused SwiGLU reads them.
    SwiGlu,
}

pub struct DecodeGemm {
    plain: CudaFunction,
    gated: CudaFunction,
    fp8: CudaFunction,
    /// One persistent CTA per SM.
    sms: u32,
    /// The stream every launch goes on: launches share `ticket`, so they must not overlap.
    stream: Arc<CudaStream>,
    /// Two ints the kernel hands its units out from; zero between launches (the kernel's last
    /// CTA resets them).
    ticket: CudaSlice<i32>,
}

impl DecodeGemm {
    pub fn load(
        ctx: &Arc<CudaContext>,
        module: &Arc<CudaModule>,
        a: &mut Alloc,
    ) -> Result<Self, DriverError> {
        let load = |name| -> Result<CudaFunction, DriverError> {
            let f = module.load_function(name)?;
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                SMEM as i32,
            )?;
            Ok(f)
        };
        let sms =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(Self {
            plain: load("decode_gemm_plain")?,
            gated: load("decode_gemm_gated")?,
            fp8: load("decode_gemm_fp8")?,
            sms: sms.max(1) as u32,
            stream: a.stream().clone(),
            ticket: a.zeros(2)?,
        })
    }

    /// Whether this kernel can run the GEMM (either form), at any rows per expert: the masked
    /// layout, N in 256-row units (gated: the intermediate in 128-row units), K in 64-deep
    /// stages.
    pub fn fits(layout: Layout, groups: usize, n: usize, k: usize) -> bool {
        matches!(layout, Layout::Masked { stride, .. } if stride > 0)
            && groups <= MAX_GROUPS.min(KERNEL_GROUPS)
            && n > 0
            && n % (2 * BOX_ROWS) == 0
            && k > 0
            && k % BOX_K == 0
    }

    /// Whether it is the kernel for the GEMM: it fits, with at most `MAX_MEAN_ROWS` rows per
    /// expert on average.
    pub fn takes(layout: Layout, groups: usize, n: usize, k: usize) -> bool {
        let few = matches!(layout, Layout::Masked { mean_rows, .. } if mean_rows <= MAX_MEAN_ROWS);
        few && Self::fits(layout, groups, n, k)
    }

    /// Whether the FP8 form takes the GEMM: experts of at most `MAX_MEAN_ROWS` rows on average,
    /// N in 256-row units, K in 128-deep scale blocks, the `stride` of strided spans in whole
    /// 32-row chunks (the row scales of a chunk stay in its expert's block; None: blocks).
    pub fn takes_fp8(
        mean_rows: usize,
        stride: Option<usize>,
        groups: usize,
        n: usize,
        k: usize,
    ) -> bool {
        stride.is_none_or(|s| s > 0 && s % CHUNK_ROWS == 0)
            && mean_rows <= MAX_MEAN_ROWS
            && groups <= MAX_GROUPS.min(KERNEL_GROUPS)
            && n > 0
            && n % (2 * BOX_ROWS) == 0
            && k > 0
            && k % BLOCK == 0
    }

    /// The FP8 form of `Out::Plain`: `y [rows, w.n]` = expert e's rows of `x` (`spans`; `x`
    /// quantized in the matching layout, `fp8::Live`) times its weights; no other row is
    /// written.
    pub fn gemm_fp8(
        &self,
        x: &Fp8Rows,
        rows: usize,
        w: &Fp8Weights,
        spans: Spans,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        let stream = &self.stream;
        let (groups, n, k) = (w.groups, w.n, w.k);
        let strided = match spans {
            Spans::Strided { stride, .. } => Some(stride),
            Spans::Blocks { .. } => None,
        };
        assert!(
            Self::takes_fp8(0, strided, groups, n, k) && x.k == k,
            "the FP8 decode GEMM does not take n {n} k {k} (rows of {}) over {groups} groups in \
             {spans:?}",
            x.k
        );
        let (sizes, offsets, stride) = match spans {
            Spans::Strided { stride, counts } => {
                assert!(stride * groups <= rows, "strided rows past the buffer");
                (counts, None, stride)
            }
            Spans::Blocks { offsets, ends } => {
                assert!(offsets.len() >= groups, "an offset per expert");
                (ends, Some(offsets), 0)
            }
        };
        assert!(
            rows <= x.cap
                && y.len() >= rows * n
                && w.q.len() >= groups * n * k
                && w.sf.len() >= groups * (n / BLOCK) * (k / BLOCK)
                && x.sf.len() >= (k / BLOCK) * x.ld().max(groups * stride)
                && sizes.len() >= groups,
            "FP8 decode GEMM operands smaller than their shapes"
        );
        let swizzle = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
        let wm = tensor_map_2d(
            w.q.device_ptr(stream).0,
            Elem::Fp8,
            [k, groups * n],
            [BLOCK as u32, BOX_ROWS as u32],
            swizzle,
        )?;
        let xm = tensor_map_2d(
            x.q.device_ptr(stream).0,
            Elem::Fp8,
            [k, rows],
            [BLOCK as u32, CHUNK_ROWS as u32],
            swizzle,
        )?;
        let (g32, s32, ld, n32, k32) = (
            groups as i32,
            stride as i32,
            x.ld() as i32,
            n as i32,
            k as i32,
        );
        let null = 0u64;
        let mut l = stream.launch_builder(&self.fp8);
        l.arg(&wm).arg(&xm).arg(&w.sf).arg(&x.sf).arg(sizes);
        match offsets {
            Some(o) => l.arg(o),
            None => l.arg(&null),
        };
        l.arg(&g32)
            .arg(&s32)
            .arg(&ld)
            .arg(&n32)
            .arg(&k32)
            .arg(y)
            .arg(&self.ticket);
        // SAFETY: the tensor maps span w (groups x n x k bytes) and x (rows x k bytes); w.sf
        // holds groups x n/128 x k/128 floats; x.sf is read at an expert's rows only (below its
        // count: strided, within its stride's block; blocks, below ends[e] <= rows <= cap); the
        // kernel writes y only at an expert's rows (asserted within y) and reads `groups` sizes
        // and offsets. `ticket` is zero now, as in `gemm`.
        unsafe { l.launch(self.config()) }.map(drop)
    }

    fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.sms, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: SMEM,
        }
    }

    /// Launches `g` writing `y` (`Out` says its shape) on the stream it was loaded with; rows of
    /// an expert past its count, and past the stride, are not written.
    pub fn gemm(&self, g: Gemm, out: Out, y: &mut CudaSlice<bf16>) -> Result<(), DriverError> {
        let stream = &self.stream;
        assert!(
            Self::fits(g.layout, g.groups, g.n, g.k),
            "the decode GEMM does not fit n {} k {} over {} groups in {:?}",
            g.n,
            g.k,
            g.groups,
            g.layout
        );
        let Layout::Masked { stride, .. } = g.layout else {
            unreachable!("fits() admits the masked layout only")
        };
        let cols = match out {
            Out::Plain => g.n,
            Out::SwiGlu => g.n / 2,
        };
        assert!(
            stride * g.groups <= g.rows
                && g.x.len() >= g.rows * g.k
                && y.len() >= g.rows * cols
                && g.w.len() >= g.groups * g.n * g.k
                && g.sizes.len() >= g.groups,
            "decode GEMM operands smaller than their shapes"
        );
        let w = tensor_map(
            g.w.device_ptr(stream).0,
            g.k,
            g.groups * g.n,
            BOX_ROWS as u32,
        )?;
        let x = tensor_map(g.x.device_ptr(stream).0, g.k, g.rows, CHUNK_ROWS as u32)?;
        let (groups, s, n, k) = (g.groups as i32, stride as i32, g.n as i32, g.k as i32);
        let f = match out {
            Out::Plain => &self.plain,
            Out::SwiGlu => &self.gated,
        };
        let mut l = stream.launch_builder(f);
        l.arg(&w)
            .arg(&x)
            .arg(g.sizes)
            .arg(&groups)
            .arg(&s)
            .arg(&n)
            .arg(&k)
            .arg(y)
            .arg(&self.ticket);
        let cfg = self.config();
        // SAFETY: the tensor maps span w (groups x n x k) and x (rows x k), whose loads past the
        // end read zeros; the kernel writes y only at rows e * stride + r for r < min(counts[e],
        // stride), within `groups * stride <= rows` rows of `cols` (asserted), and reads
        // `groups` counts. `ticket` is two ints, zero now: every launch goes on `self.stream`,
        // so the last one has run to its end, where it zeroed them.
        unsafe { l.launch(cfg) }.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_few_rows_per_expert_on_whole_boxes() {
        let masked = |mean_rows| Layout::Masked {
            stride: 512,
            mean_rows,
        };
        // deepseek-v3's decode: gate/up 4096 x 7168, down 7168 x 2048, 64 local experts.
        assert!(DecodeGemm::takes(masked(16), 64, 4096, 7168));
        assert!(DecodeGemm::takes(masked(24), 64, 7168, 2048));
        assert!(
            !DecodeGemm::takes(masked(25), 64, 7168, 2048),
            "past 24 rows per expert on average, DeepGEMM's 64-row tile"
        );
        assert!(!DecodeGemm::takes(masked(32), 64, 7168, 2048));
        assert!(
            DecodeGemm::fits(masked(32), 64, 7168, 2048),
            "it can still run them"
        );
        assert!(!DecodeGemm::takes(Layout::Psum, 64, 7168, 2048));
        assert!(
            !DecodeGemm::takes(masked(16), 8, 384, 256),
            "N off the 256-row unit"
        );
        assert!(
            !DecodeGemm::takes(masked(16), 8, 256, 96),
            "K off the stage"
        );
        assert!(!DecodeGemm::takes(masked(16), MAX_GROUPS + 1, 256, 256));
        let no_stride = Layout::Masked {
            stride: 0,
            mean_rows: 0,
        };
        assert!(!DecodeGemm::takes(no_stride, 8, 256, 256));
    }

    #[test]
    fn the_fp8_form_takes_whole_scale_blocks_and_chunks() {
        let takes = DecodeGemm::takes_fp8;
        // deepseek-v3's decode, strided (NCCL EP) and in blocks (NCCL).
        for stride in [Some(128), None] {
            assert!(takes(16, stride, 64, 4096, 7168));
            assert!(takes(24, stride, 64, 7168, 2048));
            assert!(
                !takes(25, stride, 64, 7168, 2048),
                "DeepGEMM's past 24 rows"
            );
            assert!(
                !takes(16, stride, 64, 4096, 7168 - 64),
                "K off the scale block"
            );
            assert!(
                !takes(16, stride, 64, 4096 - 128, 7168),
                "N off the 256-row unit"
            );
            assert!(!takes(16, stride, MAX_GROUPS + 1, 256, 256));
        }
        assert!(
            !takes(16, Some(48), 8, 256, 256),
            "a stride off the 32-row chunk"
        );
        assert!(!takes(16, Some(0), 8, 256, 256));
    }
}
