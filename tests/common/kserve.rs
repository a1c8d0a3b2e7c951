//! What the KServe v2 tests share: a client, tensors and requests, their outputs, the readiness
//! calls, shared-memory parameters, REST bodies, and the catalogue's bad calls checked.

use std::collections::HashMap;
use std::time::Duration;

use epserve::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use epserve::inference::infer_parameter::ParameterChoice;
use epserve::inference::model_infer_request::InferInputTensor;
use epserve::inference::{
    InferParameter, ModelInferRequest, ModelInferResponse, ModelReadyRequest, ServerLiveRequest,
    ServerReadyRequest,
};
use tonic::transport::Channel;
use tonic::Code;

pub type Client = GrpcInferenceServiceClient<Channel>;

pub const H: usize = 64; // synthetic:tiny
pub const K: usize = 2;
pub const E: usize = 8;

pub async fn client(addr: &str) -> Client {
    GrpcInferenceServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(256 << 20)
        .max_encoding_message_size(256 << 20)
}

pub fn le_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn le_bf16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect()
}

pub fn input(name: &str, datatype: &str, shape: &[i64]) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
        ..Default::default()
    }
}

/// A request whose inputs all carry raw data.
pub fn raw_request(
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

pub fn hidden(n: usize, x: &[f32]) -> (InferInputTensor, Vec<u8>) {
    (
        input("hidden_states", "FP32", &[n as i64, H as i64]),
        le_f32(x),
    )
}

pub fn good(n: usize) -> ModelInferRequest {
    let x: Vec<f32> = (0..n * H)
        .map(|i| ((i * 7919) % 200) as f32 / 100.0 - 1.0)
        .collect();
    raw_request("layer-0", "ok", vec![hidden(n, &x)])
}

pub fn output_f32(r: &ModelInferResponse) -> Vec<f32> {
    assert_eq!(r.outputs.len(), 1);
    assert_eq!(r.raw_output_contents.len(), 1);
    let o = &r.outputs[0];
    assert_eq!(o.name, "output");
    let v = floats(&o.datatype, &r.raw_output_contents[0]);
    assert_eq!(o.shape, vec![(v.len() / H) as i64, H as i64]);
    v
}

/// An FP32 or BF16 output's little-endian bytes as f32.
pub fn floats(datatype: &str, raw: &[u8]) -> Vec<f32> {
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

pub fn string_param(s: &str) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::StringParam(s.into())),
    }
}

/// `InvalidArgument` → `INVALID_ARGUMENT`.
pub fn code_name(c: Code) -> String {
    let mut out = String::new();
    for (i, ch) in format!("{c:?}").chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

pub async fn ready(c: &mut Client) -> (bool, bool, bool) {
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

pub async fn until(c: &mut Client, want: (bool, bool, bool), within: Duration) {
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

/// The catalogue's shared-memory calls (`system_shared_memory_round_trip_and_refusals` makes
/// them; `triton_calls_typed_models_and_compressed_requests` the others).
pub fn shared_memory_case(case: &str) -> bool {
    ["region", "shared", "tensor", "Shared"]
        .iter()
        .any(|w| case.contains(w))
}

/// Each of the catalogue's bad calls (its shared-memory ones, or the others) was made and
/// answered with its code and message, and every call made is one of them.
pub fn check_bad_calls(outcomes: &[(&str, Code, String)], shared_memory: bool) {
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
pub fn param(p: ParameterChoice) -> InferParameter {
    InferParameter {
        parameter_choice: Some(p),
    }
}

/// Parameters naming `len` bytes at `offset` of `region`.
pub fn shm_params(region: &str, offset: i64, len: usize) -> HashMap<String, InferParameter> {
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

/// A REST answer's JSON and its binary tail (empty without one).
pub fn rest_answer(headers: &http::HeaderMap, body: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let split = headers
        .get("inference-header-content-length")
        .map_or(body.len(), |v| v.to_str().unwrap().parse().unwrap());
    let json = serde_json::from_slice(&body[..split])
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)));
    (json, body[split..].to_vec())
}

/// The one output of a REST answer, as f32, from its JSON data or its binary tail.
pub fn rest_output(headers: &http::HeaderMap, body: &[u8]) -> (String, Vec<f32>) {
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
pub type RestBody = (Vec<(&'static str, String)>, Vec<u8>);

/// A REST inference body: its JSON, then `binary` (its length goes in the header).
pub fn rest_body(json: serde_json::Value, binary: &[u8]) -> RestBody {
    let mut body = serde_json::to_vec(&json).unwrap();
    let mut headers = vec![];
    if !binary.is_empty() {
        headers.push(("inference-header-content-length", body.len().to_string()));
        body.extend_from_slice(binary);
    }
    (headers, body)
}
