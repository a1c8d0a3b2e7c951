// The shared expert at decode (deepseek-v3's: gate/up 4096 x 7168, down 7168 x 2048) over one
// block of 128 rows, as the step ran it (DeepGEMM's psum instance, 128 x 256 tiles: only 16 and
// 28 column tiles for 132 SMs), against the decode GEMM in 4 chunks of 32 rows, and cuBLAS at 8
// to 256 rows (what the step runs now), alone and both GEMMs in one CUDA graph. Timing only.
#include "common.cuh"
#include "../../kernels/decode_gemm.cuh"
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>
#include <cublas_v2.h>
using namespace deep_gemm;
using cute::UMMA::Major;
using bf = __nv_bfloat16;
constexpr auto psum = &sm90_bf16_gemm_impl<Major::K, Major::K, 0, 0, 0, 256, 128, 256, 64, 128, 128, 128, 3, 128, 256, 1, false, 132,
                                           GemmType::MGroupedContiguousWithPsumLayout, false, cutlass::bfloat16_t>;
const int psum_smem = 128 * 256 * 2 + 3 * (128 + 256) * 64 * 2 + 3 * 16;
int main() {
  const int H = 7168, I = 2048, M = 128;
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaFuncSetAttribute(psum, cudaFuncAttributeMaxDynamicSharedMemorySize, psum_smem));
  CK(cudaFuncSetAttribute(decode_gemm_plain, cudaFuncAttributeMaxDynamicSharedMemorySize, decode_gemm::kSmem));
  CK(cudaFuncSetAttribute(decode_gemm_gated, cudaFuncAttributeMaxDynamicSharedMemorySize, decode_gemm::kSmem));
  int* ticket; CK(cudaMalloc(&ticket, 8)); CK(cudaMemset(ticket, 0, 8));  // the decode GEMM's
  bf *wgu, *wdn, *x, *gu, *act, *y;
  CK(cudaMalloc(&wgu, (size_t)2 * I * H * 2)); CK(cudaMalloc(&wdn, (size_t)H * I * 2));
  CK(cudaMalloc(&x, (size_t)256 * H * 2)); CK(cudaMalloc(&gu, (size_t)256 * 2 * I * 2)); CK(cudaMalloc(&act, (size_t)256 * I * 2)); CK(cudaMalloc(&y, (size_t)256 * H * 2));
  fill<<<1024, 256>>>(wgu, (size_t)2 * I * H, 0.02f); fill<<<1024, 256>>>(wdn, (size_t)H * I, 0.02f); fill<<<1024, 256>>>(x, (size_t)256 * H, 1.f);
  std::vector<int> ends(256, M); int* d_ends; CK(cudaMalloc(&d_ends, 1024)); CK(cudaMemcpy(d_ends, ends.data(), 1024, cudaMemcpyHostToDevice));
  std::vector<int> cnt(256, 0); cnt[0] = M; int* d_cnt; CK(cudaMalloc(&d_cnt, 1024)); CK(cudaMemcpy(d_cnt, cnt.data(), 1024, cudaMemcpyHostToDevice));
  auto dg = [&](int n, int k, bf* a, bf* b, bf* d) {
    CUtensorMap ma = map2d(a, k, M, 128), mb = map2d(b, k, n, 256), md = map2d(d, n, M, 128);
    cudaLaunchConfig_t c = {}; c.gridDim = 132; c.blockDim = 384; c.dynamicSmemBytes = psum_smem;
    CK(cudaLaunchKernelEx(&c, psum, d_ends, (uint32_t)0, (uint32_t)n, (uint32_t)k, ma, mb, md));
  };
  CUtensorMap wu = map2d(wgu, H, 2 * I, 128), xu = map2d(x, H, M, 32), wd = map2d(wdn, I, H, 128), xd = map2d(act, I, M, 32);
  float a = median_us([&] { dg(2 * I, H, x, wgu, gu); }, 50), b = median_us([&] { dg(H, I, act, wdn, y); }, 50);
  float c = median_us([&] { decode_gemm_gated<<<sms, decode_gemm::kThreads, decode_gemm::kSmem>>>(wu, xu, d_cnt, 1, M, 2 * I, H, act, ticket); }, 50);
  float d = median_us([&] { decode_gemm_plain<<<sms, decode_gemm::kThreads, decode_gemm::kSmem>>>(wd, xd, d_cnt, 1, M, H, I, y, ticket); }, 50);
  double bu = 2.0 * I * H * 2, bd = 1.0 * H * I * 2;
  printf("shared expert, 128 rows: DeepGEMM psum up %.1f us (%.2f TB/s), down %.1f us (%.2f TB/s)\n", a, bu / a / 1e6, b, bd / b / 1e6);
  printf("shared expert, 128 rows: decode_gemm (4 chunks) gated up %.1f us (%.2f TB/s), down %.1f us (%.2f TB/s)\n", c, bu / c / 1e6, d, bd / d / 1e6);
  cublasHandle_t h; cublasCreate(&h);
  void* ws; CK(cudaMalloc(&ws, 32 << 20)); cublasSetWorkspace(h, ws, 32 << 20);
  auto blas = [&](int m, int n, int k, const bf* xx, const bf* w, bf* yy) {
    const float al = 1.f, be = 0.f;
    cublasStatus_t st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &al, w, CUDA_R_16BF, k, xx, CUDA_R_16BF, k, &be, yy, CUDA_R_16BF, n,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) { printf("cublas %d\n", (int)st); exit(1); }
  };
  for (int m : {8, 16, 32, 64, 128, 256}) {
    float u = median_us([&] { blas(m, 2 * I, H, x, wgu, gu); }, 50), dd = median_us([&] { blas(m, H, I, act, wdn, y); }, 50);
    // The same inside a graph (as the step runs it).
    cudaStream_t s; cudaStreamCreate(&s); cublasSetStream(h, s);
    cudaGraph_t gr; cudaGraphExec_t ge;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal); blas(m, 2 * I, H, x, wgu, gu); blas(m, H, I, act, wdn, y); cudaStreamEndCapture(s, &gr);
    CK(cudaGraphInstantiate(&ge, gr, 0));
    float g2 = median_us([&] { cudaGraphLaunch(ge, s); }, 50, s);
    cublasSetStream(h, 0);
    printf("cuBLAS, %3d rows: up %.1f us (%.2f TB/s), down %.1f us (%.2f TB/s); both in a graph %.1f us\n", m, u, bu / u / 1e6, dd, bd / dd / 1e6, g2);
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
