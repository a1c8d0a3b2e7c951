//! The gRPC port's accept loop: hyper's connections, each with its shares of the upload and
//! answer budgets and its calls counted, closed when idle or at shutdown, and dropped when its
//! answers go unread (`answer`).

use std::convert::Infallible;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tracing::warn;

use super::answer::Answers;
use super::conn::{Calls, ConnArgs, PerConnection};
use super::listen::Acceptor;
use super::upload::Budget;
use super::Http2;

/// How long a connection may take to say goodbye before it is dropped: at shutdown (its calls
/// are answered by then), and when idle (it has none).
const CLOSE_WAIT: Duration = Duration::from_secs(5);
const IDLE_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// The accept loop: each connection served over HTTP/2 with its share of the upload budget,
/// closed when idle or at `stop` (GOAWAY, then dropped after a wait). The loop is ours rather than
/// tonic's transport server, whose built-in grpc-timeout layer answers an expired deadline with
/// CANCELLED before the service can say DEADLINE_EXCEEDED.
pub async fn serve_connections<S>(
    routes: S,
    http2: Http2,
    conns: ConnArgs,
    uploads: Arc<Budget>,
    answers: Arc<Answers>,
    listener: tokio::net::TcpListener,
    stop: CancellationToken,
) where
    S: tonic::codegen::Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::service::TowerToHyperService;
    // gRPC is HTTP/2; HTTP/1.1 is spoken only to refuse it (`unknown`): a load balancer's GET
    // probe gets 505, not a 200 with a gRPC error it would read as healthy.
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10));
    http2.serve(&mut builder);
    let open = tokio_util::task::TaskTracker::new();
    let mut acceptor = Acceptor::new(listener, "gRPC");
    loop {
        tokio::select! {
            (tcp, peer) = acceptor.accept() => {
                let _ = tcp.set_nodelay(true);
                let calls = Calls::default();
                let unread = answers.connection();
                let service = PerConnection::new(
                    routes.clone(),
                    uploads.connection(),
                    unread.clone(),
                    calls.clone(),
                );
                let conn = builder
                    .serve_connection(TokioIo::new(tcp), TowerToHyperService::new(service))
                    .into_owned();
                let (conns, stop) = (conns.clone(), stop.clone());
                open.spawn(async move {
                    let mut conn = pin!(conn);
                    let (why, wait) = tokio::select! {
                        end = conn.as_mut() => {
                            if let Err(e) = end {
                                tracing::debug!(%peer, "gRPC connection ended: {e}");
                            }
                            return;
                        }
                        why = unread.must_close() => {
                            // Its answers are not being read: no goodbye would be read either.
                            tracing::debug!(%peer, "gRPC connection dropped ({why})");
                            return;
                        }
                        _ = calls.idle(conns.first_call(), conns.idle()) => ("idle", IDLE_CLOSE_WAIT),
                        _ = stop.cancelled() => ("shutting down", CLOSE_WAIT),
                    };
                    // GOAWAY; a peer that never finished its handshake or does not answer is
                    // dropped after `wait`.
                    conn.as_mut().graceful_shutdown();
                    if tokio::time::timeout(wait, conn).await.is_err() {
                        tracing::debug!(
                            %peer,
                            wait_seconds = wait.as_secs_f64(),
                            "gRPC connection dropped after closing ({why})"
                        );
                    }
                });
            }
            _ = stop.cancelled() => break,
        }
    }
    drop(acceptor);
    open.close();
    // Every admitted call is answered by now; this only waits for connections to close.
    if tokio::time::timeout(CLOSE_WAIT, open.wait()).await.is_err() {
        warn!("gRPC connections still open {CLOSE_WAIT:?} after shutdown; closing");
    }
}
