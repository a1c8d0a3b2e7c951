// Weight-streaming grouped GEMM for experts with few rows each (decode, the masked layout):
// y[e * S + r] = x[e * S + r] . w_e^T for r < min(counts[e], S). At 16 rows per expert the GEMM
// is a read of the weights, so the kernel is built around that read: the weights are the MMA's
// 16-row A operand and an expert's rows its 8-column B tiles (no row padding to 32 or 64 rows
// per weight tile), TMA streams two 128-row weight boxes per 64-deep stage into a deep pipeline,
// and the math (mma.sync from ldmatrix) stays far under the stage's load time.
//
// One persistent CTA per SM takes units (expert, chunk of 32 of its rows, 256 weight rows) in
// that order from a ticket in global memory: an expert past 32 rows reads its weights once more
// per chunk, on other SMs at about the same time, so mostly from L2, and a hot expert does not
// hold up one SM. Those L2 units are cheap, so a fixed round-robin left the SMs that drew them
// idle at the end (20 to 30 µs of 1.4 ms on a draw with one hot expert); tickets even that out.
// The last CTA out sets the ticket back to zero, so launches on one stream need nothing between
// them; launches must not overlap. Units are counted on the device from the counts, so a
// captured graph serves any routing.
//
// The gated form takes gate rows [j, j + 128) and up rows [I + j, I + j + 128) in one unit and
// writes silu(gate) * up (both rounded to bf16 first, as the unfused SwiGLU reads them) straight
// into the activations, so the gate/up output never reaches memory.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace decode_gemm {

constexpr int kBoxRows = 128;                           // weight rows per TMA box, two per stage
constexpr int kBoxK = 64;                               // K per stage: one 128-byte swizzle row
constexpr int kChunk = 32;                              // rows of x per pass over a unit's weights
constexpr int kWarps = 8;                               // math warps: 16 rows of each box each
// 5 in the build (server/backend/cuda/decode_gemm.rs sizes shared memory for it); the probe
// (scripts/probes/decode_gemm.cu) may set it to time others.
#ifndef DECODE_GEMM_STAGES
#define DECODE_GEMM_STAGES 5
#endif
constexpr int kStages = DECODE_GEMM_STAGES;
constexpr int kMaxGroups = 1024;                        // experts one launch takes
constexpr int kBoxBytes = kBoxRows * kBoxK * 2;         // 16 KB
constexpr int kStageBytes = 2 * kBoxBytes + kChunk * kBoxK * 2;  // 36 KB, a multiple of 1 KB
constexpr int kThreads = (kWarps + 1) * 32;             // and one TMA warp
// Stages, their full and empty barriers, and slack to align the stages to the swizzle's 1 KB (the
// units' prefix is static shared memory).
constexpr int kSmem = kStages * kStageBytes + 2 * kStages * 8 + 1024;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count));
}
__device__ __forceinline__ void bar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes));
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)));
}
__device__ __forceinline__ void bar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}" ::"r"(
          smem_addr(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          smem_addr(dst)),
      "l"(map), "r"(x), "r"(y), "r"(smem_addr(bar))
      : "memory");
}

// Four 8x8 bf16 matrices from a box of 128-byte rows under the 128-byte swizzle (16-byte chunk c
// of row r sits at chunk c ^ (r % 8)); this lane addresses row `r`, columns [col, col + 8).
__device__ __forceinline__ void ldmatrix4(uint32_t (&d)[4], const uint8_t* box, int r, int col) {
  const uint8_t* p = box + r * 128 + (((col >> 3) ^ (r & 7)) << 4);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, "
      "%2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// `w`: [groups * N, K] in boxes of 64 x 128; `x`: [rows, K] in boxes of 64 x 32. Gated: N = 2I,
// y is [rows, I]; else y is [rows, N]. N % 256 == 0 (gated: I % 128 == 0), K % 64 == 0.
// `ticket`: two ints, zero at launch (the next unit, the CTAs done), zero again at exit.
template <bool kGated>
__device__ __forceinline__ void run(const CUtensorMap* w, const CUtensorMap* x, const int* counts, int groups, int S,
                                    int N, int K, __nv_bfloat16* y, int* ticket) {
  extern __shared__ uint8_t raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; s++) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], kWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // The unit whose first stage is stage s (-1: no more units).
  __shared__ int unit_of[kStages];
  // first[e]: expert e's first unit; chunks of 32 rows times the units of weight rows.
  __shared__ int first[kMaxGroups + 1];
  const int per_expert = kGated ? N / 2 / kBoxRows : N / (2 * kBoxRows);
  if (warp == 0) {
    int carry = 0;
    for (int base = 0; base < groups; base += 32) {
      const int e = base + lane;
      int v = e < groups ? per_expert * ((min(max(counts[e], 0), S) + kChunk - 1) / kChunk) : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += up;
      }
      if (e < groups) first[e + 1] = carry + v;
      carry += __shfl_sync(0xffffffffu, v, 31);
    }
    if (lane == 0) first[0] = 0;
  }
  __syncthreads();
  const int units = first[groups], kblocks = K / kBoxK, out_cols = kGated ? N / 2 : N;
  // Unit u: expert e (first[e] <= u < first[e + 1]), its chunk's first row c0, weight rows j.
  auto unit = [&](int u, int& e, int& c0, int& j) {
    int lo = 0, hi = groups - 1;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (first[mid + 1] <= u) lo = mid + 1;
      else hi = mid;
    }
    e = lo;
    c0 = (u - first[e]) / per_expert * kChunk;
    j = (u - first[e]) % per_expert;
  };
  int s = 0;
  uint32_t phase = 0;
  auto advance = [&] {
    if (++s == kStages) {
      s = 0;
      phase ^= 1;
    }
  };

  if (warp == kWarps) {
    if (lane != 0) return;
    for (int u = atomicAdd(ticket, 1); u < units; u = atomicAdd(ticket, 1)) {
      int e, c0, j;
      unit(u, e, c0, j);
      // The unit's two boxes: gate and up rows of the same columns, or 256 consecutive rows.
      const int r0 = e * N + j * (kGated ? kBoxRows : 2 * kBoxRows), r1 = r0 + (kGated ? N / 2 : kBoxRows);
      for (int kb = 0; kb < kblocks; kb++) {
        bar_wait(&empty[s], phase ^ 1);
        uint8_t* st = smem + s * kStageBytes;
        if (kb == 0) unit_of[s] = u;  // published by the arrive below (a release)
        bar_expect(&full[s], kStageBytes);
        tma_load(st, w, kb * kBoxK, r0, &full[s]);
        tma_load(st + kBoxBytes, w, kb * kBoxK, r1, &full[s]);
        tma_load(st + 2 * kBoxBytes, x, kb * kBoxK, e * S + c0, &full[s]);
        advance();
      }
    }
    // No more units: a stage that carries no data, only the end.
    bar_wait(&empty[s], phase ^ 1);
    unit_of[s] = -1;
    bar_arrive(&full[s]);
    return;
  }

  const int g = lane / 4, t = lane % 4;
  // ldmatrix rows and columns of this lane: A (16 weight rows x 16 k), B (16 x-rows x 16 k).
  const int a_row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;
  for (;;) {
    bar_wait(&full[s], phase);
    const int u = unit_of[s];
    if (u < 0) break;
    int e, c0, j;
    unit(u, e, c0, j);
    const int rows = min(counts[e], S);
    // 8-row tiles of x with rows in this chunk (warp-uniform).
    const int tiles = min(4, (rows - c0 + 7) / 8);
    float acc[2][4][4] = {};
    for (int kb = 0; kb < kblocks; kb++) {
      bar_wait(&full[s], phase);
      const uint8_t* st = smem + s * kStageBytes;
#pragma unroll
      for (int k = 0; k < kBoxK; k += 16) {
        uint32_t a[2][4], b[2][4];
        ldmatrix4(a[0], st, a_row, k + a_col);
        ldmatrix4(a[1], st + kBoxBytes, a_row, k + a_col);
        ldmatrix4(b[0], st + 2 * kBoxBytes, b_row, k + b_col);
        if (tiles > 2) ldmatrix4(b[1], st + 2 * kBoxBytes, 16 + b_row, k + b_col);
#pragma unroll
        for (int m = 0; m < 2; m++) {
#pragma unroll
          for (int n = 0; n < 4; n++)
            if (n < tiles) mma(acc[m][n], a[m], b[n / 2][(n % 2) * 2], b[n / 2][(n % 2) * 2 + 1]);
        }
      }
      __syncwarp();
      if (lane == 0) bar_arrive(&empty[s]);
      advance();
    }
    // acc[m][n][i]: weight row warp * 16 + g + (i / 2) * 8 of box m, x row c0 + n * 8 + 2t + i % 2.
#pragma unroll
    for (int n = 0; n < 4; n++) {
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int r = c0 + n * 8 + 2 * t + i % 2, col = warp * 16 + g + (i / 2) * 8;
        if (n >= tiles || r >= rows) continue;
        __nv_bfloat16* out = y + (size_t)(e * S + r) * out_cols;
        if (kGated) {
          const float gate = round_bf16(acc[0][n][i]), up = round_bf16(acc[1][n][i]);
          out[j * kBoxRows + col] = __float2bfloat16(gate / (1.f + expf(-gate)) * up);
        } else {
          out[j * 2 * kBoxRows + col] = __float2bfloat16(acc[0][n][i]);
          out[j * 2 * kBoxRows + kBoxRows + col] = __float2bfloat16(acc[1][n][i]);
        }
      }
    }
  }
  // This CTA's producer has taken its last ticket; the last CTA out resets the pair.
  if (warp == 0 && lane == 0) {
    __threadfence();
    if (atomicAdd(ticket + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      ticket[0] = 0;
      ticket[1] = 0;
    }
  }
}

}  // namespace decode_gemm

// The two forms, one persistent CTA per SM (grid: the SM count), `decode_gemm::kThreads` threads,
// `decode_gemm::kSmem` bytes of dynamic shared memory; `ticket` as `run` says.
extern "C" __global__ void __launch_bounds__(decode_gemm::kThreads, 1)
    decode_gemm_plain(const __grid_constant__ CUtensorMap w, const __grid_constant__ CUtensorMap x,
                      const int* counts, int groups, int S, int N, int K, __nv_bfloat16* y, int* ticket) {
  decode_gemm::run<false>(&w, &x, counts, groups, S, N, K, y, ticket);
}

extern "C" __global__ void __launch_bounds__(decode_gemm::kThreads, 1)
    decode_gemm_gated(const __grid_constant__ CUtensorMap w, const __grid_constant__ CUtensorMap x,
                      const int* counts, int groups, int S, int N, int K, __nv_bfloat16* y, int* ticket) {
  decode_gemm::run<true>(&w, &x, counts, groups, S, N, K, y, ticket);
}
