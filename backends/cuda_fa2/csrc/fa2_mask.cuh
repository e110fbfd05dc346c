// attncore cuda_fa2: logit transforms and masking of a warp's S tile (order: semantics.md -- scale,
// soft cap, ALiBi, then the mask).
//
// Without soft cap and ALiBi (kFoldScale) s stays raw q.k here: the scale is folded into the exp2
// of the softmax (one FMA per element), and tiles that need no mask are not touched at all.  Only
// boundary tiles are masked: the one crossing kv_hi, those crossing the causal diagonal or the
// sliding window's edge, and every tile of a custom mask.
#pragma once
#include "fa2_kernel_traits.cuh"

namespace fa2 {

template <bool SOFTCAP, bool ALIBI>
constexpr bool kFoldScale = !SOFTCAP && !ALIBI;

// This thread's rows (g = lane / 4 and g + 8 of each m16 tile): query token and ALiBi slope (base 2).
template <int NMQ>
struct RowInfo {
  int tok[NMQ][2];
  float slope[NMQ][2];
};

template <typename Cfg, bool ALIBI, typename CtaT>
__device__ __forceinline__ void init_rows(RowInfo<Cfg::NMQ>& rows, const CtaT& cta) {
  int row_head[Cfg::NMQ][2];
#pragma unroll
  for (int mi = 0; mi < Cfg::NMQ; ++mi)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      int lr = cta.wq * Cfg::NMQ * 16 + mi * 16 + (cta.lane >> 2) + h2 * 8;
      int pr = cta.w.row0 + lr;
      rows.tok[mi][h2] = pr / cta.G;
      row_head[mi][h2] = cta.kvh * cta.G + pr % cta.G;
      rows.slope[mi][h2] = 0.f;
      if (ALIBI && lr < cta.w.rows_here) rows.slope[mi][h2] = cta.p.alibi_slopes[row_head[mi][h2]] * kLog2e;
    }
}

// Scale / soft cap / ALiBi / mask of tile `tile` (this warp's keys start kv_w0 into the tile).
// Masked logits become -inf.
template <typename Cfg, int MASK, bool SOFTCAP, bool ALIBI, typename CtaT>
__device__ __forceinline__ void scale_and_mask(float (&s)[Cfg::NMQ][Cfg::NKT][4], const CtaT& cta,
                                               const RowInfo<Cfg::NMQ>& rows, int tile, int kv_w0) {
  constexpr int KVT = Cfg::KVT;
  const Fa2Params& p = cta.p;
  const int kv_lo = cta.w.kv_lo, kv_hi = cta.w.kv_hi, delta = cta.w.delta, lane = cta.lane;
  const int t0 = kv_lo + tile * KVT + kv_w0;  // first key of this warp
  const int tile_end = kv_lo + (tile + 1) * KVT;
  bool need_mask = tile_end > kv_hi || MASK == kMaskCustom;
  if (MASK == kMaskCausal) need_mask |= (tile_end - 1 > cta.w.tok_lo + delta);
  if (p.window_left >= 0) need_mask |= (kv_lo + tile * KVT < cta.w.tok_hi + delta - p.window_left);
  constexpr bool FOLD = kFoldScale<SOFTCAP, ALIBI>;
#pragma unroll
  for (int mi = 0; mi < Cfg::NMQ; ++mi)
#pragma unroll
    for (int j = 0; j < Cfg::NKT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (FOLD && !need_mask) continue;
        float x = s[mi][j][e];
        if (SOFTCAP) {
          x = tanhf(x * p.softcap_pre) * p.softcap_post;
        } else if (!FOLD) {
          x *= p.scale_log2;
        }
        const int h2 = e >> 1;
        const int kv = t0 + j * 8 + 2 * (lane & 3) + (e & 1);
        if (ALIBI) x += rows.slope[mi][h2] * (float)(kv - rows.tok[mi][h2]);
        if (need_mask) {
          const int tok = rows.tok[mi][h2];
          bool keep = kv < kv_hi;
          if (MASK == kMaskCausal) keep &= kv <= tok + delta;
          if (p.window_left >= 0) keep &= kv >= tok + delta - p.window_left;
          if (MASK == kMaskCustom) {
            if (keep && tok < cta.w.qo_len) {
              int64_t bit = (int64_t)tok * cta.w.kv_len + kv;
              uint8_t byte = p.mask[cta.mask_base + (bit >> 3)];
              keep = (byte >> (bit & 7)) & 1;
            } else {
              keep = false;
            }
          }
          if (!keep) x = kNegInf;
        }
        s[mi][j][e] = x;
      }
}

}  // namespace fa2
