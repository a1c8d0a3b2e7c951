//! The `nccl-ep` exchange: NVIDIA NCCL EP with the expert-major layout, in high-throughput (HT)
//! or low-latency (LL) mode per bucket, each mode with its own group and handle made before any
//! capture. Prepare is `ncclEpUpdateHandle` (HT writes each local expert's padded offset straight
//! into the grouped GEMM's offsets), dispatch lands the received rows where the GEMM reads them
//! (HT: packed, padded to the GEMM tile; LL: `[local expert][world x tokens]` with a count per
//! expert), and combine takes the expert outputs back home (HT: weighted by us first; LL: the
//! library weighs them). With zero-copy on, HT's expert rows are `ncclMemAlloc` memory registered
//! once as a symmetric window, and the library moves rows straight into and out of it (NCCL EP
//! 0.2 has no zero-copy for LL's expert-major layout: LL always stages). With FP8 experts the
//! rows move as FP8 (`StepShape::fp8_dispatch`): quantized at home, their codes and scales
//! forwarded as they are (QUANT_FWD), landing in plain memory beside the window, which then
//! takes only the experts' outputs for combine.
//!
//! `sys::nccl_ep` wraps the library (RAII groups and handles, checked tensor descriptions; every
//! raw call of the exchange), `exchange` is the `Exchange` over it.

mod exchange;

pub use exchange::{EpExchange, EpPath, Footprint, RowBuffer};

use std::sync::{Arc, OnceLock};

use cudarc::driver::result;
use nccl_sys::ep::NcclEp;

use crate::backend::cuda::shape::StepShape;
use crate::backend::cuda::sys::device::compute_major;

/// NCCL EP needs the device API of NCCL 2.30.4 or newer.
pub const MIN_NCCL: i32 = 23004;
/// NCCL EP runs at most 8 ranks per node (one NVLink domain); groups here are one node (see
/// `placement`), so this bounds the world before the roster is known.
pub const MAX_WORLD: usize = 8;

/// The library, loaded once for the process (see `sys::nccl::loaded` for why never unloaded).
pub fn library() -> Result<Arc<NcclEp>, String> {
    static EP: OnceLock<Result<Arc<NcclEp>, String>> = OnceLock::new();
    EP.get_or_init(|| NcclEp::load().map(Arc::new).map_err(|e| e.to_string()))
        .clone()
}

fn nvcc() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        dirs.push(std::path::Path::new(&h).join("bin"));
    }
    dirs.push("/usr/local/cuda/bin".into());
    dirs.into_iter()
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}

/// Whether `nccl-ep` can run here, and if not the first reason, in one line each. Checked before
/// anything is created.
pub fn gates(nccl_version: i32, world: usize) -> Result<String, String> {
    result::init().map_err(|e| format!("CUDA: {e}"))?;
    let major = compute_major(0).map_err(|e| format!("CUDA device 0: {e}"))?;
    if major < 9 {
        return Err(format!(
            "NCCL EP needs SM 90 or newer; this GPU is SM {major}x"
        ));
    }
    if nccl_version < MIN_NCCL {
        return Err(format!(
            "NCCL EP needs NCCL >= 2.30.4; loaded NCCL is {}",
            nccl_sys::version_string(nccl_version)
        ));
    }
    let ep = library().map_err(|e| format!("libnccl_ep: {e}"))?;
    let Some(nvcc) = nvcc() else {
        return Err(
            "NCCL EP compiles its kernels at run time and no nvcc was found (PATH, CUDA_HOME, /usr/local/cuda)"
                .into(),
        );
    };
    if world > MAX_WORLD {
        return Err(format!(
            "NCCL EP runs at most {MAX_WORLD} ranks per node and this service runs it on one node; the group has {world}"
        ));
    }
    Ok(format!(
        "NCCL EP {} from {}, SM {major}x, nvcc {}",
        nccl_sys::version_string(ep.version),
        ep.path.display(),
        nvcc.display()
    ))
}

/// Whether NCCL EP can carry a group placed on these nodes (each node id with its ranks), once
/// the rendezvous has told every rank. Between nodes NCCL EP 0.2 moves rows through NCCL's
/// GPU-initiated networking (GIN: GDAKI or a proxy, on RDMA NICs with GPUDirect), and within a
/// node through NVLink for at most 8 ranks. No machine here has GIN, so no test has run a group
/// of nodes on NCCL EP: it is refused, with `nccl` (NCCL's own network transports) as the way.
pub fn placement(nodes: &[(String, Vec<usize>)]) -> Result<(), String> {
    if let Some((node, ranks)) = nodes.iter().find(|(_, r)| r.len() > MAX_WORLD) {
        return Err(format!(
            "NCCL EP runs at most {MAX_WORLD} ranks per node; node {node} has {}",
            ranks.len()
        ));
    }
    if nodes.len() > 1 {
        let names: Vec<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
        return Err(format!(
            "the group spans {} nodes ({}); NCCL EP between nodes needs NCCL's GPU-initiated networking (GIN over RDMA NICs), which is not verified here: run --backend nccl, whose exchange crosses nodes on NCCL's network transports",
            nodes.len(),
            names.join(", ")
        ));
    }
    Ok(())
}

/// Experts a rank as NCCL EP numbers them on one path: the rank's slots, or for the
/// high-throughput kernels the next power of two (NCCL EP 0.2 asserts one in
/// `launch_build_em_tables` and aborts the process otherwise). The slots past ours are never
/// routed to (the slot table holds only ours), so they receive no rows, take no padding and
/// add no GEMM work: 2 redundant experts on DeepSeek-V3 at EP2 (129 slots a rank) run HT as 256.
pub fn ep_local(slots: usize, low_latency: bool) -> usize {
    match low_latency {
        true => slots,
        false => slots.next_power_of_two(),
    }
}

/// The shape problems NCCL EP would reject, found first with a clear reason.
pub fn validate(s: &StepShape, align: usize) -> Result<(), String> {
    let mut bad = Vec::new();
    if s.experts % s.world != 0 {
        bad.push(format!("{} experts over {} ranks", s.experts, s.world));
    }
    if s.top_k > s.experts {
        bad.push(format!("top-k {} > {} experts", s.top_k, s.experts));
    }
    if s.max_home == 0 {
        bad.push("max dispatch tokens per rank is 0".into());
    }
    if (s.hidden * 2) % 16 != 0 {
        bad.push(format!(
            "token row of {} bytes is not a multiple of 16",
            s.hidden * 2
        ));
    }
    if !align.is_power_of_two() {
        bad.push(format!("alignment {align} is not a power of two"));
    }
    if s.ht_capacity(align) < s.max_home {
        bad.push("receive capacity below dispatch capacity".into());
    }
    if s.ll_rows(s.max_home) > i32::MAX as usize {
        bad.push("low-latency receive rows exceed 2^31".into());
    }
    match bad.is_empty() {
        true => Ok(()),
        false => Err(format!("NCCL EP group config: {}", bad.join("; "))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(world: usize, experts: usize, top_k: usize, hidden: usize) -> StepShape {
        StepShape {
            world,
            rank: 0,
            experts,
            model_experts: experts,
            top_k,
            hidden,
            inter: 64,
            shared_inter: 0,
            max_home: 64,
            ep: None,
            expert_dtype: crate::model::ExpertDtype::Bf16,
            overlap: 0,
            split: usize::MAX,
        }
    }

    #[test]
    fn receive_capacity_covers_duplication_and_padding() {
        // 4 ranks x 64 tokens x min(8, 32) local copies, plus 32 experts x 63 padding rows.
        assert_eq!(shape(4, 128, 8, 2048).ht_capacity(64), 2048 + 32 * 63);
        // Few local experts: a token reaches at most 2 of them.
        assert_eq!(shape(8, 16, 4, 64).ht_capacity(1), 8 * 64 * 2);
    }

    #[test]
    fn config_problems_are_named_before_the_library_sees_them() {
        assert!(validate(&shape(4, 128, 8, 2048), 64).is_ok());
        let e = validate(&shape(3, 128, 8, 2048), 64).unwrap_err();
        assert!(e.contains("128 experts over 3 ranks"), "{e}");
        let e = validate(&shape(4, 128, 8, 2048), 48).unwrap_err();
        assert!(e.contains("alignment 48 is not a power of two"), "{e}");
        let e = validate(&shape(4, 128, 8, 2044), 64).unwrap_err();
        assert!(e.contains("4088 bytes is not a multiple of 16"), "{e}");
    }

    fn nodes(sizes: &[usize]) -> Vec<(String, Vec<usize>)> {
        let mut next = 0;
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let ranks = (next..next + n).collect();
                next += n;
                (format!("n{i}"), ranks)
            })
            .collect()
    }

    /// One node of up to 8 ranks runs; more per node, or a second node, is refused by name.
    #[test]
    fn nccl_ep_runs_one_node_of_at_most_eight() {
        assert_eq!(placement(&nodes(&[8])), Ok(()));
        let nine = placement(&nodes(&[9])).unwrap_err();
        assert!(nine.contains("node n0 has 9"), "{nine}");
        let two = placement(&nodes(&[4, 4])).unwrap_err();
        assert!(
            two.contains("2 nodes (n0, n1)") && two.contains("--backend nccl"),
            "{two}"
        );
    }
}
