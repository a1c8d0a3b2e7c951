//! A captured step: a CUDA graph the rank launches on its stream.

use cudarc::driver::sys::{self, CUevent_record_flags};
use cudarc::driver::{CudaEvent, CudaGraph, CudaStream, DriverError};

/// One captured step's graph, and the events it records between its phases (after gating,
/// prepare, dispatch and the experts), where it has phases (not a step split in two).
pub struct Graph(CudaGraph, Option<[CudaEvent; 4]>);

// SAFETY: a graph exec may be launched from any thread with its context; the rank owns it and
// launches it through &self from its step thread, one launch at a time.
unsafe impl Send for Graph {}

impl Graph {
    pub fn new(g: CudaGraph, marks: Option<[CudaEvent; 4]>) -> Self {
        Self(g, marks)
    }

    /// The events its last replay recorded between its phases.
    pub fn marks(&self) -> Option<&[CudaEvent; 4]> {
        self.1.as_ref()
    }

    /// Launches the graph on the stream it was captured on.
    pub fn launch(&self) -> Result<(), DriverError> {
        self.0.launch()
    }
}

/// Records `event` on `stream` as a node of the graph the stream is capturing, so that each
/// replay records it (a plain record during capture only orders the captured work).
pub fn mark_in_capture(event: &CudaEvent, stream: &CudaStream) -> Result<(), DriverError> {
    // SAFETY: both handles are live (borrowed) and of the context the capture bound to this
    // thread; outside a capture the driver refuses the flag with an error.
    unsafe {
        sys::cuEventRecordWithFlags(
            event.cu_event(),
            stream.cu_stream(),
            CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
        )
    }
    .result()
}

/// How many nodes of each kind `g` holds (top level, then inside child graphs), by the driver's
/// name for the kind: what a replay asks of the host (a host node waits for a driver thread).
pub fn node_kinds(g: &CudaGraph) -> Result<std::collections::BTreeMap<String, usize>, DriverError> {
    let mut out = std::collections::BTreeMap::new();
    count_nodes(g.cu_graph(), &mut out)?;
    Ok(out)
}

fn count_nodes(
    g: sys::CUgraph,
    out: &mut std::collections::BTreeMap<String, usize>,
) -> Result<(), DriverError> {
    let mut n = 0usize;
    // SAFETY: `g` is a live graph (borrowed from its owner); a null array asks for the count.
    unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) }.result()?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` has room for the `n` nodes the driver reports.
    unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) }.result()?;
    for &node in &nodes[..n] {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to the live graph `g`; `kind` is a valid out-pointer.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }.result()?;
        if kind == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_GRAPH {
            let mut child: sys::CUgraph = std::ptr::null_mut();
            // SAFETY: `node` is a child-graph node of `g`; the child stays owned by it.
            unsafe { sys::cuGraphChildGraphNodeGetGraph(node, &mut child) }.result()?;
            count_nodes(child, out)?;
        }
        let name = format!("{kind:?}");
        let name = name
            .trim_start_matches("CU_GRAPH_NODE_TYPE_")
            .to_lowercase();
        *out.entry(name).or_default() += 1;
    }
    Ok(())
}
