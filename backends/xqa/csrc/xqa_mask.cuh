// attncore xqa: what the mask of a thread's S rows needs (the mask itself is applied in the kernel,
// xqa_decode.cuh, which says why).
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
    mask_base = p.spec_mask ? p.spec_mask + (int64_t)b * QL * p.mask_words16 : nullptr;
  }
};

}  // namespace xqa
