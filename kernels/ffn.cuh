// The experts' FFN on the tiled path: the bf16 grouped GEMMs over 64-row tiles, SwiGLU (over
// packed rows, the masked layout, or the GEMM's tiles), and gate weights applied to expert rows.
// One of epserve.cu's parts (its includes and `bf16` come from there).
#pragma once

namespace {

constexpr int kTile = 64;
constexpr int kTileK = 32;

// 16 bytes from global to shared, bypassing L1; `fill` false: 16 zero bytes instead.
__device__ inline void cp_async16(void* dst, const void* src, bool fill) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(fill ? 16 : 0));
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

// act[r, i] = silu(gu[r, i]) * gu[r, I + i] (times w[r] where w is given) for r < *rows. Block per row.
__global__ void swiglu(const bf16* gu, const int* rows, int I, const float* w, bf16* act) {
  const int r = blockIdx.x;
  if (r >= *rows) return;
  swiglu_row(gu + (size_t)r * 2 * I, I, w ? w[r] : 1.f, act + (size_t)r * I);
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

// y[r] *= w[r] for r < *rows (HT combine takes rows already weighted). Block per row.
__global__ void scale_rows(bf16* y, const float* w, const int* rows, int H) {
  const int r = blockIdx.x;
  if (r >= *rows) return;
  const float s = w[r];
  for (int h = threadIdx.x; h < H; h += blockDim.x)
    y[(size_t)r * H + h] = __float2bfloat16(__bfloat162float(y[(size_t)r * H + h]) * s);
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

}  // extern "C"
