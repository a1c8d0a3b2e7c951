//! The gRPC front: `epserve.v1.MoeService`, decoding and validating requests into jobs.

pub mod catalogue;
pub mod tensor;

use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::model::MoeSpec;
use crate::proto::moe_service_server::MoeService;
use crate::proto::{
    self, DType, ForwardRequest, ForwardResponse, GetModelInfoRequest, ModelInfo, ProbeRequest,
    ProbeResponse,
};
use crate::router::{Admission, Job, JobInput, Permit};
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
    /// Most requests of one ForwardStream answered or in progress but not yet taken by the
    /// transport (--max-stream-in-flight).
    stream_in_flight: usize,
}

/// Notifies the batcher when a request's handler ends, whether answered or cancelled.
struct WakeOnDrop(Arc<Notify>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

/// The `grpc-timeout` header as the gRPC spec writes it: 1 to 8 digits and a unit (H, M, S, m,
/// u, n). Anything else is refused rather than guessed at.
pub fn grpc_timeout(meta: &tonic::metadata::MetadataMap) -> Result<Option<Duration>, Status> {
    let Some(v) = meta.get("grpc-timeout") else {
        return Ok(None);
    };
    let bad = || {
        Status::invalid_argument(format!(
            "grpc-timeout {v:?} is not 1 to 8 digits followed by H, M, S, m, u or n"
        ))
    };
    let v = v.to_str().map_err(|_| bad())?;
    let (num, unit) = v.split_at(v.len().checked_sub(1).ok_or_else(bad)?);
    if num.is_empty() || num.len() > 8 || !num.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = num.parse().map_err(|_| bad())?;
    Ok(Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return Err(bad()),
    }))
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
        stream_in_flight: usize,
    ) -> Self {
        Self {
            stream_in_flight: stream_in_flight.max(1),
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

    /// Admits, queues and waits for one request, within its deadline. The admission permit
    /// comes back with the answer, for the caller to hold until the response is written.
    async fn run(
        &self,
        r: ForwardRequest,
        deadline: Option<Instant>,
    ) -> Result<(ForwardResponse, Option<Permit>), Status> {
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
        self.jobs.try_send(job.clone()).map_err(|e| match e {
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
        let wait = async {
            match deadline {
                Some(d) => tokio::time::timeout_at(d.into(), reply).await.map_err(|_| {
                    Status::deadline_exceeded(
                        "the deadline passed while the request was in the service",
                    )
                }),
                None => Ok(reply.await),
            }
        };
        // A broken group answers at once, wherever the request is: the step holding it may be
        // stuck on a device that will never finish.
        let answer = tokio::select! {
            biased;
            a = wait => a?,
            why = self.broken.broken() => return Err(self.broken_status(&job, &why)),
        };
        let out = answer
            .map_err(|_| Status::unavailable("the request was dropped: the EP group stopped"))??;
        let resp = ForwardResponse {
            id,
            output: Some(tensor::encode(&out, n, self.spec.hidden, out_dtype)),
            error: None,
        };
        Ok((resp, job.take_permit()))
    }

    /// A request's status once the group broke: INTERNAL if a step that held it computed
    /// something wrong, else UNAVAILABLE.
    fn broken_status(&self, job: &Job, why: &str) -> Status {
        if self.broken.corrupt() && job.in_step() {
            Status::internal(format!(
                "the step holding this request produced a wrong result; the EP group is broken: {why}"
            ))
        } else {
            Status::unavailable(format!("the EP group is broken: {why}"))
        }
    }

    /// Reads one ForwardStream: each request runs on its own task, so answers go out in
    /// completion order. A request is read only when the stream has a free in-flight slot. The
    /// stream ends when the client's half is done and every answer is out, or, after the answers
    /// in progress, with the status of a message that could not be decoded. If the client goes
    /// away, pending requests are abandoned, which frees their queued tokens.
    async fn read_stream(
        self: Arc<Self>,
        mut inbound: Streaming<ForwardRequest>,
        tx: mpsc::Sender<Result<(ForwardResponse, Held), Status>>,
        deadline: Option<Instant>,
        parent: opentelemetry::Context,
    ) {
        let slots = Arc::new(Semaphore::new(self.stream_in_flight));
        let mut tasks = tokio::task::JoinSet::new();
        let end = loop {
            let next = async {
                let slot = slots.clone().acquire_owned().await;
                (slot, inbound.message().await)
            };
            let (slot, msg) = tokio::select! {
                x = next => x,
                _ = tx.closed() => return,
            };
            let Ok(slot) = slot else { return };
            let r = match msg {
                Ok(Some(r)) => r,
                Ok(None) => break None,
                Err(status) => break Some(status),
            };
            let (api, tx, parent) = (self.clone(), tx.clone(), parent.clone());
            tasks.spawn(async move {
                let id = r.id.clone();
                let answer = tokio::select! {
                    a = api.forward_one(r, deadline, "ForwardStream", &parent) => a,
                    _ = tx.closed() => return,
                };
                let item = match answer {
                    Ok((resp, permit)) => (resp, (slot, permit)),
                    Err(s) => (error_response(id, &s), (slot, None)),
                };
                let _ = tx.send(Ok(item)).await;
            });
            while tasks.try_join_next().is_some() {}
        };
        while tasks.join_next().await.is_some() {}
        if let Some(status) = end {
            tracing::debug!("ForwardStream ended by a bad message: {status}");
            let _ = tx.send(Err(status)).await;
        }
    }

    /// `run` with the request's span and metrics.
    async fn forward_one(
        &self,
        r: ForwardRequest,
        deadline: Option<Instant>,
        method: &'static str,
        parent: &opentelemetry::Context,
    ) -> Result<(ForwardResponse, Option<Permit>), Status> {
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

fn error_response(id: String, s: &Status) -> ForwardResponse {
    ForwardResponse {
        id,
        output: None,
        error: Some(proto::Error {
            code: s.code() as i32,
            message: s.message().to_string(),
        }),
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
        Code::Internal => "INTERNAL",
        Code::OutOfRange => "OUT_OF_RANGE",
        _ => "OTHER",
    }
}

/// When the call's deadline passes; None without one (or one too far off to represent).
fn deadline_of<T>(req: &Request<T>) -> Result<Option<Instant>, Status> {
    let d = grpc_timeout(req.metadata()).map_err(|s| rejected("invalid_argument", s))?;
    Ok(d.and_then(|d| Instant::now().checked_add(d)))
}

/// What a stream holds for one answer until the transport takes it: the stream's in-flight slot
/// and the request's admission permit.
type Held = (OwnedSemaphorePermit, Option<Permit>);

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ForwardResponse, Status>> + Send>>;

#[tonic::async_trait]
impl MoeService for Arc<MoeApi> {
    async fn forward(
        &self,
        req: Request<ForwardRequest>,
    ) -> Result<Response<ForwardResponse>, Status> {
        let deadline = deadline_of(&req)?;
        let parent = remote_context(req.metadata());
        self.forward_one(req.into_inner(), deadline, "Forward", &parent)
            .await
            .map(|(resp, _permit)| Response::new(resp))
    }

    type ForwardStreamStream = ResponseStream;

    async fn forward_stream(
        &self,
        req: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::ForwardStreamStream>, Status> {
        // A stream's deadline and trace context apply to every request on it.
        let deadline = deadline_of(&req)?;
        let parent = remote_context(req.metadata());
        let inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(self.stream_in_flight);
        tokio::spawn(self.clone().read_stream(inbound, tx, deadline, parent));
        // An answer's slot and permit go when the transport takes it (HTTP/2 flow control holds
        // the rest back), so a client that does not read stops being read, within its budget.
        let out = ReceiverStream::new(rx).map(|a| a.map(|(resp, _held)| resp));
        Ok(Response::new(Box::pin(out)))
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
        let deadline = deadline_of(&req)?;
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
        let (out, _permit) = self.forward_one(r, deadline, "Probe", &parent).await?;
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

/// The request decode and validate path under random input (a fixed seed and budget, so CI runs
/// the same cases every time): no input panics, every refusal is INVALID_ARGUMENT with a
/// message, and everything accepted is consistent with the model.
#[cfg(test)]
mod fuzz {
    use super::*;
    use prost::Message;
    use rand::{Rng, SeedableRng};

    fn api() -> MoeApi {
        let spec = Arc::new(crate::model::synthetic::preset("tiny").unwrap());
        let (jobs, _rx) = mpsc::channel(1);
        MoeApi::new(
            spec,
            ModelInfo::default(),
            jobs,
            Admission::new(1, 1),
            Arc::new(Notify::new()),
            Arc::new(Abort::default()),
            1,
        )
    }

    /// A broken group answers every waiting request at once, whatever holds it: INTERNAL for one
    /// inside the step whose output was wrong, UNAVAILABLE for one still queued.
    #[tokio::test]
    async fn a_broken_group_answers_waiting_requests_by_where_they_are() {
        let spec = Arc::new(crate::model::synthetic::preset("tiny").unwrap());
        let (jobs, mut rx) = mpsc::channel(4);
        let abort = Arc::new(Abort::default());
        let api = Arc::new(MoeApi::new(
            spec.clone(),
            ModelInfo::default(),
            jobs,
            Admission::new(4, 64),
            Arc::new(Notify::new()),
            abort.clone(),
            1,
        ));
        api.set_phase(Phase::Serving);
        let x = vec![0.5f32; spec.hidden];
        let req = |id: &str| ForwardRequest {
            id: id.into(),
            layer: spec.moe_layers[0],
            hidden_states: Some(tensor::encode(&x, 1, spec.hidden, DType::F32)),
            ..Default::default()
        };
        let (a, b) = (api.clone(), api.clone());
        let (ra, rb) = (req("in-step"), req("queued"));
        let in_step = tokio::spawn(async move { a.run(ra, None).await.map(drop) });
        let queued = tokio::spawn(async move { b.run(rb, None).await.map(drop) });
        let (j1, j2) = (rx.recv().await.unwrap(), rx.recv().await.unwrap());
        let stepped = if j1.input.id == "in-step" { &j1 } else { &j2 };
        stepped.started(Instant::now());
        abort.trigger_corrupt("NCCL EP received 9 rows where the routing sent 8");
        let e = in_step.await.unwrap().unwrap_err();
        assert_eq!(e.code(), Code::Internal, "{e:?}");
        assert!(e.message().contains("routing sent 8"), "{e:?}");
        let e = queued.await.unwrap().unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        assert!(e.message().contains("routing sent 8"), "{e:?}");
    }

    fn pick<T: Copy>(rng: &mut impl Rng, from: &[T]) -> T {
        from[rng.random_range(0..from.len())]
    }

    /// A tensor near the valid ones: dtypes in and out of the enum, shapes of any rank and sign,
    /// data of the right length or not, values finite or not.
    fn tensor(rng: &mut impl Rng, cols: usize, valid: &[i32]) -> proto::Tensor {
        if rng.random_bool(0.6) {
            // A valid tensor, perhaps with one byte changed.
            let dtype = pick(rng, valid);
            let n = rng.random_range(1..4usize);
            let data = match dtype {
                1 => (0..n * cols)
                    .flat_map(|_| half::bf16::from_f32(rng.random::<f32>()).to_le_bytes())
                    .collect(),
                2 => (0..n * cols)
                    .flat_map(|_| half::f16::from_f32(rng.random::<f32>()).to_le_bytes())
                    .collect(),
                3 => (0..n * cols)
                    .flat_map(|_| rng.random::<f32>().to_le_bytes())
                    .collect(),
                // Expert ids: a row of distinct ids, mostly in range.
                4 => (0..n)
                    .flat_map(|_| (0..cols as i32).map(|e| e * 3 % 9))
                    .flat_map(i32::to_le_bytes)
                    .collect(),
                _ => (0..n * cols)
                    .flat_map(|i| (i as i64 % 8).to_le_bytes())
                    .collect(),
            };
            let mut t = proto::Tensor {
                dtype,
                shape: vec![n as i64, cols as i64],
                data,
            };
            if rng.random_bool(0.3) && !t.data.is_empty() {
                let at = rng.random_range(0..t.data.len());
                t.data[at] = rng.random();
            }
            return t;
        }
        let dtype = pick(rng, &[0, 1, 2, 3, 4, 5, 6, -1, 99, i32::MAX]);
        let n = pick(rng, &[0i64, 1, 2, 7, -1, i64::MAX, 1 << 40]);
        let c = pick(rng, &[cols as i64, cols as i64 - 1, 0, -3, i64::MIN]);
        let shape = match rng.random_range(0..5) {
            0 => vec![],
            1 => vec![n],
            2 => vec![n, c, 1],
            _ => vec![n, c],
        };
        let elem = pick(rng, &[1usize, 2, 4, 8]);
        let rows = usize::try_from(n).unwrap_or(0).min(8);
        let len = rows * cols.max(1) * elem;
        let len = rng.random_range(0..len + 9);
        let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        proto::Tensor { dtype, shape, data }
    }

    #[test]
    fn no_request_panics_and_every_refusal_is_invalid_argument() {
        let api = api();
        let (h, k) = (api.spec.hidden, api.spec.top_k);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
        let mut accepted = 0;
        for i in 0..20_000 {
            let mut r = if i % 4 == 0 {
                // Raw bytes on the wire: decoding must fail cleanly or give some request.
                let len = rng.random_range(0..64);
                let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                match ForwardRequest::decode(bytes.as_slice()) {
                    Ok(r) => r,
                    Err(_) => continue,
                }
            } else {
                ForwardRequest::default()
            };
            r.layer = pick(&mut rng, &[0, 0, 1, 2, u32::MAX]);
            r.output_dtype = pick(&mut rng, &[0, 0, 1, 3, 4, 77]);
            if rng.random_bool(0.9) {
                r.hidden_states = Some(tensor(&mut rng, h, &[1, 2, 3]));
            }
            if rng.random_bool(0.3) {
                r.topk_ids = Some(tensor(&mut rng, k, &[4, 5]));
                r.topk_weights = Some(tensor(&mut rng, k, &[1, 2, 3]));
            }
            if rng.random_bool(0.1) {
                r.topk_ids = None;
            }
            let out = MoeApi::out_dtype(&r);
            match out.and_then(|_| api.validate(r.clone(), None)) {
                Err(s) => {
                    assert_eq!(s.code(), Code::InvalidArgument, "{r:?}: {s:?}");
                    assert!(!s.message().is_empty());
                }
                Ok(input) => {
                    accepted += 1;
                    assert_eq!(input.hidden.len(), input.tokens * h);
                    assert!(input.hidden.iter().all(|v| v.is_finite()));
                    if let Some((ids, w)) = &input.routing {
                        assert_eq!((ids.len(), w.len()), (input.tokens * k, input.tokens * k));
                        assert!(ids
                            .iter()
                            .all(|&e| (0..api.spec.num_experts as i32).contains(&e)));
                    }
                }
            }
        }
        // The generator reaches the valid region too, so the checks past the first run.
        assert!(accepted > 100, "only {accepted} requests were valid");
    }
}
