//! The `Exchange` over NCCL EP (see the module above): a path per mode (its handle, group and
//! expert rows), prepare, dispatch and combine as tensor descriptions of the step's buffers.
//! No raw call here: `sys::nccl_ep` holds them.

use cudarc::driver::{result, CudaSlice, CudaStream};
use half::bf16;
use nccl_sys::ep::*;

use crate::backend::cuda::exchange::ep::{ep_local, library, validate};
use crate::backend::cuda::exchange::{Exchange, ExpertRows, Home};
use crate::backend::cuda::kernels::fp8::{Fp8Rows, Live};
use crate::backend::cuda::kernels::hopper;
use crate::backend::cuda::shape::StepShape;
use crate::backend::cuda::sys::nccl::{Comm, SymBuffer};
use crate::backend::cuda::sys::nccl_ep::{Dispatch, Group, Handle, Layout, Tensor};
use crate::backend::cuda::{Alloc, Gpu, GpuError};
use crate::metric_names;
use crate::model::fp8::BLOCK;

/// The expert rows: a registered window (zero-copy) or plain device memory.
pub enum RowBuffer {
    Window(SymBuffer<bf16>),
    Plain(CudaSlice<bf16>),
}

impl RowBuffer {
    pub fn slice(&self) -> &CudaSlice<bf16> {
        match self {
            RowBuffer::Window(w) => w,
            RowBuffer::Plain(p) => p,
        }
    }
    pub fn slice_mut(&mut self) -> &mut CudaSlice<bf16> {
        match self {
            RowBuffer::Window(w) => w,
            RowBuffer::Plain(p) => p,
        }
    }
    /// The rows as NCCL EP sees them, of extents `sizes`: the window when there is one.
    fn tensor(&mut self, sizes: &[usize], stream: &CudaStream) -> Tensor<'_> {
        match self {
            RowBuffer::Window(w) => Tensor::window(w, sizes),
            RowBuffer::Plain(p) => Tensor::of_mut(p, sizes, stream),
        }
    }
}

/// What one mode's group, handle and rows take on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Device memory the group took when created (its symmetric buffers), measured as the
    /// drop in the device's free memory.
    pub group_bytes: u64,
    pub handle_bytes: u64,
    /// The expert rows (registered as a window with zero-copy on).
    pub rows_bytes: u64,
    pub windowed: bool,
}

/// FP8 dispatch's receive side (NCCL EP's QUANT_FWD: codes and scales forwarded as sent): the
/// codes, as the FP8 GEMM's operand, and the scales as they land (token-major, `[.., k / 128]`),
/// then laid out MN-major into `rows.sf` for the GEMM.
struct Fp8Recv {
    rows: Fp8Rows,
    scales: CudaSlice<f32>,
}

/// One mode: its handle (with its group) and expert rows. Field order is teardown order: the
/// handle and its group, then the window (deregistered before the communicator, which outlives the exchange).
pub struct EpPath {
    handle: Handle,
    /// The experts' outputs, combine's input (and with bf16 dispatch, the rows it lands).
    rows: RowBuffer,
    /// With FP8 experts: where dispatch lands the rows.
    fp8: Option<Fp8Recv>,
    /// HT: receive capacity in rows; LL: rows per local expert (world x tokens).
    pub cap: usize,
    /// Its group masks a peer that leaves a kernel waiting past its timeout (LL).
    masks: bool,
    low_latency: bool,
    /// Tokens per rank the group was sized for.
    pub tokens: usize,
    pub footprint: Footprint,
    /// The rows' extents as NCCL EP sees them: `[local][cap][hidden]` (LL) or `[cap][hidden]`.
    extents: Vec<usize>,
    /// Experts a rank as this path's group numbers them (`ep_local`): the rank's slots, or
    /// for HT the next power of two.
    local: usize,
    /// Where NCCL EP's numbers are not the slots (a group of fewer ranks, or HT's power of
    /// two): slots to its expert numbers.
    renumber: Option<Renumber>,
}

fn free_bytes() -> u64 {
    result::mem_get_info().map_or(0, |(free, _)| free as u64)
}

impl EpPath {
    /// Creates the group (collective) and the handle; every rank calls this in the same order.
    fn new(
        comm: &Comm,
        s: &StepShape,
        low_latency: bool,
        tokens: usize,
        align: usize,
        zero_copy: bool,
        a: &mut Alloc,
    ) -> Result<Self, GpuError> {
        let ep = library().map_err(GpuError::Config)?;
        let stream = a.stream().clone();
        // NCCL EP 0.2 refuses zero-copy LL dispatch in the expert-major layout ("requires
        // NCCL_EP_LAYOUT_RANK_MAJOR"): LL goes through the library's staging.
        let zero_copy = zero_copy && !low_latency;
        let local = ep_local(s.local(), low_latency);
        // HT's capacity counts the rank's slots only: the slots past them receive nothing.
        let (cap, rows_len) = match low_latency {
            true => (s.world * tokens, s.ll_rows(tokens)),
            false => {
                let c = s.ht_capacity(align);
                (c, c)
            }
        };
        let mut cfg = ncclEpGroupConfig_t::new();
        cfg.num_experts = (s.world * local) as u32;
        cfg.max_dispatch_tokens_per_rank = tokens as u32;
        cfg.max_token_bytes = (s.hidden * 2) as u32;
        cfg.num_topk = s.top_k as u32;
        // ON asks for dispatch's output in a window too; FP8 rows land in plain memory, and AUTO
        // still lets combine read the window directly.
        cfg.zero_copy = match (zero_copy, s.fp8_dispatch()) {
            (true, false) => ncclEpZeroCopyMode_t::ON,
            (true, true) => ncclEpZeroCopyMode_t::AUTO,
            (false, _) => ncclEpZeroCopyMode_t::OFF,
        };
        match low_latency {
            // LL sizes its receive side itself.
            true => {
                cfg.algorithm = ncclEpAlgorithm_t::LOW_LATENCY;
                // A lost peer masked after this wait, so the step ends (`verify` then refuses
                // its output); HT has no mask in NCCL EP 0.2.
                if let Some(t) = s.ep.and_then(|e| e.mask_after) {
                    cfg.enable_mask = 1;
                    cfg.timeout_ns = t.as_nanos().min(u128::from(u64::MAX)) as u64;
                }
            }
            false => {
                cfg.algorithm = ncclEpAlgorithm_t::HIGH_THROUGHPUT;
                cfg.max_recv_tokens_per_rank = cap as u32;
            }
        }
        let before = free_bytes();
        let group = Group::create(&ep, comm, &cfg)?;
        let mut hcfg = ncclEpHandleConfig_t::new();
        if !low_latency {
            hcfg.dispatch_output_per_expert_alignment = align;
        }
        let mem = group.handle_bytes(&hcfg, s.top_k)?;
        let handle_mem = a.zeros::<u8>(mem)?;
        let handle = Handle::init(group, &hcfg, s.top_k, handle_mem, &stream)?;
        // The group's own memory, LL's buffer included (made at the handle's init).
        let group_bytes = (before.saturating_sub(free_bytes())).saturating_sub(mem as u64);
        let rows = match zero_copy {
            true => RowBuffer::Window(comm.sym_alloc::<bf16>(rows_len * s.hidden, &stream)?),
            false => RowBuffer::Plain(a.zeros::<bf16>(rows_len * s.hidden)?),
        };
        let fp8 = match s.fp8_dispatch() {
            true => Some(Fp8Recv {
                rows: Fp8Rows::zeros(a, rows_len, s.hidden)?,
                scales: a.zeros(rows_len * (s.hidden / BLOCK))?,
            }),
            false => None,
        };
        let fp8_bytes = fp8.as_ref().map_or(0, |f| {
            f.rows.q.len() + 4 * (f.rows.sf.len() + f.scales.len())
        });
        let footprint = Footprint {
            group_bytes,
            handle_bytes: mem as u64,
            rows_bytes: (rows_len * s.hidden * 2 + fp8_bytes) as u64,
            windowed: zero_copy,
        };
        let extents = match low_latency {
            true => vec![local, cap, s.hidden],
            false => vec![cap, s.hidden],
        };
        Ok(Self {
            masks: cfg.enable_mask != 0,
            low_latency,
            handle,
            rows,
            fp8,
            cap,
            tokens,
            footprint,
            extents,
            local,
            renumber: None,
        })
    }

    pub fn rows(&self) -> &CudaSlice<bf16> {
        self.rows.slice()
    }

    /// A low-latency group over a communicator that lost a member is left allocated when the
    /// path goes (its destroy is a barrier over the communicator: `Group::abandon`); HT's
    /// destroy ended with a peer gone (56 ms, 2x H100). Returns the bytes left.
    fn abandon(&mut self) -> u64 {
        match self.low_latency {
            true => {
                self.handle.abandon_group();
                self.footprint.group_bytes
            }
            false => 0,
        }
    }

    /// Why a step's output cannot stand: its group masked a peer (the rows to and from it
    /// were skipped).
    fn masked(&self) -> Option<String> {
        let masked = self.masks && self.handle.group().masked_a_peer().unwrap_or(true);
        masked.then(|| {
            "NCCL EP masked a rank that left its kernels waiting past --step-timeout: the rows to and from it were skipped".into()
        })
    }

    pub fn rows_mut(&mut self) -> &mut CudaSlice<bf16> {
        self.rows.slice_mut()
    }

    /// The rows, with their extents, and the handle that moves them.
    fn parts(&mut self, stream: &CudaStream) -> (Tensor<'_>, &mut Handle) {
        (self.rows.tensor(&self.extents, stream), &mut self.handle)
    }

    /// Where dispatch lands the rows: the bf16 rows, or the FP8 codes with their scales as they
    /// land (`[.., k / 128]` beside the rows' extents); and the handle.
    fn landing(&mut self, stream: &CudaStream) -> (Tensor<'_>, Option<Tensor<'_>>, &mut Handle) {
        let Some(f) = self.fp8.as_mut() else {
            let rows = self.rows.tensor(&self.extents, stream);
            return (rows, None, &mut self.handle);
        };
        let mut sf = self.extents.clone();
        if let Some(last) = sf.last_mut() {
            *last /= BLOCK;
        }
        let codes = Tensor::fp8_mut(&mut f.rows.q, &self.extents, stream);
        let scales = Tensor::of_mut(&mut f.scales, &sf, stream);
        (codes, Some(scales), &mut self.handle)
    }

    /// With FP8 dispatch: the landed scales (every row of the mode's space) laid out as the FP8
    /// GEMM reads them, MN-major over HT's psum blocks or each of LL's expert strides.
    fn scales_for_gemm(&mut self, g: &Gpu, ll: bool) -> Result<(), GpuError> {
        let Some(f) = self.fp8.as_mut() else {
            return Ok(());
        };
        let layout = match ll {
            true => hopper::Layout::Masked {
                stride: self.cap,
                mean_rows: 0,
            },
            false => hopper::Layout::Psum,
        };
        let rows = f.rows.cap;
        g.fp8
            .scales_mn(&f.scales, rows, layout, &mut f.rows, &g.stream)?;
        Ok(())
    }

    /// The expert rows as the FFN takes them: the bf16 rows (its outputs) and, with FP8
    /// dispatch, the landed FP8 rows as its operand.
    fn expert_bufs(&mut self) -> (&mut CudaSlice<bf16>, Option<&Fp8Rows>) {
        (self.rows.slice_mut(), self.fp8.as_ref().map(|f| &f.rows))
    }
}

/// One rank's NCCL EP state: a path per mode in use (LL for buckets up to `ll_max`, HT above);
/// `GpuStep` holds it (as its exchange) before the communicator, so it is torn down first.
pub struct EpExchange {
    /// The shape NCCL EP's groups were made for: the communicator's members (`on_members`).
    shape: StepShape,
    /// This rank and the group's ranks: the gathered counts' rows, by group rank.
    group: (usize, usize),
    paths: Paths,
    b: Bufs,
}

/// A group of fewer ranks than the slots were placed on (NCCL EP numbers the experts of its
/// members only), or HT's power of two of experts a rank: the step's slots are renumbered before
/// a path's handle takes them.
struct Renumber {
    /// `[group experts]`: each live slot's expert number among the members (-1: a lost rank's).
    map: CudaSlice<i32>,
    /// The bucket's entries renumbered `[max_home, k]`.
    ids: CudaSlice<i32>,
}

/// The shape of `s`'s group over the communicator's `members` (group ranks, ascending; this rank
/// among them): each keeps its slots, NCCL EP numbers them by the member's place.
fn on_members(s: &StepShape, members: &[usize]) -> Result<StepShape, GpuError> {
    let me = (members.iter().position(|&r| r == s.rank))
        .ok_or_else(|| GpuError::Config(format!("rank {} is not in its communicator", s.rank)))?;
    let n = members.len();
    Ok(StepShape {
        world: n,
        rank: me,
        experts: n * s.local(),
        ..*s
    })
}

/// Each of the group's slots as NCCL EP numbers it over `members` with `local` experts a rank
/// (`ep_local`): member i's slot j is i x local + j; a lost rank's slots are -1 (the table
/// routes nothing to them).
fn slot_numbers(s: &StepShape, members: &[usize], local: usize) -> Vec<i32> {
    let l = s.local();
    (0..s.experts)
        .map(|slot| match members.binary_search(&(slot / l)) {
            Ok(i) => (i * local + slot % l) as i32,
            Err(_) => -1,
        })
        .collect()
}

/// A path per mode in use: LL for buckets up to its token count, HT above.
struct Paths {
    ll: Option<EpPath>,
    ht: Option<EpPath>,
}

impl Paths {
    fn ll_max(&self) -> usize {
        self.ll.as_ref().map_or(0, |p| p.tokens)
    }

    fn is_ll(&self, bucket: usize) -> bool {
        bucket <= self.ll_max()
    }

    fn get(&self, bucket: usize) -> &EpPath {
        let p = match self.is_ll(bucket) {
            true => self.ll.as_ref(),
            false => self.ht.as_ref(),
        };
        p.expect("a path for every bucket")
    }

    fn get_mut(&mut self, bucket: usize) -> &mut EpPath {
        let p = match self.is_ll(bucket) {
            true => self.ll.as_mut(),
            false => self.ht.as_mut(),
        };
        p.expect("a path for every bucket")
    }
}

/// The step's buffers NCCL EP reads and writes besides a path's rows.
struct Bufs {
    /// Per-local-expert counts from the last step (HT: padded, from UpdateHandle; LL: received,
    /// from Dispatch).
    counters: CudaSlice<i32>,
    /// HT: each local expert's padded offset `[local + 1]` and the padded total (one int),
    /// written by UpdateHandle.
    local_off: CudaSlice<i32>,
    total: CudaSlice<i32>,
    /// The Hopper GEMM's sizes (`hopper::MAX_GROUPS`): HT psum ends, LL masked counts.
    sizes: CudaSlice<i32>,
    /// LL: the grouped GEMM's row blocks (starts, then ends).
    bounds: CudaSlice<i32>,
    /// HT: the routing weight of each received row (HT combine wants rows already weighted).
    recv_w: CudaSlice<f32>,
    /// Combined home rows `[T, hidden]` in bf16, before the shared expert is added.
    out_b: CudaSlice<bf16>,
    /// With FP8 experts: the home rows' codes `[T, hidden]` and scales `[T, hidden / 128]`
    /// (token-major), as dispatch sends them.
    home_fp8: Option<(CudaSlice<u8>, CudaSlice<f32>)>,
}

impl EpExchange {
    /// Creates the groups (collective: LL first, then HT) and their handles over `comm`'s
    /// members (the group's ranks, or those left of it); every member calls this together.
    pub fn new(comm: &Comm, full: &StepShape, a: &mut Alloc) -> Result<Self, GpuError> {
        let e = full
            .ep
            .ok_or_else(|| GpuError::Config("no NCCL EP settings".into()))?;
        let members = comm.members();
        let shape = on_members(full, members)?;
        let s = &shape;
        validate(s, e.align).map_err(GpuError::Config)?;
        let mut ll = match e.ll_max {
            0 => None,
            t => Some(EpPath::new(comm, s, true, t, e.align, e.zero_copy, a)?),
        };
        let mut ht = match s.max_home > e.ll_max {
            true => Some(EpPath::new(
                comm,
                s,
                false,
                s.max_home,
                e.align,
                e.zero_copy,
                a,
            )?),
            false => None,
        };
        for (mode, p) in [("ll", &ll), ("ht", &ht)] {
            if let Some(f) = p.as_ref().map(|p| p.footprint) {
                tracing::info!(
                    rank = s.rank,
                    mode,
                    group_mib = f.group_bytes >> 20,
                    handle_kib = f.handle_bytes >> 10,
                    rows_mib = f.rows_bytes >> 20,
                    window = f.windowed,
                    "NCCL EP footprint"
                );
            }
        }
        let l = s.local();
        // NCCL EP's per-expert outputs span the widest path's numbering.
        let wide = [&ll, &ht]
            .iter()
            .flat_map(|p| p.as_ref())
            .map(|p| p.local)
            .max();
        let wide = wide.unwrap_or(l);
        let b = Bufs {
            recv_w: a.zeros(ht.as_ref().map_or(0, |p| p.cap))?,
            counters: a.zeros(wide)?,
            local_off: a.zeros(wide + 1)?,
            total: a.zeros(1)?,
            sizes: a.zeros(hopper::MAX_GROUPS)?,
            bounds: a.zeros(2 * l)?,
            out_b: a.zeros(s.max_home * s.hidden)?,
            home_fp8: match s.fp8_dispatch() {
                true => Some((
                    a.zeros(s.max_home * s.hidden)?,
                    a.zeros(s.max_home * (s.hidden / BLOCK))?,
                )),
                false => None,
            },
        };
        for p in [&mut ll, &mut ht].into_iter().flatten() {
            if !comm.whole() || p.local != l {
                p.renumber = Some(Renumber {
                    map: a.upload(&slot_numbers(full, members, p.local))?,
                    ids: a.zeros(s.max_home * s.top_k)?,
                });
            }
        }
        Ok(Self {
            shape,
            group: (full.rank, full.world),
            paths: Paths { ll, ht },
            b,
        })
    }

    /// The largest bucket that runs low-latency (0: none).
    pub fn ll_max(&self) -> usize {
        self.paths.ll_max()
    }

    /// Whether `bucket` runs low-latency.
    pub fn is_ll(&self, bucket: usize) -> bool {
        self.paths.is_ll(bucket)
    }

    pub fn path(&self, bucket: usize) -> &EpPath {
        self.paths.get(bucket)
    }

    /// Both modes' footprints: (LL, HT).
    pub fn footprints(&self) -> (Option<Footprint>, Option<Footprint>) {
        (
            self.paths.ll.as_ref().map(|p| p.footprint),
            self.paths.ht.as_ref().map(|p| p.footprint),
        )
    }

    /// Prepare: routing of `bucket` rows (`ids` rows past the step's tokens are -1) into the
    /// bucket's handle. HT: each local expert's padded offset lands in `local_off[..L]` and the
    /// padded total in `total` and `local_off[L]` (the grouped GEMM's block bounds; the experts
    /// past the rank's L slots in NCCL EP's numbering receive nothing).
    fn update_handle(
        &mut self,
        g: &Gpu,
        ids: &CudaSlice<i32>,
        bucket: usize,
    ) -> Result<(), GpuError> {
        let (k, slots, stream) = (self.shape.top_k, self.shape.local(), &g.stream);
        let ll = self.is_ll(bucket);
        let (p, b) = (self.paths.get_mut(bucket), &mut self.b);
        let local = p.local;
        let ids = match p.renumber.as_mut() {
            Some(r) => {
                g.renumber(ids, &r.map, bucket * k, &mut r.ids)?;
                &r.ids
            }
            None => ids,
        };
        let mut t_ids = Tensor::of(ids, &[bucket, k], stream);
        if ll {
            // LL takes no layout here.
            return Ok(p.handle.update(&mut t_ids, None, stream)?);
        }
        let Bufs {
            counters,
            local_off,
            total,
            ..
        } = b;
        {
            let mut t_cnt = Tensor::of_mut(counters, &[local], stream);
            let mut t_off = Tensor::of_mut(local_off, &[local], stream);
            let mut t_tot = Tensor::of_mut(total, &[1], stream);
            let layout = Layout {
                counters: Some(&mut t_cnt),
                offsets: Some(&mut t_off),
                total: Some(&mut t_tot),
            };
            p.handle.update(&mut t_ids, Some(layout), stream)?;
        }
        // The padded total after the rank's slots' offsets: the grouped GEMM's last block bound.
        stream.memcpy_dtod(total, &mut local_off.slice_mut(slots..=slots))?;
        Ok(())
    }
}

impl Exchange for EpExchange {
    /// NCCL EP lays the rows out itself: only the counts, for the all-gather (the routing
    /// metrics and `verify`).
    fn count(
        &mut self,
        g: &Gpu,
        home: &Home,
        bucket: usize,
        counts: &mut CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        g.count_experts(home.ids, home.n, bucket, self.shape.top_k, counts)?;
        Ok(())
    }

    /// HT: the blocks' ends are counted from the routing here (`Gpu::routed_ends`: NCCL EP's
    /// counts are padded to the alignment, and the expert kernels would run the padding).
    fn prepare(&mut self, g: &Gpu, home: &Home, bucket: usize) -> Result<(), GpuError> {
        self.update_handle(g, home.ids, bucket)?;
        if !self.is_ll(bucket) {
            let b = &mut self.b;
            let l = self.shape.local();
            g.routed_ends(home.gathered, self.group, l, &b.local_off, &mut b.sizes)?;
        }
        Ok(())
    }

    /// The bucket's home rows (HT: with their routing weights) into its expert rows. With FP8
    /// experts the live home rows are quantized first (the rule of `kernels/fp8_rule.cuh`) and
    /// NCCL EP forwards their codes and scales (QUANT_FWD): half the bytes; the scales that land
    /// are then laid out as the FP8 GEMM reads them.
    fn dispatch(
        &mut self,
        g: &Gpu,
        _comm: &Comm,
        home: &Home,
        bucket: usize,
    ) -> Result<(), GpuError> {
        let (x, w, stream) = (home.x, home.w, &g.stream);
        let (k, hidden) = (self.shape.top_k, self.shape.hidden);
        let ll = self.is_ll(bucket);
        let (p, b) = (self.paths.get_mut(bucket), &mut self.b);
        let (cap, local) = (p.cap, p.local);
        let Bufs {
            counters,
            recv_w,
            home_fp8,
            ..
        } = b;
        if let Some((q, sf)) = home_fp8.as_mut() {
            let live = Live::Upto(home.n);
            g.fp8
                .quantize_tokens(x, (bucket, hidden), live, (q, sf), stream)?;
        }
        let (mut t_x, mut t_sf) = match home_fp8.as_ref() {
            Some((q, sf)) => (
                Tensor::fp8(q, &[bucket, hidden], stream),
                Some(Tensor::of(sf, &[bucket, hidden / BLOCK], stream)),
            ),
            None => (Tensor::of(x, &[bucket, hidden], stream), None),
        };
        {
            let (mut t_r, mut t_rsf, handle) = p.landing(stream);
            let scales = t_sf.as_mut().zip(t_rsf.as_mut());
            match ll {
                // LL expert-major: the per-expert received counts, at dispatch time.
                true => {
                    let mut t_cnt = Tensor::of_mut(counters, &[local], stream);
                    let d = Dispatch {
                        x: &mut t_x,
                        w: None,
                        rows: &mut t_r,
                        rows_w: None,
                        scales,
                    };
                    let layout = Layout {
                        counters: Some(&mut t_cnt),
                        ..Layout::default()
                    };
                    handle.dispatch(d, Some(layout), stream)?;
                }
                // HT forward: the weights travel with the rows (one per received row).
                false => {
                    let mut t_w = Tensor::of(w, &[bucket, k], stream);
                    let mut t_rw = Tensor::of_mut(recv_w, &[cap], stream);
                    let d = Dispatch {
                        x: &mut t_x,
                        w: Some(&mut t_w),
                        rows: &mut t_r,
                        rows_w: Some(&mut t_rw),
                        scales,
                    };
                    handle.dispatch(d, None, stream)?;
                }
            }
        }
        p.scales_for_gemm(g, ll)?;
        Ok(())
    }

    fn expert_rows(&mut self, g: &Gpu, bucket: usize) -> Result<ExpertRows<'_>, GpuError> {
        let s = self.shape;
        let ll = self.is_ll(bucket);
        let (p, b) = (self.paths.get_mut(bucket), &mut self.b);
        let Bufs {
            counters,
            local_off,
            total,
            sizes,
            bounds,
            recv_w,
            ..
        } = b;
        let (stride, valid) = (p.cap, s.world * p.tokens * s.top_k.min(s.local()));
        let (x, fp8) = p.expert_bufs();
        if ll {
            // LL rows: expert e's `counters[e]` rows start at e x (world x tokens).
            g.ll_bounds(counters, s.local(), stride, bounds, sizes)?;
            return Ok(ExpertRows::Strided {
                stride,
                valid,
                x,
                counts: sizes,
                bounds,
                fp8,
            });
        }
        // HT blocks start at multiples of `hopper::ALIGN` (the handle's expert alignment) and
        // end where `prepare` counted; its combine sums rows as they come, so each row carries
        // its routing weight.
        Ok(ExpertRows::Blocks {
            x,
            cap: s.recv_rows(bucket),
            offsets: local_off,
            ends: sizes,
            total,
            weights: Some(recv_w),
            fp8,
        })
    }

    /// The expert rows back home, summed, into `out_b`'s `bucket` rows (HT rows are weighted
    /// already; LL weighs them with the home tokens' `w` as they arrive), then widened into `out`
    /// with the shared expert's rows.
    fn combine(
        &mut self,
        g: &Gpu,
        _comm: &Comm,
        home: &Home,
        bucket: usize,
        shared: Option<&CudaSlice<bf16>>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let (w, stream) = (home.w, &g.stream);
        let (k, hidden) = (self.shape.top_k, self.shape.hidden);
        let ll = self.is_ll(bucket);
        let mut t_o = Tensor::of_mut(&mut self.b.out_b, &[bucket, hidden], stream);
        let mut t_w = Tensor::of(w, &[bucket, k], stream);
        let (mut t_c, handle) = self.paths.get_mut(bucket).parts(stream);
        handle.combine(&mut t_c, &mut t_o, ll.then_some(&mut t_w), stream)?;
        g.widen_add(
            &self.b.out_b,
            shared,
            home.n,
            bucket,
            self.shape.hidden,
            out,
        )?;
        Ok(())
    }

    fn receipts(&self) -> Option<(&CudaSlice<i32>, &CudaSlice<i32>)> {
        Some((&self.b.counters, &self.b.total))
    }

    /// Receive counts against the routing and the capacity. Overflow is impossible by
    /// construction (a group holds its largest bucket's worst case); a step that says otherwise
    /// is counted, and its output is not delivered.
    fn verify(
        &self,
        bucket: usize,
        routed: &[i64],
        counts: &[i32],
        total: i32,
    ) -> Result<(), String> {
        if let Some(why) = self.path(bucket).masked() {
            return Err(why);
        }
        let cap = self.path(bucket).cap as i64;
        let (mode, rows, expected, overflow) = match self.is_ll(bucket) {
            true => (
                "ll",
                counts.iter().map(|&c| i64::from(c)).sum::<i64>(),
                routed.iter().sum::<i64>(),
                counts.iter().any(|&c| i64::from(c) > cap),
            ),
            false => {
                let a = self.shape.ep.map_or(1, |e| e.align) as i64;
                let padded = routed.iter().map(|r| (r + a - 1) / a * a).sum();
                let total = i64::from(total);
                ("ht", total, padded, total > cap)
            }
        };
        metrics::counter!(metric_names::EP_STEPS_TOTAL, "mode" => mode).increment(1);
        metrics::gauge!(metric_names::EP_RECV_ROWS, "mode" => mode).set(rows as f64);
        if overflow {
            metrics::counter!(metric_names::EP_RECV_OVERFLOW_TOTAL, "mode" => mode).increment(1);
            return Err(format!(
                "NCCL EP ({mode}) received past its capacity: {rows} rows, capacity {cap}"
            ));
        }
        if rows != expected {
            metrics::counter!(metric_names::EP_RECV_MISMATCH_TOTAL, "mode" => mode).increment(1);
            return Err(format!(
                "NCCL EP ({mode}) received {rows} rows where the routing sent {expected}"
            ));
        }
        Ok(())
    }

    fn abandon(&mut self) -> u64 {
        let p = &mut self.paths;
        (p.ll.iter_mut().chain(p.ht.iter_mut()))
            .map(EpPath::abandon)
            .sum()
    }

    fn footprint(&self) -> Option<crate::step::EpFootprint> {
        let (ll, ht) = self.footprints();
        let e = self.shape.ep?;
        let all = [ll, ht];
        let sum = |f: fn(&Footprint) -> u64| all.iter().flatten().map(f).sum();
        Some(crate::step::EpFootprint {
            modes: crate::backend::ep_settings::ep_modes(ll.is_some(), ht.is_some()),
            // Windows in use (NCCL EP 0.2's LL expert-major path has none).
            zero_copy: e.zero_copy && all.iter().flatten().any(|f| f.windowed),
            ll_max_tokens_per_rank: e.ll_max as u32,
            group_bytes: sum(|f| f.group_bytes),
            handle_bytes: sum(|f| f.handle_bytes),
            expert_rows_bytes: sum(|f| f.rows_bytes),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(world: usize, rank: usize, experts: usize) -> StepShape {
        StepShape {
            world,
            rank,
            experts,
            model_experts: experts,
            top_k: 2,
            hidden: 512,
            inter: 64,
            shared_inter: 0,
            max_home: 8,
            ep: None,
            expert_dtype: crate::model::ExpertDtype::Bf16,
            overlap: 0,
            split: usize::MAX,
        }
    }

    /// Ranks 0, 2 and 3 of 4 (2 slots each) left: NCCL EP numbers their slots 0..6 by the
    /// members' places, rank 1's are out; this rank's shape is that of the members.
    #[test]
    fn a_lost_ranks_slots_leave_the_numbering_and_the_rest_close_up() {
        let s = shape(4, 2, 8);
        assert_eq!(
            slot_numbers(&s, &[0, 2, 3], 2),
            vec![0, 1, -1, -1, 2, 3, 4, 5]
        );
        let m = on_members(&s, &[0, 2, 3]).unwrap();
        assert_eq!((m.world, m.rank, m.experts, m.local()), (3, 1, 6, 2));
        // The whole group numbers slots as they are.
        assert_eq!(
            slot_numbers(&s, &[0, 1, 2, 3], 2),
            (0..8).collect::<Vec<i32>>()
        );
        assert!(on_members(&s, &[0, 1]).is_err());
    }

    /// HT's power of two: 3 slots a rank (2 ranks, 6 slots) are numbered as 4, each rank's
    /// slots first in its block of 4 and the fourth never used; with rank 0 lost, rank 1's
    /// close up to 0..3 of the one member's 4. LL keeps the slots' own numbers.
    #[test]
    fn ht_numbers_a_ranks_slots_in_a_power_of_two() {
        let s = shape(2, 1, 6);
        assert_eq!((ep_local(3, false), ep_local(3, true)), (4, 3));
        assert_eq!((ep_local(4, false), ep_local(129, false)), (4, 256));
        assert_eq!(slot_numbers(&s, &[0, 1], 4), vec![0, 1, 2, 4, 5, 6]);
        assert_eq!(slot_numbers(&s, &[1], 4), vec![-1, -1, -1, 0, 1, 2]);
        assert_eq!(slot_numbers(&s, &[0, 1], 3), (0..6).collect::<Vec<i32>>());
    }
}
