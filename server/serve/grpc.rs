//! A rank's gRPC surface: epserve.v1, KServe v2, health and reflection on one port, with our
//! own accept loop, and the health services that say whether it is ready and live.

use std::net::SocketAddr;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::{mpsc, Notify};

use tokio_util::sync::CancellationToken;
use tonic::server::NamedService;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;
use tracing::warn;

use super::prepare::Prepared;
use crate::api::kserve::{KserveApi, ModelInfer};
use crate::api::moe::Forward;
use crate::api::MoeApi;
use crate::config::ServeArgs;
use crate::infer::Infer;
use crate::inference::grpc_inference_service_server::GrpcInferenceServiceServer;
use crate::lifecycle::Abort;
use crate::metric_names;
use crate::proto::moe_service_server::MoeServiceServer;
use crate::request::Admission;
use crate::sched::Job;
use crate::transport::answer::Answers;
use crate::transport::bufs::Bufs;
use crate::transport::conn::ConnArgs;
use crate::transport::unary::{Limits, UnaryLayer};
use crate::transport::upload::Budget;
use crate::watchdog::Progress;

/// One rank's gRPC front: the request entry (admission, queue) behind both protocols, health and
/// reflection on the rank's own port, NOT_SERVING until the group is ready.
pub struct Front {
    pub infer: Arc<Infer>,
    pub api: Arc<MoeApi>,
    pub admission: Arc<Admission>,
    pub health: HealthReporter,
    /// Tells the batcher a waiting client left.
    pub wake: Arc<Notify>,
    pub addr: SocketAddr,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
    http_server: Option<tokio::task::JoinHandle<()>>,
    server_stop: CancellationToken,
}

impl Front {
    /// Binds --listen and serves there; returns the admitted jobs' queue, for the batcher.
    pub async fn start(
        args: &ServeArgs,
        p: &Prepared,
        abort: Arc<Abort>,
    ) -> anyhow::Result<(Self, mpsc::Receiver<Arc<Job>>)> {
        let admission = Admission::new(args.max_concurrent_requests, args.max_queued_tokens);
        let wake = Arc::new(Notify::new());
        let (job_tx, job_rx) = mpsc::channel(args.max_concurrent_requests);
        let info = super::prepare::model_info(p, args);
        let infer = Arc::new(Infer::new(
            Arc::new(p.spec.clone()),
            job_tx,
            admission.clone(),
            wake.clone(),
            abort,
        ));
        let api = Arc::new(MoeApi::new(infer.clone(), info, args.max_stream_in_flight));
        // CUDA shared memory where this rank has a GPU.
        let cuda = match p.backend {
            crate::config::BackendKind::Nccl | crate::config::BackendKind::NcclEp => {
                crate::backend::gpu::open_device()
            }
            b => Err(format!("the {} backend has no GPU", b.name())),
        };
        let kserve = Arc::new(KserveApi::new(
            infer.clone(),
            args.max_stream_in_flight,
            args.regions.clone(),
            cuda,
            args.max_request_bytes,
        ));
        let (health, health_service) = tonic_health::server::health_reporter();
        set_ready(&health, false).await;
        health
            .set_service_status(LIVENESS, ServingStatus::Serving)
            .await;
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding the gRPC address {}", args.listen))?;
        let addr = listener.local_addr()?;
        let server_stop = CancellationToken::new();
        let uploads = crate::transport::upload::Budget::new(&args.upload, args.max_request_bytes)
            .map_err(anyhow::Error::msg)?;
        let answers = crate::transport::answer::Answers::new(
            &args.answer,
            args.max_request_bytes,
            args.upload.upload_wait,
        )
        .map_err(anyhow::Error::msg)?;
        let rank = p.member.place.rank;
        let http_server =
            start_rest(args, &kserve, (&uploads, &answers), rank, &server_stop).await?;
        let server = tokio::spawn(serve_grpc(
            args.http2.clone(),
            args.conn.clone(),
            (uploads, answers),
            args.max_request_bytes,
            api.clone(),
            kserve,
            health_service,
            listener,
            server_stop.clone(),
        ));
        let front = Self {
            infer,
            api,
            admission,
            health,
            wake,
            addr,
            server,
            http_server,
            server_stop,
        };
        Ok((front, job_rx))
    }

    /// Liveness NOT_SERVING, refusals (with the reason) for `grace`, then the port closes.
    pub async fn close(self, grace: Duration) -> anyhow::Result<()> {
        self.infer.set_live(false);
        self.health
            .set_service_status(LIVENESS, ServingStatus::NotServing)
            .await;
        tokio::time::sleep(grace).await;
        self.close_now().await
    }

    /// Closes the port at once.
    pub async fn close_now(self) -> anyhow::Result<()> {
        self.server_stop.cancel();
        if let Some(h) = self.http_server {
            h.await?;
        }
        self.server.await?
    }
}

/// Health services: "" and each protocol's service are readiness; "liveness" follows the step
/// loop.
pub const LIVENESS: &str = "liveness";

pub async fn set_ready(health: &HealthReporter, ready: bool) {
    let status = if ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    health.set_service_status("", status).await;
    health
        .set_service_status(MoeServiceServer::<Arc<MoeApi>>::NAME, status)
        .await;
    health
        .set_service_status(GrpcInferenceServiceServer::<Arc<KserveApi>>::NAME, status)
        .await;
}

/// `liveness` is NOT_SERVING while one step has run longer than `limit` (a stuck rank or leader).
pub async fn watch_liveness(
    health: HealthReporter,
    infer: Arc<Infer>,
    progress: Arc<Progress>,
    limit: Duration,
) {
    let mut live = true;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = progress.running_for().is_none_or(|d| d <= limit);
        if now != live {
            live = now;
            let status = if live {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            if !live {
                warn!(
                    limit_seconds = limit.as_secs_f64(),
                    "a step has run longer than --liveness-timeout: liveness NOT_SERVING"
                );
            }
            infer.set_live(live);
            health.set_service_status(LIVENESS, status).await;
        }
    }
}

/// Binds --http-listen (before anything is served, so a taken port fails the start) and serves
/// KServe v2 REST and `/metrics` there until `stop`; None without --http-listen.
async fn start_rest(
    args: &ServeArgs,
    kserve: &Arc<KserveApi>,
    (uploads, answers): (&Arc<Budget>, &Arc<Answers>),
    rank: usize,
    stop: &CancellationToken,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(at) = args.http_listen.0 else {
        return Ok(None);
    };
    let listener = tokio::net::TcpListener::bind(at)
        .await
        .with_context(|| format!("binding the HTTP address {at} (--http-listen)"))?;
    let routes = crate::api::kserve::rest::routes(
        kserve.clone(),
        args.max_request_bytes,
        args.upload.upload_timeout,
    )
    .merge(crate::metrics::routes());
    let limits = crate::transport::http::Limits {
        conns: args.conn.clone(),
        uploads: Some(uploads.clone()),
        answers: Some(answers.clone()),
    };
    let bound = listener.local_addr()?;
    tracing::info!("rank {rank} KServe REST on http://{bound}/v2");
    Ok(Some(tokio::spawn(crate::transport::http::serve(
        listener,
        routes,
        limits,
        "HTTP",
        stop.clone(),
    ))))
}

/// Serves the gRPC services on `listener` until `stop`, then lets open calls finish (bounded).
#[allow(clippy::too_many_arguments)]
pub async fn serve_grpc(
    http2: crate::transport::Http2,
    conns: ConnArgs,
    (uploads, answers): (Arc<Budget>, Arc<Answers>),
    max_request_bytes: usize,
    api: Arc<MoeApi>,
    kserve: Arc<KserveApi>,
    health: HealthServer<impl tonic_health::pb::health_server::Health>,
    listener: tokio::net::TcpListener,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let routes = grpc_routes(max_request_bytes, uploads.timeout, api, kserve, health)?;
    crate::transport::accept::serve_connections(
        routes, http2, conns, uploads, answers, listener, stop,
    )
    .await;
    Ok(())
}

/// Every gRPC service this rank answers (epserve.v1, KServe v2, health, reflection), each unary
/// call framed by `api::unary` within the request limits; a name no service has is refused by
/// `unknown`.
fn grpc_routes(
    max_request_bytes: usize,
    read_timeout: Duration,
    api: Arc<MoeApi>,
    kserve: Arc<KserveApi>,
    health: HealthServer<impl tonic_health::pb::health_server::Health>,
) -> anyhow::Result<super::unknown::NameUnknown<tonic::service::Routes>> {
    use tonic::codec::CompressionEncoding::{Deflate, Gzip};
    use tower::Layer;
    // Reflection v1 and v1alpha (grpcurl before 1.8.8 and Python's grpcio-reflection ask v1alpha),
    // each listing both.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .include_reflection_service(false)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(
                tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
            )
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(crate::inference::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_alpha = reflection()
        .build_v1alpha()?
        .accept_compressed(Gzip)
        .accept_compressed(Deflate);
    let reflection = reflection()
        .build_v1()?
        .accept_compressed(Gzip)
        .accept_compressed(Deflate);
    let health = health.accept_compressed(Gzip).accept_compressed(Deflate);
    // An answer is at most twice its request (f32 out of bf16 in).
    let max_response = max_request_bytes.saturating_mul(2);
    // The unary calls' own framing, with the limits tonic's services have. Unused request
    // buffers are kept up to four of the largest requests, and 256 MiB.
    let unary = Limits {
        max_request: max_request_bytes,
        max_response,
        read_timeout,
        bufs: Bufs::new(
            max_request_bytes.saturating_mul(4).min(256 << 20),
            metric_names::REQUEST_BUFFERS_REUSED_TOTAL,
        ),
    };
    let moe = UnaryLayer::new(Forward(api.clone()), unary.clone()).layer(
        MoeServiceServer::new(api)
            .accept_compressed(Gzip)
            .accept_compressed(Deflate)
            .max_decoding_message_size(max_request_bytes)
            .max_encoding_message_size(max_response),
    );
    let kserve = UnaryLayer::new(ModelInfer(kserve.clone()), unary).layer(
        GrpcInferenceServiceServer::new(kserve)
            .accept_compressed(Gzip)
            .accept_compressed(Deflate)
            .max_decoding_message_size(max_request_bytes)
            .max_encoding_message_size(max_response),
    );
    let served = [
        MoeServiceServer::<Arc<MoeApi>>::NAME,
        GrpcInferenceServiceServer::<Arc<KserveApi>>::NAME,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ];
    let routes = tonic::service::Routes::new(health)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(moe)
        .add_service(kserve)
        .prepare();
    Ok(super::unknown::NameUnknown::new(routes, &served))
}
