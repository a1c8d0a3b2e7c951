//! What the GPU tests share: the first GPU, NCCL, and a group of ranks, one thread per GPU.

use std::sync::Arc;

use epserve::backend::cuda::Gpu;
use nccl_sys::{ncclUniqueId, Nccl};

use epserve::backend::cuda::sys::nccl::Comm;

/// GPU 0 (these tests run with --ignored on a GPU machine).
pub fn gpu() -> Gpu {
    Gpu::new(0).expect("a CUDA device (these tests run with --ignored on a GPU machine)")
}

/// The NCCL this machine loads, said once.
pub fn nccl() -> Arc<Nccl> {
    let nccl = Nccl::load().unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "NCCL {} from {}",
        nccl_sys::version_string(nccl.version),
        nccl.path.display()
    );
    Arc::new(nccl)
}

/// Runs `rank(id, r)` for every rank r of `world` at once, a thread each, over one fresh NCCL
/// unique id; their results in rank order. A rank that panics fails the test.
pub fn on_ranks<T: Send + 'static>(
    nccl: &Nccl,
    world: usize,
    rank: impl Fn(ncclUniqueId, usize) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let id = Comm::unique_id(nccl).unwrap();
    let rank = Arc::new(rank);
    let threads: Vec<_> = (0..world)
        .map(|r| {
            let rank = rank.clone();
            std::thread::spawn(move || rank(id, r))
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("a rank failed"))
        .collect()
}
