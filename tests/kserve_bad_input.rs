//! KServe v2's bad inputs: every case of the catalogue's first table named in its answer, and
//! the service serving on after each.

mod common;

use std::collections::HashMap;

use common::*;
use epserve::api::catalogue::BAD_INPUT;
use epserve::inference::infer_parameter::ParameterChoice;
use epserve::inference::model_infer_request::InferRequestedOutputTensor;
use epserve::inference::{InferParameter, InferTensorContents, ModelInferRequest};
use tokio_stream::StreamExt;
use tonic::Code;

use common::kserve::*;

/// Requests for every KServe v2 case of the catalogue: (case, what the message must also say,
/// request).
fn bad_requests() -> Vec<(&'static str, &'static str, ModelInferRequest)> {
    let x = vec![0.5f32; 2 * H];
    let with = |f: &dyn Fn(&mut ModelInferRequest)| {
        let mut r = good(2);
        f(&mut r);
        r
    };
    let routed = |ids: &[i32], ishape: [i64; 2], w: &[f32], wshape: [i64; 2]| {
        raw_request(
            "layer-0",
            "x",
            vec![
                hidden(2, &x),
                (
                    input("topk_ids", "INT32", &ishape),
                    ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ),
                (input("topk_weights", "FP32", &wshape), le_f32(w)),
            ],
        )
    };
    let mut v =
        vec![
        ("no hidden_states", "", raw_request("layer-0", "x", vec![])),
        (
            "hidden size other than the model's",
            "hidden size 32 does not match the model's 64",
            raw_request(
                "layer-0",
                "x",
                vec![(input("hidden_states", "FP32", &[2, 32]), le_f32(&x[..64]))],
            ),
        ),
        (
            "shape not [n, hidden]",
            "shape [2, 1, 64] must be [n, 64]",
            raw_request(
                "layer-0",
                "x",
                vec![(input("hidden_states", "FP32", &[2, 1, 64]), le_f32(&x))],
            ),
        ),
        (
            "shape not [n, hidden]",
            "shape [-2, 64] must be [n, 64]",
            raw_request(
                "layer-0",
                "x",
                vec![(input("hidden_states", "FP32", &[-2, 64]), le_f32(&x))],
            ),
        ),
        (
            "zero tokens",
            "no tokens",
            raw_request(
                "layer-0",
                "x",
                vec![(input("hidden_states", "FP32", &[0, 64]), vec![])],
            ),
        ),
        (
            "bytes not matching shape and dtype",
            "100 bytes of data for shape [2, 64] of FP32 (expected 512)",
            raw_request(
                "layer-0",
                "x",
                vec![(input("hidden_states", "FP32", &[2, 64]), vec![0; 100])],
            ),
        ),
        (
            "integer hidden states or weights, float ids",
            "hidden_states: dtype INT32 not accepted here (accepted: BF16, FP16, FP32)",
            raw_request(
                "layer-0",
                "x",
                vec![(input("hidden_states", "INT32", &[2, 64]), le_f32(&x))],
            ),
        ),
        (
            "integer hidden states or weights, float ids",
            "dtype FP64 not accepted here",
            raw_request(
                "layer-0",
                "x",
                vec![(input("hidden_states", "FP64", &[2, 64]), vec![0; 1024])],
            ),
        ),
        (
            "integer hidden states or weights, float ids",
            "topk_ids: dtype FP32 not accepted here (accepted: INT32, INT64)",
            {
                let mut r = routed(&[0, 1, 2, 3], [2, 2], &[0.5; 4], [2, 2]);
                r.inputs[1].datatype = "FP32".into();
                r
            },
        ),
        (
            "NaN or infinity in hidden states or weights",
            "non-finite value at row 1, column 3",
            {
                let mut y = x.clone();
                y[H + 3] = f32::NAN;
                raw_request("layer-0", "x", vec![hidden(2, &y)])
            },
        ),
        (
            "NaN or infinity in hidden states or weights",
            "topk_weights: non-finite value at row 0, column 1",
            routed(
                &[0, 1, 2, 3],
                [2, 2],
                &[0.5, f32::INFINITY, 0.5, 0.5],
                [2, 2],
            ),
        ),
        (
            "expert id outside 0..E",
            "the expert id at row 1, column 1 is out of range 0..8",
            routed(&[0, 1, 2, 8], [2, 2], &[0.5; 4], [2, 2]),
        ),
        (
            "an expert twice in one row",
            "row 1 names one expert twice (columns 0 and 1)",
            routed(&[0, 1, 3, 3], [2, 2], &[0.5; 4], [2, 2]),
        ),
        (
            "topk_ids or topk_weights not [n, top_k]",
            "topk_ids: shape [1, 2] must be [2, 2]",
            routed(&[0, 1], [1, 2], &[0.5; 4], [2, 2]),
        ),
        (
            "topk_ids or topk_weights not [n, top_k]",
            "topk_weights: shape [2, 3] must be [2, 2]",
            routed(&[0, 1, 2, 3], [2, 2], &[0.5; 6], [2, 3]),
        ),
        ("topk_weights without topk_ids", "", {
            let mut r = routed(&[0, 1, 2, 3], [2, 2], &[0.5; 4], [2, 2]);
            r.inputs.remove(1);
            r.raw_input_contents.remove(1);
            r
        }),
        ("topk_ids without topk_weights", "", {
            let mut r = routed(&[0, 1, 2, 3], [2, 2], &[0.5; 4], [2, 2]);
            r.inputs.remove(2);
            r.raw_input_contents.remove(2);
            r
        }),
        (
            "output_dtype not a float dtype",
            "output_datatype: INT64 is not a float dtype",
            with(&|r| {
                r.parameters
                    .insert("output_datatype".into(), string_param("INT64"));
            }),
        ),
        (
            "message over --max-request-bytes",
            "the limit is: 1048576 bytes",
            good(5000),
        ),
        (
            "more tokens than --max-queued-tokens",
            "a request of 1001 tokens exceeds --max-queued-tokens (1000)",
            good(1001),
        ),
        (
            "unknown model",
            "unknown model \"layer-9\" (models: layer-0, layer-1, each also as <name>-bf16 and <name>-fp16, and each of those -gated)",
            with(&|r| r.model_name = "layer-9".into()),
        ),
        (
            "unknown model",
            "… (100000 bytes) (models: layer-0, layer-1, each",
            with(&|r| r.model_name = "m".repeat(100_000)),
        ),
        (
            "input other than hidden_states, topk_ids, topk_weights",
            "… (100000 bytes) (inputs: hidden_states, topk_ids, topk_weights)",
            with(&|r| r.inputs[0].name = "i".repeat(100_000)),
        ),
        (
            "tensor parameter other than the shared-memory ones (input or output)",
            "… (100000 bytes) is not supported (supported: shared_memory_region,",
            with(&|r| {
                r.inputs[0]
                    .parameters
                    .insert("p".repeat(100_000), string_param("x"));
            }),
        ),
        (
            "shape not [n, hidden]",
            "shape [1, 1, 1, 1, 1, 1, 1, 1, …] (100000 dims) must be [n, 64]",
            with(&|r| r.inputs[0].shape = vec![1; 100_000]),
        ),
        (
            "model version other than 1",
            "model \"layer-0\" has no version \"2\" (versions: 1)",
            with(&|r| r.model_version = "2".into()),
        ),
        (
            "datatype string outside the protocol",
            "hidden_states: unknown datatype \"float32\"",
            with(&|r| r.inputs[0].datatype = "float32".into()),
        ),
        (
            "input other than hidden_states, topk_ids, topk_weights",
            "unknown input \"INPUT0\"",
            with(&|r| r.inputs[0].name = "INPUT0".into()),
        ),
        (
            "an input twice",
            "input \"hidden_states\" given twice",
            with(&|r| {
                r.inputs.push(r.inputs[0].clone());
                r.raw_input_contents.push(r.raw_input_contents[0].clone());
            }),
        ),
        (
            "output other than output",
            "unknown output \"OUTPUT0\" (outputs: output)",
            with(&|r| {
                r.outputs.push(InferRequestedOutputTensor {
                    name: "OUTPUT0".into(),
                    parameters: HashMap::new(),
                })
            }),
        ),
        (
            "raw_input_contents not one per input",
            "raw_input_contents has 2 entries for 1 inputs",
            with(&|r| r.raw_input_contents.push(r.raw_input_contents[0].clone())),
        ),
        (
            "data both in contents and raw_input_contents",
            "hidden_states: data given both in contents and in raw_input_contents",
            with(&|r| {
                r.inputs[0].contents = Some(InferTensorContents {
                    fp32_contents: vec![0.5; 2 * H],
                    ..Default::default()
                })
            }),
        ),
        (
            "an input without data",
            "hidden_states: no data",
            with(&|r| r.raw_input_contents.clear()),
        ),
        (
            "typed contents in another field than the datatype's",
            "hidden_states: FP32 data belongs in contents.fp32_contents, which is empty",
            with(&|r| {
                r.raw_input_contents.clear();
                r.inputs[0].contents = Some(InferTensorContents {
                    int_contents: vec![1; 2 * H],
                    ..Default::default()
                });
            }),
        ),
        (
            "BF16 or FP16 data in contents",
            "hidden_states: FP16 data goes in raw_input_contents",
            with(&|r| {
                r.raw_input_contents.clear();
                r.inputs[0].datatype = "FP16".into();
                r.inputs[0].contents = Some(InferTensorContents {
                    fp32_contents: vec![0.5; 2 * H],
                    ..Default::default()
                });
            }),
        ),
        (
            "request parameter read here (output_datatype, timeout, triton_enable_empty_final_response) or passed by Triton's client (priority, sequence_id, sequence_start, sequence_end) of the wrong type",
            "parameter \"priority\": a string value is not valid here",
            with(&|r| {
                r.parameters
                    .insert("priority".into(), string_param("high"));
            }),
        ),
        (
            "tensor parameter other than the shared-memory ones (input or output)",
            "hidden_states: parameter \"binary_data\" is not supported",
            with(&|r| {
                r.inputs[0]
                    .parameters
                    .insert("binary_data".into(), string_param("r0"));
            }),
        ),
        (
            "tensor parameter other than the shared-memory ones (input or output)",
            "output output: parameter \"classification\" is not supported",
            with(&|r| {
                let mut parameters = HashMap::new();
                parameters.insert(
                    "classification".into(),
                    InferParameter {
                        parameter_choice: Some(ParameterChoice::Int64Param(3)),
                    },
                );
                r.outputs.push(InferRequestedOutputTensor {
                    name: "output".into(),
                    parameters,
                });
            }),
        ),
        (
            "request parameter read here (output_datatype, timeout, triton_enable_empty_final_response) or passed by Triton's client (priority, sequence_id, sequence_start, sequence_end) of the wrong type",
            "parameter \"timeout\": a string value is not valid here",
            with(&|r| {
                r.parameters.insert("timeout".into(), string_param("5s"));
            }),
        ),
        (
            "request parameter read here (output_datatype, timeout, triton_enable_empty_final_response) or passed by Triton's client (priority, sequence_id, sequence_start, sequence_end) of the wrong type",
            "parameter \"triton_enable_empty_final_response\": a string value is not valid here",
            with(&|r| {
                r.parameters
                    .insert("triton_enable_empty_final_response".into(), string_param("yes"));
            }),
        ),
        (
            "hidden states in another type than a typed model's (layer-L-bf16, layer-L-fp16)",
            "hidden_states: dtype FP32 not accepted here (accepted: BF16)",
            with(&|r| r.model_name = "layer-0-bf16".into()),
        ),
    ];
    for (_, _, r) in &mut v {
        r.id = "bad".into();
    }
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
    let mut c = client(&group.addr).await;
    let cases = bad_requests();
    for entry in BAD_INPUT.iter().filter(|b| b.on.kserve()) {
        let mine: Vec<_> = cases
            .iter()
            .filter(|(case, _, _)| *case == entry.case)
            .collect();
        assert!(
            !mine.is_empty(),
            "no KServe request for catalogue case '{}'",
            entry.case
        );
        for (case, detail, req) in mine {
            let err = c.model_infer(req.clone()).await.expect_err(case);
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
                .model_infer(good(3))
                .await
                .expect("valid request after a bad one");
            assert_eq!(output_f32(&ok.into_inner()).len(), 3 * H);
        }
    }
    for (case, _, _) in &cases {
        assert!(
            BAD_INPUT.iter().any(|b| b.case == *case && b.on.kserve()),
            "'{case}' is not a KServe case of the catalogue"
        );
    }
    // A deadline from Triton's `timeout` parameter (µs), as from grpc-timeout.
    let mut late = good(2);
    late.parameters.insert(
        "timeout".into(),
        InferParameter {
            parameter_choice: Some(ParameterChoice::Int64Param(0)),
        },
    );
    let e = c.model_infer(late).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");

    // What Triton's client passes through (priority, the sequence fields) and custom keys, which
    // Triton hands to a backend that here reads none: answered as the same request without.
    let plain = output_f32(&c.model_infer(good(4)).await.unwrap().into_inner());
    let mut passed = good(4);
    for (k, v) in [
        ("priority", ParameterChoice::Uint64Param(3)),
        (
            "sequence_id",
            ParameterChoice::StringParam("conversation-7".into()),
        ),
        ("sequence_start", ParameterChoice::BoolParam(true)),
        ("sequence_end", ParameterChoice::BoolParam(false)),
        (
            "triton_grpc_forward_header",
            ParameterChoice::BoolParam(true),
        ),
        ("my_tag", ParameterChoice::StringParam("x".repeat(100_000))),
        ("my_weight", ParameterChoice::DoubleParam(0.5)),
    ] {
        passed.parameters.insert(
            k.into(),
            InferParameter {
                parameter_choice: Some(v),
            },
        );
    }
    let got = c
        .model_infer(passed)
        .await
        .expect("pass-through parameters");
    assert_eq!(output_f32(&got.into_inner()), plain);

    // On a stream every request is answered with its id, errors in error_message (with their
    // code), and the stream carries on.
    let small: Vec<_> = cases
        .iter()
        .filter(|(case, _, _)| !case.starts_with("message over"))
        .enumerate()
        .map(|(i, (case, d, r))| (format!("bad-{i}"), *case, *d, r))
        .collect();
    let mut items = vec![ModelInferRequest {
        id: "first".into(),
        ..good(1)
    }];
    items.extend(small.iter().map(|(id, _, _, r)| ModelInferRequest {
        id: id.clone(),
        ..(*r).clone()
    }));
    items.push(ModelInferRequest {
        id: "last".into(),
        ..good(5)
    });
    let mut s = c
        .model_stream_infer(tokio_stream::iter(items.clone()))
        .await
        .unwrap()
        .into_inner();
    let mut seen = HashMap::new();
    while let Some(item) = s.next().await {
        let item = item.unwrap();
        let resp = item
            .infer_response
            .expect("every answer carries the request's id");
        assert!(seen
            .insert(resp.id.clone(), (item.error_message, resp))
            .is_none());
    }
    assert_eq!(seen.len(), items.len());
    for id in ["first", "last"] {
        let (err, resp) = &seen[id];
        assert!(err.is_empty(), "{id}: {err}");
        assert!(!output_f32(resp).is_empty());
    }
    for (id, case, detail, _) in &small {
        let (err, resp) = &seen[id.as_str()];
        let entry = BAD_INPUT.iter().find(|b| b.case == *case).unwrap();
        let code = code_name(entry.code);
        assert!(
            err.starts_with(&format!("{code}: ")),
            "{id} ({case}): {err}"
        );
        for want in [entry.message, detail] {
            assert!(
                err.contains(want),
                "{id} ({case}): want '{want}', got '{err}'"
            );
        }
        assert!(resp.outputs.is_empty() && resp.raw_output_contents.is_empty());
    }
}
