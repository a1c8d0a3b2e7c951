//! The host's raw calls, each behind a safe function or type: shared memory mapped by every rank
//! of a host (`shm`), read-only file maps (a checkpoint's tensors), a background thread's
//! priority, a thread's context switches, ending the process without teardown, and a launched
//! rank's tie to its launcher.
//! With the GPU floor's `backend::cuda::sys`, its kernel launchers and the FFI crate
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

/// Lowers the calling thread's CPU priority by `by` nice steps (Linux keeps a nice value per
/// thread; 19 at most), so that background work yields its core to the serving threads at once.
/// Raising one's own nice value needs no privilege.
pub fn lower_thread_priority(by: i32) -> std::io::Result<()> {
    let nice = (thread_nice()? + by).min(19);
    let tid = nix::unistd::gettid().as_raw() as libc::id_t;
    // SAFETY: setpriority only reads its integer arguments; `tid` is this thread's own id.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Moves the calling thread into Linux's SCHED_IDLE class: it runs on the cores the serving
/// threads leave, a core running only such threads counts as free to a waking serving thread,
/// and that thread takes it at once. Entering it needs no privilege.
pub fn idle_thread() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler only reads `param`, a local that outlives the call; pid 0 is
    // the calling thread.
    let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether the calling thread is in the SCHED_IDLE class (`idle_thread`).
pub fn thread_is_idle() -> std::io::Result<bool> {
    // SAFETY: sched_getscheduler takes an integer and touches no memory; pid 0 is the calling
    // thread.
    let policy = unsafe { libc::sched_getscheduler(0) };
    if policy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(policy == libc::SCHED_IDLE)
}

/// The calling thread's nice value, from /proc (field 19 of its stat line).
pub fn thread_nice() -> std::io::Result<i32> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat")?;
    // The fields after the command name's closing parenthesis start at field 3.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    rest.split_whitespace()
        .nth(16)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no nice value in {stat:?}")))
}

/// The calling thread's context switches so far: (voluntary, involuntary). A voluntary one is a
/// wait (a lock, a sleep), an involuntary one the scheduler giving its core to another thread.
pub fn thread_switches() -> (u64, u64) {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_THREAD).map_or((0, 0), |u| {
        (
            u.voluntary_context_switches().max(0) as u64,
            u.involuntary_context_switches().max(0) as u64,
        )
    })
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_thread_that_sleeps_counts_a_voluntary_switch() {
        let (before, after) = std::thread::spawn(|| {
            let before = super::thread_switches();
            std::thread::sleep(std::time::Duration::from_millis(2));
            (before, super::thread_switches())
        })
        .join()
        .unwrap();
        assert!(after.0 > before.0, "{before:?} then {after:?}");
        assert!(after.1 >= before.1, "{before:?} then {after:?}");
    }

    #[test]
    fn a_thread_lowers_its_own_priority_only() {
        let main = super::thread_nice().unwrap();
        let (before, after) = std::thread::spawn(|| {
            let before = super::thread_nice().unwrap();
            super::lower_thread_priority(3).unwrap();
            (before, super::thread_nice().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(after, (before + 3).min(19));
        assert_eq!(
            super::thread_nice().unwrap(),
            main,
            "the caller's priority is unchanged"
        );
    }
}
