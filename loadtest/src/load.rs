//! Driving the load: closed loop (N clients, one request each outstanding) or open loop (Poisson
//! arrivals at a fixed rate, whatever the latency), over unary calls or long-lived streams.
//! Every request started inside the measured window ends with exactly one recorded status.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::{ForwardRequest, ForwardResponse};
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::Code;

use crate::config::Api;
use crate::report::Report;
use crate::workload::Workload;

#[derive(Clone, Copy, Debug)]
pub enum Mode {
    Closed(usize),
    Open(f64),
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub mode: Mode,
    pub api: Api,
    pub warmup: Duration,
    pub duration: Duration,
    pub timeout: Duration,
    pub connections: usize,
    pub max_in_flight: usize,
}

pub fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

fn status_name(s: &tonic::Status) -> String {
    // tonic's client reports its own deadline as CANCELLED "Timeout expired".
    if s.code() == Code::Cancelled && s.message().contains("Timeout expired") {
        return "DEADLINE_EXCEEDED".into();
    }
    code_name(s.code()).into()
}

/// Counts and latencies of the requests started inside the window.
pub struct Recorder {
    warm_end: Instant,
    end: Instant,
    hist: Mutex<Histogram<u64>>,
    statuses: Mutex<BTreeMap<String, u64>>,
    pub sent: AtomicU64,
    pub not_sent: AtomicU64,
    /// OK answers that arrived inside the window (whenever sent): the throughput.
    completed: AtomicU64,
    completed_tokens: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
}

impl Recorder {
    fn new(warm_end: Instant, end: Instant) -> Self {
        Self {
            warm_end,
            end,
            hist: Mutex::new(
                Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram bounds"),
            ),
            statuses: Mutex::new(BTreeMap::new()),
            sent: AtomicU64::new(0),
            not_sent: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            completed_tokens: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
        }
    }
    fn counted(&self, started: Instant) -> bool {
        started >= self.warm_end && started < self.end
    }
    fn sent(&self, started: Instant, bytes: usize) {
        if self.counted(started) {
            self.sent.fetch_add(1, Ordering::Relaxed);
            self.bytes_out.fetch_add(bytes as u64, Ordering::Relaxed);
        }
    }
    fn done(&self, started: Instant, status: &str, tokens: usize, bytes_in: usize) {
        let now = Instant::now();
        if status == "OK" && now >= self.warm_end && now < self.end {
            self.completed.fetch_add(1, Ordering::Relaxed);
            self.completed_tokens
                .fetch_add(tokens as u64, Ordering::Relaxed);
        }
        if !self.counted(started) {
            return;
        }
        *self
            .statuses
            .lock()
            .unwrap()
            .entry(status.to_string())
            .or_default() += 1;
        if status == "OK" {
            let us = started.elapsed().as_micros().max(1) as u64;
            self.hist.lock().unwrap().saturating_record(us);
            self.bytes_in.fetch_add(bytes_in as u64, Ordering::Relaxed);
        }
    }
}

/// Requests outstanding on one stream, by id.
type Pending = Arc<Mutex<HashMap<String, oneshot::Sender<Result<ForwardResponse, String>>>>>;

/// One long-lived `ForwardStream` call.
struct StreamLane {
    tx: mpsc::Sender<ForwardRequest>,
    pending: Pending,
}

impl StreamLane {
    async fn open(client: &mut MoeServiceClient<Channel>) -> anyhow::Result<Self> {
        let (tx, rx) = mpsc::channel::<ForwardRequest>(1024);
        let mut inbound = client
            .forward_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        let pending: Pending = Arc::default();
        let p = pending.clone();
        tokio::spawn(async move {
            let end = loop {
                match inbound.message().await {
                    Ok(Some(resp)) => {
                        if let Some(waiter) = p.lock().unwrap().remove(&resp.id) {
                            let _ = waiter.send(Ok(resp));
                        }
                    }
                    Ok(None) => break "NO_RESPONSE".to_string(),
                    Err(s) => break status_name(&s),
                }
            };
            for (_, waiter) in p.lock().unwrap().drain() {
                let _ = waiter.send(Err(end.clone()));
            }
        });
        Ok(Self { tx, pending })
    }
}

/// Where requests go: a pool of connections, and for streams one lane per connection.
struct Target {
    clients: Vec<MoeServiceClient<Channel>>,
    lanes: Vec<StreamLane>,
    next: AtomicUsize,
    timeout: Duration,
}

impl Target {
    async fn connect(addr: &str, plan: &Plan) -> anyhow::Result<Self> {
        let mut clients = Vec::new();
        for _ in 0..plan.connections {
            let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
                .connect()
                .await?;
            clients.push(
                MoeServiceClient::new(ch)
                    .max_decoding_message_size(1 << 30)
                    .max_encoding_message_size(1 << 30),
            );
        }
        let mut lanes = Vec::new();
        if plan.api == Api::Stream {
            for c in &mut clients {
                lanes.push(StreamLane::open(c).await?);
            }
        }
        Ok(Self {
            clients,
            lanes,
            next: AtomicUsize::new(0),
            timeout: plan.timeout,
        })
    }

    /// Sends one request; returns its status name and the response.
    async fn issue(&self, request: ForwardRequest) -> (String, Option<ForwardResponse>) {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        if self.lanes.is_empty() {
            let mut c = self.clients[i % self.clients.len()].clone();
            let mut req = tonic::Request::new(request);
            req.set_timeout(self.timeout);
            return match c.forward(req).await {
                Ok(r) => ("OK".into(), Some(r.into_inner())),
                Err(s) => (status_name(&s), None),
            };
        }
        let lane = &self.lanes[i % self.lanes.len()];
        let (tx, rx) = oneshot::channel();
        let id = request.id.clone();
        lane.pending.lock().unwrap().insert(id.clone(), tx);
        if lane.tx.send(request).await.is_err() {
            lane.pending.lock().unwrap().remove(&id);
            return ("NO_RESPONSE".into(), None);
        }
        match tokio::time::timeout(self.timeout, rx).await {
            Err(_) => {
                lane.pending.lock().unwrap().remove(&id);
                ("DEADLINE_EXCEEDED".into(), None)
            }
            Ok(Err(_)) => ("NO_RESPONSE".into(), None),
            Ok(Ok(Err(status))) => (status, None),
            Ok(Ok(Ok(resp))) => match &resp.error {
                Some(e) => (code_name(Code::from_i32(e.code)).into(), None),
                None => ("OK".into(), Some(resp)),
            },
        }
    }
}

/// One request start to finish, recorded.
async fn one(target: &Target, workload: &Mutex<Workload>, rec: &Recorder, id: u64) {
    let item = workload.lock().unwrap().next(id.to_string());
    let started = Instant::now();
    rec.sent(started, item.bytes_out);
    let (status, resp) = target.issue(item.request).await;
    let (status, bytes_in) = match resp {
        Some(r) => match workload
            .lock()
            .unwrap()
            .check(item.tokens, r.output.as_ref())
        {
            Ok(b) => (status, b),
            Err(_) => ("BAD_RESPONSE".into(), 0),
        },
        None => (status, 0),
    };
    rec.done(started, &status, item.tokens, bytes_in);
}

/// Runs the plan against `addr` and reports on the measured window.
pub async fn run(addr: &str, plan: &Plan, workload: Workload, seed: u64) -> anyhow::Result<Report> {
    let target = Arc::new(Target::connect(addr, plan).await?);
    let workload = Arc::new(Mutex::new(workload));
    let start = Instant::now();
    let (warm_end, end) = (start + plan.warmup, start + plan.warmup + plan.duration);
    let rec = Arc::new(Recorder::new(warm_end, end));
    let mut tasks = JoinSet::new();
    let ids = Arc::new(AtomicU64::new(0));
    match plan.mode {
        Mode::Closed(n) => {
            for _ in 0..n {
                let (t, w, r, ids) = (target.clone(), workload.clone(), rec.clone(), ids.clone());
                tasks.spawn(async move {
                    while Instant::now() < end {
                        one(&t, &w, &r, ids.fetch_add(1, Ordering::Relaxed)).await;
                    }
                });
            }
        }
        Mode::Open(rate) => {
            // Arrivals are scheduled on the clock, not on completions: a slow server makes
            // latency grow, never the offered rate fall.
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xA221);
            let in_flight = Arc::new(AtomicUsize::new(0));
            let mut next = start;
            while next < end {
                tokio::time::sleep_until(next).await;
                while next <= Instant::now() && next < end {
                    if in_flight.load(Ordering::Relaxed) >= plan.max_in_flight {
                        if rec.counted(next) {
                            rec.not_sent.fetch_add(1, Ordering::Relaxed);
                        }
                    } else {
                        in_flight.fetch_add(1, Ordering::Relaxed);
                        let (t, w, r, f) = (
                            target.clone(),
                            workload.clone(),
                            rec.clone(),
                            in_flight.clone(),
                        );
                        let id = ids.fetch_add(1, Ordering::Relaxed);
                        tasks.spawn(async move {
                            one(&t, &w, &r, id).await;
                            f.fetch_sub(1, Ordering::Relaxed);
                        });
                    }
                    let gap = -(1.0 - rng.random::<f64>()).ln() / rate;
                    next += Duration::from_secs_f64(gap);
                }
            }
        }
    }
    // Everything in flight ends by its own deadline; wait for it, bounded all the same.
    let drain = tokio::time::timeout(plan.timeout + Duration::from_secs(5), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drain.is_err() {
        anyhow::bail!(
            "requests still in flight {:?} after their deadline",
            plan.timeout + Duration::from_secs(5)
        );
    }
    Ok(Report::new(&rec, plan, addr, &rec_parts(&rec)))
}

/// What the report reads out of the recorder.
pub struct Parts {
    pub completed: u64,
    pub completed_tokens: u64,
    pub statuses: BTreeMap<String, u64>,
    pub hist: Histogram<u64>,
    pub bytes_out: u64,
    pub bytes_in: u64,
}

fn rec_parts(rec: &Recorder) -> Parts {
    Parts {
        completed: rec.completed.load(Ordering::Relaxed),
        completed_tokens: rec.completed_tokens.load(Ordering::Relaxed),
        statuses: rec.statuses.lock().unwrap().clone(),
        hist: rec.hist.lock().unwrap().clone(),
        bytes_out: rec.bytes_out.load(Ordering::Relaxed),
        bytes_in: rec.bytes_in.load(Ordering::Relaxed),
    }
}
