//! A client's own memory as the request path reads and writes it (Triton's shared-memory
//! extensions), and the seam through which the protocols open a client's CUDA memory without
//! knowing the backend that can.

use std::sync::Arc;

use crate::dtype::Dtype;

/// A client's memory as the request path uses it, by copies between it and this process.
pub trait ClientMemory: Send + Sync {
    /// `out.len()` bytes at `offset` into `out` (the caller keeps the span inside).
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String>;
    /// `data` to `offset`.
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String>;
    /// A GPU's memory: its address in this process (unified addressing), valid while `self`
    /// lives. None for host memory.
    fn device_address(&self) -> Option<u64> {
        None
    }
    /// Device memory: the first element of the `len` bytes at `offset`, read as `d`, that is
    /// not finite (checked where the bytes are, before admission). Host memory is checked as
    /// it is read into the ring.
    fn first_non_finite(
        &self,
        _offset: u64,
        _len: usize,
        _d: Dtype,
    ) -> Result<Option<usize>, String> {
        Err("host memory is checked as it is read".into())
    }
}

/// `len` bytes at `offset` of a client's memory; holding it keeps the memory open.
#[derive(Clone)]
pub struct ClientSpan {
    pub mem: Arc<dyn ClientMemory>,
    pub offset: u64,
    pub len: usize,
}

impl std::fmt::Debug for ClientSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClientSpan({} bytes at {})", self.len, self.offset)
    }
}

impl ClientSpan {
    /// Its bytes `[start, start + len)`, which must lie inside it.
    pub fn part(&self, start: usize, len: usize) -> Self {
        assert!(start + len <= self.len, "client span part out of bounds");
        Self {
            mem: self.mem.clone(),
            offset: self.offset + start as u64,
            len,
        }
    }

    /// The part's device address in this process, if it is a GPU's memory.
    pub fn device_address(&self) -> Option<u64> {
        self.mem.device_address().map(|a| a + self.offset)
    }

    pub fn read(&self, out: &mut [u8]) -> Result<(), String> {
        assert!(out.len() <= self.len, "client span read out of bounds");
        self.mem.read(self.offset, out)
    }

    pub fn write(&self, data: &[u8]) -> Result<(), String> {
        assert!(data.len() <= self.len, "client span write out of bounds");
        self.mem.write(self.offset, data)
    }
}

/// Opens a client's CUDA memory from its IPC handle. The GPU backend implements it; the serving
/// process hands one to the protocols at startup, or the reason there is none.
pub trait OpenDevice: Send + Sync {
    /// `size` bytes of the allocation behind `handle` on device `device`, both checked.
    fn open(&self, handle: &[u8], device: i64, size: u64) -> Result<Arc<dyn ClientMemory>, String>;
}
