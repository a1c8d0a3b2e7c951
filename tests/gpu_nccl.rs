//! NCCL through nccl-sys and the safe `Comm`, one thread per GPU: an all-gather and a grouped
//! ring send/recv, run eagerly and then captured in a CUDA graph and replayed; a communicator
//! without a lost rank keeps the group's numbering. Needs 2+ GPUs and NCCL, so it is ignored by
//! default (run with `--ignored` on a multi-GPU machine).
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use epserve::backend::cuda::sys::nccl::{Comm, NcclError};
use epserve::backend::cuda::{device_count, Gpu};
use half::bf16;
use nccl_sys::{ncclUniqueId, Nccl};

const E: usize = 16;
const ROWS: usize = 37;
const H: usize = 256;

struct Bufs {
    counts: CudaSlice<i32>,
    all: CudaSlice<i32>,
    tx: CudaSlice<bf16>,
    rx: CudaSlice<bf16>,
}

/// One step of what the `nccl` backend does: all-gather counts, exchange rows with peers.
fn exchange(comm: &Comm, b: &mut Bufs, s: &CudaStream) -> Result<(), NcclError> {
    comm.all_gather(&b.counts, &mut b.all, E, s)?;
    let (next, prev) = (
        (comm.rank + 1) % comm.world,
        (comm.rank + comm.world - 1) % comm.world,
    );
    comm.group(|| {
        comm.send(&b.tx, 0, ROWS * H, next, s)?;
        comm.recv(&mut b.rx, 0, ROWS * H, prev, s)
    })
}

fn value(rank: usize, i: usize) -> f32 {
    (rank * 7 + i % 13) as f32 // small integers: exact in bf16
}

fn check(b: &Bufs, s: &Arc<CudaStream>, rank: usize, world: usize, what: &str) {
    let all = s.clone_dtoh(&b.all).unwrap();
    for r in 0..world {
        for i in 0..E {
            assert_eq!(
                all[r * E + i],
                (r * 100 + i) as i32,
                "{what}: rank {rank} all_gather[{r}][{i}]"
            );
        }
    }
    let prev = (rank + world - 1) % world;
    let rx = s.clone_dtoh(&b.rx).unwrap();
    for (i, v) in rx.iter().enumerate() {
        assert_eq!(
            v.to_f32(),
            value(prev, i),
            "{what}: rank {rank} received element {i}"
        );
    }
}

fn rank_main(nccl: Arc<Nccl>, id: ncclUniqueId, world: usize, rank: usize) {
    let g = Gpu::new(rank).unwrap();
    g.ctx.bind_to_thread().unwrap();
    let comm = Comm::init(nccl, &id, (world, rank), &[]).unwrap();
    let s = &g.stream;
    let counts: Vec<i32> = (0..E).map(|i| (rank * 100 + i) as i32).collect();
    let tx: Vec<bf16> = (0..ROWS * H)
        .map(|i| bf16::from_f32(value(rank, i)))
        .collect();
    let mut b = Bufs {
        counts: s.clone_htod(&counts).unwrap(),
        all: s.alloc_zeros(world * E).unwrap(),
        tx: s.clone_htod(&tx).unwrap(),
        rx: s.alloc_zeros(ROWS * H).unwrap(),
    };
    exchange(&comm, &mut b, s).unwrap();
    s.synchronize().unwrap();
    check(&b, s, rank, world, "eager");

    s.memset_zeros(&mut b.all).unwrap();
    s.memset_zeros(&mut b.rx).unwrap();
    s.synchronize().unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    exchange(&comm, &mut b, s).unwrap();
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a captured graph");
    for replay in 0..3 {
        graph.launch().unwrap();
        s.synchronize().unwrap();
        check(&b, s, rank, world, &format!("graph replay {replay}"));
        s.memset_zeros(&mut b.rx).unwrap();
    }
    drop(graph);
}

/// Runs `rank(nccl, id, world, rank)` on every GPU at once, a thread each (skipped, saying
/// why, with fewer than 2).
fn on_gpus(rank: fn(Arc<Nccl>, ncclUniqueId, usize, usize)) {
    let world = device_count();
    if world < 2 {
        eprintln!("skipped: needs at least 2 GPUs, found {world}");
        return;
    }
    let nccl = common::gpu::nccl();
    let n = nccl.clone();
    common::gpu::on_ranks(&nccl, world, move |id, r| rank(n.clone(), id, world, r));
}

#[test]
#[ignore = "needs 2+ GPUs and NCCL"]
fn all_gather_and_ring_exchange_eagerly_and_in_a_graph() {
    on_gpus(rank_main);
}

/// A communicator of the ranks left after rank 1 is lost (#55): the all-gather fills each
/// member's place and leaves rank 1's as it was; the slot exchange moves slot p to rank p for
/// every member, and rank 1's slots are neither sent nor written.
fn without_rank_1(nccl: Arc<Nccl>, id: ncclUniqueId, world: usize, rank: usize) {
    let g = Gpu::new(rank).unwrap();
    g.ctx.bind_to_thread().unwrap();
    let comm = Comm::init(nccl, &id, (world, rank), &[1]).unwrap();
    assert!(!comm.whole());
    assert_eq!(comm.members().len(), world - 1);
    let s = &g.stream;
    let counts: Vec<i32> = (0..E).map(|i| (rank * 100 + i) as i32).collect();
    let counts = s.clone_htod(&counts).unwrap();
    let mut all = s.clone_htod(&vec![-7i32; world * E]).unwrap();
    comm.all_gather(&counts, &mut all, E, s).unwrap();
    // Slot p of `send` holds value(rank, p + i); rank p receives it in slot `rank`.
    let slot = 64;
    let tx: Vec<bf16> = (0..world * slot)
        .map(|i| bf16::from_f32(value(rank, i)))
        .collect();
    let tx = s.clone_htod(&tx).unwrap();
    let mut rx = s
        .clone_htod(&vec![bf16::from_f32(-1.0); world * slot])
        .unwrap();
    comm.exchange_slots(&tx, &mut rx, slot, s).unwrap();
    s.synchronize().unwrap();
    let all = s.clone_dtoh(&all).unwrap();
    let rx = s.clone_dtoh(&rx).unwrap();
    for r in 0..world {
        for i in 0..E {
            let want = if r == 1 { -7 } else { (r * 100 + i) as i32 };
            assert_eq!(all[r * E + i], want, "rank {rank}: all_gather[{r}][{i}]");
        }
        for i in 0..slot {
            let want = match r {
                1 => -1.0,
                _ => value(r, rank * slot + i),
            };
            assert_eq!(
                rx[r * slot + i].to_f32(),
                want,
                "rank {rank}: slot {r} row {i}"
            );
        }
    }
}

#[test]
#[ignore = "needs 2+ GPUs and NCCL"]
fn a_communicator_without_a_lost_rank_keeps_the_group_numbering() {
    on_gpus(|nccl, id, world, rank| {
        if rank != 1 {
            without_rank_1(nccl, id, world, rank)
        }
    });
}
