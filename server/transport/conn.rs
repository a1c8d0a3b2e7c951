//! One gRPC connection's service: its request bodies metered against its share of the decode
//! budget (`upload`), its account of unwritten answers (`answer`) given to its calls, and its
//! calls counted, so that a connection that never opens a call (one
//! that connects and sends nothing, or stops after the HTTP/2 preface) or has none open for
//! long is closed. Each such connection holds a descriptor and a task; without a bound they
//! accumulate until accepts fail.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use clap::Args;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::sync::watch;
use tonic::body::Body;

use super::answer::ConnAnswers;
use super::upload::Share;
use crate::flags::duration;

#[derive(Args, Debug, Clone)]
pub struct ConnArgs {
    /// Close a connection that has not opened its first call within this (covers a client that
    /// never sends the HTTP/2 preface); 0s: never.
    #[arg(long, env = "EPSERVE_FIRST_CALL_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub first_call_timeout: Duration,
    /// Close (HTTP/2 GOAWAY, which clients answer by reconnecting) a connection with no call open
    /// for this long; 0s: never.
    #[arg(long, env = "EPSERVE_IDLE_TIMEOUT", default_value = "10m", value_parser = duration)]
    pub idle_timeout: Duration,
}

/// Calls open on a connection and calls begun so far.
#[derive(Clone, Copy, Default)]
struct Activity {
    open: usize,
    begun: u64,
}

/// Counts a connection's calls; `idle` resolves once it has had none for too long.
#[derive(Clone, Default)]
pub struct Calls(Arc<watch::Sender<Activity>>);

/// One open call; the call is over when this is dropped (with its answer's body).
pub struct Open(Arc<watch::Sender<Activity>>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.send_modify(|a| a.open -= 1);
    }
}

impl Calls {
    pub fn begin(&self) -> Open {
        self.0.send_modify(|a| {
            a.open += 1;
            a.begun += 1;
        });
        Open(self.0.clone())
    }

    /// Resolves when the connection has had no call open for `first` before its first call, or
    /// `idle` after one (None: never).
    pub async fn idle(&self, first: Option<Duration>, idle: Option<Duration>) {
        let mut rx = self.0.subscribe();
        loop {
            let Ok(begun) = rx.wait_for(|a| a.open == 0).await.map(|a| a.begun) else {
                return std::future::pending().await;
            };
            let limit = if begun == 0 { first } else { idle };
            let active = rx.wait_for(|a| a.open > 0 || a.begun != begun);
            match limit {
                Some(limit) => {
                    if tokio::time::timeout(limit, active).await.is_err() {
                        return;
                    }
                }
                None => {
                    let _ = active.await;
                }
            }
        }
    }
}

impl ConnArgs {
    pub fn first_call(&self) -> Option<Duration> {
        (!self.first_call_timeout.is_zero()).then_some(self.first_call_timeout)
    }

    pub fn idle(&self) -> Option<Duration> {
        (!self.idle_timeout.is_zero()).then_some(self.idle_timeout)
    }
}

/// The routes `S` as one connection serves them.
#[derive(Clone)]
pub struct PerConnection<S> {
    inner: S,
    share: Arc<Share>,
    answers: Arc<ConnAnswers>,
    calls: Calls,
}

impl<S> PerConnection<S> {
    pub fn new(inner: S, share: Arc<Share>, answers: Arc<ConnAnswers>, calls: Calls) -> Self {
        Self {
            inner,
            share,
            answers,
            calls,
        }
    }
}

impl<S, B> tonic::codegen::Service<http::Request<B>> for PerConnection<S>
where
    B: HttpBody<Data = bytes::Bytes> + Unpin + Send + 'static,
    B::Error: Into<tonic::codegen::StdError>,
    S: tonic::codegen::Service<
        http::Request<Body>,
        Response = http::Response<Body>,
        Error = Infallible,
    >,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let open = self.calls.begin();
        req.extensions_mut().insert(self.answers.clone());
        req.extensions_mut().insert(self.share.clone());
        let deadline = super::header_timeout(req.headers())
            .and_then(|d| tokio::time::Instant::now().checked_add(d));
        let share = self.share.clone();
        let req = req.map(|b| Body::new(share.meter(b, deadline)));
        let answer = self.inner.call(req);
        Box::pin(async move {
            let answer = answer.await?;
            Ok(answer.map(|b| {
                Body::new(Answer {
                    body: b,
                    _open: open,
                })
            }))
        })
    }
}

/// An answer's body, holding its call open until it is dropped.
struct Answer {
    body: Body,
    _open: Open,
}

impl HttpBody for Answer {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<bytes::Bytes>, tonic::Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paused time: `idle` resolves after `first` with no call, after `idle` once calls are
    /// over, never while one is open, and a call begun and ended between two looks still counts.
    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_with_no_call_open_for_its_limit() {
        let s = Duration::from_secs(1);
        let calls = Calls::default();
        let t0 = tokio::time::Instant::now();
        calls.idle(Some(2 * s), Some(5 * s)).await;
        assert_eq!(t0.elapsed(), 2 * s);

        let calls = Calls::default();
        let watcher = {
            let calls = calls.clone();
            tokio::spawn(async move {
                let t0 = tokio::time::Instant::now();
                calls.idle(Some(2 * s), Some(5 * s)).await;
                t0.elapsed()
            })
        };
        tokio::time::sleep(s).await;
        let open = calls.begin();
        tokio::time::sleep(30 * s).await;
        assert!(!watcher.is_finished(), "idle with a call open");
        drop(open);
        // Begun and over at once: the watcher sees only its count move.
        tokio::time::sleep(4 * s).await;
        drop(calls.begin());
        let elapsed = watcher.await.unwrap();
        assert_eq!(elapsed, (1 + 30 + 4 + 5) * s);

        let calls = Calls::default();
        let never = tokio::time::timeout(3600 * s, calls.idle(None, None)).await;
        assert!(never.is_err());
    }
}
