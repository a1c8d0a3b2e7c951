// DeepGEMM's SM90 FP8 m-grouped GEMM with 1x128 activation scales and 128x128 weight scales
// (`sm90_fp8_gemm_1d2d`), compiled ahead of time from the pinned headers as kernels/hopper.cu is.
// Every parameter is fixed here; the shapes too where a tile names them (N and K; 0: given at
// launch); the host builds the TMA descriptors (server/backend/cuda/fp8.rs).
//
// Each instance: A [rows, K] and B [groups * N, K] K-major E4M3, D [rows, N] bf16; SFA f32
// [K / 128][rows rounded up to 4] (MN-major; masked: [groups * K / 128][stride]); SFB f32
// [groups][N / 128][K / 128] (K-major, a checkpoint's `weight_scale_inv` as shipped); 128-deep
// K stages; 128-byte swizzles; `groups` groups at most; `ctas` persistent
// CTAs; TMA multicast of the weight tile (B) over a cluster of `multicast` CTAs, each pair of a
// group's row tiles sharing it (only for N of an even count of column tiles: hopper.rs's
// `Tile::takes`). Which layouts, tiles, stages and clusters: build.rs's HOPPER_FP8_TILES.
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>

using namespace deep_gemm;
using cute::UMMA::Major;

#define EPSERVE_FP8_INSTANCE(type, block_m, block_n, stages, math_threads, multicast, groups, n, k, ctas)    \
  (void)&sm90_fp8_gemm_1d2d_impl<Major::K, 0, n, k, groups, block_m, block_n, 128, 128, 128, 128, stages, \
                                 128, math_threads, multicast, false, ctas,                   \
                                 static_cast<GemmType>(type), cutlass::bfloat16_t, 128>;

[[maybe_unused]] static void instantiate() {
// One EPSERVE_FP8_INSTANCE per tile.
#include "hopper_fp8_instances.inc"
}
