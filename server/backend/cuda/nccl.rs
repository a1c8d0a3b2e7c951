//! A safe NCCL communicator over `nccl-sys`: created from the unique id the rendezvous hands out,
//! destroyed on drop, aborted when the group breaks (so no rank spins forever in a collective).

use std::ffi::{c_int, c_void, CStr};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use nccl_sys::{ncclComm_t, ncclDataType_t, ncclResult_t, ncclUniqueId, Nccl};

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
impl NcclType for f32 {
    const TYPE: ncclDataType_t = ncclDataType_t::Float32;
}
impl NcclType for bf16 {
    const TYPE: ncclDataType_t = ncclDataType_t::Bfloat16;
}

pub struct Comm {
    nccl: Arc<Nccl>,
    comm: ncclComm_t,
    pub rank: usize,
    pub world: usize,
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

    /// Joins the communicator; blocks until every rank has (call with the CUDA device current).
    pub fn init(
        nccl: Arc<Nccl>,
        id: &ncclUniqueId,
        world: usize,
        rank: usize,
    ) -> Result<Self, NcclError> {
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `id` is copied by value as the C API takes it.
        let r = unsafe { (nccl.comm_init_rank)(&mut comm, world as c_int, *id, rank as c_int) };
        let me = Self {
            nccl,
            comm,
            rank,
            world,
        };
        me.check("ncclCommInitRank", r)?;
        Ok(me)
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

    /// Sends elements `[offset, offset + count)` of `buf` to `peer` (inside a group).
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
                peer as c_int,
                self.comm,
                stream.cu_stream().cast(),
            )
        };
        self.check("ncclSend", res)
    }

    /// Receives `count` elements from `peer` into `buf` at `offset` (inside a group).
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
                peer as c_int,
                self.comm,
                stream.cu_stream().cast(),
            )
        };
        self.check("ncclRecv", res)
    }

    /// The expert-parallel exchange: slot p of `send` (`slot` elements) goes to rank p, and rank
    /// p's slot for us lands in slot p of `recv`; one group, so it is a single capturable step.
    pub fn exchange_slots<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        slot: usize,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        self.group(|| {
            for p in 0..self.world {
                self.send(send, p * slot, slot, p, stream)?;
                self.recv(recv, p * slot, slot, p, stream)?;
            }
            Ok(())
        })
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

    /// The raw communicator, for libraries built on it (NCCL EP); valid while `self` lives.
    pub fn raw(&self) -> ncclComm_t {
        self.comm
    }

    /// Tears the communicator down without waiting for peers (the group is broken).
    pub fn abort(mut self) {
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
