//! The GPU layer (`--features cuda`): one context and compute stream per rank, the kernels
//! compiled by build.rs and embedded in the binary (`kernels`: one declaration each), typed
//! launchers for them by concern (`router`, `layout`, `slots`, `ffn`, `convert`; cuBLAS for the
//! router GEMM), the one device allocator (`Alloc`) and the GPU error type.

pub mod bench;
mod blas;
mod convert;
pub mod decode_gemm;
pub mod ep;
pub mod exchange;
mod experts;
mod ffn;
pub mod fp8;
mod fp8_ffn;
pub mod hopper;
pub mod ipc;
mod kernels;
mod layout;
pub mod nccl;
pub mod rank;
mod router;
pub mod setup;
pub mod shape;
pub mod slots;
pub mod step;
mod transfer;

pub use ffn::{max_tiles, Blocks, GEMM_TILE, GEMM_WIDE_N};
pub use kernels::Kernels;
pub use router::{sigmoid_group_in_regs, Logits, ROUTER_PIECES, TOPK_REGS_EXPERTS};

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, DriverError, ValidAsZeroBits,
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
    pub hopper: hopper::Hopper,
    /// FP8 experts: activation quantization and DeepGEMM's FP8 grouped GEMM.
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
        let k = Kernels::load(&module)?;
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
}
