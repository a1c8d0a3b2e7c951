//! Outputs of real rank groups against the f64 reference, for every routing kind, 1/2/4 ranks,
//! n = 1, odd n and n above `--max-tokens-per-step`, f32, bf16 and f16 in (out in the same dtype,
//! or another), gating and client routing, unary and streaming; and the same outputs whatever the
//! world size.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::reference::{compare, RefLayer};
use common::*;
use epserve::model::{synthetic, MoeSpec};
use epserve::proto::{DType, ForwardRequest};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio_stream::StreamExt;

const MAX_TOKENS: usize = 16;

struct Sent {
    x: Vec<f64>,
    routing: Option<(Vec<usize>, Vec<f64>)>,
    layer_slot: usize,
    /// The dtype the output must come back in.
    output: DType,
}

/// Requests covering every combination, with what the reference needs to check them.
fn requests(spec: &MoeSpec, rng: &mut ChaCha8Rng) -> Vec<(ForwardRequest, Sent)> {
    let (h, k, e) = (spec.hidden, spec.top_k, spec.num_experts);
    let mut out = Vec::new();
    for (slot, &layer) in spec.moe_layers.iter().enumerate() {
        for n in [1usize, 7, 2 * MAX_TOKENS + 5] {
            for input in [DType::F32, DType::Bf16, DType::F16] {
                for client in [false, true] {
                    // Output in the input's dtype, or (with client routing) in another one.
                    let output = match (client, input) {
                        (false, d) => d,
                        (true, DType::F32) => DType::Bf16,
                        (true, _) => DType::F32,
                    };
                    let mut x: Vec<f32> =
                        (0..n * h).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                    let tensor = match input {
                        DType::Bf16 => {
                            x.iter_mut()
                                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
                            bf16_tensor(&x, [n, h])
                        }
                        DType::F16 => {
                            x.iter_mut()
                                .for_each(|v| *v = half::f16::from_f32(*v).to_f32());
                            f16_tensor(&x, [n, h])
                        }
                        _ => f32_tensor(&x, [n, h]),
                    };
                    let id = format!(
                        "l{layer}-n{n}-{}-{}-{}",
                        input.as_str_name(),
                        output.as_str_name(),
                        if client { "client" } else { "gate" }
                    );
                    let mut req = request(&id, layer, tensor);
                    req.output_dtype = output as i32;
                    let routing = client.then(|| client_routing(&mut req, rng, n, k, e));
                    out.push((
                        req,
                        Sent {
                            x: x.iter().map(|&v| f64::from(v)).collect(),
                            routing,
                            layer_slot: slot,
                            output,
                        },
                    ));
                }
            }
        }
    }
    out
}

/// Sends everything once through unary Forward (concurrently) and once through one stream;
/// checks every output against the reference; returns the f32 outputs by id.
async fn check_group(
    group: &Group,
    spec: &MoeSpec,
    refs: &[RefLayer],
    seed: u64,
) -> HashMap<String, Vec<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let reqs = requests(spec, &mut rng);
    let mut client = group.client().await;
    let mut tasks = tokio::task::JoinSet::new();
    for (r, _) in &reqs {
        let (mut c, r) = (client.clone(), r.clone());
        tasks.spawn(async move { c.forward(r).await.map(|x| x.into_inner()) });
    }
    let mut unary = HashMap::new();
    while let Some(r) = tasks.join_next().await {
        let resp = r.unwrap().expect("forward");
        unary.insert(resp.id.clone(), resp);
    }
    let stream_in = tokio_stream::iter(reqs.iter().map(|(r, _)| r.clone()).collect::<Vec<_>>());
    let mut stream = client.forward_stream(stream_in).await.unwrap().into_inner();
    let mut streamed = HashMap::new();
    while let Some(resp) = stream.next().await {
        let resp = resp.unwrap();
        assert!(resp.error.is_none(), "{:?}", resp.error);
        streamed.insert(resp.id.clone(), resp);
    }
    assert_eq!(
        streamed.len(),
        reqs.len(),
        "one streamed answer per request"
    );
    let (mut excluded, mut rows) = (0, 0);
    let mut f32_out = HashMap::new();
    for (req, sent) in &reqs {
        for (how, resp) in [("unary", &unary[&req.id]), ("stream", &streamed[&req.id])] {
            let t = resp.output.as_ref().unwrap();
            let want_dtype = sent.output;
            let n = sent.x.len() / spec.hidden;
            assert_eq!(
                (t.dtype, t.shape.clone()),
                (want_dtype as i32, vec![n as i64, spec.hidden as i64]),
                "{}",
                req.id
            );
            let out = decode(t);
            let routing = sent.routing.as_ref().map(|(i, w)| (&i[..], &w[..]));
            let (err, ex) = compare(spec, &refs[sent.layer_slot], &sent.x, &out, routing);
            // Within the output's own rounding: none for f32, ~5e-4 for f16, ~4e-3 for bf16.
            let tol = match sent.output {
                DType::F32 => 1e-5,
                DType::F16 => 2e-3,
                _ => 2e-2,
            };
            assert!(
                err <= tol,
                "{} ({how}): max relative error {err:.3e} > {tol:e}",
                req.id
            );
            excluded += ex;
            rows += n;
            if sent.output == DType::F32 && how == "unary" {
                f32_out.insert(req.id.clone(), out);
            }
        }
    }
    assert!(
        excluded * 100 <= rows,
        "{excluded} of {rows} rows were routing near-ties"
    );
    f32_out
}

fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let m = b.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).abs())
        .fold(0.0, f64::max)
        / m
}

/// The preset's layers as the reference computes them.
fn reference(spec: &MoeSpec, seed: u64) -> Vec<RefLayer> {
    spec.moe_layers
        .iter()
        .map(|&l| {
            RefLayer::from_weights(
                &synthetic::layer(spec, seed, l, 0..spec.num_experts),
                spec.hidden,
            )
        })
        .collect()
}

/// A group of `world` ranks on the preset, `tokens` per step at most, plus `extra` flags.
fn launch(world: usize, preset: &str, seed: u64, tokens: usize, extra: &[&str]) -> Group {
    let (seed, tokens) = (seed.to_string(), tokens.to_string());
    let mut args = vec![
        "--seed",
        &seed,
        "--max-tokens-per-step",
        &tokens,
        "--max-batch-wait-us",
        "300",
    ];
    args.extend_from_slice(extra);
    Group::launch(world, &format!("synthetic:{preset}"), &args)
}

async fn preset_across_worlds(preset: &str, seed: u64) {
    let spec = synthetic::preset(preset).unwrap();
    let refs = reference(&spec, seed);
    let mut by_world: Vec<(usize, HashMap<String, Vec<f32>>)> = Vec::new();
    for world in [1, 2, 4, 8] {
        let group = launch(world, preset, seed, MAX_TOKENS, &[]);
        by_world.push((world, check_group(&group, &spec, &refs, 1000 + seed).await));
    }
    let (_, base) = &by_world[0];
    for (world, outs) in &by_world[1..] {
        for (id, out) in outs {
            let d = rel_diff(out, &base[id]);
            assert!(
                d <= 1e-6,
                "{preset} {id}: {world} ranks differ from 1 rank by {d:.3e}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixtral_softmax_renormalised() {
    preset_across_worlds("tiny", 11).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_softmax_without_renormalisation() {
    preset_across_worlds("tiny-qwen3", 12).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_sigmoid_group_limited_with_shared_expert() {
    preset_across_worlds("tiny-deepseek", 13).await;
}

/// Four ranks on two simulated nodes (`launch --nodes 2`): dispatch and combine between the
/// nodes and the far node's home rows go over the data connections, not shared memory. Every
/// request (every dtype, gating and client routing, unary and stream) against the reference, the
/// same outputs as the same four ranks on one node, and every rank counts the bytes it sent to
/// the other node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_match_one_node_and_the_reference() {
    let (preset, seed) = ("tiny-deepseek", 17);
    let spec = synthetic::preset(preset).unwrap();
    let refs = reference(&spec, seed);
    let one = {
        let group = launch(4, preset, seed, MAX_TOKENS, &[]);
        let out = check_group(&group, &spec, &refs, 1000 + seed).await;
        let leader = prom::scrape(&group.metrics_addrs(4)[0]);
        assert_eq!(
            prom::sum(&leader, "epserve_cross_node_bytes_total", &[]),
            0.0,
            "one node sends nothing across nodes"
        );
        out
    };
    let group = launch(4, preset, seed, MAX_TOKENS, &["--nodes", "2"]);
    let info = group
        .client()
        .await
        .get_model_info(epserve::proto::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    let nodes = &info.rank_nodes;
    assert_eq!(nodes.len(), 4, "{nodes:?}");
    assert!(
        nodes[0] == nodes[1] && nodes[2] == nodes[3] && nodes[1] != nodes[2],
        "ranks 0, 1 on one node and 2, 3 on the other: {nodes:?}"
    );
    let two = check_group(&group, &spec, &refs, 1000 + seed).await;
    for (id, out) in &two {
        let d = rel_diff(out, &one[id]);
        assert!(d <= 1e-6, "{id}: two nodes differ from one by {d:.3e}");
    }
    for (rank, addr) in group.metrics_addrs(4).iter().enumerate() {
        let sent = prom::sum(
            &prom::scrape(addr),
            "epserve_cross_node_bytes_total",
            &[("rank", &rank.to_string())],
        );
        assert!(sent > 0.0, "rank {rank} counted no bytes to the other node");
    }
}

/// The cpu backend's expert math spread over several threads per rank (`--cpu-threads`; CI's two
/// cores give one per rank by default): every request against the reference, and the same
/// outputs as one thread. Steps of 64 tokens, so each rank's rows and its shared expert's tokens
/// are cut into several blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expert_math_over_several_threads_per_rank() {
    let (preset, seed) = ("tiny-deepseek", 14);
    let spec = synthetic::preset(preset).unwrap();
    let refs = reference(&spec, seed);
    let mut outs = Vec::new();
    for threads in ["1", "3"] {
        let group = launch(2, preset, seed, 64, &["--cpu-threads", threads]);
        let log = group.proc.log_text();
        assert!(
            log.contains(&format!("threads={threads}")),
            "the ranks do not say they run {threads} threads:\n{log}"
        );
        outs.push(check_group(&group, &spec, &refs, 1000 + seed).await);
    }
    for (id, out) in &outs[1] {
        let d = rel_diff(out, &outs[0][id]);
        assert!(d <= 1e-6, "{id}: 3 threads differ from 1 by {d:.3e}");
    }
}

/// Two steps in flight (`--steps-ahead 1`): the leader sends the next step while the one before
/// runs. Every request against the reference, unary and stream, in steps of 16 tokens, so the
/// requests take many steps; the same outputs as one step at a time; and the leader says it
/// started steps ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_steps_in_flight_match_the_reference() {
    let (preset, seed) = ("tiny-deepseek", 15);
    let spec = synthetic::preset(preset).unwrap();
    let refs = reference(&spec, seed);
    let mut outs = Vec::new();
    // One step at a time, two in flight, and two in flight with four ring slots (the next step
    // packed while one is answered and two run).
    for (ahead, slots) in [("0", "2"), ("1", "2"), ("1", "4")] {
        let flags = ["--steps-ahead", ahead, "--ring-slots", slots];
        let group = launch(2, preset, seed, MAX_TOKENS, &flags);
        outs.push(check_group(&group, &spec, &refs, 1000 + seed).await);
        let addr = &group.metrics_addrs(2)[0];
        let leader = prom::scrape(addr);
        let started_ahead = prom::sum(&leader, "epserve_steps_submitted_ahead_total", &[]);
        match ahead {
            "0" => assert_eq!(started_ahead, 0.0),
            _ => assert!(started_ahead > 0.0, "no step was started ahead"),
        }
        // Every step was packed and delivered once (the warm-up step too). A step's delivery is
        // timed after its answers, so it may trail them a moment.
        let steps = prom::sum(&leader, "epserve_steps_total", &[("kind", "work")]);
        let packed = prom::sum(&leader, "epserve_step_pack_seconds_count", &[]);
        assert_eq!(packed, steps, "steps packed");
        let until = Instant::now() + Duration::from_secs(5);
        let delivered = loop {
            let n = prom::sum(
                &prom::scrape(addr),
                "epserve_step_deliver_seconds_count",
                &[],
            );
            if n >= steps || Instant::now() > until {
                break n;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(delivered, steps, "steps delivered");
    }
    for out in &outs[1..] {
        for (id, o) in out {
            let d = rel_diff(o, &outs[0][id]);
            assert!(
                d <= 1e-6,
                "{id}: steps in flight differ from one at a time by {d:.3e}"
            );
        }
    }
}

/// Answers of a MiB or more are written into buffers kept from earlier answers. Requests of
/// 4,400 down to 4,100 tokens in f32 (over 1 MiB out each), one after another, each shorter than
/// the one before so that it lands in that one's buffer, in steps of 512 tokens so that each is
/// filled over several steps: every token against the reference, so a row the delivery missed
/// would show the earlier answer's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_and_answers_reuse_buffers_and_match_the_reference() {
    let (preset, seed) = ("tiny", 16);
    let spec = synthetic::preset(preset).unwrap();
    let refs = reference(&spec, seed);
    let group = launch(2, preset, seed, 512, &[]);
    let mut client = group.client().await;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let h = spec.hidden;
    let sizes = [4400usize, 4300, 4200, 4100];
    for (i, n) in sizes.into_iter().enumerate() {
        let x: Vec<f32> = (0..n * h).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let req = request(
            &format!("big-{i}"),
            spec.moe_layers[0],
            f32_tensor(&x, [n, h]),
        );
        let resp = client.forward(req).await.expect("forward").into_inner();
        let out = decode(resp.output.as_ref().unwrap());
        assert_eq!(out.len(), n * h, "big-{i}");
        let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let (err, excluded) = compare(&spec, &refs[0], &x, &out, None);
        assert!(err <= 1e-5, "big-{i}: max relative error {err:.3e}");
        assert!(excluded * 100 <= n, "big-{i}: {excluded} near-tie rows");
    }
    let leader = prom::scrape(&group.metrics_addrs(2)[0]);
    let reused = prom::sum(&leader, "epserve_output_buffers_reused_total", &[]);
    assert_eq!(reused, (sizes.len() - 1) as f64, "answers in a kept buffer");
    // The requests (over 1 MiB each) were read by the unary path into kept buffers too. A request
    // lets its buffer go once its step is done with it, which may be a moment after its answer
    // left: at least one of the three that followed found one.
    let reused = prom::sum(&leader, "epserve_request_buffers_reused_total", &[]);
    assert!(
        (1.0..=(sizes.len() - 1) as f64).contains(&reused),
        "requests in a kept buffer: {reused}"
    );
}
