// DeepSeek-V3's activation rule (server/model/fp8.rs), shared by the kernels that quantize rows
// (kernels/fp8.cu after the exchange, kernels/epserve.cu's FP8 slots before it): per 128
// channels, s = amax / 448 (0 where that is not a normal float, the group's values then 0),
// q = e4m3(x / s) rounded to nearest even and saturated. The result depends only on the group's
// values, however many lanes share it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace fp8_rule {

// The scale of a group whose |values| lanes of `width` (a power of two <= 32, aligned in the warp)
// each reduced to `amax`; every lane of the warp must call it.
template <int width>
__device__ inline float group_scale(float amax) {
  for (int o = width / 2; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = __fdiv_rn(amax, 448.f);
  return (s >= 1.17549435e-38f && s <= 3.40282347e38f) ? s : 0.f;
}

// Four values of one lane quantized with the group's scale, packed little-endian.
__device__ inline uint32_t pack4(const float v[4], float s) {
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float y = s == 0.f ? 0.f : __fdiv_rn(v[i], s);
    const uint32_t c = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
    out |= c << (8 * i);
  }
  return out;
}

// Eight bf16 values from one 16-byte load.
__device__ inline void load8(const __nv_bfloat16* p, float v[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
    v[2 * i] = __low2float(b);
    v[2 * i + 1] = __high2float(b);
  }
}

__device__ inline float amax8(const float v[8]) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 8; i++) m = fmaxf(m, fabsf(v[i]));
  return m;
}

// Eight values quantized with the group's scale into eight bytes at `q`.
__device__ inline void store8(uint8_t* q, const float v[8], float s) {
  *reinterpret_cast<uint2*>(q) = make_uint2(pack4(v, s), pack4(v + 4, s));
}

}  // namespace fp8_rule
