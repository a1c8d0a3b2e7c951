//! The gRPC protocols over the one request entry (`crate::infer`): `epserve.v1.MoeService`
//! (`moe`) and KServe v2 / the Open Inference Protocol (`kserve`). What they share lives here:
//! deadlines from `grpc-timeout`, the status of each `Failure`, and request metrics.

pub mod catalogue;
pub mod kserve;
pub mod moe;
mod stream;

use std::time::{Duration, Instant};

use tonic::{Code, Request, Status};

use crate::router::Failure;

pub use moe::MoeApi;

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

/// When the call's deadline passes; None without one (or one too far off to represent).
fn deadline_of<T>(req: &Request<T>) -> Result<Option<Instant>, Status> {
    let d = grpc_timeout(req.metadata()).inspect_err(|_| {
        metrics::counter!("epserve_rejections_total", "reason" => "invalid_argument").increment(1);
    })?;
    Ok(d.and_then(|d| Instant::now().checked_add(d)))
}

/// Counts one finished request of `method`: its status, and its tokens when answered.
fn record(method: &'static str, code: Code, tokens: u64, t0: Instant) {
    if code == Code::Ok {
        metrics::counter!("epserve_request_tokens_total").increment(tokens);
    }
    metrics::counter!("epserve_requests_total", "method" => method, "status" => code_name(code))
        .increment(1);
    metrics::histogram!("epserve_request_duration_seconds", "method" => method)
        .record(t0.elapsed().as_secs_f64());
}

fn code_name(c: Code) -> &'static str {
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
