// Issue 17 probe (xqa's fp8 widening): warp-instructions per SM clock of mma.sync f16 m16n8k16, mma.sync e4m3
// m16n8k32 and cvt.rn.f16x2.e4m3x2, each warp running 8 independent chains, at 4 / 8 / 16 warps per SM.
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o mma_rate scripts/mma_rate.cu && ./mma_rate
//   cuobjdump -sass mma_rate | grep -oE "(HMMA|QMMA|F2FP)[.A-Z0-9_]*" | sort | uniq -c
// H200 (session 54, backends/xqa/bench/xqa.md): 0.60 / 0.56 / 2.05 at 16 warps; the SASS holds no fp8 MMA opcode.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cuda_runtime.h>
#define N_ITER 4096
template <int KIND>
__global__ void k(float* out, uint32_t seed) {
  float c[8][4];
  for (int i = 0; i < 8; ++i) for (int e = 0; e < 4; ++e) c[i][e] = 0.f;
  uint32_t a0 = seed ^ threadIdx.x, a1 = a0 * 3, a2 = a0 * 5, a3 = a0 * 7, b0 = a0 * 11, b1 = a0 * 13;
  uint32_t acc = 0;
  for (int it = 0; it < N_ITER; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (KIND == 0) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      } else if constexpr (KIND == 1) {
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      } else {
        uint32_t r;
        asm volatile("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }\n" : "=r"(r) : "r"(a0 + i));
        acc += r;
        asm volatile("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }\n" : "=r"(r) : "r"(a1 + i));
        acc ^= r;
      }
    }
    a0 += 1;
  }
  float s = acc;
  for (int i = 0; i < 8; ++i) for (int e = 0; e < 4; ++e) s += c[i][e];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
template <int KIND>
void run(const char* name, int warps_per_sm, int sms) {
  float* out; cudaMalloc(&out, sizeof(float) * sms * warps_per_sm * 32);
  k<KIND><<<sms, warps_per_sm * 32>>>(out, 1);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<KIND><<<sms, warps_per_sm * 32>>>(out, 2);
  cudaEventRecord(e1); cudaEventSynchronize(e1);
  const cudaError_t err = cudaGetLastError();  // a failed launch would time nothing
  if (err != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(err)); exit(1); }
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  int clk; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  double instr = (double)N_ITER * 8 * (KIND == 2 ? 2 : 1) * warps_per_sm;  // warp-instructions per SM
  double cycles = ms * 1e-3 * clk * 1e3;
  printf("%-26s warps/SM %2d: %.3f ms, %.2f warp-instr per SM-clock (at %d MHz nominal)\n", name, warps_per_sm, ms, instr / cycles, clk / 1000);
  cudaEventDestroy(e0); cudaEventDestroy(e1); cudaFree(out);
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int w : {4, 8, 16}) {
    run<0>("HMMA f16 m16n8k16", w, sms);
    run<1>("mma e4m3 m16n8k32", w, sms);
    run<2>("cvt f16x2.e4m3x2", w, sms);
  }
  return 0;
}
