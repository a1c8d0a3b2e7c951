//! Applying a placement on a GPU rank: its slots staged off the step path, then landed layer
//! by layer on a stream of their own between steps (`Mover`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};

use super::{Land, Spare, Staged, Write};
use crate::backend::cuda::GpuError;
use crate::backend::device::Moving;
use crate::eplb::copy_order::{CopyOrder, Part, StepCopies};
use crate::eplb::parts::{plan, Plan};
use crate::eplb::sources::{ops, Op};
use crate::eplb::stage::Stager;
use crate::eplb::SlotMap;
use crate::model::{ExpertDtype, Ffn, ModelSource, MoeSpec};
use crate::step::StageDone;

/// Events that time the copies of a placement on the device.
const TIMED: CUevent_flags = CUevent_flags::CU_EVENT_DEFAULT;

/// Experts a staging thread loads, uploads and frees at a time.
const STAGE_BATCH: usize = 8;

/// A moving group's slots on this rank: the placement steps run on, and a new one's weights.
/// A rewritten slot whose expert a slot of this rank holds is copied from it as it lands
/// (`eplb::sources`); the rest are read from the model on a thread of their own and uploaded
/// on a stream of their own (into `Spare` slots where it has them) until a step applies them.
/// Applied, its layers land one
/// before each later step (`land_beside`): a layer's copies and table rows go on the move stream
/// behind that layer's last step (`used`) and run beside another layer's step; the layer's next
/// step waits for them (`landed`), and no other step does. Until a layer's copies are enqueued
/// its steps run on its old slots, untouched; every rank runs the same steps, so every rank
/// lands a layer at the same step. One layer at a time, not in front of its own step: a whole
/// placement enqueued at once held the step thread 3-4 ms (256 slots), and a layer landed in
/// front of its own step made that step wait for its copies (1.4-2.4x its median; 2x H100,
/// docs/benchmarks.md "Load balance"). With `--eplb-step-copies SIZE` a layer lands in parts
/// of about that size a rank (`parts::plan`), one beside each step, each part started when the
/// step before it has ended (`CopyOrder`), each with the table's rows for what has landed: a
/// layer partly landed runs on it, and its next step waits for its last part only. Parts
/// started with the experts of the step beside them, or put behind the step before, made the
/// steps beside them 1.04x and 1.01x their medians against 1.00x (one H200, 128 MiB parts;
/// docs/benchmarks.md "Load balance", session 62).
pub struct Mover {
    pub map: Arc<SlotMap>,
    source: ModelSource,
    spec: MoeSpec,
    dtype: ExpertDtype,
    ctx: Arc<CudaContext>,
    rank: usize,
    /// Bytes of one slot's weights: how many slots a part takes (`--eplb-step-copies`).
    slot_bytes: u64,
    staged: Stager<Ready>,
    /// Where applied placements' copies run (kernels, like the steps'). The steps' streams at
    /// the greatest priority did not make fewer steps beside them run over 1.1x (2x H200,
    /// docs/benchmarks.md "Load balance", session 63).
    stream: Arc<CudaStream>,
    /// How much of them may start beside one step (`--eplb-step-copies`).
    step_copies: StepCopies,
    /// Recorded on the step stream before a part: the part starts once the steps before it end.
    paced: CudaEvent,
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
    /// Applied placements' staged weights, kept as `spare` once the copies that read them are
    /// done (the event then the one before them, to log how long the copies took).
    retired: Vec<(CudaEvent, Staged, Option<CudaEvent>)>,
}

/// Per layer, per part: this rank's writes, in order.
type Writes = Vec<Vec<Vec<Write>>>;

/// Per slot to stage, its (layer, index on the rank), or the (layer, logical expert) it takes.
type Pairs = Vec<(usize, usize)>;

/// A placement staged against `base` (the placement in use when it was asked for): its parts,
/// this rank's writes in each (`eplb::sources`), and the slots no slot here held, staged from
/// the model source.
struct Ready {
    staged: Staged,
    base: Arc<SlotMap>,
    plan: Plan,
    writes: Writes,
}

/// An applied placement's staged weights and the copies not enqueued yet.
struct Landing {
    staged: Staged,
    /// The slots it writes on this rank.
    slots: usize,
    order: CopyOrder<Write>,
    /// Recorded on the move stream when it was applied: the copies' device time is from here.
    started: CudaEvent,
    applied: Instant,
}

impl Mover {
    pub fn new(
        m: Moving,
        spec: MoeSpec,
        dtype: ExpertDtype,
        ctx: Arc<CudaContext>,
        (rank, slot_bytes): (usize, u64),
    ) -> Result<Self, DriverError> {
        // Staged slots are kept (`Spare`); what a failed staging allocated is freed into the
        // pool and kept there, not unmapped under a step's synchronize.
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
            step_copies: m.step_copies,
            paced: ctx.new_event(None)?,
            map: Arc::new(m.slots),
            source: m.source,
            spec,
            dtype,
            ctx,
            rank,
            slot_bytes,
            staged: Stager::default(),
            spare: Spare::default(),
            landing: None,
            last: None,
            retired: Vec::new(),
        })
    }

    /// Plans the slots `next` rewrites on this rank, and loads and uploads those that no slot
    /// here holds: all on a thread of its own, off the step path.
    pub fn stage(&mut self, epoch: u32, next: Arc<SlotMap>, done: StageDone) {
        let (source, spec, dtype) = (self.source.clone(), self.spec.clone(), self.dtype);
        let (ctx, map, spare) = (self.ctx.clone(), next.clone(), self.spare.clone());
        let (base, rank, slot_bytes) = (self.map.clone(), self.rank, self.slot_bytes);
        // The same parts on every rank: the cap in slots comes from the slot's size.
        let cap = self.step_copies.slots(slot_bytes);
        let load = move || {
            let plan = plan(&base, &map, cap);
            let (writes, at, wanted) = writes(&base, &map, &plan, rank);
            let cycle = writes.iter().flatten().flatten().any(Write::saves);
            let slots = slots_written(&writes);
            tracing::info!(
                epoch,
                staged = at.len(),
                from_slots_here = slots - at.len(),
                "placement's slots: staged from the model, or copied from slots of this rank"
            );
            let stream = (ctx.bind_to_thread().and_then(|_| ctx.new_stream()))
                .map_err(|e| format!("a staging stream: {e}"))?;
            let mut st = Staged::begin(stream, (epoch, map));
            let sizes = (spec.hidden, spec.intermediate, dtype);
            if cycle {
                st.add_cycle(sizes, &spare)
                    .map_err(|e| format!("a slot for cycles of copies: {e}"))?;
            }
            let staged = in_batches(st, &at, &wanted, (&source, &spec, dtype), &spare)?;
            let ready = Ready {
                staged,
                base,
                plan,
                writes,
            };
            // What the slots take, staged or copied here (the leader's moved bytes).
            Ok((ready, slots as u64 * slot_bytes))
        };
        self.staged.stage(epoch, next, load, done);
    }

    /// Makes what `stage` made for `epoch` the placement steps run on: its table's rows ready,
    /// its layers to land one before each later step (`land_beside`).
    pub fn apply(&mut self, epoch: u32, step: &mut impl Land) -> Result<(), String> {
        self.reap();
        // A placement still landing lands whole first: the table's rows are rewritten next.
        let flushed = self.land_all(step);
        let ready = self.staged.take(epoch, self.rank)?.weights;
        let (staged, plan) = (ready.staged, ready.plan);
        if !Arc::ptr_eq(&ready.base, &self.map) {
            // No copy reads them: kept for a later staging, not freed under the steps.
            staged.keep_in(&self.spare);
            return Err(format!(
                "placement epoch {epoch}: staged on rank {} against another placement than the \
                 one in use",
                self.rank
            ));
        }
        let s = self.stream.clone();
        let begun = (|| -> Result<CudaEvent, GpuError> {
            flushed?;
            self.ctx.bind_to_thread()?;
            // The table's page-locked rows are rewritten next: an older placement's copies of
            // them are enqueued (above) and waited for.
            for (ev, _, _) in &self.retired {
                ev.synchronize()?;
            }
            step.table_from(&self.map, &staged.map, &plan)?;
            Ok(s.record_event(Some(TIMED))?)
        })();
        // No layer's copies are enqueued yet: a failure leaves the old placement in use.
        let started = begun.map_err(|e| format!("placement epoch {epoch}: {e}"))?;
        // A placement after a lost rank lands now, whole, in front of the next step: a layer
        // left on its old table would route rows to the lost rank's slots.
        let recovery = staged.map.lost() != self.map.lost();
        self.map = staged.map.clone();
        self.landing = Some(Landing {
            slots: slots_written(&ready.writes),
            order: CopyOrder::new(ready.writes, self.step_copies.0.is_some()),
            staged,
            started,
            applied: Instant::now(),
        });
        if recovery {
            self.land_all(step)
                .map_err(|e| format!("placement epoch {epoch}: {e}"))?;
        }
        Ok(())
    }

    /// A step of layer `layer` is about to be enqueued: what `CopyOrder` puts beside it (a
    /// layer of a placement landing, or a part of one, the one run last first) lands now, its
    /// copies beside that step. Called before the step's first enqueue, so the copies' enqueueing
    /// (1-2 ms of host a layer) runs while the steps in flight do.
    pub fn land_beside(&mut self, layer: usize, step: &mut impl Land) -> Result<(), GpuError> {
        let last = self.last;
        match self
            .landing
            .as_mut()
            .and_then(|l| l.order.beside(layer, last))
        {
            Some(p) => self.land(p, step),
            None => Ok(()),
        }
    }

    /// Layer `layer`'s step is enqueued on `stream` after this. It runs on the placement its
    /// layer has: a layer still to land keeps its old slots and table until its first part is
    /// enqueued; then each step waits here for the last part enqueued and the rows with it.
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

    /// Enqueues part `p`'s copies behind its layer's last step (and, in parts, behind the
    /// steps enqueued so far), then the layer's table rows with the part landed; the layer's
    /// next step waits for them. The placement is retired once every part is enqueued.
    fn land(&mut self, p: Part<Write>, step: &mut impl Land) -> Result<(), GpuError> {
        let s = self.stream.clone();
        let l = self.landing.as_mut().expect("a placement is landing");
        s.wait(&self.used[p.layer])?;
        if l.order.parted() {
            self.paced.record(step.steps())?;
            s.wait(&self.paced)?;
        }
        step.copy(&mut l.staged, &p.slots, &s)?;
        step.rows(p.layer, p.version, &s)?;
        self.landed[p.layer].record(&s)?;
        self.waiting[p.layer] = true;
        if !l.order.done() {
            return Ok(());
        }
        let l = self.landing.take().expect("checked above");
        tracing::info!(
            epoch = l.staged.epoch,
            slots = l.slots,
            after_ms = l.applied.elapsed().as_secs_f64() * 1e3,
            "placement's copies enqueued, a part beside each step"
        );
        self.retired
            .push((s.record_event(Some(TIMED))?, l.staged, Some(l.started)));
        Ok(())
    }

    /// Every layer still to land, now.
    fn land_all(&mut self, step: &mut impl Land) -> Result<(), GpuError> {
        while let Some(p) = self.landing.as_mut().and_then(|l| l.order.next_part()) {
            self.land(p, step)?;
        }
        Ok(())
    }

    /// Keeps applied placements' staged slots once their copies are done, for the next
    /// placement's staging (`Spare`): neither freed nor allocated again. Freeing them stalled
    /// steps (2x H100: 69-83 ms on the step thread; 122-275 ms for a 256-slot placement on a
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
            staged.keep_in(&self.spare);
        }
    }
}

/// `rank`'s writes from `cur` to `next` in each of `plan`'s parts, and the slots to stage, in
/// the order of `Write::Staged`'s indices: each one's (layer, index on the rank), and the
/// (layer, logical expert) each takes.
fn writes(cur: &SlotMap, next: &SlotMap, plan: &Plan, rank: usize) -> (Writes, Pairs, Pairs) {
    let first = cur.slots_of(rank).start;
    let (mut at, mut wanted) = (Vec::new(), Vec::new());
    let mut write = |layer: usize, op| match op {
        Op::Load(i) => {
            at.push((layer, i));
            wanted.push((layer, next.layer(layer).phy2log()[first + i] as usize));
            Write::Staged(at.len() - 1)
        }
        Op::Copy { from, to } => Write::Copy { layer, from, to },
        Op::Save(from) => Write::Save { layer, from },
        Op::Restore(to) => Write::Restore { layer, to },
    };
    let mut writes = Vec::new();
    for (layer, parts) in ops(cur, next, plan, rank).into_iter().enumerate() {
        let parts = parts.into_iter();
        writes.push(
            parts
                .map(|p| p.into_iter().map(|op| write(layer, op)).collect())
                .collect(),
        );
    }
    (writes, at, wanted)
}

/// The slots `writes` write (a `Save` writes the spare slot).
fn slots_written(writes: &Writes) -> usize {
    let all = writes.iter().flatten().flatten();
    all.filter(|w| !w.saves()).count()
}

/// `st` given the slots `at` with the weights of the experts `wanted`, a few at a time: the
/// host holds one batch, not the placement (4.8 GB of f32 for 256 slots of a bf16 Qwen3-30B
/// layer set), and frees it in small pieces.
fn in_batches(
    mut st: Staged,
    at: &[(usize, usize)],
    wanted: &[(usize, usize)],
    (source, spec, dtype): (&ModelSource, &MoeSpec, ExpertDtype),
    spare: &Spare,
) -> Result<Staged, String> {
    let t0 = Instant::now();
    let (mut loaded, mut freed) = (Duration::ZERO, Duration::ZERO);
    let mut bytes = 0u64;
    let sizes = (spec.hidden, spec.intermediate, dtype);
    let mut batches = at.chunks(STAGE_BATCH).zip(wanted.chunks(STAGE_BATCH));
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let all = batches.try_for_each(|(at, wanted)| {
        let t = Instant::now();
        let ffns = (source.load_experts(spec, wanted, dtype)).map_err(|e| e.to_string())?;
        let load = t.elapsed();
        bytes += ffns.iter().map(Ffn::bytes).sum::<usize>() as u64;
        st.add(at, &ffns, sizes, spare)
            .map_err(|e| format!("uploading the staged slots: {e}"))?;
        let upload = t.elapsed() - load;
        drop(ffns);
        let free = t.elapsed() - load - upload;
        (loaded, freed) = (loaded + load, freed + free);
        // Each batch's phases, ending now, for `eplb-steps.py` to set beside the steps' gaps
        // (RUST_LOG=epserve::staging=trace; off by default).
        tracing::trace!(target: "epserve::staging", epoch = st.epoch, slots = at.len(),
            load_ms = ms(load), upload_ms = ms(upload), free_ms = ms(free), "batch staged");
        Ok::<_, String>(())
    });
    if let Err(e) = all {
        // What was staged goes back to the spares, not freed under the steps, once its copies
        // are done (the next staging writes over them on another stream).
        if let Ok(st) = st.finish() {
            st.keep_in(spare);
        }
        return Err(e);
    }
    let st = (st.finish()).map_err(|e| format!("uploading the staged slots: {e}"))?;
    tracing::info!(
        epoch = st.epoch,
        bytes,
        load_ms = ms(loaded),
        upload_ms = ms(t0.elapsed() - loaded - freed),
        host_free_ms = ms(freed),
        "placement staged"
    );
    Ok(st)
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
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut polls = 0u32;
            while !ev.try_is_complete().unwrap_or(true) && Instant::now() < deadline {
                crate::lifecycle::nap(&mut polls);
            }
            match ev.try_is_complete() {
                Ok(true) => drop((staged, started)),
                _ => std::mem::forget(staged),
            }
        }
    }
}
