// epserve's CUDA kernels (sm_90a). Every kernel that depends on the step's token count reads it
// from a device scalar, so one captured graph serves any count up to its bucket; positions are
// computed with block scans (no atomics), so a replay is bitwise reproducible. One translation
// unit, in parts by concern:
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <cub/block/block_scan.cuh>

#include "decode_gemm.cuh"
#include "fp8_rule.cuh"

using bf16 = __nv_bfloat16;

#include "routing.cuh"
#include "layout.cuh"
#include "ffn.cuh"
#include "convert.cuh"
