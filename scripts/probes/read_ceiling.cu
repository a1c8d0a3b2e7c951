// Read-bandwidth probes on one H200: plain streaming reads, and TMA 2-D boxes of the decode
// GEMM's weight pattern (row-major [rows][K], box 64 cols x BOXR rows) against the same bytes laid
// out so each box is contiguous.
#include "common.cuh"
#include <cstdint>

__global__ void k_read(const uint4* p, size_t n, unsigned* out) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v; asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678) out[0] = acc;
}

__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mb_init(uint64_t* b, int c) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(c)); }
__device__ __forceinline__ void mb_expect(uint64_t* b, uint32_t tx) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(b)), "r"(tx)); }
__device__ __forceinline__ void mb_arrive(uint64_t* b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(sa(b))); }
__device__ __forceinline__ void mb_wait(uint64_t* b, uint32_t ph) {
  asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}" :: "r"(sa(b)), "r"(ph));
}
__device__ __forceinline__ void tma2d(void* dst, const CUtensorMap* m, int x, int y, uint64_t* b) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               :: "r"(sa(dst)), "l"(m), "r"(x), "r"(y), "r"(sa(b)) : "memory");
}

// tiles = groups * ntiles; each tile: kblocks boxes. blocked: box at y = (tile * kblocks + kb) * BOXR, x = 0.
template <int STAGES, int BOXR>
__global__ void __launch_bounds__(128, 1) k_tma(const __grid_constant__ CUtensorMap m, int tiles, int kblocks, int blocked, unsigned* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint64_t* full = (uint64_t*)(smem + STAGES * BOXR * 128);
  uint64_t* empty = full + STAGES;
  if (threadIdx.x == 0) { for (int s = 0; s < STAGES; s++) { mb_init(&full[s], 1); mb_init(&empty[s], 1); } asm volatile("fence.mbarrier_init.release.cluster;"); }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if (warp == 1 && (threadIdx.x & 31) == 0) {
    int s = 0; uint32_t ph = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x)
      for (int kb = 0; kb < kblocks; kb++) {
        mb_wait(&empty[s], ph ^ 1);
        mb_expect(&full[s], BOXR * 128);
        if (blocked) tma2d(smem + s * BOXR * 128, &m, 0, (t * kblocks + kb) * BOXR, &full[s]);
        else tma2d(smem + s * BOXR * 128, &m, kb * 64, t * BOXR, &full[s]);
        if (++s == STAGES) { s = 0; ph ^= 1; }
      }
  } else if (warp == 0) {
    int s = 0; uint32_t ph = 0; unsigned acc = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x)
      for (int kb = 0; kb < kblocks; kb++) {
        mb_wait(&full[s], ph);
        acc ^= ((unsigned*)(smem + s * BOXR * 128))[threadIdx.x];
        __syncwarp();
        if (threadIdx.x == 0) mb_arrive(&empty[s]);
        if (++s == STAGES) { s = 0; ph ^= 1; }
      }
    if (acc == 0x12345678) out[0] = acc;
  }
}

template <int STAGES, int BOXR>
void run_tma(const char* name, void* w, int groups, int n, int k, unsigned* out, int ctas) {
  int ntiles = n / BOXR, kblocks = k / 64, tiles = groups * ntiles;
  size_t bytes = (size_t)groups * n * k * 2;
  size_t smem = STAGES * BOXR * 128 + 2 * STAGES * 8 + 1024;
  CK(cudaFuncSetAttribute(k_tma<STAGES, BOXR>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  for (int blocked = 0; blocked < 2; blocked++) {
    CUtensorMap m = blocked ? map2d(w, 64, (uint64_t)groups * n * (k / 64), BOXR) : map2d(w, k, (uint64_t)groups * n, BOXR);
    float us = median_us([&] { k_tma<STAGES, BOXR><<<ctas, 128, smem>>>(m, tiles, kblocks, blocked, out); }, 20);
    printf("%-10s box 64x%d stages %d ctas %d %-9s %8.1f us  %.3f TB/s\n", name, BOXR, STAGES, ctas, blocked ? "blocked" : "row-major", us, bytes / (us * 1e-6) / 1e12);
  }
}

int main() {
  const int groups = 64, H = 7168, I = 2048;
  size_t gu = (size_t)groups * 2 * I * H, dn = (size_t)groups * H * I;
  void *w; unsigned* out; CK(cudaMalloc(&w, (gu + dn) * 2)); CK(cudaMalloc(&out, 64));
  CK(cudaMemset(w, 1, (gu + dn) * 2));
  void* wd = (char*)w + gu * 2;
  size_t total = (gu + dn) * 2;
  for (int blocks : {132 * 2, 132 * 4, 132 * 8}) {
    float us = median_us([&] { k_read<<<blocks, 512>>>((const uint4*)w, total / 16, out); }, 20);
    printf("plain read %.2f GB, %d blocks: %8.1f us  %.3f TB/s\n", total / 1e9, blocks, us, total / (us * 1e-6) / 1e12);
  }
  void* w2; CK(cudaMalloc(&w2, gu * 2));
  float us = median_us([&] { cudaMemcpyAsync(w2, w, gu * 2, cudaMemcpyDeviceToDevice); }, 20);
  printf("d2d copy %.2f GB: %.1f us  %.3f TB/s (one way), %.3f (read+write)\n", gu * 2 / 1e9, us, gu * 2 / (us * 1e-6) / 1e12, gu * 4 / (us * 1e-6) / 1e12);
  CK(cudaFree(w2));
  for (int ctas : {132, 264}) {
    run_tma<5, 256>("gate_up", w, groups, 2 * I, H, out, ctas);
    run_tma<5, 256>("down", wd, groups, H, I, out, ctas);
  }
  run_tma<8, 128>("gate_up", w, groups, 2 * I, H, out, 132);
  run_tma<8, 128>("down", wd, groups, H, I, out, 132);
  run_tma<3, 256>("gate_up", w, groups, 2 * I, H, out, 132);
  CK(cudaDeviceSynchronize());
  return 0;
}
