//! Clients that ask and do not read their answers (#56 items 1 and 4): a request's admission
//! goes once its answer is made, unwritten answers are charged to `--answer-budget` (a share per
//! connection), a full budget closes the connection whose answers have waited longest, and an
//! answer not written within `--write-timeout` closes its connection. A well-behaved client beside
//! them gets every call answered.

mod common;

use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes};
use common::*;
use http_body_util::Full;
use prost::Message;
use tokio::io::AsyncWriteExt;

const MIB: usize = 1 << 20;
use common::kserve::H;

/// A Forward call of `rows` tokens as an HTTP/2 request.
fn forward(rows: usize) -> http::Request<Full<Bytes>> {
    let msg = request("unread", 0, f32_tensor(&vec![0.5; rows * H], [rows, H])).encode_to_vec();
    let mut body = Vec::with_capacity(5 + msg.len());
    body.put_u8(0);
    body.put_u32(msg.len() as u32);
    body.extend(msg);
    http::Request::post("/epserve.v1.MoeService/Forward")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// Item 1's probe: one HTTP/2 connection grants a 64 KiB window, lets one answer fill it, then
/// sends a 65,536-row request (all of --max-queued-tokens). Its admission goes once its answer is
/// made: another client's calls all succeed while the connection lives (before, each got
/// RESOURCE_EXHAUSTED for as long as it did), and the connection is dropped at --write-timeout
/// with its answers counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_that_does_not_read_holds_no_admission() {
    let shm = TempDir::new("unread-h2");
    let args = serve_args(
        &shm,
        &[
            "--rendezvous",
            "127.0.0.1:0",
            "--max-queued-tokens",
            "65536",
            "--write-timeout",
            "4s",
        ],
    );
    let mut p = Proc::spawn(&args);
    let (addr, metrics) = ports(&mut p);
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut bad, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(64 << 10)
            .initial_connection_window_size(64 << 10)
            .handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    let alive = tokio::spawn(conn);
    // 256 KiB of answer: the window is full after its first 64 KiB. Neither body is read.
    // The first answer's write starts after this, and may well before the second is made.
    let sent = Instant::now();
    let first = bad.send_request(forward(1024)).await.unwrap();
    let second = bad.send_request(forward(65536)).await.unwrap();
    let made = Instant::now();
    assert_eq!(first.status(), 200);
    assert_eq!(second.status(), 200);

    let metric = |name: &str, labels: &[(&str, &str)]| {
        common::prom::sum(&common::prom::scrape(&metrics), name, labels)
    };
    let ms = polite(&addr, Duration::from_secs(2)).await;
    assert!(
        !alive.is_finished(),
        "the connection lives until --write-timeout"
    );
    assert_eq!(metric("epserve_admitted_tokens", &[]), 0.0);
    let unwritten = metric("epserve_answer_bytes", &[]);
    assert!(
        unwritten >= (16 * MIB) as f64,
        "the 16 MiB answer is charged: {unwritten}"
    );
    eprintln!(
        "{} polite calls beside the unread answers: p50 {:.2} ms, p99 {:.2} ms; {unwritten} \
         bytes unwritten",
        ms.len(),
        ms[ms.len() / 2],
        p99(&ms)
    );
    assert!(p99(&ms) < 500.0, "polite p99 {:.1} ms", p99(&ms));

    tokio::time::timeout(Duration::from_secs(10), alive)
        .await
        .expect("the connection is dropped at --write-timeout")
        .unwrap()
        .ok();
    // Not before --write-timeout from the first answer's write (after `sent`); within 3 s of
    // it once the last answer was made.
    let (since_sent, since_made) = (sent.elapsed(), made.elapsed());
    assert!(
        since_sent >= Duration::from_secs(4) && since_made < Duration::from_secs(7),
        "dropped {since_sent:?} after the first request was sent, {since_made:?} after the \
         answers were made"
    );
    drop((first, second));
    // The charge comes back as the server drops the connection, which the client may see first
    // (16 MiB still charged at once, once, on CI): within a bound, not necessarily at once.
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while metric("epserve_answer_bytes", &[]) != 0.0 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric("epserve_answer_bytes", &[]), 0.0);
    // The second answer at least; the first too unless h2 took it into its own buffers.
    let dropped = metric("epserve_rejections_total", &[("reason", "write_timeout")]);
    assert!((1.0..=2.0).contains(&dropped), "{dropped}");
}

/// A REST ModelInfer of `rows` tokens asking for its output in binary, as raw HTTP/1.1 bytes.
fn rest_infer(rows: usize) -> Vec<u8> {
    let input: Vec<u8> = vec![0.5f32; rows * H]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let json = serde_json::json!({
        "inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [rows, H],
                    "parameters": {"binary_data_size": input.len()}}],
        "outputs": [{"name": "output", "parameters": {"binary_data": true}}],
    });
    let head = serde_json::to_vec(&json).unwrap();
    let mut req = format!(
        "POST /v2/models/layer-0/infer HTTP/1.1\r\nhost: x\r\ncontent-type: \
         application/octet-stream\r\ninference-header-content-length: {}\r\ncontent-length: \
         {}\r\n\r\n",
        head.len(),
        head.len() + input.len()
    )
    .into_bytes();
    req.extend(head);
    req.extend(input);
    req
}

/// Item 4's probe: 32 REST clients that never read a 4 MiB answer (128 MiB in all). Unwritten
/// answers are held to --answer-budget (a full budget closes the stalest reader), so the
/// leader's memory stays within README's bound (the upload and answer budgets, and admitted
/// tokens x hidden x 8 bytes) + 32 MiB, `epserve_answer_bytes` shows them, and a gRPC client
/// beside them gets every call answered. (Before, 32 such clients held +535 MiB with every
/// gauge at 0.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unread_rest_answers_are_held_to_the_answer_budget() {
    let rows = 16384; // 4 MiB of f32 each way
    let shm = TempDir::new("unread-rest");
    let args = serve_args(
        &shm,
        &[
            "--rendezvous",
            "127.0.0.1:0",
            "--max-request-bytes",
            "8MiB",
            "--upload-budget",
            "8MiB",
            "--answer-budget",
            "16MiB",
            "--max-queued-tokens",
            "70000",
            "--write-timeout",
            "60s",
        ],
    );
    let (budget, admitted) = (16 * MIB, 70000 * H * 8);
    let bound = 8 * MIB + budget + admitted;
    let mut p = Proc::spawn(&args);
    let (addr, metrics) = ports(&mut p);
    let rest = p.rest_addr();
    let pid = p.child.id();
    // Warm the allocator's pools as the load will use them.
    polite(&addr, Duration::from_millis(200)).await;
    let base = rss(pid);
    let sampler = PeakRss::start(pid);
    let body = rest_infer(rows);
    let mut unread = Vec::new();
    let sending = {
        let (rest, body) = (rest.clone(), body.clone());
        tokio::spawn(async move {
            for _ in 0..32 {
                // A small receive buffer: the answers stay in the leader, not in the kernel.
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.set_recv_buffer_size(4096).unwrap();
                let mut tcp = socket.connect(rest.parse().unwrap()).await.unwrap();
                tcp.write_all(&body).await.unwrap();
                unread.push(tcp);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            unread
        })
    };
    let ms = polite(&addr, Duration::from_secs(6)).await;
    let unread = sending.await.unwrap();
    let held = common::prom::sum(&common::prom::scrape(&metrics), "epserve_answer_bytes", &[]);
    let peak = sampler.stop().await;
    let growth = peak.saturating_sub(base);
    let samples = common::prom::scrape(&metrics);
    let evicted = common::prom::sum(
        &samples,
        "epserve_rejections_total",
        &[("reason", "answer_evicted")],
    );
    eprintln!(
        "32 unread 4 MiB REST answers: leader RSS {} MiB before, peak growth {} MiB (bound {} \
         MiB); {held} bytes unwritten at the end, {evicted} connections closed for room; {} \
         polite calls, p50 {:.2} ms p99 {:.2} ms",
        base / MIB,
        growth / MIB,
        bound / MIB,
        ms.len(),
        ms[ms.len() / 2],
        p99(&ms)
    );
    // Answers of requests let in while it had room may pass it: those are admitted tokens'.
    assert!(
        held > 0.0 && held <= (budget + admitted) as f64,
        "unwritten answers shown and within the budget: {held}"
    );
    assert!(evicted >= 1.0, "a full budget closed a stale reader");
    assert!(
        growth < bound + 32 * MIB,
        "RSS grew {} MiB over a bound of {} MiB",
        growth / MIB,
        bound / MIB
    );
    assert!(p99(&ms) < 500.0, "polite p99 {:.1} ms", p99(&ms));
    drop(unread);
}
