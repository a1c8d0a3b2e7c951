//! The leader's step pipeline. Up to one step per ring cell is in flight: a packer thread writes a
//! step's input into a free cell, the executor thread publishes it, sends the descriptor to every
//! rank, runs its own share and waits for every rank's output, and a delivery thread reads the
//! outputs and answers the finished requests, then frees the cell. So while the ranks run step N,
//! step N+1 is being packed and step N-1's answers delivered. Steps complete in order; up to the
//! driver's depth of them are on the ranks at once (`--steps-ahead`).

use std::collections::VecDeque;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_util::sync::CancellationToken;

mod recover;
mod rejoin;
mod watch;

use watch::Watch;

pub use recover::RosterView;

use super::coordinator::Offer;
use super::job::{Job, Segment, Step};
use super::pace::Pace;
use super::pipeline::{Delivery, Share};
use super::redo::Redo;
use super::rows::{copy_threads, deliver, out_bufs, pack};
use crate::dtype::Dtype;
use crate::eplb::Balance;
use crate::group::{ControlLink, GroupError, IngressOrder, Order};
use crate::lifecycle::{nap, Abort};
use crate::metric_names;
use crate::request::{Data, Failure, JobInput, Rows};
use crate::step::ring::Ring;
use crate::step::{Backend, Driver, PhaseTimes, StepDesc, StepError};
use crate::sys::shm::WaitError;
use crate::transport::bufs::Bufs;
use crate::watchdog::{AbortOnPanic, Progress};

#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Group(#[from] GroupError),
    #[error("the EP group broke: {0}")]
    Broken(String),
    /// The group is halting for a lost rank (`--on-rank-loss continue`).
    #[error("halted: {0}")]
    Halted(String),
    #[error("step {step}: rank {rank} did not finish: {reason}")]
    Output {
        step: u64,
        rank: usize,
        reason: String,
    },
}

/// The leader's control connections after startup, shared by the step executor and the drain.
#[derive(Clone)]
pub struct Control(Arc<Mutex<ControlLink>>);

impl Control {
    /// Sends `msg` to every rank in the group; whole frames, never interleaved with another
    /// sender's.
    pub fn broadcast(&self, msg: &Order) -> Result<(), GroupError> {
        self.hold().broadcast(msg)
    }

    /// The link held: what is sent through the guard goes out before any other sender's order.
    fn hold(&self) -> std::sync::MutexGuard<'_, ControlLink> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes a step's descriptor and sends it to every rank under one hold of the link, so no
    /// order sent while `make` runs goes out before the step. `make` stamps the step's
    /// placement, and the stamp that applies one lets the balancer offer the next: that order
    /// must reach every rank after the step that applies this one, or a rank drops what it
    /// staged for the step (2x H100, SIGHUP placements under load: the group broke twice in 23
    /// placements, "placement epoch 2 was never staged here").
    fn send_made(
        &self,
        make: impl FnOnce() -> Result<StepDesc, ExecutorError>,
    ) -> Result<StepDesc, ExecutorError> {
        let mut held = self.hold();
        let desc = make()?;
        held.broadcast(&Order::Step(desc.clone()))?;
        Ok(desc)
    }

    /// `rank` is back on `stream` (`ControlLink::readmit`).
    pub fn readmit(&self, rank: usize, stream: TcpStream) -> Result<(), GroupError> {
        self.hold().readmit(rank, stream)
    }

    /// Takes `rank` out of the group (`ControlLink::lose`).
    pub fn lose(&self, rank: usize) {
        self.hold().lose(rank)
    }
}

/// What the other ranks send the leader after startup besides failures (`--ingress all`).
#[derive(Clone)]
pub struct PeerEvents {
    pub offers: mpsc::UnboundedSender<(usize, Offer)>,
    /// A rank was signalled: the group drains.
    pub drain: CancellationToken,
    /// One permit per rank whose admitted requests are all answered, after a drain.
    pub drained: Arc<tokio::sync::Semaphore>,
}

pub struct Executor<B> {
    driver: Driver<B>,
    ring: Arc<Ring>,
    link: Control,
    abort: Arc<Abort>,
    /// Set before a deliberate stop, so the ranks' disconnects are not read as failures.
    closing: Arc<AtomicBool>,
    step_timeout: Duration,
    seq: u64,
    /// The driver's: whether a step is running, and since when.
    pub progress: Arc<Progress>,
    /// Its steps' packing, start and end, for the batcher.
    pub pace: Arc<Pace>,
    bufs: Arc<Bufs>,
    /// The expert placement and the load it is balanced from.
    balance: Arc<Balance>,
    /// `--on-rank-loss continue`: what the group goes on without, and how.
    loss: Option<recover::Loss>,
}

impl<B: Backend> Executor<B> {
    pub fn new(
        driver: Driver<B>,
        ring: Arc<Ring>,
        link: ControlLink,
        abort: Arc<Abort>,
        step_timeout: Duration,
        events: Option<PeerEvents>,
        // The placement, and (`--on-rank-loss continue`) where a lost rank's steps go back.
        (balance, redo): (Arc<Balance>, Option<Arc<Redo>>),
    ) -> Result<Self, GroupError> {
        let stride = ring.shape.home_stride();
        let (heard_tx, heard) = std::sync::mpsc::channel();
        let heard_tx = redo.is_some().then_some(heard_tx);
        // A rank that reports failure or disconnects breaks the group at once, instead of
        // leaving the leader to find out at the step timeout.
        let closing = Arc::new(AtomicBool::new(false));
        for (i, w) in link.workers.iter().enumerate() {
            let watch = Watch {
                rank: i + 1,
                stride,
                events: events.clone(),
                balance: balance.clone(),
                heard: heard_tx.clone(),
            };
            watch.spawn(w, abort.clone(), closing.clone())?;
        }
        recover::export_roster(link.roster.world());
        let loss = match (redo, heard_tx) {
            (Some(redo), Some(tx)) => {
                Some(recover::Loss::new(redo, (tx, heard), link.roster.clone()))
            }
            _ => None,
        };
        Ok(Self {
            loss,
            progress: driver.progress(),
            pace: Arc::default(),
            bufs: out_bufs(&ring),
            driver,
            ring,
            link: Control(Arc::new(Mutex::new(link))),
            abort,
            closing,
            step_timeout,
            seq: 0,
            balance,
        })
    }

    /// The expert placement every step runs on, and the load over the window.
    pub fn balance(&self) -> Arc<Balance> {
        self.balance.clone()
    }

    /// The placement epoch of the next step: a proposal is first handed to this rank's backend
    /// to stage (the other ranks got it from the balancer), and once every rank has staged it,
    /// the next step carries it.
    fn stamp(&mut self) -> u32 {
        if let Some((epoch, next)) = self.balance.take_own() {
            let balance = self.balance.clone();
            let done = Box::new(move |r| balance.staged(0, epoch, r));
            self.driver.stage(epoch, (*next).clone(), done);
        }
        self.balance.stamp()
    }

    /// The group's epoch and the ranks out of it (`--on-rank-loss continue`).
    pub fn roster_view(&self) -> Option<recover::RosterView> {
        self.loss.as_ref().map(recover::Loss::view)
    }

    /// The control connections, for the drain to tell every rank.
    pub fn control(&self) -> Control {
        self.link.clone()
    }

    /// Starts `step` (packed into `cell` already) through the whole group: publishes its input,
    /// sends its descriptor to every rank and submits this rank's share, behind the steps in
    /// flight. It joins `flight` first, so that a failure to start fails it with the rest.
    fn start(
        &mut self,
        flight: &mut VecDeque<SentStep>,
        step: Step,
        cell: usize,
        heartbeat: Option<OwnedSemaphorePermit>,
    ) -> Result<(), ExecutorError> {
        let now = Instant::now();
        let formed = heartbeat.is_none();
        // Heartbeats get no span: one a second would drown the traces.
        let _span = (!step.segments.is_empty()).then(|| {
            tracing::info_span!("step", step = self.seq + 1, tokens = step.tokens()).entered()
        });
        flight.push_back(SentStep {
            step,
            cell,
            heartbeat,
            seq: self.seq + 1,
            // One deadline for the whole step, whichever wait it ends up in.
            deadline: now + self.step_timeout,
            own: None,
            lost: self
                .loss
                .as_ref()
                .map(|l| l.lost.clone())
                .unwrap_or_default(),
        });
        let f = flight.back().expect("pushed just now");
        if let Some(reason) = self.abort.reason() {
            return Err(ExecutorError::Output {
                step: f.seq,
                rank: 0,
                reason,
            });
        }
        if let Some(reason) = self.abort.halting() {
            return Err(ExecutorError::Halted(reason));
        }
        self.seq += 1;
        let link = self.link.clone();
        let desc = link.send_made(|| {
            let desc = StepDesc {
                step: self.seq,
                layer: f.step.layer as u32,
                tokens: f.step.group_tokens() as u32,
                cell: cell as u32,
                client_routing: f.step.client_routing,
                input: f.step.input,
                output: f.step.output,
                homes: f.step.homes.clone(),
                placement: self.stamp(),
                lost: f.lost.clone(),
            };
            self.ring
                .publish_input(&desc)
                .map_err(ExecutorError::Broken)?;
            Ok(desc)
        })?;
        self.driver.submit(&desc)?;
        if formed {
            self.pace.submitted();
        }
        Ok(())
    }

    /// Starts a packed step, unless it was formed before a rank was lost and carries more
    /// tokens than the ranks left have room for: its rows then go back to the batcher, which
    /// forms smaller steps, and its cell and permit come back.
    fn start_fitting(
        &mut self,
        flight: &mut VecDeque<SentStep>,
        step: Step,
        cell: usize,
        (free, in_flight): (&FreeCells, &tokio::sync::Semaphore),
    ) -> Result<(), ExecutorError> {
        match &self.loss {
            Some(loss) if step.group_tokens() > loss.cap() => {
                loss.give_back(step.segments);
                free.put(cell);
                in_flight.add_permits(1);
                metrics::gauge!(metric_names::STEPS_IN_FLIGHT).decrement(1.0);
                Ok(())
            }
            _ => self.start(flight, step, cell, None),
        }
    }

    /// This rank's own share of step `seq` failed. Where it timed out waiting on a peer, that
    /// peer may be a healthy one waiting on a lost rank (a node-mate relaying a stopped node's
    /// rows: "waiting for combined rows from rank 1" with ranks 2 and 3 stopped), so the other
    /// ranks whose outputs are still missing are named too, as for a missing output.
    fn own_failed(&self, e: StepError, seq: u64, cell: usize, lost: &[u32]) -> ExecutorError {
        let rank = match &e {
            StepError::Wait { rank, .. } => *rank,
            StepError::Timeout { .. } => 0,
            _ => return e.into(),
        };
        let missing = (self.ring.missing_outputs(cell, (seq, lost))).filter(|&r| r != 0);
        match unfinished(&e, missing) {
            Some(reason) => ExecutorError::Output {
                step: seq,
                rank,
                reason,
            },
            None => e.into(),
        }
    }

    /// Finishes the oldest step in flight once this rank's share and every other rank's output
    /// are done: waiting for them (bounded by the step's deadline) when `wait`, otherwise only
    /// looking (None: not yet).
    fn finish(
        &mut self,
        f: &mut SentStep,
        wait: bool,
    ) -> Result<Option<PhaseTimes>, ExecutorError> {
        // Past the deadline the waits below say which rank is missing and why.
        let wait = wait || Instant::now() >= f.deadline;
        // The ranks out of the group when the step started, not now: a rank back since took
        // no part in it.
        let lost = f.lost.clone();
        let seq = (f.seq, &lost[..]);
        if f.own.is_none() {
            if !wait && !self.driver.ready()? {
                return Ok(None);
            }
            let (desc, times) = match self.driver.complete().expect("a step in flight") {
                Ok(done) => done,
                Err(e) => return Err(self.own_failed(e, f.seq, f.cell, &lost)),
            };
            let routed = self.driver.backend.routed();
            self.balance
                .record(desc.layer as usize, desc.placement, routed);
            f.own = Some(times);
        }
        // Every rank still missing, not only the first: a healthy rank waiting on a lost one
        // misses the deadline too, and may come first.
        let output = |rank, e: WaitError| {
            let missing = self.ring.missing_outputs(f.cell, seq);
            let reason = unfinished(&e, missing).unwrap_or_else(|| e.to_string());
            ExecutorError::Output {
                step: f.seq,
                rank,
                reason,
            }
        };
        if wait {
            self.ring
                .wait_outputs(f.cell, seq, f.deadline, &self.abort)
                .map_err(|(rank, e)| output(rank, e))?;
        } else if let Some(rank) = self.ring.missing_outputs(f.cell, seq).next() {
            return match self.abort.stop_reason() {
                Some(r) => Err(output(rank, WaitError::Aborted(r))),
                None => Ok(None),
            };
        }
        Ok(f.own)
    }

    /// Serves steps until the batcher closes the channel (drain) or a step fails (group broken).
    /// `in_flight` holds one permit per ring cell: the batcher takes one per step, and it comes
    /// back once the step is delivered. Up to the driver's depth of steps run at once: the next
    /// packed step is sent to the ranks while the one before runs, so a GPU rank queues its
    /// copies and launches behind it instead of idling for a round trip. When idle for
    /// `heartbeat`, runs an empty step through every rank, so a lost or stopped rank is found
    /// within the step timeout even without traffic. Either way the ranks are told to stop.
    pub fn serve(
        mut self,
        steps: mpsc::Receiver<Step>,
        in_flight: Arc<tokio::sync::Semaphore>,
        runtime: tokio::runtime::Handle,
        heartbeat: Duration,
    ) -> Result<(), ExecutorError> {
        let free = Arc::new(FreeCells::new(self.ring.shape.cells));
        let depth = self.ring.shape.cells;
        let (packed_tx, packed) = std::sync::mpsc::sync_channel::<(Step, usize)>(depth);
        let packer = {
            let (ring, free, abort) = (self.ring.clone(), free.clone(), self.abort.clone());
            let (control, pace) = (self.link.clone(), self.pace.clone());
            std::thread::Builder::new()
                .name("step-pack".into())
                .spawn(move || {
                    let to = Packer {
                        ring: &ring,
                        free: &free,
                        control: &control,
                        pace: &pace,
                        abort: &abort,
                    };
                    to.run(steps, packed_tx, &runtime)
                })
                .map_err(|e| ExecutorError::Broken(format!("spawning the packer: {e}")))?
        };
        // Each finished step's requests answered, then its cell and permit given back.
        let delivery = {
            let (free, permits) = (free.clone(), in_flight.clone());
            let release = move |cell| {
                free.put(cell);
                permits.add_permits(1);
                metrics::gauge!(metric_names::STEPS_IN_FLIGHT).decrement(1.0);
            };
            let guard = AbortOnPanic(self.abort.clone(), "the step delivery panicked");
            let (ring, bufs) = (self.ring.clone(), self.bufs.clone());
            Delivery::start(ring, Share::Leader, bufs, release, Some(guard))
                .map_err(|e| ExecutorError::Broken(format!("spawning the delivery: {e}")))?
        };
        let ahead = self.driver.depth();
        let mut flight: VecDeque<SentStep> = VecDeque::with_capacity(ahead);
        let (mut polls, mut closed) = (0u32, false);
        // Idle, the executor looks this often for a halt (a rank lost between steps).
        let poll = match self.loss {
            Some(_) => heartbeat.min(Duration::from_millis(50)),
            None => heartbeat,
        };
        let mut idle_since = Instant::now();
        // A rank back at the door: no step starts until those in flight are done, then it
        // rejoins between steps (a GPU rank's graphs are captured again at its roster).
        let mut comer = None;
        let result = loop {
            comer = comer.take().or_else(|| self.comer());
            if let Some(c) = comer.take_if(|_| flight.is_empty()) {
                let rank = c.rank;
                match self.rejoin(c) {
                    Err(e) if self.abort.reason().is_some() => {
                        break Err(self.fail_all(e, &mut flight, &free, &in_flight))
                    }
                    Err(e) => tracing::warn!(rank, "{e}; rank {rank} stays out of the group"),
                    Ok(()) => {}
                }
            }
            // Start every step there is room for before finishing the oldest: a GPU rank only
            // queues it, and the sooner it is queued the less its GPU idles.
            let started = if comer.is_some() {
                Ok(false)
            } else if flight.is_empty() {
                match packed.recv_timeout(poll) {
                    Ok((step, cell)) => {
                        idle_since = Instant::now();
                        self.start_fitting(&mut flight, step, cell, (&free, &in_flight))
                    }
                    Err(RecvTimeoutError::Disconnected) => break Ok(()),
                    Err(RecvTimeoutError::Timeout) if self.abort.halting().is_some() => Err(
                        ExecutorError::Halted("a rank was lost between steps".into()),
                    ),
                    Err(RecvTimeoutError::Timeout) if idle_since.elapsed() < heartbeat => continue,
                    Err(RecvTimeoutError::Timeout) => {
                        idle_since = Instant::now();
                        // Idle: an empty step through every rank finds a lost one, unless a step
                        // is on its way (that one will).
                        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                            continue;
                        };
                        let cell = free.take();
                        self.start(&mut flight, Step::empty(), cell, Some(permit))
                    }
                }
                .map(|()| true)
            } else if flight.len() < ahead && !closed {
                match packed.try_recv() {
                    Ok((step, cell)) => self
                        .start_fitting(&mut flight, step, cell, (&free, &in_flight))
                        .map(|()| true),
                    Err(TryRecvError::Empty) => Ok(false),
                    Err(TryRecvError::Disconnected) => {
                        closed = true;
                        Ok(false)
                    }
                }
            } else {
                Ok(false)
            };
            match started {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => match self.recover(e, &mut flight, &free, &in_flight) {
                    Ok(()) => continue,
                    Err(e) => break Err(self.fail_all(e, &mut flight, &free, &in_flight)),
                },
            }
            // Block only when no other step could start meanwhile.
            let wait = flight.len() >= ahead || closed || comer.is_some();
            let Some(front) = flight.front_mut() else {
                continue;
            };
            match self.finish(front, wait) {
                Ok(Some(times)) => {
                    polls = 0;
                    if let Some(loss) = &mut self.loss {
                        loss.fruitless = 0;
                    }
                    let f = flight.pop_front().expect("the front");
                    if f.heartbeat.is_some() {
                        free.put(f.cell);
                        continue;
                    }
                    tracing::debug!(
                        tokens = f.step.tokens(),
                        padding = times.padding,
                        ms = times.total.as_secs_f64() * 1e3,
                        "step"
                    );
                    self.pace.finished(times.total);
                    delivery.send(f.step, f.cell);
                }
                Ok(None) => nap(&mut polls),
                Err(e) => match self.recover(e, &mut flight, &free, &in_flight) {
                    Ok(()) => continue,
                    Err(e) => break Err(self.fail_all(e, &mut flight, &free, &in_flight)),
                },
            }
        };
        self.progress.end();
        // Steps packed behind a failed one never run; the packer fails the rest of the queue.
        while let Ok((step, _)) = packed.try_recv() {
            fail_step(&step, &self.abort);
        }
        drop(packed);
        // Answers every finished step before the ranks are told to stop.
        drop(delivery);
        if result.is_ok() {
            let _ = packer.join();
        }
        // A clean drain stops the ranks with exit 0; a broken group makes them fail too.
        let broken = self.abort.reason();
        self.closing.store(true, Ordering::Release);
        let msg = match &broken {
            None if result.is_ok() => Order::Shutdown,
            reason => Order::Failed {
                rank: 0,
                reason: reason.clone().unwrap_or_default(),
            },
        };
        let _ = self.link.broadcast(&msg);
        match (result, broken) {
            (Ok(()), Some(reason)) => Err(ExecutorError::Broken(reason)),
            (result, _) => result,
        }
    }

    /// Breaks the group for a failed step and fails every step in flight with it (INTERNAL for a
    /// wrong result, UNAVAILABLE for a lost rank), giving back their cells and permits.
    fn fail_all(
        &self,
        e: ExecutorError,
        flight: &mut VecDeque<SentStep>,
        free: &FreeCells,
        in_flight: &tokio::sync::Semaphore,
    ) -> ExecutorError {
        let why = if matches!(e, ExecutorError::Step(StepError::Corrupt { .. })) {
            self.abort.trigger_corrupt(e.to_string());
            Failure::Wrong(format!("EP group broken: {e}"))
        } else {
            self.abort.trigger(e.to_string());
            Failure::unavailable("broken", format!("EP group broken: {e}"))
        };
        for f in flight.drain(..) {
            f.step.fail(&why);
            free.put(f.cell);
            if f.heartbeat.is_none() {
                in_flight.add_permits(1);
                metrics::gauge!(metric_names::STEPS_IN_FLIGHT).decrement(1.0);
            }
        }
        e
    }

    /// The readiness step: a few tokens of known data through every rank and phase. Under
    /// `--on-rank-loss continue` the ranks hear first that the group goes on without a lost
    /// rank (the roster of epoch 0).
    pub fn warm_up(&mut self) -> Result<(), ExecutorError> {
        if self.loss.is_some() {
            let roster = Order::Roster {
                epoch: 0,
                lost: Vec::new(),
            };
            self.link.broadcast(&roster)?;
        }
        let tokens = self.ring.shape.world;
        let hidden: Vec<f32> = (0..tokens * self.ring.shape.hidden)
            .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
            .collect();
        let input = JobInput {
            id: "warm-up".into(),
            layer: 0,
            tokens,
            hidden: Rows {
                dtype: Dtype::F32,
                data: Data::Host(crate::dtype::encode(&hidden, Dtype::F32).into()),
            },
            output: Dtype::F32,
            routing: None,
            deadline: None,
            output_to: None,
        };
        let (job, mut rx) = Job::new(input, None);
        let step = Step {
            segments: vec![Segment {
                job,
                rows: 0..tokens,
            }],
            ..Step::empty()
        };
        pack(&self.ring, &step, 0, 0, 1, 0..0);
        let mut flight = VecDeque::with_capacity(1);
        let r = self.start(&mut flight, step, 0, None);
        let f = flight.front_mut().expect("started");
        r.and_then(|()| self.finish(f, true))?;
        deliver(&self.ring, &f.step, 0, 0, 1, &self.bufs, 0..0);
        let finite = |out: &[u8]| crate::dtype::first_non_finite(Dtype::F32, out).is_none();
        match rx.try_recv() {
            Ok(Ok(out)) if finite(&out) => Ok(()),
            _ => Err(ExecutorError::Output {
                step: self.seq,
                rank: 0,
                reason: "warm-up step produced no finite output".into(),
            }),
        }
    }
}

/// A step sent to the ranks and not yet finished.
struct SentStep {
    step: Step,
    cell: usize,
    /// An idle heartbeat's hold on its cell (it delivers nothing).
    heartbeat: Option<OwnedSemaphorePermit>,
    seq: u64,
    deadline: Instant,
    /// This rank's share, once completed.
    own: Option<PhaseTimes>,
    /// The ranks out of the group it ran without (`StepDesc::lost`).
    lost: Vec<u32>,
}

/// The ring cells not held by a step in flight. A step holds an `in_flight` permit before it
/// takes a cell and gives the cell back before the permit, so a permit holder always finds one.
struct FreeCells(Mutex<Vec<usize>>);

impl FreeCells {
    fn new(n: usize) -> Self {
        Self(Mutex::new((0..n).rev().collect()))
    }

    fn take(&self) -> usize {
        let mut free = self.0.lock().unwrap_or_else(|e| e.into_inner());
        free.pop()
            .expect("a step holding a permit finds a free cell")
    }

    fn put(&self, cell: usize) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(cell);
    }
}

/// The packer's share of the executor's state.
struct Packer<'a> {
    ring: &'a Ring,
    free: &'a FreeCells,
    control: &'a Control,
    pace: &'a Pace,
    abort: &'a Arc<Abort>,
}

impl Packer<'_> {
    /// Each step from the batcher into a free cell, on to the executor. Under --ingress all the
    /// other ranks are told the cell first (`IngressOrder::Pack`), so they pack their rows while the step
    /// before runs, as this thread does. When the executor is gone (the group broke), the step
    /// in hand and every later one fail.
    fn run(
        &self,
        mut steps: mpsc::Receiver<Step>,
        packed: std::sync::mpsc::SyncSender<(Step, usize)>,
        runtime: &tokio::runtime::Handle,
    ) {
        let abort = self.abort;
        let _guard = AbortOnPanic(abort.clone(), "the step packer panicked");
        let threads = copy_threads();
        while let Some(step) = runtime.block_on(steps.recv()) {
            let cell = self.free.take();
            let t0 = Instant::now();
            if step.homes.iter().skip(1).any(|&n| n > 0) {
                let order = Order::Ingress(IngressOrder::Pack {
                    cell: cell as u32,
                    key: step.key(),
                    homes: step.homes.clone(),
                });
                if let Err(e) = self.control.broadcast(&order) {
                    abort.trigger(format!("sending a step's cell to the ranks: {e}"));
                }
            }
            Share::Leader.pack(self.ring, &step, cell, threads);
            self.pace.packed(t0.elapsed());
            if let Err(std::sync::mpsc::SendError((step, _))) = packed.send((step, cell)) {
                fail_step(&step, abort);
                break;
            }
        }
        steps.close();
        while let Ok(step) = steps.try_recv() {
            fail_step(&step, abort);
        }
    }
}

fn fail_step(step: &Step, abort: &Abort) {
    let why = abort
        .reason()
        .unwrap_or_else(|| "the step executor stopped".into());
    step.fail(&Failure::unavailable(
        "broken",
        format!("EP group broken: {why}"),
    ));
}

/// `why`, naming the ranks that had not finished a step where more than one had not: a healthy
/// rank waiting on a lost one misses the deadline too, and may be the one waited on.
fn unfinished(why: &dyn std::fmt::Display, missing: impl Iterator<Item = usize>) -> Option<String> {
    let missing: Vec<String> = missing.map(|r| r.to_string()).collect();
    (missing.len() > 1).then(|| format!("{why} (ranks {} had not finished)", missing.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodes::{RankNode, Roster};

    fn desc(placement: u32) -> StepDesc {
        StepDesc {
            step: 7,
            layer: 0,
            tokens: 4,
            cell: 0,
            client_routing: false,
            input: Dtype::F32,
            output: Dtype::F32,
            homes: vec![],
            placement,
            lost: vec![],
        }
    }

    /// A leader's link to one other rank over loopback, and that rank's end.
    fn link() -> (Control, TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let rank1 = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (to_rank1, _) = listener.accept().unwrap();
        let node = |_| RankNode {
            node: "n0".into(),
            data: String::new(),
            pid: 0,
        };
        let link = ControlLink {
            workers: vec![to_rank1],
            roster: Roster((0..2).map(node).collect()),
            out: vec![false; 2],
            go_on: false,
        };
        rank1
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        (Control(Arc::new(Mutex::new(link))), rank1)
    }

    /// The balancer's next placement, offered once a step's stamp has applied this one (here:
    /// while the step is made), reaches the rank after that step, however long the step takes
    /// to make and send.
    #[test]
    fn an_order_sent_while_a_step_is_made_follows_the_step() {
        let (control, mut rank1) = link();
        let (stamped, offered) = std::sync::mpsc::channel();
        let balancer = control.clone();
        let next = std::thread::spawn(move || {
            offered.recv().unwrap();
            let order = Order::Placement {
                epoch: 3,
                phy2log: vec![],
                lost: vec![],
            };
            balancer.broadcast(&order)
        });
        let sent = control
            .send_made(|| {
                stamped.send(()).unwrap();
                // Publishing the input and everything else between the stamp and the send.
                std::thread::sleep(Duration::from_millis(200));
                Ok(desc(2))
            })
            .unwrap();
        assert_eq!(sent, desc(2));
        next.join().unwrap().unwrap();
        let first: Order = crate::group::recv(&mut rank1).unwrap();
        assert!(
            matches!(&first, Order::Step(d) if d.placement == 2),
            "{first:?}"
        );
        let second: Order = crate::group::recv(&mut rank1).unwrap();
        assert!(
            matches!(&second, Order::Placement { epoch: 3, .. }),
            "{second:?}"
        );
    }

    /// A step that cannot be made sends nothing, and the link is free for the next sender.
    #[test]
    fn a_step_that_fails_to_be_made_sends_nothing() {
        let (control, mut rank1) = link();
        let failed = control.send_made(|| Err(ExecutorError::Broken("no cell".into())));
        assert!(matches!(failed, Err(ExecutorError::Broken(_))));
        control.broadcast(&Order::Step(desc(5))).unwrap();
        let first: Order = crate::group::recv(&mut rank1).unwrap();
        assert!(
            matches!(&first, Order::Step(d) if d.placement == 5),
            "{first:?}"
        );
    }
}
