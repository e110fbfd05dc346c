// attncore xqa: the mask of a thread's S rows (both kernels apply it through MaskRows).
//
// Logits become base 2 (qk * qk_scale).  Only boundary tiles are masked: those reaching the draft
// tokens (the last q_len keys: causal among the drafts, or the spec-decode mask) or the kv end, and
// those crossing the sliding window's edge.  Row r of the CTA is draft row qi = r / G; a padding row
// (past the rows of the request) takes any valid draft row, its result is never written.
#pragma once
#include "xqa_config.cuh"

namespace xqa {

// This thread's rows (of each m16 tile: r_first and r_first + r_step; the mma C layout's g and g + 8,
// the swapped layout's 2t and 2t + 1) and the request's draft region.
template <int MT>
struct MaskRows {
  int qi[MT][2];                // draft row of each of this thread's rows
  int draft0;                   // first draft token (causal / spec mask region)
  int seq_len;
  const uint16_t* mask_base;    // the request's spec-decode mask rows, or null
  __device__ __forceinline__ MaskRows(const XqaParams& p, int row0, int G, int QL, int seq_len, int b, int r_first,
                                      int r_step) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = row0 + mt * 16 + r_first + r_step * h;
        qi[mt][h] = rr < p.rows ? rr / G : QL - 1;  // padding rows: any valid draft row
      }
    draft0 = seq_len - QL;
    this->seq_len = seq_len;
    mask_base = p.spec_mask ? p.spec_mask + (int64_t)b * QL * p.mask_words16 : nullptr;
  }

  // Whether the tile of `tile` keys from tile_start needs the mask: it reaches the drafts (or the kv end)
  // or crosses the window's edge.
  __device__ __forceinline__ bool tile_needs_mask(const XqaParams& p, int tile_start, int tile) const {
    return (tile_start + tile > draft0) || (p.window_left >= 0 && tile_start < seq_len - 1 - p.window_left);
  }
  // Draft row qi's spec-mask words, or null.
  __device__ __forceinline__ const uint16_t* row_mask(const XqaParams& p, int qi) const {
    return mask_base ? mask_base + (int64_t)qi * p.mask_words16 : nullptr;
  }
  // Whether key tok is visible to draft row qi (mrow = row_mask(p, qi)): before the kv end, inside the window,
  // and among the drafts by the spec mask, else by the causal rule.
  __device__ __forceinline__ bool visible(const XqaParams& p, int tok, int qi, const uint16_t* mrow) const {
    const int pos_q = draft0 + qi;
    bool vis = tok < seq_len;
    if (p.window_left >= 0) vis = vis && tok >= pos_q - p.window_left;
    if (tok >= draft0) {
      if (mrow) {
        const int jd = tok - draft0;
        vis = vis && ((mrow[jd >> 4] >> (jd & 15)) & 1);
      } else if (p.causal) {
        vis = vis && tok <= pos_q;
      }
    }
    return vis;
  }
};

}  // namespace xqa
