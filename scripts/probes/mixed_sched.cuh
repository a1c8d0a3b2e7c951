// A tile order for DeepGEMM's psum (m-grouped contiguous) GEMMs, tried for #54 and not kept
// (docs/benchmarks.md, "Load balance"): the persistent CTAs split into two streams, one walking
// the first part of the tile list in DeepGEMM's order and one the rest, each with a share of the
// CTAs and of the tiles. With experts ordered hottest first, every wave then holds tiles of hot
// experts (a weight tile shared by many row blocks: compute-bound) beside tiles of cold ones (a
// weight tile for one row block: bandwidth-bound). Every tile is DeepGEMM's tile, computed once
// in the same way: outputs do not change by a bit.
//
// It takes the place of DeepGEMM's scheduler (a partial specialisation of `sched::Scheduler`,
// declared before any kernel is instantiated) in the instances of 252-255 groups, whose first
// stream takes 80, 70, 60 and 50% of the CTAs; it keeps the stock members and walk, and
// changes only which tile a CTA takes next.
#pragma once
#include <deep_gemm/scheduler/gemm.cuh>

namespace deep_gemm::sched {

// The share of the CTAs (and of the tiles) the first stream takes, by instance: kNumGroups
// 255 - i takes kMixShare[i] / 20.
static constexpr uint32_t kMixShare[] = {10, 12, 14, 16};

template <uint32_t kNumGroups, uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t kNumMulticast, bool kIsMulticastOnA,
          uint32_t kNumSMs, bool kEnsureZeroPadding, uint32_t kKAlignment, uint32_t kSFKSpan,
          uint32_t kNum1DBlocksPerGroup, uint32_t kSplitKFactor, bool kUsePaddedSFLayout>
struct MixScheduler : Scheduler<GemmType::MGroupedContiguousWithPsumLayout, BLOCK_M, BLOCK_N, kNumGroups, kNumMulticast,
                                kIsMulticastOnA, kNumSMs, kEnsureZeroPadding, kKAlignment, kSFKSpan,
                                kNum1DBlocksPerGroup, kSplitKFactor, kUsePaddedSFLayout, true> {
    // The stock scheduler (`kSkipEmptyKGroups` only matters to K-grouped GEMMs).
    using Base = Scheduler<GemmType::MGroupedContiguousWithPsumLayout, BLOCK_M, BLOCK_N, kNumGroups, kNumMulticast,
                           kIsMulticastOnA, kNumSMs, kEnsureZeroPadding, kKAlignment, kSFKSpan, kNum1DBlocksPerGroup,
                           kSplitKFactor, kUsePaddedSFLayout, true>;
    static constexpr uint32_t kClusters = kNumSMs / kNumMulticast;
    static constexpr uint32_t kFirstClusters = kClusters * kMixShare[255 - kNumGroups] / 20;
    static_assert(kNumSMs % kNumMulticast == 0 and kFirstClusters > 0 and kFirstClusters < kClusters, "two streams");

    uint32_t stream_begin, stream_end, stream_offset, stream_ctas;

    CUTLASS_DEVICE explicit MixScheduler(const uint32_t& shape_m, const uint32_t& shape_n, const uint32_t& shape_k,
                                         int* grouped_layout)
        : Base(shape_m, shape_n, shape_k, grouped_layout) {
        // Ends past the last expert repeat the padded total, and every block starts aligned:
        // the row blocks are ceil(total / BLOCK_M).
        const uint32_t total =
            math::ceil_div(static_cast<uint32_t>(grouped_layout[kNumGroups - 1]), BLOCK_M) * this->num_n_blocks;
        // The first stream's tiles in proportion to its CTAs, a whole number of cluster pairs.
        uint32_t split = math::align(static_cast<uint32_t>((static_cast<uint64_t>(total) * kFirstClusters) / kClusters),
                                     2 * kNumMulticast);
        split = split < total ? split : total;
        const uint32_t cluster = blockIdx.x / kNumMulticast, lane = blockIdx.x % kNumMulticast;
        // Clusters spread over the two streams evenly (Bresenham), so neighbouring SMs differ.
        const uint32_t before = cluster * kFirstClusters / kClusters;
        const bool first = (cluster + 1) * kFirstClusters / kClusters > before;
        stream_begin = first ? 0 : split;
        stream_end = first ? split : total;
        stream_ctas = (first ? kFirstClusters : kClusters - kFirstClusters) * kNumMulticast;
        stream_offset = (first ? before : cluster - before) * kNumMulticast + lane;
    }

    CUTLASS_DEVICE bool get_next_block(uint32_t& m_block_idx, uint32_t& n_block_idx) {
        const auto next_block_idx = stream_begin + (++this->current_iter) * stream_ctas + stream_offset;
        if (next_block_idx >= stream_end)
            return false;
        // The stock walk over the groups (monotonic within a stream).
        while (next_block_idx >= (this->current_m_block_cumsum + this->num_m_blocks) * this->num_n_blocks) {
            if (++this->current_group_idx == kNumGroups)
                return false;
            this->last_psum_m = math::align(this->current_psum_m, BLOCK_M);
            this->current_psum_m = this->grouped_layout[this->current_group_idx];
            this->current_m_block_cumsum += this->num_m_blocks;
            this->num_m_blocks = math::ceil_div(this->current_psum_m - this->last_psum_m, BLOCK_M);
        }
        this->get_swizzled_block_idx(next_block_idx - this->current_m_block_cumsum * this->num_n_blocks, m_block_idx,
                                     n_block_idx);
        m_block_idx += this->last_psum_m / BLOCK_M;
        return true;
    }
};

#define EPSERVE_MIX(G)                                                                                                \
    template <uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t kNumMulticast, bool kIsMulticastOnA, uint32_t kNumSMs,   \
              bool kEnsureZeroPadding, uint32_t kKAlignment, uint32_t kSFKSpan, uint32_t kNum1DBlocksPerGroup,      \
              uint32_t kSplitKFactor, bool kUsePaddedSFLayout>                                                      \
    struct Scheduler<GemmType::MGroupedContiguousWithPsumLayout, BLOCK_M, BLOCK_N, G, kNumMulticast, kIsMulticastOnA, \
                     kNumSMs, kEnsureZeroPadding, kKAlignment, kSFKSpan, kNum1DBlocksPerGroup, kSplitKFactor,       \
                     kUsePaddedSFLayout, false>                                                                     \
        : MixScheduler<G, BLOCK_M, BLOCK_N, kNumMulticast, kIsMulticastOnA, kNumSMs, kEnsureZeroPadding, kKAlignment, \
                       kSFKSpan, kNum1DBlocksPerGroup, kSplitKFactor, kUsePaddedSFLayout> {                         \
        CUTLASS_DEVICE explicit Scheduler(const uint32_t& m, const uint32_t& n, const uint32_t& k, int* layout = nullptr) \
            : MixScheduler<G, BLOCK_M, BLOCK_N, kNumMulticast, kIsMulticastOnA, kNumSMs, kEnsureZeroPadding,          \
                           kKAlignment, kSFKSpan, kNum1DBlocksPerGroup, kSplitKFactor, kUsePaddedSFLayout>(m, n, k, layout) {} \
    };
EPSERVE_MIX(255)
EPSERVE_MIX(254)
EPSERVE_MIX(253)
EPSERVE_MIX(252)

}  // namespace deep_gemm::sched
