// prefill-rank's FP8 gate/up step two ways, on the same rows (64 experts of deepseek-v3, 512
// rows each and the ragged counts of 4096 tokens routed top-8): DeepGEMM's psum GEMM (the
// fixed-shape instance the service runs: N tile 192, 4 stages, multicast 2 on B, 64 groups) into
// bf16 gate/up rows, then kernels/fp8.cu's SwiGLU quantization; against swiglu_gemm_fp8.cuh,
// SwiGLU and its quantization in the GEMM's epilogue (its two mainloops, and one without silu).
// Prints each one's median of 50 (us) and how the outputs differ on the experts' rows: codes
// equal, and the largest difference of dequantized values over their group's amax (the unfused
// path rounds gate/up to bf16 first, so a code may move by one step). First it checks the
// epilogue's quantization by multiplication against fp8_rule's division on 2^32 random pairs.
//   device tool: bash scripts/probes/run.sh swiglu_gemm_fp8 (with DeepGEMM's headers, as run.sh says)
#include "common.cuh"
#include <cuda_fp8.h>
#include <cmath>
#define EPSERVE_MAX_GROUPS 256  // build.rs passes HOPPER_GROUPS
#include "../../kernels/fp8.cu"
#include "swiglu_gemm_fp8.cuh"
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>
using namespace deep_gemm;
using cute::UMMA::Major;

const int L = 64, ROWS = 512, H = 7168, I = 2048, GROUPS = 64, CTAS = 132, BN = 192, ST = 4;

__global__ void fill_bytes(uint8_t* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned long long z = 0x9E3779B97F4A7C15ull * (i + 1 + ((unsigned long long)seed << 40));
    z ^= z >> 31;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 29;
    p[i] = (uint8_t)(z >> 40) & 0xB7;  // finite codes of moderate size
  }
}
__global__ void fill_f32(float* p, size_t n, float lo, float hi, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned long long z = 0x9E3779B97F4A7C15ull * (i + 1 + ((unsigned long long)seed << 40));
    z ^= z >> 29;
    z *= 0xBF58476D1CE4E5B9ull;
    p[i] = lo + (hi - lo) * (float)(z >> 40) / 16777216.f;
  }
}

template <uint32_t K, uint32_t G, bool kQuantize, bool kRegA>
__global__ void __launch_bounds__(fp8_swiglu_gemm::kThreads, 1)
    fused(fp8_swiglu_gemm::Args args, const __grid_constant__ CUtensorMap a, const __grid_constant__ CUtensorMap b,
          const __grid_constant__ CUtensorMap sfa, const __grid_constant__ CUtensorMap out) {
  fp8_swiglu_gemm::run<K, G, CTAS, kQuantize, kRegA>(args, a, b, sfa, out);
}

// The epilogue's code() against fp8_rule's division (pack4) on `n` random pairs: a scale s of any
// normal exponent, x = s * 448 * u for u in [-1, 1] (as a group's values are), and x at E4M3 ties.
__global__ void check_code(unsigned long long n, unsigned long long* mismatches) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    unsigned long long z = 0x9E3779B97F4A7C15ull * (i + 1);
    z ^= z >> 31;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 29;
    const uint32_t lo = (uint32_t)z, hi = (uint32_t)(z >> 32);
    const float s = __uint_as_float(((1u + lo % 245u) << 23) | (hi & 0x7FFFFFu));  // 448 s stays finite
    float x = s * 448.f * ((float)(hi >> 8) / 8388608.f - 1.f);
    if (i % 4 == 0) {  // a tie of the E4M3 grid (four significant bits) times s, give or take an ulp
      const float t = __uint_as_float((((lo >> 8) % 15u + 118u) << 23) | (((lo >> 4) & 7u) << 20) | 0x80000u);
      x = __uint_as_float(__float_as_uint(t * s) + (int)(lo & 3u) - 1);
    }
    const float v[4] = {x, 0.f, 0.f, 0.f};
    if ((fp8_rule::pack4(v, s) & 0xFFu) != fp8_swiglu_gemm::code(x, s, __frcp_rn(s))) atomicAdd(mismatches, 1ull);
  }
}

float decode(uint8_t c) {
  __nv_fp8_e4m3 v;
  v.__x = c;
  return (float)v;
}

void launch_cluster(const void* f, int smem, cudaStream_t st, void** params) {
  Clustered c(CTAS, 384, smem, st, 2);
  CK(cudaLaunchKernelExC(&c.cfg, f, params));
}

int main() {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const size_t cap = (size_t)L * ROWS + L * 128;
  const int ld = (int)((cap + 3) / 4 * 4);
  uint8_t *xq, *aq, *aq2, *wgu;
  float *xsf, *asf, *asf2, *sgu;
  __nv_bfloat16* gu;
  CK(cudaMalloc(&xq, cap * H));
  CK(cudaMalloc(&aq, cap * I));
  CK(cudaMalloc(&aq2, cap * I));
  CK(cudaMalloc(&wgu, (size_t)L * 2 * I * H));
  CK(cudaMalloc(&xsf, (size_t)ld * (H / 128) * 4));
  CK(cudaMalloc(&asf, (size_t)ld * (I / 128) * 4));
  CK(cudaMalloc(&asf2, (size_t)ld * (I / 128) * 4));
  CK(cudaMalloc(&sgu, (size_t)L * (2 * I / 128) * (H / 128) * 4));
  CK(cudaMalloc(&gu, cap * 2 * I * 2));
  fill_bytes<<<1024, 256>>>(xq, cap * H, 1);
  fill_bytes<<<1024, 256>>>(wgu, (size_t)L * 2 * I * H, 2);
  fill_f32<<<256, 256>>>(xsf, (size_t)ld * (H / 128), 0.5e-2f, 2e-2f, 3);
  fill_f32<<<256, 256>>>(sgu, (size_t)L * (2 * I / 128) * (H / 128), 0.5e-3f, 2e-3f, 4);
  CK(cudaDeviceSynchronize());
  int* ends;
  CK(cudaMalloc(&ends, GROUPS * 4));

  auto dg = &sm90_fp8_gemm_1d2d_impl<Major::K, 0, 2 * I, H, GROUPS, 128, BN, 128, 128, 128, 128, ST, 128, 256, 2, false,
                                     CTAS, GemmType::MGroupedContiguousWithPsumLayout, cutlass::bfloat16_t, 128>;
  const int dg_smem = (128 * BN * 2 + 1023) / 1024 * 1024 + ST * ((128 + BN) * 128 + 512) + ((H / 128) * 2 * 4 + 7) / 8 * 8 + ST * 16;
  CK(cudaFuncSetAttribute(dg, cudaFuncAttributeMaxDynamicSharedMemorySize, dg_smem));
  // The kernel (A in registers), the kernel with A from shared memory (two 128-wide halves a k
  // block), and the first quantizing gate + up instead of SwiGLU (what silu costs).
  const void* fz_variants[3] = {(const void*)&fused<H, GROUPS, true, true>, (const void*)&fused<H, GROUPS, true, false>,
                                (const void*)&fused<H, GROUPS, false, true>};
  const char* fz_names[3] = {"", "A from shared memory", "without silu"};
  const void* fz = fz_variants[0];
  const int fz_smem = fp8_swiglu_gemm::smem_bytes(H);
  for (auto f : fz_variants) CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, fz_smem));
  printf("shared memory: DeepGEMM %d, fused %d bytes\n", dg_smem, fz_smem);

  unsigned long long* mism;
  CK(cudaMalloc(&mism, 8));
  CK(cudaMemset(mism, 0, 8));
  const unsigned long long pairs = 1ull << 32;
  check_code<<<132 * 8, 256>>>(pairs, mism);
  unsigned long long bad = 0;
  CK(cudaMemcpy(&bad, mism, 8, cudaMemcpyDeviceToHost));
  printf("code() against the division: %llu of %llu pairs differ\n", bad, pairs);

  for (int round = 1; round <= 2; round++) {
    for (bool ragged : {false, true}) {
      auto c = routed_counts(L, ROWS, ragged);
      std::vector<int> e(GROUPS, 0), start(L);
      int at = 0, mn = 1 << 30, mx = 0, tok = 0;
      for (int g = 0; g < L; g++) {
        start[g] = at;
        e[g] = at + c[g];
        at = (e[g] + 127) / 128 * 128;
        mn = std::min(mn, c[g]), mx = std::max(mx, c[g]), tok += c[g];
      }
      const int rows = at;
      CK(cudaMemcpy(ends, e.data(), GROUPS * 4, cudaMemcpyHostToDevice));
      const Live psum{nullptr, ends, nullptr, L, 128, 1};

      auto ma = map_rows(xq, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, H, rows, 128, 128, CU_TENSOR_MAP_SWIZZLE_128B);
      auto mb_dg = map_rows(wgu, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, H, (uint64_t)L * 2 * I, 128, BN, CU_TENSOR_MAP_SWIZZLE_128B);
      auto mb_fz = map_rows(wgu, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, H, (uint64_t)L * 2 * I, 128, 128, CU_TENSOR_MAP_SWIZZLE_128B);
      auto md = map_rows(gu, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, 2 * I, rows, 64, 128, CU_TENSOR_MAP_SWIZZLE_128B);
      auto ms = map_rows(xsf, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ld, H / 128, 128, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
      auto mo = map_rows(aq2, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, I, rows, 128, 128, CU_TENSOR_MAP_SWIZZLE_128B);

      uint32_t m0 = 0, n = 2 * I, k = H;
      void* dg_params[] = {&sgu, &ends, &m0, &n, &k, &ma, &mb_dg, &md, &ms};
      fp8_swiglu_gemm::Args args{sgu, ends, nullptr, asf2, (uint32_t)I, (uint32_t)H, (uint32_t)rows, (uint32_t)ld};
      void* fz_params[] = {&args, &ma, &mb_fz, &ms, &mo};
      auto unfused = [&] {
        launch_cluster((const void*)dg, dg_smem, st, dg_params);
        fp8_swiglu_quantize<<<rows, 128, 0, st>>>(gu, psum, I, nullptr, ld, aq, asf);
      };
      auto gemm_only = [&] { launch_cluster((const void*)dg, dg_smem, st, dg_params); };
      auto fusedf = [&] { launch_cluster((const void*)fz, fz_smem, st, fz_params); };

      CK(cudaMemset(aq2, 0xFF, cap * I));
      unfused();
      fusedf();
      CK(cudaStreamSynchronize(st));
      CK(cudaGetLastError());

      // Compare on the experts' rows.
      std::vector<uint8_t> q1((size_t)rows * I), q2((size_t)rows * I);
      std::vector<float> s1((size_t)ld * (I / 128)), s2((size_t)ld * (I / 128));
      CK(cudaMemcpy(q1.data(), aq, q1.size(), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(q2.data(), aq2, q2.size(), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(s1.data(), asf, s1.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(s2.data(), asf2, s2.size() * 4, cudaMemcpyDeviceToHost));
      size_t same = 0, total = 0, zero_groups = 0;
      double worst = 0, worst_scale = 0;
      for (int g = 0; g < L; g++)
        for (int r = start[g]; r < e[g]; r++)
          for (int j = 0; j < I / 128; j++) {
            const float a = s1[(size_t)j * ld + r], b = s2[(size_t)j * ld + r];
            if (a == 0.f) zero_groups++;
            worst_scale = std::max(worst_scale, a == 0.f ? (b == 0.f ? 0.0 : 1.0) : std::fabs(a - b) / a);
            for (int i = 0; i < 128; i++) {
              const size_t at_ = (size_t)r * I + j * 128 + i;
              same += q1[at_] == q2[at_];
              total++;
              const double d = std::fabs((double)decode(q1[at_]) * a - (double)decode(q2[at_]) * b);
              worst = std::max(worst, a == 0.f ? d : d / (448.0 * a));
            }
          }
      const float t_gemm = median_us(gemm_only, 50, st);
      const float t_unfused = median_us(unfused, 50, st);
      const float t_fused = median_us(fusedf, 50, st);
      float t_var[3];
      for (int v = 1; v < 3; v++)
        t_var[v] = median_us([&] { launch_cluster(fz_variants[v], fz_smem, st, fz_params); }, 50, st);
      const double flop = 2.0 * tok * 2.0 * I * H;
      printf("round %d %s counts %d..%d (%d rows, %d padded): DeepGEMM gate/up %.1f us (%.0f TF/s), + SwiGLU quantize %.1f us; "
             "fused %.1f us (%.0f TF/s), %.3fx | codes equal %.5f, worst |deq diff| / amax %.4f, worst scale rel diff %.2e, "
             "zero-scale groups %zu\n",
             round, ragged ? "ragged" : "even", mn, mx, tok, rows, t_gemm, flop / t_gemm / 1e6, t_unfused, t_fused,
             flop / t_fused / 1e6, t_fused / t_unfused, (double)same / total, worst, worst_scale, zero_groups);
      for (int v = 1; v < 3; v++) printf("  fused %s: %.1f us\n", fz_names[v], t_var[v]);
    }
  }
  return 0;
}
