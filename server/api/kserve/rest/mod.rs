//! KServe v2 REST (the Open Inference Protocol over HTTP/JSON, with Triton's binary-tensor,
//! model configuration, statistics, repository and shared-memory extensions): each route is the
//! gRPC method of the same name (`GrpcInferenceService for Arc<KserveApi>`), so both faces
//! answer alike; only the encoding and the status (as an HTTP code and `{"error": ...}`) differ.
//! Inference bodies are charged to the upload budget before they are read, bounded by
//! --max-request-bytes (after decompression too), and must arrive within --upload-timeout.

mod infer;
mod json;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tonic::{Code, Request, Status};

use super::KserveApi;
use crate::api::call::{record, status, Call};
use crate::infer::quote::quote;
use crate::inference::grpc_inference_service_server::GrpcInferenceService as Grpc;
use crate::inference::*;
use crate::transport::answer::ConnAnswers;
use crate::transport::http::Held;
use crate::transport::unary::Encoding;
use crate::transport::upload::{Charge, Share};

/// The `method` label of REST inference in the request metrics.
pub use crate::api::call::REST_METHOD as METHOD;
/// The most a body other than an inference request may hold (a registration, an index query).
const SMALL_BODY: usize = 64 << 10;

#[derive(Clone)]
struct Rest {
    api: Arc<KserveApi>,
    /// --max-request-bytes: an inference body's bound, on the wire and inflated.
    max_request: usize,
    /// --upload-timeout: longest a body may take to arrive.
    upload_timeout: Duration,
}

/// A status as REST answers it.
pub struct Problem(Status);

impl From<Status> for Problem {
    fn from(s: Status) -> Self {
        Self(s)
    }
}

/// The HTTP code of a gRPC status.
fn http_code(c: Code) -> StatusCode {
    match c {
        Code::Ok => StatusCode::OK,
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            StatusCode::BAD_REQUEST
        }
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        // The client went away; nobody reads this.
        Code::Cancelled => StatusCode::BAD_REQUEST,
        Code::Internal | Code::Unknown | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let code = http_code(self.0.code());
        (code, axum::Json(json!({ "error": self.0.message() }))).into_response()
    }
}

type Answer = Result<Response, Problem>;

fn ok_json(v: Value) -> Answer {
    Ok(axum::Json(v).into_response())
}

/// Health as KServe's REST says it: 200 for true, 400 for false.
fn truth(b: bool) -> Answer {
    let code = if b {
        StatusCode::OK
    } else {
        StatusCode::BAD_REQUEST
    };
    Ok(code.into_response())
}

/// The model and version a path names (an empty version: the model's one).
fn named(p: &HashMap<String, String>) -> (String, String) {
    let get = |k: &str| p.get(k).cloned().unwrap_or_default();
    (get("model"), get("version"))
}

/// The routes of one rank's REST port, over `api` (the serving side adds `/metrics`).
pub fn routes(api: Arc<KserveApi>, max_request: usize, upload_timeout: Duration) -> Router {
    let rest = Rest {
        api,
        max_request,
        upload_timeout,
    };
    let model = |tail: &str| {
        [
            format!("/v2/models/{{model}}{tail}"),
            format!("/v2/models/{{model}}/versions/{{version}}{tail}"),
        ]
    };
    let mut r = Router::new()
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2", get(server_metadata))
        .route("/v2/models/stats", get(all_stats))
        .route("/v2/repository/index", post(index))
        .route("/v2/systemsharedmemory/status", get(system_status))
        .route(
            "/v2/systemsharedmemory/region/{region}/status",
            get(system_status),
        )
        .route(
            "/v2/systemsharedmemory/region/{region}/register",
            post(system_register),
        )
        .route("/v2/systemsharedmemory/unregister", post(system_unregister))
        .route(
            "/v2/systemsharedmemory/region/{region}/unregister",
            post(system_unregister),
        )
        .route("/v2/cudasharedmemory/status", get(cuda_status))
        .route(
            "/v2/cudasharedmemory/region/{region}/status",
            get(cuda_status),
        )
        .route(
            "/v2/cudasharedmemory/region/{region}/register",
            post(cuda_register),
        )
        .route("/v2/cudasharedmemory/unregister", post(cuda_unregister))
        .route(
            "/v2/cudasharedmemory/region/{region}/unregister",
            post(cuda_unregister),
        );
    for (tail, route) in [
        ("", get(model_metadata)),
        ("/ready", get(model_ready)),
        ("/config", get(model_config)),
        ("/stats", get(model_stats)),
        ("/infer", post(model_infer)),
    ] {
        for path in model(tail) {
            r = r.route(&path, route.clone());
        }
    }
    r.with_state(rest)
        .fallback(no_route)
        .method_not_allowed_fallback(no_method)
}

/// The path a client sent is quoted as every client string is (`quote`: its first 128
/// characters, then its length), so a 60 KB path does not give a 60 KB answer.
async fn no_route(method: Method, uri: Uri) -> Problem {
    Problem(Status::not_found(format!(
        "no route {method} {} (KServe v2 REST under /v2, metrics at /metrics)",
        quote(uri.path())
    )))
}

async fn no_method(method: Method, uri: Uri) -> Response {
    let p = Problem(Status::unimplemented(format!(
        "{} does not take {method}",
        quote(uri.path())
    )));
    let mut r = p.into_response();
    *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    r
}

async fn live(State(s): State<Rest>) -> Answer {
    truth(s.api.infer.live())
}

async fn ready(State(s): State<Rest>) -> Answer {
    truth(s.api.infer.ready())
}

async fn server_metadata(State(s): State<Rest>) -> Answer {
    let mut m = Grpc::server_metadata(&s.api, Request::new(ServerMetadataRequest {}))
        .await?
        .into_inner();
    m.extensions.push("binary_tensor_data".into());
    ok_json(json::message(&m, "ServerMetadataResponse"))
}

async fn model_metadata(State(s): State<Rest>, Path(p): Path<HashMap<String, String>>) -> Answer {
    let (name, version) = named(&p);
    let m = Grpc::model_metadata(&s.api, Request::new(ModelMetadataRequest { name, version }))
        .await?
        .into_inner();
    ok_json(json::message(&m, "ModelMetadataResponse"))
}

async fn model_ready(State(s): State<Rest>, Path(p): Path<HashMap<String, String>>) -> Answer {
    let (name, version) = named(&p);
    let r = Grpc::model_ready(&s.api, Request::new(ModelReadyRequest { name, version }))
        .await?
        .into_inner();
    truth(r.ready)
}

/// The configuration itself, as Triton answers (not wrapped in `config`).
async fn model_config(State(s): State<Rest>, Path(p): Path<HashMap<String, String>>) -> Answer {
    let (name, version) = named(&p);
    let r = Grpc::model_config(&s.api, Request::new(ModelConfigRequest { name, version }))
        .await?
        .into_inner();
    let config = r.config.unwrap_or_default();
    ok_json(json::message(&config, "ModelConfig"))
}

async fn stats(s: &Rest, name: String, version: String) -> Answer {
    let r = Grpc::model_statistics(
        &s.api,
        Request::new(ModelStatisticsRequest { name, version }),
    )
    .await?
    .into_inner();
    ok_json(json::message(&r, "ModelStatisticsResponse"))
}

async fn model_stats(State(s): State<Rest>, Path(p): Path<HashMap<String, String>>) -> Answer {
    let (name, version) = named(&p);
    stats(&s, name, version).await
}

async fn all_stats(State(s): State<Rest>) -> Answer {
    stats(&s, String::new(), String::new()).await
}

/// A small JSON body (empty: `T`'s default), its fields checked.
async fn small<T: for<'a> Deserialize<'a> + Default>(body: Body) -> Result<T, Problem> {
    let bytes = http_body_util::Limited::new(body, SMALL_BODY)
        .collect()
        .await
        .map_err(|e| Status::invalid_argument(format!("reading the request body: {e}")))?
        .to_bytes();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        Problem(Status::invalid_argument(format!(
            "the request's JSON: {}",
            crate::infer::quote::parser_error(&e)
        )))
    })
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct IndexQuery {
    #[serde(default)]
    ready: bool,
}

/// The models as Triton's REST lists them: an array.
async fn index(State(s): State<Rest>, body: Body) -> Answer {
    let q: IndexQuery = small(body).await?;
    let r = Grpc::repository_index(
        &s.api,
        Request::new(RepositoryIndexRequest {
            repository_name: String::new(),
            ready: q.ready,
        }),
    )
    .await?
    .into_inner();
    let models = r
        .models
        .iter()
        .map(|m| json::message(m, "RepositoryIndexResponse.ModelIndex"))
        .collect();
    ok_json(Value::Array(models))
}

fn region(p: &HashMap<String, String>) -> String {
    p.get("region").cloned().unwrap_or_default()
}

/// Regions as Triton's REST lists them: an array.
async fn system_status(State(s): State<Rest>, p: Option<Path<HashMap<String, String>>>) -> Answer {
    let name = p.map(|p| region(&p)).unwrap_or_default();
    let r = Grpc::system_shared_memory_status(
        &s.api,
        Request::new(SystemSharedMemoryStatusRequest { name }),
    )
    .await?
    .into_inner();
    let mut regions: Vec<_> = r.regions.into_values().collect();
    regions.sort_by(|a, b| a.name.cmp(&b.name));
    let regions = regions
        .iter()
        .map(|m| json::message(m, "SystemSharedMemoryStatusResponse.RegionStatus"))
        .collect();
    ok_json(Value::Array(regions))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Register {
    key: String,
    #[serde(default)]
    offset: u64,
    byte_size: u64,
}

async fn system_register(
    State(s): State<Rest>,
    Path(p): Path<HashMap<String, String>>,
    body: Body,
) -> Answer {
    let b: Register = small(body).await?;
    let req = SystemSharedMemoryRegisterRequest {
        name: region(&p),
        key: b.key,
        offset: b.offset,
        byte_size: b.byte_size,
    };
    Grpc::system_shared_memory_register(&s.api, Request::new(req)).await?;
    Ok(StatusCode::OK.into_response())
}

async fn system_unregister(
    State(s): State<Rest>,
    p: Option<Path<HashMap<String, String>>>,
) -> Answer {
    let name = p.map(|p| region(&p)).unwrap_or_default();
    let req = SystemSharedMemoryUnregisterRequest { name };
    Grpc::system_shared_memory_unregister(&s.api, Request::new(req)).await?;
    Ok(StatusCode::OK.into_response())
}

async fn cuda_status(State(s): State<Rest>, p: Option<Path<HashMap<String, String>>>) -> Answer {
    let name = p.map(|p| region(&p)).unwrap_or_default();
    let r = Grpc::cuda_shared_memory_status(
        &s.api,
        Request::new(CudaSharedMemoryStatusRequest { name }),
    )
    .await?
    .into_inner();
    let regions = r
        .regions
        .values()
        .map(|m| json::message(m, "CudaSharedMemoryStatusResponse.RegionStatus"))
        .collect();
    ok_json(Value::Array(regions))
}

/// Triton's JSON of a raw handle: its bytes in base64.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawHandle {
    b64: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CudaRegister {
    raw_handle: RawHandle,
    device_id: i64,
    byte_size: u64,
}

async fn cuda_register(
    State(s): State<Rest>,
    Path(p): Path<HashMap<String, String>>,
    body: Body,
) -> Answer {
    use base64::Engine;
    let b: CudaRegister = small(body).await?;
    let raw_handle = base64::engine::general_purpose::STANDARD
        .decode(b.raw_handle.b64.as_bytes())
        .map_err(|e| Status::invalid_argument(format!("raw_handle.b64 is not base64: {e}")))?;
    let req = CudaSharedMemoryRegisterRequest {
        name: region(&p),
        raw_handle,
        device_id: b.device_id,
        byte_size: b.byte_size,
    };
    Grpc::cuda_shared_memory_register(&s.api, Request::new(req)).await?;
    Ok(StatusCode::OK.into_response())
}

async fn cuda_unregister(
    State(s): State<Rest>,
    p: Option<Path<HashMap<String, String>>>,
) -> Answer {
    let name = p.map(|p| region(&p)).unwrap_or_default();
    let req = CudaSharedMemoryUnregisterRequest { name };
    Grpc::cuda_shared_memory_unregister(&s.api, Request::new(req)).await?;
    Ok(StatusCode::OK.into_response())
}

/// `f` on the blocking pool: parsing and writing JSON, which at tens of megabytes would hold an
/// I/O thread (and every connection on it) for as long.
async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("parsing or writing JSON: {e}")))?
}

/// A refusal before the request reaches the entry: counted and logged as the entry's are.
fn refuse(reason: &'static str, s: Status, t0: Instant) -> Problem {
    crate::rejections::count_rejection(reason);
    tracing::debug!(reason, "request refused: {}", s.message());
    record(METHOD, s.code(), 0, t0);
    Problem(s)
}

/// `Content-Encoding` as the unary gRPC framing's compression.
fn encoding(h: &HeaderMap) -> Result<Option<Encoding>, Status> {
    match h.get(header::CONTENT_ENCODING).map(HeaderValue::as_bytes) {
        None | Some(b"identity") => Ok(None),
        Some(b"gzip") => Ok(Some(Encoding::Gzip)),
        Some(b"deflate") => Ok(Some(Encoding::Deflate)),
        Some(e) => Err(Status::invalid_argument(format!(
            "Content-Encoding {} is not served (gzip, deflate, identity)",
            String::from_utf8_lossy(e)
        ))),
    }
}

/// A number header, if present.
fn number(h: &HeaderMap, name: &str) -> Result<Option<usize>, Status> {
    h.get(name)
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| Status::invalid_argument(format!("{name} {v:?} is not a number")))
        })
        .transpose()
}

impl Rest {
    /// The body, charged to the connection's upload share while it is read.
    async fn body(
        &self,
        h: &HeaderMap,
        share: Option<&Arc<Share>>,
        body: Body,
    ) -> Result<(Bytes, Option<Charge>), (&'static str, Status)> {
        let max = self.max_request;
        let invalid = |s: Status| ("invalid_argument", s);
        let declared = number(h, "content-length").map_err(invalid)?;
        if declared.is_some_and(|n| n > max) {
            return Err((
                "request_too_large",
                Status::resource_exhausted(format!(
                    "the body's {} bytes exceed --max-request-bytes ({max})",
                    declared.unwrap_or_default()
                )),
            ));
        }
        // Charged as it arrives (what a body only declares holds nothing), kept while it is
        // inflated, the inflated bytes charged as they are made.
        let mut charge = None;
        let read = async {
            let mut body = body;
            // Pages of the declared length are resident only once written.
            let mut buf = bytes::BytesMut::with_capacity(declared.unwrap_or(0));
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| {
                    invalid(Status::invalid_argument(format!(
                        "reading the request body: {e}"
                    )))
                })?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if buf.len() + data.len() > max {
                    return Err((
                        "request_too_large",
                        Status::resource_exhausted(format!(
                            "the body exceeds --max-request-bytes ({max})"
                        )),
                    ));
                }
                if let Some(s) = share {
                    s.grow(&mut charge, buf.len() + data.len())
                        .await
                        .map_err(|s| ("upload_budget", s))?;
                }
                buf.extend_from_slice(&data);
            }
            Ok(buf.freeze())
        };
        let bytes = match tokio::time::timeout(self.upload_timeout, read).await {
            Err(_) => {
                return Err((
                    "upload_deadline",
                    Status::deadline_exceeded(format!(
                        "the request body did not arrive within --upload-timeout ({:?})",
                        self.upload_timeout
                    )),
                ))
            }
            Ok(read) => read?,
        };
        let bytes = match encoding(h).map_err(invalid)? {
            None => bytes,
            Some(e) => e
                .inflate(bytes, max, share.map(|s| (s, &mut charge)))
                .await
                .map_err(|s| match s.code() {
                    Code::ResourceExhausted if s.message().starts_with("no room") => {
                        ("upload_budget", s)
                    }
                    Code::ResourceExhausted => (
                        "request_too_large",
                        Status::resource_exhausted(format!(
                            "the body inflates past --max-request-bytes ({max})"
                        )),
                    ),
                    _ => invalid(Status::invalid_argument(s.message().to_string())),
                })?,
        };
        Ok((bytes, charge))
    }
}

async fn model_infer(
    State(s): State<Rest>,
    Path(p): Path<HashMap<String, String>>,
    share: Option<Extension<Arc<Share>>>,
    answers: Option<Extension<Arc<ConnAnswers>>>,
    h: HeaderMap,
    body: Body,
) -> Answer {
    let t0 = Instant::now();
    // A body refused before it was read whole leaves the rest unread on the connection: the
    // answer says it closes, so a client's pool does not send the next request down it.
    let bytes = s
        .body(&h, share.as_deref(), body)
        .await
        .map_err(|(reason, st)| {
            let mut r = refuse(reason, st, t0).into_response();
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            r
        });
    let bytes = match bytes {
        Ok(b) => b,
        Err(r) => return Ok(r),
    };
    if let Some(a) = &answers {
        // Its answer's room: counted and logged by `room`, recorded here.
        a.room().await.map_err(|st| {
            record(METHOD, st.code(), 0, t0);
            Problem(st)
        })?;
    }
    let invalid = |st: Status| refuse("invalid_argument", st, t0);
    let header = number(&h, infer::HEADER_LENGTH).map_err(invalid)?;
    let (model, version) = named(&p);
    // Parsed off the runtime's threads (43 MB of JSON held four gRPC clients' p50 at 280-500 ms),
    // the body's charge kept until it is parsed.
    let (bytes, charge) = bytes;
    let max = s.max_request;
    let (req, binary) = off_runtime(move || {
        let parsed = infer::request(&bytes, header, model, version, max);
        drop((bytes, charge));
        parsed.map_err(status)
    })
    .await
    .map_err(invalid)?;
    let call = Call {
        deadline: None,
        parent: crate::telemetry::remote_context(&tonic::metadata::MetadataMap::from_headers(h)),
    };
    let (resp, permit) = s.api.infer_one(req, &call, METHOD).await?;
    let (parts, json_len) =
        off_runtime(move || infer::response(resp, &binary).map_err(status)).await?;
    // Made: the admission goes, the answer is charged to its connection until written.
    let body = match answers {
        Some(a) => {
            let len = http_body::Body::size_hint(&parts).lower() as usize;
            drop(permit);
            Held::new(
                Body::new(parts),
                Box::new(a.charge(len)) as Box<dyn Send + Unpin>,
            )
        }
        None => Held::new(Body::new(parts), Box::new(permit) as Box<dyn Send + Unpin>),
    };
    let mut r = Response::new(body.into_body());
    let headers = r.headers_mut();
    match json_len {
        Some(n) => {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            headers.insert(infer::HEADER_LENGTH, HeaderValue::from(n));
        }
        None => {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
    }
    Ok(r)
}
