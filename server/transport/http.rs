//! The plain-HTTP ports (KServe REST, `/metrics`): HTTP/1.1 and cleartext HTTP/2 on one listener,
//! axum routing over hyper's connections. Each connection's requests are counted (`conn::Calls`)
//! so one that sends nothing, or stays idle past --idle-timeout, is closed, as on the gRPC port,
//! and one whose answers go unread is dropped (`answer`);
//! a request's headers must arrive within `HEADER_WAIT`; at shutdown connections get
//! `CLOSE_WAIT` to finish what they are answering.

use std::convert::Infallible;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::answer::Answers;
use super::conn::{Calls, ConnArgs};
use super::upload::Budget;

/// Longest a request's head may take to arrive (a client that opens and trickles).
const HEADER_WAIT: Duration = Duration::from_secs(10);
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// What a port's connections share: the idle limits and, for ports that take request bodies,
/// the upload and answer budgets (each connection's shares go to its requests as extensions).
#[derive(Clone)]
pub struct Limits {
    pub conns: ConnArgs,
    pub uploads: Option<Arc<Budget>>,
    pub answers: Option<Arc<Answers>>,
}

/// Serves `routes` on `listener` until `stop`; `what` names the port in logs.
pub async fn serve(
    listener: tokio::net::TcpListener,
    routes: axum::Router,
    limits: Limits,
    what: &'static str,
    stop: CancellationToken,
) {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_WAIT);
    let open = tokio_util::task::TaskTracker::new();
    let mut acceptor = super::listen::Acceptor::new(listener, what);
    loop {
        let (tcp, peer) = tokio::select! {
            c = acceptor.accept() => c,
            _ = stop.cancelled() => break,
        };
        let _ = tcp.set_nodelay(true);
        let calls = Calls::default();
        let share = limits.uploads.as_ref().map(|b| b.connection());
        let unread = limits.answers.as_ref().map(|a| a.connection());
        let (routes, counted, answers) = (routes.clone(), calls.clone(), unread.clone());
        let service = tower::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            let open = counted.begin();
            if let Some(s) = &share {
                req.extensions_mut().insert(s.clone());
            }
            if let Some(a) = &answers {
                req.extensions_mut().insert(a.clone());
            }
            let answer = tower::ServiceExt::oneshot(routes.clone(), req.map(Body::new));
            async move {
                let answer = answer.await?;
                Ok::<_, Infallible>(answer.map(|b| Held::new(b, open).into_body()))
            }
        });
        let conn = builder
            .serve_connection(
                TokioIo::new(tcp),
                hyper_util::service::TowerToHyperService::new(service),
            )
            .into_owned();
        let (conns, stop) = (limits.conns.clone(), stop.clone());
        open.spawn(async move {
            let mut conn = pin!(conn);
            let why = tokio::select! {
                end = conn.as_mut() => {
                    if let Err(e) = end {
                        debug!(%peer, "{what} connection ended: {e}");
                    }
                    return;
                }
                why = async {
                    match &unread {
                        Some(a) => a.must_close().await,
                        None => std::future::pending().await,
                    }
                } => {
                    debug!(%peer, "{what} connection dropped ({why})");
                    return;
                }
                _ = calls.idle(conns.first_call(), conns.idle()) => "idle",
                _ = stop.cancelled() => "shutting down",
            };
            conn.as_mut().graceful_shutdown();
            if tokio::time::timeout(CLOSE_WAIT, conn).await.is_err() {
                debug!(%peer, "{what} connection dropped {CLOSE_WAIT:?} after closing ({why})");
            }
        });
    }
    drop(acceptor);
    open.close();
    if tokio::time::timeout(CLOSE_WAIT, open.wait()).await.is_err() {
        warn!("{what} connections still open {CLOSE_WAIT:?} after shutdown; closing");
    }
}

/// A response body that keeps `T` (an open call, an admission permit, an answer's charge) until
/// it is sent or dropped, handing its data over in pieces (`answer::piece`).
pub struct Held<T> {
    body: Body,
    /// The rest of a data frame larger than a piece.
    rest: Bytes,
    _held: T,
}

impl<T: Send + Unpin + 'static> Held<T> {
    pub fn new(body: Body, held: T) -> Self {
        Self {
            body,
            rest: Bytes::new(),
            _held: held,
        }
    }

    pub fn into_body(self) -> Body {
        Body::new(self)
    }
}

impl<T: Unpin> http_body::Body for Held<T> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if self.rest.is_empty() {
            match std::task::ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => self.rest = data,
                    Err(f) => return Poll::Ready(Some(Ok(f))),
                },
                other => return Poll::Ready(other),
            }
        }
        let piece = super::answer::piece(&mut self.rest);
        Poll::Ready(Some(Ok(Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let (inner, rest) = (self.body.size_hint(), self.rest.len() as u64);
        let mut h = SizeHint::new();
        h.set_lower(inner.lower() + rest);
        if let Some(u) = inner.upper() {
            h.set_upper(u + rest);
        }
        h
    }
}
