//! Clients that hold the leader's memory or descriptors without doing work: uploads that declare
//! large messages and stall (unary and streams), and connections that never open a call or stop
//! opening them. The leader must bound the memory (the upload budget), end every such call with
//! a status, keep serving a well-behaved client, and close such connections.

mod common;

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::ReceiverStream;

const MIB: usize = 1 << 20;

/// A request body the test feeds frame by frame.
type Feed = StreamBody<ReceiverStream<Result<Frame<Bytes>, Infallible>>>;
type Conn = hyper::client::conn::http2::SendRequest<Feed>;

/// An HTTP/2 connection a test drives itself.
async fn h2(addr: &str) -> Conn {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    sender
}

/// A call to `path` whose one message declares `declared` bytes, of which `sent` come (in 1 MiB
/// frames) before the client stalls; returns its grpc-status and message once the server ends it.
async fn stalled_call(mut conn: Conn, path: &str, declared: usize, sent: usize) -> (i32, String) {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let feeder = tokio::spawn(async move {
        let mut head = vec![0u8];
        head.extend((declared as u32).to_be_bytes());
        let _ = tx.send(Ok(Frame::data(Bytes::from(head)))).await;
        for _ in 0..sent / MIB {
            if tx
                .send(Ok(Frame::data(Bytes::from(vec![7u8; MIB]))))
                .await
                .is_err()
            {
                return;
            }
        }
        // Stalls with the body open until the test drops it.
        std::future::pending::<()>().await;
    });
    let req = http::Request::post(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(StreamBody::new(ReceiverStream::new(rx)))
        .unwrap();
    conn.ready().await.unwrap();
    let resp = conn.send_request(req).await.unwrap();
    let outcome = grpc_outcome(resp).await;
    feeder.abort();
    outcome
}

/// 2 connections x 16 calls (unary Forward on one, ForwardStream on the other) each declare 48 MiB,
/// send 16 MiB and stall. The leader's resident memory grows by less than README's bound for
/// them + 32 MiB: the upload budget and each connection's HTTP/2 window (64 MiB; bytes come
/// through it as they are charged, each connection's share of 48 MiB of them: 6 calls hold their
/// 16 MiB where, charged their declared lengths, 2 did), every stalled call ends with DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED, a client on
/// another connection keeps its p99 under 500 ms throughout (the stalled calls wait seconds), and the upload and queue metrics
/// are back at 0 after. (On the build before the budget, #40's probe of this load held 528 MiB,
/// and no read had a deadline.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalled_uploads_hold_no_more_than_the_budget_and_end_with_a_status() {
    let declared = 48 * MIB;
    let budget = 4 * declared; // the default: 4 x --max-request-bytes
    let shm = TempDir::new("slow");
    let max = declared.to_string();
    let args = serve_args(
        &shm,
        &[
            "--rendezvous",
            "127.0.0.1:0",
            "--max-request-bytes",
            &max,
            "--upload-wait",
            "1s",
            "--upload-timeout",
            "3s",
        ],
    );
    let mut p = Proc::spawn(&args);
    let (addr, metrics) = ports(&mut p);
    let pid = p.child.id();
    let url = format!("http://{addr}");
    let mut client = epserve::proto::moe_service_client::MoeServiceClient::connect(url.clone())
        .await
        .unwrap();
    let x = vec![0.25f32; 2 * 64];
    for i in 0..20 {
        client
            .forward(request(&format!("warm{i}"), 0, f32_tensor(&x, [2, 64])))
            .await
            .unwrap();
    }
    let base = rss(pid);

    let sampler = PeakRss::start(pid);
    let mut calls = tokio::task::JoinSet::new();
    for path in [
        "/epserve.v1.MoeService/Forward",
        "/epserve.v1.MoeService/ForwardStream",
    ] {
        let conn = h2(&addr).await;
        for _ in 0..16 {
            calls.spawn(stalled_call(conn.clone(), path, declared, 16 * MIB));
        }
    }
    // A well-behaved client on its own connection, while the stalled calls last.
    let t0 = Instant::now();
    let mut ms = Vec::new();
    let mut ended = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !calls.is_empty() {
        assert!(
            Instant::now() < deadline,
            "stalled calls not ended in 30 s: {ended:?}"
        );
        let t = Instant::now();
        client
            .forward(request("polite", 0, f32_tensor(&x, [2, 64])))
            .await
            .expect("a well-behaved call while uploads stall");
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        while let Some(r) = calls.try_join_next() {
            ended.push(r.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let lasted = t0.elapsed();
    let peak = sampler.stop().await;
    ms.sort_by(f64::total_cmp);
    let p99 = ms[ms.len() * 99 / 100];
    let count = |code| ended.iter().filter(|(c, _)| *c == code).count();
    let growth = peak.saturating_sub(base);
    eprintln!(
        "32 stalled calls ended in {lasted:.1?}: {} DEADLINE_EXCEEDED, {} RESOURCE_EXHAUSTED; \
         leader RSS {} MiB before, peak growth {} MiB (budget {} MiB); {} polite calls, p50 \
         {:.2} ms p99 {p99:.2} ms",
        count(4),
        count(8),
        base / MIB,
        growth / MIB,
        budget / MIB,
        ms.len(),
        ms[ms.len() / 2]
    );
    for (code, message) in &ended {
        assert!(
            *code == 4 || *code == 8,
            "a stalled call ended with {code} {message:?}"
        );
    }
    assert!(count(4) >= 2, "the calls that got room ran out of time");
    assert!(count(8) >= 2, "the calls past the share were refused");
    let windows = 2 * 64 * MIB;
    assert!(
        growth < budget + windows + 32 * MIB,
        "RSS grew {} MiB over a budget of {} MiB and windows of {} MiB",
        growth / MIB,
        budget / MIB,
        windows / MIB
    );
    // Not held behind the stalled uploads (they wait seconds); a liveness bound, not a speed
    // target: 50 ms failed once at 75.8 ms on CI's two busy cores.
    assert!(p99 < 500.0, "polite p99 {p99:.2} ms while uploads stall");

    let samples = common::prom::scrape(&metrics);
    let metric = |name, labels: &[(&str, &str)]| common::prom::sum(&samples, name, labels);
    assert_eq!(metric("epserve_upload_bytes", &[]), 0.0);
    assert_eq!(metric("epserve_queue_requests", &[]), 0.0);
    assert_eq!(metric("epserve_queue_tokens", &[]), 0.0);
    assert_eq!(
        metric("epserve_rejections_total", &[("reason", "upload_budget")]),
        count(8) as f64
    );
    assert_eq!(
        metric("epserve_rejections_total", &[("reason", "upload_deadline")]),
        count(4) as f64
    );
}

/// Reads until the server closes the connection; how long that took.
async fn until_closed(tcp: &mut tokio::net::TcpStream, limit: Duration) -> Duration {
    let t0 = Instant::now();
    let mut buf = vec![0u8; 4096];
    loop {
        match tokio::time::timeout(limit, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return t0.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("still open after {limit:?}"),
        }
    }
}

/// A connection that sends nothing, one that stops inside the HTTP/2 preface, one that finishes
/// the handshake and never calls: each is closed after --first-call-timeout (and at most the
/// second it is given to say goodbye). One that made a call is closed once idle for
/// --idle-timeout, and a call in progress keeps its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_without_calls_are_closed() {
    let shm = TempDir::new("idle");
    let args = serve_args(
        &shm,
        &[
            "--rendezvous",
            "127.0.0.1:0",
            "--first-call-timeout",
            "1s",
            "--idle-timeout",
            "2s",
        ],
    );
    let mut p = Proc::spawn(&args);
    let (addr, _) = ports(&mut p);
    let limit = Duration::from_secs(10);

    let mut silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut half = tokio::net::TcpStream::connect(&addr).await.unwrap();
    half.write_all(&b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..10])
        .await
        .unwrap();
    let (silent, half) = tokio::join!(
        until_closed(&mut silent, limit),
        until_closed(&mut half, limit)
    );
    for (what, took) in [("silent", silent), ("half a preface", half)] {
        eprintln!("{what}: closed after {took:.2?}");
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(3),
            "{what}: {took:?}"
        );
    }

    // A handshake and no call: GOAWAY after the first-call timeout.
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (_sender, conn) =
        hyper::client::conn::http2::handshake::<_, _, http_body_util::Empty<Bytes>>(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .unwrap();
    let t0 = Instant::now();
    tokio::time::timeout(limit, conn).await.unwrap().unwrap();
    let took = t0.elapsed();
    eprintln!("handshake, no call: closed after {took:.2?}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3));

    // A stream open for 3 s (longer than the idle timeout) keeps its connection; once it is
    // over the connection is closed after the idle timeout.
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let conn = tokio::spawn(async move {
        let _ = conn.await;
        Instant::now()
    });
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let req = http::Request::post("http://localhost/epserve.v1.MoeService/ForwardStream")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(StreamBody::new(ReceiverStream::new(rx)))
        .unwrap();
    let x = vec![0.25f32; 2 * 64];
    let message = |id: &str| {
        let m = prost::Message::encode_to_vec(&request(id, 0, f32_tensor(&x, [2, 64])));
        let mut f = vec![0u8];
        f.extend((m.len() as u32).to_be_bytes());
        f.extend(m);
        Ok::<_, Infallible>(Frame::data(Bytes::from(f)))
    };
    tx.send(message("first")).await.unwrap();
    let resp = sender.send_request(req).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    tx.send(message("second")).await.unwrap();
    drop(tx);
    let body = resp.into_body().collect().await.unwrap();
    let stream_end = Instant::now();
    let status = body.trailers().and_then(|t| t.get("grpc-status")).cloned();
    assert_eq!(status.as_ref().map(|v| v.as_bytes()), Some(&b"0"[..]));
    let conn_end = tokio::time::timeout(limit, conn).await.unwrap().unwrap();
    assert!(conn_end > stream_end, "closed while a call was open");
    let idle = conn_end - stream_end;
    eprintln!("a 3 s stream, then idle: closed {idle:.2?} after it ended");
    assert!(
        idle >= Duration::from_millis(1900) && idle < Duration::from_secs(4),
        "{idle:?}"
    );
}

/// A REST POST to `path` on its own HTTP/1.1 connection: the status, once the answer is read.
async fn rest_post(addr: &str, path: &str, headers: &[(&str, String)], body: Vec<u8>) -> u16 {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::post(path).header("host", "epserve");
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let body = http_body_util::Full::new(Bytes::from(body));
    let resp = send.send_request(req.body(body).unwrap()).await.unwrap();
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    status
}

fn gzip(b: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    z.write_all(b).unwrap();
    z.finish().unwrap()
}

/// #56 item 2's probe: four connections (two gRPC, two REST) that declare 16 MiB bodies and send
/// nothing more hold `RESERVE` each, not the budget (4 x 16 MiB = --upload-budget here): a
/// client on other connections gets every call OK, gRPC messages of 2 MiB (charged: over one
/// frame) and REST bodies of 256 KiB, p99 under 500 ms. Before, each such call was refused
/// until --upload-timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn declared_bodies_that_never_come_refuse_nobody() {
    let shm = TempDir::new("declared");
    let args = serve_args(
        &shm,
        &[
            "--rendezvous",
            "127.0.0.1:0",
            "--max-request-bytes",
            "16MiB",
            "--upload-wait",
            "1s",
            "--upload-timeout",
            "30s",
        ],
    );
    let mut p = Proc::spawn(&args);
    let (addr, metrics) = ports(&mut p);
    let rest = p.rest_addr();
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let conn = h2(&addr).await;
        stalled.push(tokio::spawn(stalled_call(
            conn,
            "/epserve.v1.MoeService/Forward",
            16 * MIB,
            0,
        )));
    }
    let mut declared = Vec::new();
    for _ in 0..2 {
        let mut tcp = tokio::net::TcpStream::connect(&rest).await.unwrap();
        let head = format!(
            "POST /v2/models/layer-0/infer HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
            16 * MIB
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        declared.push(tcp);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let samples = common::prom::scrape(&metrics);
    let held = common::prom::sum(&samples, "epserve_upload_bytes", &[]);
    assert!(
        held <= (4 * (256 << 10)) as f64,
        "declared bodies hold {held} bytes"
    );

    let mut client =
        epserve::proto::moe_service_client::MoeServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap()
            .max_decoding_message_size(64 * MIB);
    let (rows, small) = (8192, 1024);
    let x = vec![0.25f32; rows * 64];
    let input: Vec<u8> = x[..small * 64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let json = serde_json::json!({
        "inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [small, 64],
                    "parameters": {"binary_data_size": input.len()}}],
        "outputs": [{"name": "output", "parameters": {"binary_data": true}}],
    });
    let (headers, body) = common::kserve::rest_body(json, &input);
    let end = Instant::now() + Duration::from_secs(3);
    let mut ms = Vec::new();
    while Instant::now() < end {
        let t = Instant::now();
        client
            .forward(request("big", 0, f32_tensor(&x, [rows, 64])))
            .await
            .expect("a 2 MiB call beside the declared bodies");
        let status = rest_post(&rest, "/v2/models/layer-0/infer", &headers, body.clone()).await;
        assert_eq!(status, 200, "a REST call beside the declared bodies");
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    eprintln!(
        "4 declared 16 MiB bodies held {held} bytes; {} gRPC 2 MiB + REST 256 KiB rounds beside \
         them, p50 {:.1} ms p99 {:.1} ms",
        ms.len(),
        ms[ms.len() / 2],
        p99(&ms)
    );
    assert!(p99(&ms) < 500.0, "p99 {:.1} ms", p99(&ms));
    for s in &stalled {
        assert!(!s.is_finished(), "a declared body is still waited for");
    }
    for s in stalled {
        s.abort();
    }
    drop(declared);
}

/// #56 items 3 and 5's probe: 24 compressed bodies (12 REST gzip, 12 gRPC gzip messages) of
/// 16 KB that each inflate to 16 MiB, and 4 REST bodies of ~7 MB of JSON numbers, all at once.
/// Inflated bytes are charged to the upload budget as they are made (the leader grows within
/// README's bound + 32 MiB; before, 24 such bodies took +209-265 MiB over a 64 MiB budget), and
/// inflating and parsing run off the runtime's threads: a gRPC client beside them keeps every
/// call OK with a p99 under 100 ms (before: p50 280-500 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compressed_and_large_json_bodies_are_charged_and_kept_off_the_runtime() {
    let shm = TempDir::new("inflate");
    let args = serve_args(
        &shm,
        &[
            "--rendezvous",
            "127.0.0.1:0",
            "--max-request-bytes",
            "16MiB",
            "--upload-wait",
            "1s",
        ],
    );
    // Upload and answer budgets (4 x 16 MiB each), admitted tokens x hidden x 8.
    let bound = 64 * MIB + 64 * MIB + 65536 * 64 * 8;
    let mut p = Proc::spawn(&args);
    let (addr, metrics) = ports(&mut p);
    let rest = p.rest_addr();
    let pid = p.child.id();
    polite(&addr, Duration::from_millis(300)).await;
    let base = rss(pid);
    let sampler = PeakRss::start(pid);

    let bomb = gzip(&vec![b' '; 16 * MIB - 64]);
    let mut grpc_bomb = vec![1u8];
    let inner = gzip(&vec![0u8; 16 * MIB - 64]);
    grpc_bomb.extend((inner.len() as u32).to_be_bytes());
    grpc_bomb.extend(&inner);
    let rows = 12000;
    let numbers: Vec<String> = (0..rows * 64)
        .map(|i| format!("{:.6}", (i % 1000) as f32 / 1000.0 - 0.5))
        .collect();
    let json = format!(
        r#"{{"inputs":[{{"name":"hidden_states","datatype":"FP32","shape":[{rows},64],"data":[{}]}}]}}"#,
        numbers.join(",")
    )
    .into_bytes();
    let mut load = tokio::task::JoinSet::new();
    for _ in 0..12 {
        let (rest, bomb) = (rest.clone(), bomb.clone());
        load.spawn(async move {
            let h = [("content-encoding", "gzip".to_string())];
            rest_post(&rest, "/v2/models/layer-0/infer", &h, bomb).await as i32
        });
        let (conn, msg) = (h2(&addr).await, grpc_bomb.clone());
        load.spawn(async move {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tx.send(Ok(Frame::data(Bytes::from(msg)))).await.unwrap();
            drop(tx);
            let req = http::Request::post("http://localhost/epserve.v1.MoeService/Forward")
                .header("content-type", "application/grpc")
                .header("grpc-encoding", "gzip")
                .header("te", "trailers")
                .body(StreamBody::new(ReceiverStream::new(rx)))
                .unwrap();
            let mut conn = conn;
            conn.ready().await.unwrap();
            grpc_outcome(conn.send_request(req).await.unwrap()).await.0
        });
    }
    for _ in 0..4 {
        let (rest, json) = (rest.clone(), json.clone());
        load.spawn(
            async move { rest_post(&rest, "/v2/models/layer-0/infer", &[], json).await as i32 },
        );
    }
    let ms = polite(&addr, Duration::from_secs(4)).await;
    let mut outcomes = Vec::new();
    while let Some(o) = load.join_next().await {
        outcomes.push(o.unwrap());
    }
    let peak = sampler.stop().await;
    let growth = peak.saturating_sub(base);
    eprintln!(
        "24 bodies inflating to 16 MiB and 4 of 7 MB of JSON: outcomes {outcomes:?}; leader RSS \
         {} MiB before, peak growth {} MiB (bound {} MiB); {} polite calls, p50 {:.2} ms p99 \
         {:.2} ms",
        base / MIB,
        growth / MIB,
        bound / MIB,
        ms.len(),
        ms[ms.len() / 2],
        p99(&ms)
    );
    assert!(
        growth < bound + 32 * MIB,
        "RSS grew {} MiB over a bound of {} MiB",
        growth / MIB,
        bound / MIB
    );
    assert!(p99(&ms) < 100.0, "polite p99 {:.1} ms", p99(&ms));
    let samples = common::prom::scrape(&metrics);
    assert_eq!(
        common::prom::sum(&samples, "epserve_upload_bytes", &[]),
        0.0
    );
}
