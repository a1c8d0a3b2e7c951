//! cuBLAS GEMMs over bf16 operands on the rank's stream, summed in f32: the router's logits over
//! the bf16 pieces (f32 out) and the shared expert's dense FFN (bf16 out).

use cudarc::cublas::sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use crate::backend::cuda::{Gpu, GpuError};

/// An element type cuBLAS writes a bf16 GEMM's output in.
pub trait BlasOut: DeviceRepr {
    const TYPE: cudarc::cublas::sys::cudaDataType_t;
}

impl BlasOut for f32 {
    const TYPE: cudarc::cublas::sys::cudaDataType_t = CUDA_R_32F;
}

impl BlasOut for bf16 {
    const TYPE: cudarc::cublas::sys::cudaDataType_t = CUDA_R_16BF;
}

impl Gpu {
    /// Row-major `c [m, n] = b [m, k] . a [n, k]^T`: bf16 operands (`a` as nn.Linear stores its
    /// weights), products summed in f32 on tensor cores, written as `T`.
    pub fn gemm_bf16<T: BlasOut>(
        &self,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        (m, n, k): (usize, usize, usize),
        c: &mut CudaSlice<T>,
    ) -> Result<(), GpuError> {
        assert!(
            a.len() >= n * k && b.len() >= m * k && c.len() >= m * n,
            "gemm_bf16 operands smaller than [{m}, {k}] . [{n}, {k}]^T"
        );
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (pa, _ra) = a.device_ptr(&self.stream);
        let (pb, _rb) = b.device_ptr(&self.stream);
        let (pc, _rc) = c.device_ptr_mut(&self.stream);
        // Row-major [m, n] is column-major [n, m] = a^T' . b^T'.
        // SAFETY: the three operands span these shapes (asserted above) and stay borrowed until
        // the call returns; alpha and beta outlive it, which reads them before it returns (host
        // pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                pa as *const _,
                CUDA_R_16BF,
                k as i32,
                pb as *const _,
                CUDA_R_16BF,
                k as i32,
                (&beta) as *const f32 as *const _,
                pc as *mut _,
                T::TYPE,
                n as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}
