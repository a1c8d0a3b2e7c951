//! Implementations of the step phases.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

/// The GPU backend's setup, or, in a build without `--features cuda`, refusals that say so.
pub mod gpu {
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

        /// Never constructed without CUDA.
        pub enum Device {}

        impl Device {
            pub fn open(
                _ordinal: usize,
                _spec: &MoeSpec,
                _weights: RankWeights,
                _world: usize,
                _rank: usize,
                _max_home: usize,
                _ep: Option<crate::config::EpSettings>,
            ) -> anyhow::Result<Self> {
                anyhow::bail!(WHY)
            }
            pub fn buffer_bytes(&self) -> usize {
                match *self {}
            }
            pub fn join(
                self,
                _nccl_id: &[u8],
                _ring: Arc<Ring>,
                _buckets: Vec<usize>,
                _graphs: bool,
                _step_timeout: Duration,
                _deadline: Instant,
            ) -> anyhow::Result<Box<dyn Backend + Send>> {
                match self {}
            }
        }
    }
}
