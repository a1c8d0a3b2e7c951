// FP8 activations for the experts' GEMMs (DeepSeek-V3's recipe, server/model/fp8.rs): each row
// quantised per 128 channels, s = amax / 448 (0 where that is not a normal float, the group's
// values then 0), q = e4m3(x / s) rounded to nearest even and saturated. One warp per (row,
// group; a block's warps take its row's groups in turn, so the grid is one block a row and the
// rows past the live count cost one early exit each): four channels a lane, the group's amax by
// shuffles. Scales go out MN-major, as
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

using bf16 = __nv_bfloat16;

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

__device__ inline float group_scale(float amax) {
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = __fdiv_rn(amax, 448.f);
  return (s >= 1.17549435e-38f && s <= 3.40282347e38f) ? s : 0.f;
}

// Four values of one lane quantised with the group's scale, packed little-endian.
__device__ inline uint32_t pack4(const float v[4], float s) {
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float y = s == 0.f ? 0.f : __fdiv_rn(v[i], s);
    const uint32_t c = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
    out |= c << (8 * i);
  }
  return out;
}

__device__ inline void load4(const bf16* p, float v[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  v[0] = __low2float(a);
  v[1] = __high2float(a);
  v[2] = __low2float(b);
  v[3] = __high2float(b);
}

}  // namespace

extern "C" {

// q[r, :K] and sf of x[r, :K] (bf16) for every live row r < gridDim.x; kWarps a block.
__global__ void fp8_quantize_rows(const bf16* x, const int* n_rows, const int* counts, int stride, int K,
                                  int ld, uint8_t* q, float* sf) {
  const int r = blockIdx.x, lane = threadIdx.x % 32;
  if (!live(r, n_rows, counts, stride)) return;
  for (int g = threadIdx.x / 32; g * kGroup < K; g += kWarps) {
    const size_t at = (size_t)r * K + g * kGroup + lane * 4;
    float v[4];
    load4(x + at, v);
    const float s = group_scale(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
    *reinterpret_cast<uint32_t*>(q + at) = pack4(v, s);
    if (lane == 0) sf[scale_at(r, g, K / kGroup, counts, stride, ld)] = s;
  }
}

// act = silu(gate) * up (times w[r] where w is given) of gu[r] = [gate | up] (bf16, 2I wide),
// in f32, quantised into q[r, :I] and sf, for every live row r < gridDim.x.
__global__ void fp8_swiglu_quantize(const bf16* gu, const int* n_rows, const int* counts, int stride, int I,
                                    const float* w, int ld, uint8_t* q, float* sf) {
  const int r = blockIdx.x, lane = threadIdx.x % 32;
  if (!live(r, n_rows, counts, stride)) return;
  const bf16* row = gu + (size_t)r * 2 * I;
  const float scale = w ? w[r] : 1.f;
  for (int g = threadIdx.x / 32; g * kGroup < I; g += kWarps) {
    const int c = g * kGroup + lane * 4;
    float a[4], u[4];
    load4(row + c, a);
    load4(row + I + c, u);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      a[i] = a[i] / (1.f + expf(-a[i])) * u[i] * scale;
      amax = fmaxf(amax, fabsf(a[i]));
    }
    const float s = group_scale(amax);
    *reinterpret_cast<uint32_t*>(q + (size_t)r * I + c) = pack4(a, s);
    if (lane == 0) sf[scale_at(r, g, I / kGroup, counts, stride, ld)] = s;
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
