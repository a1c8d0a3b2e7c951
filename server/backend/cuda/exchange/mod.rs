//! The expert-parallel exchange the GPU step runs over: how a step's routed rows leave home, where
//! the experts find them, and how their outputs come back. The step (`step.rs`) is the same
//! straight line for every exchange; each exchange is a file of its own: the fixed-slot NCCL
//! exchange (`slots`, backend `nccl`) and NVIDIA NCCL EP (`ep/`, backend `nccl-ep`).
//!
//! The step's methods (`count` to `combine`) only enqueue work on the rank's stream (no host
//! sync), so a whole step can be captured as a graph; every rank calls them in the same order
//! (they communicate).

pub mod ep;
pub mod slots;

use cudarc::driver::CudaSlice;
use half::bf16;

use crate::backend::cuda::kernels::fp8::Fp8Rows;
use crate::backend::cuda::sys::nccl::Comm;
use crate::backend::cuda::{Gpu, GpuError};
use crate::step::EpFootprint;

/// What the exchange reads of the home side, in a step of `bucket` home rows.
pub struct Home<'a> {
    /// The home tokens in bf16, `[bucket, hidden]`.
    pub x: &'a CudaSlice<bf16>,
    /// Their top-k experts and weights, `[bucket, k]` (rows past the step's tokens route
    /// nowhere: -1 and 0).
    pub ids: &'a CudaSlice<i32>,
    pub w: &'a CudaSlice<f32>,
    /// The step's home token count (one int).
    pub n: &'a CudaSlice<i32>,
    /// Every rank's per-expert counts, `[world][experts]`: valid once the step has all-gathered
    /// what `count` wrote.
    pub gathered: &'a CudaSlice<i32>,
}

/// The received rows as the expert FFN reads them; it writes each row's output in place.
pub enum ExpertRows<'a> {
    /// Contiguous blocks: expert e's rows are `[offsets[e], ends[e])`, every block starting on a
    /// multiple of `hopper::ALIGN` (the Hopper GEMM's psum layout; `ends` holds
    /// `hopper::MAX_GROUPS` ints); `total` (one int) is the padded total of at most `cap` rows.
    /// `weights`: each row's routing weight, to scale its output by (None: combine weighs).
    /// `fp8`: the rows as the FP8 GEMM's operand, quantized before they moved (the slot
    /// exchange's FP8 rows, or NCCL EP's forwarded ones); `x` then holds no input and takes the
    /// outputs.
    Blocks {
        x: &'a mut CudaSlice<bf16>,
        cap: usize,
        offsets: &'a CudaSlice<i32>,
        ends: &'a CudaSlice<i32>,
        total: &'a CudaSlice<i32>,
        weights: Option<&'a CudaSlice<f32>>,
        fp8: Option<&'a Fp8Rows>,
    },
    /// Fixed strides: expert e's `counts[e]` rows start at `e * stride` (the Hopper GEMM's masked
    /// layout; `hopper::MAX_GROUPS` ints); `bounds` are the same blocks as starts then ends (the
    /// WMMA kernels' form), `valid` the most rows they can hold in all. Combine weighs. `fp8`: as
    /// in `Blocks` (NCCL EP's forwarded FP8 rows, the scales in the masked layout).
    Strided {
        x: &'a mut CudaSlice<bf16>,
        stride: usize,
        counts: &'a CudaSlice<i32>,
        bounds: &'a CudaSlice<i32>,
        valid: usize,
        fp8: Option<&'a Fp8Rows>,
    },
}

pub trait Exchange: Send {
    /// Each expert's count of the home rows into `counts` (`experts` ints; the step all-gathers
    /// them next), with whatever the exchange lays out from the routing alone.
    fn count(
        &mut self,
        g: &Gpu,
        home: &Home,
        bucket: usize,
        counts: &mut CudaSlice<i32>,
    ) -> Result<(), GpuError>;

    /// After the all-gather: what every rank must know before rows move (NCCL EP's handle).
    fn prepare(&mut self, g: &Gpu, home: &Home, bucket: usize) -> Result<(), GpuError>;

    /// The home rows to the ranks that hold their experts.
    fn dispatch(
        &mut self,
        g: &Gpu,
        comm: &Comm,
        home: &Home,
        bucket: usize,
    ) -> Result<(), GpuError>;

    /// Where the received rows are, in the layout the expert GEMM reads.
    fn expert_rows(&mut self, g: &Gpu, bucket: usize) -> Result<ExpertRows<'_>, GpuError>;

    /// The expert outputs back home: each home row's weighted sum, plus its `shared` expert row
    /// when there is one, into `out` (f32, `bucket` rows).
    fn combine(
        &mut self,
        g: &Gpu,
        comm: &Comm,
        home: &Home,
        bucket: usize,
        shared: Option<&CudaSlice<bf16>>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError>;

    /// For an exchange whose receive side can differ from what the routing sent (NCCL EP): the
    /// device ints the rank copies home after every step, per-local-expert receive counts and
    /// the received total, for `verify`.
    fn receipts(&self) -> Option<(&CudaSlice<i32>, &CudaSlice<i32>)> {
        None
    }

    /// The host copies of `receipts` against `routed`, the rows the routing sent each local
    /// expert (from the all-gathered counts). Err: the step's output cannot be trusted.
    fn verify(
        &self,
        _bucket: usize,
        _routed: &[i64],
        _counts: &[i32],
        _total: i32,
    ) -> Result<(), String> {
        Ok(())
    }

    /// Its communicator lost a member: whatever cannot be torn down without that member is
    /// left allocated when the exchange goes (NCCL EP's LL groups). Returns the bytes left.
    fn abandon(&mut self) -> u64 {
        0
    }

    /// NCCL EP's groups and handles on the device (GetModelInfo); None for other exchanges.
    fn footprint(&self) -> Option<EpFootprint> {
        None
    }
}
