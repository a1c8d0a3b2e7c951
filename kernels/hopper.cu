// DeepGEMM's SM90 bf16 m-grouped GEMM (TMA loads, WGMMA, warp-specialised persistent CTAs),
// compiled ahead of time from the pinned headers that scripts/cuda-toolchain.sh fetches. Every
// parameter is fixed here except the shapes, so one instance serves every model; the host builds
// the TMA descriptors (server/backend/cuda/kernels/hopper.rs).
//
// Each instance: A [rows, K] and B [groups * N, K] K-major bf16 (B is the experts' nn.Linear
// weights stacked), D [rows, N] bf16; 64-deep K stages; 128-byte swizzles; `groups` groups at
// most (unused groups are empty); `ctas` persistent CTAs; no multicast. Which layouts,
// tiles and stages: build.rs's HOPPER_TILES, one line each in hopper_instances.inc.
//  - psum: expert e's rows are [align(ends[e - 1], BLOCK_M), ends[e]) (the expert-major layout
//    with aligned blocks), 2 math warpgroups;
//  - masked: expert e's rows are [e * M, e * M + counts[e]) (NCCL EP's low-latency layout),
//    1 math warpgroup (weight streaming at small M).
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>

using namespace deep_gemm;
using cute::UMMA::Major;

#define EPSERVE_INSTANCE(type, block_m, block_n, stages, math_threads, multicast, groups, n, k, ctas)        \
  (void)&sm90_bf16_gemm_impl<Major::K, Major::K, 0, n, k, groups, block_m, block_n, 64, 128, 128, 128,  \
                             stages, 128, math_threads, multicast, false, ctas,                \
                             static_cast<GemmType>(type), false, cutlass::bfloat16_t>;

[[maybe_unused]] static void instantiate() {
// One EPSERVE_INSTANCE per tile.
#include "hopper_instances.inc"
}
