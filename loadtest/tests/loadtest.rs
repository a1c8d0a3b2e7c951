//! The load generator against a real rank group and against a deliberately slowed echo service.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use epserve_loadtest::config::{Api, Dtype, Tokens};
use epserve_loadtest::echo::{self, Echo};
use epserve_loadtest::load::{self, Mode, Plan};
use epserve_loadtest::workload::{Shape, Workload};

/// The epserve binary of this workspace, built if needed.
fn epserve_bin() -> String {
    let out = Command::new(env!("CARGO"))
        .args([
            "build",
            "-p",
            "epserve",
            "--bin",
            "epserve",
            "--message-format",
            "json",
        ])
        .stderr(Stdio::null())
        .output()
        .expect("cargo build epserve");
    assert!(out.status.success(), "building epserve failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            v.get("executable")
                .and_then(|e| e.as_str())
                .map(String::from)
        })
        .next_back()
        .expect("the epserve executable")
}

/// `epserve launch` on free ports (the address first served at, each rank's /metrics); killed
/// on drop.
struct Group(Child, String, std::path::PathBuf, Vec<String>);

impl Group {
    fn launch(extra: &[&str]) -> Self {
        let shm = std::env::temp_dir().join(format!(
            "epserve-loadtest-{}-{}",
            std::process::id(),
            extra.len()
        ));
        std::fs::create_dir_all(&shm).unwrap();
        let mut child = Command::new(epserve_bin())
            .args([
                "launch",
                "--ranks",
                "2",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(["--shm-dir", &shm.display().to_string()])
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let (tx, rx) = std::sync::mpsc::channel();
        let (mtx, mrx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                if let Some(a) = l.split("serving gRPC on ").nth(1) {
                    let _ = tx.send(a.trim().to_string());
                }
                if let Some(m) = l.split(" metrics on http://").nth(1) {
                    let _ = mtx.send(m.trim().to_string());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the group serves");
        let metrics = (0..2)
            .filter_map(|_| mrx.recv_timeout(Duration::from_secs(5)).ok())
            .collect();
        Group(child, addr, shm, metrics)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.2);
    }
}

fn plan(mode: Mode, api: Api, secs: f64) -> Plan {
    Plan {
        http2: Default::default(),
        mode,
        api,
        warmup: Duration::from_millis(200),
        duration: Duration::from_secs_f64(secs),
        timeout: Duration::from_secs(10),
        connections: 2,
        max_in_flight: 100_000,
    }
}

async fn model_info(addr: &str) -> epserve::proto::ModelInfo {
    let mut c =
        epserve::proto::moe_service_client::MoeServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
    c.get_model_info(epserve::proto::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner()
}

async fn shape(addr: &str) -> Shape {
    Shape::from_info(&model_info(addr).await, None).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_add_up_against_a_rank_group() {
    // Two requests admitted at a time against eight clients: some are refused, all are counted.
    let group = Group::launch(&["--max-concurrent-requests", "2", "--allow-client-shm"]);
    let s = shape(&group.1).await;
    for (api, mode) in [
        (Api::Unary, Mode::Closed(8)),
        (Api::Stream, Mode::Closed(8)),
        (Api::Unary, Mode::Open(400.0)),
        (Api::KserveShm, Mode::Closed(8)),
    ] {
        let w = Workload::new(
            s.clone(),
            Tokens::Uniform(1, 40),
            Dtype::Bf16,
            true,
            None,
            3,
        );
        let r = load::run(&group.1, &plan(mode, api, 1.0), w, 3)
            .await
            .unwrap();
        let total: u64 = r.statuses.values().sum();
        assert_eq!(
            r.sent, total,
            "{api:?} {mode:?}: sent != sum of statuses {:?}",
            r.statuses
        );
        assert_eq!(
            r.ok,
            r.statuses.get("OK").copied().unwrap_or(0),
            "{api:?}: {:?}",
            r.statuses
        );
        assert!(r.ok > 0 && r.latency_ms.p50 > 0.0, "{:?}", r.statuses);
        assert!(
            !r.statuses.contains_key("BAD_RESPONSE"),
            "every answer had the asked shape and dtype"
        );
        let other: Vec<_> = r
            .statuses
            .keys()
            .filter(|k| *k != "OK" && *k != "RESOURCE_EXHAUSTED")
            .collect();
        assert!(other.is_empty(), "{api:?}: {:?}", r.statuses);
        if matches!(mode, Mode::Closed(_)) {
            assert!(
                r.statuses.get("RESOURCE_EXHAUSTED").copied().unwrap_or(0) > 0,
                "{api:?}: the admission bound was never hit"
            );
        }
    }
}

/// `epserve_requests_total` of one rank, all labels together.
fn requests_at(metrics_url: &str) -> f64 {
    let (host, path) = metrics_url.split_once('/').unwrap();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    use std::io::{Read, Write};
    write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.lines()
        .filter(|l| l.starts_with("epserve_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_targets_share_the_load_evenly() {
    let group = Group::launch(&["--ingress", "all"]);
    let info = model_info(&group.1).await;
    let addrs: Vec<String> = info.ingress.iter().map(|a| a.address.clone()).collect();
    assert_eq!(addrs.len(), 2, "{:?}", info.ingress);
    let s = shape(&addrs[0]).await;
    let w = Workload::new(s, Tokens::Uniform(1, 40), Dtype::Bf16, true, None, 5);
    let r = load::run(
        &addrs.join(","),
        &plan(Mode::Closed(8), Api::Unary, 1.0),
        w,
        5,
    )
    .await
    .unwrap();
    assert_eq!(
        r.statuses.keys().collect::<Vec<_>>(),
        vec!["OK"],
        "{:?}",
        r.statuses
    );
    assert_eq!(group.3.len(), 2, "both ranks' metrics addresses");
    let per_rank: Vec<f64> = group.3.iter().map(|m| requests_at(m)).collect();
    let total: f64 = per_rank.iter().sum();
    assert!(
        total >= r.ok as f64,
        "{per_rank:?} against {} answered",
        r.ok
    );
    for n in &per_rank {
        assert!(*n >= 0.4 * total, "uneven: {per_rank:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_keeps_its_rate_when_the_server_is_slow() {
    let delay = Duration::from_millis(200);
    let addr = echo::spawn(
        "127.0.0.1:0".parse().unwrap(),
        Echo { hidden: 64, delay },
        &Default::default(),
    )
    .await
    .unwrap()
    .to_string();
    let s = shape(&addr).await;
    let (rate, secs) = (100.0, 2.0);
    let w = Workload::new(s.clone(), Tokens::Fixed(4), Dtype::F32, false, None, 5);
    let open = load::run(&addr, &plan(Mode::Open(rate), Api::Unary, secs), w, 5)
        .await
        .unwrap();
    // Poisson arrivals: 200 expected, standard deviation about 14.
    let expected = rate * secs;
    assert!(
        (open.sent as f64 - expected).abs() < 0.25 * expected,
        "sent {} at {rate}/s for {secs}s",
        open.sent
    );
    assert_eq!(open.ok, open.sent);
    assert!(
        open.latency_ms.p50 >= delay.as_secs_f64() * 1000.0,
        "latency grows: {:?}",
        open.latency_ms
    );
    // A closed loop against the same server falls to clients / delay instead.
    let w = Workload::new(s, Tokens::Fixed(4), Dtype::F32, false, None, 5);
    let closed = load::run(&addr, &plan(Mode::Closed(4), Api::Unary, secs), w, 5)
        .await
        .unwrap();
    assert!(
        closed.sent_per_s < 0.5 * rate,
        "closed loop sent {}/s",
        closed.sent_per_s
    );
}

#[test]
fn the_cli_sweeps_and_writes_svg_and_json() {
    let dir = std::env::temp_dir().join(format!("epserve-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (svg, json) = (dir.join("s.svg"), dir.join("s.json"));
    let out = Command::new(env!("CARGO_BIN_EXE_epserve-loadtest"))
        .args([
            "--echo",
            "--sweep",
            "--sweep-start",
            "100",
            "--sweep-max-steps",
            "3",
            "--warmup",
            "100ms",
            "--duration",
            "400ms",
        ])
        .args([
            "--svg",
            &svg.display().to_string(),
            "--json",
            &json.display().to_string(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(
        s.starts_with("<svg") && s.contains("p99"),
        "not an SVG with the p99 line"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let points = v["points"].as_array().unwrap();
    assert!(!points.is_empty());
    for p in points {
        let total: u64 = p["statuses"]
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_u64().unwrap())
            .sum();
        assert_eq!(p["sent"].as_u64().unwrap(), total);
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_epserve-loadtest"))
        .args(["--target", "x:1"])
        .output()
        .unwrap();
    assert_eq!(
        bad.status.code(),
        Some(2),
        "missing load shape is a usage error"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--skew S` through a model's gate: its hidden states route the Zipf-popular experts (the
/// first rank's block) to at least twice the mean rows of a rank at S = 1.5, and evenly at 0.
#[test]
fn skewed_hidden_states_route_through_the_models_gate() {
    use epserve::model::routing::Router;
    use epserve::model::synthetic;
    use epserve_loadtest::workload::Skewed;
    let spec = synthetic::preset("small-deepseek").unwrap();
    let (h, e, k) = (spec.hidden, spec.num_experts, spec.top_k);
    let layer = synthetic::layer(&spec, 0, 1, 0..0);
    let shape = Shape {
        hidden: h,
        layer: 1,
        top_k: k,
        experts: e,
    };
    let per_rank = |s: f64| {
        let skew = Skewed::load(s, Some("synthetic:small-deepseek"), 0, &shape).unwrap();
        assert_eq!(skew.router.as_deref(), Some(&layer.router[..]));
        let mut w = Workload::new(
            shape.clone(),
            Tokens::Fixed(64),
            Dtype::F32,
            false,
            Some(skew),
            9,
        );
        let mut rows = [0usize; 4];
        let (mut router, mut ids, mut wts) = (Router::default(), vec![0i32; k], vec![0f32; k]);
        for i in 0..16 {
            let item = w.next(i.to_string());
            let data = &item.request.hidden_states.as_ref().unwrap().data;
            let x: Vec<f32> = data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            for t in x.chunks_exact(h) {
                let logits: Vec<f32> = (0..e)
                    .map(|g| {
                        t.iter()
                            .zip(&layer.router[g * h..(g + 1) * h])
                            .map(|(a, b)| a * b)
                            .sum()
                    })
                    .collect();
                router.route(
                    &spec.routing,
                    &logits,
                    layer.bias.as_deref(),
                    &mut ids,
                    &mut wts,
                );
                ids.iter().for_each(|&g| rows[g as usize / (e / 4)] += 1);
            }
        }
        let mean = rows.iter().sum::<usize>() as f64 / 4.0;
        *rows.iter().max().unwrap() as f64 / mean
    };
    let (even, skewed) = (per_rank(0.0), per_rank(1.5));
    assert!(even < 1.25, "S = 0: busiest rank {even:.2}x the mean");
    assert!(skewed >= 2.0, "S = 1.5: busiest rank {skewed:.2}x the mean");
}

/// A closed loop that runs longer than its requests' deadline (+5 s, the drain's bound) ends
/// with its report: the drain is timed from the end of the run, not from its start (on 2x H100
/// every 40 s run with a 20 s deadline ended "requests still in flight" and wrote nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_loop_longer_than_its_deadline_reports() {
    let addr = echo::spawn(
        "127.0.0.1:0".parse().unwrap(),
        Echo {
            hidden: 64,
            delay: Duration::from_millis(20),
        },
        &Default::default(),
    )
    .await
    .unwrap()
    .to_string();
    let s = shape(&addr).await;
    let w = Workload::new(s, Tokens::Fixed(4), Dtype::F32, false, None, 5);
    let mut p = plan(Mode::Closed(2), Api::Unary, 6.5);
    p.timeout = Duration::from_millis(500);
    let r = load::run(&addr, &p, w, 5).await.unwrap();
    assert!(r.ok > 0 && r.ok == r.sent, "{} of {} OK", r.ok, r.sent);
}
