//! What the protocols share: deadlines from `grpc-timeout`, the status of each `Failure`, and
//! request metrics.

use std::future::Future;
use std::time::{Duration, Instant};

use tonic::{Code, Request, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::metric_names;
use crate::request::{Failure, Permit};

/// The gRPC status of a request that got no output.
pub fn status(f: Failure) -> Status {
    match f {
        Failure::Invalid(m) => Status::invalid_argument(m),
        Failure::NotFound(m) => Status::not_found(m),
        Failure::Exhausted { message, .. } => Status::resource_exhausted(message),
        Failure::Unavailable { message, .. } => Status::unavailable(message),
        Failure::Deadline(m) => Status::deadline_exceeded(m),
        Failure::Wrong(m) => Status::internal(m),
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
    crate::transport::grpc_timeout(v).map(Some).ok_or_else(bad)
}

/// What a call gives every request on it (one, or all of a stream's): the deadline from
/// `grpc-timeout` (None without one, or one too far off to represent) and the trace context.
#[derive(Clone)]
pub(super) struct Call {
    pub(super) deadline: Option<Instant>,
    pub(super) parent: opentelemetry::Context,
}

impl Call {
    pub(super) fn of<T>(req: &Request<T>) -> Result<Self, Status> {
        let d = grpc_timeout(req.metadata()).inspect_err(|s| {
            crate::rejections::count_rejection("invalid_argument");
            tracing::debug!(
                reason = "invalid_argument",
                "request refused: {}",
                s.message()
            );
        })?;
        Ok(Self {
            deadline: d.and_then(|d| Instant::now().checked_add(d)),
            parent: crate::telemetry::remote_context(req.metadata()),
        })
    }

    /// Runs one request's `work` in its span and counts it: status, duration, tokens if answered.
    pub(super) async fn observe<R>(
        &self,
        method: &'static str,
        id: &str,
        work: impl Future<Output = Result<Done<R>, Failure>>,
    ) -> Result<(R, Option<Permit>), Status> {
        let t0 = Instant::now();
        let span = tracing::info_span!("request", request_id = %id, method);
        // Without a tracing backend there is nothing to attach to; that is fine.
        let _ = span.set_parent(self.parent.clone());
        let result = work.instrument(span).await.map_err(|f| {
            let reason = f.reason();
            let s = status(f);
            tracing::debug!(
                request_id = %id,
                method,
                status = code_name(s.code()),
                reason,
                "request refused: {}",
                s.message()
            );
            s
        });
        let (code, tokens) = match &result {
            Ok(d) => (Code::Ok, d.tokens as u64),
            Err(s) => (s.code(), 0),
        };
        record(method, code, tokens, t0);
        result.map(|d| (d.resp, d.permit))
    }
}

/// An answered request: its response, the admission permit to hold until the response is
/// written, and its token count (for the metrics).
pub(super) struct Done<R> {
    pub(super) resp: R,
    pub(super) permit: Option<Permit>,
    pub(super) tokens: usize,
}

/// Counts one finished request of `method`: its status, and its tokens when answered.
pub(super) fn record(method: &'static str, code: Code, tokens: u64, t0: Instant) {
    debug_assert!(
        METHODS.contains(&method),
        "method {method:?} is not in METHODS"
    );
    if code == Code::Ok {
        metrics::counter!(metric_names::REQUEST_TOKENS_TOTAL).increment(tokens);
    }
    crate::stats_log::request(code == Code::Ok, tokens);
    metrics::counter!(metric_names::REQUESTS_TOTAL, "method" => method, "status" => code_name(code))
        .increment(1);
    metrics::histogram!(metric_names::REQUEST_DURATION_SECONDS, "method" => method)
        .record(t0.elapsed().as_secs_f64());
}

/// The `method` label of KServe REST inference in the request metrics.
pub const REST_METHOD: &str = "HttpModelInfer";
/// The `method` labels of the request metrics.
pub const METHODS: &[&str] = &[
    "Forward",
    "ForwardStream",
    "ModelInfer",
    "ModelStreamInfer",
    REST_METHOD,
    "Probe",
];
/// The `status` labels of `epserve_requests_total` (what `code_name` gives).
pub const STATUSES: &[&str] = &[
    "OK",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "CANCELLED",
    "INTERNAL",
    "OUT_OF_RANGE",
    "OTHER",
];

pub(super) fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::NotFound => "NOT_FOUND",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::Unavailable => "UNAVAILABLE",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::Cancelled => "CANCELLED",
        Code::Internal => "INTERNAL",
        Code::OutOfRange => "OUT_OF_RANGE",
        _ => "OTHER",
    }
}
