// Is a same-device cuMemcpyDtoDAsync a kernel (needs free SMs) or copy-engine work?
// A kernel fills every SM for ~2 ms on stream A; a 32 MiB D2D copy goes on stream B right after.
#include <cstdio>
#include <cuda.h>
#include <cuda_runtime.h>
__global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }
int main() {
  cudaDeviceProp p; cudaGetDeviceProperties(&p, 0);
  int per = 0; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, spin, 1024, 0);
  size_t n = 32u << 20; void *a, *b; cudaMalloc(&a, n); cudaMalloc(&b, n);
  cudaStream_t sa, sb; cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking);
  cudaEvent_t e0, e1, e2, k1; cudaEventCreate(&e0); cudaEventCreate(&e1); cudaEventCreate(&e2); cudaEventCreate(&k1);
  int khz = 0; cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  long long cyc = (long long)khz * 2; // ~2 ms at the max clock (clockRate in kHz)
  for (int it = 0; it < 4; it++) {
    // alone
    cudaEventRecord(e0, sb); cuMemcpyDtoDAsync((CUdeviceptr)b, (CUdeviceptr)a, n, sb); cudaEventRecord(e1, sb);
    cudaDeviceSynchronize(); float alone; cudaEventElapsedTime(&alone, e0, e1);
    // under a kernel that fills every SM
    cudaEventRecord(e0, sa); spin<<<p.multiProcessorCount * per, 1024, 0, sa>>>(cyc); cudaEventRecord(k1, sa);
    cudaStreamWaitEvent(sb, e0, 0);
    cuMemcpyDtoDAsync((CUdeviceptr)b, (CUdeviceptr)a, n, sb); cudaEventRecord(e2, sb);
    cudaDeviceSynchronize(); float kern, copy; cudaEventElapsedTime(&kern, e0, k1); cudaEventElapsedTime(&copy, e0, e2);
    printf("SMs %d x %d blocks; 32 MiB copy alone %.1f us; under the spin: spin ends %.1f us, copy ends %.1f us -> %s\n",
      p.multiProcessorCount, per, alone * 1e3, kern * 1e3, copy * 1e3, copy < kern * 0.5 ? "copy engine (ran beside)" : "waited for SMs (a kernel)");
  }
  printf("err %s\n", cudaGetErrorString(cudaGetLastError()));
}
