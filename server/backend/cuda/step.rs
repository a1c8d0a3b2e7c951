//! The GPU step: persistent device buffers sized at startup for the largest bucket, and the five
//! phases enqueued on the rank's stream with no host sync, so a whole step can be captured.
//! The same straight line for every exchange (`exchange.rs`): gating, then the exchange's
//! count, all-gather and prepare, its dispatch, the expert FFN over the rows where the exchange
//! says they are, and its combine. A bucket is a capacity of home tokens per rank; every rank of a
//! step uses the same one, so the exchanges' fixed sizes match on both ends.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, DriverError};
use half::bf16;

use super::decode_gemm::{DecodeGemm, Out};
use super::ep::EpExchange;
use super::exchange::{Exchange, ExpertRows, Home};
use super::fp8::Fp8Weights;
use super::fp8_ffn::{self, Fp8Bufs};
use super::hopper::{self, Gemm, Hopper, Layout};
use super::nccl::Comm;
use super::shape::StepShape;
use super::slots::SlotExchange;
use super::{max_tiles, Blocks, Gpu, Logits, ROUTER_PIECES};
use super::{Alloc, GpuError};
use crate::model::{ExpertDtype, Ffn, LayerWeights, Matrix, Routing};

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

/// A grouped SwiGLU FFN's weights on the device: gate/up `[groups][2 * inter][hidden]` and down
/// `[groups][hidden][inter]`, in bf16 or in FP8 with their 128x128 block scales.
pub enum DeviceFfn {
    Bf16 {
        gate_up: CudaSlice<bf16>,
        down: CudaSlice<bf16>,
    },
    Fp8 {
        gate_up: Fp8Weights,
        down: Fp8Weights,
    },
}

impl DeviceFfn {
    fn bytes(&self) -> usize {
        match self {
            DeviceFfn::Bf16 { gate_up, down } => (gate_up.len() + down.len()) * 2,
            DeviceFfn::Fp8 { gate_up, down } => gate_up.bytes() + down.bytes(),
        }
    }

    /// `ffns` (`groups` of intermediate size `inter`) uploaded in `dtype`.
    fn upload<'a>(
        a: &mut Alloc,
        ffns: impl ExactSizeIterator<Item = &'a Ffn> + Clone,
        (hidden, inter): (usize, usize),
        dtype: ExpertDtype,
    ) -> Result<Self, DriverError> {
        Ok(match dtype {
            ExpertDtype::Bf16 => DeviceFfn::Bf16 {
                gate_up: a.upload(&to_bf16(ffns.clone().map(|f| &f.gate_up)))?,
                down: a.upload(&to_bf16(ffns.map(|f| &f.down)))?,
            },
            ExpertDtype::Fp8 => {
                let (gate_up, down) = fp8_ffn::upload(a, ffns, hidden, inter)?;
                DeviceFfn::Fp8 { gate_up, down }
            }
        })
    }

    /// Random weights made on the GPU (`epserve bench`: timing, not numerics).
    fn random(
        g: &Gpu,
        a: &mut Alloc,
        (groups, hidden, inter): (usize, usize, usize),
        seed: u64,
        dtype: ExpertDtype,
    ) -> Result<Self, DriverError> {
        Ok(match dtype {
            ExpertDtype::Bf16 => {
                let mut gate_up = a.zeros::<bf16>(groups * 2 * inter * hidden)?;
                let mut down = a.zeros::<bf16>(groups * hidden * inter)?;
                g.fill_uniform_bf16(&mut gate_up, seed, (3.0 / hidden as f32).sqrt())?;
                g.fill_uniform_bf16(&mut down, seed + 1, (3.0 / inter as f32).sqrt())?;
                DeviceFfn::Bf16 { gate_up, down }
            }
            ExpertDtype::Fp8 => {
                let (gate_up, down) = fp8_ffn::random(g, a, (groups, hidden, inter), seed)?;
                DeviceFfn::Fp8 { gate_up, down }
            }
        })
    }
}

fn to_bf16<'a>(parts: impl Iterator<Item = &'a Matrix>) -> Vec<bf16> {
    let mut out = Vec::new();
    for m in parts {
        out.extend(m.values().iter().map(|&v| bf16::from_f32(v)));
    }
    out
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
                None => a.zeros(s.experts)?,
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
        let mut router = a.zeros::<f32>(s.experts * h)?;
        g.fill_uniform_f32(&mut router, seed, (3.0 / h as f32).sqrt())?;
        let shared = match s.shared_inter {
            0 => None,
            si => Some(DeviceFfn::random(g, a, (1, h, si), seed + 3, dtype)?),
        };
        Ok(Self {
            pieces: pieces(g, a, &router)?,
            router,
            bias: a.zeros(s.experts)?,
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
    /// FP8 experts: their quantised rows.
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
            logits: Logits::new(a, t, e)?,
            ids: a.zeros(t * k)?,
            w: a.zeros(t * k)?,
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
/// other fields stay free to borrow).
macro_rules! home {
    ($b:expr) => {
        Home {
            x: &$b.xb,
            ids: &$b.ids,
            w: &$b.w,
            n: &$b.n,
            gathered: &$b.m,
        }
    };
}

/// One rank's step machinery: the GPU, its exchange and communicator, weights and buffers.
pub struct GpuStep {
    pub g: Gpu,
    /// Declared before `comm`: NCCL EP's group and handle are torn down before it.
    pub ex: Box<dyn Exchange>,
    pub comm: Comm,
    pub shape: StepShape,
    pub routing: Routing,
    pub layers: Vec<DeviceLayer>,
    pub b: Buffers,
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
        a: &mut Alloc,
    ) -> Result<Self, GpuError> {
        shape.check().map_err(GpuError::Config)?;
        let ex: Box<dyn Exchange> = match shape.ep {
            Some(_) => Box::new(EpExchange::new(&comm, &shape, a)?),
            None => Box::new(SlotExchange::new(&shape, a)?),
        };
        let b = Buffers::new(a, &shape)?;
        Ok(Self {
            g,
            ex,
            comm,
            shape,
            routing,
            layers,
            b,
        })
    }

    /// The experts' bf16 copy of f32 home rows, then the rows' top-k: from the router, or
    /// already on the device (the client's).
    pub fn gate(&mut self, layer: usize, bucket: usize, v: Variant) -> Result<(), GpuError> {
        let (g, b, s, l) = (&self.g, &mut self.b, &self.shape, &self.layers[layer]);
        let (e, k, h) = (s.experts, s.top_k, s.hidden);
        if v.rows == HomeDtype::F32 {
            g.f32_to_bf16(&b.x, &b.n, bucket, h, &mut b.xb)?;
        }
        if v.client {
            return Ok(());
        }
        match v.rows {
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
        let (g, b, s) = (&self.g, &mut self.b, &self.shape);
        self.ex.count(g, &home!(b), bucket, &mut b.counts)?;
        self.comm
            .all_gather(&b.counts, &mut b.m, s.experts, &g.stream)?;
        self.ex.prepare(g, &home!(b), bucket)
    }

    /// The home rows to the ranks that hold their experts.
    pub fn dispatch(&mut self, bucket: usize) -> Result<(), GpuError> {
        let b = &self.b;
        self.ex.dispatch(&self.g, &self.comm, &home!(b), bucket)
    }

    /// Grouped SwiGLU FFN of every local expert over the rows where the exchange put them; the
    /// output overwrites them. The Hopper GEMM runs it where the shapes allow (`Hopper::fits`),
    /// the WMMA kernels elsewhere.
    pub fn experts(&mut self, layer: usize, bucket: usize) -> Result<(), GpuError> {
        let (g, s, l) = (&self.g, &self.shape, &self.layers[layer]);
        let Buffers {
            gu,
            act,
            tiles,
            n_tiles,
            fp8,
            ..
        } = &mut self.b;
        // Rows an expert gets on average from a full bucket on every rank.
        let mean_rows = (s.world * bucket * s.top_k).div_ceil(s.experts);
        let rows = self.ex.expert_rows(g, bucket)?;
        let (gate_up, down) = match (&l.experts, fp8) {
            (DeviceFfn::Fp8 { gate_up, down }, Some(b)) => {
                let w = (gate_up, down);
                return match rows {
                    ExpertRows::Blocks {
                        x,
                        cap,
                        offsets,
                        ends,
                        total,
                        weights,
                        fp8,
                    } => {
                        let at = (offsets, ends, total);
                        let rows = (cap, fp8);
                        fp8_ffn::contiguous(g, w, rows, at, mean_rows, weights, b, gu, x)
                    }
                    ExpertRows::Strided {
                        x, stride, counts, ..
                    } => fp8_ffn::strided(g, w, (stride, counts), mean_rows, b, gu, x),
                };
            }
            (DeviceFfn::Bf16 { gate_up, down }, _) => (gate_up, down),
            (DeviceFfn::Fp8 { .. }, None) => {
                return Err(GpuError::Config("FP8 experts without FP8 buffers".into()))
            }
        };
        let w = FfnWeights {
            gate_up,
            down,
            groups: s.local(),
            inter: s.inter,
        };
        let scratch = (tiles, n_tiles, gu, act);
        match rows {
            ExpertRows::Blocks { fp8: Some(_), .. } => {
                Err(GpuError::Config("FP8 rows for bf16 experts".into()))
            }
            ExpertRows::Blocks {
                x,
                cap,
                offsets,
                ends,
                total,
                weights,
                fp8: None,
            } => {
                let blocks = Contiguous {
                    offsets,
                    ends,
                    rows: total,
                    weights,
                };
                contiguous_ffn(g, w, blocks, cap, s.hidden, scratch, x)
            }
            ExpertRows::Strided {
                x,
                stride,
                counts,
                bounds,
                valid,
            } => {
                let rows = Strided {
                    stride,
                    counts,
                    bounds,
                    valid,
                    mean_rows,
                };
                strided_ffn(g, w, rows, s.hidden, scratch, x)
            }
        }
    }

    /// The shared expert, then the exchange's combine: expert outputs back home, weighted and
    /// summed with the shared expert's rows.
    pub fn combine(&mut self, layer: usize, bucket: usize) -> Result<(), GpuError> {
        let (g, b, s, l) = (&self.g, &mut self.b, &self.shape, &self.layers[layer]);
        match (&l.shared, &mut b.fp8) {
            (None, _) => {}
            (Some(DeviceFfn::Bf16 { gate_up, down }), _) => {
                shared_ffn(g, s, (gate_up, down), bucket, b)?
            }
            (Some(DeviceFfn::Fp8 { gate_up, down }), Some(f)) => fp8_ffn::shared(
                g,
                (gate_up, down),
                bucket,
                (&b.xb, &b.n),
                (&b.sh_off, &mut b.sh_ends),
                f,
                &mut b.sgu,
                &mut b.sy,
            )?,
            (Some(DeviceFfn::Fp8 { .. }), None) => {
                return Err(GpuError::Config("FP8 experts without FP8 buffers".into()))
            }
        }
        let shared = l.shared.as_ref().map(|_| &b.sy);
        self.ex
            .combine(g, &self.comm, &home!(b), bucket, shared, &mut b.out)
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

    /// The whole step after the inputs are on the device.
    pub fn run(&mut self, layer: usize, bucket: usize, v: Variant) -> Result<(), GpuError> {
        self.gate(layer, bucket, v)?;
        self.prepare(bucket)?;
        self.dispatch(bucket)?;
        self.experts(layer, bucket)?;
        self.combine(layer, bucket)
    }
}

/// Contiguous expert-major blocks on the device: expert e's rows start at `offsets[e]` (a
/// multiple of `hopper::ALIGN`) and end at `ends[e]`; `rows` is the padded total. `weights`:
/// each row's routing weight, to scale its output by.
struct Contiguous<'a> {
    offsets: &'a CudaSlice<i32>,
    ends: &'a CudaSlice<i32>,
    rows: &'a CudaSlice<i32>,
    weights: Option<&'a CudaSlice<f32>>,
}

/// A grouped SwiGLU FFN's weights: `groups` experts of intermediate size `inter`.
struct FfnWeights<'a> {
    /// `[groups][2 * inter][hidden]`.
    gate_up: &'a CudaSlice<bf16>,
    /// `[groups][hidden][inter]`.
    down: &'a CudaSlice<bf16>,
    groups: usize,
    inter: usize,
}

/// The WMMA kernels' tile lists, then the gate/up and activation rows.
type Scratch<'a> = (
    &'a mut CudaSlice<i32>,
    &'a mut CudaSlice<i32>,
    &'a mut CudaSlice<bf16>,
    &'a mut CudaSlice<bf16>,
);

/// The FFN over contiguous blocks of at most `rows` rows, in place on `x`: gate/up, SwiGLU,
/// down. A row's weight scales its activation (the down projection is linear), or its output on
/// the WMMA path.
fn contiguous_ffn(
    g: &Gpu,
    w: FfnWeights,
    b: Contiguous,
    rows: usize,
    h: usize,
    (tiles, n_tiles, gu, act): Scratch,
    x: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    let (i, groups) = (w.inter, w.groups);
    let psum = Layout::Psum;
    if Hopper::fits(psum, groups, 2 * i, h) && Hopper::fits(psum, groups, h, i) {
        let up = Gemm {
            x,
            rows,
            w: w.gate_up,
            groups,
            n: 2 * i,
            k: h,
            layout: psum,
            sizes: b.ends,
        };
        g.hopper.gemm(up, gu, &g.stream)?;
        g.swiglu(gu, b.rows, rows, i, b.weights, act)?;
        let down = Gemm {
            x: act,
            rows,
            w: w.down,
            groups,
            n: h,
            k: i,
            layout: psum,
            sizes: b.ends,
        };
        g.hopper.gemm(down, x, &g.stream)?;
        return Ok(());
    }
    let blocks = Blocks::Offsets(b.offsets);
    g.grouped_gemm(
        x,
        w.gate_up,
        blocks,
        groups,
        rows,
        2 * i,
        h,
        tiles,
        n_tiles,
        gu,
    )?;
    g.swiglu(gu, b.rows, rows, i, None, act)?;
    g.grouped_gemm(act, w.down, blocks, groups, rows, h, i, tiles, n_tiles, x)?;
    if let Some(wt) = b.weights {
        g.scale_rows(x, wt, b.rows, rows, h)?;
    }
    Ok(())
}

/// Fixed-stride expert rows: expert e's `counts[e]` rows start at `e * stride`; `bounds` are the
/// same blocks for the WMMA kernels, `valid` the most rows in all, `mean_rows` what an expert
/// gets on average. Combine weighs the outputs.
struct Strided<'a> {
    stride: usize,
    counts: &'a CudaSlice<i32>,
    bounds: &'a CudaSlice<i32>,
    valid: usize,
    mean_rows: usize,
}

/// The FFN over fixed-stride expert rows, in place on `x`: decode's own GEMM for experts of a
/// few rows (SwiGLU in its gate/up pass), DeepGEMM's masked layout for more, or the WMMA kernels
/// over the same blocks.
fn strided_ffn(
    g: &Gpu,
    w: FfnWeights,
    r: Strided,
    h: usize,
    (tiles, n_tiles, gu, act): Scratch,
    x: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    let (i, groups) = (w.inter, w.groups);
    let masked = Layout::Masked {
        stride: r.stride,
        mean_rows: r.mean_rows,
    };
    let both = |fits: fn(Layout, usize, usize, usize) -> bool| {
        fits(masked, groups, 2 * i, h) && fits(masked, groups, h, i)
    };
    // The decode GEMM where it is the faster kernel, and where DeepGEMM's tile does not fit (a
    // stride off its 64 rows): it beats the WMMA kernels from decode to 128 rows per expert
    // (docs/benchmarks.md, "Where the decode GEMM stops paying").
    let tile = both(Hopper::fits);
    let decode = both(DecodeGemm::takes) || (both(DecodeGemm::fits) && !tile);
    if decode || tile {
        let span = groups * r.stride;
        let up = Gemm {
            x,
            rows: span,
            w: w.gate_up,
            groups,
            n: 2 * i,
            k: h,
            layout: masked,
            sizes: r.counts,
        };
        if decode {
            g.decode.gemm(up, Out::SwiGlu, act)?;
        } else {
            g.hopper.gemm(up, gu, &g.stream)?;
            g.swiglu_masked(gu, r.counts, groups, r.stride, i, act)?;
        }
        let down = Gemm {
            x: act,
            rows: span,
            w: w.down,
            groups,
            n: h,
            k: i,
            layout: masked,
            sizes: r.counts,
        };
        match decode {
            true => g.decode.gemm(down, Out::Plain, x)?,
            false => g.hopper.gemm(down, x, &g.stream)?,
        }
        return Ok(());
    }
    let blocks = Blocks::Bounds(r.bounds);
    let (rows, tiles_cap) = (r.valid, max_tiles(r.valid, groups));
    g.grouped_gemm(
        x,
        w.gate_up,
        blocks,
        groups,
        rows,
        2 * i,
        h,
        tiles,
        n_tiles,
        gu,
    )?;
    g.swiglu_tiles(gu, tiles, n_tiles, r.bounds, groups, tiles_cap, i, act)?;
    g.grouped_gemm(act, w.down, blocks, groups, rows, h, i, tiles, n_tiles, x)?;
    Ok(())
}

/// Buckets of at most this many rows run the shared expert on cuBLAS over the whole bucket: its
/// weights' read dominates, and one expert's block would give the grouped GEMM a few column
/// tiles and leave most SMs idle (at decode, 139 µs on DeepGEMM against 33 µs on cuBLAS:
/// docs/benchmarks.md). Past it compute dominates, the block has tiles for every SM, and the
/// grouped GEMM skips the bucket's padding rows, which cuBLAS would compute.
const SHARED_DENSE_ROWS: usize = 256;

/// The shared expert over the bucket's home rows (`xb`, `n` of them) into `sy`.
fn shared_ffn(
    g: &Gpu,
    s: &StepShape,
    (gate_up, down): (&CudaSlice<bf16>, &CudaSlice<bf16>),
    bucket: usize,
    b: &mut Buffers,
) -> Result<(), GpuError> {
    let (h, i) = (s.hidden, s.shared_inter);
    let psum = Layout::Psum;
    if bucket <= SHARED_DENSE_ROWS
        || !(Hopper::fits(psum, 1, 2 * i, h) && Hopper::fits(psum, 1, h, i))
    {
        g.gemm_bf16(gate_up, &b.xb, (bucket, 2 * i, h), &mut b.sgu)?;
        g.swiglu(&b.sgu, &b.n, bucket, i, None, &mut b.sact)?;
        return g.gemm_bf16(down, &b.sact, (bucket, h, i), &mut b.sy);
    }
    // One block of `n` rows from row 0.
    g.psum_ends(&b.sh_off, &b.n, &mut b.sh_ends)?;
    let gemm = |x, w, n, k| Gemm {
        x,
        rows: bucket,
        w,
        groups: 1,
        n,
        k,
        layout: psum,
        sizes: &b.sh_ends,
    };
    g.hopper
        .gemm(gemm(&b.xb, gate_up, 2 * i, h), &mut b.sgu, &g.stream)?;
    g.swiglu(&b.sgu, &b.n, bucket, i, None, &mut b.sact)?;
    g.hopper
        .gemm(gemm(&b.sact, down, h, i), &mut b.sy, &g.stream)?;
    Ok(())
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
