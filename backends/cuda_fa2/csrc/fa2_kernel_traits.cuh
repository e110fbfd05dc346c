// attncore cuda_fa2: what every part of the FA2 kernel (and fa2_sm90.cuh's Hopper kernel) shares:
// the tile configuration, the shared-memory carve-up, the work item of a CTA and the CTA's
// coordinates.  Notation: fa2_attention.cuh.
#pragma once
#include <math.h>
#include <stdint.h>

#include "attncore/ptx.cuh"
#include "fa2_params.h"

namespace fa2 {

using ac::kLog2e;
constexpr float kNegInf = -INFINITY;

enum MaskMode { kMaskNone = 0, kMaskCausal = 1, kMaskCustom = 2 };

// Folds a sink's base-2 logit into a row's softmax denominator L (kept relative to the row max Mu):
// against the larger of the two, since ex2(sink - Mu) overflows to inf when ALiBi puts a row's
// logits 128+ below its sink.  Mu becomes that max; returns the factor that rescales O (relative to
// the old Mu).  When the row max is the larger (the usual case) this is L += ex2(sink - Mu), bit for bit.
__device__ __forceinline__ float fold_sink(float& L, float& Mu, float sink_log2) {
  const float mt = fmaxf(Mu, sink_log2);
  const float f = ac::ex2(Mu - mt);
  L = L * f + ac::ex2(sink_log2 - mt);
  Mu = mt;
  return f;
}

// element offset of 16-byte chunk c of row `row` in a swizzled [rows][D] 16-bit tile
template <int D> __device__ __forceinline__ int swz(int row, int c) {
  return row * D + (ac::swz_chunk<D / 8>(row, c) << 3);
}

// ----------------------------------------------------------------------------- kernel config
template <int D_, int NWQ_, int NWKV_, int NMQ_, int NNK_, int STAGES_, int MINB_ = 2, bool PF_ = true>
struct Config {
  static constexpr int D = D_, NWQ = NWQ_, NWKV = NWKV_, NMQ = NMQ_, NNK = NNK_, STAGES = STAGES_;
  static constexpr int MINB = MINB_;          // CTAs per SM the register budget is sized for
  static constexpr bool PF = PF_ && NWKV_ > 1;  // prefetch page ids a tile ahead (decode tiles)
#ifndef FA2_P_PGTAB
#define FA2_P_PGTAB 1
#endif
  // prefill tiles: page ids of the next tile land in a small smem table one iteration ahead
  static constexpr bool PGTAB = FA2_P_PGTAB != 0 && NWKV_ == 1 && NWQ_ * 32 >= 16 * NWKV_ * NNK_;
  static constexpr int NWARPS = NWQ * NWKV, NTHREADS = NWARPS * 32;
  static constexpr int CTA_Q = NWQ * NMQ * 16;
  static constexpr int KVW = NNK * 16;        // keys per warp per stage
  static constexpr int KVT = NWKV * KVW;      // keys per stage
  static constexpr int NDT = D / 8;           // 8-wide d tiles (mma n for PV)
  static constexpr int NKT = KVW / 8;         // 8-wide key tiles (mma n for QK)
};

template <typename Cfg, int KVBYTES>
struct Smem {
  static constexpr int D = Cfg::D;
  static constexpr size_t q_bytes = (size_t)Cfg::CTA_Q * D * 2;
  static constexpr size_t stage_bytes = (size_t)Cfg::KVT * D * KVBYTES * 2;  // K + V
  static constexpr size_t cvt_bytes = KVBYTES == 1 ? (size_t)Cfg::KVT * D * 2 * 2 : 0;  // 16-bit K + V (fp8)
  static constexpr size_t pgtab_bytes = Cfg::PGTAB ? 2 * Cfg::KVT * 4 : 0;
  static constexpr size_t main_bytes = q_bytes + Cfg::STAGES * stage_bytes + cvt_bytes + pgtab_bytes;
  static constexpr int OSTRIDE = D + 4;  // padded fp32 staging row
  static constexpr size_t epi_bytes = (size_t)Cfg::NWKV * Cfg::CTA_Q * (OSTRIDE + 2) * 4;
  static constexpr size_t bytes = main_bytes > epi_bytes ? main_bytes : epi_bytes;
};

// CUDA-graph mode: the grid is the work table's capacity and the live item count is in device memory
// (p.work_count, written by plan()); CTAs past it exit before touching anything (no barrier yet).
__device__ __forceinline__ bool past_work_count(const Fa2Params& p) {
  return p.work_count != nullptr && (int)blockIdx.x >= __ldg(p.work_count);
}

// A one-unit grid's unit u (launch or counter order) -> (item, kv head): Fa2Params.head_group
__device__ __forceinline__ void unit_of(const Fa2Params& p, unsigned u, unsigned& item, int& kvh) {
  const unsigned n = (unsigned)p.num_work;
  if (p.head_group > 1) {
    const unsigned g = (unsigned)p.head_group, r = u % (n * g);
    item = r / g;
    kvh = (int)(u / (n * g) * g + r % g);
  } else {
    item = u % n;
    kvh = (int)(u / n);
  }
}
// this CTA's (item, kv head) in a one-unit grid (items, kv heads): blockIdx, or in head_group's order
__device__ __forceinline__ uint2 grid_unit(const Fa2Params& p) {
  if (p.head_group <= 1) return make_uint2(blockIdx.x, blockIdx.y);
  unsigned item;
  int kvh;
  unit_of(p, blockIdx.y * gridDim.x + blockIdx.x, item, kvh);
  return make_uint2(item, (unsigned)kvh);
}

// A CTA's work item (fa2_params.h: request, first packed row, KV range, partial slot) with its
// request's lengths and the KV range cut to what the item's rows can see (causal; a sliding
// window when window_left >= 0).  Both kernels (this one and fa2_sm90.cuh's) decode it here.
// One request (Fa2Params.one_req): from the item's index and the params alone, so that a CTA starts without
// two dependent loads (~1.5% of a one-unit CTA of P1 non-causal, H200: bench/cuda_fa2.md, session 38).
template <int CTA_Q, int KVT, int MASK>
struct WorkItem {
  int req, row0, slot, qo_start, qo_len, kv_len, delta, rows_here, tok_lo, tok_hi, kv_lo, kv_hi, n_tiles;
  __device__ __forceinline__ WorkItem(const Fa2Params& p, unsigned item, int G, int window_left) {
    int kv_begin, kv_end;
    if (p.one_req != 0) {  // (the causal cut below makes [0, kv_len) the row tile's own range)
      req = 0;
      row0 = (p.one_req > 0 ? (int)item : p.num_work - 1 - (int)item) * CTA_Q;
      qo_start = p.one_qo_start, qo_len = p.one_qo_len, kv_len = p.one_kv_len;
      kv_begin = 0, kv_end = kv_len, slot = -1;
    } else {
      const int* wi = p.work + 5 * item;
      req = wi[0], row0 = wi[1];
      kv_begin = wi[2], kv_end = wi[3];
      slot = wi[4];
      qo_start = p.qo_indptr[req];
      qo_len = p.qo_indptr[req + 1] - qo_start;
      kv_len = p.kv_lens[req];
    }
    delta = kv_len - qo_len;  // query token t sits at key position t + delta
    rows_here = min(CTA_Q, qo_len * G - row0);
    tok_lo = row0 / G, tok_hi = (row0 + rows_here - 1) / G;
    kv_lo = kv_begin, kv_hi = min(kv_end, kv_len);
    if (MASK == kMaskCausal) kv_hi = min(kv_hi, tok_hi + delta + 1);
    if (window_left >= 0) kv_lo = max(kv_lo, tok_lo + delta - window_left);
    n_tiles = kv_hi > kv_lo ? (kv_hi - kv_lo + KVT - 1) / KVT : 0;
  }
};

// request `req`'s first K/V page (paged) or token (ragged)
__device__ __forceinline__ int kv_base_of(const Fa2Params& p, int req) {
  return p.one_req != 0 ? p.one_kv_base : p.kv_indptr[req];
}

// One CTA's coordinates (thread, warp, kv head) and its work item, with the request's pointers and
// offsets every stage of the kernel uses, read once at the top of the kernel (in this order).
template <typename Cfg, typename T, int MASK>
struct Cta {
  const Fa2Params& p;
  const int tid, lane, warp, wq, wkv;  // wq: warp index along Q rows, wkv: along keys
  const uint2 unit;                    // (item, kv head): grid_unit
  const int kvh, G;
  const WorkItem<Cfg::CTA_Q, Cfg::KVT, MASK> w;
  const T* qg;
  const uint8_t* kg;
  const uint8_t* vg;
  const int page_size, kv_base;
  const int64_t mask_base;  // custom mask: the request's first byte
  __device__ __forceinline__ explicit Cta(const Fa2Params& p_)
      : p(p_), tid(threadIdx.x), lane(tid & 31), warp(tid >> 5), wq(warp % Cfg::NWQ), wkv(warp / Cfg::NWQ),
        unit(grid_unit(p)), kvh((int)unit.y), G(p.group), w(p, unit.x, G, p.window_left),
        qg(reinterpret_cast<const T*>(p.q)), kg(reinterpret_cast<const uint8_t*>(p.k)),
        vg(reinterpret_cast<const uint8_t*>(p.v)), page_size(p.page_size),
        kv_base(kv_base_of(p, w.req)), mask_base(MASK == kMaskCustom ? (int64_t)p.mask_indptr[w.req] : 0) {}
};

}  // namespace fa2
