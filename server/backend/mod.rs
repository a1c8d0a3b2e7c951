//! Implementations of the step phases.

pub mod bench;
pub mod bringup;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod ep_settings;
pub mod gpu;

pub use device::{check_gpu_limits, GPU_MAX_GROUPS, GPU_MAX_TOP_K};
