//! Serving behaviour with real rank groups: backpressure, deadlines, cancellation, health tiers,
//! drain, fail-fast on rank loss, and metrics that add up.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::prom::{scrape, sum};
use common::*;
use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::{ForwardRequest, ProbeRequest};
use tokio::task::JoinSet;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const H: usize = 64;

fn req(id: &str, layer: u32, n: usize) -> ForwardRequest {
    let x: Vec<f32> = (0..n * H)
        .map(|i| ((i * 31) % 97) as f32 / 50.0 - 1.0)
        .collect();
    request(id, layer, f32_tensor(&x, [n, H]))
}

async fn health(addr: &str, service: &str) -> Option<i32> {
    let ch = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .ok()?;
    let r = HealthClient::new(ch)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .ok()?;
    Some(r.into_inner().status)
}

async fn wait_health(addr: &str, service: &str, want: ServingStatus, within: Duration) {
    let end = Instant::now() + within;
    while health(addr, service).await != Some(want as i32) {
        assert!(Instant::now() < end, "'{service}' never became {want:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .map_or(0, |v| v.parse::<u64>().unwrap() * 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_gets_only_resource_exhausted_and_memory_stays_bounded() {
    let (max_requests, max_tokens, n) = (16usize, 1024usize, 256usize);
    let group = Group::launch(
        2,
        "synthetic:tiny",
        &[
            "--max-concurrent-requests",
            &max_requests.to_string(),
            "--max-queued-tokens",
            &max_tokens.to_string(),
        ],
    );
    let leader = group.proc.rank_pid(0);
    let worker = group.proc.rank_pid(1);
    let c = group.client().await;
    let base = rss(leader);
    // Stall the group so nothing drains: capacity is exactly what admission allows.
    kill(worker, "STOP");
    let payload = req("flood", 0, n);
    let offered = 1200usize;
    let mut tasks = JoinSet::new();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(base));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss(leader), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    for i in 0..offered {
        let (mut c, r) = (
            c.clone(),
            ForwardRequest {
                id: i.to_string(),
                ..payload.clone()
            },
        );
        tasks.spawn(async move {
            let t0 = Instant::now();
            let r = c.forward(r).await;
            (r.map(|_| ()).map_err(|s| s.code()), t0.elapsed())
        });
    }
    // Let every request reach the leader; the admitted ones wait behind the stalled rank.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    kill(worker, "CONT");
    let mut codes: HashMap<String, usize> = HashMap::new();
    while let Some(r) = tasks.join_next().await {
        let (r, took) = r.unwrap();
        if let Err(Code::ResourceExhausted) = r {
            assert!(took < Duration::from_secs(5), "a refusal took {took:?}");
        }
        *codes
            .entry(format!("{:?}", r.err().unwrap_or(Code::Ok)))
            .or_default() += 1;
    }
    sampler.abort();
    let admitted = max_tokens / n;
    assert_eq!(codes.get("Ok"), Some(&admitted), "{codes:?}");
    assert_eq!(
        codes.get("ResourceExhausted"),
        Some(&(offered - admitted)),
        "{codes:?}"
    );
    // Bound from the flags: queued tokens as f32 in and out, plus requests being decoded
    // (at most max-concurrent-requests past admission, and hyper's 200 streams per connection),
    // plus a fixed allowance for buffers and the allocator.
    let request_bytes = (n * H * 4) as u64;
    let bound =
        (max_tokens * H * 8) as u64 + (200 + max_requests as u64) * request_bytes * 2 + (24 << 20);
    let grew = peak
        .load(std::sync::atomic::Ordering::Relaxed)
        .saturating_sub(base);
    assert!(
        grew < bound,
        "leader grew {grew} B under a flood of {} B; bound {bound} B",
        offered as u64 * request_bytes
    );
    let mut c = c.clone();
    for i in 0..5 {
        c.forward(req(&format!("after-{i}"), 1, 33))
            .await
            .expect("normal requests after the flood");
    }
}

/// The leader's metric, by name and labels.
fn leader_metric(group: &Group, name: &str, with: &[(&str, &str)]) -> f64 {
    sum(&scrape(&group.metrics_addrs(2)[0]), name, with)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_expire_in_the_queue_and_cancelled_streams_free_their_tokens() {
    let group = Group::launch(2, "synthetic:tiny", &[]);
    let worker = group.proc.rank_pid(1);
    let mut c = group.client().await;
    kill(worker, "STOP");
    // This one enters a step and waits there for the stopped rank.
    let mut blocked = c.clone();
    let first = tokio::spawn(async move { blocked.forward(req("first", 0, 2)).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // 1 ms deadline behind the stalled step. tonic's client would enforce the deadline itself;
    // a raw call sends only the grpc-timeout header, so the answer seen is the server's own.
    let (status, message) = raw_forward(&group.addr, &req("late", 1, 3), "1m").await;
    assert_eq!(status, Code::DeadlineExceeded as i32, "{message}");

    // A stream's queued requests hold tokens until the client cancels the stream.
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    for i in 0..5 {
        tx.send(req(&format!("s{i}"), 1, 10)).await.unwrap();
    }
    let stream = c
        .forward_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let end = Instant::now() + Duration::from_secs(5);
    while leader_metric(&group, "epserve_queue_tokens", &[]) < 50.0 {
        assert!(Instant::now() < end, "the stream's tokens never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(stream);
    drop(tx);
    let end = Instant::now() + Duration::from_secs(3);
    while leader_metric(&group, "epserve_queue_tokens", &[]) > 0.0 {
        assert!(
            Instant::now() < end,
            "cancelling the stream did not free its queued tokens"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    kill(worker, "CONT");
    first
        .await
        .unwrap()
        .expect("the request inside the stalled step completes");
    c.forward(req("again", 0, 4)).await.unwrap();
    // Nothing of layer 1 ever reached a step: not the late request, not the cancelled stream.
    assert_eq!(
        leader_metric(&group, "epserve_step_tokens_total", &[("layer", "1")]),
        0.0
    );
    assert!(
        leader_metric(
            &group,
            "epserve_requests_total",
            &[("status", "DEADLINE_EXCEEDED")]
        ) >= 1.0
    );
    assert!(leader_metric(&group, "epserve_step_tokens_total", &[("layer", "0")]) >= 6.0);
}

/// One unary Forward over plain HTTP/2 with a `grpc-timeout` header and no client-side timer;
/// returns the server's grpc-status and grpc-message.
async fn raw_forward(addr: &str, r: &ForwardRequest, timeout: &str) -> (i32, String) {
    let msg = prost::Message::encode_to_vec(r);
    let mut framed = vec![0u8];
    framed.extend((msg.len() as u32).to_be_bytes());
    framed.extend(msg);
    let path = "/epserve.v1.MoeService/Forward";
    raw_unary(addr, path, &[("grpc-timeout", timeout)], framed).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_start_serve_and_drain_and_liveness_follows_a_stopped_rank() {
    let shm = TempDir::new("health");
    let serve = |rank: usize, rendezvous: &str| serve(rank, 2, rendezvous, &shm, FAST_LIVENESS);
    let mut r0 = serve(0, "127.0.0.1:0");
    let rendezvous = r0
        .wait_for("epserve-rendezvous ", Duration::from_secs(30))
        .unwrap();
    let addr = r0
        .wait_for("gRPC listening on", Duration::from_secs(30))
        .unwrap();
    let addr = addr.split(',').next().unwrap().to_string();
    // Up, but the group is not formed: NOT_SERVING, and requests are refused as unavailable.
    wait_health(&addr, "", ServingStatus::NotServing, Duration::from_secs(5)).await;
    wait_health(
        &addr,
        "epserve.v1.MoeService",
        ServingStatus::NotServing,
        Duration::from_secs(5),
    )
    .await;
    let mut c = MoeServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    assert_eq!(
        c.forward(req("early", 0, 1)).await.unwrap_err().code(),
        Code::Unavailable
    );
    let mut r1 = serve(1, &rendezvous);
    wait_health(&addr, "", ServingStatus::Serving, Duration::from_secs(30)).await;
    wait_health(
        &addr,
        "epserve.v1.MoeService",
        ServingStatus::Serving,
        Duration::from_secs(1),
    )
    .await;
    wait_health(
        &addr,
        "liveness",
        ServingStatus::Serving,
        Duration::from_secs(1),
    )
    .await;
    let probe = c.probe(ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.world_size, 2);

    // A stopped rank stalls the heartbeat step: liveness goes NOT_SERVING, and back.
    let worker = r1.child.id();
    kill(worker, "STOP");
    wait_health(
        &addr,
        "liveness",
        ServingStatus::NotServing,
        Duration::from_secs(5),
    )
    .await;
    // Drain: a request inside the stalled step, then SIGTERM to both ranks (as Kubernetes does).
    let mut inside = c.clone();
    let admitted = tokio::spawn(async move { inside.forward(req("admitted", 0, 3)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    r0.signal("TERM");
    kill(worker, "TERM");
    wait_health(&addr, "", ServingStatus::NotServing, Duration::from_secs(5)).await;
    let refused = c.forward(req("new", 0, 1)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable);
    assert!(refused.message().contains("draining"), "{refused:?}");
    kill(worker, "CONT");
    admitted
        .await
        .unwrap()
        .expect("an admitted request is answered during the drain");
    for p in [&mut r0, &mut r1] {
        let st = p
            .wait_exit(Duration::from_secs(10))
            .expect("exits after the drain");
        assert!(st.success(), "{st}: {}", p.log_text());
    }
}

/// An error a client saw: code, message, when.
type ClientError = (Code, String, Instant);

/// Clients in a loop until they get an error; returns each error with when it arrived.
fn load(c: &MoeServiceClient<Channel>, clients: usize) -> JoinSet<(usize, Vec<ClientError>)> {
    let mut tasks = JoinSet::new();
    for i in 0..clients {
        let mut c = c.clone();
        tasks.spawn(async move {
            let (mut ok, mut errs) = (0, Vec::new());
            for j in 0.. {
                match c
                    .forward(req(
                        &format!("{i}-{j}"),
                        (j % 2) as u32,
                        1 + (i * 7 + j) % 40,
                    ))
                    .await
                {
                    Ok(_) => ok += 1,
                    Err(s) => {
                        errs.push((s.code(), s.message().to_string(), Instant::now()));
                        break;
                    }
                }
            }
            (ok, errs)
        });
    }
    tasks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_answers_everything_admitted_and_exits_zero() {
    drain_under_load(&[]).await;
}

/// As above with two steps in flight (`--steps-ahead 1`): the leader sends a step while the one
/// before runs, and the drain still answers every admitted request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_two_steps_in_flight_answers_everything_admitted() {
    drain_under_load(&["--steps-ahead", "1"]).await;
}

async fn drain_under_load(extra: &[&str]) {
    let mut args = vec!["--drain-timeout", "10s"];
    args.extend_from_slice(extra);
    let mut group = Group::launch(2, "synthetic:tiny", &args);
    let c = group.client().await;
    let mut tasks = load(&c, 16);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    group.proc.signal("TERM");
    let (mut ok, mut refused) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        let (n, errs) = r.unwrap();
        ok += n;
        for (code, msg, _) in errs {
            assert_eq!(code, Code::Unavailable, "{msg}");
            // A refusal of new work (draining, or the port closed after the grace), never an
            // admitted request that failed.
            let new_work =
                msg.contains("draining") || msg.contains("connect") || msg.contains("transport");
            assert!(
                new_work,
                "an admitted request failed during the drain: {msg}"
            );
            refused += 1;
        }
    }
    assert!(ok > 0 && refused == 16, "ok {ok}, refused {refused}");
    let st = group
        .proc
        .wait_exit(Duration::from_secs(10))
        .expect("the group exits within the drain timeout");
    assert!(st.success(), "{}", group.proc.log_text());
    assert!(t0.elapsed() < Duration::from_secs(10));
}

/// Kills (or stops) one rank under load; every client must get UNAVAILABLE within the step
/// timeout plus a second, and the whole group must exit non-zero.
async fn rank_loss(rank: usize, sig: &str, extra: &[&str]) {
    let step_timeout = Duration::from_secs(2);
    let mut args = vec!["--step-timeout", "2s", "--heartbeat-interval", "200ms"];
    args.extend_from_slice(extra);
    let mut group = Group::launch(4, "synthetic:tiny-qwen3", &args);
    let c = group.client().await;
    let pids: Vec<u32> = (0..4).map(|r| group.proc.rank_pid(r)).collect();
    let mut tasks = load(&c, 8);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let killed = Instant::now();
    kill(pids[rank], sig);
    let mut named = 0;
    while let Some(r) = tasks.join_next().await {
        let (_, errs) = r.unwrap();
        let (code, msg, at) = errs
            .into_iter()
            .next()
            .expect("every client ends with an error");
        assert!(
            at - killed <= step_timeout + Duration::from_secs(1),
            "{sig} rank {rank}: answered after {:?}",
            at - killed
        );
        if rank == 0 {
            // No server is left to answer: what the client sees is its library's report of the
            // dropped connection (tonic: UNAVAILABLE, or CANCELLED / UNKNOWN "transport error",
            // or an h2 error reading the body of a response cut off mid-way), and promptly.
            let transport = code == Code::Unavailable
                || msg.contains("transport")
                || msg.contains("canceled")
                || msg.contains("error reading a body from connection");
            assert!(transport, "{sig} leader: {code:?} {msg}");
            continue;
        }
        assert_eq!(code, Code::Unavailable, "{sig} rank {rank}: {msg}");
        // The leader names the lost rank; requests sent after it stopped see a closed port. The
        // launcher stops the group when it sees the rank exit, so a request can also reach the
        // leader after that stop and before its own failure detection: refused as draining.
        if msg.contains(&format!("rank {rank}")) {
            named += 1;
        } else {
            assert!(
                msg.contains("connect") || msg.contains("transport") || msg.starts_with("draining"),
                "{sig} rank {rank}: {msg}"
            );
        }
    }
    assert!(
        rank == 0 || named > 0,
        "no client was told which rank was lost:\n{}",
        group.proc.log_text()
    );
    let st = group
        .proc
        .wait_exit(Duration::from_secs(15))
        .expect("the launcher exits");
    assert!(!st.success());
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}/cmdline")).exists() || zombie(pid),
            "rank pid {pid} still running"
        );
    }
}

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.split_whitespace().nth(2) == Some("Z"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_worker_fails_fast() {
    rank_loss(2, "KILL", &[]).await;
}

/// A rank lost with two steps in flight (`--steps-ahead 1`): both steps' clients are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_worker_with_two_steps_in_flight_fails_fast() {
    rank_loss(2, "KILL", &["--steps-ahead", "1"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_of_a_worker_with_two_steps_in_flight_fails_fast() {
    rank_loss(1, "STOP", &["--steps-ahead", "1"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_router_fails_fast() {
    rank_loss(0, "KILL", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_of_a_worker_fails_fast() {
    rank_loss(1, "STOP", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_of_every_rank_parse_and_add_up() {
    let world = 2;
    let group = Group::launch(
        world,
        "synthetic:tiny",
        &[
            "--metrics-per-expert",
            "--max-concurrent-requests",
            "77",
            "--max-queued-tokens",
            "5000",
        ],
    );
    let addrs = group.metrics_addrs(world);
    // Before any request: every known label value at 0, the configured limits, process_*.
    let first = scrape(&addrs[0]);
    let value = |name: &str, with: &[(&str, &str)]| {
        let hits: Vec<f64> = first
            .iter()
            .filter(|x| {
                x.name == name
                    && with
                        .iter()
                        .all(|(k, v)| x.labels.get(*k).is_some_and(|l| l == v))
            })
            .map(|x| x.value)
            .collect();
        assert_eq!(hits.len(), 1, "{name} {with:?}: {hits:?}");
        hits[0]
    };
    for &reason in epserve::rejections::REJECTION_REASONS {
        assert_eq!(
            value("epserve_rejections_total", &[("reason", reason)]),
            0.0
        );
    }
    for &method in epserve::api::METHODS {
        for &status in epserve::api::STATUSES {
            let with = [("method", method), ("status", status)];
            assert_eq!(value("epserve_requests_total", &with), 0.0);
        }
    }
    for d in ["in", "out"] {
        assert_eq!(value("epserve_shm_bytes_total", &[("direction", d)]), 0.0);
    }
    assert_eq!(value("epserve_limit_max_concurrent_requests", &[]), 77.0);
    assert_eq!(value("epserve_limit_max_queued_tokens", &[]), 5000.0);
    assert_eq!(value("epserve_admitted_requests", &[]), 0.0);
    assert_eq!(value("epserve_requests_running", &[]), 0.0);
    assert_eq!(value("epserve_startup_stage", &[("stage", "ready")]), 1.0);
    assert!(value("process_resident_memory_bytes", &[]) > 0.0);
    assert!(value("process_open_fds", &[]) > 0.0);
    table_lists_every_metric(&addrs);
    let total = |name: &str, with: &[(&str, &str)]| -> f64 {
        addrs.iter().map(|a| sum(&scrape(a), name, with)).sum()
    };
    let before_expert: Vec<f64> = (0..8)
        .map(|e| {
            total(
                "epserve_expert_tokens_total",
                &[("layer", "1"), ("expert", &e.to_string())],
            )
        })
        .collect();
    let before_tokens = total("epserve_request_tokens_total", &[]);
    let before_ok = total(
        "epserve_requests_total",
        &[("method", "Forward"), ("status", "OK")],
    );
    let before_steps1 = total("epserve_step_tokens_total", &[("layer", "1")]);
    let mut c = group.client().await;
    let mut expect = [0f64; 8];
    let mut sent = 0usize;
    for i in 0..20usize {
        let n = 1 + i * 3;
        let ids: Vec<i32> = (0..n)
            .flat_map(|t| [((t + i) % 8) as i32, ((t + i + 3) % 8) as i32])
            .collect();
        ids.iter().for_each(|&e| expect[e as usize] += 1.0);
        let mut r = req(&format!("m{i}"), 1, n);
        r.topk_ids = Some(i32_tensor(&ids, [n, 2]));
        r.topk_weights = Some(f32_tensor(&vec![0.5; 2 * n], [n, 2]));
        c.forward(r).await.unwrap();
        sent += n;
    }
    let bad = c.forward(req("bad", 7, 1)).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    for a in &addrs {
        let s = scrape(a);
        assert!(
            sum(&s, "epserve_build_info", &[]) == 1.0
                && sum(&s, "epserve_group_info", &[("world_size", "2")]) == 1.0,
            "{a}"
        );
        assert!(s
            .iter()
            .any(|x| x.name == "epserve_step_phase_seconds_bucket"
                && x.labels.get("phase").is_some_and(|p| p == "dispatch")));
    }
    assert_eq!(
        total(
            "epserve_requests_total",
            &[("method", "Forward"), ("status", "OK")]
        ) - before_ok,
        20.0
    );
    assert_eq!(
        total(
            "epserve_requests_total",
            &[("method", "Forward"), ("status", "INVALID_ARGUMENT")]
        ),
        1.0
    );
    assert_eq!(
        total(
            "epserve_rejections_total",
            &[("reason", "invalid_argument")]
        ),
        1.0
    );
    assert_eq!(
        total("epserve_request_tokens_total", &[]) - before_tokens,
        sent as f64
    );
    // Every request answered, the good and the bad: none still counts as running.
    assert_eq!(total("epserve_requests_running", &[]), 0.0);
    assert_eq!(
        total("epserve_step_tokens_total", &[("layer", "1")]) - before_steps1,
        sent as f64 * world as f64,
        "every rank counts each step's tokens"
    );
    for (e, want) in expect.iter().enumerate() {
        let got = total(
            "epserve_expert_tokens_total",
            &[("layer", "1"), ("expert", &e.to_string())],
        ) - before_expert[e];
        assert_eq!(got, *want, "expert {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_timeout_past_eight_digits_is_refused_not_a_panic() {
    let group = Group::launch(2, "synthetic:tiny", &[]);
    for bad in ["123456789S", "S", "12x", "-5m", "10"] {
        let (status, message) = raw_forward(&group.addr, &req("t", 0, 2), bad).await;
        assert_eq!(status, Code::InvalidArgument as i32, "{bad}: {message}");
        assert!(message.contains("grpc-timeout"), "{bad}: {message}");
    }
    // Eight digits of hours is valid (and far off): served.
    let (status, message) = raw_forward(&group.addr, &req("t", 0, 2), "99999999H").await;
    assert_eq!(status, 0, "{message}");
    group
        .client()
        .await
        .forward(req("after", 0, 3))
        .await
        .unwrap();
}

/// A ForwardStream client that sends 1M tokens and never reads: the stream stops being read once
/// its in-flight answers wait for the client (HTTP/2 flow control holds the sends), the leader's
/// memory stays within the queue bound, and once the client reads, every answer comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_is_not_read_is_held_by_flow_control_not_leader_memory() {
    let (n, in_flight, max_tokens) = (256usize, 16usize, 4096usize);
    let total_tokens = 1usize << 20;
    let group = Group::launch(
        2,
        "synthetic:tiny",
        &[
            "--max-stream-in-flight",
            &in_flight.to_string(),
            "--max-queued-tokens",
            &max_tokens.to_string(),
        ],
    );
    let leader = group.proc.rank_pid(0);
    let mut c = group.client().await;
    let one = req("x", 0, n);
    let want = decode(
        &c.forward(one.clone())
            .await
            .unwrap()
            .into_inner()
            .output
            .unwrap(),
    );
    let base = rss(leader);
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = sent.clone();
    let requests = tokio_stream::iter(0..total_tokens / n).map(move |i| {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ForwardRequest {
            id: i.to_string(),
            ..one.clone()
        }
    });
    let mut answers = c.forward_stream(requests).await.unwrap().into_inner();
    let mut peak = base;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        peak = peak.max(rss(leader));
    }
    let taken = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        taken < total_tokens / n / 4,
        "{taken} requests were taken from a client that reads nothing"
    );
    // The queue's bound (f32 in and out), the stream's in-flight answers encoded, HTTP/2 windows
    // and a fixed allowance.
    let request_bytes = (n * H * 4) as u64;
    let bound = (max_tokens * H * 8) as u64 + in_flight as u64 * request_bytes * 2 + (24 << 20);
    let grew = peak.saturating_sub(base);
    assert!(grew < bound, "leader grew {grew} B; bound {bound} B");
    // Now read: the stream serves on, every answer right.
    for i in 0..200 {
        let a = answers
            .next()
            .await
            .unwrap_or_else(|| panic!("stream ended after {i} answers"))
            .unwrap();
        assert!(a.error.is_none(), "{:?}", a.error);
        let got = decode(&a.output.unwrap());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst <= 1e-5, "answer {} differs by {worst}", a.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_message_that_cannot_be_decoded_ends_the_stream_with_its_status() {
    let group = Group::launch(2, "synthetic:tiny", &["--max-request-bytes", "65536"]);
    let mut c = group.client().await;
    let items = vec![req("small", 0, 4), req("huge", 0, 1024), req("never", 0, 4)];
    let mut s = c
        .forward_stream(tokio_stream::iter(items))
        .await
        .unwrap()
        .into_inner();
    let first = s.next().await.unwrap().unwrap();
    assert_eq!((first.id.as_str(), first.error), ("small", None));
    let end = s.next().await.unwrap().unwrap_err();
    assert_eq!(end.code(), Code::OutOfRange, "{end:?}");
    assert!(
        end.message().contains("message length too large"),
        "{end:?}"
    );
    assert!(s.next().await.is_none());
    c.forward(req("after", 0, 3)).await.unwrap();
}

/// Every `epserve_*` series the ranks export is a row of the metrics table
/// (`epserve::metric_names`, README's table) with its type.
fn table_lists_every_metric(addrs: &[String]) {
    let rows: std::collections::BTreeMap<&str, &str> = epserve::metric_names::TABLE
        .iter()
        .map(|m| (m.name, m.kind.name()))
        .collect();
    let mut wrong = Vec::new();
    for a in addrs {
        for line in common::prom::scrape_text(a).lines() {
            let Some(t) = line.strip_prefix("# TYPE epserve_") else {
                continue;
            };
            let (name, kind) = t.split_once(' ').unwrap();
            let name = format!("epserve_{name}");
            match rows.get(name.as_str()) {
                Some(&k) if k == kind => {}
                other => wrong.push(format!("{name} is a {kind}; the table says {other:?}")),
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
