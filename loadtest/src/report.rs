//! The figures of one run: a table on stdout, JSON on request.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::Ordering;

use serde::Serialize;

use crate::config::Api;
use crate::record::{Mode, Parts, Plan, Recorder};

#[derive(Clone, Debug, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub target: String,
    pub api: Api,
    /// "closed" or "open".
    pub mode: &'static str,
    pub concurrency: Option<usize>,
    pub offered_rate: Option<f64>,
    pub duration_s: f64,
    /// Requests started in the window; equals the sum of `statuses`.
    pub sent: u64,
    /// Open loop: arrivals not sent because --max-in-flight was reached.
    pub not_sent: u64,
    pub statuses: BTreeMap<String, u64>,
    pub ok: u64,
    /// Requests started per second (the achieved offered rate).
    pub sent_per_s: f64,
    /// Throughput: OK answers that arrived inside the window, per second.
    pub requests_per_s: f64,
    pub tokens_per_s: f64,
    pub gb_per_s_out: f64,
    pub gb_per_s_in: f64,
    /// Of OK requests, milliseconds.
    pub latency_ms: Latency,
}

impl Report {
    pub fn new(rec: &Recorder, plan: &Plan, target: &str, p: &Parts) -> Self {
        let secs = plan.duration.as_secs_f64();
        let ms = |q: f64| p.hist.value_at_quantile(q) as f64 / 1000.0;
        let ok = p.statuses.get("OK").copied().unwrap_or(0);
        let sent = rec.sent.load(Ordering::Relaxed);
        let (mode, concurrency, offered_rate) = match plan.mode {
            Mode::Closed(n) => ("closed", Some(n), None),
            Mode::Open(r) => ("open", None, Some(r)),
        };
        Self {
            target: target.to_string(),
            api: plan.api,
            mode,
            concurrency,
            offered_rate,
            duration_s: secs,
            sent,
            not_sent: rec.not_sent.load(Ordering::Relaxed),
            statuses: p.statuses.clone(),
            ok,
            sent_per_s: sent as f64 / secs,
            requests_per_s: p.completed as f64 / secs,
            tokens_per_s: p.completed_tokens as f64 / secs,
            gb_per_s_out: p.bytes_out as f64 / secs / 1e9,
            gb_per_s_in: p.bytes_in as f64 / secs / 1e9,
            latency_ms: Latency {
                p50: ms(0.5),
                p90: ms(0.9),
                p99: ms(0.99),
                p999: ms(0.999),
                max: p.hist.max() as f64 / 1000.0,
                mean: p.hist.mean() / 1000.0,
            },
        }
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let load = match (self.concurrency, self.offered_rate) {
            (Some(n), _) => format!("closed loop, {n} clients"),
            (_, Some(r)) => format!("open loop, {r} req/s offered"),
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "target {} ({:?}), {load}, {:.1} s measured",
            self.target, self.api, self.duration_s
        );
        let _ = writeln!(
            s,
            "  sent        {:>10}   ({:.1}/s; not sent at the in-flight cap: {})",
            self.sent, self.sent_per_s, self.not_sent
        );
        for (k, v) in &self.statuses {
            let _ = writeln!(s, "  {k:<11} {v:>10}");
        }
        let _ = writeln!(s, "  requests/s  {:>10.1}", self.requests_per_s);
        let _ = writeln!(s, "  tokens/s    {:>10.1}", self.tokens_per_s);
        let _ = writeln!(
            s,
            "  GB/s out/in {:>10.4} / {:.4}",
            self.gb_per_s_out, self.gb_per_s_in
        );
        let l = &self.latency_ms;
        let _ = writeln!(
            s,
            "  latency ms  p50 {:.3}  p90 {:.3}  p99 {:.3}  p99.9 {:.3}  max {:.3}  mean {:.3}",
            l.p50, l.p90, l.p99, l.p999, l.max, l.mean
        );
        s
    }
}

/// The target as a fraction of the bare transport, measured in the same run.
#[derive(Debug, Serialize)]
pub struct Comparison {
    pub service: Report,
    /// What the service is compared with: "echo", or the other API (--compare-api).
    pub versus: String,
    pub echo: Report,
    pub requests_per_s_ratio: f64,
    pub p50_latency_ratio: f64,
    pub p99_latency_ratio: f64,
}

impl Comparison {
    pub fn new(service: Report, echo: Report) -> Self {
        Self::versus(service, echo, "echo".into())
    }

    pub fn versus(service: Report, echo: Report, versus: String) -> Self {
        let div = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        Self {
            versus,
            requests_per_s_ratio: div(service.requests_per_s, echo.requests_per_s),
            p50_latency_ratio: div(service.latency_ms.p50, echo.latency_ms.p50),
            p99_latency_ratio: div(service.latency_ms.p99, echo.latency_ms.p99),
            service,
            echo,
        }
    }
    pub fn table(&self) -> String {
        format!(
            "{}\n{}\n{:?} / {}: throughput {:.3}x, p50 latency {:.2}x, p99 latency {:.2}x\n",
            self.service.table(),
            self.echo.table(),
            self.service.api,
            self.versus,
            self.requests_per_s_ratio,
            self.p50_latency_ratio,
            self.p99_latency_ratio
        )
    }
}
