//! The GPU backend's entry points, or, in a build without `--features cuda`, refusals that say
//! so.

pub use super::device::{GpuDevice, Joining, Moving, Seat, SPLIT_FROM};

#[cfg(feature = "cuda")]
pub use super::cuda::bench::run as bench;
#[cfg(feature = "cuda")]
pub use super::cuda::setup::{available, device_count, ep_gates, new_unique_id, open};
#[cfg(feature = "cuda")]
pub use super::cuda::sys::ipc::open_device;

#[cfg(not(feature = "cuda"))]
pub use nocuda::*;

#[cfg(not(feature = "cuda"))]
mod nocuda {
    use std::sync::Arc;

    use super::{GpuDevice, Moving, Seat};
    use crate::backend::bench::{BenchConfig, ConfigResult, Plan};
    use crate::model::{MoeSpec, RankWeights};

    const WHY: &str = "this binary was built without GPU support (build with --features cuda)";

    pub fn available() -> Result<String, String> {
        Err(WHY.into())
    }
    pub fn device_count() -> usize {
        0
    }
    pub fn ep_gates(_world: usize) -> Result<String, String> {
        Err(WHY.into())
    }
    pub fn new_unique_id() -> anyhow::Result<Vec<u8>> {
        anyhow::bail!(WHY)
    }
    pub fn bench(_plan: &Plan, _configs: &[BenchConfig]) -> anyhow::Result<Vec<ConfigResult>> {
        anyhow::bail!("epserve bench times the GPU step: {WHY}")
    }
    pub fn open_device() -> Result<Arc<dyn crate::request::OpenDevice>, String> {
        Err(WHY.into())
    }
    pub fn open(
        _seat: Seat,
        _spec: &MoeSpec,
        _weights: RankWeights,
        _moving: Option<Moving>,
    ) -> anyhow::Result<Box<dyn GpuDevice>> {
        anyhow::bail!(WHY)
    }
}
