// FP8 activations for the experts' GEMMs (DeepSeek-V3's recipe, server/model/fp8.rs): each row
// quantized per 128 channels by kernels/fp8_rule.cuh. One block a row (so the rows past the
// live count cost one early exit each), one half-warp a 128-channel group, eight channels a
// lane, the group's amax by shuffles. Scales go out MN-major, as
// DeepGEMM's FP8 kernels read them: sf[g * ld + r], ld the rows rounded up to 4 (16 bytes); in
// the masked layout each expert's block on its own, sf[(e * G + g) * stride + j] for row
// r = e * stride + j of G groups. For NCCL EP's dispatch they go out token-major (a row's G
// together, as it forwards them), and fp8_scales_mn lays the landed ones out MN-major.
//
// Which rows are live (`Live`): with `counts` (the masked layout), r % stride < counts[r / stride];
// with `ends` (the psum layout), r < ends[e] for the expert e whose block holds r, each block
// starting at the end before it rounded up to `align`; else r < *n_rows. Other rows are left as
// they are: the GEMM's tiles may read them, and their outputs are never used. The psum layout's
// padding is a ninth of prefill-rank's rows and seven eighths of decode-rank's (decode-rank's FP8
// experts phase 994.6 -> 974.5 us on 1x H100, docs/benchmarks.md).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "fp8_rule.cuh"

using bf16 = __nv_bfloat16;
using fp8_rule::amax8;
using fp8_rule::group_scale;
using fp8_rule::load8;
using fp8_rule::store8;

// Passed by value; server/backend/cuda/fp8.rs's `LiveRows` mirrors it field for field.
struct Live {
  const int* n_rows;
  const int* ends;    // psum: `groups` ends, non-decreasing
  const int* counts;  // masked: one count per `stride` rows
  int groups, align, stride;
};

namespace {

constexpr int kGroup = 128;
constexpr int kWarps = 4;

// The expert holding r is the number of experts whose blocks end (rounded up to `align`) at or
// before r: one pass over the ends, a load a thread and a counting barrier, so a row pays one
// load's latency, as with `n_rows` (a binary search's chain of loads cost prefill-rank's SwiGLU
// more than its padding rows did). Every thread of the block must call it.
__device__ inline bool psum_live(int r, const Live& l) {
  __shared__ int ends[EPSERVE_MAX_GROUPS];  // build.rs's HOPPER_GROUPS, the GEMMs' bound
  int e = 0;
  for (int g0 = 0; g0 < l.groups; g0 += blockDim.x) {
    const int g = g0 + threadIdx.x;
    bool before = false;
    if (g < l.groups) {
      ends[g] = l.ends[g];
      before = (ends[g] + l.align - 1) / l.align * l.align <= r;
    }
    e += __syncthreads_count(before);
  }
  return e < l.groups && r < ends[e];
}

__device__ inline bool live(int r, const Live& l) {
  if (l.counts) return r % l.stride < l.counts[r / l.stride];
  if (l.ends) return psum_live(r, l);
  return !l.n_rows || r < *l.n_rows;
}

__device__ inline size_t scale_at(int r, int g, int G, const Live& l, int ld) {
  if (l.counts) return ((size_t)(r / l.stride) * G + g) * l.stride + r % l.stride;
  return (size_t)g * ld + r;
}

// The body of the row quantizers: scales MN-major (scale_at) or token-major.
template <bool kTokenMajor>
__device__ inline void quantize_row(const bf16* x, const Live& l, int K, int ld, uint8_t* q, float* sf) {
  const int r = blockIdx.x, G = K / kGroup, half = threadIdx.x / 16 % 2, lane = threadIdx.x % 16;
  if (!live(r, l)) return;
  for (int g0 = threadIdx.x / 32 * 2; g0 < G; g0 += 2 * kWarps) {
    const int g = g0 + half;
    const size_t at = (size_t)r * K + g * kGroup + lane * 8;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (g < G) load8(x + at, v);
    const float s = group_scale<16>(amax8(v));
    if (g >= G) continue;
    store8(q + at, v, s);
    if (lane == 0) sf[kTokenMajor ? (size_t)r * G + g : scale_at(r, g, G, l, ld)] = s;
  }
}

}  // namespace

extern "C" {

// q[r, :K] and sf of x[r, :K] (bf16) for every live row r < gridDim.x. A block's kWarps warps
// take the row's groups two at a time, one a half-warp, eight channels a lane (16-byte loads);
// both halves run every iteration, as the scale's shuffles take the whole warp.
__global__ void fp8_quantize_rows(const bf16* x, Live l, int K, int ld, uint8_t* q, float* sf) {
  quantize_row<false>(x, l, K, ld, q, sf);
}

// As fp8_quantize_rows, the scales token-major (sf[r * K / 128 + g]: a row's scales together,
// as NCCL EP forwards them beside its codes).
__global__ void fp8_quantize_tokens(const bf16* x, Live l, int K, uint8_t* q, float* sf) {
  quantize_row<true>(x, l, K, 0, q, sf);
}

// dst[(b * G + g) * ld + r] = src[(b * rows + r) * G + g] for blocks b < gridDim.z: token-major
// scales (NCCL EP's received ones) into the FP8 GEMM's MN-major layout (one block, ld the rows
// rounded up to 4: the psum layout; an expert's block each, ld = rows: the masked one). A 32 x 32
// tile a block of 32 x 8 threads, so both sides move whole lines.
__global__ void fp8_scales_mn(const float* src, int rows, int G, int ld, float* dst) {
  __shared__ float tile[32][33];
  const int b = blockIdx.z, r0 = blockIdx.x * 32, g0 = blockIdx.y * 32;
  const float* s = src + (size_t)b * rows * G;
  float* d = dst + (size_t)b * G * ld;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int r = r0 + i, g = g0 + threadIdx.x;
    if (r < rows && g < G) tile[i][threadIdx.x] = s[(size_t)r * G + g];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int g = g0 + i, r = r0 + threadIdx.x;
    if (r < rows && g < G) d[(size_t)g * ld + r] = tile[threadIdx.x][i];
  }
}

// act = silu(gate) * up (times w[r] where w is given) of gu[r] = [gate | up] (bf16, 2I wide),
// in f32, quantized into q[r, :I] and sf, for every live row r < gridDim.x; the groups as in
// fp8_quantize_rows. silu by the fast intrinsics (a few ulp on bf16 inputs): expf and IEEE
// division's instructions bounded the kernel (32768 x 2048 rows, 1x H100: 138 -> 118 us,
// scripts/probes/swiglu_fp8.cu); the quantization keeps fp8_rule's division, the rule exactly.
__global__ void fp8_swiglu_quantize(const bf16* gu, Live l, int I, const float* w, int ld, uint8_t* q,
                                    float* sf) {
  const int r = blockIdx.x, G = I / kGroup, half = threadIdx.x / 16 % 2, lane = threadIdx.x % 16;
  if (!live(r, l)) return;
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
    if (lane == 0) sf[scale_at(r, g, G, l, ld)] = s;
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
