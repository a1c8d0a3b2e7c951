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

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

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
/// send 16 MiB and stall. The leader's resident memory grows by less than its upload budget +
/// 32 MiB, every stalled call ends with DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED, a client on
/// another connection keeps its p99 under 50 ms throughout, and the upload and queue metrics
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

    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut peak = 0;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss(pid));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            peak
        })
    };
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
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.await.unwrap();
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
    assert!(
        growth < budget + 32 * MIB,
        "RSS grew {} MiB over a budget of {} MiB",
        growth / MIB,
        budget / MIB
    );
    assert!(p99 < 50.0, "polite p99 {p99:.2} ms while uploads stall");

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
