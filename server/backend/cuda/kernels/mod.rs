//! Every kernel module's kernels, each declared once: a table makes the field and loads the
//! function by the same name (`Kernels` for epserve.cu, `Fp8Kernels` for fp8.cu, `FiniteCheck`). Their launchers live by concern, as the kernels do:
//! `router` (routing.cuh's top-k), `layout` and `slots` (layout.cuh), `ffn` (ffn.cuh), `convert`
//! (convert.cuh).

pub mod convert;
pub mod decode_gemm;
pub mod ffn;
pub mod fp8;
pub mod hopper;
pub mod layout;
pub mod router;
pub mod slots;

use cudarc::driver::{CudaFunction, CudaModule, DriverError, LaunchConfig};

use crate::backend::cuda::Gpu;

macro_rules! kernel_table {
    ($(#[$doc:meta])* $table:ident { $($(#[$c:meta])* $name:ident),* $(,)? }) => {
        $(#[$doc])*
        pub struct $table {
            $($(#[$c])* pub(super) $name: CudaFunction,)*
        }

        impl $table {
            pub(super) fn load(module: &std::sync::Arc<CudaModule>) -> Result<Self, DriverError> {
                Ok(Self {
                    $($name: module.load_function(stringify!($name))?,)*
                })
            }
        }
    };
}

kernel_table! {
    /// epserve.cu's kernels, loaded once per context.
    Kernels {
    // routing.cuh (launched by `router`)
    bf16_pieces,
    topk_softmax,
    topk_softmax_regs,
    topk_sigmoid_group,
    topk_sigmoid_group_regs,
    count_experts,
    exclusive_scan,
    assign_positions,
    to_slots,
    renumber,
    // layout.cuh (`layout`; the slot exchange's by `slots`)
    gather_rows,
    combine,
    pack_slots,
    pack_slots_fp8,
    recv_map,
    scatter_by_map,
    scatter_fp8_by_map,
    gather_by_map,
    slot_index,
    ll_bounds,
    psum_ends,
    routed_ends,
    split_count,
    // ffn.cuh (`ffn`)
    build_tiles,
    grouped_gemm,
    grouped_gemm_wide,
    swiglu,
    swiglu_masked,
    swiglu_tiles,
    scale_rows,
    // convert.cuh (`convert`)
    f32_to_bf16,
    widen_rows,
    narrow_rows,
    widen_add,
    fill_uniform_bf16,
    fill_uniform_f32,
    }
}

kernel_table! {
    /// fp8.cu's kernels (launched by `fp8`): the activation quantizers, by fp8_rule.cuh's rule.
    Fp8Kernels {
        fp8_quantize_rows,
        fp8_quantize_tokens,
        fp8_scales_mn,
        fp8_swiglu_quantize,
        fp8_fill_random,
    }
}

kernel_table! {
    /// epserve.cu's check of a client's device rows (launched by `sys::ipc`, per device rather
    /// than per rank: a region may live on any GPU of the host).
    FiniteCheck {
        first_non_finite,
    }
}

impl Gpu {
    pub(super) fn cfg(grid: (u32, u32), block: u32, shared: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (grid.0.max(1), grid.1.max(1), 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
        }
    }

    /// A grid-stride launch over `elems` values: enough blocks to fill the GPU, no more.
    pub(super) fn rows_cfg(elems: usize) -> LaunchConfig {
        Self::cfg((elems.div_ceil(256).clamp(1, 132 * 16) as u32, 1), 256, 0)
    }
}
