// What the probes share: error checks, a median event timing, random bf16 fills, and 2-D tensor
// maps as the service builds them (256-byte L2 promotion; bf16 rows in 64-column boxes under the
// 128-byte swizzle, as the Hopper GEMM reads them).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>
#include <algorithm>
#include <random>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                   \
  do {                                                                          \
    auto e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                    \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));         \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

// Median microseconds of `iters` runs of f on `stream`, after `warmup` runs.
template <typename F> float median_us(F f, int iters, cudaStream_t stream = 0, int warmup = 2) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; i++) f();
  CK(cudaDeviceSynchronize());
  std::vector<float> v;
  for (int i = 0; i < iters; i++) {
    cudaEventRecord(a, stream);
    f();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    v.push_back(ms * 1e3f);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// x[i] uniform in [-scale, scale), a hash of i and `seed` (the same values on every run).
__global__ void fill(__nv_bfloat16* x, size_t n, float scale, unsigned seed = 0) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned long long z = 0x9E3779B97F4A7C15ull * (i + 1 + ((unsigned long long)seed << 40));
    z ^= z >> 31;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 29;
    x[i] = __float2bfloat16(scale * ((float)(z >> 40) / 16777216.f * 2.f - 1.f));
  }
}

// Bytes that are E4M3 codes of no NaN (0x7F, 0xFF), a hash of the index (the same on every run).
__global__ void fill_bytes(uint8_t* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned long long z = 0x9E3779B97F4A7C15ull * (i + 1);
    z ^= z >> 31;
    p[i] = (uint8_t)(z >> 40) & 0xB7;
  }
}
__global__ void fill_f32(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

// A launch of `ctas` CTAs of `threads` in clusters of `cluster` (DeepGEMM's TMA multicast), on
// `stream`: pass `&cfg` to cudaLaunchKernelEx(C). Not copied: `cfg` points at `at`.
struct Clustered {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute at[1];
  Clustered(int ctas, int threads, int smem, cudaStream_t stream, int cluster) {
    cfg.gridDim = ctas;
    cfg.blockDim = threads;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = cluster, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
  }
  Clustered(const Clustered&) = delete;
};

// `outer` rows of `inner` elements of `bytes` each at `base`, in boxes of `box_inner` x
// `box_outer`, 256-byte L2 promotion (as the service's maps).
inline CUtensorMap map_rows(void* base, CUtensorMapDataType type, int bytes, uint64_t inner, uint64_t outer,
                            uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle) {
  static PFN_cuTensorMapEncodeTiled_v12000 enc = [] {
    PFN_cuTensorMapEncodeTiled_v12000 f = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", (void**)&f, cudaEnableDefault, &q));
    return f;
  }();
  CUtensorMap m;
  cuuint64_t dims[2] = {inner, outer}, strides[1] = {inner * bytes};
  cuuint32_t box[2] = {box_inner, box_outer}, elems[2] = {1, 1};
  if (enc(&m, type, 2, base, dims, strides, box, elems, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    printf("cuTensorMapEncodeTiled failed\n");
    exit(1);
  }
  return m;
}

// `outer` rows of `inner` bf16 at `base`, in boxes of 64 columns x `box_rows` rows.
inline CUtensorMap map2d(void* base, uint64_t inner, uint64_t outer, uint32_t box_rows) {
  return map_rows(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, inner, outer, 64, box_rows, CU_TENSOR_MAP_SWIZZLE_128B);
}

// Rows per expert of `experts`: `rows` each, or (ragged) 4096 tokens routed top-8 over them at
// random, as the bench's prefill-rank routes (the same counts on every run).
inline std::vector<int> routed_counts(int experts, int rows, bool ragged) {
  std::vector<int> c(experts, rows);
  if (!ragged) return c;
  std::fill(c.begin(), c.end(), 0);
  std::mt19937 rng(7);
  std::vector<int> e(experts);
  for (int t = 0; t < 4096; t++) {
    for (int i = 0; i < experts; i++) e[i] = i;
    std::shuffle(e.begin(), e.end(), rng);
    for (int k = 0; k < 8; k++) c[e[k]]++;
  }
  return c;
}
