//! The GPU floor (`--features cuda`), in rooms:
//! - `sys`: every raw driver and library call behind a safe type (NCCL, NCCL EP, cuBLAS,
//!   page-locked and registered host memory, CUDA IPC, graphs, device attributes);
//! - `kernels`: the kernel table (one declaration each) and the typed launchers by concern
//!   (routing, layout, the FFN pieces, conversions, FP8, DeepGEMM's Hopper GEMMs, decode's GEMM);
//! - `exchange`: the `Exchange` trait and its two implementations (`slots`, `ep`);
//! - `experts`: the experts' weights and the kernels chosen for them, bf16 and FP8;
//! - `placement`: expert slots on the device (the table gating reads, staged weights);
//! - the rank: `shape` (its sizes), `step` (its phases), `transfer` (rows to and from the GPU),
//!   `rank` (graphs and the steps in flight), `setup` (bring-up), `bench`.
//!
//! This file holds one context and compute stream per rank (`Gpu`), the one device allocator
//! (`Alloc`) and the GPU error type. Raw calls live in `sys` and the kernel launchers only.

pub mod bench;
pub mod exchange;
mod experts;
pub mod kernels;
pub mod placement;
pub mod rank;
pub mod setup;
pub mod shape;
pub mod step;
pub mod sys;
mod transfer;

pub use kernels::ffn::{max_tiles, Blocks, GEMM_TILE, GEMM_WIDE_N};
pub use kernels::router::{sigmoid_group_in_regs, Logits, ROUTER_PIECES, TOPK_REGS_EXPERTS};
pub use kernels::Kernels;

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::metric_names;

/// `kernels/epserve.cu` (its parts: routing, layout, ffn, convert), compiled for sm_90a (plus
/// compute_90a PTX).
pub static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/epserve_kernels.fatbin"));

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
    Nccl(#[from] sys::nccl::NcclError),
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("{0}")]
    Config(String),
    /// The step's completion event did not fire within this bound.
    #[error("the GPU step did not finish within {0:?} (a peer is gone or stuck)")]
    Timeout(std::time::Duration),
    /// The wait ended because the group halts (or broke): a peer is gone.
    #[error("the wait for the GPU step ended: {0}")]
    Halted(String),
}

impl From<String> for GpuError {
    fn from(why: String) -> Self {
        GpuError::Config(why)
    }
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
        metrics::counter!(metric_names::DEVICE_ALLOCATIONS_TOTAL).increment(1);
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

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub k: Kernels,
    /// The Hopper grouped GEMM (DeepGEMM's kernels).
    pub hopper: kernels::hopper::Hopper,
    /// FP8 experts: activation quantization and DeepGEMM's FP8 grouped GEMM.
    pub fp8: kernels::fp8::Fp8,
    /// Decode's expert GEMM (experts of a few rows, the masked layout).
    pub decode: kernels::decode_gemm::DecodeGemm,
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
        sys::device::untracked(&ctx);
        let stream = ctx.new_stream()?;
        let module = ctx.load_module(Ptx::from_binary(FATBIN.to_vec()))?;
        let k = Kernels::load(&module)?;
        let hopper = kernels::hopper::Hopper::load(&ctx)?;
        let fp8 = kernels::fp8::Fp8::load(&ctx)?;
        // Through `Alloc`, as every device allocation, so it is counted.
        let mut a = Alloc::new(stream.clone());
        let decode = kernels::decode_gemm::DecodeGemm::load(&ctx, &module, &mut a)?;
        let blas = CudaBlas::new(stream.clone())?;
        let mut workspace = a.zeros::<u8>(BLAS_WORKSPACE)?;
        // Kept in `self` and dropped after the handle.
        sys::device::set_blas_workspace(&blas, &mut workspace, &stream)?;
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
}
