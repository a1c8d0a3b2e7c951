//! The CPU backend: every rank owns one persistent shared-memory segment, created at startup and
//! sized for the worst step, which peers map and write into one-sidedly. Each phase writes, then
//! raises a per-source flag with the step's sequence number; readers wait for the flags of every
//! source, so no step can read another's data. A peer on another node gets the same writes and
//! raises over its data connection (`nodes::mirror`), applied there to its own segment. f32
//! math; GEMMs through ndarray (matrixmultiply), the experts' blocks spread over the rank's lanes
//! (`math`).

mod math;
pub mod phases;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};

pub use math::default_lanes;
use math::Lanes;
use phases::{run_phases, AllToAll, Experts, Gating, StepIo};

use crate::eplb::stage::{rewritten, Stager};
use crate::eplb::{pick, SlotMap};
use crate::lifecycle::Abort;
use crate::model::routing::Router;
use crate::model::{Ffn, ModelSource, MoeSpec, RankWeights};
use crate::nodes::mirror::{DataLink, Target};
use crate::nodes::plane::DataLinks;
use crate::nodes::Roster;
use crate::step::ring::{Output, Ring};
use crate::step::{Backend, PhaseTimes, StageDone, StepDesc, StepError};
use crate::sys::shm::{wait_seq, Pod, Shm};

const LINE: usize = 64;

/// Per-rank segment layout, identical on every rank.
#[derive(Clone, Copy, Debug)]
pub struct SegmentShape {
    pub world: usize,
    /// Expert slots per layer, over all ranks (`eplb::SlotMap::slots`).
    pub slots: usize,
    pub top_k: usize,
    pub hidden: usize,
    /// Most home tokens per rank per step.
    pub max_home: usize,
}

#[derive(Clone, Copy)]
enum Flag {
    Counts = 0,
    Dispatch = 1,
    Combine = 2,
}

impl SegmentShape {
    /// Worst-case rows one rank receives: every source sends each of its tokens to at most
    /// min(k, its slots) of this rank's slots (a token's k experts are distinct, and each row
    /// goes to one replica).
    pub fn recv_rows(&self) -> usize {
        self.world * self.max_home * self.top_k.min(self.slots / self.world)
    }
    fn flag(&self, kind: Flag, src: usize) -> usize {
        (kind as usize * self.world + src) * LINE
    }
    fn counts(&self, src: usize) -> usize {
        3 * self.world * LINE + src * self.slots * 4
    }
    fn meta(&self, row: usize) -> usize {
        (self.counts(self.world)).next_multiple_of(LINE) + row * 12
    }
    fn rows(&self, row: usize) -> usize {
        self.meta(self.recv_rows()).next_multiple_of(LINE) + row * self.hidden * 4
    }
    fn combine(&self, token: usize, k: usize) -> usize {
        self.rows(self.recv_rows()).next_multiple_of(LINE)
            + (token * self.top_k + k) * self.hidden * 4
    }
    pub fn bytes(&self) -> usize {
        self.combine(self.max_home, 0).next_multiple_of(LINE)
    }
}

/// The ranks a step's phases write to and wait for: all but its lost ones.
fn live(desc: &StepDesc, world: usize) -> impl Iterator<Item = usize> + '_ {
    (0..world).filter(|&r| !desc.is_lost(r))
}

pub fn segment_path(dir: &Path, group: &str, rank: usize) -> PathBuf {
    dir.join(format!("epserve-{group}-rank{rank}"))
}

/// This rank's own segment (always mapped: it is created here).
fn own_of(segs: &[Peer], rank: usize) -> &Shm {
    match &segs[rank] {
        Peer::Mapped(s) => s,
        Peer::Linked(_) => unreachable!("rank {rank}'s own segment is mapped by attach"),
    }
}

/// Where a peer's segment is written: mapped here (same node), or over its data connection.
enum Peer {
    Mapped(Shm),
    Linked(Arc<DataLink>),
}

impl Peer {
    fn write<T: Pod>(&self, off: usize, src: &[T]) {
        match self {
            Peer::Mapped(s) => s.write(off, src),
            Peer::Linked(l) => l.write(Target::Segment, off, src),
        }
    }
    /// Raises the flag at `off`; Err: the data connection failed (now or at an earlier write).
    fn raise(&self, off: usize, seq: u64) -> Result<(), String> {
        match self {
            Peer::Mapped(s) => {
                crate::sys::shm::raise(s.flag(off), seq);
                Ok(())
            }
            Peer::Linked(l) => l.raise(Target::Segment, off, seq),
        }
    }
}

pub struct CpuRank {
    rank: usize,
    shape: SegmentShape,
    spec: MoeSpec,
    /// One entry per slot of this rank, per layer (`weights.layers[l].experts[i]` is slot
    /// `map.slots_of(rank).start + i`).
    weights: RankWeights,
    map: Arc<SlotMap>,
    /// Per rank: on this rank's node (routing prefers replicas there).
    near: Vec<bool>,
    /// Where a moved slot's weights are read again from.
    source: ModelSource,
    /// A placement's rewritten slots, loaded off the step path until a step applies them:
    /// (layer, this rank's slot index, weights).
    staged: Stager<Vec<(usize, usize, Ffn)>>,
    /// Every rank's segment by rank: mapped (this node's; this rank's own is what peers write
    /// into and all it reads, `own_of`) or linked (another node's).
    segs: Vec<Peer>,
    /// Where the node's segments are (a rejoining rank's is mapped again from there).
    dir: PathBuf,
    group: String,
    ring: Arc<Ring>,
    abort: Arc<Abort>,
    step_timeout: Duration,
    deadline: Instant,
    s: Scratch,
    lanes: Lanes,
    /// Steps run and not yet completed, with each one's routing (`[world, slots]`): this
    /// backend runs each step whole in `submit`.
    done: std::collections::VecDeque<(PhaseTimes, Vec<u32>)>,
    /// The routing of the last step completed (`routed`), and buffers to reuse for the next.
    completed: Vec<u32>,
    spare: Vec<Vec<u32>>,
}

/// A block of one local expert's received rows, run by one lane.
struct Block {
    expert: usize,
    first: usize,
    rows: usize,
}

/// Host scratch, sized at startup for the worst step and never grown.
struct Scratch {
    x: Vec<f32>,
    ids: Vec<i32>,
    w: Vec<f32>,
    logits: Vec<f32>,
    /// Rows per slot from this rank, this step.
    counts: Vec<u32>,
    /// Each (token, k) row's slot.
    slot_ids: Vec<u32>,
    /// Rows per logical expert picked so far this step (spreads them over its replicas).
    nth: Vec<u32>,
    matrix: Vec<u32>,
    next_row: Vec<usize>,
    /// This step's expert blocks (capacity for the worst step, kept).
    blocks: Vec<Block>,
    out: Vec<f32>,
    /// The home rows as the ring carries them (any wire dtype), before widening or after
    /// narrowing.
    wire: Vec<u8>,
    router: Router,
}

impl CpuRank {
    /// Creates this rank's segment (zero-filled: every flag starts at step 0).
    pub fn create_segment(
        dir: &Path,
        group: &str,
        rank: usize,
        shape: SegmentShape,
    ) -> std::io::Result<Shm> {
        let path = segment_path(dir, group, rank);
        match Shm::create(&path, shape.bytes()) {
            // This rank of this group ran before, and was killed: a rank rejoining replaces
            // its old file (its peers map the new one).
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                std::fs::remove_file(&path)?;
                Shm::create(&path, shape.bytes())
            }
            r => r,
        }
    }

    /// Maps the segment of every peer of its node, takes the links to the others, and builds
    /// the rank; `own` came from `create_segment`. The experts' math runs on `lanes` threads.
    #[allow(clippy::too_many_arguments)]
    pub fn attach(
        dir: &Path,
        group: &str,
        rank: usize,
        own: Shm,
        (roster, links): (&Roster, &DataLinks),
        shape: SegmentShape,
        spec: MoeSpec,
        (weights, map, source): (RankWeights, SlotMap, ModelSource),
        ring: Arc<Ring>,
        abort: Arc<Abort>,
        step_timeout: Duration,
        lanes: usize,
    ) -> std::io::Result<Self> {
        let mut own = Some(own);
        let segs = (0..shape.world)
            .map(|r| match links.to(r) {
                Some(l) => Ok(Peer::Linked(l.clone())),
                None if r == rank => Ok(Peer::Mapped(own.take().expect("own segment"))),
                None if roster.same_node(r, rank) => Ok(Peer::Mapped(Shm::open(
                    &segment_path(dir, group, r),
                    shape.bytes(),
                )?)),
                None => Err(std::io::Error::other(format!(
                    "no data connection to rank {r} on node {}",
                    roster.node(r)
                ))),
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        let (t, h, k, e) = (shape.max_home, shape.hidden, shape.top_k, spec.num_experts);
        let inter = spec.intermediate.max(spec.shared_intermediate);
        let lanes = Lanes::new(lanes, h, inter, weights.dtype)?;
        if map.slots() != shape.slots || map.world != shape.world {
            return Err(std::io::Error::other(format!(
                "{} slots over {} ranks, the segment holds {} over {}",
                map.slots(),
                map.world,
                shape.slots,
                shape.world
            )));
        }
        let local = map.per_rank();
        let cells = ring.shape.cells;
        let s = Scratch {
            x: vec![0.0; t * h],
            ids: vec![0; t * k],
            w: vec![0.0; t * k],
            logits: vec![0.0; t * e],
            counts: vec![0; shape.slots],
            slot_ids: vec![0; t * k],
            nth: vec![0; e],
            matrix: vec![0; shape.world * shape.slots],
            next_row: vec![0; shape.slots],
            // At most one partial block per expert; the others hold at least `block_rows(1)`
            // rows, the fewest any step cuts to.
            blocks: Vec::with_capacity(local + shape.recv_rows().div_ceil(lanes.block_rows(1))),
            out: vec![0.0; t * h],
            wire: vec![0; t * h * 4],
            router: Router::default(),
        };
        Ok(Self {
            rank,
            near: (0..shape.world)
                .map(|r| roster.same_node(r, rank))
                .collect(),
            map: Arc::new(map),
            source,
            staged: Stager::default(),
            shape,
            spec,
            weights,
            segs,
            dir: dir.to_path_buf(),
            group: group.to_string(),
            ring,
            abort,
            step_timeout,
            deadline: Instant::now(),
            s,
            lanes,
            done: std::collections::VecDeque::with_capacity(cells),
            completed: vec![0; shape.world * shape.slots],
            spare: vec![vec![0; shape.world * shape.slots]; cells],
        })
    }

    fn wait_all(&self, desc: &StepDesc, kind: Flag, what: &'static str) -> Result<(), StepError> {
        let own = own_of(&self.segs, self.rank);
        for src in live(desc, self.shape.world) {
            wait_seq(
                own.flag(self.shape.flag(kind, src)),
                desc.step,
                self.deadline,
                &self.abort,
            )
            .map_err(|source| StepError::Wait {
                step: desc.step,
                what,
                rank: src,
                source,
            })?;
        }
        Ok(())
    }

    fn raise(&self, peer: usize, kind: Flag, step: u64) -> Result<(), StepError> {
        self.segs[peer]
            .raise(self.shape.flag(kind, self.rank), step)
            .map_err(|msg| StepError::DataLink { step, msg })
    }

    /// The row where `src`'s rows for each of `dest`'s slots start in `dest`'s receive buffer:
    /// slot-major, sources in rank order.
    fn layout(&self, dest: usize, src: usize, out: &mut [usize]) {
        let (n, m) = (self.shape.slots, &self.s.matrix);
        let mut start = 0;
        for (i, slot) in self.map.slots_of(dest).enumerate() {
            let before: u32 = (0..src).map(|s| m[s * n + slot]).sum();
            out[i] = start + before as usize;
            start += (0..self.shape.world)
                .map(|s| m[s * n + slot] as usize)
                .sum::<usize>();
        }
    }
}

impl StepIo for CpuRank {
    fn load_home(
        &mut self,
        desc: &StepDesc,
        home: std::ops::Range<usize>,
    ) -> Result<(), StepError> {
        self.deadline = Instant::now() + self.step_timeout;
        let (cell, n, h, k) = (
            desc.cell as usize,
            home.len(),
            self.shape.hidden,
            self.shape.top_k,
        );
        if n > self.shape.max_home {
            return Err(StepError::Invalid {
                step: desc.step,
                msg: format!("{n} home tokens exceed the buffers"),
            });
        }
        self.ring
            .wait_input(cell, desc.step, self.deadline, &self.abort)?;
        // The one conversion of the input: the wire dtype, widened to f32 here.
        let wire = &mut self.s.wire[..n * h * desc.input.bytes()];
        self.ring.read_hidden(cell, home.clone(), desc.input, wire);
        crate::dtype::to_f32(desc.input, wire, &mut self.s.x[..n * h]);
        if desc.client_routing {
            self.ring
                .read_routing(cell, home, &mut self.s.ids[..n * k], &mut self.s.w[..n * k]);
            let e = self.spec.num_experts as i32;
            if let Some(bad) = self.s.ids[..n * k]
                .iter()
                .find(|&&id| !(0..e).contains(&id))
            {
                return Err(StepError::Invalid {
                    step: desc.step,
                    msg: format!("expert id {bad} out of range"),
                });
            }
        }
        Ok(())
    }

    fn store_home(
        &mut self,
        desc: &StepDesc,
        home: std::ops::Range<usize>,
    ) -> Result<(), StepError> {
        let n = home.len() * self.shape.hidden;
        let wire = &mut self.s.wire[..n * desc.output.bytes()];
        crate::dtype::from_f32(desc.output, &self.s.out[..n], wire);
        self.ring
            .write_output(&Output::of(desc, self.rank, home), wire)
            .map_err(|msg| StepError::DataLink {
                step: desc.step,
                msg,
            })
    }
}

impl Gating for CpuRank {
    /// On the step's thread: too little math to pay for waking the lanes (measured, 16 cores:
    /// gating 42-78 µs on them against 22-44 µs here, docs/benchmarks.md).
    fn gate(&mut self, desc: &StepDesc, n: usize) -> Result<(), StepError> {
        let (h, e, k) = (self.shape.hidden, self.spec.num_experts, self.shape.top_k);
        let layer = &self.weights.layers[desc.layer as usize];
        let s = &mut self.s;
        let xa = ArrayView2::from_shape((n, h), &s.x[..n * h]).expect("x shape");
        let ra = ArrayView2::from_shape((e, h), &layer.router).expect("router shape");
        let mut la =
            ArrayViewMut2::from_shape((n, e), &mut s.logits[..n * e]).expect("logits shape");
        general_mat_mul(1.0, &xa, &ra.t(), 0.0, &mut la);
        for t in 0..n {
            s.router.route(
                &self.spec.routing,
                &s.logits[t * e..(t + 1) * e],
                layer.bias.as_deref(),
                &mut s.ids[t * k..(t + 1) * k],
                &mut s.w[t * k..(t + 1) * k],
            );
        }
        Ok(())
    }
}

impl AllToAll for CpuRank {
    /// Each row's slot (one replica of its expert), then an all-gather of per-slot counts:
    /// every rank learns the whole [source, slot] matrix.
    fn prepare(&mut self, desc: &StepDesc, n: usize) -> Result<(), StepError> {
        let (slots, k) = (self.shape.slots, self.shape.top_k);
        let (map, near, rank) = (&self.map, &self.near, self.rank);
        let layer = map.layer(desc.layer as usize);
        let s = &mut self.s;
        s.counts.fill(0);
        s.nth.fill(0);
        for (i, &id) in s.ids[..n * k].iter().enumerate() {
            let g = id as usize;
            let slot = pick(layer.replicas(g), s.nth[g] as usize, rank, |slot| {
                near[map.rank_of(slot as usize)]
            });
            s.nth[g] += 1;
            s.slot_ids[i] = slot;
            s.counts[slot as usize] += 1;
        }
        for peer in live(desc, self.shape.world) {
            self.segs[peer].write(self.shape.counts(self.rank), &self.s.counts);
            self.raise(peer, Flag::Counts, desc.step)?;
        }
        self.wait_all(desc, Flag::Counts, "routing counts")?;
        own_of(&self.segs, self.rank).read(
            self.shape.counts(0),
            &mut self.s.matrix[..self.shape.world * slots],
        );
        // A lost rank's row holds whatever it wrote last: it sends nothing now.
        for src in desc.lost.iter().map(|&r| r as usize) {
            self.s.matrix[src * slots..(src + 1) * slots].fill(0);
        }
        Ok(())
    }

    /// Each (token, k) row goes to its slot's block in the slot's rank's receive buffer.
    fn dispatch(&mut self, desc: &StepDesc, n: usize) -> Result<(), StepError> {
        let (h, k, local) = (self.shape.hidden, self.shape.top_k, self.map.per_rank());
        let mut next = std::mem::take(&mut self.s.next_row);
        for dest in 0..self.shape.world {
            self.layout(dest, self.rank, &mut next[dest * local..(dest + 1) * local]);
        }
        for t in 0..n {
            for j in 0..k {
                let slot = self.s.slot_ids[t * k + j] as usize;
                let dest = self.map.rank_of(slot);
                let row = next[slot];
                next[slot] += 1;
                let seg = &self.segs[dest];
                seg.write(self.shape.rows(row), &self.s.x[t * h..(t + 1) * h]);
                seg.write(
                    self.shape.meta(row),
                    &[self.rank as i32, t as i32, j as i32],
                );
            }
        }
        self.s.next_row = next;
        for dest in live(desc, self.shape.world) {
            self.raise(dest, Flag::Dispatch, desc.step)?;
        }
        self.wait_all(desc, Flag::Dispatch, "dispatched tokens")
    }

    /// Home side: weighted sum of the k expert outputs each token got back, plus shared experts.
    fn combine(&mut self, desc: &StepDesc, n: usize) -> Result<(), StepError> {
        for peer in live(desc, self.shape.world) {
            self.raise(peer, Flag::Combine, desc.step)?;
        }
        self.wait_all(desc, Flag::Combine, "combined rows")?;
        let (h, k, shape) = (self.shape.hidden, self.shape.top_k, self.shape);
        let own = own_of(&self.segs, self.rank);
        let shared = self.weights.layers[desc.layer as usize].shared.as_ref();
        let (x, w) = (&self.s.x, &self.s.w);
        // The weighted sums alone are too little math for the lanes (one block: this thread);
        // a shared expert is an FFN over every home token.
        let per = match shared {
            Some(_) => self.lanes.block_rows(n),
            None => n.max(1),
        };
        let blocks = self.s.out[..n * h].chunks_mut(per * h).enumerate();
        self.lanes.each(blocks, |(b, block), lane| {
            let first = b * per;
            let row = &mut lane.rows[..h];
            for (i, out) in block.chunks_exact_mut(h).enumerate() {
                let t = first + i;
                out.fill(0.0);
                for j in 0..k {
                    own.read(shape.combine(t, j), row);
                    let w = w[t * k + j];
                    out.iter_mut()
                        .zip(row.iter())
                        .for_each(|(o, &r)| *o += w * r);
                }
            }
            if let Some(shared) = shared {
                let m = block.len() / h;
                lane.forward_from(shared, &x[first * h..(first + m) * h], m, h);
                block
                    .iter_mut()
                    .zip(&lane.y[..m * h])
                    .for_each(|(o, &y)| *o += y);
            }
        });
        Ok(())
    }
}

impl Experts for CpuRank {
    /// Cuts each local slot's received rows into blocks, runs the blocks over the lanes, and
    /// writes each output row into its home rank's combine buffer at (token, k).
    fn compute(&mut self, desc: &StepDesc) -> Result<(), StepError> {
        let (h, n, shape) = (self.shape.hidden, self.shape.slots, self.shape);
        let mut blocks = std::mem::take(&mut self.s.blocks);
        blocks.clear();
        let totals = |slot: usize| -> usize {
            (0..shape.world)
                .map(|src| self.s.matrix[src * n + slot] as usize)
                .sum()
        };
        let all: usize = self.map.slots_of(self.rank).map(totals).sum();
        let per = self.lanes.block_rows(all);
        let mut start = 0;
        for (expert, slot) in self.map.slots_of(self.rank).enumerate() {
            let total = totals(slot);
            for first in (start..start + total).step_by(per) {
                let rows = per.min(start + total - first);
                blocks.push(Block {
                    expert,
                    first,
                    rows,
                });
            }
            start += total;
        }
        let experts = &self.weights.layers[desc.layer as usize].experts;
        let segs = &self.segs;
        let own = own_of(segs, self.rank);
        self.lanes.each(blocks.iter(), |b, lane| {
            let m = b.rows;
            own.read(shape.rows(b.first), &mut lane.rows[..m * h]);
            own.read(shape.meta(b.first), &mut lane.meta[..m * 3]);
            lane.forward(&experts[b.expert], m, h);
            for (r, meta) in lane.meta[..m * 3].chunks_exact(3).enumerate() {
                let (src, t, j) = (meta[0] as usize, meta[1] as usize, meta[2] as usize);
                segs[src].write(shape.combine(t, j), &lane.y[r * h..(r + 1) * h]);
            }
        });
        self.s.blocks = blocks;
        Ok(())
    }
}

impl Backend for CpuRank {
    /// Every peer has mapped this rank's segment: its file can go.
    fn group_started(&self) {
        own_of(&self.segs, self.rank).unlink();
    }

    fn submit(&mut self, desc: &StepDesc, home: std::ops::Range<usize>) -> Result<(), StepError> {
        let times = run_phases(self, desc, home)?;
        let mut routed = self.spare.pop().unwrap_or_default();
        routed.clone_from(&self.s.matrix);
        self.done.push_back((times, routed));
        Ok(())
    }

    fn ready(&mut self) -> Result<bool, StepError> {
        Ok(!self.done.is_empty())
    }

    fn complete(&mut self) -> Result<PhaseTimes, StepError> {
        let Some((times, mut routed)) = self.done.pop_front() else {
            return Ok(PhaseTimes::default());
        };
        std::mem::swap(&mut self.completed, &mut routed);
        self.spare.push(routed);
        Ok(times)
    }

    fn depth(&self) -> usize {
        self.ring.shape.cells
    }

    fn routed(&self) -> &[u32] {
        &self.completed
    }

    /// Reads the experts of this rank's rewritten slots again from the model source on a thread
    /// of its own (the checkpoint every rank can read, or the synthetic seed), exactly as they
    /// were loaded at startup.
    fn stage(&mut self, epoch: u32, next: Arc<SlotMap>, done: StageDone) {
        let (at, wanted): (Vec<_>, Vec<_>) =
            rewritten(&self.map, &next, self.rank).into_iter().unzip();
        let (source, spec, dtype) = (self.source.clone(), self.spec.clone(), self.weights.dtype);
        let load = move || {
            let ffns = (source.load_experts(&spec, &wanted, dtype)).map_err(|e| e.to_string())?;
            let bytes = ffns.iter().map(Ffn::bytes).sum::<usize>() as u64;
            let slots: Vec<_> = at
                .into_iter()
                .zip(ffns)
                .map(|((l, i), f)| (l, i, f))
                .collect();
            Ok((slots, bytes))
        };
        self.staged.stage(epoch, next, load, done);
    }

    fn apply(&mut self, epoch: u32) -> Result<(), String> {
        let s = self.staged.take(epoch, self.rank)?;
        for (l, i, ffn) in s.weights {
            self.weights.layers[l].experts[i] = ffn;
        }
        self.map = s.map;
        Ok(())
    }

    /// Maps the segment a restarted rank made (on this node; its old mapping goes).
    fn rejoin(&mut self, rank: usize, _nccl_id: Option<&[u8]>) -> Result<(), String> {
        match self.segs.get(rank) {
            Some(Peer::Mapped(_)) if rank != self.rank => {}
            _ => return Err(format!("rank {rank} is not a peer of this node")),
        }
        let path = segment_path(&self.dir, &self.group, rank);
        let seg = Shm::open(&path, self.shape.bytes())
            .map_err(|e| format!("mapping {}: {e}", path.display()))?;
        self.segs[rank] = Peer::Mapped(seg);
        Ok(())
    }

    fn buffers(&self) -> Vec<(&'static str, usize, usize)> {
        let v = |name, p: *const u8, len| (name, p as usize, len);
        let s = &self.s;
        let mut out: Vec<_> = (self.segs.iter())
            .filter_map(|p| match p {
                Peer::Mapped(seg) => Some(("exchange_segment", seg.addr(), seg.len())),
                Peer::Linked(_) => None,
            })
            .collect();
        out.push(self.ring.buffer());
        out.extend([
            v("home_x", s.x.as_ptr().cast(), s.x.capacity()),
            v("home_out", s.out.as_ptr().cast(), s.out.capacity()),
        ]);
        out.extend(self.lanes.buffers());
        out
    }
}
