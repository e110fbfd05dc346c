// attncore xqa: the online softmax of one S tile, per warp, in registers (base 2).
//
// Per row: m' = the tile's row max where it exceeds m by more than ac::kMaxSlack, else m (ac::next_max;
// the 4 lanes of a row reduced with quad_max), p = exp2(s - m'), l = l * exp2(m - m') + sum p; a row
// with no key yet keeps m = -inf and uses 0 as its reference (no NaN).  P is rounded to CT into pa, the
// A operand of O += P V.  O is rescaled by exp2(m - m') only when some row max of the warp grew (alpha
// == 1 for every other row).
#pragma once
#include "attncore/ptx.cuh"
#include "xqa_config.cuh"

namespace xqa {

template <typename Cfg, typename CT>
__device__ __forceinline__ void online_softmax(float (&s)[Cfg::MT][2 * Cfg::KB][4], float (&m_run)[Cfg::MT][2],
                                               float (&l_run)[Cfg::MT][2], uint32_t (&pa)[Cfg::MT][Cfg::KB][4],
                                               float (&o)[Cfg::MT][Cfg::D / 8][4]) {
  constexpr int MT = Cfg::MT, KB = Cfg::KB, NTILES_D = Cfg::D / 8;
  float alpha_r[MT][2];
  bool grew = false;  // a row max of this warp moved: O needs rescaling (skipped otherwise)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(s[mt][0][2 * h], s[mt][0][2 * h + 1]);
#pragma unroll
      for (int j = 1; j < 2 * KB; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * h], s[mt][j][2 * h + 1]));
      mx = ac::quad_max(mx);
      const float m_new = ac::next_max(m_run[mt][h], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = ac::ex2(m_run[mt][h] - m_use);
      grew |= m_new > m_run[mt][h];
      alpha_r[mt][h] = alpha;
      m_run[mt][h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 2 * KB; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = ac::ex2(s[mt][j][2 * h + e] - m_use);
          s[mt][j][2 * h + e] = pv;
          sum += pv;
        }
      l_run[mt][h] = l_run[mt][h] * alpha + sum;
    }
#pragma unroll
    for (int kb_ = 0; kb_ < KB; ++kb_) {
      pa[mt][kb_][0] = ac::pack2<CT>(s[mt][2 * kb_][0], s[mt][2 * kb_][1]);
      pa[mt][kb_][1] = ac::pack2<CT>(s[mt][2 * kb_][2], s[mt][2 * kb_][3]);
      pa[mt][kb_][2] = ac::pack2<CT>(s[mt][2 * kb_ + 1][0], s[mt][2 * kb_ + 1][1]);
      pa[mt][kb_][3] = ac::pack2<CT>(s[mt][2 * kb_ + 1][2], s[mt][2 * kb_ + 1][3]);
    }
  }

  if (__any_sync(0xffffffffu, grew)) {  // rows whose max did not move have alpha == 1
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int n = 0; n < NTILES_D; ++n) {
          o[mt][n][2 * h] *= alpha_r[mt][h];
          o[mt][n][2 * h + 1] *= alpha_r[mt][h];
        }
  }
}

}  // namespace xqa
