// The weight-streaming decode GEMM (kernels/decode_gemm.cuh) on decode's expert shapes (64
// experts of deepseek-v3, stride 512): its outputs against an f64 reference on the host for a few
// experts (a hot one included), its times against DeepGEMM's masked 32 x 256 instance plus
// SwiGLU (what it replaced) in the same run, and the two kernels' outputs compared. Then draws of
// 16 to 128 rows per expert on average against DeepGEMM's 64 x 256 instance, which the step runs
// for experts of more rows: where one stops paying (`DecodeGemm::takes`).
#include "common.cuh"
#include "../../kernels/decode_gemm.cuh"
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>
#include <cmath>
#include <random>
using namespace deep_gemm;
using cute::UMMA::Major;
using bf = __nv_bfloat16;
constexpr int GROUPS = 256;
const int H = 7168, I = 2048, L = 64, S = 512;

__global__ void swiglu_masked(const bf* gu, const int* counts, int S, int I, bf* act) {
  const int e = blockIdx.x, c = min(counts[e], S);
  for (int r = blockIdx.y; r < c; r += gridDim.y)
    for (int i = threadIdx.x; i < I; i += blockDim.x) {
      const size_t row = (size_t)e * S + r;
      const float a = __bfloat162float(gu[row * 2 * I + i]), u = __bfloat162float(gu[row * 2 * I + I + i]);
      act[row * I + i] = __float2bfloat16(a / (1.f + expf(-a)) * u);
    }
}

int sms;
int* ticket;  // the kernel's two ints, zero between launches
void ours(bool gated, const CUtensorMap& w, const CUtensorMap& x, const int* counts, int n, int k, bf* y) {
  auto f = gated ? decode_gemm_gated : decode_gemm_plain;
  f<<<sms, decode_gemm::kThreads, decode_gemm::kSmem>>>(w, x, counts, L, S, n, k, y, ticket);
}
// DeepGEMM's masked instances of BM x 256 tiles, ST stages, one math warpgroup: 32 x 256 with 5
// stages is what the decode GEMM replaced; 64 x 256 with 4 the step's for experts of more rows
// (build.rs's HOPPER_TILES).
template <int BM, int ST>
constexpr auto dg_masked = &sm90_bf16_gemm_impl<Major::K, Major::K, 0, 0, 0, GROUPS, BM, 256, 64, 128, 128, 128, ST, 128, 128, 1,
                                                false, 132, GemmType::MGroupedMasked, false, cutlass::bfloat16_t>;
template <int BM, int ST>
void deepgemm(const int* counts, int n, int k, const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& d) {
  const int smem = BM * 256 * 2 + ST * (BM + 256) * 64 * 2 + ST * 16;
  static const bool ready = [&] {
    CK(cudaFuncSetAttribute(dg_masked<BM, ST>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)ready;
  cudaLaunchConfig_t c = {}; c.gridDim = 132; c.blockDim = 256; c.dynamicSmemBytes = smem;
  CK(cudaLaunchKernelEx(&c, dg_masked<BM, ST>, (int*)counts, (uint32_t)S, (uint32_t)n, (uint32_t)k, a, b, d));
}

std::vector<float> host(const bf* d, size_t n) {
  std::vector<bf> h(n); CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(n); for (size_t i = 0; i < n; i++) f[i] = __bfloat162float(h[i]); return f;
}

int main() {
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaFuncSetAttribute(decode_gemm_plain, cudaFuncAttributeMaxDynamicSharedMemorySize, decode_gemm::kSmem));
  CK(cudaFuncSetAttribute(decode_gemm_gated, cudaFuncAttributeMaxDynamicSharedMemorySize, decode_gemm::kSmem));
  CK(cudaMalloc(&ticket, 8)); CK(cudaMemset(ticket, 0, 8));
  bf *wgu, *wdn, *x, *gu, *act, *act2, *y, *y2;
  CK(cudaMalloc(&wgu, (size_t)L * 2 * I * H * 2)); CK(cudaMalloc(&wdn, (size_t)L * H * I * 2));
  CK(cudaMalloc(&x, (size_t)L * S * H * 2)); CK(cudaMalloc(&gu, (size_t)L * S * 2 * I * 2));
  CK(cudaMalloc(&act, (size_t)L * S * I * 2)); CK(cudaMalloc(&act2, (size_t)L * S * I * 2));
  CK(cudaMalloc(&y, (size_t)L * S * H * 2)); CK(cudaMalloc(&y2, (size_t)L * S * H * 2));
  fill<<<1024, 256>>>(wgu, (size_t)L * 2 * I * H, 0.02f, 1); fill<<<1024, 256>>>(wdn, (size_t)L * H * I, 0.02f, 2);
  fill<<<1024, 256>>>(x, (size_t)L * S * H, 1.f, 3);
  // Decode: 512 tokens x top-8 over 256 experts, this rank's 64; then expert 5 made hot (200
  // rows), expert 6 given 33 rows (one row past a chunk), expert 7 none.
  std::mt19937 rng(1); std::vector<int> c(GROUPS, 0);
  for (int t = 0; t < 512; t++) { std::vector<int> e(256); for (int i = 0; i < 256; i++) e[i] = i; std::shuffle(e.begin(), e.end(), rng); for (int k = 0; k < 8; k++) if (e[k] < L) c[e[k]]++; }
  std::vector<int> hot = c; hot[5] = 200; hot[6] = 33; hot[7] = 0;
  int *d_c, *d_hot; CK(cudaMalloc(&d_c, GROUPS * 4)); CK(cudaMalloc(&d_hot, GROUPS * 4));
  CK(cudaMemcpy(d_c, c.data(), GROUPS * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(d_hot, hot.data(), GROUPS * 4, cudaMemcpyHostToDevice));
  int tot = 0, mx = 0; for (int i = 0; i < L; i++) { tot += c[i]; mx = std::max(mx, c[i]); }
  printf("decode counts: %d rows over %d experts, at most %d\n", tot, L, mx);

  CUtensorMap w_up = map2d(wgu, H, (uint64_t)L * 2 * I, 128), w_dn = map2d(wdn, I, (uint64_t)L * H, 128);
  CUtensorMap x_up = map2d(x, H, (uint64_t)L * S, 32), x_dn = map2d(act, I, (uint64_t)L * S, 32);
  // Correctness, on the hot counts: gated up into act, plain down into y; f64 on the host, every
  // row, every 13th column (13 is prime to the kernel's 8-, 16- and 128-column patterns).
  CK(cudaMemset(act, 0xff, (size_t)L * S * I * 2)); CK(cudaMemset(y, 0xff, (size_t)L * S * H * 2));
  ours(true, w_up, x_up, d_hot, 2 * I, H, act); ours(false, w_dn, x_dn, d_hot, H, I, y);
  CK(cudaDeviceSynchronize());
  int bad = 0;
  for (int e : {0, 5, 6, 7, 63}) {
    const int rows = hot[e];
    auto W = host(wgu + (size_t)e * 2 * I * H, (size_t)2 * I * H), D = host(wdn + (size_t)e * H * I, (size_t)H * I);
    auto X = host(x + (size_t)e * S * H, (size_t)S * H), A = host(act + (size_t)e * S * I, (size_t)S * I), Y = host(y + (size_t)e * S * H, (size_t)S * H);
    double ea = 0, ma = 0, ey = 0, my = 0; int untouched = 0;
    for (int r = 0; r < rows; r++) {
      for (int i = 0; i < I; i += 13) {
        double g = 0, u = 0;
        for (int k = 0; k < H; k++) { g += (double)X[r * H + k] * W[(size_t)i * H + k]; u += (double)X[r * H + k] * W[(size_t)(I + i) * H + k]; }
        const double ref = g / (1 + exp(-g)) * u;
        ea = std::max(ea, fabs(ref - A[(size_t)r * I + i])); ma = std::max(ma, fabs(ref));
      }
      for (int n = 0; n < H; n += 13) {
        double s = 0;
        for (int k = 0; k < I; k++) s += (double)A[(size_t)r * I + k] * D[(size_t)n * I + k];
        ey = std::max(ey, fabs(s - Y[(size_t)r * H + n])); my = std::max(my, fabs(s));
      }
    }
    // Rows past the count stay as they were (all ones bits: NaN).
    for (int r = rows; r < std::min(rows + 8, S); r++) untouched += !std::isnan(A[(size_t)r * I]) + !std::isnan(Y[(size_t)r * H + H - 1]);
    const bool ok = ea <= 1e-2 * std::max(ma, 1e-3) && ey <= 1e-2 * std::max(my, 1e-3) && untouched == 0;
    bad += !ok;
    printf("expert %2d, %3d rows: gated worst %.3e of %.3e, down worst %.3e of %.3e, rows past the count written %d: %s\n", e, rows, ea, ma, ey, my, untouched, ok ? "ok" : "BAD");
  }

  double up_b = (double)L * 2 * I * H * 2, dn_b = (double)L * H * I * 2;
  CUtensorMap a_up = map2d(x, H, (uint64_t)L * S, 32), b_up = map2d(wgu, H, (uint64_t)L * 2 * I, 256), d_up = map2d(gu, 2 * I, (uint64_t)L * S, 32);
  CUtensorMap a_dn = map2d(act2, I, (uint64_t)L * S, 32), b_dn = map2d(wdn, I, (uint64_t)L * H, 256), d_dn = map2d(y2, H, (uint64_t)L * S, 32);
  for (int which = 0; which < 2; which++) {
    const int* cnt = which ? d_hot : d_c;
    const char* name = which ? "hot" : "decode";
    float su = median_us([&] { ours(true, w_up, x_up, cnt, 2 * I, H, act); }, 30);
    float sd = median_us([&] { ours(false, w_dn, x_dn, cnt, H, I, y); }, 30);
    float sp = median_us([&] { ours(true, w_up, x_up, cnt, 2 * I, H, act); ours(false, w_dn, x_dn, cnt, H, I, y); }, 30);
    float du = median_us([&] { deepgemm<32, 5>(cnt, 2 * I, H, a_up, b_up, d_up); }, 30);
    float dd = median_us([&] { deepgemm<32, 5>(cnt, H, I, a_dn, b_dn, d_dn); }, 30);
    float dp = median_us([&] { deepgemm<32, 5>(cnt, 2 * I, H, a_up, b_up, d_up); swiglu_masked<<<dim3(L, 32), 256>>>(gu, cnt, S, I, act2); deepgemm<32, 5>(cnt, H, I, a_dn, b_dn, d_dn); }, 30);
    printf("%-6s decode_gemm: gated up %7.1f us (%.3f TB/s), down %7.1f us (%.3f TB/s), both %7.1f us (%.3f TB/s)\n", name, su, up_b / su / 1e6, sd, dn_b / sd / 1e6, sp, (up_b + dn_b) / sp / 1e6);
    printf("%-6s deepgemm 32x256 st5: up %7.1f us, down %7.1f us, up + swiglu + down %7.1f us (%.3f TB/s)\n", name, du, dd, dp, (up_b + dn_b) / dp / 1e6);
  }
  // Ours against DeepGEMM (+ SwiGLU) on the decode counts, every valid row: how many outputs
  // differ at all, and the largest difference.
  ours(true, w_up, x_up, d_c, 2 * I, H, act); ours(false, w_dn, x_dn, d_c, H, I, y);
  deepgemm<32, 5>(d_c, 2 * I, H, a_up, b_up, d_up); swiglu_masked<<<dim3(L, 32), 256>>>(gu, d_c, S, I, act2); deepgemm<32, 5>(d_c, H, I, a_dn, b_dn, d_dn);
  CK(cudaDeviceSynchronize());
  for (int which = 0; which < 2; which++) {
    const int cols = which ? H : I;
    auto A = host(which ? y : act, (size_t)L * S * cols), B = host(which ? y2 : act2, (size_t)L * S * cols);
    size_t n = 0, differ = 0; double worst = 0;
    for (int e = 0; e < L; e++)
      for (size_t i = (size_t)e * S * cols; i < ((size_t)e * S + c[e]) * cols; i++) {
        n++; differ += A[i] != B[i]; worst = std::max(worst, (double)fabsf(A[i] - B[i]));
      }
    printf("%s against DeepGEMM's: %zu of %zu outputs differ, largest difference %.3e\n", which ? "down" : "gated up", differ, n, worst);
  }
  // Larger draws: `tokens` x top-8 over 256 experts, this rank's 64. Ours (both passes, SwiGLU
  // fused) against DeepGEMM 64 x 256 + SwiGLU + DeepGEMM 64 x 256 (the probe's SwiGLU is the
  // plain one, slower than the step's `swiglu_masked`; it is timed alone so it can be left out),
  // medians of 30; then the outputs compared.
  CUtensorMap a64_up = map2d(x, H, (uint64_t)L * S, 64), d64_up = map2d(gu, 2 * I, (uint64_t)L * S, 64);
  CUtensorMap a64_dn = map2d(act2, I, (uint64_t)L * S, 64), d64_dn = map2d(y2, H, (uint64_t)L * S, 64);
  for (int tokens : {512, 768, 1024, 1536, 2048, 4096}) {
    std::vector<int> cc(GROUPS, 0);
    for (int t = 0; t < tokens; t++) { std::vector<int> e(256); for (int i = 0; i < 256; i++) e[i] = i; std::shuffle(e.begin(), e.end(), rng); for (int k = 0; k < 8; k++) if (e[k] < L) cc[e[k]]++; }
    int rows = 0, most = 0; for (int i = 0; i < L; i++) { rows += cc[i]; most = std::max(most, cc[i]); }
    CK(cudaMemcpy(d_c, cc.data(), GROUPS * 4, cudaMemcpyHostToDevice));
    float sp = median_us([&] { ours(true, w_up, x_up, d_c, 2 * I, H, act); ours(false, w_dn, x_dn, d_c, H, I, y); }, 30);
    float dp = median_us([&] { deepgemm<64, 4>(d_c, 2 * I, H, a64_up, b_up, d64_up); deepgemm<64, 4>(d_c, H, I, a64_dn, b_dn, d64_dn); }, 30);
    float sw = median_us([&] { swiglu_masked<<<dim3(L, 32), 256>>>(gu, d_c, S, I, act2); }, 30);
    ours(true, w_up, x_up, d_c, 2 * I, H, act); ours(false, w_dn, x_dn, d_c, H, I, y);
    deepgemm<64, 4>(d_c, 2 * I, H, a64_up, b_up, d64_up); swiglu_masked<<<dim3(L, 32), 256>>>(gu, d_c, S, I, act2); deepgemm<64, 4>(d_c, H, I, a64_dn, b_dn, d64_dn);
    CK(cudaDeviceSynchronize());
    auto A = host(y, (size_t)L * S * H), B = host(y2, (size_t)L * S * H);
    size_t n = 0, differ = 0;
    for (int e = 0; e < L; e++)
      for (size_t i = (size_t)e * S * H; i < ((size_t)e * S + cc[e]) * H; i++) { n++; differ += A[i] != B[i]; }
    printf("%4d tokens, %4d rows (mean %5.1f, most %3d): decode_gemm %7.1f us, deepgemm 64x256 up + down %7.1f us (+ probe SwiGLU %5.1f us); down outputs differing %zu of %zu\n",
           tokens, rows, rows / (double)L, most, sp, dp, sw, differ, n);
  }
  int tk[2]; CK(cudaMemcpy(tk, ticket, 8, cudaMemcpyDeviceToHost));
  printf("ticket after every launch: %d %d\n", tk[0], tk[1]);
  bad += tk[0] != 0 || tk[1] != 0;
  printf("%s\n", bad ? "FAILED" : "all checked experts ok");
  return bad != 0;
}
