// Conversions: rows between f32, bf16 and f16, a client's rows checked for non-finite values, and
// the bench's random fills.
// One of epserve.cu's parts (its includes and `bf16` come from there).
#pragma once

extern "C" {

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
