// attncore cuda_fa2: the two tensor-core steps of a K/V tile, per warp (mma.sync m16n8k16, fp32
// accumulate).  A warp owns NMQ m16 row tiles (rows qrow_base ...) and KVW = 16 NNK keys of the
// stage (keys kv_w0 ...).  Accumulator layout (the mma C layout): s[mi][j][e] is row
// 16 mi + lane / 4 + 8 (e / 2), key 8 j + 2 (lane % 4) + e % 2 -- which is also the A-operand layout,
// so P goes from the S accumulators to the P V MMA without leaving registers.
#pragma once
#include "fa2_kernel_traits.cuh"

namespace fa2 {

// s = Q K^T for this warp's rows x keys (Q: A from ldmatrix; K: B from ldmatrix, K-major in smem).
template <typename Cfg, typename T>
__device__ __forceinline__ void compute_s(float (&s)[Cfg::NMQ][Cfg::NKT][4], const T* sQ, const T* tK, int qrow_base,
                                          int kv_w0, int lane) {
  constexpr int D = Cfg::D, NMQ = Cfg::NMQ, NNK = Cfg::NNK, NKT = Cfg::NKT;
#pragma unroll
  for (int mi = 0; mi < NMQ; ++mi)
#pragma unroll
    for (int j = 0; j < NKT; ++j) s[mi][j][0] = s[mi][j][1] = s[mi][j][2] = s[mi][j][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[NMQ][4];
#pragma unroll
    for (int mi = 0; mi < NMQ; ++mi)
      ac::ldsm_x4(a[mi], sQ + swz<D>(qrow_base + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
    for (int nj = 0; nj < NNK; ++nj) {
      uint32_t b[4];
      ac::ldsm_x4(b, tK + swz<D>(kv_w0 + nj * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
      for (int mi = 0; mi < NMQ; ++mi) {
        ac::mma16816<T>(s[mi][2 * nj], a[mi], b[0], b[1]);
        ac::mma16816<T>(s[mi][2 * nj + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// o += P V: P (the softmax probabilities left in s) rounded to T in place as the A operand, V from
// ldmatrix.trans (V is [keys][D] in smem: .trans gives the k-major B fragments).
template <typename Cfg, typename T>
__device__ __forceinline__ void accumulate_pv(float (&o)[Cfg::NMQ][Cfg::NDT][4],
                                              const float (&s)[Cfg::NMQ][Cfg::NKT][4], const T* tV, int kv_w0, int lane) {
  constexpr int D = Cfg::D, NMQ = Cfg::NMQ, NNK = Cfg::NNK, NDT = Cfg::NDT;
#pragma unroll
  for (int kk = 0; kk < NNK; ++kk) {
    uint32_t a[NMQ][4];
#pragma unroll
    for (int mi = 0; mi < NMQ; ++mi) {
      a[mi][0] = ac::pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
      a[mi][1] = ac::pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
      a[mi][2] = ac::pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
      a[mi][3] = ac::pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < NDT / 2; ++dp) {
      uint32_t b[4];
      ac::ldsm_x4_t(b, tV + swz<D>(kv_w0 + kk * 16 + (lane & 15), dp * 2 + (lane >> 4)));
#pragma unroll
      for (int mi = 0; mi < NMQ; ++mi) {
        ac::mma16816<T>(o[mi][2 * dp], a[mi], b[0], b[1]);
        ac::mma16816<T>(o[mi][2 * dp + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

}  // namespace fa2
