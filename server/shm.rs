//! Host shared memory: a file under `--shm-dir` (tmpfs) mapped by every rank of one host. The CPU
//! image of symmetric memory: peers write into each other's segments one-sidedly and publish with
//! per-step sequence flags.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Plain numbers that may be copied bytewise in and out of shared memory.
pub trait Pod: Copy + 'static {}
impl Pod for f32 {}
impl Pod for i32 {}
impl Pod for u32 {}

pub struct Shm {
    map: memmap2::MmapRaw,
    path: PathBuf,
    owner: bool,
    unlinked: AtomicBool,
}

impl Shm {
    /// Creates a new zero-filled segment; fails if the file exists.
    pub fn create(path: &Path, len: usize) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        file.set_len(len as u64)?;
        Self::map(file, path, true)
    }

    /// Maps a peer's segment, checking its size.
    pub fn open(path: &Path, len: usize) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let actual = file.metadata()?.len();
        if actual != len as u64 {
            return Err(std::io::Error::other(format!(
                "{} is {actual} bytes, expected {len}",
                path.display()
            )));
        }
        Self::map(file, path, false)
    }

    fn map(file: std::fs::File, path: &Path, owner: bool) -> std::io::Result<Self> {
        let map = memmap2::MmapOptions::new().map_raw(&file)?;
        Ok(Self {
            map,
            path: path.to_path_buf(),
            owner,
            unlinked: AtomicBool::new(false),
        })
    }

    /// Removes the file once every peer has mapped it; the mapping stays valid, and nothing is
    /// left behind in the shm directory whatever way the process ends.
    pub fn unlink(&self) {
        if self.owner && !self.unlinked.swap(true, Ordering::AcqRel) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The mapping's address in this process (stable for the segment's life).
    pub fn addr(&self) -> usize {
        self.map.as_ptr() as usize
    }

    fn check(&self, off: usize, bytes: usize, align: usize) {
        assert!(
            off.checked_add(bytes).is_some_and(|e| e <= self.len()) && off % align == 0,
            "shm access [{off}, +{bytes}) outside {} bytes or misaligned",
            self.len()
        );
    }

    /// Copies `src` to byte offset `off`.
    pub fn write<T: Pod>(&self, off: usize, src: &[T]) {
        let bytes = std::mem::size_of_val(src);
        self.check(off, bytes, 1);
        // SAFETY: the range is inside the mapping (checked above); `src` is plain data. Concurrent
        // access to the same bytes is excluded by the step protocol (flags order writer, reader).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr().cast::<u8>(),
                self.map.as_mut_ptr().add(off),
                bytes,
            )
        };
    }

    /// Copies from byte offset `off` into `dst`.
    pub fn read<T: Pod>(&self, off: usize, dst: &mut [T]) {
        let bytes = std::mem::size_of_val(dst);
        self.check(off, bytes, 1);
        // SAFETY: as in `write`; every bit pattern is a valid `T: Pod`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(off),
                dst.as_mut_ptr().cast::<u8>(),
                bytes,
            )
        };
    }

    /// The 8-byte flag at byte offset `off`.
    pub fn flag(&self, off: usize) -> &AtomicU64 {
        self.check(off, 8, 8);
        // SAFETY: in bounds and 8-aligned (checked; the mapping is page-aligned); the memory lives
        // as long as `self` and is only ever accessed atomically at flag offsets.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(off).cast::<u64>()) }
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// Why a group-wide wait ended early: set once by whoever sees the group break first.
#[derive(Default)]
pub struct Abort {
    set: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Abort {
    pub fn trigger(&self, reason: impl Into<String>) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(reason.into());
        }
        self.set.store(true, Ordering::Release);
    }
    pub fn reason(&self) -> Option<String> {
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("aborted: {0}")]
    Aborted(String),
}

/// Waits until `flag >= seq`: spins briefly, then yields, then sleeps in short naps, so idle ranks
/// leave the cores to ranks that compute.
pub fn wait_seq(
    flag: &AtomicU64,
    seq: u64,
    deadline: Instant,
    abort: &Abort,
) -> Result<(), WaitError> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if flag.load(Ordering::Acquire) >= seq {
            return Ok(());
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
            continue;
        }
        if let Some(r) = abort.reason() {
            return Err(WaitError::Aborted(r));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(WaitError::Timeout(now - start));
        }
        if spins < 256 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_see_each_other_and_bounds_are_checked() {
        let dir = std::env::temp_dir().join(format!("epserve-shm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("seg");
        let a = Shm::create(&path, 4096).unwrap();
        let b = Shm::open(&path, 4096).unwrap();
        assert!(Shm::open(&path, 8192).is_err());
        a.write(64, &[1.5f32, -2.0]);
        a.flag(0).store(7, Ordering::Release);
        let mut out = [0f32; 2];
        b.read(64, &mut out);
        assert_eq!(out, [1.5, -2.0]);
        let abort = Abort::default();
        wait_seq(b.flag(0), 7, Instant::now(), &abort).unwrap();
        let late = Instant::now() + Duration::from_millis(5);
        assert!(matches!(
            wait_seq(b.flag(0), 8, late, &abort),
            Err(WaitError::Timeout(_))
        ));
        abort.trigger("peer gone");
        assert!(matches!(
            wait_seq(b.flag(0), 8, late + Duration::from_secs(60), &abort),
            Err(WaitError::Aborted(r)) if r == "peer gone"
        ));
        a.unlink();
        assert!(!path.exists());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.read(4090, &mut out)));
        assert!(r.is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
