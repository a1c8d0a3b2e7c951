//! Before a rank talks to the group: the model, its placement, the backend it resolves to, the
//! group's fingerprint and the shapes of its shared memory (`plan`, quick: the ports open after
//! it), then its experts' weights loaded (`load`, seconds to minutes).

use std::time::Instant;

use anyhow::{anyhow, bail};
use tracing::info;

use crate::backend::bringup::{BringUp, CpuBringUp, GpuBringUp};
use crate::backend::cpu::SegmentShape;
use crate::backend::ep_settings::EpSettings;
use crate::backend::gpu;
use crate::config::{graph_buckets, BackendKind, Member, ServeArgs};
use crate::eplb::SlotMap;
use crate::flags::OnOff;
use crate::group::Fingerprint;
use crate::model::{ExpertDtype, ModelSource, MoeSpec};
use crate::proto::{DType, ExpertRange, LayerPlacement, ModelInfo};
use crate::step::max_home_tokens;
use crate::step::ring::RingShape;

/// Everything a rank knows before it talks to the group.
pub struct Prepared {
    pub member: Member,
    pub source: ModelSource,
    pub spec: MoeSpec,
    /// The expert slots every rank starts from.
    pub slots: SlotMap,
    pub fingerprint: Fingerprint,
    pub backend: BackendKind,
    pub segment: SegmentShape,
    pub ring: RingShape,
    /// GPU backends: home-token buckets, ascending.
    pub buckets: Vec<usize>,
    /// Persistent exchange memory per rank (GetModelInfo; on the GPU backends 0 until loaded).
    pub exchange_bytes: u64,
    pub expert_dtype: ExpertDtype,
    /// Bytes of this rank's experts where it computes them: host memory (cpu) or its GPU
    /// (0 until loaded).
    pub expert_bytes: u64,
    /// nccl-ep: the exchange's settings.
    pub ep: Option<EpSettings>,
}

/// `--expert-dtype` for this model (`ExpertDtype::resolve`), saying why where auto falls back.
fn resolve_expert_dtype(
    args: &ServeArgs,
    spec: &MoeSpec,
    source: &ModelSource,
) -> anyhow::Result<ExpertDtype> {
    let (dtype, note) =
        ExpertDtype::resolve(args.expert_dtype.asked(), spec, source.shipped_fp8()?)?;
    if let Some(n) = note {
        info!("{n}");
    }
    Ok(dtype)
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

pub fn backend_name(b: BackendKind) -> String {
    b.name().to_string()
}

/// `--ep-mode` resolved against the buckets, added to the group's fingerprint: every rank must
/// build the same groups (NCCL EP's creation is collective).
fn ep_settings(
    args: &ServeArgs,
    buckets: &[usize],
    hidden: usize,
    fingerprint: &mut Vec<(String, String)>,
) -> anyhow::Result<EpSettings> {
    let zero_copy = args.zero_copy == OnOff::On;
    let (e, note) = EpSettings::resolve(
        args.ep_mode,
        args.ep_ll_max_tokens,
        buckets,
        zero_copy,
        hidden,
    )
    .map_err(|e| anyhow!(e))?;
    if let Some(n) = note {
        info!("{n}");
    }
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
    Ok(e)
}

/// What a rank knows before it talks to the group, short of its weights.
pub fn plan(args: &ServeArgs, member: Member) -> anyhow::Result<Prepared> {
    let source = ModelSource::parse(&args.model, args.seed)?;
    let mut spec = source.spec()?;
    spec.cap_layers(args.layers);
    spec.validate()?;
    let world = member.place.world;
    let slots = starting_slots(args, &spec, world)?;
    let backend = resolve_backend(args.backend, world)?;
    let expert_dtype = resolve_expert_dtype(args, &spec, &source)?;
    let max_home = max_home_tokens(args.max_tokens_per_step, member.place.world);
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
        ("ingress".into(), args.ingress.name().into()),
        ("ring_cells".into(), args.ring_cells.to_string()),
        ("expert_dtype".into(), expert_dtype.name().into()),
    ];
    fingerprint.extend(spec.fingerprint());
    fingerprint.push(("expert_slots".into(), slots_digest(&slots)));
    if matches!(backend, BackendKind::Nccl | BackendKind::NcclEp) {
        fingerprint.push(("graph_buckets".into(), format!("{buckets:?}")));
        fingerprint.push(("cuda_graphs".into(), format!("{:?}", args.cuda_graphs)));
    }
    let ep = match backend {
        BackendKind::NcclEp => Some(ep_settings(args, &buckets, spec.hidden, &mut fingerprint)?),
        _ => None,
    };
    let segment = SegmentShape {
        world: member.place.world,
        slots: slots.slots(),
        top_k: spec.top_k,
        hidden: spec.hidden,
        max_home,
    };
    let ring = RingShape::new(
        args.ring_cells,
        member.place.world,
        max_home,
        spec.hidden,
        spec.top_k,
    );
    let exchange_bytes = match backend {
        BackendKind::Nccl | BackendKind::NcclEp => 0,
        _ => segment.bytes() as u64,
    };
    Ok(Prepared {
        member,
        source,
        spec,
        slots,
        fingerprint,
        backend,
        segment,
        ring,
        buckets,
        exchange_bytes,
        expert_dtype,
        expert_bytes: 0,
        ep,
    })
}

/// `--load-threads`, or (0) this host's cores shared by the ranks on it: LOCAL_WORLD_SIZE where
/// the launcher set it, else all `world` ranks, as if on this host.
fn load_threads(asked: usize, world: usize) -> usize {
    if asked > 0 {
        return asked;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let here = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(world);
    (cores / here.max(1)).max(1)
}

/// A long stage logs its progress this often.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// This rank's experts' weights, where it computes them (its GPU opened on the GPU backends),
/// ready to join the group; fills in the bytes it holds.
pub fn load(args: &ServeArgs, p: &mut Prepared) -> anyhow::Result<Box<dyn BringUp>> {
    crate::startup::enter(crate::startup::Stage::Load);
    let t0 = Instant::now();
    let rank = p.member.place.rank;
    let experts = p.slots.experts_of(rank);
    let layers = p.spec.moe_layers.len();
    let first = &experts[0];
    info!(slots = ?p.slots.slots_of(rank), experts = ?first, layers, "loading weights");
    let mut progress = crate::startup::Progress::new("layers loaded", layers, PROGRESS_EVERY);
    // The load pool is rayon's global one, sized once per process: the weights are made on it
    // here, and a GPU rank converts them to bf16 on it when it places them.
    let asked = load_threads(args.load_threads, p.member.place.world);
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .num_threads(asked)
        .thread_name(|i| format!("load-{i}"))
        .build_global()
    {
        tracing::debug!(
            "load threads already started ({e}): {}",
            rayon::current_num_threads()
        );
    }
    let threads = rayon::current_num_threads();
    let weights = p.source.load(&p.spec, &experts, p.expert_dtype, &mut |l| {
        progress.tick(l.expert_bytes() as u64);
    })?;
    let host_bytes = weights.expert_bytes() as u64;
    let took = t0.elapsed();
    info!(
        layers,
        expert_dtype = %p.expert_dtype.name(),
        expert_bytes = host_bytes,
        seconds = crate::startup::secs(took),
        gb_per_s = format!("{:.2}", host_bytes as f64 / took.as_secs_f64().max(1e-9) / 1e9),
        threads,
        "weights loaded"
    );
    let rank: Box<dyn BringUp> = match p.backend {
        BackendKind::Nccl | BackendKind::NcclEp => {
            let seat = gpu::Seat {
                ordinal: device_ordinal(args, rank)?,
                place: p.member.place,
                max_home: p.segment.max_home,
                ep: p.ep,
                overlap: args.overlap.resolve(),
                split: match args.two_batch {
                    OnOff::On => gpu::SPLIT_FROM,
                    OnOff::Off => usize::MAX,
                },
            };
            // Slots that may move are addressed through a table gating reads on the device;
            // a group whose slots never move keeps expert e in slot e, and no table.
            let moves = !p.slots.is_contiguous()
                || args.eplb_interval.0.is_some()
                || args.placement.is_some();
            let moving = moves.then(|| gpu::Moving {
                slots: p.slots.clone(),
                source: p.source.clone(),
                step_copies: args.eplb_step_copies,
            });
            let dev = gpu::open(seat, &p.spec, weights, moving)?;
            p.exchange_bytes = dev.buffer_bytes() as u64;
            p.expert_bytes = dev.expert_bytes() as u64;
            Box::new(GpuBringUp {
                device: dev,
                buckets: p.buckets.clone(),
                graphs: args.cuda_graphs == OnOff::On,
                phase_times: args.step_phase_times == OnOff::On,
                step_timeout: args.step_timeout,
            })
        }
        _ => {
            p.expert_bytes = host_bytes;
            Box::new(CpuBringUp {
                rank,
                segment: p.segment,
                spec: p.spec.clone(),
                slots: p.slots.clone(),
                source: p.source.clone(),
                weights,
                step_timeout: args.step_timeout,
                threads: args.cpu_threads,
                own: None,
            })
        }
    };
    Ok(rank)
}

/// What GetModelInfo says of this group.
pub fn model_info(p: &Prepared, args: &ServeArgs) -> ModelInfo {
    let (spec, source, slots) = (&p.spec, &p.source, &p.slots);
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
        world_size: slots.world as u32,
        backend: backend_name(p.backend),
        max_tokens_per_step: args.max_tokens_per_step as u32,
        max_request_bytes: args.max_request_bytes as u64,
        placement: match slots.is_contiguous() {
            true => (0..slots.world)
                .map(|r| ExpertRange {
                    rank: r as u32,
                    first: slots.slots_of(r).start as u32,
                    count: slots.per_rank() as u32,
                })
                .collect(),
            false => Vec::new(),
        },
        exchange_bytes_per_rank: p.exchange_bytes,
        version: env!("CARGO_PKG_VERSION").into(),
        // Measured when the group forms (MoeApi::set_ep_footprint).
        nccl_ep: None,
        ingress_mode: args.ingress.name().into(),
        // Known when the group forms (MoeApi::set_ingress).
        ingress: Vec::new(),
        expert_dtype: p.expert_dtype.name().into(),
        expert_bytes_per_rank: p.expert_bytes,
        // Known when the group forms (MoeApi::set_nodes).
        rank_nodes: Vec::new(),
        redundant_experts: slots.redundant() as u32,
        slots_per_rank: slots.per_rank() as u32,
        // The leader's balancer says which placement is current (MoeApi::set_placement).
        layer_placement: layer_placement(&spec.moe_layers, slots),
        placement_epoch: 0,
        // The leader's executor says who is in the group (MoeApi::set_roster).
        live_ranks: (0..slots.world as u32).collect(),
        lost_ranks: Vec::new(),
        group_epoch: 0,
        on_rank_loss: String::new(),
    }
}

/// GetModelInfo's placement of `slots`.
pub fn layer_placement(layer_ids: &[u32], slots: &SlotMap) -> Vec<LayerPlacement> {
    (layer_ids.iter().zip(slots.layers()))
        .map(|(&layer, l)| LayerPlacement {
            layer,
            phy2log: l.phy2log().to_vec(),
        })
        .collect()
}

/// `--placement`, else `--redundant-experts` slots after the contiguous blocks.
fn starting_slots(args: &ServeArgs, spec: &MoeSpec, world: usize) -> anyhow::Result<SlotMap> {
    let (e, layers) = (spec.num_experts, spec.moe_layers.len());
    let slots = match &args.placement {
        Some(file) => SlotMap::from_file(file, e, world, layers).map_err(|e| anyhow!(e))?,
        None => {
            let r = args.redundant_experts;
            match (e + r) % world.max(1) {
                0 => SlotMap::contiguous(e, world, r, layers).map_err(|e| anyhow!(e))?,
                _ if r == 0 => bail!(
                    "{e} experts cannot be split evenly over {world} ranks (experts must be divisible by the world size, or experts + --redundant-experts)"
                ),
                _ => bail!(
                    "{e} experts + --redundant-experts {r} = {} slots cannot be split evenly over {world} ranks (every rank holds as many slots)",
                    e + r
                ),
            }
        }
    };
    if args.placement.is_some()
        && args.redundant_experts != 0
        && slots.redundant() != args.redundant_experts
    {
        bail!(
            "--placement has {} redundant slots per layer, --redundant-experts says {}",
            slots.redundant(),
            args.redundant_experts
        );
    }
    Ok(slots)
}

/// The starting placement, for the fingerprint: every rank must start from the same one.
fn slots_digest(slots: &SlotMap) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for l in slots.layers() {
        for &g in l.phy2log() {
            h = (h ^ u64::from(g)).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    format!(
        "{} slots, {} redundant, {h:016x}",
        slots.slots(),
        slots.redundant()
    )
}
