//! Prometheus metrics: names carry their units, histograms have explicit buckets, and every rank
//! serves its own `/metrics` so a PodMonitor can scrape all of them.

use std::net::SocketAddr;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing::info;

use crate::metric_names::{self, Kind};

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
    // Every metric described from the table, so HELP and README say the same.
    for m in metric_names::TABLE {
        match m.kind {
            Kind::Counter => metrics::describe_counter!(m.name, m.help),
            Kind::Gauge => metrics::describe_gauge!(m.name, m.help),
            Kind::Histogram => metrics::describe_histogram!(m.name, m.help),
        }
    }
    gauge!(metric_names::UPLOAD_BYTES).set(0.0);
    gauge!(metric_names::ANSWER_BYTES).set(0.0);
    gauge!(metric_names::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
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
        counter!(metric_names::REJECTIONS_TOTAL, "reason" => reason).increment(0);
    }
    for &method in crate::api::METHODS {
        for &status in crate::api::STATUSES {
            counter!(metric_names::REQUESTS_TOTAL, "method" => method, "status" => status)
                .increment(0);
        }
    }
    for kind in ["work", "heartbeat"] {
        counter!(metric_names::STEPS_TOTAL, "kind" => kind).increment(0);
    }
    for direction in ["in", "out"] {
        counter!(metric_names::SHM_TENSORS_TOTAL, "direction" => direction).increment(0);
        counter!(metric_names::SHM_BYTES_TOTAL, "direction" => direction).increment(0);
    }
    for name in [
        metric_names::REQUEST_TOKENS_TOTAL,
        metric_names::INGRESS_BYTES_TOTAL,
        metric_names::EGRESS_BYTES_TOTAL,
        metric_names::STEP_PADDING_TOKENS_TOTAL,
        metric_names::STEPS_SUBMITTED_AHEAD_TOTAL,
        metric_names::PARTIAL_STEPS_BEHIND_TOTAL,
    ] {
        counter!(name).increment(0);
    }
    gauge!(metric_names::ADMITTED_REQUESTS).set(0.0);
    gauge!(metric_names::ADMITTED_TOKENS).set(0.0);
    gauge!(metric_names::REQUESTS_RUNNING).set(0.0);
    crate::startup::zero_series();
    // Histograms the dashboard and alerts name, empty until their first value.
    for &method in crate::api::METHODS {
        let _ = histogram!(metric_names::REQUEST_DURATION_SECONDS, "method" => method);
    }
    for name in [
        metric_names::REQUEST_QUEUE_SECONDS,
        metric_names::REQUEST_IN_STEP_SECONDS,
        metric_names::STEP_DURATION_SECONDS,
    ] {
        let _ = histogram!(name);
    }
}

/// `--metrics-per-expert`: each of this rank's experts on every layer at 0 from start.
pub fn zero_expert_series(layers: &[u32], experts: &[Vec<usize>]) {
    for (layer, mine) in layers.iter().zip(experts) {
        for e in mine {
            counter!(metric_names::EXPERT_TOKENS_TOTAL, "layer" => layer.to_string(), "expert" => e.to_string())
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
    let text = HANDLE.get().map(|h| h.render()).unwrap_or_default();
    match metrics_process::collector::collect().cpu_seconds_total {
        Some(cpu) => with_cpu_seconds(text, cpu),
        None => text,
    }
}

/// `process_cpu_seconds_total` as Prometheus' own clients give it, in fractions of a second:
/// metrics-process sets it through a u64 counter, whole seconds, which a rate over a minute of
/// a rank using half a core reads as steps of 0 and 1/60. The sample is replaced in place, so
/// that it stays under its HELP and TYPE lines.
fn with_cpu_seconds(text: String, cpu: f64) -> String {
    const NAME: &str = "process_cpu_seconds_total ";
    let mut out = String::with_capacity(text.len() + 16);
    for line in text.lines() {
        match line.starts_with(NAME) {
            true => out.push_str(&format!("{NAME}{cpu}")),
            false => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// The leader's expert placement and load as JSON (`/eplb`), set once the group forms.
type Status = Box<dyn Fn() -> String + Send + Sync>;
static EPLB: std::sync::OnceLock<Status> = std::sync::OnceLock::new();

/// What `/eplb` answers on this process (rank 0).
pub fn set_eplb_status(f: Status) {
    let _ = EPLB.set(f);
}

/// `GET /metrics`, and on rank 0 `GET /eplb` (read-only), for any HTTP port to serve.
pub fn routes() -> axum::Router {
    use axum::http::header::CONTENT_TYPE;
    axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(|| async {
                ([(CONTENT_TYPE, "text/plain; version=0.0.4")], render())
            }),
        )
        .route(
            "/eplb",
            axum::routing::get(|| async {
                match EPLB.get() {
                    Some(f) => Ok(([(CONTENT_TYPE, "application/json")], f())),
                    None => Err((
                        axum::http::StatusCode::NOT_FOUND,
                        "the placement is served by rank 0, once the group has formed\n",
                    )),
                }
            }),
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
        answers: None,
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

#[cfg(test)]
mod cpu_tests {
    #[test]
    fn cpu_seconds_keep_their_fraction_and_their_place() {
        let text = "# HELP process_cpu_seconds_total cpu\n# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3\nprocess_open_fds 9\n";
        let got = super::with_cpu_seconds(text.into(), 3.27);
        assert_eq!(
            got,
            "# HELP process_cpu_seconds_total cpu\n# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.27\nprocess_open_fds 9\n"
        );
    }
}
