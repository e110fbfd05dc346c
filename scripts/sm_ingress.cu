// How many bytes per second one SM can pull from HBM, by copy engine: plain 16-byte loads into registers, cp.async
// 16-byte copies into a shared-memory ring (xqa's and prefill90's engine) and cp.async.bulk (the TMA's 1-D bulk copy,
// one thread issuing 32 KiB at a time).  N CTAs, each with more than half an SM's shared memory, so that each runs
// alone on its SM: the read bandwidth on N SMs, as POD's SM split gives the decode part (issue 16).
// Build and run on the device machine (sm_90):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/sm_ingress scripts/sm_ingress.cu && /tmp/sm_ingress
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

constexpr int STAGES = 6, CHUNK = 32768, SMEM = STAGES * CHUNK + 64;
constexpr size_t BYTES = size_t(2) << 30;  // 2 GiB: far beyond the L2

__global__ void __launch_bounds__(1024) ldg_kernel(const uint4* __restrict__ src, size_t n16, unsigned* sink) {
  extern __shared__ uint8_t smem[];  // only to hold the SM
  const size_t per = n16 / gridDim.x, lo = per * blockIdx.x, hi = lo + per;
  uint32_t acc = 0;
  for (size_t i = lo + threadIdx.x; i < hi; i += 8 * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = i + k * blockDim.x < hi ? __ldcs(src + i + k * blockDim.x) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (acc == 0x12345678u) sink[0] = smem[threadIdx.x];
}

__global__ void __launch_bounds__(256) cpasync_kernel(const uint8_t* __restrict__ src, size_t chunks, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const size_t per = chunks / gridDim.x, lo = per * blockIdx.x;
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  auto issue = [&](size_t c, int stage) {
    for (int o = threadIdx.x * 16; o < CHUNK; o += blockDim.x * 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(base + stage * CHUNK + o),
                   "l"(src + (lo + c) * CHUNK + o));
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int s = 0; s < STAGES - 1; ++s) issue(s, s);
  uint32_t acc = 0;
  for (size_t c = 0; c < per; ++c) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();
    acc ^= smem[(c % STAGES) * CHUNK + threadIdx.x];
    if (c + STAGES - 1 < per) issue(c + STAGES - 1, (c + STAGES - 1) % STAGES);
    else asm volatile("cp.async.commit_group;\n" ::);
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void __launch_bounds__(32) bulk_kernel(const uint8_t* __restrict__ src, size_t chunks, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const size_t per = chunks / gridDim.x, lo = per * blockIdx.x;
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem), bars = base + STAGES * CHUNK;
  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;\n" ::"r"(bars + 8 * s));
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::);
  __syncwarp();
  auto issue = [&](size_t c, int stage) {
    if (threadIdx.x != 0) return;
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(bars + 8 * stage), "r"(CHUNK));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     base + stage * CHUNK),
                 "l"(src + (lo + c) * CHUNK), "r"(CHUNK), "r"(bars + 8 * stage)
                 : "memory");
  };
  for (int s = 0; s < STAGES && s < (int)per; ++s) issue(s, s);
  uint32_t acc = 0;
  for (size_t c = 0; c < per; ++c) {
    const int stage = c % STAGES;
    const uint32_t parity = (c / STAGES) & 1;
    uint32_t done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
                   : "=r"(done) : "r"(bars + 8 * stage), "r"(parity) : "memory");
    acc ^= smem[stage * CHUNK + threadIdx.x];
    __syncwarp();
    if (c + STAGES < per) issue(c + STAGES, stage);
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  uint8_t* buf;
  unsigned* sink;
  if (cudaMalloc(&buf, BYTES) || cudaMalloc(&sink, 4)) return printf("cudaMalloc failed\n"), 1;
  cudaMemset(buf, 1, BYTES);
  cudaFuncSetAttribute(ldg_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  cudaFuncSetAttribute(cpasync_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  const size_t chunks = BYTES / CHUNK;
  printf("SMs %d; read GB/s (per SM) with one CTA per SM, best of 5\n%6s %22s %22s %22s\n", sms, "N", "ld.global 16 B",
         "cp.async 16 B", "cp.async.bulk 32 KiB");
  const int ns[] = {32, 48, 64, 80, 92, 100, 116, sms};
  for (int n : ns) {
    printf("%6d", n);
    for (int kind = 0; kind < 3; ++kind) {
      float best = 1e9f;
      size_t bytes = 0;
      for (int rep = 0; rep < 6; ++rep) {
        cudaEventRecord(a);
        if (kind == 0) {
          ldg_kernel<<<n, 1024, SMEM>>>(reinterpret_cast<const uint4*>(buf), BYTES / 16, sink);
          bytes = (BYTES / 16 / n) * n * 16;
        } else if (kind == 1) {
          cpasync_kernel<<<n, 256, SMEM>>>(buf, chunks, sink);
          bytes = (chunks / n) * n * CHUNK;
        } else {
          bulk_kernel<<<n, 32, SMEM>>>(buf, chunks, sink);
          bytes = (chunks / n) * n * CHUNK;
        }
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        if (rep > 0 && ms < best) best = ms;
      }
      const cudaError_t e = cudaGetLastError();
      if (e) return printf("\nCUDA error %s\n", cudaGetErrorString(e)), 1;
      const double gbs = bytes / (best * 1e-3) / 1e9;
      printf(" %12.0f (%6.1f)", gbs, gbs / n);
    }
    printf("\n");
  }
  return 0;
}
