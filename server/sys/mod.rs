//! The host's raw calls, each behind a safe function or type: shared memory mapped by every rank
//! of a host (`shm`), read-only file maps (a checkpoint's tensors), and ending the process without
//! teardown. With the GPU floor's `backend::cuda::sys`, its kernel launchers and the FFI crate
//! (`nccl-sys`), the only places with `unsafe`.

pub mod shm;

/// `file` mapped read-only. The file must not be truncated while mapped: a checkpoint truncated
/// underneath a loading rank is the operator's error, and faults rather than corrupts.
pub fn map_file(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: read-only input that nothing writes while it is mapped (a checkpoint being
    // loaded, the operator's to keep still); the map is owned by the returned value, which
    // outlives every slice read from it.
    unsafe { memmap2::Mmap::map(file) }
}

/// Ends the process at once with `code`: no destructors, no exit handlers.
pub fn exit_immediately(code: i32) -> ! {
    // SAFETY: _exit has no preconditions; it ends the process without touching Rust state.
    unsafe { libc::_exit(code) }
}
