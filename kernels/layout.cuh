// Layout: rows between token order and expert order, the `nccl` backend's exchange, and the
// grouped GEMMs' blocks in NCCL EP's layouts. The exchange sends every peer one slot of C rows
// (C = tokens x min(K, local experts), the most a peer can receive from one source), so transfer
// sizes are fixed and the exchange is capturable.
// One of epserve.cu's parts (its includes and `bf16` come from there).
#pragma once

extern "C" {

// out[r] = x[entry_of[r] / K] for r < *rows (H a multiple of 8: 16-byte copies). Block per row.
__global__ void gather_rows(const bf16* x, const int* entry_of, const int* rows, int K, int H, bf16* out) {
  const int r = blockIdx.x;
  if (r >= *rows) return;
  const int4* src = reinterpret_cast<const int4*>(x + (size_t)(entry_of[r] / K) * H);
  int4* dst = reinterpret_cast<int4*>(out + (size_t)r * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = src[i];
}

// out[t] = sum_k w[t,k] * y[pos_of[t*K+k]] (+ shared[t]) in f32, for t < *n. Block per token.
__global__ void combine(const bf16* y, const int* pos_of, const float* w, const int* n, int K, int H,
                        const bf16* shared, float* out) {
  const int t = blockIdx.x;
  if (t >= *n) return;
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.f;
    for (int k = 0; k < K; k++) acc += w[t * K + k] * __bfloat162float(y[(size_t)pos_of[t * K + k] * H + h]);
    if (shared) acc += __bfloat162float(shared[(size_t)t * H + h]);
    out[(size_t)t * H + h] = acc;
  }
}

// The expert (and so the peer) of expert-major row r: the last e with offsets[e] <= r.
__device__ inline int expert_of_row(const int* offsets, int E, int r) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// send[peer][slot] = x[token of expert-major row r]: rows for peer p are the block of experts
// [p*L, (p+1)*L), already contiguous in expert-major order. Block per row r < offsets[E].
__global__ void pack_slots(const bf16* x, const int* entry_of, const int* offsets, int E, int L, int K, int H, int C,
                           int rows_cap, bf16* send) {
  const int r = blockIdx.x;
  if (r >= rows_cap || r >= offsets[E]) return;
  const int peer = expert_of_row(offsets, E, r) / L;
  const int slot = r - offsets[peer * L];
  const int4* src = reinterpret_cast<const int4*>(x + (size_t)(entry_of[r] / K) * H);
  int4* dst = reinterpret_cast<int4*>(send + ((size_t)peer * C + slot) * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = src[i];
}

// FP8 experts: pack_slots's rows quantized on the way out (fp8_rule.cuh), each slot row R bytes:
// the H E4M3 codes, then the H / 128 f32 scales (R = StepShape::slot_row_bytes). Block per row
// r < offsets[E]; each half-warp one 128-channel group, eight channels a lane.
__global__ void pack_slots_fp8(const bf16* x, const int* entry_of, const int* offsets, int E, int L, int K, int H,
                               int C, int R, int rows_cap, uint8_t* send) {
  const int r = blockIdx.x;
  if (r >= rows_cap || r >= offsets[E]) return;
  const int peer = expert_of_row(offsets, E, r) / L;
  const int slot = r - offsets[peer * L];
  const bf16* src = x + (size_t)(entry_of[r] / K) * H;
  uint8_t* dst = send + ((size_t)peer * C + slot) * R;
  float* sf = reinterpret_cast<float*>(dst + H);
  const int G = H / 128, half = (threadIdx.x / 16) % 2, lane = threadIdx.x % 16;
  // Both halves of a warp run every iteration (the scale's shuffles take the whole warp).
  for (int g0 = threadIdx.x / 32 * 2; g0 < G; g0 += blockDim.x / 16) {
    const int g = g0 + half;
    const int c = g * 128 + lane * 8;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (g < G) fp8_rule::load8(src + c, v);
    const float s = fp8_rule::group_scale<16>(fp8_rule::amax8(v));
    if (g >= G) continue;
    fp8_rule::store8(dst + c, v, s);
    if (lane == 0) sf[g] = s;
  }
}

// Receive side, from the all-gathered counts M [W][E]: map[s*C + i] = the expert-major position
// (local experts, sources in rank order within each expert) of row i of source s's slot, or -1.
// Each expert's block starts at a multiple of A (the Hopper GEMM's tile): local_offsets [L+1]
// gets the starts and the padded total, rows the padded total, ends [G] each block's end (the
// padded total past the last expert). Single block.
__global__ void recv_map(const int* M, int rank, int W, int E, int L, int C, int A, int G, int* map,
                         int* local_offsets, int* rows, int* ends) {
  extern __shared__ int base[];  // [le][s] (L * W = E ints): position of source s's first row of le
  if (threadIdx.x == 0) {
    int pos = 0;
    for (int le = 0; le < L; le++) {
      local_offsets[le] = pos;
      for (int s = 0; s < W; s++) {
        base[le * W + s] = pos;
        pos += M[s * E + rank * L + le];
      }
      ends[le] = pos;
      pos = (pos + A - 1) / A * A;
    }
    local_offsets[L] = pos;
    *rows = pos;
    for (int e = L; e < G; e++) ends[e] = pos;
  }
  __syncthreads();
  for (int q = threadIdx.x; q < W * C; q += blockDim.x) {
    const int s = q / C, i = q % C;
    int start = 0, out = -1;
    for (int le = 0; le < L; le++) {
      const int c = M[s * E + rank * L + le];
      if (i < start + c) {
        out = base[le * W + s] + (i - start);
        break;
      }
      start += c;
    }
    map[q] = out;
  }
}

// dst[map[q]] = src[q] where map[q] >= 0 (slots -> expert-major). Block per q.
__global__ void scatter_by_map(const bf16* src, const int* map, int H, bf16* dst) {
  const int q = blockIdx.x, m = map[q];
  if (m < 0) return;
  const int4* a = reinterpret_cast<const int4*>(src + (size_t)q * H);
  int4* b = reinterpret_cast<int4*>(dst + (size_t)m * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) b[i] = a[i];
}

// FP8 slot rows (pack_slots_fp8's) into the FFN's A operand: q[m] = the row's codes and
// sf[g * ld + m] its scales (MN-major, as fp8_quantize_rows writes them), m = map[s] >= 0.
// Block per slot row s.
__global__ void scatter_fp8_by_map(const uint8_t* src, const int* map, int H, int R, int ld, uint8_t* q, float* sf) {
  const int s = blockIdx.x, m = map[s];
  if (m < 0) return;
  const uint8_t* row = src + (size_t)s * R;
  const int4* a = reinterpret_cast<const int4*>(row);
  int4* b = reinterpret_cast<int4*>(q + (size_t)m * H);
  for (int i = threadIdx.x; i < H / 16; i += blockDim.x) b[i] = a[i];
  const float* scales = reinterpret_cast<const float*>(row + H);
  for (int g = threadIdx.x; g < H / 128; g += blockDim.x) sf[(size_t)g * ld + m] = scales[g];
}

// dst[q] = src[map[q]] where map[q] >= 0 (expert-major -> slots). Block per q.
__global__ void gather_by_map(const bf16* src, const int* map, int H, bf16* dst) {
  const int q = blockIdx.x, m = map[q];
  if (m < 0) return;
  const int4* a = reinterpret_cast<const int4*>(src + (size_t)m * H);
  int4* b = reinterpret_cast<int4*>(dst + (size_t)q * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) b[i] = a[i];
}

// Where entry j = t*K+k's expert output comes back: peer*C + slot, as `pack_slots` sent it.
__global__ void slot_index(const int* ids, const int* pos_of, const int* offsets, const int* n, int K, int L, int C,
                           int* idx) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= *n * K) return;
  const int peer = ids[j] / L;
  idx[j] = peer * C + (pos_of[j] - offsets[peer * L]);
}

// NCCL EP low-latency expert-major output: local expert e's rows start at e * S, and counts[e] of
// them are filled. bounds = [starts (L), ends (L)] for the grouped GEMM. Single block.
// `masked` [G]: the same counts for the Hopper GEMM's masked layout, 0 past the last expert.
__global__ void ll_bounds(const int* counts, int L, int S, int G, int* bounds, int* masked) {
  for (int e = threadIdx.x; e < G; e += blockDim.x) {
    const int c = e < L ? counts[e] : 0, valid = c < 0 ? 0 : (c > S ? S : c);
    if (e < L) {
      bounds[e] = e * S;
      bounds[L + e] = e * S + valid;
    }
    masked[e] = valid;
  }
}

// The Hopper GEMM's psum layout from A-aligned expert-major offsets [L] and counts [L]:
// ends[e] = offsets[e] + counts[e], and past the last expert its end aligned up to A (empty
// groups: the kernel starts each group at the aligned end of the one before). [G]
__global__ void psum_ends(const int* offsets, const int* counts, int L, int A, int G, int* ends) {
  const int last = offsets[L - 1] + counts[L - 1], padded = (last + A - 1) / A * A;
  for (int e = threadIdx.x; e < G; e += blockDim.x) ends[e] = e < L ? offsets[e] + counts[e] : padded;
}

// The psum ends of NCCL EP's expert-major (HT) blocks from the routing itself: its per-expert
// counts are padded to the alignment, so expert e's rows end at offsets[e] plus the rows every
// rank routed to it (`M` [W][W * L], the all-gathered counts; this rank's experts from
// rank * L). The GEMMs and the quantizers then skip the padding (at decode most of a block).
__global__ void routed_ends(const int* M, int rank, int W, int L, const int* offsets, int G, int* ends) {
  for (int e = threadIdx.x; e < G; e += blockDim.x) {
    if (e < L) {
      int n = 0;
      for (int w = 0; w < W; w++) n += M[(size_t)w * W * L + rank * L + e];
      ends[e] = offsets[e] + n;
    } else {
      ends[e] = offsets[L];  // the padded total
    }
  }
}

// Two-batch overlap's micro-batch counts: of a step's n home tokens, the first `half` rows
// are micro-batch A's and the rest B's.
__global__ void split_count(const int* n, int half, int* na, int* nb) {
  const int all = n[0];
  na[0] = all < half ? all : half;
  nb[0] = all > half ? (all - half < half ? all - half : half) : 0;
}

}  // extern "C"
