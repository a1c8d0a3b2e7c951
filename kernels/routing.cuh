// Routing: the router GEMM's bf16 pieces, top-k of the gate's logits (softmax, or sigmoid with
// group-limited picks; in registers when the experts fit), and each entry's expert-major position.
// One of epserve.cu's parts (its includes and `bf16` come from there).
#pragma once

namespace {

constexpr int kScanThreads = 256;

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

// Logit e of one row stored as `parts` slices of E (the router's pieces, see `bf16_pieces`),
// summed smallest piece first; one slice is the plain logit.
__device__ inline float logit(const float* row, int E, int parts, int e) {
  float v = row[(parts - 1) * E + e];
  for (int p = parts - 2; p >= 0; p--) v += row[p * E + e];
  return v;
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

// Each routed entry's logical expert to one of its replicas' slots (the placement's table:
// rep[e][r] the replicas this rank's tokens may use, cnt[e] how many), spread by the token's
// index so an expert's rows divide evenly over its replicas. Every entry of the bucket is
// written: past the step's tokens, and for pad entries (-1), -1.
__global__ void to_slots(const int* ids, int* out, const int* n, int K, int bucket, const int* rep,
                         const int* cnt, int R, int rank) {
  const int live = min(*n, bucket) * K;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < bucket * K; j += gridDim.x * blockDim.x) {
    const int e = j < live ? ids[j] : -1;
    out[j] = e < 0 ? -1 : rep[e * R + (j / K + rank) % cnt[e]];
  }
}

// Each routed entry's slot to NCCL EP's expert number in a group of fewer ranks than slots were
// placed on (a lost rank left it): map[slot] = its rank's place among the members x L + the
// slot's place on its rank. Entries of -1 stay -1. Every entry of the bucket is written.
__global__ void renumber(const int* ids, const int* map, int* out, int count) {
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < count; j += gridDim.x * blockDim.x) {
    const int s = ids[j];
    out[j] = s < 0 ? -1 : map[s];
  }
}

}  // extern "C"
