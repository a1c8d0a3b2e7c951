//! Implementations of the step phases.

pub mod cpu;
