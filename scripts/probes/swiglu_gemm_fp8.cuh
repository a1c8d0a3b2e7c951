// A probe's kernel, not the service's (#35, session 33): the FP8 gate/up GEMM with SwiGLU and its
// quantization in the epilogue (DeepSeek-V3's recipe, server/model/fp8.rs): act = silu(x.gate^T) *
// (x.up^T) (times the row's weight where given), quantized per 128 channels by fp8_rule's rule,
// straight from the f32 sums. The service writes gate/up as bf16 rows and reads them back
// (prefill-rank: 302 MB written, 268 MB read), and its 192-wide column tile leaves the last one a third full on
// 4,096 columns. Measured against that path (scripts/probes/swiglu_gemm_fp8.cu, 1x H100,
// docs/results/gpu/fp8/fused/): no faster beyond the noise, so not kept (ragged counts 0.96-1.00x
// of its time, 512 rows each 0.96-1.10x, seven calls of the forms kept here).
// Its tensor cores wait through its promotions (twice a k block, where DeepGEMM's tile waits once)
// and through its epilogue; the two ways tried of hiding the promotions (below) cost more than
// they hid.
//
// A tile is 128 rows x 128 output channels: the 128 gate rows and the 128 up rows of those
// channels (two TMA boxes of the checkpoint's stacked [gate | up] weights, so the weights stay as
// shipped), so one thread holds a channel's gate and up sums and a row's 128 channels are one
// quad's (one scale group, reduced by two shuffles). Two mainloops (kRegA):
// - false: each k block runs the gate half's 128-wide wgmmas from shared memory, promotes them
//   (times the block's activation and weight scales), then the up half's: three 64-float banks a
//   thread where one 256-wide wgmma would need four;
// - true: the warpgroup's A rows in registers, 64-wide chunks into two 32-float banks, two in
//   flight, each promotion under the next chunk's wgmmas (slower: 64-wide wgmmas).
// Issuing the two warpgroups' halves in turn (named barriers) was slower too (call 2).
//
// The rest is DeepGEMM's SM90 design (sm90_fp8_gemm_1d2d) built from its pinned headers: one TMA
// warp and two math warpgroups of 64 rows, persistent CTAs over DeepGEMM's psum scheduler, clusters
// of two sharing each weight tile (each CTA multicasts one half), the weight scales staged per
// tile. Operands: A [rows, K] E4M3 (128-byte swizzle) with SFA f32 [K / 128][ld] (MN-major); B
// [groups * 2I, K] E4M3 with SFB f32 [groups][2I / 128][K / 128]; out [rows, I] E4M3 (128-byte
// swizzle) with its scales sf[(c / 128) * ld + r]. Rows of an expert's last tile past its count
// are written too (finite), never another expert's; the down GEMM reads them, nothing uses them.
#pragma once
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

#include <deep_gemm/comm/barrier.cuh>
#include <deep_gemm/common/math.cuh>
#include <deep_gemm/common/tma_copy.cuh>
#include <deep_gemm/common/types.cuh>
#include <deep_gemm/common/utils.cuh>
#include <deep_gemm/mma/sm90.cuh>
#include <deep_gemm/ptx/ld_st.cuh>
#include <deep_gemm/ptx/utils.cuh>
#include <deep_gemm/ptx/wgmma.cuh>
#include <deep_gemm/scheduler/gemm.cuh>

#include "../../kernels/fp8_rule.cuh"

namespace fp8_swiglu_gemm {

// fp8_rule::pack4's code of one value, by a multiplication with r = RN(1 / s) where that gives
// the same code: x * r lies within two ulps of RN(x / s), so both round to the same E4M3 value
// unless one of E4M3's ties (the fraction bits below its three at 0x80000) is that close, or the
// value is in E4M3's subnormal range (|y| < 2^-6, ties elsewhere); those take the division.
__device__ inline uint32_t code(float x, float s, float r) {
  if (s == 0.f) return 0;
  float y = x * r;
  const uint32_t bits = __float_as_uint(y) & 0x7FFFFFFFu;
  if (bits < 0x3C800000u || ((bits & 0xFFFFFu) - (0x80000u - 4u)) < 8u) y = __fdiv_rn(x, s);
  return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
}

using Barrier = cutlass::arch::ClusterTransactionBarrier;
using WGMMA = deep_gemm::mma::sm90::FP8MMASelector<128>::type;
using Chunk = deep_gemm::mma::sm90::FP8MMASelector<64>::type;  // the layout of one 64-wide chunk

// n accumulators of a wgmma times the block's scales (s0 for a lane's first row, s1 for its row
// 8 below) into `sum`, the k block's promotion to f32.
template <uint32_t n>
__device__ __forceinline__ void promote(float* sum, const float* acc, float s0, float s1) {
#pragma unroll
  for (uint32_t i = 0; i < n / 4; i++) {
    sum[i * 4 + 0] += s0 * acc[i * 4 + 0];
    sum[i * 4 + 1] += s0 * acc[i * 4 + 1];
    sum[i * 4 + 2] += s1 * acc[i * 4 + 2];
    sum[i * 4 + 3] += s1 * acc[i * 4 + 3];
  }
}

// m64n64k32 E4M3 with A from registers (four per lane, the mma.m16n8k32 fragment of each warp's
// 16 rows) and B from shared memory.
template <size_t... I>
__device__ __forceinline__ void chunk_mma_impl(const uint32_t (&a)[4], uint64_t b, float* d, bool acc,
                                               cute::index_sequence<I...>) {
  cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_RS_TN<>::fma(
      a[0], a[1], a[2], a[3], b, d[I]..., acc ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}
__device__ __forceinline__ void chunk_mma(const uint32_t (&a)[4], const cute::GmmaDescriptor& b, float* d, bool acc) {
  chunk_mma_impl(a, b.desc_, d, acc, cute::make_index_sequence<32>{});
}

constexpr uint32_t kBlockM = 128, kHalf = 128, kBlockK = 128;
constexpr uint32_t kStages = 4, kMulticast = 2;
constexpr uint32_t kMathThreads = 256, kTmaThreads = 128, kThreads = kMathThreads + kTmaThreads;
constexpr uint32_t kOutBytes = kBlockM * kHalf;          // one tile of codes, 16 KB
constexpr uint32_t kABytes = kBlockM * kBlockK;          // 16 KB a stage
constexpr uint32_t kBBytes = 2 * kHalf * kBlockK;        // gate then up, 32 KB a stage
constexpr uint32_t kSfaBytes = kBlockM * sizeof(float);  // 512 B a stage

// Shared memory for K: the out tile, the stages, their activation scales, the tile's weight
// scales (gate's K / 128, then up's), the barriers.
__host__ __device__ constexpr uint32_t smem_bytes(uint32_t k) {
  return kOutBytes + kStages * (kABytes + kBBytes + kSfaBytes) + 2 * (k / kBlockK) * 4 +
         2 * kStages * sizeof(Barrier);
}

struct Args {
  const float* sfb;     // [groups][2I / 128][K / 128]
  const int* ends;      // the psum layout's kNumGroups ends
  const float* weight;  // a row's routing weight, or null
  float* sf;            // [I / 128][ld]
  uint32_t inter, k, rows, ld;
};

// kQuantize false quantizes gate + up instead of SwiGLU's output (timing SwiGLU's part:
// scripts/probes/swiglu_gemm_fp8.cu).
template <uint32_t SHAPE_K, uint32_t kNumGroups, uint32_t kNumSMs, bool kQuantize = true, bool kRegA = true>
__device__ __forceinline__ void run(const Args& args, const CUtensorMap& map_a, const CUtensorMap& map_b,
                                    const CUtensorMap& map_sfa, const CUtensorMap& map_out) {
  using namespace deep_gemm;
  const uint32_t k = SHAPE_K != 0 ? SHAPE_K : args.k, inter = args.inter;
  const uint32_t num_k = k / kBlockK;
  const uint32_t warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0), lane = ptx::get_lane_idx();

  if (warp == kMathThreads / 32 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(&map_a);
    cute::prefetch_tma_descriptor(&map_b);
    cute::prefetch_tma_descriptor(&map_sfa);
    cute::prefetch_tma_descriptor(&map_out);
  }
  __syncwarp();

  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* const out = smem;
  auto stage_a = [&](uint32_t s) { return smem + kOutBytes + s * kABytes; };
  auto stage_b = [&](uint32_t s) { return smem + kOutBytes + kStages * kABytes + s * kBBytes; };
  float* const sfa0 = reinterpret_cast<float*>(smem + kOutBytes + kStages * (kABytes + kBBytes));
  float* const sfb = sfa0 + kStages * kBlockM;
  Barrier* const full = reinterpret_cast<Barrier*>(sfb + 2 * num_k);
  Barrier* const empty = full + kStages;

  if (warp == kMathThreads / 32 + 1 && cute::elect_one_sync()) {
    for (uint32_t i = 0; i < kStages; i++) {
      full[i].init(1);
      // Every math warp of both CTAs frees a stage: the peer's multicast writes into it.
      empty[i].init(kMulticast * kMathThreads / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  comm::cluster_sync_with_relaxed_arrive();

  using Scheduler = sched::Scheduler<GemmType::MGroupedContiguousWithPsumLayout, kBlockM, 2 * kHalf, kNumGroups,
                                     kMulticast, false, kNumSMs>;
  auto scheduler = Scheduler(0, 2 * inter, k, const_cast<int*>(args.ends));
  uint32_t m_block, n_block, stage = 0, phase = 0;
  auto advance = [&] {
    stage = stage == kStages - 1 ? 0 : stage + 1;
    phase ^= stage == 0;
  };

  if (warp >= kMathThreads / 32) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp == kMathThreads / 32 + 2 && cute::elect_one_sync()) {
      const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
      while (scheduler.get_next_block(m_block, n_block)) {
        // An expert's odd last row tile has no partner: its CTA loads both halves itself.
        const bool shared = scheduler.is_tma_multicast_valid(m_block);
        const uint32_t rank = cute::block_rank_in_cluster();
        const uint32_t gate = scheduler.current_group_idx * 2 * inter + n_block * kHalf;
        for (uint32_t kb = 0; kb < num_k; kb++, advance()) {
          empty[stage].wait(phase ^ 1);
          Barrier& bar = full[stage];
          tma::copy<kBlockK, kBlockM, 128, __nv_fp8_e4m3>(&map_a, &bar, reinterpret_cast<__nv_fp8_e4m3*>(stage_a(stage)),
                                                          kb * kBlockK, m_block * kBlockM);
          tma::copy<kBlockM, 1, 0, float>(&map_sfa, &bar, sfa0 + stage * kBlockM, m_block * kBlockM, kb);
          if (shared) {
            cute::SM90_TMA_LOAD_MULTICAST_2D::copy(&map_b, reinterpret_cast<uint64_t*>(&bar), 0b11, hint,
                                                   stage_b(stage) + rank * kHalf * kBlockK, kb * kBlockK,
                                                   gate + rank * inter);
          } else {
            for (uint32_t h = 0; h < 2; h++)
              cute::SM90_TMA_LOAD_2D::copy(&map_b, reinterpret_cast<uint64_t*>(&bar), hint,
                                           stage_b(stage) + h * kHalf * kBlockK, kb * kBlockK, gate + h * inter);
          }
          bar.arrive_and_expect_tx(kABytes + kBBytes + kSfaBytes);
        }
      }
      // The peer may still multicast into this CTA's stages: wait until both have freed them.
      for (uint32_t i = 0; i < kStages; i++, advance()) empty[stage].wait(phase ^ 1);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const uint32_t wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const uint32_t r0 = warp * 16 + lane / 4, r1 = r0 + 8;  // this thread's two rows of the tile
  auto a_desc = mma::sm90::make_smem_desc(reinterpret_cast<__nv_fp8_e4m3*>(stage_a(0)) + wg * WGMMA::M * kBlockK, 1);
  auto b_desc = mma::sm90::make_smem_desc(reinterpret_cast<__nv_fp8_e4m3*>(stage_b(0)), 1);
  const uint32_t a_lo = __shfl_sync(0xffffffffu, a_desc.reg32_[0], 0);
  const uint32_t b_lo = __shfl_sync(0xffffffffu, b_desc.reg32_[0], 0);
  auto free_stage = [&] {
    if (lane < kMulticast) empty[stage].arrive(lane);
  };
  while (scheduler.get_next_block(m_block, n_block)) {
    // The tile's weight scales: gate's row of K / 128, then up's.
    {
      const uint32_t rows_sf = 2 * inter / kHalf;
      const float* g = args.sfb + ((size_t)scheduler.current_group_idx * rows_sf + n_block) * num_k;
      const float* u = g + (size_t)(inter / kHalf) * num_k;
      for (uint32_t i = threadIdx.x; i < 2 * num_k; i += kMathThreads)
        ptx::st_shared(sfb + i, i < num_k ? g[i] : u[i - num_k]);
    }
    cutlass::arch::NamedBarrier::sync(kMathThreads, 0);

    float gate[WGMMA::kNumAccum], up[WGMMA::kNumAccum], acc[WGMMA::kNumAccum];
#pragma unroll
    for (uint32_t i = 0; i < WGMMA::kNumAccum; i++) gate[i] = up[i] = 0.f;

    // One half's wgmmas (gate's 128 weight rows, or up's) over the stage's 128-deep k block.
    auto mma_half = [&](uint32_t half) {
#pragma unroll
      for (uint32_t i = 0; i < WGMMA::kNumAccum; i++) ptx::warpgroup_fence_operand(acc[i]);
      ptx::warpgroup_arrive();
#pragma unroll
      for (uint32_t kk = 0; kk < kBlockK / WGMMA::K; kk++) {
        a_desc.reg32_[0] = a_lo + (stage * kABytes + kk * WGMMA::K) / 16;
        b_desc.reg32_[0] = b_lo + (stage * kBBytes + half * kHalf * kBlockK + kk * WGMMA::K) / 16;
        WGMMA::wgmma(a_desc, b_desc, acc, kk);
      }
      ptx::warpgroup_commit_batch();
#pragma unroll
      for (uint32_t i = 0; i < WGMMA::kNumAccum; i++) ptx::warpgroup_fence_operand(acc[i]);
      ptx::warpgroup_wait<0>();
    };

    // kRegA: the warpgroup's A rows in registers (ldmatrix, once a k block), each 64-wide
    // weight chunk a register-A wgmma into one of two 32-float banks, two chunks in flight, so a
    // chunk's promotion runs under the next one's wgmmas; shared-memory A would be read again
    // for every chunk (a third more shared-memory traffic at 64 wide than at 128).
    float bank0[Chunk::kNumAccum], bank1[Chunk::kNumAccum];
    uint32_t frag[kBlockK / Chunk::K][4];
    // This lane's ldmatrix row and 16-byte column: matrices (rows 0-7 | 8-15) x (bytes 0-15 | 16-31).
    const uint32_t lm_row = wg * WGMMA::M + (warp % 4) * 16 + (lane % 8) + 8 * ((lane / 8) % 2), lm_col = lane / 16;
    auto load_a = [&] {
      const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(stage_a(stage))) + lm_row * kBlockK;
#pragma unroll
      for (uint32_t kk = 0; kk < kBlockK / Chunk::K; kk++) {
        const uint32_t at = base + (((kk * 2 + lm_col) ^ (lm_row % 8)) * 16);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(frag[kk][0]), "=r"(frag[kk][1]), "=r"(frag[kk][2]), "=r"(frag[kk][3])
                     : "r"(at));
      }
    };
    auto issue_chunk = [&](uint32_t c, float* acc) {
#pragma unroll
      for (uint32_t i = 0; i < Chunk::kNumAccum; i++) ptx::warpgroup_fence_operand(acc[i]);
      ptx::warpgroup_arrive();
#pragma unroll
      for (uint32_t kk = 0; kk < kBlockK / Chunk::K; kk++) {
        b_desc.reg32_[0] = b_lo + (stage * kBBytes + c * Chunk::N * kBlockK + kk * Chunk::K) / 16;
        chunk_mma(frag[kk], b_desc, acc, kk > 0);
      }
      ptx::warpgroup_commit_batch();
#pragma unroll
      for (uint32_t i = 0; i < Chunk::kNumAccum; i++) ptx::warpgroup_fence_operand(acc[i]);
    };

    if (scheduler.is_computation_valid(m_block, wg * WGMMA::M)) {
#pragma unroll(kRegA ? 2 : 4)
      for (uint32_t kb = 0; kb < num_k; kb++, advance()) {
        const float sg = ptx::ld_shared(sfb + kb), su = ptx::ld_shared(sfb + num_k + kb);
        full[stage].wait(phase);
        const float a0 = ptx::ld_shared(sfa0 + stage * kBlockM + r0);
        const float a1 = ptx::ld_shared(sfa0 + stage * kBlockM + r1);
        if constexpr (kRegA) {
          load_a();
          issue_chunk(0, bank0);
          issue_chunk(1, bank1);
          ptx::warpgroup_wait<1>();
          promote<Chunk::kNumAccum>(gate, bank0, a0 * sg, a1 * sg);
          issue_chunk(2, bank0);
          ptx::warpgroup_wait<1>();
          promote<Chunk::kNumAccum>(gate + Chunk::kNumAccum, bank1, a0 * sg, a1 * sg);
          issue_chunk(3, bank1);
          ptx::warpgroup_wait<1>();
          promote<Chunk::kNumAccum>(up, bank0, a0 * su, a1 * su);
          ptx::warpgroup_wait<0>();
          free_stage();
          promote<Chunk::kNumAccum>(up + Chunk::kNumAccum, bank1, a0 * su, a1 * su);
        } else {
          mma_half(0);
          promote<WGMMA::kNumAccum>(gate, acc, a0 * sg, a1 * sg);
          mma_half(1);
          free_stage();
          promote<WGMMA::kNumAccum>(up, acc, a0 * su, a1 * su);
        }
      }
    } else {
      // This warpgroup's 64 rows are all padding.
      for (uint32_t kb = 0; kb < num_k; kb++, advance()) {
        full[stage].wait(phase);
        free_stage();
      }
    }

    // The last tile's codes must have left shared memory before these overwrite them.
    if (threadIdx.x == 0) cute::tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(kMathThreads, 1);

    const uint32_t row0 = m_block * kBlockM + r0, row1 = row0 + 8;
    const float w0 = args.weight && row0 < args.rows ? args.weight[row0] : 1.f;
    const float w1 = args.weight && row1 < args.rows ? args.weight[row1] : 1.f;
    float amax0 = 0.f, amax1 = 0.f;
#pragma unroll
    for (uint32_t i = 0; i < WGMMA::kNumAccum; i++) {
      // As kernels/fp8.cu's fp8_swiglu_quantize, from f32 sums instead of bf16 rows.
      const float g = gate[i];
      if constexpr (kQuantize)
        gate[i] = __fdividef(g, 1.f + __expf(-g)) * up[i] * (i % 4 < 2 ? w0 : w1);
      else
        gate[i] = g + up[i];
      if (i % 4 < 2)
        amax0 = fmaxf(amax0, fabsf(gate[i]));
      else
        amax1 = fmaxf(amax1, fabsf(gate[i]));
    }
    // A row's 128 channels are its quad's: lanes 4q .. 4q + 3.
    const float s0 = fp8_rule::group_scale<4>(amax0), s1 = fp8_rule::group_scale<4>(amax1);
    const float v0 = s0 == 0.f ? 0.f : __frcp_rn(s0), v1 = s1 == 0.f ? 0.f : __frcp_rn(s1);
#pragma unroll
    for (uint32_t i = 0; i < WGMMA::kNumAccum / 4; i++) {
      // Channels 8i + 2 (lane % 4) and the next of rows r0 and r1, into the 128-byte swizzle.
      const uint32_t c = i * 8 + (lane % 4) * 2;
      const uint32_t q0 = code(gate[i * 4 + 0], s0, v0) | code(gate[i * 4 + 1], s0, v0) << 8;
      const uint32_t q1 = code(gate[i * 4 + 2], s1, v1) | code(gate[i * 4 + 3], s1, v1) << 8;
      auto at = [&](uint32_t r) { return out + r * 128 + (((c / 16) ^ (r % 8)) * 16) + c % 16; };
      *reinterpret_cast<uint16_t*>(at(r0)) = (uint16_t)q0;
      *reinterpret_cast<uint16_t*>(at(r1)) = (uint16_t)q1;
    }
    if (lane % 4 == 0) {
      if (row0 < args.rows) args.sf[(size_t)n_block * args.ld + row0] = s0;
      if (row1 < args.rows) args.sf[(size_t)n_block * args.ld + row1] = s1;
    }
    cute::tma_store_fence();
    cutlass::arch::NamedBarrier::sync(kMathThreads, 1);
    if (threadIdx.x == 0) {
      cute::SM90_TMA_STORE_2D::copy(&map_out, out, n_block * kHalf, m_block * kBlockM);
      cute::tma_store_arrive();
    }
    __syncwarp();
  }
  if (threadIdx.x == 0) cute::tma_store_wait<0>();
}

}  // namespace fp8_swiglu_gemm
