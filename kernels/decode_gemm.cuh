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
//
// The FP8 form (DeepSeek-V3's recipe: E4M3 weights with a scale per 128x128 block, rows with one
// per 128 channels) streams half the bytes through the same producer and stages: a stage's
// 128-byte rows are 128 channels, exactly one scale block. Its math is wgmma (`consume_fp8`), and
// each stage's products are summed apart and added in f32 times the weight box's and each row's
// scale (DeepGEMM's promotion per 128 channels). It also takes contiguous expert blocks (NCCL's
// layout), not only strides. On one H200 it reads FP8 weights at 3.6 TB/s, the bf16 form bf16
// ones at 4.2 (scripts/probes/decode_fp8.cu; docs/benchmarks.md, "Decode's own GEMM in FP8").
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace decode_gemm {

constexpr int kBoxRows = 128;                           // weight rows per TMA box, two per stage
constexpr int kBoxK = 64;                               // K per stage: one 128-byte swizzle row
constexpr int kChunk = 32;                              // rows of x per pass over a unit's weights
constexpr int kWarps = 8;                               // math warps: 16 rows of each box each
// 5 in the build (server/backend/cuda/kernels/decode_gemm.rs sizes shared memory for it); the probe
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

// FP8: the weights are wgmma's A operand, 64 rows a warpgroup, straight from the stage (K-major,
// 128-byte swizzle: 8-row atoms 1 KB apart), and a chunk's 32 rows its B (N = 32). mma.sync's
// E4M3 form held the step to 2.2 TB/s. A wgmma matrix descriptor: start address, leading byte
// offset (unused under the swizzle), stride byte offset (1 KB between 8-row atoms), 128B swizzle.
__device__ __forceinline__ uint64_t desc(const uint8_t* p) {
  return (uint64_t)((smem_addr(p) & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
         (uint64_t)1 << 62;
}

__device__ __forceinline__ void wgmma_e4m3(float (&d)[16], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b));
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma (CUTLASS's
// warpgroup_fence_operand).
__device__ __forceinline__ void fence_regs(float (&d)[2][16]) {
#pragma unroll
  for (int m = 0; m < 2; m++)
#pragma unroll
    for (int q = 0; q < 16; q++) asm volatile("" : "+f"(d[m][q])::"memory");
}

// bar_arrive from lane 0 as a predicated instruction, not a branch (see consume_fp8's unit).
__device__ __forceinline__ void arrive_lane0(uint64_t* b, int lane) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.s32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}" ::"r"(
                   smem_addr(b)),
               "r"(lane)
               : "memory");
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// The math warps of the FP8 form: warpgroup wg takes the stage's box wg (128 weight rows, two
// 64-row wgmmas a 32-deep step). Each stage's products are summed apart and added times the box's
// and each row's scale; the scales are read a stage ahead (a load waited on at once stalled every
// stage: 3.1 against 3.6 TB/s). acc[m][4n + i]: weight row
// wg * 128 + m * 64 + (warp % 4) * 16 + g + (i / 2) * 8 of the unit, chunk row n * 8 + 2t + i % 2.
template <typename Unit, typename Base, typename Count>
__device__ __forceinline__ void consume_fp8(uint8_t* smem, uint64_t* full, uint64_t* empty, const int* unit_of, int& s,
                                            uint32_t& phase, Unit unit, Base base, Count count, const float* wsf,
                                            const float* xsf, const int* offsets, int S, int xs_ld, int N,
                                            int kblocks, __nv_bfloat16* y) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wg = warp / 4, wl = warp % 4;
  for (;;) {
    bar_wait(&full[s], phase);
    // Warp-uniform as the compiler can see it: a branch it thinks divergent serialises wgmma.
    const int u = __shfl_sync(0xffffffffu, unit_of[s], 0);
    if (u < 0) break;
    int e, c0, j;
    unit(u, e, c0, j);
    const int rows = count(e), row0 = base(e);
    const float* ws = wsf + ((size_t)e * (N / kBoxRows) + 2 * j + wg) * kblocks;
    float acc[2][16] = {};
    // Stage kb's scales: its weight box's, and this lane's rows' (only rows in the expert: past
    // them the scales may be past the buffer). Read a stage ahead of their use, and not
    // multiplied until then, so no wgmma waits on them.
    auto scales = [&](float& sw, float (&sx)[4][2], int kb) {
      sw = __ldg(ws + kb);
      const float* xs = xsf + (offsets ? (size_t)kb * xs_ld + row0 : ((size_t)e * kblocks + kb) * S);
#pragma unroll
      for (int n = 0; n < 4; n++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
          const int r = c0 + n * 8 + 2 * t + i;
          sx[n][i] = r < rows ? __ldg(xs + r) : 0.f;
        }
    };
    // Starts the next stage's wgmmas into p; returns the stage it reads.
    auto issue = [&](float (&p)[2][16]) {
      bar_wait(&full[s], phase);
      const uint8_t* st = smem + s * kStageBytes;
#pragma unroll
      for (int m = 0; m < 2; m++)
#pragma unroll
        for (int q = 0; q < 16; q++) p[m][q] = 0.f;
      fence_regs(p);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const uint64_t b = desc(st + 2 * kBoxBytes + k * 32);
#pragma unroll
        for (int m = 0; m < 2; m++) wgmma_e4m3(p[m], desc(st + wg * kBoxBytes + m * 64 * 128 + k * 32), b);
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      const int used = s;
      if (++s == kStages) {
        s = 0;
        phase ^= 1;
      }
      return used;
    };
    // Stage `st`'s products are in p (its wgmmas waited for): the stage goes back to the TMA
    // warp, and the products are added times their scales.
    auto finish = [&](float (&p)[2][16], float sw, const float (&sx)[4][2], int st) {
      fence_regs(p);
      __syncwarp();
      arrive_lane0(&empty[st], lane);
#pragma unroll
      for (int m = 0; m < 2; m++)
#pragma unroll
        for (int q = 0; q < 16; q++) acc[m][q] += p[m][q] * (sw * sx[q / 4][q % 2]);
    };
    // Two stages a turn, so each stage's scales have a register set of their own.
    float p[2][16], swa, swb, sxa[4][2], sxb[4][2];
    scales(swa, sxa, 0);
    for (int kb = 0; kb < kblocks; kb += 2) {
      int at = issue(p);
      if (kb + 1 < kblocks) scales(swb, sxb, kb + 1);
      wgmma_wait<0>();
      finish(p, swa, sxa, at);
      if (kb + 1 >= kblocks) break;
      at = issue(p);
      if (kb + 2 < kblocks) scales(swa, sxa, kb + 2);
      wgmma_wait<0>();
      finish(p, swb, sxb, at);
    }
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
      for (int q = 0; q < 16; q++) {
        const int r = c0 + (q / 4) * 8 + 2 * t + q % 2;
        if (r >= rows) continue;
        const int col = j * 2 * kBoxRows + wg * kBoxRows + m * 64 + wl * 16 + g + ((q / 2) % 2) * 8;
        y[(size_t)(row0 + r) * N + col] = __float2bfloat16(acc[m][q]);
      }
  }
}

// `w`: [groups * N, K] in boxes of 128 bytes x 128 rows; `x`: [rows, K] in boxes of 128 bytes x
// 32 rows. Gated: N = 2I, y is [rows, I]; else y is [rows, N]. N % 256 == 0 (gated: I % 128 ==
// 0), K % 64 == 0 (FP8: % 128). Expert e's rows: without `offsets` (the masked layout) the first
// min(sizes[e], S) of [e * S, (e + 1) * S); with them (FP8 only: contiguous blocks)
// [offsets[e], sizes[e]). FP8 only: `wsf` [groups][N / 128][K / 128]; `xsf` the rows' scales as
// kernels/fp8.cu lays them out: masked, each expert's [K / 128][S] (S % 32 == 0), else
// [K / 128][xs_ld].
// `ticket`: two ints, zero at launch (the next unit, the CTAs done), zero again at exit.
template <bool kGated, bool kFp8>
__device__ __forceinline__ void run(const CUtensorMap* w, const CUtensorMap* x, const float* wsf, const float* xsf,
                                    const int* sizes, const int* offsets, int groups, int S, int xs_ld, int N, int K,
                                    __nv_bfloat16* y, int* ticket) {
  static_assert(!(kGated && kFp8), "FP8 SwiGLU is quantized apart (kernels/fp8.cu)");
  constexpr int kStageK = kFp8 ? 2 * kBoxK : kBoxK;  // channels per 128-byte row
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
  // Expert e's first row and its row count.
  auto base = [&](int e) { return offsets ? offsets[e] : e * S; };
  auto count = [&](int e) { return max(offsets ? sizes[e] - offsets[e] : min(sizes[e], S), 0); };
  if (warp == 0) {
    int carry = 0;
    for (int base = 0; base < groups; base += 32) {
      const int e = base + lane;
      int v = e < groups ? per_expert * ((count(e) + kChunk - 1) / kChunk) : 0;
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
  const int units = first[groups], kblocks = K / kStageK, out_cols = kGated ? N / 2 : N;
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
        tma_load(st, w, kb * kStageK, r0, &full[s]);
        tma_load(st + kBoxBytes, w, kb * kStageK, r1, &full[s]);
        tma_load(st + 2 * kBoxBytes, x, kb * kStageK, base(e) + c0, &full[s]);
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
  if constexpr (kFp8) {
    consume_fp8(smem, full, empty, unit_of, s, phase, unit, base, count, wsf, xsf, offsets, S, xs_ld, N, kblocks, y);
  } else {
  // ldmatrix rows and columns of this lane: A (16 weight rows x 16 k), B (16 x-rows x 16 k).
  const int a_row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;
  for (;;) {
    bar_wait(&full[s], phase);
    const int u = unit_of[s];
    if (u < 0) break;
    int e, c0, j;
    unit(u, e, c0, j);
    const int rows = count(e), row0 = base(e);
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
        __nv_bfloat16* out = y + (size_t)(row0 + r) * out_cols;
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
  decode_gemm::run<false, false>(&w, &x, nullptr, nullptr, counts, nullptr, groups, S, 0, N, K, y, ticket);
}

extern "C" __global__ void __launch_bounds__(decode_gemm::kThreads, 1)
    decode_gemm_gated(const __grid_constant__ CUtensorMap w, const __grid_constant__ CUtensorMap x,
                      const int* counts, int groups, int S, int N, int K, __nv_bfloat16* y, int* ticket) {
  decode_gemm::run<true, false>(&w, &x, nullptr, nullptr, counts, nullptr, groups, S, 0, N, K, y, ticket);
}

extern "C" __global__ void __launch_bounds__(decode_gemm::kThreads, 1)
    decode_gemm_fp8(const __grid_constant__ CUtensorMap w, const __grid_constant__ CUtensorMap x, const float* wsf,
                    const float* xsf, const int* sizes, const int* offsets, int groups, int S, int xs_ld, int N,
                    int K, __nv_bfloat16* y, int* ticket) {
  decode_gemm::run<false, true>(&w, &x, wsf, xsf, sizes, offsets, groups, S, xs_ld, N, K, y, ticket);
}
