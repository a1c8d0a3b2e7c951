//! The router's step thread: writes each step's input into the ring, sends the descriptor to every
//! rank, runs its own share, waits for every rank's output and answers the finished requests.

use std::io::ErrorKind;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::{Failure, Step};
use crate::group::{recv, Ctl, GroupError, RouterLink};
use crate::shm::Abort;
use crate::step::ring::Ring;
use crate::step::{Backend, Driver, PhaseTimes, StepDesc, StepError};
use crate::watchdog::Progress;

#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Group(#[from] GroupError),
    #[error("the EP group broke: {0}")]
    Broken(String),
    #[error("step {step}: rank {rank} did not finish: {reason}")]
    Output {
        step: u64,
        rank: usize,
        reason: String,
    },
}

pub struct Executor<B> {
    driver: Driver<B>,
    ring: Arc<Ring>,
    link: RouterLink,
    abort: Arc<Abort>,
    /// Set before a deliberate stop, so the ranks' disconnects are not read as failures.
    closing: Arc<AtomicBool>,
    step_timeout: Duration,
    seq: u64,
    pub progress: Arc<Progress>,
}

impl<B: Backend> Executor<B> {
    pub fn new(
        driver: Driver<B>,
        ring: Arc<Ring>,
        link: RouterLink,
        abort: Arc<Abort>,
        step_timeout: Duration,
    ) -> Result<Self, GroupError> {
        // A rank that reports failure or disconnects breaks the group at once, instead of
        // leaving the router to find out at the step timeout.
        let closing = Arc::new(AtomicBool::new(false));
        for (i, w) in link.workers.iter().enumerate() {
            let mut r = w.try_clone().map_err(|source| GroupError::Io {
                what: "control socket".into(),
                source,
            })?;
            let (abort, closing) = (abort.clone(), closing.clone());
            let rank = i + 1;
            std::thread::Builder::new()
                .name(format!("ctl-rank{rank}"))
                .spawn(move || watch_rank(&mut r, rank, &abort, &closing))
                .map_err(|source| GroupError::Io {
                    what: "spawning a control reader".into(),
                    source,
                })?;
        }
        Ok(Self {
            driver,
            ring,
            link,
            abort,
            closing,
            step_timeout,
            seq: 0,
            progress: Arc::new(Progress::default()),
        })
    }

    pub fn backend(&self) -> &B {
        &self.driver.backend
    }

    /// Runs one step through the whole group; on return every rank has stored its output.
    pub fn run(&mut self, step: &Step) -> Result<PhaseTimes, ExecutorError> {
        self.progress.begin();
        let r = self.run_inner(step);
        self.progress.end();
        r
    }

    fn run_inner(&mut self, step: &Step) -> Result<PhaseTimes, ExecutorError> {
        // Heartbeats get no span: one a second would drown the traces.
        let _span = (!step.segments.is_empty()).then(|| {
            tracing::info_span!("step", step = self.seq + 1, tokens = step.tokens()).entered()
        });
        if let Some(reason) = self.abort.reason() {
            return Err(ExecutorError::Output {
                step: self.seq + 1,
                rank: 0,
                reason,
            });
        }
        self.seq += 1;
        // One deadline for the whole step, whichever wait it ends up in.
        let deadline = Instant::now() + self.step_timeout;
        let slots = self.ring.shape.slots as u64;
        let slot = (self.seq % slots) as usize;
        let (h, k) = (self.ring.shape.hidden, self.ring.shape.top_k);
        let mut row = 0;
        for seg in &step.segments {
            let (a, b) = (seg.rows.start, seg.rows.end);
            self.ring
                .write_hidden(slot, row, &seg.job.input.hidden[a * h..b * h]);
            if let Some((ids, w)) = &seg.job.input.routing {
                self.ring
                    .write_routing(slot, row, &ids[a * k..b * k], &w[a * k..b * k]);
            }
            row += seg.rows.len();
        }
        self.ring.publish_input(slot, self.seq);
        let desc = StepDesc {
            step: self.seq,
            layer: step.layer as u32,
            tokens: row as u32,
            slot: slot as u32,
            client_routing: step.client_routing,
        };
        self.link.broadcast(&Ctl::Step(desc))?;
        let times = self.driver.run(&desc)?;
        self.ring
            .wait_outputs(slot, self.seq, deadline, &self.abort)
            .map_err(|(rank, e)| ExecutorError::Output {
                step: self.seq,
                rank,
                reason: e.to_string(),
            })?;
        let mut row = 0;
        for seg in &step.segments {
            let n = seg.rows.len();
            seg.job.deliver(seg.rows.clone(), h, |dst| {
                self.ring.read_output(slot, row, dst)
            });
            row += n;
        }
        Ok(times)
    }

    /// Serves steps until the batcher closes the channel (drain) or a step fails (group broken).
    /// When idle for `heartbeat`, runs an empty step through every rank, so a lost or stopped rank
    /// is found within the step timeout even without traffic. Either way the ranks are told to stop.
    pub fn serve(
        mut self,
        mut steps: mpsc::Receiver<Step>,
        ready: Arc<tokio::sync::Semaphore>,
        runtime: tokio::runtime::Handle,
        heartbeat: Duration,
    ) -> Result<(), ExecutorError> {
        let result = loop {
            let next =
                runtime.block_on(async { tokio::time::timeout(heartbeat, steps.recv()).await });
            let step = match next {
                Ok(Some(step)) => step,
                Ok(None) => break Ok(()),
                Err(_) => Step {
                    layer: 0,
                    client_routing: false,
                    segments: Vec::new(),
                },
            };
            let result = self.run(&step);
            if !step.segments.is_empty() {
                ready.add_permits(1);
            }
            match result {
                Ok(times) => tracing::debug!(tokens = step.tokens(), ?times, "step"),
                Err(e) => {
                    // A wrong result fails its requests INTERNAL; a lost rank, UNAVAILABLE.
                    let status = if matches!(e, ExecutorError::Step(StepError::Corrupt { .. })) {
                        self.abort.trigger_corrupt(e.to_string());
                        Failure::Wrong(format!("EP group broken: {e}"))
                    } else {
                        self.abort.trigger(e.to_string());
                        Failure::unavailable("broken", format!("EP group broken: {e}"))
                    };
                    step.fail(&status);
                    break Err(e);
                }
            }
        };
        steps.close();
        let why = self
            .abort
            .reason()
            .unwrap_or_else(|| "the step executor stopped".into());
        while let Ok(step) = steps.try_recv() {
            step.fail(&Failure::unavailable(
                "broken",
                format!("EP group broken: {why}"),
            ));
        }
        // A clean drain stops the ranks with exit 0; a broken group makes them fail too.
        let broken = self.abort.reason();
        self.closing.store(true, Ordering::Release);
        let msg = match &broken {
            None if result.is_ok() => Ctl::Shutdown,
            reason => Ctl::Failed {
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

    /// The readiness step: a few tokens of known data through every rank and phase.
    pub fn warm_up(&mut self) -> Result<(), ExecutorError> {
        let tokens = self.ring.shape.world;
        let hidden: Vec<f32> = (0..tokens * self.ring.shape.hidden)
            .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
            .collect();
        let input = super::JobInput {
            id: "warm-up".into(),
            layer: 0,
            tokens,
            hidden,
            routing: None,
            deadline: None,
        };
        let (job, mut rx) = super::Job::new(input, None);
        let step = Step {
            layer: 0,
            client_routing: false,
            segments: vec![super::Segment {
                job,
                rows: 0..tokens,
            }],
        };
        self.run(&step)?;
        match rx.try_recv() {
            Ok(Ok(out)) if out.iter().all(|v| v.is_finite()) => Ok(()),
            _ => Err(ExecutorError::Output {
                step: self.seq,
                rank: 0,
                reason: "warm-up step produced no finite output".into(),
            }),
        }
    }
}

/// Reads a rank's control connection after startup: the only things a rank sends are failures.
fn watch_rank(stream: &mut TcpStream, rank: usize, abort: &Abort, closing: &AtomicBool) {
    let (reason, corrupt) = match recv(stream) {
        Ok(Ctl::Failed { reason, .. }) => (format!("rank {rank} failed: {reason}"), false),
        Ok(Ctl::Corrupt { reason, .. }) => (format!("rank {rank}: {reason}"), true),
        Ok(other) => (format!("rank {rank} sent unexpected {other:?}"), false),
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
            (format!("rank {rank} disconnected"), false)
        }
        Err(e) => (format!("rank {rank} control connection: {e}"), false),
    };
    match (closing.load(Ordering::Acquire), corrupt) {
        (true, _) => {}
        (false, true) => abort.trigger_corrupt(reason),
        (false, false) => abort.trigger(reason),
    }
}
