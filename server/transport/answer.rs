//! The answer budget: memory held by answers that are made and not yet written. A request's
//! admission (its share of --max-queued-tokens) is let go once its answer is made; from then the
//! answer's bytes are charged here, to its connection's share and to the rank's budget, until
//! the transport has taken its last byte. Before, admission was held until then, and one HTTP/2
//! connection that granted a 64 KiB window and sent a 65,536-row request held all of
//! --max-queued-tokens for as long as it lived (#56).
//!
//! - A request is let in only while its connection's unwritten answers are under its share and
//!   the rank's under the budget; else it waits --upload-wait, then RESOURCE_EXHAUSTED.
//! - With the budget full, a waiting request closes the connection whose oldest answer has gone
//!   unwritten longest (at least `STALE`): clients that do not read cannot refuse those that do.
//! - An answer not written within --write-timeout closes its connection.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use clap::Args;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::flags::{duration, size};
use crate::metric_names;

/// How long an answer must have waited unwritten before a full budget closes its connection: a
/// client reading at any speed takes a 128 MiB answer off a local socket in far less.
pub const STALE: Duration = Duration::from_millis(250);

/// Largest piece of an answer handed to the transport at once. What it has taken it keeps in
/// buffers of its own, uncharged: hyper's HTTP/1 writer takes whole buffers until 400 KiB are
/// queued, h2 a stream's whole chunk whenever its window has room; so an 8 MiB answer handed over
/// as one buffer left the budget at once (32 unread REST answers: +149 MiB, the gauge at 0).
pub const PIECE: usize = 64 << 10;

/// The next piece of `data`, at most `PIECE` bytes, leaving the rest in it (no copy).
pub fn piece(data: &mut bytes::Bytes) -> bytes::Bytes {
    data.split_to(data.len().min(PIECE))
}

/// How often a request waiting on a full budget looks for a stale reader.
const LOOK_AGAIN: Duration = Duration::from_millis(50);

#[derive(Args, Debug, Clone)]
pub struct AnswerArgs {
    /// Bytes that answers made and not yet written may hold, all connections together (default:
    /// 4 x --max-request-bytes). A number of bytes or a size (256MiB).
    #[arg(long, env = "EPSERVE_ANSWER_BUDGET", value_parser = size)]
    pub answer_budget: Option<u64>,
    /// Of which one connection's answers may hold before its next request waits (default: a
    /// quarter of the budget).
    #[arg(long, env = "EPSERVE_ANSWER_CONNECTION_SHARE", value_parser = size)]
    pub answer_connection_share: Option<u64>,
    /// Longest an answer may wait to be written once it is made; past it its connection is
    /// closed (its unwritten answers counted as `write_timeout` rejections). 0s: never.
    #[arg(long, env = "EPSERVE_WRITE_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub write_timeout: Duration,
}

/// The rank's budget, shared by the connections of its gRPC and REST ports.
pub struct Answers {
    size: usize,
    share: usize,
    wait: Duration,
    write_timeout: Option<Duration>,
    held: AtomicUsize,
    /// Woken whenever an answer's charge is given back.
    freed: Notify,
    conns: Mutex<Vec<Weak<ConnAnswers>>>,
}

impl Answers {
    /// The budget of `args` (its share's wait is --upload-wait); the error names the flag that
    /// does not fit.
    pub fn new(args: &AnswerArgs, max_request: usize, wait: Duration) -> Result<Arc<Self>, String> {
        let bytes = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let size = args
            .answer_budget
            .map(bytes)
            .unwrap_or(max_request.saturating_mul(4));
        let share = args.answer_connection_share.map(bytes).unwrap_or(size / 4);
        if size == 0 || share == 0 {
            return Err("--answer-budget and --answer-connection-share must be above 0".into());
        }
        if share > size {
            return Err(format!(
                "--answer-connection-share ({share} bytes) is above --answer-budget ({size})"
            ));
        }
        Ok(Arc::new(Self {
            size,
            share,
            wait,
            write_timeout: (!args.write_timeout.is_zero()).then_some(args.write_timeout),
            held: AtomicUsize::new(0),
            freed: Notify::new(),
            conns: Mutex::new(Vec::new()),
        }))
    }

    /// A new connection's account.
    pub fn connection(self: &Arc<Self>) -> Arc<ConnAnswers> {
        let c = Arc::new(ConnAnswers {
            all: self.clone(),
            held: AtomicUsize::new(0),
            pending: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
            changed: Notify::new(),
            close: CancellationToken::new(),
        });
        let mut conns = self.conns.lock().unwrap();
        conns.retain(|w| w.strong_count() > 0);
        conns.push(Arc::downgrade(&c));
        c
    }

    /// Bytes held by unwritten answers, all connections.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Closes the connection other than `me` whose oldest unwritten answer has waited longest,
    /// if that is at least `STALE`; true if one was closed.
    fn evict(&self, me: &ConnAnswers) -> bool {
        let now = Instant::now();
        let oldest = self
            .conns
            .lock()
            .unwrap()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| !std::ptr::eq(c.as_ref(), me) && !c.close.is_cancelled())
            .filter_map(|c| Some((c.oldest()?, c)))
            .min_by_key(|(t, _)| *t);
        match oldest {
            Some((t, c)) if now.duration_since(t) >= STALE => {
                let (n, bytes) = c.unwritten();
                crate::rejections::count_rejection("answer_evicted");
                tracing::warn!(
                    answers = n,
                    bytes,
                    waited_ms = now.duration_since(t).as_millis() as u64,
                    "--answer-budget is full: closing the connection whose answers have waited \
                     longest unread"
                );
                c.close.cancel();
                true
            }
            _ => false,
        }
    }
}

/// One connection's unwritten answers.
pub struct ConnAnswers {
    all: Arc<Answers>,
    held: AtomicUsize,
    /// Its unwritten answers: id -> (when made, bytes).
    pending: Mutex<BTreeMap<u64, (Instant, usize)>>,
    next: AtomicU64,
    /// Woken whenever `pending` changes.
    changed: Notify,
    /// Cancelled when the budget closes this connection.
    close: CancellationToken,
}

impl ConnAnswers {
    /// Waits until this connection may take one more request: its answers under its share and
    /// the rank's under the budget (closing a stale reader's connection when only the budget is
    /// full); RESOURCE_EXHAUSTED after --upload-wait.
    pub async fn room(&self) -> Result<(), Status> {
        let all = &self.all;
        let deadline = Instant::now() + all.wait;
        loop {
            let freed = all.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let (mine, held) = (self.held.load(Ordering::Acquire), all.held());
            if mine < all.share && held < all.size {
                return Ok(());
            }
            if Instant::now() >= deadline {
                crate::rejections::count_rejection("answer_budget");
                tracing::debug!(reason = "answer_budget", "request refused");
                return Err(Status::resource_exhausted(format!(
                    "answers not yet read hold {mine} of this connection's {} bytes \
                     (--answer-connection-share) and {held} of --answer-budget {} on all \
                     connections; nothing freed within --upload-wait ({:?})",
                    all.share, all.size, all.wait
                )));
            }
            // Only the budget is full: a reader may turn stale while this waits; look again.
            let wake = if mine < all.share && !all.evict(self) {
                deadline.min(Instant::now() + LOOK_AGAIN)
            } else {
                deadline
            };
            let _ = tokio::time::timeout_at(wake, freed).await;
        }
    }

    /// Charges a made answer of `bytes` until the returned value is dropped (with the body that
    /// writes it). Never waits: the answer exists already; `room` is what holds requests back.
    pub fn charge(self: &Arc<Self>, bytes: usize) -> Unwritten {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.held.fetch_add(bytes, Ordering::AcqRel);
        self.all.held.fetch_add(bytes, Ordering::AcqRel);
        metrics::gauge!(metric_names::ANSWER_BYTES).increment(bytes as f64);
        self.pending
            .lock()
            .unwrap()
            .insert(id, (Instant::now(), bytes));
        self.changed.notify_waiters();
        Unwritten {
            conn: self.clone(),
            id,
            bytes,
        }
    }

    fn oldest(&self) -> Option<Instant> {
        self.pending.lock().unwrap().values().map(|p| p.0).min()
    }

    /// Unwritten answers and their bytes.
    fn unwritten(&self) -> (usize, usize) {
        let p = self.pending.lock().unwrap();
        (p.len(), p.values().map(|v| v.1).sum())
    }

    /// Resolves when this connection must close: an answer has waited --write-timeout
    /// unwritten, or the budget closed it for a waiting request (the reason, for the log).
    pub async fn must_close(&self) -> &'static str {
        tokio::select! {
            _ = self.close.cancelled() => "answer_evicted",
            _ = self.stalled() => {
                let (n, bytes) = self.unwritten();
                for _ in 0..n {
                    crate::rejections::count_rejection("write_timeout");
                }
                tracing::debug!(answers = n, bytes, "answers not written within --write-timeout");
                "write_timeout"
            }
        }
    }

    async fn stalled(&self) {
        let Some(limit) = self.all.write_timeout else {
            return std::future::pending().await;
        };
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.oldest() {
                None => changed.await,
                Some(t) if t + limit <= Instant::now() => return,
                Some(t) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(t + limit) => {}
                        _ = changed => {}
                    }
                }
            }
        }
    }
}

/// An answer's charge, given back when the body writing it is done or dropped.
pub struct Unwritten {
    conn: Arc<ConnAnswers>,
    id: u64,
    bytes: usize,
}

impl Drop for Unwritten {
    fn drop(&mut self) {
        let c = &self.conn;
        c.pending.lock().unwrap().remove(&self.id);
        c.held.fetch_sub(self.bytes, Ordering::AcqRel);
        c.all.held.fetch_sub(self.bytes, Ordering::AcqRel);
        metrics::gauge!(metric_names::ANSWER_BYTES).decrement(self.bytes as f64);
        c.all.freed.notify_waiters();
        c.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn answers(size: u64, share: u64, write: u64) -> Arc<Answers> {
        let args = AnswerArgs {
            answer_budget: Some(size),
            answer_connection_share: Some(share),
            write_timeout: Duration::from_secs(write),
        };
        Answers::new(&args, 1 << 20, Duration::from_secs(1)).unwrap()
    }

    /// A connection past its share waits --upload-wait, then RESOURCE_EXHAUSTED, while another
    /// gets in at once; a charge given back lets the waiting one in.
    #[tokio::test(start_paused = true)]
    async fn a_connection_past_its_share_waits_then_is_refused() {
        let a = answers(1000, 100, 30);
        let (one, two) = (a.connection(), a.connection());
        let first = one.charge(100);
        two.room().await.unwrap();
        let t0 = Instant::now();
        let e = one.room().await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted);
        assert_eq!(t0.elapsed(), Duration::from_secs(1));
        assert!(
            e.message().contains("hold 100 of this connection's 100"),
            "{e:?}"
        );
        let waiting = tokio::spawn({
            let one = one.clone();
            async move { one.room().await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(first);
        waiting.await.unwrap().unwrap();
        assert_eq!(a.held(), 0);
    }

    /// With the budget full, a request on a connection within its share closes the connection
    /// whose answer has waited longest unread (once it is `STALE`), and gets in when it goes.
    #[tokio::test(start_paused = true)]
    async fn a_full_budget_closes_the_stalest_reader_not_the_new_one() {
        let a = answers(300, 150, 30);
        let (old, newer, me) = (a.connection(), a.connection(), a.connection());
        let held_old = old.charge(150);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _held_newer = newer.charge(150);
        let t0 = Instant::now();
        let closer = tokio::spawn({
            let old = old.clone();
            async move {
                let why = old.must_close().await;
                drop(held_old);
                why
            }
        });
        me.room().await.unwrap();
        // The oldest was 100 ms old: it became stale 150 ms later.
        assert!(
            t0.elapsed() >= Duration::from_millis(150),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(closer.await.unwrap(), "answer_evicted");
        assert!(!newer.close.is_cancelled());
        assert_eq!(a.held(), 150);
    }

    /// An answer left unwritten --write-timeout closes its connection; one written in time, or
    /// none at all, never does.
    #[tokio::test(start_paused = true)]
    async fn an_answer_unwritten_past_the_write_timeout_closes_its_connection() {
        let a = answers(1000, 500, 30);
        let c = a.connection();
        let quiet = tokio::time::timeout(Duration::from_secs(100), c.must_close()).await;
        assert!(quiet.is_err(), "no answer, no close");
        let written = c.charge(10);
        tokio::time::sleep(Duration::from_secs(20)).await;
        drop(written);
        let t0 = Instant::now();
        let _stuck = c.charge(10);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(c.must_close().await, "write_timeout");
        assert_eq!(t0.elapsed(), Duration::from_secs(30));
    }

    #[test]
    fn shares_that_cannot_work_are_refused_at_startup() {
        let w = Duration::from_secs(1);
        let args = |b, s| AnswerArgs {
            answer_budget: b,
            answer_connection_share: s,
            write_timeout: w,
        };
        let a = Answers::new(&args(None, None), 64 << 20, w).unwrap();
        assert_eq!((a.size, a.share), (256 << 20, 64 << 20));
        let e = Answers::new(&args(Some(100), Some(200)), 64 << 20, w)
            .err()
            .unwrap();
        assert!(e.contains("above --answer-budget"), "{e}");
        assert!(Answers::new(&args(Some(0), None), 64 << 20, w).is_err());
    }
}
