//! The batching actor: owns the queue; forms a step when the head request's layer has a full step
//! queued and the pipeline has room (up to `depth` steps packed, running or being delivered), or
//! when the head has waited `max_wait` and either the pipeline is empty or, with a `Pace`, the
//! step ahead is due to leave the ranks within a packing time. A partial step is not formed
//! sooner behind a running one: waiting lets it fill, and it could not start before the ranks
//! are free. Requests whose client left or whose deadline passed leave the queue without entering
//! a step.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::job::{Job, Segment, Step};
use super::pace::Pace;
use super::redo::Redo;
use crate::lifecycle::Abort;
use crate::metric_names;
use crate::request::Failure;
use crate::step::StepKey;

#[derive(Clone)]
pub struct BatchConfig {
    pub max_tokens_per_step: usize,
    pub max_wait: Duration,
    /// Steps in flight at most: the pipeline's permits.
    pub depth: usize,
    /// The gauge those permits count (`STEPS_IN_FLIGHT`, or `OFFERS_PENDING` under --ingress all).
    pub gauge: &'static str,
    /// The executor's reports, when its steps are the ones formed here: a partial step may then
    /// be formed just in time behind a running one.
    pub pace: Option<Arc<Pace>>,
    /// Rows a lost rank's steps ended, to run again first, and the step's token cap after a
    /// loss (the leader's batcher only).
    pub redo: Option<Arc<Redo>>,
}

impl BatchConfig {
    fn cap(&self) -> usize {
        let cap = self.redo.as_ref().map_or(usize::MAX, |r| r.cap());
        self.max_tokens_per_step.min(cap)
    }
}

struct Queued {
    job: Arc<Job>,
    next_row: usize,
    /// One past its last row to run: the job's tokens, or the end of rows run again.
    end: usize,
    since: Instant,
}

impl Queued {
    /// Requests share a step when they share all of this: the ring carries one layout per step.
    fn key(&self) -> StepKey {
        let i = &self.job.input;
        StepKey {
            layer: i.layer as u32,
            client_routing: i.routing.is_some(),
            input: i.hidden.dtype,
            output: i.output,
        }
    }
    fn left(&self) -> usize {
        self.end - self.next_row
    }
    /// Never in a step: rows run again are not.
    fn fresh(&self) -> bool {
        self.next_row == 0 && self.end == self.job.input.tokens && !self.job.in_step()
    }
    /// Not started and past its deadline.
    fn expired(&self, now: std::time::Instant) -> bool {
        self.fresh() && self.job.input.deadline.is_some_and(|d| d <= now)
    }
}

/// Runs until `stop` is cancelled and the queue is empty (drain), or until the executor goes
/// away or the group breaks, in which case every queued and later job is failed with UNAVAILABLE.
/// `wake` is notified when a client leaves, so its queued tokens are freed at once. A step takes
/// one of `in_flight`'s `cfg.depth` permits (the executor returns it once the step is delivered),
/// so waiting work stays in the queue, where deadlines and cancellation reach it, until the
/// pipeline can take it.
pub async fn run_batcher(
    cfg: BatchConfig,
    mut jobs: mpsc::Receiver<Arc<Job>>,
    steps: mpsc::Sender<Step>,
    in_flight: Arc<Semaphore>,
    wake: Arc<Notify>,
    stop: CancellationToken,
    broken: Arc<Abort>,
) {
    let mut queue: VecDeque<Queued> = VecDeque::new();
    loop {
        requeue(&mut queue, cfg.redo.as_deref());
        let now = std::time::Instant::now();
        queue.retain(|q| {
            if q.expired(now) {
                crate::rejections::count_rejection("deadline_in_queue");
                tracing::debug!(reason = "deadline_in_queue", "request refused");
                q.job.fail(Failure::Deadline(
                    "the deadline passed while the request was queued".into(),
                ));
                return false;
            }
            // A request already inside a step completes; an untouched one whose client left goes.
            !q.fresh() || !q.job.abandoned()
        });
        let queued = queue.iter().map(Queued::left).sum::<usize>();
        metrics::gauge!(metric_names::QUEUE_REQUESTS).set(queue.len() as f64);
        metrics::gauge!(metric_names::QUEUE_TOKENS).set(queued as f64);
        crate::stats_log::queue(queue.len(), queued);
        let open = !stop.is_cancelled();
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
                >= cfg.cap()
        });
        // Draining: nothing more arrives, so waiting to fill is pointless.
        let due = head.map(|(_, since)| if open { since + cfg.max_wait } else { since });
        let ready = full || due.is_some_and(|d| d <= Instant::now());
        // A partial step behind another one: in how long (None: not until the pipeline empties
        // or the pace changes).
        let pace = cfg.pace.as_deref().filter(|_| ready && !full);
        let behind = pace.and_then(|p| p.partial_in(cfg.max_wait));
        let need = match full || behind == Some(Duration::ZERO) {
            true => 1,
            false => cfg.depth,
        };
        let next_deadline = queue
            .iter()
            .filter(|q| q.fresh())
            .filter_map(|q| q.job.input.deadline)
            .min();
        let wake_at = [
            due.filter(|_| !ready),
            next_deadline.map(Instant::from_std),
            behind.filter(|d| !d.is_zero()).map(|d| Instant::now() + d),
        ]
        .into_iter()
        .flatten()
        .min();
        tokio::select! {
            job = jobs.recv(), if open => match job {
                Some(job) => {
                    let end = job.input.tokens;
                    queue.push_back(Queued { job, next_row: 0, end, since: Instant::now() })
                }
                None => stop.cancel(),
            },
            // A full step may queue behind a running one; a partial one waits for an empty
            // pipeline, or for the step ahead to be due to end.
            permit = ready_for_step(&in_flight, need, &steps, cfg.gauge), if ready => match permit {
                Some(permit) => {
                    if !full && in_flight.available_permits() + 1 < cfg.depth {
                        metrics::counter!(metric_names::PARTIAL_STEPS_BEHIND_TOTAL).increment(1);
                    }
                    if let Some(p) = &cfg.pace {
                        p.formed();
                    }
                    requeue(&mut queue, cfg.redo.as_deref());
                    permit.send(take_step(&mut queue, cfg.cap()))
                }
                None => break,
            },
            _ = changed(pace) => {}
            // Taken at the top of the loop and before each step.
            _ = redone(cfg.redo.as_deref()) => {}
            _ = tokio::time::sleep_until(wake_at.unwrap_or_else(Instant::now)), if wake_at.is_some() => {}
            _ = wake.notified() => {}
            _ = stop.cancelled(), if open => {}
            // The executor may be stuck in the step that broke the group: do not wait for it.
            _ = broken.broken() => break,
        }
    }
    // The executor is gone or the group is broken.
    let why = broken
        .reason()
        .unwrap_or_else(|| "the step executor stopped".into());
    let status = Failure::unavailable("broken", format!("EP group broken: {why}"));
    jobs.close();
    while let Ok(job) = jobs.try_recv() {
        let end = job.input.tokens;
        queue.push_back(Queued {
            job,
            next_row: 0,
            end,
            since: Instant::now(),
        });
    }
    for q in queue {
        q.job.fail(status.clone());
    }
}

/// Rows given back (a lost rank's steps) at the front of the queue, oldest first, each merged
/// with the rest of its request where that is queued right after it.
fn requeue(queue: &mut VecDeque<Queued>, redo: Option<&Redo>) {
    let Some(redo) = redo else { return };
    let since = Instant::now();
    for s in redo.take().into_iter().rev() {
        let Segment { job, rows } = s;
        let rest = (queue.iter_mut()).find(|q| Arc::ptr_eq(&q.job, &job) && q.next_row == rows.end);
        match rest {
            Some(q) => q.next_row = rows.start,
            None => queue.push_front(Queued {
                job,
                next_row: rows.start,
                end: rows.end,
                since,
            }),
        }
    }
}

/// Resolves when rows come back to run again, or the cap changes; never without a redo.
async fn redone(redo: Option<&Redo>) {
    match redo {
        Some(r) => r.wake.notified().await,
        None => std::future::pending().await,
    }
}

/// Resolves when the executor reports on its steps; never without a pace.
async fn changed(pace: Option<&Pace>) {
    match pace {
        Some(p) => p.changed.notified().await,
        None => std::future::pending().await,
    }
}

/// Waits until the channel has room and `need` of the pipeline's permits are free, then keeps
/// one permit for the step; None once the executor is gone. Cancel-safe (the batcher's select
/// drops it whenever another branch wins): nothing is kept until both waits are over.
pub(super) async fn ready_for_step<'a>(
    in_flight: &Semaphore,
    need: usize,
    steps: &'a mpsc::Sender<Step>,
    gauge: &'static str,
) -> Option<mpsc::Permit<'a, Step>> {
    let need = u32::try_from(need.max(1)).unwrap_or(1);
    let send = steps.reserve().await.ok()?;
    let permits = tokio::select! {
        p = in_flight.acquire_many(need) => p.ok()?,
        _ = steps.closed() => return None,
    };
    permits.forget();
    in_flight.add_permits(need as usize - 1);
    metrics::gauge!(gauge).increment(1.0);
    Some(send)
}

/// Packs the head request's layer: FIFO, splitting the last request that does not fit.
fn take_step(queue: &mut VecDeque<Queued>, budget: usize) -> Step {
    let key = queue.front().expect("a ready queue is not empty").key();
    let mut left = budget;
    let mut segments = Vec::new();
    let now = std::time::Instant::now();
    for q in queue.iter_mut().filter(|q| q.key() == key) {
        if left == 0 {
            break;
        }
        // A request has one segment per step (its delivery fills one buffer): rows of it run
        // again after a lost rank wait for the next step.
        if segments
            .iter()
            .any(|s: &Segment| Arc::ptr_eq(&s.job, &q.job))
        {
            continue;
        }
        let take = q.left().min(left);
        q.job.started(now, segments.is_empty());
        segments.push(Segment {
            job: q.job.clone(),
            rows: q.next_row..q.next_row + take,
        });
        q.next_row += take;
        left -= take;
    }
    queue.retain(|q| q.left() > 0);
    Step::of(key, segments, Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::request::JobInput;

    fn job(
        layer: usize,
        tokens: usize,
        deadline: Option<std::time::Instant>,
    ) -> (
        Arc<Job>,
        tokio::sync::oneshot::Receiver<crate::request::Reply>,
    ) {
        typed(layer, tokens, deadline, Dtype::Bf16, Dtype::Bf16)
    }

    fn typed(
        layer: usize,
        tokens: usize,
        deadline: Option<std::time::Instant>,
        input: Dtype,
        output: Dtype,
    ) -> (
        Arc<Job>,
        tokio::sync::oneshot::Receiver<crate::request::Reply>,
    ) {
        let input = JobInput {
            id: format!("{layer}/{tokens}"),
            layer,
            tokens,
            hidden: crate::request::Rows {
                dtype: input,
                data: crate::request::Data::Host(bytes::Bytes::new()),
            },
            output,
            routing: None,
            deadline,
            output_to: None,
        };
        Job::new(input, None)
    }

    /// A batcher on its own task, with `cfg.depth` pipeline permits and room for `steps` steps.
    struct Harness {
        jobs: mpsc::Sender<Arc<Job>>,
        steps: mpsc::Receiver<Step>,
        in_flight: Arc<Semaphore>,
        wake: Arc<Notify>,
        stop: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    fn harness(
        max_tokens_per_step: usize,
        max_wait_ms: u64,
        depth: usize,
        steps: usize,
    ) -> Harness {
        harness_with(max_tokens_per_step, max_wait_ms, depth, steps, None)
    }

    fn harness_with(
        max_tokens_per_step: usize,
        max_wait_ms: u64,
        depth: usize,
        steps: usize,
        pace: Option<Arc<Pace>>,
    ) -> Harness {
        harness_redo(max_tokens_per_step, max_wait_ms, depth, steps, pace, None)
    }

    fn harness_redo(
        max_tokens_per_step: usize,
        max_wait_ms: u64,
        depth: usize,
        steps: usize,
        pace: Option<Arc<Pace>>,
        redo: Option<Arc<Redo>>,
    ) -> Harness {
        let (jobs, jrx) = mpsc::channel(64);
        let (stx, steps) = mpsc::channel(steps);
        let cfg = BatchConfig {
            max_tokens_per_step,
            max_wait: Duration::from_millis(max_wait_ms),
            depth,
            gauge: metric_names::STEPS_IN_FLIGHT,
            pace,
            redo,
        };
        let in_flight = Arc::new(Semaphore::new(depth));
        let (wake, stop) = (Arc::new(Notify::new()), CancellationToken::new());
        let task = tokio::spawn(run_batcher(
            cfg,
            jrx,
            stx,
            in_flight.clone(),
            wake.clone(),
            stop.clone(),
            Arc::new(Abort::default()),
        ));
        Harness {
            jobs,
            steps,
            in_flight,
            wake,
            stop,
            task,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn packs_by_layer_splits_large_requests_and_waits_at_most_max_wait() {
        let h = harness(8, 5, 1, 1);
        let (jtx, mut srx, stop, task) = (h.jobs, h.steps, h.stop, h.task);
        let ready = h.in_flight;
        let mut keep = Vec::new();
        for (j, rx) in [job(0, 3, None), job(1, 2, None), job(0, 11, None)] {
            jtx.send(j).await.unwrap();
            keep.push(rx);
        }
        let sizes = |s: &Step| {
            s.segments
                .iter()
                .map(|g| (g.job.input.tokens, g.rows.clone()))
                .collect::<Vec<_>>()
        };
        // Layer 0 has 14 tokens queued: a full step at once, splitting the 11-token request.
        let s = srx.recv().await.unwrap();
        assert_eq!((s.layer, s.tokens()), (0, 8));
        assert_eq!(sizes(&s), vec![(3, 0..3), (11, 0..5)]);
        // The executor must finish a step before the next one is formed.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(srx.try_recv().is_err());
        ready.add_permits(1);
        // The rest are not full: they go out once the head has waited max_wait.
        let t0 = Instant::now();
        let s = srx.recv().await.unwrap();
        assert_eq!((s.layer, sizes(&s)), (1, vec![(2, 0..2)]));
        assert!(t0.elapsed() <= Duration::from_millis(5));
        ready.add_permits(1);
        let s = srx.recv().await.unwrap();
        assert_eq!((s.layer, sizes(&s)), (0, vec![(11, 5..11)]));
        stop.cancel();
        task.await.unwrap();
    }

    /// Rows a lost rank's steps gave back run first, in steps of the smaller cap, merged with
    /// the rest of their request where it is queued right after them; a request never has two
    /// segments in one step (its delivery fills one buffer).
    #[tokio::test(start_paused = true)]
    async fn rows_given_back_run_first_one_segment_a_request_a_step() {
        let redo = Arc::new(Redo::new(usize::MAX));
        let h = harness_redo(8, 5, 1, 1, None, Some(redo.clone()));
        let (jtx, mut srx, stop, task, ready) = (h.jobs, h.steps, h.stop, h.task, h.in_flight);
        let (a, _ra) = job(0, 12, None);
        let (b, _rb) = job(0, 4, None);
        jtx.send(a.clone()).await.unwrap();
        let s = srx.recv().await.unwrap();
        assert_eq!(s.segments[0].rows, 0..8);
        // That step is ended by a loss: its rows come back, the cap falls to 6; b is queued.
        jtx.send(b.clone()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
        redo.set_cap(6);
        redo.give(s.segments);
        ready.add_permits(1);
        let rows = |s: &Step| -> Vec<(usize, std::ops::Range<usize>)> {
            (s.segments.iter())
                .map(|g| (g.job.input.tokens, g.rows.clone()))
                .collect()
        };
        // a's rows 0..8 merged with its queued 8..12: one range, first, cut at the cap.
        let s = srx.recv().await.unwrap();
        assert_eq!(rows(&s), vec![(12, 0..6)]);
        ready.add_permits(1);
        let s = srx.recv().await.unwrap();
        assert_eq!(rows(&s), vec![(12, 6..12)]);
        ready.add_permits(1);
        let s = srx.recv().await.unwrap();
        assert_eq!(rows(&s), vec![(4, 0..4)]);
        // Two separate ranges of one request given back: never in the same step.
        let (c, _rc) = job(0, 10, None);
        redo.give(vec![
            Segment {
                job: c.clone(),
                rows: 0..2,
            },
            Segment {
                job: c.clone(),
                rows: 6..8,
            },
        ]);
        ready.add_permits(1);
        let s = srx.recv().await.unwrap();
        assert_eq!(rows(&s), vec![(10, 0..2)]);
        ready.add_permits(1);
        let s = srx.recv().await.unwrap();
        assert_eq!(rows(&s), vec![(10, 6..8)]);
        stop.cancel();
        task.await.unwrap();
    }

    /// The ring carries one input and one output dtype per step: requests of one layer that
    /// differ in either go in different steps, each in its turn.
    #[tokio::test(start_paused = true)]
    async fn requests_share_a_step_only_with_the_same_dtypes() {
        let h = harness(64, 5, 1, 1);
        let (jtx, mut srx, stop, task) = (h.jobs, h.steps, h.stop, h.task);
        let mut keep = Vec::new();
        let kinds = [
            (Dtype::Bf16, Dtype::Bf16),
            (Dtype::F32, Dtype::Bf16),
            (Dtype::Bf16, Dtype::Bf16),
            (Dtype::Bf16, Dtype::F32),
        ];
        for (i, o) in kinds {
            let (j, rx) = typed(0, 2, None, i, o);
            jtx.send(j).await.unwrap();
            keep.push(rx);
        }
        let mut seen = Vec::new();
        for _ in 0..3 {
            let s = srx.recv().await.unwrap();
            assert!(s
                .segments
                .iter()
                .all(|g| (g.job.input.hidden.dtype, g.job.input.output) == (s.input, s.output)));
            seen.push(((s.input, s.output), s.segments.len()));
            h.in_flight.add_permits(1);
        }
        assert_eq!(
            seen,
            vec![
                ((Dtype::Bf16, Dtype::Bf16), 2),
                ((Dtype::F32, Dtype::Bf16), 1),
                ((Dtype::Bf16, Dtype::F32), 1)
            ]
        );
        stop.cancel();
        task.await.unwrap();
    }

    /// With two steps in flight: a full step forms behind a running one, a partial one only once
    /// the pipeline is empty (it could leave no sooner, and waiting lets it fill).
    #[tokio::test(start_paused = true)]
    async fn full_steps_pipeline_and_partial_steps_wait_for_an_empty_pipeline() {
        let h = harness(4, 1, 2, 4);
        let (jtx, mut srx, stop, task) = (h.jobs, h.steps, h.stop, h.task);
        let in_flight = h.in_flight;
        let mut keep = Vec::new();
        for (j, rx) in [
            job(0, 4, None),
            job(0, 4, None),
            job(0, 4, None),
            job(0, 1, None),
        ] {
            jtx.send(j).await.unwrap();
            keep.push(rx);
        }
        // Two full steps at once; the third waits for a permit.
        for _ in 0..2 {
            assert_eq!(srx.recv().await.unwrap().tokens(), 4);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(srx.try_recv().is_err());
        in_flight.add_permits(1);
        assert_eq!(srx.recv().await.unwrap().tokens(), 4);
        // The 1-token rest is due, but a step is still in flight (and one was just formed).
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(srx.try_recv().is_err());
        in_flight.add_permits(1);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(srx.try_recv().is_err(), "one step is still in flight");
        in_flight.add_permits(1);
        assert_eq!(srx.recv().await.unwrap().tokens(), 1);
        stop.cancel();
        task.await.unwrap();
    }

    /// With the executor's pace, a partial step forms behind a running one once that one is due
    /// to end within a packing time (and max_wait), not before it is on the ranks.
    #[tokio::test(start_paused = true)]
    async fn with_a_pace_a_partial_step_forms_just_in_time_behind_a_running_one() {
        let pace = Arc::new(Pace::default());
        // An earlier step: 10 ms on the ranks, 2 ms to pack.
        pace.formed();
        pace.packed(Duration::from_millis(2));
        pace.submitted();
        pace.finished(Duration::from_millis(10));
        let h = harness_with(4, 1, 2, 4, Some(pace.clone()));
        let (jtx, mut srx, stop, task) = (h.jobs, h.steps, h.stop, h.task);
        let mut keep = Vec::new();
        for (j, rx) in [job(0, 4, None), job(0, 1, None)] {
            jtx.send(j).await.unwrap();
            keep.push(rx);
        }
        assert_eq!(srx.recv().await.unwrap().tokens(), 4);
        // The full step is being packed: the 1-token rest waits, though a permit is free.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(srx.try_recv().is_err());
        // On the ranks now: the rest forms 10 - 2 - 1 ms later, while the full step still holds
        // its permit.
        pace.submitted();
        let t0 = Instant::now();
        let s = srx.recv().await.unwrap();
        let waited = t0.elapsed();
        assert_eq!(s.tokens(), 1);
        assert!(
            waited >= Duration::from_millis(6) && waited <= Duration::from_millis(7),
            "{waited:?}"
        );
        assert_eq!(h.in_flight.available_permits(), 0);
        stop.cancel();
        task.await.unwrap();
    }

    /// A step waiting for room in the channel is cancelled by every arriving job; no permit may
    /// leak, or a partial step (which needs them all) would never form.
    #[tokio::test(start_paused = true)]
    async fn waiting_for_the_channel_loses_no_permit() {
        let h = harness(4, 1, 2, 1);
        let (jtx, mut srx, stop, task) = (h.jobs, h.steps, h.stop, h.task);
        let in_flight = h.in_flight;
        let mut keep = Vec::new();
        // Two full steps: the first fills the channel, the second waits for room...
        for (j, rx) in [job(0, 4, None), job(0, 4, None)] {
            jtx.send(j).await.unwrap();
            keep.push(rx);
        }
        // ...while jobs of another layer keep arriving, each cancelling that wait.
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_micros(100)).await;
            let (j, rx) = job(1, 1, None);
            jtx.send(j).await.unwrap();
            keep.push(rx);
        }
        for _ in 0..2 {
            let s = tokio::time::timeout(Duration::from_secs(1), srx.recv()).await;
            assert_eq!(s.expect("a full step forms").unwrap().tokens(), 4);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(in_flight.available_permits(), 0);
        // Both steps delivered: the partial layer-1 step needs both permits back, and gets them.
        in_flight.add_permits(2);
        let s = tokio::time::timeout(Duration::from_secs(1), srx.recv()).await;
        assert_eq!(s.expect("no permit leaked").unwrap().layer, 1);
        stop.cancel();
        in_flight.add_permits(8);
        while srx.recv().await.is_some() {}
        task.await.unwrap();
    }

    #[tokio::test]
    async fn expired_and_abandoned_requests_never_enter_a_step() {
        let h = harness(64, 20, 1, 1);
        let (jtx, mut srx, stop, task) = (h.jobs, h.steps, h.stop, h.task);
        let wake = h.wake;
        let (late, late_rx) = job(
            0,
            4,
            Some(std::time::Instant::now() + Duration::from_millis(1)),
        );
        let (gone, gone_rx) = job(0, 5, None);
        let (kept, _kept_rx) = job(0, 6, None);
        for j in [late, gone, kept] {
            jtx.send(j).await.unwrap();
        }
        drop(gone_rx);
        wake.notify_one();
        let err = late_rx.await.unwrap().unwrap_err();
        assert!(matches!(err, Failure::Deadline(_)), "{err:?}");
        let s = srx.recv().await.unwrap();
        assert_eq!(
            s.segments
                .iter()
                .map(|g| g.job.input.tokens)
                .collect::<Vec<_>>(),
            vec![6]
        );
        stop.cancel();
        task.await.unwrap();
    }
}
