//! Expert slots and online load balancing (EPLB) on the cpu backend. A DeepSeek-V3-shaped FP8
//! checkpoint on 4 ranks with one redundant slot per rank, under hidden states that send the
//! busiest rank at least 2x the mean routed rows: the balancer's placement brings the rows per
//! rank (the ranks' own counters, and `epserve_rank_load_ratio`) within 1.15 of the mean; every
//! token of every answer stays within 1e-5 of the f64 reference before, during and after 20
//! placements, with no failed request; moved weights are the checkpoint's bytes.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::checkpoint::{fp8_reference, write_model, Arch};
use common::loss::Tally;
use common::prom::{scrape, sum};
use common::reference::{compare_tokens, route, RefLayer};
use common::*;
use epserve::eplb::SlotMap;
use epserve::model::{ExpertDtype, ModelSource, MoeSpec};
use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::GetModelInfoRequest;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tonic::transport::Channel;

const RANKS: usize = 4;
const SEED: u64 = 54;

/// `n` tokens: two in three pulled towards the `hot` experts (their router rows added, scaled),
/// the rest uniform.
fn skewed(
    rng: &mut ChaCha8Rng,
    spec: &MoeSpec,
    layer: &RefLayer,
    hot: &[usize],
    n: usize,
) -> Vec<f32> {
    let h = spec.hidden;
    let mut x: Vec<f32> = (0..n * h).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    for t in (0..n).filter(|t| t % 3 != 0) {
        for &g in hot {
            let row = &layer.router[g * h..(g + 1) * h];
            for (v, r) in x[t * h..(t + 1) * h].iter_mut().zip(row) {
                *v += (3.0 * r) as f32;
            }
        }
    }
    x
}

/// Routed rows per rank of `x` under `map` (an expert's rows split evenly over its replicas),
/// by the reference's routing.
fn rows_under(map: &SlotMap, spec: &MoeSpec, layer: &RefLayer, x: &[f32]) -> Vec<f64> {
    let mut rows = vec![0.0; RANKS];
    for t in x.chunks(spec.hidden) {
        let xs: Vec<f64> = t.iter().map(|&v| f64::from(v)).collect();
        for g in route(spec, layer, &xs).0 {
            let replicas = map.layer(0).replicas(g);
            for &s in replicas {
                rows[map.rank_of(s as usize)] += 1.0 / replicas.len() as f64;
            }
        }
    }
    rows
}

fn ratio(rows: &[f64]) -> f64 {
    let mean = rows.iter().sum::<f64>() / rows.len() as f64;
    rows.iter().copied().fold(0.0, f64::max) / mean
}

/// Routed rows each rank has received so far (its per-slot counters summed).
fn rank_rows(metrics: &[String]) -> Vec<f64> {
    metrics
        .iter()
        .map(|a| sum(&scrape(a), "epserve_expert_tokens_total", &[]))
        .collect()
}

fn leader_value(metrics: &[String], name: &str, with: &[(&str, &str)]) -> f64 {
    sum(&scrape(&metrics[0]), name, with)
}

/// Rows per rank over `d` of traffic, from the ranks' counters.
async fn rows_over(metrics: &[String], d: Duration) -> Vec<f64> {
    let a = rank_rows(metrics);
    tokio::time::sleep(d).await;
    let b = rank_rows(metrics);
    b.iter().zip(&a).map(|(b, a)| b - a).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placements_follow_skewed_load_and_outputs_stay_exact() {
    let dir = TempDir::new("eplb");
    let a = Arch::deepseek_fp8_128(3);
    let (spec, mut refs) = write_model(&dir.0, &a, SEED);
    fp8_reference(&mut refs, &a);
    // The skew as the reference routes it, on the starting placement (each rank's block and the
    // next block's first expert): the busiest rank gets >= 2x the mean rows.
    let start = SlotMap::contiguous(16, RANKS, 4, 1).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(SEED);
    let probe = skewed(&mut rng, &spec, &refs[0], &[4, 5, 6, 7], 240);
    let rows = rows_under(&start, &spec, &refs[0], &probe);
    assert!(ratio(&rows) >= 2.0, "not skewed enough: {rows:?}");

    let group = Group::launch(
        RANKS,
        &dir.0.display().to_string(),
        &[
            "--redundant-experts",
            "4",
            "--eplb-interval",
            "2s",
            "--eplb-window",
            "200",
            "--metrics-per-expert",
            "--max-tokens-per-step",
            "64",
        ],
    );
    let metrics = group.metrics_addrs(RANKS);
    let mut c = group.client().await;
    let info = model_info(&mut c).await;
    assert_eq!((info.redundant_experts, info.slots_per_rank), (4, 5));
    assert_eq!(info.placement_epoch, 0);
    assert_eq!(info.layer_placement.len(), spec.moe_layers.len());
    assert_eq!(
        info.layer_placement[0].phy2log,
        start.layer(0).phy2log(),
        "each rank's block, then the next block's first expert"
    );

    // Clients: steady load, every token checked against the reference.
    // Rank 1's block, in every layer.
    let hot = Arc::new(Mutex::new(vec![vec![4, 5, 6, 7]; spec.moe_layers.len()]));
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let spec = Arc::new(spec);
    let refs = Arc::new(refs);
    let mut clients = Vec::new();
    for i in 0..3u64 {
        let (hot, stop, tally) = (hot.clone(), stop.clone(), tally.clone());
        let (spec, refs, mut c) = (spec.clone(), refs.clone(), group.client().await);
        clients.push(tokio::spawn(async move {
            let mut rng = ChaCha8Rng::seed_from_u64(SEED + 10 + i);
            let mut sent = 0usize;
            while !stop.load(Ordering::Acquire) {
                let slot = sent % spec.moe_layers.len();
                let layer = spec.moe_layers[slot];
                let n = 16 + (sent % 3) * 8;
                let b = hot.lock().unwrap()[slot].clone();
                let x = skewed(&mut rng, &spec, &refs[slot], &b, n);
                let id = format!("c{i}-{sent}");
                sent += 1;
                let r = c
                    .forward(request(&id, layer, f32_tensor(&x, [n, spec.hidden])))
                    .await;
                let out = match r {
                    Ok(r) => decode(r.into_inner().output.as_ref().unwrap()),
                    Err(e) => {
                        // The first failure fails the test: this client stops here.
                        tally.failures.lock().unwrap().push(format!("{id}: {e:?}"));
                        return;
                    }
                };
                let xs: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
                let (err, token, excluded) = compare_tokens(&spec, &refs[slot], &xs, &out, None);
                if err > 1e-5 {
                    let msg = format!("{id} (hot {b:?}): token {token} is {err:.3e} off");
                    tally.failures.lock().unwrap().push(msg);
                }
                tally.answers.fetch_add(1, Ordering::Relaxed);
                tally.tokens.fetch_add(n, Ordering::Relaxed);
                tally.excluded.fetch_add(excluded, Ordering::Relaxed);
            }
        }));
    }

    // Before the first placement (the balancer's first look is 2 s after the group is ready):
    // the ranks' own counters show the skew, unless the balancer already moved.
    let before = rows_over(&metrics, Duration::from_millis(1000)).await;
    let rebalances = || leader_value(&metrics, "epserve_eplb_rebalances_total", &[]);
    if rebalances() == 0.0 {
        assert!(ratio(&before) >= 2.0, "rows per rank before: {before:?}");
    }
    let end = Instant::now() + Duration::from_secs(240);
    while rebalances() < 1.0 {
        assert!(
            Instant::now() < end,
            "no placement applied\n{}",
            group.proc.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // After it, with the same hot experts: rows per rank within 1.15 of the mean.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = rows_over(&metrics, Duration::from_millis(1500)).await;
    assert!(
        ratio(&after) <= 1.15,
        "rows per rank after: {after:?} (before {before:?})"
    );
    for layer in &spec.moe_layers {
        let l = layer.to_string();
        let gauge = leader_value(&metrics, "epserve_rank_load_ratio", &[("layer", &l)]);
        assert!(gauge <= 1.15, "layer {l}: epserve_rank_load_ratio {gauge}");
        let most = leader_value(&metrics, "epserve_expert_replicas", &[("layer", &l)]);
        assert!(most >= 2.0, "layer {l}: hot experts replicated ({most})");
    }

    // Each time a placement lands, the hot experts become those one rank now holds (the next
    // rank each time): 20 placements under steady load.
    let mut seen = 0.0;
    while seen < 20.0 {
        assert!(
            Instant::now() < end,
            "{seen} placements applied\n{}",
            group.proc.log_text()
        );
        let now = rebalances();
        if now == seen {
            tokio::time::sleep(Duration::from_millis(50)).await;
        } else {
            seen = now;
            let info = model_info(&mut c).await;
            let rank = now as usize % RANKS;
            let per = info.slots_per_rank as usize;
            let sets = (info.layer_placement.iter())
                .map(|l| {
                    let mut g: Vec<usize> = l.phy2log[rank * per..(rank + 1) * per]
                        .iter()
                        .map(|&g| g as usize)
                        .collect();
                    g.sort();
                    g.dedup();
                    g
                })
                .collect();
            *hot.lock().unwrap() = sets;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Release);
    for c in clients {
        c.await.unwrap();
    }
    let failures = tally.failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    let (answers, tokens) = (
        tally.answers.load(Ordering::Relaxed),
        tally.tokens.load(Ordering::Relaxed),
    );
    let excluded = tally.excluded.load(Ordering::Relaxed);
    assert!(
        answers >= 40 && excluded * 100 <= tokens,
        "{answers} answers, {excluded} of {tokens} near-ties"
    );
    let moved = leader_value(&metrics, "epserve_eplb_moved_bytes_total", &[]);
    assert!(moved > 0.0, "placements moved no bytes");
    let info = model_info(&mut c).await;
    assert!(info.placement_epoch >= 20, "epoch {}", info.placement_epoch);
    for l in &info.layer_placement {
        SlotMap::from_tables(16, RANKS, vec![l.phy2log.clone()]).unwrap();
    }
    eprintln!(
        "{seen} placements, {answers} answers of {tokens} tokens, {moved} bytes moved; rows per rank before {before:?}, after {after:?}"
    );
}

/// A slot's weights read again for a move are the bytes the rank loaded at startup: FP8 bytes and
/// scales as the checkpoint ships them, or bf16-held values; a synthetic model's made again (and
/// quantized for FP8) the same, in the order asked, though made in parallel.
#[test]
fn moved_weights_are_the_checkpoints_bytes() {
    let dir = TempDir::new("eplb-bytes");
    let (spec, _) = write_model(&dir.0, &Arch::deepseek_fp8_128(3), SEED);
    let checkpoint = ModelSource::parse(&dir.0.display().to_string(), 0).unwrap();
    let synthetic = ModelSource::parse("synthetic:small-deepseek", 0).unwrap();
    let small = synthetic.spec().unwrap();
    let sources = [(&checkpoint, &spec), (&synthetic, &small)];
    for ((source, spec), dtype) in sources
        .into_iter()
        .flat_map(|s| [(s, ExpertDtype::Fp8), (s, ExpertDtype::Bf16)])
    {
        let all: Vec<Vec<usize>> = vec![(0..spec.num_experts).collect(); spec.moe_layers.len()];
        let loaded = source.load(spec, &all, dtype, &mut |_| {}).unwrap();
        let wanted = [(0, 3), (1, 15), (1, 0), (0, 3)];
        let moved = source.load_experts(spec, &wanted, dtype).unwrap();
        for (&(l, e), m) in wanted.iter().zip(&moved) {
            let at = &loaded.layers[l].experts[e];
            assert_eq!(
                (&m.gate_up, &m.down),
                (&at.gate_up, &at.down),
                "{dtype:?} layer {l} expert {e}"
            );
        }
    }
}

async fn model_info(c: &mut MoeServiceClient<Channel>) -> epserve::proto::ModelInfo {
    let r = c.get_model_info(GetModelInfoRequest {}).await;
    r.unwrap().into_inner()
}

/// Outputs of `n` random tokens on every layer against the reference, per token.
async fn exact(c: &mut MoeServiceClient<Channel>, spec: &MoeSpec, refs: &[RefLayer], seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for (slot, &layer) in spec.moe_layers.iter().enumerate() {
        let n = 37;
        let x: Vec<f32> = (0..n * spec.hidden)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let out = forward_f32(c, "p", layer, &x, spec.hidden).await;
        let xs: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let (err, token, _) = compare_tokens(spec, &refs[slot], &xs, &out, None);
        assert!(err <= 1e-5, "layer {layer}: token {token} is {err:.3e} off");
    }
}

/// `--placement` starts a group on a given placement (checked, the error naming the layer and
/// the expert), and SIGHUP to rank 0 applies the file again once it has changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_file_starts_the_group_and_sighup_applies_it_live() {
    let spec = epserve::model::synthetic::preset("small-deepseek").unwrap();
    let refs: Vec<RefLayer> = (spec.moe_layers.iter())
        .map(|&l| {
            RefLayer::from_weights(
                &epserve::model::synthetic::layer(&spec, 0, l, 0..16),
                spec.hidden,
            )
        })
        .collect();
    let dir = TempDir::new("placement");
    let file = dir.0.join("placement.json");
    let write = |tables: &[Vec<u32>]| {
        let json = serde_json::json!({ "phy2log": tables });
        std::fs::write(&file, json.to_string()).unwrap();
    };
    // A layer that loses expert 5: refused before the group forms.
    let mut bad: Vec<u32> = (0..16).chain([0, 1]).collect();
    bad[5] = 4;
    write(&[(0..18).map(|s| s % 16).collect(), bad]);
    let shm = TempDir::new("shm");
    let f = file.display().to_string();
    let mut p = Proc::spawn(&serve_args(
        &shm,
        &["--model", "synthetic:small-deepseek", "--placement", &f],
    ));
    assert!(p
        .wait_exit(Duration::from_secs(60))
        .is_some_and(|s| !s.success()));
    assert!(
        p.log_text().contains("layer 1: expert 5 has no slot"),
        "{}",
        p.log_text()
    );

    // Rank 0 holds the last block's experts, rank 1 the first's, each with a replica of 0.
    let first: Vec<u32> = (8..16).chain([0]).chain(0..8).chain([0]).collect();
    write(&[first.clone(), first.clone()]);
    let group = Group::launch(2, "synthetic:small-deepseek", &["--placement", &f]);
    let mut c = group.client().await;
    let info = model_info(&mut c).await;
    assert_eq!((info.redundant_experts, info.slots_per_rank), (2, 9));
    assert_eq!(info.layer_placement[1].phy2log, first);
    exact(&mut c, &spec, &refs, 1).await;

    let next: Vec<u32> = (0..16).chain([3, 9]).collect();
    write(&[first.clone(), next.clone()]);
    // Sent to every rank, as a reload to every pod would be: rank 0 applies it, rank 1 lives on.
    kill(group.proc.rank_pid(1), "HUP");
    kill(group.proc.rank_pid(0), "HUP");
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let info = model_info(&mut c).await;
        if info.placement_epoch == 1 {
            assert_eq!(info.layer_placement[0].phy2log, first);
            assert_eq!(info.layer_placement[1].phy2log, next);
            break;
        }
        assert!(
            Instant::now() < end,
            "not applied\n{}",
            group.proc.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    exact(&mut c, &spec, &refs, 2).await;
    // Rank 0 shows the placement and the load it balances from; the other ranks have neither.
    let metrics = group.metrics_addrs(2);
    let (head, body) = get(&metrics[0], "/eplb");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["epoch"], 1);
    assert_eq!(v["layers"][1]["phy2log"], serde_json::json!(next));
    assert_eq!(v["layers"][1]["layer"], spec.moe_layers[1]);
    let rows: u64 = (v["layers"][1]["expert_rows"].as_array().unwrap().iter())
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(
        rows,
        37 * 4,
        "the window holds the one request since the move"
    );
    assert!(get(&metrics[1], "/eplb").0.starts_with("HTTP/1.1 404"));
}

/// `GET path` on `addr`: the status line and headers, and the body.
fn get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}
