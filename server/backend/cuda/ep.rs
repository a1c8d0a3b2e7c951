//! The `nccl-ep` exchange: NVIDIA NCCL EP in high-throughput mode with the expert-major layout.
//! Prepare is `ncclEpUpdateHandle` (it writes each local expert's padded count and offset straight
//! into the grouped GEMM's offsets), dispatch lands the received rows where the GEMM reads them,
//! and combine takes the weighted expert outputs back home. One group and one handle per rank,
//! made before any capture; every call is capturable (the receive capacity is explicit).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use nccl_sys::ep::*;
use nccl_sys::{ncclDataType_t, ncclResult_t};

use super::nccl::{Comm, NcclError};
use super::step::{Alloc, StepShape};

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

/// Rows one rank's expert-major receive buffer needs: every source's tokens to each of its local
/// experts (at most min(k, local) per token), plus per-expert padding to `align`.
pub fn recv_capacity(s: &StepShape, align: usize) -> usize {
    s.world * s.max_home * s.top_k.min(s.local()) + s.local() * (align - 1)
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
    if recv_capacity(s, align) < s.max_home {
        bad.push("receive capacity below dispatch capacity".into());
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

/// One rank's NCCL EP state. Field order is teardown order: handle, then group (and both before
/// the communicator, which `GpuStep` declares after this).
pub struct EpExchange {
    handle: Handle,
    _group: Group,
    _handle_mem: CudaSlice<u8>,
    ep: Arc<NcclEp>,
    pub recv_cap: usize,
    /// Padded per-local-expert counts from the last UpdateHandle.
    counters: CudaSlice<i32>,
    /// The routing weight of each received row.
    recv_w: CudaSlice<f32>,
    /// Combined home rows `[T, hidden]` in bf16, before the shared expert is added.
    pub out_b: CudaSlice<bf16>,
}

impl EpExchange {
    /// Creates the group (collective) and the handle; call on every rank together.
    pub fn new(
        comm: &Comm,
        s: &StepShape,
        align: usize,
        a: &mut Alloc,
    ) -> Result<Self, super::step::GpuError> {
        validate(s, align).map_err(super::step::GpuError::Config)?;
        let ep = library().map_err(super::step::GpuError::Config)?;
        let recv_cap = recv_capacity(s, align);
        let mut cfg = ncclEpGroupConfig_t::new();
        cfg.algorithm = ncclEpAlgorithm_t::HIGH_THROUGHPUT;
        cfg.num_experts = s.experts as u32;
        cfg.max_dispatch_tokens_per_rank = s.max_home as u32;
        cfg.max_recv_tokens_per_rank = recv_cap as u32;
        cfg.max_token_bytes = (s.hidden * 2) as u32;
        let mut group: ncclEpGroup_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer, a live communicator, a config from its constructor.
        check("ncclEpCreateGroup", unsafe {
            (ep.create_group)(&mut group, comm.raw(), &cfg)
        })?;
        let group = Group {
            ep: ep.clone(),
            raw: group,
        };
        let mut hcfg = ncclEpHandleConfig_t::new();
        hcfg.dispatch_output_per_expert_alignment = align;
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
        let stream = handle_mem.stream().clone();
        let mut hm_sizes = [mem];
        let hm = ncclEpTensor_t::describe(
            handle_mem.device_ptr_mut(&stream).0,
            ncclDataType_t::Uint8,
            &mut hm_sizes,
        );
        let mut handle: ncclEpHandle_t = std::ptr::null_mut();
        // SAFETY: handle_mem holds `mem` bytes and lives as long as the handle (same struct).
        check("ncclEpInitHandle", unsafe {
            (ep.init_handle)(
                &mut handle,
                group.raw,
                ncclEpLayout_t::EXPERT_MAJOR,
                &hcfg,
                s.top_k as i32,
                &hm,
            )
        })?;
        let handle = Handle {
            ep: ep.clone(),
            raw: handle,
        };
        Ok(Self {
            handle,
            _group: group,
            _handle_mem: handle_mem,
            ep,
            recv_cap,
            counters: a.zeros(s.local())?,
            recv_w: a.zeros(recv_cap)?,
            out_b: a.zeros(s.max_home * s.hidden)?,
        })
    }

    /// Prepare: routing of `bucket` rows (`ids` rows past the step's tokens are -1) into the
    /// handle; each local expert's padded offset lands in `offsets[..L]` and the padded total
    /// in `rows` and `offsets[L]` (the grouped GEMM's block bounds).
    pub fn update(
        &mut self,
        ids: &CudaSlice<i32>,
        bucket: usize,
        k: usize,
        offsets: &mut CudaSlice<i32>,
        rows: &mut CudaSlice<i32>,
        stream: &CudaStream,
    ) -> Result<(), super::step::GpuError> {
        let local = self.counters.len();
        let (mut ids_sz, mut cnt_sz, mut off_sz, mut tot_sz) = ([bucket, k], [local], [local], [1]);
        let t_ids =
            ncclEpTensor_t::describe(ids.device_ptr(stream).0, ncclDataType_t::Int32, &mut ids_sz);
        let mut t_cnt = ncclEpTensor_t::describe(
            self.counters.device_ptr_mut(stream).0,
            ncclDataType_t::Int32,
            &mut cnt_sz,
        );
        let off = offsets.device_ptr_mut(stream).0;
        let mut t_off = ncclEpTensor_t::describe(off, ncclDataType_t::Int32, &mut off_sz);
        let tot = rows.device_ptr_mut(stream).0;
        let mut t_tot = ncclEpTensor_t::describe(tot, ncclDataType_t::Int32, &mut tot_sz);
        let mut li = ncclEpLayoutInfo_t::new();
        li.expert_counters = &mut t_cnt;
        li.expert_offsets = &mut t_off;
        li.recv_total_counter = &mut t_tot;
        let raw = stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: every descriptor points at a live buffer of the extents it states, and lives
        // on this frame through the call.
        check("ncclEpUpdateHandle", unsafe {
            (self.ep.update_handle)(self.handle.raw, &t_ids, &li, raw)
        })?;
        // SAFETY: offsets holds local + 1 ints; one int copied from the total to its end.
        unsafe { result::memcpy_dtod_async(off + (local * 4) as u64, tot, 4, stream.cu_stream()) }?;
        Ok(())
    }

    /// Dispatch: `bucket` home rows of `x` (with their routing weights) into `xe`, expert-major.
    #[allow(clippy::too_many_arguments)]
    pub fn dispatch(
        &mut self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<f32>,
        bucket: usize,
        k: usize,
        hidden: usize,
        xe: &mut CudaSlice<bf16>,
        stream: &CudaStream,
    ) -> Result<(), super::step::GpuError> {
        let (mut x_sz, mut w_sz, mut r_sz, mut rw_sz) = (
            [bucket, hidden],
            [bucket, k],
            [self.recv_cap, hidden],
            [self.recv_cap],
        );
        let mut t_x =
            ncclEpTensor_t::describe(x.device_ptr(stream).0, ncclDataType_t::Bfloat16, &mut x_sz);
        let mut t_w =
            ncclEpTensor_t::describe(w.device_ptr(stream).0, ncclDataType_t::Float32, &mut w_sz);
        let mut t_r = ncclEpTensor_t::describe(
            xe.device_ptr_mut(stream).0,
            ncclDataType_t::Bfloat16,
            &mut r_sz,
        );
        let mut t_rw = ncclEpTensor_t::describe(
            self.recv_w.device_ptr_mut(stream).0,
            ncclDataType_t::Float32,
            &mut rw_sz,
        );
        let mut din = ncclEpDispatchInputs_t::new();
        din.tokens = &mut t_x;
        din.topk_weights = &mut t_w;
        let mut dout = ncclEpDispatchOutputs_t::new();
        dout.tokens = &mut t_r;
        dout.topk_weights = &mut t_rw;
        let cfg = ncclEpDispatchConfig_t::new();
        let raw = stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: as in `update`; xe holds recv_cap rows, the group's receive capacity.
        check("ncclEpDispatch", unsafe {
            (self.ep.dispatch)(self.handle.raw, &din, &dout, std::ptr::null(), &cfg, raw)
        })?;
        Ok(())
    }

    /// The routing weight of each received row (HT combine wants rows already weighted).
    pub fn recv_weights(&self) -> &CudaSlice<f32> {
        &self.recv_w
    }

    /// Combine: the weighted expert rows in `y` back home, summed, into `out_b`'s `bucket` rows.
    pub fn combine(
        &mut self,
        y: &CudaSlice<bf16>,
        bucket: usize,
        hidden: usize,
        stream: &CudaStream,
    ) -> Result<(), super::step::GpuError> {
        let (mut c_sz, mut o_sz) = ([self.recv_cap, hidden], [bucket, hidden]);
        let mut t_c =
            ncclEpTensor_t::describe(y.device_ptr(stream).0, ncclDataType_t::Bfloat16, &mut c_sz);
        let mut t_o = ncclEpTensor_t::describe(
            self.out_b.device_ptr_mut(stream).0,
            ncclDataType_t::Bfloat16,
            &mut o_sz,
        );
        let mut cin = ncclEpCombineInputs_t::new();
        cin.tokens = &mut t_c;
        let mut cout = ncclEpCombineOutputs_t::new();
        cout.tokens = &mut t_o;
        let cfg = ncclEpCombineConfig_t::new();
        let raw = stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: as in `update`.
        check("ncclEpCombine", unsafe {
            (self.ep.combine)(self.handle.raw, &cin, &cout, &cfg, raw)
        })?;
        Ok(())
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
            ep_align: 0,
        }
    }

    #[test]
    fn receive_capacity_covers_duplication_and_padding() {
        // 4 ranks x 64 tokens x min(8, 32) local copies, plus 32 experts x 63 padding rows.
        assert_eq!(recv_capacity(&shape(4, 128, 8, 2048), 64), 2048 + 32 * 63);
        // Few local experts: a token reaches at most 2 of them.
        assert_eq!(recv_capacity(&shape(8, 16, 4, 64), 1), 8 * 64 * 2);
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
