//! Triton's catalogue calls over KServe v2 (ModelConfig, RepositoryIndex, ModelStatistics), the
//! typed models, Triton's reserved parameters, compressed requests, reflection, and each bad call
//! of the catalogue's second table.

mod common;

use std::collections::HashMap;

use common::*;
use epserve::inference::infer_parameter::ParameterChoice;
use epserve::inference::{InferParameter, ModelInferRequest, ModelMetadataRequest};
use epserve::model::synthetic;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Code;

use common::kserve::*;

/// Triton's catalogue calls (ModelConfig, RepositoryIndex, ModelStatistics), the typed models,
/// Triton's reserved parameters, gzip and deflate requests, reflection v1alpha, and each bad
/// call of the catalogue's second table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn triton_calls_typed_models_and_compressed_requests() {
    use epserve::inference::{
        DataType, ModelConfigRequest, ModelStatisticsRequest, RepositoryIndexRequest,
    };
    use tonic::codec::CompressionEncoding::{Deflate, Gzip};
    let group = Group::launch(
        2,
        "synthetic:tiny",
        &[
            "--max-request-bytes",
            "1048576",
            "--max-tokens-per-step",
            "16",
        ],
    );
    let mut c = client(&group.addr).await;
    let spec = synthetic::preset("tiny").unwrap();
    let mut names = Vec::new();
    for &l in &spec.moe_layers {
        for gated in ["", "-gated"] {
            for suffix in ["", "-bf16", "-fp16"] {
                names.push(format!("layer-{l}{suffix}{gated}"));
            }
        }
    }

    // The index lists every model, READY.
    let index = c
        .repository_index(RepositoryIndexRequest::default())
        .await
        .unwrap()
        .into_inner();
    let listed: Vec<String> = index.models.iter().map(|m| m.name.clone()).collect();
    assert_eq!(listed, names);
    assert!(index
        .models
        .iter()
        .all(|m| m.state == "READY" && m.version == "1"));

    // Each model's config: full shapes, the routing inputs optional, its own float type, and
    // metadata that says the same.
    for name in &names {
        let cfg = c
            .model_config(ModelConfigRequest {
                name: name.clone(),
                version: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .config
            .unwrap();
        let gated = name.ends_with("-gated");
        let (float, label) = match name
            .trim_end_matches("-gated")
            .rsplit_once('-')
            .map(|p| p.1)
        {
            Some("bf16") => (DataType::TypeBf16, "BF16"),
            Some("fp16") => (DataType::TypeFp16, "FP16"),
            _ => (DataType::TypeFp32, "FP32"),
        };
        assert_eq!((cfg.name.as_str(), cfg.max_batch_size), (name.as_str(), 0));
        let inputs: Vec<_> = cfg
            .input
            .iter()
            .map(|i| (i.name.as_str(), i.data_type(), i.dims.clone(), i.optional))
            .collect();
        let mut want = vec![
            ("hidden_states", float, vec![-1, H as i64], false),
            ("topk_ids", DataType::TypeInt32, vec![-1, K as i64], true),
            ("topk_weights", DataType::TypeFp32, vec![-1, K as i64], true),
        ];
        if gated {
            want.truncate(1);
        }
        assert_eq!(inputs, want, "{name}");
        assert_eq!(cfg.output.len(), 1);
        assert_eq!(
            (cfg.output[0].data_type(), cfg.output[0].dims.clone()),
            (float, vec![-1, H as i64])
        );
        assert!(!cfg.model_transaction_policy.unwrap().decoupled);
        let m = c
            .model_metadata(ModelMetadataRequest {
                name: name.clone(),
                version: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(m.inputs[0].datatype, label, "{name}");
        assert_eq!(m.inputs.len(), want.len(), "{name}");
        assert_eq!(m.outputs[0].datatype, label, "{name}");
    }

    // layer-0-bf16 answers BF16 for BF16 in, as layer-0 does for the same rows, per token.
    let mut rng = ChaCha8Rng::seed_from_u64(36);
    let n = 5;
    let x: Vec<f32> = (0..n * H).map(|_| rng.random_range(-1.0..1.0)).collect();
    let bf16_request = |model: &str| {
        raw_request(
            model,
            "bf16",
            vec![(
                input("hidden_states", "BF16", &[n as i64, H as i64]),
                le_bf16(&x),
            )],
        )
    };
    let typed = c
        .model_infer(bf16_request("layer-0-bf16"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(typed.outputs[0].datatype, "BF16");
    let plain = c
        .model_infer(bf16_request("layer-0"))
        .await
        .unwrap()
        .into_inner();
    let (a, b) = (output_f32(&typed), output_f32(&plain));
    for t in 0..n {
        let e = row_error(&a[t * H..(t + 1) * H], &b[t * H..(t + 1) * H]);
        assert!(e <= 1e-6, "token {t}: {e}");
    }

    // Statistics: three answered FP32 requests and one refused one on layer-0, counted with
    // their queue and step times; the BF16 ones on layer-0-bf16.
    let stats_client = c.clone();
    let stats = |name: &str| {
        let mut c = stats_client.clone();
        let name = name.to_string();
        async move {
            let mut s = c
                .model_statistics(ModelStatisticsRequest {
                    name,
                    version: String::new(),
                })
                .await
                .unwrap()
                .into_inner()
                .model_stats;
            assert_eq!(s.len(), 1);
            s.remove(0)
        }
    };
    let before = stats("layer-0").await;
    for _ in 0..3 {
        c.model_infer(good(4)).await.unwrap();
    }
    let mut bad = good(2);
    bad.inputs[0].shape = vec![2, 32];
    bad.raw_input_contents = vec![le_f32(&[0.5; 64]).into()];
    c.model_infer(bad).await.unwrap_err();
    let after = stats("layer-0").await;
    let (i0, i1) = (
        before.inference_stats.unwrap(),
        after.inference_stats.unwrap(),
    );
    let count = |d: &Option<epserve::inference::StatisticDuration>| d.as_ref().unwrap().count;
    let ns = |d: &Option<epserve::inference::StatisticDuration>| d.as_ref().unwrap().ns;
    assert_eq!(count(&i1.success) - count(&i0.success), 3);
    assert_eq!(count(&i1.fail) - count(&i0.fail), 1);
    assert_eq!(count(&i1.queue) - count(&i0.queue), 3);
    // perf_analyzer wants the three compute counts equal.
    for (a, b) in [
        (&i0.compute_input, &i1.compute_input),
        (&i0.compute_infer, &i1.compute_infer),
        (&i0.compute_output, &i1.compute_output),
    ] {
        assert_eq!(count(b) - count(a), 3);
    }
    assert!(ns(&i1.compute_input) > ns(&i0.compute_input));
    assert!(ns(&i1.compute_output) > ns(&i0.compute_output));
    assert!(ns(&i1.compute_infer) > ns(&i0.compute_infer));
    assert!(ns(&i1.success) - ns(&i0.success) >= ns(&i1.compute_infer) - ns(&i0.compute_infer));
    assert_eq!(after.inference_count - before.inference_count, 3);
    let steps = after.execution_count - before.execution_count;
    assert!((1..=3).contains(&steps), "{steps} steps for 3 requests");
    assert!(after.last_inference >= before.last_inference && after.last_inference > 0);
    // Each request counts once, under the model it named: of the two BF16 requests above, the
    // one to layer-0-bf16 there (the one to layer-0 counted under layer-0); one to a -gated
    // model under it alone.
    let typed_stats = stats("layer-0-bf16").await.inference_stats.unwrap();
    assert_eq!(
        count(&typed_stats.success),
        1,
        "the BF16 request to layer-0-bf16"
    );
    let (plain0, gated0) = (stats("layer-0").await, stats("layer-0-gated").await);
    c.model_infer(ModelInferRequest {
        model_name: "layer-0-gated".into(),
        ..good(2)
    })
    .await
    .unwrap();
    let (plain1, gated1) = (stats("layer-0").await, stats("layer-0-gated").await);
    assert_eq!(gated1.inference_count - gated0.inference_count, 1);
    assert_eq!(plain1.inference_count, plain0.inference_count);
    // Every model's, and the queue times are the histogram's.
    let all = c
        .model_statistics(ModelStatisticsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .model_stats;
    assert_eq!(
        all.iter().map(|m| m.name.clone()).collect::<Vec<_>>(),
        names
    );
    // Summed over every model, each request once: the queue histogram's count.
    let queued: u64 = all
        .iter()
        .map(|m| count(&m.inference_stats.as_ref().unwrap().queue))
        .sum();
    let metrics = common::prom::scrape(&group.metrics_addrs(2)[0]);
    let histogram = common::prom::sum(&metrics, "epserve_request_queue_seconds_count", &[]);
    assert_eq!(queued as f64, histogram);

    // Triton's reserved parameters: the final-response flag on a stream, others ignored.
    let flagged = |id: &str, on: Option<bool>| {
        let mut r = ModelInferRequest {
            id: id.into(),
            ..good(2)
        };
        if let Some(on) = on {
            r.parameters.insert(
                "triton_enable_empty_final_response".into(),
                InferParameter {
                    parameter_choice: Some(ParameterChoice::BoolParam(on)),
                },
            );
        }
        r.parameters
            .insert("triton_some_future_flag".into(), string_param("x"));
        r
    };
    let mut s = c
        .model_stream_infer(tokio_stream::iter(vec![
            flagged("on", Some(true)),
            flagged("off", Some(false)),
            flagged("unset", None),
        ]))
        .await
        .unwrap()
        .into_inner();
    let mut finals = HashMap::new();
    while let Some(item) = s.next().await {
        let item = item.unwrap();
        assert!(item.error_message.is_empty(), "{}", item.error_message);
        let r = item.infer_response.unwrap();
        assert_eq!(output_f32(&r).len(), 2 * H);
        let fin = r
            .parameters
            .get("triton_final_response")
            .map(|p| p.parameter_choice.clone());
        finals.insert(r.id.clone(), fin);
    }
    assert_eq!(
        finals["on"],
        Some(Some(ParameterChoice::BoolParam(true))),
        "the one response is the last"
    );
    assert_eq!((&finals["off"], &finals["unset"]), (&None, &None));

    // gzip and deflate requests, on the unary path we frame (ModelInfer, Forward) and on tonic's
    // (a stream), answer as the plain request does.
    let want = output_f32(&c.model_infer(good(3)).await.unwrap().into_inner());
    for e in [Gzip, Deflate] {
        let mut z = client(&group.addr).await.send_compressed(e);
        let got = output_f32(&z.model_infer(good(3)).await.unwrap().into_inner());
        assert_eq!(got, want, "{e:?}");
        let item = z
            .model_stream_infer(tokio_stream::iter(vec![good(3)]))
            .await
            .unwrap()
            .into_inner()
            .next()
            .await
            .unwrap()
            .unwrap();
        assert_eq!(output_f32(&item.infer_response.unwrap()), want, "{e:?}");
        let mut v1 = group.client().await.send_compressed(e);
        let x: Vec<f32> = (0..2 * H).map(|i| (i % 7) as f32 / 7.0).collect();
        let r = request("z", 0, f32_tensor(&x, [2, H]));
        let plain = group.client().await.forward(r.clone()).await.unwrap();
        let zipped = v1.forward(r).await.unwrap();
        assert_eq!(
            decode(zipped.get_ref().output.as_ref().unwrap()),
            decode(plain.get_ref().output.as_ref().unwrap())
        );
    }

    // Reflection v1alpha lists what v1 does.
    let channel = Channel::from_shared(format!("http://{}", group.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (v1, alpha) = (
        reflected_services(channel.clone()).await,
        reflected_services_v1alpha(channel).await,
    );
    assert_eq!(v1, alpha);
    for s in [
        "inference.GRPCInferenceService",
        "epserve.v1.MoeService",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(alpha.iter().any(|n| n == s), "{s}: {alpha:?}");
    }

    // The bad calls, each answered with its status and message, the service serving after.
    let frame = |flag: u8, msg: Vec<u8>| {
        let mut f = vec![flag];
        f.extend((msg.len() as u32).to_be_bytes());
        f.extend(msg);
        f
    };
    let infer = "/inference.GRPCInferenceService/ModelInfer";
    let forward = "/epserve.v1.MoeService/Forward";
    let plain_infer = frame(0, prost::Message::encode_to_vec(&good(1)));
    // 2 MiB of zero rows, a few KiB gzipped.
    let big = {
        use std::io::Write;
        let rows = (2 << 20) / (4 * H);
        let r = raw_request("layer-0", "big", vec![hidden(rows, &vec![0.0; rows * H])]);
        let mut w = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        w.write_all(&prost::Message::encode_to_vec(&r)).unwrap();
        frame(1, w.finish().unwrap())
    };
    let mut outcomes: Vec<(&str, Code, String)> = Vec::new();
    for (path, name) in [
        (
            "/inference.GRPCInferenceService/RepositoryModelLoad",
            "RepositoryModelLoad",
        ),
        ("/no.Such/Service", "no.Such"),
    ] {
        let (code, msg) = raw_unary(&group.addr, path, &[], plain_infer.clone()).await;
        assert!(msg.contains(name), "{msg}");
        outcomes.push(("a method not served", Code::from(code), msg));
    }
    for path in [infer, forward] {
        let (code, msg) = raw_unary(
            &group.addr,
            path,
            &[("grpc-encoding", "snappy")],
            plain_infer.clone(),
        )
        .await;
        outcomes.push((
            "grpc-encoding other than gzip, deflate, identity",
            Code::from(code),
            msg,
        ));
    }
    let (code, msg) = raw_unary(&group.addr, infer, &[("grpc-encoding", "gzip")], big).await;
    outcomes.push((
        "a compressed message inflating past --max-request-bytes",
        Code::from(code),
        msg,
    ));
    let e = c
        .model_statistics(ModelStatisticsRequest {
            name: String::new(),
            version: "1".into(),
        })
        .await
        .unwrap_err();
    outcomes.push((
        "ModelStatistics with a version but no model name",
        e.code(),
        e.message().into(),
    ));
    let e = c
        .repository_index(RepositoryIndexRequest {
            repository_name: "models".into(),
            ready: false,
        })
        .await
        .unwrap_err();
    outcomes.push((
        "RepositoryIndex of a named repository",
        e.code(),
        e.message().into(),
    ));
    for e in [
        c.model_config(ModelConfigRequest {
            name: "layer-99".into(),
            version: String::new(),
        })
        .await
        .unwrap_err(),
        c.model_statistics(ModelStatisticsRequest {
            name: "layer-0-fp32".into(),
            version: String::new(),
        })
        .await
        .unwrap_err(),
    ] {
        outcomes.push((
            "ModelConfig or ModelStatistics of an unknown model or version",
            e.code(),
            e.message().into(),
        ));
    }
    check_bad_calls(&outcomes, false);
    c.model_infer(good(1))
        .await
        .expect("serving after the bad calls");
}
