// Why an EPLB-balanced rank's experts phase is slower under skew (#54): DeepGEMM's SM90 psum
// GEMMs, bf16 and FP8, as kernels/hopper.cu and hopper_fp8.cu instantiate them, on one EP2
// rank's prefill rows of DeepSeek-V3 (gate/up 4096 x 7168, down 7168 x 2048) with the per-slot
// row counts of `epserve bench`'s routing (skew_counts.txt: a name, then rank 0's rows per slot
// in slot order; a unit test in server/backend/bench.rs keeps it the bench's), in that order,
// sorted hottest first and shuffled; each in DeepGEMM's tile order and in mixed_sched.cuh's at
// four shares of the CTAs. Checks that every order writes the same bits (every expert's rows),
// then times each GEMM (median of 20). PROBE_ONCE=1: the bit checks only (one launch of each,
// for a profiler). Timing only otherwise: random data.
#include "common.cuh"
#include "mixed_sched.cuh"  // instances of 252-255 groups
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>
#include <fstream>
#include <sstream>
#include <string>
using namespace deep_gemm;
using cute::UMMA::Major;

const int H = 7168, I = 2048, CTAS = 132, MAXG = 256;
constexpr auto PSUM = GemmType::MGroupedContiguousWithPsumLayout;

template <uint32_t G>
auto bf16_kernel() {
  return &sm90_bf16_gemm_impl<Major::K, Major::K, 0, 0, 0, G, 128, 256, 64, 128, 128, 128, 3, 128, 256, 1, false, CTAS,
                              PSUM, false, cutlass::bfloat16_t>;
}
template <uint32_t G>
auto fp8_kernel() {
  return &sm90_fp8_gemm_1d2d_impl<Major::K, 0, 0, 0, G, 128, 192, 128, 128, 128, 128, 4, 128, 256, 2, false, CTAS, PSUM,
                                  cutlass::bfloat16_t, 128>;
}


int bf16_smem() { return (128 * 256 * 2 + 1023) / 1024 * 1024 + 3 * (128 + 256) * 64 * 2 + 3 * 16; }
int fp8_smem(int k) {
  const int BN = 192, ST = 4;
  int d = (128 * BN * 2 + 1023) / 1024 * 1024, stage = (128 + BN) * 128, sfa = (128 * 4 + 127) / 128 * 128;
  int sfb = ((k / 128) * 2 * 4 + 7) / 8 * 8;
  return d + ST * (stage + sfa) + sfb + ST * 16;
}

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : "skew_counts.txt";
  std::ifstream in(path);
  std::vector<std::pair<std::string, std::vector<int>>> sets;
  for (std::string line; std::getline(in, line);) {
    std::istringstream s(line);
    std::string name;
    s >> name;
    std::vector<int> c;
    for (int x; s >> x;) c.push_back(x);
    if (!c.empty()) sets.push_back({name, c});
  }
  if (sets.empty()) {
    printf("no counts in %s\n", path);
    return 1;
  }
  int max_slots = 0;
  size_t cap = 0;
  for (auto& [n, c] : sets) {
    max_slots = std::max(max_slots, (int)c.size());
    size_t r = 0;
    for (int x : c) r += (x + 127) / 128 * 128;
    cap = std::max(cap, r);
  }
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  __nv_bfloat16 *x, *wgu, *wdn, *gu, *gu2, *act, *y, *y2;
  uint8_t *xq, *aq, *wgu8, *wdn8;
  float *xsf, *asf, *sgu, *sdn;
  const size_t L = max_slots;
  CK(cudaMalloc(&x, cap * H * 2));
  CK(cudaMalloc(&act, cap * I * 2));
  CK(cudaMalloc(&wgu, L * 2 * I * H * 2));
  CK(cudaMalloc(&wdn, L * H * I * 2));
  CK(cudaMalloc(&gu, cap * 2 * I * 2));
  CK(cudaMalloc(&gu2, cap * 2 * I * 2));
  CK(cudaMalloc(&y, cap * H * 2));
  CK(cudaMalloc(&y2, cap * H * 2));
  CK(cudaMalloc(&xq, cap * H));
  CK(cudaMalloc(&aq, cap * I));
  CK(cudaMalloc(&wgu8, L * 2 * I * H));
  CK(cudaMalloc(&wdn8, L * H * I));
  CK(cudaMalloc(&xsf, cap * (H / 128) * 4));
  CK(cudaMalloc(&asf, cap * (I / 128) * 4));
  CK(cudaMalloc(&sgu, L * (2 * I / 128) * (H / 128) * 4));
  CK(cudaMalloc(&sdn, L * (H / 128) * (I / 128) * 4));
  fill<<<1024, 256>>>(x, cap * H, 1.f, 1);
  fill<<<1024, 256>>>(act, cap * I, 1.f, 2);
  fill<<<1024, 256>>>(wgu, L * 2 * I * H, 0.05f, 3);
  fill<<<1024, 256>>>(wdn, L * H * I, 0.05f, 4);
  fill_bytes<<<1024, 256>>>(xq, cap * H);
  fill_bytes<<<1024, 256>>>(aq, cap * I);
  fill_bytes<<<1024, 256>>>(wgu8, L * 2 * I * H);
  fill_bytes<<<1024, 256>>>(wdn8, L * H * I);
  fill_f32<<<256, 256>>>(xsf, cap * (H / 128), 1e-2f);
  fill_f32<<<256, 256>>>(asf, cap * (I / 128), 1e-2f);
  fill_f32<<<256, 256>>>(sgu, L * (2 * I / 128) * (H / 128), 1e-3f);
  fill_f32<<<256, 256>>>(sdn, L * (H / 128) * (I / 128), 1e-3f);
  CK(cudaDeviceSynchronize());
  int* ends;
  CK(cudaMalloc(&ends, MAXG * 4));

  // DeepGEMM's order, then mixed_sched.cuh's at each share of the first stream.
  const char* orders[] = {"stock", "mix.50", "mix.60", "mix.70", "mix.80"};
  decltype(bf16_kernel<MAXG>()) bk[] = {bf16_kernel<MAXG>(), bf16_kernel<255>(), bf16_kernel<254>(), bf16_kernel<253>(), bf16_kernel<252>()};
  decltype(fp8_kernel<MAXG>()) fk[] = {fp8_kernel<MAXG>(), fp8_kernel<255>(), fp8_kernel<254>(), fp8_kernel<253>(), fp8_kernel<252>()};
  for (auto f : bk) CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, bf16_smem()));
  for (auto f : fk) CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, fp8_smem(H)));

  int rows = 0;
  auto launch_bf16 = [&](auto f, int n, int k, __nv_bfloat16* a, __nv_bfloat16* b, __nv_bfloat16* d) {
    auto ma = map2d(a, k, rows, 128), mb = map2d(b, k, L * n, 256), md = map2d(d, n, rows, 128);
    Clustered c(CTAS, 128 + 256, bf16_smem(), st, 1);
    CK(cudaLaunchKernelEx(&c.cfg, f, ends, 0u, (uint32_t)n, (uint32_t)k, ma, mb, md));
  };
  auto launch_fp8 = [&](auto f, int n, int k, uint8_t* a, float* sfa, uint8_t* b, float* sfb, __nv_bfloat16* d) {
    auto ma = map_rows(a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, rows, 128, 128, CU_TENSOR_MAP_SWIZZLE_128B);
    auto mb = map_rows(b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, L * n, 128, 192, CU_TENSOR_MAP_SWIZZLE_128B);
    auto md = map_rows(d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, n, rows, 64, 128, CU_TENSOR_MAP_SWIZZLE_128B);
    auto ms = map_rows(sfa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, cap, k / 128, 128, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
    Clustered c(CTAS, 128 + 256, fp8_smem(k), st, 2);
    CK(cudaLaunchKernelEx(&c.cfg, f, sfb, ends, 0u, (uint32_t)n, (uint32_t)k, ma, mb, md, ms));
  };

  std::mt19937 rng(11);
  for (auto& [name, counts] : sets) {
    std::vector<int> desc = counts, shuf = counts;
    std::sort(desc.begin(), desc.end(), [](int a, int b) { return a > b; });
    std::shuffle(shuf.begin(), shuf.end(), rng);
    for (auto [oname, c] : {std::pair{"kept", counts}, std::pair{"desc", desc}, std::pair{"shuffled", shuf}}) {
      std::vector<int> e(MAXG, 0), begin(c.size());
      int at = 0, tok = 0, one = 0;
      for (size_t g = 0; g < c.size(); g++) {
        begin[g] = at;
        e[g] = at + c[g];
        at = (e[g] + 127) / 128 * 128;
        tok += c[g];
        one += c[g] <= 128;
      }
      for (int g = c.size(); g < MAXG; g++) e[g] = at;
      rows = at;
      CK(cudaMemcpy(ends, e.data(), MAXG * 4, cudaMemcpyHostToDevice));
      // Same bits from both orders, over every expert's rows.
      auto same = [&](__nv_bfloat16* p, __nv_bfloat16* q, int n) {
        std::vector<uint16_t> a((size_t)rows * n), b((size_t)rows * n);
        CK(cudaMemcpy(a.data(), p, a.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), q, b.size() * 2, cudaMemcpyDeviceToHost));
        for (size_t g = 0; g < c.size(); g++)
          for (size_t r = begin[g]; r < (size_t)e[g]; r++)
            for (int j = 0; j < n; j++)
              if (a[r * n + j] != b[r * n + j]) {
                printf("MISMATCH %s %s slot %zu row %zu col %d\n", name.c_str(), oname, g, r, j);
                return false;
              }
        return true;
      };
      CK(cudaMemset(gu, 0x11, (size_t)rows * 2 * I * 2));
      CK(cudaMemset(y, 0x11, (size_t)rows * H * 2));
      launch_bf16(bk[0], 2 * I, H, x, wgu, gu);
      launch_fp8(fk[0], H, I, aq, asf, wdn8, sdn, y);
      bool ok = true;
      for (int v = 1; v < 5; v++) {
        CK(cudaMemset(gu2, 0x7f, (size_t)rows * 2 * I * 2));
        CK(cudaMemset(y2, 0x7f, (size_t)rows * H * 2));
        launch_bf16(bk[v], 2 * I, H, x, wgu, gu2);
        launch_fp8(fk[v], H, I, aq, asf, wdn8, sdn, y2);
        CK(cudaStreamSynchronize(st));
        ok = ok && same(gu, gu2, 2 * I) && same(y, y2, H);
      }
      if (getenv("PROBE_ONCE")) {  // one launch of each (for a profiler)
        printf("%s %s same bits %s\n", name.c_str(), oname, ok ? "yes" : "NO");
        continue;
      }
      printf("%-8s %-8s slots %zu rows %d blocks %d (<=128 rows: %d) same bits %s\n", name.c_str(), oname, c.size(), tok,
             rows / 128, one, ok ? "yes" : "NO");
      const int it = 20;
      for (int v = 0; v < 5; v++) {
        float bu = median_us([&] { launch_bf16(bk[v], 2 * I, H, x, wgu, gu); }, it, st);
        float bd = median_us([&] { launch_bf16(bk[v], H, I, act, wdn, y); }, it, st);
        float fu = median_us([&] { launch_fp8(fk[v], 2 * I, H, xq, xsf, wgu8, sgu, gu); }, it, st);
        float fd = median_us([&] { launch_fp8(fk[v], H, I, aq, asf, wdn8, sdn, y); }, it, st);
        CK(cudaDeviceSynchronize());
        printf("  %-8s %-8s %-7s bf16 up %7.1f down %7.1f both %7.1f | fp8 up %7.1f down %7.1f both %7.1f\n", name.c_str(),
               oname, orders[v], bu, bd, bu + bd, fu, fd, fu + fd);
      }
      fflush(stdout);
    }
  }
  return 0;
}
