//! Bringing a GPU rank up, in the order the rendezvous needs: open the device and upload the
//! weights (slow, done while the group gathers), then join the communicator and capture the steps
//! (collective: every rank at once, after the leader says so).

use std::time::Instant;

use anyhow::{anyhow, Context};
use nccl_sys::ncclUniqueId;

use crate::backend::cuda::placement::{Land, Mover, SlotTable};
use crate::backend::cuda::rank::GpuRank;
use crate::backend::cuda::shape::{EpShape, StepShape};
use crate::backend::cuda::step::{DeviceLayer, GpuStep};
use crate::backend::cuda::sys::nccl::{init_apart, loaded, new_id};
use crate::backend::cuda::Gpu;
use crate::backend::cuda::{Alloc, GpuError};
use crate::backend::device::{check_gpu_limits, GpuDevice, Joining, Moving, Seat};
use crate::eplb::copy_order::StepCopies;
use crate::eplb::SlotMap;
use crate::model::{ExpertDtype, ModelSource, MoeSpec, RankWeights};
use crate::place::Place;
use crate::step::Backend;

/// Why the GPU backend cannot run here, if it cannot: no device, or no NCCL.
pub fn available() -> Result<String, String> {
    let n = crate::backend::cuda::device_count();
    if n == 0 {
        return Err("no CUDA device is visible".into());
    }
    let nccl = loaded()?;
    Ok(format!(
        "{n} GPUs, NCCL {} from {}",
        nccl_sys::version_string(nccl.version),
        nccl.path.display()
    ))
}

pub fn device_count() -> usize {
    crate::backend::cuda::device_count()
}

/// Why `nccl-ep` cannot run here (after `available`), or what it will run on.
pub fn ep_gates(world: usize) -> Result<String, String> {
    crate::backend::cuda::exchange::ep::gates(loaded()?.version, world)
}

/// The leader's NCCL unique id, handed to every rank in the rendezvous Welcome.
pub fn new_unique_id() -> anyhow::Result<Vec<u8>> {
    new_id().map_err(|e| anyhow!(e))
}

/// Opens GPU `seat.ordinal` with this rank's weights on it (`GpuDevice`).
pub fn open(
    seat: Seat,
    spec: &MoeSpec,
    weights: RankWeights,
    moving: Option<Moving>,
) -> anyhow::Result<Box<dyn GpuDevice>> {
    Ok(Box::new(Device::open(seat, spec, weights, moving)?))
}

/// A GPU with this rank's weights on it, not yet in the group. The service and `epserve bench`
/// both bring their ranks up through it, so the shapes, the NCCL EP layout and its checks are
/// decided in one place.
pub struct Device {
    g: Gpu,
    alloc: Alloc,
    layers: Vec<DeviceLayer>,
    shape: StepShape,
    spec: MoeSpec,
    ordinal: usize,
    /// Where the slots start, when they may move (read through a slot table)...
    slots: Option<SlotMap>,
    /// ...and where a moved slot's weights come from (None in `epserve bench`: they never
    /// move), and how many of a placement's copies go beside a step.
    source: Option<(ModelSource, StepCopies)>,
}

impl Device {
    pub fn open(
        seat: Seat,
        spec: &MoeSpec,
        weights: RankWeights,
        moving: Option<Moving>,
    ) -> anyhow::Result<Self> {
        let (slots, source) = match moving {
            Some(m) => (Some(m.slots), Some((m.source, m.step_copies))),
            None => (None, None),
        };
        let mut d = Self::new(seat, spec, weights.dtype, slots, |g, alloc, shape| {
            if let Some(l) = weights
                .layers
                .iter()
                .find(|l| l.experts.len() != shape.local())
            {
                anyhow::bail!(
                    "{} experts' weights for {} slots on this rank",
                    l.experts.len(),
                    shape.local()
                );
            }
            weights
                .layers
                .iter()
                .map(|l| DeviceLayer::upload(g, alloc, l, shape))
                .collect::<Result<Vec<_>, _>>()
                .context("uploading the weights")
        })?;
        d.source = source;
        Ok(d)
    }

    /// As `open`, with random weights made on the GPU (`epserve bench`: timing, not numerics).
    pub fn random(
        seat: Seat,
        spec: &MoeSpec,
        dtype: ExpertDtype,
        seed: u64,
        slots: Option<SlotMap>,
    ) -> anyhow::Result<Self> {
        Self::new(seat, spec, dtype, slots, |g, alloc, shape| {
            (0..spec.moe_layers.len() as u64)
                .map(|l| DeviceLayer::random(g, alloc, shape, seed + 10 * l))
                .collect::<Result<Vec<_>, _>>()
                .context("making random weights")
        })
    }

    fn new(
        seat: Seat,
        spec: &MoeSpec,
        dtype: ExpertDtype,
        slots: Option<SlotMap>,
        layers: impl FnOnce(&Gpu, &mut Alloc, &StepShape) -> anyhow::Result<Vec<DeviceLayer>>,
    ) -> anyhow::Result<Self> {
        let Seat {
            ordinal,
            place: Place { rank, world },
            max_home,
            ep,
            overlap,
            split,
        } = seat;
        check_gpu_limits(spec).map_err(|e| anyhow!(e))?;
        let mut shape = StepShape::new(spec, world, rank, max_home);
        shape.ep = ep.map(|e| EpShape::new(e.ll_max, e.zero_copy));
        shape.expert_dtype = dtype;
        shape.overlap = overlap;
        shape.split = split;
        if let Some(m) = &slots {
            shape.experts = m.slots();
        }
        if let Some(e) = shape.ep {
            crate::backend::cuda::exchange::ep::validate(&shape, e.align)
                .map_err(|e| anyhow!(e))?;
        }
        shape.check().map_err(|e| anyhow!(e))?;
        let g = Gpu::new(ordinal).with_context(|| format!("opening GPU {ordinal}"))?;
        let mut alloc = Alloc::new(g.stream.clone());
        let layers = layers(&g, &mut alloc, &shape)?;
        g.stream.synchronize()?;
        tracing::info!(
            gpu = ordinal,
            weights_mib = alloc.bytes >> 20,
            step_buffers_mib = shape.buffer_bytes() >> 20,
            "weights on the GPU"
        );
        Ok(Self {
            g,
            alloc,
            layers,
            shape,
            spec: spec.clone(),
            ordinal,
            slots,
            source: None,
        })
    }

    /// Joins the communicator of every rank but `out` (bounded by `deadline`) and allocates the step buffers (and the
    /// NCCL EP group): collective, every rank at once. Returns the step and the allocator that
    /// counted every device allocation.
    pub fn connect(
        mut self,
        nccl_id: &[u8],
        deadline: Instant,
        near: Vec<bool>,
        out: &[u32],
    ) -> anyhow::Result<(GpuStep, Alloc)> {
        let id: &[u8; 128] = nccl_id
            .try_into()
            .map_err(|_| anyhow!("the leader sent no NCCL unique id"))?;
        let id = ncclUniqueId::from_bytes(id);
        let (world, rank) = (self.shape.world, self.shape.rank);
        let ctx = self.g.ctx.clone();
        let rx = init_apart(ctx, id, (world, rank), out.to_vec(), |_, c| {
            Ok::<_, GpuError>(c)
        })?;
        let wait = deadline.saturating_duration_since(Instant::now());
        let comm = rx
            .recv_timeout(wait)
            .map_err(|_| anyhow!("NCCL init did not complete within {wait:?}: a rank is missing"))?
            .context("NCCL init")?;
        self.g.ctx.bind_to_thread()?;
        let table = match &self.slots {
            Some(m) => Some(SlotTable::new(&mut self.alloc, m, rank, near)?),
            None => None,
        };
        // The exchange (NCCL EP's groups are collective too): every rank makes it here, in the
        // same order.
        let core = GpuStep::new(
            self.g,
            comm,
            self.shape,
            self.spec.routing.clone(),
            self.layers,
            table,
            &mut self.alloc,
        )
        .context("the step's exchange and buffers")?;
        Ok((core, self.alloc))
    }
}

/// Whether each of `world` ranks shares `rank`'s node (all of them when the nodes are not known).
pub fn near_ranks(nodes: &[(String, Vec<usize>)], rank: usize, world: usize) -> Vec<bool> {
    match nodes.iter().find(|(_, ranks)| ranks.contains(&rank)) {
        Some((_, ranks)) => (0..world).map(|r| ranks.contains(&r)).collect(),
        None => vec![true; world],
    }
}

impl GpuDevice for Device {
    fn check_nodes(&self, nodes: &[(String, Vec<usize>)]) -> Result<(), String> {
        match self.shape.ep {
            Some(_) => crate::backend::cuda::exchange::ep::placement(nodes),
            None => Ok(()),
        }
    }

    fn buffer_bytes(&self) -> usize {
        self.shape.buffer_bytes()
    }

    fn expert_bytes(&self) -> usize {
        self.layers.iter().map(DeviceLayer::expert_bytes).sum()
    }

    fn join(self: Box<Self>, at: Joining) -> anyhow::Result<Box<dyn Backend + Send>> {
        let (graphs, phase_times) = (at.graphs, at.phase_times);
        let (ordinal, graph_count) = (
            self.ordinal,
            at.buckets.len() * 2 * self.spec.moe_layers.len(),
        );
        let t0 = Instant::now();
        let rank = self.shape.rank;
        let near = near_ranks(&at.nodes, rank, self.shape.world);
        let moving = match (&self.slots, &self.source) {
            (Some(slots), Some((source, step_copies))) => Some(Moving {
                slots: slots.clone(),
                source: source.clone(),
                step_copies: *step_copies,
            }),
            _ => None,
        };
        let (spec, dtype) = (self.spec.clone(), self.shape.expert_dtype);
        let out = at.rejoining.clone().unwrap_or_default();
        let mut me = self;
        // A step whose peer is lost ends (LL masks it) when the group goes on without it.
        if let Some(e) = me.shape.ep.as_mut().filter(|_| at.go_on) {
            e.mask_after = Some(at.step_timeout);
        }
        let (core, alloc) = me.connect(at.nccl_id, at.deadline, near, &out)?;
        let mover = moving
            .map(|m| {
                Mover::new(
                    m,
                    spec,
                    dtype,
                    core.g.ctx.clone(),
                    (rank, core.slot_bytes()),
                )
            })
            .transpose()?;
        let mut rank_ = GpuRank::new(
            core,
            at.ring,
            at.buckets,
            (graphs, phase_times),
            at.step_timeout,
            at.abort,
            mover,
        )?;
        // Every rank at once; a rank coming back captures with the others at its roster.
        if at.rejoining.is_none() {
            rank_.prime()?;
            if at.go_on {
                rank_.warm_shrunk()?;
            }
        }
        tracing::info!(
            gpu = ordinal,
            device_mib = alloc.bytes >> 20,
            graphs = if graphs && at.rejoining.is_none() {
                graph_count
            } else {
                0
            },
            seconds = t0.elapsed().as_secs_f32(),
            "GPU step ready"
        );
        Ok(Box::new(rank_))
    }
}
