//! `--ingress all` with real rank groups: every rank serves, the same input gives the same output
//! at every rank and as with leader ingress (and as the f64 reference); concurrent load at every
//! rank is all answered; a drain and a rank failure answer every client of every rank; a trickle
//! at one rank is not starved by a flood at another. The same on two simulated nodes
//! (`launch --nodes 2`), and a node killed or stopped.

mod common;

use std::time::{Duration, Instant};

use common::reference::{compare, RefLayer};
use common::*;
use epserve::model::{synthetic, MoeSpec};
use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::{ForwardRequest, GetModelInfoRequest};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::task::JoinSet;
use tonic::transport::Channel;
use tonic::Code;

const PRESET: &str = "tiny-deepseek";
const SEED: u64 = 21;
/// Small steps, so requests split over several and ranks' offers interleave.
const MAX_TOKENS: &str = "16";

fn flags(ingress: &str) -> Vec<&str> {
    vec![
        "--seed",
        "21",
        "--max-tokens-per-step",
        MAX_TOKENS,
        "--ingress",
        ingress,
    ]
}

async fn client(addr: &str) -> MoeServiceClient<Channel> {
    MoeServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(64 << 20)
}

/// Every rank's address, by rank, as GetModelInfo tells a client (each rank tells the same).
async fn ingress(group: &Group, ranks: usize) -> Vec<String> {
    let info = client(&group.addr)
        .await
        .get_model_info(GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.ingress_mode, "all");
    let addrs: Vec<String> = info.ingress.iter().map(|a| a.address.clone()).collect();
    assert_eq!(addrs.len(), ranks, "{:?}", info.ingress);
    assert_eq!(info.rank_nodes.len(), ranks, "{:?}", info.rank_nodes);
    for (r, a) in info.ingress.iter().enumerate() {
        assert_eq!(a.rank as usize, r);
        let theirs = client(&a.address)
            .await
            .get_model_info(GetModelInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(theirs.ingress, info.ingress, "rank {r} tells another list");
        assert_eq!(
            theirs.rank_nodes, info.rank_nodes,
            "rank {r} tells other nodes"
        );
    }
    addrs
}

struct Case {
    req: ForwardRequest,
    x: Vec<f64>,
    slot: usize,
    routing: Option<(Vec<usize>, Vec<f64>)>,
}

/// Random f32 requests of every MoE layer, 1 to 37 tokens, gating or client routing.
fn cases(spec: &MoeSpec, rng: &mut ChaCha8Rng, count: usize, tag: &str) -> Vec<Case> {
    let (h, k, e) = (spec.hidden, spec.top_k, spec.num_experts);
    (0..count)
        .map(|i| {
            let slot = i % spec.moe_layers.len();
            let n = [1, 7, 37, 4][(i / 2) % 4];
            let x: Vec<f32> = (0..n * h).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let mut req = request(
                &format!("{tag}-{i}"),
                spec.moe_layers[slot],
                f32_tensor(&x, [n, h]),
            );
            let routing = (i % 3 == 2).then(|| client_routing(&mut req, rng, n, k, e));
            Case {
                req,
                x: x.iter().map(|&v| f64::from(v)).collect(),
                slot,
                routing,
            }
        })
        .collect()
}

fn refs(spec: &MoeSpec) -> Vec<RefLayer> {
    spec.moe_layers
        .iter()
        .map(|&l| {
            RefLayer::from_weights(
                &synthetic::layer(spec, SEED, l, 0..spec.num_experts),
                spec.hidden,
            )
        })
        .collect()
}

/// Sends every case to `addr`, all at once; the f32 outputs, in order.
async fn send_all(addr: &str, cases: &[Case]) -> Vec<Vec<f32>> {
    let c = client(addr).await;
    let mut tasks = JoinSet::new();
    for (i, case) in cases.iter().enumerate() {
        let (mut c, r) = (c.clone(), case.req.clone());
        tasks.spawn(async move { (i, c.forward(r).await) });
    }
    let mut out = vec![Vec::new(); cases.len()];
    while let Some(r) = tasks.join_next().await {
        let (i, resp) = r.unwrap();
        let resp = resp.unwrap_or_else(|s| panic!("{addr} {}: {s}", cases[i].req.id));
        out[i] = decode(resp.into_inner().output.as_ref().unwrap());
    }
    out
}

fn check(spec: &MoeSpec, refs: &[RefLayer], case: &Case, out: &[f32], at: &str) {
    let routing = case.routing.as_ref().map(|(i, w)| (&i[..], &w[..]));
    let (err, excluded) = compare(spec, &refs[case.slot], &case.x, out, routing);
    assert!(
        err <= 1e-5,
        "{at} {}: error {err:.3e} against f64",
        case.req.id
    );
    assert!(
        excluded * 4 <= case.x.len() / spec.hidden + 1,
        "{}: near-ties",
        case.req.id
    );
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rank_answers_as_the_leader_does_and_as_the_reference() {
    let spec = synthetic::preset(PRESET).unwrap();
    let refs = refs(&spec);
    let cases = cases(&spec, &mut ChaCha8Rng::seed_from_u64(5), 24, "same");
    let model = format!("synthetic:{PRESET}");
    let routed = {
        let group = Group::launch(4, &model, &flags("leader"));
        send_all(&group.addr, &cases).await
    };
    // On one node, and on two (`--nodes 2`: the flags cross nodes, the rows stay home).
    for nodes in ["1", "2"] {
        let mut f = flags("all");
        f.extend(["--nodes", nodes]);
        let group = Group::launch(4, &model, &f);
        every_rank_at_once(&group, &spec, &refs, &cases, &routed, nodes).await;
    }
}

/// Every rank of `group` sent every case at once (their requests share steps): each answer
/// against the reference and against `routed`, leader ingress's on one node.
async fn every_rank_at_once(
    group: &Group,
    spec: &MoeSpec,
    refs: &[RefLayer],
    cases: &[Case],
    routed: &[Vec<f32>],
    nodes: &str,
) {
    let addrs = ingress(group, 4).await;
    let mut tasks = JoinSet::new();
    for (r, a) in addrs.iter().enumerate() {
        let a = a.clone();
        let cs: Vec<Case> = cases
            .iter()
            .map(|c| Case {
                req: c.req.clone(),
                x: Vec::new(),
                slot: 0,
                routing: None,
            })
            .collect();
        tasks.spawn(async move { (r, send_all(&a, &cs).await) });
    }
    while let Some(r) = tasks.join_next().await {
        let (rank, outs) = r.unwrap();
        for ((case, out), want) in cases.iter().zip(&outs).zip(routed) {
            check(
                spec,
                refs,
                case,
                out,
                &format!("{nodes} node(s), rank {rank}"),
            );
            let d = max_diff(out, want);
            assert!(
                d <= 1e-6,
                "{nodes} node(s), rank {rank} {}: {d:e} from leader ingress on one node",
                case.req.id
            );
        }
    }
}

/// `service`'s health at `addr`.
async fn health(addr: &str, service: &str) -> i32 {
    let ch = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic_health::pb::health_client::HealthClient::new(ch)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map_or(-1, |r| r.into_inner().status)
}

const SERVING: i32 = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
const NOT_SERVING: i32 = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rank_serves_the_whole_surface() {
    use epserve::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
    use epserve::inference::model_infer_request::InferInputTensor;
    use epserve::inference::ModelInferRequest;
    let spec = synthetic::preset(PRESET).unwrap();
    let group = Group::launch(4, &format!("synthetic:{PRESET}"), &flags("all"));
    let addrs = ingress(&group, 4).await;
    // 7 tokens of the second layer, gated (KServe has no client routing here).
    let case = cases(&spec, &mut ChaCha8Rng::seed_from_u64(9), 4, "surface").remove(3);
    assert!(case.routing.is_none());
    let (n, h) = (case.x.len() / spec.hidden, spec.hidden);
    let x: Vec<u8> = case
        .x
        .iter()
        .flat_map(|&v| (v as f32).to_le_bytes())
        .collect();
    for (r, a) in addrs.iter().enumerate() {
        for service in [
            "",
            "epserve.v1.MoeService",
            "inference.GRPCInferenceService",
            "liveness",
        ] {
            assert_eq!(health(a, service).await, SERVING, "rank {r} '{service}'");
        }
        let ch = Channel::from_shared(format!("http://{a}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let names = reflected_services(ch.clone()).await;
        for service in ["epserve.v1.MoeService", "inference.GRPCInferenceService"] {
            assert!(names.contains(&service.to_string()), "rank {r}: {names:?}");
        }
        // The same rows through KServe v2 and epserve.v1 at this rank.
        let forward = client(a)
            .await
            .forward(case.req.clone())
            .await
            .unwrap()
            .into_inner();
        let want = decode(forward.output.as_ref().unwrap());
        let k = ModelInferRequest {
            model_name: format!("layer-{}", spec.moe_layers[case.slot]),
            id: "kserve".into(),
            inputs: vec![InferInputTensor {
                name: "hidden_states".into(),
                datatype: "FP32".into(),
                shape: vec![n as i64, h as i64],
                ..Default::default()
            }],
            raw_input_contents: vec![x.clone().into()],
            ..Default::default()
        };
        let got = GrpcInferenceServiceClient::new(ch)
            .max_decoding_message_size(64 << 20)
            .model_infer(k)
            .await
            .unwrap_or_else(|s| panic!("rank {r} KServe: {s}"))
            .into_inner();
        let out: Vec<f32> = got.raw_output_contents[0]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert!(
            max_diff(&out, &want) <= 1e-6,
            "rank {r}: KServe differs from Forward"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_load_at_every_rank_is_all_answered() {
    for nodes in ["1", "2"] {
        load_at_every_rank(nodes).await;
    }
}

async fn load_at_every_rank(nodes: &str) {
    let spec = synthetic::preset(PRESET).unwrap();
    let refs = refs(&spec);
    let mut f = flags("all");
    f.extend(["--nodes", nodes]);
    let group = Group::launch(4, &format!("synthetic:{PRESET}"), &f);
    let addrs = ingress(&group, 4).await;
    let mut tasks = JoinSet::new();
    for (r, a) in addrs.iter().enumerate() {
        // 8 clients per rank, 6 requests each.
        for c in 0..8 {
            let a = a.clone();
            let cs = cases(
                &spec,
                &mut ChaCha8Rng::seed_from_u64((r * 8 + c) as u64),
                6,
                &format!("r{r}c{c}"),
            );
            tasks.spawn(async move {
                let mut cl = client(&a).await;
                let mut outs = Vec::new();
                for case in &cs {
                    let resp = cl.forward(case.req.clone()).await;
                    let resp = resp.unwrap_or_else(|s| panic!("{}: {s}", case.req.id));
                    outs.push(decode(resp.into_inner().output.as_ref().unwrap()));
                }
                (r, cs, outs)
            });
        }
    }
    let mut answered = 0;
    while let Some(t) = tasks.join_next().await {
        let (rank, cs, outs) = t.unwrap();
        for (case, out) in cs.iter().zip(&outs) {
            check(
                &spec,
                &refs,
                case,
                out,
                &format!("{nodes} node(s), rank {rank}"),
            );
            answered += 1;
        }
    }
    assert_eq!(answered, 4 * 8 * 6);
}

const H: usize = 64;

fn small(id: &str, layer: u32, n: usize) -> ForwardRequest {
    let x: Vec<f32> = (0..n * H)
        .map(|i| ((i * 31) % 97) as f32 / 50.0 - 1.0)
        .collect();
    request(id, layer, f32_tensor(&x, [n, H]))
}

/// What one looping client saw: answers, then the error that ended it and when.
type Ended = (usize, usize, Code, String, Instant);

/// `clients` looping clients at every address until each gets an error.
fn load_everywhere(addrs: &[String], clients: usize, layers: &[u32]) -> JoinSet<Ended> {
    let mut tasks = JoinSet::new();
    for (r, a) in addrs.iter().enumerate() {
        for i in 0..clients {
            let (a, layers) = (a.clone(), layers.to_vec());
            tasks.spawn(async move {
                let mut c = client(&a).await;
                for j in 0.. {
                    let layer = layers[(i + j) % layers.len()];
                    if let Err(s) = c
                        .forward(small(&format!("{r}-{i}-{j}"), layer, 1 + (i * 7 + j) % 20))
                        .await
                    {
                        return (r, j, s.code(), s.message().to_string(), Instant::now());
                    }
                }
                unreachable!()
            });
        }
    }
    tasks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_at_any_rank_drains_every_rank_and_answers_everything_admitted() {
    for nodes in ["1", "2"] {
        drain_at_rank_2(nodes).await;
    }
}

/// SIGTERM at rank 2 (on the second node of two): every rank drains and exits 0.
async fn drain_at_rank_2(nodes: &str) {
    let spec = synthetic::preset("tiny").unwrap();
    assert_eq!(spec.hidden, H);
    let mut group = Group::launch(
        4,
        "synthetic:tiny",
        &[
            "--ingress",
            "all",
            "--drain-timeout",
            "10s",
            "--nodes",
            nodes,
        ],
    );
    let addrs = ingress(&group, 4).await;
    let mut tasks = load_everywhere(&addrs, 4, &spec.moe_layers);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    // A worker's SIGTERM drains the whole group (as when every pod of it is told to stop).
    kill(group.proc.rank_pid(2), "TERM");
    let mut per_rank = [0usize; 4];
    while let Some(t) = tasks.join_next().await {
        let (rank, ok, code, msg, _) = t.unwrap();
        per_rank[rank] += ok;
        assert_eq!(code, Code::Unavailable, "rank {rank}: {msg}");
        let new_work =
            msg.contains("draining") || msg.contains("connect") || msg.contains("transport");
        assert!(
            new_work,
            "rank {rank}: an admitted request failed during the drain: {msg}"
        );
    }
    assert!(
        per_rank.iter().all(|&n| n > 0),
        "answers per rank {per_rank:?}"
    );
    let st = group
        .proc
        .wait_exit(Duration::from_secs(15))
        .expect("the group exits within the drain timeout");
    assert!(st.success(), "{}", group.proc.log_text());
    assert!(t0.elapsed() < Duration::from_secs(15));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_rank_answers_every_client_of_every_rank() {
    lose(&["--nodes", "1"], &[2], "KILL").await;
}

/// kill -9 of the second node's ranks (2 and 3) of two: every client of the first node is
/// answered within the step timeout plus a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_answers_every_client_of_every_node() {
    lose(&["--nodes", "2"], &[2, 3], "KILL").await;
}

/// SIGSTOP of the second node's ranks (a partitioned node: connections up, nothing answers):
/// every client of the first node is answered within the step timeout plus a second; the
/// stopped ranks' own clients when the launcher kills them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_node_answers_every_client_of_the_other_node() {
    lose(&["--nodes", "2"], &[2, 3], "STOP").await;
}

/// Whether `msg` names rank `r`: alone ("rank 2") or in a list ("ranks 1, 2, 3 had not
/// finished", as the leader says when a stopped node holds up a live rank of its own node).
fn names_rank(msg: &str, r: usize) -> bool {
    msg.contains(&format!("rank {r}"))
        || msg.split("ranks ").skip(1).any(|tail| {
            tail.split(|c: char| !(c.is_ascii_digit() || c == ',' || c == ' '))
                .next()
                .unwrap_or("")
                .split(',')
                .any(|x| x.trim() == r.to_string())
        })
}

/// Sends `sig` to `lost` under load at every rank; every other rank's clients are answered
/// UNAVAILABLE within the step timeout (2 s) plus a second, some of them naming a lost rank;
/// the launcher exits non-zero.
async fn lose(extra: &[&str], lost: &[usize], sig: &str) {
    let spec = synthetic::preset("tiny").unwrap();
    let mut flags = vec![
        "--ingress",
        "all",
        "--step-timeout",
        "2s",
        "--heartbeat-interval",
        "200ms",
        "--shutdown-grace",
        "3s",
    ];
    flags.extend_from_slice(extra);
    let mut group = Group::launch(4, "synthetic:tiny", &flags);
    let addrs = ingress(&group, 4).await;
    let pids: Vec<u32> = (0..4).map(|r| group.proc.rank_pid(r)).collect();
    let mut tasks = load_everywhere(&addrs, 4, &spec.moe_layers);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let killed = Instant::now();
    for &r in lost {
        kill(pids[r], sig);
    }
    // Every other rank's readiness turns NOT_SERVING (its port stays up for the grace).
    for (r, a) in addrs.iter().enumerate().filter(|(r, _)| !lost.contains(r)) {
        while health(a, "").await != NOT_SERVING {
            assert!(
                killed.elapsed() < Duration::from_secs(3),
                "rank {r} still ready"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut named = 0;
    while let Some(t) = tasks.join_next().await {
        let (rank, _, code, msg, at) = t.unwrap();
        // A stopped rank's own clients wait for it: nothing there can answer them.
        let stopped = sig == "STOP" && lost.contains(&rank);
        assert!(
            stopped || at - killed <= Duration::from_secs(3),
            "rank {rank}'s client answered after {:?}: {code:?} {msg}\n{}",
            at - killed,
            group.proc.log_text()
        );
        if lost.contains(&rank) {
            // Its own server is gone: the client library reports the dropped connection.
            continue;
        }
        assert_eq!(code, Code::Unavailable, "rank {rank}: {msg}");
        if lost.iter().any(|&r| names_rank(&msg, r)) {
            named += 1;
        }
    }
    assert!(
        named > 0,
        "no client was told which rank was lost:\n{}",
        group.proc.log_text()
    );
    let st = group
        .proc
        .wait_exit(Duration::from_secs(15))
        .expect("the launcher exits");
    assert!(!st.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickle_at_one_rank_is_not_starved_by_a_flood_at_another() {
    let spec = synthetic::preset("tiny").unwrap();
    let group = Group::launch(
        4,
        "synthetic:tiny",
        &["--ingress", "all", "--max-tokens-per-step", "16"],
    );
    let addrs = ingress(&group, 4).await;
    let (flood_layer, trickle_layer) = (spec.moe_layers[0], spec.moe_layers[1]);
    let stop = Instant::now() + Duration::from_secs(3);
    // The flood: 32 clients at rank 0, each request 40 tokens of one layer (10 steps' worth of
    // rank 0's slice), always more queued than a step takes.
    let mut flood = JoinSet::new();
    for i in 0..32 {
        let a = addrs[0].clone();
        flood.spawn(async move {
            let mut c = client(&a).await;
            let mut n = 0;
            while Instant::now() < stop {
                c.forward(small(&format!("f{i}-{n}"), flood_layer, 40))
                    .await
                    .unwrap();
                n += 1;
            }
            n
        });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The trickle: one client at rank 3, one token of another layer at a time.
    let mut c = client(&addrs[3]).await;
    let (mut worst, mut answered) = (Duration::ZERO, 0);
    while Instant::now() + Duration::from_millis(200) < stop {
        let t = Instant::now();
        c.forward(small(&format!("t{answered}"), trickle_layer, 1))
            .await
            .unwrap();
        worst = worst.max(t.elapsed());
        answered += 1;
    }
    let mut flooded = 0;
    while let Some(n) = flood.join_next().await {
        flooded += n.unwrap();
    }
    // Each trickle request waits for at most the steps already formed (two) and its own: tens of
    // milliseconds here, while one flood request waits behind the whole queue.
    assert!(flooded > 32, "the flood ran ({flooded} answered)");
    assert!(
        answered >= 10,
        "{answered} trickle requests answered in ~2.5 s"
    );
    assert!(
        worst < Duration::from_millis(500),
        "a trickle request waited {worst:?}"
    );
}

#[test]
fn a_rank_is_named_alone_or_in_a_list() {
    let leader =
        "step 95: rank 1 did not finish: timed out after 1.99s (ranks 1, 2, 3 had not finished)";
    assert!(names_rank(leader, 2) && names_rank(leader, 3) && names_rank(leader, 1));
    assert!(!names_rank(leader, 0) && !names_rank(leader, 9));
    assert!(names_rank(
        "waiting for combined rows from rank 2: timed out",
        2
    ));
    assert!(!names_rank("the EP group is broken", 2) && !names_rank("ranks 12, 13", 2));
}
