// The FP8 form of the decode GEMM (kernels/decode_gemm.cuh) alone, on an EP4 rank's decode
// shapes of deepseek-v3 (64 experts, gate/up 4096 x 7168 and down 7168 x 2048, 16 rows per
// expert in strides of 32): its time and weight read rate, beside the bf16 form's on the same
// rows in the same run. Timing only (random codes): the numerics are tests/gpu_fp8.rs's.
#include "common.cuh"
#ifdef DECODE_GEMM_HEADER  // a variant's header, to time against this one
#include DECODE_GEMM_HEADER
#else
#include "../../kernels/decode_gemm.cuh"
#endif
using bf = __nv_bfloat16;
const int L = 64, S = 32, ROWS = 16;


int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaFuncSetAttribute(decode_gemm_plain, cudaFuncAttributeMaxDynamicSharedMemorySize, decode_gemm::kSmem));
  CK(cudaFuncSetAttribute(decode_gemm_fp8, cudaFuncAttributeMaxDynamicSharedMemorySize, decode_gemm::kSmem));
  int* ticket;
  CK(cudaMalloc(&ticket, 8));
  CK(cudaMemset(ticket, 0, 8));
  int* counts;
  std::vector<int> hc(L, ROWS);
  CK(cudaMalloc(&counts, L * 4));
  CK(cudaMemcpy(counts, hc.data(), L * 4, cudaMemcpyHostToDevice));
  struct Shape { const char* name; int n, k; } shapes[] = {{"gate/up", 4096, 7168}, {"down", 7168, 2048}};
  printf("%-8s %6s %6s | %10s %8s | %10s %8s\n", "gemm", "n", "k", "bf16 us", "TB/s", "fp8 us", "TB/s");
  for (auto sh : shapes) {
    const size_t wn = (size_t)L * sh.n * sh.k, xn = (size_t)L * S * sh.k;
    bf *wb, *xb, *y;
    uint8_t *wq, *xq;
    float *wsf, *xsf;
    CK(cudaMalloc(&wb, wn * 2));
    CK(cudaMalloc(&xb, xn * 2));
    CK(cudaMalloc(&wq, wn));
    CK(cudaMalloc(&xq, xn));
    CK(cudaMalloc(&y, (size_t)L * S * sh.n * 2));
    const size_t wsn = (size_t)L * (sh.n / 128) * (sh.k / 128), xsn = (size_t)L * (sh.k / 128) * S;
    CK(cudaMalloc(&wsf, wsn * 4));
    CK(cudaMalloc(&xsf, xsn * 4));
    fill<<<1024, 256>>>(wb, wn, 0.05f);
    fill<<<1024, 256>>>(xb, xn, 1.f, 1);
    fill_bytes<<<1024, 256>>>(wq, wn);
    fill_bytes<<<1024, 256>>>(xq, xn);
    fill_f32<<<256, 256>>>(wsf, wsn, 1e-3f);
    fill_f32<<<256, 256>>>(xsf, xsn, 1e-2f);
    CK(cudaDeviceSynchronize());
    const CUtensorMap mwb = map2d(wb, sh.k, (uint64_t)L * sh.n, 128), mxb = map2d(xb, sh.k, (uint64_t)L * S, 32);
    // FP8 rows of k bytes are bf16 rows of k / 2 to the TMA: the same 128-byte boxes.
    const CUtensorMap mwq = map2d(wq, sh.k / 2, (uint64_t)L * sh.n, 128), mxq = map2d(xq, sh.k / 2, (uint64_t)L * S, 32);
    const float tb = median_us([&] {
      decode_gemm_plain<<<sms, decode_gemm::kThreads, decode_gemm::kSmem>>>(mwb, mxb, counts, L, S, sh.n, sh.k, y, ticket);
    }, 50);
    const float tq = median_us([&] {
      decode_gemm_fp8<<<sms, decode_gemm::kThreads, decode_gemm::kSmem>>>(mwq, mxq, wsf, xsf, counts, nullptr, L, S, 0,
                                                                           sh.n, sh.k, y, ticket);
    }, 50);
    CK(cudaGetLastError());
    printf("%-8s %6d %6d | %10.1f %8.2f | %10.1f %8.2f\n", sh.name, sh.n, sh.k, tb, wn * 2 / tb / 1e6, tq,
           wn / tq / 1e6);
    cudaFree(wb); cudaFree(xb); cudaFree(wq); cudaFree(xq); cudaFree(y); cudaFree(wsf); cudaFree(xsf);
  }
  return 0;
}
