// attncore xqa: XQA-style GQA decode on tensor cores (paged KV, split-KV, spec-decode).
//
// Notation
//   B        requests                      Hq, Hkv, G = Hq / Hkv   query heads, kv heads, group
//   QL       q_len_per_req (draft rows)    R = G * QL              rows sharing one kv head
//   row r    -> draft row qi = r / G, query head kvh * G + r % G   (packed into the MMA M dim)
//   MT       m16 tiles per CTA (1 or 2)    MG = ceil(R / (16 MT))  m-groups (grid.x)
//   D        head dim (64 / 128 / 256)     PS = 2^page_size_log2   page size
//   T        keys per pipeline tile        T = NW * KPW: NW = 4 warps split the keys, KPW keys per
//            (TILE)                        warp (16, or 32 for fp8 KV in 16-row CTAs, D <= 128)
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
#pragma once
#include <stdint.h>

#include "attncore/ptx.cuh"
#include "xqa_params.h"

namespace xqa {

constexpr int NW = 4;         // warps per CTA
constexpr int NT = NW * 32;   // threads per CTA

// KPW_ keys per warp per tile (16 or 32: TILE = NW * KPW keys); STAGES_ / MINB_ override the ring
// depth and the CTAs-per-SM register budget (0: derived below); L2PF_ the cp.async L2 prefetch hint
// in bytes (0 none, 64, 128, 256); DIAG_ (tuning diagnostics only, wrong results): 1 streams the KV
// without computing, 2 computes on zeroed tiles without loading.
template <int D_, int KV_BYTES_, int MT_, int KPW_ = 16, int STAGES_ = 0, int MINB_ = 0, int DIAG_ = 0,
          int L2PF_ = 128>
struct Config {
  static constexpr int D = D_;
  static constexpr int KVB = KV_BYTES_;                    // bytes per kv element (2 or 1)
  static constexpr int MT = MT_;
  static constexpr int KPW = KPW_;                         // keys per warp per tile
  static constexpr int KB = KPW / 16;                      // 16-key blocks per warp per tile
  static constexpr int TILE = NW * KPW;                    // keys per pipeline tile
  static constexpr int DIAG = DIAG_;
  static constexpr int L2PF = L2PF_;
  static constexpr int ROWS = 16 * MT;                     // packed rows per CTA
  static constexpr int RB = D * KVB;                       // bytes per key row in smem
  static constexpr int C = RB / 16;                        // 16-byte chunks per key row
  static constexpr int RPT = TILE * C / NT;                // key rows each thread copies per tile
  static constexpr int STAGE_BYTES = 2 * TILE * RB;        // K + V tile
  static constexpr int STAGES_RAW = 98304 / STAGE_BYTES;
  static constexpr int STAGES_AUTO = STAGES_RAW < 2 ? 2 : (STAGES_RAW > 4 ? 4 : STAGES_RAW);
  static constexpr int STAGES = STAGES_ > 0 ? STAGES_ : STAGES_AUTO;
  static constexpr int QRB = D * 2;                        // bytes per Q row (16-bit)
  static constexpr int Q_BYTES = ROWS * QRB;
  static constexpr int RED_PITCH = D + 8;                  // floats per row of the merge buffer
  static constexpr int RED_BYTES = NW * ROWS * RED_PITCH * 4;
  static constexpr int PIPE_BYTES = STAGES * STAGE_BYTES;
  static constexpr int BIG_BYTES = PIPE_BYTES > RED_BYTES ? PIPE_BYTES : RED_BYTES;
  static constexpr int ML_BYTES = NW * ROWS * 2 * 4;       // per-warp m, l
  static constexpr int STAT_BYTES = ROWS * (NW + 2) * 4;   // per-row warp weights, M, L
  static constexpr int BIG_OFF = (Q_BYTES + ML_BYTES + STAT_BYTES + 16 + 127) / 128 * 128;
  static constexpr int SMEM = BIG_OFF + BIG_BYTES;
  // CTAs per SM the register budget is sized for (H100: 228 KB smem per SM); MT2 keeps 2 so its
  // 32-row accumulators do not spill.
  static constexpr int MIN_BLOCKS_AUTO = (MT == 1 && SMEM <= 72 * 1024) ? 3 : (SMEM <= 110 * 1024 ? 2 : 1);
  static constexpr int MIN_BLOCKS = MINB_ > 0 ? MINB_ : MIN_BLOCKS_AUTO;
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  static_assert(KPW == 16 || KPW == 32, "keys per warp");
  static_assert(STAGES >= 2, "ring depth");
  static_assert(L2PF == 0 || L2PF == 64 || L2PF == 128 || L2PF == 256, "L2 prefetch size");
  static_assert(NT % C == 0 && RPT >= 1 && TILE % RPT == 0, "copy mapping");
};

// ------------------------------------------------------------------------------ kernel
template <typename QT, int KVK, int OUTK, typename Cfg>
__global__ void __launch_bounds__(NT, Cfg::MIN_BLOCKS) xqa_decode_kernel(const __grid_constant__ XqaParams p) {
  constexpr int D = Cfg::D, MT = Cfg::MT, ROWS = Cfg::ROWS, RB = Cfg::RB, C = Cfg::C, RPT = Cfg::RPT;
  constexpr int STAGES = Cfg::STAGES, TILE = Cfg::TILE, KPW = Cfg::KPW, KB = Cfg::KB, DIAG = Cfg::DIAG;
  constexpr bool FP8 = KVK != 0;
  constexpr int NTILES_D = D / 8;  // n8 tiles of the output
  using CT = typename std::conditional<FP8, __half, QT>::type;  // MMA operand type
  const float fold = (KVK == 1) ? ac::kFp8Fold : 1.f;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sm_q = smem;
  float* sm_ml = reinterpret_cast<float*>(smem + Cfg::Q_BYTES);                 // [NW][ROWS][2]
  float* sm_stat = sm_ml + NW * ROWS * 2;                                        // [ROWS][NW+2]
  int* sm_flag = reinterpret_cast<int*>(sm_stat + ROWS * (NW + 2));
  uint8_t* sm_big = smem + Cfg::BIG_OFF;                                         // pipeline / merge
  float* sm_red = reinterpret_cast<float*>(sm_big);                             // [NW][ROWS][RED_PITCH]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int mg = blockIdx.x;
  const int split = blockIdx.y % p.num_splits;
  const int kvh = blockIdx.y / p.num_splits;
  const int b = blockIdx.z;

  ac::grid_dep_wait();  // no-op unless launched with PDL

  const int G = p.group, QL = p.q_len;
  const int row0 = mg * ROWS;                                   // first packed row of this CTA
  const int rows_here = min(ROWS, p.rows - row0);
  const int seq_len = p.seq_lens[b];

  // ---- kv range of this request (window lower bound of draft row 0, tile aligned), then split.
  int lo = 0;
  if (p.window_left >= 0) lo = max(0, seq_len - QL - p.window_left);
  const int kv_begin = (lo / TILE) * TILE;
  const int n_tiles = seq_len > kv_begin ? (seq_len - kv_begin + TILE - 1) / TILE : 0;
  const int tps = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int t_first = split * tps;
  const int my_tiles = max(0, min(n_tiles, t_first + tps) - t_first);

  const int* pt = p.page_table + (p.page_table_indptr ? (int64_t)p.page_table_indptr[b]
                                                      : (int64_t)b * p.page_table_stride);
  const int lg = p.page_size_log2;
  const int ps_mask = (1 << lg) - 1;
  const bool one_page = (1 << lg) >= RPT;  // a thread's RPT rows of a tile lie in one page

  // ---- Q tile -> smem (16-bit CT, swizzled; permuted within 16-dim groups for fp8 KV).
  float q_unscale = 1.f;  // 2^k when bf16 q was prescaled by 2^-k into fp16
  {
    constexpr int GROUPS16 = D / 16;
    constexpr bool CONVERT = FP8 && std::is_same<QT, __nv_bfloat16>::value;
    float q_prescale = 1.f;
    if constexpr (CONVERT) {
      float mx = 0.f;
      for (int i = tid; i < ROWS * GROUPS16; i += NT) {
        const int r = i / GROUPS16, gi = i % GROUPS16;
        if (r < rows_here) {
          const int rr = row0 + r;
          const QT* src = reinterpret_cast<const QT*>(p.q) + (int64_t)(b * QL + rr / G) * p.q_stride_tok +
                          (int64_t)(kvh * G + rr % G) * p.q_stride_head + gi * 16;
          const uint4 a = *reinterpret_cast<const uint4*>(src);
          const uint4 c = *reinterpret_cast<const uint4*>(src + 8);
          const uint32_t w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float2 f = ac::unpack2<QT>(w[j]);
            mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
          }
        }
      }
      mx = ac::warp_max(mx);
      if (lane == 0) sm_ml[warp] = mx;
      __syncthreads();
      mx = fmaxf(fmaxf(sm_ml[0], sm_ml[1]), fmaxf(sm_ml[2], sm_ml[3]));
      __syncthreads();
      int k = 0;
      if (mx > 16384.f) k = (int)ceilf(log2f(mx / 16384.f));
      if (!(k < 128)) k = 0;  // inf / nan in q: leave unscaled (propagates like the reference)
      q_prescale = exp2f((float)-k);
      q_unscale = exp2f((float)k);
    }
    for (int i = tid; i < ROWS * GROUPS16; i += NT) {
      const int r = i / GROUPS16, gi = i % GROUPS16;
      uint4 lo4 = make_uint4(0, 0, 0, 0), hi4 = make_uint4(0, 0, 0, 0);
      if (r < rows_here) {
        const int rr = row0 + r;
        const int qi = rr / G, hh = rr % G;
        const QT* src = reinterpret_cast<const QT*>(p.q) + (int64_t)(b * QL + qi) * p.q_stride_tok +
                        (int64_t)(kvh * G + hh) * p.q_stride_head + gi * 16;
        lo4 = *reinterpret_cast<const uint4*>(src);
        hi4 = *reinterpret_cast<const uint4*>(src + 8);
        if constexpr (CONVERT) {
          uint32_t w[8] = {lo4.x, lo4.y, lo4.z, lo4.w, hi4.x, hi4.y, hi4.z, hi4.w};
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float2 f = ac::unpack2<QT>(w[j]);
            w[j] = ac::pack2<__half>(f.x * q_prescale, f.y * q_prescale);
          }
          lo4 = make_uint4(w[0], w[1], w[2], w[3]);
          hi4 = make_uint4(w[4], w[5], w[6], w[7]);
        }
      }
      if constexpr (FP8) {
        // pair j (dims 2j, 2j+1) -> position j/2 (j even) or 4 + j/2 (j odd)
        const uint32_t s[8] = {lo4.x, lo4.y, lo4.z, lo4.w, hi4.x, hi4.y, hi4.z, hi4.w};
        lo4 = make_uint4(s[0], s[2], s[4], s[6]);
        hi4 = make_uint4(s[1], s[3], s[5], s[7]);
      }
      uint8_t* rowp = sm_q + r * Cfg::QRB;
      *reinterpret_cast<uint4*>(rowp + (ac::swz_chunk<D / 8>(r, 2 * gi) << 4)) = lo4;
      *reinterpret_cast<uint4*>(rowp + (ac::swz_chunk<D / 8>(r, 2 * gi + 1) << 4)) = hi4;
    }
  }

  // ---- per-thread copy mapping: chunk ld_c of key rows ld_r0 .. ld_r0 + RPT - 1 of each tile.
  const int ld_c = tid % C;
  const int ld_r0 = (tid / C) * RPT;
  const uint8_t* kbase = reinterpret_cast<const uint8_t*>(p.k) + ((int64_t)kvh * p.k_stride_head) * Cfg::KVB + ld_c * 16;
  const uint8_t* vbase = reinterpret_cast<const uint8_t*>(p.v) + ((int64_t)kvh * p.v_stride_head) * Cfg::KVB + ld_c * 16;

  int pg[RPT];
  auto fetch_pages = [&](int tile) {
    if constexpr (DIAG == 2) return;
    const int tok0 = kv_begin + tile * TILE + ld_r0;
    if (one_page) {
      const int v = tok0 < seq_len ? __ldg(pt + (tok0 >> lg)) : 0;
#pragma unroll
      for (int k = 0; k < RPT; ++k) pg[k] = v;
    } else {
#pragma unroll
      for (int k = 0; k < RPT; ++k) pg[k] = (tok0 + k) < seq_len ? __ldg(pt + ((tok0 + k) >> lg)) : 0;
    }
  };
  const int64_t k_tok_bytes = p.k_stride_tok * Cfg::KVB, v_tok_bytes = p.v_stride_tok * Cfg::KVB;
  // EDGE (std::true_type: the first tile of a split, issued in the prologue): keys left of draft row
  // 0's window (kv_begin rounds lo down to a tile) are zero-filled too.  They are masked in S, but
  // 0 * NaN is NaN in P V (semantics.md rule 2); the main loop's copies never need the test.
  auto issue = [&](int stage, int tile, auto edge) {
    if constexpr (DIAG == 2) return;
    constexpr bool EDGE = decltype(edge)::value;
    const int tok0 = kv_begin + tile * TILE + ld_r0;
    const uint32_t ks = ac::smem_u32(sm_big + stage * Cfg::STAGE_BYTES);
    const uint32_t vs = ks + TILE * RB;
    if (one_page) {
      // RPT consecutive slots of one page: one address, then constant steps.  Rows past seq_len
      // (zero-filled, nothing read) still point inside that page (or page 0 when the whole run is
      // past the end), so no select is needed.
      const int64_t page = pg[0];
      const int64_t slot = tok0 & ps_mask;
      const uint8_t* ksrc = kbase + (page * p.k_stride_page + slot * p.k_stride_tok) * Cfg::KVB;
      const uint8_t* vsrc = vbase + (page * p.v_stride_page + slot * p.v_stride_tok) * Cfg::KVB;
#pragma unroll
      for (int k = 0; k < RPT; ++k) {
        const int r = ld_r0 + k;
        const bool valid = tok0 + k < seq_len && (!EDGE || tok0 + k >= lo);
        const uint32_t off = r * RB + (ac::swz_chunk<C>(r, ld_c) << 4);
        ac::cp_async16<Cfg::L2PF>(ks + off, ksrc + k * k_tok_bytes, valid);
        ac::cp_async16<Cfg::L2PF>(vs + off, vsrc + k * v_tok_bytes, valid);
      }
      return;
    }
#pragma unroll
    for (int k = 0; k < RPT; ++k) {
      const int r = ld_r0 + k;
      const int tok = tok0 + k;
      const bool valid = tok < seq_len && (!EDGE || tok >= lo);
      const int64_t slot = tok & ps_mask;
      const int64_t page = pg[k];
      const uint8_t* ksrc = kbase + (page * p.k_stride_page + slot * p.k_stride_tok) * Cfg::KVB;
      const uint8_t* vsrc = vbase + (page * p.v_stride_page + slot * p.v_stride_tok) * Cfg::KVB;
      const uint32_t off = r * RB + (ac::swz_chunk<C>(r, ld_c) << 4);
      ac::cp_async16<Cfg::L2PF>(ks + off, valid ? (const void*)ksrc : p.k, valid);
      ac::cp_async16<Cfg::L2PF>(vs + off, valid ? (const void*)vsrc : p.v, valid);
    }
  };

  // ---- per-thread row info for masking: rows g and g + 8 of each m-tile.
  int row_qi[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = row0 + mt * 16 + g + 8 * h;
      row_qi[mt][h] = rr < p.rows ? rr / G : QL - 1;  // padding rows: any valid draft row
    }
  const int draft0 = seq_len - QL;  // first draft token (causal / spec mask region)
  const uint16_t* mask_base = p.spec_mask ? p.spec_mask + (int64_t)b * QL * p.mask_words16 : nullptr;

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

  if constexpr (DIAG == 2) {  // diagnostic: compute on zeroed tiles (nothing is loaded)
    for (int i = tid; i < Cfg::PIPE_BYTES / 16; i += NT) reinterpret_cast<uint4*>(sm_big)[i] = make_uint4(0, 0, 0, 0);
    __syncthreads();
  }

  // ---- pipeline prologue
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < my_tiles) {
      fetch_pages(t_first + i);
      if (i == 0) issue(i, t_first + i, std::true_type{});
      else issue(i, t_first + i, std::false_type{});
    }
    ac::cp_async_commit();
  }
  if (STAGES - 1 < my_tiles) fetch_pages(t_first + STAGES - 1);

  const uint32_t q_s = ac::smem_u32(sm_q);
  const float qk_scale = p.qk_scale_log2 * fold * q_unscale;

  for (int it = 0; it < my_tiles; ++it) {
    ac::cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int ni = it + STAGES - 1;
      if (ni < my_tiles) {
        issue(ni % STAGES, t_first + ni, std::false_type{});
        if (ni + 1 < my_tiles) fetch_pages(t_first + ni + 1);
      }
      ac::cp_async_commit();
    }
    const int stage = it % STAGES;
    const uint32_t ks = ac::smem_u32(sm_big + stage * Cfg::STAGE_BYTES);
    const uint32_t vs = ks + TILE * RB;
    const int tile_start = kv_begin + (t_first + it) * TILE;

    if constexpr (DIAG == 1) continue;  // diagnostic: stream the KV only

    // S = Q K^T for this warp's KPW keys (KB blocks of 16; n8 tile j = keys 8j..8j+7 of the warp)
    float s[MT][2 * KB][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 2 * KB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.f;

    const int lm = lane >> 3;  // which 8x8 matrix this lane addresses
    const int kw0 = warp * KPW;  // this warp's first key row in the tile
    if constexpr (!FP8) {
#pragma unroll
      for (int kstep = 0; kstep < D / 16; ++kstep) {
        uint32_t kb[KB][4];
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          const int r = kw0 + kb_ * 16 + (lm >> 1) * 8 + (lane & 7);
          ac::ldsm_x4(kb[kb_], ks + r * RB + (ac::swz_chunk<C>(r, 2 * kstep + (lm & 1)) << 4));
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t qa[4];
          const int r = mt * 16 + (lm & 1) * 8 + (lane & 7);
          ac::ldsm_x4(qa, q_s + r * Cfg::QRB + (ac::swz_chunk<D / 8>(r, 2 * kstep + (lm >> 1)) << 4));
#pragma unroll
          for (int kb_ = 0; kb_ < KB; ++kb_) {
            ac::mma16816<CT>(s[mt][2 * kb_], qa, kb[kb_][0], kb[kb_][1]);
            ac::mma16816<CT>(s[mt][2 * kb_ + 1], qa, kb[kb_][2], kb[kb_][3]);
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 32; ++kk) {
        uint32_t x[KB][4];
#pragma unroll
        for (int kb_ = 0; kb_ < KB; ++kb_) {
          const int r = kw0 + kb_ * 16 + (lm & 1) * 8 + (lane & 7);
          ac::ldsm_x4(x[kb_], ks + r * RB + (ac::swz_chunk<C>(r, 2 * kk + (lm >> 1)) << 4));
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int kstep = 2 * kk + hh;
          uint32_t bk[KB][4];
#pragma unroll
          for (int kb_ = 0; kb_ < KB; ++kb_) {
            bk[kb_][0] = ac::cvt_fp8x2_lo<KVK>(x[kb_][2 * hh]);
            bk[kb_][1] = ac::cvt_fp8x2_hi<KVK>(x[kb_][2 * hh]);
            bk[kb_][2] = ac::cvt_fp8x2_lo<KVK>(x[kb_][2 * hh + 1]);
            bk[kb_][3] = ac::cvt_fp8x2_hi<KVK>(x[kb_][2 * hh + 1]);
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t qa[4];
            const int r = mt * 16 + (lm & 1) * 8 + (lane & 7);
            ac::ldsm_x4(qa, q_s + r * Cfg::QRB + (ac::swz_chunk<D / 8>(r, 2 * kstep + (lm >> 1)) << 4));
#pragma unroll
            for (int kb_ = 0; kb_ < KB; ++kb_) {
              ac::mma16816<CT>(s[mt][2 * kb_], qa, bk[kb_][0], bk[kb_][1]);
              ac::mma16816<CT>(s[mt][2 * kb_ + 1], qa, bk[kb_][2], bk[kb_][3]);
            }
          }
        }
      }
    }

    // scale, mask (boundary tiles only), online softmax
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
          const int qi = row_qi[mt][h];
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
        const float m_new = fmaxf(m_run[mt][h], mx);
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

    // O += P V
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

  // ---- merge the 4 warps: per-row (m, l) then weighted O sum through smem.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = ac::quad_sum(l_run[mt][h]);
      if (t == 0) {
        const int r = mt * 16 + g + 8 * h;
        sm_ml[(warp * ROWS + r) * 2 + 0] = m_run[mt][h];
        sm_ml[(warp * ROWS + r) * 2 + 1] = l;
      }
    }
  __syncthreads();
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

  const bool split_mode = p.num_splits > 1;
    const int64_t unit = ((int64_t)(b * p.num_kv_heads + kvh) * p.m_groups + mg);  // (b, kvh, mg)
  constexpr int D4 = D / 4;

  auto store_out = [&](int r, int d4, float4 v) {  // r: row within CTA
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
  };
  auto store_lse = [&](int r, float v) {
    const int rr = row0 + r;
    const int qi = rr / G, hh = rr % G;
    p.lse[(int64_t)(b * QL + qi) * p.lse_stride_tok + (int64_t)(kvh * G + hh) * p.lse_stride_head] = v;
  };
  // Final normaliser of a row r that saw a key (L != 0), given its max M and its sum L relative to M
  // (base 2): sets lse and returns the factor for the O accumulated relative to M.  A sink is folded
  // into the denominator against the larger of M and the sink: ex2(sink - M) overflows to inf when
  // the sink is 128+ (base 2; ~88.7 nats) above every logit of the row (a large sink, or logits far
  // below zero: q.k * bmm1_scale is unbounded), which gave LSE +inf and output 0.  With no sink, or
  // M >= sink, the operations are those of before (1 / (L + ex2(sink - M)), M + log2(L + ...)); a
  // larger sink gives the same values up to rounding.  A NaN row (NaN L) stays NaN.
  auto normalise = [&](int r, float M, float L, float& lse) -> float {
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
  };

  if (!split_mode) {
    for (int i = tid; i < rows_here * D4; i += NT) {
      const int r = i / D4, d4 = i % D4;
      const float* st = sm_stat + r * (NW + 2);
      const float M = st[NW], L = st[NW + 1];
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(sm_red + (w * ROWS + r) * Cfg::RED_PITCH + d4 * 4);
        acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
      }
      // L == 0: no key (0, -inf); a NaN query row has NaN L (its m stays -inf, fmaxf drops NaN),
      // and NaN != 0 carries it to the output and LSE (semantics.md rule 3)
      float f = 0.f, lse_r;
      if (L != 0.f) f = normalise(r, M, L, lse_r);
      store_out(r, d4, make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f));
    }
    if (p.lse && tid < rows_here) {
      const float* st = sm_stat + tid * (NW + 2);
      const float M = st[NW], L = st[NW + 1];
      float lse_r = -INFINITY;
      if (L != 0.f) normalise(tid, M, L, lse_r);
      store_lse(tid, lse_r);
    }
    return;
  }

  // ---- split-KV: write normalised partial O and its LSE, then the last CTA merges.
  {
    float* po = p.ws_partial_o + (unit * p.num_splits + split) * ROWS * D;
    float* pl = p.ws_partial_lse + (unit * p.num_splits + split) * ROWS;
    for (int i = tid; i < rows_here * D4; i += NT) {
      const int r = i / D4, d4 = i % D4;
      const float L = sm_stat[r * (NW + 2) + NW + 1];
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < NW; ++w) {
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
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int prev = atomicAdd(p.ws_counters + unit, 1);
    const int last = prev == p.num_splits - 1;
    if (last) p.ws_counters[unit] = 0;  // every split has arrived: ready for the next launch
    *sm_flag = last;
  }
  __syncthreads();
  if (!*sm_flag) return;
  __threadfence();

  // Merge: weights w_s = 2^(lse_s - M) per row, stored in smem (reusing the merge buffer).
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
    if (L != 0.f) f = normalise(r, M, L, lse_r);
    store_out(r, d4, make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f));
  }
  if (p.lse && tid < rows_here) {
    const float M = sm_stat[tid * (NW + 2) + NW], L = sm_stat[tid * (NW + 2) + NW + 1];
    float lse_r = -INFINITY;
    if (L != 0.f) normalise(tid, M, L, lse_r);
    store_lse(tid, lse_r);
  }
}

}  // namespace xqa
