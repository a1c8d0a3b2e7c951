//! One rank's life: load its experts, join the group, set up the persistent exchange buffers,
//! then either serve (rank 0: gRPC, batcher, step executor) or follow step descriptors.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tonic::server::NamedService;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;
use tracing::{error, info, warn};

use crate::api::kserve::KserveApi;
use crate::api::MoeApi;
use crate::backend::cpu::{CpuRank, SegmentShape};
use crate::backend::gpu;
use crate::config::{graph_buckets, BackendKind, EpSettings, Member, OnOff, ServeArgs};
use crate::group::{self, expect, send, Ctl, Fingerprint, Joined, RouterLink};
use crate::infer::{Infer, Phase};
use crate::inference::grpc_inference_service_server::GrpcInferenceServiceServer;
use crate::model::{ModelSource, MoeSpec, Placement, RankWeights};
use crate::proto::moe_service_server::MoeServiceServer;
use crate::proto::{DType, ExpertRange, ModelInfo};
use crate::router::{run_batcher, Admission, BatchConfig, Executor};
use crate::shm::Abort;
use crate::step::ring::{Ring, RingShape};
use crate::step::{max_home_tokens, Backend, Driver, StepError};
use crate::watchdog::{self, AbortOnPanic, Progress, SetupDeadline, STUCK_GRACE};

const RING_SLOTS: usize = 2;

/// How long a broken router waits for its step executor before exiting without it.
const BROKEN_JOIN: Duration = Duration::from_secs(2);

/// What a GPU rank does after NCCL init that takes no deadline of its own.
const GPU_SETUP: &str = "joining NCCL, creating the NCCL EP groups and capturing the step graphs";

/// Where this rank's weights are before it joins: host memory (cpu) or its GPU (nccl).
enum Weights {
    Host(RankWeights),
    Gpu(Box<gpu::Device>),
}

/// Everything a rank knows before it talks to the group.
struct Prepared {
    member: Member,
    source: ModelSource,
    spec: MoeSpec,
    placement: Placement,
    fingerprint: Fingerprint,
    backend: BackendKind,
    segment: SegmentShape,
    ring: RingShape,
    weights: Weights,
    /// GPU backends: home-token buckets, ascending.
    buckets: Vec<usize>,
    /// Persistent exchange memory per rank (GetModelInfo).
    exchange_bytes: u64,
}

/// `auto` becomes `nccl-ep` where its gates pass, else `nccl` where GPUs and NCCL are found,
/// else `cpu`, saying why; an explicit GPU backend that cannot run refuses with the reason.
fn resolve_backend(kind: BackendKind, world: usize) -> anyhow::Result<BackendKind> {
    if kind == BackendKind::Cpu {
        return Ok(BackendKind::Cpu);
    }
    let gpu = gpu::available();
    let ep = match (kind, &gpu) {
        (BackendKind::NcclEp | BackendKind::Auto, Ok(_)) => gpu::ep_gates(world),
        (_, Err(why)) => Err(why.clone()),
        _ => Err("not asked for".into()),
    };
    match (kind, gpu, ep) {
        (BackendKind::Cpu, _, _) => Ok(BackendKind::Cpu),
        (BackendKind::NcclEp | BackendKind::Auto, _, Ok(what)) => {
            info!("backend nccl-ep: {what}");
            Ok(BackendKind::NcclEp)
        }
        (BackendKind::NcclEp, _, Err(why)) => bail!("--backend nccl-ep cannot run here: {why}"),
        (BackendKind::Nccl | BackendKind::Auto, Ok(what), ep) => {
            if let (BackendKind::Auto, Err(why)) = (kind, ep) {
                info!("--backend auto: not nccl-ep ({why})");
            }
            info!("backend nccl: {what}");
            Ok(BackendKind::Nccl)
        }
        (BackendKind::Nccl, Err(why), _) => bail!("--backend nccl cannot run here: {why}"),
        (_, Err(why), _) => {
            info!("--backend auto: using cpu ({why})");
            Ok(BackendKind::Cpu)
        }
    }
}

/// The GPU of `rank`: --device, else LOCAL_RANK, else the rank modulo the visible GPUs.
fn device_ordinal(args: &ServeArgs, rank: usize) -> anyhow::Result<usize> {
    let count = gpu::device_count();
    let local = match std::env::var("LOCAL_RANK") {
        Ok(v) => Some(
            v.trim()
                .parse::<usize>()
                .map_err(|_| anyhow!("LOCAL_RANK={v} is not a number"))?,
        ),
        Err(_) => None,
    };
    let d = args.device.or(local).unwrap_or(rank % count.max(1));
    if d >= count {
        bail!("GPU {d} does not exist ({count} visible)");
    }
    Ok(d)
}

fn backend_name(b: BackendKind) -> String {
    b.name().to_string()
}

fn prepare(args: &ServeArgs, member: Member) -> anyhow::Result<Prepared> {
    let source = ModelSource::parse(&args.model, args.seed)?;
    let mut spec = source.spec()?;
    spec.cap_layers(args.layers);
    spec.validate()?;
    let placement = Placement::new(spec.num_experts, member.world)?;
    let backend = resolve_backend(args.backend, member.world)?;
    let max_home = max_home_tokens(args.max_tokens_per_step, member.world);
    let buckets = graph_buckets(&args.graph_buckets, max_home).map_err(|e| anyhow!(e))?;
    let mut fingerprint = vec![
        ("version".to_string(), env!("CARGO_PKG_VERSION").to_string()),
        ("backend".into(), backend_name(backend)),
        ("model".into(), source.describe()),
        ("weights".into(), source.identity()?),
        (
            "max_tokens_per_step".into(),
            args.max_tokens_per_step.to_string(),
        ),
    ];
    fingerprint.extend(spec.fingerprint());
    if matches!(backend, BackendKind::Nccl | BackendKind::NcclEp) {
        fingerprint.push(("graph_buckets".into(), format!("{buckets:?}")));
        fingerprint.push(("cuda_graphs".into(), format!("{:?}", args.cuda_graphs)));
    }
    // Every rank must build the same groups (NCCL EP's creation is collective).
    let ep = match backend {
        BackendKind::NcclEp => {
            let (e, note) = EpSettings::resolve(
                args.ep_mode,
                args.ep_ll_max_tokens,
                &buckets,
                args.zero_copy == OnOff::On,
                spec.hidden,
            )
            .map_err(|e| anyhow!(e))?;
            if let Some(n) = note {
                info!("{n}");
            }
            Some(e)
        }
        _ => None,
    };
    if let Some(e) = ep {
        fingerprint.push(("ep_mode".into(), args.ep_mode.name().into()));
        fingerprint.push(("ep_ll_max".into(), e.ll_max.to_string()));
        fingerprint.push(("zero_copy".into(), e.zero_copy.to_string()));
        info!(
            mode = args.ep_mode.name(),
            buckets = e.modes(),
            ll_up_to_tokens = e.ll_max,
            zero_copy = e.zero_copy,
            "nccl-ep"
        );
    }
    let segment = SegmentShape {
        world: member.world,
        experts: spec.num_experts,
        top_k: spec.top_k,
        hidden: spec.hidden,
        max_home,
    };
    let ring = RingShape {
        slots: RING_SLOTS,
        world: member.world,
        max_tokens: args.max_tokens_per_step,
        hidden: spec.hidden,
        top_k: spec.top_k,
    };
    let t0 = Instant::now();
    let experts = placement.experts_of(member.rank);
    let weights = source.load(&spec, experts.clone())?;
    info!(
        rank = member.rank,
        experts = ?experts,
        layers = spec.moe_layers.len(),
        expert_mib = weights.expert_bytes() >> 20,
        seconds = t0.elapsed().as_secs_f32(),
        "weights loaded"
    );
    let (weights, exchange_bytes) = match backend {
        BackendKind::Nccl | BackendKind::NcclEp => {
            let ordinal = device_ordinal(args, member.rank)?;
            let dev = gpu::Device::open(
                ordinal,
                &spec,
                weights,
                member.world,
                member.rank,
                max_home,
                ep,
            )?;
            let bytes = dev.buffer_bytes() as u64;
            (Weights::Gpu(Box::new(dev)), bytes)
        }
        _ => (Weights::Host(weights), segment.bytes() as u64),
    };
    Ok(Prepared {
        member,
        source,
        spec,
        placement,
        fingerprint,
        backend,
        segment,
        ring,
        weights,
        buckets,
        exchange_bytes,
    })
}

pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let member = args.member().map_err(|e| anyhow!(e))?;
    let rank = member.rank;
    // The router binds its rendezvous port before anything slow, so ranks can connect while it
    // loads; given port 0 it says on stdout which port it got (how `launch` avoids port races).
    let listener = match rank {
        0 => Some(bind_rendezvous(&member.rendezvous, args.rendezvous_bind).context("rank 0")?),
        _ => None,
    };
    let p = prepare(&args, member).with_context(|| format!("rank {rank}"))?;
    let metrics = crate::metrics::install()?;
    let r = match listener {
        Some(l) => run_router(&args, p, metrics, l),
        None => run_worker(&args, p, metrics),
    };
    r.with_context(|| format!("rank {rank}"))
}

/// The line rank 0 prints on stdout when it bound rendezvous port 0.
pub const RENDEZVOUS_LINE: &str = "epserve-rendezvous ";

fn bind_rendezvous(addr: &str, given: Option<SocketAddr>) -> anyhow::Result<TcpListener> {
    let bind = match given {
        Some(a) => a,
        None => rendezvous_bind(addr)?,
    };
    let listener =
        TcpListener::bind(bind).with_context(|| format!("binding the rendezvous port {bind}"))?;
    if bind.port() == 0 {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{RENDEZVOUS_LINE}{}", listener.local_addr()?)?;
        out.flush()?;
    }
    Ok(listener)
}

/// This user's private directory for the group's segments under --shm-dir.
fn segment_dir(args: &ServeArgs) -> anyhow::Result<std::path::PathBuf> {
    crate::shm::private_dir(&args.shm_dir)
        .with_context(|| format!("the segment directory under {}", args.shm_dir.display()))
}

fn ring_path(dir: &Path, group: &str) -> std::path::PathBuf {
    dir.join(format!("epserve-{group}-ring"))
}

/// The rendezvous listener binds the address the rendezvous name resolves to (its first IPv4
/// one where there is one): ranks reach the router there, and nothing else is opened.
fn rendezvous_bind(addr: &str) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let all: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .with_context(|| format!("rendezvous address '{addr}' is not HOST:PORT that resolves"))?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| anyhow!("rendezvous address '{addr}' resolves to no address"))
}

/// The router: gRPC comes up first (NOT_SERVING), the group forms, a warm-up step runs, then it
/// serves until a signal (drain) or a broken group.
fn run_router(
    args: &ServeArgs,
    p: Prepared,
    metrics: PrometheusHandle,
    rendezvous: TcpListener,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(router_main(args, p, metrics, rendezvous))
}

/// Health services: "" and each protocol's service are readiness; "liveness" follows the step
/// loop.
const LIVENESS: &str = "liveness";

async fn set_ready(health: &HealthReporter, ready: bool) {
    let status = if ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    health.set_service_status("", status).await;
    health
        .set_service_status(MoeServiceServer::<Arc<MoeApi>>::NAME, status)
        .await;
    health
        .set_service_status(GrpcInferenceServiceServer::<Arc<KserveApi>>::NAME, status)
        .await;
}

async fn router_main(
    args: &ServeArgs,
    p: Prepared,
    metrics: PrometheusHandle,
    rendezvous: TcpListener,
) -> anyhow::Result<()> {
    crate::metrics::serve(args.metrics_listen, metrics, 0).await?;
    let abort = Arc::new(Abort::default());
    let admission = Admission::new(args.max_concurrent_requests, args.max_queued_tokens);
    let wake = Arc::new(Notify::new());
    let (job_tx, job_rx) = mpsc::channel(args.max_concurrent_requests);
    let info = model_info(&p, args);
    let infer = Arc::new(Infer::new(
        Arc::new(p.spec.clone()),
        job_tx,
        admission.clone(),
        wake.clone(),
        abort.clone(),
    ));
    let api = Arc::new(MoeApi::new(infer.clone(), info, args.max_stream_in_flight));
    let kserve = Arc::new(KserveApi::new(infer.clone(), args.max_stream_in_flight));

    let (health, health_service) = tonic_health::server::health_reporter();
    set_ready(&health, false).await;
    health
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the gRPC address {}", args.listen))?;
    let addr = listener.local_addr()?;
    let server_stop = CancellationToken::new();
    let server = tokio::spawn(serve_grpc(
        args.http2.clone(),
        args.max_request_bytes,
        api.clone(),
        kserve,
        health_service,
        listener,
        server_stop.clone(),
    ));
    info!("gRPC listening on {addr}, NOT_SERVING until the group is ready");

    let (setup_args, setup_abort) = (args.clone(), abort.clone());
    let setup =
        tokio::task::spawn_blocking(move || form_group(&setup_args, p, rendezvous, setup_abort))
            .await;
    let exec = match setup.map_err(anyhow::Error::from).and_then(|r| r) {
        Ok((e, footprint)) => {
            if let Some(f) = footprint {
                api.set_ep_footprint(f);
            }
            e
        }
        Err(e) => {
            server_stop.cancel();
            let _ = server.await;
            return Err(e);
        }
    };
    let progress = exec.progress.clone();
    let (step_tx, step_rx) = mpsc::channel(1);
    let (handle, heartbeat) = (tokio::runtime::Handle::current(), args.heartbeat_interval);
    let exec_abort = abort.clone();
    // One permit per ring slot: a step holds one from when it is formed until it is delivered.
    let in_flight = Arc::new(tokio::sync::Semaphore::new(RING_SLOTS));
    metrics::gauge!("epserve_steps_in_flight").set(0.0);
    let permits = in_flight.clone();
    let exec_thread = std::thread::Builder::new()
        .name("step-executor".into())
        .spawn(move || {
            let _guard = AbortOnPanic(exec_abort, "the step executor panicked");
            exec.serve(step_rx, permits, handle, heartbeat)
        })?;
    let batch_stop = CancellationToken::new();
    let batch = BatchConfig {
        max_tokens_per_step: args.max_tokens_per_step,
        max_wait: Duration::from_micros(args.max_batch_wait_us),
        depth: RING_SLOTS,
    };
    let batcher = tokio::spawn(run_batcher(
        batch,
        job_rx,
        step_tx,
        in_flight,
        wake,
        batch_stop.clone(),
        abort.clone(),
    ));
    infer.set_phase(Phase::Serving);
    set_ready(&health, true).await;
    info!("serving gRPC on {addr}");
    let watchdog = tokio::spawn(watch_liveness(
        health.clone(),
        infer.clone(),
        progress.clone(),
        args.liveness_timeout,
    ));
    // A step past --step-timeout whose own waits did not end it (a device call that never
    // returns) breaks the group from here: every waiting request is answered at once.
    let (stuck_abort, limit) = (abort.clone(), args.step_timeout);
    watchdog::watch_steps(progress, limit, move |d| {
        stuck_abort.trigger(format!(
            "a step has run {d:.1?}, past --step-timeout {limit:?}: a rank or its GPU is stuck"
        ))
    })?;

    let stop = wait_for_stop(&abort).await;
    let drained = match &stop {
        Stop::Signal(name) => {
            infer.set_phase(Phase::Draining);
            set_ready(&health, false).await;
            let (requests, tokens) = admission.held();
            warn!(
                requests,
                tokens, "{name}: draining; new requests are refused"
            );
            let done = tokio::time::timeout(args.drain_timeout, admission.drained())
                .await
                .is_ok();
            if !done {
                let (requests, tokens) = admission.held();
                abort.trigger(format!(
                    "drain timeout: {requests} requests ({tokens} tokens) unfinished after {:?}",
                    args.drain_timeout
                ));
            }
            done
        }
        Stop::Broken(reason) => {
            infer.set_phase(Phase::Broken);
            set_ready(&health, false).await;
            error!("EP group broken: {reason}; answering every waiting request UNAVAILABLE");
            false
        }
    };
    batch_stop.cancel();
    let _ = batcher.await;
    // The executor ends within a step unless a device call under it never returns; once the
    // group is broken its clients are answered, so there is no step worth a long wait.
    let joined = tokio::task::spawn_blocking(move || exec_thread.join());
    let bound = match abort.reason() {
        Some(_) => BROKEN_JOIN,
        None => args.step_timeout + STUCK_GRACE,
    };
    let executed = tokio::time::timeout(bound, joined).await;
    watchdog.abort();
    infer.set_live(false);
    health
        .set_service_status(LIVENESS, ServingStatus::NotServing)
        .await;
    // Keep answering UNAVAILABLE (with the reason) a moment before the port closes, so clients
    // and load balancers see a clean refusal rather than a dropped connection.
    tokio::time::sleep(args.shutdown_grace).await;
    let Ok(executed) = executed else {
        let why = abort.reason().unwrap_or_default();
        watchdog::exit_now(
            1,
            &format!("the step executor is stuck in a device call ({why})"),
        );
    };
    server_stop.cancel();
    server.await??;
    executed?.map_err(|_| anyhow!("the step executor panicked"))??;
    if let Some(reason) = abort.reason() {
        bail!("the EP group broke: {reason}");
    }
    if drained {
        info!("drained; exiting");
    }
    Ok(())
}

type GroupExecutor = Executor<Box<dyn Backend + Send>>;

/// Joins the group, sets up the exchange buffers and runs the warm-up step (blocking); also says
/// what the NCCL EP exchange takes on this GPU (nccl-ep).
fn form_group(
    args: &ServeArgs,
    p: Prepared,
    listener: TcpListener,
    abort: Arc<Abort>,
) -> anyhow::Result<(GroupExecutor, Option<crate::proto::NcclEpFootprint>)> {
    let world = p.member.world;
    let bind = listener.local_addr()?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let group_id = format!("{:x}-{nanos:x}", std::process::id());
    let host = group::host_id();
    let nccl_id = match &p.weights {
        Weights::Gpu(_) => Some(gpu::new_unique_id()?),
        Weights::Host(_) => None,
    };
    info!(world, rendezvous = %bind, group = %group_id, "waiting for ranks");
    let timeout = args.rendezvous_timeout;
    let want = group::Expect {
        world,
        fingerprint: &p.fingerprint,
        host: &host,
        same_host: true,
        token: args.group_token.as_deref().unwrap_or_default(),
    };
    let mut link = RouterLink::accept(&listener, &want, &group_id, nccl_id.clone(), timeout)?;
    drop(listener);
    let dir = segment_dir(args)?;
    let swept = crate::shm::sweep_stale(&dir);
    if swept > 0 {
        info!("removed {swept} segment(s) of groups whose router is gone");
    }
    let dir = dir.as_path();
    let setup = (|| -> anyhow::Result<(Box<dyn Backend + Send>, Arc<Ring>)> {
        let deadline = Instant::now() + timeout;
        let ring = Arc::new(
            Ring::create(&ring_path(dir, &group_id), p.ring).context("creating the step ring")?,
        );
        let backend: Box<dyn Backend + Send> = match p.weights {
            Weights::Host(weights) => {
                let own =
                    CpuRank::create_segment(dir, &group_id, 0, p.segment).with_context(|| {
                        format!("creating the exchange segment in {}", dir.display())
                    })?;
                link.gather("its exchange segment", deadline, |r| Ctl::Created {
                    rank: r,
                })?;
                link.broadcast(&Ctl::Map)?;
                let rank = CpuRank::attach(
                    dir,
                    &group_id,
                    0,
                    own,
                    p.segment,
                    p.spec.clone(),
                    weights,
                    ring.clone(),
                    abort.clone(),
                    args.step_timeout,
                )
                .context("mapping the peers' exchange segments")?;
                link.gather("mapping every segment", deadline, |r| Ctl::Mapped {
                    rank: r,
                })?;
                rank.unlink_own();
                Box::new(rank)
            }
            Weights::Gpu(dev) => {
                link.gather("its GPU and weights", deadline, |r| Ctl::Created {
                    rank: r,
                })?;
                link.broadcast(&Ctl::Map)?;
                let _bound = SetupDeadline::new(GPU_SETUP, deadline);
                let rank = dev.join(
                    nccl_id.as_deref().unwrap_or_default(),
                    ring.clone(),
                    p.buckets.clone(),
                    args.cuda_graphs == OnOff::On,
                    args.step_timeout,
                    deadline,
                )?;
                link.gather("joining NCCL and capturing its steps", deadline, |r| {
                    Ctl::Mapped { rank: r }
                })?;
                rank
            }
        };
        link.broadcast(&Ctl::Go)?;
        ring.unlink();
        Ok((backend, ring))
    })();
    let (rank, ring) = match setup {
        Ok(x) => x,
        Err(e) => {
            link.reject_all(&format!("startup failed at rank 0: {e:#}"));
            return Err(e);
        }
    };
    link.clear_timeouts()?;
    group_info(p.backend, 0, world);
    let buffers = rank.buffers();
    // Logged per mode by every rank as its groups were made.
    let footprint = rank.ep_footprint();
    let driver = Driver::new(
        rank,
        0,
        world,
        p.spec.moe_layers.clone(),
        args.metrics_per_expert,
        p.ring,
    );
    let mut exec = Executor::new(driver, ring, link, abort, args.step_timeout)?;
    exec.warm_up().context("warm-up step")?;
    info!(
        ?buffers,
        "group ready: every rank joined, weights loaded, warm-up step done"
    );
    Ok((exec, footprint))
}

fn group_info(backend: BackendKind, rank: usize, world: usize) {
    metrics::gauge!(
        "epserve_group_info",
        "backend" => backend_name(backend),
        "world_size" => world.to_string(),
        "ranks_joined" => world.to_string(),
        "rank" => rank.to_string()
    )
    .set(1.0);
}

/// `liveness` is NOT_SERVING while one step has run longer than `limit` (a stuck rank or router).
async fn watch_liveness(
    health: HealthReporter,
    infer: Arc<Infer>,
    progress: Arc<Progress>,
    limit: Duration,
) {
    let mut live = true;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = progress.running_for().is_none_or(|d| d <= limit);
        if now != live {
            live = now;
            let status = if live {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            if !live {
                warn!("a step has run longer than {limit:?}: liveness NOT_SERVING");
            }
            infer.set_live(live);
            health.set_service_status(LIVENESS, status).await;
        }
    }
}

/// Serves the gRPC services on `listener` until `stop`, then lets open calls finish (bounded).
/// The accept loop is ours rather than tonic's transport server, whose built-in grpc-timeout
/// layer answers an expired deadline with CANCELLED before the service can say DEADLINE_EXCEEDED.
async fn serve_grpc(
    http2: crate::transport::Http2,
    max_request_bytes: usize,
    api: Arc<MoeApi>,
    kserve: Arc<KserveApi>,
    health: HealthServer<impl tonic_health::pb::health_server::Health>,
    listener: tokio::net::TcpListener,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::service::TowerToHyperService;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(crate::inference::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let moe = MoeServiceServer::new(api)
        .max_decoding_message_size(max_request_bytes)
        .max_encoding_message_size(max_request_bytes.saturating_mul(2));
    let kserve = GrpcInferenceServiceServer::new(kserve)
        .max_decoding_message_size(max_request_bytes)
        .max_encoding_message_size(max_request_bytes.saturating_mul(2));
    let routes = tonic::service::Routes::new(health)
        .add_service(reflection)
        .add_service(moe)
        .add_service(kserve)
        .prepare();
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    http2.serve(&mut builder);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        warn!("gRPC accept: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let conn = builder.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(routes.clone()));
                let conn = graceful.watch(conn.into_owned());
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, "gRPC connection ended: {e}");
                    }
                });
            }
            _ = stop.cancelled() => break,
        }
    }
    drop(listener);
    // Every admitted call is answered by now; this only waits for connections to close.
    if tokio::time::timeout(Duration::from_secs(5), graceful.shutdown())
        .await
        .is_err()
    {
        warn!("gRPC connections still open 5s after shutdown; closing");
    }
    Ok(())
}

enum Stop {
    Signal(&'static str),
    Broken(String),
}

/// SIGINT, SIGTERM, or the group breaking.
async fn wait_for_stop(abort: &Abort) -> Stop {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return Stop::Broken("cannot install signal handlers".into());
    };
    let broken = async {
        loop {
            if let Some(r) = abort.reason() {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        _ = int.recv() => Stop::Signal("SIGINT"),
        _ = term.recv() => Stop::Signal("SIGTERM"),
        r = broken => Stop::Broken(r),
    }
}

fn model_info(p: &Prepared, args: &ServeArgs) -> ModelInfo {
    let (spec, source, placement) = (&p.spec, &p.source, &p.placement);
    ModelInfo {
        model: source.describe(),
        architecture: spec.architecture.clone(),
        hidden_size: spec.hidden as u32,
        intermediate_size: spec.intermediate as u32,
        moe_layers: spec.moe_layers.clone(),
        num_experts: spec.num_experts as u32,
        top_k: spec.top_k as u32,
        routing: spec.routing.name().into(),
        renormalize: spec.routing.renormalize(),
        num_shared_experts: spec.num_shared_experts as u32,
        accepted_dtypes: vec![DType::Bf16 as i32, DType::F16 as i32, DType::F32 as i32],
        world_size: placement.world as u32,
        backend: backend_name(p.backend),
        max_tokens_per_step: args.max_tokens_per_step as u32,
        placement: (0..placement.world)
            .map(|r| ExpertRange {
                rank: r as u32,
                first: placement.experts_of(r).start as u32,
                count: placement.per_rank() as u32,
            })
            .collect(),
        exchange_bytes_per_rank: p.exchange_bytes,
        version: env!("CARGO_PKG_VERSION").into(),
        // Measured when the group forms (MoeApi::set_ep_footprint).
        nccl_ep: None,
    }
}

fn run_worker(args: &ServeArgs, p: Prepared, metrics: PrometheusHandle) -> anyhow::Result<()> {
    let rank = p.member.rank;
    // Metrics on a small runtime of their own: the step loop stays plain blocking code.
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let listen = args.metrics_listen;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let r = rt.map_err(anyhow::Error::from).and_then(|rt| {
                rt.block_on(async {
                    let r = crate::metrics::serve(listen, metrics, rank).await;
                    let ok = r.is_ok();
                    let _ = addr_tx.send(r);
                    if ok {
                        std::future::pending::<()>().await;
                    }
                    Ok(())
                })
            });
            if let Err(e) = r {
                error!("metrics endpoint: {e:#}");
            }
        })?;
    addr_rx
        .recv()
        .map_err(|_| anyhow!("the metrics thread died"))??;
    let timeout = args.rendezvous_timeout;
    let addr = &p.member.rendezvous;
    let Joined {
        mut stream,
        group: group_id,
        nccl_id,
    } = group::join(
        addr,
        rank,
        p.member.world,
        &p.fingerprint,
        args.group_token.as_deref().unwrap_or_default(),
        timeout,
    )?;
    let deadline = Instant::now() + timeout;
    let dir = segment_dir(args)?;
    let dir = dir.as_path();
    let setup = (|| -> anyhow::Result<Box<dyn Backend + Send>> {
        let open_ring = || -> anyhow::Result<Arc<Ring>> {
            Ok(Arc::new(
                Ring::open(&ring_path(dir, &group_id), p.ring).context("mapping the step ring")?,
            ))
        };
        let backend: Box<dyn Backend + Send> = match p.weights {
            Weights::Host(weights) => {
                let own = CpuRank::create_segment(dir, &group_id, rank, p.segment).with_context(
                    || format!("creating the exchange segment in {}", dir.display()),
                )?;
                send(&mut stream, &Ctl::Created { rank })?;
                expect_msg(&mut stream, Ctl::Map, deadline)?;
                let backend = CpuRank::attach(
                    dir,
                    &group_id,
                    rank,
                    own,
                    p.segment,
                    p.spec.clone(),
                    weights,
                    open_ring()?,
                    Arc::new(Abort::default()),
                    args.step_timeout,
                )
                .context("mapping the peers' exchange segments")?;
                send(&mut stream, &Ctl::Mapped { rank })?;
                expect_msg(&mut stream, Ctl::Go, deadline)?;
                backend.unlink_own();
                Box::new(backend)
            }
            Weights::Gpu(dev) => {
                send(&mut stream, &Ctl::Created { rank })?;
                expect_msg(&mut stream, Ctl::Map, deadline)?;
                let _bound = SetupDeadline::new(GPU_SETUP, deadline);
                let backend = dev.join(
                    nccl_id.as_deref().unwrap_or_default(),
                    open_ring()?,
                    p.buckets.clone(),
                    args.cuda_graphs == OnOff::On,
                    args.step_timeout,
                    deadline,
                )?;
                send(&mut stream, &Ctl::Mapped { rank })?;
                expect_msg(&mut stream, Ctl::Go, deadline)?;
                backend
            }
        };
        Ok(backend)
    })();
    let backend = match setup {
        Ok(b) => b,
        Err(e) => {
            let _ = send(
                &mut stream,
                &Ctl::Failed {
                    rank,
                    reason: format!("{e:#}"),
                },
            );
            return Err(e);
        }
    };
    // The router sends a step or a heartbeat at least every heartbeat interval plus one step.
    let silence = args.heartbeat_interval + args.step_timeout + Duration::from_secs(1);
    stream.set_read_timeout(Some(silence))?;
    group_info(p.backend, rank, p.member.world);
    // The router drives the drain: a signalled rank keeps running the router's steps until it is
    // told to stop or loses the router, so nothing admitted is lost when every pod gets SIGTERM.
    let signalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, signalled.clone())?;
    }
    info!(buffers = ?backend.buffers(), "joined the group");
    let driver = Driver::new(
        backend,
        rank,
        p.member.world,
        p.spec.moe_layers.clone(),
        args.metrics_per_expert,
        p.ring,
    );
    follow_steps(&mut stream, driver, silence, args.step_timeout)
}

fn expect_msg(stream: &mut TcpStream, want: Ctl, deadline: Instant) -> anyhow::Result<()> {
    let got = expect(stream, &format!("{want:?}"), deadline)?;
    if got != want {
        bail!("expected {want:?} from the router, got {got:?}");
    }
    Ok(())
}

/// Runs each step the router sends, until told to stop. A step that outlives --step-timeout
/// (a device call that never returns) ends the process from the watchdog: nothing here could.
fn follow_steps<B: Backend>(
    stream: &mut TcpStream,
    mut driver: Driver<B>,
    silence: Duration,
    step_timeout: Duration,
) -> anyhow::Result<()> {
    let progress = Arc::new(Progress::default());
    let mut report = stream.try_clone()?;
    let rank = driver.rank;
    watchdog::watch_steps(progress.clone(), step_timeout, move |d| {
        let reason = format!("a step has run {d:.1?}, past --step-timeout {step_timeout:?}");
        let _ = send(
            &mut report,
            &Ctl::Failed {
                rank,
                reason: reason.clone(),
            },
        );
        watchdog::exit_now(1, &reason);
    })?;
    loop {
        match group::recv(stream) {
            Ok(Ctl::Step(desc)) => {
                progress.begin();
                let r = driver.run(&desc);
                progress.end();
                if let Err(e) = r {
                    let reason = e.to_string();
                    let msg = match e {
                        StepError::Corrupt { .. } => Ctl::Corrupt { rank, reason },
                        _ => Ctl::Failed { rank, reason },
                    };
                    let _ = send(stream, &msg);
                    return Err(e.into());
                }
            }
            Ok(Ctl::Shutdown) => {
                info!("router asked to stop; exiting");
                return Ok(());
            }
            Ok(Ctl::Failed { reason, .. }) => bail!("the EP group stopped: {reason}"),
            Ok(other) => bail!("unexpected control message {other:?}"),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                bail!("the router (rank 0) sent nothing for {silence:?}: it is stuck or gone")
            }
            Err(e) => bail!("lost the connection to the router (rank 0): {e}"),
        }
    }
}
