//! Implementations of the step phases.

pub mod bench;
pub mod bringup;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ep_settings;

use crate::model::{MoeSpec, Routing};

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

/// The GPU backend's setup, or, in a build without `--features cuda`, refusals that say so.
pub mod gpu {
    /// Where one GPU rank sits: its device, the group, the most home tokens a step gives it, and
    /// NCCL EP's settings (None: the `nccl` exchange). The service and `epserve bench` open their
    /// devices from it.
    #[derive(Clone, Copy, Debug)]
    pub struct Seat {
        pub ordinal: usize,
        pub world: usize,
        pub rank: usize,
        pub max_home: usize,
        pub ep: Option<super::ep_settings::EpSettings>,
    }

    #[cfg(feature = "cuda")]
    pub use super::cuda::bench::run as bench;
    #[cfg(feature = "cuda")]
    pub use super::cuda::ipc::IpcRegion;
    #[cfg(feature = "cuda")]
    pub use super::cuda::setup::{available, device_count, ep_gates, new_unique_id, Device};

    #[cfg(not(feature = "cuda"))]
    pub use nocuda::*;

    #[cfg(not(feature = "cuda"))]
    mod nocuda {
        use std::sync::Arc;
        use std::time::{Duration, Instant};

        use crate::model::{MoeSpec, RankWeights};
        use crate::step::ring::Ring;
        use crate::step::Backend;

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
        pub fn bench(
            _plan: &crate::backend::bench::Plan,
            _configs: &[crate::backend::bench::BenchConfig],
        ) -> anyhow::Result<Vec<crate::backend::bench::ConfigResult>> {
            anyhow::bail!("epserve bench times the GPU step: {WHY}")
        }

        /// Never constructed without CUDA.
        pub enum IpcRegion {}

        impl IpcRegion {
            pub fn open(_handle: &[u8], _device: i64, _len: u64) -> Result<Self, String> {
                Err(WHY.into())
            }
            pub fn device(&self) -> usize {
                match *self {}
            }
        }

        impl crate::step::direct::ClientMemory for IpcRegion {
            fn device_address(&self) -> Option<u64> {
                match *self {}
            }
            fn read(&self, _offset: u64, _out: &mut [u8]) -> Result<(), String> {
                match *self {}
            }
            fn write(&self, _offset: u64, _data: &[u8]) -> Result<(), String> {
                match *self {}
            }
            fn first_non_finite(
                &self,
                _offset: u64,
                _len: usize,
                _d: crate::dtype::Dtype,
            ) -> Result<Option<usize>, String> {
                match *self {}
            }
        }

        /// Never constructed without CUDA.
        pub enum Device {}

        impl Device {
            pub fn open(
                _seat: super::Seat,
                _spec: &MoeSpec,
                _weights: RankWeights,
            ) -> anyhow::Result<Self> {
                anyhow::bail!(WHY)
            }
            pub fn check_nodes(&self, _nodes: &[(String, Vec<usize>)]) -> Result<(), String> {
                match *self {}
            }
            pub fn buffer_bytes(&self) -> usize {
                match *self {}
            }
            pub fn expert_bytes(&self) -> usize {
                match *self {}
            }
            #[allow(clippy::too_many_arguments)]
            pub fn join(
                self,
                _nccl_id: &[u8],
                _ring: Arc<Ring>,
                _buckets: Vec<usize>,
                _graphs: bool,
                _step_timeout: Duration,
                _deadline: Instant,
                _abort: Arc<crate::lifecycle::Abort>,
            ) -> anyhow::Result<Box<dyn Backend + Send>> {
                match self {}
            }
        }
    }
}
