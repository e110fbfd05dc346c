// attncore cuda_fa2: what the FA2 kernel copies into shared memory, and how it prepares it there.
//
//   load_q              Q tile -> smem with cp.async (rows past the request zero-filled), one group.
//   KvLoader            K/V tiles -> the STAGES-deep smem ring: the page-table gather happens in the
//                       copy itself (one cp.async per 16-byte chunk, rows past kv_hi zero-filled).
//                       Page ids: prefill tiles (PGTAB) read them from a 2 x KVT smem table filled one
//                       iteration ahead, decode tiles with PF a tile ahead into registers, else directly.
//   convert_fp8_stage   fp8 K/V stage -> 16-bit tiles (exact), once per stage for the whole CTA, so the
//                       MMAs and ldmatrix see the same layout as for 16-bit KV.
//   rope_rotate_*       LLaMA rotate-half RoPE in smem: Q once (position tok + delta), K per stage.
// 16-bit tiles are [rows][D] with 16-byte chunks XOR-swizzled (swz) so ldmatrix is conflict free;
// fp8 stages land unswizzled (row r, chunk c at r * D + 16 c) and are swizzled by the conversion.
#pragma once
#include "fa2_kernel_traits.cuh"

namespace fa2 {

// Q tile -> smem (zero rows past the request); Q is its own cp.async group (also when the CTA has
// no K/V tile: the epilogue waits on it).
template <typename Cfg, typename T, typename CtaT>
__device__ __forceinline__ void load_q(T* sQ, const CtaT& cta) {
  constexpr int D = Cfg::D, CTA_Q = Cfg::CTA_Q, NT = Cfg::NTHREADS, CPR16 = D / 8;
  const Fa2Params& p = cta.p;
  const int G = cta.G;
  for (int idx = cta.tid; idx < CTA_Q * CPR16; idx += NT) {
    int r = idx / CPR16, ch = idx % CPR16;
    bool ok = r < cta.w.rows_here;
    const T* src = cta.qg;
    if (ok) {
      int pr = cta.w.row0 + r, tok = pr / G, h = cta.kvh * G + pr % G;
      src = cta.qg + (int64_t)(cta.w.qo_start + tok) * p.q_stride_n + (int64_t)h * p.q_stride_h + ch * 8;
    }
    ac::cp_async16(sQ + swz<D>(r, ch), src, ok);
  }
  ac::cp_async_commit();
}

// K/V tile copies of one thread: chunk column c of rows r0 + it * RSTEP (it < LROWS) of each tile.
template <typename Cfg, typename T, int KVB, typename CtaT>
struct KvLoader {
  static constexpr int D = Cfg::D, KVT = Cfg::KVT, NT = Cfg::NTHREADS;
  static constexpr int CPRKV = D * KVB / 16;                 // 16-byte chunks per row, K/V global data
  static constexpr int LROWS = (KVT * CPRKV + NT - 1) / NT;  // chunks per thread per K (or V) tile
  static constexpr bool PF = Cfg::PF;
  static_assert(NT % CPRKV == 0 && (KVT * CPRKV) % NT == 0, "tile copy shape");
  static constexpr int RSTEP = NT / CPRKV;  // rows between a thread's successive chunks
  static constexpr size_t STAGE_BYTES = (size_t)KVT * D * KVB * 2;  // K + V
  static constexpr int PF_SLOTS = PF ? LROWS : 1;
  // PF's page ids live in an array of the caller (int pg_pf[PF_SLOTS]), not in this struct: an
  // array indexed before unrolling would keep the whole struct in memory, and every load through
  // it (params, pointers) inside the tile loop.

  // References to the kernel's values, as the lambdas this replaced captured them: holding copies of
  // the smem pointers instead changes how the compiler associates the stage addresses (other code).
  const CtaT& cta;
  uint8_t* const& sKV;  // STAGES x (K tile, V tile)
  int* const& sPg;      // PGTAB: [2][KVT] page ids
  int pg_next = 0;      // PGTAB: this thread's page id of the tile after next (tab_load -> tab_store)

  __device__ __forceinline__ KvLoader(const CtaT& cta_, uint8_t* const& sKV_, int* const& sPg_)
      : cta(cta_), sKV(sKV_), sPg(sPg_) {}

  // PF: page ids of `tile` into registers, one tile ahead of its copy
  __device__ __forceinline__ void fetch_pages(const Fa2Params& p, int (&pg_pf)[PF_SLOTS], int tile) {
    if constexpr (PF) {
      const int t0 = cta.w.kv_lo + tile * KVT;
#pragma unroll
      for (int it = 0; it < LROWS; ++it) {
        int t = t0 + cta.tid / CPRKV + it * (NT / CPRKV);
        pg_pf[it] = (cta.page_size > 0 && t < cta.w.kv_hi) ? __ldg(p.kv_indices + cta.kv_base + t / cta.page_size) : 0;
      }
    }
  }
  // PGTAB: this thread's page id of `tile` (loaded now, stored into the table after this tile's math)
  __device__ __forceinline__ void tab_load(const Fa2Params& p, int tile) {
    if constexpr (Cfg::PGTAB) {
      const int t = cta.w.kv_lo + tile * KVT + cta.tid;
      pg_next = (cta.page_size > 0 && cta.tid < KVT && t < cta.w.kv_hi)
                    ? __ldg(p.kv_indices + cta.kv_base + t / cta.page_size) : 0;
    }
  }
  __device__ __forceinline__ void tab_store(int tile) {
    if constexpr (Cfg::PGTAB) {
      if (cta.tid < KVT) sPg[(tile & 1) * KVT + cta.tid] = pg_next;
    }
  }

  // cp.async of `tile` into `stage` (use_tab: its page ids are in the smem table)
  __device__ __forceinline__ void load_tile(const Fa2Params& p, const int (&pg_pf)[PF_SLOTS], int tile, int stage,
                                            bool use_tab) {
    const int kvh = cta.kvh, page_size = cta.page_size, kv_hi = cta.w.kv_hi;
    const uint8_t* kg = cta.kg;
    const uint8_t* vg = cta.vg;
    const int t0 = cta.w.kv_lo + tile * KVT;
    uint8_t* dk = sKV + stage * STAGE_BYTES;
    uint8_t* dv = dk + STAGE_BYTES / 2;
    const int r0 = cta.tid / CPRKV, ch = cta.tid % CPRKV;
    if (page_size == 0) {
      // ragged: one base address per tile, a constant step per row group
      const int64_t tok0 = (int64_t)(cta.kv_base + t0 + r0);
      const uint8_t* pk = kg + ((tok0 * p.k_stride_n + (int64_t)kvh * p.k_stride_h) * KVB + ch * 16);
      const uint8_t* pv = vg + ((tok0 * p.v_stride_n + (int64_t)kvh * p.v_stride_h) * KVB + ch * 16);
      const int64_t sk = (int64_t)RSTEP * p.k_stride_n * KVB, sv = (int64_t)RSTEP * p.v_stride_n * KVB;
#pragma unroll
      for (int it = 0; it < LROWS; ++it) {
        const int r = r0 + it * RSTEP;
        const bool ok = t0 + r < kv_hi;
        const int so = KVB == 2 ? swz<D>(r, ch) * 2 : (r * D + ch * 16);
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
        int pg = PF ? pg_pf[it]
                    : (Cfg::PGTAB && use_tab ? sPg[(tile & 1) * KVT + r] : p.kv_indices[cta.kv_base + t / page_size]);
        int sl = t % page_size;
        ko = ((int64_t)pg * p.k_stride_p + (int64_t)sl * p.k_stride_n + (int64_t)kvh * p.k_stride_h) * KVB + ch * 16;
        vo = ((int64_t)pg * p.v_stride_p + (int64_t)sl * p.v_stride_n + (int64_t)kvh * p.v_stride_h) * KVB + ch * 16;
      }
      const int so = KVB == 2 ? swz<D>(r, ch) * 2 : (r * D + ch * 16);
      ac::cp_async16(dk + so, kg + ko, ok);
      ac::cp_async16(dv + so, vg + vo, ok);
    }
  }
};

// fp8 K/V stage `stage` of the ring (K then V, [KVT][D] bytes each) -> 16-bit swizzled tiles sK16 / sV16,
// exact.
template <typename Cfg, typename T, int KVKIND>
__device__ __forceinline__ void convert_fp8_stage(const uint8_t* sKV, int stage, T* sK16, T* sV16, int tid) {
  constexpr int D = Cfg::D, KVT = Cfg::KVT, NT = Cfg::NTHREADS, CPRKV = D / 16;
  constexpr size_t STAGE_BYTES = (size_t)KVT * D * 2;  // K + V, one byte each
  const uint8_t* rk = sKV + stage * STAGE_BYTES;
  const uint8_t* rv = rk + STAGE_BYTES / 2;
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
}

// Rotate-half RoPE of element pair (i, i + D/2) of row r of a swizzled 16-bit tile at position
// pos0 + pos1: angle (pos0 + pos1) * rope_rcp_scale * theta^(-2i/D), in fp32, rounded back to T.
template <int D, typename T>
__device__ __forceinline__ void rope_rotate_pair(T* tile, int r, int i, int pos0, int pos1, const Fa2Params& p) {
  float freq = exp2f(-2.f * i / D * p.rope_log2_theta) * p.rope_rcp_scale;
  float sn, cs;
  sincosf((float)(pos0 + pos1) * freq, &sn, &cs);
  T* a = tile + swz<D>(r, i >> 3) + (i & 7);
  T* b = tile + swz<D>(r, (i + D / 2) >> 3) + (i & 7);
  float x1 = (float)*a, x2 = (float)*b;
  *a = (T)(x1 * cs - x2 * sn);
  *b = (T)(x2 * cs + x1 * sn);
}

// Q in smem, once (rows past the request left alone): query token tok sits at key position tok + delta.
template <typename Cfg, typename T, typename CtaT>
__device__ __forceinline__ void rope_rotate_q(T* sQ, const CtaT& cta, const Fa2Params& p) {
  constexpr int D = Cfg::D;
  for (int idx = cta.tid; idx < Cfg::CTA_Q * (D / 2); idx += Cfg::NTHREADS) {
    int r = idx / (D / 2), i = idx % (D / 2);
    if (r >= cta.w.rows_here) continue;
    int tok = (cta.w.row0 + r) / cta.G;
    // (rope_rotate_pair written out: a call would let the compiler sink i's computation past the
    // branch above, and the whole kernel would schedule differently)
    float freq = exp2f(-2.f * i / D * p.rope_log2_theta) * p.rope_rcp_scale;
    float sn, cs;
    sincosf((float)(tok + cta.w.delta) * freq, &sn, &cs);
    T* a = sQ + swz<D>(r, i >> 3) + (i & 7);
    T* b = sQ + swz<D>(r, (i + D / 2) >> 3) + (i & 7);
    float x1 = (float)*a, x2 = (float)*b;
    *a = (T)(x1 * cs - x2 * sn);
    *b = (T)(x2 * cs + x1 * sn);
  }
}

// The K tile of stage (tile `tile`: keys kv_lo + tile * KVT ...) in smem.
template <typename Cfg, typename T>
__device__ __forceinline__ void rope_rotate_k(T* k_rw, int kv_lo, int tile, int tid, const Fa2Params& p) {
  constexpr int D = Cfg::D;
  const int t0 = kv_lo + tile * Cfg::KVT;
  for (int idx = tid; idx < Cfg::KVT * (D / 2); idx += Cfg::NTHREADS) {
    int r = idx / (D / 2), i = idx % (D / 2);
    rope_rotate_pair<D>(k_rw, r, i, t0, r, p);
  }
}

}  // namespace fa2
