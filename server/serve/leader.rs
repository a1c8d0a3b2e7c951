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

use super::bringup::{bring_up, Reach, Side};
use super::grpc::{set_ready, watch_liveness, Front};
use super::prepare::Prepared;
use super::stop::{wait_for_stop, Stop};
use crate::backend::bringup::{BringUp, Site};
use crate::config::{Ingress, ServeArgs};
use crate::eplb::{Balance, EplbConfig};
use crate::group::{self, ControlLink, IngressOrder, Order};
use crate::infer::Phase;
use crate::lifecycle::Abort;
use crate::metric_names;
use crate::nodes::plane::DataListener;
use crate::sched::{
    run_batcher, run_coordinator, BatchConfig, Control, CoordConfig, Executor, ExecutorError, Job,
    Offer, PeerEvents, Redo,
};
use crate::step::ring::Ring;
use crate::step::{Backend, Driver};
use crate::watchdog::{self, AbortOnPanic, Progress, STUCK_GRACE};

/// How long a broken leader waits for its step executor before exiting without it.
const BROKEN_JOIN: Duration = Duration::from_secs(2);

/// The leader: gRPC comes up first (NOT_SERVING), the group forms, a warm-up step runs, then it
/// serves until a signal (drain) or a broken group.
pub fn run(args: &ServeArgs, p: Prepared, rendezvous: TcpListener) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(leader_main(args, p, rendezvous))
}

async fn leader_main(args: &ServeArgs, p: Prepared, rendezvous: TcpListener) -> anyhow::Result<()> {
    let abort = Arc::new(Abort::default());
    let (front, job_rx) = Front::start(args, &p, abort.clone()).await?;
    let shape = Shape {
        world: p.member.place.world,
        stride: p.ring.home_stride(),
        cells: p.ring.cells,
    };
    // --ingress all: the other ranks' offers and drain messages; None under leader ingress.
    let mut peers = (args.ingress == Ingress::All).then(Peers::new);
    info!(
        "gRPC listening on {}, NOT_SERVING until the group is ready",
        front.addr
    );
    let events = peers.as_ref().map(|p| p.events.clone());
    let formed = match form(args, p, rendezvous, &front, &abort, events).await {
        Ok(f) => f,
        Err(e) => {
            let _ = front.close_now().await;
            return Err(e);
        }
    };
    let ingress = formed.ingress.clone();
    let offers = peers.as_mut().and_then(|p| p.offers.take());
    let pipe = Pipeline::start(args, formed, shape, job_rx, offers, &front, &abort)?;
    let watchdog = go_live(args, &front, &abort, &pipe, peers.is_some(), ingress).await?;
    let stop = wait_for_stop(&abort, peers.as_ref().map(|p| p.events.drain.clone())).await;
    let drained = match &stop {
        Stop::Signal(name) => {
            drain(
                args,
                name,
                &front,
                &abort,
                &pipe,
                peers.as_ref().map(|p| &p.events),
                shape,
            )
            .await
        }
        Stop::Broken(reason) => {
            front.infer.set_phase(Phase::Broken);
            set_ready(&front.health, false).await;
            error!("EP group broken: {reason}; answering every waiting request UNAVAILABLE");
            false
        }
    };
    pipe.stop(args, &abort, front, watchdog).await?;
    if drained {
        info!("drained; exiting");
    }
    Ok(())
}

/// The group's shape as the leader's phases need it: ranks, home rows per rank, ring cells.
#[derive(Clone, Copy)]
struct Shape {
    world: usize,
    stride: usize,
    cells: usize,
}

/// Loads the weights and forms the group (blocking, off the runtime), then tells the API what
/// the group holds and where it serves.
async fn form(
    args: &ServeArgs,
    mut p: Prepared,
    rendezvous: TcpListener,
    front: &Front,
    abort: &Arc<Abort>,
    events: Option<PeerEvents>,
) -> anyhow::Result<Formed> {
    let (args, abort) = (args.clone(), abort.clone());
    let (api, here) = (front.api.clone(), front.addr.to_string());
    let setup = tokio::task::spawn_blocking(move || {
        let rank = super::prepare::load(&args, &mut p)?;
        api.set_footprint(p.exchange_bytes, p.expert_bytes);
        form_group(&args, p, rank, rendezvous, abort, events, here)
    })
    .await;
    let formed = setup.map_err(anyhow::Error::from).and_then(|r| r)?;
    if let Some(f) = &formed.footprint {
        front.api.set_ep_footprint(f.clone());
    }
    front.api.set_ingress(&formed.ingress);
    let (balance, layers) = (formed.exec.balance(), formed.layer_ids.clone());
    let status = balance.clone();
    crate::metrics::set_eplb_status(Box::new(move || status.status().to_string()));
    front.api.set_placement(Arc::new(move || {
        let (epoch, map) = balance.current();
        (epoch, super::prepare::layer_placement(&layers, &map))
    }));
    front.api.set_nodes(formed.nodes.clone());
    if let Some(view) = formed.exec.roster_view() {
        front.api.set_roster(view);
    }
    Ok(formed)
}

/// `--ingress all` on the leader: what the other ranks send it after startup, from their
/// control connections (`events`: offers, drain, drained), and the offers' receiving end, which
/// the coordinator takes. One value for every phase that differs by ingress.
struct Peers {
    events: PeerEvents,
    offers: Option<mpsc::UnboundedReceiver<(usize, Offer)>>,
}

impl Peers {
    fn new() -> Self {
        let (offers_tx, offers_rx) = mpsc::unbounded_channel();
        Self {
            events: PeerEvents {
                offers: offers_tx,
                drain: CancellationToken::new(),
                drained: Arc::new(tokio::sync::Semaphore::new(0)),
            },
            offers: Some(offers_rx),
        }
    }
}

/// The serving pipeline: the step executor on its own thread, fed by the batcher (and the
/// coordinator under --ingress all).
struct Pipeline {
    executor: std::thread::JoinHandle<Result<(), ExecutorError>>,
    batcher: tokio::task::JoinHandle<()>,
    coordinator: Option<tokio::task::JoinHandle<()>>,
    batch_stop: CancellationToken,
    control: Control,
    progress: Arc<Progress>,
}

impl Pipeline {
    fn start(
        args: &ServeArgs,
        formed: Formed,
        shape: Shape,
        jobs: mpsc::Receiver<Arc<Job>>,
        // --ingress all: the other ranks' offers; None: the leader's batcher forms every step.
        offers: Option<mpsc::UnboundedReceiver<(usize, Offer)>>,
        front: &Front,
        abort: &Arc<Abort>,
    ) -> anyhow::Result<Self> {
        let (exec, redo) = (formed.exec, formed.redo);
        let (progress, pace, control) = (exec.progress.clone(), exec.pace.clone(), exec.control());
        let batch_stop = CancellationToken::new();
        crate::sched::spawn_balancer(
            exec.balance(),
            control.clone(),
            args.placement.clone(),
            batch_stop.clone(),
            abort.clone(),
        )?;
        let (step_tx, step_rx) = mpsc::channel(1);
        // One permit per ring cell: a step holds one from when it is formed until it is delivered.
        let in_flight = Arc::new(tokio::sync::Semaphore::new(shape.cells));
        metrics::gauge!(metric_names::STEPS_IN_FLIGHT).set(0.0);
        let executor = spawn_executor(exec, step_rx, in_flight.clone(), args, abort)?;
        let batch = |max_tokens_per_step, gauge, pace, redo| BatchConfig {
            max_tokens_per_step,
            max_wait: Duration::from_micros(args.max_batch_wait_us),
            depth: shape.cells,
            gauge,
            pace,
            redo,
        };
        let batcher = |cfg, steps, permits| {
            let (wake, stop) = (front.wake.clone(), batch_stop.clone());
            tokio::spawn(run_batcher(
                cfg,
                jobs,
                steps,
                permits,
                wake,
                stop,
                abort.clone(),
            ))
        };
        let (batcher, coordinator) = match offers {
            None => {
                let cfg = batch(
                    args.max_tokens_per_step,
                    metric_names::STEPS_IN_FLIGHT,
                    Some(pace),
                    redo,
                );
                (batcher(cfg, step_tx, in_flight), None)
            }
            // This rank's batcher forms offers; the coordinator forms the group's steps.
            Some(offers) => {
                let (own_tx, own_rx) = mpsc::channel(1);
                let own_permits = Arc::new(tokio::sync::Semaphore::new(shape.cells));
                let b = batcher(
                    batch(shape.stride, metric_names::OFFERS_PENDING, None, None),
                    own_tx,
                    own_permits.clone(),
                );
                let cfg = CoordConfig {
                    world: shape.world,
                    stride: shape.stride,
                    depth: shape.cells,
                };
                let c = run_coordinator(
                    cfg,
                    own_rx,
                    own_permits,
                    offers,
                    step_tx,
                    in_flight,
                    batch_stop.clone(),
                    abort.clone(),
                );
                (b, Some(tokio::spawn(c)))
            }
        };
        Ok(Self {
            executor,
            batcher,
            coordinator,
            batch_stop,
            control,
            progress,
        })
    }

    /// Stops forming steps, waits for the executor (bounded: a device call may never return),
    /// closes the front after its grace, and says how the group ended.
    async fn stop(
        self,
        args: &ServeArgs,
        abort: &Abort,
        front: Front,
        watchdog: tokio::task::JoinHandle<()>,
    ) -> anyhow::Result<()> {
        self.batch_stop.cancel();
        let _ = self.batcher.await;
        if let Some(c) = self.coordinator {
            let _ = c.await;
        }
        // The executor ends within a step unless a device call under it never returns; once the
        // group is broken its clients are answered, so there is no step worth a long wait.
        let executor = self.executor;
        let joined = tokio::task::spawn_blocking(move || executor.join());
        let bound = match abort.reason() {
            Some(_) => BROKEN_JOIN,
            None => args.step_timeout + STUCK_GRACE,
        };
        let executed = tokio::time::timeout(bound, joined).await;
        watchdog.abort();
        // Keep answering UNAVAILABLE (with the reason) a moment before the port closes, so
        // clients and load balancers see a clean refusal rather than a dropped connection.
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
        Ok(())
    }
}

/// The step executor on a thread of its own (it blocks on device and peer waits); a panic
/// there breaks the group.
fn spawn_executor(
    exec: Executor<Box<dyn Backend + Send>>,
    steps: mpsc::Receiver<crate::sched::Step>,
    in_flight: Arc<tokio::sync::Semaphore>,
    args: &ServeArgs,
    abort: &Arc<Abort>,
) -> std::io::Result<std::thread::JoinHandle<Result<(), ExecutorError>>> {
    let (handle, heartbeat) = (tokio::runtime::Handle::current(), args.heartbeat_interval);
    let abort = abort.clone();
    std::thread::Builder::new()
        .name("step-executor".into())
        .spawn(move || {
            let _guard = AbortOnPanic(abort, "the step executor panicked");
            exec.serve(steps, in_flight, handle, heartbeat)
        })
}

/// The warm-up step has run: the other ranks admit requests too (--ingress all), the API serves
/// and reports ready, and the liveness and stuck-step watchdogs start.
async fn go_live(
    args: &ServeArgs,
    front: &Front,
    abort: &Arc<Abort>,
    pipe: &Pipeline,
    all_ingress: bool,
    ingress: Vec<String>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    if all_ingress {
        if let Err(e) = pipe
            .control
            .broadcast(&Order::Ingress(IngressOrder::Open { addrs: ingress }))
        {
            abort.trigger(format!("telling the ranks the group is ready: {e}"));
        }
    }
    front.infer.set_phase(Phase::Serving);
    set_ready(&front.health, true).await;
    if std::env::var_os(crate::sys::LAUNCHER_PID).is_some() {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", crate::sys::READY_LINE).and_then(|()| out.flush());
    }
    crate::startup::enter(crate::startup::Stage::Ready);
    info!("serving gRPC on {}", front.addr);
    let watchdog = tokio::spawn(watch_liveness(
        front.health.clone(),
        front.infer.clone(),
        pipe.progress.clone(),
        args.liveness_timeout,
    ));
    // A step past --step-timeout whose own waits did not end it (a device call that never
    // returns) breaks the group from here: every waiting request is answered at once.
    let (stuck_abort, limit) = (abort.clone(), args.step_timeout);
    watchdog::watch_steps(pipe.progress.clone(), limit, move |d| {
        stuck_abort.trigger(format!(
            "a step has run {d:.1?}, past --step-timeout {limit:?}: a rank or its GPU is stuck"
        ))
    })?;
    Ok(watchdog)
}

/// A signal: new requests are refused, every rank that takes requests drains too, and the group
/// stops once all have (within --drain-timeout, else the group breaks). Whether all drained.
async fn drain(
    args: &ServeArgs,
    signal: &str,
    front: &Front,
    abort: &Abort,
    pipe: &Pipeline,
    events: Option<&PeerEvents>,
    shape: Shape,
) -> bool {
    front.infer.set_phase(Phase::Draining);
    set_ready(&front.health, false).await;
    let (requests, tokens) = front.admission.held();
    warn!(
        requests,
        tokens, "{signal}: draining; new requests are refused"
    );
    let others = events.map(|e| e.drained.clone());
    if others.is_some() {
        if let Err(e) = pipe.control.broadcast(&Order::Ingress(IngressOrder::Drain)) {
            abort.trigger(format!("telling the ranks to drain: {e}"));
        }
    }
    let world = shape.world;
    let all_drained = async {
        front.admission.drained().await;
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
        let (requests, tokens) = front.admission.held();
        let ranks = others.map_or(0, |d| (world - 1).saturating_sub(d.available_permits()));
        abort.trigger(format!(
            "drain timeout: {requests} requests ({tokens} tokens) here and {ranks} other rank(s) unfinished after {:?}",
            args.drain_timeout
        ));
    }
    done
}

/// The group, formed and warmed up.
struct Formed {
    exec: Executor<Box<dyn Backend + Send>>,
    /// What the NCCL EP exchange takes on this GPU (nccl-ep).
    footprint: Option<crate::step::EpFootprint>,
    /// Where each rank that takes requests serves gRPC, by rank (`here` alone under leader
    /// ingress).
    ingress: Vec<String>,
    /// Each rank's node, by rank.
    nodes: Vec<String>,
    /// The model's index of each MoE layer.
    layer_ids: Vec<u32>,
    /// `--on-rank-loss continue`: the rows a lost rank's steps give back to the batcher.
    redo: Option<Arc<Redo>>,
}

/// A group across nodes says which ranks each holds.
fn log_nodes(roster: &crate::nodes::Roster) {
    if roster.spans_nodes() {
        for (node, ranks) in roster.nodes() {
            info!(node = %node, ?ranks, "the group's ranks on node {node}");
        }
    }
}

/// Names the group (and makes its NCCL id, for a GPU backend), then waits for every rank to
/// join on `listener`: the link to them, the group's name and NCCL id.
fn accept_ranks(
    args: &ServeArgs,
    p: &Prepared,
    rank: &dyn BringUp,
    listener: &TcpListener,
    data_port: u16,
) -> anyhow::Result<(ControlLink, String, Option<Vec<u8>>)> {
    let world = p.member.place.world;
    let bind = listener.local_addr()?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    // The leader's pid and host: `shm::sweep_stale` reads them back from file names.
    let group_id = format!("{:x}-{nanos:x}-{}", std::process::id(), group::host_tag());
    let host = group::host_id();
    let nccl_id = rank.new_nccl_id()?;
    crate::startup::enter(crate::startup::Stage::Rendezvous);
    info!(world, rendezvous = %bind, group = %group_id, "waiting for ranks");
    let want = group::Expect {
        world,
        fingerprint: &p.fingerprint,
        host: &host,
        node: &p.member.node,
        data_port,
        token: args.group_token.as_deref().unwrap_or_default(),
    };
    let timeout = args.rendezvous_timeout;
    let go_on = |roster: &crate::nodes::Roster| {
        super::loss::decide(
            args.on_rank_loss,
            args.ingress,
            p.ep.as_ref(),
            &p.slots,
            roster,
        )
        .map_err(|e| format!("{e:#}"))
    };
    let link = ControlLink::accept(listener, &want, &group_id, nccl_id.clone(), timeout, &go_on)?;
    Ok((link, group_id, nccl_id))
}

/// Joins the group, sets up the exchange buffers, learns where every rank serves (`events`:
/// --ingress all) and runs the warm-up step (blocking).
fn form_group(
    args: &ServeArgs,
    p: Prepared,
    rank: Box<dyn BringUp>,
    listener: TcpListener,
    abort: Arc<Abort>,
    events: Option<PeerEvents>,
    here: String,
) -> anyhow::Result<Formed> {
    let world = p.member.place.world;
    let timeout = args.rendezvous_timeout;
    let data = DataListener::bind(args.data_listen, &p.member.rendezvous)?;
    let (mut link, group_id, nccl_id) =
        accept_ranks(args, &p, rank.as_ref(), &listener, data.port()?)?;
    let roster = link.roster.clone();
    let go_on = link.go_on;
    let redo = go_on.then(|| Arc::new(Redo::new(args.max_tokens_per_step)));
    let dir = swept_segment_dir(args)?;
    let dir = dir.as_path();
    // The backend, the step ring, and where each rank serves.
    type Built = (Box<dyn Backend + Send>, Arc<Ring>, Vec<String>);
    let setup = (|| -> anyhow::Result<Built> {
        let deadline = Instant::now() + timeout;
        let ring = Arc::new(
            Ring::create(&super::site::ring_path(dir, &group_id), p.ring)
                .context("creating the step ring")?,
        );
        let mapped = || Ok(ring.clone());
        let site = Site {
            dir,
            group: &group_id,
            roster: &roster,
            nccl_id: nccl_id.as_deref().unwrap_or_default(),
            ring: &mapped,
            deadline,
            abort: abort.clone(),
            keep_files: go_on,
            rejoining: None,
        };
        let reach = Reach {
            listener: data,
            rank: 0,
            token: args.group_token.clone().unwrap_or_default(),
            step_timeout: args.step_timeout,
        };
        crate::startup::enter(crate::startup::Stage::BringUp);
        let backend = bring_up(&mut Side::Leader(&mut link), rank, site, reach)?;
        if !go_on {
            ring.unlink();
        }
        let ingress = match events {
            Some(_) => link.gather_listening(here.clone(), deadline)?,
            None => vec![here.clone()],
        };
        Ok((backend, ring, ingress))
    })();
    let (rank, ring, ingress) = match setup {
        Ok(x) => x,
        Err(e) => {
            // Logged before the others hear it: they exit at once, and a launcher that sees them
            // go stops this rank too (#56: 1 launch in 8 lost the line naming the tensor).
            tracing::error!("startup failed at rank 0, refusing the group: {e:#}");
            link.reject_all(&format!("startup failed at rank 0: {e:#}"));
            return Err(e);
        }
    };
    link.clear_timeouts()?;
    super::site::group_info(p.backend, 0, world);
    log_nodes(&roster);
    let buffers = crate::step::buffer_sizes(&rank.buffers());
    // Logged per mode by every rank as its groups were made.
    let footprint = rank.ep_footprint();
    let mut exec = Executor::new(
        driver(args, &p, rank),
        ring,
        link,
        abort,
        args.step_timeout,
        events,
        (Arc::new(balance(args, &p, &roster)), redo.clone()),
    )?;
    if go_on {
        // A lost rank that restarts comes back through the rendezvous port.
        let door = crate::group::rejoin::Door {
            world,
            fingerprint: p.fingerprint.clone(),
            token: args.group_token.clone().unwrap_or_default(),
            roster: roster.clone(),
            host: group::host_id(),
        };
        exec.open_door(listener, door, &group_id)?;
    }
    let formed = Formed {
        footprint,
        exec,
        redo,
        ingress,
        nodes: roster.0.iter().map(|s| s.node.clone()).collect(),
        layer_ids: p.spec.moe_layers.clone(),
    };
    warm_up(formed, buffers)
}

/// The segment directory, with the files of groups this host routed and whose leader is gone
/// removed.
fn swept_segment_dir(args: &ServeArgs) -> anyhow::Result<std::path::PathBuf> {
    let dir = super::site::segment_dir(args)?;
    let swept = crate::sys::shm::sweep_stale(&dir, &group::host_tag());
    if swept > 0 {
        info!("removed {swept} segment(s) of groups whose leader is gone");
    }
    Ok(dir)
}

/// Rank 0's driver of the group's steps.
fn driver(
    args: &ServeArgs,
    p: &Prepared,
    rank: Box<dyn Backend + Send>,
) -> Driver<Box<dyn Backend + Send>> {
    Driver::new(
        rank,
        0,
        p.member.place.world,
        (p.spec.moe_layers.clone(), p.slots.clone()),
        args.metrics_per_expert,
        p.ring,
        args.steps_ahead(p.backend),
    )
}

/// The leader's view of the expert placement and its load (`--eplb-*`).
fn balance(args: &ServeArgs, p: &Prepared, roster: &crate::nodes::Roster) -> Balance {
    let groups = match p.spec.routing {
        crate::model::Routing::SigmoidGroupTopK { n_group, .. } => n_group,
        crate::model::Routing::SoftmaxTopK { .. } => 1,
    };
    let cfg = EplbConfig {
        interval: args.eplb_interval.0,
        window: args.eplb_window,
        threshold: args.eplb_threshold,
        groups,
        nodes: roster.nodes().len().max(1),
    };
    Balance::new(p.slots.clone(), p.spec.moe_layers.clone(), cfg)
}

/// Runs the warm-up step through every rank: the group is formed once it returns.
fn warm_up(mut formed: Formed, buffers: String) -> anyhow::Result<Formed> {
    crate::startup::enter(crate::startup::Stage::WarmUp);
    formed.exec.warm_up().context("warm-up step")?;
    info!(
        %buffers,
        "group ready: every rank joined, weights loaded, warm-up step done"
    );
    Ok(formed)
}
