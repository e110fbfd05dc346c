// attncore cuda_fa2: the end of the FA2 kernel and the split-KV merge.
//
// The epilogue: each warp holds (m, l, O) of its rows over its keys; with NWKV warps along the keys
// (decode tiles) these are partial softmaxes of one row.  They are staged in smem (fp32, rows padded
// to D + 4 floats), merged (weights exp2(m_w - M)), normalised and written coalesced, 16 bytes per
// thread: the final output (+ sink, out_scale, LSE), or, for a split work item (slot >= 0), a float
// partial and its LSE that fa2_merge_kernel combines.  L == 0 means the row saw no key: output 0,
// LSE -inf.  A NaN query row has NaN L (its m stays -inf: fmaxf drops NaN) and NaN != 0 carries it
// to the output and LSE (semantics.md, non-finite inputs rule 3).  The kernel calls stage_partials,
// then per row chunk merge_warps, the normalisation (written in the kernel: fa2_attention.cuh says
// why) and write_row.
#pragma once
#include "fa2_kernel_traits.cuh"

namespace fa2 {

// The staging area (reusing the pipeline's smem): per warp along the keys, O rows (fp32, padded to
// D + 4 floats against bank conflicts), then the rows' m and l.
template <typename Cfg>
struct EpiSmem {
  static constexpr int OS = Smem<Cfg, 2>::OSTRIDE;  // (Smem sizes it; independent of the KV width)
  float* eO;  // [NWKV][CTA_Q][OS]
  float* eM;  // [NWKV][CTA_Q]
  float* eL;  // [NWKV][CTA_Q]
  __device__ __forceinline__ explicit EpiSmem(uint8_t* smem)
      : eO(reinterpret_cast<float*>(smem)), eM(eO + Cfg::NWKV * Cfg::CTA_Q * OS), eL(eM + Cfg::NWKV * Cfg::CTA_Q) {}
};

// Every warp's (m, l, O) of its rows -> smem (after the last K/V copies landed).
template <typename Cfg, typename CtaT>
__device__ __forceinline__ void stage_partials(uint8_t* smem, const float (&o)[Cfg::NMQ][Cfg::NDT][4],
                                               const float (&m)[Cfg::NMQ][2], const float (&l)[Cfg::NMQ][2],
                                               const CtaT& cta) {
  constexpr int NMQ = Cfg::NMQ, NDT = Cfg::NDT, CTA_Q = Cfg::CTA_Q, OS = EpiSmem<Cfg>::OS;
  const int lane = cta.lane, wq = cta.wq, wkv = cta.wkv;
  ac::cp_async_wait<0>();
  __syncthreads();
  const EpiSmem<Cfg> e(smem);
#pragma unroll
  for (int mi = 0; mi < NMQ; ++mi)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const float ls = ac::quad_sum(l[mi][h2]);
      const int lr = wq * NMQ * 16 + mi * 16 + (lane >> 2) + h2 * 8;
      float* orow = e.eO + (wkv * CTA_Q + lr) * OS;
#pragma unroll
      for (int j = 0; j < NDT; ++j)
        *reinterpret_cast<float2*>(orow + j * 8 + 2 * (lane & 3)) = make_float2(o[mi][j][2 * h2], o[mi][j][2 * h2 + 1]);
      if ((lane & 3) == 0) {
        e.eM[wkv * CTA_Q + lr] = m[mi][h2];
        e.eL[wkv * CTA_Q + lr] = ls;
      }
    }
  __syncthreads();
}

// Row r, chunk c (8 columns) merged over the NWKV warps: Mu (the max, 0 when no warp saw a key),
// L and acc relative to Mu.
template <typename Cfg>
__device__ __forceinline__ void merge_warps(uint8_t* smem, int r, int c, float& Mu, float& L, float (&acc)[8]) {
  constexpr int CTA_Q = Cfg::CTA_Q, OS = EpiSmem<Cfg>::OS;
  const EpiSmem<Cfg> e(smem);
  float M = kNegInf;
#pragma unroll
  for (int w = 0; w < Cfg::NWKV; ++w) M = fmaxf(M, e.eM[w * CTA_Q + r]);
  Mu = M == kNegInf ? 0.f : M;
  L = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
#pragma unroll
  for (int w = 0; w < Cfg::NWKV; ++w) {
    const float f = ac::ex2(e.eM[w * CTA_Q + r] - Mu);
    L += e.eL[w * CTA_Q + r] * f;
    const float* src = e.eO + (w * CTA_Q + r) * OS + c * 8;
    float4 u0 = *reinterpret_cast<const float4*>(src), u1 = *reinterpret_cast<const float4*>(src + 4);
    acc[0] += u0.x * f; acc[1] += u0.y * f; acc[2] += u0.z * f; acc[3] += u0.w * f;
    acc[4] += u1.x * f; acc[5] += u1.y * f; acc[6] += u1.z * f; acc[7] += u1.w * f;
  }
}

// acc * scale of row tok, head h, chunk c: the final output (T) and LSE, or a float partial of slot.
template <typename Cfg, typename T>
__device__ __forceinline__ void write_row(const Fa2Params& p, const float (&acc)[8], float scale, float lse_v,
                                          bool final_out, int qo_start, int slot, int tok, int h, int c) {
  if (final_out) {
    T* dst = reinterpret_cast<T*>(p.o) + (int64_t)(qo_start + tok) * p.o_stride_n + (int64_t)h * p.o_stride_h + c * 8;
    uint4 pk;
    uint32_t* pp = reinterpret_cast<uint32_t*>(&pk);
#pragma unroll
    for (int e = 0; e < 4; ++e) pp[e] = ac::pack2<T>(acc[2 * e] * scale, acc[2 * e + 1] * scale);
    *reinterpret_cast<uint4*>(dst) = pk;
    if (c == 0 && p.lse != nullptr) p.lse[(int64_t)(qo_start + tok) * p.num_qo_heads + h] = lse_v;
  } else {
    float* dst = p.o_part + ((int64_t)(slot + tok) * p.num_qo_heads + h) * Cfg::D + c * 8;
    *reinterpret_cast<float4*>(dst) = make_float4(acc[0] * scale, acc[1] * scale, acc[2] * scale, acc[3] * scale);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4] * scale, acc[5] * scale, acc[6] * scale, acc[7] * scale);
    if (c == 0) p.lse_part[(int64_t)(slot + tok) * p.num_qo_heads + h] = lse_v;
  }
}

// ------------------------------------------------------------------- merge of split-KV partials
// grid (num_rows, Hq), D/4 threads: each thread merges 4 floats of one (row, head) over the splits.
// Row n of the merge table (schedule.py Schedule.merge_table): out row, first partial row, partial row
// stride, splits.  CUDA-graph mode: the grid is the table's capacity, the live row count in merge_count.
template <typename T, int D>
__global__ void __launch_bounds__(D / 4) fa2_merge_kernel(const Fa2MergeParams p) {
  const int n = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
  if (p.merge_count != nullptr && n >= __ldg(p.merge_count)) return;
  const int4 mt = __ldg(reinterpret_cast<const int4*>(p.merge_table) + n);
  const int out_row = mt.x, ns = mt.w;
  const int64_t base = mt.y;
  const int64_t rs = (int64_t)mt.z * p.num_qo_heads;  // partial-row stride between splits, in (row, head)s
  const float* lp = p.lse_part + base * p.num_qo_heads + h;
  float M = kNegInf;
#pragma unroll 8
  for (int s = 0; s < ns; ++s) M = fmaxf(M, lp[s * rs]);
  float Mu = M == kNegInf ? 0.f : M;
  float L = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const float* op = p.o_part + (base * p.num_qo_heads + h) * D + c * 4;
#pragma unroll 4
  for (int s = 0; s < ns; ++s) {
    const float f = ac::ex2(lp[s * rs] - Mu);
    const float4 u = *reinterpret_cast<const float4*>(op + s * rs * D);
    L += f;
    acc.x += u.x * f; acc.y += u.y * f; acc.z += u.z * f; acc.w += u.w * f;
  }
  float lse_v = kNegInf, scale = 0.f;
  if (L != 0.f) {  // as in the main epilogue: 0 = no key in any split; NaN (a NaN query) propagates
    float f = 1.f;
    if (p.sinks != nullptr) f = fold_sink(L, Mu, p.sinks[h] * kLog2e);
    lse_v = Mu + log2f(L);
    scale = p.out_scale * f / L;
  }
  T* dst = reinterpret_cast<T*>(p.o) + (int64_t)out_row * p.o_stride_n + (int64_t)h * p.o_stride_h + c * 4;
  uint2 pk;
  pk.x = ac::pack2<T>(acc.x * scale, acc.y * scale);
  pk.y = ac::pack2<T>(acc.z * scale, acc.w * scale);
  *reinterpret_cast<uint2*>(dst) = pk;
  if (c == 0 && p.lse != nullptr) p.lse[(int64_t)out_row * p.num_qo_heads + h] = lse_v;
}


}  // namespace fa2
