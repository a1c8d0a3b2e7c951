//! The decode budget: memory held by request messages while they are read. Admission counts a
//! request's tokens only once its message is whole; so 2 connections x 16 streams that declared
//! 48 MiB, sent 16 and stalled held 528 MiB of the leader with every queue metric at 0. Here a
//! request body is metered: a message is charged against its connection's share and the rank's
//! budget as its bytes arrive, `RESERVE` of it from its prefix (the readers' buffers are sized
//! from the declared length, but a page is resident only once written), and released when its
//! last byte has passed. Charging the declared length up front let four connections that only
//! declared 16 MiB bodies refuse every other client until --upload-timeout (#56). Over budget a
//! message waits `--upload-wait`, then gets RESOURCE_EXHAUSTED; a message whose bytes stop coming
//! gets DEADLINE_EXCEEDED at its call's `grpc-timeout`, else `--upload-timeout` after its first
//! byte. Either way its charge is freed when the call lets the body go.
//!
//! A message wholly inside one HTTP/2 frame is not charged (the frame is in memory already, and
//! frames are bounded by --http2-max-frame-size); neither is one over --max-request-bytes, which
//! the reader refuses from its prefix without allocating.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use clap::Args;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tonic::Status;

use crate::flags::{duration, size};
use crate::metric_names;

type BoxError = Box<dyn StdError + Send + Sync>;
type Charged = Result<Charge, Status>;

/// What a message is charged from its prefix before its bytes come: enough for a frame or two
/// (--http2-max-frame-size is 16 KiB to 1 MiB), little enough that declared lengths alone fill
/// no budget.
pub const RESERVE: usize = 256 << 10;

#[derive(Args, Debug, Clone)]
pub struct UploadArgs {
    /// Bytes that request messages being read may hold, all connections together (default:
    /// 4 x --max-request-bytes). A number of bytes or a size (256MiB).
    #[arg(long, env = "EPSERVE_UPLOAD_BUDGET", value_parser = size)]
    pub upload_budget: Option<u64>,
    /// Of which one connection may hold (default: a quarter of the budget, and at least
    /// --max-request-bytes).
    #[arg(long, env = "EPSERVE_UPLOAD_CONNECTION_SHARE", value_parser = size)]
    pub upload_connection_share: Option<u64>,
    /// Longest a message waits for room in the budget before RESOURCE_EXHAUSTED.
    #[arg(long, env = "EPSERVE_UPLOAD_WAIT", default_value = "1s", value_parser = duration)]
    pub upload_wait: Duration,
    /// Longest a request message may take to arrive when its call sets no grpc-timeout (a unary
    /// call's from its start, a stream's each from its first byte); past it DEADLINE_EXCEEDED.
    #[arg(long, env = "EPSERVE_UPLOAD_TIMEOUT", default_value = "60s", value_parser = duration)]
    pub upload_timeout: Duration,
}

impl UploadArgs {
    /// The budget and a connection's share, in bytes, for messages of at most `max_message`;
    /// the error names the flag that does not fit.
    pub fn sizes(&self, max_message: usize) -> Result<(usize, usize), String> {
        let bytes = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let size = self
            .upload_budget
            .map(bytes)
            .unwrap_or(max_message.saturating_mul(4))
            .min(Semaphore::MAX_PERMITS);
        // The largest message a reader charges: its prefix's length is a u32.
        let largest = max_message.min(u32::MAX as usize);
        if size < largest {
            return Err(format!(
                "--upload-budget ({size} bytes) is below --max-request-bytes ({max_message}): a \
                 message of the largest accepted size could never be read"
            ));
        }
        let share = self
            .upload_connection_share
            .map(bytes)
            .unwrap_or((size / 4).max(largest));
        if share < largest {
            return Err(format!(
                "--upload-connection-share ({share} bytes) is below --max-request-bytes \
                 ({max_message}): a message of the largest accepted size could never be read"
            ));
        }
        if share > size {
            return Err(format!(
                "--upload-connection-share ({share} bytes) is above --upload-budget ({size})"
            ));
        }
        Ok((size, share))
    }
}

/// The rank's budget, shared by its connections.
pub struct Budget {
    all: Arc<Semaphore>,
    size: usize,
    share: usize,
    wait: Duration,
    pub timeout: Duration,
    /// Larger messages are refused by the readers from their prefix; they are not charged.
    max_message: usize,
}

impl Budget {
    /// The budget of `args` for messages of at most `max_message` bytes; the error names the
    /// flag that does not fit.
    pub fn new(args: &UploadArgs, max_message: usize) -> Result<Arc<Self>, String> {
        let (size, share) = args.sizes(max_message)?;
        Ok(Arc::new(Self {
            all: Arc::new(Semaphore::new(size)),
            size,
            share,
            wait: args.upload_wait,
            timeout: args.upload_timeout,
            max_message,
        }))
    }

    /// The bytes a rank may hold in messages being read.
    pub fn size(&self) -> usize {
        self.size
    }

    /// A new connection's share.
    pub fn connection(self: &Arc<Self>) -> Arc<Share> {
        Arc::new(Share {
            budget: self.clone(),
            mine: Arc::new(Semaphore::new(self.share)),
        })
    }

    fn held(&self) -> usize {
        self.size - self.all.available_permits()
    }
}

/// One connection's part of the budget.
pub struct Share {
    budget: Arc<Budget>,
    mine: Arc<Semaphore>,
}

impl Share {
    /// `body` metered against this share; `deadline` is its call's grpc-timeout, if it set one.
    pub fn meter<B>(self: &Arc<Self>, body: B, deadline: Option<Instant>) -> Metered<B> {
        Metered {
            inner: body,
            share: self.clone(),
            call_deadline: deadline,
            head: [0; 5],
            have: 0,
            left: 0,
            declared: 0,
            oversize: false,
            charge: None,
            held: None,
            waiting: None,
            timer: None,
            done: false,
        }
    }

    /// Grows `charge` to `to` bytes (a body read here as it arrives), waiting for room as a
    /// message does; nothing if it holds that much already.
    pub async fn grow(
        self: &Arc<Self>,
        charge: &mut Option<Charge>,
        to: usize,
    ) -> Result<(), Status> {
        let have = charge.as_ref().map_or(0, Charge::bytes);
        if to <= have {
            return Ok(());
        }
        let more = u32::try_from(to - have).unwrap_or(u32::MAX);
        let c = self.clone().charge(more).await?;
        match charge {
            Some(held) => held.merge(c),
            None => *charge = Some(c),
        }
        Ok(())
    }

    /// Room for a message of `len` bytes: this connection's share first, then the rank's.
    async fn charge(self: Arc<Self>, len: u32) -> Result<Charge, Status> {
        let b = &self.budget;
        let got = tokio::time::timeout(b.wait, async {
            let mine = self.mine.clone().acquire_many_owned(len).await;
            let all = b.all.clone().acquire_many_owned(len).await;
            (mine, all)
        })
        .await;
        match got {
            Ok((Ok(mine), Ok(all))) => Ok(Charge::new(mine, all)),
            Ok(_) => Err(Status::internal("the upload budget was closed")),
            Err(_) => {
                crate::rejections::count_rejection("upload_budget");
                tracing::debug!(reason = "upload_budget", bytes = len, "request refused");
                Err(Status::resource_exhausted(format!(
                    "no room to read a request message of {len} bytes within --upload-wait \
                     ({:?}): this connection's messages hold {} of its {} bytes, all \
                     connections' {} of --upload-budget {}",
                    b.wait,
                    b.share - self.mine.available_permits(),
                    b.share,
                    b.held(),
                    b.size
                )))
            }
        }
    }
}

/// One message's room in the budget, given back on drop.
pub struct Charge {
    /// (this connection's share, the rank's budget); taken by `merge`.
    room: Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)>,
}

impl Charge {
    fn new(mine: OwnedSemaphorePermit, all: OwnedSemaphorePermit) -> Self {
        metrics::gauge!(metric_names::UPLOAD_BYTES).increment(all.num_permits() as f64);
        Self {
            room: Some((mine, all)),
        }
    }

    pub fn bytes(&self) -> usize {
        self.room.as_ref().map_or(0, |r| r.1.num_permits())
    }

    /// Takes `other`'s room into this one.
    fn merge(&mut self, mut other: Charge) {
        if let (Some(r), Some(o)) = (self.room.as_mut(), other.room.take()) {
            r.0.merge(o.0);
            r.1.merge(o.1);
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        metrics::gauge!(metric_names::UPLOAD_BYTES).decrement(self.bytes() as f64);
    }
}

/// A request body whose messages are charged to a `Share` before they are handed on.
pub struct Metered<B> {
    inner: B,
    share: Arc<Share>,
    call_deadline: Option<Instant>,
    /// The prefix of the next message, `have` bytes of it seen.
    head: [u8; 5],
    have: usize,
    /// Bytes of the current message still to come, of its declared length.
    left: usize,
    declared: usize,
    /// The current message is over --max-request-bytes: the reader refuses it, uncharged.
    oversize: bool,
    /// The current message's room, held until its last byte has passed.
    charge: Option<Charge>,
    /// A frame waiting for its message's charge.
    held: Option<Frame<Bytes>>,
    waiting: Option<Pin<Box<dyn Future<Output = Charged> + Send>>>,
    /// When the current message must be in.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    done: bool,
}

/// What one data frame did to the message in progress.
#[derive(Debug, PartialEq, Eq)]
struct Scan {
    /// The message in progress before the frame was completed by it.
    closed: bool,
    /// A message begun in the frame and left incomplete at its end: its declared length.
    opened: Option<usize>,
}

impl<B> Metered<B> {
    fn scan(&mut self, mut data: &[u8]) -> Scan {
        let mut s = Scan {
            closed: false,
            opened: None,
        };
        while !data.is_empty() {
            if self.left > 0 {
                let n = self.left.min(data.len());
                self.left -= n;
                data = &data[n..];
                if self.left == 0 && s.opened.take().is_none() {
                    s.closed = true;
                }
                continue;
            }
            let n = (5 - self.have).min(data.len());
            self.head[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data = &data[n..];
            if self.have == 5 {
                self.have = 0;
                let h = &self.head;
                self.left = u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize;
                self.declared = self.left;
                if self.left > 0 {
                    s.opened = Some(self.left);
                }
            }
        }
        s
    }

    fn fail(&mut self, s: Status) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.done = true;
        self.charge = None;
        self.held = None;
        self.waiting = None;
        self.timer = None;
        Poll::Ready(Some(Err(Box::new(s))))
    }

    /// DEADLINE_EXCEEDED if the current message's time is up.
    fn late(&mut self, cx: &mut Context<'_>) -> Option<Status> {
        let t = self.timer.as_mut()?;
        t.as_mut().poll(cx).is_ready().then(|| {
            crate::rejections::count_rejection("upload_deadline");
            tracing::debug!(
                reason = "upload_deadline",
                missing = self.left,
                "request refused"
            );
            let by = match self.call_deadline {
                Some(_) => "the call's grpc-timeout".to_string(),
                None => format!("--upload-timeout ({:?})", self.share.budget.timeout),
            };
            Status::deadline_exceeded(format!(
                "the request message did not arrive within {by}: {} bytes still missing",
                self.left
            ))
        })
    }
}

impl<B> Body for Metered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(w) = this.waiting.as_mut() {
            match w.as_mut().poll(cx) {
                Poll::Ready(Ok(c)) => {
                    this.waiting = None;
                    match this.charge.as_mut() {
                        Some(held) => held.merge(c),
                        None => this.charge = Some(c),
                    }
                    return Poll::Ready(this.held.take().map(Ok));
                }
                Poll::Ready(Err(s)) => return this.fail(s),
                Poll::Pending => {
                    return match this.late(cx) {
                        Some(s) => this.fail(s),
                        None => Poll::Pending,
                    }
                }
            }
        }
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => {
                return match this.late(cx) {
                    Some(s) => this.fail(s),
                    None => Poll::Pending,
                }
            }
            Poll::Ready(None) => {
                this.done = true;
                this.charge = None;
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(Some(Ok(f))) => f,
        };
        let Some(data) = frame.data_ref() else {
            return Poll::Ready(Some(Ok(frame)));
        };
        let scan = this.scan(data);
        if scan.closed {
            this.charge = None;
            this.timer = None;
        }
        let budget = &this.share.budget;
        if let Some(len) = scan.opened {
            this.oversize = len > budget.max_message;
            if !this.oversize {
                let deadline = this
                    .call_deadline
                    .unwrap_or_else(|| Instant::now() + budget.timeout);
                this.timer = Some(Box::pin(tokio::time::sleep_until(deadline)));
            }
        }
        if this.left == 0 || this.oversize {
            return Poll::Ready(Some(Ok(frame)));
        }
        // The message goes on past this frame: charged what has come, RESERVE at least.
        let arrived = this.declared - this.left;
        let target = this.declared.min(arrived.max(RESERVE));
        let have = this.charge.as_ref().map_or(0, Charge::bytes);
        if target <= have {
            return Poll::Ready(Some(Ok(frame)));
        }
        this.held = Some(frame);
        this.waiting = Some(Box::pin(this.share.clone().charge((target - have) as u32)));
        // Polls the charge at once: it is granted without waiting while there is room.
        Pin::new(this).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.done || (self.held.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use tokio::sync::mpsc;
    use tonic::Code;

    /// A body whose frames a test sends one by one; it ends when the sender is dropped.
    struct Feed(mpsc::UnboundedReceiver<Bytes>);

    impl Body for Feed {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
        }
    }

    use std::convert::Infallible;

    fn feed() -> (mpsc::UnboundedSender<Bytes>, Feed) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, Feed(rx))
    }

    fn budget(size: u64, share: u64, max: usize) -> Arc<Budget> {
        let args = UploadArgs {
            upload_budget: Some(size),
            upload_connection_share: Some(share),
            upload_wait: Duration::from_secs(1),
            upload_timeout: Duration::from_secs(10),
        };
        Budget::new(&args, max).unwrap()
    }

    fn framed(len: usize) -> Vec<u8> {
        let mut f = vec![0];
        f.extend((len as u32).to_be_bytes());
        f.extend((0..len).map(|i| i as u8));
        f
    }

    async fn next(b: &mut Metered<Feed>) -> Option<Result<Bytes, Status>> {
        let f = std::future::poll_fn(|cx| Pin::new(&mut *b).poll_frame(cx)).await?;
        Some(
            f.map(|f| f.into_data().unwrap())
                .map_err(|e| *e.downcast::<Status>().unwrap()),
        )
    }

    /// Random messages cut at random places: every byte passes in order, and between frames the
    /// budget holds exactly what the message whose prefix has arrived and whose body has not is
    /// charged: its bytes so far, `RESERVE` at least, its declared length at most (nothing for
    /// one that came whole inside a frame).
    #[tokio::test]
    async fn a_message_is_charged_from_its_prefix_to_its_last_byte() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let b = budget(1 << 30, 1 << 30, 1 << 20);
        let share = b.connection();
        for _ in 0..20 {
            let lens: Vec<usize> = (0..rng.random_range(1..6))
                .map(|_| [0, 1, 4, 100, 70_000, 1_000_000][rng.random_range(0..6)])
                .collect();
            let bytes: Vec<u8> = lens.iter().flat_map(|&l| framed(l)).collect();
            // Where each message's body starts and ends in the stream.
            let mut spans = Vec::new();
            let mut at = 0;
            for &l in &lens {
                spans.push((at + 5, at + 5 + l, l));
                at += 5 + l;
            }
            let (tx, body) = feed();
            let mut m = share.meter(body, None);
            let (mut sent, mut got) = (0, Vec::new());
            while sent < bytes.len() {
                let n = rng.random_range(1..=(bytes.len() - sent).min(50_000));
                tx.send(Bytes::copy_from_slice(&bytes[sent..sent + n]))
                    .unwrap();
                sent += n;
                got.extend_from_slice(&next(&mut m).await.unwrap().unwrap());
                // The message whose prefix is whole and whose body is not.
                let want = spans
                    .iter()
                    .find(|&&(s, e, _)| s <= sent && sent < e)
                    .map_or(0, |&(s, _, l)| l.min((sent - s).max(RESERVE)));
                assert_eq!(b.held(), want, "{lens:?} after {sent} bytes");
            }
            drop(tx);
            assert!(next(&mut m).await.is_none());
            assert_eq!(got, bytes);
            assert_eq!(b.held(), 0);
        }
    }

    /// Messages that declare their whole share and send a few bytes hold `RESERVE` each: a
    /// fifth gets in where, charged their declared lengths, the second would have waited (#56:
    /// four stalled uploads refused every other client until --upload-timeout). As their bytes
    /// come, the charge follows them up to the declared length.
    #[tokio::test(start_paused = true)]
    async fn a_declared_length_holds_only_a_reserve_until_its_bytes_come() {
        let mib = 1 << 20;
        let b = budget(4 * mib as u64, 4 * mib as u64, 4 * mib);
        let share = b.connection();
        let mut stalled = Vec::new();
        for _ in 0..5 {
            let (tx, body) = feed();
            let mut m = share.meter(body, None);
            tx.send(start(4 * mib, 10)).unwrap();
            next(&mut m).await.unwrap().unwrap();
            stalled.push((tx, m));
        }
        assert_eq!(b.held(), 5 * RESERVE);
        let (tx, m) = &mut stalled[0];
        tx.send(Bytes::from(vec![1; mib])).unwrap();
        next(m).await.unwrap().unwrap();
        assert_eq!(b.held(), 4 * RESERVE + mib + 10);
        drop(stalled);
        assert_eq!(b.held(), 0);
    }

    /// A paused clock's timers fire within a millisecond of their time.
    fn near(elapsed: Duration, want: Duration) {
        assert!(
            elapsed >= want && elapsed <= want + Duration::from_millis(2),
            "{elapsed:?}, not {want:?}"
        );
    }

    /// The first `n` bytes of a message of `len`, as one frame.
    fn start(len: usize, n: usize) -> Bytes {
        Bytes::from(framed(len)[..5 + n].to_vec())
    }

    /// One connection past its share waits --upload-wait, then RESOURCE_EXHAUSTED, while
    /// another connection reads; the waiting message goes through if room frees in time.
    #[tokio::test(start_paused = true)]
    async fn past_its_share_a_message_waits_then_is_refused() {
        let b = budget(300, 100, 100);
        let (one, two) = (b.connection(), b.connection());
        let (tx1, body1) = feed();
        let mut first = one.meter(body1, None);
        tx1.send(start(100, 10)).unwrap();
        next(&mut first).await.unwrap().unwrap();
        assert_eq!(b.held(), 100);

        let (tx2, body2) = feed();
        let mut second = one.meter(body2, None);
        tx2.send(start(50, 10)).unwrap();
        let t0 = tokio::time::Instant::now();
        let e = next(&mut second).await.unwrap().unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted);
        near(t0.elapsed(), Duration::from_secs(1));
        assert!(e.message().contains("hold 100 of its 100 bytes"), "{e:?}");
        assert!(next(&mut second).await.is_none(), "a refused body ends");

        let (tx3, body3) = feed();
        let mut other = two.meter(body3, None);
        tx3.send(start(100, 1)).unwrap();
        next(&mut other).await.unwrap().unwrap();
        assert_eq!(b.held(), 200);

        // Room frees within the wait: the message goes on.
        let (tx4, body4) = feed();
        let mut third = one.meter(body4, None);
        tx4.send(start(60, 0)).unwrap();
        let waiting = tokio::spawn(async move {
            let got = next(&mut third).await.map(|r| r.map(|f| f.len()));
            (got, third)
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        tx1.send(Bytes::from(vec![0; 90])).unwrap();
        next(&mut first).await.unwrap().unwrap();
        let (got, _third) = waiting.await.unwrap();
        assert_eq!(got.unwrap().unwrap(), 5);
        assert_eq!(b.held(), 160);
        drop((other, tx3));
        assert_eq!(b.held(), 60, "a dropped body frees its charge");
    }

    /// A message whose bytes stop coming ends DEADLINE_EXCEEDED at --upload-timeout, or at the
    /// call's deadline when it set one, and frees its charge; an oversize one is not charged.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_message_ends_at_its_deadline() {
        let b = budget(1000, 1000, 100);
        let share = b.connection();
        for (deadline, after) in [(None, 10.0), (Some(3.0), 3.0)] {
            let (tx, body) = feed();
            let t0 = tokio::time::Instant::now();
            let deadline = deadline.map(|d| Instant::now() + Duration::from_secs_f64(d));
            let mut m = share.meter(body, deadline);
            tx.send(start(80, 40)).unwrap();
            next(&mut m).await.unwrap().unwrap();
            assert_eq!(b.held(), 80);
            let e = next(&mut m).await.unwrap().unwrap_err();
            assert_eq!(e.code(), Code::DeadlineExceeded);
            assert!(e.message().contains("40 bytes still missing"), "{e:?}");
            near(t0.elapsed(), Duration::from_secs_f64(after));
            assert_eq!(b.held(), 0);
        }
        let (tx, body) = feed();
        let mut m = share.meter(body, None);
        tx.send(start(101, 1)).unwrap();
        next(&mut m).await.unwrap().unwrap();
        assert_eq!(b.held(), 0, "the reader refuses it from its prefix");
    }

    #[test]
    fn shares_that_cannot_work_are_refused_at_startup() {
        let args = |budget, share| UploadArgs {
            upload_budget: budget,
            upload_connection_share: share,
            upload_wait: Duration::from_secs(1),
            upload_timeout: Duration::from_secs(1),
        };
        let b = Budget::new(&args(None, None), 64 << 20).unwrap();
        assert_eq!((b.size, b.share), (256 << 20, 64 << 20));
        let b = Budget::new(&args(Some(1 << 30), None), 64 << 20).unwrap();
        assert_eq!(b.share, 256 << 20);
        let e = Budget::new(&args(None, Some(1 << 20)), 64 << 20)
            .err()
            .unwrap();
        assert!(e.contains("--upload-connection-share"), "{e}");
        let e = Budget::new(&args(Some(32 << 20), None), 64 << 20)
            .err()
            .unwrap();
        assert!(
            e.contains("--upload-budget (33554432 bytes) is below"),
            "{e}"
        );
        let e = Budget::new(&args(Some(128 << 20), Some(256 << 20)), 64 << 20)
            .err()
            .unwrap();
        assert!(e.contains("above --upload-budget"), "{e}");
    }
}
