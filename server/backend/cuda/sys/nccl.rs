//! A safe NCCL communicator over `nccl-sys`: created from the unique id the rendezvous hands out,
//! destroyed on drop, aborted when the group breaks (so no rank spins forever in a collective).

use std::ffi::{c_int, c_void, CStr};
use std::mem::ManuallyDrop;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError,
    ValidAsZeroBits,
};
use half::bf16;
use nccl_sys::{ncclComm_t, ncclDataType_t, ncclResult_t, ncclUniqueId, ncclWindow_t, Nccl};

/// NCCL, loaded once and never unloaded: `ncclGetUniqueId` starts a bootstrap thread that runs
/// library code, so a dlclose after it would pull the code from under that thread.
pub fn loaded() -> Result<Arc<Nccl>, String> {
    static NCCL: OnceLock<Result<Arc<Nccl>, String>> = OnceLock::new();
    NCCL.get_or_init(|| Nccl::load().map(Arc::new).map_err(|e| e.to_string()))
        .clone()
}

/// A new communicator's unique id (the leader's, handed to every rank that joins it), as bytes.
pub fn new_id() -> Result<Vec<u8>, String> {
    let id = Comm::unique_id(&*loaded()?).map_err(|e| e.to_string())?;
    Ok(id.as_bytes().to_vec())
}

/// `Comm::init` (with NCCL loaded) on a thread of its own bound to `ctx`, since NCCL init blocks
/// until every member has joined; then `then` with the communicator, on that thread. The
/// receiver has the outcome; the caller bounds its wait (an init whose peer never comes holds
/// its thread, not the caller).
pub fn init_apart<T, E>(
    ctx: Arc<CudaContext>,
    id: ncclUniqueId,
    (world, rank): (usize, usize),
    lost: Vec<u32>,
    then: impl FnOnce(&Arc<CudaContext>, Comm) -> Result<T, E> + Send + 'static,
) -> std::io::Result<Receiver<Result<T, E>>>
where
    T: Send + 'static,
    E: From<NcclError> + From<DriverError> + From<String> + Send + 'static,
{
    let (tx, rx) = channel();
    std::thread::Builder::new()
        .name("nccl-init".into())
        .spawn(move || {
            let r = ctx.bind_to_thread().map_err(E::from).and_then(|()| {
                let nccl = loaded().map_err(E::from)?;
                let comm = Comm::init(nccl, &id, (world, rank), &lost)?;
                then(&ctx, comm)
            });
            let _ = tx.send(r);
        })?;
    Ok(rx)
}

/// `NCCL_WIN_COLL_SYMMETRIC`: every rank registers a buffer of the same size.
const WIN_COLL_SYMMETRIC: c_int = 0x01;

#[derive(Debug)]
pub struct NcclError {
    pub op: &'static str,
    pub result: ncclResult_t,
    /// NCCL's last-error text, when it has one.
    pub detail: String,
}

impl std::fmt::Display for NcclError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.op, self.result)?;
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for NcclError {}

/// Element types NCCL moves for us.
pub trait NcclType {
    const TYPE: ncclDataType_t;
}
impl NcclType for i32 {
    const TYPE: ncclDataType_t = ncclDataType_t::Int32;
}
impl NcclType for i64 {
    const TYPE: ncclDataType_t = ncclDataType_t::Int64;
}
impl NcclType for f32 {
    const TYPE: ncclDataType_t = ncclDataType_t::Float32;
}
impl NcclType for bf16 {
    const TYPE: ncclDataType_t = ncclDataType_t::Bfloat16;
}
impl NcclType for u8 {
    const TYPE: ncclDataType_t = ncclDataType_t::Uint8;
}

pub struct Comm {
    nccl: Arc<Nccl>,
    comm: ncclComm_t,
    /// This rank and the group's size as the group numbers them: a lost rank keeps its number.
    pub rank: usize,
    pub world: usize,
    /// The group's ranks in the communicator, ascending: NCCL's rank i is `members[i]` (every
    /// rank until one is lost).
    members: Vec<usize>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; `Comm`'s methods
// take `&self` only for calls NCCL allows concurrently with nothing else on the same stream.
unsafe impl Send for Comm {}

impl Comm {
    pub fn unique_id(nccl: &Nccl) -> Result<ncclUniqueId, NcclError> {
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer.
        let r = unsafe { (nccl.get_unique_id)(&mut id) };
        r.ok().map(|_| id).map_err(|result| NcclError {
            op: "ncclGetUniqueId",
            result,
            detail: String::new(),
        })
    }

    /// Joins the communicator of the group's ranks but `lost`; blocks until every one has (call
    /// with the CUDA device current).
    pub fn init(
        nccl: Arc<Nccl>,
        id: &ncclUniqueId,
        (world, rank): (usize, usize),
        lost: &[u32],
    ) -> Result<Self, NcclError> {
        let members: Vec<usize> = (0..world)
            .filter(|r| !lost.contains(&(*r as u32)))
            .collect();
        let Some(me) = members.iter().position(|&r| r == rank) else {
            return Err(NcclError {
                op: "ncclCommInitRank",
                result: ncclResult_t::INVALID_ARGUMENT,
                detail: format!("rank {rank} is out of the group (lost {lost:?})"),
            });
        };
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `id` is copied by value as the C API takes it.
        let r =
            unsafe { (nccl.comm_init_rank)(&mut comm, members.len() as c_int, *id, me as c_int) };
        let me = Self {
            nccl,
            comm,
            rank,
            world,
            members,
        };
        me.check("ncclCommInitRank", r)?;
        Ok(me)
    }

    /// Whether every rank of the group is in the communicator.
    pub fn whole(&self) -> bool {
        self.members.len() == self.world
    }

    /// The group's ranks in the communicator, ascending.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// Group rank `peer`'s rank in the communicator.
    fn nccl_rank(&self, peer: usize) -> c_int {
        let i = self.members.binary_search(&peer);
        i.unwrap_or_else(|_| panic!("rank {peer} is not in the communicator")) as c_int
    }

    fn check(&self, op: &'static str, r: ncclResult_t) -> Result<(), NcclError> {
        r.ok().map_err(|result| {
            let detail = if self.comm.is_null() {
                self.nccl.error_string(result)
            } else {
                // SAFETY: a live communicator; NCCL returns a NUL-terminated string it owns.
                let p = unsafe { (self.nccl.get_last_error)(self.comm) };
                if p.is_null() {
                    String::new()
                } else {
                    // SAFETY: non-null, NUL-terminated (NCCL's contract).
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            };
            NcclError { op, result, detail }
        })
    }

    /// Every rank's `count` elements of `send`, in rank order, into `recv` (`world * count`).
    /// Without a lost rank, its place in `recv` is left as it was: sends and receives between
    /// the members, each into its own place (NCCL's all-gather packs its ranks together).
    pub fn all_gather<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        count: usize,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        assert!(
            send.len() >= count && recv.len() >= count * self.world,
            "all_gather buffers too small"
        );
        if !self.whole() {
            return self.group(|| {
                for &p in &self.members {
                    self.send(send, 0, count, p, stream)?;
                    self.recv(recv, p * count, count, p, stream)?;
                }
                Ok(())
            });
        }
        let (s, _a) = send.device_ptr(stream);
        let (r, _b) = recv.device_ptr_mut(stream);
        // SAFETY: both device buffers hold the counts asserted above and live through the call;
        // the stream is the one the buffers are used on.
        let res = unsafe {
            (self.nccl.all_gather)(
                s as *const c_void,
                r as *mut c_void,
                count,
                T::TYPE,
                self.comm,
                stream.cu_stream().cast(),
            )
        };
        self.check("ncclAllGather", res)
    }

    /// Sends elements `[offset, offset + count)` of `buf` to group rank `peer` (inside a group).
    pub fn send<T: NcclType>(
        &self,
        buf: &CudaSlice<T>,
        offset: usize,
        count: usize,
        peer: usize,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        assert!(
            offset + count <= buf.len() && peer < self.world,
            "send out of bounds"
        );
        let (p, _a) = buf.device_ptr(stream);
        let p = p + (offset * std::mem::size_of::<T>()) as u64;
        // SAFETY: the range is inside the buffer (asserted); the buffer outlives the enqueue.
        let res = unsafe {
            (self.nccl.send)(
                p as *const c_void,
                count,
                T::TYPE,
                self.nccl_rank(peer),
                self.comm,
                stream.cu_stream().cast(),
            )
        };
        self.check("ncclSend", res)
    }

    /// Receives `count` elements from group rank `peer` into `buf` at `offset` (inside a group).
    pub fn recv<T: NcclType>(
        &self,
        buf: &mut CudaSlice<T>,
        offset: usize,
        count: usize,
        peer: usize,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        assert!(
            offset + count <= buf.len() && peer < self.world,
            "recv out of bounds"
        );
        let (p, _a) = buf.device_ptr_mut(stream);
        let p = p + (offset * std::mem::size_of::<T>()) as u64;
        // SAFETY: as in `send`.
        let res = unsafe {
            (self.nccl.recv)(
                p as *mut c_void,
                count,
                T::TYPE,
                self.nccl_rank(peer),
                self.comm,
                stream.cu_stream().cast(),
            )
        };
        self.check("ncclRecv", res)
    }

    /// Runs `f` between ncclGroupStart and ncclGroupEnd (always ends the group).
    pub fn group<R>(&self, f: impl FnOnce() -> Result<R, NcclError>) -> Result<R, NcclError> {
        // SAFETY: no arguments; pairs with the ncclGroupEnd below.
        self.check("ncclGroupStart", unsafe { (self.nccl.group_start)() })?;
        let r = f();
        // SAFETY: closes the group opened above, whatever `f` did.
        let end = self.check("ncclGroupEnd", unsafe { (self.nccl.group_end)() });
        let r = r?;
        end.map(|_| r)
    }

    /// `len` zeroed elements from `ncclMemAlloc`, registered once as a symmetric window
    /// (collective: every rank allocates the same sizes in the same order, outside any capture).
    pub fn sym_alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<SymBuffer<T>, NcclError> {
        let missing = |op| NcclError {
            op,
            result: ncclResult_t::INVALID_USAGE,
            detail: "not in this NCCL (symmetric windows need NCCL >= 2.27)".into(),
        };
        let alloc = self.nccl.mem_alloc.ok_or(missing("ncclMemAlloc"))?;
        let free = self.nccl.mem_free.ok_or(missing("ncclMemFree"))?;
        let register = (self.nccl.comm_window_register).ok_or(missing("ncclCommWindowRegister"))?;
        let deregister =
            (self.nccl.comm_window_deregister).ok_or(missing("ncclCommWindowDeregister"))?;
        let bytes = len.max(1) * std::mem::size_of::<T>();
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; NCCL allocates `bytes` of device memory on this device.
        self.check("ncclMemAlloc", unsafe { alloc(&mut ptr, bytes) })?;
        let mut win: ncclWindow_t = std::ptr::null_mut();
        // SAFETY: ptr holds `bytes` from ncclMemAlloc; a live communicator; valid out-pointer.
        let r = unsafe { register(self.comm, ptr, bytes, &mut win, WIN_COLL_SYMMETRIC) };
        if let Err(e) = self.check("ncclCommWindowRegister", r) {
            // SAFETY: allocated above, not registered, freed once.
            unsafe { free(ptr) };
            return Err(e);
        }
        // SAFETY: ptr is a device allocation of len.max(1) elements of T on the stream's context;
        // the slice is leaked, never freed by cudarc (`SymBuffer::drop` frees it through NCCL).
        let mut view = unsafe { stream.upgrade_device_ptr::<T>(ptr as u64, len.max(1)) };
        let zeroed = stream.memset_zeros(&mut view);
        let me = SymBuffer {
            free,
            deregister,
            comm: self.comm,
            win,
            view: ManuallyDrop::new(view),
        };
        zeroed.map_err(|e| NcclError {
            op: "cuMemsetD8Async",
            result: ncclResult_t::UNHANDLED_CUDA_ERROR,
            detail: e.to_string(),
        })?;
        Ok(me)
    }

    /// The communicator of the members but `gone` (group ranks), made by every member left at
    /// once (`gone` do not call it): `ncclCommShrink`, with `lost` NCCL_SHRINK_ABORT, so the
    /// operations in flight here that wait for a gone peer end first (measured: 46 ms on 2x
    /// H100, a captured step's kernel released, where `ncclCommAbort` never returned;
    /// docs/benchmarks.md "Losing a rank"); this one is then left to be aborted. Without
    /// `lost`, this one stays in use beside the new one.
    pub fn shrink(&self, gone: &[usize], lost: bool) -> Result<Comm, NcclError> {
        let f = self.nccl.comm_shrink.ok_or_else(|| NcclError {
            op: "ncclCommShrink",
            result: ncclResult_t::INVALID_USAGE,
            detail: "not in this NCCL (needs NCCL >= 2.27)".into(),
        })?;
        let mut exclude: Vec<c_int> = (self.members.iter())
            .filter(|m| gone.contains(m))
            .map(|&m| self.nccl_rank(m))
            .collect();
        let members: Vec<usize> = (self.members.iter().copied())
            .filter(|m| !gone.contains(m))
            .collect();
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: a live communicator; `exclude` holds its length of this communicator's ranks;
        // a valid out-pointer; a null config inherits this communicator's (blocking).
        let r = unsafe {
            f(
                self.comm,
                exclude.as_mut_ptr(),
                exclude.len() as c_int,
                &mut comm,
                std::ptr::null_mut(),
                match lost {
                    true => nccl_sys::NCCL_SHRINK_ABORT,
                    false => nccl_sys::NCCL_SHRINK_DEFAULT,
                },
            )
        };
        self.check("ncclCommShrink", r)?;
        if comm.is_null() {
            return Err(NcclError {
                op: "ncclCommShrink",
                result: ncclResult_t::INTERNAL_ERROR,
                detail: "no communicator came back".into(),
            });
        }
        Ok(Self {
            nccl: self.nccl.clone(),
            comm,
            rank: self.rank,
            world: self.world,
            members,
        })
    }

    /// Whether `abort` ended it.
    pub fn aborted(&self) -> bool {
        self.comm.is_null()
    }

    /// The raw communicator, for libraries built on it (NCCL EP); valid while `self` lives.
    pub fn raw(&self) -> ncclComm_t {
        self.comm
    }

    /// Tears the communicator down without waiting for peers (the group is broken, or goes on
    /// without one): NCCL's kernels still waiting on a peer return. Nothing more goes through
    /// it: a call fails (a null communicator).
    pub fn abort(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: a live communicator, not used afterwards (nulled, so Drop skips it).
            unsafe { (self.nccl.comm_abort)(self.comm) };
            self.comm = std::ptr::null_mut();
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: a live communicator owned by `self`, destroyed once.
            let r = unsafe { (self.nccl.comm_destroy)(self.comm) };
            if r != ncclResult_t::SUCCESS {
                tracing::warn!("ncclCommDestroy: {r}");
            }
        }
    }
}

/// Device memory from `ncclMemAlloc`, registered as a symmetric window of a communicator. It
/// must be dropped before the communicator (its owner's field order sees to that): deregistering
/// is collective, like registering.
pub struct SymBuffer<T> {
    free: unsafe extern "C" fn(*mut c_void) -> ncclResult_t,
    deregister: unsafe extern "C" fn(ncclComm_t, ncclWindow_t) -> ncclResult_t,
    comm: ncclComm_t,
    win: ncclWindow_t,
    /// The memory as cudarc sees it, for the kernels; never freed by cudarc.
    view: ManuallyDrop<CudaSlice<T>>,
}

// SAFETY: used by the one thread that runs the rank's steps at a time, like the communicator.
unsafe impl<T> Send for SymBuffer<T> {}

impl<T> SymBuffer<T> {
    pub fn window(&self) -> ncclWindow_t {
        self.win
    }
}

impl<T> std::ops::Deref for SymBuffer<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.view
    }
}

impl<T> std::ops::DerefMut for SymBuffer<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.view
    }
}

impl<T> Drop for SymBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; leaking hands the pointer back without cudarc freeing it.
        let ptr = unsafe { ManuallyDrop::take(&mut self.view) }.leak();
        // SAFETY: the window was registered on this (still live) communicator, deregistered once.
        let r = unsafe { (self.deregister)(self.comm, self.win) };
        if r != ncclResult_t::SUCCESS {
            tracing::warn!("ncclCommWindowDeregister: {r}");
        }
        // SAFETY: allocated by ncclMemAlloc, no longer registered, freed once.
        let r = unsafe { (self.free)(ptr as *mut c_void) };
        if r != ncclResult_t::SUCCESS {
            tracing::warn!("ncclMemFree: {r}");
        }
    }
}
