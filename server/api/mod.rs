//! The gRPC front: `epserve.v1.MoeService`, decoding and validating requests into jobs.

pub mod catalogue;
pub mod tensor;

use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::model::MoeSpec;
use crate::proto::moe_service_server::MoeService;
use crate::proto::{
    self, DType, ForwardRequest, ForwardResponse, GetModelInfoRequest, ModelInfo, ProbeRequest,
    ProbeResponse,
};
use crate::router::{Admission, Job, JobInput};
use crate::shm::Abort;
use crate::telemetry::remote_context;

/// Where the service is in its life; requests are only admitted while `Serving`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Starting = 0,
    Serving = 1,
    Draining = 2,
    Broken = 3,
}

pub struct MoeApi {
    spec: Arc<MoeSpec>,
    info: ModelInfo,
    /// Measured once the group has formed (nccl-ep).
    ep_footprint: std::sync::OnceLock<crate::proto::NcclEpFootprint>,
    jobs: mpsc::Sender<Arc<Job>>,
    admission: Arc<Admission>,
    phase: AtomicU8,
    /// Tells the batcher a waiting client went away, so its queued work is dropped at once.
    wake: Arc<Notify>,
    /// Why the group broke, once it has.
    broken: Arc<Abort>,
}

/// Notifies the batcher when a request's handler ends, whether answered or cancelled.
struct WakeOnDrop(Arc<Notify>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

/// The `grpc-timeout` header: digits and a unit (H, M, S, m, u, n).
pub fn grpc_timeout(meta: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let v = meta.get("grpc-timeout")?.to_str().ok()?;
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn rejected(reason: &'static str, status: Status) -> Status {
    metrics::counter!("epserve_rejections_total", "reason" => reason).increment(1);
    status
}

impl MoeApi {
    pub fn new(
        spec: Arc<MoeSpec>,
        info: ModelInfo,
        jobs: mpsc::Sender<Arc<Job>>,
        admission: Arc<Admission>,
        wake: Arc<Notify>,
        broken: Arc<Abort>,
    ) -> Self {
        Self {
            spec,
            info,
            ep_footprint: std::sync::OnceLock::new(),
            jobs,
            admission,
            phase: AtomicU8::new(Phase::Starting as u8),
            wake,
            broken,
        }
    }

    /// What the NCCL EP exchange takes on the GPU, for GetModelInfo (set once, at startup).
    pub fn set_ep_footprint(&self, f: crate::proto::NcclEpFootprint) {
        let _ = self.ep_footprint.set(f);
    }

    pub fn set_phase(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::Release);
    }

    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Starting,
            1 => Phase::Serving,
            2 => Phase::Draining,
            _ => Phase::Broken,
        }
    }

    fn check_serving(&self) -> Result<(), Status> {
        // A broken group is reported as such whatever the phase (a drain may have begun first).
        if let Some(why) = self.broken.reason() {
            return Err(rejected(
                "broken",
                Status::unavailable(format!("the EP group is broken: {why}")),
            ));
        }
        match self.phase() {
            Phase::Serving => Ok(()),
            Phase::Starting => Err(rejected(
                "starting",
                Status::unavailable("starting: the EP group is not ready yet"),
            )),
            Phase::Draining => Err(rejected(
                "draining",
                Status::unavailable("draining: not accepting new requests"),
            )),
            Phase::Broken => Err(rejected(
                "broken",
                Status::unavailable("the EP group is broken"),
            )),
        }
    }

    fn validate(&self, r: ForwardRequest, deadline: Option<Instant>) -> Result<JobInput, Status> {
        let spec = &self.spec;
        let layer = spec.layer_slot(r.layer).ok_or_else(|| {
            Status::invalid_argument(format!(
                "layer {} is not an MoE layer of this model (MoE layers: {:?})",
                r.layer, spec.moe_layers
            ))
        })?;
        let hs = r
            .hidden_states
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("hidden_states is required"))?;
        if hs.shape.len() == 2 && hs.shape[1] >= 0 && hs.shape[1] as usize != spec.hidden {
            return Err(Status::invalid_argument(format!(
                "hidden_states: hidden size {} does not match the model's {}",
                hs.shape[1], spec.hidden
            )));
        }
        let (hidden, n, _) = tensor::floats(hs, "hidden_states", None, spec.hidden)?;
        let routing = match (&r.topk_ids, &r.topk_weights) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(Status::invalid_argument(
                    "topk_weights given without topk_ids",
                ))
            }
            (Some(_), None) => {
                return Err(Status::invalid_argument(
                    "topk_ids given without topk_weights",
                ))
            }
            (Some(ids), Some(w)) => {
                let ids = tensor::expert_ids(ids, n, spec.top_k, spec.num_experts)?;
                let (w, _, _) = tensor::floats(w, "topk_weights", Some(n), spec.top_k)?;
                Some((ids, w))
            }
        };
        Ok(JobInput {
            id: r.id,
            layer,
            tokens: n,
            hidden,
            routing,
            deadline,
        })
    }

    fn out_dtype(r: &ForwardRequest) -> Result<DType, Status> {
        let input = r
            .hidden_states
            .as_ref()
            .map_or(DType::F32 as i32, |t| t.dtype);
        match tensor::dtype(r.output_dtype, "output_dtype")? {
            DType::DtypeUnspecified => tensor::dtype(input, "hidden_states"),
            d if tensor::FLOATS.contains(&d) => Ok(d),
            d => Err(Status::invalid_argument(format!(
                "output_dtype: {} is not a float dtype",
                d.as_str_name()
            ))),
        }
    }

    /// Admits, queues and waits for one request, within its deadline.
    async fn run(
        &self,
        r: ForwardRequest,
        deadline: Option<Instant>,
    ) -> Result<ForwardResponse, Status> {
        self.check_serving()?;
        let out_dtype = Self::out_dtype(&r).map_err(|s| rejected("invalid_argument", s))?;
        let input = self
            .validate(r, deadline)
            .map_err(|s| rejected("invalid_argument", s))?;
        if deadline.is_some_and(|d| d <= Instant::now()) {
            return Err(rejected(
                "deadline_on_arrival",
                Status::deadline_exceeded("the deadline passed before admission"),
            ));
        }
        let (id, n) = (input.id.clone(), input.tokens);
        let permit = self
            .admission
            .try_admit(n)
            .map_err(|(reason, s)| rejected(reason, s))?;
        // Drain may have begun between the first check and admission; the permit counts either way.
        self.check_serving()?;
        let (job, reply) = Job::new(input, Some(permit));
        self.jobs.try_send(job).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => rejected(
                "queue_full",
                Status::resource_exhausted("the request queue is full"),
            ),
            mpsc::error::TrySendError::Closed(_) => rejected(
                "broken",
                Status::unavailable("the service is not accepting requests"),
            ),
        })?;
        let _wake = WakeOnDrop(self.wake.clone());
        let answer = match deadline {
            Some(d) => tokio::time::timeout_at(d.into(), reply)
                .await
                .map_err(|_| {
                    Status::deadline_exceeded(
                        "the deadline passed while the request was in the service",
                    )
                })?,
            None => reply.await,
        };
        let out = answer
            .map_err(|_| Status::unavailable("the request was dropped: the EP group stopped"))??;
        Ok(ForwardResponse {
            id,
            output: Some(tensor::encode(&out, n, self.spec.hidden, out_dtype)),
            error: None,
        })
    }

    /// `run` with the request's span and metrics.
    async fn forward_one(
        &self,
        r: ForwardRequest,
        deadline: Option<Instant>,
        method: &'static str,
        parent: &opentelemetry::Context,
    ) -> Result<ForwardResponse, Status> {
        let t0 = Instant::now();
        let n = r
            .hidden_states
            .as_ref()
            .and_then(|t| t.shape.first())
            .copied()
            .unwrap_or(0)
            .max(0) as u64;
        let span = tracing::info_span!("request", request_id = %r.id, method);
        // Without a tracing backend there is nothing to attach to; that is fine.
        let _ = span.set_parent(parent.clone());
        let result = self.run(r, deadline).instrument(span).await;
        let code = match &result {
            Ok(_) => {
                metrics::counter!("epserve_request_tokens_total").increment(n);
                Code::Ok
            }
            Err(s) => s.code(),
        };
        metrics::counter!("epserve_requests_total", "method" => method, "status" => code_name(code)).increment(1);
        metrics::histogram!("epserve_request_duration_seconds", "method" => method)
            .record(t0.elapsed().as_secs_f64());
        result
    }
}

fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::Unavailable => "UNAVAILABLE",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::Cancelled => "CANCELLED",
        _ => "OTHER",
    }
}

fn deadline_of<T>(req: &Request<T>) -> Option<Instant> {
    grpc_timeout(req.metadata()).map(|d| Instant::now() + d)
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ForwardResponse, Status>> + Send>>;

#[tonic::async_trait]
impl MoeService for Arc<MoeApi> {
    async fn forward(
        &self,
        req: Request<ForwardRequest>,
    ) -> Result<Response<ForwardResponse>, Status> {
        let deadline = deadline_of(&req);
        let parent = remote_context(req.metadata());
        self.forward_one(req.into_inner(), deadline, "Forward", &parent)
            .await
            .map(Response::new)
    }

    type ForwardStreamStream = ResponseStream;

    async fn forward_stream(
        &self,
        req: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::ForwardStreamStream>, Status> {
        // A stream's deadline and trace context apply to every request on it.
        let deadline = deadline_of(&req);
        let parent = remote_context(req.metadata());
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let api = self.clone();
        tokio::spawn(async move {
            // Each request runs on its own task so answers go out in completion order; the stream
            // ends when the client's half is done and every answer is out. If the client goes
            // away, every pending request is abandoned, which frees its queued tokens.
            while let Ok(Some(r)) = inbound.message().await {
                let (api, tx, parent) = (api.clone(), tx.clone(), parent.clone());
                tokio::spawn(async move {
                    let id = r.id.clone();
                    let answer = tokio::select! {
                        a = api.forward_one(r, deadline, "ForwardStream", &parent) => a,
                        _ = tx.closed() => return,
                    };
                    let resp = answer.unwrap_or_else(|s| ForwardResponse {
                        id,
                        output: None,
                        error: Some(proto::Error {
                            code: s.code() as i32,
                            message: s.message().to_string(),
                        }),
                    });
                    let _ = tx.send(Ok(resp)).await;
                });
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        let mut info = self.info.clone();
        info.nccl_ep = self.ep_footprint.get().cloned();
        Ok(Response::new(info))
    }

    async fn probe(&self, req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let deadline = deadline_of(&req);
        let parent = remote_context(req.metadata());
        let t0 = Instant::now();
        let h = self.spec.hidden;
        let x: Vec<f32> = (0..h).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
        let r = ForwardRequest {
            id: "probe".into(),
            layer: self.spec.moe_layers[0],
            hidden_states: Some(tensor::encode(&x, 1, h, DType::F32)),
            topk_ids: None,
            topk_weights: None,
            output_dtype: DType::F32 as i32,
        };
        let out = self.forward_one(r, deadline, "Probe", &parent).await?;
        let ok = out
            .output
            .is_some_and(|t| tensor::floats(&t, "output", Some(1), h).is_ok());
        if !ok {
            return Err(Status::internal("the probe step produced no finite output"));
        }
        Ok(Response::new(ProbeResponse {
            seconds: t0.elapsed().as_secs_f64(),
            world_size: self.info.world_size,
        }))
    }
}
