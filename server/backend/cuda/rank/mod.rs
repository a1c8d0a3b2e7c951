//! The `nccl` backend's rank: a `GpuStep` fed straight from the host step ring (registered with
//! the driver once, so its rows are copied by DMA in their wire dtype and converted on the GPU),
//! one CUDA graph per (layer, bucket, routing source) captured at startup and replayed, and every
//! wait on the GPU bounded by the step timeout (a lost peer would otherwise hang NCCL forever).
//! Two steps may be in flight: the rows move on copy streams of their own, so the next step's
//! input comes in, and the last one's output goes out, while a step computes.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result, CudaEvent, DevicePtr};

use crate::backend::cuda::placement::Mover;
use crate::backend::cuda::step::{GpuStep, HomeDtype, Variant};
use crate::backend::cuda::sys::graph::Graph;
use crate::backend::cuda::sys::memory::{direct_in, direct_out, ring_in, ring_out, RingPin};
use crate::backend::cuda::transfer::{pack_rows, unpack_rows, Copies, Staging, DEPTH};
use crate::backend::cuda::GpuError;
use crate::dtype::Dtype;
use crate::eplb::SlotMap;
use crate::lifecycle::Abort;
use crate::metric_names;
use crate::step::direct::{pieces, DirectRun};
use crate::step::ring::{Output, Ring};
use crate::step::{Backend, EnqueueParts, PhaseTimes, StageDone, StepDesc, StepError};

mod regroup;
mod timing;

use timing::Marks;

/// The device memory gauge is read at most this often, after a step's answer is out:
/// `cuMemGetInfo` is a call into the driver on the rank's thread, before the next step's
/// launch. 5.8 µs median on 2x H200 (session 65, where reading it every step or once a second
/// made no measured difference to the steps), 8 ms on some machines (sglang#25225).
const MEMORY_EVERY: Duration = Duration::from_secs(1);

/// Waits for `ev` until `started + bound`, spinning briefly, then sleeping in short naps; a
/// group that halts (a peer is gone) ends the wait at once where `abort` is given.
pub(in crate::backend::cuda) fn wait_event(
    ev: &CudaEvent,
    started: Instant,
    bound: Duration,
    abort: Option<&Abort>,
) -> Result<(), GpuError> {
    let deadline = started + bound;
    let mut polls = 0u32;
    loop {
        if ev.try_is_complete()? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(GpuError::Timeout(bound));
        }
        if let Some(why) = abort.and_then(|a| a.stop_reason()) {
            return Err(GpuError::Halted(why));
        }
        crate::lifecycle::nap(&mut polls);
    }
}

pub struct GpuRank {
    /// Where slots move: the placement, and a new one's staged weights. First, so it is dropped
    /// first: its copies into the step's weights finish before they are freed.
    mover: Option<Mover>,
    /// None once poisoned: a failed step leaks the device state rather than free memory a hung
    /// kernel may still touch (the process is about to exit).
    core: Option<GpuStep>,
    /// One set per step in flight. Dropped only while not poisoned and idle: a copy into it may
    /// still be in flight otherwise.
    st: Vec<Staging>,
    copies: Copies,
    /// Before `ring`, so it is unregistered before the ring is unmapped; None once poisoned.
    pinned: Option<RingPin>,
    ring: Arc<Ring>,
    /// Home-token capacities, ascending; the last is the largest a step can need.
    buckets: Vec<usize>,
    /// `[layer][bucket][Variant::index]`, when graphs are on.
    graphs: Vec<Option<Graph>>,
    /// The compute stream's end, for the eager warm-up steps.
    synced: CudaEvent,
    /// Each staging set's step has reached the ring (recorded on the copy-out stream).
    done: Vec<CudaEvent>,
    /// Each staging set's step's timing events on the compute stream.
    marks: Vec<Marks>,
    /// Steps submitted and not yet completed, oldest first.
    flight: std::collections::VecDeque<Submitted>,
    /// Steps a halt ended (a peer is gone) whose work may still wait on the device for it:
    /// `regroup` aborts the communicator, which releases them, and waits for them.
    stuck: Vec<Submitted>,
    /// The device memory gauge's last read (`MEMORY_EVERY`).
    memory_read: Option<Instant>,
    /// Whether steps are replayed from captured graphs (`regroup` captures them again).
    use_graphs: bool,
    /// Whether each graph records events between its phases (`--step-phase-times`).
    phase_times: bool,
    /// Whether this rank warmed up and captured its graphs (a rank coming back does so at the
    /// roster that has it live, with the others).
    primed: bool,
    /// The communicator with a rank coming back, being joined on a thread of its own (NCCL
    /// init blocks until every rank has joined): taken at the roster that has it live.
    growing: Option<regroup::Growing>,
    /// The staging set the next step takes (they alternate: steps complete in order).
    next_set: usize,
    routed: Vec<u32>,
    /// Rows the routing sent each local expert this step (the receive check's side), kept so
    /// the per-step check allocates nothing.
    routed_local: Vec<i64>,
    step_timeout: Duration,
    /// The group broken: ends a wait for a step's input from another node.
    abort: Arc<Abort>,
}

/// A step submitted on the GPU.
struct Submitted {
    step: u64,
    /// Its cell and output rows in the ring, announced when it completes.
    output: Output,
    tokens: usize,
    bucket: usize,
    set: usize,
    started: Instant,
    /// The host's time from the step's start event to its graph launched and the copies of its
    /// counts behind it enqueued.
    enqueue: Duration,
    /// The host's context switches while enqueueing it (voluntary, involuntary).
    switches: (u64, u64),
    /// Of `enqueue`, each part's host time (`EnqueueParts`).
    parts: EnqueueParts,
    /// The graph it replayed (`graphs`' index), None when launched eagerly.
    graph: Option<usize>,
    /// The client memory its copies read and write, held open until it completes.
    _direct: Vec<DirectRun>,
}

/// What enqueueing a step gave: the client memory its copies use, the host's time and context
/// switches (voluntary, involuntary) from its start event to its last copy enqueued, the graph
/// it replayed.
struct Launched {
    runs: Vec<DirectRun>,
    enqueue: Duration,
    switches: (u64, u64),
    parts: EnqueueParts,
    graph: Option<usize>,
}

impl GpuRank {
    /// Warms every bucket up eagerly, once per leader (NCCL connects, and cuBLAS picks and loads
    /// each GEMM's kernel, on first use: never inside a capture), then captures each graph.
    /// Every rank calls this in lockstep: the warm-up steps communicate.
    pub fn new(
        core: GpuStep,
        ring: Arc<Ring>,
        buckets: Vec<usize>,
        (graphs, phase_times): (bool, bool),
        step_timeout: Duration,
        abort: Arc<Abort>,
        mover: Option<Mover>,
    ) -> Result<Self, GpuError> {
        // Not primed here: the caller does, with every rank (`prime`), or the roster that has
        // a rank coming back live does (`regroup`).
        let s = core.shape;
        let t = s.max_home;
        if buckets.last() != Some(&t) || buckets.windows(2).any(|w| w[0] >= w[1]) {
            return Err(GpuError::Config(format!(
                "buckets {buckets:?} must ascend to the largest home slice ({t})"
            )));
        }
        core.g.ctx.bind_to_thread()?;
        let st = (0..DEPTH)
            .map(|_| Staging::new(&s))
            .collect::<Result<Vec<_>, _>>()?;
        let done = (0..DEPTH)
            .map(|_| core.g.ctx.new_event(None))
            .collect::<Result<Vec<_>, _>>()?;
        let synced = core.g.ctx.new_event(None)?;
        let marks = (0..DEPTH)
            .map(|_| Marks::new(&core))
            .collect::<Result<Vec<_>, _>>()?;
        let copies = Copies::new(&core)?;
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
            st,
            copies,
            pinned,
            ring,
            buckets,
            graphs: Vec::new(),
            synced,
            done,
            marks,
            flight: std::collections::VecDeque::with_capacity(DEPTH),
            stuck: Vec::new(),
            memory_read: None,
            use_graphs: graphs,
            phase_times,
            primed: false,
            growing: None,
            next_set: 0,
            step_timeout,
            abort,
            mover,
        };
        if let Some(f) = me.core().ex.footprint() {
            // Present (at zero) from the start, so a dashboard can alert on any increase.
            for mode in ["ll", "ht"] {
                if f.modes.contains(mode) {
                    metrics::counter!(metric_names::EP_RECV_OVERFLOW_TOTAL, "mode" => mode)
                        .absolute(0);
                    metrics::counter!(metric_names::EP_RECV_MISMATCH_TOTAL, "mode" => mode)
                        .absolute(0);
                }
            }
        }
        Ok(me)
    }

    /// Warms every bucket up and captures the graphs (collective: every rank in the
    /// communicator at once, in the same order).
    pub(in crate::backend::cuda) fn prime(&mut self) -> Result<(), GpuError> {
        let layers = self.core().layers.len();
        for bucket in self.buckets.clone() {
            for rows in [HomeDtype::F32, HomeDtype::Bf16] {
                self.eager(0, 0, bucket, Variant::new(rows, false))?;
                self.finish(Instant::now(), Duration::from_secs(60))?;
            }
        }
        if self.use_graphs {
            for layer in 0..layers {
                for bucket in self.buckets.clone() {
                    for v in Variant::ALL {
                        let g = self.capture(layer, bucket, v)?;
                        self.graphs.push(Some(g));
                    }
                }
            }
        }
        self.primed = true;
        Ok(())
    }

    fn core(&mut self) -> &mut GpuStep {
        self.core.as_mut().expect("the GPU rank is poisoned")
    }

    /// One step's small copies and phases, launched one by one (no graph).
    fn eager(
        &mut self,
        set: usize,
        layer: usize,
        bucket: usize,
        v: Variant,
    ) -> Result<(), GpuError> {
        let c = self.core.as_mut().expect("the GPU rank is poisoned");
        let st = &mut self.st[set];
        st.copy_in(c, bucket, v)?;
        c.run(layer, bucket, v)?;
        st.copy_out(c, bucket)?;
        Ok(())
    }

    /// One step's graph, with the events it records between its phases where they are timed
    /// (`Graph::marks`).
    fn capture(&mut self, layer: usize, bucket: usize, v: Variant) -> Result<Graph, GpuError> {
        let c = self.core.as_mut().expect("the GPU rank is poisoned");
        let marks = match self.phase_times {
            true => {
                let e = || c.g.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
                Some([e()?, e()?, e()?, e()?])
            }
            false => None,
        };
        let mut phased = false;
        let g = c.capture(|c| {
            phased = c.run_marked(layer, bucket, v, marks.as_ref())?;
            Ok(())
        })?;
        // Once, for the largest step: what its replay asks of the driver (a host node would
        // stall the GPU until a driver thread runs it).
        if layer == 0 && Some(&bucket) == self.buckets.last() && v.index() == 0 {
            if let Ok(kinds) = crate::backend::cuda::sys::graph::node_kinds(&g) {
                tracing::info!(bucket, ?kinds, "a step's graph nodes");
            }
        }
        Ok(Graph::new(g, marks.filter(|_| phased)))
    }

    /// Waits for everything enqueued on the compute stream so far, until `bound` after `started`.
    fn finish(&mut self, started: Instant, bound: Duration) -> Result<(), GpuError> {
        let stream = self.core().g.stream.clone();
        self.synced.record(&stream)?;
        wait_event(&self.synced, started, bound, None)
    }

    /// After a failed step: abort the communicator (a hung NCCL kernel would block any other
    /// teardown) and leak the device state rather than free memory a kernel may still touch
    /// (the process is about to exit).
    fn poison(&mut self) {
        if let Some(c) = self.core.take() {
            let GpuStep {
                g,
                ex,
                mut comm,
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
            // So is the staging (empty from here: every use of it checks `core` first).
            std::mem::forget(std::mem::take(&mut self.st));
        }
    }

    /// What the exchange received against what the routing sent (this step's all-gathered
    /// counts), for an exchange that can differ (NCCL EP), each micro-batch's where the step
    /// split: a step that fails the check is counted by the exchange, and its output is not
    /// delivered.
    fn check_receive(&mut self, step: u64, bucket: usize, set: usize) -> Result<(), StepError> {
        let Some(c) = self.core.as_ref() else {
            return Ok(());
        };
        let s = &c.shape;
        let (l, e) = (s.local(), s.experts);
        let (tallies, st) = (c.tallies(bucket), &self.st[set]);
        for (t, got) in tallies.iter().flatten().zip(&st.tallies) {
            if t.ex.receipts().is_none() {
                continue;
            }
            let m = got.m.as_slice();
            // Rows each local expert was sent, over every source.
            for (j, r) in self.routed_local.iter_mut().enumerate() {
                *r = (0..s.world)
                    .map(|src| i64::from(m[src * e + s.rank * l + j].max(0)))
                    .sum();
            }
            let counts = &got.recv.as_slice()[..l];
            (t.ex.verify(
                t.bucket,
                &self.routed_local,
                counts,
                got.total.as_slice()[0],
            ))
            .map_err(|msg| {
                tracing::error!(step, "{msg}");
                StepError::Corrupt { step, msg }
            })?;
        }
        Ok(())
    }

    /// The smallest bucket holding `most_home` rows (every rank's home fits it).
    fn bucket_of(&self, most_home: usize) -> Option<usize> {
        self.buckets.iter().position(|&b| b >= most_home.max(1))
    }

    /// A device failure: the rank is poisoned and the step fails.
    fn failed(&mut self, step: u64, e: GpuError) -> StepError {
        self.poison();
        StepError::Device {
            step,
            source: Box::new(e),
        }
    }

    /// A step that did not finish, for want of a peer (past its bound, or ended by a halt):
    /// its work stays on the device, and the rank's state with it, until `regroup` aborts the
    /// communicator (or the process exits: `Drop` poisons).
    fn unfinished(&mut self, f: Submitted, e: GpuError) -> StepError {
        let step = f.step;
        self.stuck.push(f);
        match e {
            GpuError::Timeout(after) => StepError::Timeout { step, after },
            GpuError::Halted(why) => StepError::Wait {
                step,
                what: "the GPU step",
                rank: self.core.as_ref().map_or(0, |c| c.shape.rank),
                source: crate::sys::shm::WaitError::Aborted(why),
            },
            e => self.failed(step, e),
        }
    }

    /// Checks the step and fills the next staging set; the bucket's index and the set.
    fn stage(&mut self, desc: &StepDesc, home: &Range<usize>) -> Result<(usize, usize), StepError> {
        let invalid = |msg: String| StepError::Invalid {
            step: desc.step,
            msg,
        };
        if self.flight.len() >= DEPTH {
            return Err(invalid(format!("{DEPTH} steps in flight already")));
        }
        let (cell, n) = (desc.cell as usize, home.len());
        let bi = self
            .bucket_of(desc.most_home(self.ring.shape.world))
            .ok_or_else(|| invalid(format!("{} tokens exceed the buffers", desc.tokens)))?;
        let deadline = Instant::now() + self.step_timeout;
        self.ring
            .wait_input(cell, desc.step, deadline, &self.abort)?;
        let c = self
            .core
            .as_ref()
            .ok_or_else(|| invalid("the GPU rank failed".into()))?;
        // The executor thread is not the one that created the context.
        c.g.ctx
            .bind_to_thread()
            .map_err(|e| invalid(format!("binding the CUDA context: {e}")))?;
        let (k, e, layers) = (c.shape.top_k, c.shape.model_experts, c.layers.len());
        if desc.layer as usize >= layers {
            return Err(invalid(format!("layer {} is not loaded", desc.layer)));
        }
        let set = self.next_set;
        let st: &mut Staging = &mut self.st[set];
        if desc.client_routing {
            self.ring.read_routing(
                cell,
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
        Ok((bi, set))
    }

    /// Enqueues the whole step: its rows into the inbox on the copy-in stream (behind the step
    /// before's use of it), the step on the compute stream, its output through the outbox on the
    /// copy-out stream; then `done[set]`. Also the host's time from the step's start event to
    /// its graph and its counts' copies enqueued.
    fn launch(
        &mut self,
        desc: &StepDesc,
        home: Range<usize>,
        bi: usize,
        set: usize,
    ) -> Result<Launched, GpuError> {
        let (cell, n, layer) = (desc.cell as usize, home.len(), desc.layer as usize);
        let bucket = self.buckets[bi];
        let rows = match desc.input {
            Dtype::Bf16 => HomeDtype::Bf16,
            _ => HomeDtype::F32,
        };
        let v = Variant::new(rows, desc.client_routing);
        if let (Some(m), Some(c)) = (&mut self.mover, &mut self.core) {
            m.land_beside(layer, c)?;
        }
        let ring = self.ring.clone();
        let cp = &self.copies;
        let c = self.core.as_mut().expect("checked in stage");
        let s = c.g.stream.clone();
        // Rows in a client's device memory come from there; the rest from the ring.
        let runs = ring.direct.within(cell, &home);
        let (in_row, out_row) = (
            c.shape.hidden * desc.input.bytes(),
            c.shape.hidden * desc.output.bytes(),
        );
        cp.h2d.wait(&cp.inbox_free)?;
        for (rows, span) in pieces(home.clone(), &runs, |r| r.input.as_ref()) {
            let at = (rows.start - home.start) * in_row;
            match span {
                Some(span) => direct_in(span, &mut c.b.inbox, at, &cp.h2d)?,
                None => ring_in(
                    ring.hidden_span(cell, rows, desc.input),
                    &mut c.b.inbox,
                    at,
                    &cp.h2d,
                )?,
            }
        }
        cp.inbox_full.record(&cp.h2d)?;
        s.wait(&cp.inbox_full)?;
        unpack_rows(c, n, desc.input)?;
        let began = Instant::now();
        let switches = crate::sys::thread_switches();
        let mk = &self.marks[set];
        mk.began.record(&s)?;
        if let Some(m) = &mut self.mover {
            m.before(layer, &s)?;
        }
        if self.core.as_ref().is_some_and(|c| c.splits(bucket)) {
            metrics::counter!(metric_names::TWO_BATCH_STEPS_TOTAL).increment(1);
        }
        mk.launched.record(&s)?;
        let at_before = began.elapsed();
        let st = &mut self.st[set];
        let c = self.core.as_mut().expect("checked in stage");
        st.copy_in(c, bucket, v)?;
        mk.copied.record(&s)?;
        // The next step's rows wait for these small copies too: on one copy engine they would
        // queue behind its rows (docs/benchmarks.md "Load balance", session 56).
        self.copies.inbox_free.record(&s)?;
        let at_in = began.elapsed();
        let graph = match self.graphs.is_empty() {
            true => {
                c.run(layer, bucket, v)?;
                None
            }
            false => {
                let per_bucket = Variant::ALL.len();
                let g = (layer * self.buckets.len() + bi) * per_bucket + v.index();
                self.graphs[g]
                    .as_ref()
                    .expect("captured at startup")
                    .launch()?;
                Some(g)
            }
        };
        let at_graph = began.elapsed();
        mk.computed.record(&s)?;
        st.copy_out(c, bucket)?;
        let enqueue = began.elapsed();
        let parts = EnqueueParts {
            before: at_before,
            copy_in: at_in - at_before,
            graph: at_graph - at_in,
            copy_out: enqueue - at_graph,
        };
        let now = crate::sys::thread_switches();
        let switches = (now.0 - switches.0, now.1 - switches.1);
        if let Some(m) = &mut self.mover {
            m.after(layer, &s)?;
        }
        self.marks[set].ended.record(&s)?;
        let cp = &self.copies;
        let c = self.core.as_mut().expect("checked in stage");
        s.wait(&cp.outbox_free)?;
        pack_rows(c, n, desc.output)?;
        cp.outbox_full.record(&s)?;
        cp.d2h.wait(&cp.outbox_full)?;
        for (rows, span) in pieces(home.clone(), &runs, |r| r.output.as_ref()) {
            let at = (rows.start - home.start) * out_row;
            match span {
                Some(span) => direct_out(&c.b.outbox, at, span, &cp.d2h)?,
                None => ring_out(
                    &c.b.outbox,
                    at,
                    ring.output_span(cell, rows, desc.output),
                    &cp.d2h,
                )?,
            }
        }
        cp.outbox_free.record(&cp.d2h)?;
        self.done[set].record(&cp.d2h)?;
        Ok(Launched {
            runs,
            enqueue,
            switches,
            parts,
            graph,
        })
    }
}

impl Backend for GpuRank {
    fn submit(&mut self, desc: &StepDesc, home: Range<usize>) -> Result<(), StepError> {
        let started = Instant::now();
        let (bi, set) = self.stage(desc, &home)?;
        let rank = self.core.as_ref().map_or(0, |c| c.shape.rank);
        let output = Output::of(desc, rank, home.clone());
        let Launched {
            runs: direct,
            enqueue,
            switches,
            parts,
            graph,
        } = match self.launch(desc, home, bi, set) {
            Ok(launched) => launched,
            Err(e) => return Err(self.failed(desc.step, e)),
        };
        self.next_set = (set + 1) % DEPTH;
        self.flight.push_back(Submitted {
            step: desc.step,
            output,
            tokens: desc.tokens as usize,
            bucket: self.buckets[bi],
            set,
            started,
            enqueue,
            switches,
            parts,
            graph,
            _direct: direct,
        });
        Ok(())
    }

    fn ready(&mut self) -> Result<bool, StepError> {
        let Some(f) = self.flight.front() else {
            return Ok(false);
        };
        let step = f.step;
        match self.done[f.set].try_is_complete() {
            Ok(r) => Ok(r),
            Err(e) => Err(self.failed(step, e.into())),
        }
    }

    fn complete(&mut self) -> Result<PhaseTimes, StepError> {
        let f = self.flight.pop_front().ok_or(StepError::Invalid {
            step: 0,
            msg: "no step in flight".into(),
        })?;
        if self.core.is_none() {
            return Err(StepError::Invalid {
                step: f.step,
                msg: "the GPU rank failed".into(),
            });
        }
        if let Err(e) = wait_event(
            &self.done[f.set],
            f.started,
            self.step_timeout,
            Some(&self.abort),
        ) {
            return Err(self.unfinished(f, e));
        }
        self.routed.fill(0);
        for t in self.st[f.set].tallies.iter().filter(|t| t.bucket > 0) {
            for (r, &m) in self.routed.iter_mut().zip(t.m.as_slice()) {
                *r += m.max(0) as u32;
            }
        }
        self.check_receive(f.step, f.bucket, f.set)?;
        if let Some(m) = &mut self.mover {
            m.reap();
        }
        // The rows went into the ring by DMA before the step's completion event.
        self.ring
            .publish_output(&f.output)
            .map_err(|msg| StepError::DataLink { step: f.step, msg })?;
        // Whole-device use, so an allocation by anyone in the process (NCCL included) shows.
        if self.memory_read.is_none_or(|t| t.elapsed() >= MEMORY_EVERY) {
            self.memory_read = Some(Instant::now());
            if let Ok((free, total)) = result::mem_get_info() {
                metrics::gauge!(metric_names::DEVICE_MEMORY_USED_BYTES).set((total - free) as f64);
            }
        }
        let world = self.ring.shape.world;
        // A graph's marks hold its last replay's: unless a step still in flight replays it.
        let inside = f
            .graph
            .filter(|&g| self.flight.iter().all(|n| n.graph != Some(g)))
            .and_then(|g| self.graphs[g].as_ref()?.marks());
        let t = self.marks[f.set].times(inside);
        Ok(PhaseTimes {
            total: f.started.elapsed(),
            padding: (f.bucket * world).saturating_sub(f.tokens),
            enqueue: Some(f.enqueue),
            enqueue_switches: Some(f.switches),
            enqueue_parts: Some(f.parts),
            ..t
        })
    }

    fn depth(&self) -> usize {
        DEPTH
    }

    fn routed(&self) -> &[u32] {
        &self.routed
    }

    fn stage(&mut self, epoch: u32, next: Arc<SlotMap>, done: StageDone) {
        match &mut self.mover {
            Some(m) => m.stage(epoch, next, done),
            None => done(Err(format!(
                "placement epoch {epoch}: this group's slots do not move (start it with \
                 --redundant-experts, --placement or --eplb-interval)"
            ))),
        }
    }

    /// The staged placement becomes current: each layer's slots and table are copied in on the
    /// mover's stream behind that layer's steps in flight, and its next step waits for them.
    fn apply(&mut self, epoch: u32) -> Result<(), String> {
        let m = (self.mover.as_mut()).ok_or("this group's slots do not move")?;
        let c = self.core.as_mut().ok_or("the GPU rank failed")?;
        m.apply(epoch, c)
    }

    fn rejoin_id(&self) -> Result<Option<Vec<u8>>, String> {
        crate::backend::cuda::sys::nccl::new_id().map(Some)
    }

    fn rejoin(&mut self, rank: usize, nccl_id: Option<&[u8]>) -> Result<(), String> {
        self.grow(rank, nccl_id).map_err(|e| e.to_string())
    }

    fn regroup(&mut self, lost: &[u32]) -> Result<(), String> {
        self.regroup_now(lost).map_err(|e| {
            self.poison();
            e.to_string()
        })
    }

    fn ep_footprint(&self) -> Option<crate::step::EpFootprint> {
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
        // A step still in flight may be copying into the staging or the ring: leave them be.
        if !self.flight.is_empty() || !self.stuck.is_empty() {
            self.poison();
        }
        // Graphs go before the buffers and communicator they reference.
        self.graphs.clear();
        // Before the step's context: nothing is in flight (every step's completion event was
        // waited for), so no copy touches the staging. Poisoned, it was leaked already.
        drop(std::mem::take(&mut self.st));
    }
}
