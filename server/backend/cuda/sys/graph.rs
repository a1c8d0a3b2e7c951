//! A captured step: a CUDA graph the rank launches on its stream.

use cudarc::driver::{CudaGraph, DriverError};

/// One captured step's graph.
pub struct Graph(CudaGraph);

// SAFETY: a graph exec may be launched from any thread with its context; the rank owns it and
// launches it through &self from its step thread, one launch at a time.
unsafe impl Send for Graph {}

impl Graph {
    pub fn new(g: CudaGraph) -> Self {
        Self(g)
    }

    /// Launches the graph on the stream it was captured on.
    pub fn launch(&self) -> Result<(), DriverError> {
        self.0.launch()
    }
}
