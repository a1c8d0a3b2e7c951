//! The service as a client sees it: bad requests, model info, health, reflection, and exchange
//! buffers that never move or grow.

mod common;

use common::*;
use epserve::api::catalogue::BAD_INPUT;
use epserve::proto::{DType, ForwardRequest, GetModelInfoRequest, Tensor};
use rand::{Rng, SeedableRng};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use tokio_stream::StreamExt;
use tonic::Code;

const H: usize = 64; // synthetic:tiny

fn good(n: usize) -> ForwardRequest {
    let x: Vec<f32> = (0..n * H)
        .map(|i| ((i * 7919) % 200) as f32 / 100.0 - 1.0)
        .collect();
    request("ok", 0, f32_tensor(&x, [n, H]))
}

/// Requests for every case of the catalogue: (case, what the message must also say, request).
fn bad_requests() -> Vec<(&'static str, &'static str, ForwardRequest)> {
    let mut v = Vec::new();
    let mut r = good(2);
    r.hidden_states = None;
    v.push(("no hidden_states", "", r));
    v.push((
        "hidden size other than the model's",
        "hidden size 32 does not match the model's 64",
        request("x", 0, f32_tensor(&[0.5; 64], [2, 32])),
    ));
    let mut t = f32_tensor(&[0.5; 2 * H], [2, H]);
    t.data.truncate(100);
    v.push((
        "bytes not matching shape and dtype",
        "100 bytes of data for shape [2, 64] of F32 (expected 512)",
        request("x", 0, t),
    ));
    let mut t = f32_tensor(&[0.5; 2 * H], [2, H]);
    t.dtype = 42;
    v.push((
        "dtype number outside the enum",
        "unknown dtype 42",
        request("x", 0, t),
    ));
    let mut t = f32_tensor(&[0.5; 2 * H], [2, H]);
    t.dtype = DType::I32 as i32;
    v.push((
        "integer hidden states or weights, float ids",
        "dtype I32 not accepted",
        request("x", 0, t),
    ));
    let t3 = Tensor {
        shape: vec![2, 1, 64],
        ..f32_tensor(&[0.5; 2 * H], [2, H])
    };
    v.push((
        "shape not [n, hidden]",
        "shape [2, 1, 64] must be [n, 64]",
        request("x", 0, t3),
    ));
    let neg = Tensor {
        shape: vec![-2, 64],
        ..f32_tensor(&[0.5; 2 * H], [2, H])
    };
    v.push((
        "shape not [n, hidden]",
        "shape [-2, 64] must be [n, 64]",
        request("x", 0, neg),
    ));
    // A 100,000-dim shape: quoted as its first 8 dims and its rank, so the status stays small.
    let wide = Tensor {
        shape: vec![1; 100_000],
        ..f32_tensor(&[0.5; H], [1, H])
    };
    v.push((
        "shape not [n, hidden]",
        "shape [1, 1, 1, 1, 1, 1, 1, 1, …] (100000 dims) must be [n, 64]",
        request("x", 0, wide),
    ));
    v.push((
        "zero tokens",
        "no tokens",
        request("x", 0, f32_tensor(&[], [0, H])),
    ));
    let mut x = vec![0.5f32; 2 * H];
    x[H + 3] = f32::INFINITY;
    v.push((
        "NaN or infinity in hidden states or weights",
        "non-finite value at row 1, column 3",
        request("x", 0, f32_tensor(&x, [2, H])),
    ));
    let mut r = good(2);
    r.layer = 9;
    v.push((
        "layer that is not an MoE layer",
        "layer 9 is not an MoE layer of this model (MoE layers: [0, 1])",
        r,
    ));
    let with_routing = |ids: &[i32], shape: [usize; 2]| {
        let mut r = good(2);
        r.topk_ids = Some(i32_tensor(ids, shape));
        r.topk_weights = Some(f32_tensor(&[0.5; 4], [2, 2]));
        r
    };
    v.push((
        "expert id outside 0..E",
        "the expert id at row 1, column 1 is out of range 0..8",
        with_routing(&[0, 1, 2, 8], [2, 2]),
    ));
    v.push((
        "expert id outside 0..E",
        "the expert id at row 0, column 0 is out of range",
        with_routing(&[-1, 1, 2, 3], [2, 2]),
    ));
    v.push((
        "an expert twice in one row",
        "row 1 names one expert twice (columns 0 and 1)",
        with_routing(&[0, 1, 3, 3], [2, 2]),
    ));
    v.push((
        "topk_ids or topk_weights not [n, top_k]",
        "topk_ids: shape [2, 3] must be [2, 2]",
        with_routing(&[0, 1, 2, 3, 4, 5], [2, 3]),
    ));
    v.push((
        "topk_ids or topk_weights not [n, top_k]",
        "topk_ids: shape [1, 2] must be [2, 2]",
        with_routing(&[0, 1], [1, 2]),
    ));
    let mut r = with_routing(&[0, 1, 2, 3], [2, 2]);
    r.topk_weights = Some(f32_tensor(&[0.5; 6], [2, 3]));
    v.push((
        "topk_ids or topk_weights not [n, top_k]",
        "topk_weights: shape [2, 3] must be [2, 2]",
        r,
    ));
    let mut r = with_routing(&[0, 1, 2, 3], [2, 2]);
    r.topk_ids = None;
    v.push(("topk_weights without topk_ids", "", r));
    let mut r = with_routing(&[0, 1, 2, 3], [2, 2]);
    r.topk_weights = None;
    v.push(("topk_ids without topk_weights", "", r));
    let mut r = with_routing(&[0, 1, 2, 3], [2, 2]);
    r.topk_weights = Some(f32_tensor(&[0.5, f32::NAN, 0.5, 0.5], [2, 2]));
    v.push((
        "NaN or infinity in hidden states or weights",
        "topk_weights: non-finite value at row 0, column 1",
        r,
    ));
    let mut r = with_routing(&[0, 1, 2, 3], [2, 2]);
    r.topk_ids.as_mut().unwrap().dtype = DType::F32 as i32;
    v.push((
        "integer hidden states or weights, float ids",
        "topk_ids: dtype F32 not accepted here (accepted: I32, I64)",
        r,
    ));
    let mut r = good(2);
    r.output_dtype = DType::I64 as i32;
    v.push((
        "output_dtype not a float dtype",
        "output_dtype: I64 is not a float dtype",
        r,
    ));
    let mut r = good(2);
    r.output_dtype = 77;
    v.push((
        "dtype number outside the enum",
        "output_dtype: unknown dtype 77",
        r,
    ));
    v.push((
        "message over --max-request-bytes",
        "the limit is: 1048576 bytes",
        good(5000),
    ));
    v.push((
        "more tokens than --max-queued-tokens",
        "a request of 1001 tokens exceeds --max-queued-tokens (1000)",
        good(1001),
    ));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_named_and_the_service_keeps_serving() {
    let group = Group::launch(
        2,
        "synthetic:tiny",
        &[
            "--max-request-bytes",
            "1048576",
            "--max-queued-tokens",
            "1000",
        ],
    );
    let mut c = group.client().await;
    let cases = bad_requests();
    for entry in BAD_INPUT.iter().filter(|b| b.on.v1()) {
        let mine: Vec<_> = cases
            .iter()
            .filter(|(case, _, _)| *case == entry.case)
            .collect();
        assert!(
            !mine.is_empty(),
            "no test request for catalogue case '{}'",
            entry.case
        );
        for (case, detail, req) in mine {
            let err = c.forward(req.clone()).await.expect_err(case);
            assert_eq!(err.code(), entry.code, "{case}: {err:?}");
            for want in [entry.message, detail] {
                assert!(
                    err.message().contains(want),
                    "{case}: want '{want}', got '{}'",
                    err.message()
                );
            }
            assert!(
                err.message().len() < 2048,
                "{case}: a status of {} bytes",
                err.message().len()
            );
            let ok = c
                .forward(good(3))
                .await
                .expect("valid request after a bad one")
                .into_inner();
            assert_eq!(ok.output.unwrap().shape, vec![3, H as i64]);
        }
    }
    for (case, _, _) in &cases {
        assert!(
            BAD_INPUT.iter().any(|b| b.case == *case && b.on.v1()),
            "'{case}' is not an epserve.v1 case of the catalogue"
        );
    }
    // On a stream, a bad request gets an error item and the others still succeed.
    let invalid: Vec<_> = cases
        .iter()
        .filter(|(case, _, _)| {
            BAD_INPUT
                .iter()
                .any(|b| b.case == *case && b.code == Code::InvalidArgument)
        })
        .collect();
    let mut items = vec![good(1)];
    items.extend(invalid.iter().map(|(_, d, r)| ForwardRequest {
        id: d.to_string(),
        ..r.clone()
    }));
    items.push(ForwardRequest {
        id: "last".into(),
        ..good(5)
    });
    let mut s = c
        .forward_stream(tokio_stream::iter(items.clone()))
        .await
        .unwrap()
        .into_inner();
    let (mut ok, mut failed) = (0, 0);
    while let Some(item) = s.next().await {
        let item = item.unwrap();
        match item.error {
            Some(e) => {
                assert_eq!(e.code, Code::InvalidArgument as i32);
                assert!(e.message.contains(&item.id), "{} vs {}", e.message, item.id);
                failed += 1;
            }
            None => ok += 1,
        }
    }
    assert_eq!((ok, failed), (2, invalid.len()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_info_health_and_reflection() {
    let group = Group::launch(
        2,
        "synthetic:tiny-deepseek",
        &["--max-tokens-per-step", "48"],
    );
    let mut c = group.client().await;
    let info = c
        .get_model_info(GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            info.hidden_size,
            info.num_experts,
            info.top_k,
            info.world_size
        ),
        (64, 16, 4, 2)
    );
    assert_eq!(info.moe_layers, vec![1, 2]);
    assert_eq!(
        (
            info.routing.as_str(),
            info.num_shared_experts,
            info.backend.as_str()
        ),
        ("sigmoid_group_topk", 1, "cpu")
    );
    assert_eq!(info.max_tokens_per_step, 48);
    assert_eq!(
        info.placement
            .iter()
            .map(|p| (p.rank, p.first, p.count))
            .collect::<Vec<_>>(),
        vec![(0, 0, 8), (1, 8, 8)]
    );
    assert!(info.exchange_bytes_per_rank > 0);

    let channel = tonic::transport::Channel::from_shared(format!("http://{}", group.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    for service in [
        "",
        "epserve.v1.MoeService",
        "inference.GRPCInferenceService",
    ] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "'{service}'"
        );
    }

    let names = reflected_services(channel).await;
    for service in ["epserve.v1.MoeService", "inference.GRPCInferenceService"] {
        assert!(names.contains(&service.to_string()), "{names:?}");
    }
}

/// The shared-memory mappings of a process: (address range, file).
fn shm_maps(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("epserve-"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            format!("{} {}", f[0], f[5])
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_buffers_never_move_or_grow() {
    let world = 4;
    let group = Group::launch(world, "synthetic:tiny", &["--max-tokens-per-step", "64"]);
    let ranks = group.proc.children();
    assert_eq!(ranks.len(), world);
    let before: Vec<Vec<String>> = ranks.iter().map(|&p| shm_maps(p)).collect();
    for maps in &before {
        // Every rank maps every rank's segment and the step ring, and nothing else of ours.
        assert_eq!(maps.len(), world + 1, "{maps:?}");
        assert!(maps
            .iter()
            .all(|m| m.ends_with("(deleted)") || m.contains("epserve-")));
    }
    // Segments live in this user's private directory (0700) and are unlinked once mapped:
    // nothing is left in it.
    let uid = std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap();
    let private = group.shm.0.join(format!("epserve-{uid}"));
    let entries: Vec<_> = std::fs::read_dir(&group.shm.0)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(entries, vec![private.clone()]);
    assert_eq!(
        std::fs::metadata(&private).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert_eq!(std::fs::read_dir(&private).unwrap().count(), 0);
    let mut c = group.client().await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..300 {
        let n = rng.random_range(1..=200usize);
        let mut r = good(n);
        r.layer = (i % 2) as u32;
        let mut c = c.clone();
        tasks.spawn(async move {
            c.forward(r)
                .await
                .map(|r| r.into_inner().output.unwrap().shape[0])
        });
        if i % 50 == 49 {
            while let Some(r) = tasks.join_next().await {
                r.unwrap().unwrap();
            }
        }
    }
    c.forward(good(1)).await.unwrap();
    let after: Vec<Vec<String>> = ranks.iter().map(|&p| shm_maps(p)).collect();
    assert_eq!(before, after, "exchange mappings changed across steps");
}

/// One call's oversize metadata is that call's affair: 100 KiB of metadata on a unary call
/// (under `--http2-max-header-list-size`, 1 MiB) is served, and a stream open beside it on the
/// same HTTP/2 connection carries on (h2's ceiling on a header block's frames used to close the
/// whole connection: every call on it failed UNAVAILABLE). A request that is not gRPC gets an
/// HTTP error (505 for HTTP/1.1, 415 for HTTP/2 without gRPC's content type), never a `200` to
/// read as healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_metadata_stays_with_its_call_and_other_http_gets_an_http_error() {
    let group = Group::launch(2, "synthetic:tiny", &[]);
    let mut c = group.client().await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut answers = c
        .forward_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let item = |id: &str| request(id, 0, f32_tensor(&[0.5; 2 * 64], [2, 64]));
    tx.send(item("before")).await.unwrap();
    assert_eq!(answers.message().await.unwrap().unwrap().id, "before");

    let mut big = tonic::Request::new(item("big"));
    big.metadata_mut()
        .insert("x-big", "m".repeat(100 << 10).parse().unwrap());
    match c.forward(big).await {
        Ok(r) => assert_eq!(r.into_inner().id, "big"),
        Err(s) => assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}"),
    }
    tx.send(item("after")).await.unwrap();
    let after = answers.message().await.expect("the sibling stream");
    assert_eq!(after.unwrap().id, "after");
    let ok = c
        .forward(item("next"))
        .await
        .expect("the connection serves");
    assert_eq!(ok.into_inner().id, "next");

    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(&group.addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: epserve\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    assert!(
        reply.starts_with(b"HTTP/1.1 505"),
        "HTTP/1.1 answered: {}",
        String::from_utf8_lossy(&reply)
    );
    // HTTP/2 without gRPC's content type: 415, not 200.
    let (status, _) = raw_h2(&group.addr, "GET", "/v2/health/ready").await;
    assert_eq!(status, 415);
}

/// One HTTP/2 request with no body and no gRPC content type; its status and body.
async fn raw_h2(addr: &str, method: &str, path: &str) -> (u16, String) {
    use http_body_util::BodyExt;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let r = send.send_request(req).await.unwrap();
    let status = r.status().as_u16();
    let body = r.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Refusals are logged at debug, with their reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_logged_at_debug_with_their_reason() {
    let shm = TempDir::new("refusals");
    let args = serve_args(&shm, &["--rendezvous", "127.0.0.1:0"]);
    let mut p = Proc::spawn_env(&args, &[("RUST_LOG", "info,epserve=debug")]);
    let (addr, _) = ports(&mut p);
    let mut c =
        epserve::proto::moe_service_client::MoeServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
    let e = c
        .forward(request("empty", 0, f32_tensor(&[], [0, 64])))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let t0 = std::time::Instant::now();
    let line = loop {
        let log = p.log_text();
        if let Some(l) = log.lines().find(|l| l.contains("request refused")) {
            break l.to_string();
        }
        assert!(t0.elapsed().as_secs() < 10, "no refusal logged:\n{log}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(
        line.contains("DEBUG") && line.contains("invalid_argument") && line.contains("no tokens"),
        "{line}"
    );
}
