//! Expert slots on the device: the table gating reads to send each (token, expert) entry to one
//! of the expert's replicas (`to_slots`, inside the captured graphs), and a new placement's
//! weights staged beside the ones in use, then copied over the slots it rewrites, layer by layer,
//! on a stream of their own between that layer's steps (`Mover`). The graphs read the table and
//! the weights where they are, so a placement is rewritten in place and no graph is captured
//! again. From the gate on, the exchanges and the experts address
//! slots (`StepShape::experts`), the router logical experts (`StepShape::model_experts`).

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DriverError, PushKernelArg};

use crate::backend::cuda::experts::DeviceFfn;
use crate::backend::cuda::sys::memory::{htod, Pinned};
use crate::backend::cuda::{Alloc, Gpu, GpuError};
use crate::backend::device::Moving;
use crate::eplb::stage::{rewritten, Stager};
use crate::eplb::SlotMap;
use crate::model::{ExpertDtype, Ffn, ModelSource, MoeSpec};
use crate::step::StageDone;

/// Per layer, per logical expert, the slots this rank's tokens may use (`[experts][r]`, by
/// `SlotMap::replica_table`) and how many (`[experts]`); one device buffer per layer, each
/// written from a page-locked copy of its own, so a layer's new rows go in without a host wait.
pub struct SlotTable {
    rep: Vec<CudaSlice<i32>>,
    cnt: Vec<CudaSlice<i32>>,
    host: Vec<(Pinned<i32>, Pinned<i32>)>,
    experts: usize,
    r: usize,
    rank: usize,
    /// Whether each rank shares this rank's node: its replicas are preferred where it has any.
    near: Vec<bool>,
}

impl SlotTable {
    /// `map`'s table for `rank`, whose node holds the ranks `near` marks.
    pub fn new(
        a: &mut Alloc,
        map: &SlotMap,
        rank: usize,
        near: Vec<bool>,
    ) -> Result<Self, DriverError> {
        // An expert has at most one slot plus every redundant one.
        let r = 1 + map.redundant();
        let (mut rep, mut cnt, mut host) = (Vec::new(), Vec::new(), Vec::new());
        for (t, c) in map.replica_table(&near, r) {
            rep.push(a.upload(&t)?);
            cnt.push(a.upload(&c)?);
            host.push((Pinned::new(t.len())?, Pinned::new(c.len())?));
        }
        Ok(Self {
            rep,
            cnt,
            host,
            experts: map.experts,
            r,
            rank,
            near,
        })
    }

    /// Makes `map` the source `write` copies each layer's rows from. The copies of the last
    /// `set` must be done (the caller waits for them).
    pub fn set(&mut self, map: &SlotMap) {
        for ((t, c), (pt, pc)) in map
            .replica_table(&self.near, self.r)
            .into_iter()
            .zip(&mut self.host)
        {
            pt.as_mut_slice().copy_from_slice(&t);
            pc.as_mut_slice().copy_from_slice(&c);
        }
    }

    /// Copies layer `layer`'s rows of the table `set` made on `stream` (page-locked: the host
    /// does not wait): work enqueued after it on `stream` (or waiting for it) reads them.
    pub fn write(&mut self, layer: usize, stream: &Arc<CudaStream>) -> Result<(), DriverError> {
        let (pt, pc) = &self.host[layer];
        htod(pt, 0..pt.as_slice().len(), &mut self.rep[layer], stream)?;
        htod(pc, 0..pc.as_slice().len(), &mut self.cnt[layer], stream)
    }
}

impl Gpu {
    /// Layer `layer`'s routed entries (`ids [bucket, k]`, logical experts) as slots, into `out`
    /// (the step's own copy: a replayed graph maps the same entries again).
    pub fn to_slots(
        &self,
        t: &SlotTable,
        layer: usize,
        (ids, out): (&CudaSlice<i32>, &mut CudaSlice<i32>),
        n: &CudaSlice<i32>,
        (bucket, k): (usize, usize),
    ) -> Result<(), GpuError> {
        assert!(
            ids.len() >= bucket * k && out.len() >= bucket * k,
            "ids smaller than the bucket"
        );
        let (rep, cnt) = (&t.rep[layer], &t.cnt[layer]);
        assert!(rep.len() == t.experts * t.r && cnt.len() == t.experts);
        let (k_, b_, r_, rank) = (k as i32, bucket as i32, t.r as i32, t.rank as i32);
        let mut l = self.stream.launch_builder(&self.k.to_slots);
        l.arg(ids).arg(out).arg(n).arg(&k_).arg(&b_);
        l.arg(rep).arg(cnt).arg(&r_).arg(&rank);
        // SAFETY: `ids` and `out` hold the bucket's bucket * k entries (checked above), those of
        // the step's tokens -1 or a logical expert below `e` (the top-k kernels' and the checked
        // client routing's); `rep` and `cnt` are this layer's e * r and e ints, every count in
        // 1..=r.
        unsafe { l.launch(Self::rows_cfg(bucket * k)) }?;
        Ok(())
    }
}

/// A placement's rewritten slots, on the device beside the ones in use.
pub struct Staged {
    pub epoch: u32,
    pub map: Arc<SlotMap>,
    /// (layer, slot index on this rank, its weights as one group).
    pub slots: Vec<(usize, usize, DeviceFfn)>,
    /// The stream they were uploaded on (their memory is freed on it).
    _stream: Arc<CudaStream>,
}

impl Staged {
    /// Slots already on the device (`epserve bench`'s random ones), freed on `stream`.
    pub fn new(
        epoch: u32,
        map: Arc<SlotMap>,
        slots: Vec<(usize, usize, DeviceFfn)>,
        stream: Arc<CudaStream>,
    ) -> Self {
        Self {
            epoch,
            map,
            slots,
            _stream: stream,
        }
    }

    /// `ffns` uploaded on a stream of their own and waited for (on a staging thread, never the
    /// step's).
    pub fn upload(
        stream: Arc<CudaStream>,
        (epoch, map): (u32, Arc<SlotMap>),
        at: Vec<(usize, usize)>,
        ffns: &[Ffn],
        (hidden, inter, dtype): (usize, usize, ExpertDtype),
    ) -> Result<Self, GpuError> {
        let mut a = Alloc::new(stream.clone());
        let mut slots = Vec::with_capacity(at.len());
        for ((l, i), f) in at.into_iter().zip(ffns) {
            let w = DeviceFfn::upload(&mut a, std::iter::once(f), (hidden, inter), dtype)?;
            slots.push((l, i, w));
        }
        stream.synchronize()?;
        Ok(Self {
            epoch,
            map,
            slots,
            _stream: stream,
        })
    }
}

impl Drop for Mover {
    /// A placement's copies may still read its staged buffers: they go once the copies are done,
    /// or are leaked when the device does not finish them in a few seconds (a failed rank).
    fn drop(&mut self) {
        for (ev, staged, started) in std::mem::take(&mut self.retired) {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let mut polls = 0u32;
            while !ev.try_is_complete().unwrap_or(true) && std::time::Instant::now() < deadline {
                crate::lifecycle::nap(&mut polls);
            }
            match ev.try_is_complete() {
                Ok(true) => drop((staged, started)),
                _ => std::mem::forget(staged),
            }
        }
    }
}

/// What holds the slots' weights and the table the graphs read (the step): where an applied
/// placement lands, layer by layer.
pub trait Land {
    /// Makes `map` the placement the table's rows are written from (`land`).
    fn table_from(&mut self, map: &SlotMap) -> Result<(), GpuError>;
    /// Layer `layer`'s share of `staged` on `stream`: its slots copied over the ones they
    /// rewrite, and its rows of the table. No step of the layer may run meanwhile: the caller
    /// orders `stream` after the layer's last step, and the next after the copies.
    fn land(
        &mut self,
        staged: &Staged,
        layer: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<(), GpuError>;
}

/// Events that time the copies of a placement on the device.
const TIMED: CUevent_flags = CUevent_flags::CU_EVENT_DEFAULT;

/// A moving group's slots on this rank: the placement steps run on, and a new one's weights,
/// read from the model on a thread of their own and uploaded on a stream of their own until a
/// step applies them. Applied, each layer's copies and table rows go on the move stream behind
/// that layer's last step (`used`), so they run under the other layers' steps; the layer's next
/// step waits for them (`landed`), and no other step does.
pub struct Mover {
    pub map: Arc<SlotMap>,
    source: ModelSource,
    spec: MoeSpec,
    dtype: ExpertDtype,
    ctx: Arc<CudaContext>,
    rank: usize,
    staged: Stager<Staged>,
    /// Where applied placements' copies run.
    stream: Arc<CudaStream>,
    /// Per layer: its last step's end on the step stream; its copies' end on `stream`, and
    /// whether its next step must wait for them.
    used: Vec<CudaEvent>,
    landed: Vec<CudaEvent>,
    waiting: Vec<bool>,
    /// Applied placements' staged weights, freed once the copies that read them are done (the
    /// event then the one before them, to log how long the copies took on the device).
    retired: Vec<(CudaEvent, Staged, Option<CudaEvent>)>,
}

impl Mover {
    pub fn new(
        m: Moving,
        spec: MoeSpec,
        dtype: ExpertDtype,
        ctx: Arc<CudaContext>,
        rank: usize,
    ) -> Result<Self, DriverError> {
        // Staged slots are freed after each move: kept in the pool for the next one, not
        // unmapped under a step's synchronize.
        crate::backend::cuda::sys::device::keep_freed(&ctx)?;
        let layers = m.slots.layers().len();
        let events = |n| {
            (0..n)
                .map(|_| ctx.new_event(None))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Self {
            used: events(layers)?,
            landed: events(layers)?,
            waiting: vec![false; layers],
            stream: ctx.new_stream()?,
            map: Arc::new(m.slots),
            source: m.source,
            spec,
            dtype,
            ctx,
            rank,
            staged: Stager::default(),
            retired: Vec::new(),
        })
    }

    /// Loads and uploads the slots `next` rewrites on this rank, off the step path.
    pub fn stage(&mut self, epoch: u32, next: Arc<SlotMap>, done: StageDone) {
        let (at, wanted): (Vec<_>, Vec<_>) =
            rewritten(&self.map, &next, self.rank).into_iter().unzip();
        let (source, spec, dtype) = (self.source.clone(), self.spec.clone(), self.dtype);
        let (ctx, map) = (self.ctx.clone(), next.clone());
        let load = move || {
            let ffns = (source.load_experts(&spec, &wanted, dtype)).map_err(|e| e.to_string())?;
            let bytes = ffns.iter().map(Ffn::bytes).sum::<usize>() as u64;
            let sizes = (spec.hidden, spec.intermediate, dtype);
            let s = (ctx.bind_to_thread().and_then(|_| ctx.new_stream()))
                .map_err(|e| format!("a staging stream: {e}"))?;
            let st = Staged::upload(s, (epoch, map), at, &ffns, sizes)
                .map_err(|e| format!("uploading the staged slots: {e}"))?;
            Ok((st, bytes))
        };
        self.staged.stage(epoch, next, load, done);
    }

    /// Makes what `stage` made for `epoch` the placement steps run on: every layer's copies and
    /// table rows enqueued on the move stream behind that layer's last step.
    pub fn apply(&mut self, epoch: u32, step: &mut impl Land) -> Result<(), String> {
        self.reap();
        let staged = self.staged.take(epoch, self.rank)?.weights;
        let s = self.stream.clone();
        let t0 = std::time::Instant::now();
        let enqueued = (|| -> Result<(CudaEvent, CudaEvent), GpuError> {
            self.ctx.bind_to_thread()?;
            // The table's page-locked rows are rewritten next: an older placement's copies of
            // them are long done, waited for all the same.
            for (ev, _, _) in &self.retired {
                ev.synchronize()?;
            }
            let started = s.record_event(Some(TIMED))?;
            step.table_from(&staged.map)?;
            for l in 0..self.used.len() {
                s.wait(&self.used[l])?;
                step.land(&staged, l, &s)?;
                self.landed[l].record(&s)?;
                self.waiting[l] = true;
            }
            Ok((started, s.record_event(Some(TIMED))?))
        })();
        // Some copies may be enqueued already: the map is the new one either way, and a
        // failure here is a device failure the next step meets.
        self.map = staged.map.clone();
        let (started, copied) = enqueued.map_err(|e| format!("placement epoch {epoch}: {e}"))?;
        tracing::info!(
            epoch,
            slots = staged.slots.len(),
            host_ms = t0.elapsed().as_secs_f64() * 1e3,
            "placement's copies enqueued"
        );
        self.retired.push((copied, staged, Some(started)));
        Ok(())
    }

    /// Layer `layer`'s step is enqueued on `stream` after this: it waits for the layer's copies
    /// of an applied placement, if any.
    pub fn before(&mut self, layer: usize, stream: &CudaStream) -> Result<(), DriverError> {
        if std::mem::take(&mut self.waiting[layer]) {
            stream.wait(&self.landed[layer])?;
        }
        Ok(())
    }

    /// Layer `layer`'s step was enqueued on `stream`: a later placement's copies wait for it.
    pub fn after(&mut self, layer: usize, stream: &CudaStream) -> Result<(), DriverError> {
        self.used[layer].record(stream)
    }

    /// Frees applied placements' staged buffers once their copies are done, on a thread of
    /// their own: freeing a placement's hundreds of buffers is slow (2x H100, 126 slots of a
    /// 4-layer move: the step whose completion freed them took 69-83 ms, 23x its size's
    /// median, while the copies took 1.7 ms on the device). Their memory stays in the device's
    /// pool (`keep_freed`) for the next placement's staging.
    pub fn reap(&mut self) {
        let (done, left): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retired)
            .into_iter()
            .partition(|(ev, _, _)| ev.try_is_complete().unwrap_or(false));
        self.retired = left;
        for (ev, staged, started) in done {
            if let Some(ms) = started.as_ref().and_then(|s| s.elapsed_ms(&ev).ok()) {
                tracing::info!(
                    epoch = staged.epoch,
                    device_ms = ms,
                    "placement's copies done"
                );
            }
            let ctx = self.ctx.clone();
            let freed = std::thread::Builder::new()
                .name("eplb-free".into())
                .spawn(move || {
                    let _ = ctx.bind_to_thread();
                    drop((staged, started, ev));
                });
            if let Err(e) = freed {
                // The closure, and the buffers with it, were dropped here.
                tracing::warn!("could not free a placement's staged buffers off the step: {e}");
            }
        }
    }
}
