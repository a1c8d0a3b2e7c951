//! A backend's bring-up in the halves the group's two barriers divide it into, so the startup
//! handshake (`serve::bringup`) is written once for every backend: `create` makes what this
//! rank's peers will map (the cpu backend's exchange segment; a GPU's weights are on it
//! already), `join` maps the peers' (or joins NCCL) and returns the running backend. A new
//! backend is a folder with one `BringUp`, made in one arm of `serve::prepare::load`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::cpu::{default_lanes, segment_path, CpuRank, SegmentShape};
use super::gpu;
use crate::eplb::SlotMap;
use crate::lifecycle::Abort;
use crate::model::{ModelSource, MoeSpec, RankWeights};
use crate::nodes::plane::DataLinks;
use crate::nodes::Roster;
use crate::step::ring::Ring;
use crate::step::Backend;
use crate::sys::shm::Shm;
use crate::watchdog::SetupDeadline;

/// Where the group meets on this node.
pub struct Site<'a> {
    /// The directory of the node's shared-memory segments.
    pub dir: &'a Path,
    pub group: &'a str,
    /// Every rank's node, and where its data connections reach it.
    pub roster: &'a Roster,
    /// NCCL's unique id (GPU backends).
    pub nccl_id: &'a [u8],
    /// The step ring, mapped once every rank has arrived (the leader creates it before then).
    pub ring: &'a dyn Fn() -> anyhow::Result<Arc<Ring>>,
    pub deadline: Instant,
    pub abort: Arc<Abort>,
    /// The group goes on without a lost rank: the segment and ring files stay while it runs,
    /// for a restarted rank to map (their owners remove them on exit).
    pub keep_files: bool,
    /// This rank comes back into a running group without these ranks (`Joining::rejoining`).
    pub rejoining: Option<&'a [u32]>,
}

/// One rank's backend on its way into the group.
pub trait BringUp: Send {
    /// The leader's id for the group's communicator, handed to every rank in its welcome
    /// (GPU backends: NCCL's unique id).
    fn new_nccl_id(&self) -> anyhow::Result<Option<Vec<u8>>> {
        Ok(None)
    }
    /// What the first barrier waits for, and the second (for the errors that name them).
    fn barriers(&self) -> [&'static str; 2];
    /// Before the first barrier: what the peers will map.
    fn create(&mut self, at: &Site) -> anyhow::Result<()>;
    /// After `create`: another mapping of what peers of other nodes write into through their
    /// data connections (the cpu backend's segment; none on a GPU).
    fn mirrored(&self, _at: &Site) -> anyhow::Result<Option<Shm>> {
        Ok(None)
    }
    /// Between the barriers: the peers of its node mapped, those of others through `links` (or
    /// NCCL joined); the backend. Once every rank has joined, the handshake calls its
    /// `Backend::group_started`.
    fn join(
        self: Box<Self>,
        at: &Site,
        links: &DataLinks,
    ) -> anyhow::Result<Box<dyn Backend + Send>>;
}

/// The cpu backend: peers exchange through each rank's shared-memory segment.
pub struct CpuBringUp {
    pub rank: usize,
    pub segment: SegmentShape,
    pub spec: MoeSpec,
    pub weights: RankWeights,
    /// The slots the weights fill, and where a moved slot's weights are read again.
    pub slots: SlotMap,
    pub source: ModelSource,
    pub step_timeout: Duration,
    /// --cpu-threads (0: by the world size).
    pub threads: usize,
    /// This rank's segment: None until `create`.
    pub own: Option<Shm>,
}

impl BringUp for CpuBringUp {
    fn barriers(&self) -> [&'static str; 2] {
        ["its exchange segment", "mapping every segment"]
    }

    fn create(&mut self, at: &Site) -> anyhow::Result<()> {
        let own = CpuRank::create_segment(at.dir, at.group, self.rank, self.segment)
            .with_context(|| format!("creating the exchange segment in {}", at.dir.display()))?;
        self.own = Some(own);
        Ok(())
    }

    fn mirrored(&self, at: &Site) -> anyhow::Result<Option<Shm>> {
        let path = segment_path(at.dir, at.group, self.rank);
        let seg = Shm::open(&path, self.segment.bytes())
            .with_context(|| format!("mapping {} for the data connections", path.display()))?;
        Ok(Some(seg))
    }

    fn join(
        self: Box<Self>,
        at: &Site,
        links: &DataLinks,
    ) -> anyhow::Result<Box<dyn Backend + Send>> {
        let me = *self;
        let own = me.own.context("joining before creating the segment")?;
        let lanes = match me.threads {
            0 => default_lanes(me.segment.world),
            n => n,
        };
        let backend = CpuRank::attach(
            at.dir,
            at.group,
            me.rank,
            own,
            (at.roster, links),
            me.segment,
            me.spec,
            (me.weights, me.slots, me.source),
            (at.ring)()?,
            at.abort.clone(),
            me.step_timeout,
            lanes,
        )
        .context("mapping the peers' exchange segments")?;
        tracing::info!(threads = lanes, "cpu backend: expert math threads");
        Ok(Box::new(backend))
    }
}

/// A GPU backend (`nccl`, `nccl-ep`): its weights are on the device already; joining is NCCL's
/// and the step graphs'.
pub struct GpuBringUp {
    pub device: Box<dyn gpu::GpuDevice>,
    /// Home-token buckets, ascending.
    pub buckets: Vec<usize>,
    pub graphs: bool,
    /// Each graph times its phases (`--step-phase-times`).
    pub phase_times: bool,
    pub step_timeout: Duration,
}

/// What a GPU rank does after NCCL init that takes no deadline of its own.
const GPU_SETUP: &str = "joining NCCL, creating the NCCL EP groups and capturing the step graphs";

impl BringUp for GpuBringUp {
    fn new_nccl_id(&self) -> anyhow::Result<Option<Vec<u8>>> {
        Ok(Some(gpu::new_unique_id()?))
    }

    fn barriers(&self) -> [&'static str; 2] {
        [
            "its GPU and weights",
            "joining NCCL and capturing its steps",
        ]
    }

    /// Refuses a placement the exchange cannot carry (nccl-ep across nodes) on every rank alike,
    /// before NCCL is joined.
    fn create(&mut self, at: &Site) -> anyhow::Result<()> {
        self.device
            .check_nodes(&at.roster.nodes())
            .map_err(|why| anyhow::anyhow!("nccl-ep cannot run this group: {why}"))
    }

    fn join(self: Box<Self>, at: &Site, _: &DataLinks) -> anyhow::Result<Box<dyn Backend + Send>> {
        let _bound = SetupDeadline::new(GPU_SETUP, at.deadline);
        let me = *self;
        me.device.join(gpu::Joining {
            nccl_id: at.nccl_id,
            ring: (at.ring)()?,
            buckets: me.buckets,
            graphs: me.graphs,
            phase_times: me.phase_times,
            step_timeout: me.step_timeout,
            deadline: at.deadline,
            abort: at.abort.clone(),
            nodes: at.roster.nodes(),
            rejoining: at.rejoining.map(<[u32]>::to_vec),
            go_on: at.keep_files,
        })
    }
}
