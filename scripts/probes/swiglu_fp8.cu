// kernels/fp8.cu's fp8_swiglu_quantize in variants, on prefill-rank's rows (32768 x 2048): silu
// by expf and IEEE division (base) or by __expf and __fdividef (-DFAST_SILU); the quantization
// by __fdiv_rn (fp8_rule) or by a correctly rounded reciprocal and one Markstein step (-DRCP,
// checked against __fdiv_rn on 2^32 random pairs) or a plain reciprocal (-DRCP_INEXACT, the
// ceiling only). Times each, and writes its codes and scales (argv[1]) for a byte comparison.
#include "common.cuh"
#include <cuda_fp8.h>
#include <stdint.h>
#include "../../kernels/fp8_rule.cuh"
using bf16 = __nv_bfloat16;
using namespace fp8_rule;
constexpr int kGroup = 128, kWarps = 4;

// v / s from r = RN(1 / s) and one Markstein step: not always RN(v / s) (the check counts).
__device__ inline float div_by(float v, float s, float r) {
  const float q = v * r;
  const float e = fmaf(-s, q, v);
  return fmaf(e, r, q);
}
__device__ inline float refined_rcp(float s) { return __frcp_rn(s); }
__device__ inline uint32_t pack4r(const float v[4], float s, float r, bool fast) {
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
#if defined(RCP_INEXACT)
    const float y = s == 0.f ? 0.f : v[i] * r;
#else
    const float y = s == 0.f ? 0.f : (fast ? div_by(v[i], s, r) : __fdiv_rn(v[i], s));
#endif
    const uint32_t c = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
    out |= c << (8 * i);
  }
  return out;
}

__global__ void swiglu(const bf16* gu, const int* n_rows, int I, const float* w, int ld, uint8_t* q, float* sf) {
  const int r = blockIdx.x, G = I / kGroup, half = threadIdx.x / 16 % 2, lane = threadIdx.x % 16;
  if (r >= *n_rows) return;
  const bf16* row = gu + (size_t)r * 2 * I;
  const float scale = w ? w[r] : 1.f;
  for (int g0 = threadIdx.x / 32 * 2; g0 < G; g0 += 2 * kWarps) {
    const int g = g0 + half, c = g * kGroup + lane * 8;
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, u[8];
    if (g < G) {
      load8(row + c, a);
      load8(row + I + c, u);
#pragma unroll
      for (int i = 0; i < 8; i++) {
#ifdef FAST_SILU
        a[i] = __fdividef(a[i], 1.f + __expf(-a[i])) * u[i] * scale;
#else
        a[i] = a[i] / (1.f + expf(-a[i])) * u[i] * scale;
#endif
      }
    }
    const float s = group_scale<16>(amax8(a));
    if (g >= G) continue;
#if defined(RCP) || defined(RCP_INEXACT)
    const bool fast = s >= 0x1p-90f && s <= 0x1p120f;
    const float rc = fast ? refined_rcp(s) : 0.f;
    *reinterpret_cast<uint2*>(q + (size_t)r * I + c) = make_uint2(pack4r(a, s, rc, fast), pack4r(a + 4, s, rc, fast));
#else
    store8(q + (size_t)r * I + c, a, s);
#endif
    if (lane == 0) sf[(size_t)g * ld + r] = s;
  }
}

// Mismatches of div_by against __fdiv_rn over n random (v, s) pairs, |v| <= 448 s.
__global__ void check_div(unsigned long long n, unsigned long long* bad, unsigned seed) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    unsigned long long z = (i + 1) * 0x9E3779B97F4A7C15ull + seed;
    z ^= z >> 31; z *= 0xBF58476D1CE4E5B9ull; z ^= z >> 29;
    // s: any normal float in [2^-90, 2^120]; v: s * 448 * u, u in (-1, 1) with a random exponent.
    const int se = (int)((z >> 8) % 210) - 90;
    const float s = ldexpf(1.f + (float)((z >> 20) & 0x7FFFFF) / 8388608.f, se) ;
    if (!(s >= 0x1p-90f && s <= 0x1p120f)) continue;
    const int ue = -(int)((z >> 44) % 24);
    const float u = ldexpf(1.f + (float)((z >> 3) & 0x7FFFF) / 524288.f, ue) * 0.5f * ((z >> 63) ? -1.f : 1.f);
    const float v = fminf(u * 448.f * s, 448.f * s);
    const float a = __fdiv_rn(v, s), b = div_by(v, s, refined_rcp(s));
    if (__float_as_uint(a) != __float_as_uint(b)) atomicAdd(bad, 1ull);
  }
}

int main(int argc, char** argv) {
  const int I = 2048, ROWS = 32768, cap = ROWS;
  bf16* gu; uint8_t* q; float *sf, *w; int* n;
  CK(cudaMalloc(&gu, (size_t)cap * 2 * I * 2));
  CK(cudaMalloc(&q, (size_t)cap * I));
  CK(cudaMalloc(&sf, (size_t)cap * (I / 128) * 4));
  CK(cudaMalloc(&w, cap * 4));
  CK(cudaMalloc(&n, 4));
  fill<<<1024, 256>>>(gu, (size_t)cap * 2 * I, 3.f, 11);
  std::vector<float> hw(cap, 0.37f);
  CK(cudaMemcpy(w, hw.data(), cap * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(n, &ROWS, 4, cudaMemcpyHostToDevice));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  float t = median_us([&] { swiglu<<<cap, 128, 0, st>>>(gu, n, I, w, cap, q, sf); }, 100, st, 5);
  CK(cudaDeviceSynchronize());
  printf("%s: SwiGLU+quantize %d rows x %d: %.1f us (%.2f TB/s)\n", argv[0], ROWS, I, t, ROWS * (double)I * 5 / t / 1e6);
  std::vector<uint8_t> hq((size_t)cap * I); std::vector<float> hs((size_t)cap * (I / 128));
  CK(cudaMemcpy(hq.data(), q, hq.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hs.data(), sf, hs.size() * 4, cudaMemcpyDeviceToHost));
  if (argc > 1) {
    FILE* f = fopen(argv[1], "wb");
    fwrite(hq.data(), 1, hq.size(), f); fwrite(hs.data(), 4, hs.size(), f); fclose(f);
  }
#ifdef RCP
  unsigned long long* bad; CK(cudaMalloc(&bad, 8)); CK(cudaMemset(bad, 0, 8));
  const unsigned long long pairs = 1ull << 32;
  check_div<<<132 * 16, 256>>>(pairs, bad, 99);
  unsigned long long hb; CK(cudaMemcpy(&hb, bad, 8, cudaMemcpyDeviceToHost));
  printf("div_by against __fdiv_rn: %llu of %llu random pairs differ\n", hb, pairs);
#endif
  return 0;
}
