//! KServe v2 REST: JSON and binary-tensor inference equal to gRPC and the reference, the plain
//! routes, and the catalogue's REST refusals.

mod common;

use std::time::Duration;

use common::reference::{token, RefLayer, TIE_MARGIN};
use common::*;
use epserve::model::synthetic;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tonic::Code;

use common::kserve::*;

/// KServe v2 REST: JSON and binary-tensor inference equal to ModelInfer over gRPC and to the f64
/// reference per token (BF16 and client routing included); health, metadata, configuration,
/// statistics and `/metrics` on the port; each of the catalogue's REST refusals answered with its
/// status's HTTP code and message, and a valid request served after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_answers_as_grpc_and_refuses_by_name() {
    use epserve::api::catalogue::BAD_HTTP;
    use serde_json::json;
    let group = Group::launch(
        2,
        "synthetic:tiny",
        &["--max-request-bytes", "65536", "--upload-timeout", "1s"],
    );
    let http = group.http_addr();
    let get = |path: &'static str| {
        let http = http.clone();
        async move { common::http(&http, "GET", path, &[], vec![]).await }
    };
    assert_eq!(get("/v2/health/live").await.0, 200);
    assert_eq!(get("/v2/health/ready").await.0, 200);
    assert_eq!(get("/v2/models/layer-0/versions/1/ready").await.0, 200);
    assert_eq!(get("/v2/models/layer-9/ready").await.0, 400);
    let (_, _, b) = get("/v2").await;
    let meta: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert!(
        meta["extensions"]
            .as_array()
            .unwrap()
            .contains(&json!("binary_tensor_data")),
        "{meta}"
    );
    let (_, _, b) = get("/v2/models/layer-0/config").await;
    let config: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(config["input"][1]["optional"], true, "{config}");
    assert_eq!(config["input"][1]["dims"], json!([-1, K]), "{config}");

    // Inference: each form against the same request over gRPC and the f64 reference.
    let mut c = client(&group.addr).await;
    let spec = synthetic::preset("tiny").unwrap();
    let layer = spec.moe_layers[0];
    let reference = RefLayer::from_weights(&synthetic::layer(&spec, 0, layer, 0..E), H);
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let (mut tokens, mut ties) = (0, 0);
    for (form, n) in [
        ("json", 5usize),
        ("binary", 7),
        ("bf16-binary", 3),
        ("routing-json", 4),
    ] {
        let x: Vec<f32> = (0..n * H).map(|_| rng.random_range(-1f32..1.0)).collect();
        let bf16 = form == "bf16-binary";
        // The hidden states as they are sent (BF16 rounds them).
        let sent: Vec<f32> = if bf16 {
            x.iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect()
        } else {
            x.clone()
        };
        let (model, datatype) = if bf16 {
            ("layer-0-bf16", "BF16")
        } else {
            ("layer-0", "FP32")
        };
        let shape = json!([n, H]);
        let (mut inputs, mut binary) = (vec![], vec![]);
        let mut grpc = vec![];
        if form == "json" || form == "routing-json" {
            let data: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
            inputs.push(json!({"name": "hidden_states", "shape": shape, "datatype": datatype, "data": data}));
        } else {
            let bytes = if bf16 { le_bf16(&x) } else { le_f32(&x) };
            inputs.push(
                json!({"name": "hidden_states", "shape": shape, "datatype": datatype,
                               "parameters": {"binary_data_size": bytes.len()}}),
            );
            binary.extend_from_slice(&bytes);
        }
        grpc.push((
            input("hidden_states", datatype, &[n as i64, H as i64]),
            if bf16 { le_bf16(&x) } else { le_f32(&x) },
        ));
        let mut routing = None;
        if form == "routing-json" {
            let mut ids = vec![];
            for _ in 0..n {
                let mut row: Vec<i32> = vec![];
                while row.len() < K {
                    let e = rng.random_range(0..E as i32);
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                ids.push(row);
            }
            let w: Vec<f32> = (0..n * K).map(|_| rng.random_range(0.05f32..1.0)).collect();
            let flat: Vec<i32> = ids.concat();
            let kshape = [n as i64, K as i64];
            // Nested rows for the ids, flat numbers for the weights.
            inputs.push(
                json!({"name": "topk_ids", "shape": kshape, "datatype": "INT32", "data": ids}),
            );
            let wd: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
            inputs.push(
                json!({"name": "topk_weights", "shape": kshape, "datatype": "FP32", "data": wd}),
            );
            grpc.push((
                input("topk_ids", "INT32", &kshape),
                flat.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ));
            grpc.push((input("topk_weights", "FP32", &kshape), le_f32(&w)));
            routing = Some((
                flat.iter().map(|&v| v as usize).collect::<Vec<_>>(),
                w.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>(),
            ));
        }
        let in_binary = form.ends_with("binary");
        let body = json!({"id": form, "inputs": inputs,
                          "outputs": [{"name": "output", "parameters": {"binary_data": in_binary}}]});
        let (headers, body) = rest_body(body, &binary);
        let path = format!("/v2/models/{model}/infer");
        let (status, h, b) = common::http(&http, "POST", &path, &headers, body).await;
        assert_eq!(status, 200, "{form}: {}", String::from_utf8_lossy(&b));
        assert_eq!(rest_answer(&h, &b).0["id"], form);
        let (dt, out) = rest_output(&h, &b);
        assert_eq!(dt, datatype, "{form}");
        let want = c
            .model_infer(raw_request(model, form, grpc))
            .await
            .unwrap()
            .into_inner();
        let want = output_f32(&want);
        let tol = if bf16 { 2e-2 } else { 1e-5 };
        for t in 0..n {
            let row = t * H..(t + 1) * H;
            let e = row_error(&out[row.clone()], &want[row.clone()]);
            assert!(e <= 1e-6, "{form} token {t}: REST vs gRPC {e:.3e}");
            let xf: Vec<f64> = sent[row.clone()].iter().map(|&v| f64::from(v)).collect();
            let r = routing.as_ref().map(|(i, w): &(Vec<usize>, Vec<f64>)| {
                (&i[t * K..(t + 1) * K], &w[t * K..(t + 1) * K])
            });
            let (reference, margin) = token(&spec, &reference, &xf, r);
            tokens += 1;
            if margin < TIE_MARGIN {
                ties += 1;
                continue;
            }
            let reference: Vec<f32> = reference.iter().map(|&v| v as f32).collect();
            let e = row_error(&out[row], &reference);
            assert!(e <= tol, "{form} token {t}: vs f64 reference {e:.3e}");
        }
    }
    assert!(
        ties * 10 <= tokens,
        "{ties} of {tokens} tokens were near-ties"
    );

    // The catalogue's REST refusals.
    let x1: Vec<f64> = (0..H).map(|i| (i as f64) / 64.0).collect();
    let hidden1 = |extra: serde_json::Value| {
        let mut i = json!({"name": "hidden_states", "shape": [1, H], "datatype": "FP32"});
        for (k, v) in extra.as_object().unwrap() {
            i[k] = v.clone();
        }
        json!({"inputs": [i]})
    };
    let valid = || rest_body(hidden1(json!({"data": x1.clone()})), &[]);
    let gzip = |b: &[u8]| {
        use std::io::Write;
        let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(b).unwrap();
        z.finish().unwrap()
    };
    let mut bodies: Vec<(&str, RestBody)> = vec![];
    let mut add = |case, body: RestBody| bodies.push((case, body));
    let not_json = "a body that is not the protocol's JSON (unknown fields included)";
    add(not_json, (vec![], b"{\"inputs\": [".to_vec()));
    add(not_json, rest_body(json!({"inputs": [], "extra": 1}), &[]));
    let over = "a body over --max-request-bytes (declared, sent or inflated)";
    add(over, (vec![], vec![b' '; 70_000]));
    let mut big = serde_json::to_vec(&hidden1(json!({"data": x1.clone()}))).unwrap();
    big.extend(std::iter::repeat_n(b' ', 70_000));
    add(
        over,
        (vec![("content-encoding", "gzip".into())], gzip(&big)),
    );
    let (_, plain) = valid();
    add(
        "Content-Encoding other than gzip, deflate, identity",
        (vec![("content-encoding", "br".into())], plain),
    );
    let sizes = "binary tensor sizes that do not add up to the body";
    add(
        sizes,
        rest_body(
            hidden1(json!({"parameters": {"binary_data_size": 4 * H}})),
            &[0; 8],
        ),
    );
    add(
        sizes,
        rest_body(
            hidden1(json!({"parameters": {"binary_data_size": 8}})),
            &[0; 16],
        ),
    );
    add(
        sizes,
        (
            vec![("inference-header-content-length", "100000".into())],
            b"{}".to_vec(),
        ),
    );
    add("an input with no data", rest_body(hidden1(json!({})), &[]));
    let fit = "JSON data not fitting the input's shape or datatype";
    add(fit, rest_body(hidden1(json!({"data": [1, 2, 3]})), &[]));
    add(fit, rest_body(hidden1(json!({"data": vec![true; H]})), &[]));
    let mut p = hidden1(json!({"data": x1.clone()}));
    p["parameters"] = json!({"p": [1]});
    add(
        "a parameter that is an array, an object or null",
        rest_body(p, &[]),
    );
    let mut p = hidden1(json!({"data": x1.clone()}));
    p["outputs"] = json!([{"name": "output", "parameters": {"binary_data": 1}}]);
    add(
        "binary_data, binary_data_output or binary_data_size of the wrong type",
        rest_body(p, &[]),
    );
    add(
        "an output in JSON with a NaN or infinite value",
        rest_body(hidden1(json!({"data": vec![3e38; H]})), &[]),
    );
    let mut outcomes: Vec<(&str, u16, String)> = vec![];
    for (case, (headers, body)) in bodies {
        let (status, _, b) =
            common::http(&http, "POST", "/v2/models/layer-0/infer", &headers, body).await;
        let msg = serde_json::from_slice::<serde_json::Value>(&b).unwrap()["error"]
            .as_str()
            .unwrap()
            .to_string();
        outcomes.push((case, status, msg));
        let (h, b) = valid();
        let (ok, _, _) = common::http(&http, "POST", "/v2/models/layer-0/infer", &h, b).await;
        assert_eq!(ok, 200, "serving after '{case}'");
    }
    let (s, _, b) = common::http(&http, "GET", "/v3/models", &[], vec![]).await;
    outcomes.push(("a path not served", s, String::from_utf8_lossy(&b).into()));
    let (s, _, b) = common::http(&http, "PUT", "/v2", &[], vec![]).await;
    outcomes.push((
        "a method a path does not take (HTTP 405)",
        s,
        String::from_utf8_lossy(&b).into(),
    ));
    // A 60 KB path: the answer quotes its first 128 characters and its length (404 and 405).
    let name = "m".repeat(60_000);
    for (method, path, code) in [
        ("GET", format!("/v3/{name}"), 404),
        ("PUT", format!("/v2/models/{name}/ready"), 405),
    ] {
        let (s, _, b) = common::http(&http, method, &path, &[], vec![]).await;
        let body = String::from_utf8_lossy(&b);
        let head = &body[..body.len().min(300)];
        assert_eq!(s, code, "{method} a 60 KB path: {head}");
        assert!(
            body.len() < 600,
            "{method}: a {} byte answer: {head}",
            body.len()
        );
        assert!(
            body.contains(&format!("({} bytes)", path.len())),
            "{method}: {head}"
        );
    }
    // 60 KB client strings inside the JSON and the path (#56: an unknown field's name and a
    // string where a number goes were quoted whole by the parser's message): every answer
    // quotes at most 128 characters of each.
    let long = "x".repeat(60_000);
    let row = |name: &str, datatype: &str, data: serde_json::Value| {
        serde_json::json!({"inputs": [{"name": name, "datatype": datatype, "shape": [1, 64],
                                        "data": data}]})
    };
    for (what, path, body) in [
        (
            "an unknown field",
            "/v2/models/layer-0/infer".to_string(),
            serde_json::json!({&long: 1}),
        ),
        (
            "a string for a number",
            "/v2/models/layer-0/infer".to_string(),
            row("hidden_states", "FP32", serde_json::json!([&long])),
        ),
        (
            "an input name",
            "/v2/models/layer-0/infer".to_string(),
            row(&long, "FP32", serde_json::json!([0.5])),
        ),
        (
            "a datatype",
            "/v2/models/layer-0/infer".to_string(),
            row("hidden_states", &long, serde_json::json!([0.5])),
        ),
        (
            "a model name",
            format!("/v2/models/{long}/infer"),
            row("hidden_states", "FP32", serde_json::json!(vec![0.5; 64])),
        ),
        (
            "a version",
            format!("/v2/models/layer-0/versions/{long}/infer"),
            row("hidden_states", "FP32", serde_json::json!(vec![0.5; 64])),
        ),
    ] {
        let body = serde_json::to_vec(&body).unwrap();
        let (s, _, b) = common::http(&http, "POST", &path, &[], body).await;
        let answer = String::from_utf8_lossy(&b);
        let head = &answer[..answer.len().min(300)];
        assert!(s >= 400, "{what}: {s} {head}");
        assert!(
            answer.len() < 600,
            "{what}: a {} byte answer: {head}",
            answer.len()
        );
    }
    // A body that stops coming: DEADLINE_EXCEEDED after --upload-timeout (1 s).
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(&http).await.unwrap();
        s.write_all(
            b"POST /v2/models/layer-0/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"in",
        )
        .await
        .unwrap();
        let mut reply = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut reply))
            .await
            .expect("answered after --upload-timeout")
            .unwrap();
        let reply = String::from_utf8_lossy(&reply).into_owned();
        let status = reply[9..12].parse().unwrap();
        outcomes.push((
            "a body that does not arrive within --upload-timeout",
            status,
            reply,
        ));
    }
    let http_code = |c: Code| match c {
        Code::InvalidArgument => 400,
        Code::NotFound => 404,
        Code::ResourceExhausted => 429,
        Code::DeadlineExceeded => 504,
        Code::Unimplemented => 405,
        c => panic!("no REST case has {c:?}"),
    };
    for entry in BAD_HTTP {
        let mine: Vec<_> = outcomes.iter().filter(|o| o.0 == entry.case).collect();
        assert!(!mine.is_empty(), "no request for '{}'", entry.case);
        for (case, status, msg) in mine {
            assert_eq!(*status, http_code(entry.code), "{case}: {msg}");
            assert!(msg.contains(entry.message), "{case}: {msg}");
        }
    }
    for o in &outcomes {
        assert!(
            BAD_HTTP.iter().any(|b| b.case == o.0),
            "{} is not in BAD_HTTP",
            o.0
        );
    }

    // CUDA shared memory needs a GPU rank: refused as over gRPC, and nothing is listed.
    let body = serde_json::to_vec(
        &json!({"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 64}),
    )
    .unwrap();
    let (s, _, b) = common::http(
        &http,
        "POST",
        "/v2/cudasharedmemory/region/r/register",
        &[],
        body,
    )
    .await;
    assert_eq!(s, 503, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("CUDA shared memory is not served here"));
    let (s, _, b) = get("/v2/cudasharedmemory/status").await;
    assert_eq!((s, b.as_ref()), (200, b"[]".as_ref()));

    // Statistics and metrics count REST requests.
    let (_, _, b) = get("/v2/models/layer-0/stats").await;
    let stats: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert!(
        stats["model_stats"][0]["inference_count"].as_u64().unwrap() > 0,
        "{stats}"
    );
    let (_, _, b) = get("/metrics").await;
    let metrics = common::prom::parse(&String::from_utf8_lossy(&b)).unwrap();
    let ok = common::prom::sum(
        &metrics,
        "epserve_requests_total",
        &[("method", "HttpModelInfer"), ("status", "OK")],
    );
    let bad = common::prom::sum(
        &metrics,
        "epserve_requests_total",
        &[("method", "HttpModelInfer"), ("status", "INVALID_ARGUMENT")],
    );
    assert!(ok >= 3.0 && bad >= 8.0, "ok {ok}, invalid {bad}");
}
