//! The `nccl` backend served end to end, the way users run it (`epserve launch --backend nccl`):
//! 1,000 random requests of random sizes (some with their own routing) give the CPU backend's
//! outputs for the same weights, on 1, 2, 4 (and 8) GPUs, graphs on and off; replaying one bucket's
//! graph 100 times gives bitwise-identical outputs; 1,000 steps allocate nothing on the device.
//! `nccl-ep` in each mode, zero-copy on and off, graphs on and off, gives the `nccl` backend's
//! outputs (needs NCCL >= 2.30.4 and libnccl_ep: scripts/device-run.sh ep).
//! Outputs of both GPU backends are checked per request and per token against the f64 reference
//! (`tests/common/reference.rs`, near-ties excepted). A fault drill stops or kills a non-leader
//! rank under load and times the answers and the group's exit. BF16 and F16 rows, copied from the
//! host ring as they came and converted on the GPU, give the F32 rows' outputs, in every output
//! dtype. Two steps in flight (`--steps-ahead 1`) and one at a time both match the f64 reference.
//! Triton's CUDA shared memory: this process's device buffers, registered by IPC handle, give
//! Forward's outputs per token. Timing each step's phases inside its graph changes no output.
//! Needs GPUs and NCCL; ignored by default. On a GPU machine with a carried binary:
//! `EPSERVE_BIN=.device/bin/epserve .device/bin/gpu_serve --ignored --test-threads 1`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::prom::{scrape, sum};
use common::reference::{route, token, RefLayer, TIE_MARGIN};
use common::{bf16_tensor, decode, f16_tensor, f32_tensor, i32_tensor, kill, request};
use common::{row_error, Group};
use epserve::backend::cuda::device_count;
use epserve::model::{synthetic, MoeSpec};
use epserve::proto::{DType, ForwardRequest};
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
    run_spread(std::slice::from_ref(&g.addr), reqs, in_flight)
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

/// Requests checked against the f64 reference in each run (the reference costs ~75 MFLOP a
/// token in f64; the first `F64_REQUESTS` of the 1,000 keep it to seconds on the GPU host).
const F64_REQUESTS: usize = 200;
/// Largest error of one token: max |out - ref| over max |ref| of that token (bf16 experts).
const TOKEN_TOL: f64 = 3e-2;

/// The f64 reference layers of the test model (seed 0, every expert).
fn reference_layers() -> (MoeSpec, Vec<RefLayer>) {
    reference_layers_of(MODEL)
}

/// The f64 reference layers of a synthetic preset, capped to the two layers the tests serve.
fn reference_layers_of(model: &str) -> (MoeSpec, Vec<RefLayer>) {
    let mut spec = synthetic::preset(model.trim_start_matches("synthetic:")).unwrap();
    spec.cap_layers(Some(2));
    let layers = spec
        .moe_layers
        .iter()
        .map(|&l| {
            RefLayer::from_weights(
                &synthetic::layer(&spec, 0, l, 0..spec.num_experts),
                spec.hidden,
            )
        })
        .collect();
    (spec, layers)
}

/// The f64 reference of `spec`'s layers under the FP8 recipe (weights quantized in 128x128
/// blocks at load, as the service does with `--expert-dtype fp8`).
fn fp8_reference(spec: &MoeSpec) -> Vec<RefLayer> {
    spec.moe_layers
        .iter()
        .map(|&l| {
            RefLayer::from_weights_fp8(
                &synthetic::layer(spec, 0, l, 0..spec.num_experts),
                spec.hidden,
            )
        })
        .collect()
}

/// Every token of the first `F64_REQUESTS` requests against the f64 reference: asserts each
/// token's error within `token_tol` (near-ties excepted, and at most 10% of tokens may be);
/// returns (worst token,
/// worst request's ||out - ref|| / ||ref||, tokens checked, near-ties).
fn check_f64(
    what: &str,
    spec: &MoeSpec,
    layers: &[RefLayer],
    reqs: &[ForwardRequest],
    outs: &[Vec<f32>],
    token_tol: f64,
) -> (f64, f64, usize, usize) {
    let (h, k) = (spec.hidden, spec.top_k);
    let per_request: Vec<(f64, f64, usize, usize)> = std::thread::scope(|scope| {
        let tasks: Vec<_> = reqs
            .iter()
            .zip(outs)
            .take(F64_REQUESTS)
            .map(|(r, out)| {
                scope.spawn(move || {
                    let x: Vec<f64> = decode(r.hidden_states.as_ref().unwrap())
                        .into_iter()
                        .map(f64::from)
                        .collect();
                    let routing = r.topk_ids.as_ref().map(|ids| {
                        let ids: Vec<usize> = ids
                            .data
                            .chunks_exact(4)
                            .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as usize)
                            .collect();
                        let w: Vec<f64> = decode(r.topk_weights.as_ref().unwrap())
                            .into_iter()
                            .map(f64::from)
                            .collect();
                        (ids, w)
                    });
                    let layer = &layers[spec.layer_slot(r.layer).unwrap()];
                    let (mut worst, mut d2, mut n2, mut ties) = (0f64, 0f64, 0f64, 0);
                    let n = x.len() / h;
                    for t in 0..n {
                        let rt = routing
                            .as_ref()
                            .map(|(i, w)| (&i[t * k..(t + 1) * k], &w[t * k..(t + 1) * k]));
                        let (want, margin) = token(spec, layer, &x[t * h..(t + 1) * h], rt);
                        // The GPU's router logits are f32, as the reference's f32 rounding bound.
                        if margin < TIE_MARGIN {
                            ties += 1;
                            continue;
                        }
                        let got = &out[t * h..(t + 1) * h];
                        assert!(
                            got.iter().all(|v| v.is_finite()),
                            "{what} {}: token {t} not finite",
                            r.id
                        );
                        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
                        let err = got
                            .iter()
                            .zip(&want)
                            .fold(0f64, |m, (&o, w)| m.max((f64::from(o) - w).abs()))
                            / scale;
                        worst = worst.max(err);
                        for (&o, w) in got.iter().zip(&want) {
                            d2 += (f64::from(o) - w).powi(2);
                            n2 += w * w;
                        }
                    }
                    let rel = if n2 > 0.0 { (d2 / n2).sqrt() } else { 0.0 };
                    (worst, rel, n - ties, ties)
                })
            })
            .collect();
        tasks.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let fold = per_request.iter().fold((0f64, 0f64, 0, 0), |a, r| {
        (a.0.max(r.0), a.1.max(r.1), a.2 + r.2, a.3 + r.3)
    });
    eprintln!(
        "{what}: against f64, {} tokens of {} requests: worst token {:.3e}, worst request {:.3e}, {} near-ties skipped",
        fold.2, F64_REQUESTS, fold.0, fold.1, fold.3
    );
    assert!(
        fold.3 * 10 <= fold.2 + fold.3,
        "{what}: {} of {} tokens are near-ties",
        fold.3,
        fold.2 + fold.3
    );
    // Each token on its own: the worst one over every request.
    assert!(
        fold.0 <= token_tol,
        "{what}: a token's error is {:.3e} > {token_tol:.0e}",
        fold.0
    );
    fold
}

fn launch(ranks: usize, backend: &str, graphs: &str) -> Group {
    launch_with(ranks, backend, graphs, &[])
}

/// The group's GetModelInfo, from outside a runtime.
fn model_info(g: &Group) -> epserve::proto::ModelInfo {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut c = g.client().await;
        c.get_model_info(epserve::proto::GetModelInfoRequest {})
            .await
            .unwrap()
            .into_inner()
    })
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
    let (spec, layers) = reference_layers();
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
            let what = format!("nccl, {ranks} GPU(s), graphs {graphs}");
            check_f64(&what, &spec, &layers, &reqs, &out, TOKEN_TOL);
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

/// A DeepSeek-style layer (grouped sigmoid routing with a bias, one shared expert) on the `nccl`
/// backend, every token against the f64 reference: the only GPU test of the shared expert. One
/// request in ten is 600 to 900 tokens, so steps of more than 256 home rows per rank (the
/// shared expert on the grouped GEMM) mix with smaller ones (on cuBLAS) on 1 and 2 GPUs.
#[test]
#[ignore = "needs GPUs and NCCL"]
fn shared_expert_model_matches_the_f64_reference() {
    const SHARED: &str = "synthetic:tiny-deepseek";
    let (spec, layers) = reference_layers_of(SHARED);
    assert!(spec.shared_intermediate > 0, "{SHARED} has a shared expert");
    mixed_steps(SHARED, &spec, &layers, 31, "nccl", &[], TOKEN_TOL);
}

/// `model` on `backend` with `extra` flags, 1 and more GPUs, graphs on and off: `F64_REQUESTS`
/// seeded requests, one in ten of 600 to 900 tokens (steps of more than 256 home rows per rank)
/// among ones of 1 to 64, every token against `layers` within `tol`.
/// Seeded requests of `spec`'s model: one in ten of 600-900 tokens, the rest of 1-64, on any
/// MoE layer.
fn mixed_requests(spec: &MoeSpec, seed: u64) -> Vec<ForwardRequest> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..F64_REQUESTS)
        .map(|i| {
            let n = match i % 10 {
                0 => r.random_range(600..=900usize),
                _ => r.random_range(1..=64usize),
            };
            let x: Vec<f32> = (0..n * spec.hidden)
                .map(|_| r.random_range(-1.0..1.0))
                .collect();
            let layer = spec.moe_layers[r.random_range(0..spec.moe_layers.len())];
            request(&format!("s{i}"), layer, f32_tensor(&x, [n, spec.hidden]))
        })
        .collect()
}

/// `--overlap on` (the FP8 shared expert on a stream of its own from the gate on, under the
/// exchange; #57) answers bit for bit as `off`, graphs on and off, on a DeepSeek layer with a
/// shared expert, and within the FP8 bound of the f64 reference per token. One request at a
/// time: each is a step of its own, so both groups run it in the same bucket on the same
/// kernels (steps batched differently may choose other kernels, and round otherwise).
#[test]
#[ignore = "needs GPUs and NCCL"]
fn the_shared_expert_under_the_exchange_changes_no_bit() {
    const SMALL: &str = "synthetic:small-deepseek";
    let (spec, _) = reference_layers_of(SMALL);
    let layers = fp8_reference(&spec);
    let reqs = mixed_requests(&spec, 57);
    let ranks = *gpu_counts().last().unwrap();
    for graphs in ["on", "off"] {
        let run = |overlap: &str| {
            let args = [
                "--layers",
                "2",
                "--backend",
                "nccl",
                "--cuda-graphs",
                graphs,
                "--expert-dtype",
                "fp8",
                "--max-tokens-per-step",
                "2048",
                "--overlap",
                overlap,
            ];
            let g = Group::launch(ranks, SMALL, &args);
            run_all(&g, &reqs, 1)
        };
        let (off, on) = (run("off"), run("on"));
        let what = format!("{SMALL} fp8, --overlap on, {ranks} GPU(s), graphs {graphs}");
        for (i, (a, b)) in off.iter().zip(&on).enumerate() {
            let same =
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{what}: request {i} differs from --overlap off");
        }
        check_f64(&what, &spec, &layers, &reqs, &on, 6e-2);
        eprintln!(
            "{what}: {} requests bitwise equal to --overlap off",
            reqs.len()
        );
    }
}

/// `--two-batch on` (#57 item 1: steps of at least 512 tokens a rank run as two
/// micro-batches, one's rows moving while the other's experts compute) answers bit for bit as
/// `off`, graphs on and off: `nccl` and `nccl-ep` HT with FP8 experts (a DeepSeek layer with
/// a shared expert), `nccl-ep` HT with bf16 ones (the test model); every token within its
/// bound of the f64 reference; the ranks counted split steps with `on` and none with `off`
/// (else the comparison would prove nothing). One request at a time, as the shared expert's
/// test: the same bucket on both groups.
#[test]
#[ignore = "needs GPUs and NCCL (nccl-ep: NCCL >= 2.30.4 and libnccl_ep)"]
fn two_batch_steps_change_no_bit() {
    const SMALL: &str = "synthetic:small-deepseek";
    let ranks = *gpu_counts().last().unwrap();
    let (small, _) = reference_layers_of(SMALL);
    let (spec, bf16_layers) = reference_layers();
    let fp8_layers = fp8_reference(&small);
    let (small_reqs, reqs) = (mixed_requests(&small, 59), mixed_requests(&spec, 61));
    let mut runs = vec![("nccl", "fp8")];
    if nccl_ep_runs(ranks) {
        runs.extend([("nccl-ep", "fp8"), ("nccl-ep", "bf16")]);
    }
    for (backend, dtype) in runs {
        let (model, spec, layers, reqs, tol) = match dtype {
            "fp8" => (SMALL, &small, &fp8_layers, &small_reqs, 6e-2),
            _ => (MODEL, &spec, &bf16_layers, &reqs, TOKEN_TOL),
        };
        for graphs in ["on", "off"] {
            let run = |two_batch: &str| {
                let args = [
                    "--layers",
                    "2",
                    "--backend",
                    backend,
                    "--ep-mode",
                    "ht",
                    "--cuda-graphs",
                    graphs,
                    "--expert-dtype",
                    dtype,
                    "--max-tokens-per-step",
                    "2048",
                    "--two-batch",
                    two_batch,
                ];
                let g = Group::launch(ranks, model, &args);
                let out = run_all(&g, reqs, 1);
                let split: f64 = (g.metrics_addrs(ranks).iter())
                    .map(|a| sum(&scrape(a), "epserve_two_batch_steps_total", &[]))
                    .sum();
                (out, split)
            };
            let ((off, none), (on, split)) = (run("off"), run("on"));
            let what = format!(
                "{model} {dtype}, {backend}, --two-batch on, {ranks} GPU(s), graphs {graphs}"
            );
            assert!(
                none == 0.0 && split > 0.0,
                "{what}: split steps {none} off, {split} on"
            );
            for (i, (a, b)) in off.iter().zip(&on).enumerate() {
                let same =
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{what}: request {i} differs from --two-batch off");
            }
            check_f64(&what, spec, layers, reqs, &on, tol);
            eprintln!(
                "{what}: {} requests bitwise equal to --two-batch off ({split} split steps over the ranks)",
                reqs.len()
            );
        }
    }
}

fn mixed_steps(
    model: &str,
    spec: &MoeSpec,
    layers: &[RefLayer],
    seed: u64,
    backend: &str,
    extra: &[&str],
    tol: f64,
) {
    let reqs = mixed_requests(spec, seed);
    for ranks in gpu_counts() {
        for graphs in ["on", "off"] {
            let mut args = vec![
                "--layers",
                "2",
                "--backend",
                backend,
                "--cuda-graphs",
                graphs,
                "--step-timeout",
                "60s",
                "--max-tokens-per-step",
                "2048",
            ];
            args.extend_from_slice(extra);
            let g = Group::launch(ranks, model, &args);
            let out = run_all(&g, &reqs, 16);
            let what = format!("{model} {extra:?}, {backend}, {ranks} GPU(s), graphs {graphs}");
            check_f64(&what, spec, layers, &reqs, &out, tol);
        }
    }
}

/// FP8 experts (`--expert-dtype fp8`, DeepSeek-V3's recipe, quantized at load) on the `nccl`
/// backend, every token against the f64 reference of the recipe (weights in 128x128 blocks,
/// activations in bf16 quantized per 128 channels), graphs on and off: the test model's 1,000
/// requests under the bf16 tests' bound; and a DeepSeek layer with a shared expert at small
/// sizes (intermediate 128), steps of 600-900 tokens mixed with small ones, under a bound of its
/// own. Why two bounds: the FP8 tensor cores accumulate with ~14 bits between DeepGEMM's f32
/// promotions, so a gate/up value can round to the other side of a bf16 step than f64 puts it,
/// and its activation then to the other E4M3 step (1/16 to 1/8 of it). One such activation of I
/// moves a token by about 0.1 |a| / (sqrt(I) rms(a)): 1-2% at I = 768, up to 5% for the largest
/// activations at I = 128 (measured worst token 3.9e-2 over 20,675 tokens on one H200).
#[test]
#[ignore = "needs GPUs and NCCL"]
fn fp8_experts_match_the_f64_reference() {
    let (spec, _) = reference_layers();
    let layers = fp8_reference(&spec);
    let reqs = requests(7, REQUESTS);
    for ranks in gpu_counts() {
        for graphs in ["on", "off"] {
            let args = [
                "--layers",
                "2",
                "--backend",
                "nccl",
                "--expert-dtype",
                "fp8",
                "--cuda-graphs",
                graphs,
            ];
            let g = Group::launch(ranks, MODEL, &args);
            let out = run_all(&g, &reqs, 16);
            let what = format!("{MODEL} fp8, nccl, {ranks} GPU(s), graphs {graphs}");
            check_f64(&what, &spec, &layers, &reqs, &out, TOKEN_TOL);
        }
    }
    const SMALL: &str = "synthetic:small-deepseek";
    const SMALL_TOL: f64 = 6e-2;
    let (spec, _) = reference_layers_of(SMALL);
    let layers = fp8_reference(&spec);
    mixed_steps(
        SMALL,
        &spec,
        &layers,
        37,
        "nccl",
        &["--expert-dtype", "fp8"],
        SMALL_TOL,
    );
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
    // The memory gauge is read after a step at most once a second: one more step past that.
    std::thread::sleep(Duration::from_millis(1100));
    run_all(&g, &requests(13, 1), 1);
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

/// `--step-phase-times on` (events inside each step's graph) leaves every output bitwise as
/// it was and times each of the five phases of every step: the phases' sum within the ranks'
/// busy time; without it no GPU step reports phases.
#[test]
#[ignore = "needs GPUs and NCCL"]
fn step_phase_times_leave_outputs_bitwise_and_time_every_phase() {
    let ranks = *gpu_counts().last().unwrap();
    let reqs = requests(13, 200);
    let phase_count = |s: &[common::prom::Sample], p: &str| {
        sum(s, "epserve_step_phase_seconds_count", &[("phase", p)])
    };
    let phases = ["gating", "prepare", "dispatch", "experts", "combine"];
    let plain = {
        let g = launch(ranks, "nccl", "on");
        let out = run_all(&g, &reqs, 1);
        let s = scrape(&g.metrics_addrs(ranks)[0]);
        for p in phases {
            assert_eq!(
                phase_count(&s, p),
                0.0,
                "{p} timed without --step-phase-times"
            );
        }
        out
    };
    let g = launch_with(ranks, "nccl", "on", &["--step-phase-times", "on"]);
    let timed = run_all(&g, &reqs, 1);
    for (i, (a, b)) in timed.iter().zip(&plain).enumerate() {
        assert!(
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "request {i}: outputs differ with the phases timed"
        );
    }
    std::thread::sleep(Duration::from_millis(200));
    for (r, addr) in g.metrics_addrs(ranks).iter().enumerate() {
        let s = scrape(addr);
        let steps = sum(&s, "epserve_steps_total", &[("kind", "work")]);
        let busy = sum(&s, "epserve_step_duration_seconds_sum", &[]);
        let mut spent = 0.0;
        for p in phases {
            // One request in flight: no step waits behind another replay of its graph.
            assert_eq!(
                phase_count(&s, p),
                steps,
                "rank {r}: {p} timed in every step"
            );
            spent += sum(&s, "epserve_step_phase_seconds_sum", &[("phase", p)]);
        }
        eprintln!("rank {r}: {steps} steps, phases {spent:.4} s of {busy:.4} s busy");
        assert!(
            spent > 0.0 && spent <= busy,
            "rank {r}: phases {spent} s, busy {busy} s"
        );
    }
}

/// Expert slots on the GPU (#54): a group started on a placement file with redundant slots
/// matches the f64 reference per token; SIGHUP applies a new placement between graph replays
/// (the slot table and the rewritten slots' weights copied in place, no graph captured again),
/// and its outputs are bitwise those of a fresh group started on that placement; SIGHUP back to
/// the first placement (staged into the slots the second staged) gives the first's outputs
/// again, bit for bit. Each exchange (nccl-ep where it runs). On one GPU every expert is on the
/// rank: both placements are copied from its own slots, the swaps through the spare slot
/// (`eplb::sources`); over two, every slot is staged from the model.
#[test]
#[ignore = "needs GPUs and NCCL"]
fn a_placement_applied_between_graph_replays_equals_a_group_started_on_it() {
    let world = (*gpu_counts().last().unwrap()).min(2);
    let (spec, refs) = reference_layers();
    let e = spec.num_experts;
    let per = e / world;
    let dir = common::TempDir::new("gpu-placement");
    let file = dir.0.join("placement.json");
    let write = |t: &[u32]| {
        let json = serde_json::json!({ "phy2log": [t, t] });
        std::fs::write(&file, json.to_string()).unwrap();
    };
    let f = file.display().to_string();
    let reqs = requests(31, F64_REQUESTS);
    // Two replicas each. FP8 once a backend: its staged slots are written over kept ones as
    // bytes and scales. nccl-ep in its default mode (these one-request steps run LL), then
    // HT alone: 65 slots a rank, which NCCL EP's HT kernels number as 128 (`ep_local`).
    let mut backends = vec![
        ("nccl", vec![5u32, 77], "bf16", "auto"),
        ("nccl", vec![5, 77], "fp8", "auto"),
    ];
    if nccl_ep_runs(world) {
        backends.push(("nccl-ep", vec![5, 77], "bf16", "auto"));
        backends.push(("nccl-ep", vec![5, 77], "fp8", "ht"));
    }
    // EPSERVE_PLACEMENT_CASES=nccl-ep/fp8/ht,...: those cases only (a device call's time
    // limit); a case named with /0 runs without the replicas. The ranks inherit the
    // environment: EPSERVE_EPLB_STEP_COPIES=1 lands each placement a slot a rank a step (by
    // default these test-size layers land whole).
    if let Ok(only) = std::env::var("EPSERVE_PLACEMENT_CASES") {
        let mut picked = vec![];
        for c in only.split(',') {
            let p: Vec<&str> = c.split('/').collect();
            let bare = p.get(3) == Some(&"0");
            for b in backends.iter().filter(|b| p[..3] == [b.0, b.2, b.3]) {
                picked.push((b.0, if bare { vec![] } else { b.1.clone() }, b.2, b.3));
            }
        }
        backends = picked;
    }
    let fp8_refs = fp8_reference(&spec);
    for (backend, extras, dtype, mode) in backends {
        let on = [
            "--placement",
            f.as_str(),
            "--expert-dtype",
            dtype,
            "--ep-mode",
            mode,
        ];
        let refs = if dtype == "fp8" { &fp8_refs } else { &refs };
        let n = extras.len();
        let extra = |r: usize| extras[r * n / world..(r + 1) * n / world].to_vec();
        // A: each rank's block, then its share of the replicas. B: each rank the next rank's
        // block backwards, then the same replicas: every slot's expert changes.
        let a: Vec<u32> = (0..world)
            .flat_map(|r| (r * per..(r + 1) * per).map(|g| g as u32).chain(extra(r)))
            .collect();
        let b: Vec<u32> = (0..world)
            .flat_map(|r| {
                let next = (r + 1) % world;
                let block = (next * per..(next + 1) * per).rev().map(|g| g as u32);
                block.chain(extra(r))
            })
            .collect();
        write(&a);
        let g = launch_with(world, backend, "on", &on);
        let info = model_info(&g);
        let slots = ((e + n) / world) as u32;
        assert_eq!(
            (info.redundant_experts, info.slots_per_rank),
            (n as u32, slots)
        );
        assert_eq!(info.layer_placement[0].phy2log, a);
        let outs = run_all(&g, &reqs, 1);
        let before = check_f64(
            &format!("{backend} {dtype} on A"),
            &spec,
            refs,
            &reqs,
            &outs,
            TOKEN_TOL,
        );
        write(&b);
        kill(g.proc.rank_pid(0), "HUP");
        let end = Instant::now() + Duration::from_secs(120);
        while model_info(&g).placement_epoch != 1 {
            assert!(Instant::now() < end, "B not applied\n{}", g.proc.log_text());
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(model_info(&g).layer_placement[1].phy2log, b);
        land(&g, world, 1, &reqs);
        let live = run_all(&g, &reqs, 1);
        let after = check_f64(
            &format!("{backend} {dtype} on B, live"),
            &spec,
            refs,
            &reqs,
            &live,
            TOKEN_TOL,
        );
        if world > 1 {
            landed_on_the_device(&g, world, per, &extras, world - 1);
        }
        // A again: its slots staged into those B's placement staged and landed (kept, not
        // freed), so the outputs are A's, bit for bit, and block 0 is back on rank 0.
        write(&a);
        kill(g.proc.rank_pid(0), "HUP");
        let end = Instant::now() + Duration::from_secs(120);
        while model_info(&g).placement_epoch != 2 {
            assert!(
                Instant::now() < end,
                "A again not applied\n{}",
                g.proc.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        land(&g, world, 2, &reqs);
        let again = run_all(&g, &reqs, 1);
        let what = format!("{backend} {dtype} ({mode}), {n} redundant");
        bitwise(
            &format!("{what}: A applied again against A's first"),
            &again,
            &outs,
        );
        if world > 1 {
            landed_on_the_device(&g, world, per, &extras, 0);
        }
        if mode == "ht" {
            let ht: f64 = (g.metrics_addrs(world).iter())
                .map(|a| sum(&scrape(a), "epserve_ep_steps_total", &[("mode", "ht")]))
                .sum();
            assert!(ht > 0.0, "{backend} {dtype}: no HT step");
        }
        drop(g);
        // The file holds A again: B for the fresh group (started on A, it matched only where
        // outputs do not depend on the placement: the slot exchange, NCCL EP's LL).
        write(&b);
        let fresh = launch_with(world, backend, "on", &on);
        let started = run_all(&fresh, &reqs, 1);
        bitwise(
            &format!("{what}: B applied live against a group started on B"),
            &live,
            &started,
        );
        eprintln!(
            "{backend} {dtype} ({mode}), {world} GPUs, {n} redundant: A {before:?}, B live {after:?} (worst token, worst request, tokens, near-ties); B live = B started, A again = A, bitwise, {} requests",
            reqs.len()
        );
    }
}

/// Sends requests one at a time until every rank has landed placement `epoch` (its "copies
/// enqueued" line). A layer runs on its old slots until a later step lands it
/// (`Mover::land_beside`), and on NCCL EP's HT path a step's bits depend on the placement (a
/// token's rows are summed on the ranks that computed them, then combined): until then they
/// may be the old placement's (both within the f64 bound).
fn land(g: &Group, world: usize, epoch: u32, reqs: &[ForwardRequest]) {
    let needle = format!("epoch={epoch} ");
    let end = Instant::now() + Duration::from_secs(60);
    for r in reqs.iter().cycle() {
        let text = g.proc.log_text();
        let landed = |k: usize| {
            let rank = format!("rank={k} ");
            text.lines()
                .any(|l| l.contains(&rank) && l.contains("copies enqueued") && l.contains(&needle))
        };
        if (0..world).all(landed) {
            return;
        }
        assert!(
            Instant::now() < end,
            "placement {epoch} not landed on every rank\n{text}"
        );
        run_all(g, std::slice::from_ref(r), 1);
    }
}

/// Every request's outputs bit for bit those of `want`; else how many requests and values
/// differ, and by how much.
fn bitwise(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}: request counts");
    let (mut reqs, mut values, mut worst, mut first) = (0, 0, 0f32, None);
    for (i, (x, y)) in got.iter().zip(want).enumerate() {
        assert_eq!(x.len(), y.len(), "{what}: request {i}'s output lengths");
        let d = x.iter().zip(y).filter(|(p, q)| p.to_bits() != q.to_bits());
        let d: Vec<f32> = d.map(|(p, q)| (p - q).abs()).collect();
        if !d.is_empty() {
            reqs += 1;
            values += d.len();
            worst = d.iter().fold(worst, |a, &b| a.max(b));
            first.get_or_insert(i);
        }
    }
    assert!(
        reqs == 0,
        "{what}: {reqs} of {} requests differ ({values} values, the first request {first:?}, largest difference {worst:e})",
        got.len()
    );
}

/// A placement landed on the device, not only in GetModelInfo (its layers land one under each
/// later step): rows for eight of block 0's experts (none with a replica), on each layer, all
/// reach `holder`, the rank that holds block 0 in it, and none reach another rank.
fn landed_on_the_device(g: &Group, world: usize, per: usize, replicated: &[u32], holder: usize) {
    let (n, m) = (16usize, g.metrics_addrs(world));
    let rows = |r: usize| sum(&scrape(&m[r]), "epserve_rank_received_tokens_sum", &[]);
    let ids: Vec<i32> = (0..per as i32)
        .filter(|e| !replicated.contains(&(*e as u32)))
        .take(TOP_K)
        .collect();
    assert_eq!(
        ids.len(),
        TOP_K,
        "block 0 has {TOP_K} experts without a replica"
    );
    let probes: Vec<ForwardRequest> = (0..2u32)
        .map(|layer| {
            let x: Vec<f32> = (0..n * HIDDEN)
                .map(|i| (i % 7) as f32 * 0.1 - 0.3)
                .collect();
            let mut req = request(&format!("probe{layer}"), layer, f32_tensor(&x, [n, HIDDEN]));
            req.topk_ids = Some(i32_tensor(&ids.repeat(n), [n, TOP_K]));
            req.topk_weights = Some(f32_tensor(&vec![0.125; n * TOP_K], [n, TOP_K]));
            req
        })
        .collect();
    let before: Vec<f64> = (0..world).map(rows).collect();
    run_all(g, &probes, 1);
    let got: Vec<f64> = (0..world).map(|r| rows(r) - before[r]).collect();
    let want = (2 * n * TOP_K) as f64;
    assert!(
        (0..world).all(|r| got[r] == if r == holder { want } else { 0.0 }),
        "rows received per rank for block 0's experts: {got:?}, want {want} on rank {holder} and none elsewhere"
    );
}

/// Two steps in flight (`--steps-ahead 1`, the `nccl` default): the leader sends a step while the
/// one before runs, each rank queues it, and the rows move on their own copy streams. Against one
/// step at a time (`--steps-ahead 0`), every request's tokens against the f64 reference (the
/// steps' compositions differ between the two, so the bits may too); with 1, the leader started
/// steps ahead.
#[test]
#[ignore = "needs GPUs and NCCL"]
fn two_steps_in_flight_match_the_f64_reference() {
    two_steps_in_flight("nccl", &[]);
}

/// The same on `nccl-ep`, in its default mode (LL for small buckets, HT above) and HT for every
/// step: two steps in flight over NCCL EP's buffers. Needs NCCL >= 2.30.4 and libnccl_ep
/// (scripts/device-run.sh ep).
#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn nccl_ep_two_steps_in_flight_match_the_f64_reference() {
    if !nccl_ep_runs(*gpu_counts().last().unwrap()) {
        return;
    }
    two_steps_in_flight("nccl-ep", &["--ep-mode", "auto"]);
    two_steps_in_flight("nccl-ep", &["--ep-mode", "ht"]);
}

/// FP8 experts on `nccl-ep`: low-latency (DeepGEMM's masked layout over NCCL EP's expert-major
/// rows) and high-throughput (the psum layout over its aligned blocks, in registered windows),
/// the rows forwarded as FP8 codes and scales (QUANT_FWD), every token against the f64 reference
/// of the recipe, as `fp8_experts_match_the_f64_reference` checks `nccl`; and the small DeepSeek
/// layer, whose rows move as bf16 (too narrow for the forward recipe), under its own bound. Needs
/// NCCL 2.30 and NCCL EP (scripts/device-run.sh ep).
#[test]
#[ignore = "needs GPUs, NCCL 2.30 and NCCL EP"]
fn nccl_ep_fp8_experts_match_the_f64_reference() {
    let world = *gpu_counts().last().unwrap();
    if !nccl_ep_runs(world) {
        return;
    }
    let (spec, _) = reference_layers();
    let layers = fp8_reference(&spec);
    let reqs = requests(17, REQUESTS);
    for mode in ["ll", "ht"] {
        let flags = ["--expert-dtype", "fp8", "--ep-mode", mode];
        let g = launch_with(world, "nccl-ep", "on", &flags);
        assert_eq!(model_info(&g).expert_dtype, "fp8");
        let out = run_all(&g, &reqs, 32);
        let what = format!("{MODEL} fp8, nccl-ep {mode}, {world} GPU(s)");
        check_f64(&what, &spec, &layers, &reqs, &out, TOKEN_TOL);
    }
    // Rows of 256 channels carry two scales (8 bytes), not the whole 16-byte units NCCL EP's
    // forward recipe moves: they go as bf16 and are quantized after the exchange.
    const SMALL: &str = "synthetic:small-deepseek";
    let (spec, _) = reference_layers_of(SMALL);
    let layers = fp8_reference(&spec);
    let flags = ["--expert-dtype", "fp8", "--ep-mode", "auto"];
    mixed_steps(SMALL, &spec, &layers, 41, "nccl-ep", &flags, 6e-2);
}

/// Whether `nccl-ep` runs on `world` GPUs here (NCCL >= 2.30.4 and libnccl_ep); where not, says
/// why and the test skips.
fn nccl_ep_runs(world: usize) -> bool {
    epserve::backend::gpu::ep_gates(world)
        .map_err(|why| {
            eprintln!("skipped: nccl-ep cannot run here ({why}); run with NCCL 2.30 and NCCL EP (scripts/device-run.sh ep)")
        })
        .is_ok()
}

fn two_steps_in_flight(backend: &str, extra: &[&str]) {
    let (spec, layers) = reference_layers();
    let reqs = requests(13, REQUESTS);
    let ranks = *gpu_counts().last().unwrap();
    for ahead in ["0", "1"] {
        let mut flags = vec!["--steps-ahead", ahead];
        flags.extend_from_slice(extra);
        let g = launch_with(ranks, backend, "on", &flags);
        let t0 = Instant::now();
        let out = run_all(&g, &reqs, 32);
        let secs = t0.elapsed().as_secs_f64();
        let what = format!("{backend} {extra:?}, {ranks} GPU(s), --steps-ahead {ahead}");
        let (worst, worst_req, tokens, ties) =
            check_f64(&what, &spec, &layers, &reqs, &out, TOKEN_TOL);
        let started: Vec<f64> = g
            .metrics_addrs(ranks)
            .iter()
            .map(|a| sum(&scrape(a), "epserve_steps_submitted_ahead_total", &[]))
            .collect();
        eprintln!(
            "{what}: {REQUESTS} requests in {secs:.2}s; worst token {worst:.3e}, worst request \
             {worst_req:.3e} over {tokens} tokens ({ties} near-ties); steps started ahead per rank \
             {started:?}"
        );
        match ahead {
            "0" => assert!(started.iter().all(|&n| n == 0.0), "{started:?}"),
            _ => assert!(started[0] > 0.0, "the leader started no step ahead"),
        }
    }
}

/// Rows in BF16 and F16 go from the ring to the GPU as they came and are widened there; outputs
/// in BF16 and F16 are narrowed there. Each (input, output) pair, all in flight together (so steps
/// of different dtypes interleave), gives per token the F32 path's output for the same values:
/// within 1e-5 for F32 outputs, within the output dtype's rounding otherwise.
#[test]
#[ignore = "needs GPUs and NCCL"]
fn wire_dtypes_convert_on_the_gpu_and_match_f32_rows() {
    let ranks = *gpu_counts().last().unwrap();
    let g = launch(ranks, "nccl", "on");
    let base = requests(21, 120);
    let pairs = [
        (DType::Bf16, DType::Bf16),
        (DType::Bf16, DType::F32),
        (DType::F16, DType::F16),
        (DType::F16, DType::F32),
        (DType::F32, DType::Bf16),
        (DType::F32, DType::F16),
    ];
    // (f32 request of the rounded values, the same values in the wire dtype) per pair and request.
    let mut f32_reqs = Vec::new();
    let mut wire_reqs = Vec::new();
    for (p, &(din, dout)) in pairs.iter().enumerate() {
        for r in &base {
            let x = decode(r.hidden_states.as_ref().unwrap());
            let n = x.len() / HIDDEN;
            let round = |v: f32| match din {
                DType::Bf16 => half::bf16::from_f32(v).to_f32(),
                DType::F16 => half::f16::from_f32(v).to_f32(),
                _ => v,
            };
            let x: Vec<f32> = x.into_iter().map(round).collect();
            let mut f = r.clone();
            f.id = format!("{}-f32-{p}", r.id);
            f.hidden_states = Some(f32_tensor(&x, [n, HIDDEN]));
            f.output_dtype = DType::F32 as i32;
            let mut w = f.clone();
            w.id = format!("{}-wire-{p}", r.id);
            w.hidden_states = Some(match din {
                DType::Bf16 => bf16_tensor(&x, [n, HIDDEN]),
                DType::F16 => f16_tensor(&x, [n, HIDDEN]),
                _ => f32_tensor(&x, [n, HIDDEN]),
            });
            w.output_dtype = dout as i32;
            f32_reqs.push(f);
            wire_reqs.push(w);
        }
    }
    let all: Vec<ForwardRequest> = f32_reqs.iter().chain(&wire_reqs).cloned().collect();
    let outs = run_all(&g, &all, 32);
    let (want, got) = outs.split_at(f32_reqs.len());
    // bf16 rows are routed on tensor cores, f32 rows in SGEMM: the same f32 products summed in
    // another order, so a routing near-tie may resolve either way.
    let (spec, layers) = reference_layers();
    let (mut ties, mut tokens) = (0, 0);
    for (i, (w, o)) in want.iter().zip(got).enumerate() {
        let (din, dout) = pairs[i / base.len()];
        let req = &f32_reqs[i];
        let x = decode(req.hidden_states.as_ref().unwrap());
        let layer = &layers[spec.layer_slot(req.layer).unwrap()];
        // Relative rounding of one output value in its dtype (half an ulp), and slack for f32.
        let eps = match dout {
            DType::Bf16 => 2f64.powi(-8),
            DType::F16 => 2f64.powi(-11),
            _ => 0.0,
        };
        assert_eq!(w.len(), o.len());
        for (t, (wt, ot)) in w.chunks(HIDDEN).zip(o.chunks(HIDDEN)).enumerate() {
            tokens += 1;
            let xt: Vec<f64> = x[t * HIDDEN..][..HIDDEN]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            if req.topk_ids.is_none() && route(&spec, layer, &xt).2 < TIE_MARGIN {
                ties += 1;
                continue;
            }
            let scale = wt.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
            for (&a, &b) in wt.iter().zip(ot) {
                let (a, b) = (f64::from(a), f64::from(b));
                assert!(
                    (a - b).abs() <= a.abs() * eps + 1e-5 * scale,
                    "{din:?} in, {dout:?} out, request {}, token {t}: {b} where the f32 rows give {a}",
                    wire_reqs[i].id
                );
            }
        }
    }
    eprintln!(
        "{ranks} GPUs: {} requests in 6 (input, output) dtype pairs match their f32 rows per token \
         ({ties} near-ties skipped)",
        wire_reqs.len()
    );
    assert!(ties * 10 <= tokens, "{ties} near-ties in {tokens} tokens");
}

/// `nccl-ep` in `mode` (plus `extra` flags) with zero-copy on and off and graphs on and off, on
/// every GPU (and, for `also_two`, once on 2): 1,000 requests each against the `nccl` backend;
/// every step checked for overflow and for rows the routing did not send (`/metrics`).
/// Returns the steps each mode ran, over all runs (None: nccl-ep cannot run here, skipped).
fn ep_mode_matches_nccl(mode: &str, extra: &[&str], also_two: bool) -> Option<(f64, f64)> {
    let world = *gpu_counts().last().unwrap();
    if !nccl_ep_runs(world) {
        return None;
    }
    let reqs = requests(21, REQUESTS);
    let (spec, layers) = reference_layers();
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
        let info = model_info(&g);
        let fp = info
            .nccl_ep
            .expect("GetModelInfo reports the NCCL EP footprint");
        // NCCL EP 0.2 has no zero-copy LL in the expert-major layout: LL stages.
        assert_eq!(fp.zero_copy, zc == "on" && mode != "ll", "{fp:?}");
        assert!(fp.handle_bytes > 0 && fp.expert_rows_bytes > 0, "{fp:?}");
        let out = run_all(&g, &reqs, 16);
        let what =
            format!("nccl-ep {mode} {extra:?}, zero-copy {zc}, graphs {graphs}, {ranks} GPUs");
        check_f64(&what, &spec, &layers, &reqs, &out, TOKEN_TOL);
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
    Some((ll_steps, ht_steps))
}

/// Every request to rank `i % addrs.len()`, `in_flight` at a time per rank; outputs in order.
fn run_spread(addrs: &[String], reqs: &[ForwardRequest], in_flight: usize) -> Vec<Vec<f32>> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut clients = Vec::new();
        for a in addrs {
            let c = epserve::proto::moe_service_client::MoeServiceClient::connect(format!(
                "http://{a}"
            ))
            .await
            .unwrap()
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20);
            clients.push((c, Arc::new(tokio::sync::Semaphore::new(in_flight))));
        }
        let mut tasks = Vec::with_capacity(reqs.len());
        for (i, req) in reqs.iter().cloned().enumerate() {
            let (c, gate) = &clients[i % clients.len()];
            let (mut c, gate) = (c.clone(), gate.clone());
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

/// --ingress all: the requests spread over every rank give what leader ingress gives (nccl
/// backend, same requests), and each token matches the f64 reference.
#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn nccl_ep_ingress_all_matches_the_nccl_backend() {
    let world = *gpu_counts().last().unwrap();
    if !nccl_ep_runs(world) {
        return;
    }
    let reqs = requests(23, REQUESTS);
    let (spec, layers) = reference_layers();
    let reference = {
        let g = launch(world, "nccl", "on");
        run_all(&g, &reqs, 16)
    };
    let g = launch_with(
        world,
        "nccl-ep",
        "on",
        &["--ep-ll-max-tokens", "32", "--ingress", "all"],
    );
    let info = model_info(&g);
    let addrs: Vec<String> = info.ingress.iter().map(|a| a.address.clone()).collect();
    assert_eq!((info.ingress_mode.as_str(), addrs.len()), ("all", world));
    let out = run_spread(&addrs, &reqs, 8);
    let what = format!("nccl-ep auto, --ingress all, {world} GPUs");
    check_f64(&what, &spec, &layers, &reqs, &out, TOKEN_TOL);
    let (rel, worst) = relative_error(&out, &reference);
    eprintln!("{what}: against leader ingress on nccl: ||out-ref||/||ref|| = {rel:.3e} (worst request {worst:.3e})");
    assert!(rel <= 1e-2, "{what}: {rel:.3e}");
}

/// Needs NCCL >= 2.30.4 and libnccl_ep (scripts/device-run.sh ep); the image's NCCL alone fails.
#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn nccl_ep_ht_matches_the_nccl_backend() {
    let Some((ll, ht)) = ep_mode_matches_nccl("ht", &[], false) else {
        return;
    };
    assert!(ll == 0.0 && ht > 0.0, "steps: LL {ll}, HT {ht}");
}

#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn nccl_ep_ll_matches_the_nccl_backend() {
    let Some((ll, ht)) = ep_mode_matches_nccl("ll", &[], false) else {
        return;
    };
    assert!(ll > 0.0 && ht == 0.0, "steps: LL {ll}, HT {ht}");
}

/// Auto with LL up to 32 tokens per rank: small steps run LL, batched ones HT.
#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn nccl_ep_auto_matches_the_nccl_backend() {
    let Some((ll, ht)) = ep_mode_matches_nccl("auto", &["--ep-ll-max-tokens", "32"], true) else {
        return;
    };
    assert!(ll > 0.0 && ht > 0.0, "steps: LL {ll}, HT {ht}");
}

/// The image's NCCL (< 2.30.4): `nccl-ep` refuses with its gate's reason; `auto` serves on `nccl`.
#[test]
#[ignore = "needs GPUs and an NCCL older than 2.30.4"]
fn nccl_ep_refuses_on_old_nccl_and_auto_serves_on_nccl() {
    let nccl = nccl_sys::Nccl::load().unwrap_or_else(|e| panic!("{e}"));
    if nccl.version >= 23004 {
        eprintln!(
            "skipped: NCCL {} is new enough for NCCL EP; run with the image's NCCL",
            nccl_sys::version_string(nccl.version)
        );
        return;
    }
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
        "--http-listen",
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
    // One rank per GPU (NCCL refuses two ranks on one).
    let g = Group::launch(
        device_count().min(2),
        "synthetic:tiny",
        &["--backend", "auto"],
    );
    let info = model_info(&g);
    assert_eq!(info.backend, "nccl");
    assert!(g
        .proc
        .log_text()
        .contains("--backend auto: not nccl-ep (NCCL EP needs NCCL >= 2.30.4"));
}

/// Under load from 32 clients, stops (`STOP`) or kills (`KILL`) the last rank (a worker, never
/// the leader): every client is answered within --step-timeout + 1 s, with UNAVAILABLE naming the
/// broken group, and the group exits non-zero. Prints the time to the first answer and to the
/// group's exit.
fn fault_drill(backend: &str, sig: &str, extra: &[&str]) {
    let world = *gpu_counts().last().unwrap();
    if world < 2 {
        eprintln!("skipped: the drill stops a worker, so it needs 2 GPUs or more (found {world})");
        return;
    }
    let victim_rank = world - 1;
    let step_timeout = Duration::from_secs(5);
    let mut args = vec![
        "--layers",
        "1",
        "--backend",
        backend,
        "--step-timeout",
        "5s",
        "--heartbeat-interval",
        "500ms",
    ];
    args.extend_from_slice(extra);
    let mut g = Group::launch(world, MODEL, &args);
    let victim = g.proc.rank_pid(victim_rank);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (first, last, codes, fault, late) = rt.block_on(async {
        let client = g.client().await;
        let reqs: Vec<ForwardRequest> = requests(31, 64)
            .into_iter()
            .map(|r| ForwardRequest { layer: 0, ..r })
            .collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..32 {
            let (mut c, reqs, stop) = (client.clone(), reqs.clone(), stop.clone());
            tasks.spawn(async move {
                let mut j = i;
                loop {
                    let mut r = tonic::Request::new(reqs[j % reqs.len()].clone());
                    r.set_timeout(Duration::from_secs(30));
                    let sent = Instant::now();
                    match c.forward(r).await {
                        Ok(_) if !stop.load(std::sync::atomic::Ordering::Relaxed) => j += 32,
                        Ok(_) => return (tonic::Code::Ok, String::new(), sent, Instant::now()),
                        Err(s) => return (s.code(), s.message().to_string(), sent, Instant::now()),
                    }
                }
            });
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        let at = Instant::now();
        kill(victim, sig);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (mut first, mut last) = (Duration::MAX, Duration::ZERO);
        let mut late: Vec<String> = Vec::new();
        let mut codes = std::collections::BTreeMap::<String, usize>::new();
        while let Some(r) = tasks.join_next().await {
            let (code, msg, sent, done) = r.unwrap();
            *codes.entry(format!("{code:?}")).or_default() += 1;
            if code == tonic::Code::Ok {
                continue;
            }
            let since = done.saturating_duration_since(at);
            first = first.min(since);
            last = last.max(since);
            // A request sent as the leader's port closed sees the closed connection.
            let closed = msg.contains("transport") || msg.contains("connect");
            assert!(
                code == tonic::Code::Unavailable || closed,
                "{backend} {sig}: {code:?} {msg}"
            );
            if done.saturating_duration_since(sent.max(at)) > step_timeout + Duration::from_secs(1)
            {
                late.push(format!("{since:?}: {msg}"));
            }
        }
        (first, last, codes, at, late)
    });
    let status = g
        .proc
        .wait_exit(Duration::from_secs(60))
        .expect("the group exits");
    let exit = fault.elapsed();
    let log = g.proc.log_text();
    for l in log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
    {
        eprintln!("  {l}");
    }
    eprintln!(
        "fault drill {backend} {extra:?}, {sig} rank {victim_rank} of {world} under 32 clients, --step-timeout 5s: answers {codes:?}; first error {first:.2?}, last {last:.2?} after the fault; group exited ({status}) {exit:.1?} after it"
    );
    assert!(!status.success(), "{backend} {sig}: the group exited 0");
    assert!(
        late.is_empty(),
        "{backend} {sig}: answered later than --step-timeout + 1 s: {late:?}"
    );
}

#[test]
#[ignore = "needs 2+ GPUs and NCCL"]
fn nccl_fault_drill_stop_and_kill_a_rank() {
    fault_drill("nccl", "STOP", &[]);
    fault_drill("nccl", "KILL", &[]);
}

/// Needs NCCL >= 2.30.4 and libnccl_ep (scripts/device-run.sh ep).
#[test]
#[ignore = "needs 2+ GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn nccl_ep_fault_drill_stop_and_kill_a_rank() {
    if !nccl_ep_runs(*gpu_counts().last().unwrap()) {
        return;
    }
    for ahead in ["0", "1"] {
        fault_drill("nccl-ep", "STOP", &["--steps-ahead", ahead]);
        fault_drill("nccl-ep", "KILL", &["--steps-ahead", ahead]);
    }
}

/// The Forward request of `n` f32 rows `x` (id `id`) and the group's answer to it, decoded: what
/// the shared-memory paths are checked against.
fn forward_f32(
    rt: &tokio::runtime::Runtime,
    g: &Group,
    id: &str,
    x: &[f32],
    n: usize,
) -> (ForwardRequest, Vec<f32>) {
    let fwd = request(id, 0, f32_tensor(x, [n, HIDDEN]));
    let out = rt.block_on(async { g.client().await.forward(fwd.clone()).await });
    (fwd, decode(&out.unwrap().into_inner().output.unwrap()))
}

/// A device buffer of this (client) process, exported as Triton's clients export theirs.
struct ClientBuffer(cudarc::driver::sys::CUdeviceptr);

impl ClientBuffer {
    fn new(bytes: usize) -> Self {
        use cudarc::driver::sys;
        let mut p = 0;
        // SAFETY: a plain allocation (not stream-ordered: pool memory has no IPC handle) into a
        // valid out-pointer, in the context the test bound to this thread.
        unsafe { sys::cuMemAlloc_v2(&mut p, bytes) }
            .result()
            .unwrap();
        Self(p)
    }

    fn write(&self, data: &[u8]) {
        // SAFETY: the buffer holds at least `data.len()` bytes (the caller sized it); synchronous.
        unsafe {
            cudarc::driver::sys::cuMemcpyHtoD_v2(self.0, data.as_ptr() as *const _, data.len())
        }
        .result()
        .unwrap();
    }

    fn read(&self, out: &mut [u8]) {
        // SAFETY: as `write`, the other way.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut _, self.0, out.len())
        }
        .result()
        .unwrap();
    }

    /// The raw `cudaIpcMemHandle_t` bytes.
    fn handle(&self) -> Vec<u8> {
        use cudarc::driver::sys;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `h` is a valid out-pointer; the buffer is a live cuMemAlloc allocation.
        unsafe { sys::cuIpcGetMemHandle(&mut h, self.0) }
            .result()
            .unwrap();
        h.reserved.iter().map(|&c| c as u8).collect()
    }
}

impl Drop for ClientBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`; the server has unregistered (closed) it by now.
        let _ = unsafe { cudarc::driver::sys::cuMemFree_v2(self.0) };
    }
}

/// Triton's CUDA shared memory on one GPU rank: this process's device buffers, registered by
/// their raw IPC handles, hold the hidden states and receive the output; each request's output
/// equals Forward's over the wire per token and is within TOKEN_TOL of the f64 reference; the
/// regions are listed, a short handle and a size past the allocation are refused, and
/// unregistering closes them.
#[test]
#[ignore = "needs a GPU and NCCL"]
fn cuda_shared_memory_round_trip_equals_forward() {
    use epserve::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
    use epserve::inference::infer_parameter::ParameterChoice;
    use epserve::inference::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
    use epserve::inference::*;
    let g = launch_with(1, "nccl", "on", &["--allow-client-shm"]);
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    let (spec, layers) = reference_layers();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut c = rt
        .block_on(GrpcInferenceServiceClient::connect(format!(
            "http://{}",
            g.addr
        )))
        .unwrap()
        .max_decoding_message_size(256 << 20)
        .max_encoding_message_size(256 << 20);
    let meta = rt
        .block_on(c.server_metadata(ServerMetadataRequest {}))
        .unwrap()
        .into_inner();
    assert!(
        meta.extensions.contains(&"cuda_shared_memory".to_string()),
        "{meta:?}"
    );
    let shm = |region: &str, len: usize| -> std::collections::HashMap<String, InferParameter> {
        let p = |c| InferParameter {
            parameter_choice: Some(c),
        };
        [
            (
                "shared_memory_region",
                p(ParameterChoice::StringParam(region.into())),
            ),
            (
                "shared_memory_byte_size",
                p(ParameterChoice::Int64Param(len as i64)),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    };
    let mut r = ChaCha8Rng::seed_from_u64(31);
    let (mut reqs, mut outs) = (vec![], vec![]);
    for (i, n) in [1usize, 7, 64, 300, 1024].into_iter().enumerate() {
        let x: Vec<f32> = (0..n * HIDDEN).map(|_| r.random_range(-1.0..1.0)).collect();
        let bytes = n * HIDDEN * 4;
        let (input, output) = (ClientBuffer::new(bytes), ClientBuffer::new(bytes));
        input.write(&x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
        for (name, b) in [("in", &input), ("out", &output)] {
            rt.block_on(
                c.cuda_shared_memory_register(CudaSharedMemoryRegisterRequest {
                    name: format!("{name}-{i}"),
                    raw_handle: b.handle(),
                    device_id: 0,
                    byte_size: bytes as u64,
                }),
            )
            .unwrap_or_else(|e| panic!("register {name}-{i}: {e:?}"));
        }
        let listed = rt
            .block_on(c.cuda_shared_memory_status(CudaSharedMemoryStatusRequest::default()))
            .unwrap()
            .into_inner()
            .regions;
        assert_eq!(listed.len(), 2, "{listed:?}");
        assert_eq!(listed[&format!("in-{i}")].byte_size, bytes as u64);
        let req = ModelInferRequest {
            model_name: "layer-0".into(),
            id: format!("cuda-{i}"),
            inputs: vec![InferInputTensor {
                name: "hidden_states".into(),
                datatype: "FP32".into(),
                shape: vec![n as i64, HIDDEN as i64],
                parameters: shm(&format!("in-{i}"), bytes),
                contents: None,
            }],
            outputs: vec![InferRequestedOutputTensor {
                name: "output".into(),
                parameters: shm(&format!("out-{i}"), bytes),
            }],
            ..Default::default()
        };
        let resp = rt.block_on(c.model_infer(req)).unwrap().into_inner();
        assert!(resp.raw_output_contents.iter().all(|b| b.is_empty()));
        let mut got = vec![0u8; bytes];
        output.read(&mut got);
        let got: Vec<f32> = got
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let (fwd, want) = forward_f32(&rt, &g, &format!("f{i}"), &x, n);
        for t in 0..n {
            let row = t * HIDDEN..(t + 1) * HIDDEN;
            let err = row_error(&got[row.clone()], &want[row]);
            assert!(
                err <= 1e-6,
                "request {i} token {t}: CUDA shm vs Forward {err:.3e}"
            );
        }
        for name in ["in", "out"] {
            rt.block_on(
                c.cuda_shared_memory_unregister(CudaSharedMemoryUnregisterRequest {
                    name: format!("{name}-{i}"),
                }),
            )
            .unwrap();
        }
        reqs.push(fwd);
        outs.push(got);
    }
    // One direction in device memory, the other on the wire; the input at an offset no
    // element is aligned to (the rank copies bytes; the finite check loads bytes).
    let (n, skip) = (33usize, 6usize);
    let x: Vec<f32> = (0..n * HIDDEN).map(|_| r.random_range(-1.0..1.0)).collect();
    let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let bytes = xb.len();
    let mixed = ClientBuffer::new(skip + bytes);
    mixed.write(&[vec![0u8; skip], xb.clone()].concat());
    rt.block_on(
        c.cuda_shared_memory_register(CudaSharedMemoryRegisterRequest {
            name: "mixed".into(),
            raw_handle: mixed.handle(),
            device_id: 0,
            byte_size: (skip + bytes) as u64,
        }),
    )
    .unwrap();
    let at = |offset: usize| {
        let mut p = shm("mixed", bytes);
        p.insert(
            "shared_memory_offset".into(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::Int64Param(offset as i64)),
            },
        );
        p
    };
    let infer = |inputs: Vec<InferInputTensor>,
                 raw: Vec<Vec<u8>>,
                 out: std::collections::HashMap<String, InferParameter>| {
        rt.block_on(c.clone().model_infer(ModelInferRequest {
            model_name: "layer-0".into(),
            inputs,
            outputs: vec![InferRequestedOutputTensor {
                name: "output".into(),
                parameters: out,
            }],
            raw_input_contents: raw.into_iter().map(Into::into).collect(),
            ..Default::default()
        }))
    };
    let hidden = |parameters| InferInputTensor {
        name: "hidden_states".into(),
        datatype: "FP32".into(),
        shape: vec![n as i64, HIDDEN as i64],
        parameters,
        contents: None,
    };
    let floats = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let wire_out = infer(vec![hidden(at(skip))], vec![], Default::default())
        .unwrap()
        .into_inner();
    let device_out = {
        infer(vec![hidden(Default::default())], vec![xb.clone()], at(skip)).unwrap();
        let mut got = vec![0u8; bytes];
        let mut all = vec![0u8; skip + bytes];
        mixed.read(&mut all);
        got.copy_from_slice(&all[skip..]);
        got
    };
    let (fwd, want) = forward_f32(&rt, &g, "mixed", &x, n);
    for (what, got) in [
        (
            "CUDA input, wire output",
            floats(&wire_out.raw_output_contents[0]),
        ),
        ("wire input, CUDA output", floats(&device_out)),
    ] {
        for t in 0..n {
            let row = t * HIDDEN..(t + 1) * HIDDEN;
            let err = row_error(&got[row.clone()], &want[row]);
            assert!(err <= 1e-6, "{what}, token {t}: vs Forward {err:.3e}");
        }
        reqs.push(fwd.clone());
        outs.push(got);
    }
    // A non-finite value in device memory is refused before admission, by row and column.
    let mut bad = xb.clone();
    bad[(5 * HIDDEN + 7) * 4..(5 * HIDDEN + 8) * 4].copy_from_slice(&f32::NAN.to_le_bytes());
    mixed.write(&[vec![0u8; skip], bad].concat());
    let e = infer(vec![hidden(at(skip))], vec![], Default::default()).unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("non-finite value at row 5, column 7"),
        "{e:?}"
    );
    rt.block_on(
        c.cuda_shared_memory_unregister(CudaSharedMemoryUnregisterRequest {
            name: "mixed".into(),
        }),
    )
    .unwrap();
    check_f64(
        "CUDA shared memory",
        &spec,
        &layers,
        &reqs,
        &outs,
        TOKEN_TOL,
    );
    // What a client names is checked: a short handle, and a size past its allocation.
    let b = ClientBuffer::new(4096);
    let refuse = |handle: Vec<u8>, size: u64, want: &str| {
        let e = rt
            .block_on(
                c.clone()
                    .cuda_shared_memory_register(CudaSharedMemoryRegisterRequest {
                        name: "bad".into(),
                        raw_handle: handle,
                        device_id: 0,
                        byte_size: size,
                    }),
            )
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(want), "{e:?}");
    };
    refuse(
        b.handle()[..63].to_vec(),
        4096,
        "not a CUDA IPC handle's 64",
    );
    refuse(b.handle(), 1 << 30, "exceeds the");
    let left = rt
        .block_on(c.cuda_shared_memory_status(CudaSharedMemoryStatusRequest::default()))
        .unwrap()
        .into_inner()
        .regions;
    assert!(left.is_empty(), "{left:?}");
}
