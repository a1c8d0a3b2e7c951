// DeepGEMM's SM90 FP8 psum GEMM (sm90_fp8_gemm_1d2d, as kernels/hopper_fp8.cu instantiates it)
// on an EP4 rank's prefill shapes of deepseek-v3 (64 experts, gate/up 4096 x 7168 and down
// 7168 x 2048, 512 rows per expert, and the ragged counts of 4096 routed tokens), one instance per
// build: -DBN (N tile), -DST (stages), -DMC (TMA multicast 1 or 2, a cluster of MC CTAs),
// -DMCA (multicast on A, else on B), -DPF_SPEC (1: N and K compile-time constants, one instance
// per GEMM, as DeepGEMM's JIT builds them), -DPF_SWD (the D store's swizzle, 128 or 64 bytes: 64
// lets the N tile be 160), -DPF_GR (kNumGroups, the most experts a launch takes). With -DQUANT it
// times the step's quantization kernels (kernels/fp8.cu, or -DFP8_KERNELS=\"path\") on the same
// rows instead, over every row below the padded total and over the experts' rows alone (the psum
// layout's `Live`). Timing only (random codes).
#include "common.cuh"
#ifdef QUANT
#ifndef FP8_KERNELS  // another build's kernels/fp8.cu, to time against this one
#define FP8_KERNELS "../../kernels/fp8.cu"
#endif
#define EPSERVE_MAX_GROUPS 256  // build.rs passes HOPPER_GROUPS
#include FP8_KERNELS
#else
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>
using namespace deep_gemm;
using cute::UMMA::Major;
#endif
#ifndef PF_SPEC
#define PF_SPEC 0
#endif
#ifndef PF_SWD
#define PF_SWD 128
#endif
#ifndef PF_GR
#define PF_GR 256
#endif
const int L = 64, ROWS = 512, H = 7168, I = 2048, GROUPS = PF_GR, CTAS = 132;


int main() {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const size_t cap = (size_t)L * ROWS + L * 128;  // room for ragged blocks aligned to 128
  uint8_t *xq, *aq, *wgu, *wdn;
  float *xsf, *asf, *sgu, *sdn;
  __nv_bfloat16 *gu, *y, *xb;
  CK(cudaMalloc(&xq, cap * H));
  CK(cudaMalloc(&aq, cap * I));
  CK(cudaMalloc(&wgu, (size_t)L * 2 * I * H));
  CK(cudaMalloc(&wdn, (size_t)L * H * I));
  CK(cudaMalloc(&xsf, cap * (H / 128) * 4));
  CK(cudaMalloc(&asf, cap * (I / 128) * 4));
  CK(cudaMalloc(&sgu, (size_t)L * (2 * I / 128) * (H / 128) * 4));
  CK(cudaMalloc(&sdn, (size_t)L * (H / 128) * (I / 128) * 4));
  CK(cudaMalloc(&gu, cap * 2 * I * 2));
  CK(cudaMalloc(&y, cap * H * 2));
  xb = y;
  fill_bytes<<<1024, 256>>>(xq, cap * H);
  fill_bytes<<<1024, 256>>>(aq, cap * I);
  fill_bytes<<<1024, 256>>>(wgu, (size_t)L * 2 * I * H);
  fill_bytes<<<1024, 256>>>(wdn, (size_t)L * H * I);
  fill_f32<<<256, 256>>>(xsf, cap * (H / 128), 1e-2f);
  fill_f32<<<256, 256>>>(asf, cap * (I / 128), 1e-2f);
  fill_f32<<<256, 256>>>(sgu, (size_t)L * (2 * I / 128) * (H / 128), 1e-3f);
  fill_f32<<<256, 256>>>(sdn, (size_t)L * (H / 128) * (I / 128), 1e-3f);
  fill<<<1024, 256>>>(gu, cap * 2 * I, 1.f);
  fill<<<1024, 256>>>(y, cap * H, 1.f);
  CK(cudaDeviceSynchronize());
  int* ends;
  CK(cudaMalloc(&ends, GROUPS * 4));
  int* total;
  CK(cudaMalloc(&total, 4));
  for (bool ragged : {false, true}) {
    auto c = routed_counts(L, ROWS, ragged);
    std::vector<int> e(GROUPS, 0);
    int at = 0, mn = 1 << 30, mx = 0, tok = 0;
    for (int g = 0; g < L; g++) {
      e[g] = at + c[g];
      at = (e[g] + 127) / 128 * 128;
      mn = std::min(mn, c[g]), mx = std::max(mx, c[g]), tok += c[g];
    }
    for (int g = L; g < GROUPS; g++) e[g] = e[L - 1];
    const int rows = at;
    CK(cudaMemcpy(ends, e.data(), GROUPS * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(total, &rows, 4, cudaMemcpyHostToDevice));
    const double flop = 2.0 * tok * (2.0 * I * H + (double)H * I);
#ifdef QUANT
    // Every row below the padded total, then only the experts' rows (the psum layout's ends).
    const Live upto{total, nullptr, nullptr, 0, 128, 1}, psum{nullptr, ends, nullptr, L, 128, 1};
    for (const Live* l : {&upto, &psum}) {
      const double live_rows = l == &psum ? tok : rows;
      float tq = median_us([&] { fp8_quantize_rows<<<rows, 128, 0, st>>>(xb, *l, H, (int)cap, xq, xsf); }, 50, st);
      float ts = median_us([&] { fp8_swiglu_quantize<<<rows, 128, 0, st>>>(gu, *l, I, nullptr, (int)cap, aq, asf); }, 50, st);
      printf("%s counts %d..%d (%d rows, %d padded), %s: quantize rows %.1f us (%.2f TB/s), SwiGLU+quantize %.1f us (%.2f TB/s)\n",
             ragged ? "ragged" : "even", mn, mx, tok, rows, l == &psum ? "routed rows" : "padded rows", tq,
             live_rows * H * 3 / tq / 1e6, ts, live_rows * I * 5 / ts / 1e6);
    }
#else
    constexpr bool uniform = 128 % BN == 0;
    // N and K given at compile time (PF_SPEC) or at launch (0).
    auto inst = [](auto n, auto k) {
      return &sm90_fp8_gemm_1d2d_impl<Major::K, 0, PF_SPEC ? decltype(n)::value : 0, PF_SPEC ? decltype(k)::value : 0, GROUPS,
                                      128, BN, 128, 128, 128, PF_SWD, ST, 128, 256, MC, (bool)MCA, CTAS,
                                      GemmType::MGroupedContiguousWithPsumLayout, cutlass::bfloat16_t, 128>;
    };
    auto f_up = inst(std::integral_constant<uint32_t, 2 * I>{}, std::integral_constant<uint32_t, H>{});
    auto f_down = inst(std::integral_constant<uint32_t, H>{}, std::integral_constant<uint32_t, I>{});
    auto smem = [&](int k) {
      int d = (128 * BN * 2 + 1023) / 1024 * 1024, stage = (128 + BN) * 128, sfa = (128 * 4 + 127) / 128 * 128;
      int sfb = ((k / 128) * (uniform ? 1 : 2) * 4 + 7) / 8 * 8;
      return d + ST * (stage + sfa) + sfb + ST * 16;
    };
    CK(cudaFuncSetAttribute(f_up, cudaFuncAttributeMaxDynamicSharedMemorySize, smem(H)));
    CK(cudaFuncSetAttribute(f_down, cudaFuncAttributeMaxDynamicSharedMemorySize, smem(H)));
    auto launch = [&](auto f, int n, int k, uint8_t* a, float* sfa, uint8_t* b, float* sfb, __nv_bfloat16* d) {
      auto ma = map_rows(a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, rows, 128, 128, CU_TENSOR_MAP_SWIZZLE_128B);
      auto mb = map_rows(b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, (uint64_t)L * n, 128, BN, CU_TENSOR_MAP_SWIZZLE_128B);
      auto md = map_rows(d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, n, rows, PF_SWD / 2, 128,
                         PF_SWD == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B);
      auto ms = map_rows(sfa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, cap, k / 128, 128, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
      Clustered c(CTAS, 128 + 256, smem(k), st, MC);
      CK(cudaLaunchKernelEx(&c.cfg, f, sfb, ends, 0u, (uint32_t)n, (uint32_t)k, ma, mb, md, ms));
    };
    float t1 = median_us([&] { launch(f_up, 2 * I, H, xq, xsf, wgu, sgu, gu); }, 50, st);
    float t2 = median_us([&] { launch(f_down, H, I, aq, asf, wdn, sdn, y); }, 50, st);
    CK(cudaDeviceSynchronize());
    printf("BN %d ST %d MC %d%s SPEC %d SWD %d GR %d %s counts %d..%d (%d rows): gate/up %.1f us (%.0f TF/s) down %.1f us (%.0f TF/s) both %.1f us (%.0f TF/s)\n",
           BN, ST, MC, MC > 1 ? (MCA ? " on A" : " on B") : "", PF_SPEC, PF_SWD, PF_GR, ragged ? "ragged" : "even", mn, mx, tok, t1,
           2.0 * tok * 2 * I * H / t1 / 1e6, t2, 2.0 * tok * H * I / t2 / 1e6, t1 + t2, flop / (t1 + t2) / 1e6);
#endif
  }
  return 0;
}
