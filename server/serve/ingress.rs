//! `--ingress all` on a worker rank: its own gRPC front and batcher, whose offers the leader
//! schedules (`sched::run_coordinator`); the step loop's share is `own_rows`.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::grpc::{set_ready, watch_liveness, Front};
use super::prepare::Prepared;
use crate::config::ServeArgs;
use crate::group::{IngressReport, Report, Reporter};
use crate::infer::Phase;
use crate::lifecycle::Abort;
use crate::metric_names;
use crate::request::Failure;
use crate::sched::{lock, Offered, OwnRows};
use crate::sched::{run_batcher, BatchConfig, Step};
use crate::step::ring::Ring;
use crate::watchdog::Progress;

/// A worker's clients: its gRPC front, up before it joins the group.
pub struct Clients {
    runtime: tokio::runtime::Runtime,
    front: Front,
    jobs: Option<mpsc::Receiver<Arc<crate::sched::Job>>>,
    abort: Arc<Abort>,
    offered: Offered,
    /// The batcher's pipeline: one permit per offer not yet in a step.
    permits: Arc<Semaphore>,
    batch_stop: CancellationToken,
    /// Set when the leader says drain.
    pub drain: CancellationToken,
    rank: usize,
}

impl Clients {
    pub fn start(args: &ServeArgs, p: &Prepared, abort: Arc<Abort>) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("ingress")
            .build()?;
        let (front, jobs) = runtime.block_on(Front::start(args, p, abort.clone()))?;
        let rank = p.member.place.rank;
        info!(
            "rank {rank} gRPC listening on {}, NOT_SERVING until the group is ready",
            front.addr
        );
        Ok(Self {
            runtime,
            front,
            jobs: Some(jobs),
            abort,
            offered: Arc::default(),
            permits: Arc::new(Semaphore::new(p.ring.cells)),
            batch_stop: CancellationToken::new(),
            drain: CancellationToken::new(),
            rank,
        })
    }

    /// The bytes this rank holds, once loaded, for GetModelInfo.
    pub fn set_footprint(&self, exchange: u64, experts: u64) {
        self.front.api.set_footprint(exchange, experts);
    }

    /// Each rank's node, by rank, for GetModelInfo.
    pub fn set_nodes(&self, roster: &crate::nodes::Roster) {
        let nodes = roster.0.iter().map(|s| s.node.clone()).collect();
        self.front.api.set_nodes(nodes);
    }

    /// After startup: tells the leader where this rank serves.
    pub fn send_address(&self, stream: &mut TcpStream) -> anyhow::Result<()> {
        let msg = Report::Ingress(IngressReport::Listening {
            rank: self.rank,
            addr: self.front.addr.to_string(),
        });
        Ok(crate::group::send(stream, &msg)?)
    }

    /// What turns this rank SERVING once the leader says the group is ready.
    pub fn opener(&self) -> Opener {
        Opener {
            api: self.front.api.clone(),
            infer: self.front.infer.clone(),
            health: self.front.health.clone(),
            runtime: self.runtime.handle().clone(),
            rank: self.rank,
            addr: self.front.addr,
        }
    }

    /// Starts the batcher, the offers to the leader, the drain, a signal here asking the leader
    /// to drain the group, and liveness (requests are admitted once `Opener::open`); returns the
    /// step loop's share.
    pub fn serve(
        &mut self,
        args: &ServeArgs,
        writer: Reporter,
        ring: Arc<Ring>,
        progress: Arc<Progress>,
    ) -> anyhow::Result<OwnRows> {
        let _rt = self.runtime.enter();
        let jobs = self.jobs.take().ok_or_else(|| anyhow!("serving twice"))?;
        let stride = ring.shape.home_stride();
        let batch = BatchConfig {
            max_tokens_per_step: stride,
            max_wait: Duration::from_micros(args.max_batch_wait_us),
            depth: ring.shape.cells,
            gauge: metric_names::OFFERS_PENDING,
            pace: None,
            redo: None,
        };
        let (offer_tx, offer_rx) = mpsc::channel(1);
        let f = &self.front;
        tokio::spawn(run_batcher(
            batch,
            jobs,
            offer_tx,
            self.permits.clone(),
            f.wake.clone(),
            self.batch_stop.clone(),
            self.abort.clone(),
        ));
        tokio::spawn(forward_offers(
            offer_rx,
            self.offered.clone(),
            writer.clone(),
            self.abort.clone(),
        ));
        let (rank, drain, w) = (self.rank, self.drain.clone(), writer.clone());
        let (infer, health, admission) = (f.infer.clone(), f.health.clone(), f.admission.clone());
        tokio::spawn(async move {
            drain.cancelled().await;
            infer.set_phase(Phase::Draining);
            set_ready(&health, false).await;
            warn!("rank {rank}: draining; new requests are refused");
            admission.drained().await;
            let _ = w.send(&Report::Ingress(IngressReport::Drained { rank }));
        });
        tokio::spawn(ask_to_drain_on_signal(writer));
        tokio::spawn(watch_liveness(
            f.health.clone(),
            f.infer.clone(),
            progress,
            args.liveness_timeout,
        ));
        OwnRows::start(
            ring,
            rank,
            self.offered.clone(),
            self.permits.clone(),
            args.step_timeout,
        )
    }

    /// After the step loop: a clean stop (the group drained) or `failed`, which answers every
    /// request still here UNAVAILABLE; then the port closes after `grace`.
    pub fn finish(self, failed: Option<String>, grace: Duration) -> anyhow::Result<()> {
        let why = match failed {
            Some(reason) => {
                self.abort.trigger(reason.clone());
                self.front.infer.set_phase(Phase::Broken);
                error!("EP group broken: {reason}; answering every waiting request UNAVAILABLE");
                format!("EP group broken: {reason}")
            }
            None => "the EP group stopped".to_string(),
        };
        for s in lock(&self.offered).drain(..) {
            s.fail(&Failure::unavailable("broken", why.clone()));
        }
        self.batch_stop.cancel();
        self.runtime.block_on(async {
            set_ready(&self.front.health, false).await;
            self.front.close(grace).await
        })
    }
}

/// Turns a rank SERVING when the leader says the group is ready (`IngressOrder::Open`, after its
/// warm-up step), with every rank's address for GetModelInfo.
pub struct Opener {
    api: Arc<crate::api::MoeApi>,
    infer: Arc<crate::infer::Infer>,
    health: tonic_health::server::HealthReporter,
    runtime: tokio::runtime::Handle,
    rank: usize,
    addr: std::net::SocketAddr,
}

impl Opener {
    pub fn open(&self, addrs: &[String]) {
        self.api.set_ingress(addrs);
        self.infer.set_phase(Phase::Serving);
        self.runtime.block_on(set_ready(&self.health, true));
        info!("rank {} serving gRPC on {}", self.rank, self.addr);
    }
}

/// Each offer the batcher forms waits here for its step, and the leader hears of it.
async fn forward_offers(
    mut offers: mpsc::Receiver<Step>,
    offered: Offered,
    writer: Reporter,
    abort: Arc<Abort>,
) {
    while let Some(step) = offers.recv().await {
        let msg = Report::Ingress(IngressReport::Offer {
            key: step.key(),
            tokens: step.tokens() as u32,
        });
        lock(&offered).push_back(step);
        if let Err(e) = writer.send(&msg) {
            abort.trigger(format!("lost the leader (rank 0): {e}"));
            break;
        }
    }
}

/// SIGTERM or SIGINT here drains the whole group: the leader decides when it stops.
async fn ask_to_drain_on_signal(writer: Reporter) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    warn!("signalled: asking the leader to drain the group");
    let _ = writer.send(&Report::Ingress(IngressReport::Drain));
}
