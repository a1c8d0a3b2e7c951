//! Host shared memory: a file under `--shm-dir` (tmpfs) mapped by every rank of one host. The CPU
//! image of symmetric memory: peers write into each other's segments one-sidedly and publish with
//! per-step sequence flags.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::lifecycle::Abort;

/// Plain numbers that may be copied bytewise in and out of shared memory.
pub trait Pod: Copy + 'static {}
impl Pod for f32 {}
impl Pod for i32 {}
impl Pod for u32 {}
impl Pod for u8 {}

/// `src`'s bytes, to send.
pub fn bytes_of<T: Pod>(src: &[T]) -> &[u8] {
    // SAFETY: `T: Pod` is plain data without padding (f32, i32, u32, u8); the view borrows `src`
    // and covers exactly its bytes.
    unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src)) }
}

pub struct Shm {
    map: memmap2::MmapRaw,
    path: PathBuf,
    owner: bool,
    unlinked: AtomicBool,
}

impl Shm {
    /// Creates a new zero-filled segment, readable and writable by this user only; fails if the
    /// file exists.
    pub fn create(path: &Path, len: usize) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
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

    /// Lends `f` the `len` bytes at `off` to fill in place (a read straight into the mapping).
    pub fn fill<R>(&self, off: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        self.check(off, len, 1);
        // SAFETY: the range is inside the mapping (checked above), which outlives the borrow;
        // as in `write`, the step protocol keeps everyone else off these bytes meanwhile.
        f(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), len) })
    }

    /// Lends `f` the `len` bytes at `off` to read in place (a write straight from the mapping).
    pub fn view<R>(&self, off: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        self.check(off, len, 1);
        // SAFETY: as in `fill`; nobody writes these bytes while they are lent.
        f(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) })
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

/// This user's directory under `shm_dir` (what `private_dir` makes and checks).
pub fn private_path(shm_dir: &Path) -> PathBuf {
    shm_dir.join(format!("epserve-{}", nix::unistd::getuid().as_raw()))
}

/// This user's directory for segments under `shm_dir`: created 0700, and refused if it exists
/// with another owner or wider permissions (another user could then read or plant segments).
pub fn private_dir(shm_dir: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let uid = nix::unistd::getuid().as_raw();
    let dir = private_path(shm_dir);
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(std::io::Error::other(format!(
            "{} must be a directory of user {uid} with mode 0700 (it is {:o}, owner {})",
            dir.display(),
            meta.permissions().mode() & 0o7777,
            meta.uid()
        )));
    }
    Ok(dir)
}

/// Removes the segments of groups whose leader is gone (a rank killed between creating and
/// unlinking its files leaves them behind). A segment's name starts `epserve-<leader pid in
/// hex>-<nanos>-<leader's host tag>-`; a live process of that pid keeps its files, and a group
/// routed from another host (`host` is this one's tag) is never judged by a pid of this one.
/// Returns how many were removed.
pub fn sweep_stale(dir: &Path, host: &str) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let mut parts = name
            .to_str()
            .and_then(|n| n.strip_prefix("epserve-"))
            .unwrap_or_default()
            .split('-');
        let (Some(pid), Some(_nanos), Some(tag)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let Ok(pid) = u32::from_str_radix(pid, 16) else {
            continue;
        };
        if tag != host {
            continue;
        }
        if !Path::new(&format!("/proc/{pid}")).exists() && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("aborted: {0}")]
    Aborted(String),
}

/// Sets `flag` to `seq` and wakes every thread waiting for it in `wait_seq`, in any process that
/// maps it.
pub fn raise(flag: &AtomicU64, seq: u64) {
    flag.store(seq, Ordering::Release);
    futex::wake(flag);
}

/// Waits until `flag >= seq` (set by `raise`): spins briefly, then sleeps on the flag itself until
/// the writer's wake, so an idle rank leaves its core to ranks that compute and still wakes within
/// microseconds, not a timer's nap. Wakes at least every millisecond to see an abort.
pub fn wait_seq(
    flag: &AtomicU64,
    seq: u64,
    deadline: Instant,
    abort: &Abort,
) -> Result<(), WaitError> {
    let start = Instant::now();
    for _ in 0..SPINS {
        if flag.load(Ordering::Acquire) >= seq {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    loop {
        let seen = flag.load(Ordering::Acquire);
        if seen >= seq {
            return Ok(());
        }
        if let Some(r) = abort.stop_reason() {
            return Err(WaitError::Aborted(r));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(WaitError::Timeout(now - start));
        }
        futex::wait(flag, seen, (deadline - now).min(Duration::from_millis(1)));
    }
}

/// Polls before sleeping: a peer a few hundred nanoseconds behind costs no system call.
const SPINS: u32 = 256;

/// Linux futexes on a flag's low 32 bits, shared between processes (no FUTEX_PRIVATE_FLAG): the
/// flags live in mappings of the same file.
mod futex {
    use std::sync::atomic::AtomicU64;
    use std::time::Duration;

    // The low half of a little-endian u64 is its first word, which the futex watches.
    const _: () = assert!(cfg!(target_endian = "little"));

    fn word(flag: &AtomicU64) -> *const u32 {
        flag.as_ptr().cast::<u32>().cast_const()
    }

    pub fn wake(flag: &AtomicU64) {
        // SAFETY: the word is 4-aligned memory inside a live mapping (`Shm::flag` checks it);
        // FUTEX_WAKE only reads the address. A failure only means nobody is woken, and waiters
        // wake on their own timeout.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word(flag),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0,
            );
        }
    }

    /// Sleeps while the flag's low word still equals `seen`'s, for at most `limit`.
    pub fn wait(flag: &AtomicU64, seen: u64, limit: Duration) {
        let ts = libc::timespec {
            tv_sec: limit.as_secs() as libc::time_t,
            tv_nsec: limit.subsec_nanos() as libc::c_long,
        };
        // SAFETY: as in `wake`; `ts` outlives the call. EAGAIN (the value changed), EINTR and
        // ETIMEDOUT all return to the caller's loop, which reads the flag again.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word(flag),
                libc::FUTEX_WAIT,
                seen as u32,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0,
            );
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
            wait_seq(b.flag(0), 10, late, &abort),
            Err(WaitError::Timeout(_))
        ));
        // A waiter asleep on the flag (past its spins) returns once a peer raises it.
        let waiter = std::thread::scope(|sc| {
            let w = sc.spawn(|| {
                wait_seq(
                    b.flag(0),
                    9,
                    Instant::now() + Duration::from_secs(60),
                    &abort,
                )
            });
            std::thread::sleep(Duration::from_millis(20));
            raise(a.flag(0), 9);
            w.join().unwrap()
        });
        assert!(waiter.is_ok(), "{waiter:?}");
        abort.trigger("peer gone");
        assert!(matches!(
            wait_seq(b.flag(0), 10, late + Duration::from_secs(60), &abort),
            Err(WaitError::Aborted(r)) if r == "peer gone"
        ));
        a.unlink();
        assert!(!path.exists());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.read(4090, &mut out)));
        assert!(r.is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn segments_are_private_and_stale_ones_are_swept() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("epserve-shm-priv-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let dir = private_dir(&base).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(private_dir(&base).unwrap(), dir);
        let live = dir.join(format!("epserve-{:x}-1-abcd0123-rank0", std::process::id()));
        let seg = Shm::create(&live, 64).unwrap();
        assert_eq!(mode(&live), 0o600);
        // A pid that cannot exist (above the kernel's limit): its group is gone.
        let dead = dir.join("epserve-7fffffff-2-abcd0123-ring");
        std::fs::write(&dead, b"x").unwrap();
        // The same pid on another host (a node of a group routed elsewhere): not judged here.
        let away = dir.join("epserve-7fffffff-3-ffff0000-ring");
        std::fs::write(&away, b"x").unwrap();
        let other = dir.join("not-ours");
        std::fs::write(&other, b"x").unwrap();
        assert_eq!(sweep_stale(&dir, "abcd0123"), 1);
        assert!(live.exists() && other.exists() && away.exists() && !dead.exists());
        drop(seg);
        assert!(!live.exists());
        // Opened up to others: refused, not used.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = private_dir(&base).unwrap_err().to_string();
        assert!(e.contains("mode 0700"), "{e}");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
