//! `epserve.v1.MoeService`: its messages into the request entry and back.

use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status, Streaming};

use super::call::{record, Call, Done};
use super::stream::{self, ResponseStream};
use crate::infer::stats::Tally;
use crate::infer::tensor::{self, Dtype, View, FLOATS, IDS};
use crate::infer::{rejected, Infer, Request as Entry};
use crate::proto::moe_service_server::MoeService;
use crate::proto::{
    self, DType, ForwardRequest, ForwardResponse, GetModelInfoRequest, ModelInfo, ProbeRequest,
    ProbeResponse,
};
use crate::request::{Failure, JobInput, Permit};
use crate::transport::unary::{Spliced, Unary};

pub use crate::sched::RosterView;

/// The expert placement now: its epoch and each layer's slots.
pub type PlacementView = Arc<dyn Fn() -> (u32, Vec<proto::LayerPlacement>) + Send + Sync>;

pub struct MoeApi {
    infer: Arc<Infer>,
    info: ModelInfo,
    /// Measured once the group has formed (nccl-ep).
    ep_footprint: std::sync::OnceLock<crate::infer::EpFootprint>,
    /// Where each rank serves, once the group has formed.
    ingress: std::sync::OnceLock<Vec<crate::proto::IngressAddress>>,
    nodes: std::sync::OnceLock<Vec<String>>,
    /// (exchange, expert) bytes per rank, once the weights are in place.
    footprint: std::sync::OnceLock<(u64, u64)>,
    /// The placement steps run on now (the leader's balancer), once the group has formed.
    placement: std::sync::OnceLock<PlacementView>,
    /// The ranks out of the group (the leader, under `--on-rank-loss continue`).
    roster: std::sync::OnceLock<RosterView>,
    /// Most requests of one ForwardStream answered or in progress but not yet taken by the
    /// transport (--max-stream-in-flight).
    stream_in_flight: usize,
}

/// epserve.v1's dtype names, for messages.
fn name(d: Dtype) -> &'static str {
    wire(d).as_str_name()
}

fn wire(d: Dtype) -> DType {
    match d {
        Dtype::Bf16 => DType::Bf16,
        Dtype::F16 => DType::F16,
        Dtype::F32 => DType::F32,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
    }
}

/// The dtype field as the entry's dtype; unknown numbers are refused by name.
fn dtype(raw: i32, what: &str, accepted: &[Dtype]) -> Result<Dtype, Failure> {
    match DType::try_from(raw) {
        Ok(DType::Bf16) => Ok(Dtype::Bf16),
        Ok(DType::F16) => Ok(Dtype::F16),
        Ok(DType::F32) => Ok(Dtype::F32),
        Ok(DType::I32) => Ok(Dtype::I32),
        Ok(DType::I64) => Ok(Dtype::I64),
        Ok(DType::DtypeUnspecified) => Err(tensor::not_accepted(
            what,
            DType::DtypeUnspecified.as_str_name(),
            accepted,
            name,
        )),
        Err(_) => Err(Failure::invalid(format!("{what}: unknown dtype {raw}"))),
    }
}

fn view<'a>(t: &'a proto::Tensor, what: &str, accepted: &[Dtype]) -> Result<View<'a>, Failure> {
    Ok(View {
        dtype: dtype(t.dtype, what, accepted)?,
        shape: &t.shape,
        data: crate::request::Data::Host(t.data.clone()),
    })
}

/// `[rows, cols]` rows, already little-endian `d`, as a tensor.
pub fn tensor(data: bytes::Bytes, rows: usize, cols: usize, d: Dtype) -> proto::Tensor {
    proto::Tensor {
        dtype: wire(d) as i32,
        shape: vec![rows as i64, cols as i64],
        data,
    }
}

impl MoeApi {
    pub fn new(infer: Arc<Infer>, info: ModelInfo, stream_in_flight: usize) -> Self {
        Self {
            infer,
            info,
            ep_footprint: std::sync::OnceLock::new(),
            ingress: std::sync::OnceLock::new(),
            nodes: std::sync::OnceLock::new(),
            footprint: std::sync::OnceLock::new(),
            placement: std::sync::OnceLock::new(),
            roster: std::sync::OnceLock::new(),
            stream_in_flight: stream_in_flight.max(1),
        }
    }

    /// What the NCCL EP exchange takes on the GPU, for GetModelInfo (set once, at startup).
    pub fn set_ep_footprint(&self, f: crate::infer::EpFootprint) {
        let _ = self.ep_footprint.set(f);
    }

    /// The bytes a rank holds for its exchange and its experts (set once, when loaded).
    pub fn set_footprint(&self, exchange: u64, experts: u64) {
        let _ = self.footprint.set((exchange, experts));
    }

    /// Where clients reach each rank that takes requests, by rank (set once, at startup).
    pub fn set_ingress(&self, addrs: &[String]) {
        let list = addrs
            .iter()
            .enumerate()
            .map(|(rank, a)| crate::proto::IngressAddress {
                rank: rank as u32,
                address: a.clone(),
            })
            .collect();
        let _ = self.ingress.set(list);
    }

    /// Where GetModelInfo reads the current expert placement from (set once, on the leader).
    pub fn set_placement(&self, view: PlacementView) {
        let _ = self.placement.set(view);
    }

    /// Where GetModelInfo reads the ranks out of the group from, and that the group goes on
    /// without a lost rank (set once, on the leader).
    pub fn set_roster(&self, view: RosterView) {
        let _ = self.roster.set(view);
    }

    /// Each rank's node, by rank (set once, when the group forms).
    pub fn set_nodes(&self, nodes: Vec<String>) {
        let _ = self.nodes.set(nodes);
    }

    /// The output dtype: `output_dtype`, or the input's when unspecified.
    fn out_dtype(r: &ForwardRequest) -> Result<Dtype, Failure> {
        if r.output_dtype == DType::DtypeUnspecified as i32 {
            let input = r
                .hidden_states
                .as_ref()
                .map_or(DType::F32 as i32, |t| t.dtype);
            return dtype(input, "hidden_states", FLOATS);
        }
        match dtype(r.output_dtype, "output_dtype", FLOATS)? {
            d if d.is_float() => Ok(d),
            d => Err(Failure::invalid(format!(
                "output_dtype: {} is not a float dtype",
                name(d)
            ))),
        }
    }

    /// The request as the entry takes it, checked; its hidden states stay the client's bytes.
    fn job_input(
        &self,
        r: &ForwardRequest,
        output: Dtype,
        deadline: Option<Instant>,
    ) -> Result<JobInput, Failure> {
        let views = || -> Result<_, Failure> {
            let hidden = r
                .hidden_states
                .as_ref()
                .map(|t| view(t, "hidden_states", FLOATS))
                .transpose()?;
            let ids = r
                .topk_ids
                .as_ref()
                .map(|t| view(t, "topk_ids", IDS))
                .transpose()?;
            let w = r
                .topk_weights
                .as_ref()
                .map(|t| view(t, "topk_weights", FLOATS))
                .transpose()?;
            Ok((hidden, ids, w))
        };
        let (hidden, topk_ids, topk_weights) =
            views().map_err(|f| rejected("invalid_argument", f))?;
        self.infer.validate(Entry {
            id: r.id.clone(),
            layer: r.layer,
            hidden,
            topk_ids,
            topk_weights,
            output,
            deadline,
            names: name,
            tally: Tally::FORWARD,
        })
    }

    /// Checks, admits, queues and waits for one request. The admission permit comes back with
    /// the answer, for the caller to hold until the response is written.
    async fn run(
        &self,
        r: ForwardRequest,
        deadline: Option<Instant>,
    ) -> Result<Done<ForwardResponse>, Failure> {
        let out_dtype = Self::out_dtype(&r).map_err(|f| rejected("invalid_argument", f))?;
        let input = self.job_input(&r, out_dtype, deadline)?;
        // Only the hidden states' bytes wait in the queue, shared with the request's buffer.
        drop(r);
        let id = input.id.clone();
        let a = self.infer.submit(input, Tally::FORWARD).await?;
        let resp = ForwardResponse {
            id,
            output: Some(tensor(
                a.output,
                a.tokens,
                self.infer.spec().hidden,
                out_dtype,
            )),
            error: None,
        };
        Ok(Done {
            resp,
            permit: a.permit,
            tokens: a.tokens,
        })
    }

    /// `run` with the request's span and metrics.
    async fn forward_one(
        &self,
        r: ForwardRequest,
        call: &Call,
        method: &'static str,
    ) -> Result<(ForwardResponse, Option<Permit>), Status> {
        let id = r.id.clone();
        call.observe(method, &id, self.run(r, call.deadline)).await
    }
}

fn error_response(id: String, s: &Status) -> ForwardResponse {
    ForwardResponse {
        id,
        output: None,
        error: Some(proto::Error {
            code: s.code() as i32,
            message: s.message().to_string(),
        }),
    }
}

/// `Forward` as `unary` serves it: the request read into a kept buffer, the answer's bytes sent
/// as they are, the admission permit held until they are handed to the transport.
#[derive(Clone)]
pub struct Forward(pub Arc<MoeApi>);

impl Unary for Forward {
    type Req = ForwardRequest;
    type Resp = ForwardResponse;
    type Hold = Option<Permit>;
    const PATH: &'static str = "/epserve.v1.MoeService/Forward";
    const METHOD: &'static str = "Forward";

    async fn call(
        self,
        req: Request<ForwardRequest>,
    ) -> Result<(ForwardResponse, Option<Permit>), Status> {
        let call = Call::of(&req)?;
        self.0
            .forward_one(req.into_inner(), &call, Self::METHOD)
            .await
    }

    fn refused(status: &Status, since: Instant) {
        record(Self::METHOD, status.code(), 0, since);
    }
}

impl Spliced for ForwardResponse {
    fn take_large(&mut self) -> Vec<(&'static [u32], bytes::Bytes)> {
        // output = 2, Tensor.data = 3.
        match &mut self.output {
            Some(t) if !t.data.is_empty() => vec![(&[2, 3], std::mem::take(&mut t.data))],
            _ => Vec::new(),
        }
    }
}

#[tonic::async_trait]
impl MoeService for Arc<MoeApi> {
    /// Served by `Forward` behind `unary::WithUnary`; tonic's own path, should anything route here.
    async fn forward(
        &self,
        req: Request<ForwardRequest>,
    ) -> Result<Response<ForwardResponse>, Status> {
        let (resp, _permit) = Forward(self.clone()).call(req).await?;
        Ok(Response::new(resp))
    }

    type ForwardStreamStream = ResponseStream<ForwardResponse>;

    async fn forward_stream(
        &self,
        req: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::ForwardStreamStream>, Status> {
        let call = Call::of(&req)?;
        let api = self.clone();
        let answers = req
            .extensions()
            .get::<Arc<crate::transport::answer::ConnAnswers>>()
            .cloned();
        let out = stream::serve(req.into_inner(), self.stream_in_flight, answers, move |r| {
            let (api, call) = (api.clone(), call.clone());
            async move {
                let id = r.id.clone();
                match api.forward_one(r, &call, "ForwardStream").await {
                    Ok(answer) => answer,
                    Err(s) => (error_response(id, &s), None),
                }
            }
        });
        Ok(Response::new(out))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        let mut info = self.info.clone();
        info.nccl_ep = self.ep_footprint.get().map(|f| proto::NcclEpFootprint {
            modes: f.modes.into(),
            zero_copy: f.zero_copy,
            ll_max_tokens_per_rank: f.ll_max_tokens_per_rank,
            group_bytes: f.group_bytes,
            handle_bytes: f.handle_bytes,
            expert_rows_bytes: f.expert_rows_bytes,
        });
        info.ingress = self.ingress.get().cloned().unwrap_or_default();
        info.rank_nodes = self.nodes.get().cloned().unwrap_or_default();
        if let Some(view) = self.placement.get() {
            let (epoch, layers) = view();
            info.placement_epoch = epoch;
            info.layer_placement = layers;
        }
        let (epoch, lost) = self.roster.get().map(|v| v()).unwrap_or_default();
        info.on_rank_loss = match self.roster.get() {
            Some(_) => "continue",
            None => "exit",
        }
        .into();
        info.group_epoch = epoch;
        info.live_ranks = (0..info.world_size).filter(|r| !lost.contains(r)).collect();
        info.lost_ranks = lost;
        if let Some(&(exchange, experts)) = self.footprint.get() {
            info.exchange_bytes_per_rank = exchange;
            info.expert_bytes_per_rank = experts;
        }
        Ok(Response::new(info))
    }

    async fn probe(&self, req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let call = Call::of(&req)?;
        let t0 = Instant::now();
        let spec = self.infer.spec();
        let h = spec.hidden;
        let x: Vec<f32> = (0..h).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
        let r = ForwardRequest {
            id: "probe".into(),
            layer: spec.moe_layers[0],
            hidden_states: Some(tensor(
                tensor::encode(&x, Dtype::F32).into(),
                1,
                h,
                Dtype::F32,
            )),
            topk_ids: None,
            topk_weights: None,
            output_dtype: DType::F32 as i32,
        };
        let (out, _permit) = self.forward_one(r, &call, "Probe").await?;
        let finite = out.output.is_some_and(|t| {
            view(&t, "output", FLOATS)
                .and_then(|v| tensor::floats(&v, "output", Some(1), h, name))
                .is_ok()
        });
        if !finite {
            return Err(Status::internal("the probe step produced no finite output"));
        }
        Ok(Response::new(ProbeResponse {
            seconds: t0.elapsed().as_secs_f64(),
            world_size: self.info.world_size,
        }))
    }
}

/// The request decode and validate path under random input (a fixed seed and budget, so CI runs
/// the same cases every time): no input panics, every refusal is INVALID_ARGUMENT with a
/// message, and everything accepted is consistent with the model.
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::api::status;
    use crate::infer::Phase;
    use crate::lifecycle::Abort;
    use crate::request::Admission;
    use prost::Message;
    use rand::{Rng, SeedableRng};
    use tokio::sync::{mpsc, Notify};
    use tonic::Code;

    fn infer(jobs: mpsc::Sender<Arc<crate::infer::Job>>, abort: Arc<Abort>) -> Arc<Infer> {
        let spec = Arc::new(crate::model::synthetic::preset("tiny").unwrap());
        let adm = Admission::new(4, 64);
        Arc::new(Infer::new(spec, jobs, adm, Arc::new(Notify::new()), abort))
    }

    fn api() -> MoeApi {
        let (jobs, _rx) = mpsc::channel(1);
        MoeApi::new(infer(jobs, Arc::default()), ModelInfo::default(), 1)
    }

    /// A broken group answers every waiting request at once, whatever holds it: INTERNAL for one
    /// inside the step whose output was wrong, UNAVAILABLE for one still queued.
    #[tokio::test]
    async fn a_broken_group_answers_waiting_requests_by_where_they_are() {
        let (jobs, mut rx) = mpsc::channel(4);
        let abort = Arc::new(Abort::default());
        let infer = infer(jobs, abort.clone());
        infer.set_phase(Phase::Serving);
        let api = Arc::new(MoeApi::new(infer.clone(), ModelInfo::default(), 1));
        let spec = infer.spec();
        let x = vec![0.5f32; spec.hidden];
        let req = |id: &str| ForwardRequest {
            id: id.into(),
            layer: spec.moe_layers[0],
            hidden_states: Some(super::tensor(
                tensor::encode(&x, Dtype::F32).into(),
                1,
                spec.hidden,
                Dtype::F32,
            )),
            ..Default::default()
        };
        let (a, b) = (api.clone(), api.clone());
        let (ra, rb) = (req("in-step"), req("queued"));
        let in_step = tokio::spawn(async move { a.run(ra, None).await.map(drop) });
        let queued = tokio::spawn(async move { b.run(rb, None).await.map(drop) });
        let (j1, j2) = (rx.recv().await.unwrap(), rx.recv().await.unwrap());
        let stepped = if j1.input.id == "in-step" { &j1 } else { &j2 };
        stepped.started(Instant::now(), true);
        abort.trigger_corrupt("NCCL EP received 9 rows where the routing sent 8");
        let e = status(in_step.await.unwrap().unwrap_err());
        assert_eq!(e.code(), Code::Internal, "{e:?}");
        assert!(e.message().contains("routing sent 8"), "{e:?}");
        let e = status(queued.await.unwrap().unwrap_err());
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        assert!(e.message().contains("routing sent 8"), "{e:?}");
    }

    fn pick<T: Copy>(rng: &mut impl Rng, from: &[T]) -> T {
        from[rng.random_range(0..from.len())]
    }

    /// A tensor near the valid ones: dtypes in and out of the enum, shapes of any rank and sign,
    /// data of the right length or not, values finite or not.
    fn tensor(rng: &mut impl Rng, cols: usize, valid: &[i32]) -> proto::Tensor {
        if rng.random_bool(0.6) {
            // A valid tensor, perhaps with one byte changed.
            let dtype = pick(rng, valid);
            let n = rng.random_range(1..4usize);
            let mut data: Vec<u8> = match dtype {
                1 => (0..n * cols)
                    .flat_map(|_| half::bf16::from_f32(rng.random::<f32>()).to_le_bytes())
                    .collect(),
                2 => (0..n * cols)
                    .flat_map(|_| half::f16::from_f32(rng.random::<f32>()).to_le_bytes())
                    .collect(),
                3 => (0..n * cols)
                    .flat_map(|_| rng.random::<f32>().to_le_bytes())
                    .collect(),
                // Expert ids: a row of distinct ids, mostly in range.
                4 => (0..n)
                    .flat_map(|_| (0..cols as i32).map(|e| e * 3 % 9))
                    .flat_map(i32::to_le_bytes)
                    .collect(),
                _ => (0..n * cols)
                    .flat_map(|i| (i as i64 % 8).to_le_bytes())
                    .collect(),
            };
            if rng.random_bool(0.3) && !data.is_empty() {
                let at = rng.random_range(0..data.len());
                data[at] = rng.random();
            }
            return proto::Tensor {
                dtype,
                shape: vec![n as i64, cols as i64],
                data: data.into(),
            };
        }
        let dtype = pick(rng, &[0, 1, 2, 3, 4, 5, 6, -1, 99, i32::MAX]);
        let n = pick(rng, &[0i64, 1, 2, 7, -1, i64::MAX, 1 << 40]);
        let c = pick(rng, &[cols as i64, cols as i64 - 1, 0, -3, i64::MIN]);
        let shape = match rng.random_range(0..5) {
            0 => vec![],
            1 => vec![n],
            2 => vec![n, c, 1],
            _ => vec![n, c],
        };
        let elem = pick(rng, &[1usize, 2, 4, 8]);
        let rows = usize::try_from(n).unwrap_or(0).min(8);
        let len = rows * cols.max(1) * elem;
        let len = rng.random_range(0..len + 9);
        let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        proto::Tensor {
            dtype,
            shape,
            data: data.into(),
        }
    }

    #[test]
    fn no_request_panics_and_every_refusal_is_invalid_argument() {
        let api = api();
        let (h, k) = (api.infer.spec().hidden, api.infer.spec().top_k);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
        let mut accepted = 0;
        for i in 0..20_000 {
            let mut r = if i % 4 == 0 {
                // Raw bytes on the wire: decoding must fail cleanly or give some request.
                let len = rng.random_range(0..64);
                let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                match ForwardRequest::decode(bytes.as_slice()) {
                    Ok(r) => r,
                    Err(_) => continue,
                }
            } else {
                ForwardRequest::default()
            };
            r.layer = pick(&mut rng, &[0, 0, 1, 2, u32::MAX]);
            r.output_dtype = pick(&mut rng, &[0, 0, 1, 3, 4, 77]);
            if rng.random_bool(0.9) {
                r.hidden_states = Some(tensor(&mut rng, h, &[1, 2, 3]));
            }
            if rng.random_bool(0.3) {
                r.topk_ids = Some(tensor(&mut rng, k, &[4, 5]));
                r.topk_weights = Some(tensor(&mut rng, k, &[1, 2, 3]));
            }
            if rng.random_bool(0.1) {
                r.topk_ids = None;
            }
            let out = MoeApi::out_dtype(&r);
            match out.and_then(|o| api.job_input(&r, o, None)).map_err(status) {
                Err(s) => {
                    assert_eq!(s.code(), Code::InvalidArgument, "{r:?}: {s:?}");
                    assert!(!s.message().is_empty());
                }
                Ok(input) => {
                    accepted += 1;
                    let x = &input.hidden;
                    assert_eq!(x.data.len(), input.tokens * h * x.dtype.bytes());
                    let mut wide = vec![0f32; input.tokens * h];
                    crate::dtype::to_f32(x.dtype, x.data.host().expect("host rows"), &mut wide);
                    assert!(wide.iter().all(|v| v.is_finite()));
                    assert!(input.output.is_float());
                    if let Some((ids, w)) = &input.routing {
                        assert_eq!((ids.len(), w.len()), (input.tokens * k, input.tokens * k));
                        assert!(ids
                            .iter()
                            .all(|&e| (0..api.infer.spec().num_experts as i32).contains(&e)));
                    }
                }
            }
        }
        // The generator reaches the valid region too, so the checks past the first run.
        assert!(accepted > 100, "only {accepted} requests were valid");
    }
}
