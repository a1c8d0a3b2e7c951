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
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// `--log-format`: lines for people, or one JSON object a line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

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

/// Who writes each line, on every event: `launch` interleaves its ranks on one stderr, and a
/// cluster's log store mixes pods. Text lines start `rank=R node=H `; JSON objects gain `rank`
/// and `node` keys.
pub struct Ranked<F> {
    inner: F,
    rank: Option<usize>,
    node: String,
    json: bool,
}

impl<F> Ranked<F> {
    pub fn new(inner: F, rank: Option<usize>, node: String, json: bool) -> Self {
        Self {
            inner,
            rank,
            node,
            json,
        }
    }
}

impl<S, N, F> FormatEvent<S, N> for Ranked<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let Some(rank) = self.rank else {
            return self.inner.format_event(ctx, writer, event);
        };
        if !self.json {
            write!(writer, "rank={rank} node={} ", self.node)?;
            return self.inner.format_event(ctx, writer, event);
        }
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        match line.strip_prefix('{') {
            Some(rest) => {
                let node = serde_json::Value::from(self.node.as_str());
                write!(writer, "{{\"rank\":{rank},\"node\":{node},{rest}")
            }
            None => writer.write_str(&line),
        }
    }
}

/// This host's name (the pod's, in Kubernetes): the default `--node-id`.
pub fn node_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown".into())
}

/// Installs the global subscriber; `otlp` is a collector's gRPC endpoint (http://host:4317);
/// `rank`: the rank this process serves as, and `node` its node (else the host's name), named on
/// every line.
pub fn init(
    format: LogFormat,
    otlp: Option<&str>,
    role: &str,
    rank: Option<usize>,
    node: Option<String>,
) -> anyhow::Result<Telemetry> {
    let filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let stderr = std::io::stderr;
    let node = node.unwrap_or_else(node_name);
    let fmt = match format {
        LogFormat::Text => {
            let f = tracing_subscriber::fmt::format();
            tracing_subscriber::fmt::layer()
                .with_writer(stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .event_format(Ranked::new(f, rank, node, false))
                .boxed()
        }
        LogFormat::Json => {
            let f = tracing_subscriber::fmt::format().json().flatten_event(true);
            tracing_subscriber::fmt::layer()
                .json()
                .with_writer(stderr)
                .event_format(Ranked::new(f, rank, node, true))
                .boxed()
        }
    };
    let mut telemetry = Telemetry {
        provider: None,
        _runtime: None,
    };
    // OpenTelemetry's own variables where the flag is not given (an operator's standard setup).
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let otlp = otlp
        .map(str::to_string)
        .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"));
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
            // The builder reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; "epserve" only
            // where they name no service.
            let mut resource = Resource::builder();
            if env("OTEL_SERVICE_NAME").is_none() {
                resource = resource.with_service_name("epserve");
            }
            let resource = resource
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::Ranked;

    /// Lines written by the subscriber, kept.
    #[derive(Clone, Default)]
    struct Kept(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Kept {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(json: bool, rank: Option<usize>) -> String {
        let kept = Kept::default();
        let out = kept.clone();
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer(move || out.clone());
        let subscriber: Box<dyn tracing::Subscriber + Send + Sync> = match json {
            true => {
                let f = tracing_subscriber::fmt::format().json().flatten_event(true);
                let l = layer
                    .json()
                    .event_format(Ranked::new(f, rank, "h\"1".into(), true));
                Box::new(tracing_subscriber::registry().with(l))
            }
            false => {
                let f = tracing_subscriber::fmt::format();
                let l = layer.event_format(Ranked::new(f, rank, "h\"1".into(), false));
                Box::new(tracing_subscriber::registry().with(l))
            }
        };
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(seconds = 1.5, "weights loaded");
        });
        let bytes = kept.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn every_line_names_its_rank_and_node() {
        let text = logged(false, Some(3));
        assert!(text.starts_with("rank=3 node=h\"1 "), "{text}");
        assert!(text.contains("weights loaded seconds=1.5"), "{text}");
        let json = logged(true, Some(3));
        let v: serde_json::Value = serde_json::from_str(json.trim()).expect(&json);
        assert_eq!(v["rank"], 3, "{json}");
        assert_eq!(v["node"], "h\"1", "{json}");
        // The event's fields at the top level, beside rank, node and level (#58: nested under
        // `fields`, a log store indexed none of them).
        assert_eq!(v["message"], "weights loaded", "{json}");
        assert_eq!(v["seconds"], 1.5, "{json}");
        assert!(v.get("fields").is_none(), "{json}");
        // No rank (launch, bench): the line as the formatter writes it.
        let v: serde_json::Value = serde_json::from_str(logged(true, None).trim()).unwrap();
        assert!(v.get("rank").is_none() && v["level"] == "INFO");
        assert!(!logged(false, None).contains("rank="));
    }
}
