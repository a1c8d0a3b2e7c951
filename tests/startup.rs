//! Startup failures: each ends startup on every rank with one clear error line and a non-zero
//! exit, within the rendezvous timeout.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// Waits for a failing exit by `limit`; asserts exactly one ERROR line, containing `needle`.
fn fails_with(p: &mut Proc, needle: &str, limit: Duration) {
    let status = p
        .wait_exit(limit)
        .unwrap_or_else(|| panic!("still running after {limit:?}:\n{}", p.log_text()));
    assert!(!status.success(), "exited 0:\n{}", p.log_text());
    let log = p.log_text();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "want one error line:\n{log}");
    assert!(
        errors[0].contains(needle),
        "error line lacks '{needle}': {}",
        errors[0]
    );
}

/// Rank 0 on rendezvous port 0, and the address it got.
fn leader(world: usize, shm: &TempDir, extra: &[&str]) -> (Proc, String) {
    let mut p = serve(0, world, "127.0.0.1:0", shm, extra);
    let addr = p
        .wait_for("epserve-rendezvous ", Duration::from_secs(20))
        .unwrap();
    (p, addr)
}

#[test]
fn config_mismatch_names_the_field_on_every_rank() {
    let shm = TempDir::new("mismatch");
    let (mut r0, addr) = leader(
        2,
        &shm,
        &["--max-tokens-per-step", "32", "--rendezvous-timeout", "20s"],
    );
    let mut r1 = serve(
        1,
        2,
        &addr,
        &shm,
        &["--max-tokens-per-step", "64", "--rendezvous-timeout", "20s"],
    );
    let want = "config mismatch in 'max_tokens_per_step': rank 1 has 64, rank 0 has 32";
    fails_with(&mut r0, want, Duration::from_secs(20));
    fails_with(&mut r1, want, Duration::from_secs(20));
    let (mut r0, addr) = leader(2, &shm, &["--model", "synthetic:tiny-qwen3"]);
    let mut r1 = serve(1, 2, &addr, &shm, &["--model", "synthetic:tiny"]);
    fails_with(
        &mut r0,
        "config mismatch in 'model'",
        Duration::from_secs(20),
    );
    fails_with(
        &mut r1,
        "config mismatch in 'model'",
        Duration::from_secs(20),
    );
}

#[test]
fn experts_not_divisible_by_ranks() {
    let shm = TempDir::new("div");
    let mut ranks: Vec<Proc> = (0..3)
        .map(|r| serve(r, 3, if r == 0 { "127.0.0.1:0" } else { NOBODY }, &shm, &[]))
        .collect();
    for p in &mut ranks {
        fails_with(
            p,
            "8 experts cannot be split evenly over 3 ranks",
            Duration::from_secs(20),
        );
    }
    // Redundant slots that do not split evenly either.
    let mut ranks: Vec<Proc> = (0..2)
        .map(|r| {
            let at = if r == 0 { "127.0.0.1:0" } else { NOBODY };
            serve(r, 2, at, &shm, &["--redundant-experts", "1"])
        })
        .collect();
    for p in &mut ranks {
        fails_with(
            p,
            "8 experts + --redundant-experts 1 = 9 slots cannot be split evenly over 2 ranks",
            Duration::from_secs(20),
        );
    }
    let args = [
        "launch",
        "--ranks",
        "3",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    let mut launch = Proc::spawn(&args.map(String::from));
    let status = launch
        .wait_exit(Duration::from_secs(20))
        .expect("launch exits");
    assert!(!status.success());
    assert!(
        launch.log_text().contains("cannot be split evenly"),
        "{}",
        launch.log_text()
    );
}

#[test]
fn missing_rank_and_missing_leader_time_out_by_name() {
    let shm = TempDir::new("missing");
    let t0 = Instant::now();
    let flags = |node| ["--rendezvous-timeout", "2s", "--node-id", node];
    let (mut r0, addr) = leader(4, &shm, &flags("node-a"));
    let mut r1 = serve(1, 4, &addr, &shm, &flags("node-b"));
    let want = "rank(s) 2, 3 of world size 4 did not join the rendezvous within 2s \
                (joined: node node-a rank 0; node node-b rank 1)";
    fails_with(&mut r0, want, Duration::from_secs(15));
    fails_with(&mut r1, want, Duration::from_secs(15));
    assert!(
        t0.elapsed() < Duration::from_secs(12),
        "took {:?}",
        t0.elapsed()
    );

    let mut lonely = serve(1, 2, NOBODY, &shm, &["--rendezvous-timeout", "1s"]);
    fails_with(
        &mut lonely,
        &format!("leader (rank 0) at {NOBODY} was not reachable within 1s"),
        Duration::from_secs(10),
    );
}

#[test]
fn unknown_models_list_what_is_supported() {
    let dir = TempDir::new("llama");
    std::fs::write(
        dir.0.join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}"#,
    )
    .unwrap();
    let shm = TempDir::new("unknown");
    let model = dir.0.display().to_string();
    let mut p = serve(0, 1, "127.0.0.1:0", &shm, &["--model", &model]);
    fails_with(
        &mut p,
        "unsupported architecture 'llama'",
        Duration::from_secs(10),
    );
    assert!(p.log_text().contains("qwen3_moe"), "{}", p.log_text());
    let mut p = serve(0, 1, "127.0.0.1:0", &shm, &["--model", "synthetic:nope"]);
    fails_with(
        &mut p,
        "unknown synthetic preset 'nope' (presets: tiny",
        Duration::from_secs(10),
    );
    let mut p = serve(0, 1, "127.0.0.1:0", &shm, &["--model", "/no/such/dir"]);
    fails_with(&mut p, "expected synthetic:NAME", Duration::from_secs(10));
}

#[test]
fn backend_nccl_without_a_gpu_refuses_and_auto_serves_on_cpu() {
    // Only meaningful where the GPU backend cannot run: the CPU-only CI machines.
    if epserve::backend::gpu::available().is_ok() {
        eprintln!("GPU backend available here; nothing to check");
        return;
    }
    let shm = TempDir::new("nogpu");
    let mut p = serve(0, 1, "127.0.0.1:0", &shm, &["--backend", "nccl"]);
    fails_with(
        &mut p,
        "--backend nccl cannot run here",
        Duration::from_secs(20),
    );
    let g = Group::launch(2, "synthetic:tiny", &["--backend", "auto"]);
    assert!(g.proc.log_text().contains("--backend auto: using cpu ("));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let info = rt.block_on(async {
        let mut c = g.client().await;
        c.get_model_info(epserve::proto::GetModelInfoRequest {})
            .await
            .unwrap()
            .into_inner()
    });
    assert_eq!(info.backend, "cpu");
}

#[test]
fn strays_at_the_rendezvous_are_closed_and_the_group_forms() {
    use std::io::Write;
    use std::net::TcpStream;
    let shm = TempDir::new("strays");
    let token = ["--group-token", "s3cret", "--rendezvous-timeout", "60s"];
    // A host name binds the address it resolves to, not every interface.
    let mut r0 = serve(0, 2, "localhost:0", &shm, &token);
    let addr = r0
        .wait_for("epserve-rendezvous ", Duration::from_secs(20))
        .unwrap();
    assert!(addr.starts_with("127.0.0.1:"), "bound {addr}");
    // Before any rank: a connection that says nothing, one that sends garbage, an HTTP probe,
    // and a rank with the wrong token.
    let silent = TcpStream::connect(&addr).unwrap();
    let mut garbage = TcpStream::connect(&addr).unwrap();
    garbage.write_all(b"\x00\x00\x00\x05hello").unwrap();
    let mut http = TcpStream::connect(&addr).unwrap();
    http.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut intruder = serve(1, 2, &addr, &shm, &["--group-token", "guess"]);
    fails_with(
        &mut intruder,
        "wrong or missing group token",
        Duration::from_secs(20),
    );
    // The token from the environment, as from a Kubernetes Secret.
    let mut args = vec![
        "serve",
        "--rank",
        "1",
        "--world-size",
        "2",
        "--rendezvous",
        &addr,
    ];
    let dir = shm.0.display().to_string();
    args.extend([
        "--metrics-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--shm-dir",
        &dir,
    ]);
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let _r1 = Proc::spawn_env(&args, &[("EPSERVE_GROUP_TOKEN", "s3cret")]);
    r0.wait_for("serving gRPC on", Duration::from_secs(60))
        .unwrap();
    let log = r0.log_text();
    for want in ["no hello", "wrong or missing --group-token"] {
        assert!(log.contains(want), "leader log lacks '{want}':\n{log}");
    }
    drop(silent);
}

/// Without `--group-token`, a hello that names no seat of the group (another world size, a rank
/// out of range) is a stray: refused and closed, and the group still forms. (It aborted the
/// group: any local process could stop a forming group with one hello.)
#[test]
fn without_a_token_a_seatless_hello_is_a_stray() {
    let shm = TempDir::new("seatless");
    let (mut r0, addr) = leader(2, &shm, &["--rendezvous-timeout", "60s"]);
    // Ranks of a group of 4 (a real process checks its own rank against its own world size, so
    // an out-of-range rank of this world cannot be started; it takes the same path).
    let mut first = serve(1, 4, &addr, &shm, &["--rendezvous-timeout", "20s"]);
    let mut last = serve(3, 4, &addr, &shm, &["--rendezvous-timeout", "20s"]);
    for p in [&mut first, &mut last] {
        let status = p
            .wait_exit(Duration::from_secs(30))
            .expect("a refused rank exits");
        assert!(!status.success(), "{}", p.log_text());
    }
    let _r1 = serve(1, 2, &addr, &shm, &[]);
    r0.wait_for("serving gRPC on", Duration::from_secs(60))
        .unwrap();
    let log = r0.log_text();
    assert!(
        log.contains("config mismatch: rank 1 has world_size=4, rank 0 has 2")
            && log.contains("config mismatch: rank 3 has world_size=4, rank 0 has 2")
            && log.contains("a stray"),
        "{log}"
    );
}

/// `launch --group-token` hands the token to its ranks in their environment: no rank's command
/// line (what `ps` shows) holds it.
#[test]
fn launch_keeps_the_group_token_off_the_ranks_command_lines() {
    let secret = "not-on-argv-3141";
    let g = Group::launch(2, "synthetic:tiny", &["--group-token", secret]);
    let pids = g.proc.children();
    assert_eq!(pids.len(), 2);
    for pid in pids {
        let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let argv = String::from_utf8_lossy(&argv).replace('\0', " ");
        assert!(argv.contains(" serve "), "{argv}");
        assert!(
            !argv.contains(secret),
            "rank {pid}'s argv holds the token: {argv}"
        );
    }
}

#[test]
fn upload_budgets_that_cannot_read_the_largest_message_are_refused() {
    let shm = TempDir::new("budget");
    for (flags, needle) in [
        (
            ["--upload-budget", "32MiB"],
            "--upload-budget (33554432 bytes) is below --max-request-bytes",
        ),
        (
            ["--upload-connection-share", "1MiB"],
            "--upload-connection-share (1048576 bytes) is below --max-request-bytes",
        ),
    ] {
        let mut p = serve(0, 1, "127.0.0.1:0", &shm, &flags);
        fails_with(&mut p, needle, Duration::from_secs(10));
    }
}

/// The ports come up before the weights load: while a model that takes seconds loads, health
/// answers NOT_SERVING, `/metrics` answers, and the log shows each stage in order with its
/// rank; then the rank serves. A metrics port that is taken fails the start before any weight
/// is loaded, naming the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ports_answer_while_weights_load_and_a_taken_port_fails_first() {
    let shm = TempDir::new("slow-load");
    let slow = [
        "--model",
        "synthetic:qwen3-30b-a3b",
        "--layers",
        "2",
        "--log-stats-interval",
        "1s",
    ];
    let mut args = serve_args(&shm, &slow);
    args.extend(["--rendezvous".to_string(), "127.0.0.1:0".to_string()]);
    let mut p = Proc::spawn(&args);
    let addr = p
        .wait_for("gRPC listening on ", Duration::from_secs(60))
        .unwrap();
    let addr = addr.trim_end_matches(", NOT_SERVING until the group is ready");
    let metrics = p
        .wait_for("rank 0 metrics on http://", Duration::from_secs(5))
        .unwrap()
        .trim_end_matches("/metrics")
        .to_string();
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let mut readiness = async || {
        let req = tonic_health::pb::HealthCheckRequest::default();
        health.check(req).await.unwrap().into_inner().status
    };
    let status = readiness().await;
    let scraped = common::prom::scrape(&metrics);
    let loading = !p.log_text().contains("weights loaded");
    assert!(
        loading,
        "the weights loaded before the ports were checked; the test needs a slower model:\n{}",
        p.log_text()
    );
    assert_eq!(status, 2, "NOT_SERVING while loading");
    assert!(
        scraped
            .iter()
            .any(|s| s.name == "process_cpu_seconds_total"),
        "metrics answer while loading"
    );
    let stage = |scraped: &[common::prom::Sample], name: &str| {
        let of =
            |s: &&common::prom::Sample| s.labels.get("stage").map(String::as_str) == Some(name);
        let at = scraped
            .iter()
            .filter(|s| s.name == "epserve_startup_stage")
            .find(of);
        let took = scraped
            .iter()
            .filter(|s| s.name == "epserve_startup_seconds")
            .find(of);
        (at.map(|s| s.value), took.map(|s| s.value))
    };
    assert_eq!(stage(&scraped, "load").0, Some(1.0), "in the load stage");
    assert_eq!(stage(&scraped, "ready").0, Some(0.0), "not ready yet");
    p.wait_for("serving gRPC on", Duration::from_secs(300))
        .unwrap();
    assert_eq!(readiness().await, 1, "SERVING once the group is ready");
    let scraped = common::prom::scrape(&metrics);
    assert_eq!(stage(&scraped, "ready").0, Some(1.0));
    let (at, took) = stage(&scraped, "load");
    assert_eq!(at, Some(0.0));
    assert!(took.is_some_and(|s| s > 0.0), "load took {took:?}");
    p.wait_for("stats requests=0 ", Duration::from_secs(5))
        .unwrap();
    let log = p.log_text();
    // Every event names its rank and host first (stdout's rendezvous line is not an event).
    for line in log.lines().filter(|l| l.contains("Z  INFO ")) {
        assert!(line.starts_with("rank=0 node="), "no rank on: {line}");
    }
    let at = |needle: &str| {
        log.find(needle)
            .unwrap_or_else(|| panic!("no '{needle}' in the log:\n{log}"))
    };
    let stages = [
        "epserve starting version=",
        "rank 0 metrics on",
        "rank 0 KServe REST on",
        "gRPC listening on",
        "startup: loading weights stage=\"load\"",
        "layers loaded done=2 of=2 bytes=",
        "weights loaded",
        "startup: waiting for every rank to join",
        "startup: setting up the exchange",
        "startup: running the warm-up step",
        "group ready",
        "startup: ready",
        "serving gRPC on",
    ];
    for w in stages.windows(2) {
        assert!(at(w[0]) < at(w[1]), "'{}' before '{}':\n{log}", w[0], w[1]);
    }
    kill(p.child.id(), "INT");
    assert!(p
        .wait_exit(Duration::from_secs(30))
        .is_some_and(|s| s.success()));

    // A taken metrics port: refused before loading, naming the address.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = taken.local_addr().unwrap().to_string();
    let mut args = serve_args(&shm, &slow);
    let i = args.iter().position(|a| a == "--metrics-listen").unwrap();
    args[i + 1] = at.clone();
    args.extend(["--rendezvous".to_string(), "127.0.0.1:0".to_string()]);
    let mut p = Proc::spawn(&args);
    fails_with(
        &mut p,
        &format!("binding the metrics address {at}"),
        Duration::from_secs(30),
    );
    assert!(
        !p.log_text().contains("loading weights"),
        "{}",
        p.log_text()
    );
}

/// Two nodes whose ranks start in reverse order (3, 2, then 1, then the leader last) form the
/// group within the rendezvous timeout and answer; each node its own --node-id and --shm-dir.
#[test]
fn nodes_joining_in_reverse_order_form_the_group() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let dirs = [TempDir::new("node-a"), TempDir::new("node-b")];
    let node = |r: usize| ["a", "b"][r / 2];
    let mut ranks: Vec<(usize, Proc)> = Vec::new();
    for r in [3, 2, 1, 0] {
        let flags = ["--node-id", node(r), "--rendezvous-timeout", "60s"];
        ranks.push((r, serve(r, 4, &addr, &dirs[r / 2], &flags)));
        std::thread::sleep(Duration::from_millis(300));
    }
    let (_, leader) = ranks.iter_mut().find(|(r, _)| *r == 0).unwrap();
    let grpc = leader
        .wait_for("serving gRPC on", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    let log = leader.log_text();
    assert!(
        log.contains("the group's ranks on node b") && log.contains("ranks=[2, 3]"),
        "{log}"
    );
    assert_eq!(forward_rows(&grpc, 3), ["a", "a", "b", "b"]);
}

/// #56 item 7's probe: three stray TCP connections to every rank's data port, each sending
/// nothing, while a 4-rank, 2-node group forms: hellos are read concurrently, so the group forms
/// within a --rendezvous-timeout (10 s) that the strays' 3 x 5 s, read one at a time, outlasted.
#[test]
fn stray_connections_to_the_data_ports_do_not_stop_a_group() {
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let addr = format!("127.0.0.1:{}", free());
    let data: Vec<String> = (0..4).map(|_| format!("127.0.0.1:{}", free())).collect();
    let dirs = [TempDir::new("stray-a"), TempDir::new("stray-b")];
    let node = |r: usize| ["a", "b"][r / 2];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut strays = Vec::new();
    for d in &data {
        for _ in 0..3 {
            let (d, stop) = (d.clone(), stop.clone());
            strays.push(std::thread::spawn(move || {
                // Connects as soon as the port is bound, then holds the connection silent.
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(s) = std::net::TcpStream::connect(&d) {
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        drop(s);
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }));
        }
    }
    let mut ranks: Vec<(usize, Proc)> = Vec::new();
    let t0 = std::time::Instant::now();
    for r in [3, 2, 1, 0] {
        let flags = [
            "--node-id",
            node(r),
            "--rendezvous-timeout",
            "10s",
            "--data-listen",
            &data[r],
        ];
        ranks.push((r, serve(r, 4, &addr, &dirs[r / 2], &flags)));
    }
    let (_, leader) = ranks.iter_mut().find(|(r, _)| *r == 0).unwrap();
    let grpc = leader
        .wait_for("serving gRPC on", Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("formed in {:?} with 3 strays a data port", t0.elapsed());
    assert_eq!(forward_rows(&grpc, 3), ["a", "a", "b", "b"]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for s in strays {
        s.join().unwrap();
    }
}

/// One Forward of `rows` tokens of synthetic:tiny (hidden 64) at `grpc`, answered in full; then
/// GetModelInfo's nodes of the group.
fn forward_rows(grpc: &str, rows: usize) -> Vec<String> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c =
            epserve::proto::moe_service_client::MoeServiceClient::connect(format!("http://{grpc}"))
                .await
                .unwrap();
        let x = vec![0.5f32; rows * 64];
        let out = c
            .forward(request("r", 0, f32_tensor(&x, [rows, 64])))
            .await
            .expect("forward across nodes")
            .into_inner();
        assert_eq!(decode(out.output.as_ref().unwrap()).len(), rows * 64);
        c.get_model_info(epserve::proto::GetModelInfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .rank_nodes
    })
}

/// One launcher per node, as the pods of a LeaderWorkerSet run it (`launch --ranks 4 --nodes 2
/// --node-index I`, the rendezvous from LWS_LEADER_ADDRESS and MASTER_PORT): the worker node
/// starts first, the group forms, serves, and SIGTERM at the leader drains both; each launcher
/// exits 0 and removes nothing of the other's.
#[test]
fn one_launcher_per_node_forms_the_group_and_drains() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let dirs = [TempDir::new("pod-0"), TempDir::new("pod-1")];
    let pod = |i: usize| {
        let mut args: Vec<String> = [
            "launch",
            "--ranks",
            "4",
            "--nodes",
            "2",
            "--node-index",
            &i.to_string(),
            "--node-id",
            ["pod-0", "pod-1"][i],
            "--model",
            "synthetic:tiny",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--http-listen",
            "off",
            "--rendezvous-timeout",
            "60s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(["--shm-dir".into(), dirs[i].0.display().to_string()]);
        let env = [
            ("LWS_LEADER_ADDRESS", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
        ];
        Proc::spawn_env(&args, &env)
    };
    let mut worker = pod(1);
    std::thread::sleep(Duration::from_millis(500));
    let mut leader = pod(0);
    let grpc = leader
        .wait_for("serving gRPC on", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}\nworker:\n{}", worker.log_text()));
    let log = leader.log_text();
    assert!(
        log.contains("the group's ranks on node pod-1") && log.contains("ranks=[2, 3]"),
        "{log}"
    );
    let nodes = forward_rows(&grpc, 5);
    assert_eq!(nodes, ["pod-0", "pod-0", "pod-1", "pod-1"]);
    leader.signal("TERM");
    for (name, p) in [("leader", &mut leader), ("worker", &mut worker)] {
        let st = p
            .wait_exit(Duration::from_secs(30))
            .unwrap_or_else(|| panic!("{name} still running:\n{}", p.log_text()));
        assert!(st.success(), "{name} exited {st}:\n{}", p.log_text());
    }
}

/// Whether `pid` has exited (gone, or a zombie its new parent has not reaped yet).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Err(_) => true,
        Ok(s) => s
            .lines()
            .any(|l| l.starts_with("State:") && l.contains("Z")),
    }
}

/// #58: the ranks of a launcher die with it. SIGKILL of the launcher (no chance to stop them)
/// and SIGHUP (a closed terminal, which ended the launcher alone) each leave no rank running
/// within a few seconds; before, the ranks kept serving on their ports.
#[test]
fn the_ranks_of_a_launcher_die_with_it() {
    for sig in ["KILL", "HUP"] {
        let mut g = Group::launch(2, "synthetic:tiny", &[]);
        let ranks = g.proc.children();
        assert_eq!(ranks.len(), 2, "{}", g.proc.log_text());
        g.proc.signal(sig);
        let end = std::time::Instant::now() + Duration::from_secs(20);
        while !ranks.iter().all(|&p| exited(p)) {
            assert!(
                std::time::Instant::now() < end,
                "SIG{sig}: ranks {ranks:?} still running 20 s after the launcher's signal"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        if sig == "HUP" {
            // A drain, as SIGTERM: the launcher exits 0 once its ranks have.
            let status = g
                .proc
                .wait_exit(Duration::from_secs(20))
                .expect("launch exits");
            assert!(status.success(), "{status}: {}", g.proc.log_text());
        }
    }
}
