//! Ranks 1..: join the leader's group, build the backend in lockstep, then run each step the
//! leader sends until told to stop or the leader is gone.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::sync::mpsc::TryRecvError;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use tracing::info;

use super::bringup::{bring_up, Reach, Side};
use super::ingress::{Clients, Opener};
use super::prepare::{self, Prepared};
use crate::backend::bringup::{BringUp, Site};
use crate::config::{Ingress, ServeArgs};
use crate::eplb::SlotMap;
use crate::group::{self, send, Bringup, IngressOrder, Joined, Order, Report, Reporter};
use crate::lifecycle::{nap, Abort};
use crate::nodes::plane::DataListener;
use crate::request::Failure;
use crate::sched::{OwnRows, PackOrder, Step};
use crate::step::ring::Ring;
use crate::step::{Backend, Driver, StepDesc, StepError};
use crate::watchdog::{self, Progress};

/// Joins the leader's group and runs its steps until told to stop.
pub fn run(args: &ServeArgs, mut p: Prepared) -> anyhow::Result<()> {
    // --ingress all: this rank's gRPC is up (NOT_SERVING) before it joins, as the leader's is.
    // One cause ends everything: a failed group stops this rank's waits inside a step and
    // answers its clients.
    let abort = Arc::new(Abort::default());
    let clients = match args.ingress {
        Ingress::All => Some(Clients::start(args, &p, abort.clone())?),
        Ingress::Leader => None,
    };
    let me = prepare::load(args, &mut p)?;
    if let Some(c) = &clients {
        c.set_footprint(p.exchange_bytes, p.expert_bytes);
    }
    match join(args, &p, me, clients.as_ref(), &abort) {
        Ok(joined) => follow(args, &p, joined, clients, abort),
        Err(e) => {
            if let Some(c) = clients {
                let _ = c.finish(Some(format!("{e:#}")), Duration::ZERO);
            }
            Err(e)
        }
    }
}

/// This rank in the group: its control connection, its backend, and the step ring it mapped.
struct InGroup {
    stream: TcpStream,
    backend: Box<dyn Backend + Send>,
    ring: Option<Arc<Ring>>,
    /// Every rank's node and process (a lost rank of this node is fenced from here too).
    roster: crate::nodes::Roster,
    /// The group goes on without a lost rank (`--on-rank-loss continue`).
    go_on: bool,
}

/// Joins the leader's group and brings the backend up in lockstep with it (then tells the leader
/// where this rank's clients reach it, --ingress all). A failed bring-up is told to the leader.
fn join(
    args: &ServeArgs,
    p: &Prepared,
    me: Box<dyn BringUp>,
    clients: Option<&Clients>,
    abort: &Arc<Abort>,
) -> anyhow::Result<InGroup> {
    let rank = p.member.place.rank;
    let (data, joined) = rendezvous(args, p)?;
    let Joined {
        mut stream,
        group: group_id,
        nccl_id,
        roster,
        go_on,
        rejoining,
    } = joined;
    if let Some(c) = clients {
        c.set_nodes(&roster);
    }
    let deadline = Instant::now() + args.rendezvous_timeout;
    let dir = super::site::segment_dir(args)?;
    let dir = dir.as_path();
    let ring = NodeRing::new(super::site::ring_path(dir, &group_id), p.ring);
    let setup = {
        // The first rank of a node other than rank 0's makes the node's ring, before the
        // first barrier, so its node's ranks find it after.
        let made = match roster.leader(rank) == rank && !roster.same_node(rank, 0) {
            true => ring.create(),
            false => Ok(()),
        };
        let open_ring = || ring.open();
        let site = Site {
            dir,
            group: &group_id,
            roster: &roster,
            nccl_id: nccl_id.as_deref().unwrap_or_default(),
            ring: &open_ring,
            deadline,
            abort: abort.clone(),
            keep_files: go_on,
            rejoining: rejoining.as_deref(),
        };
        let reach = Reach {
            listener: data,
            rank,
            token: args.group_token.clone().unwrap_or_default(),
            step_timeout: args.step_timeout,
        };
        let mut side = Side::Worker {
            stream: &mut stream,
            rank,
        };
        crate::startup::enter(crate::startup::Stage::BringUp);
        made.and_then(|()| bring_up(&mut side, me, site, reach))
            .and_then(|b| match clients {
                Some(c) => c.send_address(&mut stream).map(|()| b),
                None => Ok(b),
            })
    };
    // Every rank of the node mapped it (or the bring-up failed): its file can go, unless a
    // restarted rank may map it again.
    let ring = match go_on && setup.is_ok() {
        true => ring.keep(),
        false => ring.unlink(),
    };
    match setup {
        Ok(backend) => Ok(InGroup {
            stream,
            backend,
            ring,
            roster,
            go_on,
        }),
        Err(e) => {
            let reason = format!("{e:#}");
            // Logged before the leader hears it and the group (and a launcher) stops.
            tracing::error!("startup failed at rank {rank}: {reason}");
            let _ = send(&mut stream, &Bringup::Failed { rank, reason });
            Err(e)
        }
    }
}

/// Opens this rank's data listener (for ranks of other nodes) and joins the leader's
/// rendezvous, bounded by --rendezvous-timeout.
fn rendezvous(args: &ServeArgs, p: &Prepared) -> anyhow::Result<(DataListener, Joined)> {
    crate::startup::enter(crate::startup::Stage::Rendezvous);
    let data = DataListener::bind(args.data_listen, &p.member.rendezvous)?;
    let joiner = group::Joiner {
        place: p.member.place,
        node: &p.member.node,
        data_port: data.port()?,
    };
    let joined = group::join(
        &p.member.rendezvous,
        &joiner,
        &p.fingerprint,
        args.group_token.as_deref().unwrap_or_default(),
        args.rendezvous_timeout,
    )?;
    Ok((data, joined))
}

/// This rank's node's step ring, mapped once: made here by the node's first rank (a node other
/// than rank 0's), opened by the others when their bring-up asks.
struct NodeRing {
    path: std::path::PathBuf,
    shape: crate::step::ring::RingShape,
    mapped: std::cell::RefCell<Option<Arc<Ring>>>,
}

impl NodeRing {
    fn new(path: std::path::PathBuf, shape: crate::step::ring::RingShape) -> Self {
        Self {
            path,
            shape,
            mapped: Default::default(),
        }
    }

    fn create(&self) -> anyhow::Result<()> {
        let ring =
            Ring::create(&self.path, self.shape).context("creating this node's step ring")?;
        *self.mapped.borrow_mut() = Some(Arc::new(ring));
        Ok(())
    }

    fn open(&self) -> anyhow::Result<Arc<Ring>> {
        if let Some(ring) = self.mapped.borrow().as_ref() {
            return Ok(ring.clone());
        }
        let ring = Arc::new(Ring::open(&self.path, self.shape).context("mapping the step ring")?);
        *self.mapped.borrow_mut() = Some(ring.clone());
        Ok(ring)
    }

    /// The mapping, its file kept (for a restarted rank to map; it goes with the mapping).
    fn keep(self) -> Option<Arc<Ring>> {
        self.mapped.into_inner()
    }

    /// Once every rank of the node has mapped it (or the bring-up failed): its file goes, the
    /// mapping stays.
    fn unlink(self) -> Option<Arc<Ring>> {
        let ring = self.mapped.into_inner();
        if let Some(r) = &ring {
            r.unlink();
        }
        ring
    }
}

/// Runs the leader's steps (and, --ingress all, serves this rank's clients) until told to stop
/// or the leader is gone, then closes the clients' front.
fn follow(
    args: &ServeArgs,
    p: &Prepared,
    m: InGroup,
    mut clients: Option<Clients>,
    abort: Arc<Abort>,
) -> anyhow::Result<()> {
    let (rank, stream, backend) = (p.member.place.rank, m.stream, m.backend);
    // The leader sends a step or a heartbeat at least every heartbeat interval plus one step.
    let silence = args.heartbeat_interval + args.step_timeout + Duration::from_secs(1);
    stream.set_read_timeout(Some(silence))?;
    super::site::group_info(p.backend, rank, p.member.place.world);
    // The leader drives the drain: a signalled rank keeps running the leader's steps until it is
    // told to stop or loses the leader, so nothing admitted is lost when every pod gets SIGTERM.
    let signalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, signalled.clone())?;
    }
    // SIGHUP re-applies --placement on rank 0; here it is harmless rather than fatal, so a
    // reload sent to every pod does not end the group.
    if args.placement.is_some() {
        let ignored = Arc::new(std::sync::atomic::AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGHUP, ignored)?;
    }
    info!(
        buffers = %crate::step::buffer_sizes(&backend.buffers()),
        "joined the group"
    );
    crate::startup::enter(crate::startup::Stage::Ready);
    let driver = Driver::new(
        backend,
        rank,
        p.member.place.world,
        (p.spec.moe_layers.clone(), p.slots.clone()),
        args.metrics_per_expert,
        p.ring,
        args.steps_ahead(p.backend),
    );
    let writer = Reporter::new(stream.try_clone()?);
    let progress = driver.progress();
    let ingress = match (&mut clients, m.ring) {
        (Some(c), Some(ring)) => Some(OwnIngress {
            rows: c.serve(args, writer.clone(), ring, progress.clone())?,
            drain: c.drain.clone(),
            opener: c.opener(),
        }),
        (Some(_), None) => bail!("the step ring was never mapped"),
        (None, _) => None,
    };
    let looped = Follow {
        writer,
        progress,
        silence,
        step_timeout: args.step_timeout,
        ingress,
        abort,
        go_on: m.go_on,
        roster: m.roster,
    }
    .run(stream, driver);
    match clients {
        Some(c) => {
            let failed = looped.as_ref().err().map(|e| format!("{e:#}"));
            let closed = c.finish(failed, args.shutdown_grace);
            looped.and(closed)
        }
        None => looped,
    }
}

/// Reads the leader's messages on a thread of its own, so that a failed group is known at once,
/// even while a step here waits for a lost rank: `abort` ends that wait.
/// Pack orders go straight to `orders` (--ingress all), so this rank packs its rows while
/// the step before runs.
fn read_leader(
    mut stream: TcpStream,
    abort: Arc<Abort>,
    orders: Option<std::sync::mpsc::Sender<PackOrder>>,
) -> anyhow::Result<std::sync::mpsc::Receiver<std::io::Result<Order>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("ctl-leader".into())
        .spawn(move || loop {
            let msg = match (group::recv(&mut stream), &orders) {
                (Ok(Order::Ingress(IngressOrder::Pack { cell, key, homes })), Some(o)) => {
                    let order = PackOrder {
                        cell: cell as usize,
                        key,
                        homes,
                    };
                    let _ = o.send(order);
                    continue;
                }
                (msg, _) => msg,
            };
            let last = match &msg {
                // Ends the waits of the steps in flight now; the step loop reports once they are.
                Ok(Order::Halt { epoch }) => {
                    abort.halt(format!("the leader halted the group (epoch {epoch})"));
                    false
                }
                Ok(Order::Failed { reason, .. }) => {
                    abort.trigger(format!("the EP group stopped: {reason}"));
                    true
                }
                Ok(Order::Shutdown) => true,
                Ok(_) => false,
                Err(e) => {
                    abort.trigger(format!("lost the leader (rank 0): {e}"));
                    true
                }
            };
            if tx.send(msg).is_err() || last {
                return;
            }
        })?;
    Ok(rx)
}

/// The step loop's connections and this rank's share of its clients (--ingress all).
struct Follow {
    /// Sends to the leader (the step loop, the watchdog and the ingress tasks share it).
    writer: Reporter,
    progress: Arc<Progress>,
    /// The leader sends a step or heartbeat at least this often.
    silence: Duration,
    step_timeout: Duration,
    /// --ingress all: this rank's own clients.
    ingress: Option<OwnIngress>,
    abort: Arc<Abort>,
    /// The leader goes on without a lost rank (`--on-rank-loss continue`, told by its first
    /// `Roster`): a step that fails here for want of a peer is reported and dropped, not fatal.
    go_on: bool,
    roster: crate::nodes::Roster,
}

/// What a worker that takes requests (--ingress all) adds to the step loop: its clients' rows
/// in the steps, the drain the leader's signal starts, and the gate that admits requests once the
/// leader says the group is ready.
struct OwnIngress {
    rows: OwnRows,
    drain: tokio_util::sync::CancellationToken,
    opener: Opener,
}

impl OwnIngress {
    /// The leader's `--ingress all` orders that reach the step loop (the reader thread hands
    /// packs to the packer).
    fn obey(&self, order: IngressOrder) -> Next {
        match order {
            IngressOrder::Open { addrs } => self.opener.open(&addrs),
            IngressOrder::Drain => self.drain.cancel(),
            IngressOrder::Pack { .. } => {
                return Next::Fail((None, anyhow!("unexpected control message {order:?}")))
            }
        }
        Next::Go
    }
}

/// What the step loop does after a message from the leader.
enum Next {
    Go,
    Stop,
    Fail(Failed),
}

impl Follow {
    /// Runs each step the leader sends, until told to stop. A step that outlives --step-timeout
    /// (a device call that never returns) ends the process from the watchdog: nothing here could.
    /// Up to the driver's depth of steps are in flight: a step the leader sends while the one
    /// before runs is submitted at once (a GPU rank queues it behind), and the oldest is completed
    /// when done, or first, when no more may start.
    fn run<B: Backend>(mut self, stream: TcpStream, mut driver: Driver<B>) -> anyhow::Result<()> {
        let rank = driver.rank;
        let (report, step_timeout) = (self.writer.clone(), self.step_timeout);
        watchdog::watch_steps(self.progress.clone(), step_timeout, move |d| {
            let reason = format!("a step has run {d:.1?}, past --step-timeout {step_timeout:?}");
            let _ = report.send(&Report::Failed {
                rank,
                reason: reason.clone(),
            });
            watchdog::exit_now(1, &reason);
        })?;
        let orders = self.ingress.as_ref().and_then(|i| i.rows.orders());
        let messages = read_leader(stream, self.abort.clone(), orders)?;
        let depth = driver.depth();
        let mut flight: VecDeque<Running> = VecDeque::with_capacity(depth);
        let mut polls = 0u32;
        let (tell, e): Failed = loop {
            if !flight.is_empty() {
                // An error here is the step's own: completing it reports it.
                let done = flight.len() >= depth || driver.ready().unwrap_or(true);
                if done {
                    polls = 0;
                    match self.complete(&mut driver, &mut flight) {
                        Ok(()) => continue,
                        Err(e) => break e,
                    }
                }
            }
            let msg = match flight.is_empty() {
                true => messages
                    .recv()
                    .unwrap_or_else(|_| Err(std::io::ErrorKind::UnexpectedEof.into())),
                false => match messages.try_recv() {
                    Ok(msg) => msg,
                    Err(TryRecvError::Empty) => {
                        nap(&mut polls);
                        continue;
                    }
                    Err(TryRecvError::Disconnected) => {
                        Err(std::io::ErrorKind::UnexpectedEof.into())
                    }
                },
            };
            match self.on_message(msg, &mut driver, &mut flight) {
                Next::Go => {}
                Next::Stop => return Ok(()),
                Next::Fail(f) => break f,
            }
        };
        if let Some(tell) = tell {
            let _ = self.writer.send(&tell);
        }
        // This rank's own rows in steps that will not finish.
        let why = Failure::unavailable("broken", format!("EP group broken: {e:#}"));
        for r in flight.drain(..) {
            if let Some(step) = r.mine {
                step.fail(&why);
            }
        }
        Err(e)
    }

    /// What one message from the leader does: a step is submitted, the others change what this
    /// rank serves, stop it, or end the group.
    fn on_message<B: Backend>(
        &mut self,
        msg: std::io::Result<Order>,
        driver: &mut Driver<B>,
        flight: &mut VecDeque<Running>,
    ) -> Next {
        let silence = self.silence;
        match msg {
            Ok(Order::Step(desc)) => match self.submit(driver, flight, desc) {
                Ok(()) => Next::Go,
                Err(e) => Next::Fail(e),
            },
            Ok(Order::Shutdown) => {
                // The leader asks only once every step is answered: nothing is in flight.
                info!("leader asked to stop; exiting");
                Next::Stop
            }
            Ok(Order::Ingress(order)) => match &self.ingress {
                Some(i) => i.obey(order),
                None => Next::Fail((None, anyhow!("unexpected control message {order:?}"))),
            },
            Ok(Order::Failed { reason, .. }) => {
                Next::Fail((None, anyhow!("the EP group stopped: {reason}")))
            }
            Ok(Order::Placement {
                epoch,
                phy2log,
                lost,
            }) => {
                self.stage(driver, epoch, phy2log, lost);
                Next::Go
            }
            Ok(Order::Halt { epoch }) => {
                // Every step in flight ends (their waits were ended by the reader thread).
                let ended = driver.abandon() + flight.len();
                flight.clear();
                info!(epoch, ended, "halted by the leader");
                match self.writer.send(&Report::Halted {
                    rank: driver.rank,
                    epoch,
                }) {
                    Ok(()) => Next::Go,
                    Err(e) => Next::Fail((None, anyhow!("telling the leader: {e}"))),
                }
            }
            Ok(Order::Rejoin { rank, pid, nccl_id }) => {
                let error = driver.rejoin(rank, nccl_id.as_deref()).err();
                if let Some(seat) = self.roster.0.get_mut(rank) {
                    seat.pid = pid;
                }
                match &error {
                    None => info!(rank, "mapped rejoining rank {rank}'s segment"),
                    Some(e) => tracing::warn!(rank, "rejoining rank {rank}: {e}"),
                }
                let report = Report::Rejoined {
                    rank: driver.rank,
                    of: rank,
                    error,
                };
                match self.writer.send(&report) {
                    Ok(()) => Next::Go,
                    Err(e) => Next::Fail((None, anyhow!("telling the leader: {e}"))),
                }
            }
            Ok(Order::Roster { epoch, lost }) => {
                // A roster after a rank came back follows steps that ran without a halt: they
                // finish on the group they started in (a GPU rank regroups with none in flight).
                while !flight.is_empty() {
                    if let Err(f) = self.complete(driver, flight) {
                        return Next::Fail(f);
                    }
                }
                self.go_on = true;
                for r in 0..self.roster.world() {
                    if !lost.contains(&(r as u32)) {
                        self.abort.unfence(r);
                    }
                }
                for &r in &lost {
                    self.abort.fence(r as usize);
                    if let Some(said) = self.roster.fence(driver.rank, r as usize) {
                        tracing::warn!("{said}");
                    }
                }
                if let Err(e) = driver.backend.regroup(&lost) {
                    return Next::Fail((None, anyhow!("going on without ranks {lost:?}: {e}")));
                }
                if epoch > 0 {
                    info!(epoch, ?lost, "the group goes on");
                }
                self.abort.resume();
                Next::Go
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Next::Fail((
                    None,
                    anyhow!(
                        "the leader (rank 0) sent nothing for {silence:?}: it is stuck or gone"
                    ),
                ))
            }
            Err(e) => Next::Fail((
                None,
                anyhow!("lost the connection to the leader (rank 0): {e}"),
            )),
        }
    }

    /// Stages a new expert placement off the step loop and tells the leader when it is staged;
    /// a placement this rank cannot take is refused to the leader, which keeps the old one.
    fn stage<B: Backend>(
        &self,
        driver: &mut Driver<B>,
        epoch: u32,
        phy2log: Vec<Vec<u32>>,
        lost: Vec<u32>,
    ) {
        let (rank, writer) = (driver.rank, self.writer.clone());
        let done = Box::new(move |r: Result<u64, String>| {
            let (bytes, error) = match r {
                Ok(b) => (b, None),
                Err(e) => (0, Some(e)),
            };
            let _ = writer.send(&Report::Staged {
                rank,
                epoch,
                bytes,
                error,
            });
        });
        let map = driver.map().1.clone();
        match SlotMap::without(map.experts, map.world, phy2log, lost) {
            Ok(next)
                if next.slots() == map.slots() && next.layers().len() == map.layers().len() =>
            {
                driver.stage(epoch, next, done)
            }
            Ok(_) => done(Err("the placement's shape differs from the group's".into())),
            Err(e) => done(Err(e)),
        }
    }

    /// Submits a step behind those in flight, with this rank's own rows when it brought some.
    /// A failure comes with what to tell the leader.
    fn submit<B: Backend>(
        &mut self,
        driver: &mut Driver<B>,
        flight: &mut VecDeque<Running>,
        desc: StepDesc,
    ) -> Result<(), Failed> {
        let rank = driver.rank;
        let mine = match &mut self.ingress {
            Some(i) => i.rows.before(&desc).map_err(|e| {
                let reason = format!("step {}: {e}", desc.step);
                (
                    Some(Report::Failed { rank, reason }),
                    anyhow::Error::new(e).context(format!("step {}", desc.step)),
                )
            })?,
            None => None,
        };
        let r = driver.submit(&desc);
        match r {
            Ok(()) => {
                flight.push_back(Running { desc, mine });
                Ok(())
            }
            Err(e) => self.dropped(rank, e, Running { desc, mine }, flight),
        }
    }

    /// A step failed here. While the group halts, or where it goes on without a lost rank
    /// and the step failed for want of a peer, the step is dropped (its rows run again after
    /// the halt) and the leader told; otherwise the group is broken.
    fn dropped(
        &self,
        rank: usize,
        e: StepError,
        failed: Running,
        flight: &mut VecDeque<Running>,
    ) -> Result<(), Failed> {
        let peer = matches!(
            e,
            StepError::Wait { .. } | StepError::Timeout { .. } | StepError::DataLink { .. }
        );
        if self.abort.halting().is_some() && peer {
            tracing::debug!(step = failed.desc.step, "ended by the halt: {e}");
            return Ok(());
        }
        if self.go_on && peer {
            let reason = e.to_string();
            tracing::warn!("{reason}; waiting for the leader to halt the group");
            self.abort.halt(reason.clone());
            return match self.writer.send(&Report::StepFailed { rank, reason }) {
                Ok(()) => Ok(()),
                Err(w) => Err((None, anyhow!("telling the leader: {w}"))),
            };
        }
        flight.push_front(failed);
        Err(broken(rank, e, flight))
    }

    /// Completes the oldest step in flight and hands this rank's own rows in it to delivery.
    fn complete<B: Backend>(
        &mut self,
        driver: &mut Driver<B>,
        flight: &mut VecDeque<Running>,
    ) -> Result<(), Failed> {
        let r = driver.complete().expect("a step in flight");
        match r {
            Ok(_) => {
                let done = flight.pop_front().expect("a step in flight");
                if let (Some(i), Some(step)) = (&mut self.ingress, done.mine) {
                    i.rows.after(step, done.desc.cell as usize);
                }
                Ok(())
            }
            Err(e) => {
                let failed = flight.pop_front().expect("a step in flight");
                self.dropped(driver.rank, e, failed, flight)
            }
        }
    }
}

/// What a failed step tells the leader (None: nothing), and the error this rank exits with.
type Failed = (Option<Report>, anyhow::Error);

/// A step submitted on this rank and not yet completed.
struct Running {
    desc: StepDesc,
    /// This rank's own rows in it (--ingress all).
    mine: Option<Step>,
}

/// A step failed: this rank's own rows in every step in flight fail with it (INTERNAL for a
/// wrong result, UNAVAILABLE otherwise), and the leader is told.
fn broken(rank: usize, e: StepError, flight: &mut VecDeque<Running>) -> Failed {
    let reason = e.to_string();
    let why = format!("EP group broken: {reason}");
    let why = match &e {
        StepError::Corrupt { .. } => Failure::Wrong(why),
        _ => Failure::unavailable("broken", why),
    };
    for r in flight.drain(..) {
        if let Some(step) = r.mine {
            step.fail(&why);
        }
    }
    let tell = match e {
        StepError::Corrupt { .. } => Report::Corrupt { rank, reason },
        _ => Report::Failed { rank, reason },
    };
    (Some(tell), e.into())
}
