//! Driving the load: closed loop (N clients, one request each outstanding) or open loop (Poisson
//! arrivals at a fixed rate, whatever the latency), over unary calls or long-lived streams.
//! Every request started inside the measured window ends with exactly one recorded status.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use epserve::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use epserve::inference::infer_parameter::ParameterChoice;
use epserve::inference::model_infer_request::InferInputTensor;
use epserve::inference::{
    InferParameter, ModelInferRequest, ModelInferResponse, ModelStreamInferResponse,
};
use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::{DType, ForwardRequest, ForwardResponse};
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Code;

use crate::config::Api;
use crate::record::Recorder;
use crate::report::Report;
use crate::workload::{Out, Workload};

pub use crate::record::{Mode, Plan};

pub fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

fn status_name(s: &tonic::Status) -> String {
    // tonic's client reports its own deadline as CANCELLED "Timeout expired".
    if s.code() == Code::Cancelled && s.message().contains("Timeout expired") {
        return "DEADLINE_EXCEEDED".into();
    }
    code_name(s.code()).into()
}

fn v1_out(r: &ForwardResponse) -> Option<Out> {
    r.output.as_ref().map(Out::of)
}

fn kserve_out(r: &ModelInferResponse) -> Option<Out> {
    let (t, raw) = (r.outputs.first()?, r.raw_output_contents.first()?);
    let dtype = match t.datatype.as_str() {
        "BF16" => DType::Bf16,
        "FP16" => DType::F16,
        "FP32" => DType::F32,
        _ => DType::DtypeUnspecified,
    };
    Some(Out {
        dtype: dtype as i32,
        shape: t.shape.clone(),
        bytes: raw.len(),
    })
}

/// An answer: its status name and, when OK, its output.
type Answer = (String, Option<Out>);

/// The same request as KServe v2 asks it (the tensors' bytes move, not copied).
fn kserve_request(r: ForwardRequest, model: &str) -> ModelInferRequest {
    let datatype = |d: i32| match DType::try_from(d) {
        Ok(DType::Bf16) => "BF16",
        Ok(DType::F16) => "FP16",
        Ok(DType::I32) => "INT32",
        Ok(DType::I64) => "INT64",
        _ => "FP32",
    };
    let mut out = ModelInferRequest {
        model_name: model.to_string(),
        id: r.id,
        ..Default::default()
    };
    let named = [
        ("hidden_states", r.hidden_states),
        ("topk_ids", r.topk_ids),
        ("topk_weights", r.topk_weights),
    ];
    for (name, t) in named {
        if let Some(t) = t {
            out.inputs.push(InferInputTensor {
                name: name.into(),
                datatype: datatype(t.dtype).into(),
                shape: t.shape,
                ..Default::default()
            });
            out.raw_input_contents.push(t.data);
        }
    }
    if r.output_dtype != 0 {
        out.parameters.insert(
            "output_datatype".into(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::StringParam(
                    datatype(r.output_dtype).into(),
                )),
            },
        );
    }
    out
}

/// Requests outstanding on one stream, by id.
type Pending = Arc<Mutex<HashMap<String, oneshot::Sender<Answer>>>>;

/// One long-lived stream call (`ForwardStream` or `ModelStreamInfer`).
struct StreamLane<Req> {
    tx: mpsc::Sender<Req>,
    pending: Pending,
}

impl<Req: Send + 'static> StreamLane<Req> {
    /// Opens a lane whose answers come from `inbound`, each mapped by `answer` to (id, answer).
    fn open<Resp: Send + 'static>(
        tx: mpsc::Sender<Req>,
        mut inbound: tonic::Streaming<Resp>,
        answer: fn(Resp) -> (String, Answer),
    ) -> Self {
        let pending: Pending = Arc::default();
        let p = pending.clone();
        tokio::spawn(async move {
            let end = loop {
                match inbound.message().await {
                    Ok(Some(resp)) => {
                        let (id, a) = answer(resp);
                        if let Some(waiter) = p.lock().unwrap().remove(&id) {
                            let _ = waiter.send(a);
                        }
                    }
                    Ok(None) => break "NO_RESPONSE".to_string(),
                    Err(s) => break status_name(&s),
                }
            };
            for (_, waiter) in p.lock().unwrap().drain() {
                let _ = waiter.send((end.clone(), None));
            }
        });
        Self { tx, pending }
    }

    async fn issue(&self, id: String, request: Req, timeout: Duration) -> Answer {
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id.clone(), tx);
        if self.tx.send(request).await.is_err() {
            self.pending.lock().unwrap().remove(&id);
            return ("NO_RESPONSE".into(), None);
        }
        match tokio::time::timeout(timeout, rx).await {
            Err(_) => {
                self.pending.lock().unwrap().remove(&id);
                ("DEADLINE_EXCEEDED".into(), None)
            }
            Ok(Err(_)) => ("NO_RESPONSE".into(), None),
            Ok(Ok(a)) => a,
        }
    }
}

fn v1_answer(resp: ForwardResponse) -> (String, Answer) {
    let a = match &resp.error {
        Some(e) => (code_name(Code::from_i32(e.code)).into(), None),
        None => ("OK".into(), v1_out(&resp)),
    };
    (resp.id, a)
}

/// A KServe stream error is `CODE: message`.
fn kserve_answer(resp: ModelStreamInferResponse) -> (String, Answer) {
    let r = resp.infer_response.unwrap_or_default();
    let a = if resp.error_message.is_empty() {
        ("OK".into(), kserve_out(&r))
    } else {
        let code = resp.error_message.split(':').next().unwrap_or("ERROR");
        (code.to_string(), None)
    };
    (r.id, a)
}

/// Where requests go: a pool of connections, and for streams one lane per connection.
struct Target {
    v1: Vec<MoeServiceClient<Channel>>,
    kserve: Vec<GrpcInferenceServiceClient<Channel>>,
    v1_lanes: Vec<StreamLane<ForwardRequest>>,
    kserve_lanes: Vec<StreamLane<ModelInferRequest>>,
    /// `--api kserve-shm`: the regions, one pair per request in flight.
    regions: Option<crate::shm::Regions>,
    api: Api,
    /// The KServe model of the workload's layer.
    model: String,
    next: AtomicUsize,
    timeout: Duration,
}

impl Target {
    /// `plan.connections` to each of the comma-separated addresses: requests go round-robin
    /// over all of them, so every address gets the same share.
    async fn connect(addrs: &str, plan: &Plan, workload: &Workload) -> anyhow::Result<Self> {
        let layer = workload.shape().layer;
        let (mut v1, mut kserve) = (Vec::new(), Vec::new());
        let each = addrs
            .split(',')
            .flat_map(|a| std::iter::repeat_n(a, plan.connections));
        for addr in each {
            let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?;
            let ch = plan.http2.endpoint(ch).connect().await?;
            v1.push(
                MoeServiceClient::new(ch.clone())
                    .max_decoding_message_size(1 << 30)
                    .max_encoding_message_size(1 << 30),
            );
            kserve.push(
                GrpcInferenceServiceClient::new(ch)
                    .max_decoding_message_size(1 << 30)
                    .max_encoding_message_size(1 << 30),
            );
        }
        let (mut v1_lanes, mut kserve_lanes) = (Vec::new(), Vec::new());
        match plan.api {
            Api::Stream => {
                for c in &mut v1 {
                    let (tx, rx) = mpsc::channel(1024);
                    let inbound = c.forward_stream(ReceiverStream::new(rx)).await?;
                    v1_lanes.push(StreamLane::open(tx, inbound.into_inner(), v1_answer));
                }
            }
            Api::KserveStream => {
                for c in &mut kserve {
                    let (tx, rx) = mpsc::channel(1024);
                    let inbound = c.model_stream_infer(ReceiverStream::new(rx)).await?;
                    kserve_lanes.push(StreamLane::open(tx, inbound.into_inner(), kserve_answer));
                }
            }
            Api::Unary | Api::Kserve | Api::KserveShm => {}
        }
        let regions = match plan.api {
            Api::KserveShm => {
                if addrs.contains(',') {
                    anyhow::bail!("--api kserve-shm takes one address (the regions are local)");
                }
                let in_flight = match plan.mode {
                    Mode::Closed(n) => n,
                    Mode::Open(_) => plan.max_in_flight,
                };
                // The largest output: f32 rows of the largest request.
                let len = workload.max_tokens() * workload.shape().hidden * 4;
                Some(crate::shm::Regions::create(&mut kserve[0], in_flight, len).await?)
            }
            _ => None,
        };
        Ok(Self {
            v1,
            kserve,
            v1_lanes,
            kserve_lanes,
            regions,
            api: plan.api,
            model: format!("layer-{layer}"),
            next: AtomicUsize::new(0),
            timeout: plan.timeout,
        })
    }

    /// Sends one request; returns its status name and output.
    async fn issue(&self, request: ForwardRequest) -> Answer {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let timeout = self.timeout;
        match self.api {
            Api::Unary => {
                let mut c = self.v1[i % self.v1.len()].clone();
                let mut req = tonic::Request::new(request);
                req.set_timeout(timeout);
                match c.forward(req).await {
                    Ok(r) => ("OK".into(), v1_out(r.get_ref())),
                    Err(s) => (status_name(&s), None),
                }
            }
            Api::Kserve => {
                let mut c = self.kserve[i % self.kserve.len()].clone();
                let mut req = tonic::Request::new(kserve_request(request, &self.model));
                req.set_timeout(timeout);
                match c.model_infer(req).await {
                    Ok(r) => ("OK".into(), kserve_out(r.get_ref())),
                    Err(s) => (status_name(&s), None),
                }
            }
            Api::KserveShm => {
                let mut c = self.kserve[i % self.kserve.len()].clone();
                let regions = self.regions.as_ref().expect("kserve-shm has regions");
                let req = kserve_request(request, &self.model);
                match regions.infer(&mut c, req, timeout).await {
                    Ok((r, bytes)) => ("OK".into(), kserve_out(&r).map(|o| Out { bytes, ..o })),
                    Err(s) => (status_name(&s), None),
                }
            }
            Api::Stream => {
                let lane = &self.v1_lanes[i % self.v1_lanes.len()];
                lane.issue(request.id.clone(), request, timeout).await
            }
            Api::KserveStream => {
                let lane = &self.kserve_lanes[i % self.kserve_lanes.len()];
                let id = request.id.clone();
                lane.issue(id, kserve_request(request, &self.model), timeout)
                    .await
            }
        }
    }
}

/// One request start to finish, recorded.
async fn one(target: &Target, workload: &Mutex<Workload>, rec: &Recorder, id: u64) {
    let item = workload.lock().unwrap().next(id.to_string());
    let started = Instant::now();
    rec.sent(started, item.bytes_out);
    let (status, out) = target.issue(item.request).await;
    let (status, bytes_in) = match out {
        Some(o) if status == "OK" => match workload.lock().unwrap().check(item.tokens, &o) {
            Ok(b) => (status, b),
            Err(_) => ("BAD_RESPONSE".into(), 0),
        },
        None if status == "OK" => ("BAD_RESPONSE".into(), 0),
        _ => (status, 0),
    };
    rec.done(started, &status, item.tokens, bytes_in);
}

/// Runs the plan against `addr` (one address, or several comma-separated: the load is spread
/// evenly over them) and reports on the measured window.
pub async fn run(addr: &str, plan: &Plan, workload: Workload, seed: u64) -> anyhow::Result<Report> {
    let target = Arc::new(Target::connect(addr, plan, &workload).await?);
    let workload = Arc::new(Mutex::new(workload));
    let start = Instant::now();
    let (warm_end, end) = (start + plan.warmup, start + plan.warmup + plan.duration);
    let rec = Arc::new(Recorder::new(warm_end, end));
    let mut tasks = JoinSet::new();
    let ids = Arc::new(AtomicU64::new(0));
    match plan.mode {
        Mode::Closed(n) => {
            for _ in 0..n {
                let (t, w, r, ids) = (target.clone(), workload.clone(), rec.clone(), ids.clone());
                tasks.spawn(async move {
                    while Instant::now() < end {
                        one(&t, &w, &r, ids.fetch_add(1, Ordering::Relaxed)).await;
                    }
                });
            }
        }
        Mode::Open(rate) => {
            // Arrivals are scheduled on the clock, not on completions: a slow server makes
            // latency grow, never the offered rate fall.
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xA221);
            let in_flight = Arc::new(AtomicUsize::new(0));
            let mut next = start;
            while next < end {
                tokio::time::sleep_until(next).await;
                while next <= Instant::now() && next < end {
                    if in_flight.load(Ordering::Relaxed) >= plan.max_in_flight {
                        if rec.counted(next) {
                            rec.not_sent.fetch_add(1, Ordering::Relaxed);
                        }
                    } else {
                        in_flight.fetch_add(1, Ordering::Relaxed);
                        let (t, w, r, f) = (
                            target.clone(),
                            workload.clone(),
                            rec.clone(),
                            in_flight.clone(),
                        );
                        let id = ids.fetch_add(1, Ordering::Relaxed);
                        tasks.spawn(async move {
                            one(&t, &w, &r, id).await;
                            f.fetch_sub(1, Ordering::Relaxed);
                        });
                    }
                    let gap = -(1.0 - rng.random::<f64>()).ln() / rate;
                    next += Duration::from_secs_f64(gap);
                }
            }
        }
    }
    // Everything in flight ends by its own deadline; wait for it from the end of the run (closed
    // loops are still sending until then), bounded all the same.
    tokio::time::sleep_until(end).await;
    let drain = tokio::time::timeout(plan.timeout + Duration::from_secs(5), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drain.is_err() {
        anyhow::bail!(
            "requests still in flight {:?} after their deadline",
            plan.timeout + Duration::from_secs(5)
        );
    }
    if let Some(regions) = &target.regions {
        regions.close(&mut target.kserve[0].clone()).await;
    }
    Ok(Report::new(&rec, plan, addr, &rec.parts()))
}
