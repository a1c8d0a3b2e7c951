//! Buffers of megabytes kept for reuse: answers (the step's delivery writes them) and requests
//! (the gRPC front reads them off the wire, `api::unary`). A fresh buffer of megabytes costs a
//! page fault for every 4 KiB written into it, because the allocator hands large freed blocks
//! back to the kernel: on 1x H200 the leader took 1,400-2,100 minor faults per answer of 8 MB and
//! 2-5 ms to deliver a 16 MB step. A reused buffer is already mapped.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// Below this a buffer comes from the allocator, which reuses small blocks itself (no faults
/// were measured for 512 KiB answers).
const MIN_BYTES: usize = 1 << 20;

pub struct Bufs {
    free: Mutex<Vec<Vec<u8>>>,
    /// Most bytes kept while unused.
    cap: usize,
    /// The counter of buffers taken from `free`.
    reused: &'static str,
}

impl Bufs {
    /// Keeps up to `cap` bytes of unused buffers; counts reuses under `reused`.
    pub fn new(cap: usize, reused: &'static str) -> Arc<Self> {
        Arc::new(Self {
            free: Mutex::new(Vec::new()),
            cap,
            reused,
        })
    }

    fn free(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of `len` bytes. A reused one still holds earlier bytes: the caller writes every
    /// byte before it lets the buffer go.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= MIN_BYTES {
            let mut free = self.free();
            let fit = (0..free.len())
                .filter(|&i| free[i].capacity() >= len)
                .min_by_key(|&i| free[i].capacity());
            if let Some(i) = fit {
                let mut buf = free.swap_remove(i);
                drop(free);
                buf.resize(len, 0);
                metrics::counter!(self.reused).increment(1);
                return buf;
            }
        }
        vec![0; len]
    }

    /// The filled buffer as `Bytes`; it comes back here once its last handle is dropped.
    pub fn freeze(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        if buf.capacity() < MIN_BYTES {
            return Bytes::from(buf);
        }
        Bytes::from_owner(Kept(buf, self.clone()))
    }

    fn keep(&self, buf: Vec<u8>) {
        let mut free = self.free();
        let held: usize = free.iter().map(Vec::capacity).sum();
        if held + buf.capacity() <= self.cap {
            free.push(buf);
        }
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.free().iter().map(Vec::capacity).sum()
    }
}

/// A buffer's bytes, given back to the pool when dropped.
struct Kept(Vec<u8>, Arc<Bufs>);

impl AsRef<[u8]> for Kept {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.1.keep(std::mem::take(&mut self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metric_names;

    #[test]
    fn a_dropped_answer_is_reused_for_the_next_that_fits() {
        let pool = Bufs::new(8 * MIN_BYTES, metric_names::OUTPUT_BUFFERS_REUSED_TOTAL);
        let mut buf = pool.take(2 * MIN_BYTES);
        buf.fill(7);
        let ptr = buf.as_ptr();
        let answer = pool.freeze(buf);
        assert_eq!(answer.len(), 2 * MIN_BYTES);
        assert!(answer.iter().all(|&b| b == 7));
        assert_eq!(pool.held(), 0);
        let copy = answer.clone();
        drop(answer);
        assert_eq!(pool.held(), 0, "kept only once every handle is gone");
        drop(copy);
        assert_eq!(pool.held(), 2 * MIN_BYTES);
        // Too large for it: a new buffer; small enough: the same memory, at the new length.
        let larger = pool.take(3 * MIN_BYTES);
        assert_ne!(larger.as_ptr(), ptr);
        let again = pool.take(MIN_BYTES + 5);
        assert_eq!((again.as_ptr(), again.len()), (ptr, MIN_BYTES + 5));
        assert_eq!(pool.held(), 0);
    }

    #[test]
    fn the_smallest_fitting_buffer_is_taken() {
        let pool = Bufs::new(16 * MIN_BYTES, metric_names::OUTPUT_BUFFERS_REUSED_TOTAL);
        let big = pool.take(4 * MIN_BYTES);
        let small = pool.take(2 * MIN_BYTES);
        let small_ptr = small.as_ptr();
        drop((pool.freeze(big), pool.freeze(small)));
        let again = pool.take(MIN_BYTES);
        assert_eq!(again.as_ptr(), small_ptr);
    }

    #[test]
    fn what_it_keeps_is_bounded_and_small_answers_are_not_kept() {
        let pool = Bufs::new(3 * MIN_BYTES, metric_names::OUTPUT_BUFFERS_REUSED_TOTAL);
        let bufs: Vec<_> = (0..3).map(|_| pool.take(2 * MIN_BYTES)).collect();
        drop(bufs.into_iter().map(|b| pool.freeze(b)).collect::<Vec<_>>());
        assert_eq!(pool.held(), 2 * MIN_BYTES, "one fits under the cap");
        drop(pool.freeze(pool.take(MIN_BYTES - 1)));
        assert_eq!(pool.held(), 2 * MIN_BYTES);
    }
}
