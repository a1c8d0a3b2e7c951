//! Traces reach an OTLP collector under the caller's W3C trace id; JSON logs are JSON.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

/// A received span: trace id (hex), name, attribute keys, its resource's service.name.
type Span = (String, String, Vec<String>, String);

/// A collector that keeps every span it is sent.
#[derive(Default, Clone)]
struct Collector(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            let service = (rs.resource.iter().flat_map(|r| &r.attributes))
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref()?.value.clone())
                .map(|v| format!("{v:?}"))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let id: String = s.trace_id.iter().map(|b| format!("{b:02x}")).collect();
                    spans.push((
                        id,
                        s.name,
                        s.attributes.into_iter().map(|a| a.key).collect(),
                        service.clone(),
                    ));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// With `--otlp-endpoint`, as service "epserve"; with only OpenTelemetry's own variables
/// (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME), there and under that name (#58: they were
/// ignored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_spans_reach_the_collector_under_the_callers_trace() {
    for standard in [false, true] {
        spans_reach_the_collector(standard).await;
    }
}

async fn spans_reach_the_collector(standard: bool) {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = format!("http://{}", listener.local_addr().unwrap());
    let svc = TraceServiceServer::new(collector.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    // The exporter batches every OTEL_BSP_SCHEDULE_DELAY ms (an SDK variable): short, for the test.
    let (flags, env, service): (&[&str], Vec<(&str, &str)>, &str) = match standard {
        false => (&["--otlp-endpoint", &otlp], vec![], "epserve"),
        true => (
            &[],
            vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp),
                ("OTEL_SERVICE_NAME", "ffn-pool"),
            ],
            "ffn-pool",
        ),
    };
    let mut env = env;
    env.push(("OTEL_BSP_SCHEDULE_DELAY", "100"));
    let group = Group::launch_env(1, "synthetic:tiny", flags, &env);
    let mut c = group.client().await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut r = tonic::Request::new(request("traced-1", 0, f32_tensor(&[0.25; 64], [1, 64])));
    r.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-00f067aa0ba902b7-01")
            .parse()
            .unwrap(),
    );
    c.forward(r).await.unwrap();
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        let spans = collector.0.lock().unwrap().clone();
        let mine: Vec<_> = spans
            .iter()
            .filter(|(id, name, _, _)| id == trace_id && name == "request")
            .collect();
        if let Some((_, _, attrs, svc)) = mine.first() {
            assert!(attrs.iter().any(|a| a == "request_id"), "{attrs:?}");
            assert!(svc.contains(&format!("{service:?}")), "service {svc}");
            assert!(
                spans.iter().any(|(_, name, _, _)| name == "step"),
                "step spans are exported too"
            );
            break;
        }
        assert!(
            Instant::now() < end,
            "no request span under trace {trace_id}; got {spans:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn json_logs_are_one_object_per_line() {
    let group = Group::launch(1, "synthetic:tiny", &["--log-format", "json"]);
    let log = group.proc.log_text();
    let mut n = 0;
    for line in log.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v.get("level").is_some() && v.get("message").is_some() && v.get("fields").is_none(),
            "{line}"
        );
        n += 1;
    }
    assert!(n >= 3, "{log}");
}
