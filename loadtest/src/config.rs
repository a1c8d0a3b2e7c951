//! Flags, validated at start.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{Parser, ValueEnum};

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("'{s}': {e} (write e.g. 2s, 500ms)"))
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// One `Forward` call per request.
    Unary,
    /// Requests multiplexed over long-lived `ForwardStream` calls.
    Stream,
    /// One KServe v2 `ModelInfer` call per request (model `layer-<L>`).
    Kserve,
    /// Requests multiplexed over long-lived KServe v2 `ModelStreamInfer` calls.
    KserveStream,
    /// One KServe v2 `ModelInfer` call per request with the hidden states and the output in
    /// system shared memory (POSIX objects under /dev/shm, registered once; same host only).
    KserveShm,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    F32,
}

impl Dtype {
    pub fn bytes(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }
}

/// Tokens per request: `N`, `uniform:A-B` or `exp:MEAN` (at least 1).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub enum Tokens {
    Fixed(usize),
    Uniform(usize, usize),
    Exp(f64),
}

impl FromStr for Tokens {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("'{s}': write N, uniform:A-B or exp:MEAN");
        if let Some(r) = s.strip_prefix("uniform:") {
            let (a, b) = r.split_once('-').ok_or_else(bad)?;
            let (a, b) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
            if a == 0 || a > b {
                return Err(format!("'{s}': need 1 <= A <= B"));
            }
            return Ok(Tokens::Uniform(a, b));
        }
        if let Some(m) = s.strip_prefix("exp:") {
            let m: f64 = m.parse().map_err(|_| bad())?;
            if m < 1.0 {
                return Err(format!("'{s}': the mean must be at least 1"));
            }
            return Ok(Tokens::Exp(m));
        }
        match s.parse() {
            Ok(n) if n > 0 => Ok(Tokens::Fixed(n)),
            _ => Err(bad()),
        }
    }
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "epserve-loadtest",
    version,
    about = "gRPC load generator for epserve"
)]
pub struct Args {
    /// HTTP/2 settings of the client and of the echo started here (epserve's own flags; give the
    /// service the same ones).
    #[command(flatten)]
    pub http2: epserve::transport::Http2,
    /// The service to load, HOST:PORT (epserve's leader, or an echo service), or several
    /// comma-separated (the ranks of --ingress all): the load is spread evenly over them.
    #[arg(long, env = "LOADTEST_TARGET")]
    pub target: Option<String>,
    /// Closed loop: this many clients, each with one request outstanding.
    #[arg(long, conflicts_with = "rate")]
    pub concurrency: Option<usize>,
    /// Open loop: Poisson arrivals at this many requests per second, whatever the latency.
    #[arg(long)]
    pub rate: Option<f64>,
    /// How each request reaches the service.
    #[arg(long, value_enum, default_value = "unary")]
    pub api: Api,
    /// Tokens per request: N, uniform:A-B or exp:MEAN.
    #[arg(long, default_value = "16")]
    pub tokens: Tokens,
    /// The hidden states' dtype on the wire (the answer comes back in it).
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: Dtype,
    /// Send random top-k routing with each request (skips the server's gating).
    #[arg(long)]
    pub client_routing: bool,
    /// The model layer to load (default: the first MoE layer).
    #[arg(long)]
    pub layer: Option<u32>,
    /// Skewed load: expert popularity follows a Zipf law of this exponent (0: even), the most
    /// popular experts first (the first rank's block under contiguous placement). Hidden states
    /// are pulled towards a drawn expert through --skew-model's gate; with --client-routing the
    /// ids are drawn so.
    #[arg(long)]
    pub skew: Option<f64>,
    /// The model the target serves (its --model), for --skew's hidden states: its router of
    /// --layer is read here.
    #[arg(long)]
    pub skew_model: Option<String>,
    /// --skew-model's --seed (synthetic models).
    #[arg(long, default_value_t = 0)]
    pub skew_model_seed: u64,
    /// Requests started in this first stretch are not counted.
    #[arg(long, default_value = "2s", value_parser = duration)]
    pub warmup: Duration,
    /// Measured stretch after the warm-up.
    #[arg(long, default_value = "10s", value_parser = duration)]
    pub duration: Duration,
    /// Per-request deadline (sent as grpc-timeout).
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub timeout: Duration,
    /// HTTP/2 connections to spread the load over, to each target address.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Open loop: most requests outstanding; arrivals past it are counted as `NOT_SENT`.
    #[arg(long, default_value_t = 100_000)]
    pub max_in_flight: usize,
    /// Write the report (or the sweep) as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Step the offered rate up until the service saturates; draws latency against throughput.
    #[arg(long)]
    pub sweep: bool,
    /// The sweep's first offered rate, requests per second.
    #[arg(long, default_value_t = 50.0)]
    pub sweep_start: f64,
    /// Each sweep step offers this many times the rate of the one before.
    #[arg(long, default_value_t = 1.6)]
    pub sweep_factor: f64,
    /// The sweep stops after this many steps, saturated or not.
    #[arg(long, default_value_t = 12)]
    pub sweep_max_steps: usize,
    /// Where the sweep's SVG goes.
    #[arg(long, default_value = "sweep.svg")]
    pub svg: PathBuf,
    /// Also load a bare echo service (same API and sizes, no compute) in the same run and report
    /// the target's figures as a ratio of it. Started here unless --echo-target names one.
    #[arg(long)]
    pub echo: bool,
    /// With --echo: an echo service already running at HOST:PORT (else one is started here).
    #[arg(long)]
    pub echo_target: Option<String>,
    /// Also run the same load over this API on the same target, right after, and report the
    /// first as a ratio of it (e.g. `--api kserve --compare-api unary`).
    #[arg(long, value_enum, conflicts_with_all = ["echo", "echo_target", "sweep"])]
    pub compare_api: Option<Api>,
    /// Only run an echo service on this address (for another loadtest to target).
    #[arg(long)]
    pub serve_echo: Option<SocketAddr>,
    /// The echo service's hidden size (with --serve-echo).
    #[arg(long, default_value_t = 64)]
    pub echo_hidden: u32,
    /// The echo service waits this long per request (a deliberately slow server).
    #[arg(long, default_value = "0ms", value_parser = duration)]
    pub echo_delay: Duration,
    /// Seed of the random hidden states, sizes, routing and arrivals.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl Args {
    pub fn validate(&self) -> Result<(), String> {
        if self.serve_echo.is_some() {
            return Ok(());
        }
        if self.target.is_none() && !(self.echo && self.echo_target.is_none()) {
            return Err(
                "--target is required (or --echo alone, to load only an echo service)".into(),
            );
        }
        if !self.sweep && self.concurrency.is_none() && self.rate.is_none() {
            return Err(
                "give --concurrency N (closed loop), --rate R (open loop) or --sweep".into(),
            );
        }
        if self.rate.is_some_and(|r| r.is_nan() || r <= 0.0) || self.concurrency == Some(0) {
            return Err("--rate and --concurrency must be positive".into());
        }
        match self.skew {
            Some(s) if !s.is_finite() || s < 0.0 => {
                return Err("--skew must be a finite exponent, 0 or more".into())
            }
            Some(_) if !self.client_routing && self.skew_model.is_none() => return Err(
                "--skew needs --skew-model (the target's model, for its gate) or --client-routing"
                    .into(),
            ),
            _ => {}
        }
        if self.connections == 0 || self.sweep_factor <= 1.0 {
            return Err("--connections must be positive and --sweep-factor above 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod help {
    /// `--help` describes every flag it lists.
    #[test]
    fn every_flag_is_described() {
        use clap::CommandFactory;
        let bare: Vec<String> = super::Args::command()
            .get_arguments()
            .filter(|a| !a.is_hide_set() && !matches!(a.get_id().as_str(), "help" | "version"))
            .filter(|a| a.get_help().is_none() && a.get_long_help().is_none())
            .map(|a| format!("--{}", a.get_id()))
            .collect();
        assert!(bare.is_empty(), "no description: {bare:?}");
    }
}
