//! The host's raw calls, each behind a safe function or type: shared memory mapped by every rank
//! of a host (`shm`), read-only file maps (a checkpoint's tensors), and ending the process without
//! teardown. With the GPU floor's `backend::cuda::sys`, its kernel launchers and the FFI crate
//! (`nccl-sys`), the only places with `unsafe`.

pub mod shm;

/// `file` mapped read-only. The file must not be truncated while mapped: a checkpoint truncated
/// underneath a loading rank is the operator's error, and faults rather than corrupts.
pub fn map_file(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only and owned by the returned value; its bytes are read as plain
    // bytes (never as references to typed data that a concurrent write could invalidate).
    unsafe { memmap2::Mmap::map(file) }
}

/// Ends the process at once with `code`: no destructors, no exit handlers.
pub fn exit_immediately(code: i32) -> ! {
    // SAFETY: _exit has no preconditions; it ends the process without touching Rust state.
    unsafe { libc::_exit(code) }
}
