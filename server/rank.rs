//! One rank's life: load its experts, join the group, set up the persistent exchange buffers,
//! then either serve (rank 0: gRPC, batcher, step executor) or follow step descriptors.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::api::MoeApi;
use crate::backend::cpu::{CpuRank, SegmentShape};
use crate::config::{Member, ServeArgs};
use crate::group::{self, expect, send, Ctl, Fingerprint, RouterLink};
use crate::model::{ModelSource, MoeSpec, Placement, RankWeights};
use crate::proto::moe_service_server::MoeServiceServer;
use crate::proto::{DType, ExpertRange, ModelInfo};
use crate::router::{run_batcher, BatchConfig, Executor};
use crate::shm::Abort;
use crate::step::ring::{Ring, RingShape};
use crate::step::{max_home_tokens, Backend, Driver};

const RING_SLOTS: usize = 2;

/// Everything a rank knows before it talks to the group.
struct Prepared {
    member: Member,
    source: ModelSource,
    spec: MoeSpec,
    placement: Placement,
    fingerprint: Fingerprint,
    segment: SegmentShape,
    ring: RingShape,
    weights: RankWeights,
}

fn prepare(args: &ServeArgs, member: Member) -> anyhow::Result<Prepared> {
    let source = ModelSource::parse(&args.model, args.seed)?;
    let mut spec = source.spec()?;
    spec.cap_layers(args.layers);
    spec.validate()?;
    let placement = Placement::new(spec.num_experts, member.world)?;
    let mut fingerprint = vec![
        ("version".to_string(), env!("CARGO_PKG_VERSION").to_string()),
        (
            "backend".into(),
            format!("{:?}", args.backend).to_lowercase(),
        ),
        ("model".into(), source.describe()),
        (
            "max_tokens_per_step".into(),
            args.max_tokens_per_step.to_string(),
        ),
    ];
    fingerprint.extend(spec.fingerprint());
    let segment = SegmentShape {
        world: member.world,
        experts: spec.num_experts,
        top_k: spec.top_k,
        hidden: spec.hidden,
        max_home: max_home_tokens(args.max_tokens_per_step, member.world),
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
        exchange_mib = segment.bytes() >> 20,
        seconds = t0.elapsed().as_secs_f32(),
        "weights loaded"
    );
    Ok(Prepared {
        member,
        source,
        spec,
        placement,
        fingerprint,
        segment,
        ring,
        weights,
    })
}

pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let member = args.member().map_err(|e| anyhow!(e))?;
    let rank = member.rank;
    let p = prepare(&args, member).with_context(|| format!("rank {rank}"))?;
    let r = if rank == 0 {
        run_router(&args, p)
    } else {
        run_worker(&args, p)
    };
    r.with_context(|| format!("rank {rank}"))
}

fn ring_path(dir: &Path, group: &str) -> std::path::PathBuf {
    dir.join(format!("epserve-{group}-ring"))
}

/// The rendezvous listener binds the rendezvous address's IP, or every interface for a name.
fn rendezvous_bind(addr: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(a);
    }
    let port = addr
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok());
    port.map(|p| SocketAddr::from(([0, 0, 0, 0], p)))
        .ok_or_else(|| anyhow!("rendezvous address '{addr}' is not HOST:PORT"))
}

fn run_router(args: &ServeArgs, p: Prepared) -> anyhow::Result<()> {
    let world = p.member.world;
    let bind = rendezvous_bind(&p.member.rendezvous)?;
    let listener =
        TcpListener::bind(bind).with_context(|| format!("binding the rendezvous port {bind}"))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let group_id = format!("{:x}-{nanos:x}", std::process::id());
    let host = group::host_id();
    info!(world, rendezvous = %bind, group = %group_id, "waiting for ranks");
    let timeout = args.rendezvous_timeout;
    let mut link = RouterLink::accept(
        &listener,
        world,
        &p.fingerprint,
        &host,
        true,
        &group_id,
        timeout,
    )?;
    drop(listener);
    let abort = Arc::new(Abort::default());
    let dir = args.shm_dir.as_path();
    let setup = (|| -> anyhow::Result<(CpuRank, Arc<Ring>)> {
        let deadline = Instant::now() + timeout;
        let own = CpuRank::create_segment(dir, &group_id, 0, p.segment)
            .with_context(|| format!("creating the exchange segment in {}", dir.display()))?;
        let ring = Arc::new(
            Ring::create(&ring_path(dir, &group_id), p.ring).context("creating the step ring")?,
        );
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
            p.weights,
            ring.clone(),
            abort.clone(),
            args.step_timeout,
        )
        .context("mapping the peers' exchange segments")?;
        link.gather("mapping every segment", deadline, |r| Ctl::Mapped {
            rank: r,
        })?;
        link.broadcast(&Ctl::Go)?;
        rank.unlink_own();
        ring.unlink();
        Ok((rank, ring))
    })();
    let (rank, ring) = match setup {
        Ok(x) => x,
        Err(e) => {
            link.reject_all(&format!("startup failed at rank 0: {e:#}"));
            return Err(e);
        }
    };
    link.clear_timeouts()?;
    let buffers = rank.buffers();
    let exchange_bytes = p.segment.bytes() as u64;
    let mut exec = Executor::new(
        Driver::new(rank, 0, world),
        ring,
        link,
        abort.clone(),
        args.step_timeout,
        p.spec.hidden,
        p.spec.top_k,
    )?;
    exec.warm_up().context("warm-up step")?;
    info!(
        ?buffers,
        "group ready: every rank joined, weights loaded, warm-up step done"
    );

    let spec = Arc::new(p.spec);
    let info = model_info(&spec, &p.source, &p.placement, args, exchange_bytes);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (job_tx, job_rx) = mpsc::channel(args.max_queued_requests);
    let (step_tx, step_rx) = mpsc::channel(1);
    let exec_thread = std::thread::Builder::new()
        .name("step-executor".into())
        .spawn(move || exec.serve(step_rx))?;
    let batch = BatchConfig {
        max_tokens_per_step: args.max_tokens_per_step,
        max_wait: Duration::from_micros(args.max_batch_wait_us),
    };
    let served = runtime.block_on(async {
        let batcher = tokio::spawn(run_batcher(batch, job_rx, step_tx));
        let api = Arc::new(MoeApi::new(spec, info, job_tx));
        let r = serve_grpc(args, api, abort.clone()).await;
        let _ = batcher.await;
        r
    });
    let executed = exec_thread
        .join()
        .map_err(|_| anyhow!("the step executor panicked"))?;
    served?;
    executed?;
    info!("drained; exiting");
    Ok(())
}

async fn serve_grpc(args: &ServeArgs, api: Arc<MoeApi>, abort: Arc<Abort>) -> anyhow::Result<()> {
    use tonic_health::ServingStatus;
    let (health, health_service) = tonic_health::server::health_reporter();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let moe = MoeServiceServer::new(api)
        .max_decoding_message_size(args.max_request_bytes)
        .max_encoding_message_size(args.max_request_bytes.saturating_mul(2));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the gRPC address {}", args.listen))?;
    let addr = listener.local_addr()?;
    health.set_serving::<MoeServiceServer<Arc<MoeApi>>>().await;
    health.set_service_status("", ServingStatus::Serving).await;
    info!("serving gRPC on {addr}");
    let stop = async {
        let reason = wait_for_stop(&abort).await;
        warn!("{reason}: not serving any more");
        health
            .set_not_serving::<MoeServiceServer<Arc<MoeApi>>>()
            .await;
        health
            .set_service_status("", ServingStatus::NotServing)
            .await;
    };
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection)
        .add_service(moe)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            stop,
        )
        .await?;
    Ok(())
}

/// SIGINT, SIGTERM, or the group breaking.
async fn wait_for_stop(abort: &Abort) -> String {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return "cannot install signal handlers".into();
    };
    let broken = async {
        loop {
            if let Some(r) = abort.reason() {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        _ = int.recv() => "SIGINT".into(),
        _ = term.recv() => "SIGTERM".into(),
        r = broken => format!("EP group broken ({r})"),
    }
}

fn model_info(
    spec: &MoeSpec,
    source: &ModelSource,
    placement: &Placement,
    args: &ServeArgs,
    exchange: u64,
) -> ModelInfo {
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
        backend: format!("{:?}", args.backend).to_lowercase(),
        max_tokens_per_step: args.max_tokens_per_step as u32,
        placement: (0..placement.world)
            .map(|r| ExpertRange {
                rank: r as u32,
                first: placement.experts_of(r).start as u32,
                count: placement.per_rank() as u32,
            })
            .collect(),
        exchange_bytes_per_rank: exchange,
        version: env!("CARGO_PKG_VERSION").into(),
    }
}

fn run_worker(args: &ServeArgs, p: Prepared) -> anyhow::Result<()> {
    let rank = p.member.rank;
    let timeout = args.rendezvous_timeout;
    let addr = &p.member.rendezvous;
    let (mut stream, group_id) = group::join(addr, rank, p.member.world, &p.fingerprint, timeout)?;
    let deadline = Instant::now() + timeout;
    let dir = args.shm_dir.as_path();
    let setup = (|| -> anyhow::Result<CpuRank> {
        let own = CpuRank::create_segment(dir, &group_id, rank, p.segment)
            .with_context(|| format!("creating the exchange segment in {}", dir.display()))?;
        send(&mut stream, &Ctl::Created { rank })?;
        expect_msg(&mut stream, Ctl::Map, deadline)?;
        let ring = Arc::new(
            Ring::open(&ring_path(dir, &group_id), p.ring).context("mapping the step ring")?,
        );
        let backend = CpuRank::attach(
            dir,
            &group_id,
            rank,
            own,
            p.segment,
            p.spec.clone(),
            p.weights,
            ring,
            Arc::new(Abort::default()),
            args.step_timeout,
        )
        .context("mapping the peers' exchange segments")?;
        send(&mut stream, &Ctl::Mapped { rank })?;
        expect_msg(&mut stream, Ctl::Go, deadline)?;
        backend.unlink_own();
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
    stream.set_read_timeout(None)?;
    // The router drives the drain: a signalled rank keeps running the router's steps until it is
    // told to stop or loses the router, so nothing admitted is lost when every pod gets SIGTERM.
    let signalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, signalled.clone())?;
    }
    info!(buffers = ?backend.buffers(), "joined the group");
    follow_steps(&mut stream, Driver::new(backend, rank, p.member.world))
}

fn expect_msg(stream: &mut TcpStream, want: Ctl, deadline: Instant) -> anyhow::Result<()> {
    let got = expect(stream, &format!("{want:?}"), deadline)?;
    if got != want {
        bail!("expected {want:?} from the router, got {got:?}");
    }
    Ok(())
}

/// Runs each step the router sends, until told to stop.
fn follow_steps<B: Backend>(stream: &mut TcpStream, mut driver: Driver<B>) -> anyhow::Result<()> {
    loop {
        match group::recv(stream) {
            Ok(Ctl::Step(desc)) => {
                if let Err(e) = driver.run(&desc) {
                    let _ = send(
                        stream,
                        &Ctl::Failed {
                            rank: driver.rank,
                            reason: e.to_string(),
                        },
                    );
                    return Err(e.into());
                }
            }
            Ok(Ctl::Shutdown) => {
                info!("router asked to stop; exiting");
                return Ok(());
            }
            Ok(Ctl::Failed { reason, .. }) => bail!("the EP group stopped: {reason}"),
            Ok(other) => bail!("unexpected control message {other:?}"),
            Err(e) => bail!("lost the connection to the router (rank 0): {e}"),
        }
    }
}
