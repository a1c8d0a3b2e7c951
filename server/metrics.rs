//! Prometheus metrics: names carry their units, histograms have explicit buckets, and every rank
//! serves its own `/metrics` so a PodMonitor can scrape all of them.

use std::net::SocketAddr;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing::info;

const SECONDS: &[f64] = &[
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    500e-3, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const TOKENS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0, 65536.0,
];

/// Installs the global recorder; call once per process.
pub fn install() -> anyhow::Result<()> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS)?
        .set_buckets_for_metric(Matcher::Suffix("_tokens".into()), TOKENS)?
        .install_recorder()?;
    metrics::describe_counter!(
        "epserve_requests_total",
        "Requests answered, by method and gRPC status"
    );
    metrics::describe_histogram!(
        "epserve_request_duration_seconds",
        "Request latency at the gRPC front"
    );
    metrics::describe_histogram!(
        "epserve_request_queue_seconds",
        "Time from admission to the request's first step"
    );
    metrics::describe_histogram!(
        "epserve_request_in_step_seconds",
        "Time from the request's first step to its answer"
    );
    metrics::describe_counter!(
        "epserve_request_tokens_total",
        "Tokens of requests answered OK"
    );
    metrics::describe_counter!(
        "epserve_ingress_bytes_total",
        "Hidden-state bytes of requests queued, in their wire dtype"
    );
    metrics::describe_counter!(
        "epserve_egress_bytes_total",
        "Output bytes of requests answered, in their wire dtype"
    );
    metrics::describe_counter!("epserve_rejections_total", "Requests refused, by reason");
    metrics::describe_counter!(
        "epserve_cross_node_bytes_total",
        "Bytes this rank sent to ranks of other nodes over its data connections"
    );
    metrics::describe_gauge!(
        crate::transport::upload::UPLOAD_BYTES,
        "Bytes charged to the upload budget by request messages being read"
    );
    metrics::gauge!(crate::transport::upload::UPLOAD_BYTES).set(0.0);
    metrics::describe_gauge!("epserve_queue_requests", "Requests waiting for a step");
    metrics::describe_gauge!("epserve_queue_tokens", "Tokens waiting for a step");
    metrics::describe_gauge!(
        "epserve_steps_in_flight",
        "Steps formed and not yet delivered (packed, running or being answered), router only"
    );
    metrics::describe_gauge!(
        "epserve_offers_pending",
        "--ingress all: this rank's packed offers not yet taken into a step"
    );
    metrics::describe_counter!(
        "epserve_steps_total",
        "Steps run on this rank (kind: work or heartbeat)"
    );
    metrics::describe_histogram!("epserve_step_tokens", "Tokens per step, all ranks together");
    metrics::describe_counter!(
        "epserve_step_tokens_total",
        "Tokens through steps, by layer"
    );
    metrics::describe_counter!(
        "epserve_step_padding_tokens_total",
        "Padding tokens added to steps (graph buckets)"
    );
    metrics::describe_histogram!(
        "epserve_step_duration_seconds",
        "Whole step on this rank, from its start (or the step before's end, when it was queued \
         behind it) to its end: the sum is the time the rank was busy"
    );
    metrics::describe_counter!(
        "epserve_steps_submitted_ahead_total",
        "Steps this rank started while the step before was still running (--steps-ahead)"
    );
    metrics::describe_counter!(
        crate::sched::PARTIAL_STEPS_BEHIND,
        "Router: partial steps formed while another step was in the pipeline, just in time for \
         the ranks"
    );
    metrics::describe_histogram!("epserve_step_phase_seconds", "Step phases on this rank");
    metrics::describe_histogram!(
        crate::sched::PACK_SECONDS,
        "A step's input rows copied from its requests into the step ring"
    );
    metrics::describe_histogram!(
        crate::sched::DELIVER_SECONDS,
        "A finished step's output rows copied from the step ring to its requests"
    );
    metrics::describe_counter!(
        crate::transport::bufs::OUTPUT_BUFFERS_REUSED,
        "Answers of 1 MiB or more written into a buffer kept from an earlier answer"
    );
    metrics::describe_counter!(
        crate::transport::bufs::REQUEST_BUFFERS_REUSED,
        "Unary requests of 1 MiB or more read into a buffer kept from an earlier request"
    );
    metrics::describe_histogram!(
        "epserve_rank_received_tokens",
        "Token rows this rank received per step"
    );
    metrics::describe_gauge!(
        "epserve_expert_balance_ratio",
        "Last step: mean/max tokens per rank (1 = balanced)"
    );
    metrics::describe_gauge!(
        "epserve_expert_skew_ratio",
        "Last step: max/mean tokens per expert (1 = balanced)"
    );
    metrics::describe_counter!(
        "epserve_expert_tokens_total",
        "Token rows per local expert (--metrics-per-expert)"
    );
    metrics::describe_gauge!("epserve_group_info", "The EP group this rank belongs to");
    metrics::describe_counter!(
        "epserve_ep_steps_total",
        "nccl-ep steps on this rank, by mode (ll, ht)"
    );
    metrics::describe_gauge!(
        "epserve_ep_recv_rows",
        "nccl-ep: rows this rank's experts received in the last step (HT: padded), by mode"
    );
    metrics::describe_counter!(
        "epserve_ep_recv_overflow_total",
        "nccl-ep steps that received past the group's capacity (never, by construction)"
    );
    metrics::describe_counter!(
        "epserve_ep_recv_mismatch_total",
        "nccl-ep steps whose received rows differ from what the routing sent"
    );
    metrics::describe_counter!(
        "epserve_device_allocations_total",
        "Device allocations by the GPU backend (all made at startup)"
    );
    metrics::describe_gauge!(
        "epserve_device_memory_used_bytes",
        "Memory in use on this rank's GPU after the last step (whole device)"
    );
    metrics::describe_gauge!("epserve_build_info", "Build of this binary");
    gauge!("epserve_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    metrics::describe_counter!(
        crate::api::kserve::regions::SHM_TENSORS,
        "KServe tensors read from (in) or written to (out) a client's shared-memory region"
    );
    metrics::describe_counter!(
        crate::api::kserve::regions::SHM_BYTES,
        "Bytes read from (in) or written to (out) clients' shared-memory regions"
    );
    metrics::describe_gauge!(
        "epserve_admitted_requests",
        "Requests admitted and not yet finished (running or queued)"
    );
    metrics::describe_gauge!(
        "epserve_admitted_tokens",
        "Tokens of the requests admitted and not yet finished"
    );
    metrics::describe_gauge!(
        "epserve_limit_max_concurrent_requests",
        "--max-concurrent-requests, for alerts as a ratio"
    );
    metrics::describe_gauge!(
        "epserve_limit_max_queued_tokens",
        "--max-queued-tokens, for alerts as a ratio"
    );
    metrics::describe_gauge!(
        crate::sched::REQUESTS_RUNNING,
        "Requests with rows in a step and not yet answered"
    );
    metrics::describe_gauge!(
        crate::startup::STAGE,
        "1 for the startup stage this rank is in (load, rendezvous, bringup, warmup, ready)"
    );
    metrics::describe_gauge!(
        crate::startup::SECONDS,
        "Seconds each finished startup stage took"
    );
    zero_series();
    let process = metrics_process::Collector::default();
    process.describe();
    let _ = PROCESS.set(process);
    let _ = HANDLE.set(handle);
    Ok(())
}

/// process_* metrics (CPU seconds, memory, open files), collected at each scrape.
static PROCESS: std::sync::OnceLock<metrics_process::Collector> = std::sync::OnceLock::new();

/// Every known label value of the labelled counters, at 0 from start: a series an alert or a
/// dashboard names exists before its first event.
fn zero_series() {
    for &reason in crate::rejections::REJECTION_REASONS {
        counter!("epserve_rejections_total", "reason" => reason).increment(0);
    }
    for &method in crate::api::METHODS {
        for &status in crate::api::STATUSES {
            counter!("epserve_requests_total", "method" => method, "status" => status).increment(0);
        }
    }
    for kind in ["work", "heartbeat"] {
        counter!("epserve_steps_total", "kind" => kind).increment(0);
    }
    for direction in ["in", "out"] {
        counter!(crate::api::kserve::regions::SHM_TENSORS, "direction" => direction).increment(0);
        counter!(crate::api::kserve::regions::SHM_BYTES, "direction" => direction).increment(0);
    }
    for name in [
        "epserve_request_tokens_total",
        "epserve_ingress_bytes_total",
        "epserve_egress_bytes_total",
        "epserve_step_padding_tokens_total",
        "epserve_steps_submitted_ahead_total",
        crate::sched::PARTIAL_STEPS_BEHIND,
    ] {
        counter!(name).increment(0);
    }
    gauge!("epserve_admitted_requests").set(0.0);
    gauge!("epserve_admitted_tokens").set(0.0);
    gauge!(crate::sched::REQUESTS_RUNNING).set(0.0);
    crate::startup::zero_series();
    // Histograms the dashboard and alerts name, empty until their first value.
    for &method in crate::api::METHODS {
        let _ = histogram!("epserve_request_duration_seconds", "method" => method);
    }
    for name in [
        "epserve_request_queue_seconds",
        "epserve_request_in_step_seconds",
        "epserve_step_duration_seconds",
    ] {
        let _ = histogram!(name);
    }
}

/// `--metrics-per-expert`: each of this rank's experts on every layer at 0 from start.
pub fn zero_expert_series(layers: &[u32], experts: std::ops::Range<usize>) {
    for layer in layers {
        for e in experts.clone() {
            counter!("epserve_expert_tokens_total", "layer" => layer.to_string(), "expert" => e.to_string())
                .increment(0);
        }
    }
}

/// The exporter, for every port that serves `/metrics` (set by `install`).
static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();

/// The Prometheus text of this process's metrics, `process_*` collected now.
fn render() -> String {
    if let Some(p) = PROCESS.get() {
        p.collect();
    }
    HANDLE.get().map(|h| h.render()).unwrap_or_default()
}

/// `GET /metrics`, for any HTTP port to serve.
pub fn routes() -> axum::Router {
    use axum::http::header::CONTENT_TYPE;
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(|| async { ([(CONTENT_TYPE, "text/plain; version=0.0.4")], render()) }),
    )
}

/// Binds `addr` and serves `/metrics` there (idle connections closed as `conns` says);
/// returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    conns: crate::transport::conn::ConnArgs,
    rank: usize,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding the metrics address {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    info!("rank {rank} metrics on http://{bound}/metrics");
    let limits = crate::transport::http::Limits {
        conns,
        uploads: None,
    };
    let routes =
        routes().fallback(|| async { (axum::http::StatusCode::NOT_FOUND, "try /metrics\n") });
    tokio::spawn(crate::transport::http::serve(
        listener,
        routes,
        limits,
        "metrics",
        tokio_util::sync::CancellationToken::new(),
    ));
    Ok(bound)
}
