//! Logs and traces: `tracing` to stderr as text or JSON; optional OTLP trace export
//! (`--otlp-endpoint`); W3C trace context read from gRPC metadata.

use std::io::IsTerminal;

use opentelemetry::propagation::Extractor;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::LogFormat;

/// Flushes and stops trace export when dropped (at the end of `main`).
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// The OTLP exporter's connection lives on this runtime: the SDK's batch thread cannot drive
    /// tonic's I/O by itself.
    _runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("OTLP trace export did not shut down cleanly: {e}");
            }
        }
    }
}

/// Installs the global subscriber; `otlp` is a collector's gRPC endpoint (http://host:4317).
pub fn init(format: LogFormat, otlp: Option<&str>, role: &str) -> anyhow::Result<Telemetry> {
    let filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let stderr = std::io::stderr;
    let fmt = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(stderr)
            .boxed(),
    };
    let mut telemetry = Telemetry {
        provider: None,
        _runtime: None,
    };
    let otel = match otlp {
        None => None,
        Some(endpoint) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("otlp")
                .enable_all()
                .build()?;
            let exporter = {
                let _inside = runtime.enter();
                opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint)
                    .build()?
            };
            let resource = Resource::builder()
                .with_service_name("epserve")
                .with_attribute(KeyValue::new("epserve.role", role.to_string()))
                .build();
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build();
            let tracer = provider.tracer("epserve");
            telemetry.provider = Some(provider);
            telemetry._runtime = Some(runtime);
            // The exporter's own transport must not trace into itself.
            let quiet =
                EnvFilter::new("info,h2=off,hyper=off,tonic=off,tower=off,opentelemetry=off");
            Some(
                tracing_opentelemetry::layer()
                    .with_tracer(tracer)
                    .with_filter(quiet),
            )
        }
    };
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter()))
        .with(otel)
        .try_init()?;
    Ok(telemetry)
}

/// Reads `traceparent`/`tracestate` from gRPC metadata.
struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// The caller's trace context (W3C), to parent the request's span.
pub fn remote_context(meta: &tonic::metadata::MetadataMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&Metadata(meta)))
}
