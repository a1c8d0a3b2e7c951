//! Host memory the GPU copies to and from by DMA, and the copies: page-locked staging
//! (`Pinned`), the step ring registered in place (`RingPin`), and async copies on a stream between
//! them, device memory, and a client's device memory (by unified addressing). Each copy checks
//! its bounds before the raw call.

use std::ops::Range;

use cudarc::driver::sys;
use cudarc::driver::{
    result, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError,
};

use crate::request::ClientSpan;
use crate::step::ring::Ring;

/// Page-locked host memory (an async copy from pageable memory would wait for the stream).
pub struct Pinned<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: plain host memory owned by this value; access is through &self / &mut self only.
unsafe impl<T: Send> Send for Pinned<T> {}

impl<T: DeviceRepr + Copy + Default> Pinned<T> {
    /// Allocates `len` elements, set to the default (the context must be current).
    pub fn new(len: usize) -> Result<Self, DriverError> {
        let len = len.max(1);
        // SAFETY: a fresh allocation of len elements; cuMemHostAlloc returns suitably aligned memory.
        let ptr = unsafe { result::malloc_host(len * std::mem::size_of::<T>(), 0) }? as *mut T;
        // SAFETY: ptr holds len elements of T, written before any read.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }.fill(T::default());
        Ok(Self { ptr, len })
    }
    /// The host data. Only valid to read while no copy into it is in flight: the rank reads it
    /// after the step's completion event.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: ptr holds len initialised elements for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, borrowed mutably through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T> Drop for Pinned<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
        if let Err(e) = unsafe { result::free_host(self.ptr.cast()) } {
            tracing::warn!("cuMemFreeHost: {e}");
        }
    }
}

/// Host copy `src[range]` into the start of `dst` on `stream` (pinned source: asynchronous).
pub fn htod<T: DeviceRepr + Copy + Default>(
    src: &Pinned<T>,
    range: Range<usize>,
    dst: &mut CudaSlice<T>,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    assert!(
        range.end <= src.len && range.len() <= dst.len(),
        "htod bounds"
    );
    let (d, _sync) = dst.device_ptr_mut(stream);
    // SAFETY: the ranges are inside both buffers (asserted); the pinned source outlives the copy.
    unsafe { result::memcpy_htod_async(d, &src.as_slice()[range], stream.cu_stream()) }
}

pub fn dtoh<T: DeviceRepr + Copy + Default>(
    src: &CudaSlice<T>,
    len: usize,
    dst: &mut Pinned<T>,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    assert!(len <= src.len() && len <= dst.len, "dtoh bounds");
    let (s, _sync) = src.device_ptr(stream);
    // SAFETY: as in `htod`; the host reads `dst` only after the step's completion event.
    unsafe { result::memcpy_dtoh_async(&mut dst.as_mut_slice()[..len], s, stream.cu_stream()) }
}

/// The step ring registered with the driver (page-locked in place), so rows move between it and
/// the GPU by DMA with no host staging copy (without it the same copies still work, staged). Unregistered on drop, which must come before the
/// ring is unmapped and after the last copy touching it.
pub struct RingPin(usize);

impl RingPin {
    pub fn new(ring: &Ring) -> Result<Self, DriverError> {
        let (_, addr, len) = ring.buffer();
        // SAFETY: [addr, addr + len rounded up to a page) is the ring's own mapping (mmap maps
        // whole pages, page-aligned), which the rank keeps mapped for longer than this value.
        unsafe {
            sys::cuMemHostRegister_v2(
                addr as *mut std::ffi::c_void,
                len.next_multiple_of(4096),
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()?;
        Ok(Self(addr))
    }
}

impl Drop for RingPin {
    fn drop(&mut self) {
        // SAFETY: registered once in `new`; no copy is in flight (the last step was waited for).
        if let Err(e) =
            unsafe { sys::cuMemHostUnregister(self.0 as *mut std::ffi::c_void) }.result()
        {
            tracing::warn!("cuMemHostUnregister: {e}");
        }
    }
}

/// `bytes` from host address `src` (inside the registered ring) into `dst` from byte `at`, on
/// `stream`.
pub fn ring_in<T>(
    src: (usize, usize),
    dst: &mut CudaSlice<T>,
    at: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    let (src, bytes) = src;
    assert!(
        at + bytes <= dst.len() * std::mem::size_of::<T>(),
        "ring_in bounds"
    );
    if bytes == 0 {
        return Ok(());
    }
    let (d, _sync) = dst.device_ptr_mut(stream);
    // SAFETY: the span lies inside the ring's mapping (`Ring::hidden_span` checks the rows) and
    // `dst` holds `at + bytes` (asserted); the leader rewrites a cell only after every rank has
    // published its output, which this rank does after the step's completion event.
    unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            d + at as u64,
            src as *const std::ffi::c_void,
            bytes,
            stream.cu_stream(),
        )
    }
    .result()
}

/// `bytes` of `src` from byte `at` into host address `dst` (inside the registered ring), on
/// `stream`.
pub fn ring_out<T>(
    src: &CudaSlice<T>,
    at: usize,
    dst: (usize, usize),
    stream: &CudaStream,
) -> Result<(), DriverError> {
    let (dst, bytes) = dst;
    assert!(
        at + bytes <= src.len() * std::mem::size_of::<T>(),
        "ring_out bounds"
    );
    if bytes == 0 {
        return Ok(());
    }
    let (s, _sync) = src.device_ptr(stream);
    // SAFETY: as in `ring_in` (`Ring::output_span` checks the rows); the leader reads these rows
    // only after this rank publishes them, after the step's completion event.
    unsafe {
        sys::cuMemcpyDtoHAsync_v2(
            dst as *mut std::ffi::c_void,
            s + at as u64,
            bytes,
            stream.cu_stream(),
        )
    }
    .result()
}

/// A client's device rows (`span`, in this process's address space) into `dst` from byte `at`,
/// on `stream`: device to device, across GPUs by unified addressing.
pub fn direct_in<T>(
    span: &ClientSpan,
    dst: &mut CudaSlice<T>,
    at: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    assert!(
        at + span.len <= dst.len() * std::mem::size_of::<T>(),
        "direct_in bounds"
    );
    let src = span
        .device_address()
        .expect("a direct run is in device memory");
    let (d, _sync) = dst.device_ptr_mut(stream);
    // SAFETY: the span lies inside the client's mapped allocation (checked against the region
    // when the request named it) and stays mapped until the step completes (the rank's flight
    // holds it); `dst` holds `at + len` (asserted).
    unsafe { sys::cuMemcpyAsync(d + at as u64, src, span.len, stream.cu_stream()) }.result()
}

/// `span.len` bytes of `src` from byte `at` into a client's device rows, on `stream`.
pub fn direct_out<T>(
    src: &CudaSlice<T>,
    at: usize,
    span: &ClientSpan,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    assert!(
        at + span.len <= src.len() * std::mem::size_of::<T>(),
        "direct_out bounds"
    );
    let dst = span
        .device_address()
        .expect("a direct run is in device memory");
    let (s, _sync) = src.device_ptr(stream);
    // SAFETY: as in `direct_in`, the other way; the client reads them only once answered, after
    // the step's completion event.
    unsafe { sys::cuMemcpyAsync(dst, s + at as u64, span.len, stream.cu_stream()) }.result()
}

/// `bytes` from the start of `src` to the start of `dst`, on `stream`.
pub fn dtod<S, D>(
    src: &CudaSlice<S>,
    dst: &mut CudaSlice<D>,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    assert!(
        bytes <= src.len() * std::mem::size_of::<S>()
            && bytes <= dst.len() * std::mem::size_of::<D>(),
        "dtod bounds"
    );
    if bytes == 0 {
        return Ok(());
    }
    let (s, _a) = src.device_ptr(stream);
    let (d, _b) = dst.device_ptr_mut(stream);
    // SAFETY: both spans lie inside their allocations (asserted); the copy is ordered on `stream`
    // after what wrote `src` and before what reads `dst`.
    unsafe { result::memcpy_dtod_async(d, s, bytes, stream.cu_stream()) }
}
