//! KServe v2 / the Open Inference Protocol (`inference.GRPCInferenceService`), the stock Triton
//! client's API: one model per MoE layer, `layer-<L>` version "1", over the same request entry
//! as epserve.v1, so admission, deadlines, batching and numerics are the same.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tonic::{Request, Response, Status, Streaming};

use super::stream::{self, ResponseStream};
use super::unary::Unary;
use super::{code_name, status, Call, Done};
use crate::infer::quote::quote;
use crate::infer::tensor::{self, Dtype, View, FLOATS, IDS};
use crate::infer::{rejected, Infer, Request as Entry};
use crate::inference::grpc_inference_service_server::GrpcInferenceService;
use crate::inference::infer_parameter::ParameterChoice;
use crate::inference::model_infer_request::InferInputTensor;
use crate::inference::model_infer_response::InferOutputTensor;
use crate::inference::model_metadata_response::TensorMetadata;
use crate::inference::{
    InferParameter, ModelInferRequest, ModelInferResponse, ModelMetadataRequest,
    ModelMetadataResponse, ModelReadyRequest, ModelReadyResponse, ModelStreamInferResponse,
    ServerLiveRequest, ServerLiveResponse, ServerMetadataRequest, ServerMetadataResponse,
    ServerReadyRequest, ServerReadyResponse,
};
use crate::router::{Failure, Permit};

/// Every model's one version; an empty version asks for it.
pub const VERSION: &str = "1";
/// What ModelMetadata calls the models' platform.
pub const PLATFORM: &str = "epserve";
const HIDDEN: &str = "hidden_states";
const IDS_IN: &str = "topk_ids";
const WEIGHTS: &str = "topk_weights";
const OUTPUT: &str = "output";
/// Request parameters understood here: the output's float type, and Triton's timeout (µs).
const PARAMETERS: &str = "output_datatype, timeout";

pub struct KserveApi {
    infer: Arc<Infer>,
    /// Most requests of one ModelStreamInfer in progress or not yet taken by the transport.
    stream_in_flight: usize,
}

/// The model name of an MoE layer.
pub fn model_name(layer: u32) -> String {
    format!("layer-{layer}")
}

/// The Open Inference Protocol's datatype names.
fn name(d: Dtype) -> &'static str {
    match d {
        Dtype::Bf16 => "BF16",
        Dtype::F16 => "FP16",
        Dtype::F32 => "FP32",
        Dtype::I32 => "INT32",
        Dtype::I64 => "INT64",
    }
}

/// A datatype string as the entry's dtype. The protocol's other types are refused as not
/// accepted, anything else as unknown.
fn datatype(s: &str, what: &str, accepted: &[Dtype]) -> Result<Dtype, Failure> {
    match s {
        "BF16" => Ok(Dtype::Bf16),
        "FP16" => Ok(Dtype::F16),
        "FP32" => Ok(Dtype::F32),
        "INT32" => Ok(Dtype::I32),
        "INT64" => Ok(Dtype::I64),
        "BOOL" | "UINT8" | "UINT16" | "UINT32" | "UINT64" | "INT8" | "INT16" | "FP64" | "BYTES" => {
            Err(tensor::not_accepted(what, s, accepted, name))
        }
        _ => Err(Failure::invalid(format!(
            "{what}: unknown datatype {}",
            quote(s)
        ))),
    }
}

fn param_name(p: &InferParameter) -> &'static str {
    match p.parameter_choice {
        Some(ParameterChoice::BoolParam(_)) => "bool",
        Some(ParameterChoice::Int64Param(_)) => "int64",
        Some(ParameterChoice::StringParam(_)) => "string",
        Some(ParameterChoice::DoubleParam(_)) => "double",
        Some(ParameterChoice::Uint64Param(_)) => "uint64",
        None => "empty",
    }
}

/// An input's data as little-endian bytes: its raw entry (shared, not copied), or its typed
/// contents.
fn input_bytes(t: &InferInputTensor, d: Dtype, raw: Option<&Bytes>) -> Result<Bytes, Failure> {
    let what = &t.name;
    match (raw, &t.contents) {
        (Some(_), Some(_)) => Err(Failure::invalid(format!(
            "{what}: data given both in contents and in raw_input_contents"
        ))),
        (Some(raw), None) => Ok(raw.clone()),
        (None, None) => Err(Failure::invalid(format!(
            "{what}: no data (neither contents nor raw_input_contents)"
        ))),
        (None, Some(c)) => {
            let typed: Option<Vec<u8>> = match d {
                Dtype::F32 => (!c.fp32_contents.is_empty()).then(|| {
                    c.fp32_contents
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect()
                }),
                Dtype::I32 => (!c.int_contents.is_empty()).then(|| {
                    c.int_contents
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect()
                }),
                Dtype::I64 => (!c.int64_contents.is_empty()).then(|| {
                    c.int64_contents
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect()
                }),
                Dtype::Bf16 | Dtype::F16 => {
                    return Err(Failure::invalid(format!(
                        "{what}: {} data goes in raw_input_contents (contents has no field for it)",
                        name(d)
                    )))
                }
            };
            let field = match d {
                Dtype::F32 => "fp32_contents",
                Dtype::I32 => "int_contents",
                _ => "int64_contents",
            };
            typed.map(Bytes::from).ok_or_else(|| {
                Failure::invalid(format!(
                    "{what}: {} data belongs in contents.{field}, which is empty",
                    name(d)
                ))
            })
        }
    }
}

/// The three inputs by slot (hidden_states, topk_ids, topk_weights): dtype, shape and bytes.
type Found<'a> = [Option<(Dtype, &'a [i64], Bytes)>; 3];

/// Refuses parameters this server does not act on, rather than ignoring what a client asked.
fn no_parameters(what: &str, p: &HashMap<String, InferParameter>) -> Result<(), Failure> {
    match p.keys().min() {
        None => Ok(()),
        Some(k) => Err(Failure::invalid(format!(
            "{what}: parameter {} is not supported",
            quote(k)
        ))),
    }
}

/// The request's own settings: output datatype (None: the input's) and deadline.
fn settings(
    r: &ModelInferRequest,
    deadline: Option<Instant>,
) -> Result<(Option<Dtype>, Option<Instant>), Failure> {
    let (mut out, mut deadline) = (None, deadline);
    for (k, v) in &r.parameters {
        match (k.as_str(), &v.parameter_choice) {
            ("output_datatype", Some(ParameterChoice::StringParam(s))) => {
                let d = datatype(s, "output_datatype", FLOATS)?;
                if !d.is_float() {
                    return Err(Failure::invalid(format!(
                        "output_datatype: {s} is not a float dtype"
                    )));
                }
                out = Some(d);
            }
            ("timeout", Some(ParameterChoice::Int64Param(us))) if *us >= 0 => {
                let own = Instant::now().checked_add(Duration::from_micros(*us as u64));
                deadline = match (deadline, own) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            ("output_datatype" | "timeout", _) => {
                return Err(Failure::invalid(format!(
                    "parameter {}: a {} value is not valid here (output_datatype: a string; \
                     timeout: microseconds, a non-negative int64)",
                    quote(k),
                    param_name(v)
                )))
            }
            _ => {
                return Err(Failure::invalid(format!(
                    "parameter {} is not supported (supported: {PARAMETERS})",
                    quote(k)
                )))
            }
        }
    }
    Ok((out, deadline))
}

impl KserveApi {
    pub fn new(infer: Arc<Infer>, stream_in_flight: usize) -> Self {
        Self {
            infer,
            stream_in_flight: stream_in_flight.max(1),
        }
    }

    /// The layer a model name and version serve.
    fn layer(&self, model: &str, version: &str) -> Result<u32, Failure> {
        let layers = &self.infer.spec().moe_layers;
        let layer = layers
            .iter()
            .copied()
            .find(|&l| model_name(l) == model)
            .ok_or_else(|| {
                let names: Vec<String> = layers.iter().map(|&l| model_name(l)).collect();
                Failure::NotFound(format!(
                    "unknown model {} (models: {})",
                    quote(model),
                    names.join(", ")
                ))
            })?;
        if !version.is_empty() && version != VERSION {
            return Err(Failure::NotFound(format!(
                "model {} has no version {} (versions: {VERSION})",
                quote(model),
                quote(version)
            )));
        }
        Ok(layer)
    }

    /// The request's inputs, checked against the model (the hidden states stay the client's
    /// bytes), and its output datatype.
    fn decode(
        &self,
        r: &ModelInferRequest,
        layer: u32,
        deadline: Option<Instant>,
    ) -> Result<(crate::router::JobInput, Dtype), Failure> {
        let (out, deadline) = settings(r, deadline).map_err(|f| rejected("invalid_argument", f))?;
        let (found, out) = Self::inputs(r, out).map_err(|f| rejected("invalid_argument", f))?;
        let view = |i: usize| {
            found[i].as_ref().map(|(dtype, shape, data)| View {
                dtype: *dtype,
                shape,
                data: data.clone(),
            })
        };
        let input = self.infer.validate(Entry {
            id: r.id.clone(),
            layer,
            hidden: view(0),
            topk_ids: view(1),
            topk_weights: view(2),
            output: out,
            deadline,
            names: name,
        })?;
        Ok((input, out))
    }

    /// The protocol's own checks: outputs asked for, inputs by name with their data, and the
    /// output datatype (`out`, else the hidden states').
    fn inputs(r: &ModelInferRequest, out: Option<Dtype>) -> Result<(Found<'_>, Dtype), Failure> {
        for o in &r.outputs {
            if o.name != OUTPUT {
                return Err(Failure::invalid(format!(
                    "unknown output {} (outputs: {OUTPUT})",
                    quote(&o.name)
                )));
            }
            no_parameters(&format!("output {OUTPUT}"), &o.parameters)?;
        }
        let raw = &r.raw_input_contents;
        if !raw.is_empty() && raw.len() != r.inputs.len() {
            return Err(Failure::invalid(format!(
                "raw_input_contents has {} entries for {} inputs (one per input, or none)",
                raw.len(),
                r.inputs.len()
            )));
        }
        // (name, accepted dtypes, slot in `found`)
        const INPUTS: [(&str, &[Dtype]); 3] = [(HIDDEN, FLOATS), (IDS_IN, IDS), (WEIGHTS, FLOATS)];
        let mut found: Found = [None, None, None];
        for (i, t) in r.inputs.iter().enumerate() {
            let slot = INPUTS
                .iter()
                .position(|(n, _)| *n == t.name)
                .ok_or_else(|| {
                    Failure::invalid(format!(
                        "unknown input {} (inputs: {HIDDEN}, {IDS_IN}, {WEIGHTS})",
                        quote(&t.name)
                    ))
                })?;
            if found[slot].is_some() {
                return Err(Failure::invalid(format!("input {:?} given twice", t.name)));
            }
            no_parameters(&t.name, &t.parameters)?;
            let d = datatype(&t.datatype, &t.name, INPUTS[slot].1)?;
            if !INPUTS[slot].1.contains(&d) {
                return Err(tensor::not_accepted(&t.name, name(d), INPUTS[slot].1, name));
            }
            let data = input_bytes(t, d, raw.get(i))?;
            found[slot] = Some((d, &t.shape, data));
        }
        let out = match (out, &found[0]) {
            (Some(d), _) => d,
            (None, Some((d, _, _))) => *d,
            (None, None) => Dtype::F32,
        };
        Ok((found, out))
    }

    /// Decodes, checks, admits and waits for one request. The admission permit comes back with
    /// the answer, for the caller to hold until the response is written.
    async fn run(
        &self,
        mut r: ModelInferRequest,
        deadline: Option<Instant>,
    ) -> Result<Done<ModelInferResponse>, Failure> {
        let layer = self
            .layer(&r.model_name, &r.model_version)
            .map_err(|f| rejected("not_found", f))?;
        let (input, out_dtype) = self.decode(&r, layer, deadline)?;
        let (id, model) = (std::mem::take(&mut r.id), std::mem::take(&mut r.model_name));
        // Only the hidden states' bytes wait in the queue, shared with the request's buffer.
        drop(r);
        let a = self.infer.submit(input).await?;
        let hidden = self.infer.spec().hidden;
        let resp = ModelInferResponse {
            model_name: model,
            model_version: VERSION.into(),
            id,
            parameters: HashMap::new(),
            outputs: vec![InferOutputTensor {
                name: OUTPUT.into(),
                datatype: name(out_dtype).into(),
                shape: vec![a.tokens as i64, hidden as i64],
                parameters: HashMap::new(),
                contents: None,
            }],
            raw_output_contents: vec![a.output],
        };
        Ok(Done {
            resp,
            permit: a.permit,
            tokens: a.tokens,
        })
    }

    /// `run` with the request's span and metrics.
    async fn infer_one(
        &self,
        r: ModelInferRequest,
        call: &Call,
        method: &'static str,
    ) -> Result<(ModelInferResponse, Option<Permit>), Status> {
        let id = r.id.clone();
        call.observe(method, &id, self.run(r, call.deadline)).await
    }

    fn tensor_metadata(&self) -> (Vec<TensorMetadata>, Vec<TensorMetadata>) {
        let spec = self.infer.spec();
        let (h, k) = (spec.hidden as i64, spec.top_k as i64);
        let t = |n: &str, d: &str, cols: i64| TensorMetadata {
            name: n.into(),
            datatype: d.into(),
            shape: vec![-1, cols],
        };
        (
            vec![
                t(HIDDEN, "FP32", h),
                t(IDS_IN, "INT32", k),
                t(WEIGHTS, "FP32", k),
            ],
            vec![t(OUTPUT, "FP32", h)],
        )
    }
}

/// A failed stream request's answer: its id and model, and the status as `CODE: message`.
fn stream_error(r: &ModelInferRequest, s: &Status) -> ModelStreamInferResponse {
    ModelStreamInferResponse {
        error_message: format!("{}: {}", code_name(s.code()), s.message()),
        infer_response: Some(ModelInferResponse {
            model_name: r.model_name.clone(),
            model_version: r.model_version.clone(),
            id: r.id.clone(),
            ..Default::default()
        }),
    }
}

/// `ModelInfer` as `unary` serves it (see `moe::Forward`).
#[derive(Clone)]
pub struct ModelInfer(pub Arc<KserveApi>);

impl Unary for ModelInfer {
    type Req = ModelInferRequest;
    type Resp = ModelInferResponse;
    type Hold = Option<Permit>;
    const PATH: &'static str = "/inference.GRPCInferenceService/ModelInfer";
    const METHOD: &'static str = "ModelInfer";

    async fn call(
        self,
        req: Request<ModelInferRequest>,
    ) -> Result<(ModelInferResponse, Option<Permit>), Status> {
        let call = Call::of(&req)?;
        self.0
            .infer_one(req.into_inner(), &call, Self::METHOD)
            .await
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for Arc<KserveApi> {
    async fn server_live(
        &self,
        _: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse {
            live: self.infer.live(),
        }))
    }

    async fn server_ready(
        &self,
        _: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse {
            ready: self.infer.ready(),
        }))
    }

    /// An unknown model or version is not ready (as Triton answers), rather than an error.
    async fn model_ready(
        &self,
        req: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let r = req.into_inner();
        let known = self.layer(&r.name, &r.version).is_ok();
        Ok(Response::new(ModelReadyResponse {
            ready: known && self.infer.ready(),
        }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(ServerMetadataResponse {
            name: "epserve".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: vec!["parameters".into()],
        }))
    }

    async fn model_metadata(
        &self,
        req: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let r = req.into_inner();
        self.layer(&r.name, &r.version).map_err(status)?;
        let (inputs, outputs) = self.tensor_metadata();
        Ok(Response::new(ModelMetadataResponse {
            name: r.name,
            versions: vec![VERSION.into()],
            platform: PLATFORM.into(),
            inputs,
            outputs,
        }))
    }

    /// Served by `ModelInfer` behind `unary::WithUnary`; tonic's own path, should anything route
    /// here.
    async fn model_infer(
        &self,
        req: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let (resp, _permit) = ModelInfer(self.clone()).call(req).await?;
        Ok(Response::new(resp))
    }

    type ModelStreamInferStream = ResponseStream<ModelStreamInferResponse>;

    async fn model_stream_infer(
        &self,
        req: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let call = Call::of(&req)?;
        let api = self.clone();
        let out = stream::serve(req.into_inner(), self.stream_in_flight, move |r| {
            let (api, call) = (api.clone(), call.clone());
            async move {
                let head = ModelInferRequest {
                    model_name: r.model_name.clone(),
                    model_version: r.model_version.clone(),
                    id: r.id.clone(),
                    ..Default::default()
                };
                match api.infer_one(r, &call, "ModelStreamInfer").await {
                    Ok((resp, permit)) => (
                        ModelStreamInferResponse {
                            error_message: String::new(),
                            infer_response: Some(resp),
                        },
                        permit,
                    ),
                    Err(s) => (stream_error(&head, &s), None),
                }
            }
        });
        Ok(Response::new(out))
    }
}

/// The KServe decode path under random input (fixed seed and budget): no input panics, every
/// refusal is INVALID_ARGUMENT or NOT_FOUND with a message, and what is accepted is consistent
/// with the model.
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::router::Admission;
    use crate::shm::Abort;
    use prost::Message;
    use rand::{Rng, SeedableRng};
    use tokio::sync::{mpsc, Notify};
    use tonic::Code;

    fn pick<T: Clone>(rng: &mut impl Rng, from: &[T]) -> T {
        from[rng.random_range(0..from.len())].clone()
    }

    fn tensor(rng: &mut impl Rng, name: &str, cols: usize) -> (InferInputTensor, Vec<u8>) {
        if rng.random_bool(0.6) {
            // A valid tensor of 2 rows: distinct ids, or small finite floats.
            let floats: Vec<f32> = (0..2 * cols)
                .map(|_| rng.random_range(0.1f32..1.0))
                .collect();
            let (datatype, data): (&str, Vec<u8>) = if name == "topk_ids" {
                let rows = (0..2).flat_map(|_| 0..cols as i32);
                ("INT32", rows.flat_map(i32::to_le_bytes).collect())
            } else if rng.random_bool(0.5) {
                (
                    "FP32",
                    floats.iter().flat_map(|x| x.to_le_bytes()).collect(),
                )
            } else {
                let bf16 = floats
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes());
                ("BF16", bf16.collect())
            };
            let t = InferInputTensor {
                name: name.into(),
                datatype: datatype.into(),
                shape: vec![2, cols as i64],
                ..Default::default()
            };
            return (t, data);
        }
        let datatype = pick(
            rng,
            &["FP32", "BF16", "FP16", "INT32", "INT64", "FP64", "x", ""],
        );
        let n = pick(rng, &[1i64, 2, 3, 0, -1, i64::MAX]);
        let c = pick(rng, &[cols as i64, cols as i64, cols as i64 + 1, 0]);
        let shape = match rng.random_range(0..6) {
            0 => vec![n],
            1 => vec![n, c, 1],
            _ => vec![n, c],
        };
        let elem = match datatype {
            "BF16" | "FP16" => 2,
            "INT64" | "FP64" => 8,
            _ => 4,
        };
        let rows = usize::try_from(n).unwrap_or(0).min(4);
        let mut len = rows * cols * elem;
        if rng.random_bool(0.2) {
            len = rng.random_range(0..len + 9);
        }
        // Mostly small finite values and in-range distinct-ish ids.
        let data: Vec<u8> = match datatype {
            "FP32" => (0..len / 4)
                .flat_map(|_| rng.random_range(-1.0f32..1.0).to_le_bytes())
                .collect(),
            "INT32" => (0..len / 4)
                .flat_map(|i| ((i % cols.max(1)) as i32).to_le_bytes())
                .collect(),
            _ => (0..len).map(|_| rng.random()).collect(),
        };
        let mut t = InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape,
            ..Default::default()
        };
        if rng.random_bool(0.1) {
            t.contents = Some(crate::inference::InferTensorContents {
                fp32_contents: vec![0.5; rows * cols],
                ..Default::default()
            });
        }
        (t, data)
    }

    #[test]
    fn no_request_panics_and_every_refusal_is_named() {
        let spec = Arc::new(crate::model::synthetic::preset("tiny").unwrap());
        let (jobs, _rx) = mpsc::channel(1);
        let infer = Infer::new(
            spec.clone(),
            jobs,
            Admission::new(1, 1),
            Arc::new(Notify::new()),
            Arc::new(Abort::default()),
        );
        let api = KserveApi::new(Arc::new(infer), 1);
        let (h, k) = (spec.hidden, spec.top_k);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x6b73);
        let mut accepted = 0;
        for i in 0..20_000 {
            let mut r = if i % 4 == 0 {
                let len = rng.random_range(0..96);
                let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                match ModelInferRequest::decode(bytes.as_slice()) {
                    Ok(r) => r,
                    Err(_) => continue,
                }
            } else {
                ModelInferRequest::default()
            };
            r.model_name = pick(&mut rng, &["layer-0", "layer-0", "layer-1", "layer-2", ""]).into();
            r.model_version = pick(&mut rng, &["", "", "1", "2"]).into();
            let mut raw = Vec::new();
            for (name, cols, p) in [
                ("hidden_states", h, 0.9),
                ("topk_ids", k, 0.3),
                ("topk_weights", k, 0.3),
                ("other", h, 0.02),
            ] {
                if rng.random_bool(p) {
                    let (t, d) = tensor(&mut rng, name, cols);
                    r.inputs.push(t);
                    raw.push(d.into());
                }
            }
            if rng.random_bool(0.9) {
                r.raw_input_contents = raw;
            }
            if rng.random_bool(0.05) {
                r.parameters.insert(
                    pick(&mut rng, &["output_datatype", "timeout", "priority"]).into(),
                    pick(
                        &mut rng,
                        &[
                            InferParameter::default(),
                            InferParameter {
                                parameter_choice: Some(ParameterChoice::StringParam("BF16".into())),
                            },
                            InferParameter {
                                parameter_choice: Some(ParameterChoice::Int64Param(-5)),
                            },
                        ],
                    ),
                );
            }
            let result = api
                .layer(&r.model_name, &r.model_version)
                .and_then(|layer| api.decode(&r, layer, None));
            match result.map_err(status) {
                Err(s) => {
                    assert!(
                        matches!(s.code(), Code::InvalidArgument | Code::NotFound),
                        "{r:?}: {s:?}"
                    );
                    assert!(!s.message().is_empty());
                }
                Ok((input, out)) => {
                    accepted += 1;
                    assert!(out.is_float());
                    let x = &input.hidden;
                    assert_eq!(x.data.len(), input.tokens * h * x.dtype.bytes());
                    let mut wide = vec![0f32; input.tokens * h];
                    crate::dtype::to_f32(x.dtype, &x.data, &mut wide);
                    assert!(wide.iter().all(|v| v.is_finite()));
                    assert_eq!(input.output, out);
                    if let Some((ids, w)) = &input.routing {
                        assert_eq!((ids.len(), w.len()), (input.tokens * k, input.tokens * k));
                        assert!(ids
                            .iter()
                            .all(|&e| (0..spec.num_experts as i32).contains(&e)));
                    }
                }
            }
        }
        assert!(accepted > 100, "only {accepted} requests were valid");
    }
}
