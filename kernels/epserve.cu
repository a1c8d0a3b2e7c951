// epserve's CUDA kernels (sm_90a). Every kernel that depends on the step's token count reads it
// from a device scalar, so one captured graph serves any count up to its bucket; positions are
// computed with block scans (no atomics), so a replay is bitwise reproducible.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <cub/block/block_scan.cuh>

#include "decode_gemm.cuh"
#include "fp8_rule.cuh"

using bf16 = __nv_bfloat16;

namespace {

__device__ inline float warp_max(float v) {
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ inline float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Largest value, ties to the lower index (the CPU reference's order).
__device__ inline void warp_argmax(float& v, int& i) {
  for (int o = 16; o; o >>= 1) {
    float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    if (v2 > v || (v2 == v && i2 < i)) {
      v = v2;
      i = i2;
    }
  }
}

// K rounds of argmax over p[0..E) (shared, this warp's), removing each pick.
__device__ inline void pick_top_k(float* p, int E, int K, int lane, int* ids, float* picked) {
  for (int k = 0; k < K; k++) {
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int e = lane; e < E; e += 32) {
      float x = p[e];
      if (x > v || (x == v && e < i)) {
        v = x;
        i = e;
      }
    }
    warp_argmax(v, i);
    ids[k] = i;
    picked[k] = v;
    __syncwarp();
    if (lane == (i & 31)) p[i] = -INFINITY;
    __syncwarp();
  }
}

constexpr int kScanThreads = 256;
constexpr int kTile = 64;
constexpr int kTileK = 32;

// Logit e of one row stored as `parts` slices of E (the router's pieces, see `bf16_pieces`),
// summed smallest piece first; one slice is the plain logit.
__device__ inline float logit(const float* row, int E, int parts, int e) {
  float v = row[(parts - 1) * E + e];
  for (int p = parts - 2; p >= 0; p--) v += row[p * E + e];
  return v;
}

// 16 bytes from global to shared, bypassing L1; `fill` false: 16 zero bytes instead.
__device__ inline void cp_async16(void* dst, const void* src, bool fill) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(fill ? 16 : 0));
}

// The top-k kernels' row: one warp per token, or -1 for a warp past n_cap or past the step's
// tokens (whose ids it marks -1, with weight 0).
__device__ inline int topk_row(const int* n, int n_cap, int K, int* ids, float* weights) {
  const int lane = threadIdx.x % 32, t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= n_cap) return -1;
  if (t >= *n) {
    if (lane < K) {
      ids[t * K + lane] = -1;
      weights[t * K + lane] = 0.f;
    }
    return -1;
  }
  return t;
}

// The top-k kernels' register form: a warp's row with lane l holding experts l + 32 j, j < kRegs
// (E <= 32 kRegs; -inf past E). The arithmetic and tie-breaking are the shared-memory kernels';
// what changes is that a row's loads issue together and no step walks shared memory serially.
constexpr int kRegs = 8;

__device__ inline void load_row(const float* l, int E, int parts, int lane, float (&v)[kRegs]) {
#pragma unroll
  for (int j = 0; j < kRegs; j++) {
    const int e = lane + 32 * j;
    v[j] = e < E ? logit(l, E, parts, e) : -INFINITY;
  }
}

// A float's bits as an unsigned that orders as the float does (not NaN; -0 taken as +0, which
// compares equal to it), so a warp's argmax is two single-instruction reductions.
__device__ inline unsigned order_key(float f) {
  const unsigned b = __float_as_uint(f + 0.f);
  return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

__device__ inline float from_key(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

// K rounds of argmax over the row (ties to the lower index), removing each pick; lane k ends with
// pick k's index, value, and `carry` at the pick (what the caller weighs it by).
__device__ inline void regs_top_k(float (&v)[kRegs], const float (&carry)[kRegs], int K, int lane, int& id,
                                  float& val, float& carried) {
  for (int k = 0; k < K; k++) {
    unsigned best = 0;  // below every float's key
    int i = 0x7fffffff;
    float c = 0.f;
#pragma unroll
    for (int j = 0; j < kRegs; j++) {
      const unsigned key = order_key(v[j]);
      if (key > best) {
        best = key;
        i = lane + 32 * j;
        c = carry[j];
      }
    }
    const unsigned top = __reduce_max_sync(0xffffffffu, best);
    const int pick = __reduce_min_sync(0xffffffffu, best == top ? i : 0x7fffffff);
    c = __shfl_sync(0xffffffffu, c, pick % 32);
    if (lane == k) {
      id = pick;
      val = from_key(top);
      carried = c;
    }
#pragma unroll
    for (int j = 0; j < kRegs; j++)
      if (lane + 32 * j == pick) v[j] = -INFINITY;
  }
}

// Lane 0's sum of the K picks in pick order (as the shared-memory kernels add them), on every lane.
__device__ inline float picks_sum(float val, int K) {
  float tot = 0.f;
  for (int k = 0; k < K; k++) tot += __shfl_sync(0xffffffffu, val, k);
  return tot;
}

// One row's SwiGLU, act[i] = silu(g[i]) * g[I + i] * s: 8 columns (16 bytes) per thread and step
// when I % 8 == 0, so a row's loads issue together; one column at a time otherwise.
__device__ inline void swiglu_row(const bf16* g, int I, float s, bf16* act) {
  if (I % 8 == 0) {
    for (int i = threadIdx.x * 8; i < I; i += blockDim.x * 8) {
      const uint4 a4 = *reinterpret_cast<const uint4*>(g + i), u4 = *reinterpret_cast<const uint4*>(g + I + i);
      const bf16* a = reinterpret_cast<const bf16*>(&a4);
      const bf16* u = reinterpret_cast<const bf16*>(&u4);
      uint4 o4;
      bf16* o = reinterpret_cast<bf16*>(&o4);
#pragma unroll
      for (int q = 0; q < 8; q++) {
        const float x = __bfloat162float(a[q]);
        o[q] = __float2bfloat16(x / (1.f + expf(-x)) * __bfloat162float(u[q]) * s);
      }
      *reinterpret_cast<uint4*>(act + i) = o4;
    }
    return;
  }
  for (int i = threadIdx.x; i < I; i += blockDim.x) {
    const float a = __bfloat162float(g[i]), u = __bfloat162float(g[I + i]);
    act[i] = __float2bfloat16(a / (1.f + expf(-a)) * u * s);
  }
}

}  // namespace

extern "C" {

// The f32 router `w` (n values) as three bf16 pieces, `out = [hi; mid; lo]` (3n): hi + mid + lo
// == w exactly for normal values (each piece takes the next 8 bits of the 24), so bf16 rows times
// the pieces, summed in f32, are the f32 products of the rows and `w`.
__global__ void bf16_pieces(const float* w, size_t n, bf16* out) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float v = w[i];
    const bf16 hi = __float2bfloat16(v);
    const float r = v - __bfloat162float(hi);
    const bf16 mid = __float2bfloat16(r);
    out[i] = hi;
    out[n + i] = mid;
    out[2 * n + i] = __float2bfloat16(r - __bfloat162float(mid));
  }
}

// Softmax over E logits, top-k, optional renormalisation (Mixtral, Qwen3-MoE). One warp per
// token; dynamic shared memory: (blockDim.x / 32) * E floats. Tokens >= *n get ids -1. Each
// row of `logits` is `parts` slices of E, summed (`logit`).
__global__ void topk_softmax(const float* logits, const int* n, int n_cap, int E, int parts, int K, int renorm,
                             int* ids, float* weights) {
  extern __shared__ float sm[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = topk_row(n, n_cap, K, ids, weights);
  if (t < 0) return;
  float* p = sm + warp * E;
  const float* l = logits + (size_t)t * E * parts;
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    p[e] = logit(l, E, parts, e);
    m = fmaxf(m, p[e]);
  }
  m = warp_max(m);
  float s = 0.f;
  for (int e = lane; e < E; e += 32) {
    float x = expf(p[e] - m);
    p[e] = x;
    s += x;
  }
  s = warp_sum(s);
  for (int e = lane; e < E; e += 32) p[e] /= s;
  __syncwarp();
  int sel[32];
  float w[32];
  pick_top_k(p, E, K, lane, sel, w);
  if (lane == 0) {
    float tot = 0.f;
    for (int k = 0; k < K; k++) tot += w[k];
    for (int k = 0; k < K; k++) {
      ids[t * K + k] = sel[k];
      weights[t * K + k] = renorm ? w[k] / tot : w[k];
    }
  }
}

// `topk_softmax` for E <= 32 kRegs, the row in registers (see `load_row`). Same arguments and
// results; one warp per token, any number of warps per block, no shared memory.
__global__ void topk_softmax_regs(const float* logits, const int* n, int n_cap, int E, int parts, int K, int renorm,
                                  int* ids, float* weights) {
  const int lane = threadIdx.x % 32;
  const int t = topk_row(n, n_cap, K, ids, weights);
  if (t < 0) return;
  float v[kRegs];
  load_row(logits + (size_t)t * E * parts, E, parts, lane, v);
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRegs; j++) m = fmaxf(m, v[j]);
  m = warp_max(m);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kRegs; j++) {
    if (lane + 32 * j < E) {
      v[j] = expf(v[j] - m);
      s += v[j];
    }
  }
  s = warp_sum(s);
#pragma unroll
  for (int j = 0; j < kRegs; j++)
    if (lane + 32 * j < E) v[j] /= s;
  int id = 0;
  float val = 0.f, unused = 0.f;
  regs_top_k(v, v, K, lane, id, val, unused);
  const float tot = picks_sum(val, K);
  if (lane < K) {
    ids[t * K + lane] = id;
    weights[t * K + lane] = renorm ? val / tot : val;
  }
}

// `topk_sigmoid_group` for E <= 32 kRegs with one group (n_group 1) or groups of 32 experts (then
// group g is register g across the warp, and its top-2 two warp reductions).
__global__ void topk_sigmoid_group_regs(const float* logits, const float* bias, const int* n, int n_cap, int E,
                                        int parts, int K, int n_group, int topk_group, int renorm, float scaling,
                                        int* ids, float* weights) {
  const int lane = threadIdx.x % 32;
  const int t = topk_row(n, n_cap, K, ids, weights);
  if (t < 0) return;
  float c[kRegs], sc[kRegs];
  load_row(logits + (size_t)t * E * parts, E, parts, lane, c);
#pragma unroll
  for (int j = 0; j < kRegs; j++) {
    const int e = lane + 32 * j;
    sc[j] = e < E ? 1.f / (1.f + expf(-c[j])) : 0.f;
    c[j] = e < E ? sc[j] + (bias ? bias[e] : 0.f) : -INFINITY;
  }
  if (n_group > 1) {
    // Each group's two best choices (the second equals the first when two lanes hold it), as
    // the shared-memory kernel's scan finds them.
    float g[kRegs];
#pragma unroll
    for (int j = 0; j < kRegs; j++) {
      if (j >= n_group) continue;
      const unsigned key = order_key(c[j]);
      const unsigned a = __reduce_max_sync(0xffffffffu, key);
      const bool twice = __popc(__ballot_sync(0xffffffffu, key == a)) > 1;
      const unsigned b = twice ? a : __reduce_max_sync(0xffffffffu, key == a ? 0u : key);
      g[j] = from_key(a) + from_key(b);
    }
    unsigned keep = 0;
    for (int q = 0; q < topk_group; q++) {
      float best = -INFINITY;
      int bi = 0x7fffffff;
#pragma unroll
      for (int j = 0; j < kRegs; j++) {
        const bool open = j < n_group && !((keep >> j) & 1u);
        if (open && (g[j] > best || (g[j] == best && j < bi))) {
          best = g[j];
          bi = j;
        }
      }
      keep |= 1u << bi;
    }
#pragma unroll
    for (int j = 0; j < kRegs; j++)
      if (j < n_group && !((keep >> j) & 1u)) c[j] = 0.f;
  }
  // Each pick is weighed by its score.
  int id = 0;
  float pick = 0.f, w = 0.f;
  regs_top_k(c, sc, K, lane, id, pick, w);
  const float tot = picks_sum(w, K) + 1e-20f;
  if (lane < K) {
    ids[t * K + lane] = id;
    weights[t * K + lane] = (renorm ? w / tot : w) * scaling;
  }
}

// DeepSeek-V3: sigmoid scores, choice = score + bias, the best topk_group of n_group groups by the
// sum of their top-2 choices, top-k among those (others score 0.0, as Hugging Face masks), weights
// from the scores, optional renormalisation (+1e-20), times scaling. n_group <= 32, K <= 32.
// Dynamic shared memory: (blockDim.x / 32) * (2 * E + 32) floats. Logits as in `topk_softmax`.
__global__ void topk_sigmoid_group(const float* logits, const float* bias, const int* n, int n_cap, int E,
                                   int parts, int K, int n_group, int topk_group, int renorm, float scaling, int* ids,
                                   float* weights) {
  extern __shared__ float sm[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = topk_row(n, n_cap, K, ids, weights);
  if (t < 0) return;
  float* s = sm + warp * (2 * E + 32);
  float* c = s + E;
  float* g = c + E;
  const float* l = logits + (size_t)t * E * parts;
  for (int e = lane; e < E; e += 32) {
    s[e] = 1.f / (1.f + expf(-logit(l, E, parts, e)));
    c[e] = s[e] + (bias ? bias[e] : 0.f);
  }
  __syncwarp();
  const int per = E / n_group;
  if (lane < n_group) {
    float a = -INFINITY, b = -INFINITY;
    for (int j = 0; j < per; j++) {
      float v = c[lane * per + j];
      if (v > a) {
        b = a;
        a = v;
      } else if (v > b) {
        b = v;
      }
    }
    g[lane] = a + b;
  }
  __syncwarp();
  unsigned keep = 0;
  for (int q = 0; q < topk_group; q++) {
    bool open = lane < n_group && !((keep >> lane) & 1u);
    float v = open ? g[lane] : -INFINITY;
    int i = open ? lane : 0x7fffffff;
    warp_argmax(v, i);
    keep |= 1u << i;
  }
  for (int e = lane; e < E; e += 32)
    if (!((keep >> (e / per)) & 1u)) c[e] = 0.f;
  __syncwarp();
  int sel[32];
  float w[32];
  pick_top_k(c, E, K, lane, sel, w);
  if (lane == 0) {
    float tot = 0.f;
    for (int k = 0; k < K; k++) {
      w[k] = s[sel[k]];
      tot += w[k];
    }
    tot += 1e-20f;
    for (int k = 0; k < K; k++) {
      ids[t * K + k] = sel[k];
      weights[t * K + k] = (renorm ? w[k] / tot : w[k]) * scaling;
    }
  }
}

// counts[e] += rows routed to e (counts zeroed by the caller; addition order does not matter).
__global__ void count_experts(const int* ids, const int* n, int K, int* counts) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < *n * K) {
    const int e = ids[j];
    if (e >= 0) atomicAdd(&counts[e], 1);
  }
}

// offsets[e] = sum of counts[0..e), offsets[E] = total. One block of 256 threads, any E.
__global__ void exclusive_scan(const int* counts, int E, int* offsets) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int carry = 0;
  for (int start = 0; start < E; start += kScanThreads) {
    const int e = start + threadIdx.x;
    int v = e < E ? counts[e] : 0, x, agg;
    Scan(tmp).ExclusiveSum(v, x, agg);
    if (e < E) offsets[e] = carry + x;
    carry += agg;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets[E] = carry;
}

// Expert-major positions, one block (256 threads) per expert: entry j = t*K+k routed to e gets
// pos_of[j] = offsets[e] + (number of earlier entries routed to e); entry_of is the inverse.
__global__ void assign_positions(const int* ids, const int* n, int K, const int* offsets, int* pos_of,
                                 int* entry_of) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int e = blockIdx.x, total = *n * K;
  int base = offsets[e];
  for (int start = 0; start < total; start += kScanThreads) {
    const int j = start + threadIdx.x;
    const int f = (j < total && ids[j] == e) ? 1 : 0;
    int rank, agg;
    Scan(tmp).ExclusiveSum(f, rank, agg);
    if (f) {
      pos_of[j] = base + rank;
      entry_of[base + rank] = j;
    }
    base += agg;
    __syncthreads();
  }
}

// out[r] = x[entry_of[r] / K] for r < *rows (H a multiple of 8: 16-byte copies). Block per row.
__global__ void gather_rows(const bf16* x, const int* entry_of, const int* rows, int K, int H, bf16* out) {
  const int r = blockIdx.x;
  if (r >= *rows) return;
  const int4* src = reinterpret_cast<const int4*>(x + (size_t)(entry_of[r] / K) * H);
  int4* dst = reinterpret_cast<int4*>(out + (size_t)r * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = src[i];
}

// act[r, i] = silu(gu[r, i]) * gu[r, I + i] (times w[r] where w is given) for r < *rows. Block per row.
__global__ void swiglu(const bf16* gu, const int* rows, int I, const float* w, bf16* act) {
  const int r = blockIdx.x;
  if (r >= *rows) return;
  swiglu_row(gu + (size_t)r * 2 * I, I, w ? w[r] : 1.f, act + (size_t)r * I);
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

// Work list of the grouped GEMM: one (expert, first row) per 64-row tile of each expert's block
// [starts[e], ends[e]) (contiguous blocks pass offsets and offsets + 1). Single thread (E is
// small); tiles has room for ceil(rows / 64) + E entries.
__global__ void build_tiles(const int* starts, const int* ends, int E, int* tiles, int* n_tiles) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int n = 0;
  for (int e = 0; e < E; e++)
    for (int m = starts[e]; m < ends[e]; m += kTile) {
      tiles[2 * n] = e;
      tiles[2 * n + 1] = m;
      n++;
    }
  *n_tiles = n;
}

// Grouped GEMM on tensor cores: for each tile (e, m0), Y[m0:m0+64, n0:n0+64] = X[rows] . W_e^T,
// W_e [N, Kd] row-major (an nn.Linear weight), bf16 in, f32 accumulate, bf16 out. Rows past the
// expert's block are not written. N % 64 == 0, Kd % 32 == 0. Grid (N / 64, max tiles); 128 threads.
__global__ void __launch_bounds__(128) grouped_gemm(const bf16* X, const bf16* W, const int* ends,
                                                    const int* tiles, const int* n_tiles, int N, int Kd, bf16* Y) {
  using namespace nvcuda;
  if ((int)blockIdx.y >= *n_tiles) return;
  const int e = tiles[2 * blockIdx.y], m0 = tiles[2 * blockIdx.y + 1];
  const int m_end = ends[e], n0 = blockIdx.x * kTile;
  const bf16* We = W + (size_t)e * N * Kd;
  constexpr int kLd = kTileK + 8;
  __shared__ __align__(32) bf16 As[kTile][kLd];
  __shared__ __align__(32) bf16 Bs[kTile][kLd];
  __shared__ __align__(32) float Cs[kTile][kTile + 4];
  const int warp = threadIdx.x / 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.f);
  for (int k0 = 0; k0 < Kd; k0 += kTileK) {
    // 64 rows x 32 columns = 256 chunks of 8 bf16 per operand; 2 per thread.
    for (int c = threadIdx.x; c < kTile * kTileK / 8; c += blockDim.x) {
      const int r = c / (kTileK / 8), col = (c % (kTileK / 8)) * 8;
      int4 a = make_int4(0, 0, 0, 0);
      if (m0 + r < m_end) a = *reinterpret_cast<const int4*>(X + (size_t)(m0 + r) * Kd + k0 + col);
      *reinterpret_cast<int4*>(&As[r][col]) = a;
      *reinterpret_cast<int4*>(&Bs[r][col]) = *reinterpret_cast<const int4*>(We + (size_t)(n0 + r) * Kd + k0 + col);
    }
    __syncthreads();
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b[2];
      for (int i = 0; i < 2; i++) wmma::load_matrix_sync(a[i], &As[wm + 16 * i][kk], kLd);
      for (int j = 0; j < 2; j++) wmma::load_matrix_sync(b[j], &Bs[wn + 16 * j][kk], kLd);
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++)
      wmma::store_matrix_sync(&Cs[wm + 16 * i][wn + 16 * j], acc[i][j], kTile + 4, wmma::mem_row_major);
  __syncthreads();
  for (int c = threadIdx.x; c < kTile * kTile; c += blockDim.x) {
    const int r = c / kTile, col = c % kTile;
    if (m0 + r < m_end) Y[(size_t)(m0 + r) * N + n0 + col] = __float2bfloat16(Cs[r][col]);
  }
}

// The same grouped GEMM with 64 x 128 output tiles for N % 128 == 0: 8 warps (2 along M, 4 along
// N, 32 x 32 each), and the next K slice loaded with cp.async while the tensor cores work on this
// one (two stages), so weight reads overlap the math. Rows past the expert's block are zero-filled
// on load and not written.
constexpr int kWideN = 128;
constexpr int kLdW = kTileK + 8;  // padded row (bf16) of a shared-memory operand tile
constexpr int kStageA = kTile * kLdW, kStageB = kWideN * kLdW;
constexpr int kWideSmem = 2 * (kStageA + kStageB) * 2 > kTile * (kWideN + 4) * 4
                              ? 2 * (kStageA + kStageB) * 2
                              : kTile * (kWideN + 4) * 4;

__global__ void __launch_bounds__(256) grouped_gemm_wide(const bf16* X, const bf16* W, const int* ends,
                                                         const int* tiles, const int* n_tiles, int N, int Kd,
                                                         bf16* Y) {
  using namespace nvcuda;
  if ((int)blockIdx.y >= *n_tiles) return;
  const int e = tiles[2 * blockIdx.y], m0 = tiles[2 * blockIdx.y + 1];
  const int m_end = ends[e], n0 = blockIdx.x * kWideN;
  const bf16* We = W + (size_t)e * N * Kd;
  __shared__ __align__(128) unsigned char smem[kWideSmem];
  bf16* As = reinterpret_cast<bf16*>(smem);
  bf16* Bs = As + 2 * kStageA;
  const int warp = threadIdx.x / 32;
  const int wm = (warp / 4) * 32, wn = (warp % 4) * 32;
  // One stage: A 64 x 32 (256 chunks of 8 bf16, one per thread), B 128 x 32 (two per thread).
  auto load = [&](int stage, int k0) {
    {
      const int r = threadIdx.x / 4, col = (threadIdx.x % 4) * 8;
      const bool ok = m0 + r < m_end;
      const bf16* src = X + (size_t)(ok ? m0 + r : m0) * Kd + k0 + col;
      cp_async16(As + stage * kStageA + r * kLdW + col, src, ok);
    }
    for (int c = threadIdx.x; c < kWideN * 4; c += 256) {
      const int r = c / 4, col = (c % 4) * 8;
      cp_async16(Bs + stage * kStageB + r * kLdW + col, We + (size_t)(n0 + r) * Kd + k0 + col, true);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.f);
  const int steps = Kd / kTileK;
  load(0, 0);
  for (int s = 0; s < steps; s++) {
    const int cur = s & 1;
    if (s + 1 < steps) {
      load(cur ^ 1, (s + 1) * kTileK);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();
    const bf16* a_s = As + cur * kStageA;
    const bf16* b_s = Bs + cur * kStageB;
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b[2];
      for (int i = 0; i < 2; i++) wmma::load_matrix_sync(a[i], a_s + (wm + 16 * i) * kLdW + kk, kLdW);
      for (int j = 0; j < 2; j++) wmma::load_matrix_sync(b[j], b_s + (wn + 16 * j) * kLdW + kk, kLdW);
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();  // the next iteration's load overwrites this stage
  }
  float* Cs = reinterpret_cast<float*>(smem);
  constexpr int kLdC = kWideN + 4;
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++)
      wmma::store_matrix_sync(Cs + (wm + 16 * i) * kLdC + wn + 16 * j, acc[i][j], kLdC, wmma::mem_row_major);
  __syncthreads();
  for (int c = threadIdx.x; c < kTile * kWideN / 2; c += 256) {
    const int r = c / (kWideN / 2), col = (c % (kWideN / 2)) * 2;
    if (m0 + r < m_end)
      *reinterpret_cast<__nv_bfloat162*>(Y + (size_t)(m0 + r) * N + n0 + col) =
          __floats2bfloat162_rn(Cs[r * kLdC + col], Cs[r * kLdC + col + 1]);
  }
}

// ---- Expert-parallel data movement (the `nccl` backend's exchange) ----
// Each rank sends every peer one slot of C rows (C = tokens x min(K, local experts), the most a
// peer can receive from one source), so transfer sizes are fixed and the exchange is capturable.

__global__ void f32_to_bf16(const float* x, const int* n, int H, bf16* y) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (size_t)*n * H) y[i] = __float2bfloat16(x[i]);
}

// x[i] = float(src[i]) for the first n rows of H: the home rows as the client sent them, copied
// straight from the host ring (bf16, or f16 when f16 != 0). Launched with n known on the host.
__global__ void widen_rows(const unsigned short* src, int f16, int n, int H, float* x) {
  const size_t total = (size_t)n * H;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const unsigned short v = src[i];
    x[i] = f16 ? __half2float(__ushort_as_half(v)) : __uint_as_float((unsigned)v << 16);
  }
}

// out[i] = x[i] rounded to nearest even as bf16 (or f16 when f16 != 0): the output rows in the
// dtype the client asked for, for the copy straight into the host ring.
__global__ void narrow_rows(const float* x, int f16, int n, int H, unsigned short* out) {
  const size_t total = (size_t)n * H;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    out[i] = f16 ? __half_as_ushort(__float2half_rn(x[i])) : __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
  }
}

// *first = min(*first, i) for each element i of x[0, n) that is not finite: a client's hidden
// states in its own device memory, checked before admission as host ones are. kind: 0 f32, 1
// bf16, 2 f16. Byte loads only: the client picks the offset, so x need not be aligned.
__global__ void first_non_finite(const unsigned char* x, unsigned long long n, int kind,
                                 unsigned long long* first) {
  const int size = kind == 0 ? 4 : 2;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    // The top two bytes (little-endian) hold the sign and the exponent.
    const unsigned char hi = x[i * size + size - 1], lo = x[i * size + size - 2];
    const bool bad = kind == 2 ? (hi & 0x7c) == 0x7c : (hi & 0x7f) == 0x7f && (lo & 0x80);
    if (bad) atomicMin(first, i);
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

// FP8 experts: pack_slots's rows quantised on the way out (fp8_rule.cuh), each slot row R bytes:
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

// ---- NCCL EP glue ----

// y[r] *= w[r] for r < *rows (HT combine takes rows already weighted). Block per row.
__global__ void scale_rows(bf16* y, const float* w, const int* rows, int H) {
  const int r = blockIdx.x;
  if (r >= *rows) return;
  const float s = w[r];
  for (int h = threadIdx.x; h < H; h += blockDim.x)
    y[(size_t)r * H + h] = __float2bfloat16(__bfloat162float(y[(size_t)r * H + h]) * s);
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

// SwiGLU over the masked layout's filled rows: expert e's rows [e * S, e * S + counts[e]).
// Grid (L, Y): block (e, y) takes rows y, y + Y, ... of expert e, so a few rows per expert (decode)
// spread over Y blocks instead of waiting on one.
__global__ void swiglu_masked(const bf16* gu, const int* counts, int S, int I, bf16* act) {
  const int e = blockIdx.x, c = min(counts[e], S);
  for (int r = blockIdx.y; r < c; r += gridDim.y) {
    const size_t row = (size_t)e * S + r;
    swiglu_row(gu + row * 2 * I, I, 1.f, act + row * I);
  }
}

// The SwiGLU activation over the grouped GEMM's tiles only (rows not contiguous, as in the
// low-latency layout): block per tile, rows [m0, min(m0 + 64, ends[e])).
__global__ void swiglu_tiles(const bf16* gu, const int* tiles, const int* n_tiles, const int* ends, int I,
                             bf16* act) {
  if ((int)blockIdx.x >= *n_tiles) return;
  const int e = tiles[2 * blockIdx.x], m0 = tiles[2 * blockIdx.x + 1];
  const int m1 = min(m0 + kTile, ends[e]);
  for (int r = m0; r < m1; r++) swiglu_row(gu + (size_t)r * 2 * I, I, 1.f, act + (size_t)r * I);
}

// out[t] = x[t] (+ shared[t]) in f32 for t < *n: the combined bf16 rows into the output. Grid
// (n_cap, ceil(H / 8 / blockDim)): 8 columns (16 bytes) per thread; H % 8 == 0.
__global__ void widen_add(const bf16* x, const bf16* shared, const int* n, int H, float* out) {
  const int t = blockIdx.x, h = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
  if (t >= *n || h >= H) return;
  const size_t at = (size_t)t * H + h;
  const uint4 x4 = *reinterpret_cast<const uint4*>(x + at);
  const bf16* xs = reinterpret_cast<const bf16*>(&x4);
  float v[8];
#pragma unroll
  for (int q = 0; q < 8; q++) v[q] = __bfloat162float(xs[q]);
  if (shared) {
    const uint4 s4 = *reinterpret_cast<const uint4*>(shared + at);
    const bf16* ss = reinterpret_cast<const bf16*>(&s4);
#pragma unroll
    for (int q = 0; q < 8; q++) v[q] += __bfloat162float(ss[q]);
  }
  float4* o = reinterpret_cast<float4*>(out + at);
  o[0] = make_float4(v[0], v[1], v[2], v[3]);
  o[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// ---- Benchmark inputs ----

__device__ inline float hash_uniform(unsigned long long seed, size_t i) {
  unsigned long long z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)(z >> 40) * (1.f / 16777216.f) * 2.f - 1.f;  // [-1, 1)
}

// x[i] = scale * U[-1, 1) from (seed, i): random weights and inputs made on the GPU.
__global__ void fill_uniform_bf16(bf16* x, size_t n, unsigned long long seed, float scale) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    x[i] = __float2bfloat16(scale * hash_uniform(seed, i));
}

__global__ void fill_uniform_f32(float* x, size_t n, unsigned long long seed, float scale) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    x[i] = scale * hash_uniform(seed, i);
}

}  // extern "C"
