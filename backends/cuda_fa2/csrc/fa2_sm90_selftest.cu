// attncore cuda_fa2: standalone checks of the wgmma primitives fa2_sm90.cuh relies on (sm_90a only).
// One warpgroup, one tile, operands staged exactly as the attention kernel stages them:
//   mode 0 (SS, both K-major):  C[64 x N] = A[64 x K] B[N x K]^T   (S = Q K^T), N 48 / 64 / 80 / 128
//   mode 1 (RS, B MN-major):    C[64 x N] = A[64 x K] B[K x N]     (O = P V, A from registers), N 64 / 128 / 256
// K = 128, 64 where N > 128 (static shared memory holds 48 KiB).
// A, B: 16-bit row-major in global memory; C: float row-major, written from the accumulator layout.
// swap (mode 1): swap LBO / SBO of the MN-major descriptor (which one is right is what this checks).
// Entry: fa2_sm90_selftest(mode, dtype 0 fp16 / 1 bf16, n, A, B, C, swap, stream) -> cudaError_t
// (cudaErrorInvalidValue for an (mode, n) not built here)
#include "fa2_sm90.cuh"

namespace {
using namespace fa2::sm90;

template <typename T, int N, int MODE>
__global__ void __launch_bounds__(128, 1) selftest_kernel(const T* A, const T* B, float* C, int swap) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int K = N > 128 ? 64 : 128;
  __shared__ __align__(1024) uint8_t sA[64 * K * 2];
  __shared__ __align__(1024) uint8_t sB[K * N * 2];
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  // A -> smem [64][K] swizzled (mode 0 only)
  if constexpr (MODE == 0)
    for (int idx = tid; idx < 64 * (K / 8); idx += 128) {
      const int r = idx / (K / 8), c = idx % (K / 8);
      *reinterpret_cast<uint4*>(sA + sw128<64>(r, c)) = *reinterpret_cast<const uint4*>(A + r * K + c * 8);
    }
  if constexpr (MODE == 0) {  // B [N][K] -> smem [N rows][K] swizzled
    for (int idx = tid; idx < N * (K / 8); idx += 128) {
      const int r = idx / (K / 8), c = idx % (K / 8);
      *reinterpret_cast<uint4*>(sB + sw128<N>(r, c)) = *reinterpret_cast<const uint4*>(B + r * K + c * 8);
    }
  } else {  // B [K][N] -> smem [K rows][N] swizzled (the V tile layout)
    for (int idx = tid; idx < K * (N / 8); idx += 128) {
      const int r = idx / (N / 8), c = idx % (N / 8);
      *reinterpret_cast<uint4*>(sB + sw128<K>(r, c)) = *reinterpret_cast<const uint4*>(B + r * N + c * 8);
    }
  }
  fence_async_smem();
  __syncthreads();
  const uint32_t a_s = ac::smem_u32(sA), b_s = ac::smem_u32(sB);
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  reg_fence<N / 2>(d);
  wg_fence();
  if constexpr (MODE == 0) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) mma_ss<T, N>(d, desc_k<64>(a_s, kk), desc_k<N>(b_s, kk), kk > 0);
  } else {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      const T* a0 = A + (16 * w + g) * K + 16 * kk + 2 * t;
      uint32_t a[4];
      a[0] = *reinterpret_cast<const uint32_t*>(a0);
      a[1] = *reinterpret_cast<const uint32_t*>(a0 + 8 * K);
      a[2] = *reinterpret_cast<const uint32_t*>(a0 + 8);
      a[3] = *reinterpret_cast<const uint32_t*>(a0 + 8 * K + 8);
      mma_rs_t<T, N>(d, a, desc_mn<K>(b_s, kk, swap != 0));
    }
  }
  wg_commit();
  wg_wait<0>();
  reg_fence<N / 2>(d);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) C[(16 * w + g + 8 * (e >> 1)) * N + 8 * j + 2 * t + (e & 1)] = d[j * 4 + e];
#endif
}

template <typename T, int N, int MODE>
int launch(const void* A, const void* B, float* C, int swap, cudaStream_t st) {
  selftest_kernel<T, N, MODE><<<1, 128, 0, st>>>((const T*)A, (const T*)B, C, swap);
  return (int)cudaGetLastError();
}

template <typename T>
int dispatch(int mode, int n, const void* A, const void* B, float* C, int swap, cudaStream_t st) {
  if (mode == 0) {
    switch (n) {
      case 48: return launch<T, 48, 0>(A, B, C, swap, st);
      case 64: return launch<T, 64, 0>(A, B, C, swap, st);
      case 80: return launch<T, 80, 0>(A, B, C, swap, st);
      case 128: return launch<T, 128, 0>(A, B, C, swap, st);
    }
  } else {
    switch (n) {
      case 64: return launch<T, 64, 1>(A, B, C, swap, st);
      case 128: return launch<T, 128, 1>(A, B, C, swap, st);
      case 256: return launch<T, 256, 1>(A, B, C, swap, st);
    }
  }
  return (int)cudaErrorInvalidValue;
}
}  // namespace

extern "C" __attribute__((visibility("default"))) int fa2_sm90_selftest(int mode, int dtype, int n, const void* A,
                                                                       const void* B, float* C, int swap,
                                                                       cudaStream_t st) {
  return dtype == 1 ? dispatch<__nv_bfloat16>(mode, n, A, B, C, swap, st)
                    : dispatch<__half>(mode, n, A, B, C, swap, st);
}
