//! Losing a GPU rank under load (#55): `--backend nccl` and `nccl-ep` (where NCCL EP loads) on
//! 2 GPUs (4 where there are), a
//! DeepSeek-V3-shaped FP8 checkpoint written by the test, 32 clients of steady load checking
//! every token against the f64 reference. kill -9 of rank 1 (and SIGSTOP, FP8): no request
//! fails, the answers' longest delay after the loss within 3 s (after a stop, --step-timeout +
//! 3 s; `nccl-ep` runs every bucket low-latency, whose kernels mask a lost peer after
//! --step-timeout, 2 s), the ranks left form a new communicator, capture their graphs again and serve every
//! expert (on 2 GPUs, rank 0 holds them all); killed rank 1 restarted rejoins. FP8 and bf16
//! experts. Needs GPUs and NCCL;
//! ignored by default. On a GPU machine with a carried binary:
//! `EPSERVE_BIN=.device/bin/epserve .device/bin/gpu_rank_loss --ignored --test-threads 1`.
#![cfg(feature = "cuda")]

mod common;

use std::time::Duration;

use common::loss::{lose_and_rejoin, lose_under_load, Drill, HIDDEN, HIDDEN_LL};
use epserve::backend::cuda::device_count;

/// Each token's bound against f64: the GPU tests' bounds for FP8 experts at intermediate 128
/// (`gpu_serve.rs`), and for bf16 experts.
const FP8_TOL: f64 = 6e-2;
const BF16_TOL: f64 = 3e-2;

/// The backends to drill: `nccl`, and `nccl-ep` where NCCL EP loads (NCCL >= 2.30.4 and
/// libnccl_ep, as `scripts/device-run.sh ep` sets them up); else it is skipped, saying why.
/// `nccl-ep` is drilled with bf16 experts only: FP8 experts on its LL kernels stall at this
/// checkpoint's first step (an open bug, with or without the mask; the DeepSeek-V3 layer's
/// FP8 experts lose a rank on it fine: docs/benchmarks.md "Losing a rank").
fn backends() -> Vec<&'static str> {
    let ep = match (nccl_sys::Nccl::load(), nccl_sys::ep::NcclEp::load()) {
        (Ok(n), Ok(_)) if n.version >= epserve::backend::cuda::exchange::ep::MIN_NCCL => Ok(()),
        (Ok(n), Ok(_)) => Err(format!(
            "NCCL {} < 2.30.4",
            nccl_sys::version_string(n.version)
        )),
        (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
    };
    match ep {
        Ok(()) => vec!["nccl", "nccl-ep"],
        Err(why) => {
            eprintln!("nccl-ep skipped: {why} (scripts/device-run.sh ep)");
            vec!["nccl"]
        }
    }
}

/// The group's flags on `world` GPUs with `dtype` experts on `backend`.
fn flags<'a>(world: usize, backend: &'a str, dtype: &'a str) -> Vec<&'a str> {
    // 16 experts: on 2 GPUs every rank holds all of them (16 slots each); on 4, each rank its
    // block and more (the nccl slot exchange: the next block's first two; nccl-ep the next
    // block whole, a power of two of slots a rank as its HT kernels number them anyway).
    let redundant = match (world, backend) {
        (2, _) => "16",
        (_, "nccl-ep") => "16",
        _ => "8",
    };
    let mut f = vec![
        "--backend",
        backend,
        "--expert-dtype",
        dtype,
        "--redundant-experts",
        redundant,
        // NCCL EP's LL kernels give up on a lost peer after it: a kill mid-step costs it
        // (on 4 GPUs 1.9 s of a 2 s timeout, then 0.9 s regrouping: over the 3 s bound).
        "--step-timeout",
        if backend == "nccl-ep" { "1s" } else { "2s" },
        "--heartbeat-interval",
        "200ms",
        "--max-tokens-per-step",
        "128",
        // The test says when a rank comes back (`launch` would start a lost rank again itself).
        "--rank-restarts",
        "0",
    ];
    if backend == "nccl-ep" {
        // LL for every bucket: its kernels give up on a lost peer (a mask), HT's cannot.
        f.extend(["--ep-mode", "ll"]);
    }
    f
}

/// The checkpoint's hidden size on `backend`: NCCL EP's LL kernels need a multiple of 512.
fn hidden(backend: &str) -> usize {
    match backend {
        "nccl-ep" => HIDDEN_LL,
        _ => HIDDEN,
    }
}

/// Rank 1 of 2 (or 4) GPUs lost by `sig` with `dtype` experts, on each of `backends`.
async fn drill(dtype: &str, sig: &str, tol: f64, backends: &[&str]) {
    let world = device_count().min(4);
    if world < 2 {
        eprintln!("skipped: losing a rank needs 2 GPUs or more (found {world})");
        return;
    }
    for backend in backends {
        drill_on(world, backend, dtype, sig, tol).await;
    }
}

async fn drill_on(world: usize, backend: &str, dtype: &str, sig: &str, tol: f64) {
    let tag = format!("gpu-loss-{backend}-{dtype}-{sig}");
    let flags = flags(world, backend, dtype);
    let bound = match sig {
        "STOP" => Duration::from_secs(6),
        _ => Duration::from_secs(3),
    };
    let d = Drill {
        tag: &tag,
        world,
        flags: &flags,
        ranks: &[1],
        sig,
        bound,
        tol,
        fp8: dtype == "fp8",
        hidden: hidden(backend),
    };
    let phases = lose_under_load(&d).await;
    eprintln!("{world} GPUs, {backend}, {dtype}, SIG{sig}: {phases}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs 2+ GPUs and NCCL"]
async fn a_killed_gpu_rank_is_left_behind_and_no_request_fails() {
    drill("fp8", "KILL", FP8_TOL, &["nccl"]).await;
    drill("bf16", "KILL", BF16_TOL, &backends()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs 2+ GPUs and NCCL"]
async fn a_stopped_gpu_rank_is_fenced_and_no_request_fails() {
    drill("fp8", "STOP", FP8_TOL, &["nccl"]).await;
}

/// Rank 1 killed under load and started again with its command line: every rank joins a
/// communicator with it and captures its graphs again (it its first), the group is whole again
/// and no request fails. `nccl` with FP8 and bf16 experts, `nccl-ep` (where it loads) with bf16,
/// on 2 GPUs (4 where there are).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs 2+ GPUs and NCCL"]
async fn a_killed_gpu_rank_restarted_rejoins_and_no_request_fails() {
    let world = device_count().min(4);
    if world < 2 {
        eprintln!("skipped: a rank rejoining needs 2 GPUs or more (found {world})");
        return;
    }
    for backend in backends() {
        let dtypes: &[(&str, f64)] = match backend {
            "nccl-ep" => &[("bf16", BF16_TOL)],
            _ => &[("fp8", FP8_TOL), ("bf16", BF16_TOL)],
        };
        for &(dtype, tol) in dtypes {
            let flags = flags(world, backend, dtype);
            let tag = format!("gpu-rejoin-{backend}-{dtype}");
            let check = (tol, dtype == "fp8", hidden(backend));
            let line = lose_and_rejoin(&tag, (world, 1), &flags, check).await;
            eprintln!("{world} GPUs, {backend}, {dtype}, rank 1 back: {line}");
        }
    }
}
