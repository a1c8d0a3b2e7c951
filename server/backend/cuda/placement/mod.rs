//! Expert slots on the device: the table gating reads to send each (token, expert) entry to one
//! of the expert's replicas (`to_slots`, inside the captured graphs), and a new placement's
//! weights, from slots of this rank that hold them or staged beside the ones in use, copied over
//! the slots it rewrites, a part at a time beside the other layers' steps, on a stream of their
//! own, each part with the table's rows for what has landed (`Mover`, `eplb::parts`,
//! `eplb::sources`). The graphs read the table and the weights where they are, so a placement
//! is rewritten in place and no graph is captured again. From the gate on, the exchanges and
//! the experts address slots (`StepShape::experts`), the router logical experts
//! (`StepShape::model_experts`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DriverError, PushKernelArg};

use crate::backend::cuda::experts::DeviceFfn;
use crate::backend::cuda::sys::memory::{htod, Pinned};
use crate::backend::cuda::{Alloc, Gpu, GpuError};
use crate::eplb::parts::{midway, Plan};
use crate::eplb::SlotMap;
use crate::model::{ExpertDtype, Ffn};

mod mover;
pub use mover::Mover;

/// Per layer, per logical expert, the slots this rank's tokens may use (`[experts][r]`, by
/// `SlotMap::replica_table`) and how many (`[experts]`); one device buffer per layer, each
/// written from page-locked rows of its own, so a layer's new rows go in without a host wait.
/// A placement landing in parts has a version of the rows for each part (`parts::midway`).
pub struct SlotTable {
    rep: Vec<CudaSlice<i32>>,
    cnt: Vec<CudaSlice<i32>>,
    /// Per layer, its rows' versions one after another; grown, never shrunk.
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

    /// Makes the rows of `plan`'s parts from `cur` to `next` what `write` copies from: per
    /// layer, version `k` with its parts up to `k` landed, the last `next`'s own. The copies of
    /// the last `set` must be done (the caller waits for them).
    pub fn set(&mut self, cur: &SlotMap, next: &SlotMap, plan: &Plan) -> Result<(), DriverError> {
        let (er, e) = (self.experts * self.r, self.experts);
        for (l, (pt, pc)) in self.host.iter_mut().enumerate() {
            let versions = plan.layers[l].len().max(1);
            if pt.as_slice().len() < versions * er {
                // Page-locked memory is allocated only when a placement has more parts than any
                // before it.
                *pt = Pinned::new(versions * er)?;
                *pc = Pinned::new(versions * e)?;
            }
            for k in 0..versions {
                let (t, c) = match k + 1 == versions {
                    true => next.layer_table(next.layer(l), &self.near, self.r),
                    false => next.layer_table(&midway(cur, next, plan, l, k), &self.near, self.r),
                };
                pt.as_mut_slice()[k * er..(k + 1) * er].copy_from_slice(&t);
                pc.as_mut_slice()[k * e..(k + 1) * e].copy_from_slice(&c);
            }
        }
        Ok(())
    }

    /// Copies version `k` of layer `layer`'s rows (`set`) on `stream` (page-locked: the host
    /// does not wait): work enqueued after it on `stream` (or waiting for it) reads them.
    pub fn write(
        &mut self,
        layer: usize,
        k: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<(), DriverError> {
        let (er, e) = (self.experts * self.r, self.experts);
        let (pt, pc) = &self.host[layer];
        htod(pt, k * er..(k + 1) * er, &mut self.rep[layer], stream)?;
        htod(pc, k * e..(k + 1) * e, &mut self.cnt[layer], stream)
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
/// steps, for 122-275 ms (2x H100, docs/benchmarks.md "Load balance"), freed at once or
/// paced; kept, a group holds what its largest placement staged, as the pool did.
pub type Spare = Arc<std::sync::Mutex<Vec<DeviceFfn>>>;

/// A placement's rewritten slots, on the device beside the ones in use.
pub struct Staged {
    pub epoch: u32,
    pub map: Arc<SlotMap>,
    /// (layer, slot index on this rank, its weights as one group).
    pub slots: Vec<(usize, usize, DeviceFfn)>,
    /// The slot a cycle of slot copies goes through (`Write::Save`), where the placement has one.
    pub cycle: Option<DeviceFfn>,
    /// The stream they were uploaded on (their memory is freed on it).
    stream: Arc<CudaStream>,
}

/// One write of a slot a placement rewrites on this rank (`eplb::sources`), slots as indices
/// on the rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// The staged slot `Staged::slots[k]` over the slot it is for.
    Staged(usize),
    /// Slot `from` of `layer` over its slot `to`.
    Copy {
        layer: usize,
        from: usize,
        to: usize,
    },
    /// Slot `from` of `layer` into `Staged::cycle`.
    Save { layer: usize, from: usize },
    /// `Staged::cycle` over slot `to` of `layer`.
    Restore { layer: usize, to: usize },
}

impl Write {
    /// Whether it writes the spare slot (`Staged::cycle`), not one of the layer's.
    pub fn saves(&self) -> bool {
        matches!(self, Write::Save { .. })
    }
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
            cycle: None,
            stream,
        }
    }

    /// No slots yet of `epoch`'s `map`; `add` uploads them on `stream` (a staging thread's,
    /// never the step's).
    pub fn begin(stream: Arc<CudaStream>, (epoch, map): (u32, Arc<SlotMap>)) -> Self {
        Self::new(epoch, map, Vec::new(), stream)
    }

    /// `ffns` (the slots `at`: layer, index on the rank) uploaded into `spare` slots where it
    /// has them. Each copy has read its host buffer when it returns (pageable memory), so the
    /// caller may drop `ffns` before `finish`.
    pub fn add(
        &mut self,
        at: &[(usize, usize)],
        ffns: &[Ffn],
        (hidden, inter, dtype): (usize, usize, ExpertDtype),
        spare: &Spare,
    ) -> Result<(), GpuError> {
        let stream = &self.stream;
        let mut a = Alloc::new(stream.clone());
        for (&(l, i), f) in at.iter().zip(ffns) {
            let kept = spare.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let w = match kept {
                Some(mut w) => {
                    w.upload_into(f, (hidden, inter), stream)?;
                    w
                }
                None => DeviceFfn::upload(&mut a, std::iter::once(f), (hidden, inter), dtype)?,
            };
            self.slots.push((l, i, w));
        }
        Ok(())
    }

    /// `cycle`, from `spare` where it has one: the slot cycles of copies go through.
    pub fn add_cycle(
        &mut self,
        (hidden, inter, dtype): (usize, usize, ExpertDtype),
        spare: &Spare,
    ) -> Result<(), GpuError> {
        let kept = spare.lock().unwrap_or_else(|e| e.into_inner()).pop();
        self.cycle = Some(match kept {
            Some(w) => w,
            None => {
                DeviceFfn::one_group(&mut Alloc::new(self.stream.clone()), (hidden, inter), dtype)?
            }
        });
        Ok(())
    }

    /// Its slots into `spare`, for a later staging to write over (no copy may still read them).
    pub fn keep_in(self, spare: &Spare) {
        let mut kept = spare.lock().unwrap_or_else(|e| e.into_inner());
        kept.extend(self.slots.into_iter().map(|(_, _, w)| w));
        kept.extend(self.cycle);
    }

    /// Waits for the uploads.
    pub fn finish(self) -> Result<Self, GpuError> {
        self.stream.synchronize()?;
        Ok(self)
    }
}

/// What holds the slots' weights and the table the graphs read (the step): where an applied
/// placement lands, part by part.
pub trait Land {
    /// Makes the rows of `plan`'s parts from `cur` to `next` the ones `rows` writes.
    fn table_from(&mut self, cur: &SlotMap, next: &SlotMap, plan: &Plan) -> Result<(), GpuError>;
    /// The stream the steps run on.
    fn steps(&self) -> &Arc<CudaStream>;
    /// `writes` in order, from `staged`'s slots or this rank's own, on `stream`. No step may
    /// read the slots they write meanwhile: the caller orders `stream` after their layer's
    /// last step, and its next after the copies and the rows that route to them.
    fn copy(
        &mut self,
        staged: &mut Staged,
        writes: &[Write],
        stream: &Arc<CudaStream>,
    ) -> Result<(), GpuError>;
    /// Layer `layer`'s rows of the table with its parts up to `k` landed, on `stream`, once
    /// their slots are copied.
    fn rows(&mut self, layer: usize, k: usize, stream: &Arc<CudaStream>) -> Result<(), GpuError>;
    /// Bytes of one slot's weights (the same on every rank).
    fn slot_bytes(&self) -> u64;
}
