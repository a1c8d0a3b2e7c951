//! A client's CUDA memory, as Triton's CUDA shared-memory extension names it: a raw
//! `cudaIpcMemHandle_t` exported by another process, opened once in the primary context of the
//! device the client names and closed when the last request holding it is done. A GPU rank of
//! this process copies rows from and to it device to device, on its own streams, by its address
//! (`ClientMemory::device_address`). The host copies here (rows another process's rank
//! computes, the routing tensors) and the finite check are synchronous, on the thread that asks
//! (the region's context bound to it first). The handle is checked before use: 64 bytes, a
//! device that exists, and an allocation that holds the registered size.

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::backend::cuda::kernels::FiniteCheck;
use crate::dtype::Dtype;
use crate::request::{ClientMemory, OpenDevice};

/// Bytes of a `cudaIpcMemHandle_t`.
pub const HANDLE_BYTES: usize = 64;

/// One opened region.
pub struct IpcRegion {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: u64,
    /// The finite check's kernel, stream and result, one check at a time.
    check: Mutex<Check>,
}

struct Check {
    f: CudaFunction,
    stream: Arc<CudaStream>,
    first: CudaSlice<u64>,
}

/// The check's kernel, by device: the module is loaded once per device, not per region.
static KERNELS: Mutex<Vec<(usize, CudaFunction)>> = Mutex::new(Vec::new());

impl Check {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self, DriverError> {
        let f = {
            let mut k = KERNELS.lock().unwrap_or_else(|e| e.into_inner());
            match k.iter().find(|(d, _)| *d == ctx.ordinal()) {
                Some((_, f)) => f.clone(),
                None => {
                    let m =
                        ctx.load_module(Ptx::from_binary(crate::backend::cuda::FATBIN.to_vec()))?;
                    let f = FiniteCheck::load(&m)?.first_non_finite;
                    k.push((ctx.ordinal(), f.clone()));
                    f
                }
            }
        };
        let stream = ctx.new_stream()?;
        Ok(Self {
            f,
            first: stream.alloc_zeros::<u64>(1)?,
            stream,
        })
    }
}

/// Opens clients' CUDA memory for the protocols (`request::OpenDevice`), when this process has a
/// GPU.
pub fn open_device() -> Result<Arc<dyn OpenDevice>, String> {
    crate::backend::cuda::setup::available()?;
    Ok(Arc::new(IpcOpener))
}

struct IpcOpener;

impl OpenDevice for IpcOpener {
    fn open(&self, handle: &[u8], device: i64, size: u64) -> Result<Arc<dyn ClientMemory>, String> {
        Ok(Arc::new(IpcRegion::open(handle, device, size)?))
    }
}

fn driver(what: &str, e: DriverError) -> String {
    format!("{what}: {e}")
}

impl IpcRegion {
    /// Opens `handle` on device `device`, `len` bytes of it.
    pub fn open(handle: &[u8], device: i64, len: u64) -> Result<Self, String> {
        let raw: [u8; HANDLE_BYTES] = handle.try_into().map_err(|_| {
            format!(
                "raw_handle is {} bytes, not a CUDA IPC handle's {HANDLE_BYTES}",
                handle.len()
            )
        })?;
        let count = crate::backend::cuda::setup::device_count();
        let ordinal = usize::try_from(device)
            .ok()
            .filter(|&d| d < count)
            .ok_or_else(|| format!("device_id {device}: {count} GPUs are visible here"))?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("opening the device", e))?;
        ctx.bind_to_thread()
            .map_err(|e| driver("binding the device", e))?;
        let check = Check::new(&ctx).map_err(|e| driver("loading the finite check", e))?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(raw) {
            *d = s as std::ffi::c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is plain bytes the driver validates
        // (a forged or stale one fails with an error, not undefined behaviour); the context is
        // bound to this thread.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| driver("the handle does not open", e))?;
        let region = Self {
            ctx,
            ptr,
            len,
            check: Mutex::new(check),
        };
        let (mut base, mut size) = (0, 0usize);
        // SAFETY: valid out-pointers; `ptr` was just mapped in this context.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(|e| driver("the allocation's size", e))?;
        let room = (base + size as u64).saturating_sub(ptr);
        if len > room {
            return Err(format!(
                "byte_size {len} exceeds the {room} bytes of the client's allocation"
            ));
        }
        Ok(region)
    }

    fn inside(&self, offset: u64, n: usize) -> Result<(), String> {
        match offset.checked_add(n as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(format!(
                "{n} bytes at {offset} lie outside the region's {}",
                self.len
            )),
        }
    }
}

impl ClientMemory for IpcRegion {
    fn device_address(&self) -> Option<u64> {
        Some(self.ptr)
    }

    /// `out.len()` bytes at `offset` (the caller keeps them inside the region).
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        self.inside(offset, out.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("binding", e))?;
        // SAFETY: the span lies inside the mapping (checked above, and the mapping was checked
        // against its allocation at open); `out` holds `out.len()` bytes; the copy is
        // synchronous, so `out` outlives it.
        unsafe {
            sys::cuMemcpyDtoH_v2(
                out.as_mut_ptr() as *mut std::ffi::c_void,
                self.ptr + offset,
                out.len(),
            )
        }
        .result()
        .map_err(|e| driver("copying from the client's GPU memory", e))
    }

    /// `data` written at `offset`.
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.inside(offset, data.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("binding", e))?;
        // SAFETY: as in `read`, the other way; synchronous, so `data` outlives the copy.
        unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr + offset,
                data.as_ptr() as *const std::ffi::c_void,
                data.len(),
            )
        }
        .result()
        .map_err(|e| driver("copying to the client's GPU memory", e))
    }

    fn first_non_finite(&self, offset: u64, len: usize, d: Dtype) -> Result<Option<usize>, String> {
        self.inside(offset, len)?;
        let kind: i32 = match d {
            Dtype::F32 => 0,
            Dtype::Bf16 => 1,
            Dtype::F16 => 2,
            _ => return Err(format!("{d:?} is not a float dtype")),
        };
        let n = (len / d.bytes()) as u64;
        let mut c = self.check.lock().unwrap_or_else(|e| e.into_inner());
        let c = &mut *c;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("binding", e))?;
        let checked = (|| -> Result<u64, DriverError> {
            c.stream.memcpy_htod(&[u64::MAX], &mut c.first)?;
            let x = self.ptr + offset;
            let mut b = c.stream.launch_builder(&c.f);
            b.arg(&x).arg(&n).arg(&kind).arg(&mut c.first);
            let cfg = LaunchConfig {
                grid_dim: ((n.div_ceil(256)).clamp(1, 132 * 8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `x` is the region's address plus an offset whose `len` bytes lie inside
            // it (checked above), and the kernel reads bytes `[0, n * size)` of it, n * size <=
            // len; `first` is one u64 of this stream's; the arguments match the kernel's
            // (pointer, u64, int, pointer).
            unsafe { b.launch(cfg) }?;
            Ok(c.stream.clone_dtoh(&c.first)?[0])
        })();
        match checked.map_err(|e| driver("checking the client's GPU memory", e))? {
            u64::MAX => Ok(None),
            i => Ok(Some(i as usize)),
        }
    }
}

impl Drop for IpcRegion {
    fn drop(&mut self) {
        let closed = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: opened in `open` in this context; no copy uses it (copies are synchronous
            // and every request holding the region has ended).
            unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result()
        });
        if let Err(e) = closed {
            tracing::warn!("closing a CUDA shared-memory region: {e}");
        }
    }
}
