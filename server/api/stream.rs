//! One bidirectional stream of requests, served the same way for every protocol: each request
//! runs on its own task and answers go out in completion order, with a bound on what one stream
//! holds and, on a connection with an answer account, on what its unwritten answers hold
//! (`transport::answer`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Status, Streaming};

use crate::request::Permit;
use crate::transport::answer::{ConnAnswers, Unwritten};

pub type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// What a stream holds for one answer until the transport takes it: the stream's in-flight slot
/// and the request's admission permit, or, on a connection with an answer account, the answer's
/// charge there (the admission let go once the answer is made).
type Held = (OwnedSemaphorePermit, Result<Unwritten, Option<Permit>>);

/// Serves `inbound` with `answer`, which turns each request into its response (an error too is a
/// response on a stream) and the permit to hold until it is written. A request is read only when
/// the stream has one of its `cap` slots free, and a slot is freed when the transport takes the
/// answer, so a client that does not read stops being read (HTTP/2 flow control holds the rest
/// back). The stream ends when the client's half is done and every answer is out, or, after the
/// answers in progress, with the status of a message that could not be decoded. If the client
/// goes away, pending requests are abandoned, which frees their queued tokens. With `answers`, a
/// request is read only while the connection's unwritten answers leave room; a stream that finds
/// none within --upload-wait ends RESOURCE_EXHAUSTED.
pub fn serve<Req, Resp, F, Fut>(
    inbound: Streaming<Req>,
    cap: usize,
    answers: Option<Arc<ConnAnswers>>,
    answer: F,
) -> ResponseStream<Resp>
where
    Req: Send + 'static,
    Resp: prost::Message + Send + 'static,
    F: Fn(Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = (Resp, Option<Permit>)> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(cap);
    tokio::spawn(read(inbound, tx, cap, answers, answer));
    Box::pin(ReceiverStream::new(rx).map(|a| a.map(|(resp, _held)| resp)))
}

async fn read<Req, Resp, F, Fut>(
    mut inbound: Streaming<Req>,
    tx: mpsc::Sender<Result<(Resp, Held), Status>>,
    cap: usize,
    answers: Option<Arc<ConnAnswers>>,
    answer: F,
) where
    Req: Send + 'static,
    Resp: prost::Message + Send + 'static,
    F: Fn(Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = (Resp, Option<Permit>)> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(cap.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    let end = loop {
        let next = async {
            let slot = slots.clone().acquire_owned().await;
            if let Some(a) = &answers {
                a.room().await?;
            }
            Ok::<_, Status>((slot, inbound.message().await))
        };
        let (slot, msg) = match tokio::select! {
            x = next => x,
            _ = tx.closed() => return,
        } {
            Ok(x) => x,
            Err(status) => break Some(status),
        };
        let Ok(slot) = slot else { return };
        let r = match msg {
            Ok(Some(r)) => r,
            Ok(None) => break None,
            Err(status) => break Some(status),
        };
        let (work, tx, answers) = (answer(r), tx.clone(), answers.clone());
        tasks.spawn(async move {
            let (resp, permit) = tokio::select! {
                a = work => a,
                _ = tx.closed() => return,
            };
            let kept = match answers {
                Some(a) => {
                    drop(permit);
                    Ok(a.charge(5 + resp.encoded_len()))
                }
                None => Err(permit),
            };
            let _ = tx.send(Ok((resp, (slot, kept)))).await;
        });
        while tasks.try_join_next().is_some() {}
    };
    while tasks.join_next().await.is_some() {}
    if let Some(status) = end {
        tracing::debug!("stream ended by a bad message: {status}");
        let _ = tx.send(Err(status)).await;
    }
}
