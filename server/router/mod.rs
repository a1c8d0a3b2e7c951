//! The router's request path: an actor owning the queue packs requests of one layer into steps of
//! at most `max_tokens_per_step` tokens (splitting large ones), and the executor thread runs each
//! step across the group and hands every finished request its output.

mod batcher;
mod executor;

pub use batcher::{run_batcher, BatchConfig};
pub use executor::{Executor, ExecutorError};

use std::ops::Range;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

pub type Reply = Result<Vec<f32>, tonic::Status>;

/// One admitted request, validated and converted to f32.
pub struct Job {
    pub id: String,
    /// Index into `MoeSpec::moe_layers`.
    pub layer: usize,
    pub tokens: usize,
    /// `[tokens, hidden]`.
    pub hidden: Vec<f32>,
    /// Client routing: ids and weights, `[tokens, top_k]` each.
    pub routing: Option<(Vec<i32>, Vec<f32>)>,
    sink: Mutex<Sink>,
}

struct Sink {
    out: Vec<f32>,
    done: usize,
    reply: Option<oneshot::Sender<Reply>>,
}

impl Job {
    pub fn new(
        id: String,
        layer: usize,
        tokens: usize,
        hidden: Vec<f32>,
        routing: Option<(Vec<i32>, Vec<f32>)>,
    ) -> (Arc<Self>, oneshot::Receiver<Reply>) {
        let (tx, rx) = oneshot::channel();
        let job = Arc::new(Self {
            id,
            layer,
            tokens,
            sink: Mutex::new(Sink {
                out: Vec::new(),
                done: 0,
                reply: Some(tx),
            }),
            hidden,
            routing,
        });
        (job, rx)
    }

    fn sink(&self) -> std::sync::MutexGuard<'_, Sink> {
        self.sink.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Nobody waits for the answer any more (client gone).
    pub fn abandoned(&self) -> bool {
        self.sink().reply.as_ref().is_none_or(|r| r.is_closed())
    }

    /// Answers with an error unless already answered.
    pub fn fail(&self, status: tonic::Status) {
        if let Some(tx) = self.sink().reply.take() {
            let _ = tx.send(Err(status));
        }
    }

    /// Stores output rows `rows` (read by `fill`); answers once every row is in.
    fn deliver(&self, rows: Range<usize>, hidden: usize, fill: impl FnOnce(&mut [f32])) {
        let mut s = self.sink();
        if s.out.is_empty() {
            s.out = vec![0.0; self.tokens * hidden];
        }
        fill(&mut s.out[rows.start * hidden..rows.end * hidden]);
        s.done += rows.len();
        if s.done == self.tokens {
            let out = std::mem::take(&mut s.out);
            if let Some(tx) = s.reply.take() {
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
    pub segments: Vec<Segment>,
}

impl Step {
    pub fn tokens(&self) -> usize {
        self.segments.iter().map(|s| s.rows.len()).sum()
    }
    pub fn fail(&self, status: &tonic::Status) {
        for s in &self.segments {
            s.job.fail(status.clone());
        }
    }
}
