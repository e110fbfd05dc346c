// attncore xqa: XQA-style GQA decode on tensor cores (paged KV, split-KV, spec-decode).
//
// Notation
//   B        requests                      Hq, Hkv, G = Hq / Hkv   query heads, kv heads, group
//   QL       q_len_per_req (draft rows)    R = G * QL              rows sharing one kv head
//   row r    -> draft row qi = r / G, query head kvh * G + r % G   (packed into the MMA M dim)
//   MT       m16 tiles per CTA (1 or 2)    MG = ceil(R / (16 MT))  m-groups (grid.x)
//   D        head dim (64 / 128 / 256)     PS = 2^page_size_log2   page size
//   T        keys per pipeline tile        T = NW * KPW: NW = 4 warps split the keys, KPW keys per
//            (TILE)                        warp (16, or 32 for fp8 KV in this kernel's 16-row CTAs, D <= 128)
//   S        splits of one request's kv range across CTAs (grid.y = S * Hkv, grid.z = B)
//   STAGES   cp.async ring depth           C = D * sizeof(kv) / 16  16-byte chunks per key row
//   s        base-2 logits: qk * qk_scale_log2 (bmm1 scale * log2 e)
//   m, l     running row max / row sum of exp2(s - m) (online softmax, one set per warp)
//
// One CTA = (m-group, split, kv head, request).  Every K/V page of its kv range is read once for
// all R rows.  Q tile -> smem once; K/V tiles stream through a STAGES-deep cp.async ring with the
// page-table gather in the copy (page ids fetched one tile ahead into registers); 16-byte chunks
// are XOR-swizzled so ldmatrix is bank-conflict free.  S = Q K^T and O += P V use
// mma.sync m16n8k16 (fp32 accumulate); P stays in registers (the S accumulator layout is the A
// fragment layout).  O is rescaled only on tiles where a row max of the warp moved.
//
// fp8 KV (e4m3 / e5m2) stays fp8 in smem and is converted in registers: ldmatrix on byte pairs
// gives each thread four bytes, widened exactly to fp16, and the MMAs run in fp16 whatever the q
// dtype (CT, the compute type).  bf16 q is converted to fp16 once per CTA with a power-of-two
// prescale 2^-k chosen from max|q| of the CTA's rows (k > 0 only when max|q| > 2^14; 2^k goes into
// the logit scale), so it cannot overflow.  P is rounded to fp16 (finer than bf16).
//   K: one b16 8x8 matrix = 8 keys x 16 dims; thread holds dims 4t..4t+3, so the MMA k index is
//      permuted (k 2t,2t+1 <-> d 4t,4t+1; k 2t+8,2t+9 <-> d 4t+2,4t+3); Q is stored in smem with
//      the same permutation, so Q.K is unchanged.
//   V: .trans gives keys 2t,2t+1 x dims 2g,2g+1; the even dims form one n8 tile and the odd dims
//      another, so O's column order is permuted (undone in the epilogue: d = 16c + 4t + 2e + odd).
//   Widening: sm_89+ uses cvt.rn.f16x2.e4m3x2 / e5m2x2 (one instruction per pair); sm_80 uses
//   integer ops: e5m2 is fp16's top byte, e4m3 becomes value * 2^-8 (fp16 subnormals are exact in
//   the MMA) and the kernel folds 2^8 into its logit and output scales (FOLD).
//
// Epilogue: the 4 warps' (m, l, O) merge through smem.  S == 1: normalise (sinks add exp(sink) to
// the denominator, folded against max(row max, sink) so that a far larger sink cannot overflow),
// scale, write out (and LSE).  S > 1: write the normalised partial O and its LSE
// to the workspace; the last CTA of a (request, kv head, m-group) to arrive (atomic counter, which
// it resets to 0) merges the S partials.  Rows that see no key give 0 and LSE -inf.
//
// The kernel below is the main loop; its parts are in (all __forceinline__: the code generated is
// that of one function, as before the split, instruction for instruction -- checked on the PTX and
// SASS of every representative specialization):
//   xqa_config.cuh     Config (tile shape, ring depth, smem carve-up), Work (the CTA's rows and keys)
//   xqa_load.cuh       Q -> smem (bf16 -> fp16 prescale for fp8 KV), K/V ring copies with the page gather
//   xqa_mma.cuh        S = Q K^T, 16-bit and fp8 (widened in registers)
//   xqa_mask.cuh       the rows' draft positions for the mask
//   xqa_softmax.cuh    online softmax, P packing, O rescale
//   xqa_epilogue.cuh   warp merge, normalise (sinks), write; split-KV partials and the last CTA's merge
//   xqa_swap.cuh       another kernel: <= 8 rows, keys as the MMA's M (Cfg::SWAP)
//   xqa_splitd.cuh     another: fp8 KV at d128, 9-32 rows, O's dims split over the warps (Cfg::SD)
// Two steps stay written out here.  O += P V: as a function of its own (even as a lambda) the compiler
// no longer shares the fp8 K and V row addresses, and ptxas then schedules the whole kernel
// differently.  The mask (MaskRows::tile_needs_mask and visible, which the swapped kernel calls):
// called here, the window / causal tests become selects and 32-row spec-decode runs took ~1% longer
// (X1 q4, H200, session 26).
#pragma once
#include "attncore/ptx.cuh"
#include "xqa_config.cuh"
#include "xqa_epilogue.cuh"
#include "xqa_load.cuh"
#include "xqa_mask.cuh"
#include "xqa_mma.cuh"
#include "xqa_params.h"
#include "xqa_softmax.cuh"

namespace xqa {

template <typename QT, int KVK, int OUTK, typename Cfg>
__global__ void __launch_bounds__(NT, Cfg::MIN_BLOCKS) xqa_decode_kernel(const __grid_constant__ XqaParams p) {
  constexpr int D = Cfg::D, MT = Cfg::MT, RB = Cfg::RB, C = Cfg::C;
  constexpr int TILE = Cfg::TILE, KPW = Cfg::KPW, KB = Cfg::KB, DIAG = Cfg::DIAG;
  constexpr bool FP8 = KVK != 0;
  constexpr int NTILES_D = D / 8;  // n8 tiles of the output
  using CT = typename std::conditional<FP8, __half, QT>::type;  // MMA operand type
  const float fold = (KVK == 1) ? ac::kFp8Fold : 1.f;

  extern __shared__ __align__(128) uint8_t smem[];
  const Smem<Cfg> sm(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  const Work<Cfg> wk(p);  // after the previous kernel's writes (PDL)
  const int G = wk.G, QL = wk.QL, row0 = wk.row0, seq_len = wk.seq_len;
  const int my_tiles = wk.my_tiles;

  const KvCopy<Cfg> kv(p, wk, sm.big, tid);
  int pg[Cfg::RPT];  // page ids of this thread's rows of the next tile
  kv.prologue(pg, tid);  // the ring's first tiles in flight while Q is read

  float q_unscale = 1.f;  // 2^k when bf16 q was prescaled by 2^-k into fp16
  load_q<Cfg, QT, FP8>(sm.q, sm.ml, p, wk, tid, lane, warp, q_unscale);

  const MaskRows<MT> rows(p, row0, G, QL, seq_len, wk.b, g, 8);
  const int draft0 = rows.draft0;
  const uint16_t* mask_base = rows.mask_base;

  float o[MT][NTILES_D][4];
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < NTILES_D; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) { m_run[mt][h] = -INFINITY; l_run[mt][h] = 0.f; }
  }


  const uint32_t q_s = ac::smem_u32(sm.q);
  const float qk_scale = p.qk_scale_log2 * fold * q_unscale;

  for (int it = 0; it < my_tiles; ++it) {
    kv.advance(pg, it);
    const auto [ks, vs, tile_start] = kv.tile(it);

    if constexpr (DIAG == 1) continue;  // diagnostic: stream the KV only

    const int lm = lane >> 3;  // which 8x8 matrix of an ldmatrix this lane addresses
    const int kw0 = warp * KPW;  // this warp's first key row in the tile
    float s[MT][2 * KB][4];
    compute_s<Cfg, CT, KVK>(s, ks, q_s, lm, kw0, lane);

    // scale, mask (boundary tiles only: the draft tokens, the kv end, the window's edge): MaskRows'
    // tile_needs_mask and visible, written out (see above)
    const bool need_mask = (tile_start + TILE > draft0) ||
                           (p.window_left >= 0 && tile_start < seq_len - 1 - p.window_left);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 2 * KB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] *= qk_scale;
    if (need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int qi = rows.qi[mt][h];
          const int pos_q = draft0 + qi;
          const uint16_t* mrow = mask_base ? mask_base + (int64_t)qi * p.mask_words16 : nullptr;
#pragma unroll
          for (int j = 0; j < 2 * KB; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int tok = tile_start + kw0 + 8 * j + 2 * t + e;
              bool vis = tok < seq_len;
              if (p.window_left >= 0) vis = vis && tok >= pos_q - p.window_left;
              if (tok >= draft0) {
                if (mrow) {
                  const int jd = tok - draft0;
                  vis = vis && ((mrow[jd >> 4] >> (jd & 15)) & 1);
                } else if (p.causal) {
                  vis = vis && tok <= pos_q;
                }
              }
              if (!vis) s[mt][j][2 * h + e] = -INFINITY;
            }
        }
    }

    uint32_t pa[MT][KB][4];
    online_softmax<Cfg, CT>(s, m_run, l_run, pa, o);

    // O += P V (xqa_mma.cuh: the fp8 V layout)
    if constexpr (!FP8) {
#pragma unroll
      for (int n2 = 0; n2 < D / 16; ++n2) {
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          uint32_t vb[4];
          const int r = kw0 + kb_ * 16 + (lm & 1) * 8 + (lane & 7);
          ac::ldsm_x4_t(vb, vs + r * RB + (ac::swz_chunk<C>(r, 2 * n2 + (lm >> 1)) << 4));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            ac::mma16816<CT>(o[mt][2 * n2], pa[mt][kb_], vb[0], vb[1]);
            ac::mma16816<CT>(o[mt][2 * n2 + 1], pa[mt][kb_], vb[2], vb[3]);
          }
        }
      }
    } else {
#pragma unroll
      for (int cc = 0; cc < D / 32; ++cc) {
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          uint32_t x[4];
          const int r = kw0 + kb_ * 16 + (lm & 1) * 8 + (lane & 7);
          ac::ldsm_x4_t(x, vs + r * RB + (ac::swz_chunk<C>(r, 2 * cc + (lm >> 1)) << 4));
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int ch = 2 * cc + hh;
            // bytes [V(2t,2g) V(2t,2g+1) V(2t+1,2g) V(2t+1,2g+1)] -> even dims pair, odd dims pair
            const uint32_t y0 = __byte_perm(x[2 * hh], 0, 0x3120);
            const uint32_t y1 = __byte_perm(x[2 * hh + 1], 0, 0x3120);
            const uint32_t e0 = ac::cvt_fp8x2_lo<KVK>(y0);
            const uint32_t e1 = ac::cvt_fp8x2_lo<KVK>(y1);
            const uint32_t o0 = ac::cvt_fp8x2_hi<KVK>(y0);
            const uint32_t o1 = ac::cvt_fp8x2_hi<KVK>(y1);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              ac::mma16816<CT>(o[mt][2 * ch], pa[mt][kb_], e0, e1);
              ac::mma16816<CT>(o[mt][2 * ch + 1], pa[mt][kb_], o0, o1);
            }
          }
        }
      }
    }
  }
  ac::cp_async_wait<0>();
  ac::grid_dep_launch();
  __syncthreads();  // pipeline smem is reused below

  merge_warps<Cfg, FP8>(sm.ml, sm.stat, sm.red, o, m_run, l_run, tid, warp, g, t);

  finish<Cfg, QT, OUTK>(p, wk, sm.stat, sm.red, sm.flag, tid, fold);
}

}  // namespace xqa
