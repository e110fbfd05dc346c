// attncore xqa: S = Q K^T of a K/V tile, per warp (mma.sync m16n8k16, fp32 accumulate, operands of
// type CT); O += P V is written out in the kernel (xqa_decode.cuh says why), with the same layouts.
// Warp w owns keys kw0 = w * KPW .. kw0 + KPW - 1 of the tile, in KB blocks of 16, and all MT m16
// row tiles of the CTA.  s[mt][j][e]: row 16 mt + lane / 4 + 8 (e / 2), key kw0 + 8 j + 2 (lane % 4)
// + e % 2 -- the mma C layout, which is also the A layout, so P goes from S to the P V MMA in
// registers (pa).
//
// fp8 KV stays fp8 in smem and is widened in registers (ac::cvt_fp8x2_lo / _hi):
//   K: ldmatrix on byte pairs gives a thread dims 4t..4t+3 of a key, so the MMA k index is permuted
//      (k 2t,2t+1 <-> d 4t,4t+1; k 2t+8,2t+9 <-> d 4t+2,4t+3); Q sits in smem with the same
//      permutation (load_q), so Q.K is unchanged.
//   V: .trans gives keys 2t,2t+1 x dims 2g,2g+1; the even dims form one n8 tile and the odd dims
//      another, so O's columns are permuted (undone in the epilogue: d = 16c + 4t + 2e + odd).
#pragma once
#include "attncore/ptx.cuh"
#include "xqa_config.cuh"

namespace xqa {

// s = Q K^T for this warp's keys (K tile at smem address ks, Q at q_s).  lm = lane / 8: the 8x8
// matrix of an ldmatrix this lane addresses.
template <typename Cfg, typename CT, int KVK>
__device__ __forceinline__ void compute_s(float (&s)[Cfg::MT][2 * Cfg::KB][4], uint32_t ks, uint32_t q_s, int lm,
                                          int kw0, int lane) {
  constexpr int D = Cfg::D, MT = Cfg::MT, KB = Cfg::KB, RB = Cfg::RB, C = Cfg::C;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 2 * KB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.f;

  if constexpr (KVK == 0) {
#pragma unroll
    for (int kstep = 0; kstep < D / 16; ++kstep) {
      uint32_t kb[KB][4];
#pragma unroll
      for (int kb_ = 0; kb_ < KB; ++kb_) {
        const int r = kw0 + kb_ * 16 + (lm >> 1) * 8 + (lane & 7);
        ac::ldsm_x4(kb[kb_], ks + r * RB + (ac::swz_chunk<C>(r, 2 * kstep + (lm & 1)) << 4));
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t qa[4];
        const int r = mt * 16 + (lm & 1) * 8 + (lane & 7);
        ac::ldsm_x4(qa, q_s + r * Cfg::QRB + (ac::swz_chunk<D / 8>(r, 2 * kstep + (lm >> 1)) << 4));
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          ac::mma16816<CT>(s[mt][2 * kb_], qa, kb[kb_][0], kb[kb_][1]);
          ac::mma16816<CT>(s[mt][2 * kb_ + 1], qa, kb[kb_][2], kb[kb_][3]);
        }
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) {
      uint32_t x[KB][4];
#pragma unroll
      for (int kb_ = 0; kb_ < KB; ++kb_) {
        const int r = kw0 + kb_ * 16 + (lm & 1) * 8 + (lane & 7);
        ac::ldsm_x4(x[kb_], ks + r * RB + (ac::swz_chunk<C>(r, 2 * kk + (lm >> 1)) << 4));
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int kstep = 2 * kk + hh;
        uint32_t bk[KB][4];
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          bk[kb_][0] = ac::cvt_fp8x2_lo<KVK>(x[kb_][2 * hh]);
          bk[kb_][1] = ac::cvt_fp8x2_hi<KVK>(x[kb_][2 * hh]);
          bk[kb_][2] = ac::cvt_fp8x2_lo<KVK>(x[kb_][2 * hh + 1]);
          bk[kb_][3] = ac::cvt_fp8x2_hi<KVK>(x[kb_][2 * hh + 1]);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t qa[4];
          const int r = mt * 16 + (lm & 1) * 8 + (lane & 7);
          ac::ldsm_x4(qa, q_s + r * Cfg::QRB + (ac::swz_chunk<D / 8>(r, 2 * kstep + (lm >> 1)) << 4));
#pragma unroll
          for (int kb_ = 0; kb_ < KB; ++kb_) {
            ac::mma16816<CT>(s[mt][2 * kb_], qa, bk[kb_][0], bk[kb_][1]);
            ac::mma16816<CT>(s[mt][2 * kb_ + 1], qa, bk[kb_][2], bk[kb_][3]);
          }
        }
      }
    }
  }
}

}  // namespace xqa
