//! The GPU step: persistent device buffers sized at startup for the largest bucket, and the five
//! phases enqueued on the rank's stream with no host sync, so a whole step can be captured.
//! A bucket is a capacity of home tokens per rank; every rank of a step uses the same one, so the
//! fixed-size slot exchange matches on both ends.

use cudarc::driver::{CudaSlice, DriverError};
use half::bf16;

use super::ep::EpExchange;
use super::hopper::{self, Gemm, Hopper, Layout};
use super::nccl::Comm;
use super::shape::StepShape;
use super::{max_tiles, Blocks, Gpu};
use super::{Alloc, GpuError};
use crate::model::{Ffn, LayerWeights, Routing};

/// One MoE layer on the device: the router in f32, this rank's experts in bf16.
pub struct DeviceLayer {
    router: CudaSlice<f32>,
    bias: CudaSlice<f32>,
    /// `[local][2 * inter][hidden]`.
    w_gu: CudaSlice<bf16>,
    /// `[local][hidden][inter]`.
    w_down: CudaSlice<bf16>,
    shared: Option<(CudaSlice<bf16>, CudaSlice<bf16>)>,
}

fn to_bf16<'a>(parts: impl Iterator<Item = &'a [f32]>) -> Vec<bf16> {
    parts.flatten().map(|&v| bf16::from_f32(v)).collect()
}

impl DeviceLayer {
    pub fn upload(a: &mut Alloc, l: &LayerWeights, experts: usize) -> Result<Self, DriverError> {
        let ffn = |a: &mut Alloc, f: &Ffn| -> Result<_, DriverError> {
            Ok((
                a.upload(&to_bf16(std::iter::once(&f.gate_up[..])))?,
                a.upload(&to_bf16(std::iter::once(&f.down[..])))?,
            ))
        };
        Ok(Self {
            router: a.upload(&l.router)?,
            bias: match &l.bias {
                Some(b) => a.upload(b)?,
                None => a.zeros(experts)?,
            },
            w_gu: a.upload(&to_bf16(l.experts.iter().map(|f| &f.gate_up[..])))?,
            w_down: a.upload(&to_bf16(l.experts.iter().map(|f| &f.down[..])))?,
            shared: l.shared.as_ref().map(|f| ffn(a, f)).transpose()?,
        })
    }

    /// Random weights made on the GPU (for `epserve bench`: timing, not numerics).
    pub fn random(g: &Gpu, a: &mut Alloc, s: &StepShape, seed: u64) -> Result<Self, DriverError> {
        let (h, i, l) = (s.hidden, s.inter, s.local());
        let mut router = a.zeros::<f32>(s.experts * h)?;
        let mut w_gu = a.zeros::<bf16>(l * 2 * i * h)?;
        let mut w_down = a.zeros::<bf16>(l * h * i)?;
        g.fill_uniform_f32(&mut router, seed, (3.0 / h as f32).sqrt())?;
        g.fill_uniform_bf16(&mut w_gu, seed + 1, (3.0 / h as f32).sqrt())?;
        g.fill_uniform_bf16(&mut w_down, seed + 2, (3.0 / i as f32).sqrt())?;
        let shared = match s.shared_inter {
            0 => None,
            si => {
                let mut gu = a.zeros::<bf16>(2 * si * h)?;
                let mut dn = a.zeros::<bf16>(h * si)?;
                g.fill_uniform_bf16(&mut gu, seed + 3, (3.0 / h as f32).sqrt())?;
                g.fill_uniform_bf16(&mut dn, seed + 4, (3.0 / si as f32).sqrt())?;
                Some((gu, dn))
            }
        };
        Ok(Self {
            router,
            bias: a.zeros(s.experts)?,
            w_gu,
            w_down,
            shared,
        })
    }
}

/// The step's persistent device buffers, sized for the largest bucket.
pub struct Buffers {
    /// Home tokens `[T, hidden]` in f32 (the router's input) and bf16 (the experts').
    pub x: CudaSlice<f32>,
    pub xb: CudaSlice<bf16>,
    /// The home rows in a 16-bit wire dtype (bf16 or f16) on their way in from the host ring,
    /// or out to it; outside the step's graph, so no peer ever reads it.
    pub wire: CudaSlice<bf16>,
    /// This step's home token count (one int), and `[0, n]` for the shared expert's GEMM.
    pub n: CudaSlice<i32>,
    pub sh_off: CudaSlice<i32>,
    logits: CudaSlice<f32>,
    pub ids: CudaSlice<i32>,
    pub w: CudaSlice<f32>,
    counts: CudaSlice<i32>,
    offsets: CudaSlice<i32>,
    pos_of: CudaSlice<i32>,
    entry_of: CudaSlice<i32>,
    /// All-gathered counts `[world][experts]`.
    pub m: CudaSlice<i32>,
    /// Slots out and in; reused by the return exchange.
    send: CudaSlice<bf16>,
    recv: CudaSlice<bf16>,
    map: CudaSlice<i32>,
    local_off: CudaSlice<i32>,
    /// Rows the experts received this step (NCCL EP HT: the padded total).
    pub rows: CudaSlice<i32>,
    /// Expert-major received rows; reused for the expert outputs (NCCL EP: in the exchange).
    xe: CudaSlice<bf16>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    tiles: CudaSlice<i32>,
    n_tiles: CudaSlice<i32>,
    /// The Hopper GEMM's per-expert sizes (`hopper::MAX_GROUPS`): psum ends or masked counts.
    sizes: CudaSlice<i32>,
    idx: CudaSlice<i32>,
    /// Shared expert: gate/up, activation, output `[T, hidden]`.
    sgu: CudaSlice<bf16>,
    sact: CudaSlice<bf16>,
    sy: CudaSlice<bf16>,
    /// The shared expert's psum ends for the Hopper GEMM (one group of `n` rows).
    sh_ends: CudaSlice<i32>,
    stiles: CudaSlice<i32>,
    sn_tiles: CudaSlice<i32>,
    /// Combined home rows `[T, hidden]` in f32.
    pub out: CudaSlice<f32>,
}

impl Buffers {
    fn new(a: &mut Alloc, s: &StepShape) -> Result<Self, DriverError> {
        let (t, h, k, e, l) = (s.max_home, s.hidden, s.top_k, s.experts, s.local());
        let rows = s.row_space();
        // The slot exchange's buffers; NCCL EP dispatches straight into its own expert rows.
        let (slots, expert_rows) = match s.ep {
            None => (s.slot_space(t), rows),
            Some(_) => (0, 0),
        };
        let si = s.shared_inter;
        Ok(Self {
            x: a.zeros(t * h)?,
            xb: a.zeros(t * h)?,
            wire: a.zeros(t * h)?,
            n: a.zeros(1)?,
            sh_off: a.zeros(2)?,
            logits: a.zeros(t * e)?,
            ids: a.zeros(t * k)?,
            w: a.zeros(t * k)?,
            counts: a.zeros(e)?,
            offsets: a.zeros(e + 1)?,
            pos_of: a.zeros(t * k)?,
            entry_of: a.zeros(t * k)?,
            m: a.zeros(s.world * e)?,
            send: a.zeros(slots * h)?,
            recv: a.zeros(slots * h)?,
            map: a.zeros(slots)?,
            local_off: a.zeros(l + 1)?,
            rows: a.zeros(1)?,
            xe: a.zeros(expert_rows * h)?,
            gu: a.zeros(rows * 2 * s.inter)?,
            act: a.zeros(rows * s.inter)?,
            tiles: a.zeros(2 * max_tiles(rows, l))?,
            n_tiles: a.zeros(1)?,
            sizes: a.zeros(hopper::MAX_GROUPS)?,
            idx: a.zeros(t * k)?,
            sgu: a.zeros(t * 2 * si)?,
            sact: a.zeros(t * si)?,
            sy: a.zeros(if si > 0 { t * h } else { 0 })?,
            sh_ends: a.zeros(hopper::MAX_GROUPS)?,
            stiles: a.zeros(2 * max_tiles(t, 1))?,
            sn_tiles: a.zeros(1)?,
            out: a.zeros(t * h)?,
        })
    }
}

/// One rank's step machinery: the GPU, its communicator, weights and buffers.
pub struct GpuStep {
    pub g: Gpu,
    /// The NCCL EP exchange (declared before `comm`: torn down first).
    pub ep: Option<EpExchange>,
    pub comm: Comm,
    pub shape: StepShape,
    pub routing: Routing,
    pub layers: Vec<DeviceLayer>,
    pub b: Buffers,
}

impl GpuStep {
    /// Allocates the buffers; `layers` were uploaded through the same `Alloc`.
    pub fn new(
        g: Gpu,
        comm: Comm,
        ep: Option<EpExchange>,
        shape: StepShape,
        routing: Routing,
        layers: Vec<DeviceLayer>,
        a: &mut Alloc,
    ) -> Result<Self, GpuError> {
        shape.check().map_err(GpuError::Config)?;
        let b = Buffers::new(a, &shape)?;
        Ok(Self {
            g,
            ep,
            comm,
            shape,
            routing,
            layers,
            b,
        })
    }

    /// Router logits and top-k over the home tokens.
    pub fn gate(&mut self, layer: usize, bucket: usize) -> Result<(), GpuError> {
        let (g, b, s, l) = (&self.g, &mut self.b, &self.shape, &self.layers[layer]);
        let (e, k, h) = (s.experts, s.top_k, s.hidden);
        g.router_logits(&b.x, &l.router, bucket, e, h, &mut b.logits)?;
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

    /// bf16 copy of the tokens, expert-major layout, all-gather of per-expert counts.
    pub fn prepare(&mut self, bucket: usize) -> Result<(), GpuError> {
        let (g, b, s) = (&self.g, &mut self.b, &self.shape);
        let (e, k, h) = (s.experts, s.top_k, s.hidden);
        g.f32_to_bf16(&b.x, &b.n, bucket, h, &mut b.xb)?;
        match &mut self.ep {
            // NCCL EP lays the rows out itself: only the counts, for the routing metrics.
            Some(_) => g.count_experts(&b.ids, &b.n, bucket, k, &mut b.counts)?,
            None => g.layout(
                &b.ids,
                &b.n,
                bucket,
                k,
                e,
                &mut b.counts,
                &mut b.offsets,
                &mut b.pos_of,
                &mut b.entry_of,
            )?,
        }
        self.comm.all_gather(&b.counts, &mut b.m, e, &g.stream)?;
        if let Some(ep) = &mut self.ep {
            ep.update(&b.ids, bucket, k, &mut b.local_off, &mut b.rows, &g.stream)?;
        }
        Ok(())
    }

    /// Tokens into per-peer slots, one grouped send/recv, received rows into expert-major order.
    pub fn dispatch(&mut self, bucket: usize) -> Result<(), GpuError> {
        let (g, b, s) = (&self.g, &mut self.b, &self.shape);
        if let Some(ep) = &mut self.ep {
            return ep.dispatch(&b.xb, &b.w, bucket, s.top_k, s.hidden, &g.stream);
        }
        let sl = s.slots(bucket);
        let rows = s.slot_space(bucket);
        g.pack_slots(
            &b.xb,
            &b.entry_of,
            &b.offsets,
            sl,
            s.top_k,
            s.hidden,
            bucket * s.top_k,
            &mut b.send,
        )?;
        self.comm
            .exchange_slots(&b.send, &mut b.recv, sl.slot_rows * s.hidden, &g.stream)?;
        g.recv_map(
            &b.m,
            sl,
            hopper::ALIGN,
            &mut b.map,
            &mut b.local_off,
            &mut b.rows,
            &mut b.sizes,
        )?;
        g.scatter_by_map(&b.recv, &b.map, rows, s.hidden, &mut b.xe)?;
        Ok(())
    }

    /// Grouped SwiGLU FFN of every local expert; the output overwrites the expert rows. The
    /// Hopper GEMM runs it where the shapes allow (`Hopper::fits`), the WMMA kernels elsewhere.
    pub fn experts(&mut self, layer: usize, bucket: usize) -> Result<(), GpuError> {
        let (g, s, l) = (&self.g, &self.shape, &self.layers[layer]);
        let (h, i, local) = (s.hidden, s.inter, s.local());
        let rows = s.recv_rows(bucket);
        let Buffers {
            xe,
            gu,
            act,
            tiles,
            n_tiles,
            sizes,
            local_off,
            rows: n_rows,
            ..
        } = &mut self.b;
        let Some(ep) = &mut self.ep else {
            // `recv_map` laid the rows out aligned and wrote their ends.
            let blocks = Contiguous {
                offsets: local_off,
                ends: sizes,
                rows: n_rows,
                weights: None,
            };
            return contiguous_ffn(g, l, blocks, rows, s, (tiles, n_tiles), (gu, act), xe);
        };
        if ep.is_ll(bucket) {
            // LL rows: expert e's `counters[e]` rows start at e x (world x tokens).
            let EpExchange {
                ll,
                counters,
                bounds,
                ..
            } = ep;
            let p = ll.as_mut().expect("an LL path for LL buckets");
            let stride = p.cap;
            g.ll_bounds(counters, stride, bounds, sizes)?;
            let masked = Layout::Masked { stride };
            if Hopper::fits(masked, local, 2 * i, h) && Hopper::fits(masked, local, h, i) {
                let span = local * stride;
                g.hopper.gemm(
                    Gemm {
                        x: p.rows(),
                        rows: span,
                        w: &l.w_gu,
                        groups: local,
                        n: 2 * i,
                        k: h,
                        layout: masked,
                        sizes,
                    },
                    gu,
                    &g.stream,
                )?;
                g.swiglu_masked(gu, sizes, local, stride, i, act)?;
                let down = Gemm {
                    x: act,
                    rows: span,
                    w: &l.w_down,
                    groups: local,
                    n: h,
                    k: i,
                    layout: masked,
                    sizes,
                };
                g.hopper.gemm(down, p.rows_mut(), &g.stream)?;
                return Ok(());
            }
            let valid = s.world * p.tokens * s.top_k.min(local);
            g.grouped_gemm(
                p.rows(),
                &l.w_gu,
                Blocks::Bounds(bounds),
                local,
                valid,
                2 * i,
                h,
                tiles,
                n_tiles,
                gu,
            )?;
            g.swiglu_tiles(
                gu,
                tiles,
                n_tiles,
                bounds,
                local,
                max_tiles(valid, local),
                i,
                act,
            )?;
            g.grouped_gemm(
                act,
                &l.w_down,
                Blocks::Bounds(bounds),
                local,
                valid,
                h,
                i,
                tiles,
                n_tiles,
                p.rows_mut(),
            )?;
            return Ok(());
        }
        let EpExchange {
            ht,
            recv_w,
            counters,
            ..
        } = ep;
        let p = ht.as_mut().expect("an HT path for HT buckets");
        // HT blocks start at multiples of `hopper::ALIGN` (the handle's expert alignment); its
        // combine sums rows as they come, so each row carries its routing weight.
        g.psum_ends(local_off, counters, sizes)?;
        let blocks = Contiguous {
            offsets: local_off,
            ends: sizes,
            rows: n_rows,
            weights: Some(recv_w),
        };
        contiguous_ffn(
            g,
            l,
            blocks,
            rows,
            s,
            (tiles, n_tiles),
            (gu, act),
            p.rows_mut(),
        )
    }

    /// Expert outputs back to their home ranks, the shared expert, and the weighted sum.
    pub fn combine(&mut self, layer: usize, bucket: usize) -> Result<(), GpuError> {
        let (g, b, s, l) = (&self.g, &mut self.b, &self.shape, &self.layers[layer]);
        let (h, k) = (s.hidden, s.top_k);
        let sl = s.slots(bucket);
        match &mut self.ep {
            Some(ep) => ep.combine(&b.w, bucket, k, h, &g.stream)?,
            None => {
                g.gather_by_map(&b.xe, &b.map, s.slot_space(bucket), h, &mut b.send)?;
                self.comm
                    .exchange_slots(&b.send, &mut b.recv, sl.slot_rows * h, &g.stream)?;
                g.slot_index(
                    &b.ids, &b.pos_of, &b.offsets, &b.n, bucket, k, sl, &mut b.idx,
                )?;
            }
        }
        if let Some((w_gu, w_down)) = &l.shared {
            shared_ffn(g, s, (w_gu, w_down), bucket, b)?;
        }
        let shared = l.shared.as_ref().map(|_| &b.sy);
        match &self.ep {
            Some(ep) => g.widen_add(&ep.out_b, shared, &b.n, bucket, h, &mut b.out)?,
            None => g.combine(
                &b.recv, &b.idx, &b.w, &b.n, bucket, k, h, shared, &mut b.out,
            )?,
        }
        Ok(())
    }

    /// The whole step after the inputs are on the device.
    pub fn run(&mut self, layer: usize, bucket: usize, client: bool) -> Result<(), GpuError> {
        if !client {
            self.gate(layer, bucket)?;
        }
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

/// The FFN over contiguous expert blocks of at most `rows` rows, in place on `xe`: gate/up,
/// SwiGLU, down. A row's weight scales its activation (the down projection is linear), or its
/// output on the WMMA path.
#[allow(clippy::too_many_arguments)]
fn contiguous_ffn(
    g: &Gpu,
    l: &DeviceLayer,
    b: Contiguous,
    rows: usize,
    s: &StepShape,
    (tiles, n_tiles): (&mut CudaSlice<i32>, &mut CudaSlice<i32>),
    (gu, act): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
    xe: &mut CudaSlice<bf16>,
) -> Result<(), GpuError> {
    let (h, i, local) = (s.hidden, s.inter, s.local());
    let psum = Layout::Psum;
    if Hopper::fits(psum, local, 2 * i, h) && Hopper::fits(psum, local, h, i) {
        let up = Gemm {
            x: xe,
            rows,
            w: &l.w_gu,
            groups: local,
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
            w: &l.w_down,
            groups: local,
            n: h,
            k: i,
            layout: psum,
            sizes: b.ends,
        };
        g.hopper.gemm(down, xe, &g.stream)?;
        return Ok(());
    }
    let blocks = Blocks::Offsets(b.offsets);
    g.grouped_gemm(
        xe,
        &l.w_gu,
        blocks,
        local,
        rows,
        2 * i,
        h,
        tiles,
        n_tiles,
        gu,
    )?;
    g.swiglu(gu, b.rows, rows, i, None, act)?;
    g.grouped_gemm(
        act, &l.w_down, blocks, local, rows, h, i, tiles, n_tiles, xe,
    )?;
    if let Some(w) = b.weights {
        g.scale_rows(xe, w, b.rows, rows, h)?;
    }
    Ok(())
}

/// The shared expert over the bucket's home rows (`xb`, `n` of them) into `sy`: one group, on
/// the Hopper GEMM where the shapes allow, else the WMMA kernels.
fn shared_ffn(
    g: &Gpu,
    s: &StepShape,
    (w_gu, w_down): (&CudaSlice<bf16>, &CudaSlice<bf16>),
    bucket: usize,
    b: &mut Buffers,
) -> Result<(), GpuError> {
    let (h, si) = (s.hidden, s.shared_inter);
    let psum = Layout::Psum;
    if Hopper::fits(psum, 1, 2 * si, h) && Hopper::fits(psum, 1, h, si) {
        // One block from row 0 (`sh_off[0]`) of `n` rows.
        g.psum_ends(&b.sh_off, &b.n, &mut b.sh_ends)?;
        let up = Gemm {
            x: &b.xb,
            rows: bucket,
            w: w_gu,
            groups: 1,
            n: 2 * si,
            k: h,
            layout: psum,
            sizes: &b.sh_ends,
        };
        g.hopper.gemm(up, &mut b.sgu, &g.stream)?;
        g.swiglu(&b.sgu, &b.n, bucket, si, None, &mut b.sact)?;
        let down = Gemm {
            x: &b.sact,
            rows: bucket,
            w: w_down,
            groups: 1,
            n: h,
            k: si,
            layout: psum,
            sizes: &b.sh_ends,
        };
        g.hopper.gemm(down, &mut b.sy, &g.stream)?;
        return Ok(());
    }
    let blocks = Blocks::Offsets(&b.sh_off);
    g.grouped_gemm(
        &b.xb,
        w_gu,
        blocks,
        1,
        bucket,
        2 * si,
        h,
        &mut b.stiles,
        &mut b.sn_tiles,
        &mut b.sgu,
    )?;
    g.swiglu(&b.sgu, &b.n, bucket, si, None, &mut b.sact)?;
    g.grouped_gemm(
        &b.sact,
        w_down,
        blocks,
        1,
        bucket,
        h,
        si,
        &mut b.stiles,
        &mut b.sn_tiles,
        &mut b.sy,
    )?;
    Ok(())
}
