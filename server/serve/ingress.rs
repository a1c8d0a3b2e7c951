//! `--ingress all` on a worker rank: its own gRPC front and batcher, whose offers the router
//! schedules (`router::run_coordinator`), and the step loop's share: this rank's offer into its
//! own rows of the slot before a step, its requests answered from there after it (on a delivery
//! thread, so the next step need not wait).

use std::collections::VecDeque;
use std::net::TcpStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::grpc::{set_ready, watch_liveness, Front};
use super::prepare::Prepared;
use super::RING_SLOTS;
use crate::config::ServeArgs;
use crate::group::{expect, Ctl, CtlWriter};
use crate::infer::Phase;
use crate::router::rows::{copy_threads, deliver, pack};
use crate::router::{run_batcher, BatchConfig, Failure, Step, OFFERS_PENDING};
use crate::shm::Abort;
use crate::step::ring::Ring;
use crate::step::StepDesc;
use crate::watchdog::Progress;

/// This rank's offers the router has not yet put in a step, oldest first (the router takes
/// each rank's in this order).
type Offered = Arc<Mutex<VecDeque<Step>>>;

/// A worker's clients: its gRPC front, up before it joins the group.
pub struct Clients {
    runtime: tokio::runtime::Runtime,
    front: Front,
    jobs: Option<mpsc::Receiver<Arc<crate::router::Job>>>,
    abort: Arc<Abort>,
    offered: Offered,
    /// The batcher's pipeline: one permit per offer not yet in a step.
    permits: Arc<Semaphore>,
    batch_stop: CancellationToken,
    /// Set when the router says drain.
    pub drain: CancellationToken,
    rank: usize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Clients {
    pub fn start(args: &ServeArgs, p: &Prepared, abort: Arc<Abort>) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("ingress")
            .build()?;
        let (front, jobs) = runtime.block_on(Front::start(args, p, abort.clone()))?;
        let rank = p.member.rank;
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
            permits: Arc::new(Semaphore::new(RING_SLOTS)),
            batch_stop: CancellationToken::new(),
            drain: CancellationToken::new(),
            rank,
        })
    }

    /// After startup: tells the router where this rank serves and learns where every rank does.
    pub fn exchange_addresses(
        &self,
        stream: &mut TcpStream,
        deadline: Instant,
    ) -> anyhow::Result<()> {
        let msg = Ctl::Listening {
            rank: self.rank,
            addr: self.front.addr.to_string(),
        };
        crate::group::send(stream, &msg)?;
        match expect(stream, "every rank's gRPC address", deadline)? {
            Ctl::Ingress { addrs } => {
                self.front.api.set_ingress(&addrs);
                Ok(())
            }
            other => bail!("expected every rank's gRPC address from the router, got {other:?}"),
        }
    }

    /// Starts taking requests: the batcher, the offers to the router, the drain, a signal here
    /// asking the router to drain the group, and liveness; returns the step loop's share.
    pub fn serve(
        &mut self,
        args: &ServeArgs,
        writer: CtlWriter,
        ring: Arc<Ring>,
        progress: Arc<Progress>,
    ) -> anyhow::Result<OwnRows> {
        let _rt = self.runtime.enter();
        let jobs = self.jobs.take().ok_or_else(|| anyhow!("serving twice"))?;
        let stride = ring.shape.home_stride();
        let batch = BatchConfig {
            max_tokens_per_step: stride,
            max_wait: Duration::from_micros(args.max_batch_wait_us),
            depth: RING_SLOTS,
            gauge: OFFERS_PENDING,
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
            let _ = w.send(&Ctl::Drained { rank });
        });
        tokio::spawn(ask_to_drain_on_signal(writer));
        tokio::spawn(watch_liveness(
            f.health.clone(),
            f.infer.clone(),
            progress,
            args.liveness_timeout,
        ));
        f.infer.set_phase(Phase::Serving);
        self.runtime.block_on(set_ready(&f.health, true));
        info!("rank {rank} serving gRPC on {}", f.addr);
        let gate = Arc::new(SlotGate::new(ring.shape.slots));
        let (tx, rx) = std::sync::mpsc::sync_channel::<(Step, usize)>(ring.shape.slots);
        let base = rank * stride;
        let deliverer = {
            let (ring, gate) = (ring.clone(), gate.clone());
            std::thread::Builder::new()
                .name("step-deliver".into())
                .spawn(move || {
                    let threads = copy_threads();
                    for (step, slot) in rx {
                        deliver(&ring, &step, slot, base, threads);
                        gate.free(slot);
                    }
                })?
        };
        Ok(OwnRows {
            ring,
            rank,
            base,
            offered: self.offered.clone(),
            permits: self.permits.clone(),
            gate,
            delivery: Some(tx),
            deliverer: Some(deliverer),
            threads: copy_threads(),
            wait: args.step_timeout,
        })
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

/// Each offer the batcher forms waits here for its step, and the router hears of it.
async fn forward_offers(
    mut offers: mpsc::Receiver<Step>,
    offered: Offered,
    writer: CtlWriter,
    abort: Arc<Abort>,
) {
    while let Some(step) = offers.recv().await {
        let msg = Ctl::Offer {
            key: step.key(),
            tokens: step.tokens() as u32,
        };
        lock(&offered).push_back(step);
        if let Err(e) = writer.send(&msg) {
            abort.trigger(format!("lost the router (rank 0): {e}"));
            break;
        }
    }
}

/// SIGTERM or SIGINT here drains the whole group: the router decides when it stops.
async fn ask_to_drain_on_signal(writer: CtlWriter) {
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
    warn!("signalled: asking the router to drain the group");
    let _ = writer.send(&Ctl::Drain);
}

/// Which ring slots still hold this rank's rows of a step being answered.
struct SlotGate {
    busy: Mutex<Vec<bool>>,
    freed: Condvar,
}

impl SlotGate {
    fn new(slots: usize) -> Self {
        Self {
            busy: Mutex::new(vec![false; slots]),
            freed: Condvar::new(),
        }
    }

    fn hold(&self, slot: usize) {
        lock(&self.busy)[slot] = true;
    }

    fn free(&self, slot: usize) {
        lock(&self.busy)[slot] = false;
        self.freed.notify_all();
    }

    /// Waits, at most `limit`, until the slot's last answers are out.
    fn wait_free(&self, slot: usize, limit: Duration) -> bool {
        let busy = lock(&self.busy);
        let (busy, _) = self
            .freed
            .wait_timeout_while(busy, limit, |b| b[slot])
            .unwrap_or_else(|e| e.into_inner());
        !busy[slot]
    }
}

/// The step loop's share of this rank's clients.
pub struct OwnRows {
    ring: Arc<Ring>,
    rank: usize,
    /// This rank's first row of a slot.
    base: usize,
    offered: Offered,
    permits: Arc<Semaphore>,
    gate: Arc<SlotGate>,
    delivery: Option<std::sync::mpsc::SyncSender<(Step, usize)>>,
    deliverer: Option<std::thread::JoinHandle<()>>,
    threads: usize,
    /// Bound on waiting for a slot's answers to be out.
    wait: Duration,
}

impl OwnRows {
    /// Before `desc` runs: the offer it takes from this rank, packed into its rows.
    pub fn before(&mut self, desc: &StepDesc) -> Result<Option<Step>, String> {
        let n = desc.homes.get(self.rank).copied().unwrap_or(0) as usize;
        if n == 0 {
            return Ok(None);
        }
        let step = lock(&self.offered).pop_front().ok_or_else(|| {
            format!(
                "step {}: the router took an offer this rank did not make",
                desc.step
            )
        })?;
        self.permits.add_permits(1);
        metrics::gauge!(OFFERS_PENDING).decrement(1.0);
        if step.key() != desc.key() || step.tokens() != n {
            let why = format!(
                "step {}: the router took {n} rows of {:?}, this rank offered {} of {:?}",
                desc.step,
                desc.key(),
                step.tokens(),
                step.key()
            );
            step.fail(&Failure::unavailable("broken", why.clone()));
            return Err(why);
        }
        let slot = desc.slot as usize;
        if !self.gate.wait_free(slot, self.wait) {
            let why = format!(
                "step {}: slot {slot}'s answers not out within {:?}",
                desc.step, self.wait
            );
            step.fail(&Failure::unavailable("broken", why.clone()));
            return Err(why);
        }
        pack(&self.ring, &step, slot, self.base, self.threads);
        Ok(Some(step))
    }

    /// After the step ran: its requests are answered on the delivery thread.
    pub fn after(&mut self, step: Step, slot: usize) {
        self.gate.hold(slot);
        if let Some(tx) = &self.delivery {
            let _ = tx.send((step, slot));
        }
    }
}

impl Drop for OwnRows {
    /// Answers every finished step before the rank goes on to stop.
    fn drop(&mut self) {
        self.delivery.take();
        if let Some(d) = self.deliverer.take() {
            let _ = d.join();
        }
    }
}
