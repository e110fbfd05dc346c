// attncore cuda_fa2: the online softmax of one S tile, per warp, in registers.
//
// Per row (two per m16 tile and thread: h2 = 0 / 1 for rows g and g + 8): the reference max m' (the
// tile's max, 4 lanes of a row reduced with quad_max, where it exceeds m by more than ac::kMaxSlack, else m:
// ac::next_max), p = exp2(s * sc - m'), l = l * exp2(m - m') + sum p, and O rescaled by alpha = exp2(m - m').
// m is in scaled base-2 units: sc is the logit scale when it was folded out of scale_and_mask
// (kFoldScale), else 1.  A row with no key yet keeps m = -inf and uses 0 as its reference (exp2(-inf) =
// 0, no NaN).  O is rescaled only when some row max of the warp moved (alpha == 1 otherwise).
#pragma once
#include "fa2_kernel_traits.cuh"

namespace fa2 {

template <int NMQ, int NKT, int NDT>
__device__ __forceinline__ void online_softmax(float (&s)[NMQ][NKT][4], float (&m)[NMQ][2], float (&l)[NMQ][2],
                                               float (&o)[NMQ][NDT][4], float sc) {
  float alpha[NMQ][2];
  bool moved = false;
#pragma unroll
  for (int mi = 0; mi < NMQ; ++mi)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < NKT; ++j) mx = fmaxf(mx, fmaxf(s[mi][j][2 * h2], s[mi][j][2 * h2 + 1]));
      mx = ac::quad_max(mx);
      const float mnew = ac::next_max(m[mi][h2], mx * sc);
      const float mu = mnew == kNegInf ? 0.f : mnew;
      const float a = ac::ex2(m[mi][h2] - mu);
      moved |= mnew != m[mi][h2];
      alpha[mi][h2] = a;
      m[mi][h2] = mnew;
      float rs = 0.f;
#pragma unroll
      for (int j = 0; j < NKT; ++j) {
        float p0 = ac::ex2(fmaf(s[mi][j][2 * h2], sc, -mu)), p1 = ac::ex2(fmaf(s[mi][j][2 * h2 + 1], sc, -mu));
        s[mi][j][2 * h2] = p0;
        s[mi][j][2 * h2 + 1] = p1;
        rs += p0 + p1;
      }
      l[mi][h2] = l[mi][h2] * a + rs;
    }
  if (__any_sync(0xffffffff, moved)) {
#pragma unroll
    for (int mi = 0; mi < NMQ; ++mi)
#pragma unroll
      for (int j = 0; j < NDT; ++j) {
        o[mi][j][0] *= alpha[mi][0];
        o[mi][j][1] *= alpha[mi][0];
        o[mi][j][2] *= alpha[mi][1];
        o[mi][j][3] *= alpha[mi][1];
      }
  }
}

}  // namespace fa2
