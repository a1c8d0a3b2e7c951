//! The protocol-neutral request entry: readiness, checks into a job, admission, queueing and the
//! wait for the answer. Each protocol (epserve.v1, KServe v2) decodes its messages into a
//! `Request`, calls `validate` then `submit`, and maps a `Failure` to its own status; none of
//! them repeats admission or batching.

pub mod quote;
pub mod stats;
pub mod tensor;

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::{mpsc, Notify};

use crate::lifecycle::Abort;
use crate::metric_names;
use crate::model::MoeSpec;
use crate::request::{Admission, Failure, JobInput, Permit};
/// The queue's item, for whoever builds an `Infer` (the serving process, tests).
pub use crate::sched::Job;
/// What the exchange holds on each GPU, as GetModelInfo reports it.
pub use crate::step::EpFootprint;
use tensor::{Dtype, Names, View};

/// Where the service is in its life; requests are only admitted while `Serving`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Starting = 0,
    Serving = 1,
    Draining = 2,
    Broken = 3,
}

/// One request as any protocol hands it over, borrowing the client's bytes.
pub struct Request<'a> {
    pub id: String,
    /// The model's own layer index.
    pub layer: u32,
    pub hidden: Option<View<'a>>,
    pub topk_ids: Option<View<'a>>,
    pub topk_weights: Option<View<'a>>,
    /// The dtype the output leaves in.
    pub output: Dtype,
    pub deadline: Option<Instant>,
    /// How the protocol spells dtypes, for messages.
    pub names: Names,
    /// The model whose statistics count it.
    pub tally: stats::Tally,
}

/// A finished request: `[tokens, hidden]` rows in the output dtype, and the admission permit for
/// the caller to hold until its response is written.
pub struct Answer {
    pub output: Bytes,
    pub tokens: usize,
    pub permit: Option<Permit>,
}

pub struct Infer {
    spec: Arc<MoeSpec>,
    jobs: mpsc::Sender<Arc<Job>>,
    admission: Arc<Admission>,
    phase: AtomicU8,
    /// The step loop makes progress (the `liveness` health service says the same).
    live: AtomicBool,
    /// Tells the batcher a waiting client went away, so its queued work is dropped at once.
    wake: Arc<Notify>,
    /// Why the group broke, once it has.
    broken: Arc<Abort>,
    /// By layer slot (`MoeSpec::moe_layers`), then model (`Tally::slot`).
    stats: Vec<[stats::LayerStats; stats::Tally::PER_LAYER]>,
}

/// Counts a refusal under `reason`, logs it at debug, and passes it on.
pub fn rejected(reason: &'static str, f: Failure) -> Failure {
    crate::rejections::count_rejection(reason);
    tracing::debug!(reason, "request refused: {f}");
    f
}

/// A submitted request's place in its model's statistics, recorded when it ends.
struct Counted<'a> {
    stats: &'a stats::LayerStats,
    t0: Instant,
    job: Option<Arc<Job>>,
    answered: bool,
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        let timings = self.job.as_ref().map(|j| j.timings());
        match timings {
            Some(t) if self.answered => self.stats.answered(self.t0.elapsed(), &t),
            _ => self.stats.failed(self.t0.elapsed(), timings.as_ref()),
        }
    }
}

/// Notifies the batcher when a request's wait ends, whether answered or cancelled.
struct WakeOnDrop(Arc<Notify>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

impl Infer {
    pub fn new(
        spec: Arc<MoeSpec>,
        jobs: mpsc::Sender<Arc<Job>>,
        admission: Arc<Admission>,
        wake: Arc<Notify>,
        broken: Arc<Abort>,
    ) -> Self {
        let stats = spec.moe_layers.iter().map(|_| Default::default()).collect();
        Self {
            stats,
            spec,
            jobs,
            admission,
            phase: AtomicU8::new(Phase::Starting as u8),
            live: AtomicBool::new(true),
            wake,
            broken,
        }
    }

    pub fn spec(&self) -> &MoeSpec {
        &self.spec
    }

    /// The statistics of the requests counted under one MoE layer's (the model's own index)
    /// model `tally`.
    pub fn stats(&self, layer: u32, tally: stats::Tally) -> Option<&stats::LayerStats> {
        self.spec
            .layer_slot(layer)
            .map(|i| &self.stats[i][tally.slot()])
    }

    pub fn set_phase(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::Release);
    }

    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Starting,
            1 => Phase::Serving,
            2 => Phase::Draining,
            _ => Phase::Broken,
        }
    }

    pub fn set_live(&self, live: bool) {
        self.live.store(live, Ordering::Release);
    }

    pub fn live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Admitting requests now.
    pub fn ready(&self) -> bool {
        self.check_serving().is_ok()
    }

    fn check_serving(&self) -> Result<(), Failure> {
        // A broken group is reported as such whatever the phase (a drain may have begun first).
        if let Some(why) = self.broken.reason() {
            return Err(Failure::unavailable(
                "broken",
                format!("the EP group is broken: {why}"),
            ));
        }
        match self.phase() {
            Phase::Serving => Ok(()),
            Phase::Starting => Err(Failure::unavailable(
                "starting",
                "starting: the EP group is not ready yet",
            )),
            Phase::Draining => Err(Failure::unavailable(
                "draining",
                "draining: not accepting new requests",
            )),
            Phase::Broken => Err(Failure::unavailable("broken", "the EP group is broken")),
        }
    }

    /// Checks a request against the model; its hidden states stay the client's bytes. Refusals
    /// are counted.
    pub fn validate(&self, r: Request) -> Result<JobInput, Failure> {
        let (t0, layer, tally) = (Instant::now(), r.layer, r.tally);
        self.check_rows(r).map_err(|f| {
            if let Some(s) = self.stats(layer, tally) {
                s.failed(t0.elapsed(), None);
            }
            rejected("invalid_argument", f)
        })
    }

    fn check_rows(&self, r: Request) -> Result<JobInput, Failure> {
        let spec = &self.spec;
        let layer = spec.layer_slot(r.layer).ok_or_else(|| {
            Failure::invalid(format!(
                "layer {} is not an MoE layer of this model (MoE layers: {:?})",
                r.layer, spec.moe_layers
            ))
        })?;
        let hs = r
            .hidden
            .ok_or_else(|| Failure::invalid("hidden_states is required"))?;
        if hs.shape.len() == 2 && hs.shape[1] >= 0 && hs.shape[1] as usize != spec.hidden {
            return Err(Failure::invalid(format!(
                "hidden_states: hidden size {} does not match the model's {}",
                hs.shape[1], spec.hidden
            )));
        }
        let (hidden, n) = tensor::rows(hs, "hidden_states", spec.hidden, r.names)?;
        if !r.output.is_float() {
            return Err(Failure::invalid(format!(
                "output dtype {} is not a float dtype",
                (r.names)(r.output)
            )));
        }
        let routing = match (r.topk_ids, r.topk_weights) {
            (None, None) => None,
            (None, Some(_)) => return Err(Failure::invalid("topk_weights given without topk_ids")),
            (Some(_), None) => return Err(Failure::invalid("topk_ids given without topk_weights")),
            (Some(ids), Some(w)) => {
                let ids = tensor::expert_ids(&ids, n, spec.top_k, spec.num_experts, r.names)?;
                let (w, _) = tensor::floats(&w, "topk_weights", Some(n), spec.top_k, r.names)?;
                Some((ids, w))
            }
        };
        Ok(JobInput {
            id: r.id,
            layer,
            tokens: n,
            hidden,
            output: r.output,
            routing,
            deadline: r.deadline,
            output_to: None,
        })
    }

    /// Admits, queues and waits for one checked request, within its deadline. A broken group
    /// answers at once, wherever the request is.
    pub async fn submit(&self, input: JobInput, tally: stats::Tally) -> Result<Answer, Failure> {
        // Counted when it ends, however: answered, failed, or its caller gone (dropped here).
        let mut count = Counted {
            stats: &self.stats[input.layer][tally.slot()],
            t0: Instant::now(),
            job: None,
            answered: false,
        };
        let result = self.wait(input, &mut count.job).await;
        count.answered = result.is_ok();
        result
    }

    /// Admits and queues `input` (its job left in `job`) and waits for its answer.
    async fn wait(
        &self,
        input: JobInput,
        job_out: &mut Option<Arc<Job>>,
    ) -> Result<Answer, Failure> {
        self.check_serving().map_err(|f| rejected(f.reason(), f))?;
        let deadline = input.deadline;
        if deadline.is_some_and(|d| d <= Instant::now()) {
            return Err(rejected(
                "deadline_on_arrival",
                Failure::Deadline("the deadline passed before admission".into()),
            ));
        }
        let tokens = input.tokens;
        // A device tensor's bytes never cross the wire.
        let ingress = input.hidden.data.host().map_or(0, |b| b.len());
        let permit = self
            .admission
            .try_admit(tokens)
            .map_err(|f| rejected(f.reason(), f))?;
        // Drain may have begun between the first check and admission; the permit counts either way.
        self.check_serving().map_err(|f| rejected(f.reason(), f))?;
        let (job, reply) = Job::new(input, Some(permit));
        *job_out = Some(job.clone());
        self.jobs.try_send(job.clone()).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => rejected(
                "queue_full",
                Failure::Exhausted {
                    reason: "queue_full",
                    message: "the request queue is full".into(),
                },
            ),
            mpsc::error::TrySendError::Closed(_) => rejected(
                "broken",
                Failure::unavailable("broken", "the service is not accepting requests"),
            ),
        })?;
        // Hidden-state bytes as they crossed the wire: in for each queued request, out for each
        // answered one.
        metrics::counter!(metric_names::INGRESS_BYTES_TOTAL).increment(ingress as u64);
        let _wake = WakeOnDrop(self.wake.clone());
        let wait = async {
            match deadline {
                Some(d) => tokio::time::timeout_at(d.into(), reply).await.map_err(|_| {
                    Failure::Deadline(
                        "the deadline passed while the request was in the service".into(),
                    )
                }),
                None => Ok(reply.await),
            }
        };
        // The step holding the request may be stuck on a device that will never finish.
        let answer = tokio::select! {
            biased;
            a = wait => a?,
            why = self.broken.broken() => return Err(self.broken_failure(&job, &why)),
        };
        let output = answer.map_err(|_| {
            Failure::unavailable("dropped", "the request was dropped: the EP group stopped")
        })??;
        metrics::counter!(metric_names::EGRESS_BYTES_TOTAL).increment(output.len() as u64);
        Ok(Answer {
            output,
            tokens,
            permit: job.take_permit(),
        })
    }

    /// Why a request failed once the group broke: a wrong result if a step that held it computed
    /// something wrong, else unavailable.
    fn broken_failure(&self, job: &Job, why: &str) -> Failure {
        if self.broken.corrupt() && job.in_step() {
            Failure::Wrong(format!(
                "the step holding this request produced a wrong result; the EP group is broken: {why}"
            ))
        } else {
            Failure::unavailable("broken", format!("the EP group is broken: {why}"))
        }
    }
}
