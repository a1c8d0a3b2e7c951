//! The rows' and the small per-step values' way between the host and the GPU: page-locked
//! staging, the step ring registered with the driver, and the inbox/outbox copies on streams of
//! their own, so that a GPU rank's next step comes in and its last one goes out while one runs.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{
    result, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError,
};

use super::shape::StepShape;
use super::step::{GpuStep, Variant};
use crate::dtype::Dtype;
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
fn htod<T: DeviceRepr + Copy + Default>(
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

fn dtoh<T: DeviceRepr + Copy + Default>(
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
pub(super) struct RingPin(usize);

impl RingPin {
    pub(super) fn new(ring: &Ring) -> Result<Self, DriverError> {
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
pub(super) fn ring_in<T>(
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
    // `dst` holds `at + bytes` (asserted); the router rewrites a slot only after every rank has
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
pub(super) fn ring_out<T>(
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
    // SAFETY: as in `ring_in` (`Ring::output_span` checks the rows); the router reads these rows
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
pub(super) fn direct_in<T>(
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
pub(super) fn direct_out<T>(
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
fn dtod<S, D>(
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

/// The home rows from the inbox into the step's own buffers: bf16 rows as they are into `xb`
/// (`Rows::Bf16`), f32 rows into `x`, f16 ones through a widening kernel into `x`.
pub(super) fn unpack_rows(c: &mut GpuStep, n: usize, d: Dtype) -> Result<(), DriverError> {
    let (h, s) = (c.shape.hidden, c.g.stream.clone());
    match d {
        Dtype::Bf16 => dtod(&c.b.inbox, &mut c.b.xb, n * h * 2, &s),
        Dtype::F32 => dtod(&c.b.inbox, &mut c.b.x, n * h * 4, &s),
        _ => {
            c.g.widen_rows(&c.b.inbox, d == Dtype::F16, n, h, &mut c.b.x)
        }
    }
}

/// The step's output rows into the outbox in `d`: f32 as they are, 16-bit ones narrowed.
pub(super) fn pack_rows(c: &mut GpuStep, n: usize, d: Dtype) -> Result<(), DriverError> {
    let (h, s) = (c.shape.hidden, c.g.stream.clone());
    match d {
        Dtype::F32 => dtod(&c.b.out, &mut c.b.outbox, n * h * 4, &s),
        _ => {
            c.g.narrow_rows(&c.b.out, d == Dtype::F16, n, h, &mut c.b.outbox)
        }
    }
}

/// The rows' way between the ring and the step, on copy streams of their own, so that step N+1's
/// rows come in and step N-1's go out while step N computes. The events hand each box from one
/// stream to the other; each wait takes the latest record, which the submit order makes the
/// right one.
pub(super) struct Copies {
    pub h2d: Arc<CudaStream>,
    pub d2h: Arc<CudaStream>,
    /// The inbox holds the next step's rows / the step has taken them out.
    pub inbox_full: CudaEvent,
    pub inbox_free: CudaEvent,
    /// The outbox holds a step's output / it has reached the ring.
    pub outbox_full: CudaEvent,
    pub outbox_free: CudaEvent,
}

impl Copies {
    pub(super) fn new(c: &GpuStep) -> Result<Self, DriverError> {
        let ctx = &c.g.ctx;
        Ok(Self {
            h2d: ctx.new_stream()?,
            d2h: ctx.new_stream()?,
            inbox_full: ctx.new_event(None)?,
            inbox_free: ctx.new_event(None)?,
            outbox_full: ctx.new_event(None)?,
            outbox_free: ctx.new_event(None)?,
        })
    }
}

/// Steps a GPU rank holds submitted at once: each has its own staging set and completion event.
pub(super) const DEPTH: usize = 2;

/// Pinned staging of one step's small inputs and outputs (the rows go through the ring), one set
/// per step in flight.
pub(super) struct Staging {
    pub ids: Pinned<i32>,
    pub w: Pinned<f32>,
    /// `[n, 0, n]`: the home count and the shared expert's offsets.
    pub n: Pinned<i32>,
    pub m: Pinned<i32>,
    /// NCCL EP's per-local-expert receive counts and HT padded total, for the overflow check.
    pub recv: Pinned<i32>,
    pub total: Pinned<i32>,
}

impl Staging {
    pub(super) fn new(s: &StepShape) -> Result<Self, DriverError> {
        let (t, k) = (s.max_home, s.top_k);
        Ok(Self {
            ids: Pinned::new(t * k)?,
            w: Pinned::new(t * k)?,
            n: Pinned::new(1)?,
            m: Pinned::new(s.world * s.experts)?,
            recv: Pinned::new(s.local())?,
            total: Pinned::new(1)?,
        })
    }

    /// The step's count (and the client's routing) onto the device, on the step's stream. Outside
    /// the graph: the set differs between the steps in flight.
    pub(super) fn copy_in(
        &self,
        c: &mut GpuStep,
        bucket: usize,
        v: Variant,
    ) -> Result<(), DriverError> {
        let (s, k) = (c.g.stream.clone(), c.shape.top_k);
        htod(&self.n, 0..1, &mut c.b.n, &s)?;
        if v.client {
            htod(&self.ids, 0..bucket * k, &mut c.b.ids, &s)?;
            htod(&self.w, 0..bucket * k, &mut c.b.w, &s)?;
        }
        Ok(())
    }

    /// The routing counts (and NCCL EP's receipts) back, before the next step can overwrite them.
    pub(super) fn copy_out(&mut self, c: &GpuStep) -> Result<(), DriverError> {
        let s = c.g.stream.clone();
        dtoh(&c.b.m, c.b.m.len(), &mut self.m, &s)?;
        if let Some((counts, total)) = c.ex.receipts() {
            dtoh(counts, counts.len(), &mut self.recv, &s)?;
            dtoh(total, 1, &mut self.total, &s)?;
        }
        Ok(())
    }
}
