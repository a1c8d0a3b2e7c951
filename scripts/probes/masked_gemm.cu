// DeepGEMM SM90 bf16 masked instances on decode's expert shapes (64 experts, stride 512, ~16 rows
// each), timed one kernel at a time; plus the same launches with programmatic dependent launch.
#include "common.cuh"
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>
#include <random>
using namespace deep_gemm;
using cute::UMMA::Major;
constexpr int GROUPS = 256, CTAS = 132;

template <int BM, int BN, int ST, int CTA = CTAS>
struct Inst {
  static constexpr auto f = &sm90_bf16_gemm_impl<Major::K, Major::K, 0, 0, 0, GROUPS, BM, BN, 64, 128, 128, 128, ST, 128, 128, 1, false, CTA,
                                                 GemmType::MGroupedMasked, false, cutlass::bfloat16_t>;
  static int smem() { return ((BM * BN * 2 + 1023) / 1024 * 1024) + ST * (BM + BN) * 64 * 2 + ST * 16; }
};

struct Shape { const char* name; int n, k; void* w; };
int *d_counts; void *d_x, *d_y; const int S = 512, L = 64; Shape shapes[2];

template <int BM, int BN, int ST, int CTA = CTAS>
void launch(const Shape& s, cudaStream_t st, bool pdl) {
  using I = Inst<BM, BN, ST, CTA>;
  static bool init = false;
  static CUtensorMap a[2], b[2], d[2];
  if (!init) {
    CK(cudaFuncSetAttribute(I::f, cudaFuncAttributeMaxDynamicSharedMemorySize, I::smem())); init = true;
    for (int i = 0; i < 2; i++) { const Shape& t = shapes[i]; a[i] = map2d(d_x, t.k, (uint64_t)L * S, BM); b[i] = map2d(t.w, t.k, (uint64_t)L * t.n, BN); d[i] = map2d(d_y, t.n, (uint64_t)L * S, BM); }
  }
  const int i = &s == &shapes[0] ? 0 : 1;
  cudaLaunchConfig_t c = {}; c.gridDim = CTA; c.blockDim = 256; c.dynamicSmemBytes = I::smem(); c.stream = st;
  cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = at; c.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&c, I::f, d_counts, (uint32_t)S, (uint32_t)s.n, (uint32_t)s.k, a[i], b[i], d[i]));
}

template <int BM, int BN, int ST, int CTA = CTAS>
void row(Shape* sh, cudaStream_t st) {
  float t[2], sum = 0; double bytes = 0;
  for (int i = 0; i < 2; i++) {
    t[i] = median_us([&] { launch<BM, BN, ST, CTA>(sh[i], st, false); }, 30);
    sum += t[i]; bytes += (double)L * sh[i].n * sh[i].k * 2;
  }
  // Both back to back, the second launched programmatically (PDL) or not.
  float pair = median_us([&] { launch<BM, BN, ST, CTA>(sh[0], st, false); launch<BM, BN, ST, CTA>(sh[1], st, false); }, 30);
  float pdl = median_us([&] { launch<BM, BN, ST, CTA>(sh[0], st, false); launch<BM, BN, ST, CTA>(sh[1], st, true); }, 30);
  printf("%2dx%3d st%d ctas %3d: up %7.1f us (%.3f TB/s) down %7.1f us (%.3f TB/s) | pair %7.1f (%.3f TB/s) pdl %7.1f\n", BM, BN, ST, CTA,
         t[0], L * (double)sh[0].n * sh[0].k * 2 / t[0] / 1e6, t[1], L * (double)sh[1].n * sh[1].k * 2 / t[1] / 1e6, pair, bytes / pair / 1e6, pdl);
}

int main() {
  const int H = 7168, I = 2048;
  __nv_bfloat16 *wgu, *wdn, *x, *y;
  CK(cudaMalloc(&wgu, (size_t)L * 2 * I * H * 2)); CK(cudaMalloc(&wdn, (size_t)L * H * I * 2));
  CK(cudaMalloc(&x, (size_t)L * S * H * 2)); CK(cudaMalloc(&y, (size_t)L * S * H * 2));
  fill<<<1024, 256>>>(wgu, (size_t)L * 2 * I * H, 0.02f); fill<<<1024, 256>>>(wdn, (size_t)L * H * I, 0.02f); fill<<<1024, 256>>>(x, (size_t)L * S * H, 1.f);
  d_x = x; d_y = y;
  // 512 tokens x top-8 over 256 experts: this rank's 64 experts' counts.
  std::mt19937 rng(1); std::vector<int> c(GROUPS, 0);
  for (int t = 0; t < 512; t++) { std::vector<int> e(256); for (int i = 0; i < 256; i++) e[i] = i; std::shuffle(e.begin(), e.end(), rng); for (int k = 0; k < 8; k++) if (e[k] < L) c[e[k]]++; }
  int mn = 99, mx = 0, tot = 0; for (int i = 0; i < L; i++) { mn = std::min(mn, c[i]); mx = std::max(mx, c[i]); tot += c[i]; }
  printf("counts: %d rows, %d..%d per expert\n", tot, mn, mx);
  CK(cudaMalloc(&d_counts, GROUPS * 4)); CK(cudaMemcpy(d_counts, c.data(), GROUPS * 4, cudaMemcpyHostToDevice));
  shapes[0] = {"up", 2 * I, H, wgu}; shapes[1] = {"down", H, I, wdn}; Shape* sh = shapes;
  cudaStream_t st; cudaStreamCreate(&st);
  row<32, 256, 5>(sh, st);
  row<32, 256, 4>(sh, st);
  row<32, 256, 3>(sh, st);
  row<32, 128, 8>(sh, st);
  row<32, 128, 6>(sh, st);
  row<32, 128, 4>(sh, st);
  row<64, 256, 4>(sh, st);
  row<64, 256, 3>(sh, st);
  row<32, 256, 5, 128>(sh, st);
  row<32, 256, 5, 120>(sh, st);
  row<32, 256, 3, 128>(sh, st);
  row<32, 256, 5>(sh, st);
  CK(cudaDeviceSynchronize());
  return 0;
}
