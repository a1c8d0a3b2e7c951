//! KServe v2 / the Open Inference Protocol as a client sees it, through the generated stubs:
//! metadata, readiness through start, stall and drain, inference equal to Forward and to the f64
//! reference per token, client routing, every bad-input case of the catalogue, and streaming.
//! (`tests/tritonclient/` runs the stock Python Triton client against the same surface in CI.)

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::reference::{token, RefLayer, TIE_MARGIN};
use common::*;
use epserve::api::catalogue::BAD_INPUT;
use epserve::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use epserve::inference::infer_parameter::ParameterChoice;
use epserve::inference::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use epserve::inference::{
    InferParameter, InferTensorContents, ModelInferRequest, ModelInferResponse,
    ModelMetadataRequest, ModelReadyRequest, ServerLiveRequest, ServerMetadataRequest,
    ServerReadyRequest,
};
use epserve::model::synthetic;
use epserve::proto::{DType, ForwardRequest};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Code;

type Client = GrpcInferenceServiceClient<Channel>;

const H: usize = 64; // synthetic:tiny
const K: usize = 2;
const E: usize = 8;

async fn client(addr: &str) -> Client {
    GrpcInferenceServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(256 << 20)
        .max_encoding_message_size(256 << 20)
}

fn le_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn le_bf16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect()
}

fn input(name: &str, datatype: &str, shape: &[i64]) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
        ..Default::default()
    }
}

/// A request whose inputs all carry raw data.
fn raw_request(
    model: &str,
    id: &str,
    inputs: Vec<(InferInputTensor, Vec<u8>)>,
) -> ModelInferRequest {
    let (inputs, raw): (Vec<_>, Vec<_>) = inputs.into_iter().unzip();
    ModelInferRequest {
        model_name: model.into(),
        id: id.into(),
        inputs,
        raw_input_contents: raw.into_iter().map(Into::into).collect(),
        ..Default::default()
    }
}

fn hidden(n: usize, x: &[f32]) -> (InferInputTensor, Vec<u8>) {
    (
        input("hidden_states", "FP32", &[n as i64, H as i64]),
        le_f32(x),
    )
}

fn good(n: usize) -> ModelInferRequest {
    let x: Vec<f32> = (0..n * H)
        .map(|i| ((i * 7919) % 200) as f32 / 100.0 - 1.0)
        .collect();
    raw_request("layer-0", "ok", vec![hidden(n, &x)])
}

fn output_f32(r: &ModelInferResponse) -> Vec<f32> {
    assert_eq!(r.outputs.len(), 1);
    assert_eq!(r.raw_output_contents.len(), 1);
    let o = &r.outputs[0];
    assert_eq!(o.name, "output");
    let v = floats(&o.datatype, &r.raw_output_contents[0]);
    assert_eq!(o.shape, vec![(v.len() / H) as i64, H as i64]);
    v
}

/// An FP32 or BF16 output's little-endian bytes as f32.
fn floats(datatype: &str, raw: &[u8]) -> Vec<f32> {
    match datatype {
        "FP32" => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        "BF16" => raw
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        d => panic!("unexpected output datatype {d}"),
    }
}

fn string_param(s: &str) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::StringParam(s.into())),
    }
}

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
}

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
            "expert 8 at row 1 is out of range 0..8",
            routed(&[0, 1, 2, 8], [2, 2], &[0.5; 4], [2, 2]),
        ),
        (
            "an expert twice in one row",
            "expert 3 repeated in row 1",
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
            "parameter not understood (request, input or output)",
            "… (100000 bytes) is not supported (supported: output_datatype, timeout, triton_*)",
            with(&|r| {
                r.parameters.insert("p".repeat(100_000), string_param("x"));
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
            "parameter not understood (request, input or output)",
            "parameter \"sequence_id\" is not supported (supported: output_datatype, timeout, triton_*)",
            with(&|r| {
                r.parameters.insert(
                    "sequence_id".into(),
                    InferParameter {
                        parameter_choice: Some(ParameterChoice::Int64Param(7)),
                    },
                );
            }),
        ),
        (
            "parameter not understood (request, input or output)",
            "hidden_states: parameter \"binary_data\" is not supported",
            with(&|r| {
                r.inputs[0]
                    .parameters
                    .insert("binary_data".into(), string_param("r0"));
            }),
        ),
        (
            "parameter not understood (request, input or output)",
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
            "output_datatype, timeout or triton_enable_empty_final_response of the wrong type",
            "parameter \"timeout\": a string value is not valid here",
            with(&|r| {
                r.parameters.insert("timeout".into(), string_param("5s"));
            }),
        ),
        (
            "output_datatype, timeout or triton_enable_empty_final_response of the wrong type",
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

/// `InvalidArgument` → `INVALID_ARGUMENT`.
fn code_name(c: Code) -> String {
    let mut out = String::new();
    for (i, ch) in format!("{c:?}").chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

async fn ready(c: &mut Client) -> (bool, bool, bool) {
    let live = c
        .server_live(ServerLiveRequest {})
        .await
        .unwrap()
        .into_inner()
        .live;
    let server = c
        .server_ready(ServerReadyRequest {})
        .await
        .unwrap()
        .into_inner()
        .ready;
    let model = c
        .model_ready(ModelReadyRequest {
            name: "layer-0".into(),
            version: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .ready;
    (live, server, model)
}

async fn until(c: &mut Client, want: (bool, bool, bool), within: Duration) {
    let end = std::time::Instant::now() + within;
    loop {
        let now = ready(c).await;
        if now == want {
            return;
        }
        assert!(
            std::time::Instant::now() < end,
            "(live, ready, model ready) {now:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
    let typed_stats = stats("layer-0-bf16").await.inference_stats.unwrap();
    assert_eq!(count(&typed_stats.success), 2, "both BF16 requests");
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
    // A -gated model reports its twin's statistics (the layer's, in that float type).
    let queued: u64 = all
        .iter()
        .filter(|m| !m.name.ends_with("-gated"))
        .map(|m| count(&m.inference_stats.as_ref().unwrap().queue))
        .sum();
    for m in all.iter().filter(|m| m.name.ends_with("-gated")) {
        let twin = all
            .iter()
            .find(|t| t.name == m.name.trim_end_matches("-gated"))
            .unwrap();
        assert_eq!(m.inference_stats, twin.inference_stats, "{}", m.name);
    }
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

/// The catalogue's shared-memory calls (`system_shared_memory_round_trip_and_refusals` makes
/// them; `triton_calls_typed_models_and_compressed_requests` the others).
fn shared_memory_case(case: &str) -> bool {
    ["region", "shared", "tensor", "Shared"]
        .iter()
        .any(|w| case.contains(w))
}

/// Each of the catalogue's bad calls (its shared-memory ones, or the others) was made and
/// answered with its code and message, and every call made is one of them.
fn check_bad_calls(outcomes: &[(&str, Code, String)], shared_memory: bool) {
    use epserve::api::catalogue::BAD_CALL;
    for entry in BAD_CALL
        .iter()
        .filter(|b| shared_memory_case(b.case) == shared_memory)
    {
        let mine: Vec<_> = outcomes.iter().filter(|o| o.0 == entry.case).collect();
        assert!(!mine.is_empty(), "no call for '{}'", entry.case);
        for (case, code, msg) in mine {
            assert_eq!(*code, entry.code, "{case}: {msg}");
            assert!(msg.contains(entry.message), "{case}: {msg}");
        }
    }
    for o in outcomes {
        assert!(
            BAD_CALL.iter().any(|b| b.case == o.0),
            "{} is not in BAD_CALL",
            o.0
        );
    }
}

/// A tensor parameter.
fn param(p: ParameterChoice) -> InferParameter {
    InferParameter {
        parameter_choice: Some(p),
    }
}

/// Parameters naming `len` bytes at `offset` of `region`.
fn shm_params(region: &str, offset: i64, len: usize) -> HashMap<String, InferParameter> {
    [
        (
            "shared_memory_region",
            ParameterChoice::StringParam(region.into()),
        ),
        ("shared_memory_offset", ParameterChoice::Int64Param(offset)),
        (
            "shared_memory_byte_size",
            ParameterChoice::Int64Param(len as i64),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), param(v)))
    .collect()
}

/// Triton's system shared memory: inputs read from the client's region and the output written
/// to it, equal per token to the same request over the wire (client routing and a mix of
/// regions and raw entries included), regions listed and unregistered, and each refusal of the
/// catalogue's shared-memory rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_shared_memory_round_trip_and_refusals() {
    use epserve::inference::{
        SystemSharedMemoryRegisterRequest, SystemSharedMemoryStatusRequest,
        SystemSharedMemoryUnregisterRequest,
    };
    use std::os::unix::fs::{FileExt, PermissionsExt};
    let dir = TempDir::new("regions");
    let group = Group::launch(
        2,
        "synthetic:tiny",
        &["--shm-regions-dir", dir.0.to_str().unwrap()],
    );
    let mut c = client(&group.addr).await;
    let object = |name: &str, len: u64, mode: u32| {
        let p = dir.0.join(name);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        f.set_len(len).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        f
    };
    let registrar = c.clone();
    let register = |name: &str, key: &str, offset: u64, byte_size: u64| {
        let mut c = registrar.clone();
        let r = SystemSharedMemoryRegisterRequest {
            name: name.into(),
            key: key.into(),
            offset,
            byte_size,
        };
        async move { c.system_shared_memory_register(r).await }
    };
    let input_obj = object("in", 1 << 20, 0o600);
    let output_obj = object("out", 1 << 20, 0o600);
    register("in", "/in", 512, 64 << 10).await.unwrap();
    register("out", "/out", 0, 64 << 10).await.unwrap();

    let mut rng = ChaCha8Rng::seed_from_u64(363);
    let n = 6;
    let x: Vec<f32> = (0..n * H).map(|_| rng.random_range(-1.0..1.0)).collect();
    let ids: Vec<i32> = (0..n)
        .flat_map(|t| [(t % E) as i32, ((t + 3) % E) as i32])
        .collect();
    let w: Vec<f32> = (0..n * K).map(|_| rng.random_range(0.1..1.0)).collect();
    input_obj.write_all_at(&le_f32(&x), 512 + 128).unwrap();
    let bytes = n * H * 4;
    for routed in [false, true] {
        // Over the wire.
        let mut inputs = vec![hidden(n, &x)];
        if routed {
            inputs.push((
                input("topk_ids", "INT32", &[n as i64, K as i64]),
                ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ));
            inputs.push((
                input("topk_weights", "FP32", &[n as i64, K as i64]),
                le_f32(&w),
            ));
        }
        let plain = c
            .model_infer(raw_request("layer-0", "wire", inputs.clone()))
            .await
            .unwrap()
            .into_inner();
        let want = output_f32(&plain);
        // Through the regions: the hidden states from "in", the routing (if any) as raw
        // entries for the inputs that carry no region, the output into "out".
        let mut req = raw_request("layer-0", "shm", inputs);
        req.raw_input_contents.remove(0);
        req.inputs[0].parameters = shm_params("in", 128, bytes);
        req.outputs = vec![InferRequestedOutputTensor {
            name: "output".into(),
            parameters: shm_params("out", 256, bytes + 100),
        }];
        let resp = c.model_infer(req).await.unwrap().into_inner();
        assert_eq!(resp.raw_output_contents, vec![bytes::Bytes::new()]);
        let o = &resp.outputs[0];
        assert_eq!(
            (o.datatype.as_str(), o.shape.clone()),
            ("FP32", vec![n as i64, H as i64])
        );
        assert_eq!(
            o.parameters["shared_memory_byte_size"].parameter_choice,
            Some(ParameterChoice::Int64Param(bytes as i64))
        );
        let mut got = vec![0u8; bytes];
        output_obj.read_exact_at(&mut got, 256).unwrap();
        let got: Vec<f32> = got
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        for t in 0..n {
            let e = row_error(&got[t * H..(t + 1) * H], &want[t * H..(t + 1) * H]);
            assert!(e <= 1e-6, "routed {routed}, token {t}: {e}");
        }
    }

    // A non-finite value in a region is found as its rows are read into the step: refused by
    // row and column, and the next request is answered.
    let mut bad = x.clone();
    bad[4 * H + 5] = f32::NAN;
    input_obj.write_all_at(&le_f32(&bad), 512 + 128).unwrap();
    let mut req = raw_request("layer-0", "nan", vec![hidden(n, &x)]);
    req.raw_input_contents.clear();
    req.inputs[0].parameters = shm_params("in", 128, bytes);
    let e = c.model_infer(req).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("non-finite value at row 4, column 5"),
        "{e:?}"
    );
    input_obj.write_all_at(&le_f32(&x), 512 + 128).unwrap();

    // Status of one and of all; unregistering one.
    let status = c
        .system_shared_memory_status(SystemSharedMemoryStatusRequest::default())
        .await
        .unwrap()
        .into_inner()
        .regions;
    assert_eq!(status.len(), 2);
    assert_eq!(
        (
            status["in"].key.as_str(),
            status["in"].offset,
            status["in"].byte_size
        ),
        ("/in", 512, 64 << 10)
    );

    // The refusals.
    let mut outcomes: Vec<(&str, Code, String)> = Vec::new();
    let mut note = |case: &'static str, e: tonic::Status| {
        outcomes.push((case, e.code(), e.message().to_string()));
    };
    object("wide", 4096, 0o666);
    std::os::unix::fs::symlink(dir.0.join("in"), dir.0.join("link")).unwrap();
    for key in ["in", "/a/b", "/", "/.."] {
        note(
            "a region key that is not a POSIX shared-memory name",
            register("k", key, 0, 16).await.unwrap_err(),
        );
    }
    note(
        "a region key that does not open",
        register("k", "/missing", 0, 16).await.unwrap_err(),
    );
    let link = register("k", "/link", 0, 16).await.unwrap_err();
    assert_eq!(link.code(), Code::InvalidArgument, "{link:?}");
    note(
        "a region object of a wider mode than --shm-regions-mode",
        register("k", "/wide", 0, 16).await.unwrap_err(),
    );
    note(
        "a region past the end of its object",
        register("k", "/in", (1 << 20) - 8, 16).await.unwrap_err(),
    );
    note(
        "a region name registered twice",
        register("in", "/in", 0, 16).await.unwrap_err(),
    );
    note(
        "SystemSharedMemoryStatus of a region not registered",
        c.system_shared_memory_status(SystemSharedMemoryStatusRequest { name: "k".into() })
            .await
            .unwrap_err(),
    );
    let shm_request = |region: &str, offset: i64, len: usize| {
        let mut r = good(2);
        r.raw_input_contents.clear();
        r.inputs[0].parameters = shm_params(region, offset, len);
        r
    };
    let two = 2 * H * 4;
    for (case, req) in [
        (
            "a tensor naming a region not registered",
            shm_request("k", 0, two),
        ),
        (
            "a tensor's offset and byte size outside its region",
            shm_request("in", (64 << 10) - 16, two),
        ),
        (
            "a tensor's offset and byte size outside its region",
            shm_request("in", i64::MAX, two),
        ),
        ("data both in shared memory and in the request", {
            let mut r = good(2);
            r.inputs[0].parameters = shm_params("in", 0, two);
            r
        }),
        ("an output region smaller than the output", {
            let mut r = good(2);
            r.outputs = vec![InferRequestedOutputTensor {
                name: "output".into(),
                parameters: shm_params("out", 0, two - 1),
            }];
            r
        }),
        (
            "shared-memory parameters incomplete or of the wrong type",
            {
                let mut r = shm_request("in", 0, two);
                r.inputs[0].parameters.remove("shared_memory_byte_size");
                r
            },
        ),
        (
            "shared-memory parameters incomplete or of the wrong type",
            {
                let mut r = shm_request("in", 0, two);
                r.inputs[0].parameters.insert(
                    "shared_memory_offset".into(),
                    param(ParameterChoice::Int64Param(-1)),
                );
                r
            },
        ),
    ] {
        note(case, c.model_infer(req).await.unwrap_err());
    }
    let e = c
        .cuda_shared_memory_register(epserve::inference::CudaSharedMemoryRegisterRequest {
            name: "g".into(),
            raw_handle: vec![0; 64],
            device_id: 0,
            byte_size: 16,
        })
        .await
        .unwrap_err();
    note(
        "CudaSharedMemoryRegister on the cpu backend (CUDA shared memory needs a GPU rank)",
        e,
    );
    c.cuda_shared_memory_unregister(
        epserve::inference::CudaSharedMemoryUnregisterRequest::default(),
    )
    .await
    .expect("nothing to unregister is not an error");
    // A region whose object the client truncates: the read fails cleanly.
    let t = object("t", 4096, 0o600);
    register("t", "/t", 0, 4096).await.unwrap();
    t.set_len(10).unwrap();
    note(
        "a region's object truncated under a request",
        c.model_infer(shm_request("t", 0, two)).await.unwrap_err(),
    );
    check_bad_calls(&outcomes, true);

    // Unregistered, a region is gone for new requests; all of them at once with an empty name.
    c.system_shared_memory_unregister(SystemSharedMemoryUnregisterRequest { name: "in".into() })
        .await
        .unwrap();
    let e = c.model_infer(shm_request("in", 0, two)).await.unwrap_err();
    assert!(e.message().contains("is not registered"), "{e:?}");
    c.system_shared_memory_unregister(SystemSharedMemoryUnregisterRequest::default())
        .await
        .unwrap();
    let left = c
        .system_shared_memory_status(SystemSharedMemoryStatusRequest::default())
        .await
        .unwrap()
        .into_inner()
        .regions;
    assert!(left.is_empty(), "{left:?}");
    let metrics = common::prom::scrape(&group.metrics_addrs(2)[0]);
    let tensors = |d| common::prom::sum(&metrics, "epserve_shm_tensors_total", &[("direction", d)]);
    // The non-finite and the truncated objects' requests named their regions too (rows are
    // read as their step is packed): counted as tensors; bytes as far as they were read.
    assert_eq!((tensors("in"), tensors("out")), (4.0, 2.0));
    let read = common::prom::sum(&metrics, "epserve_shm_bytes_total", &[("direction", "in")]);
    assert_eq!(read, 3.0 * bytes as f64);
    c.model_infer(good(1))
        .await
        .expect("serving after the refusals");
}

/// A REST answer's JSON and its binary tail (empty without one).
fn rest_answer(headers: &http::HeaderMap, body: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let split = headers
        .get("inference-header-content-length")
        .map_or(body.len(), |v| v.to_str().unwrap().parse().unwrap());
    let json = serde_json::from_slice(&body[..split])
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)));
    (json, body[split..].to_vec())
}

/// The one output of a REST answer, as f32, from its JSON data or its binary tail.
fn rest_output(headers: &http::HeaderMap, body: &[u8]) -> (String, Vec<f32>) {
    let (json, tail) = rest_answer(headers, body);
    let o = &json["outputs"][0];
    assert_eq!(o["name"], "output", "{json}");
    let datatype = o["datatype"].as_str().unwrap().to_string();
    let v: Vec<f32> = match o["data"].as_array() {
        Some(d) => d.iter().map(|v| v.as_f64().unwrap() as f32).collect(),
        None => {
            assert_eq!(o["parameters"]["binary_data_size"], tail.len(), "{json}");
            floats(&datatype, &tail)
        }
    };
    assert_eq!(o["shape"], serde_json::json!([v.len() / H, H]), "{json}");
    (datatype, v)
}

/// A REST request's headers and body.
type RestBody = (Vec<(&'static str, String)>, Vec<u8>);

/// A REST inference body: its JSON, then `binary` (its length goes in the header).
fn rest_body(json: serde_json::Value, binary: &[u8]) -> RestBody {
    let mut body = serde_json::to_vec(&json).unwrap();
    let mut headers = vec![];
    if !binary.is_empty() {
        headers.push(("inference-header-content-length", body.len().to_string()));
        body.extend_from_slice(binary);
    }
    (headers, body)
}

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
