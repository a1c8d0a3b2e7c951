//! The `nccl-ep` exchange: NVIDIA NCCL EP with the expert-major layout, in high-throughput (HT)
//! or low-latency (LL) mode per bucket, each mode with its own group and handle made before any
//! capture. Prepare is `ncclEpUpdateHandle` (HT writes each local expert's padded offset straight
//! into the grouped GEMM's offsets), dispatch lands the received rows where the GEMM reads them
//! (HT: packed, padded to the GEMM tile; LL: `[local expert][world x tokens]` with a count per
//! expert), and combine takes the expert outputs back home (HT: weighted by us first; LL: the
//! library weighs them). With zero-copy on, HT's expert rows are `ncclMemAlloc` memory registered
//! once as a symmetric window, and the library moves rows straight into and out of it (NCCL EP
//! 0.2 has no zero-copy for LL's expert-major layout: LL always stages).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use nccl_sys::ep::*;
use nccl_sys::{ncclDataType_t, ncclResult_t};

use super::exchange::{Exchange, ExpertRows, Home};
use super::nccl::{Comm, NcclError, SymBuffer};
use super::shape::StepShape;
use super::{hopper, Alloc, Gpu, GpuError};

/// NCCL EP needs the device API of NCCL 2.30.4 or newer.
pub const MIN_NCCL: i32 = 23004;
/// NCCL EP runs at most 8 ranks per node.
pub const MAX_WORLD: usize = 8;

fn check(op: &'static str, r: ncclResult_t) -> Result<(), NcclError> {
    r.ok().map_err(|result| NcclError {
        op,
        result,
        detail: String::new(),
    })
}

/// The library, loaded once for the process (see `setup::nccl` for why never unloaded).
pub fn library() -> Result<Arc<NcclEp>, String> {
    static EP: OnceLock<Result<Arc<NcclEp>, String>> = OnceLock::new();
    EP.get_or_init(|| NcclEp::load().map(Arc::new).map_err(|e| e.to_string()))
        .clone()
}

fn nvcc() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        dirs.push(std::path::Path::new(&h).join("bin"));
    }
    dirs.push("/usr/local/cuda/bin".into());
    dirs.into_iter()
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}

/// Whether `nccl-ep` can run here, and if not the first reason, in one line each. Checked before
/// anything is created.
pub fn gates(nccl_version: i32, world: usize) -> Result<String, String> {
    result::init().map_err(|e| format!("CUDA: {e}"))?;
    let dev = result::device::get(0).map_err(|e| format!("CUDA device 0: {e}"))?;
    // SAFETY: a device handle from cuDeviceGet; plain attribute query.
    let major = unsafe {
        result::device::get_attribute(
            dev,
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )
    }
    .map_err(|e| format!("CUDA device 0: {e}"))?;
    if major < 9 {
        return Err(format!(
            "NCCL EP needs SM 90 or newer; this GPU is SM {major}x"
        ));
    }
    if nccl_version < MIN_NCCL {
        return Err(format!(
            "NCCL EP needs NCCL >= 2.30.4; loaded NCCL is {}",
            nccl_sys::version_string(nccl_version)
        ));
    }
    let ep = library().map_err(|e| format!("libnccl_ep: {e}"))?;
    let Some(nvcc) = nvcc() else {
        return Err(
            "NCCL EP compiles its kernels at run time and no nvcc was found (PATH, CUDA_HOME, /usr/local/cuda)"
                .into(),
        );
    };
    if world > MAX_WORLD {
        return Err(format!(
            "NCCL EP runs at most {MAX_WORLD} ranks per node; the group has {world}"
        ));
    }
    Ok(format!(
        "NCCL EP {} from {}, SM {major}x, nvcc {}",
        nccl_sys::version_string(ep.version),
        ep.path.display(),
        nvcc.display()
    ))
}

/// The shape problems NCCL EP would reject, found first with a clear reason.
pub fn validate(s: &StepShape, align: usize) -> Result<(), String> {
    let mut bad = Vec::new();
    if s.experts % s.world != 0 {
        bad.push(format!("{} experts over {} ranks", s.experts, s.world));
    }
    if s.top_k > s.experts {
        bad.push(format!("top-k {} > {} experts", s.top_k, s.experts));
    }
    if s.max_home == 0 {
        bad.push("max dispatch tokens per rank is 0".into());
    }
    if (s.hidden * 2) % 16 != 0 {
        bad.push(format!(
            "token row of {} bytes is not a multiple of 16",
            s.hidden * 2
        ));
    }
    if !align.is_power_of_two() {
        bad.push(format!("alignment {align} is not a power of two"));
    }
    if s.ht_capacity(align) < s.max_home {
        bad.push("receive capacity below dispatch capacity".into());
    }
    if s.ll_rows(s.max_home) > i32::MAX as usize {
        bad.push("low-latency receive rows exceed 2^31".into());
    }
    match bad.is_empty() {
        true => Ok(()),
        false => Err(format!("NCCL EP group config: {}", bad.join("; "))),
    }
}

struct Group {
    ep: Arc<NcclEp>,
    raw: ncclEpGroup_t,
}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: created by ncclEpCreateGroup, destroyed once, after its handle (field order).
        let r = unsafe { (self.ep.group_destroy)(self.raw) };
        if r != ncclResult_t::SUCCESS {
            tracing::warn!("ncclEpGroupDestroy: {r}");
        }
    }
}

struct Handle {
    ep: Arc<NcclEp>,
    raw: ncclEpHandle_t,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by ncclEpInitHandle, destroyed once, before its group.
        let r = unsafe { (self.ep.handle_destroy)(self.raw) };
        if r != ncclResult_t::SUCCESS {
            tracing::warn!("ncclEpHandleDestroy: {r}");
        }
    }
}

// SAFETY: the group and handle are used by the one thread that runs the rank's steps at a time.
unsafe impl Send for Group {}
// SAFETY: as for `Group`.
unsafe impl Send for Handle {}

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
    /// A descriptor of the rows with extents `sizes`: the window when there is one.
    fn tensor(&mut self, sizes: &mut [usize], stream: &CudaStream) -> ncclEpTensor_t {
        match self {
            RowBuffer::Window(w) => {
                ncclEpTensor_t::in_window(w.window(), 0, ncclDataType_t::Bfloat16, sizes)
            }
            RowBuffer::Plain(p) => ncclEpTensor_t::describe(
                p.device_ptr_mut(stream).0,
                ncclDataType_t::Bfloat16,
                sizes,
            ),
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

/// One mode: its group, handle and expert rows. Field order is teardown order: handle, group,
/// then the window (deregistered before the communicator, which outlives the exchange).
pub struct EpPath {
    handle: Handle,
    _group: Group,
    _handle_mem: CudaSlice<u8>,
    rows: RowBuffer,
    ep: Arc<NcclEp>,
    /// HT: receive capacity in rows; LL: rows per local expert (world x tokens).
    pub cap: usize,
    /// Tokens per rank the group was sized for.
    pub tokens: usize,
    pub footprint: Footprint,
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
        let (cap, rows_len) = match low_latency {
            true => (s.world * tokens, s.ll_rows(tokens)),
            false => {
                let c = s.ht_capacity(align);
                (c, c)
            }
        };
        let mut cfg = ncclEpGroupConfig_t::new();
        cfg.num_experts = s.experts as u32;
        cfg.max_dispatch_tokens_per_rank = tokens as u32;
        cfg.max_token_bytes = (s.hidden * 2) as u32;
        cfg.num_topk = s.top_k as u32;
        cfg.zero_copy = match zero_copy {
            true => ncclEpZeroCopyMode_t::ON,
            false => ncclEpZeroCopyMode_t::OFF,
        };
        match low_latency {
            // LL sizes its receive side itself.
            true => cfg.algorithm = ncclEpAlgorithm_t::LOW_LATENCY,
            false => {
                cfg.algorithm = ncclEpAlgorithm_t::HIGH_THROUGHPUT;
                cfg.max_recv_tokens_per_rank = cap as u32;
            }
        }
        let before = free_bytes();
        let mut raw: ncclEpGroup_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer, a live communicator, a config from its constructor.
        check("ncclEpCreateGroup", unsafe {
            (ep.create_group)(&mut raw, comm.raw(), &cfg)
        })?;
        let group = Group {
            ep: ep.clone(),
            raw,
        };
        let group_bytes = before.saturating_sub(free_bytes());
        let mut hcfg = ncclEpHandleConfig_t::new();
        if !low_latency {
            hcfg.dispatch_output_per_expert_alignment = align;
        }
        let mut mem = 0usize;
        // SAFETY: live group, valid config and out-pointer.
        check("ncclEpHandleMemSize", unsafe {
            (ep.handle_mem_size)(
                group.raw,
                ncclEpLayout_t::EXPERT_MAJOR,
                &hcfg,
                &mut mem,
                s.top_k as i32,
            )
        })?;
        let mut handle_mem = a.zeros::<u8>(mem)?;
        let mut hm_sizes = [mem];
        let hm = ncclEpTensor_t::describe(
            handle_mem.device_ptr_mut(&stream).0,
            ncclDataType_t::Uint8,
            &mut hm_sizes,
        );
        let mut raw: ncclEpHandle_t = std::ptr::null_mut();
        // SAFETY: handle_mem holds `mem` bytes and lives as long as the handle (same struct).
        // With LL's automatic buffer size this may allocate, collectively: every rank is here.
        check("ncclEpInitHandle", unsafe {
            (ep.init_handle)(
                &mut raw,
                group.raw,
                ncclEpLayout_t::EXPERT_MAJOR,
                &hcfg,
                s.top_k as i32,
                &hm,
            )
        })?;
        let handle = Handle {
            ep: ep.clone(),
            raw,
        };
        let rows = match zero_copy {
            true => RowBuffer::Window(comm.sym_alloc::<bf16>(rows_len * s.hidden, &stream)?),
            false => RowBuffer::Plain(a.zeros::<bf16>(rows_len * s.hidden)?),
        };
        let footprint = Footprint {
            group_bytes,
            handle_bytes: mem as u64,
            rows_bytes: (rows_len * s.hidden * 2) as u64,
            windowed: zero_copy,
        };
        Ok(Self {
            handle,
            _group: group,
            _handle_mem: handle_mem,
            rows,
            ep,
            cap,
            tokens,
            footprint,
        })
    }

    pub fn rows(&self) -> &CudaSlice<bf16> {
        self.rows.slice()
    }
    pub fn rows_mut(&mut self) -> &mut CudaSlice<bf16> {
        self.rows.slice_mut()
    }
}

/// One rank's NCCL EP state: a path per mode in use (LL for buckets up to `ll_max`, HT above);
/// `GpuStep` holds it (as its exchange) before the communicator, so it is torn down first.
pub struct EpExchange {
    shape: StepShape,
    ll: Option<EpPath>,
    ht: Option<EpPath>,
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
}

impl EpExchange {
    /// Creates the groups (collective: LL first, then HT) and their handles; every rank calls
    /// this together.
    pub fn new(comm: &Comm, s: &StepShape, a: &mut Alloc) -> Result<Self, GpuError> {
        let e =
            s.ep.ok_or_else(|| GpuError::Config("no NCCL EP settings".into()))?;
        validate(s, e.align).map_err(GpuError::Config)?;
        let ll = match e.ll_max {
            0 => None,
            t => Some(EpPath::new(comm, s, true, t, e.align, e.zero_copy, a)?),
        };
        let ht = match s.max_home > e.ll_max {
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
        Ok(Self {
            shape: *s,
            recv_w: a.zeros(ht.as_ref().map_or(0, |p| p.cap))?,
            ll,
            ht,
            counters: a.zeros(l)?,
            local_off: a.zeros(l + 1)?,
            total: a.zeros(1)?,
            sizes: a.zeros(hopper::MAX_GROUPS)?,
            bounds: a.zeros(2 * l)?,
            out_b: a.zeros(s.max_home * s.hidden)?,
        })
    }

    /// The largest bucket that runs low-latency (0: none).
    pub fn ll_max(&self) -> usize {
        self.ll.as_ref().map_or(0, |p| p.tokens)
    }

    /// Whether `bucket` runs low-latency.
    pub fn is_ll(&self, bucket: usize) -> bool {
        bucket <= self.ll_max()
    }

    pub fn path(&self, bucket: usize) -> &EpPath {
        let p = match self.is_ll(bucket) {
            true => self.ll.as_ref(),
            false => self.ht.as_ref(),
        };
        p.expect("a path for every bucket")
    }

    fn path_mut(&mut self, bucket: usize) -> &mut EpPath {
        let p = match self.is_ll(bucket) {
            true => self.ll.as_mut(),
            false => self.ht.as_mut(),
        };
        p.expect("a path for every bucket")
    }

    /// Both modes' footprints: (LL, HT).
    pub fn footprints(&self) -> (Option<Footprint>, Option<Footprint>) {
        (
            self.ll.as_ref().map(|p| p.footprint),
            self.ht.as_ref().map(|p| p.footprint),
        )
    }

    /// Prepare: routing of `bucket` rows (`ids` rows past the step's tokens are -1) into the
    /// bucket's handle. HT: each local expert's padded offset lands in `local_off[..L]` and the
    /// padded total in `total` and `local_off[L]` (the grouped GEMM's block bounds).
    fn update_handle(
        &mut self,
        ids: &CudaSlice<i32>,
        bucket: usize,
        stream: &CudaStream,
    ) -> Result<(), GpuError> {
        let k = self.shape.top_k;
        let local = self.counters.len();
        let mut ids_sz = [bucket, k];
        let t_ids =
            ncclEpTensor_t::describe(ids.device_ptr(stream).0, ncclDataType_t::Int32, &mut ids_sz);
        let raw = stream.cu_stream() as nccl_sys::cudaStream_t;
        if self.is_ll(bucket) {
            let p = self.path_mut(bucket);
            // SAFETY: the descriptor and its sizes live on this frame through the call; LL
            // takes no layout info here.
            return Ok(check("ncclEpUpdateHandle", unsafe {
                (p.ep.update_handle)(p.handle.raw, &t_ids, std::ptr::null(), raw)
            })?);
        }
        let (mut cnt_sz, mut off_sz, mut tot_sz) = ([local], [local], [1]);
        let mut t_cnt = ncclEpTensor_t::describe(
            self.counters.device_ptr_mut(stream).0,
            ncclDataType_t::Int32,
            &mut cnt_sz,
        );
        let off = self.local_off.device_ptr_mut(stream).0;
        let mut t_off = ncclEpTensor_t::describe(off, ncclDataType_t::Int32, &mut off_sz);
        let tot = self.total.device_ptr_mut(stream).0;
        let mut t_tot = ncclEpTensor_t::describe(tot, ncclDataType_t::Int32, &mut tot_sz);
        let mut li = ncclEpLayoutInfo_t::new();
        li.expert_counters = &mut t_cnt;
        li.expert_offsets = &mut t_off;
        li.recv_total_counter = &mut t_tot;
        let p = self.path_mut(bucket);
        // SAFETY: every descriptor points at a live buffer of the extents it states, and lives
        // on this frame through the call.
        check("ncclEpUpdateHandle", unsafe {
            (p.ep.update_handle)(p.handle.raw, &t_ids, &li, raw)
        })?;
        // SAFETY: offsets holds local + 1 ints; one int copied from the total to its end.
        unsafe { result::memcpy_dtod_async(off + (local * 4) as u64, tot, 4, stream.cu_stream()) }?;
        Ok(())
    }

    /// Dispatch: `bucket` home rows of `x` (HT: with their routing weights) into the bucket's
    /// expert rows.
    fn dispatch_rows(
        &mut self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<f32>,
        bucket: usize,
        stream: &CudaStream,
    ) -> Result<(), GpuError> {
        let (k, hidden) = (self.shape.top_k, self.shape.hidden);
        let ll = self.is_ll(bucket);
        let local = self.counters.len();
        let (mut x_sz, mut w_sz, mut rw_sz, mut cnt_sz) =
            ([bucket, hidden], [bucket, k], [0usize], [local]);
        let mut t_x =
            ncclEpTensor_t::describe(x.device_ptr(stream).0, ncclDataType_t::Bfloat16, &mut x_sz);
        let mut t_w =
            ncclEpTensor_t::describe(w.device_ptr(stream).0, ncclDataType_t::Float32, &mut w_sz);
        let mut t_cnt = ncclEpTensor_t::describe(
            self.counters.device_ptr_mut(stream).0,
            ncclDataType_t::Int32,
            &mut cnt_sz,
        );
        let recv_w = self.recv_w.device_ptr_mut(stream).0;
        let p = self.path_mut(bucket);
        let mut r_sz3 = [local, p.cap, hidden];
        let mut r_sz2 = [p.cap, hidden];
        rw_sz[0] = p.cap;
        let mut t_r = match ll {
            true => p.rows.tensor(&mut r_sz3, stream),
            false => p.rows.tensor(&mut r_sz2, stream),
        };
        let mut t_rw = ncclEpTensor_t::describe(recv_w, ncclDataType_t::Float32, &mut rw_sz);
        let mut din = ncclEpDispatchInputs_t::new();
        din.tokens = &mut t_x;
        let mut dout = ncclEpDispatchOutputs_t::new();
        dout.tokens = &mut t_r;
        let mut li = ncclEpLayoutInfo_t::new();
        let li_ptr = match ll {
            // LL expert-major: the per-expert received counts, at dispatch time.
            true => {
                li.expert_counters = &mut t_cnt;
                &li as *const ncclEpLayoutInfo_t
            }
            // HT forward: the weights travel with the rows (one per received row).
            false => {
                din.topk_weights = &mut t_w;
                dout.topk_weights = &mut t_rw;
                std::ptr::null()
            }
        };
        let cfg = ncclEpDispatchConfig_t::new();
        let raw = stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: every descriptor points at a live buffer of the extents it states (the rows
        // hold the group's receive capacity) and lives on this frame through the call.
        check("ncclEpDispatch", unsafe {
            (p.ep.dispatch)(p.handle.raw, &din, &dout, li_ptr, &cfg, raw)
        })?;
        Ok(())
    }

    /// Combine: the expert rows back home, summed, into `out_b`'s `bucket` rows. HT rows are
    /// weighted already; LL weighs them with the home tokens' `w` as they arrive.
    fn combine_rows(
        &mut self,
        w: &CudaSlice<f32>,
        bucket: usize,
        stream: &CudaStream,
    ) -> Result<(), GpuError> {
        let (k, hidden) = (self.shape.top_k, self.shape.hidden);
        let ll = self.is_ll(bucket);
        let local = self.counters.len();
        let (mut o_sz, mut w_sz) = ([bucket, hidden], [bucket, k]);
        let mut t_o = ncclEpTensor_t::describe(
            self.out_b.device_ptr_mut(stream).0,
            ncclDataType_t::Bfloat16,
            &mut o_sz,
        );
        let mut t_w =
            ncclEpTensor_t::describe(w.device_ptr(stream).0, ncclDataType_t::Float32, &mut w_sz);
        let p = self.path_mut(bucket);
        let mut c_sz3 = [local, p.cap, hidden];
        let mut c_sz2 = [p.cap, hidden];
        let mut t_c = match ll {
            true => p.rows.tensor(&mut c_sz3, stream),
            false => p.rows.tensor(&mut c_sz2, stream),
        };
        let mut cin = ncclEpCombineInputs_t::new();
        cin.tokens = &mut t_c;
        let mut cout = ncclEpCombineOutputs_t::new();
        cout.tokens = &mut t_o;
        if ll {
            cout.topk_weights = &mut t_w;
        }
        let cfg = ncclEpCombineConfig_t::new();
        let raw = stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: as in `dispatch`.
        check("ncclEpCombine", unsafe {
            (p.ep.combine)(p.handle.raw, &cin, &cout, &cfg, raw)
        })?;
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

    fn prepare(&mut self, g: &Gpu, home: &Home, bucket: usize) -> Result<(), GpuError> {
        self.update_handle(home.ids, bucket, &g.stream)
    }

    fn dispatch(
        &mut self,
        g: &Gpu,
        _comm: &Comm,
        home: &Home,
        bucket: usize,
    ) -> Result<(), GpuError> {
        self.dispatch_rows(home.x, home.w, bucket, &g.stream)
    }

    fn expert_rows(&mut self, g: &Gpu, bucket: usize) -> Result<ExpertRows<'_>, GpuError> {
        let s = self.shape;
        let ll_bucket = self.is_ll(bucket);
        let Self {
            ll,
            ht,
            counters,
            local_off,
            total,
            sizes,
            bounds,
            recv_w,
            ..
        } = self;
        if ll_bucket {
            // LL rows: expert e's `counters[e]` rows start at e x (world x tokens).
            let p = ll.as_mut().expect("an LL path for LL buckets");
            g.ll_bounds(counters, p.cap, bounds, sizes)?;
            return Ok(ExpertRows::Strided {
                stride: p.cap,
                valid: s.world * p.tokens * s.top_k.min(s.local()),
                x: p.rows_mut(),
                counts: sizes,
                bounds,
            });
        }
        // HT blocks start at multiples of `hopper::ALIGN` (the handle's expert alignment); its
        // combine sums rows as they come, so each row carries its routing weight.
        let p = ht.as_mut().expect("an HT path for HT buckets");
        g.psum_ends(local_off, counters, sizes)?;
        Ok(ExpertRows::Blocks {
            x: p.rows_mut(),
            cap: s.recv_rows(bucket),
            offsets: local_off,
            ends: sizes,
            total,
            weights: Some(recv_w),
            fp8: None,
        })
    }

    fn combine(
        &mut self,
        g: &Gpu,
        _comm: &Comm,
        home: &Home,
        bucket: usize,
        shared: Option<&CudaSlice<bf16>>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        self.combine_rows(home.w, bucket, &g.stream)?;
        g.widen_add(&self.out_b, shared, home.n, bucket, self.shape.hidden, out)?;
        Ok(())
    }

    fn receipts(&self) -> Option<(&CudaSlice<i32>, &CudaSlice<i32>)> {
        Some((&self.counters, &self.total))
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
        metrics::counter!("epserve_ep_steps_total", "mode" => mode).increment(1);
        metrics::gauge!("epserve_ep_recv_rows", "mode" => mode).set(rows as f64);
        if overflow {
            metrics::counter!("epserve_ep_recv_overflow_total", "mode" => mode).increment(1);
            return Err(format!(
                "NCCL EP ({mode}) received past its capacity: {rows} rows, capacity {cap}"
            ));
        }
        if rows != expected {
            metrics::counter!("epserve_ep_recv_mismatch_total", "mode" => mode).increment(1);
            return Err(format!(
                "NCCL EP ({mode}) received {rows} rows where the routing sent {expected}"
            ));
        }
        Ok(())
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

    fn shape(world: usize, experts: usize, top_k: usize, hidden: usize) -> StepShape {
        StepShape {
            world,
            rank: 0,
            experts,
            top_k,
            hidden,
            inter: 64,
            shared_inter: 0,
            max_home: 64,
            ep: None,
            expert_dtype: crate::model::ExpertDtype::Bf16,
        }
    }

    #[test]
    fn receive_capacity_covers_duplication_and_padding() {
        // 4 ranks x 64 tokens x min(8, 32) local copies, plus 32 experts x 63 padding rows.
        assert_eq!(shape(4, 128, 8, 2048).ht_capacity(64), 2048 + 32 * 63);
        // Few local experts: a token reaches at most 2 of them.
        assert_eq!(shape(8, 16, 4, 64).ht_capacity(1), 8 * 64 * 2);
    }

    #[test]
    fn config_problems_are_named_before_the_library_sees_them() {
        assert!(validate(&shape(4, 128, 8, 2048), 64).is_ok());
        let e = validate(&shape(3, 128, 8, 2048), 64).unwrap_err();
        assert!(e.contains("128 experts over 3 ranks"), "{e}");
        let e = validate(&shape(4, 128, 8, 2048), 48).unwrap_err();
        assert!(e.contains("alignment 48 is not a power of two"), "{e}");
        let e = validate(&shape(4, 128, 8, 2044), 64).unwrap_err();
        assert!(e.contains("4088 bytes is not a multiple of 16"), "{e}");
    }
}
