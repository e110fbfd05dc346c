// attncore xqa: the end of the kernel -- merge the 4 warps' partial softmaxes, normalise, write; with
// split-KV (S > 1) write a partial and let the last CTA of a (request, kv head, m-group) merge the S
// partials.
//
//   merge_warps     each warp's (m, l) per row -> smem (store_ml); per row M = max over warps, L = sum of the
//                   warps' l * exp2(m_w - M) (sm_stat), then each warp's O scaled by its weight
//                   (sm_red; fp8 KV: O's permuted columns put back in order).
//   Out             the final writes: output (q dtype or fp8 e4m3 with saturation) and LSE, and the
//                   normaliser (with the sink folded in against max(row max, sink)).
//   write_final     S == 1: sum the warps' O (Cfg::SLOTS of them), normalise, write (and the LSE).
//   write_partial   S > 1: the normalised partial O and its LSE to the workspace (L2, __stcg), then
//   last_to_arrive  an arrival counter per (b, kvh, mg); the last CTA resets it to 0 and merges:
//   merge_splits    weights 2^(lse_s - M) per row, the weighted sum of the S partials, normalise.
//   finish          the above in order, for every kernel (after merge_warps / the swapped or split-dims merge).
// Rows that see no key give output 0 and LSE -inf.  A NaN query row has NaN L (its m stays -inf:
// fmaxf drops NaN) and NaN != 0 carries it to the output and LSE (semantics.md rule 3).
#pragma once
#include "attncore/ptx.cuh"
#include "xqa_config.cuh"

namespace xqa {

// From the warps' (m, l) of each row (sm_ml): the row's M, L and each warp's weight (sm_stat).
template <typename Cfg>
__device__ __forceinline__ void warp_weights(const float* sm_ml, float* sm_stat, int tid) {
  constexpr int ROWS = Cfg::ROWS;
  if (tid < ROWS) {
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_ml[(w * ROWS + tid) * 2]);
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = sm_ml[(w * ROWS + tid) * 2];
      const float sc = mw == -INFINITY ? 0.f : ac::ex2(mw - M);
      sm_stat[tid * (NW + 2) + w] = sc;
      L += sc * sm_ml[(w * ROWS + tid) * 2 + 1];
    }
    sm_stat[tid * (NW + 2) + NW] = M;
    sm_stat[tid * (NW + 2) + NW + 1] = L;
  }
}

// This warp's (m, l) of its rows (the mma C layout's: row 16 mt + g + 8 h; l summed over the row's 4 lanes) into
// sm_ml, for warp_weights.
template <typename Cfg>
__device__ __forceinline__ void store_ml(float* sm_ml, const float (&m_run)[Cfg::MT][2],
                                         const float (&l_run)[Cfg::MT][2], int warp, int g, int t) {
#pragma unroll
  for (int mt = 0; mt < Cfg::MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = ac::quad_sum(l_run[mt][h]);
      if (t == 0) {
        const int r = mt * 16 + g + 8 * h;
        sm_ml[(warp * Cfg::ROWS + r) * 2 + 0] = m_run[mt][h];
        sm_ml[(warp * Cfg::ROWS + r) * 2 + 1] = l;
      }
    }
}

template <typename Cfg, bool FP8>
__device__ __forceinline__ void merge_warps(float* sm_ml, float* sm_stat, float* sm_red,
                                            const float (&o)[Cfg::MT][Cfg::D / 8][4], const float (&m_run)[Cfg::MT][2],
                                            const float (&l_run)[Cfg::MT][2], int tid, int warp, int g, int t) {
  constexpr int MT = Cfg::MT, ROWS = Cfg::ROWS, NTILES_D = Cfg::D / 8;
  store_ml<Cfg>(sm_ml, m_run, l_run, warp, g, t);
  __syncthreads();
  warp_weights<Cfg>(sm_ml, sm_stat, tid);
  __syncthreads();
  // each warp writes its scaled O
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + g + 8 * h;
      const float sc = sm_stat[r * (NW + 2) + warp];
      float* dst = sm_red + (warp * ROWS + r) * Cfg::RED_PITCH;
#pragma unroll
      for (int n = 0; n < NTILES_D; ++n) {
        if constexpr (!FP8) {
          *reinterpret_cast<float2*>(dst + 8 * n + 2 * t) = make_float2(o[mt][n][2 * h] * sc, o[mt][n][2 * h + 1] * sc);
        } else {
          const int d0 = 16 * (n >> 1) + 4 * t + (n & 1);
          dst[d0] = o[mt][n][2 * h] * sc;
          dst[d0 + 2] = o[mt][n][2 * h + 1] * sc;
        }
      }
    }
  __syncthreads();
}

// The CTA's final writes.  Holds references to the kernel's values, as the lambdas it replaces did.
template <typename QT, int OUTK>
struct Out {
  const XqaParams& p;
  const int &G, &QL, &b, &kvh, &row0;
  const float& fold;  // fp8 e4m3 KV on sm_80: 2^8 (ac::kFp8Fold), else 1

  // r: row within the CTA, d4: group of 4 columns
  __device__ __forceinline__ void store_out(int r, int d4, float4 v) const {
    const int rr = row0 + r;
    const int qi = rr / G, hh = rr % G;
    const int64_t off = (int64_t)(b * QL + qi) * p.o_stride_tok + (int64_t)(kvh * G + hh) * p.o_stride_head + d4 * 4;
    if constexpr (OUTK == 0) {
      uint2 u = make_uint2(ac::pack2<QT>(v.x, v.y), ac::pack2<QT>(v.z, v.w));
      *reinterpret_cast<uint2*>(reinterpret_cast<QT*>(p.out) + off) = u;
    } else {
      const __nv_fp8x2_storage_t a = __nv_cvt_float2_to_fp8x2(make_float2(v.x, v.y), __NV_SATFINITE, __NV_E4M3);
      const __nv_fp8x2_storage_t c = __nv_cvt_float2_to_fp8x2(make_float2(v.z, v.w), __NV_SATFINITE, __NV_E4M3);
      *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(p.out) + off) = (uint32_t)a | ((uint32_t)c << 16);
    }
  }
  __device__ __forceinline__ void store_lse(int r, float v) const {
    const int rr = row0 + r;
    const int qi = rr / G, hh = rr % G;
    p.lse[(int64_t)(b * QL + qi) * p.lse_stride_tok + (int64_t)(kvh * G + hh) * p.lse_stride_head] = v;
  }
  // Final normaliser of a row r that saw a key (L != 0), given its max M and its sum L relative to M
  // (base 2): sets lse and returns the factor for the O accumulated relative to M.  A sink is folded
  // into the denominator against the larger of M and the sink: ex2(sink - M) overflows to inf when
  // the sink is 128+ (base 2; ~88.7 nats) above every logit of the row (a large sink, or logits far
  // below zero: q.k * bmm1_scale is unbounded), which gave LSE +inf and output 0.  With no sink, or
  // M >= sink, the operations are those of before (1 / (L + ex2(sink - M)), M + log2(L + ...)); a
  // larger sink gives the same values up to rounding.  A NaN row (NaN L) stays NaN.
  __device__ __forceinline__ float normalise(int r, float M, float L, float& lse) const {
    float den = L;
    if (p.sinks) {
      const float sk = p.sinks[kvh * G + (row0 + r) % G] * ac::kLog2e;
      if (sk > M) {  // relative to the sink: ex2(M - sk) <= 1 (0 for a NaN row's M = -inf: L keeps it NaN)
        const float e = ac::ex2(M - sk);
        den = L * e + 1.f;
        lse = sk + __log2f(den);
        return p.out_scale * fold * e / den;
      }
      den = L + ac::ex2(sk - M);
    }
    lse = M + __log2f(den);
    return p.out_scale * fold / den;
  }
};

// S == 1: the rows' outputs (sum of the warps' scaled O, normalised) and LSE.
template <typename Cfg, typename OutT>
__device__ __forceinline__ void write_final(const OutT& out, const XqaParams& p, const float* sm_stat,
                                            const float* sm_red, int tid, int rows_here) {
  constexpr int ROWS = Cfg::ROWS, D4 = Cfg::D / 4;
  for (int i = tid; i < rows_here * D4; i += NT) {
    const int r = i / D4, d4 = i % D4;
    const float* st = sm_stat + r * (NW + 2);
    const float M = st[NW], L = st[NW + 1];
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < Cfg::SLOTS; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(sm_red + (w * ROWS + r) * Cfg::RED_PITCH + d4 * 4);
      acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
    }
    // L == 0: no key (0, -inf); a NaN query row has NaN L (its m stays -inf, fmaxf drops NaN),
    // and NaN != 0 carries it to the output and LSE (semantics.md rule 3)
    float f = 0.f, lse_r;
    if (L != 0.f) f = out.normalise(r, M, L, lse_r);
    out.store_out(r, d4, make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f));
  }
  if (p.lse && tid < rows_here) {
    const float* st = sm_stat + tid * (NW + 2);
    const float M = st[NW], L = st[NW + 1];
    float lse_r = -INFINITY;
    if (L != 0.f) out.normalise(tid, M, L, lse_r);
    out.store_lse(tid, lse_r);
  }
}

// S > 1: this split's normalised partial O and its LSE into the workspace slot of `unit` (b, kvh, mg).
template <typename Cfg>
__device__ __forceinline__ void write_partial(const XqaParams& p, const float* sm_stat, const float* sm_red,
                                              int64_t unit, int split, int tid, int rows_here) {
  constexpr int D = Cfg::D, ROWS = Cfg::ROWS, D4 = D / 4;
  float* po = p.ws_partial_o + (unit * p.num_splits + split) * ROWS * D;
  float* pl = p.ws_partial_lse + (unit * p.num_splits + split) * ROWS;
  for (int i = tid; i < rows_here * D4; i += NT) {
    const int r = i / D4, d4 = i % D4;
    const float L = sm_stat[r * (NW + 2) + NW + 1];
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < Cfg::SLOTS; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(sm_red + (w * ROWS + r) * Cfg::RED_PITCH + d4 * 4);
      acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
    }
    const float f = L != 0.f ? 1.f / L : 0.f;
    __stcg(reinterpret_cast<float4*>(po + r * D + d4 * 4), make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f));
  }
  if (tid < rows_here) {
    const float M = sm_stat[tid * (NW + 2) + NW], L = sm_stat[tid * (NW + 2) + NW + 1];
    __stcg(pl + tid, L != 0.f ? M + __log2f(L) : -INFINITY);
  }
}

// After write_partial: count this CTA's arrival; true in the last of the S CTAs (which resets the
// counter to 0, ready for the next launch).
__device__ __forceinline__ bool last_to_arrive(const XqaParams& p, int64_t unit, int* sm_flag, int tid) {
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int prev = atomicAdd(p.ws_counters + unit, 1);
    const int last = prev == p.num_splits - 1;
    if (last) p.ws_counters[unit] = 0;  // every split has arrived: ready for the next launch
    *sm_flag = last;
  }
  __syncthreads();
  if (!*sm_flag) return false;
  __threadfence();
  return true;
}

// The last CTA: weights w_s = 2^(lse_s - M) per row (in smem, reusing the merge buffer), the
// weighted sum of the S partials, normalised and written.
template <typename Cfg, typename OutT>
__device__ __forceinline__ void merge_splits(const OutT& out, const XqaParams& p, float* sm_stat, float* sm_red,
                                             int64_t unit, int tid, int rows_here) {
  constexpr int D = Cfg::D, ROWS = Cfg::ROWS, D4 = D / 4;
  const int S = p.num_splits;
  float* sm_w = sm_red;  // [ROWS][S]
  const float* plse = p.ws_partial_lse + unit * S * ROWS;
  const float* pob = p.ws_partial_o + unit * S * ROWS * D;
  __syncthreads();
  for (int i = tid; i < rows_here * S; i += NT) {
    const int r = i / S, s_ = i % S;
    sm_w[r * S + s_] = __ldcg(plse + s_ * ROWS + r);
  }
  __syncthreads();
  if (tid < rows_here) {
    float M = -INFINITY;
    for (int s_ = 0; s_ < S; ++s_) M = fmaxf(M, sm_w[tid * S + s_]);
    float L = 0.f;
    for (int s_ = 0; s_ < S; ++s_) {
      const float x = sm_w[tid * S + s_];
      const float w = x == -INFINITY ? 0.f : ac::ex2(x - M);
      sm_w[tid * S + s_] = w;
      L += w;
    }
    sm_stat[tid * (NW + 2) + NW] = M;
    sm_stat[tid * (NW + 2) + NW + 1] = L;
  }
  __syncthreads();
  for (int i = tid; i < rows_here * D4; i += NT) {
    const int r = i / D4, d4 = i % D4;
    const float M = sm_stat[r * (NW + 2) + NW], L = sm_stat[r * (NW + 2) + NW + 1];
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (L != 0.f) {  // a NaN partial LSE (NaN query row) gives NaN weights, L and output
      const float* src = pob + r * D + d4 * 4;
      int s_ = 0;
      for (; s_ + 8 <= S; s_ += 8) {
        float4 x[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) x[u] = __ldcg(reinterpret_cast<const float4*>(src + (int64_t)(s_ + u) * ROWS * D));
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const float w = sm_w[r * S + s_ + u];
          acc.x += w * x[u].x; acc.y += w * x[u].y; acc.z += w * x[u].z; acc.w += w * x[u].w;
        }
      }
      for (; s_ < S; ++s_) {
        const float4 x = __ldcg(reinterpret_cast<const float4*>(src + (int64_t)s_ * ROWS * D));
        const float w = sm_w[r * S + s_];
        acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
      }
    }
    float f = 0.f, lse_r;
    if (L != 0.f) f = out.normalise(r, M, L, lse_r);
    out.store_out(r, d4, make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f));
  }
  if (p.lse && tid < rows_here) {
    const float M = sm_stat[tid * (NW + 2) + NW], L = sm_stat[tid * (NW + 2) + NW + 1];
    float lse_r = -INFINITY;
    if (L != 0.f) out.normalise(tid, M, L, lse_r);
    out.store_lse(tid, lse_r);
  }
}

// After the warps' merge: S == 1 writes the rows; S > 1 writes this split's partial, and the last
// split's CTA merges them all.
template <typename Cfg, typename QT, int OUTK>
__device__ __forceinline__ void finish(const XqaParams& p, const Work<Cfg>& wk, float* sm_stat, float* sm_red,
                                       int* sm_flag, int tid, float fold) {
  const int G = wk.G, QL = wk.QL, row0 = wk.row0, rows_here = wk.rows_here;
  const int b = wk.b, kvh = wk.kvh, mg = wk.mg, split = wk.split;
  const bool split_mode = p.num_splits > 1;
  const int64_t unit = ((int64_t)(b * p.num_kv_heads + kvh) * p.m_groups + mg);  // (b, kvh, mg)
  const Out<QT, OUTK> out{p, G, QL, b, kvh, row0, fold};
  if (!split_mode) {
    write_final<Cfg>(out, p, sm_stat, sm_red, tid, rows_here);
    return;
  }
  write_partial<Cfg>(p, sm_stat, sm_red, unit, split, tid, rows_here);
  if (!last_to_arrive(p, unit, sm_flag, tid)) return;
  merge_splits<Cfg>(out, p, sm_stat, sm_red, unit, tid, rows_here);
}

}  // namespace xqa
