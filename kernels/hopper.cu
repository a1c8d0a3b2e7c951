// DeepGEMM's SM90 bf16 m-grouped GEMM (TMA loads, WGMMA, warp-specialised persistent CTAs),
// compiled ahead of time from the pinned headers that scripts/cuda-toolchain.sh fetches. Every
// parameter is fixed here except the shapes, so one instance serves every model; the host builds
// the TMA descriptors once per persistent buffer (server/backend/cuda/hopper.rs).
//
// Both instances: A [rows, K] and B [groups * N, K] K-major bf16 (B is the experts' nn.Linear
// weights stacked), D [rows, N] bf16; 128-byte swizzles; 256 groups at most (unused groups are
// empty); 132 persistent CTAs (one per H100/H200 SM); no multicast.
//  - psum: expert e's rows are [align(ends[e - 1], 128), ends[e]) (the expert-major layout with
//    128-row-aligned blocks); 128 x 256 tiles, 2 math warpgroups, 3 stages (measured on one H200
//    beside 128 x 128 with 6 stages: 430 against 402 TFLOP/s at prefill, docs/benchmarks.md).
//  - masked: expert e's rows are [e * M, e * M + counts[e]) (NCCL EP's low-latency layout);
//    64 x 128 tiles, 1 math warpgroup, 8 stages (weight streaming at small M).
// hopper.rs names each instance by its mangled symbol; build.rs checks that both exist.
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>

using namespace deep_gemm;
using cute::UMMA::Major;

[[maybe_unused]] static void instantiate() {
  (void)&sm90_bf16_gemm_impl<Major::K, Major::K, 0, 0, 0, 256, 128, 256, 64, 128, 128, 128, 3, 128, 256, 1, false,
                             132, GemmType::MGroupedContiguousWithPsumLayout, false, cutlass::bfloat16_t>;
  (void)&sm90_bf16_gemm_impl<Major::K, Major::K, 0, 0, 0, 256, 64, 128, 64, 128, 128, 128, 8, 128, 128, 1, false,
                             132, GemmType::MGroupedMasked, false, cutlass::bfloat16_t>;
}
