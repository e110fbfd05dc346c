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
//
// The kernel below is the main loop; its parts are in (all __forceinline__, so the code generated is
// that of one function, as before the split):
//   fa2_kernel_traits.cuh   Config (tile shape), Smem (carve-up), WorkItem, Cta (coordinates), swz
//   fa2_load.cuh            Q and K/V copies (page gather, page-id prefetch), fp8 -> 16-bit, RoPE
//   fa2_mma.cuh             S = Q K^T and O += P V (mma.sync m16n8k16)
//   fa2_mask.cuh            scale, soft cap, ALiBi, causal / window / custom mask
//   fa2_softmax.cuh         online softmax (base 2), O rescale
//   fa2_epilogue.cuh        cross-warp merge, normalise, write (or a split partial); fa2_merge_kernel
// fa2_sm90.cuh is the Hopper (wgmma) kernel; it shares fa2_kernel_traits.cuh.
#pragma once
#include "fa2_epilogue.cuh"
#include "fa2_kernel_traits.cuh"
#include "fa2_load.cuh"
#include "fa2_mask.cuh"
#include "fa2_mma.cuh"
#include "fa2_softmax.cuh"

namespace fa2 {

// T: q/out dtype.  KVKIND: 0 same as T, 1 e4m3, 2 e5m2.
template <typename Cfg, typename T, int KVKIND, int MASK, bool SOFTCAP, bool ALIBI, bool ROPE>
__global__ void __launch_bounds__(Cfg::NTHREADS, Cfg::MINB) fa2_attention_kernel(const Fa2Params p) {
  constexpr int NMQ = Cfg::NMQ, NKT = Cfg::NKT, NDT = Cfg::NDT;
  constexpr int KVT = Cfg::KVT, KVW = Cfg::KVW, STAGES = Cfg::STAGES;
  constexpr int KVB = KVKIND == 0 ? 2 : 1;  // bytes per K/V element in global memory
  using SM = Smem<Cfg, KVB>;
  using CtaT = Cta<Cfg, T, MASK>;

  if (past_work_count(p)) return;  // CUDA-graph mode: a capacity grid
  extern __shared__ __align__(128) uint8_t smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  uint8_t* sKV = smem + SM::q_bytes;  // STAGES x (K tile, V tile)
  T* sK16 = reinterpret_cast<T*>(smem + SM::q_bytes + STAGES * SM::stage_bytes);  // fp8 only
  T* sV16 = sK16 + KVT * Cfg::D;
  int* sPg = reinterpret_cast<int*>(smem + SM::q_bytes + STAGES * SM::stage_bytes + SM::cvt_bytes);  // [2][KVT]

  const CtaT cta(p);
  const int tid = cta.tid, lane = cta.lane;
  const int kv_lo = cta.w.kv_lo, n_tiles = cta.w.n_tiles;

  load_q<Cfg>(sQ, cta);
  using KvLoaderT = KvLoader<Cfg, T, KVB, CtaT>;
  KvLoaderT kv(cta, sKV, sPg);
  int pg_pf[KvLoaderT::PF_SLOTS];  // PF: page ids of the next tile, in registers
  pg_pf[0] = 0;
  RowInfo<NMQ> rows;
  init_rows<Cfg, ALIBI>(rows, cta);

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
    // ---- prologue: STAGES - 1 tiles in flight; page ids of tile STAGES - 1 fetched (PF) or in the
    // table (PGTAB, visible after the loop-top barrier)
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < n_tiles) {
        kv.fetch_pages(p, pg_pf, s);
        kv.load_tile(p, pg_pf, s, s, false);
      }
      ac::cp_async_commit();
    }
    kv.fetch_pages(p, pg_pf, STAGES - 1);
    kv.tab_load(p, STAGES - 1);
    kv.tab_store(STAGES - 1);
    if (ROPE) {
      ac::cp_async_wait<STAGES - 2>();
      __syncthreads();
      rope_rotate_q<Cfg>(sQ, cta, p);
    }

    const int qrow_base = cta.wq * NMQ * 16;
    const int kv_w0 = cta.wkv * KVW;  // this warp's first key within a stage

    for (int tile = 0; tile < n_tiles; ++tile) {
      ac::cp_async_wait<STAGES - 2>();
      __syncthreads();
      {
        int nt = tile + STAGES - 1;
        if (nt < n_tiles) {
          kv.load_tile(p, pg_pf, nt, nt % STAGES, true);
          kv.fetch_pages(p, pg_pf, nt + 1);
        }
        kv.tab_load(p, nt + 1);  // stored after this tile's math, read by the next iteration's copy
        ac::cp_async_commit();
      }
      const int stage = tile % STAGES;
      const T* tK;
      const T* tV;
      if constexpr (KVB == 1) {
        convert_fp8_stage<Cfg, T, KVKIND>(sKV, stage, sK16, sV16, tid);
        tK = sK16;
        tV = sV16;
        if (!ROPE) __syncthreads();
      } else {
        tK = reinterpret_cast<const T*>(sKV + stage * SM::stage_bytes);
        tV = reinterpret_cast<const T*>(sKV + stage * SM::stage_bytes + SM::stage_bytes / 2);
      }
      if (ROPE) {
        if constexpr (KVB == 1) __syncthreads();
        rope_rotate_k<Cfg>(const_cast<T*>(tK), kv_lo, tile, tid, p);
        __syncthreads();
      }

      float s[NMQ][NKT][4];
      compute_s<Cfg>(s, sQ, tK, qrow_base, kv_w0, lane);
      scale_and_mask<Cfg, MASK, SOFTCAP, ALIBI>(s, cta, rows, tile, kv_w0);
      online_softmax(s, m, l, o, kFoldScale<SOFTCAP, ALIBI> ? p.scale_log2 : 1.f);
      accumulate_pv<Cfg>(o, s, tV, kv_w0, lane);
      kv.tab_store(tile + STAGES);
    }
  }

  // ---- epilogue (fa2_epilogue.cuh): stage every warp's partial softmax in smem, then per row chunk
  // merge the NWKV warps, normalise, write.  The normalisation is written here: as a function of its
  // own (even a lambda) the compiler lays out its final / partial branches differently, and ptxas
  // then schedules the whole kernel differently (checked on the PTX and SASS).
  stage_partials<Cfg>(smem, o, m, l, cta);
  const int row0 = cta.w.row0, slot = cta.w.slot, qo_start = cta.w.qo_start, G = cta.G, kvh = cta.kvh;
  constexpr int CPR16 = Cfg::D / 8;
  const bool final_out = slot < 0;
  for (int idx = tid; idx < cta.w.rows_here * CPR16; idx += Cfg::NTHREADS) {
    const int r = idx / CPR16, c = idx % CPR16;
    float Mu, L, acc[8];
    merge_warps<Cfg>(smem, r, c, Mu, L, acc);
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
    write_row<Cfg, T>(p, acc, scale, lse_v, final_out, qo_start, slot, tok, h, c);
  }
}

}  // namespace fa2
