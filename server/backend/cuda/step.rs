//! The GPU step: persistent device buffers sized at startup for the largest bucket, and the five
//! phases enqueued on the rank's stream with no host sync, so a whole step can be captured.
//! The same straight line for every exchange (`exchange.rs`): gating, then the exchange's
//! count, all-gather and prepare, its dispatch, the expert FFN over the rows where the exchange
//! says they are, and its combine. A bucket is a capacity of home tokens per rank; every rank of a
//! step uses the same one, so the exchanges' fixed sizes match on both ends.

pub mod split;

use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, CudaStream, DriverError};
use half::bf16;

use crate::backend::cuda::exchange::ep::EpExchange;
use crate::backend::cuda::exchange::slots::SlotExchange;
use crate::backend::cuda::exchange::{Exchange, Home};
use crate::backend::cuda::experts::fp8::Fp8Bufs;
use crate::backend::cuda::experts::{self, Choices, DeviceFfn, Scratch, SharedRows};
use crate::backend::cuda::kernels::hopper::{self, Sms};
use crate::backend::cuda::placement::{Land, SlotTable, Staged, Write};
use crate::backend::cuda::shape::StepShape;
use crate::backend::cuda::sys::graph;
use crate::backend::cuda::sys::nccl::Comm;
use crate::backend::cuda::{max_tiles, Gpu, Logits, ROUTER_PIECES};
use crate::backend::cuda::{Alloc, GpuError};
use crate::eplb::parts::Plan;
use crate::eplb::SlotMap;
use crate::model::{ExpertDtype, LayerWeights, Routing};

/// One MoE layer on the device: the router in f32 (and as bf16 pieces, for bf16 rows), this
/// rank's experts and the shared expert in the experts' dtype.
pub struct DeviceLayer {
    router: CudaSlice<f32>,
    /// `[3][experts][hidden]`: `Gpu::bf16_pieces` of `router`.
    pieces: CudaSlice<bf16>,
    bias: CudaSlice<f32>,
    experts: DeviceFfn,
    shared: Option<DeviceFfn>,
}

/// Where a step's home rows are, and in which dtype, when its graph starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HomeDtype {
    /// f32 in `x` (f32 and f16 clients): the step makes the experts' bf16 copy, and routes the
    /// f32 rows in SGEMM.
    F32,
    /// bf16 in `xb`, as a bf16 client sent them: nothing to convert, and the router runs on
    /// tensor cores (`Gpu::router_logits_bf16`: the same f32 products as SGEMM, in f32 sums).
    Bf16,
}

/// What one of a (layer, bucket)'s captured graphs is for: the rows' form, and whether the
/// client sent the top-k (then no router runs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    pub rows: HomeDtype,
    pub client: bool,
}

impl Variant {
    pub const ALL: [Variant; 4] = [
        Variant::new(HomeDtype::F32, false),
        Variant::new(HomeDtype::F32, true),
        Variant::new(HomeDtype::Bf16, false),
        Variant::new(HomeDtype::Bf16, true),
    ];

    pub const fn new(rows: HomeDtype, client: bool) -> Self {
        Self { rows, client }
    }

    /// Its place in `ALL`.
    pub fn index(self) -> usize {
        2 * self.rows as usize + usize::from(self.client)
    }
}

fn pieces(g: &Gpu, a: &mut Alloc, router: &CudaSlice<f32>) -> Result<CudaSlice<bf16>, DriverError> {
    let mut p = a.zeros::<bf16>(ROUTER_PIECES * router.len())?;
    g.bf16_pieces(router, &mut p)?;
    Ok(p)
}

impl DeviceLayer {
    /// Device bytes of its routed and shared experts, scales included.
    pub fn expert_bytes(&self) -> usize {
        self.experts.bytes() + self.shared.as_ref().map_or(0, DeviceFfn::bytes)
    }

    /// The layer's router and this rank's experts, the experts in `dtype`.
    pub fn upload(
        g: &Gpu,
        a: &mut Alloc,
        l: &LayerWeights,
        s: &StepShape,
    ) -> Result<Self, DriverError> {
        let (h, dtype) = (s.hidden, s.expert_dtype);
        let router = a.upload(&l.router)?;
        Ok(Self {
            pieces: pieces(g, a, &router)?,
            router,
            bias: match &l.bias {
                Some(b) => a.upload(b)?,
                None => a.zeros(s.model_experts)?,
            },
            experts: DeviceFfn::upload(a, l.experts.iter(), (h, s.inter), dtype)?,
            shared: l
                .shared
                .as_ref()
                .map(|f| DeviceFfn::upload(a, std::iter::once(f), (h, f.inter), dtype))
                .transpose()?,
        })
    }

    /// Random weights made on the GPU (for `epserve bench`: timing, not numerics).
    pub fn random(g: &Gpu, a: &mut Alloc, s: &StepShape, seed: u64) -> Result<Self, DriverError> {
        let (h, i, l, dtype) = (s.hidden, s.inter, s.local(), s.expert_dtype);
        let mut router = a.zeros::<f32>(s.model_experts * h)?;
        g.fill_uniform_f32(&mut router, seed, (3.0 / h as f32).sqrt())?;
        let shared = match s.shared_inter {
            0 => None,
            si => Some(DeviceFfn::random(g, a, (1, h, si), seed + 3, dtype)?),
        };
        Ok(Self {
            pieces: pieces(g, a, &router)?,
            router,
            bias: a.zeros(s.model_experts)?,
            experts: DeviceFfn::random(g, a, (l, h, i), seed + 1, dtype)?,
            shared,
        })
    }
}

/// The step's persistent device buffers, sized for the largest bucket.
pub struct Buffers {
    /// Home tokens `[T, hidden]`: f32 rows (`HomeDtype::F32`, SGEMM's input), and bf16 rows (the
    /// experts' and the bf16 router's input: a bf16 client's rows as they came, or made from `x`).
    pub x: CudaSlice<f32>,
    pub xb: CudaSlice<bf16>,
    /// The home rows as they come from the host ring and as they leave for it, in the wire
    /// dtype (room for f32 rows: `[T, hidden]` of 4 bytes each), outside the step's graph, so no
    /// peer ever reads them. Each has its own copy stream: the next step's rows land in `inbox`
    /// while a step runs, and its output leaves from `outbox` while the next runs.
    pub inbox: CudaSlice<bf16>,
    pub outbox: CudaSlice<bf16>,
    /// This step's home token count (one int).
    pub n: CudaSlice<i32>,
    /// 0 (one int, never written): where the shared expert's block starts.
    sh_off: CudaSlice<i32>,
    logits: Logits,
    pub ids: CudaSlice<i32>,
    pub w: CudaSlice<f32>,
    /// The entries' slots (`GpuStep::table`'s map of `ids`).
    sids: CudaSlice<i32>,
    /// This rank's per-expert counts of its home rows, and every rank's `[world][experts]`.
    counts: CudaSlice<i32>,
    pub m: CudaSlice<i32>,
    /// The expert FFN's gate/up and activation rows, and the WMMA kernels' tiles.
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    tiles: CudaSlice<i32>,
    n_tiles: CudaSlice<i32>,
    /// Shared expert: gate/up, activation, output `[T, hidden]`.
    sgu: CudaSlice<bf16>,
    sact: CudaSlice<bf16>,
    sy: CudaSlice<bf16>,
    /// The shared expert's psum ends for the grouped GEMM (one group of `n` rows).
    sh_ends: CudaSlice<i32>,
    /// Combined home rows `[T, hidden]` in f32.
    pub out: CudaSlice<f32>,
    /// FP8 experts: their quantized rows.
    fp8: Option<Fp8Bufs>,
}

impl Buffers {
    fn new(a: &mut Alloc, s: &StepShape) -> Result<Self, DriverError> {
        let (t, h, k, e, l) = (s.max_home, s.hidden, s.top_k, s.experts, s.local());
        let rows = s.row_space();
        let si = s.shared_inter;
        Ok(Self {
            x: a.zeros(t * h)?,
            xb: a.zeros(t * h)?,
            inbox: a.zeros(t * h * 2)?,
            outbox: a.zeros(t * h * 2)?,
            n: a.zeros(1)?,
            sh_off: a.zeros(1)?,
            logits: Logits::new(a, t, s.model_experts)?,
            ids: a.zeros(t * k)?,
            w: a.zeros(t * k)?,
            sids: a.zeros(t * k)?,
            counts: a.zeros(e)?,
            m: a.zeros(s.world * e)?,
            gu: a.zeros(rows * 2 * s.inter)?,
            act: a.zeros(rows * s.inter)?,
            tiles: a.zeros(2 * max_tiles(rows, l))?,
            n_tiles: a.zeros(1)?,
            sgu: a.zeros(t * 2 * si)?,
            sact: a.zeros(t * si)?,
            sy: a.zeros(if si > 0 { t * h } else { 0 })?,
            sh_ends: a.zeros(hopper::MAX_GROUPS)?,
            out: a.zeros(t * h)?,
            fp8: match s.expert_dtype {
                ExpertDtype::Fp8 => Some(Fp8Bufs::new(a, s)?),
                ExpertDtype::Bf16 => None,
            },
        })
    }
}

/// What the exchange reads of the home side, borrowed field by field from the buffers (so the
/// other fields stay free to borrow); `slotted`: the entries' slots (`sids`), where slots move.
macro_rules! home {
    ($b:expr, $slotted:expr) => {
        Home {
            x: &$b.xb,
            ids: if $slotted { &$b.sids } else { &$b.ids },
            w: &$b.w,
            n: &$b.n,
            gathered: &$b.m,
        }
    };
}

/// The exchange `shape` names over `comm`'s members: NCCL EP's groups are collective, every
/// member makes them together.
pub fn exchange(
    comm: &Comm,
    shape: &StepShape,
    a: &mut Alloc,
) -> Result<Box<dyn Exchange>, GpuError> {
    Ok(match shape.ep {
        Some(_) => Box::new(EpExchange::new(comm, shape, a)?),
        None => Box::new(SlotExchange::new(shape, a)?),
    })
}

/// One rank's step machinery: the GPU, its exchange and communicator, weights and buffers.
pub struct GpuStep {
    pub g: Gpu,
    /// Declared before `comm`: NCCL EP's group and handle are torn down before it.
    pub ex: Box<dyn Exchange>,
    /// Two-batch overlap (`split`): the second micro-batch's exchange and rows; before `comm`
    /// too. None: no bucket splits.
    pub twin: Option<split::Twin>,
    pub comm: Comm,
    pub shape: StepShape,
    pub routing: Routing,
    pub layers: Vec<DeviceLayer>,
    pub b: Buffers,
    /// The expert kernels, chosen once per bucket and row format.
    choices: Choices,
    /// Where gating sends each routed entry among its expert's slots (None: expert e is slot
    /// e, the placement of a group whose slots never move).
    pub table: Option<SlotTable>,
    /// `--overlap`: the shared expert's stream, the events it starts after and ends at, and
    /// whether this step's shared expert runs there already (`shared_ahead`).
    side: Arc<CudaStream>,
    fork: CudaEvent,
    join: CudaEvent,
    ahead: bool,
}

impl GpuStep {
    /// Makes the exchange `shape` names (NCCL EP's groups are collective: every rank calls this
    /// together) and allocates the buffers; `layers` were uploaded through the same `Alloc`.
    pub fn new(
        g: Gpu,
        comm: Comm,
        shape: StepShape,
        routing: Routing,
        layers: Vec<DeviceLayer>,
        table: Option<SlotTable>,
        a: &mut Alloc,
    ) -> Result<Self, GpuError> {
        shape.check().map_err(GpuError::Config)?;
        let ex = exchange(&comm, &shape, a)?;
        let twin = match shape.split {
            usize::MAX => None,
            _ => Some(split::Twin::new(&g, &comm, &shape, a)?),
        };
        let b = Buffers::new(a, &shape)?;
        let event = || {
            g.ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
        };
        let (side, fork, join) = (g.ctx.new_stream()?, event()?, event()?);
        Ok(Self {
            side,
            fork,
            join,
            ahead: false,
            g,
            ex,
            twin,
            comm,
            shape,
            routing,
            layers,
            b,
            choices: Choices::default(),
            table,
        })
    }

    /// The experts' bf16 copy of f32 home rows, then the rows' top-k: from the router, or
    /// already on the device (the client's); then each entry's slot, where slots move.
    pub fn gate(&mut self, layer: usize, bucket: usize, v: Variant) -> Result<(), GpuError> {
        let (g, b, s) = (&self.g, &mut self.b, &self.shape);
        if v.rows == HomeDtype::F32 {
            g.f32_to_bf16(&b.x, &b.n, bucket, s.hidden, &mut b.xb)?;
        }
        if !v.client {
            self.top_k(layer, bucket, v.rows)?;
        }
        if let Some(t) = &self.table {
            let b = &mut self.b;
            self.g.to_slots(
                t,
                layer,
                (&b.ids, &mut b.sids),
                &b.n,
                (bucket, self.shape.top_k),
            )?;
        }
        Ok(())
    }

    /// The router's logits and their top-k (logical experts).
    fn top_k(&mut self, layer: usize, bucket: usize, rows: HomeDtype) -> Result<(), GpuError> {
        let (g, b, s, l) = (&self.g, &mut self.b, &self.shape, &self.layers[layer]);
        let (e, k, h) = (s.model_experts, s.top_k, s.hidden);
        match rows {
            HomeDtype::F32 => g.router_logits(&b.x, &l.router, bucket, e, h, &mut b.logits)?,
            HomeDtype::Bf16 => {
                g.router_logits_bf16(&b.xb, &l.pieces, bucket, e, h, &mut b.logits)?
            }
        }
        match self.routing {
            Routing::SoftmaxTopK { renormalize } => g.topk_softmax(
                &b.logits,
                &b.n,
                bucket,
                e,
                k,
                renormalize,
                &mut b.ids,
                &mut b.w,
            )?,
            Routing::SigmoidGroupTopK {
                n_group,
                topk_group,
                renormalize,
                scaling,
            } => g.topk_sigmoid_group(
                &b.logits,
                &l.bias,
                &b.n,
                bucket,
                e,
                k,
                (n_group, topk_group),
                renormalize,
                scaling,
                &mut b.ids,
                &mut b.w,
            )?,
        }
        Ok(())
    }

    /// The exchange's counts, their all-gather, the exchange's prepare.
    pub fn prepare(&mut self, bucket: usize) -> Result<(), GpuError> {
        let (g, b, s, t) = (&self.g, &mut self.b, &self.shape, self.table.is_some());
        self.ex.count(g, &home!(b, t), bucket, &mut b.counts)?;
        self.comm
            .all_gather(&b.counts, &mut b.m, s.experts, &g.stream)?;
        self.ex.prepare(g, &home!(b, t), bucket)
    }

    /// The home rows to the ranks that hold their experts.
    pub fn dispatch(&mut self, bucket: usize) -> Result<(), GpuError> {
        let (b, t) = (&self.b, self.table.is_some());
        self.ex.dispatch(&self.g, &self.comm, &home!(b, t), bucket)
    }

    /// Grouped SwiGLU FFN of every local expert over the rows where the exchange put them, on
    /// the kernels chosen for this bucket and row format (`experts::Routed`); the output
    /// overwrites them.
    pub fn experts(&mut self, layer: usize, bucket: usize) -> Result<(), GpuError> {
        let l = &self.layers[layer];
        let (g, s, b) = (&self.g, &self.shape, &mut self.b);
        routed(
            g,
            s,
            &mut self.choices,
            b,
            l,
            self.ex.as_mut(),
            (bucket, bucket, Sms::All),
        )
    }

    /// `--overlap`: the FP8 shared expert of `layer` launched on the side stream once the gate
    /// has made the home rows, so it runs under the exchange; `combine` waits for it. Whether
    /// it was (only FP8 shared experts: bf16's at decode run on cuBLAS, bound to the step's
    /// stream).
    fn shared_ahead(&mut self, layer: usize, bucket: usize) -> Result<bool, GpuError> {
        let (g, b, s, l) = (&self.g, &mut self.b, &self.shape, &self.layers[layer]);
        let Some(DeviceFfn::Fp8 { gate_up, down }) =
            l.shared.as_ref().filter(|_| bucket <= s.overlap)
        else {
            return Ok(false);
        };
        let (experts::Shared::Fp8, Some(f)) = (self.choices.shared(s, bucket), b.fp8.as_mut())
        else {
            return Ok(false);
        };
        g.psum_ends(&b.sh_off, &b.n, &mut b.sh_ends)?;
        self.fork.record(&g.stream)?;
        self.side.wait(&self.fork)?;
        let (w, rows) = ((gate_up, down), (&b.xb, &b.n));
        let (gu, y) = (&mut b.sgu, &mut b.sy);
        let at = (bucket, Sms::All);
        experts::fp8::shared(g, &self.side, w, at, rows, &b.sh_ends, f, gu, y)?;
        self.join.record(&self.side)?;
        Ok(true)
    }

    /// The shared expert (unless `shared_ahead` launched it: then the wait for it), then the
    /// exchange's combine: expert outputs back home, weighted and summed with the shared
    /// expert's rows.
    pub fn combine(&mut self, layer: usize, bucket: usize) -> Result<(), GpuError> {
        if std::mem::take(&mut self.ahead) {
            self.g.stream.wait(&self.join)?;
        } else {
            self.shared(layer, bucket, Sms::All)?;
        }
        let (g, b, l) = (&self.g, &mut self.b, &self.layers[layer]);
        let t = self.table.is_some();
        let shared = l.shared.as_ref().map(|_| &b.sy);
        self.ex
            .combine(g, &self.comm, &home!(b, t), bucket, shared, &mut b.out)
    }

    /// `layer`'s shared expert over the step's home rows into `sy`, on the step's stream and
    /// `sms` (none where the layer has none).
    fn shared(&mut self, layer: usize, bucket: usize, sms: Sms) -> Result<(), GpuError> {
        let (g, b, s, l) = (&self.g, &mut self.b, &self.shape, &self.layers[layer]);
        let Some(w) = &l.shared else {
            return Ok(());
        };
        let kernels = self.choices.shared(s, bucket);
        let rows = SharedRows {
            fp8: b.fp8.as_mut(),
            xb: &b.xb,
            n: &b.n,
            zero: &b.sh_off,
            ends: &mut b.sh_ends,
            gu: &mut b.sgu,
            act: &mut b.sact,
            y: &mut b.sy,
        };
        experts::shared(g, w, rows, s, (kernels, bucket, sms))
    }

    /// `f`'s work on the stream, captured as an uploaded graph instead of run. The capture ends
    /// whatever `f` returns, so the stream stays usable and the error is `f`'s.
    pub fn capture(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<(), GpuError>,
    ) -> Result<CudaGraph, GpuError> {
        let stream = self.g.stream.clone();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let r = f(self);
        let g = stream.end_capture(CUgraphInstantiate_flags(0));
        r?;
        let g = g?.ok_or_else(|| GpuError::Config("captured an empty step".into()))?;
        g.upload()?;
        Ok(g)
    }

    /// The whole step after the inputs are on the device: as two micro-batches where the
    /// bucket splits (`split`).
    pub fn run(&mut self, layer: usize, bucket: usize, v: Variant) -> Result<(), GpuError> {
        self.run_marked(layer, bucket, v, None).map(|_| ())
    }

    /// `run`, recording `marks` on the stream after gating, prepare, dispatch and the experts;
    /// false (and none recorded) where the step splits in two, whose phases interleave.
    pub fn run_marked(
        &mut self,
        layer: usize,
        bucket: usize,
        v: Variant,
        marks: Option<&[CudaEvent; 4]>,
    ) -> Result<bool, GpuError> {
        if self.splits(bucket) {
            self.run_split(layer, bucket, v)?;
            return Ok(false);
        }
        let s = self.g.stream.clone();
        let mark = |i: usize| marks.map_or(Ok(()), |m| graph::mark_in_capture(&m[i], &s));
        self.gate(layer, bucket, v)?;
        mark(0)?;
        self.ahead = self.shared_ahead(layer, bucket)?;
        self.prepare(bucket)?;
        mark(1)?;
        self.dispatch(bucket)?;
        mark(2)?;
        self.experts(layer, bucket)?;
        mark(3)?;
        self.combine(layer, bucket)?;
        Ok(true)
    }
}

/// Grouped SwiGLU FFN of every local expert of `l` over the rows where `ex` put them (a step
/// of `bucket` home tokens), on the kernels chosen for `step`'s bucket (the whole step's, where
/// it split: its micro-batches run what it would have) and row format, on `sms`; the output
/// overwrites them.
fn routed(
    g: &Gpu,
    s: &StepShape,
    choices: &mut Choices,
    b: &mut Buffers,
    l: &DeviceLayer,
    ex: &mut dyn Exchange,
    (bucket, step, sms): (usize, usize, Sms),
) -> Result<(), GpuError> {
    let rows = ex.expert_rows(g, bucket)?;
    let kernels = choices.routed(s, step, rows.format());
    let scratch = Scratch {
        gu: &mut b.gu,
        act: &mut b.act,
        tiles: &mut b.tiles,
        n_tiles: &mut b.n_tiles,
        fp8: b.fp8.as_mut(),
    };
    experts::routed(g, s, (kernels, bucket, sms), &l.experts, rows, scratch)
}

impl Land for GpuStep {
    fn table_from(&mut self, cur: &SlotMap, next: &SlotMap, plan: &Plan) -> Result<(), GpuError> {
        self.table_mut()?.set(cur, next, plan)?;
        Ok(())
    }

    fn steps(&self) -> &Arc<CudaStream> {
        &self.g.stream
    }

    fn copy(
        &mut self,
        staged: &mut Staged,
        writes: &[Write],
        stream: &Arc<CudaStream>,
    ) -> Result<(), GpuError> {
        let groups = self.shape.experts / self.shape.world;
        let no_cycle =
            || GpuError::Config("a cycle of slot copies with no spare slot staged".into());
        for &w in writes {
            match w {
                Write::Staged(k) => {
                    let (l, i, w) = &staged.slots[k];
                    self.layers[*l].experts.write_group(*i, w, stream)?;
                }
                Write::Copy { layer, from, to } => {
                    (self.layers[layer].experts).copy_group((from, to), groups, stream)?
                }
                Write::Save { layer, from } => {
                    let c = staged.cycle.as_mut().ok_or_else(no_cycle)?;
                    self.layers[layer].experts.read_group(from, c, stream)?;
                }
                Write::Restore { layer, to } => {
                    let c = staged.cycle.as_ref().ok_or_else(no_cycle)?;
                    self.layers[layer].experts.write_group(to, c, stream)?;
                }
            }
        }
        Ok(())
    }

    fn rows(&mut self, layer: usize, k: usize, stream: &Arc<CudaStream>) -> Result<(), GpuError> {
        self.table_mut()?.write(layer, k, stream)?;
        Ok(())
    }

    fn slot_bytes(&self) -> u64 {
        let l = &self.layers[0].experts;
        (l.bytes() / (self.shape.experts / self.shape.world).max(1)) as u64
    }
}

impl GpuStep {
    fn table_mut(&mut self) -> Result<&mut SlotTable, GpuError> {
        self.table.as_mut().ok_or_else(|| {
            GpuError::Config("this group's slots do not move (no slot table)".into())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Variant;

    #[test]
    fn a_variant_indexes_its_place_among_the_captured_graphs() {
        for (i, v) in Variant::ALL.iter().enumerate() {
            assert_eq!(v.index(), i, "{v:?}");
        }
    }
}
