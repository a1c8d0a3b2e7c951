//! A GPU rank as the rest of the service sees it before it joins the group: where it sits
//! (`Seat`), what the GPU kernels can route, and the opened device behind a trait, so a build
//! without CUDA stubs one function (`gpu::open`) rather than a copy of the device's methods.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::lifecycle::Abort;
use crate::model::{MoeSpec, Routing};
use crate::step::ring::Ring;
use crate::step::Backend;

/// What the GPU routing kernels hold in registers per warp (kernels/*.cu: `int sel[32]`, one group
/// score per lane): a model past these runs on the cpu backend only.
pub const GPU_MAX_TOP_K: usize = 32;
pub const GPU_MAX_GROUPS: usize = 32;

/// Refuses, before anything starts, a model the GPU kernels cannot route.
pub fn check_gpu_limits(spec: &MoeSpec) -> Result<(), String> {
    if spec.top_k > GPU_MAX_TOP_K {
        return Err(format!(
            "top_k {} exceeds the GPU routing kernels' {GPU_MAX_TOP_K}",
            spec.top_k
        ));
    }
    if let Routing::SigmoidGroupTopK { n_group, .. } = spec.routing {
        if n_group > GPU_MAX_GROUPS {
            return Err(format!(
                "n_group {n_group} exceeds the GPU routing kernel's {GPU_MAX_GROUPS}"
            ));
        }
    }
    Ok(())
}

/// The smallest step (home tokens a rank) that two-batch overlap splits (`--two-batch on`):
/// micro-batches of at least 256 tokens, below which the exchange is short and the experts
/// phase reads weights, with nothing under it to gain.
pub const SPLIT_FROM: usize = 512;

/// Where one GPU rank sits: its device, the group, the most home tokens a step gives it, and
/// NCCL EP's settings (None: the `nccl` exchange). The service and `epserve bench` open their
/// devices from it.
#[derive(Clone, Copy, Debug)]
pub struct Seat {
    pub ordinal: usize,
    pub place: crate::place::Place,
    pub max_home: usize,
    pub ep: Option<super::ep_settings::EpSettings>,
    /// `--overlap`, resolved: the largest bucket (home tokens) whose steps overlap; 0: none.
    pub overlap: usize,
    /// Two-batch overlap: the smallest bucket (home tokens) that splits; usize::MAX: none.
    pub split: usize,
}

/// What a GPU rank needs to join the group.
pub struct Joining<'a> {
    /// NCCL's unique id, from the leader.
    pub nccl_id: &'a [u8],
    pub ring: Arc<Ring>,
    /// Home-token buckets, ascending.
    pub buckets: Vec<usize>,
    pub graphs: bool,
    /// Each graph times its phases (`--step-phase-times`).
    pub phase_times: bool,
    pub step_timeout: Duration,
    /// Bounds NCCL init: a rank that never arrives would block it forever.
    pub deadline: Instant,
    pub abort: Arc<Abort>,
    /// The group's hosts and their ranks (a slot on this rank's node is preferred).
    pub nodes: Vec<(String, Vec<usize>)>,
    /// None: every rank joins at once, and warms up and captures its step graphs now. Some: this
    /// rank comes back into a running group without these ranks; it warms up and captures with
    /// the others at the roster that has it live again (`Backend::regroup`).
    pub rejoining: Option<Vec<u32>>,
    /// The group goes on without a lost rank (`--on-rank-loss`): what a regroup needs is made
    /// ready at startup (`GpuRank::warm_shrunk`).
    pub go_on: bool,
}

/// A group whose expert slots may move (redundant slots, a placement file, online EPLB): where
/// it starts, and where a moved slot's weights come from.
pub struct Moving {
    pub slots: crate::eplb::SlotMap,
    pub source: crate::model::ModelSource,
    /// How much of a placement's copies may start beside one step (`--eplb-step-copies`).
    pub step_copies: crate::eplb::copy_order::StepCopies,
}

/// A GPU with this rank's weights on it, not yet in the group (`gpu::open`).
pub trait GpuDevice: Send {
    /// Whether this rank's exchange can carry the group on these nodes (nccl-ep: one node of
    /// at most 8 ranks; nccl: any).
    fn check_nodes(&self, nodes: &[(String, Vec<usize>)]) -> Result<(), String>;
    /// Device bytes of the step buffers `join` will allocate.
    fn buffer_bytes(&self) -> usize;
    /// Device bytes of the experts' weights, routed and shared.
    fn expert_bytes(&self) -> usize;
    /// Joins the communicator, allocates the step buffers, warms up and captures every
    /// bucket's graphs.
    fn join(self: Box<Self>, at: Joining) -> anyhow::Result<Box<dyn Backend + Send>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_limits_refuse_what_the_kernels_cannot_route() {
        let mut spec = crate::model::synthetic::preset("tiny-deepseek").unwrap();
        assert_eq!(check_gpu_limits(&spec), Ok(()));
        spec.routing = Routing::SigmoidGroupTopK {
            n_group: 64,
            topk_group: 2,
            renormalize: true,
            scaling: 1.0,
        };
        assert!(check_gpu_limits(&spec).unwrap_err().contains("n_group 64"));
        spec.routing = Routing::SoftmaxTopK { renormalize: true };
        spec.top_k = 33;
        assert!(check_gpu_limits(&spec).unwrap_err().contains("top_k 33"));
    }
}
