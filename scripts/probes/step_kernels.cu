// Decode's small step kernels on one GPU, each timed as what one more copy adds inside a CUDA graph
// (21 copies minus 1, over 20): the landed kernels of kernels/epserve.cu against the forms they
// replaced (copied below as `*_before`), with their outputs compared bit for bit; and cuBLAS's
// three-piece router GEMM (the landed bf16 router) for scale.
#include "../../kernels/epserve.cu"
#include "common.cuh"
#include <cublas_v2.h>
#include <numeric>
#include <random>

// Before 3e9893c: one block per 8 rows of an expert over the whole stride, one column per step.
__global__ void swiglu_masked_before(const bf16* gu, const int* counts, int S, int I, bf16* act) {
  const int e = blockIdx.x, r0 = blockIdx.y * 8, r1 = min(r0 + 8, counts[e]);
  for (int r = r0; r < r1; r++) {
    const size_t row = (size_t)e * S + r;
    const bf16* g = gu + row * 2 * I;
    for (int i = threadIdx.x; i < I; i += blockDim.x) {
      const float a = __bfloat162float(g[i]), u = __bfloat162float(g[I + i]);
      act[row * I + i] = __float2bfloat16(a / (1.f + expf(-a)) * u);
    }
  }
}

// Before 3e9893c: one block per row, one column per step.
__global__ void widen_add_before(const bf16* x, const bf16* shared, const int* n, int H, float* out) {
  const int t = blockIdx.x;
  if (t >= *n) return;
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float v = __bfloat162float(x[(size_t)t * H + h]);
    if (shared) v += __bfloat162float(shared[(size_t)t * H + h]);
    out[(size_t)t * H + h] = v;
  }
}

// f's work captured `reps` times into one graph: the graph's median time on s.
template <typename F> float graph_once(cudaStream_t s, F f, int reps) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int r = 0; r < reps; r++) f();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  return median_us([&] { cudaGraphLaunch(ge, s); }, 200, s, 10);
}
template <typename F> float added_us(cudaStream_t s, F f) { return (graph_once(s, f, 21) - graph_once(s, f, 1)) / 20; }

template <typename T> std::vector<T> host(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  // decode on 4 ranks of DeepSeek-V3's shapes: 64 local experts, rows at a stride of 4 x 128, ~16 each.
  const int L = 64, S = 512, I = 2048, H = 7168, T = 128, K = 8, E = 256;
  std::mt19937 rng(1);
  bf16 *gu, *act1, *act2, *xb;
  float *out1, *out2, *logits;
  int *counts, *n, *ids1, *ids2;
  float *w1, *w2;
  CK(cudaMalloc(&gu, (size_t)L * S * 2 * I * 2));
  CK(cudaMalloc(&act1, (size_t)L * S * I * 2));
  CK(cudaMalloc(&act2, (size_t)L * S * I * 2));
  CK(cudaMalloc(&xb, (size_t)T * H * 2));
  CK(cudaMalloc(&out1, (size_t)T * H * 4));
  CK(cudaMalloc(&out2, (size_t)T * H * 4));
  CK(cudaMalloc(&logits, (size_t)T * 3 * E * 4));
  CK(cudaMalloc(&counts, 256 * 4));
  CK(cudaMalloc(&n, 4));
  CK(cudaMalloc(&ids1, T * K * 4));
  CK(cudaMalloc(&ids2, T * K * 4));
  CK(cudaMalloc(&w1, T * K * 4));
  CK(cudaMalloc(&w2, T * K * 4));
  std::vector<int> c(256, 0);
  for (int i = 0; i < L; i++) c[i] = 8 + rng() % 20;
  CK(cudaMemcpy(counts, c.data(), 1024, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(n, &T, 4, cudaMemcpyHostToDevice));
  std::vector<bf16> hb((size_t)L * S * 2 * I);
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  for (auto& v : hb) v = __float2bfloat16(u(rng));
  CK(cudaMemcpy(gu, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(xb, hb.data(), (size_t)T * H * 2, cudaMemcpyHostToDevice));
  // Router logits as the bf16 router leaves them: three slices per row, each far smaller.
  std::vector<float> hl((size_t)T * 3 * E);
  for (size_t i = 0; i < hl.size(); i++) hl[i] = u(rng) * (((i / E) % 3) == 0 ? 1.f : ((i / E) % 3) == 1 ? 1e-3f : 1e-6f);
  CK(cudaMemcpy(logits, hl.data(), hl.size() * 4, cudaMemcpyHostToDevice));

  printf("empty kernel: %.2f us\n", added_us(s, [&] { ll_bounds<<<1, 32, 0, s>>>(counts, 0, S, 0, nullptr, nullptr); }));
  auto sw1 = [&] { swiglu_masked_before<<<dim3(L, S / 8), 256, 0, s>>>(gu, counts, S, I, act1); };
  auto sw2 = [&] { swiglu_masked<<<dim3(L, 32), 256, 0, s>>>(gu, counts, S, I, act2); };
  printf("swiglu_masked (64 experts, %d rows): before %.2f us, landed %.2f us", std::accumulate(c.begin(), c.end(), 0), added_us(s, sw1), added_us(s, sw2));
  CK(cudaMemset(act1, 0, (size_t)L * S * I * 2));
  CK(cudaMemset(act2, 0, (size_t)L * S * I * 2));
  sw1();
  sw2();
  CK(cudaStreamSynchronize(s));
  printf(", outputs %s\n", host((uint16_t*)act1, (size_t)L * S * I) == host((uint16_t*)act2, (size_t)L * S * I) ? "bitwise equal" : "DIFFER");
  auto wa1 = [&] { widen_add_before<<<T, 256, 0, s>>>(xb, nullptr, n, H, out1); };
  auto wa2 = [&] { widen_add<<<dim3(T, (H / 8 + 255) / 256), 256, 0, s>>>(xb, nullptr, n, H, out2); };
  printf("widen_add (128 x 7168): before %.2f us, landed %.2f us", added_us(s, wa1), added_us(s, wa2));
  wa1();
  wa2();
  CK(cudaStreamSynchronize(s));
  printf(", outputs %s\n", host(out1, (size_t)T * H) == host(out2, (size_t)T * H) ? "bitwise equal" : "DIFFER");
  auto same = [&] { return host(ids1, T * K) == host(ids2, T * K) && host(w1, T * K) == host(w2, T * K); };
  auto sm1 = [&] { topk_softmax<<<T / 4, 128, 4 * E * 4, s>>>(logits, n, T, E, 3, K, 1, ids1, w1); };
  auto sm2 = [&] { topk_softmax_regs<<<T / 4, 128, 0, s>>>(logits, n, T, E, 3, K, 1, ids2, w2); };
  printf("top-k softmax (256 experts, 3 slices): shared memory %.2f us, registers %.2f us", added_us(s, sm1), added_us(s, sm2));
  sm1();
  sm2();
  CK(cudaStreamSynchronize(s));
  printf(", picks %s\n", same() ? "bitwise equal" : "DIFFER");
  auto sg1 = [&] { topk_sigmoid_group<<<T / 4, 128, 4 * (2 * E + 32) * 4, s>>>(logits, nullptr, n, T, E, 3, K, 8, 4, 1, 2.5f, ids1, w1); };
  auto sg2 = [&] { topk_sigmoid_group_regs<<<T / 4, 128, 0, s>>>(logits, nullptr, n, T, E, 3, K, 8, 4, 1, 2.5f, ids2, w2); };
  printf("top-k sigmoid, 8 groups of 32: shared memory %.2f us, registers %.2f us", added_us(s, sg1), added_us(s, sg2));
  sg1();
  sg2();
  CK(cudaStreamSynchronize(s));
  printf(", picks %s\n", same() ? "bitwise equal" : "DIFFER");
  // The bf16 router GEMM (rows x [hi; mid; lo] pieces), for scale.
  cublasHandle_t blas;
  cublasCreate(&blas);
  cublasSetStream(blas, s);
  void* ws;
  CK(cudaMalloc(&ws, 32 << 20));
  cublasSetWorkspace(blas, ws, 32 << 20);
  bf16* pieces;
  CK(cudaMalloc(&pieces, (size_t)3 * E * H * 2));
  CK(cudaMemcpy(pieces, hb.data(), (size_t)3 * E * H * 2, cudaMemcpyHostToDevice));
  const float one = 1.f, zero = 0.f;
  printf("cuBLAS bf16 router GEMM (128 x 768 x 7168): %.2f us\n", added_us(s, [&] {
           cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, 3 * E, T, H, &one, pieces, CUDA_R_16BF, H, xb, CUDA_R_16BF, H, &zero, logits,
                        CUDA_R_32F, 3 * E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
         }));
  return 0;
}
