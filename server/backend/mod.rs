//! Implementations of the step phases.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
