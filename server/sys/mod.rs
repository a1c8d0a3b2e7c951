//! The host's raw calls, each behind a safe function or type: shared memory mapped by every rank
//! of a host (`shm`), read-only file maps (a checkpoint's tensors), ending the process without
//! teardown, and a launched rank's tie to its launcher. With the GPU floor's `backend::cuda::sys`, its kernel launchers and the FFI crate
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

/// Set in each rank's environment by `launch`: the launcher's pid, which the rank ties its life
/// to.
pub const LAUNCHER_PID: &str = "EPSERVE_LAUNCHER_PID";

/// The line rank 0 started by `launch` prints on stdout once the group serves: from then on the
/// launcher leaves another rank's exit to the leader (`--on-rank-loss`).
pub const READY_LINE: &str = "epserve-group-ready";

/// In a rank `launch` started: SIGTERM (a drain) when the launcher dies, however it dies; at once
/// if it is gone already. Killing the launcher with SIGKILL left its ranks serving on their
/// ports (#58).
pub fn tie_to_launcher() -> anyhow::Result<()> {
    use anyhow::Context;
    use nix::sys::signal::{kill, Signal};
    let Ok(pid) = std::env::var(LAUNCHER_PID) else {
        return Ok(());
    };
    nix::sys::prctl::set_pdeathsig(Signal::SIGTERM).context("tying the rank to its launcher")?;
    // Set after the fork: a launcher gone in between left this rank to init.
    if nix::unistd::getppid().as_raw().to_string() != pid {
        let _ = kill(nix::unistd::getpid(), Signal::SIGTERM);
    }
    Ok(())
}
