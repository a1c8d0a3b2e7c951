//! One step, the same on every rank: load the home slice → gating → prepare → dispatch → expert
//! compute → combine → store the home slice. The driver knows nothing of CPU or CUDA: a backend
//! implements `Backend` (submit a step, complete it) over buffers it owns, and runs the phases
//! its own way: the cpu backend one by one on the host (`backend::cpu::phases`), the GPU backend
//! as captured graphs (`backend::cuda::step`).

mod desc;
pub mod direct;
mod record;
pub mod ring;

pub use desc::{home_range, max_home_tokens, StepDesc, StepError, StepKey};
pub use record::{EnqueueParts, PhaseTimes};

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::eplb::SlotMap;
use crate::metric_names;
use crate::watchdog::Progress;

/// Hears once a placement's weights are staged on this rank (the bytes loaded), or why not.
pub type StageDone = Box<dyn FnOnce(Result<u64, String>) + Send>;

/// A rank's share of each step. A step is submitted, then completed, oldest first; a backend
/// that runs on a device may hold up to `depth` steps submitted, so the next step's copies and
/// launches are queued while one runs. A backend that computes on the host runs the whole step in
/// `submit`.
pub trait Backend {
    /// Starts this rank's share of a step, from the ring's input.
    fn submit(&mut self, desc: &StepDesc, home: Range<usize>) -> Result<(), StepError>;
    /// Whether the oldest submitted step has finished (never waits).
    fn ready(&mut self) -> Result<bool, StepError>;
    /// Completes the oldest submitted step: waits for it (within the step timeout), checks it and
    /// publishes its output rows in the ring.
    fn complete(&mut self) -> Result<PhaseTimes, StepError>;
    /// Most steps it can hold submitted at once.
    fn depth(&self) -> usize;
    /// (name, address, bytes) of every persistent buffer, for logs and the no-regrowth check.
    fn buffers(&self) -> Vec<(&'static str, usize, usize)>;
    /// The last completed step's routing: `[world, slots]` token rows from each source rank per
    /// expert slot.
    fn routed(&self) -> &[u32];
    /// Starts loading, off the step path, the weights `next` puts into this rank's slots;
    /// `done` hears when they are staged or why not. A backend whose slots do not move says so.
    fn stage(&mut self, epoch: u32, _next: Arc<SlotMap>, done: StageDone) {
        done(Err(format!(
            "placement epoch {epoch}: this backend's expert slots do not move"
        )))
    }
    /// Swaps in what `stage` loaded for `epoch`, between steps.
    fn apply(&mut self, epoch: u32) -> Result<(), String> {
        Err(format!(
            "placement epoch {epoch}: this backend's expert slots do not move"
        ))
    }
    /// What a rank coming back needs from the leader to join this backend's group with the
    /// others (GPU backends: the unique id of the communicator they make with it).
    fn rejoin_id(&self) -> Result<Option<Vec<u8>>, String> {
        Ok(None)
    }
    /// Lost `rank` restarted: map what it made again (its exchange segment), or begin joining
    /// a communicator with it (`nccl_id`, `rejoin_id`'s), between steps; it takes part in steps
    /// from the roster that has it live. A backend that cannot take a rank back says so.
    fn rejoin(&mut self, rank: usize, _nccl_id: Option<&[u8]>) -> Result<(), String> {
        Err(format!("this backend cannot take rank {rank} back"))
    }
    /// The group goes on without `lost` (`Order::Roster`, every rank left at once, between
    /// steps): a backend whose communicator holds lost ranks makes one without them.
    fn regroup(&mut self, _lost: &[u32]) -> Result<(), String> {
        Ok(())
    }
    /// The NCCL EP exchange's footprint on this GPU (the nccl-ep backend only).
    fn ep_footprint(&self) -> Option<EpFootprint> {
        None
    }
    /// Every rank has joined the group: drop what only its bring-up needed.
    fn group_started(&self) {}
}

/// What the NCCL EP exchange takes on one GPU (`Backend::ep_footprint`; GetModelInfo reports
/// it as `NcclEpFootprint`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpFootprint {
    /// Modes the buckets use: "ll", "ht" or "ll+ht".
    pub modes: &'static str,
    /// Expert rows in registered NCCL windows.
    pub zero_copy: bool,
    /// Buckets up to this many home tokens per rank run low-latency (0: none).
    pub ll_max_tokens_per_rank: u32,
    /// Device bytes of the groups' symmetric buffers, the handles, and the expert rows.
    pub group_bytes: u64,
    pub handle_bytes: u64,
    pub expert_rows_bytes: u64,
}

/// Persistent buffers as a log line shows them: each one's name and size, by kind, and the
/// total (addresses stay out of logs).
pub fn buffer_sizes(buffers: &[(&'static str, usize, usize)]) -> String {
    let mut by_name: Vec<(&str, usize, usize)> = Vec::new();
    for &(name, _, bytes) in buffers {
        match by_name.iter_mut().find(|(n, _, _)| *n == name) {
            Some(e) => {
                e.1 += 1;
                e.2 += bytes;
            }
            None => by_name.push((name, 1, bytes)),
        }
    }
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let total: usize = by_name.iter().map(|e| e.2).sum();
    let parts: Vec<String> = by_name
        .iter()
        .map(|(n, count, bytes)| format!("{count} {n} {:.1} MiB", mib(*bytes)))
        .collect();
    format!("{} ({:.1} MiB)", parts.join(", "), mib(total))
}

impl<B: Backend + ?Sized> Backend for Box<B> {
    fn submit(&mut self, desc: &StepDesc, home: Range<usize>) -> Result<(), StepError> {
        (**self).submit(desc, home)
    }
    fn ready(&mut self) -> Result<bool, StepError> {
        (**self).ready()
    }
    fn complete(&mut self) -> Result<PhaseTimes, StepError> {
        (**self).complete()
    }
    fn depth(&self) -> usize {
        (**self).depth()
    }
    fn buffers(&self) -> Vec<(&'static str, usize, usize)> {
        (**self).buffers()
    }
    fn routed(&self) -> &[u32] {
        (**self).routed()
    }
    fn stage(&mut self, epoch: u32, next: Arc<SlotMap>, done: StageDone) {
        (**self).stage(epoch, next, done)
    }
    fn apply(&mut self, epoch: u32) -> Result<(), String> {
        (**self).apply(epoch)
    }
    fn ep_footprint(&self) -> Option<EpFootprint> {
        (**self).ep_footprint()
    }
    fn group_started(&self) {
        (**self).group_started()
    }
    fn rejoin_id(&self) -> Result<Option<Vec<u8>>, String> {
        (**self).rejoin_id()
    }
    fn rejoin(&mut self, rank: usize, nccl_id: Option<&[u8]>) -> Result<(), String> {
        (**self).rejoin(rank, nccl_id)
    }
    fn regroup(&mut self, lost: &[u32]) -> Result<(), String> {
        (**self).regroup(lost)
    }
}

pub struct Driver<B> {
    pub backend: B,
    pub rank: usize,
    pub world: usize,
    /// The model's own index of each MoE layer (metric labels).
    pub layer_ids: Vec<u32>,
    /// Export per-expert token counters (one series per expert and layer).
    pub per_expert: bool,
    /// The expert slots steps run on, and its epoch (`StepDesc::placement`).
    map: Arc<SlotMap>,
    epoch: u32,
    /// A placement handed to the backend to stage, until a step applies it.
    staging: Option<(u32, Arc<SlotMap>)>,
    /// The ring's cells and tokens: a descriptor must fit them.
    ring: ring::RingShape,
    /// Steps submitted and not yet completed, oldest first, with when each was submitted.
    /// Each with the placement it runs on (for its record).
    flight: std::collections::VecDeque<(StepDesc, Instant, Arc<SlotMap>)>,
    /// When the last step completed: a step queued behind it was busy only from then.
    last_done: Instant,
    /// Most steps in flight at once: 1 + `--steps-ahead`, within the backend's and the ring's.
    depth: usize,
    /// Since when the oldest step in flight has run, for the watchdog and the liveness probe.
    progress: Arc<Progress>,
}

impl<B: Backend> Driver<B> {
    pub fn new(
        backend: B,
        rank: usize,
        world: usize,
        (layer_ids, map): (Vec<u32>, SlotMap),
        per_expert: bool,
        ring: ring::RingShape,
        ahead: usize,
    ) -> Self {
        let depth = (1 + ahead).min(backend.depth()).min(ring.cells).max(1);
        Self {
            backend,
            rank,
            world,
            layer_ids,
            per_expert,
            map: Arc::new(map),
            epoch: 0,
            staging: None,
            ring,
            flight: std::collections::VecDeque::with_capacity(depth),
            last_done: Instant::now(),
            depth,
            progress: Arc::new(Progress::default()),
        }
    }

    /// Whether a step is running on this rank, and since when.
    pub fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    /// Most steps this rank holds in flight at once.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The placement steps run on now.
    pub fn map(&self) -> (u32, &Arc<SlotMap>) {
        (self.epoch, &self.map)
    }

    /// Hands a new placement to the backend to stage; the step whose descriptor carries `epoch`
    /// applies it.
    pub fn stage(&mut self, epoch: u32, next: SlotMap, done: StageDone) {
        let next = Arc::new(next);
        self.staging = Some((epoch, next.clone()));
        self.backend.stage(epoch, next, done);
    }

    /// The placement of `desc`, applied before it runs where it is a new one.
    fn placement(&mut self, desc: &StepDesc) -> Result<(), StepError> {
        if desc.placement == self.epoch {
            return Ok(());
        }
        let bad = |msg| StepError::Invalid {
            step: desc.step,
            msg,
        };
        let next = match self.staging.take() {
            Some((epoch, next)) if epoch == desc.placement => next,
            _ => {
                return Err(bad(format!(
                    "placement epoch {} was never staged here",
                    desc.placement
                )))
            }
        };
        self.backend.apply(desc.placement).map_err(bad)?;
        self.map = next;
        self.epoch = desc.placement;
        Ok(())
    }

    /// Steps submitted and not yet completed.
    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.flight.len()
    }

    /// A descriptor came over the network: every index in it is checked before use.
    fn check(&self, desc: &StepDesc) -> Result<(), StepError> {
        let msg = if desc.layer as usize >= self.layer_ids.len() {
            format!(
                "layer index {} of {} layers",
                desc.layer,
                self.layer_ids.len()
            )
        } else if desc.cell as usize >= self.ring.cells {
            format!("ring cell {} of {}", desc.cell, self.ring.cells)
        } else if !desc.input.is_float() || !desc.output.is_float() {
            format!("rows of {:?} in, {:?} out", desc.input, desc.output)
        } else if desc.tokens as usize > self.ring.max_tokens {
            format!(
                "{} tokens, more than a step holds ({})",
                desc.tokens, self.ring.max_tokens
            )
        } else if desc.lost.windows(2).any(|w| w[0] >= w[1])
            || desc
                .lost
                .iter()
                .any(|&r| r as usize >= self.world || r == 0)
            || desc.is_lost(self.rank)
        {
            format!(
                "lost ranks {:?} of {} (ascending, never rank 0 or this rank {})",
                desc.lost, self.world, self.rank
            )
        } else if desc.homes.is_empty() && desc.most_home(self.world) > self.ring.home_stride() {
            format!(
                "{} tokens over {} ranks in the group: more than {} home rows a rank",
                desc.tokens,
                self.world - desc.lost.len(),
                self.ring.home_stride()
            )
        } else if !desc.homes.is_empty()
            && (desc.homes.len() != self.world
                || desc
                    .homes
                    .iter()
                    .any(|&n| n as usize > self.ring.home_stride())
                || desc.homes.iter().map(|&n| n as u64).sum::<u64>() != u64::from(desc.tokens))
        {
            format!(
                "home rows {:?} for {} ranks of at most {} rows, {} tokens",
                desc.homes,
                self.world,
                self.ring.home_stride(),
                desc.tokens
            )
        } else {
            return Ok(());
        };
        Err(StepError::Invalid {
            step: desc.step,
            msg: format!("bad step descriptor: {msg}"),
        })
    }

    /// Starts a step behind those in flight (at most `depth` at once).
    pub fn submit(&mut self, desc: &StepDesc) -> Result<(), StepError> {
        self.check(desc)?;
        if self.flight.len() >= self.depth {
            return Err(StepError::Invalid {
                step: desc.step,
                msg: format!("{} steps in flight already", self.flight.len()),
            });
        }
        self.placement(desc)?;
        let home = desc.home(self.world, self.rank, self.ring.home_stride());
        let at = Instant::now();
        match self.flight.is_empty() {
            true => self.progress.begin_at(at),
            false => metrics::counter!(metric_names::STEPS_SUBMITTED_AHEAD_TOTAL).increment(1),
        }
        if let Err(e) = self.backend.submit(desc, home) {
            if self.flight.is_empty() {
                self.progress.end();
            }
            return Err(e);
        }
        self.flight.push_back((desc.clone(), at, self.map.clone()));
        Ok(())
    }

    /// Lost `rank` restarted: this rank maps what it made again, or begins joining a
    /// communicator with it (`Backend::rejoin`).
    pub fn rejoin(&mut self, rank: usize, nccl_id: Option<&[u8]>) -> Result<(), String> {
        self.backend.rejoin(rank, nccl_id)
    }

    /// Ends every step in flight without their results (a halt: their rows run again).
    /// Returns how many there were.
    pub fn abandon(&mut self) -> usize {
        let mut n = 0;
        while let Some(r) = self.complete() {
            if let Err(e) = r {
                tracing::debug!("a step ended by the halt: {e}");
            }
            n += 1;
        }
        self.progress.end();
        n
    }

    /// Whether the oldest step in flight has finished (false when none is).
    pub fn ready(&mut self) -> Result<bool, StepError> {
        match self.flight.is_empty() {
            true => Ok(false),
            false => self.backend.ready(),
        }
    }

    /// Completes the oldest step in flight (waiting for it, bounded by the step timeout) and
    /// records it; None when none is in flight.
    pub fn complete(&mut self) -> Option<Result<(StepDesc, PhaseTimes), StepError>> {
        let (desc, at, map) = self.flight.pop_front()?;
        let r = self.backend.complete();
        match (&r, self.flight.front()) {
            (Ok(_), Some(&(_, next, _))) => self.progress.begin_at(next),
            _ => self.progress.end(),
        }
        let mut times = match r {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        // Busy time, not time in flight: the steps' durations add up to the rank's busy time.
        let now = Instant::now();
        times.total = now - at.max(self.last_done);
        self.last_done = now;
        record::record_step(&record::StepRecord {
            step: desc.step,
            layer: self
                .layer_ids
                .get(desc.layer as usize)
                .copied()
                .unwrap_or(desc.layer),
            tokens: desc.tokens as usize,
            heartbeat: desc.tokens == 0,
            times: &times,
            routed: self.backend.routed(),
            slots: &map,
            layer_index: desc.layer as usize,
            world: self.world,
            rank: self.rank,
            per_expert: self.per_expert,
        });
        Some(Ok((desc, times)))
    }

    /// One step on its own: submitted and completed (nothing else may be in flight). The
    /// service keeps steps in flight through `submit` and `complete`; the tests use this.
    #[cfg(test)]
    pub fn run(&mut self, desc: &StepDesc) -> Result<PhaseTimes, StepError> {
        assert!(self.flight.is_empty(), "run with steps in flight");
        self.submit(desc)?;
        self.complete()
            .expect("submitted just now")
            .map(|(_, times)| times)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;

    /// Buffers are logged by kind and size, without their addresses.
    #[test]
    fn buffer_sizes_leave_addresses_out() {
        let b = [
            ("exchange_segment", 0x7f00_0000_1000, 1 << 20),
            ("step_ring", 0x7f00_1000_0000, 1 << 20),
            ("exchange_segment", 0x7f00_2000_0000, 1 << 20),
        ];
        let line = buffer_sizes(&b);
        assert_eq!(
            line,
            "2 exchange_segment 2.0 MiB, 1 step_ring 1.0 MiB (3.0 MiB)"
        );
        assert!(!line.contains(&0x7f00_0000_1000usize.to_string()));
    }

    fn one_slot() -> SlotMap {
        SlotMap::contiguous(2, 1, 0, 1).unwrap()
    }

    /// Holds what it is given until completed, like a device backend.
    struct Queue(std::collections::VecDeque<u64>, Vec<u64>);

    impl Backend for Queue {
        fn submit(&mut self, d: &StepDesc, _: Range<usize>) -> Result<(), StepError> {
            self.0.push_back(d.step);
            Ok(())
        }
        fn ready(&mut self) -> Result<bool, StepError> {
            Ok(!self.0.is_empty())
        }
        fn complete(&mut self) -> Result<PhaseTimes, StepError> {
            self.1.push(self.0.pop_front().expect("a step submitted"));
            Ok(PhaseTimes::default())
        }
        fn depth(&self) -> usize {
            2
        }
        fn buffers(&self) -> Vec<(&'static str, usize, usize)> {
            Vec::new()
        }
        fn routed(&self) -> &[u32] {
            &[]
        }
    }

    #[test]
    fn a_descriptor_out_of_range_is_refused_before_the_backend_sees_it() {
        let ring = ring::RingShape {
            cells: 2,
            world: 2,
            max_tokens: 64,
            hidden: 8,
            top_k: 2,
        };
        let mut d = Driver::new(
            Queue(Default::default(), Vec::new()),
            1,
            2,
            (vec![3, 5], SlotMap::contiguous(4, 2, 0, 2).unwrap()),
            false,
            ring,
            0,
        );
        let ok = StepDesc {
            step: 1,
            layer: 1,
            tokens: 64,
            cell: 1,
            client_routing: false,
            input: Dtype::Bf16,
            output: Dtype::F32,
            homes: Vec::new(),
            placement: 0,
            lost: Vec::new(),
        };
        d.run(&ok).unwrap();
        for (bad, want) in [
            (
                StepDesc {
                    layer: 2,
                    ..ok.clone()
                },
                "layer index 2 of 2",
            ),
            (
                StepDesc {
                    cell: 2,
                    ..ok.clone()
                },
                "ring cell 2 of 2",
            ),
            (
                StepDesc {
                    tokens: 65,
                    ..ok.clone()
                },
                "65 tokens",
            ),
            (
                StepDesc {
                    input: Dtype::I64,
                    ..ok.clone()
                },
                "rows of I64 in",
            ),
            (
                StepDesc {
                    layer: u32::MAX,
                    ..ok.clone()
                },
                "layer index",
            ),
            (
                StepDesc {
                    homes: vec![32, 31],
                    tokens: 64,
                    ..ok.clone()
                },
                "home rows [32, 31]",
            ),
            (
                StepDesc {
                    homes: vec![33, 0],
                    tokens: 33,
                    ..ok.clone()
                },
                "home rows [33, 0]",
            ),
            (
                StepDesc {
                    homes: vec![4],
                    tokens: 4,
                    ..ok.clone()
                },
                "home rows [4]",
            ),
        ] {
            let e = d.run(&bad).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        assert_eq!(d.backend.1, vec![1]);
        let own = StepDesc {
            homes: vec![0, 32],
            tokens: 32,
            ..ok
        };
        d.run(&own).unwrap();
        assert_eq!(d.backend.1, vec![1, 1]);
        assert_eq!(own.home(2, 1, 32), 32..64);
        assert_eq!(own.home(2, 0, 32), 0..0);
        assert_eq!(own.most_home(2), 32);
    }

    #[test]
    fn steps_in_flight_are_bounded_by_the_depth_and_complete_in_order() {
        let ring = ring::RingShape {
            cells: 2,
            world: 1,
            max_tokens: 8,
            hidden: 4,
            top_k: 1,
        };
        let desc = |step| StepDesc {
            step,
            layer: 0,
            tokens: 8,
            cell: (step % 2) as u32,
            client_routing: false,
            input: Dtype::F32,
            output: Dtype::F32,
            homes: Vec::new(),
            placement: 0,
            lost: Vec::new(),
        };
        let queue = || Queue(Default::default(), Vec::new());
        // --steps-ahead 0: one at a time, whatever the backend holds.
        let mut one = Driver::new(queue(), 0, 1, (vec![0], one_slot()), false, ring, 0);
        assert_eq!(one.depth(), 1);
        one.submit(&desc(1)).unwrap();
        let e = one.submit(&desc(2)).unwrap_err().to_string();
        assert!(e.contains("1 steps in flight already"), "{e}");
        // 1 ahead: two in flight, completed oldest first; never more than the ring's cells.
        let mut two = Driver::new(queue(), 0, 1, (vec![0], one_slot()), false, ring, 5);
        assert_eq!(two.depth(), 2);
        assert!(!two.ready().unwrap(), "nothing in flight is not ready");
        assert!(two.complete().is_none());
        two.submit(&desc(1)).unwrap();
        two.submit(&desc(2)).unwrap();
        assert!(two.submit(&desc(3)).is_err());
        assert_eq!(two.in_flight(), 2);
        assert_eq!(two.complete().unwrap().unwrap().0.step, 1);
        two.submit(&desc(3)).unwrap();
        assert_eq!(two.complete().unwrap().unwrap().0.step, 2);
        assert_eq!(two.complete().unwrap().unwrap().0.step, 3);
        assert_eq!(two.backend.1, vec![1, 2, 3]);
        assert_eq!(two.in_flight(), 0);
    }

    #[test]
    fn home_ranges_partition_the_step() {
        for world in 1..=5 {
            for tokens in 0..40 {
                let mut next = 0;
                for r in 0..world {
                    let h = home_range(tokens, world, r);
                    assert_eq!(h.start, next);
                    assert!(h.len() <= max_home_tokens(tokens.max(1), world));
                    next = h.end;
                }
                assert_eq!(next, tokens);
            }
        }
    }
}
