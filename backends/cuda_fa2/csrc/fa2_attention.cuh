// attncore cuda_fa2: FA2-style attention kernel (prefill, append and decode through one template).
//
// Notation (see fa2_params.h for the data contract)
//   B, Hq, Hkv, G = Hq/Hkv, D          batch, heads, group, head dim
//   packed row r = tok * G + g          query token tok, head kvh * G + g: a GQA group shares K/V
//   CTA_Q = NWQ * NMQ * 16              packed rows per CTA (NWQ warps along Q, NMQ m16 tiles each)
//   KVW = 16 * NNK (per warp),          KVT = NWKV * KVW keys per pipeline stage (NWKV warps along KV)
//   STAGES                              cp.async pipeline depth for K/V tiles
//   s = q.k * scale * log2(e)           logits in base 2: exp2 with the scale folded in
//   m, l                                running row max / row sum of exp2(s - m) (online softmax)
//   LSE = m + log2(l)                   base 2
//
// Per CTA: one work item (request, packed-row tile, kv range) of one kv head (blockIdx.y).
//   Q tile -> smem (cp.async, zero-filled past the end) -> mma A fragments via ldmatrix.
//   K/V tiles -> smem ring of STAGES buffers (cp.async, page-table gather in the copy,
//   zero-fill past kv end), 16-byte chunks XOR-swizzled by (row & 7) so ldmatrix is conflict free.
//   Page ids: prefill tiles read them from a 2 x KVT smem table filled one iteration ahead (the id
//   load overlaps the math); decode tiles load them directly, or a tile ahead into registers (PF).
//   S = Q K^T with mma.sync m16n8k16 (fp32 accum), mask on boundary tiles only, online softmax in
//   registers, P (bf16/fp16) reused in place as the A operand of O += P V (ldmatrix.trans for V).
//   fp8 KV: tiles land as fp8 and are converted once per stage into 16-bit smem tiles (exact).
//   RoPE (LLaMA rotate-half): Q rotated in smem once; K rotated in smem per stage.
//   Epilogue: per-warp (m, l, O) staged in smem (fp32), merged across the NWKV warps, normalised,
//   then written coalesced: final output (+ sink, out_scale, LSE) or a float partial for fa2_merge.
// Causal tiles above the diagonal are never loaded: the kv range is clipped per CTA.
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
template <int D> __device__ __forceinline__ int swz(int row, int c) { return row * D + (ac::swz_chunk<D / 8>(row, c) << 3); }

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

// A CTA's work item (fa2_params.h: request, first packed row, KV range, partial slot) with its
// request's lengths and the KV range cut to what the item's rows can see (causal; a sliding
// window when window_left >= 0).  Both kernels (this one and fa2_sm90.cuh's) decode it here.
template <int CTA_Q, int KVT, int MASK>
struct WorkItem {
  int req, row0, slot, qo_start, qo_len, kv_len, delta, rows_here, tok_lo, tok_hi, kv_lo, kv_hi, n_tiles;
  __device__ __forceinline__ WorkItem(const Fa2Params& p, unsigned item, int G, int window_left) {
    const int* wi = p.work + 5 * item;
    req = wi[0], row0 = wi[1];
    const int kv_begin = wi[2], kv_end = wi[3];
    slot = wi[4];
    qo_start = p.qo_indptr[req];
    qo_len = p.qo_indptr[req + 1] - qo_start;
    kv_len = p.kv_lens[req];
    delta = kv_len - qo_len;  // query token t sits at key position t + delta
    rows_here = min(CTA_Q, qo_len * G - row0);
    tok_lo = row0 / G, tok_hi = (row0 + rows_here - 1) / G;
    kv_lo = kv_begin, kv_hi = min(kv_end, kv_len);
    if (MASK == kMaskCausal) kv_hi = min(kv_hi, tok_hi + delta + 1);
    if (window_left >= 0) kv_lo = max(kv_lo, tok_lo + delta - window_left);
    n_tiles = kv_hi > kv_lo ? (kv_hi - kv_lo + KVT - 1) / KVT : 0;
  }
};

// --------------------------------------------------------------------------------- the kernel
// T: q/out dtype.  KVKIND: 0 same as T, 1 e4m3, 2 e5m2.
template <typename Cfg, typename T, int KVKIND, int MASK, bool SOFTCAP, bool ALIBI, bool ROPE>
__global__ void __launch_bounds__(Cfg::NTHREADS, Cfg::MINB) fa2_attention_kernel(const Fa2Params p) {
  constexpr int D = Cfg::D, NMQ = Cfg::NMQ, NNK = Cfg::NNK, NKT = Cfg::NKT, NDT = Cfg::NDT;
  constexpr int KVT = Cfg::KVT, KVW = Cfg::KVW, CTA_Q = Cfg::CTA_Q, STAGES = Cfg::STAGES;
  constexpr int NT = Cfg::NTHREADS;
  constexpr int KVB = KVKIND == 0 ? 2 : 1;  // bytes per K/V element in global memory
  using SM = Smem<Cfg, KVB>;
  constexpr int CPR16 = D / 8;               // 16-byte chunks per row, 16-bit data
  constexpr int CPRKV = D * KVB / 16;        // 16-byte chunks per row, K/V global data

  extern __shared__ __align__(128) uint8_t smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  uint8_t* sKV = smem + SM::q_bytes;  // STAGES x (K tile, V tile)
  T* sK16 = reinterpret_cast<T*>(smem + SM::q_bytes + STAGES * SM::stage_bytes);  // fp8 only
  T* sV16 = sK16 + KVT * D;
  int* sPg = reinterpret_cast<int*>(smem + SM::q_bytes + STAGES * SM::stage_bytes + SM::cvt_bytes);  // [2][KVT]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wq = warp % Cfg::NWQ, wkv = warp / Cfg::NWQ;
  const int kvh = blockIdx.y;
  const int G = p.group;

  const WorkItem<CTA_Q, KVT, MASK> w(p, blockIdx.x, G, p.window_left);
  const int req = w.req, row0 = w.row0, slot = w.slot, qo_start = w.qo_start, qo_len = w.qo_len;
  const int kv_len = w.kv_len, delta = w.delta, rows_here = w.rows_here, tok_lo = w.tok_lo, tok_hi = w.tok_hi;
  const int kv_lo = w.kv_lo, kv_hi = w.kv_hi, n_tiles = w.n_tiles;

  const T* qg = reinterpret_cast<const T*>(p.q);
  const uint8_t* kg = reinterpret_cast<const uint8_t*>(p.k);
  const uint8_t* vg = reinterpret_cast<const uint8_t*>(p.v);
  const int page_size = p.page_size;
  const int kv_base = p.kv_indptr[req];
  const int64_t mask_base = MASK == kMaskCustom ? (int64_t)p.mask_indptr[req] : 0;

  // ---- Q tile -> smem (zero rows past the request)
  for (int idx = tid; idx < CTA_Q * CPR16; idx += NT) {
    int r = idx / CPR16, c = idx % CPR16;
    bool ok = r < rows_here;
    const T* src = qg;
    if (ok) {
      int pr = row0 + r, tok = pr / G, h = kvh * G + pr % G;
      src = qg + (int64_t)(qo_start + tok) * p.q_stride_n + (int64_t)h * p.q_stride_h + c * 8;
    }
    ac::cp_async16(sQ + swz<D>(r, c), src, ok);
  }
  ac::cp_async_commit();  // Q is its own group (also when there is no tile: the epilogue waits on it)

  // ---- K/V tile loader: page-table gather in the async copy.  Decode tiles (NWKV > 1) fetch the
  // page ids of the next tile one iteration ahead, so the index load latency overlaps compute.
  constexpr int LROWS = (KVT * CPRKV + NT - 1) / NT;
  constexpr bool PF = Cfg::PF;
  int pg_pf[PF ? LROWS : 1];
  pg_pf[0] = 0;
  auto fetch_pages = [&](int tile) {
    if constexpr (PF) {
      const int t0 = kv_lo + tile * KVT;
#pragma unroll
      for (int it = 0; it < LROWS; ++it) {
        int t = t0 + tid / CPRKV + it * (NT / CPRKV);
        pg_pf[it] = (page_size > 0 && t < kv_hi) ? __ldg(p.kv_indices + kv_base + t / page_size) : 0;
      }
    }
  };
  static_assert(NT % CPRKV == 0 && (KVT * CPRKV) % NT == 0, "tile copy shape");
  constexpr int RSTEP = NT / CPRKV;  // rows between a thread's successive chunks
  auto load_tile = [&](int tile, int stage, bool use_tab) {
    const int t0 = kv_lo + tile * KVT;
    uint8_t* dk = sKV + stage * SM::stage_bytes;
    uint8_t* dv = dk + SM::stage_bytes / 2;
    const int r0 = tid / CPRKV, c = tid % CPRKV;
    if (page_size == 0) {
      // ragged: one base address per tile, a constant step per row group
      const int64_t tok0 = (int64_t)(kv_base + t0 + r0);
      const uint8_t* pk = kg + ((tok0 * p.k_stride_n + (int64_t)kvh * p.k_stride_h) * KVB + c * 16);
      const uint8_t* pv = vg + ((tok0 * p.v_stride_n + (int64_t)kvh * p.v_stride_h) * KVB + c * 16);
      const int64_t sk = (int64_t)RSTEP * p.k_stride_n * KVB, sv = (int64_t)RSTEP * p.v_stride_n * KVB;
#pragma unroll
      for (int it = 0; it < LROWS; ++it) {
        const int r = r0 + it * RSTEP;
        const bool ok = t0 + r < kv_hi;
        const int so = KVB == 2 ? swz<D>(r, c) * 2 : (r * D + c * 16);
        ac::cp_async16(dk + so, ok ? pk + it * sk : kg, ok);
        ac::cp_async16(dv + so, ok ? pv + it * sv : vg, ok);
      }
      return;
    }
#pragma unroll
    for (int it = 0; it < LROWS; ++it) {
      const int r = r0 + it * RSTEP;
      const int t = t0 + r;
      const bool ok = t < kv_hi;
      int64_t ko = 0, vo = 0;
      if (ok) {
        int pg = PF ? pg_pf[it] : (Cfg::PGTAB && use_tab ? sPg[(tile & 1) * KVT + r] : p.kv_indices[kv_base + t / page_size]);
        int sl = t % page_size;
        ko = ((int64_t)pg * p.k_stride_p + (int64_t)sl * p.k_stride_n + (int64_t)kvh * p.k_stride_h) * KVB + c * 16;
        vo = ((int64_t)pg * p.v_stride_p + (int64_t)sl * p.v_stride_n + (int64_t)kvh * p.v_stride_h) * KVB + c * 16;
      }
      const int so = KVB == 2 ? swz<D>(r, c) * 2 : (r * D + c * 16);
      ac::cp_async16(dk + so, kg + ko, ok);
      ac::cp_async16(dv + so, vg + vo, ok);
    }
  };

  // ---- per-thread row info: rows g and g+8 of each m tile
  int row_tok[NMQ][2], row_head[NMQ][2];
  float row_slope[NMQ][2];
#pragma unroll
  for (int mi = 0; mi < NMQ; ++mi)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      int lr = wq * NMQ * 16 + mi * 16 + (lane >> 2) + h2 * 8;
      int pr = row0 + lr;
      row_tok[mi][h2] = pr / G;
      row_head[mi][h2] = kvh * G + pr % G;
      row_slope[mi][h2] = 0.f;
      if (ALIBI && lr < rows_here) row_slope[mi][h2] = p.alibi_slopes[row_head[mi][h2]] * kLog2e;
    }

  float o[NMQ][NDT][4];
  float m[NMQ][2], l[NMQ][2];
#pragma unroll
  for (int mi = 0; mi < NMQ; ++mi) {
#pragma unroll
    for (int j = 0; j < NDT; ++j) o[mi][j][0] = o[mi][j][1] = o[mi][j][2] = o[mi][j][3] = 0.f;
    m[mi][0] = m[mi][1] = kNegInf;
    l[mi][0] = l[mi][1] = 0.f;
  }

  if (n_tiles > 0) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < n_tiles) {
        fetch_pages(s);
        load_tile(s, s, false);
      }
      ac::cp_async_commit();
    }
    fetch_pages(STAGES - 1);
    // page ids of tile STAGES-1 -> table (visible after the loop-top barrier)
    int pg_next = 0;
    auto tab_load = [&](int tile) {
      if constexpr (Cfg::PGTAB) {
        const int t = kv_lo + tile * KVT + tid;
        pg_next = (page_size > 0 && tid < KVT && t < kv_hi) ? __ldg(p.kv_indices + kv_base + t / page_size) : 0;
      }
    };
    auto tab_store = [&](int tile) {
      if constexpr (Cfg::PGTAB) {
        if (tid < KVT) sPg[(tile & 1) * KVT + tid] = pg_next;
      }
    };
    tab_load(STAGES - 1);
    tab_store(STAGES - 1);
    if (ROPE) {
      // rotate Q in smem (rotate-half over the full head dim), position tok + delta
      ac::cp_async_wait<STAGES - 2>();
      __syncthreads();
      for (int idx = tid; idx < CTA_Q * (D / 2); idx += NT) {
        int r = idx / (D / 2), i = idx % (D / 2);
        if (r >= rows_here) continue;
        int tok = (row0 + r) / G;
        float freq = exp2f(-2.f * i / D * p.rope_log2_theta) * p.rope_rcp_scale;
        float sn, cs;
        sincosf((float)(tok + delta) * freq, &sn, &cs);
        T* a = sQ + swz<D>(r, i >> 3) + (i & 7);
        T* b = sQ + swz<D>(r, (i + D / 2) >> 3) + (i & 7);
        float x1 = (float)*a, x2 = (float)*b;
        *a = (T)(x1 * cs - x2 * sn);
        *b = (T)(x2 * cs + x1 * sn);
      }
    }

    const int qrow_base = wq * NMQ * 16;
    const int kv_w0 = wkv * KVW;  // this warp's first key within a stage

    for (int tile = 0; tile < n_tiles; ++tile) {
      ac::cp_async_wait<STAGES - 2>();
      __syncthreads();
      {
        int nt = tile + STAGES - 1;
        if (nt < n_tiles) {
          load_tile(nt, nt % STAGES, true);
          fetch_pages(nt + 1);
        }
        tab_load(nt + 1);  // stored after this tile's math, read by the next iteration's copy
        ac::cp_async_commit();
      }
      const int stage = tile % STAGES;
      const T* tK;
      const T* tV;
      if constexpr (KVB == 1) {
        // fp8 -> 16-bit, once per stage for the whole CTA
        const uint8_t* rk = sKV + stage * SM::stage_bytes;
        const uint8_t* rv = rk + SM::stage_bytes / 2;
        for (int idx = tid; idx < KVT * CPRKV; idx += NT) {
          int r = idx / CPRKV, c = idx % CPRKV;
          uint4 ka = *reinterpret_cast<const uint4*>(rk + r * D + c * 16);
          uint4 va = *reinterpret_cast<const uint4*>(rv + r * D + c * 16);
          const uint16_t* k2 = reinterpret_cast<const uint16_t*>(&ka);
          const uint16_t* v2 = reinterpret_cast<const uint16_t*>(&va);
          uint4 k0, k1, v0, v1;
          uint32_t* pk0 = reinterpret_cast<uint32_t*>(&k0);
          uint32_t* pk1 = reinterpret_cast<uint32_t*>(&k1);
          uint32_t* pv0 = reinterpret_cast<uint32_t*>(&v0);
          uint32_t* pv1 = reinterpret_cast<uint32_t*>(&v1);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            pk0[j] = ac::fp8x2_to<T, KVKIND>(k2[j]);
            pk1[j] = ac::fp8x2_to<T, KVKIND>(k2[j + 4]);
            pv0[j] = ac::fp8x2_to<T, KVKIND>(v2[j]);
            pv1[j] = ac::fp8x2_to<T, KVKIND>(v2[j + 4]);
          }
          *reinterpret_cast<uint4*>(sK16 + swz<D>(r, 2 * c)) = k0;
          *reinterpret_cast<uint4*>(sK16 + swz<D>(r, 2 * c + 1)) = k1;
          *reinterpret_cast<uint4*>(sV16 + swz<D>(r, 2 * c)) = v0;
          *reinterpret_cast<uint4*>(sV16 + swz<D>(r, 2 * c + 1)) = v1;
        }
        tK = sK16;
        tV = sV16;
        if (!ROPE) __syncthreads();
      } else {
        tK = reinterpret_cast<const T*>(sKV + stage * SM::stage_bytes);
        tV = reinterpret_cast<const T*>(sKV + stage * SM::stage_bytes + SM::stage_bytes / 2);
      }
      if (ROPE) {
        if constexpr (KVB == 1) __syncthreads();
        T* k_rw = const_cast<T*>(tK);
        const int t0 = kv_lo + tile * KVT;
        for (int idx = tid; idx < KVT * (D / 2); idx += NT) {
          int r = idx / (D / 2), i = idx % (D / 2);
          float freq = exp2f(-2.f * i / D * p.rope_log2_theta) * p.rope_rcp_scale;
          float sn, cs;
          sincosf((float)(t0 + r) * freq, &sn, &cs);
          T* a = k_rw + swz<D>(r, i >> 3) + (i & 7);
          T* b = k_rw + swz<D>(r, (i + D / 2) >> 3) + (i & 7);
          float x1 = (float)*a, x2 = (float)*b;
          *a = (T)(x1 * cs - x2 * sn);
          *b = (T)(x2 * cs + x1 * sn);
        }
        __syncthreads();
      }

      // ---- S = Q K^T for this warp's rows x keys
      float s[NMQ][NKT][4];
#pragma unroll
      for (int mi = 0; mi < NMQ; ++mi)
#pragma unroll
        for (int j = 0; j < NKT; ++j) s[mi][j][0] = s[mi][j][1] = s[mi][j][2] = s[mi][j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[NMQ][4];
#pragma unroll
        for (int mi = 0; mi < NMQ; ++mi)
          ac::ldsm_x4(a[mi], sQ + swz<D>(qrow_base + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
        for (int nj = 0; nj < NNK; ++nj) {
          uint32_t b[4];
          ac::ldsm_x4(b, tK + swz<D>(kv_w0 + nj * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int mi = 0; mi < NMQ; ++mi) {
            ac::mma16816<T>(s[mi][2 * nj], a[mi], b[0], b[1]);
            ac::mma16816<T>(s[mi][2 * nj + 1], a[mi], b[2], b[3]);
          }
        }
      }

      // ---- scale, soft cap, ALiBi, mask
      const int t0 = kv_lo + tile * KVT + kv_w0;  // first key of this warp
      const int tile_end = kv_lo + (tile + 1) * KVT;
      bool need_mask = tile_end > kv_hi || MASK == kMaskCustom;
      if (MASK == kMaskCausal) need_mask |= (tile_end - 1 > tok_lo + delta);
      if (p.window_left >= 0) need_mask |= (kv_lo + tile * KVT < tok_hi + delta - p.window_left);
      // FOLD (no soft cap / ALiBi): s stays raw q.k here; the scale is folded into exp2 below.
      constexpr bool FOLD = !SOFTCAP && !ALIBI;
#pragma unroll
      for (int mi = 0; mi < NMQ; ++mi)
#pragma unroll
        for (int j = 0; j < NKT; ++j)
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
            if (ALIBI) x += row_slope[mi][h2] * (float)(kv - row_tok[mi][h2]);
            if (need_mask) {
              const int tok = row_tok[mi][h2];
              bool keep = kv < kv_hi;
              if (MASK == kMaskCausal) keep &= kv <= tok + delta;
              if (p.window_left >= 0) keep &= kv >= tok + delta - p.window_left;
              if (MASK == kMaskCustom) {
                if (keep && tok < qo_len) {
                  int64_t bit = (int64_t)tok * kv_len + kv;
                  uint8_t byte = p.mask[mask_base + (bit >> 3)];
                  keep = (byte >> (bit & 7)) & 1;
                } else {
                  keep = false;
                }
              }
              if (!keep) x = kNegInf;
            }
            s[mi][j][e] = x;
          }

      // ---- online softmax (m in scaled base-2 units); O is rescaled only when some row max moved
      const float sc = FOLD ? p.scale_log2 : 1.f;
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
          const float mnew = fmaxf(m[mi][h2], mx * sc);
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

      // ---- O += P V
#pragma unroll
      for (int kk = 0; kk < NNK; ++kk) {
        uint32_t a[NMQ][4];
#pragma unroll
        for (int mi = 0; mi < NMQ; ++mi) {
          a[mi][0] = ac::pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
          a[mi][1] = ac::pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
          a[mi][2] = ac::pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
          a[mi][3] = ac::pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < NDT / 2; ++dp) {
          uint32_t b[4];
          ac::ldsm_x4_t(b, tV + swz<D>(kv_w0 + kk * 16 + (lane & 15), dp * 2 + (lane >> 4)));
#pragma unroll
          for (int mi = 0; mi < NMQ; ++mi) {
            ac::mma16816<T>(o[mi][2 * dp], a[mi], b[0], b[1]);
            ac::mma16816<T>(o[mi][2 * dp + 1], a[mi], b[2], b[3]);
          }
        }
      }
      tab_store(tile + STAGES);
    }
  }

  // ---- epilogue: stage (m, l, O) per warp in smem, merge across NWKV warps, write
  ac::cp_async_wait<0>();
  __syncthreads();
  constexpr int OS = SM::OSTRIDE;
  float* eO = reinterpret_cast<float*>(smem);                   // [NWKV][CTA_Q][OS]
  float* eM = eO + Cfg::NWKV * CTA_Q * OS;                      // [NWKV][CTA_Q]
  float* eL = eM + Cfg::NWKV * CTA_Q;
#pragma unroll
  for (int mi = 0; mi < NMQ; ++mi)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const float ls = ac::quad_sum(l[mi][h2]);
      const int lr = wq * NMQ * 16 + mi * 16 + (lane >> 2) + h2 * 8;
      float* orow = eO + (wkv * CTA_Q + lr) * OS;
#pragma unroll
      for (int j = 0; j < NDT; ++j)
        *reinterpret_cast<float2*>(orow + j * 8 + 2 * (lane & 3)) = make_float2(o[mi][j][2 * h2], o[mi][j][2 * h2 + 1]);
      if ((lane & 3) == 0) {
        eM[wkv * CTA_Q + lr] = m[mi][h2];
        eL[wkv * CTA_Q + lr] = ls;
      }
    }
  __syncthreads();

  const bool final_out = slot < 0;
  for (int idx = tid; idx < rows_here * CPR16; idx += NT) {
    const int r = idx / CPR16, c = idx % CPR16;
    float M = kNegInf;
#pragma unroll
    for (int w = 0; w < Cfg::NWKV; ++w) M = fmaxf(M, eM[w * CTA_Q + r]);
    float Mu = M == kNegInf ? 0.f : M;
    float L = 0.f, acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
    for (int w = 0; w < Cfg::NWKV; ++w) {
      const float f = ac::ex2(eM[w * CTA_Q + r] - Mu);
      L += eL[w * CTA_Q + r] * f;
      const float* src = eO + (w * CTA_Q + r) * OS + c * 8;
      float4 u0 = *reinterpret_cast<const float4*>(src), u1 = *reinterpret_cast<const float4*>(src + 4);
      acc[0] += u0.x * f; acc[1] += u0.y * f; acc[2] += u0.z * f; acc[3] += u0.w * f;
      acc[4] += u1.x * f; acc[5] += u1.y * f; acc[6] += u1.z * f; acc[7] += u1.w * f;
    }
    const int pr = row0 + r, tok = pr / G, h = kvh * G + pr % G;
    float lse_v = kNegInf, scale = 0.f;
    // L == 0: the row saw no key (0, -inf).  A NaN query gives NaN L (its m stays -inf: fmaxf drops
    // NaN), and NaN != 0 lets it reach the output and LSE (semantics.md, non-finite inputs rule 3).
    if (L != 0.f) {
      float f = 1.f;
      if (final_out && p.sinks != nullptr) f = fold_sink(L, Mu, p.sinks[h] * kLog2e);
      lse_v = Mu + log2f(L);
      scale = (final_out ? p.out_scale : 1.f) * f / L;
    }
    if (final_out) {
      T* dst = reinterpret_cast<T*>(p.o) + (int64_t)(qo_start + tok) * p.o_stride_n + (int64_t)h * p.o_stride_h + c * 8;
      uint4 pk;
      uint32_t* pp = reinterpret_cast<uint32_t*>(&pk);
#pragma unroll
      for (int e = 0; e < 4; ++e) pp[e] = ac::pack2<T>(acc[2 * e] * scale, acc[2 * e + 1] * scale);
      *reinterpret_cast<uint4*>(dst) = pk;
      if (c == 0 && p.lse != nullptr) p.lse[(int64_t)(qo_start + tok) * p.num_qo_heads + h] = lse_v;
    } else {
      float* dst = p.o_part + ((int64_t)(slot + tok) * p.num_qo_heads + h) * D + c * 8;
      *reinterpret_cast<float4*>(dst) = make_float4(acc[0] * scale, acc[1] * scale, acc[2] * scale, acc[3] * scale);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4] * scale, acc[5] * scale, acc[6] * scale, acc[7] * scale);
      if (c == 0) p.lse_part[(int64_t)(slot + tok) * p.num_qo_heads + h] = lse_v;
    }
  }
}

// ------------------------------------------------------------------- merge of split-KV partials
// grid (nnz_q, Hq), D/4 threads: each thread merges 4 floats of one (row, head) over the splits.
template <typename T, int D>
__global__ void __launch_bounds__(D / 4) fa2_merge_kernel(const Fa2MergeParams p) {
  const int n = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
  // request of row n: last i with qo_indptr[i] <= n (qo_indptr is non-decreasing)
  int lo = 0, hi = p.batch;
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (p.qo_indptr[mid] <= n) lo = mid; else hi = mid;
  }
  const int req = lo;
  const int ns = p.num_splits[req];
  if (ns <= 1) return;
  const int qo_start = p.qo_indptr[req], qo_len = p.qo_indptr[req + 1] - qo_start;
  const int64_t base = p.tmp_off[req] + (n - qo_start);
  const int64_t rs = (int64_t)qo_len * p.num_qo_heads;  // tmp-row stride between splits, in (row, head)s
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
  T* dst = reinterpret_cast<T*>(p.o) + (int64_t)n * p.o_stride_n + (int64_t)h * p.o_stride_h + c * 4;
  uint2 pk;
  pk.x = ac::pack2<T>(acc.x * scale, acc.y * scale);
  pk.y = ac::pack2<T>(acc.z * scale, acc.w * scale);
  *reinterpret_cast<uint2*>(dst) = pk;
  if (c == 0 && p.lse != nullptr) p.lse[(int64_t)n * p.num_qo_heads + h] = lse_v;
}

}  // namespace fa2
