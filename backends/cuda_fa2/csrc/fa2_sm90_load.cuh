// attncore cuda_fa2: the K/V tile copies of the Hopper kernel (fa2_sm90.cuh): a thread's chunks of a
// K and a V tile into the 128-byte swizzled stage that wgmma reads, the page-table gather in the copy.
#pragma once
#include "fa2_kernel_traits.cuh"
#include "fa2_sm90_wgmma.h"

namespace fa2 {
namespace sm90 {

// TMA tensor maps of ragged K and V (CUtensorMap's 128 opaque bytes, encoded by fa2_attention.cu's launcher): a
// 3-D tensor (column, kv head, token), boxes of 64 columns (128 bytes: one 128B-swizzled block) x 1 head x KVT
// tokens, so one box lands as one column block of a stage exactly as KvTileCopy lays it out.  on 0: no maps (paged
// K/V, strides TMA cannot take, the POD kernel): every tile by cp.async.
struct alignas(64) TmaMap {
  uint64_t bytes[16];
};
struct KvTma {
  TmaMap k, v;
  int on;
};

// A full K/V tile of Cfg (fa2_sm90.cuh's Cfg90) by TMA, from one thread (the producer's others only arrive): PARTS
// as KvTileCopy::issue, the bytes expected on `bar` (the stage's, or SEPKV's barrier of the part).  `token`: the
// tile's first row.  Box b is the tile's 64-column block b: chunk 8 b of row 0 in sw128's layout.
template <typename Cfg, int PARTS>
__device__ __forceinline__ void tma_kv_tile(const KvTma& m, int kvh, int token, uint32_t dk, uint32_t dv,
                                            uint32_t bar) {
  mbar_expect_tx(bar, (PARTS & 1) * Cfg::k_bytes + (PARTS >> 1) * Cfg::v_bytes);
#pragma unroll
  for (int b = 0; b < Cfg::D / 64; ++b) {
    const uint32_t off = sw128<Cfg::KVT>(0, 8 * b);
    if (PARTS & 1) tma_load_3d(dk + off, &m.k, b * 64, kvh, token, bar);
    if ((PARTS & 2) && b < Cfg::DV / 64) tma_load_3d(dv + off, &m.v, b * 64, kvh, token, bar);
  }
}

// base + off * unit in bytes: one IMAD.WIDE.U32
__device__ __forceinline__ const char* row_addr(const void* base, uint32_t off, uint32_t unit) {
  uint64_t w;  // (from C++ the product became a 64-bit multiply by the hoisted, widened unit: one add more per copy)
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(w) : "r"(off), "r"(unit));
  return reinterpret_cast<const char*>(base) + w;
}

// K/V tile copies of one thread: chunk columns c + g * CSTEP (g < NC; of V, g < NCV) of rows r0 + it * STEP (it < N)
// of each K and V tile, into the 128B-swizzled stage; rows past kv_hi are zero-filled.  NC > 1 where a row has more
// chunks than the copying threads cover in one 8-row pass (d256 by the 128 producer threads: two columns 16 chunks
// apart, so that STEP stays a multiple of the swizzle period; d192: three, 8 apart).  NCV < NC: V rows shorter than
// K's (head_dim_vo < head_dim_qk).  Ragged rows advance by the token
// stride.  Paged rows use 32-bit offsets (fa2_params.h: k_row_*) held in registers by prefetch() (the
// plain loop a tile ahead, the WS producer just before the copy), so the copy is one widening
// multiply-add and a cp.async per chunk.
// LEAN (Cfg90::LEAN: the producer of paged K/V, bound by its instruction count): page 16's ids loaded from one base
// (rows_fixed), one page-id load for two rows where they share a page of another size, the page table's pointer held
// for the tile, and no select in the copies.
template <int KVT, int N, int STEP, typename T, int NC = 1, int CSTEP = 0, bool LEAN = false, int NCV = NC>
struct KvTileCopy {
  static_assert(NC == 1 || CSTEP % 8 == 0, "column groups a whole number of 64-element blocks apart");
  static_assert(NCV <= NC, "V rows no longer than K's");
  // column group g: CSTEP / 8 column blocks of KVT rows further in smem, CSTEP * 8 elements further in memory
  static constexpr uint32_t GS = (CSTEP / 8) * KVT * 128;
  const T *kb, *vb;          // this thread's column of this kv head (ragged: + the request's first token)
  const int32_t* pages;      // the request's page ids (paged)
  int64_t k_sn, v_sn;        // ragged token strides
  int r0, c, kv_lo, kv_hi, page_size, page_shift;
  uint32_t k_unit, k_sp, k_rs, v_unit, v_sp, v_rs;
  bool same;
  uint32_t roff[N];          // paged: K row offsets of the tile prefetch() was last called for

  __device__ __forceinline__ KvTileCopy(const Fa2Params& p, const T* k, const T* v, int kvh, int kv_base, int r0_,
                                        int c_, int kv_lo_, int kv_hi_)
      : kb(k + (int64_t)kvh * p.k_stride_h + c_ * 8), vb(v + (int64_t)kvh * p.v_stride_h + c_ * 8),
        pages(p.kv_indices + kv_base), k_sn(p.k_stride_n), v_sn(p.v_stride_n), r0(r0_), c(c_), kv_lo(kv_lo_),
        kv_hi(kv_hi_), page_size(p.page_size), page_shift(p.page_shift), k_unit(p.k_row_unit), k_sp(p.k_row_sp),
        k_rs(p.k_row_sn), v_unit(p.v_row_unit), v_sp(p.v_row_sp), v_rs(p.v_row_sn), same(p.kv_same_strides != 0) {
    if (page_size == 0) {
      kb += (int64_t)kv_base * k_sn;
      vb += (int64_t)kv_base * v_sn;
    }
  }
  // Pages of PS slots (1 or 16) and a tile starting at a page boundary: row it of a thread lies it * STEP / PS pages
  // after its first row's page, at slot t0 % PS + it * STEP % PS (r0 < STEP, and STEP and PS divide one another), so
  // every page-id load is at an immediate offset from one base; all are issued before the multiplies, the base and
  // the stride opaque.  ptxas otherwise gave each load its own 64-bit address and a reload of the stride and issued
  // them four at a time: page 1's general form took ~140 instructions a tile, this one ~55.  H200, session 36, same
  // runs: P3 page 1 0.614 ms against 0.647; page 16 (against the pair form below) P3 0.611 against 0.629, P4 1.064
  // against 1.102, d64 0.395 against 0.419, d256 0.554 against 0.570.
  template <int PS>
  __device__ __forceinline__ void rows_fixed(const int32_t* pt, int t0, uint32_t sp, uint32_t rs) {
    static_assert((PS % STEP == 0 || STEP % PS == 0) && KVT % PS == 0, "a thread's rows at fixed page offsets");
    const int left = kv_hi - t0;
    const int32_t* pb = pt + (uint32_t)t0 / PS;
    asm volatile("" : "+l"(pb));
    uint32_t pg[N];
#pragma unroll
    for (int it = 0; it < N; ++it)  // a page's first row of this thread's loads its id
      if ((it * STEP) % PS == 0) pg[it] = it * STEP < left ? (uint32_t)__ldg(pb + it * STEP / PS) : 0u;
    uint32_t m = sp, o = ((uint32_t)t0 % PS) * rs;
    asm volatile("" : "+r"(m));
#pragma unroll
    for (int it = 0; it < N; ++it) {
      const int slot = (it * STEP) % PS;
      roff[it] = pg[it - slot / STEP] * m + o + (uint32_t)slot * rs;
    }
  }
  // paged: row offsets of `tile` (K, or V when the strides differ) into roff
  __device__ __forceinline__ void rows(int tile, bool v) {
    const int t0 = kv_lo + tile * KVT + r0;
    const uint32_t sp = v ? v_sp : k_sp, rs = v ? v_rs : k_rs;
    const int32_t* pt = pages;  // LEAN: held for the tile (ptxas rebuilt it from the params for every load)
    if constexpr (LEAN) asm volatile("" : "+l"(pt));
    if (page_size == 1) {
      rows_fixed<1>(pt, t0, sp, rs);
    } else if (LEAN && page_size == 16 && (kv_lo & 15) == 0) {  // LEAN only (the persistent pipelined loop spills)
      rows_fixed<16>(pt, t0, sp, rs);
    } else if (LEAN && N % 2 == 0 && page_shift >= 0 && ((page_size | kv_lo) & (2 * STEP - 1)) == 0) {
      // Pages of a multiple of 2 STEP slots, tiles starting at one: rows it and it + 1 of a thread (r0 < STEP,
      // it even) share a page, so one page id serves both
#pragma unroll
      for (int it = 0; it < N; it += 2) {
        const int t = t0 + it * STEP;
        const uint32_t pg = t < kv_hi ? (uint32_t)__ldg(pt + (t >> page_shift)) : 0u;
        roff[it] = pg * sp + (uint32_t)(t & (page_size - 1)) * rs;
        roff[it + 1] = roff[it] + STEP * rs;
      }
    } else if (page_shift >= 0) {
#pragma unroll
      for (int it = 0; it < N; ++it) {
        const int t = t0 + it * STEP;
        const uint32_t pg = t < kv_hi ? (uint32_t)__ldg(pt + (t >> page_shift)) : 0u;
        roff[it] = pg * sp + (uint32_t)(t & (page_size - 1)) * rs;
      }
    } else {
#pragma unroll
      for (int it = 0; it < N; ++it) {
        const int t = t0 + it * STEP, pi = t / page_size;
        const uint32_t pg = t < kv_hi ? (uint32_t)__ldg(pt + pi) : 0u;
        roff[it] = pg * sp + (uint32_t)(t - pi * page_size) * rs;
      }
    }
  }
  __device__ __forceinline__ void prefetch(int tile) {
    if (page_size > 0) rows(tile, false);
  }
  // cp.async of `tile`: PARTS 3, its K tile into dk and its V tile into dv, row by row; 1 or 2, the K or the V tile
  // alone (the two-stage ring hands them over apart: Cfg90::SEPKV).  Paged: prefetch(tile) must have run.
  // STEP is a multiple of the 8-row swizzle period, so row r0 + it * STEP lands at a fixed offset from row r0:
  // immediates, not registers held across the tile loop.
  template <int PARTS = 3>
  __device__ __forceinline__ void issue(int tile, uint8_t* dk, uint8_t* dv) {
    static_assert(STEP % 8 == 0, "rows of one thread share the swizzle phase");
    constexpr bool K = PARTS & 1, V = PARTS & 2;
    const int t0 = kv_lo + tile * KVT, left = kv_hi - t0 - r0;
    const uint32_t so = sw128<KVT>(r0, c);
    uint32_t sk = ac::smem_u32(dk) + so, sv = ac::smem_u32(dv) + so;
    asm volatile("" : "+r"(sk), "+r"(sv));  // opaque per tile: ptxas would hoist 2N row addresses otherwise
    if (page_size == 0) {
      const T* pk = kb + (int64_t)(t0 + r0) * k_sn;
      const T* pv = vb + (int64_t)(t0 + r0) * v_sn;
      if ((N - 1) * STEP < left) {  // every row of this thread's in the keys (all but a unit's last tile): no
        // predicate and no select per copy, ~3 instead of ~5.5 instructions each (1-3% on P1 and d256 before TMA took
        // such tiles where the launcher gives maps; H200, session 33)
#pragma unroll
        for (int it = 0; it < N; ++it) {
#pragma unroll
          for (int g = 0; g < NC; ++g) {
            if (K) ac::cp_async16(sk + g * GS + it * STEP * 128, pk + g * CSTEP * 8, true);
            if (V && g < NCV) ac::cp_async16(sv + g * GS + it * STEP * 128, pv + g * CSTEP * 8, true);
          }
          pk += STEP * k_sn;
          pv += STEP * v_sn;
        }
        return;
      }
#pragma unroll
      for (int it = 0; it < N; ++it) {
        const bool ok = it * STEP < left;
#pragma unroll
        for (int g = 0; g < NC; ++g) {  // zero-fill reads nothing: any valid address (kb / vb + a column)
          if (K) ac::cp_async16(sk + g * GS + it * STEP * 128, (ok ? pk : kb) + g * CSTEP * 8, ok);
          if (V && g < NCV) ac::cp_async16(sv + g * GS + it * STEP * 128, (ok ? pv : vb) + g * CSTEP * 8, ok);
        }
        pk += STEP * k_sn;
        pv += STEP * v_sn;
      }
      return;
    }
    // LEAN, every row of this thread's in the keys (all but a unit's last tile): no predicates, ~2 instructions a copy
    // with row_addr instead of ~4 (H200 2026-11-30, same run, 9 rounds: P3 page 1 0.594 ms against 0.606, paged d64
    // 0.369 against 0.382, page 16 and P4 level)
    if (LEAN && (N - 1) * STEP < left && (same || !V)) {
      if (K) copy_paged<NC, true>(sk, kb, k_unit, left);
      if (V) copy_paged<NCV, true>(sv, vb, v_unit, left);
      return;
    }
    if (K) copy_paged<NC>(sk, kb, k_unit, left);
    if (V && !same) rows(tile, true);  // rare (K and V strides differ): V's rows now, not prefetched
    if (V) copy_paged<NCV>(sv, vb, v_unit, left);
  }
  template <int NG, bool FULL = false>  // NG: the row's column groups (NC or NCV); FULL (LEAN): every row in the keys
  __device__ __forceinline__ void copy_paged(uint32_t dst, const T* base, uint32_t unit, int left) {
#pragma unroll
    for (int it = 0; it < N; ++it) {
      const bool ok = FULL || it * STEP < left;
      if constexpr (LEAN) {
        // a row past kv_hi (zero-filled, nothing read) has an offset in page 0 (rows()): a valid address, no
        // select; in bytes, one wide multiply-add from the base
        const char* src = row_addr(base, roff[it], unit * (uint32_t)sizeof(T));
#pragma unroll
        for (int g = 0; g < NG; ++g)
          ac::cp_async16(dst + g * GS + it * STEP * 128, src + g * CSTEP * 8 * (int)sizeof(T), ok);
      } else {
        const T* src = base + (ok ? (uint64_t)roff[it] * unit : 0ull);
#pragma unroll
        for (int g = 0; g < NG; ++g) ac::cp_async16(dst + g * GS + it * STEP * 128, src + g * CSTEP * 8, ok);
      }
    }
  }
};

}  // namespace sm90
}  // namespace fa2
