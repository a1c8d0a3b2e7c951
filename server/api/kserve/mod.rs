//! KServe v2 / the Open Inference Protocol (`inference.GRPCInferenceService`), the stock Triton
//! client's API, with Triton's model configuration, statistics and repository index: the models
//! of `models`, over the same request entry as epserve.v1, so admission, deadlines, batching and
//! numerics are the same.

mod models;
pub mod regions;
pub mod rest;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tonic::{Request, Response, Status, Streaming};

use super::call::{code_name, record, status, Call, Done};
use super::stream::{self, ResponseStream};
use crate::infer::quote::quote;
use crate::infer::stats::{LayerStats, Total};
use crate::infer::tensor::{self, Dtype, View, FLOATS, IDS};
use crate::infer::{rejected, Infer, Request as Entry};
use crate::inference::grpc_inference_service_server::GrpcInferenceService;
use crate::inference::infer_parameter::ParameterChoice;
use crate::inference::model_infer_request::InferInputTensor;
use crate::inference::model_infer_response::InferOutputTensor;
use crate::inference::{
    CudaSharedMemoryRegisterRequest, CudaSharedMemoryRegisterResponse,
    CudaSharedMemoryStatusRequest, CudaSharedMemoryStatusResponse,
    CudaSharedMemoryUnregisterRequest, CudaSharedMemoryUnregisterResponse, InferParameter,
    InferStatistics, ModelConfigRequest, ModelConfigResponse, ModelInferRequest,
    ModelInferResponse, ModelMetadataRequest, ModelMetadataResponse, ModelReadyRequest,
    ModelReadyResponse, ModelStatistics, ModelStatisticsRequest, ModelStatisticsResponse,
    ModelStreamInferResponse, RepositoryIndexRequest, RepositoryIndexResponse, ServerLiveRequest,
    ServerLiveResponse, ServerMetadataRequest, ServerMetadataResponse, ServerReadyRequest,
    ServerReadyResponse, StatisticDuration, SystemSharedMemoryRegisterRequest,
    SystemSharedMemoryRegisterResponse, SystemSharedMemoryStatusRequest,
    SystemSharedMemoryStatusResponse, SystemSharedMemoryUnregisterRequest,
    SystemSharedMemoryUnregisterResponse,
};
use crate::metric_names;
use crate::request::{Data, Failure, Permit};
use crate::transport::unary::{Spliced, Unary};
use models::{name, Model, HIDDEN, IDS_IN, OUTPUT, PLATFORM, VERSION, WEIGHTS};
use regions::{Regions, Span};

/// Request parameters read here: the output's float type and Triton's timeout (µs). Triton's
/// reserved `triton_*` ones and the ones its client sends for scheduling (`priority`, the
/// sequence fields) are taken as Triton takes them for a model that has no use for them:
/// checked, then ignored. Any other key is a custom parameter, which Triton hands to the
/// model's backend; no model here reads one, so it is accepted and ignored too.
const PARAMETERS: &str = "output_datatype, timeout";
/// Triton's streaming flag: each response says whether it is the request's last. Every model
/// here answers once, so the one response is the last.
const EMPTY_FINAL: &str = "triton_enable_empty_final_response";
const FINAL: &str = "triton_final_response";

pub struct KserveApi {
    infer: Arc<Infer>,
    /// Clients' system shared-memory regions.
    regions: Regions,
    /// --max-request-bytes: the most one tensor read from shared memory may hold (as a message
    /// on the wire may).
    max_request: usize,
    /// Most requests of one ModelStreamInfer in progress or not yet taken by the transport.
    stream_in_flight: usize,
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
type Found<'a> = [Option<(Dtype, &'a [i64], Data)>; 3];

/// Where a tensor lies in shared memory, as its parameters name it: (region, offset, bytes).
type ShmRef = (String, u64, u64);

/// A tensor's parameters: Triton's shared-memory ones, the only ones a tensor takes here; any
/// other is refused rather than ignored.
fn tensor_parameters(
    what: &str,
    p: &HashMap<String, InferParameter>,
) -> Result<Option<ShmRef>, Failure> {
    let (mut region, mut offset, mut size) = (None, None, None);
    for (k, v) in p {
        let number = |v: &InferParameter| match v.parameter_choice {
            Some(ParameterChoice::Int64Param(n)) => u64::try_from(n).ok(),
            Some(ParameterChoice::Uint64Param(n)) => Some(n),
            _ => None,
        };
        let wrong = || {
            Failure::invalid(format!(
                "{what}: parameter {}: a {} value is not valid here (shared_memory_region: a \
                 string; shared_memory_offset and shared_memory_byte_size: non-negative integers)",
                quote(k),
                param_name(v)
            ))
        };
        match k.as_str() {
            "shared_memory_region" => match &v.parameter_choice {
                Some(ParameterChoice::StringParam(r)) => region = Some(r.clone()),
                _ => return Err(wrong()),
            },
            "shared_memory_offset" => offset = Some(number(v).ok_or_else(wrong)?),
            "shared_memory_byte_size" => size = Some(number(v).ok_or_else(wrong)?),
            _ => {
                return Err(Failure::invalid(format!(
                    "{what}: parameter {} is not supported (supported: shared_memory_region, \
                     shared_memory_offset, shared_memory_byte_size)",
                    quote(k)
                )))
            }
        }
    }
    match (region, size) {
        (Some(r), Some(n)) => Ok(Some((r, offset.unwrap_or(0), n))),
        (None, None) if offset.is_none() => Ok(None),
        (Some(_), None) => Err(Failure::invalid(format!(
            "{what}: shared_memory_region without shared_memory_byte_size"
        ))),
        _ => Err(Failure::invalid(format!(
            "{what}: shared_memory_offset or shared_memory_byte_size without \
             shared_memory_region"
        ))),
    }
}

/// A decoded request and what its answer needs.
struct Decoded {
    input: crate::request::JobInput,
    /// The output's type.
    out: Dtype,
    /// Mark a stream's answer as the request's last.
    mark_final: bool,
    /// Where the output goes, if to the client's shared memory.
    out_span: Option<Span>,
}

fn bool_param(b: bool) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::BoolParam(b)),
    }
}

fn string_param(s: &str) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::StringParam(s.into())),
    }
}

fn int_param(n: usize) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::Int64Param(n as i64)),
    }
}

/// The request's own settings.
struct Settings {
    /// None: the model's choice.
    output: Option<Dtype>,
    deadline: Option<Instant>,
    /// Say on a stream's response that it is the last (Triton's `triton_final_response`).
    mark_final: bool,
}

/// The request's parameters (see PARAMETERS): the ones read here and Triton's scheduling ones
/// checked by type, every other key ignored.
fn settings(r: &ModelInferRequest, deadline: Option<Instant>) -> Result<Settings, Failure> {
    let mut s = Settings {
        output: None,
        deadline,
        mark_final: false,
    };
    for (k, v) in &r.parameters {
        match (k.as_str(), &v.parameter_choice) {
            ("output_datatype", Some(ParameterChoice::StringParam(d))) => {
                let d = datatype(d, "output_datatype", FLOATS)?;
                if !d.is_float() {
                    return Err(Failure::invalid(format!(
                        "output_datatype: {} is not a float dtype",
                        name(d)
                    )));
                }
                s.output = Some(d);
            }
            ("timeout", Some(ParameterChoice::Int64Param(us))) if *us >= 0 => {
                let own = Instant::now().checked_add(Duration::from_micros(*us as u64));
                s.deadline = match (s.deadline, own) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            (EMPTY_FINAL, Some(ParameterChoice::BoolParam(on))) => s.mark_final = *on,
            // One queue here, first come first served; a stateless model has no sequences.
            ("priority", Some(ParameterChoice::Int64Param(0..)))
            | ("priority", Some(ParameterChoice::Uint64Param(_)))
            | ("sequence_id", Some(ParameterChoice::Int64Param(0..)))
            | ("sequence_id", Some(ParameterChoice::Uint64Param(_)))
            | ("sequence_id", Some(ParameterChoice::StringParam(_)))
            | ("sequence_start" | "sequence_end", Some(ParameterChoice::BoolParam(_))) => {}
            (
                "output_datatype" | "timeout" | EMPTY_FINAL | "priority" | "sequence_id"
                | "sequence_start" | "sequence_end",
                _,
            ) => {
                return Err(Failure::invalid(format!(
                    "parameter {}: a {} value is not valid here (output_datatype: a string; \
                     timeout: microseconds, a non-negative int64; {EMPTY_FINAL}: a bool; \
                     priority: a non-negative integer; sequence_id: a non-negative integer or \
                     a string; sequence_start, sequence_end: bools)",
                    quote(k),
                    param_name(v)
                )))
            }
            (k, _) => {
                tracing::debug!(
                    "parameter {} is not read by this service (it reads {PARAMETERS}); ignored",
                    quote(k)
                );
            }
        }
    }
    Ok(s)
}

/// A model's statistics as Triton reports them.
fn statistics(m: &Model, s: &LayerStats) -> ModelStatistics {
    let d = |t: &Total| {
        let (count, ns) = t.get();
        Some(StatisticDuration { count, ns })
    };
    ModelStatistics {
        name: m.name(),
        version: VERSION.into(),
        last_inference: s.last_answer_ms.load(Ordering::Relaxed),
        inference_count: s.success.get().0,
        execution_count: s.executions.load(Ordering::Relaxed),
        inference_stats: Some(InferStatistics {
            success: d(&s.success),
            fail: d(&s.fail),
            queue: d(&s.queue),
            compute_input: d(&s.compute_input),
            compute_infer: d(&s.compute_infer),
            compute_output: d(&s.compute_output),
            ..Default::default()
        }),
    }
}

impl KserveApi {
    pub fn new(
        infer: Arc<Infer>,
        stream_in_flight: usize,
        regions: regions::RegionArgs,
        cuda: Result<Arc<dyn crate::request::OpenDevice>, String>,
        max_request: usize,
    ) -> Self {
        Self {
            infer,
            regions: Regions::new(regions, cuda),
            max_request,
            stream_in_flight: stream_in_flight.max(1),
        }
    }

    /// The model a name and version ask for.
    fn model(&self, model: &str, version: &str) -> Result<Model, Failure> {
        Model::find(self.infer.spec(), model, version)
    }

    /// The request's inputs, checked against the model (the hidden states stay the client's
    /// bytes, or are read from its shared-memory region), and what its answer needs.
    fn decode(
        &self,
        r: &ModelInferRequest,
        model: Model,
        deadline: Option<Instant>,
    ) -> Result<Decoded, Failure> {
        let set = settings(r, deadline).map_err(|f| rejected("invalid_argument", f))?;
        let (found, out_span) = self
            .inputs(r, model)
            .map_err(|f| rejected("invalid_argument", f))?;
        let out = set
            .output
            .unwrap_or_else(|| model.output(found[0].as_ref().map(|f| f.0)));
        let view = |i: usize| {
            found[i].as_ref().map(|(dtype, shape, data)| View {
                dtype: *dtype,
                shape,
                data: data.clone(),
            })
        };
        let mut input = self.infer.validate(Entry {
            id: r.id.clone(),
            layer: model.layer,
            hidden: view(0),
            topk_ids: view(1),
            topk_weights: view(2),
            output: out,
            deadline: set.deadline,
            names: name,
            tally: model.tally(),
        })?;
        let need = input.tokens * self.infer.spec().hidden * out.bytes();
        if let Some(span) = &out_span {
            if span.len < need {
                return Err(rejected(
                    "invalid_argument",
                    Failure::invalid(format!(
                        "output {OUTPUT}: shared_memory_byte_size {} is less than the output's \
                         {need} bytes ({} x {} {})",
                        span.len,
                        input.tokens,
                        self.infer.spec().hidden,
                        name(out)
                    )),
                ));
            }
        }
        // CUDA memory takes the output straight from the step. A POSIX object's comes through
        // the answer's buffer, written below on this request's own thread: tmpfs serializes
        // writes to one object (its inode lock), and written straight from the ring on the
        // step's delivery thread they cost 13 ms a step against 3.0 for the buffer's copy
        // (1x H200, docs/benchmarks.md).
        input.output_to = out_span
            .as_ref()
            .filter(|s| s.on_device())
            .map(Span::client);
        Ok(Decoded {
            input,
            out,
            mark_final: set.mark_final,
            out_span,
        })
    }

    /// The protocol's own checks: outputs asked for (and the region the output goes to), and
    /// inputs by name with their data, the hidden states in one of the types `hidden` lists.
    /// An input's data is its shared-memory span, its typed contents, or a raw entry: one per
    /// input, or (as Triton's clients send them) one per input with neither of the others.
    fn inputs<'a>(
        &self,
        r: &'a ModelInferRequest,
        model: Model,
    ) -> Result<(Found<'a>, Option<Span>), Failure> {
        let mut out_span = None;
        for o in &r.outputs {
            if o.name != OUTPUT {
                return Err(Failure::invalid(format!(
                    "unknown output {} (outputs: {OUTPUT})",
                    quote(&o.name)
                )));
            }
            let what = format!("output {OUTPUT}");
            if let Some((region, offset, len)) = tensor_parameters(&what, &o.parameters)? {
                out_span = Some(self.regions.get(&region, &what)?.span(offset, len, &what)?);
            }
        }
        let shm: Vec<Option<ShmRef>> = r
            .inputs
            .iter()
            .map(|t| tensor_parameters(&t.name, &t.parameters))
            .collect::<Result<_, _>>()?;
        let raw = &r.raw_input_contents;
        // Positional when there is one raw entry per input; else taken in order by the inputs
        // that carry neither shared memory nor contents.
        let positional = raw.len() == r.inputs.len();
        let takers = r
            .inputs
            .iter()
            .zip(&shm)
            .filter(|(t, m)| t.contents.is_none() && m.is_none())
            .count();
        if !raw.is_empty() && !positional && raw.len() != takers {
            return Err(Failure::invalid(format!(
                "raw_input_contents has {} entries for {} inputs (one per input, or one per \
                 input without contents or shared memory)",
                raw.len(),
                r.inputs.len()
            )));
        }
        let mut next_raw = 0;
        // (name, accepted dtypes), by slot in `found`; the model's own inputs only.
        let inputs: [(&str, &[Dtype]); 3] =
            [(HIDDEN, model.accepts()), (IDS_IN, IDS), (WEIGHTS, FLOATS)];
        let inputs = &inputs[..model.inputs().len()];
        let mut found: Found = [None, None, None];
        for (i, (t, shm)) in r.inputs.iter().zip(shm).enumerate() {
            let slot = inputs
                .iter()
                .position(|(n, _)| *n == t.name)
                .ok_or_else(|| {
                    Failure::invalid(format!(
                        "unknown input {} (inputs: {})",
                        quote(&t.name),
                        model.inputs().join(", ")
                    ))
                })?;
            if found[slot].is_some() {
                return Err(Failure::invalid(format!("input {:?} given twice", t.name)));
            }
            let d = datatype(&t.datatype, &t.name, inputs[slot].1)?;
            if !inputs[slot].1.contains(&d) {
                return Err(tensor::not_accepted(&t.name, name(d), inputs[slot].1, name));
            }
            let raw = if positional {
                raw.get(i)
            } else if t.contents.is_none() && shm.is_none() {
                next_raw += 1;
                raw.get(next_raw - 1)
            } else {
                None
            };
            let data = match shm {
                Some(_) if raw.is_some() || t.contents.is_some() => {
                    return Err(Failure::invalid(format!(
                        "{}: data given both in shared memory and in the request",
                        t.name
                    )))
                }
                Some((region, offset, len)) => {
                    self.shm_input(&t.name, &region, offset, len, slot == 0)?
                }
                None => Data::Host(input_bytes(t, d, raw)?),
            };
            found[slot] = Some((d, &t.shape, data));
        }
        Ok((found, out_span))
    }

    /// An input from a shared-memory region. The hidden states (`stays`) stay there until their
    /// step reads them (a POSIX object's into the ring, CUDA memory by the GPU rank); the small
    /// routing tensors are read at once.
    fn shm_input(
        &self,
        what: &str,
        region: &str,
        offset: u64,
        len: u64,
        stays: bool,
    ) -> Result<Data, Failure> {
        if len > self.max_request as u64 {
            return Err(Failure::invalid(format!(
                "{what}: shared_memory_byte_size {len} exceeds --max-request-bytes ({})",
                self.max_request
            )));
        }
        let span = self.regions.get(region, what)?.span(offset, len, what)?;
        let data = match stays {
            true => {
                // A POSIX object's reads count themselves as they happen.
                if span.on_device() {
                    metrics::counter!(metric_names::SHM_BYTES_TOTAL, "direction" => "in")
                        .increment(len);
                }
                Data::Client(span.client())
            }
            false => Data::Host(span.read()?),
        };
        metrics::counter!(metric_names::SHM_TENSORS_TOTAL, "direction" => "in").increment(1);
        Ok(data)
    }

    /// Decodes, checks, admits and waits for one request. The admission permit comes back with
    /// the answer, for the caller to hold until the response is written.
    async fn run(
        &self,
        mut r: ModelInferRequest,
        deadline: Option<Instant>,
    ) -> Result<Done<ModelInferResponse>, Failure> {
        let model = self
            .model(&r.model_name, &r.model_version)
            .map_err(|f| rejected("not_found", f))?;
        let (d, tally) = (self.decode(&r, model, deadline)?, model.tally());
        let (id, model) = (std::mem::take(&mut r.id), std::mem::take(&mut r.model_name));
        // Only the hidden states' bytes wait in the queue, shared with the request's buffer.
        drop(r);
        let a = self.infer.submit(d.input, tally).await?;
        let hidden = self.infer.spec().hidden;
        let mut parameters = HashMap::new();
        if d.mark_final {
            parameters.insert(FINAL.to_string(), bool_param(true));
        }
        let mut output = InferOutputTensor {
            name: OUTPUT.into(),
            datatype: name(d.out).into(),
            shape: vec![a.tokens as i64, hidden as i64],
            parameters: HashMap::new(),
            contents: None,
        };
        // The answer goes to the client's region, or in the response. Either way the response
        // has one raw entry per output, as Triton's do (empty for a region's): its clients read
        // the entries by the outputs' order.
        let raw_output_contents = match &d.out_span {
            Some(span) => {
                let len = a.tokens * hidden * d.out.bytes();
                match span.on_device() {
                    // Written there before the answer (`JobInput::output_to`).
                    true => metrics::counter!(metric_names::SHM_BYTES_TOTAL, "direction" => "out")
                        .increment(len as u64),
                    false => span.client().write(&a.output).map_err(Failure::invalid)?,
                }
                metrics::counter!(metric_names::SHM_TENSORS_TOTAL, "direction" => "out")
                    .increment(1);
                let p = &mut output.parameters;
                p.insert(
                    "shared_memory_region".into(),
                    string_param(&span.region.name),
                );
                p.insert("shared_memory_byte_size".into(), int_param(len));
                p.insert(
                    "shared_memory_offset".into(),
                    int_param(span.offset as usize),
                );
                vec![Bytes::new()]
            }
            None => vec![a.output],
        };
        let resp = ModelInferResponse {
            model_name: model,
            model_version: VERSION.into(),
            id,
            parameters,
            outputs: vec![output],
            raw_output_contents,
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

    /// Why no model is ready, if none is.
    fn not_ready(&self) -> Option<String> {
        (!self.infer.ready()).then(|| format!("the service is {:?}", self.infer.phase()))
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

    fn refused(status: &Status, since: Instant) {
        record(Self::METHOD, status.code(), 0, since);
    }
}

impl Spliced for ModelInferResponse {
    fn take_large(&mut self) -> Vec<(&'static [u32], Bytes)> {
        // raw_output_contents = 6, repeated: appended in order.
        self.raw_output_contents
            .drain(..)
            .map(|b| (&[6][..], b))
            .collect()
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
        let known = self.model(&r.name, &r.version).is_ok();
        Ok(Response::new(ModelReadyResponse {
            ready: known && self.infer.ready(),
        }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        let mut extensions: Vec<String> = [
            "parameters",
            "model_configuration",
            "statistics",
            "system_shared_memory",
        ]
        .map(String::from)
        .to_vec();
        if self.regions.cuda() {
            extensions.push("cuda_shared_memory".into());
        }
        Ok(Response::new(ServerMetadataResponse {
            name: "epserve".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions,
        }))
    }

    async fn model_metadata(
        &self,
        req: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let r = req.into_inner();
        let model = self.model(&r.name, &r.version).map_err(status)?;
        let (inputs, outputs) = model.metadata(self.infer.spec());
        Ok(Response::new(ModelMetadataResponse {
            name: r.name,
            versions: vec![VERSION.into()],
            platform: PLATFORM.into(),
            inputs,
            outputs,
        }))
    }

    async fn model_config(
        &self,
        req: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        let r = req.into_inner();
        let model = self.model(&r.name, &r.version).map_err(status)?;
        Ok(Response::new(ModelConfigResponse {
            config: Some(model.config(self.infer.spec())),
        }))
    }

    /// One model's statistics, or every model's for an empty name.
    async fn model_statistics(
        &self,
        req: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        let r = req.into_inner();
        let spec = self.infer.spec();
        let models: Vec<Model> = if r.name.is_empty() {
            if !r.version.is_empty() {
                return Err(Status::invalid_argument(
                    "a version without a model name: name the model, or leave both empty for all",
                ));
            }
            Model::all(spec).collect()
        } else {
            vec![self.model(&r.name, &r.version).map_err(status)?]
        };
        let model_stats = models
            .iter()
            .filter_map(|m| Some(statistics(m, self.infer.stats(m.layer, m.tally())?)))
            .collect();
        Ok(Response::new(ModelStatisticsResponse { model_stats }))
    }

    async fn repository_index(
        &self,
        req: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        let r = req.into_inner();
        if !r.repository_name.is_empty() {
            return Err(Status::not_found(format!(
                "unknown repository {} (epserve has one, unnamed: leave repository_name empty)",
                quote(&r.repository_name)
            )));
        }
        let why = self.not_ready();
        Ok(Response::new(RepositoryIndexResponse {
            models: models::index(self.infer.spec(), why.as_deref(), r.ready),
        }))
    }

    async fn system_shared_memory_status(
        &self,
        req: Request<SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<SystemSharedMemoryStatusResponse>, Status> {
        let regions = self.regions.status(&req.into_inner().name)?;
        Ok(Response::new(SystemSharedMemoryStatusResponse { regions }))
    }

    async fn system_shared_memory_register(
        &self,
        req: Request<SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<SystemSharedMemoryRegisterResponse>, Status> {
        let r = req.into_inner();
        self.regions
            .register(&r.name, &r.key, r.offset, r.byte_size)
            .inspect_err(|s| tracing::debug!("shared-memory region refused: {}", s.message()))?;
        Ok(Response::new(SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        req: Request<SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<SystemSharedMemoryUnregisterResponse>, Status> {
        self.regions.unregister(&req.into_inner().name);
        Ok(Response::new(SystemSharedMemoryUnregisterResponse {}))
    }

    async fn cuda_shared_memory_status(
        &self,
        req: Request<CudaSharedMemoryStatusRequest>,
    ) -> Result<Response<CudaSharedMemoryStatusResponse>, Status> {
        let regions = self.regions.cuda_status(&req.into_inner().name)?;
        Ok(Response::new(CudaSharedMemoryStatusResponse { regions }))
    }

    async fn cuda_shared_memory_register(
        &self,
        req: Request<CudaSharedMemoryRegisterRequest>,
    ) -> Result<Response<CudaSharedMemoryRegisterResponse>, Status> {
        let r = req.into_inner();
        self.regions
            .register_cuda(&r.name, &r.raw_handle, r.device_id, r.byte_size)
            .inspect_err(|s| {
                tracing::debug!("CUDA shared-memory region refused: {}", s.message())
            })?;
        Ok(Response::new(CudaSharedMemoryRegisterResponse {}))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        req: Request<CudaSharedMemoryUnregisterRequest>,
    ) -> Result<Response<CudaSharedMemoryUnregisterResponse>, Status> {
        self.regions.unregister_cuda(&req.into_inner().name);
        Ok(Response::new(CudaSharedMemoryUnregisterResponse {}))
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
        let answers = req
            .extensions()
            .get::<Arc<crate::transport::answer::ConnAnswers>>()
            .cloned();
        let out = stream::serve(req.into_inner(), self.stream_in_flight, answers, move |r| {
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

#[cfg(test)]
mod fuzz;
