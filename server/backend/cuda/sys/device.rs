//! Device attributes and the context settings the step needs before its first allocation.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{result, CudaContext, CudaSlice, CudaStream, DevicePtrMut, DriverError};

/// Device `ordinal`'s compute capability major version (9 for Hopper).
pub fn compute_major(ordinal: usize) -> Result<i32, DriverError> {
    result::init()?;
    let dev = result::device::get(ordinal as i32)?;
    // SAFETY: a device handle from cuDeviceGet; a plain attribute query.
    unsafe {
        result::device::get_attribute(
            dev,
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )
    }
}

/// Stops cudarc recording an event per allocation on `ctx`, which captured graphs would
/// otherwise contain. Call before the first allocation on the context (`Gpu::new` does).
pub fn untracked(ctx: &Arc<CudaContext>) {
    // SAFETY: the caller has made no allocation on this context yet; streams are ordered by
    // hand (events recorded explicitly), which is all the tracking provided.
    unsafe { ctx.disable_event_tracking() };
}

/// Gives cuBLAS `workspace` so that captured graphs never make it allocate. The workspace must
/// outlive the handle: its owner drops it after `blas`.
pub fn set_blas_workspace(
    blas: &CudaBlas,
    workspace: &mut CudaSlice<u8>,
    stream: &Arc<CudaStream>,
) -> Result<(), cudarc::cublas::result::CublasError> {
    let bytes = workspace.len();
    let ws = workspace.device_ptr_mut(stream).0;
    // SAFETY: `ws` is a live device allocation of `bytes` bytes, which the caller keeps alive
    // for as long as the handle.
    unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ws as *mut _, bytes) }
        .result()
}

/// Keeps memory freed on `ctx`'s device in its default pool for reuse instead of handing it
/// back to the driver. Stream-ordered frees (cudarc's) are released at the next synchronize on
/// any thread once the pool holds more than its threshold (0 by default): the step's wait for
/// its completion event then unmaps gigabytes (2x H100, a 4-layer placement's 2.4 GB staged
/// per rank: one step of 51 ms, 24x its size's median, though the buffers were freed on a
/// thread of their own).
pub fn keep_freed(ctx: &Arc<CudaContext>) -> Result<(), DriverError> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and the context's own device ordinal.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
    let mut threshold = u64::MAX;
    // SAFETY: the pool handle just returned; RELEASE_THRESHOLD takes a pointer to a u64.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
}
