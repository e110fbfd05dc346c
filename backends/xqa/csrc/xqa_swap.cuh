// attncore xqa: the swapped-product kernel, for at most 8 rows per kv head (Cfg::SWAP), 16-bit or fp8 KV.
//
// At GQA group 4 (one draft token) the main kernel's m16n8k16 MMAs carry 16 rows of which 4 are
// queries.  Here the keys are the MMA's M and the CTA's 8 rows its N:
//   S^T = K Q^T     A = K (16 keys x 16 dims: ldmatrix of the K rows; fp8 widened in registers as in
//                   xqa_mma.cuh, the k index permuted the same way), B = Q^T (held in registers for the CTA)
//   O^T += V^T P^T  A = V^T (16 dims x 16 keys, the .trans fragment; fp8: xqa_mma.cuh's, its even dims as M
//                   rows 0-7 and its odd dims as M rows 8-15), B = P^T
// which is half the MMAs per tile, and the softmax works on 8 rows, not 16.
//
// Layouts (lane = 4 g + t):
//   s[kb][e]   key kw0 + 16 kb + g + 8 (e / 2), row 2 t + e % 2      (the C layout of S^T)
//   o[c][e]    row 2 t + e % 2 of dim 16 c + 2 g + e / 2 (fp8) or 16 c + g + 8 (e / 2) (16-bit)
//              (the C layout of O^T; dim_of below)
//   m_run[h], l_run[h]  row 2 t + h; l_run is this lane's partial sum over its keys (summed over
//              the 8 lanes of the row in merge_warps_t)
// A row's max reduces over the 8 lanes of equal t (ac::col_max).  P^T goes from S^T's C layout to
// the B layout with one movmatrix per 8 x 8 block (ac::movm_t).
//
// The pipeline, the mask's rules, the prescaled Q and the epilogue are the main kernel's
// (xqa_decode.cuh, xqa_load.cuh, xqa_mask.cuh, xqa_epilogue.cuh).
#pragma once
#include "attncore/ptx.cuh"
#include "xqa_config.cuh"
#include "xqa_epilogue.cuh"
#include "xqa_load.cuh"
#include "xqa_mask.cuh"
#include "xqa_params.h"

namespace xqa {

// Q^T as B fragments, for every 16-dim k step: qb[ks] = (k 2t, 2t+1 | k 2t+8, 2t+9) of row g.
template <typename Cfg>
__device__ __forceinline__ void load_qt(uint32_t (&qb)[Cfg::D / 16][2], uint32_t q_s, int lane) {
  constexpr int D = Cfg::D;
  const int lm = lane >> 3, r = lane & 7;
#pragma unroll
  for (int ks = 0; ks < D / 16; ks += 2) {
    uint32_t x[4];
    ac::ldsm_x4(x, q_s + r * Cfg::QRB + (ac::swz_chunk<D / 8>(r, 2 * ks + lm) << 4));
    qb[ks][0] = x[0];
    qb[ks][1] = x[1];
    qb[ks + 1][0] = x[2];
    qb[ks + 1][1] = x[3];
  }
}

// The dim of O^T's element o[c][e] for this lane's g (the layouts above).
template <bool FP8>
__device__ __forceinline__ int dim_of(int c, int g, int e) {
  return FP8 ? 16 * c + 2 * g + e / 2 : 16 * c + g + 8 * (e / 2);
}

// Each warp's (m, l) per row and its O^T, weighted, into sm.ml / sm.stat / sm.red: what merge_warps
// leaves for the epilogue.
template <typename Cfg, bool FP8>
__device__ __forceinline__ void merge_warps_t(const Smem<Cfg>& sm, const float (&o)[Cfg::D / 16][4],
                                              const float (&m_run)[2], const float (&l_run)[2], int tid, int warp,
                                              int g, int t) {
  constexpr int ROWS = Cfg::ROWS;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = ac::col_sum(l_run[h]);
    if (g == 0) {
      const int r = 2 * t + h;
      sm.ml[(warp * ROWS + r) * 2 + 0] = m_run[h];
      sm.ml[(warp * ROWS + r) * 2 + 1] = l;
    }
  }
  __syncthreads();
  warp_weights<Cfg>(sm.ml, sm.stat, tid);
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 2 * t + h;
    const float sc = sm.stat[r * (NW + 2) + warp];
    float* dst = sm.red + (warp * ROWS + r) * Cfg::RED_PITCH;
#pragma unroll
    for (int c = 0; c < Cfg::D / 16; ++c) {
      if constexpr (FP8) {  // dims 2 g, 2 g + 1: one 8-byte store
        *reinterpret_cast<float2*>(dst + dim_of<FP8>(c, g, 0)) = make_float2(o[c][h] * sc, o[c][2 + h] * sc);
      } else {
        dst[dim_of<FP8>(c, g, 0)] = o[c][h] * sc;
        dst[dim_of<FP8>(c, g, 2)] = o[c][2 + h] * sc;
      }
    }
  }
  __syncthreads();
}

template <typename QT, int KVK, int OUTK, typename Cfg>
__global__ void __launch_bounds__(NT, Cfg::MIN_BLOCKS) xqa_decode_swap_kernel(const __grid_constant__ XqaParams p) {
  constexpr int D = Cfg::D, RB = Cfg::RB, C = Cfg::C;
  constexpr int TILE = Cfg::TILE, KPW = Cfg::KPW, KB = Cfg::KB, DIAG = Cfg::DIAG;
  constexpr int DT = D / 16;  // k steps of S^T, m16 tiles of O^T
  constexpr bool FP8 = KVK != 0;
  using CT = typename std::conditional<FP8, __half, QT>::type;  // MMA operand type (xqa_decode.cuh)
  static_assert(Cfg::SWAP, "the swapped kernel's configuration");
  const float fold = (KVK == 1) ? ac::kFp8Fold : 1.f;

  extern __shared__ __align__(128) uint8_t smem[];
  const Smem<Cfg> sm(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  const Work<Cfg> wk(p);  // after the previous kernel's writes (PDL)
  const int seq_len = wk.seq_len, my_tiles = wk.my_tiles;

  const KvCopy<Cfg> kv(p, wk, sm.big, tid);
  int pg[Cfg::RPT];  // page ids of this thread's rows of the next tile
  kv.prologue(pg, tid);  // the ring's first tiles in flight while Q is read

  float q_unscale = 1.f;
  load_q<Cfg, QT, FP8>(sm.q, sm.ml, p, wk, tid, lane, warp, q_unscale);
  const MaskRows<1> rows(p, wk.row0, wk.G, wk.QL, seq_len, wk.b, 2 * t, 1);

  float o[DT][4];
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
#pragma unroll
  for (int c = 0; c < DT; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[c][e] = 0.f;

  __syncthreads();  // Q is in smem
  uint32_t qb[DT][2];
  load_qt<Cfg>(qb, ac::smem_u32(sm.q), lane);
  const float qk_scale = p.qk_scale_log2 * fold * q_unscale;

  for (int it = 0; it < my_tiles; ++it) {
    kv.advance(pg, it);
    const auto [ks, vs, tile_start] = kv.tile(it);

    if constexpr (DIAG == 1) continue;

    const int lm = lane >> 3;
    const int kw0 = warp * KPW;
    // ---- S^T = K Q^T
    float s[KB][4];
#pragma unroll
    for (int kb_ = 0; kb_ < KB; ++kb_)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[kb_][e] = 0.f;
    if constexpr (FP8) {
#pragma unroll
      for (int kk = 0; kk < D / 32; ++kk) {
        uint32_t x[KB][4];  // [keys 0-7 | 8-15] x [chunk 2 kk | 2 kk + 1]
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          const int r = kw0 + kb_ * 16 + (lm & 1) * 8 + (lane & 7);
          ac::ldsm_x4(x[kb_], ks + r * RB + (ac::swz_chunk<C>(r, 2 * kk + (lm >> 1)) << 4));
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int kb_ = 0; kb_ < KB; ++kb_) {
            const uint32_t a[4] = {ac::cvt_fp8x2_lo<KVK>(x[kb_][2 * hh]), ac::cvt_fp8x2_lo<KVK>(x[kb_][2 * hh + 1]),
                                   ac::cvt_fp8x2_hi<KVK>(x[kb_][2 * hh]), ac::cvt_fp8x2_hi<KVK>(x[kb_][2 * hh + 1])};
            ac::mma16816<__half>(s[kb_], a, qb[2 * kk + hh][0], qb[2 * kk + hh][1]);
          }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < DT; ++kk)
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          uint32_t a[4];  // [keys 0-7 | 8-15] x [dims 16 kk .. +7 | +8 .. +15]: the A fragment as it comes
          const int r = kw0 + kb_ * 16 + (lm & 1) * 8 + (lane & 7);
          ac::ldsm_x4(a, ks + r * RB + (ac::swz_chunk<C>(r, 2 * kk + (lm >> 1)) << 4));
          ac::mma16816<CT>(s[kb_], a, qb[kk][0], qb[kk][1]);
        }
    }

    // ---- mask (boundary tiles only; xqa_mask.cuh).  S stays unscaled: the row max is scaled (qk_scale > 0, so the
    // max commutes with it) and P = 2^(s qk_scale - m) takes one FFMA an element
    if (rows.tile_needs_mask(p, tile_start, TILE)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int qi = rows.qi[0][h];
        const uint16_t* mrow = rows.row_mask(p, qi);
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_)
#pragma unroll
          for (int hk = 0; hk < 2; ++hk)
            if (!rows.visible(p, tile_start + kw0 + 16 * kb_ + g + 8 * hk, qi, mrow)) s[kb_][2 * hk + h] = -INFINITY;
      }
    }

    // ---- online softmax over the keys of rows 2t, 2t + 1 (xqa_softmax.cuh's rules)
    float alpha[2];
    bool grew = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(s[0][h], s[0][2 + h]);
#pragma unroll
      for (int kb_ = 1; kb_ < KB; ++kb_) mx = fmaxf(mx, fmaxf(s[kb_][h], s[kb_][2 + h]));
      mx = ac::col_max(mx) * qk_scale;
      const float m_new = ac::next_max(m_run[h], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = ac::ex2(m_run[h] - m_use);
      grew |= m_new > m_run[h];
      m_run[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int kb_ = 0; kb_ < KB; ++kb_)
#pragma unroll
        for (int hk = 0; hk < 2; ++hk) {
          const float pv = ac::ex2(fmaf(s[kb_][2 * hk + h], qk_scale, -m_use));
          s[kb_][2 * hk + h] = pv;
          sum += pv;
        }
      l_run[h] = l_run[h] * alpha[h] + sum;
    }
    uint32_t pb[KB][2];  // P^T as the B operand: keys 2t, 2t+1 (| +8) of row g
#pragma unroll
    for (int kb_ = 0; kb_ < KB; ++kb_) {
      pb[kb_][0] = ac::movm_t(ac::pack2<CT>(s[kb_][0], s[kb_][1]));
      pb[kb_][1] = ac::movm_t(ac::pack2<CT>(s[kb_][2], s[kb_][3]));
    }
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int c = 0; c < DT; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[c][e] *= alpha[e & 1];
    }

    // ---- O^T += V^T P^T
    if constexpr (FP8) {
#pragma unroll
      for (int cc = 0; cc < D / 32; ++cc) {
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          uint32_t x[4];  // [keys 0-7 | 8-15] x [chunk 2 cc | 2 cc + 1], .trans: keys 2t, 2t+1 x dims 2g, 2g+1
          const int r = kw0 + kb_ * 16 + (lm & 1) * 8 + (lane & 7);
          ac::ldsm_x4_t(x, vs + r * RB + (ac::swz_chunk<C>(r, 2 * cc + (lm >> 1)) << 4));
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const uint32_t y0 = __byte_perm(x[2 * hh], 0, 0x3120);  // even dims' pair | odd dims' pair
            const uint32_t y1 = __byte_perm(x[2 * hh + 1], 0, 0x3120);
            const uint32_t a[4] = {ac::cvt_fp8x2_lo<KVK>(y0), ac::cvt_fp8x2_hi<KVK>(y0),
                                   ac::cvt_fp8x2_lo<KVK>(y1), ac::cvt_fp8x2_hi<KVK>(y1)};
            ac::mma16816<__half>(o[2 * cc + hh], a, pb[kb_][0], pb[kb_][1]);
          }
        }
      }
    } else {
#pragma unroll
      for (int c = 0; c < DT; ++c)
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          uint32_t x[4];  // [keys 0-7 | 8-15] x [dims 16 c .. +7 | +8 .. +15], .trans: keys 2t, 2t+1 of dim g
          const int r = kw0 + kb_ * 16 + (lm & 1) * 8 + (lane & 7);
          ac::ldsm_x4_t(x, vs + r * RB + (ac::swz_chunk<C>(r, 2 * c + (lm >> 1)) << 4));
          const uint32_t a[4] = {x[0], x[2], x[1], x[3]};  // A rows: dims g | g + 8; k: keys 2t | 2t + 8
          ac::mma16816<CT>(o[c], a, pb[kb_][0], pb[kb_][1]);
        }
    }
  }
  ac::cp_async_wait<0>();
  ac::grid_dep_launch();
  __syncthreads();  // pipeline smem is reused below

  merge_warps_t<Cfg, FP8>(sm, o, m_run, l_run, tid, warp, g, t);
  finish<Cfg, QT, OUTK>(p, wk, sm.stat, sm.red, sm.flag, tid, fold);
}

}  // namespace xqa
