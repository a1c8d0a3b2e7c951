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

/// Staged slots whose placement landed, kept for the next placement's staging: freeing a
/// placement's 256 slots (4.8 GB) stalled every thread's driver calls, and with them the
/// steps, for 150-275 ms (2x H100, docs/benchmarks.md "Load balance"), freed at once or
/// paced; kept, a group holds what its largest placement staged, as the pool did.
pub type Spare = Arc<std::sync::Mutex<Vec<DeviceFfn>>>;

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
    /// step's), into `spare` slots where it has them.
    pub fn upload(
        stream: Arc<CudaStream>,
        (epoch, map): (u32, Arc<SlotMap>),
        at: Vec<(usize, usize)>,
        ffns: &[Ffn],
        (hidden, inter, dtype): (usize, usize, ExpertDtype),
        spare: &Spare,
    ) -> Result<Self, GpuError> {
        let mut a = Alloc::new(stream.clone());
        let mut slots = Vec::with_capacity(at.len());
        for ((l, i), f) in at.into_iter().zip(ffns) {
            let kept = spare.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let w = match kept {
                Some(mut w) => {
                    w.upload_into(f, (hidden, inter), &stream)?;
                    w
                }
                None => DeviceFfn::upload(&mut a, std::iter::once(f), (hidden, inter), dtype)?,
            };
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
        if let Some(l) = self.landing.take() {
            // Some of its layers' copies may be enqueued: it goes once they are done.
            match self.stream.record_event(None) {
                Ok(ev) => self.retired.push((ev, l.staged, None)),
                Err(_) => std::mem::forget(l.staged),
            }
        }
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

/// Steps a layer runs on its old slots, when it is the only one left to land, before it lands
/// in front of its own step (which then waits for the copies).
const ALONE: usize = 8;

/// A moving group's slots on this rank: the placement steps run on, and a new one's weights,
/// read from the model on a thread of their own and uploaded on a stream of their own (into
/// `Spare` slots where it has them) until a step applies them. Applied, its layers land one
/// before each later step (`land_beside`): a layer's copies and table rows go on the move stream
/// behind that layer's last step (`used`) and run beside another layer's step; the layer's next
/// step waits for them (`landed`), and no other step does. Until a layer's copies are enqueued
/// its steps run on its old slots, untouched; every rank runs the same steps, so every rank
/// lands a layer at the same step. One layer at a time, not in front of its own step: a whole
/// placement enqueued at once held the step thread 3-4 ms (256 slots), and a layer landed in
/// front of its own step made that step wait for its copies (1.4-2.4x its median; 2x H100,
/// docs/benchmarks.md "Load balance").
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
    /// Landed placements' staged slots, for the next one's (`Spare`).
    spare: Spare,
    /// The applied placement whose layers are still landing, and the layer of the last step.
    landing: Option<Landing>,
    last: Option<usize>,
    /// Applied placements' staged weights, freed once the copies that read them are done (the
    /// event then the one before them, to log how long the copies took on the device).
    retired: Vec<(CudaEvent, Staged, Option<CudaEvent>)>,
}

/// An applied placement's staged weights and the layers whose copies are not enqueued yet.
struct Landing {
    staged: Staged,
    left: Vec<bool>,
    /// Steps run since only their own layer was left to land.
    alone: usize,
    /// Recorded on the move stream when it was applied: the copies' device time is from here.
    started: CudaEvent,
    applied: std::time::Instant,
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
            spare: Spare::default(),
            landing: None,
            last: None,
            retired: Vec::new(),
        })
    }

    /// Loads and uploads the slots `next` rewrites on this rank, off the step path.
    pub fn stage(&mut self, epoch: u32, next: Arc<SlotMap>, done: StageDone) {
        let (at, wanted): (Vec<_>, Vec<_>) =
            rewritten(&self.map, &next, self.rank).into_iter().unzip();
        let (source, spec, dtype) = (self.source.clone(), self.spec.clone(), self.dtype);
        let (ctx, map, spare) = (self.ctx.clone(), next.clone(), self.spare.clone());
        let load = move || {
            let t0 = std::time::Instant::now();
            let ffns = (source.load_experts(&spec, &wanted, dtype)).map_err(|e| e.to_string())?;
            let loaded = t0.elapsed();
            let bytes = ffns.iter().map(Ffn::bytes).sum::<usize>() as u64;
            let sizes = (spec.hidden, spec.intermediate, dtype);
            let s = (ctx.bind_to_thread().and_then(|_| ctx.new_stream()))
                .map_err(|e| format!("a staging stream: {e}"))?;
            let st = Staged::upload(s, (epoch, map), at, &ffns, sizes, &spare)
                .map_err(|e| format!("uploading the staged slots: {e}"))?;
            let uploaded = t0.elapsed();
            drop(ffns);
            tracing::info!(
                epoch,
                bytes,
                load_ms = loaded.as_secs_f64() * 1e3,
                upload_ms = (uploaded - loaded).as_secs_f64() * 1e3,
                host_free_ms = (t0.elapsed() - uploaded).as_secs_f64() * 1e3,
                "placement staged"
            );
            Ok((st, bytes))
        };
        self.staged.stage(epoch, next, load, done);
    }

    /// Makes what `stage` made for `epoch` the placement steps run on: its table's rows ready,
    /// its layers to land one per step (`after`), or before their own next step (`before`).
    pub fn apply(&mut self, epoch: u32, step: &mut impl Land) -> Result<(), String> {
        self.reap();
        // A placement still landing lands whole first: the table's rows are rewritten next.
        let flushed = self.land_all(step);
        let staged = self.staged.take(epoch, self.rank)?.weights;
        let s = self.stream.clone();
        let begun = (|| -> Result<CudaEvent, GpuError> {
            flushed?;
            self.ctx.bind_to_thread()?;
            // The table's page-locked rows are rewritten next: an older placement's copies of
            // them are enqueued (above) and waited for.
            for (ev, _, _) in &self.retired {
                ev.synchronize()?;
            }
            step.table_from(&staged.map)?;
            Ok(s.record_event(Some(TIMED))?)
        })();
        // No layer's copies are enqueued yet: a failure leaves the old placement in use.
        let started = begun.map_err(|e| format!("placement epoch {epoch}: {e}"))?;
        self.map = staged.map.clone();
        self.landing = Some(Landing {
            left: vec![true; self.used.len()],
            alone: 0,
            staged,
            started,
            applied: std::time::Instant::now(),
        });
        Ok(())
    }

    /// A step of layer `layer` is about to be enqueued: one other layer of a placement landing
    /// lands now, its copies beside that step (the one run last first: its next step is the
    /// furthest off); this layer itself only when no other is left and it has run `ALONE`
    /// steps since (one busy layer must wait once). Called before the step's first enqueue, so
    /// the copies' enqueueing (1-2 ms of host a layer) runs while the steps in flight do.
    pub fn land_beside(&mut self, layer: usize, step: &mut impl Land) -> Result<(), GpuError> {
        let last = self.last;
        let pick = self.landing.as_mut().and_then(|l| {
            let other = |x: usize| x != layer && l.left[x];
            match last.filter(|&x| other(x)) {
                Some(x) => Some(x),
                None => (0..l.left.len()).find(|&x| other(x)).or_else(|| {
                    l.alone += 1;
                    (l.left[layer] && l.alone > ALONE).then_some(layer)
                }),
            }
        });
        match pick {
            Some(x) => self.land(x, step),
            None => Ok(()),
        }
    }

    /// Layer `layer`'s step is enqueued on `stream` after this. It runs on the placement its
    /// layer has: a layer still to land keeps its old slots and table, whole, until its copies
    /// are enqueued; a layer landed waits for its copies here.
    pub fn before(&mut self, layer: usize, stream: &CudaStream) -> Result<(), DriverError> {
        if std::mem::take(&mut self.waiting[layer]) {
            stream.wait(&self.landed[layer])?;
        }
        Ok(())
    }

    /// Layer `layer`'s step was enqueued on `stream`: a later placement's copies wait for it.
    pub fn after(&mut self, layer: usize, stream: &CudaStream) -> Result<(), DriverError> {
        self.last = Some(layer);
        self.used[layer].record(stream)
    }

    /// Enqueues layer `layer`'s copies and table rows behind its last step; the placement is
    /// retired once its last layer's are.
    fn land(&mut self, layer: usize, step: &mut impl Land) -> Result<(), GpuError> {
        let s = self.stream.clone();
        let l = self.landing.as_mut().expect("a placement is landing");
        l.left[layer] = false;
        s.wait(&self.used[layer])?;
        step.land(&l.staged, layer, &s)?;
        self.landed[layer].record(&s)?;
        self.waiting[layer] = true;
        if l.left.iter().any(|&x| x) {
            return Ok(());
        }
        let l = self.landing.take().expect("checked above");
        tracing::info!(
            epoch = l.staged.epoch,
            slots = l.staged.slots.len(),
            after_ms = l.applied.elapsed().as_secs_f64() * 1e3,
            "placement's copies enqueued, a layer under each step"
        );
        self.retired
            .push((s.record_event(Some(TIMED))?, l.staged, Some(l.started)));
        Ok(())
    }

    /// Every layer still to land, now.
    fn land_all(&mut self, step: &mut impl Land) -> Result<(), GpuError> {
        while let Some(l) = (self.landing.as_ref()).and_then(|l| l.left.iter().position(|&x| x)) {
            self.land(l, step)?;
        }
        Ok(())
    }

    /// Keeps applied placements' staged slots once their copies are done, for the next
    /// placement's staging (`Spare`): neither freed nor allocated again. Freeing them stalled
    /// steps (2x H100: 69-83 ms on the step thread; 150-275 ms for a 256-slot placement on a
    /// thread of its own, paced or not).
    pub fn reap(&mut self) {
        let (done, left): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retired)
            .into_iter()
            .partition(|(ev, _, _)| ev.try_is_complete().unwrap_or(false));
        self.retired = left;
        for (ev, staged, started) in done {
            if let Some(ms) = started.as_ref().and_then(|s| s.elapsed_ms(&ev).ok()) {
                // From the apply to the last layer's copies: its layers' steps between them.
                tracing::info!(
                    epoch = staged.epoch,
                    span_ms = ms,
                    "placement's copies done"
                );
            }
            let mut staged = staged;
            let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
            spare.extend(staged.slots.drain(..).map(|(_, _, w)| w));
            drop((staged, started, ev));
        }
    }
}
