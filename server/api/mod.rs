//! The gRPC front: `epserve.v1.MoeService`, decoding and validating requests into jobs.

pub mod tensor;

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::model::MoeSpec;
use crate::proto::moe_service_server::MoeService;
use crate::proto::{self, DType, ForwardRequest, ForwardResponse, GetModelInfoRequest, ModelInfo};
use crate::router::Job;

pub struct MoeApi {
    spec: Arc<MoeSpec>,
    info: ModelInfo,
    jobs: mpsc::Sender<Arc<Job>>,
}

/// A validated request: the job to queue and how to answer.
struct Admitted {
    job: Arc<Job>,
    reply: tokio::sync::oneshot::Receiver<crate::router::Reply>,
    out_dtype: DType,
}

impl MoeApi {
    pub fn new(spec: Arc<MoeSpec>, info: ModelInfo, jobs: mpsc::Sender<Arc<Job>>) -> Self {
        Self { spec, info, jobs }
    }

    fn validate(&self, r: ForwardRequest) -> Result<Admitted, Status> {
        let spec = &self.spec;
        let layer = spec.layer_slot(r.layer).ok_or_else(|| {
            Status::invalid_argument(format!(
                "layer {} is not an MoE layer of this model (MoE layers: {:?})",
                r.layer, spec.moe_layers
            ))
        })?;
        let hs = r
            .hidden_states
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("hidden_states is required"))?;
        if hs.shape.len() == 2 && hs.shape[1] >= 0 && hs.shape[1] as usize != spec.hidden {
            return Err(Status::invalid_argument(format!(
                "hidden_states: hidden size {} does not match the model's {}",
                hs.shape[1], spec.hidden
            )));
        }
        let (hidden, n, in_dtype) = tensor::floats(hs, "hidden_states", None, spec.hidden)?;
        let routing = match (&r.topk_ids, &r.topk_weights) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(Status::invalid_argument(
                    "topk_weights given without topk_ids",
                ))
            }
            (Some(_), None) => {
                return Err(Status::invalid_argument(
                    "topk_ids given without topk_weights",
                ))
            }
            (Some(ids), Some(w)) => {
                let ids = tensor::expert_ids(ids, n, spec.top_k, spec.num_experts)?;
                let (w, _, _) = tensor::floats(w, "topk_weights", Some(n), spec.top_k)?;
                Some((ids, w))
            }
        };
        let out_dtype = match tensor::dtype(r.output_dtype, "output_dtype")? {
            DType::DtypeUnspecified => in_dtype,
            d if tensor::FLOATS.contains(&d) => d,
            d => {
                return Err(Status::invalid_argument(format!(
                    "output_dtype: {} is not a float dtype",
                    d.as_str_name()
                )))
            }
        };
        let (job, reply) = Job::new(r.id, layer, n, hidden, routing);
        Ok(Admitted {
            job,
            reply,
            out_dtype,
        })
    }

    /// Validates, queues and waits for one request.
    async fn forward_one(&self, r: ForwardRequest) -> Result<ForwardResponse, Status> {
        let a = self.validate(r)?;
        let (id, n) = (a.job.id.clone(), a.job.tokens);
        self.jobs.try_send(a.job).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                Status::resource_exhausted("the request queue is full")
            }
            mpsc::error::TrySendError::Closed(_) => {
                Status::unavailable("the service is not accepting requests")
            }
        })?;
        let out = a
            .reply
            .await
            .map_err(|_| Status::unavailable("the request was dropped: the EP group stopped"))??;
        Ok(ForwardResponse {
            id,
            output: Some(tensor::encode(&out, n, self.spec.hidden, a.out_dtype)),
            error: None,
        })
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ForwardResponse, Status>> + Send>>;

#[tonic::async_trait]
impl MoeService for Arc<MoeApi> {
    async fn forward(
        &self,
        req: Request<ForwardRequest>,
    ) -> Result<Response<ForwardResponse>, Status> {
        self.forward_one(req.into_inner()).await.map(Response::new)
    }

    type ForwardStreamStream = ResponseStream;

    async fn forward_stream(
        &self,
        req: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::ForwardStreamStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let api = self.clone();
        tokio::spawn(async move {
            // Each request runs on its own task so answers go out in completion order; the stream
            // ends when the client's half is done and every answer is out.
            while let Ok(Some(r)) = inbound.message().await {
                let (api, tx) = (api.clone(), tx.clone());
                tokio::spawn(async move {
                    let id = r.id.clone();
                    let resp = api
                        .forward_one(r)
                        .await
                        .unwrap_or_else(|s| ForwardResponse {
                            id,
                            output: None,
                            error: Some(proto::Error {
                                code: s.code() as i32,
                                message: s.message().to_string(),
                            }),
                        });
                    let _ = tx.send(Ok(resp)).await;
                });
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }
}
