//! The `nccl` backend served end to end, the way users run it (`epserve launch --backend nccl`):
//! 1,000 random requests of random sizes (some with their own routing) give the CPU backend's
//! outputs for the same weights, on 1, 2, 4 (and 8) GPUs, graphs on and off; replaying one bucket's
//! graph 100 times gives bitwise-identical outputs; 1,000 steps allocate nothing on the device.
//! `nccl-ep` in each mode, zero-copy on and off, graphs on and off, gives the `nccl` backend's
//! outputs (needs NCCL >= 2.30.4 and libnccl_ep: scripts/device-run.sh ep).
//! Needs GPUs and NCCL; ignored by default. On a GPU machine with a carried binary:
//! `EPSERVE_BIN=.device/bin/epserve .device/bin/gpu_serve --ignored --test-threads 1`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::prom::{scrape, sum};
use common::{decode, f32_tensor, i32_tensor, request, Group};
use epserve::backend::cuda::device_count;
use epserve::proto::ForwardRequest;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const MODEL: &str = "synthetic:qwen3-30b-a3b";
const HIDDEN: usize = 2048;
const EXPERTS: usize = 128;
const TOP_K: usize = 8;
const REQUESTS: usize = 1000;

/// Seeded random requests: 1..=64 tokens, either layer, one in five with client routing.
fn requests(seed: u64, count: usize) -> Vec<ForwardRequest> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|i| {
            let n = r.random_range(1..=64usize);
            let x: Vec<f32> = (0..n * HIDDEN).map(|_| r.random_range(-1.0..1.0)).collect();
            let mut req = request(
                &format!("r{i}"),
                r.random_range(0..2u32),
                f32_tensor(&x, [n, HIDDEN]),
            );
            if r.random_range(0..5) == 0 {
                let mut ids = Vec::with_capacity(n * TOP_K);
                let mut w = Vec::with_capacity(n * TOP_K);
                for _ in 0..n {
                    let mut chosen = Vec::with_capacity(TOP_K);
                    while chosen.len() < TOP_K {
                        let e = r.random_range(0..EXPERTS as i32);
                        if !chosen.contains(&e) {
                            chosen.push(e);
                        }
                    }
                    ids.extend(chosen);
                    w.extend((0..TOP_K).map(|_| r.random_range(0.05f32..1.0)));
                }
                req.topk_ids = Some(i32_tensor(&ids, [n, TOP_K]));
                req.topk_weights = Some(f32_tensor(&w, [n, TOP_K]));
            }
            req
        })
        .collect()
}

/// Sends every request, `in_flight` at a time, and returns the outputs in request order.
fn run_all(g: &Group, reqs: &[ForwardRequest], in_flight: usize) -> Vec<Vec<f32>> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = g.client().await;
        let gate = Arc::new(tokio::sync::Semaphore::new(in_flight));
        let mut tasks = Vec::with_capacity(reqs.len());
        for req in reqs.iter().cloned() {
            let (mut c, gate) = (client.clone(), gate.clone());
            tasks.push(tokio::spawn(async move {
                let _permit = gate.acquire_owned().await.unwrap();
                let id = req.id.clone();
                let out = c
                    .forward(req)
                    .await
                    .unwrap_or_else(|s| panic!("request {id}: {s}"));
                decode(out.into_inner().output.as_ref().unwrap())
            }));
        }
        let mut outs = Vec::with_capacity(tasks.len());
        for t in tasks {
            outs.push(t.await.unwrap());
        }
        outs
    })
}

/// ||out - ref|| / ||ref|| over every request, and the worst single request's.
fn relative_error(out: &[Vec<f32>], reference: &[Vec<f32>]) -> (f64, f64) {
    let (mut diff, mut norm, mut worst) = (0f64, 0f64, 0f64);
    for (o, r) in out.iter().zip(reference) {
        assert_eq!(o.len(), r.len());
        let (mut d, mut n) = (0f64, 0f64);
        for (&a, &b) in o.iter().zip(r) {
            assert!(a.is_finite(), "non-finite output");
            d += (f64::from(a) - f64::from(b)).powi(2);
            n += f64::from(b).powi(2);
        }
        worst = worst.max((d / n).sqrt());
        diff += d;
        norm += n;
    }
    ((diff / norm).sqrt(), worst)
}

fn launch(ranks: usize, backend: &str, graphs: &str) -> Group {
    launch_with(ranks, backend, graphs, &[])
}

fn launch_with(ranks: usize, backend: &str, graphs: &str, extra: &[&str]) -> Group {
    let mut args = vec![
        "--layers",
        "2",
        "--backend",
        backend,
        "--cuda-graphs",
        graphs,
        "--step-timeout",
        "60s",
    ];
    args.extend_from_slice(extra);
    Group::launch(ranks, MODEL, &args)
}

fn gpu_counts() -> Vec<usize> {
    let n = device_count();
    assert!(n >= 1, "needs a GPU");
    [1, 2, 4, 8].into_iter().filter(|&r| r <= n).collect()
}

#[test]
#[ignore = "needs GPUs and NCCL"]
fn nccl_backend_matches_the_cpu_backend() {
    let reqs = requests(7, REQUESTS);
    let t0 = Instant::now();
    let reference = {
        let g = launch(4, "cpu", "off");
        run_all(&g, &reqs, 16)
    };
    eprintln!(
        "cpu backend, 4 ranks: {REQUESTS} requests ({} tokens) in {:.1}s",
        reqs.iter()
            .map(|r| r.hidden_states.as_ref().unwrap().shape[0])
            .sum::<i64>(),
        t0.elapsed().as_secs_f64()
    );
    for ranks in gpu_counts() {
        for graphs in ["on", "off"] {
            let t0 = Instant::now();
            let g = launch(ranks, "nccl", graphs);
            let up = t0.elapsed();
            let t1 = Instant::now();
            let out = run_all(&g, &reqs, 16);
            let (rel, worst) = relative_error(&out, &reference);
            eprintln!(
                "nccl, {ranks} GPU(s), graphs {graphs}: up in {:.1}s, {REQUESTS} requests in {:.2}s, ||out-ref||/||ref|| = {rel:.3e} (worst request {worst:.3e})",
                up.as_secs_f64(),
                t1.elapsed().as_secs_f64()
            );
            assert!(
                rel <= 1e-2,
                "{ranks} GPUs, graphs {graphs}: relative error {rel:.3e}"
            );
        }
    }
}

#[test]
#[ignore = "needs GPUs and NCCL"]
fn graph_replays_are_bitwise_identical_and_steps_allocate_nothing() {
    let ranks = *gpu_counts().last().unwrap();
    let g = launch(ranks, "nccl", "on");
    let metrics = g.metrics_addrs(ranks);
    let device_state = || -> Vec<(f64, f64)> {
        metrics
            .iter()
            .map(|a| {
                let s = scrape(a);
                (
                    sum(&s, "epserve_device_allocations_total", &[]),
                    sum(&s, "epserve_device_memory_used_bytes", &[]),
                )
            })
            .collect()
    };
    let work_steps = || -> f64 {
        sum(
            &scrape(&metrics[0]),
            "epserve_steps_total",
            &[("kind", "work")],
        )
    };
    // One at a time: each request is a step of its own, in the same bucket every time.
    let same = requests(11, 1).pop().unwrap();
    let replays = run_all(&g, &vec![same; 100], 1);
    for (i, r) in replays.iter().enumerate() {
        assert!(
            r.iter()
                .zip(&replays[0])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "replay {i} differs from the first"
        );
    }
    let before = device_state();
    let steps_before = work_steps();
    assert!(before
        .iter()
        .all(|&(allocs, used)| allocs > 0.0 && used > 0.0));
    let reqs = requests(12, REQUESTS);
    let t0 = Instant::now();
    let outs = run_all(&g, &reqs, 1);
    assert!(outs.iter().flatten().all(|v| v.is_finite()));
    std::thread::sleep(Duration::from_millis(200));
    let steps = work_steps() - steps_before;
    let after = device_state();
    eprintln!(
        "{ranks} GPUs: 100 replays bitwise equal; {steps} steps in {:.2}s; per rank (allocations, device bytes used) before {before:?}, after {after:?}",
        t0.elapsed().as_secs_f64()
    );
    assert!(steps >= REQUESTS as f64, "only {steps} steps ran");
    assert_eq!(before, after, "device allocations changed across the steps");
}

/// `nccl-ep` in `mode` (plus `extra` flags) with zero-copy on and off and graphs on and off, on
/// every GPU (and, for `also_two`, once on 2): 1,000 requests each against the `nccl` backend;
/// every step checked for overflow and for rows the routing did not send (`/metrics`).
/// Returns the steps each mode ran, over all runs.
fn ep_mode_matches_nccl(mode: &str, extra: &[&str], also_two: bool) -> (f64, f64) {
    let world = *gpu_counts().last().unwrap();
    if let Err(why) = epserve::backend::gpu::ep_gates(world) {
        panic!(
            "nccl-ep cannot run here ({why}): run with NCCL 2.30 and NCCL EP (device-run.sh ep)"
        );
    }
    let reqs = requests(21, REQUESTS);
    let reference = {
        let g = launch(world, "nccl", "on");
        run_all(&g, &reqs, 16)
    };
    let mut runs = vec![];
    for zc in ["on", "off"] {
        for graphs in ["on", "off"] {
            runs.push((world, zc, graphs));
        }
    }
    if also_two && world > 2 {
        runs.push((2, "on", "on"));
    }
    let (mut ll_steps, mut ht_steps) = (0.0, 0.0);
    for (ranks, zc, graphs) in runs {
        let t0 = Instant::now();
        let mut flags = vec!["--ep-mode", mode, "--zero-copy", zc];
        flags.extend_from_slice(extra);
        let g = launch_with(ranks, "nccl-ep", graphs, &flags);
        let up = t0.elapsed();
        let info = tokio::runtime::Runtime::new().unwrap().block_on(async {
            let mut c = g.client().await;
            c.get_model_info(epserve::proto::GetModelInfoRequest {})
                .await
                .unwrap()
                .into_inner()
        });
        let fp = info
            .nccl_ep
            .expect("GetModelInfo reports the NCCL EP footprint");
        // NCCL EP 0.2 has no zero-copy LL in the expert-major layout: LL stages.
        assert_eq!(fp.zero_copy, zc == "on" && mode != "ll", "{fp:?}");
        assert!(fp.handle_bytes > 0 && fp.expert_rows_bytes > 0, "{fp:?}");
        let out = run_all(&g, &reqs, 16);
        let (rel, worst) = relative_error(&out, &reference);
        let (mut ll, mut ht) = (0.0, 0.0);
        for a in g.metrics_addrs(ranks) {
            let m = scrape(&a);
            for name in [
                "epserve_ep_recv_overflow_total",
                "epserve_ep_recv_mismatch_total",
            ] {
                assert!(m.iter().any(|x| x.name == name), "{a}: no {name}");
                assert_eq!(sum(&m, name, &[]), 0.0, "{a}: {name}");
            }
            ll += sum(&m, "epserve_ep_steps_total", &[("mode", "ll")]);
            ht += sum(&m, "epserve_ep_steps_total", &[("mode", "ht")]);
        }
        eprintln!(
            "nccl-ep --ep-mode {mode} {extra:?}, zero-copy {zc}, graphs {graphs}, {ranks} GPUs: up in {:.1}s; footprint {} (groups {} MiB, handles {} KiB, expert rows {} MiB); steps LL {ll}, HT {ht} (all ranks); overflow 0, mismatch 0; against nccl on {world}: ||out-ref||/||ref|| = {rel:.3e} (worst request {worst:.3e})",
            up.as_secs_f64(),
            fp.modes,
            fp.group_bytes >> 20,
            fp.handle_bytes >> 10,
            fp.expert_rows_bytes >> 20,
        );
        assert!(
            rel <= 1e-2,
            "{mode}, zero-copy {zc}, graphs {graphs}, {ranks} GPUs: {rel:.3e}"
        );
        ll_steps += ll;
        ht_steps += ht;
    }
    (ll_steps, ht_steps)
}

/// Needs NCCL >= 2.30.4 and libnccl_ep (scripts/device-run.sh ep); the image's NCCL alone fails.
#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn nccl_ep_ht_matches_the_nccl_backend() {
    let (ll, ht) = ep_mode_matches_nccl("ht", &[], false);
    assert!(ll == 0.0 && ht > 0.0, "steps: LL {ll}, HT {ht}");
}

#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn nccl_ep_ll_matches_the_nccl_backend() {
    let (ll, ht) = ep_mode_matches_nccl("ll", &[], false);
    assert!(ll > 0.0 && ht == 0.0, "steps: LL {ll}, HT {ht}");
}

/// Auto with LL up to 32 tokens per rank: small steps run LL, batched ones HT.
#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn nccl_ep_auto_matches_the_nccl_backend() {
    let (ll, ht) = ep_mode_matches_nccl("auto", &["--ep-ll-max-tokens", "32"], true);
    assert!(ll > 0.0 && ht > 0.0, "steps: LL {ll}, HT {ht}");
}

/// The image's NCCL (< 2.30.4): `nccl-ep` refuses with its gate's reason; `auto` serves on `nccl`.
#[test]
#[ignore = "needs GPUs and an NCCL older than 2.30.4"]
fn nccl_ep_refuses_on_old_nccl_and_auto_serves_on_nccl() {
    let nccl = nccl_sys::Nccl::load().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        nccl.version < 23004,
        "NCCL {} is new enough for NCCL EP: run with the image's NCCL",
        nccl_sys::version_string(nccl.version)
    );
    let shm = common::TempDir::new("ep-gate");
    let args: Vec<String> = [
        "serve",
        "--backend",
        "nccl-ep",
        "--model",
        "synthetic:tiny",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--rendezvous",
        "127.0.0.1:0",
        "--shm-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([shm.0.display().to_string()])
    .collect();
    let mut p = common::Proc::spawn(&args);
    let status = p.wait_exit(Duration::from_secs(60)).expect("exits");
    assert!(!status.success());
    let log = p.log_text();
    assert!(
        log.contains("--backend nccl-ep cannot run here: NCCL EP needs NCCL >= 2.30.4"),
        "{log}"
    );
    let g = Group::launch(2, "synthetic:tiny", &["--backend", "auto"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let info = rt.block_on(async {
        let mut c = g.client().await;
        c.get_model_info(epserve::proto::GetModelInfoRequest {})
            .await
            .unwrap()
            .into_inner()
    });
    assert_eq!(info.backend, "nccl");
    assert!(g
        .proc
        .log_text()
        .contains("--backend auto: not nccl-ep (NCCL EP needs NCCL >= 2.30.4"));
}
