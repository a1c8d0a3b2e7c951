// FP8 activations for the experts' GEMMs (DeepSeek-V3's recipe, server/model/fp8.rs): each row
// quantised per 128 channels by kernels/fp8_rule.cuh. One block a row (so the rows past the
// live count cost one early exit each), one half-warp a 128-channel group, eight channels a
// lane, the group's amax by shuffles. Scales go out MN-major, as
// DeepGEMM's FP8 kernels read them: sf[g * ld + r], ld the rows rounded up to 4 (16 bytes); in
// the masked layout each expert's block on its own, sf[(e * G + g) * stride + j] for row
// r = e * stride + j of G groups.
//
// Which rows are live: r < *n_rows (the contiguous layout's padded total), or, with `counts`,
// r % stride < counts[r / stride] (the masked layout). Other rows are left as they are: the
// GEMM's tiles may read them, and their outputs are never used.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "fp8_rule.cuh"

using bf16 = __nv_bfloat16;
using fp8_rule::amax8;
using fp8_rule::group_scale;
using fp8_rule::load8;
using fp8_rule::store8;

namespace {

constexpr int kGroup = 128;
constexpr int kWarps = 4;

__device__ inline bool live(int r, const int* n_rows, const int* counts, int stride) {
  if (counts) return r % stride < counts[r / stride];
  return !n_rows || r < *n_rows;
}

__device__ inline size_t scale_at(int r, int g, int G, const int* counts, int stride, int ld) {
  if (counts) return ((size_t)(r / stride) * G + g) * stride + r % stride;
  return (size_t)g * ld + r;
}

}  // namespace

extern "C" {

// q[r, :K] and sf of x[r, :K] (bf16) for every live row r < gridDim.x. A block's kWarps warps
// take the row's groups two at a time, one a half-warp, eight channels a lane (16-byte loads);
// both halves run every iteration, as the scale's shuffles take the whole warp.
__global__ void fp8_quantize_rows(const bf16* x, const int* n_rows, const int* counts, int stride, int K,
                                  int ld, uint8_t* q, float* sf) {
  const int r = blockIdx.x, G = K / kGroup, half = threadIdx.x / 16 % 2, lane = threadIdx.x % 16;
  if (!live(r, n_rows, counts, stride)) return;
  for (int g0 = threadIdx.x / 32 * 2; g0 < G; g0 += 2 * kWarps) {
    const int g = g0 + half;
    const size_t at = (size_t)r * K + g * kGroup + lane * 8;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (g < G) load8(x + at, v);
    const float s = group_scale<16>(amax8(v));
    if (g >= G) continue;
    store8(q + at, v, s);
    if (lane == 0) sf[scale_at(r, g, G, counts, stride, ld)] = s;
  }
}

// act = silu(gate) * up (times w[r] where w is given) of gu[r] = [gate | up] (bf16, 2I wide),
// in f32, quantised into q[r, :I] and sf, for every live row r < gridDim.x; the groups as in
// fp8_quantize_rows. silu by the fast intrinsics (a few ulp on bf16 inputs): expf and IEEE
// division's instructions bounded the kernel (32768 x 2048 rows, 1x H100: 138 -> 118 us,
// scripts/probes/swiglu_fp8.cu); the quantisation keeps fp8_rule's division, the rule exactly.
__global__ void fp8_swiglu_quantize(const bf16* gu, const int* n_rows, const int* counts, int stride, int I,
                                    const float* w, int ld, uint8_t* q, float* sf) {
  const int r = blockIdx.x, G = I / kGroup, half = threadIdx.x / 16 % 2, lane = threadIdx.x % 16;
  if (!live(r, n_rows, counts, stride)) return;
  const bf16* row = gu + (size_t)r * 2 * I;
  const float scale = w ? w[r] : 1.f;
  for (int g0 = threadIdx.x / 32 * 2; g0 < G; g0 += 2 * kWarps) {
    const int g = g0 + half, c = g * kGroup + lane * 8;
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, u[8];
    if (g < G) {
      load8(row + c, a);
      load8(row + I + c, u);
#pragma unroll
      for (int i = 0; i < 8; i++) a[i] = __fdividef(a[i], 1.f + __expf(-a[i])) * u[i] * scale;
    }
    const float s = group_scale<16>(amax8(a));
    if (g >= G) continue;
    store8(q + (size_t)r * I + c, a, s);
    if (lane == 0) sf[scale_at(r, g, G, counts, stride, ld)] = s;
  }
}

// Random E4M3 codes for benchmark weights (never 0x7F/0xFF, NaN): a hash of (index, seed).
__global__ void fp8_fill_random(uint8_t* q, unsigned long long n, unsigned long long seed) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    unsigned long long z = (i + seed * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
    z ^= z >> 31;
    uint8_t b = (uint8_t)(z >> 24);
    if ((b & 0x7F) == 0x7F) b ^= 1;
    q[i] = b;
  }
}

}  // extern "C"
