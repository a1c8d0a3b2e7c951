//! Rank 0: gRPC comes up first (NOT_SERVING), the group forms, a warm-up step runs, then it serves
//! through the request entry, the batcher and the step executor until a signal (drain) or a broken
//! group, and stops the ranks.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::bringup::{bring_up, Side, Site};
use super::grpc::{set_ready, watch_liveness, Front};
use super::prepare::{Prepared, Weights};
use super::stop::{wait_for_stop, Stop};
use crate::backend::gpu;
use crate::config::Ingress;
use crate::config::ServeArgs;
use crate::group::Ctl;
use crate::group::{self, RouterLink};
use crate::infer::Phase;
use crate::lifecycle::Abort;
use crate::sched::{
    run_batcher, run_coordinator, BatchConfig, CoordConfig, Executor, PeerEvents, OFFERS_PENDING,
};
use crate::step::ring::Ring;
use crate::step::{Backend, Driver};
use crate::watchdog::{self, AbortOnPanic, STUCK_GRACE};

/// How long a broken router waits for its step executor before exiting without it.
const BROKEN_JOIN: Duration = Duration::from_secs(2);

/// The router: gRPC comes up first (NOT_SERVING), the group forms, a warm-up step runs, then it
/// serves until a signal (drain) or a broken group.
pub fn run(args: &ServeArgs, p: Prepared, rendezvous: TcpListener) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(router_main(args, p, rendezvous))
}

async fn router_main(
    args: &ServeArgs,
    mut p: Prepared,
    rendezvous: TcpListener,
) -> anyhow::Result<()> {
    let abort = Arc::new(Abort::default());
    let (front, job_rx) = Front::start(args, &p, abort.clone()).await?;
    let (infer, api, admission, health, addr) = (
        front.infer.clone(),
        front.api.clone(),
        front.admission.clone(),
        front.health.clone(),
        front.addr,
    );
    let (world, stride, slots) = (p.member.world, p.ring.home_stride(), p.ring.slots);
    // --ingress all: the other ranks' offers and drain messages, from their control connections.
    let (offers_tx, offers_rx) = mpsc::unbounded_channel();
    let events = (args.ingress == Ingress::All).then(|| PeerEvents {
        offers: offers_tx,
        drain: CancellationToken::new(),
        drained: Arc::new(tokio::sync::Semaphore::new(0)),
    });
    info!("gRPC listening on {addr}, NOT_SERVING until the group is ready");

    let (setup_args, setup_abort, setup_events) = (args.clone(), abort.clone(), events.clone());
    let setup_api = api.clone();
    let setup = tokio::task::spawn_blocking(move || {
        let weights = super::prepare::load(&setup_args, &mut p)?;
        setup_api.set_footprint(p.exchange_bytes, p.expert_bytes);
        let here = addr.to_string();
        form_group(
            &setup_args,
            p,
            weights,
            rendezvous,
            setup_abort,
            setup_events,
            here,
        )
    })
    .await;
    let (exec, ingress) = match setup.map_err(anyhow::Error::from).and_then(|r| r) {
        Ok(Formed {
            exec,
            footprint,
            ingress,
        }) => {
            if let Some(f) = footprint {
                api.set_ep_footprint(f);
            }
            api.set_ingress(&ingress);
            (exec, ingress)
        }
        Err(e) => {
            let _ = front.close_now().await;
            return Err(e);
        }
    };
    let progress = exec.progress.clone();
    let pace = exec.pace.clone();
    let control = exec.control();
    let (step_tx, step_rx) = mpsc::channel(1);
    let (handle, heartbeat) = (tokio::runtime::Handle::current(), args.heartbeat_interval);
    let exec_abort = abort.clone();
    // One permit per ring slot: a step holds one from when it is formed until it is delivered.
    let in_flight = Arc::new(tokio::sync::Semaphore::new(slots));
    metrics::gauge!(crate::sched::STEPS_IN_FLIGHT).set(0.0);
    let permits = in_flight.clone();
    let exec_thread = std::thread::Builder::new()
        .name("step-executor".into())
        .spawn(move || {
            let _guard = AbortOnPanic(exec_abort, "the step executor panicked");
            exec.serve(step_rx, permits, handle, heartbeat)
        })?;
    let batch_stop = CancellationToken::new();
    let max_wait = Duration::from_micros(args.max_batch_wait_us);
    // The router's batcher forms the group's steps; under --ingress all it forms this rank's
    // offers, and the coordinator forms steps from every rank's.
    let (batcher, coordinator) = match &events {
        None => {
            let batch = BatchConfig {
                max_tokens_per_step: args.max_tokens_per_step,
                max_wait,
                depth: slots,
                gauge: crate::sched::STEPS_IN_FLIGHT,
                pace: Some(pace),
            };
            let b = run_batcher(
                batch,
                job_rx,
                step_tx,
                in_flight,
                front.wake.clone(),
                batch_stop.clone(),
                abort.clone(),
            );
            (tokio::spawn(b), None)
        }
        Some(_) => {
            let batch = BatchConfig {
                max_tokens_per_step: stride,
                max_wait,
                depth: slots,
                gauge: OFFERS_PENDING,
                // The coordinator forms the group's steps from these offers.
                pace: None,
            };
            let (own_tx, own_rx) = mpsc::channel(1);
            let own_permits = Arc::new(tokio::sync::Semaphore::new(slots));
            let b = run_batcher(
                batch,
                job_rx,
                own_tx,
                own_permits.clone(),
                front.wake.clone(),
                batch_stop.clone(),
                abort.clone(),
            );
            let cfg = CoordConfig {
                world,
                stride,
                depth: slots,
            };
            let c = run_coordinator(
                cfg,
                own_rx,
                own_permits,
                offers_rx,
                step_tx,
                in_flight,
                batch_stop.clone(),
                abort.clone(),
            );
            (tokio::spawn(b), Some(tokio::spawn(c)))
        }
    };
    // The other ranks admit requests from here on too (the warm-up step has run).
    if events.is_some() {
        if let Err(e) = control.broadcast(&Ctl::Ingress { addrs: ingress }) {
            abort.trigger(format!("telling the ranks the group is ready: {e}"));
        }
    }
    infer.set_phase(Phase::Serving);
    set_ready(&health, true).await;
    crate::startup::enter(crate::startup::Stage::Ready);
    info!("serving gRPC on {addr}");
    let watchdog = tokio::spawn(watch_liveness(
        health.clone(),
        infer.clone(),
        progress.clone(),
        args.liveness_timeout,
    ));
    // A step past --step-timeout whose own waits did not end it (a device call that never
    // returns) breaks the group from here: every waiting request is answered at once.
    let (stuck_abort, limit) = (abort.clone(), args.step_timeout);
    watchdog::watch_steps(progress, limit, move |d| {
        stuck_abort.trigger(format!(
            "a step has run {d:.1?}, past --step-timeout {limit:?}: a rank or its GPU is stuck"
        ))
    })?;

    let asked = events.as_ref().map(|e| e.drain.clone());
    let stop = wait_for_stop(&abort, asked).await;
    let drained = match &stop {
        Stop::Signal(name) => {
            infer.set_phase(Phase::Draining);
            set_ready(&health, false).await;
            let (requests, tokens) = admission.held();
            warn!(
                requests,
                tokens, "{name}: draining; new requests are refused"
            );
            // Every rank that takes requests drains too; the group stops once all have.
            let others = events.as_ref().map(|e| e.drained.clone());
            if others.is_some() {
                if let Err(e) = control.broadcast(&Ctl::Drain) {
                    abort.trigger(format!("telling the ranks to drain: {e}"));
                }
            }
            let all_drained = async {
                admission.drained().await;
                if let Some(d) = &others {
                    let _ = d.acquire_many(world as u32 - 1).await;
                }
            };
            // A group that breaks meanwhile ends the drain: its ranks will not report drained.
            let done = tokio::select! {
                r = tokio::time::timeout(args.drain_timeout, all_drained) => r.is_ok(),
                _ = abort.broken() => false,
            };
            if !done && abort.reason().is_none() {
                let (requests, tokens) = admission.held();
                let ranks = others.map_or(0, |d| (world - 1).saturating_sub(d.available_permits()));
                abort.trigger(format!(
                    "drain timeout: {requests} requests ({tokens} tokens) here and {ranks} other rank(s) unfinished after {:?}",
                    args.drain_timeout
                ));
            }
            done
        }
        Stop::Broken(reason) => {
            infer.set_phase(Phase::Broken);
            set_ready(&health, false).await;
            error!("EP group broken: {reason}; answering every waiting request UNAVAILABLE");
            false
        }
    };
    batch_stop.cancel();
    let _ = batcher.await;
    if let Some(c) = coordinator {
        let _ = c.await;
    }
    // The executor ends within a step unless a device call under it never returns; once the
    // group is broken its clients are answered, so there is no step worth a long wait.
    let joined = tokio::task::spawn_blocking(move || exec_thread.join());
    let bound = match abort.reason() {
        Some(_) => BROKEN_JOIN,
        None => args.step_timeout + STUCK_GRACE,
    };
    let executed = tokio::time::timeout(bound, joined).await;
    watchdog.abort();
    // Keep answering UNAVAILABLE (with the reason) a moment before the port closes, so clients
    // and load balancers see a clean refusal rather than a dropped connection.
    let closed = front.close(args.shutdown_grace).await;
    let Ok(executed) = executed else {
        let why = abort.reason().unwrap_or_default();
        watchdog::exit_now(
            1,
            &format!("the step executor is stuck in a device call ({why})"),
        );
    };
    closed?;
    executed?.map_err(|_| anyhow!("the step executor panicked"))??;
    if let Some(reason) = abort.reason() {
        bail!("the EP group broke: {reason}");
    }
    if drained {
        info!("drained; exiting");
    }
    Ok(())
}

/// The group, formed and warmed up.
struct Formed {
    exec: Executor<Box<dyn Backend + Send>>,
    /// What the NCCL EP exchange takes on this GPU (nccl-ep).
    footprint: Option<crate::step::EpFootprint>,
    /// Where each rank that takes requests serves gRPC, by rank (`here` alone under router
    /// ingress).
    ingress: Vec<String>,
}

/// Joins the group, sets up the exchange buffers, learns where every rank serves (`events`:
/// --ingress all) and runs the warm-up step (blocking).
fn form_group(
    args: &ServeArgs,
    p: Prepared,
    weights: Weights,
    listener: TcpListener,
    abort: Arc<Abort>,
    events: Option<PeerEvents>,
    here: String,
) -> anyhow::Result<Formed> {
    let world = p.member.world;
    let bind = listener.local_addr()?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let group_id = format!("{:x}-{nanos:x}", std::process::id());
    let host = group::host_id();
    let nccl_id = match &weights {
        Weights::Gpu(_) => Some(gpu::new_unique_id()?),
        Weights::Host(_) => None,
    };
    crate::startup::enter(crate::startup::Stage::Rendezvous);
    info!(world, rendezvous = %bind, group = %group_id, "waiting for ranks");
    let timeout = args.rendezvous_timeout;
    let want = group::Expect {
        world,
        fingerprint: &p.fingerprint,
        host: &host,
        same_host: true,
        token: args.group_token.as_deref().unwrap_or_default(),
    };
    let mut link = RouterLink::accept(&listener, &want, &group_id, nccl_id.clone(), timeout)?;
    drop(listener);
    let dir = super::segment_dir(args)?;
    let swept = crate::shm::sweep_stale(&dir);
    if swept > 0 {
        info!("removed {swept} segment(s) of groups whose router is gone");
    }
    let dir = dir.as_path();
    // The backend, the step ring, and where each rank serves.
    type Built = (Box<dyn Backend + Send>, Arc<Ring>, Vec<String>);
    let setup = (|| -> anyhow::Result<Built> {
        let deadline = Instant::now() + timeout;
        let ring = Arc::new(
            Ring::create(&super::ring_path(dir, &group_id), p.ring)
                .context("creating the step ring")?,
        );
        let mapped = || Ok(ring.clone());
        let site = Site {
            dir,
            group: &group_id,
            nccl_id: nccl_id.as_deref().unwrap_or_default(),
            ring: &mapped,
            deadline,
        };
        crate::startup::enter(crate::startup::Stage::BringUp);
        let backend = bring_up(
            &mut Side::Router(&mut link),
            weights,
            &p,
            site,
            args,
            abort.clone(),
        )?;
        ring.unlink();
        let ingress = match events {
            Some(_) => link.gather_listening(here.clone(), deadline)?,
            None => vec![here.clone()],
        };
        Ok((backend, ring, ingress))
    })();
    let (rank, ring, ingress) = match setup {
        Ok(x) => x,
        Err(e) => {
            link.reject_all(&format!("startup failed at rank 0: {e:#}"));
            return Err(e);
        }
    };
    link.clear_timeouts()?;
    super::group_info(p.backend, 0, world);
    let buffers = rank.buffers();
    // Logged per mode by every rank as its groups were made.
    let footprint = rank.ep_footprint();
    let driver = Driver::new(
        rank,
        0,
        world,
        p.spec.moe_layers.clone(),
        args.metrics_per_expert,
        p.ring,
        args.steps_ahead(p.backend),
    );
    let mut exec = Executor::new(driver, ring, link, abort, args.step_timeout, events)?;
    crate::startup::enter(crate::startup::Stage::WarmUp);
    exec.warm_up().context("warm-up step")?;
    info!(
        buffers = %crate::step::buffer_sizes(&buffers),
        "group ready: every rank joined, weights loaded, warm-up step done"
    );
    Ok(Formed {
        exec,
        footprint,
        ingress,
    })
}
