//! The `nccl` backend's rank: a `GpuStep` fed straight from the host step ring (registered with
//! the driver once, so its rows are copied by DMA in their wire dtype and converted on the GPU),
//! one CUDA graph per (layer, bucket, routing source) captured at startup and replayed, and every
//! wait on the GPU bounded by the step timeout (a lost peer would otherwise hang NCCL forever).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cudarc::driver::{
    result, CudaEvent, CudaGraph, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    DriverError,
};

use super::step::{GpuStep, Rows, Variant};
use super::GpuError;
use crate::dtype::Dtype;
use crate::step::ring::Ring;
use crate::step::{Backend, PhaseTimes, StepDesc, StepError};

/// Page-locked host memory (the graph's copies need fixed, pinned addresses).
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

/// Host copy `src[..len]` into `dst[off..]` on `stream` (pinned source: capturable).
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
struct RingPin(usize);

impl RingPin {
    fn new(ring: &Ring) -> Result<Self, DriverError> {
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

/// `bytes` from host address `src` (inside the registered ring) into `dst`, on `stream`.
fn ring_in<T>(
    src: (usize, usize),
    dst: &mut CudaSlice<T>,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    let (src, bytes) = src;
    assert!(
        bytes <= dst.len() * std::mem::size_of::<T>(),
        "ring_in bounds"
    );
    if bytes == 0 {
        return Ok(());
    }
    let (d, _sync) = dst.device_ptr_mut(stream);
    // SAFETY: the span lies inside the ring's mapping (`Ring::hidden_span` checks the rows) and
    // `dst` holds `bytes` (asserted); the router rewrites a slot only after every rank has
    // published its output, which this rank does after the step's completion event.
    unsafe {
        sys::cuMemcpyHtoDAsync_v2(d, src as *const std::ffi::c_void, bytes, stream.cu_stream())
    }
    .result()
}

/// `bytes` of `src` into host address `dst` (inside the registered ring), on `stream`.
fn ring_out<T>(
    src: &CudaSlice<T>,
    dst: (usize, usize),
    stream: &CudaStream,
) -> Result<(), DriverError> {
    let (dst, bytes) = dst;
    assert!(
        bytes <= src.len() * std::mem::size_of::<T>(),
        "ring_out bounds"
    );
    if bytes == 0 {
        return Ok(());
    }
    let (s, _sync) = src.device_ptr(stream);
    // SAFETY: as in `ring_in` (`Ring::output_span` checks the rows); the router reads these rows
    // only after this rank publishes them, after the step's completion event.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut std::ffi::c_void, s, bytes, stream.cu_stream()) }
        .result()
}

/// The home rows from the ring onto the GPU: bf16 rows as they are into `xb` (`Rows::Bf16`), f32
/// rows into `x`, f16 ones through the wire buffer and a widening kernel into `x`. Outside the
/// graph: the slot and rows vary per step.
fn load_rows(
    c: &mut GpuStep,
    ring: &Ring,
    slot: usize,
    home: Range<usize>,
    d: Dtype,
) -> Result<(), DriverError> {
    let (n, h, s) = (home.len(), c.shape.hidden, c.g.stream.clone());
    let span = ring.hidden_span(slot, home, d);
    match d {
        Dtype::Bf16 => ring_in(span, &mut c.b.xb, &s),
        Dtype::F32 => ring_in(span, &mut c.b.x, &s),
        _ => {
            ring_in(span, &mut c.b.wire, &s)?;
            c.g.widen_rows(&c.b.wire, d == Dtype::F16, n, h, &mut c.b.x)
        }
    }
}

/// The step's output rows into the ring in `d`: f32 directly, 16-bit ones narrowed on the GPU.
fn store_rows(
    c: &mut GpuStep,
    ring: &Ring,
    slot: usize,
    home: Range<usize>,
    d: Dtype,
) -> Result<(), DriverError> {
    let (n, h, s) = (home.len(), c.shape.hidden, c.g.stream.clone());
    let span = ring.output_span(slot, home, d);
    match d {
        Dtype::F32 => ring_out(&c.b.out, span, &s),
        _ => {
            c.g.narrow_rows(&c.b.out, d == Dtype::F16, n, h, &mut c.b.wire)?;
            ring_out(&c.b.wire, span, &s)
        }
    }
}

/// Pinned staging of one step's small inputs and outputs (the rows go through the ring).
struct Staging {
    ids: Pinned<i32>,
    w: Pinned<f32>,
    /// `[n, 0, n]`: the home count and the shared expert's offsets.
    n: Pinned<i32>,
    m: Pinned<i32>,
    /// NCCL EP's per-local-expert receive counts and HT padded total, for the overflow check.
    recv: Pinned<i32>,
    total: Pinned<i32>,
}

/// Everything a step enqueues, copies included: captured as is, or run eagerly.
fn enqueue(
    c: &mut GpuStep,
    st: &mut Staging,
    layer: usize,
    bucket: usize,
    v: Variant,
) -> Result<(), GpuError> {
    let s = c.g.stream.clone();
    let k = c.shape.top_k;
    htod(&st.n, 0..1, &mut c.b.n, &s)?;
    if v.client {
        htod(&st.ids, 0..bucket * k, &mut c.b.ids, &s)?;
        htod(&st.w, 0..bucket * k, &mut c.b.w, &s)?;
    }
    c.run(layer, bucket, v)?;
    let m = c.b.m.len();
    dtoh(&c.b.m, m, &mut st.m, &s)?;
    if let Some((counts, total)) = c.ex.receipts() {
        dtoh(counts, counts.len(), &mut st.recv, &s)?;
        dtoh(total, 1, &mut st.total, &s)?;
    }
    Ok(())
}

/// Waits for `ev` until `started + bound`, spinning briefly, then sleeping in short naps.
fn wait_event(ev: &CudaEvent, started: Instant, bound: Duration) -> Result<(), GpuError> {
    let deadline = started + bound;
    let mut polls = 0u32;
    loop {
        if ev.try_is_complete()? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(GpuError::Timeout(bound));
        }
        polls += 1;
        if polls < 2000 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// A captured step.
struct Graph(CudaGraph);

// SAFETY: a graph exec may be launched from any thread with its context; the rank owns it and
// launches it through &mut self, one thread at a time.
unsafe impl Send for Graph {}

pub struct GpuRank {
    /// None once poisoned: a failed step leaks the device state rather than free memory a hung
    /// kernel may still touch (the process is about to exit).
    core: Option<GpuStep>,
    /// Dropped only while not poisoned: a copy into it may still be in flight otherwise.
    st: std::mem::ManuallyDrop<Staging>,
    /// Before `ring`, so it is unregistered before the ring is unmapped; None once poisoned.
    pinned: Option<RingPin>,
    ring: Arc<Ring>,
    /// Home-token capacities, ascending; the last is the largest a step can need.
    buckets: Vec<usize>,
    /// `[layer][bucket][Variant::index]`, when graphs are on.
    graphs: Vec<Option<Graph>>,
    done: CudaEvent,
    routed: Vec<u32>,
    /// Rows the routing sent each local expert this step (the receive check's side), kept so
    /// the per-step check allocates nothing.
    routed_local: Vec<i64>,
    step_timeout: Duration,
}

impl GpuRank {
    /// Warms every bucket up eagerly, once per router (NCCL connects, and cuBLAS picks and loads
    /// each GEMM's kernel, on first use: never inside a capture), then captures each graph.
    /// Every rank calls this in lockstep: the warm-up steps communicate.
    pub fn new(
        core: GpuStep,
        ring: Arc<Ring>,
        buckets: Vec<usize>,
        graphs: bool,
        step_timeout: Duration,
    ) -> Result<Self, GpuError> {
        let s = core.shape;
        let (t, k) = (s.max_home, s.top_k);
        if buckets.last() != Some(&t) || buckets.windows(2).any(|w| w[0] >= w[1]) {
            return Err(GpuError::Config(format!(
                "buckets {buckets:?} must ascend to the largest home slice ({t})"
            )));
        }
        core.g.ctx.bind_to_thread()?;
        let st = Staging {
            ids: Pinned::new(t * k)?,
            w: Pinned::new(t * k)?,
            n: Pinned::new(1)?,
            m: Pinned::new(s.world * s.experts)?,
            recv: Pinned::new(s.local())?,
            total: Pinned::new(1)?,
        };
        let done = core.g.ctx.new_event(None)?;
        // The kernel refuses to pin a writable file mapping outside tmpfs (e.g. --shm-dir on
        // disk): then the driver stages the same copies through its own pinned buffers.
        let pinned = match RingPin::new(&ring) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(
                    "the step ring could not be registered with the driver ({e}): rows are \
                     copied through the driver's staging, more slowly; put --shm-dir on a tmpfs"
                );
                None
            }
        };
        let mut me = Self {
            routed: vec![0; s.world * s.experts],
            routed_local: vec![0; s.local()],
            core: Some(core),
            st: std::mem::ManuallyDrop::new(st),
            pinned,
            ring,
            buckets,
            graphs: Vec::new(),
            done,
            step_timeout,
        };
        if let Some(f) = me.core().ex.footprint() {
            // Present (at zero) from the start, so a dashboard can alert on any increase.
            for mode in ["ll", "ht"] {
                if f.modes.contains(mode) {
                    metrics::counter!("epserve_ep_recv_overflow_total", "mode" => mode).absolute(0);
                    metrics::counter!("epserve_ep_recv_mismatch_total", "mode" => mode).absolute(0);
                }
            }
        }
        let layers = me.core().layers.len();
        for bucket in me.buckets.clone() {
            for rows in [Rows::F32, Rows::Bf16] {
                me.eager(0, bucket, Variant::new(rows, false))?;
                me.finish(Instant::now(), Duration::from_secs(60))?;
            }
        }
        if graphs {
            for layer in 0..layers {
                for bucket in me.buckets.clone() {
                    for v in Variant::ALL {
                        let g = me.capture(layer, bucket, v)?;
                        me.graphs.push(Some(Graph(g)));
                    }
                }
            }
        }
        Ok(me)
    }

    fn core(&mut self) -> &mut GpuStep {
        self.core.as_mut().expect("the GPU rank is poisoned")
    }

    fn eager(&mut self, layer: usize, bucket: usize, v: Variant) -> Result<(), GpuError> {
        let c = self.core.as_mut().expect("the GPU rank is poisoned");
        enqueue(c, &mut self.st, layer, bucket, v)
    }

    fn capture(&mut self, layer: usize, bucket: usize, v: Variant) -> Result<CudaGraph, GpuError> {
        let st = &mut self.st;
        let c = self.core.as_mut().expect("the GPU rank is poisoned");
        c.capture(|c| enqueue(c, st, layer, bucket, v))
    }

    /// Waits for everything enqueued so far, until `bound` after `started`.
    fn finish(&mut self, started: Instant, bound: Duration) -> Result<(), GpuError> {
        let stream = self.core().g.stream.clone();
        self.done.record(&stream)?;
        wait_event(&self.done, started, bound)
    }

    /// After a failed step: abort the communicator (a hung NCCL kernel would block any other
    /// teardown) and leak the device state rather than free memory a kernel may still touch
    /// (the process is about to exit).
    fn poison(&mut self) {
        if let Some(c) = self.core.take() {
            let GpuStep {
                g,
                ex,
                comm,
                layers,
                b,
                ..
            } = c;
            // The exchange too (NCCL EP's group and handle): destroying them would wait on the
            // broken group.
            std::mem::forget(ex);
            comm.abort();
            std::mem::forget((g, layers, b));
            self.graphs.drain(..).for_each(std::mem::forget);
            // A copy may still be in flight to or from the ring: keep it registered.
            std::mem::forget(self.pinned.take());
        }
    }

    /// What the exchange received against what the routing sent (this step's all-gathered
    /// counts), for an exchange that can differ (NCCL EP): a step that fails the check is
    /// counted by the exchange, and its output is not delivered.
    fn check_receive(&mut self, step: u64, bucket: usize) -> Result<(), StepError> {
        let Some(c) = self.core.as_ref() else {
            return Ok(());
        };
        if c.ex.receipts().is_none() {
            return Ok(());
        }
        let s = &c.shape;
        let (l, e) = (s.local(), s.experts);
        // Rows each local expert was sent, over every source.
        for (j, r) in self.routed_local.iter_mut().enumerate() {
            *r = (0..s.world)
                .map(|src| i64::from(self.routed[src * e + s.rank * l + j]))
                .sum();
        }
        let counts = &self.st.recv.as_slice()[..l];
        c.ex.verify(
            bucket,
            &self.routed_local,
            counts,
            self.st.total.as_slice()[0],
        )
        .map_err(|msg| {
            tracing::error!(step, "{msg}");
            StepError::Corrupt { step, msg }
        })
    }

    /// The smallest bucket holding `most_home` rows (every rank's home fits it).
    fn bucket_of(&self, most_home: usize) -> Option<usize> {
        self.buckets.iter().position(|&b| b >= most_home.max(1))
    }

    fn run_step(&mut self, desc: &StepDesc, home: Range<usize>) -> Result<usize, StepError> {
        let started = Instant::now();
        let invalid = |msg: String| StepError::Invalid {
            step: desc.step,
            msg,
        };
        let (slot, n) = (desc.slot as usize, home.len());
        let bi = self
            .bucket_of(desc.most_home(self.ring.shape.world))
            .ok_or_else(|| invalid(format!("{} tokens exceed the buffers", desc.tokens)))?;
        if !self.ring.input_ready(slot, desc.step) {
            return Err(invalid(format!(
                "slot {slot} does not hold this step's input"
            )));
        }
        let c = self.core.as_ref().expect("the GPU rank is poisoned");
        // The executor thread is not the one that created the context.
        c.g.ctx
            .bind_to_thread()
            .map_err(|e| invalid(format!("binding the CUDA context: {e}")))?;
        let (k, e, layers) = (c.shape.top_k, c.shape.experts, c.layers.len());
        let layer = desc.layer as usize;
        if layer >= layers {
            return Err(invalid(format!("layer {layer} is not loaded")));
        }
        let st: &mut Staging = &mut self.st;
        if desc.client_routing {
            self.ring.read_routing(
                slot,
                home.clone(),
                &mut st.ids.as_mut_slice()[..n * k],
                &mut st.w.as_mut_slice()[..n * k],
            );
            if let Some(bad) = st.ids.as_slice()[..n * k]
                .iter()
                .find(|&&id| !(0..e as i32).contains(&id))
            {
                return Err(invalid(format!("expert id {bad} out of range")));
            }
            // The bucket's padding rows are routed nowhere (the top-k kernels do the same).
            let bucket = self.buckets[bi];
            st.ids.as_mut_slice()[n * k..bucket * k].fill(-1);
            st.w.as_mut_slice()[n * k..bucket * k].fill(0.0);
        }
        st.n.as_mut_slice()[0] = n as i32;
        let bucket = self.buckets[bi];
        let ring = self.ring.clone();
        let c = self.core.as_mut().expect("the GPU rank is poisoned");
        let rows = match desc.input {
            Dtype::Bf16 => Rows::Bf16,
            _ => Rows::F32,
        };
        let v = Variant::new(rows, desc.client_routing);
        let mut launched =
            load_rows(c, &ring, slot, home.clone(), desc.input).map_err(GpuError::from);
        if launched.is_ok() {
            launched = match self.graphs.is_empty() {
                true => self.eager(layer, bucket, v),
                false => {
                    let per_bucket = Variant::ALL.len();
                    let g = (layer * self.buckets.len() + bi) * per_bucket + v.index();
                    let graph = self.graphs[g].as_ref().expect("captured at startup");
                    graph.0.launch().map_err(GpuError::from)
                }
            };
        }
        if launched.is_ok() {
            let c = self.core.as_mut().expect("the GPU rank is poisoned");
            launched = store_rows(c, &ring, slot, home, desc.output).map_err(GpuError::from);
        }
        if let Err(e) = launched.and_then(|_| self.finish(started, self.step_timeout)) {
            self.poison();
            let step = desc.step;
            return Err(match e {
                GpuError::Timeout(after) => StepError::Timeout { step, after },
                e => StepError::Device {
                    step,
                    source: Box::new(e),
                },
            });
        }
        for (r, &m) in self.routed.iter_mut().zip(self.st.m.as_slice()) {
            *r = m.max(0) as u32;
        }
        self.check_receive(desc.step, bucket)?;
        // Whole-device use, so an allocation by anyone in the process (NCCL included) shows.
        if let Ok((free, total)) = result::mem_get_info() {
            metrics::gauge!("epserve_device_memory_used_bytes").set((total - free) as f64);
        }
        Ok(bucket)
    }
}

impl Backend for GpuRank {
    fn step(&mut self, desc: &StepDesc, home: Range<usize>) -> Result<PhaseTimes, StepError> {
        let t0 = Instant::now();
        let bucket = self.run_step(desc, home)?;
        // The rows went into the ring by DMA before the step's completion event.
        self.ring.publish_output(
            desc.slot as usize,
            self.core.as_ref().map_or(0, |c| c.shape.rank),
            desc.step,
        );
        let world = self.ring.shape.world;
        Ok(PhaseTimes {
            total: t0.elapsed(),
            padding: (bucket * world).saturating_sub(desc.tokens as usize),
            ..PhaseTimes::default()
        })
    }

    fn routed(&self) -> &[u32] {
        &self.routed
    }

    fn ep_footprint(&self) -> Option<crate::proto::NcclEpFootprint> {
        self.core.as_ref()?.ex.footprint()
    }

    fn buffers(&self) -> Vec<(&'static str, usize, usize)> {
        let mut v = vec![self.ring.buffer()];
        if let Some(c) = &self.core {
            let (p, _s) = c.b.out.device_ptr(&c.g.stream);
            v.push(("gpu_step_buffers", p as usize, c.shape.buffer_bytes()));
        }
        v
    }
}

impl Drop for GpuRank {
    fn drop(&mut self) {
        // Graphs go before the buffers and communicator they reference.
        self.graphs.clear();
        if self.core.is_some() {
            // SAFETY: dropped once, here; the stream was synchronised by the last step's event.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.st) };
        }
    }
}
