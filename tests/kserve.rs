//! KServe v2 / the Open Inference Protocol as a client sees it, through the generated stubs:
//! metadata, inference equal to Forward and to the f64 reference per token, client routing, and
//! readiness through start, stall and drain. The catalogue's bad inputs are `kserve_bad_input`,
//! Triton's calls `kserve_triton`, shared memory `kserve_shm`, REST `kserve_rest`
//! (`tests/tritonclient/` runs the stock Python Triton client against the same surface in CI).

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::reference::{token, RefLayer, TIE_MARGIN};
use common::*;
use epserve::inference::model_infer_request::InferRequestedOutputTensor;
use epserve::inference::{
    InferTensorContents, ModelInferRequest, ModelMetadataRequest, ModelReadyRequest,
    ServerLiveRequest, ServerMetadataRequest, ServerReadyRequest,
};
use epserve::model::synthetic;
use epserve::proto::{DType, ForwardRequest};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio_stream::StreamExt;
use tonic::Code;

use common::kserve::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_and_inference_equal_forward_and_the_reference_per_token() {
    let group = Group::launch(2, "synthetic:tiny", &["--max-tokens-per-step", "16"]);
    let mut c = client(&group.addr).await;
    let mut v1 = group.client().await;
    assert!(
        c.server_live(ServerLiveRequest {})
            .await
            .unwrap()
            .into_inner()
            .live
    );
    assert!(
        c.server_ready(ServerReadyRequest {})
            .await
            .unwrap()
            .into_inner()
            .ready
    );
    let meta = c
        .server_metadata(ServerMetadataRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(meta.name, "epserve");
    assert_eq!(meta.version, env!("CARGO_PKG_VERSION"));

    let spec = synthetic::preset("tiny").unwrap();
    assert_eq!((spec.hidden, spec.top_k, spec.num_experts), (H, K, E));
    for &layer in &spec.moe_layers {
        let name = format!("layer-{layer}");
        for version in ["", "1"] {
            let ready = c
                .model_ready(ModelReadyRequest {
                    name: name.clone(),
                    version: version.into(),
                })
                .await
                .unwrap()
                .into_inner();
            assert!(ready.ready, "{name} v{version:?}");
            let m = c
                .model_metadata(ModelMetadataRequest {
                    name: name.clone(),
                    version: version.into(),
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(
                (m.name.as_str(), m.versions.as_slice()),
                (name.as_str(), &["1".to_string()][..])
            );
            assert_eq!(m.platform, "epserve");
            let shapes: Vec<(String, String, Vec<i64>)> = m
                .inputs
                .iter()
                .chain(&m.outputs)
                .map(|t| (t.name.clone(), t.datatype.clone(), t.shape.clone()))
                .collect();
            let want = [
                ("hidden_states", "FP32", H),
                ("topk_ids", "INT32", K),
                ("topk_weights", "FP32", K),
                ("output", "FP32", H),
            ];
            let want: Vec<(String, String, Vec<i64>)> = want
                .iter()
                .map(|(n, d, c)| (n.to_string(), d.to_string(), vec![-1, *c as i64]))
                .collect();
            assert_eq!(shapes, want);
        }
    }
    for (name, version) in [("layer-7", ""), ("nope", "1"), ("layer-0", "2")] {
        let r = ModelReadyRequest {
            name: name.into(),
            version: version.into(),
        };
        assert!(
            !c.model_ready(r).await.unwrap().into_inner().ready,
            "{name}"
        );
        let e = c
            .model_metadata(ModelMetadataRequest {
                name: name.into(),
                version: version.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{name} {version}: {e:?}");
    }

    // Inference: the same random input through KServe v2 and Forward, every token compared with
    // Forward (same f32 backend: <= 1e-6) and with the f64 reference.
    let refs: Vec<RefLayer> = spec
        .moe_layers
        .iter()
        .map(|&l| RefLayer::from_weights(&synthetic::layer(&spec, 0, l, 0..E), H))
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let (mut tokens, mut ties) = (0, 0);
    for (slot, &layer) in spec.moe_layers.iter().enumerate() {
        for n in [1usize, 5, 37] {
            for form in [
                "fp32-raw",
                "fp32-contents",
                "bf16-raw",
                "routing-i32",
                "routing-i64",
                "bf16-out",
            ] {
                let mut x: Vec<f32> = (0..n * H).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let bf16_in = form == "bf16-raw";
                if bf16_in {
                    x.iter_mut()
                        .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
                }
                let id = format!("l{layer}-n{n}-{form}");
                let shape = [n as i64, H as i64];
                let mut k = ModelInferRequest {
                    model_name: format!("layer-{layer}"),
                    model_version: if n == 5 { "1".into() } else { String::new() },
                    id: id.clone(),
                    ..Default::default()
                };
                let mut f = ForwardRequest {
                    id: id.clone(),
                    layer,
                    ..Default::default()
                };
                let mut raw: Vec<Vec<u8>> = Vec::new();
                if form == "fp32-contents" {
                    let mut t = input("hidden_states", "FP32", &shape);
                    t.contents = Some(InferTensorContents {
                        fp32_contents: x.clone(),
                        ..Default::default()
                    });
                    k.inputs.push(t);
                } else if bf16_in {
                    k.inputs.push(input("hidden_states", "BF16", &shape));
                    raw.push(le_bf16(&x));
                } else {
                    k.inputs.push(input("hidden_states", "FP32", &shape));
                    raw.push(le_f32(&x));
                }
                f.hidden_states = Some(if bf16_in {
                    bf16_tensor(&x, [n, H])
                } else {
                    f32_tensor(&x, [n, H])
                });
                let mut routing = None;
                if form.starts_with("routing") {
                    let mut ids = Vec::new();
                    for _ in 0..n {
                        ids.extend(
                            rand::seq::index::sample(&mut rng, E, K)
                                .into_iter()
                                .map(|e| e as i32),
                        );
                    }
                    let w: Vec<f32> = (0..n * K).map(|_| rng.random_range(0.05f32..1.0)).collect();
                    let kshape = [n as i64, K as i64];
                    if form == "routing-i32" {
                        // Raw data is all or nothing: every input carries it.
                        k.inputs.push(input("topk_ids", "INT32", &kshape));
                        raw.push(ids.iter().flat_map(|v| v.to_le_bytes()).collect());
                        k.inputs.push(input("topk_weights", "FP32", &kshape));
                        raw.push(le_f32(&w));
                    } else {
                        // Typed contents for every input, hidden states included.
                        k.inputs[0].contents = Some(InferTensorContents {
                            fp32_contents: x.clone(),
                            ..Default::default()
                        });
                        raw.clear();
                        let mut t = input("topk_ids", "INT64", &kshape);
                        t.contents = Some(InferTensorContents {
                            int64_contents: ids.iter().map(|&v| i64::from(v)).collect(),
                            ..Default::default()
                        });
                        k.inputs.push(t);
                        let mut t = input("topk_weights", "FP32", &kshape);
                        t.contents = Some(InferTensorContents {
                            fp32_contents: w.clone(),
                            ..Default::default()
                        });
                        k.inputs.push(t);
                    }
                    f.topk_ids = Some(i32_tensor(&ids, [n, K]));
                    f.topk_weights = Some(f32_tensor(&w, [n, K]));
                    routing = Some((
                        ids.iter().map(|&v| v as usize).collect::<Vec<_>>(),
                        w.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>(),
                    ));
                }
                if form == "bf16-out" {
                    k.parameters
                        .insert("output_datatype".into(), string_param("BF16"));
                    f.output_dtype = DType::Bf16 as i32;
                    k.outputs.push(InferRequestedOutputTensor {
                        name: "output".into(),
                        parameters: HashMap::new(),
                    });
                }
                k.raw_input_contents = raw.into_iter().map(Into::into).collect();
                let got = c
                    .model_infer(k)
                    .await
                    .unwrap_or_else(|e| panic!("{id}: {e:?}"))
                    .into_inner();
                assert_eq!(
                    (
                        got.id.as_str(),
                        got.model_name.as_str(),
                        got.model_version.as_str()
                    ),
                    (id.as_str(), format!("layer-{layer}").as_str(), "1")
                );
                let want_dt = if bf16_in || form == "bf16-out" {
                    "BF16"
                } else {
                    "FP32"
                };
                assert_eq!(got.outputs[0].datatype, want_dt, "{id}");
                let out = output_f32(&got);
                let fwd = decode(&v1.forward(f).await.unwrap().into_inner().output.unwrap());
                let xf: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
                let tol = if want_dt == "BF16" { 2e-2 } else { 1e-5 };
                for t in 0..n {
                    let row = t * H..(t + 1) * H;
                    let e = row_error(&out[row.clone()], &fwd[row.clone()]);
                    assert!(e <= 1e-6, "{id} token {t}: KServe vs Forward {e:.3e}");
                    let r = routing.as_ref().map(|(i, w): &(Vec<usize>, Vec<f64>)| {
                        (&i[t * K..(t + 1) * K], &w[t * K..(t + 1) * K])
                    });
                    let (want, margin) = token(&spec, &refs[slot], &xf[row.clone()], r);
                    tokens += 1;
                    if margin < TIE_MARGIN {
                        ties += 1;
                        continue;
                    }
                    let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
                    let e = row_error(&out[row], &want);
                    assert!(
                        e <= tol,
                        "{id} token {t}: vs f64 reference {e:.3e} > {tol:e}"
                    );
                }
            }
        }
    }
    assert!(
        ties * 10 <= tokens,
        "{ties} of {tokens} tokens were near-ties"
    );

    // #56 item 6: client shared memory is off without --allow-client-shm. The probe registered
    // another process's object of the service's user by name, read it 4 bytes a request through
    // an error message and overwrote it with an output; now its registration is refused.
    let dir = std::env::temp_dir().join(format!("epserve-theirs-{}", std::process::id()));
    std::fs::write(&dir, vec![7u8; 4096]).unwrap();
    let e = c
        .system_shared_memory_register(epserve::inference::SystemSharedMemoryRegisterRequest {
            name: "theirs".into(),
            key: format!("/{}", dir.file_name().unwrap().to_str().unwrap()),
            offset: 0,
            byte_size: 4096,
        })
        .await
        .unwrap_err();
    std::fs::remove_file(&dir).unwrap();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("--allow-client-shm"), "{e:?}");
}

/// ServerLive follows liveness; ServerReady and ModelReady follow readiness: not ready while the
/// group forms or drains, and inference is refused UNAVAILABLE then, while an admitted request
/// is still answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_start_stall_and_drain() {
    let shm = TempDir::new("kserve-health");
    let serve = |rank: usize, rendezvous: &str| serve(rank, 2, rendezvous, &shm, FAST_LIVENESS);
    let mut r0 = serve(0, "127.0.0.1:0");
    let rendezvous = r0
        .wait_for("epserve-rendezvous ", Duration::from_secs(30))
        .unwrap();
    let addr = r0
        .wait_for("gRPC listening on", Duration::from_secs(30))
        .unwrap();
    let addr = addr.split(',').next().unwrap().to_string();
    let mut c = client(&addr).await;
    assert_eq!(ready(&mut c).await, (true, false, false));
    let e = c.model_infer(good(1)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("starting"), "{e:?}");

    let mut r1 = serve(1, &rendezvous);
    until(&mut c, (true, true, true), Duration::from_secs(30)).await;
    c.model_infer(good(2)).await.unwrap();

    // A stopped rank stalls the heartbeat step: not live, and back once it runs.
    let worker = r1.child.id();
    kill(worker, "STOP");
    until(&mut c, (false, true, true), Duration::from_secs(5)).await;
    // Drain: a request inside the stalled step, then SIGTERM to both ranks.
    let mut inside = c.clone();
    let admitted = tokio::spawn(async move { inside.model_infer(good(3)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    r0.signal("TERM");
    kill(worker, "TERM");
    until(&mut c, (false, false, false), Duration::from_secs(5)).await;
    let e = c.model_infer(good(1)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("draining"), "{e:?}");
    let mut s = c
        .model_stream_infer(tokio_stream::iter(vec![good(1)]))
        .await
        .unwrap()
        .into_inner();
    let item = s.next().await.unwrap().unwrap();
    assert!(
        item.error_message.starts_with("UNAVAILABLE: draining"),
        "{}",
        item.error_message
    );
    kill(worker, "CONT");
    let answered = admitted
        .await
        .unwrap()
        .expect("an admitted request is answered during the drain");
    assert_eq!(output_f32(&answered.into_inner()).len(), 3 * H);
    for p in [&mut r0, &mut r1] {
        let st = p
            .wait_exit(Duration::from_secs(10))
            .expect("exits after the drain");
        assert!(st.success(), "{st}: {}", p.log_text());
    }
}
