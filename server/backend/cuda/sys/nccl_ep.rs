//! A safe layer over NCCL EP's functions (nccl-sys holds the raw ones): RAII groups and
//! handles, results mapped to `NcclError`, and tensor descriptions that keep the extents they
//! point at and borrow their buffer for as long as a call can see them, their extents checked
//! against the buffer (their dtype is the element type's). Every `unsafe` of the `nccl-ep` exchange is here.

use std::ffi::c_int;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use nccl_sys::ep::*;
use nccl_sys::{ncclDataType_t, ncclResult_t};

use crate::backend::cuda::sys::nccl::{Comm, NcclError, NcclType, SymBuffer};

pub fn check(op: &'static str, r: ncclResult_t) -> Result<(), NcclError> {
    r.ok().map_err(|result| NcclError {
        op,
        result,
        detail: String::new(),
    })
}

/// A buffer as NCCL EP sees it: its descriptor, the extents the descriptor points at (boxed, so
/// they stay put), and a borrow of the buffer.
pub struct Tensor<'a> {
    raw: ncclEpTensor_t,
    _sizes: Box<[usize]>,
    _buf: PhantomData<&'a mut ()>,
}

impl<'a> Tensor<'a> {
    fn new(len: usize, sizes: &[usize], make: impl FnOnce(&mut [usize]) -> ncclEpTensor_t) -> Self {
        let elems: usize = sizes.iter().product();
        assert!(
            elems <= len,
            "NCCL EP tensor of extents {sizes:?} over a buffer of {len} elements"
        );
        let mut sizes: Box<[usize]> = sizes.into();
        let raw = make(&mut sizes);
        Self {
            raw,
            _sizes: sizes,
            _buf: PhantomData,
        }
    }

    /// Device memory at `ptr` (`len` elements) as `dtype` values of extents `sizes`.
    fn device(ptr: u64, len: usize, dtype: ncclDataType_t, sizes: &[usize]) -> Self {
        Self::new(len, sizes, |s| ncclEpTensor_t::describe(ptr, dtype, s))
    }

    /// `buf` as an input of extents `sizes`.
    pub fn of<T: NcclType>(buf: &'a CudaSlice<T>, sizes: &[usize], stream: &CudaStream) -> Self {
        Self::device(buf.device_ptr(stream).0, buf.len(), T::TYPE, sizes)
    }

    /// `buf` as an output (or in-place operand) of extents `sizes`.
    pub fn of_mut<T: NcclType>(
        buf: &'a mut CudaSlice<T>,
        sizes: &[usize],
        stream: &CudaStream,
    ) -> Self {
        let len = buf.len();
        Self::device(buf.device_ptr_mut(stream).0, len, T::TYPE, sizes)
    }

    /// `buf`'s bytes as E4M3 values (NCCL EP's FP8 tokens), an input of extents `sizes`.
    pub fn fp8(buf: &'a CudaSlice<u8>, sizes: &[usize], stream: &CudaStream) -> Self {
        Self::device(
            buf.device_ptr(stream).0,
            buf.len(),
            ncclDataType_t::Float8e4m3,
            sizes,
        )
    }

    /// `buf`'s bytes as E4M3 values, an output of extents `sizes`.
    pub fn fp8_mut(buf: &'a mut CudaSlice<u8>, sizes: &[usize], stream: &CudaStream) -> Self {
        let len = buf.len();
        Self::device(
            buf.device_ptr_mut(stream).0,
            len,
            ncclDataType_t::Float8e4m3,
            sizes,
        )
    }

    /// A registered window's rows, from its start, of extents `sizes`.
    pub fn window<T: NcclType>(buf: &'a mut SymBuffer<T>, sizes: &[usize]) -> Self {
        let win = buf.window();
        Self::new(buf.len(), sizes, |s| {
            ncclEpTensor_t::in_window(win, 0, T::TYPE, s)
        })
    }

    fn raw(&mut self) -> *mut ncclEpTensor_t {
        &mut self.raw
    }
}

/// A communicator's NCCL EP group.
pub struct Group {
    ep: Arc<NcclEp>,
    raw: ncclEpGroup_t,
    /// Left undestroyed when it goes (`abandon`).
    abandoned: bool,
}

impl Group {
    /// Collective: every rank of `comm` creates its group together.
    pub fn create(
        ep: &Arc<NcclEp>,
        comm: &Comm,
        cfg: &ncclEpGroupConfig_t,
    ) -> Result<Self, NcclError> {
        let mut raw: ncclEpGroup_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer, a live communicator, a config from its constructor.
        check("ncclEpCreateGroup", unsafe {
            (ep.create_group)(&mut raw, comm.raw(), cfg)
        })?;
        Ok(Self {
            ep: ep.clone(),
            raw,
            abandoned: false,
        })
    }

    /// Leaves the group undestroyed when it goes, its device memory allocated: NCCL EP destroys
    /// a low-latency group with a barrier over its communicator (`ncclEpGroupDestroy`: an
    /// all-reduce, then `cudaDeviceSynchronize`), which never ends once a member is gone, and
    /// its stuck kernel then holds every later legacy-stream copy on the device.
    pub fn abandon(&mut self) {
        self.abandoned = true;
    }

    /// Whether a kernel of this group masked a peer that did not answer within the group's
    /// timeout (`enable_mask` groups only; a pinned host flag, no GPU sync).
    pub fn masked_a_peer(&self) -> Result<bool, NcclError> {
        let mut flag: c_int = 0;
        // SAFETY: a live group, a valid out-pointer.
        check("ncclEpGetAsyncError", unsafe {
            (self.ep.get_async_error)(self.raw, &mut flag)
        })?;
        Ok(flag != 0)
    }

    /// Device bytes a handle of this group needs.
    pub fn handle_bytes(
        &self,
        cfg: &ncclEpHandleConfig_t,
        top_k: usize,
    ) -> Result<usize, NcclError> {
        let mut mem = 0usize;
        // SAFETY: a live group, a valid config and out-pointer.
        check("ncclEpHandleMemSize", unsafe {
            (self.ep.handle_mem_size)(
                self.raw,
                ncclEpLayout_t::EXPERT_MAJOR,
                cfg,
                &mut mem,
                top_k as i32,
            )
        })?;
        Ok(mem)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.abandoned {
            return;
        }
        // SAFETY: created by ncclEpCreateGroup, destroyed once, after its handle (`Handle` owns
        // its group and drops it after destroying itself).
        let r = unsafe { (self.ep.group_destroy)(self.raw) };
        if r != ncclResult_t::SUCCESS {
            tracing::warn!("ncclEpGroupDestroy: {r}");
        }
    }
}

/// A handle in the expert-major layout, with its group and its device memory: destroyed before
/// either (field order).
pub struct Handle {
    raw: ncclEpHandle_t,
    group: Group,
    _mem: CudaSlice<u8>,
}

/// What NCCL EP writes of the expert-major layout: per-expert counts, per-expert offsets, the
/// received total.
#[derive(Default)]
pub struct Layout<'t, 'a> {
    pub counters: Option<&'t mut Tensor<'a>>,
    pub offsets: Option<&'t mut Tensor<'a>>,
    pub total: Option<&'t mut Tensor<'a>>,
}

impl Layout<'_, '_> {
    fn raw(self) -> ncclEpLayoutInfo_t {
        let mut li = ncclEpLayoutInfo_t::new();
        if let Some(t) = self.counters {
            li.expert_counters = t.raw();
        }
        if let Some(t) = self.offsets {
            li.expert_offsets = t.raw();
        }
        if let Some(t) = self.total {
            li.recv_total_counter = t.raw();
        }
        li
    }
}

/// A dispatch's operands: the home rows (and their routing weights), the expert rows they land
/// in (and one weight per received row).
pub struct Dispatch<'t, 'a> {
    pub x: &'t mut Tensor<'a>,
    pub w: Option<&'t mut Tensor<'a>>,
    pub rows: &'t mut Tensor<'a>,
    pub rows_w: Option<&'t mut Tensor<'a>>,
    /// FP8 rows' scales, sent and received (`x` and `rows` then hold E4M3 codes): forwarded as
    /// they are (NCCL EP's QUANT_FWD recipe).
    pub scales: Option<(&'t mut Tensor<'a>, &'t mut Tensor<'a>)>,
}

impl Handle {
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// The handle goes as usual (local), its group stays (`Group::abandon`).
    pub fn abandon_group(&mut self) {
        self.group.abandon();
    }

    /// Collective with LL's automatic buffer size (the library may allocate): every rank is here.
    pub fn init(
        group: Group,
        cfg: &ncclEpHandleConfig_t,
        top_k: usize,
        mut mem: CudaSlice<u8>,
        stream: &CudaStream,
    ) -> Result<Self, NcclError> {
        let need = group.handle_bytes(cfg, top_k)?;
        let len = mem.len();
        let mut hm = Tensor::of_mut(&mut mem, &[len], stream);
        assert!(len >= need, "a handle of {need} bytes in {len}");
        let mut raw: ncclEpHandle_t = std::ptr::null_mut();
        // SAFETY: the handle memory holds at least the size the group asked for (asserted) and
        // moves into the handle, freed only after the handle is destroyed; a valid config and
        // out-pointer.
        check("ncclEpInitHandle", unsafe {
            (group.ep.init_handle)(
                &mut raw,
                group.raw,
                ncclEpLayout_t::EXPERT_MAJOR,
                cfg,
                top_k as i32,
                hm.raw(),
            )
        })?;
        drop(hm);
        Ok(Self {
            raw,
            group,
            _mem: mem,
        })
    }

    fn stream(stream: &CudaStream) -> nccl_sys::cudaStream_t {
        stream.cu_stream() as nccl_sys::cudaStream_t
    }

    /// Prepare: the step's routing (`ids`), and the layout it writes (HT).
    pub fn update(
        &mut self,
        ids: &mut Tensor,
        layout: Option<Layout>,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        let li = layout.map(Layout::raw);
        let li_ptr = li.as_ref().map_or(std::ptr::null(), |l| l as *const _);
        // SAFETY: every descriptor points at a live buffer it fits (checked when made) and is
        // borrowed through the call; a null layout is allowed (LL).
        check("ncclEpUpdateHandle", unsafe {
            (self.group.ep.update_handle)(self.raw, ids.raw(), li_ptr, Self::stream(stream))
        })
    }

    /// Dispatch: `d.x` to the expert rows `d.rows`, with the layout it writes at dispatch (LL).
    pub fn dispatch(
        &mut self,
        d: Dispatch,
        layout: Option<Layout>,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        let mut din = ncclEpDispatchInputs_t::new();
        din.tokens = d.x.raw();
        let mut dout = ncclEpDispatchOutputs_t::new();
        dout.tokens = d.rows.raw();
        if let Some(w) = d.w {
            din.topk_weights = w.raw();
        }
        if let Some(w) = d.rows_w {
            dout.topk_weights = w.raw();
        }
        let mut cfg = ncclEpDispatchConfig_t::new();
        if let Some((sent, received)) = d.scales {
            din.scales = sent.raw();
            dout.scales = received.raw();
            cfg.quant_recipe = ncclEpDispQuant_t::FWD;
        }
        let li = layout.map(Layout::raw);
        let li_ptr = li.as_ref().map_or(std::ptr::null(), |l| l as *const _);
        // SAFETY: as in `update`; the rows (and the received scales, where given) hold the
        // group's receive capacity (their extents, checked against their buffers).
        check("ncclEpDispatch", unsafe {
            (self.group.ep.dispatch)(self.raw, &din, &dout, li_ptr, &cfg, Self::stream(stream))
        })
    }

    /// Combine: the expert rows back home into `out`, summed (weighed by `w` where given: LL).
    pub fn combine(
        &mut self,
        rows: &mut Tensor,
        out: &mut Tensor,
        w: Option<&mut Tensor>,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        let mut cin = ncclEpCombineInputs_t::new();
        cin.tokens = rows.raw();
        let mut cout = ncclEpCombineOutputs_t::new();
        cout.tokens = out.raw();
        if let Some(w) = w {
            cout.topk_weights = w.raw();
        }
        let cfg = ncclEpCombineConfig_t::new();
        // SAFETY: as in `update`.
        check("ncclEpCombine", unsafe {
            (self.group.ep.combine)(self.raw, &cin, &cout, &cfg, Self::stream(stream))
        })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by ncclEpInitHandle, destroyed once, before its group (a field, dropped
        // after this).
        let r = unsafe { (self.group.ep.handle_destroy)(self.raw) };
        if r != ncclResult_t::SUCCESS {
            tracing::warn!("ncclEpHandleDestroy: {r}");
        }
    }
}

// SAFETY: the group and handle are used by the one thread that runs the rank's steps at a time.
unsafe impl Send for Group {}
// SAFETY: as for `Group`.
unsafe impl Send for Handle {}
