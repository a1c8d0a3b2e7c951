//! The router on the device: logits from SGEMM over f32 rows or from tensor cores over bf16 rows
//! (exact bf16 pieces of the f32 weights), then the top-k kernels over them.

use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, DriverError, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::backend::cuda::{Alloc, Gpu, GpuError};

/// Pieces of the f32 router the bf16 router multiplies (`bf16_pieces`).
pub const ROUTER_PIECES: usize = 3;

/// The most experts the top-k kernels' register form takes (`kRegs` x 32 in kernels/routing.cuh):
/// a warp's row in registers, its argmax two warp reductions. Past it, the shared-memory form.
pub const TOPK_REGS_EXPERTS: usize = 256;

/// Whether DeepSeek-V3 routing over `e` experts in `n_group` groups runs in the register form:
/// one group, or groups of 32 (one register of the warp each).
pub fn sigmoid_group_in_regs(e: usize, n_group: usize) -> bool {
    e <= TOPK_REGS_EXPERTS && (n_group == 1 || e == 32 * n_group)
}

/// Router logits on the device: each of a bucket's rows is `parts` slices of `e` floats whose
/// sum is the logit. SGEMM writes one slice; the bf16 router one per piece of the weights, which
/// the top-k kernels sum.
pub struct Logits {
    buf: CudaSlice<f32>,
    parts: usize,
}

impl Logits {
    /// Room for `rows` rows from either router.
    pub fn new(a: &mut Alloc, rows: usize, e: usize) -> Result<Self, DriverError> {
        Ok(Self {
            buf: a.zeros(rows * e * ROUTER_PIECES)?,
            parts: 1,
        })
    }

    /// Rows already in `buf`, `parts` slices each.
    pub fn from_slices(buf: CudaSlice<f32>, parts: usize) -> Self {
        Self { buf, parts }
    }

    pub fn buf(&self) -> &CudaSlice<f32> {
        &self.buf
    }

    fn check(&self, n_cap: usize, e: usize) {
        assert!(
            (1..=ROUTER_PIECES).contains(&self.parts) && self.buf.len() >= n_cap * e * self.parts,
            "logits smaller than their shape"
        );
    }
}

impl Gpu {
    /// `logits [n_cap, e] = x [n_cap, h] . router [e, h]^T` in f32 (cuBLAS SGEMM: IEEE f32 on
    /// the FMA units, not TF32: routing near-ties must resolve as the f32 reference does).
    /// Every row of the bucket is computed; the step ignores rows past its token count.
    pub fn router_logits(
        &self,
        x: &CudaSlice<f32>,
        router: &CudaSlice<f32>,
        n_cap: usize,
        e: usize,
        h: usize,
        logits: &mut Logits,
    ) -> Result<(), GpuError> {
        assert!(
            x.len() >= n_cap * h && router.len() >= e * h && logits.buf.len() >= n_cap * e,
            "router_logits operands smaller than their shapes"
        );
        // Row-major logits [n_cap, e] is column-major [e, n_cap] = router^T' . x^T'.
        let cfg = GemmConfig {
            transa: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
            transb: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            m: e as i32,
            n: n_cap as i32,
            k: h as i32,
            alpha: 1.0f32,
            lda: h as i32,
            ldb: h as i32,
            beta: 0.0f32,
            ldc: e as i32,
        };
        logits.parts = 1;
        // SAFETY: the three operands span the shapes in `cfg` (asserted above).
        unsafe { self.blas.gemm(cfg, router, x, &mut logits.buf) }?;
        Ok(())
    }

    /// The same logits for rows that are exactly bf16 (`xb`, a bf16 client's rows), on tensor
    /// cores: `xb` times each bf16 piece of the router (`pieces [3][e][h]`, `bf16_pieces`). Each
    /// product of two bf16 values is exact in f32 and the pieces sum to the f32 weight, so this
    /// sums the same f32 products as `router_logits`, in f32 but in another order and with the
    /// tensor cores' rounding: at DeepSeek-V3's hidden size 7168 the worst logit was 1.6e-5 from
    /// f64 where SGEMM's was 2.9e-6 (`gpu_kernels`), against ~1e-3 for bf16 or TF32 weights. It
    /// takes a quarter of SGEMM's time at prefill and two thirds at decode (docs/benchmarks.md).
    pub fn router_logits_bf16(
        &self,
        xb: &CudaSlice<bf16>,
        pieces: &CudaSlice<bf16>,
        n_cap: usize,
        e: usize,
        h: usize,
        logits: &mut Logits,
    ) -> Result<(), GpuError> {
        let m = ROUTER_PIECES * e;
        assert!(
            xb.len() >= n_cap * h && pieces.len() >= m * h && logits.buf.len() >= n_cap * m,
            "router_logits_bf16 operands smaller than their shapes"
        );
        logits.parts = ROUTER_PIECES;
        // Row-major [n_cap, 3e]: one slice of e per piece.
        self.gemm_bf16(pieces, xb, (n_cap, m, h), &mut logits.buf)
    }

    /// `out [3][n] = bf16_pieces(w [n])`: the router's weights as the bf16 router reads them.
    pub fn bf16_pieces(
        &self,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), DriverError> {
        assert!(
            out.len() >= ROUTER_PIECES * w.len(),
            "bf16_pieces output too small"
        );
        let n = w.len();
        let mut b = self.stream.launch_builder(&self.k.bf16_pieces);
        b.arg(w).arg(&n).arg(out);
        // SAFETY: `w` holds n floats and `out` 3n bf16 (asserted); grid-stride loop.
        unsafe { b.launch(Self::cfg((n.div_ceil(256).min(4096) as u32, 1), 256, 0)) }.map(drop)
    }

    /// The top-k kernels' launch: one warp per row, four to a block, each warp with `floats`
    /// floats of shared memory (none in the register form).
    fn topk_cfg(n_cap: usize, floats: usize) -> LaunchConfig {
        const WARPS: usize = 4;
        let grid = n_cap.div_ceil(WARPS) as u32;
        Self::cfg((grid, 1), 32 * WARPS as u32, (WARPS * floats * 4) as u32)
    }

    /// Softmax top-k for `n_cap` rows of `logits [n_cap, e]`; rows >= *n get ids -1. Up to
    /// `TOPK_REGS_EXPERTS` experts in the register form, with the same results.
    #[allow(clippy::too_many_arguments)]
    pub fn topk_softmax(
        &self,
        logits: &Logits,
        n: &CudaSlice<i32>,
        n_cap: usize,
        e: usize,
        k: usize,
        renorm: bool,
        ids: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), DriverError> {
        let (f, cfg) = match e <= TOPK_REGS_EXPERTS {
            true => (&self.k.topk_softmax_regs, Self::topk_cfg(n_cap, 0)),
            false => (&self.k.topk_softmax, Self::topk_cfg(n_cap, e)),
        };
        logits.check(n_cap, e);
        let (n_cap, e, k, renorm) = (n_cap as i32, e as i32, k as i32, i32::from(renorm));
        let parts = logits.parts as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(&logits.buf)
            .arg(n)
            .arg(&n_cap)
            .arg(&e)
            .arg(&parts)
            .arg(&k)
            .arg(&renorm)
            .arg(ids)
            .arg(weights);
        // SAFETY: argument types and order match the kernel's signature; every buffer holds
        // n_cap rows (callers size them so); shared memory is sized for the block's warps.
        unsafe { b.launch(cfg) }.map(drop)
    }

    /// DeepSeek-V3 group-limited top-k (see the kernel); in the register form where
    /// `sigmoid_group_in_regs`, with the same results.
    #[allow(clippy::too_many_arguments)]
    pub fn topk_sigmoid_group(
        &self,
        logits: &Logits,
        bias: &CudaSlice<f32>,
        n: &CudaSlice<i32>,
        n_cap: usize,
        e: usize,
        k: usize,
        groups: (usize, usize),
        renorm: bool,
        scaling: f32,
        ids: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), DriverError> {
        let (f, cfg) = match sigmoid_group_in_regs(e, groups.0) {
            true => (&self.k.topk_sigmoid_group_regs, Self::topk_cfg(n_cap, 0)),
            false => (
                &self.k.topk_sigmoid_group,
                Self::topk_cfg(n_cap, 2 * e + 32),
            ),
        };
        logits.check(n_cap, e);
        let (n_cap, e, k) = (n_cap as i32, e as i32, k as i32);
        let (ng, tg, renorm) = (groups.0 as i32, groups.1 as i32, i32::from(renorm));
        let parts = logits.parts as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(&logits.buf)
            .arg(bias)
            .arg(n)
            .arg(&n_cap)
            .arg(&e)
            .arg(&parts)
            .arg(&k)
            .arg(&ng)
            .arg(&tg)
            .arg(&renorm)
            .arg(&scaling);
        b.arg(ids).arg(weights);
        // SAFETY: as in `topk_softmax`; n_group <= 32 and k <= 32: `Device::open` refuses any other
        // model (backend::check_gpu_limits).
        unsafe { b.launch(cfg) }.map(drop)
    }
}
