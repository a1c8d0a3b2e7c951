//! The batching actor: owns the queue; forms a step when the executor can take one and either the
//! head request's layer has a full step queued or the head has waited `max_wait`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Job, Segment, Step};

#[derive(Clone, Copy, Debug)]
pub struct BatchConfig {
    pub max_tokens_per_step: usize,
    pub max_wait: Duration,
}

struct Queued {
    job: Arc<Job>,
    next_row: usize,
    since: Instant,
}

impl Queued {
    fn key(&self) -> (usize, bool) {
        (self.job.layer, self.job.routing.is_some())
    }
    fn left(&self) -> usize {
        self.job.tokens - self.next_row
    }
}

/// Runs until `jobs` is closed and the queue is empty (drain), or until the executor goes away,
/// in which case every queued and later job is failed with UNAVAILABLE.
pub async fn run_batcher(
    cfg: BatchConfig,
    mut jobs: mpsc::Receiver<Arc<Job>>,
    steps: mpsc::Sender<Step>,
) {
    let mut queue: VecDeque<Queued> = VecDeque::new();
    let mut open = true;
    loop {
        queue.retain(|q| q.next_row > 0 || !q.job.abandoned());
        if !open && queue.is_empty() {
            return;
        }
        let head = queue.front().map(|q| (q.key(), q.since));
        let full = head.is_some_and(|(key, _)| {
            queue
                .iter()
                .filter(|q| q.key() == key)
                .map(Queued::left)
                .sum::<usize>()
                >= cfg.max_tokens_per_step
        });
        // Draining: nothing more can arrive, so waiting to fill is pointless.
        let due = head.map(|(_, since)| if open { since + cfg.max_wait } else { since });
        let ready = full || due.is_some_and(|d| d <= Instant::now());
        tokio::select! {
            job = jobs.recv(), if open => match job {
                Some(job) => queue.push_back(Queued { job, next_row: 0, since: Instant::now() }),
                None => open = false,
            },
            permit = steps.reserve(), if ready => match permit {
                Ok(permit) => permit.send(take_step(&mut queue, cfg.max_tokens_per_step)),
                Err(_) => break,
            },
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if !ready && due.is_some() => {}
        }
    }
    // The executor is gone: the group is broken.
    let status = tonic::Status::unavailable("the EP group has stopped");
    jobs.close();
    while let Ok(job) = jobs.try_recv() {
        queue.push_back(Queued {
            job,
            next_row: 0,
            since: Instant::now(),
        });
    }
    for q in queue {
        q.job.fail(status.clone());
    }
}

/// Packs the head request's layer: FIFO, splitting the last request that does not fit.
fn take_step(queue: &mut VecDeque<Queued>, budget: usize) -> Step {
    let key = queue.front().expect("a ready queue is not empty").key();
    let mut left = budget;
    let mut segments = Vec::new();
    for q in queue.iter_mut().filter(|q| q.key() == key) {
        if left == 0 {
            break;
        }
        let take = q.left().min(left);
        segments.push(Segment {
            job: q.job.clone(),
            rows: q.next_row..q.next_row + take,
        });
        q.next_row += take;
        left -= take;
    }
    queue.retain(|q| q.left() > 0);
    Step {
        layer: key.0,
        client_routing: key.1,
        segments,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(layer: usize, tokens: usize) -> Arc<Job> {
        let (j, rx) = Job::new(
            format!("{layer}/{tokens}"),
            layer,
            tokens,
            vec![0.0; tokens],
            None,
        );
        std::mem::forget(rx);
        j
    }

    #[tokio::test(start_paused = true)]
    async fn packs_by_layer_splits_large_requests_and_waits_at_most_max_wait() {
        let (jtx, jrx) = mpsc::channel(16);
        let (stx, mut srx) = mpsc::channel(1);
        let cfg = BatchConfig {
            max_tokens_per_step: 8,
            max_wait: Duration::from_millis(5),
        };
        let task = tokio::spawn(run_batcher(cfg, jrx, stx));
        for j in [job(0, 3), job(1, 2), job(0, 11)] {
            jtx.send(j).await.unwrap();
        }
        let sizes = |s: &Step| {
            s.segments
                .iter()
                .map(|g| (g.job.tokens, g.rows.clone()))
                .collect::<Vec<_>>()
        };
        // Layer 0 has 14 tokens queued: a full step at once, splitting the 11-token request.
        let s = srx.recv().await.unwrap();
        assert_eq!((s.layer, s.tokens()), (0, 8));
        assert_eq!(sizes(&s), vec![(3, 0..3), (11, 0..5)]);
        // The rest are not full: they go out once the head has waited max_wait.
        let t0 = Instant::now();
        let s = srx.recv().await.unwrap();
        assert_eq!((s.layer, sizes(&s)), (1, vec![(2, 0..2)]));
        assert!(t0.elapsed() <= Duration::from_millis(5));
        let s = srx.recv().await.unwrap();
        assert_eq!((s.layer, sizes(&s)), (0, vec![(11, 5..11)]));
        drop(jtx);
        task.await.unwrap();
    }
}
