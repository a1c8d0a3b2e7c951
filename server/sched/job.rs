//! One admitted request on its way through the steps, and the steps it rides in.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::dtype::Dtype;
use crate::metric_names;
use crate::request::{Failure, JobInput, Permit, Reply};
use crate::step::StepKey;
use crate::transport::bufs::Bufs;

/// One admitted request on its way through the steps.
pub struct Job {
    pub input: JobInput,
    pub admitted: Instant,
    sink: Mutex<Sink>,
    /// Released when the job is gone from every step and queue, or, once answered, when its
    /// handler has handed the response to the transport (`take_permit`).
    permit: Mutex<Option<Permit>>,
}

struct Sink {
    /// `[tokens, hidden]` in the output dtype, allocated with the first rows delivered.
    out: Vec<u8>,
    done: usize,
    first_step: Option<Instant>,
    /// From the first step to the last row delivered, once answered.
    in_step: Option<std::time::Duration>,
    /// Time spent copying the steps' rows that carried this job's into the ring, and out of it.
    input: std::time::Duration,
    output: std::time::Duration,
    /// Steps this job's rows led (it was the first segment).
    led_steps: u32,
    reply: Option<oneshot::Sender<Reply>>,
}

impl Sink {
    /// The reply, taken to answer once; a running request stops counting as running.
    fn answer(&mut self) -> Option<oneshot::Sender<Reply>> {
        let tx = self.reply.take();
        if tx.is_some() && self.first_step.is_some() {
            metrics::gauge!(metric_names::REQUESTS_RUNNING).decrement(1.0);
        }
        tx
    }
}

impl Drop for Sink {
    /// A job dropped unanswered (its step abandoned) stops running too.
    fn drop(&mut self) {
        self.answer();
    }
}

/// Where a job's time went, for the per-model statistics (`crate::infer::stats`): the same
/// instants as the queue and in-step histograms.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    /// Admission to the first step; None if no row entered a step.
    pub queue: Option<std::time::Duration>,
    /// The first step to the last row delivered; None unless answered.
    pub in_step: Option<std::time::Duration>,
    /// Of `in_step`: copying the rows of the steps it was in, into the ring and out of it.
    pub input: std::time::Duration,
    pub output: std::time::Duration,
    pub led_steps: u32,
}

impl Job {
    pub fn new(input: JobInput, permit: Option<Permit>) -> (Arc<Self>, oneshot::Receiver<Reply>) {
        let (tx, rx) = oneshot::channel();
        let job = Arc::new(Self {
            input,
            admitted: Instant::now(),
            sink: Mutex::new(Sink {
                out: Vec::new(),
                done: 0,
                first_step: None,
                in_step: None,
                input: Default::default(),
                output: Default::default(),
                led_steps: 0,
                reply: Some(tx),
            }),
            permit: Mutex::new(permit),
        });
        (job, rx)
    }

    fn sink(&self) -> std::sync::MutexGuard<'_, Sink> {
        self.sink.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The admission permit, for the handler to hold until its response is written.
    pub fn take_permit(&self) -> Option<Permit> {
        self.permit.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Some of its rows have entered a step.
    pub fn in_step(&self) -> bool {
        self.sink().first_step.is_some()
    }

    /// Nobody waits for the answer any more (client gone, or already answered).
    pub fn abandoned(&self) -> bool {
        self.sink().reply.as_ref().is_none_or(|r| r.is_closed())
    }

    /// Answers with an error unless already answered.
    pub fn fail(&self, why: Failure) {
        if let Some(tx) = self.sink().answer() {
            let _ = tx.send(Err(why));
        }
    }

    /// Some rows enter a step at `at`; `leads`: they are its first segment (the step counts once).
    pub(crate) fn started(&self, at: Instant, leads: bool) {
        let mut s = self.sink();
        s.led_steps += leads as u32;
        if s.first_step.is_none() {
            s.first_step = Some(at);
            if s.reply.is_some() {
                metrics::gauge!(metric_names::REQUESTS_RUNNING).increment(1.0);
            }
            metrics::histogram!(metric_names::REQUEST_QUEUE_SECONDS)
                .record((at - self.admitted).as_secs_f64());
        }
    }

    pub fn timings(&self) -> Timings {
        let s = self.sink();
        Timings {
            queue: s.first_step.map(|t| t - self.admitted),
            in_step: s.in_step,
            input: s.input,
            output: s.output,
            led_steps: s.led_steps,
        }
    }

    /// The output buffer, taken out for the delivery to fill outside the lock; allocated on
    /// first use.
    pub(super) fn take_out(&self, row_bytes: usize, bufs: &Bufs) -> Vec<u8> {
        let mut s = self.sink();
        if s.out.is_empty() {
            s.out = bufs.take(self.input.tokens * row_bytes);
        }
        std::mem::take(&mut s.out)
    }

    /// A step that carried some of its rows took `d` to copy them all into the ring.
    pub(super) fn packed(&self, d: std::time::Duration) {
        self.sink().input += d;
    }

    /// Puts the buffer back with `rows` more filled in (None: they went to the client's device
    /// memory), `took` the step's whole copy out; answers once every row is in.
    pub(super) fn put_out(
        &self,
        out: Option<Vec<u8>>,
        rows: usize,
        took: std::time::Duration,
        bufs: &Arc<Bufs>,
    ) {
        let mut s = self.sink();
        s.output += took;
        if let Some(out) = out {
            s.out = out;
        }
        s.done += rows;
        if s.done == self.input.tokens {
            if let Some(t) = s.first_step {
                let d = t.elapsed();
                s.in_step = Some(d);
                metrics::histogram!(metric_names::REQUEST_IN_STEP_SECONDS).record(d.as_secs_f64());
            }
            let out = bufs.freeze(std::mem::take(&mut s.out));
            if let Some(tx) = s.answer() {
                let _ = tx.send(Ok(out));
            }
        }
    }
}

/// A piece of one job inside a step.
pub struct Segment {
    pub job: Arc<Job>,
    pub rows: Range<usize>,
}

/// What the batcher hands the executor.
pub struct Step {
    pub layer: usize,
    pub client_routing: bool,
    /// Every request in a step shares its input and output dtypes: the ring carries them as is.
    pub input: Dtype,
    pub output: Dtype,
    /// This rank's rows (the leader's: every rank's, under `--ingress all` its own).
    pub segments: Vec<Segment>,
    /// `--ingress all`: every rank's home rows (`StepDesc::homes`); empty when the leader packs
    /// the whole step.
    pub homes: Vec<u32>,
}

impl Step {
    /// No rows: a heartbeat through every rank (and the base of the warm-up step).
    pub fn empty() -> Self {
        Self {
            layer: 0,
            client_routing: false,
            input: Dtype::F32,
            output: Dtype::F32,
            segments: Vec::new(),
            homes: Vec::new(),
        }
    }

    pub fn key(&self) -> StepKey {
        StepKey {
            layer: self.layer as u32,
            client_routing: self.client_routing,
            input: self.input,
            output: self.output,
        }
    }
    /// A step of `key` with these rows; `homes` as in `StepDesc::homes`.
    pub fn of(key: StepKey, segments: Vec<Segment>, homes: Vec<u32>) -> Self {
        Self {
            layer: key.layer as usize,
            client_routing: key.client_routing,
            input: key.input,
            output: key.output,
            segments,
            homes,
        }
    }
    /// Tokens of the whole step, every rank's.
    pub fn group_tokens(&self) -> usize {
        match self.homes.is_empty() {
            true => self.tokens(),
            false => self.homes.iter().map(|&n| n as usize).sum(),
        }
    }
    pub fn tokens(&self) -> usize {
        self.segments.iter().map(|s| s.rows.len()).sum()
    }
    pub fn fail(&self, why: &Failure) {
        for s in &self.segments {
            s.job.fail(why.clone());
        }
    }
}
