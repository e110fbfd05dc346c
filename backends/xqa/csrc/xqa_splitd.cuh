// attncore xqa: the split-dims kernel, fp8 KV at d128, 16 or 32 rows per CTA (Cfg::SD).
//
// The main kernel splits a tile's keys over the warps for both products, so each warp holds O for every row and
// dim: 32 rows x 128 dims are 128 fp32 accumulators per thread, 245 registers and 2 CTAs per SM, too few warps to
// hide the fp8 widening and the MMAs under the loads (X1 q4 e4m3 at 64% of the read ceiling).  Here the warps
// split the keys for S = Q K^T as before, and the dims for O += P V: P goes through shared memory, and warp w keeps
// O for dims 32 w .. 32 w + 31 only (32 accumulators per thread), so 4 CTAs fit an SM.  The warps then share each
// row's max: a tile's maxima are exchanged through smem only when one of them moves it (ac::next_max; the
// __syncthreads_or that completes P's tile votes on it), which after the first tiles is rare.
//
// Layouts (lane = 4 g + t), the main kernel's (xqa_mma.cuh):
//   s[mt][j][e]   row 16 mt + g + 8 (e / 2), key 16 warp + 8 j + 2 t + e % 2
//   P tile        [ROWS][64 keys] fp16, 16-byte chunks swizzled (ac::swz_chunk), written from s by 4-byte stores
//   o[mt][n][e]   row 16 mt + g + 8 (e / 2), dims of this warp's n8 tile n: the fp8 V layout's permuted columns,
//                 dim 16 (2 warp + n / 2) + 4 t + 2 (e % 2) + n % 2 (undone in the merge)
//   m_run[mt][h], l_run[mt][h]   row 16 mt + g + 8 h; m_run is the CTA's, l_run this lane's sum over its keys
// The ring, the mask's rules, the prescaled Q and the epilogue are the main kernel's; the merge has one slot.
#pragma once
#include "attncore/ptx.cuh"
#include "xqa_config.cuh"
#include "xqa_epilogue.cuh"
#include "xqa_load.cuh"
#include "xqa_mask.cuh"
#include "xqa_mma.cuh"
#include "xqa_params.h"

namespace xqa {

template <typename QT, int KVK, int OUTK, typename Cfg>
__global__ void __launch_bounds__(NT, Cfg::MIN_BLOCKS) xqa_decode_sd_kernel(const __grid_constant__ XqaParams p) {
  constexpr int D = Cfg::D, MT = Cfg::MT, RB = Cfg::RB, C = Cfg::C, ROWS = Cfg::ROWS;
  constexpr int TILE = Cfg::TILE, DIAG = Cfg::DIAG;
  constexpr int KT = TILE / 16;  // 16-key blocks of a tile (O += P V's k steps)
  constexpr int PC = TILE / 8;   // 16-byte chunks of a P row
  static_assert(Cfg::SD && KVK != 0 && D == 128 && TILE == 64, "the split-dims kernel's configuration");
  const float fold = (KVK == 1) ? ac::kFp8Fold : 1.f;

  extern __shared__ __align__(128) uint8_t smem[];
  const Smem<Cfg> sm(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, lm = lane >> 3;

  const Work<Cfg> wk(p);  // after the previous kernel's writes (PDL)
  const int my_tiles = wk.my_tiles;

  const KvCopy<Cfg> kv(p, wk, sm.big, tid);
  int pg[Cfg::RPT];
  kv.prologue(pg, tid);

  float q_unscale = 1.f;
  load_q<Cfg, QT, true>(sm.q, sm.ml, p, wk, tid, lane, warp, q_unscale);
  const MaskRows<MT> rows(p, wk.row0, wk.G, wk.QL, wk.seq_len, wk.b, g, 8);

  float o[MT][4][4];
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) m_run[mt][h] = -INFINITY, l_run[mt][h] = 0.f;
  }

  const uint32_t q_s = ac::smem_u32(sm.q), p_s = ac::smem_u32(sm.pt);
  float* const xmax = sm.ml;  // [NW][ROWS]: the warps' tile maxima when a row max moves
  const float qk_scale = p.qk_scale_log2 * fold * q_unscale;
  const int kw0 = 16 * warp;  // this warp's keys of a tile, for S

  for (int it = 0; it < my_tiles; ++it) {
    kv.advance(pg, it);
    const auto [ks, vs, tile_start] = kv.tile(it);

    if constexpr (DIAG == 1) continue;

    // ---- S = Q K^T for this warp's 16 keys (xqa_mma.cuh), masked (xqa_mask.cuh).  Left unscaled: the row max is
    // scaled (qk_scale > 0, so the max commutes with it) and P = 2^(s qk_scale - m) takes one FFMA an element
    float s[MT][2][4];
    compute_s<Cfg, __half, KVK>(s, ks, q_s, lm, kw0, lane);
    if (rows.tile_needs_mask(p, tile_start, TILE)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int qi = rows.qi[mt][h];
          const uint16_t* mrow = rows.row_mask(p, qi);
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (!rows.visible(p, tile_start + kw0 + 8 * j + 2 * t + e, qi, mrow)) s[mt][j][2 * h + e] = -INFINITY;
        }
    }

    // ---- the rows' max over the tile's 64 keys, exchanged only when it moves (xqa_softmax.cuh's rule).  A warp
    // whose rows keep the CTA's max writes its P at once; the barrier that completes P's tile also votes on a move
    // (the ring's barrier above has freed the tile).  On a move (rare after the first tiles) the warps exchange
    // their maxima, P is rewritten at the new max and a second barrier completes it.
    float mx[MT][2];
    bool up = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float a = fmaxf(fmaxf(s[mt][0][2 * h], s[mt][0][2 * h + 1]), fmaxf(s[mt][1][2 * h], s[mt][1][2 * h + 1]));
        mx[mt][h] = ac::quad_max(a) * qk_scale;
        up |= ac::next_max(m_run[mt][h], mx[mt][h]) != m_run[mt][h];
      }
    up = __any_sync(0xffffffffu, up);  // warp-uniform: this warp's P waits for the exchange
    auto store_p = [&](int mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * mt + g + 8 * h;
#pragma unroll
        for (int j = 0; j < 2; ++j)
          *reinterpret_cast<uint32_t*>(sm.pt + r * (TILE * 2) + (ac::swz_chunk<PC>(r, 2 * warp + j) << 4) + 4 * t) =
              ac::pack2<__half>(s[mt][j][2 * h], s[mt][j][2 * h + 1]);
      }
    };
    // P = 2^(s - m) in s, this lane's sums into l_run (scaled by alpha first where given), P -> smem (4-byte
    // stores: a row's 8 lanes hit 8 distinct chunks)
    auto write_p = [&](const float (*alpha)[2]) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_use = m_run[mt][h] == -INFINITY ? 0.f : m_run[mt][h];
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pv = ac::ex2(fmaf(s[mt][j][2 * h + e], qk_scale, -m_use));
              s[mt][j][2 * h + e] = pv;
              sum += pv;
            }
          l_run[mt][h] = (alpha ? l_run[mt][h] * alpha[mt][h] : l_run[mt][h]) + sum;
        }
        store_p(mt);
      }
    };
    if (!up) write_p(nullptr);
    if (__syncthreads_or(up)) {
      if (t == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) xmax[warp * ROWS + 16 * mt + g + 8 * h] = mx[mt][h];
      }
      __syncthreads();  // (the next writes come after the next move's vote, which every reader has passed)
      float alpha[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * mt + g + 8 * h;
          const float m4 = fmaxf(fmaxf(xmax[r], xmax[ROWS + r]), fmaxf(xmax[2 * ROWS + r], xmax[3 * ROWS + r]));
          const float m_new = ac::next_max(m_run[mt][h], m4);
          alpha[mt][h] = ac::ex2(m_run[mt][h] - (m_new == -INFINITY ? 0.f : m_new));
          m_run[mt][h] = m_new;
        }
      if (up) {
        write_p(alpha);
      } else {  // P and the sums were taken at the old max
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            l_run[mt][h] *= alpha[mt][h];
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) s[mt][j][2 * h + e] *= alpha[mt][h];
          }
          store_p(mt);
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mt][n][e] *= alpha[mt][e >> 1];
      __syncthreads();  // P's tile complete
    }

    // ---- O += P V for this warp's dims (fp8 chunks 2 warp, 2 warp + 1) over the tile's 64 keys
#pragma unroll
    for (int kb = 0; kb < KT; ++kb) {
      uint32_t pa[MT][4];  // P's A fragments: rows 16 mt .., keys 16 kb ..
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = 16 * mt + (lm & 1) * 8 + (lane & 7);
        ac::ldsm_x4(pa[mt], p_s + r * (TILE * 2) + (ac::swz_chunk<PC>(r, 2 * kb + (lm >> 1)) << 4));
      }
      uint32_t x[4];  // [keys 0-7 | 8-15] x [chunk 2 warp | 2 warp + 1], .trans: keys 2t, 2t+1 x dims 2g, 2g+1
      const int r = 16 * kb + (lm & 1) * 8 + (lane & 7);
      ac::ldsm_x4_t(x, vs + r * RB + (ac::swz_chunk<C>(r, 2 * warp + (lm >> 1)) << 4));
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        // bytes [V(2t,2g) V(2t,2g+1) V(2t+1,2g) V(2t+1,2g+1)] -> even dims pair, odd dims pair (xqa_decode.cuh)
        const uint32_t y0 = __byte_perm(x[2 * hh], 0, 0x3120);
        const uint32_t y1 = __byte_perm(x[2 * hh + 1], 0, 0x3120);
        const uint32_t e0 = ac::cvt_fp8x2_lo<KVK>(y0), e1 = ac::cvt_fp8x2_lo<KVK>(y1);
        const uint32_t o0 = ac::cvt_fp8x2_hi<KVK>(y0), o1 = ac::cvt_fp8x2_hi<KVK>(y1);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ac::mma16816<__half>(o[mt][2 * hh], pa[mt], e0, e1);
          ac::mma16816<__half>(o[mt][2 * hh + 1], pa[mt], o0, o1);
        }
      }
    }
  }
  ac::cp_async_wait<0>();
  ac::grid_dep_launch();
  __syncthreads();  // pipeline smem is reused below

  // ---- merge: every warp holds the CTA's m and its keys' l; O's dims are disjoint, one slot
  store_ml<Cfg>(sm.ml, m_run, l_run, warp, g, t);
  __syncthreads();
  warp_weights<Cfg>(sm.ml, sm.stat, tid);  // M = the CTA's m, L = the sum of the warps' l, weights 1 (0: no key)
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * mt + g + 8 * h;
      const float sc = sm.stat[r * (NW + 2) + warp];
      float* dst = sm.red + r * Cfg::RED_PITCH;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int d0 = 16 * (2 * warp + (n >> 1)) + 4 * t + (n & 1);
        dst[d0] = o[mt][n][2 * h] * sc;
        dst[d0 + 2] = o[mt][n][2 * h + 1] * sc;
      }
    }
  __syncthreads();
  finish<Cfg, QT, OUTK>(p, wk, sm.stat, sm.red, sm.flag, tid, fold);
}

}  // namespace xqa
