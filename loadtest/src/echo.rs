//! A bare service with epserve's API that computes nothing: it returns a tensor of the request's
//! size. Loading it in the same run gives the transport's ceiling; a delay makes it a
//! deliberately slow server.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use epserve::metric_names;
use epserve::proto::moe_service_server::{MoeService, MoeServiceServer};
use epserve::proto::{
    DType, ForwardRequest, ForwardResponse, GetModelInfoRequest, ModelInfo, ProbeRequest,
    ProbeResponse, Tensor,
};
use epserve::transport::bufs::Bufs;
use epserve::transport::unary::{Limits, Unary, WithUnary};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

#[derive(Clone)]
pub struct Echo {
    pub hidden: u32,
    pub delay: Duration,
}

impl Echo {
    async fn answer(&self, r: ForwardRequest) -> ForwardResponse {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let output = r.hidden_states.map(|t| {
            let out = if r.output_dtype == 0 {
                t.dtype
            } else {
                r.output_dtype
            };
            let bytes = |d: i32| if d == DType::F32 as i32 { 4 } else { 2 };
            let data = if out == t.dtype {
                t.data
            } else {
                vec![0; t.data.len() / bytes(t.dtype) * bytes(out)].into()
            };
            Tensor {
                dtype: out,
                shape: t.shape,
                data,
            }
        });
        ForwardResponse {
            id: r.id,
            output,
            error: None,
        }
    }
}

/// The echo's `Forward` framed as the service frames it (`epserve::transport::unary`), so that the
/// ceiling it measures is the service's transport, not tonic's codec.
#[derive(Clone)]
struct Forward(Arc<Echo>);

impl Unary for Forward {
    type Req = ForwardRequest;
    type Resp = ForwardResponse;
    type Hold = ();
    const PATH: &'static str = "/epserve.v1.MoeService/Forward";
    const METHOD: &'static str = "Forward";

    async fn call(self, req: Request<ForwardRequest>) -> Result<(ForwardResponse, ()), Status> {
        Ok((self.0.answer(req.into_inner()).await, ()))
    }

    /// The echo keeps no request metrics.
    fn refused(_: &Status, _: std::time::Instant) {}
}

type Out = Pin<Box<dyn Stream<Item = Result<ForwardResponse, Status>> + Send>>;

#[tonic::async_trait]
impl MoeService for Echo {
    async fn forward(
        &self,
        req: Request<ForwardRequest>,
    ) -> Result<Response<ForwardResponse>, Status> {
        Ok(Response::new(self.answer(req.into_inner()).await))
    }

    type ForwardStreamStream = Out;

    async fn forward_stream(
        &self,
        req: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Out>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(1024);
        let me = Arc::new(self.clone());
        tokio::spawn(async move {
            while let Ok(Some(r)) = inbound.message().await {
                let (me, tx) = (me.clone(), tx.clone());
                tokio::spawn(async move {
                    let _ = tx.send(Ok(me.answer(r).await)).await;
                });
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        Ok(Response::new(ModelInfo {
            model: "echo".into(),
            architecture: "echo".into(),
            hidden_size: self.hidden,
            moe_layers: vec![0],
            num_experts: 8,
            top_k: 2,
            routing: "none".into(),
            accepted_dtypes: vec![DType::Bf16 as i32, DType::F16 as i32, DType::F32 as i32],
            world_size: 1,
            backend: "echo".into(),
            ..Default::default()
        }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse {
            seconds: 0.0,
            world_size: 1,
        }))
    }
}

/// Starts an echo service on `addr` in the background; returns where it listens.
pub async fn spawn(
    addr: SocketAddr,
    echo: Echo,
    http2: &epserve::transport::Http2,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let limits = Limits {
        max_request: 1 << 30,
        max_response: 1 << 30,
        read_timeout: std::time::Duration::from_secs(60),
        bufs: Bufs::new(256 << 20, metric_names::REQUEST_BUFFERS_REUSED_TOTAL),
    };
    let svc = WithUnary::new(
        MoeServiceServer::new(echo.clone())
            .max_decoding_message_size(1 << 30)
            .max_encoding_message_size(1 << 30),
        Forward(Arc::new(echo)),
        limits,
    );
    // Small answers must not wait for Nagle, or the ceiling would be a TCP artefact.
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |s| s.and_then(|s| s.set_nodelay(true).map(|_| s)),
    );
    tokio::spawn(
        http2
            .tonic_server(tonic::transport::Server::builder())
            .add_service(svc)
            .serve_with_incoming(incoming),
    );
    Ok(bound)
}
