//! Two-batch overlap (#57 item 1): a step of `bucket` home tokens runs as two micro-batches of
//! `bucket / 2`, each through an exchange of its own (micro-batch A through the step's, B
//! through the `Twin`'s), so that one's rows move while the other's experts compute:
//!
//! ```text
//! exchange stream:  count+gather+prepare+dispatch A | the same for B | combine A | combine B
//! step stream:      gate, shared expert             |   experts A    | experts B |  B's rows home
//! ```
//!
//! Every call that communicates goes on the exchange stream, in one order on every rank; the
//! experts' psum GEMMs run on their instances of fewer CTAs (`Sms::BesideExchange`, passed down
//! from here), leaving the exchange's kernels their SMs (DeepGEMM's tiles are scheduled
//! statically: a CTA that waits for a busy SM ends that much later). Each row meets the same kernels as without the split,
//! and no kernel's result for a row depends on the other rows, so outputs do not change.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use half::bf16;

use super::{exchange, routed, GpuStep, Variant};
use crate::backend::cuda::exchange::{Exchange, Home};
use crate::backend::cuda::kernels::hopper::Sms;
use crate::backend::cuda::shape::StepShape;
use crate::backend::cuda::sys::nccl::Comm;
use crate::backend::cuda::{Alloc, Gpu, GpuError};

/// The fewest home tokens a micro-batch takes (`SPLIT_FROM`'s half).
const MIN_HALF: usize = crate::backend::device::SPLIT_FROM / 2;

/// One micro-batch's token count, per-expert counts and every rank's (all-gathered).
struct Half {
    n: CudaSlice<i32>,
    counts: CudaSlice<i32>,
    m: CudaSlice<i32>,
}

impl Half {
    fn new(s: &StepShape, a: &mut Alloc) -> Result<Self, GpuError> {
        Ok(Self {
            n: a.zeros(1)?,
            counts: a.zeros(s.experts)?,
            m: a.zeros(s.world * s.experts)?,
        })
    }
}

/// Micro-batch B's exchange, home rows and output, both micro-batches' counts, the exchange's
/// stream and the events between it and the step's.
pub struct Twin {
    ex: Box<dyn Exchange>,
    xb: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    w: CudaSlice<f32>,
    sids: CudaSlice<i32>,
    /// A's, then B's.
    halves: [Half; 2],
    out: CudaSlice<f32>,
    /// B's rows of the shared expert's output.
    sy: CudaSlice<bf16>,
    stream: Arc<CudaStream>,
    /// Step to exchange: the rows are gated; A's and B's experts are done.
    gated: CudaEvent,
    done: [CudaEvent; 2],
    /// Exchange to step: A's and B's rows arrived; both combined.
    arrived: [CudaEvent; 2],
    combined: CudaEvent,
}

impl Twin {
    /// B's exchange over `comm` (collective, as the step's) and buffers for half the largest
    /// bucket.
    pub fn new(g: &Gpu, comm: &Comm, s: &StepShape, a: &mut Alloc) -> Result<Self, GpuError> {
        let (half, h, k) = (s.max_home.div_ceil(2), s.hidden, s.top_k);
        let event = || {
            g.ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
        };
        Ok(Self {
            ex: exchange(comm, s, a)?,
            xb: a.zeros(half * h)?,
            ids: a.zeros(half * k)?,
            w: a.zeros(half * k)?,
            sids: a.zeros(half * k)?,
            halves: [Half::new(s, a)?, Half::new(s, a)?],
            out: a.zeros(half * h)?,
            sy: a.zeros(if s.shared_inter > 0 { half * h } else { 0 })?,
            stream: g.ctx.new_stream()?,
            gated: event()?,
            done: [event()?, event()?],
            arrived: [event()?, event()?],
            combined: event()?,
        })
    }

    /// Its communicator lost a member: as `Exchange::abandon`.
    pub fn abandon(&mut self) -> u64 {
        self.ex.abandon()
    }
}

impl GpuStep {
    /// Whether a step of `bucket` home tokens runs as two micro-batches.
    pub fn splits(&self, bucket: usize) -> bool {
        let half = bucket / 2;
        let ll = self.shape.ep.map_or(0, |e| e.ll_max);
        self.twin.is_some()
            && bucket >= self.shape.split
            && bucket % 2 == 0
            && half >= MIN_HALF
            && half > ll
    }

    fn twin(&mut self) -> &mut Twin {
        self.twin.as_mut().expect("split steps have a twin")
    }

    /// `f` with the GPU's launches on the exchange's stream (`Twin::stream`).
    fn on_exchange<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let side = self.twin().stream.clone();
        let step = std::mem::replace(&mut self.g.stream, side);
        let r = f(self);
        self.g.stream = step;
        r
    }

    /// The step as two micro-batches (module docs); `splits(bucket)` holds.
    pub(super) fn run_split(
        &mut self,
        layer: usize,
        bucket: usize,
        v: Variant,
    ) -> Result<(), GpuError> {
        let (half, h, k) = (bucket / 2, self.shape.hidden, self.shape.top_k);
        self.gate(layer, bucket, v)?;
        {
            let GpuStep {
                g, b, twin, table, ..
            } = self;
            let tw = twin.as_mut().expect("split steps have a twin");
            let s = &g.stream;
            let [ha, hb] = &mut tw.halves;
            g.split_count(&b.n, half, &mut ha.n, &mut hb.n)?;
            s.memcpy_dtod(&b.xb.slice(half * h..bucket * h), &mut tw.xb)?;
            s.memcpy_dtod(&b.ids.slice(half * k..bucket * k), &mut tw.ids)?;
            s.memcpy_dtod(&b.w.slice(half * k..bucket * k), &mut tw.w)?;
            if table.is_some() {
                s.memcpy_dtod(&b.sids.slice(half * k..bucket * k), &mut tw.sids)?;
            }
            tw.gated.record(s)?;
            tw.stream.wait(&tw.gated)?;
        }
        self.on_exchange(|c| (0..2).try_for_each(|i| c.send(i, half)))?;
        self.computed(layer, bucket)?;
        self.on_exchange(|c| (0..2).try_for_each(|i| c.bring(i, layer, half)))?;
        let GpuStep { g, b, twin, .. } = self;
        let tw = twin.as_mut().expect("split steps have a twin");
        g.stream.wait(&tw.combined)?;
        let mut rest = b.out.slice_mut(half * h..bucket * h);
        g.stream
            .memcpy_dtod(&tw.out.slice(0..half * h), &mut rest)?;
        Ok(())
    }

    /// On the step's stream, beside the exchange's: the shared expert over the whole step (B's
    /// rows of it copied to the twin), then each micro-batch's experts.
    fn computed(&mut self, layer: usize, bucket: usize) -> Result<(), GpuError> {
        let (half, h) = (bucket / 2, self.shape.hidden);
        self.shared(layer, bucket, Sms::BesideExchange)?;
        if self.layers[layer].shared.is_some() {
            let GpuStep { g, b, twin, .. } = self;
            let tw = twin.as_mut().expect("split steps have a twin");
            g.stream
                .memcpy_dtod(&b.sy.slice(half * h..bucket * h), &mut tw.sy)?;
        }
        (0..2).try_for_each(|i| self.experts_of(i, layer, half))
    }

    /// On the exchange's stream: micro-batch `i`'s counts, their all-gather, prepare and
    /// dispatch, then the event its experts wait for.
    fn send(&mut self, i: usize, half: usize) -> Result<(), GpuError> {
        let GpuStep {
            g,
            comm,
            b,
            ex,
            twin,
            table,
            shape,
            ..
        } = self;
        let tw = twin.as_mut().expect("split steps have a twin");
        let t = table.is_some();
        let [ha, hb] = &mut tw.halves;
        let (ex, (x, ids, w), hf) = match i {
            0 => (
                ex.as_mut(),
                (&b.xb, if t { &b.sids } else { &b.ids }, &b.w),
                ha,
            ),
            _ => (
                tw.ex.as_mut(),
                (&tw.xb, if t { &tw.sids } else { &tw.ids }, &tw.w),
                hb,
            ),
        };
        macro_rules! home {
            () => {
                Home {
                    x,
                    ids,
                    w,
                    n: &hf.n,
                    gathered: &hf.m,
                }
            };
        }
        ex.count(g, &home!(), half, &mut hf.counts)?;
        comm.all_gather(&hf.counts, &mut hf.m, shape.experts, &g.stream)?;
        ex.prepare(g, &home!(), half)?;
        ex.dispatch(g, comm, &home!(), half)?;
        tw.arrived[i].record(&g.stream)?;
        Ok(())
    }

    /// On the step's stream: micro-batch `i`'s experts once its rows arrived, then the event
    /// its combine waits for.
    fn experts_of(&mut self, i: usize, layer: usize, half: usize) -> Result<(), GpuError> {
        let GpuStep {
            g,
            b,
            ex,
            twin,
            shape,
            choices,
            layers,
            ..
        } = self;
        let tw = twin.as_mut().expect("split steps have a twin");
        g.stream.wait(&tw.arrived[i])?;
        let ex = match i {
            0 => ex.as_mut(),
            _ => tw.ex.as_mut(),
        };
        let at = (half, 2 * half, Sms::BesideExchange);
        routed(g, shape, choices, b, &layers[layer], ex, at)?;
        tw.done[i].record(&g.stream)?;
        Ok(())
    }

    /// On the exchange's stream: micro-batch `i`'s combine once its experts are done (A's
    /// into the step's first rows, B's into the twin's), then, after B's, the event the step
    /// waits for.
    fn bring(&mut self, i: usize, layer: usize, half: usize) -> Result<(), GpuError> {
        let GpuStep {
            g,
            comm,
            b,
            ex,
            twin,
            table,
            layers,
            ..
        } = self;
        let tw = twin.as_mut().expect("split steps have a twin");
        g.stream.wait(&tw.done[i])?;
        let t = table.is_some();
        let shared = layers[layer].shared.is_some();
        let [ha, hb] = &tw.halves;
        let (ex, (x, ids, w), hf, sy, out) = match i {
            0 => (
                ex.as_mut(),
                (&b.xb, if t { &b.sids } else { &b.ids }, &b.w),
                ha,
                &b.sy,
                &mut b.out,
            ),
            _ => (
                tw.ex.as_mut(),
                (&tw.xb, if t { &tw.sids } else { &tw.ids }, &tw.w),
                hb,
                &tw.sy,
                &mut tw.out,
            ),
        };
        let home = Home {
            x,
            ids,
            w,
            n: &hf.n,
            gathered: &hf.m,
        };
        ex.combine(g, comm, &home, half, shared.then_some(sy), out)?;
        if i == 1 {
            tw.combined.record(&g.stream)?;
        }
        Ok(())
    }
}

/// What a step leaves for the rank to check after it, per exchange it ran: the all-gathered
/// counts its rows were routed by, the exchange (its receipts) and the rows a rank sent it.
pub struct Tally<'a> {
    pub m: &'a CudaSlice<i32>,
    pub ex: &'a dyn Exchange,
    pub bucket: usize,
}

impl GpuStep {
    /// A step of `bucket`'s tallies: one, or one per micro-batch where it split (no allocation:
    /// read on every step).
    pub fn tallies(&self, bucket: usize) -> [Option<Tally<'_>>; 2] {
        match self.twin.as_ref().filter(|_| self.splits(bucket)) {
            None => [
                Some(Tally {
                    m: &self.b.m,
                    ex: self.ex.as_ref(),
                    bucket,
                }),
                None,
            ],
            Some(tw) => {
                let half = bucket / 2;
                [
                    Some(Tally {
                        m: &tw.halves[0].m,
                        ex: self.ex.as_ref(),
                        bucket: half,
                    }),
                    Some(Tally {
                        m: &tw.halves[1].m,
                        ex: tw.ex.as_ref(),
                        bucket: half,
                    }),
                ]
            }
        }
    }
}
