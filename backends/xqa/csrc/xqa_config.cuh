// attncore xqa: the kernel's compile-time configuration (tile shape, pipeline depth, shared-memory
// carve-up, register budget), and a CTA's share of the work.  Notation: xqa_decode.cuh.
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
// without computing, 2 computes on zeroed tiles without loading.  SWAP_ (<= 8 rows): the swapped
// products of xqa_swap.cuh, 8 rows per CTA.  SD_ (fp8 KV, d128, 64-key tiles): the split-dims kernel of
// xqa_splitd.cuh, 16 MT rows per CTA, P through smem, one merge slot.
template <int D_, int KV_BYTES_, int MT_, int KPW_ = 16, int STAGES_ = 0, int MINB_ = 0, int DIAG_ = 0,
          int L2PF_ = 128, int SWAP_ = 0, int SD_ = 0>
struct Config {
  static constexpr int D = D_;
  static constexpr int KVB = KV_BYTES_;                    // bytes per kv element (2 or 1)
  static constexpr int MT = MT_;
  static constexpr int KPW = KPW_;                         // keys per warp per tile
  static constexpr int KB = KPW / 16;                      // 16-key blocks per warp per tile
  static constexpr int TILE = NW * KPW;                    // keys per pipeline tile
  static constexpr int DIAG = DIAG_;
  static constexpr int L2PF = L2PF_;
  static constexpr bool SWAP = SWAP_ != 0;
  static constexpr bool SD = SD_ != 0;
  static constexpr int ROWS = SWAP ? 8 : 16 * MT;          // packed rows per CTA
  static constexpr int RB = D * KVB;                       // bytes per key row in smem
  static constexpr int C = RB / 16;                        // 16-byte chunks per key row
  static constexpr int RPT = TILE * C / NT;                // key rows each thread copies per tile
  static constexpr int STAGE_BYTES = 2 * TILE * RB;        // K + V tile
  static constexpr int STAGES_RAW = 98304 / STAGE_BYTES;
  static constexpr int STAGES_AUTO = STAGES_RAW < 2 ? 2 : (STAGES_RAW > 4 ? 4 : STAGES_RAW);
  static constexpr int STAGES = STAGES_ > 0 ? STAGES_ : STAGES_AUTO;
  static constexpr int QRB = D * 2;                        // bytes per Q row (16-bit)
  static constexpr int Q_BYTES = ROWS * QRB;
  static constexpr int P_BYTES = SD ? ROWS * TILE * 2 : 0; // SD: P, a [ROWS][TILE] 16-bit tile
  static constexpr int SLOTS = SD ? 1 : NW;                // merge slots (SD: the warps hold disjoint dims of O)
  static constexpr int RED_PITCH = D + 8;                  // floats per row of the merge buffer
  static constexpr int RED_BYTES = SLOTS * ROWS * RED_PITCH * 4;
  static constexpr int PIPE_BYTES = STAGES * STAGE_BYTES;
  static constexpr int BIG_BYTES = PIPE_BYTES > RED_BYTES ? PIPE_BYTES : RED_BYTES;
  static constexpr int ML_BYTES = NW * ROWS * 2 * 4;       // per-warp m, l
  static constexpr int STAT_BYTES = ROWS * (NW + 2) * 4;   // per-row warp weights, M, L
  static constexpr int BIG_OFF = (Q_BYTES + P_BYTES + ML_BYTES + STAT_BYTES + 16 + 127) / 128 * 128;
  static constexpr int SMEM = BIG_OFF + BIG_BYTES;
  // CTAs per SM the register budget is sized for (H100: 228 KB smem per SM); MT2 keeps 2 so its
  // 32-row accumulators do not spill.
  static constexpr int MIN_BLOCKS_AUTO = (MT == 1 && SMEM <= 72 * 1024) ? 3 : (SMEM <= 110 * 1024 ? 2 : 1);
  static constexpr int MIN_BLOCKS = MINB_ > 0 ? MINB_ : MIN_BLOCKS_AUTO;
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  static_assert(KPW == 16 || KPW == 32, "keys per warp");
  static_assert(!SWAP || MT == 1, "the swapped products serve one 8-row tile");
  static_assert(!SD || (!SWAP && KVB == 1 && D == 128 && KPW == 16),
                "the split-dims kernel: fp8 KV, d128, 64-key tiles");
  static_assert(STAGES >= 2, "ring depth");
  static_assert(L2PF == 0 || L2PF == 64 || L2PF == 128 || L2PF == 256, "L2 prefetch size");
  static_assert(NT % C == 0 && RPT >= 1 && TILE % RPT == 0, "copy mapping");
};

// One CTA's share of the work: its place in the grid (m-group mg, split, kv head kvh, request b), its
// packed rows (rows row0 .. row0 + rows_here - 1), the kv range of its request (keys from kv_begin, the
// window start of draft row 0 rounded down to a tile, to seq_len) cut into TILE-key tiles and split
// across CTAs (this one: my_tiles tiles from t_first), and the request's page table (pages of 2^lg
// keys).  Read after griddepcontrol.wait (the constructor waits; a no-op unless launched with PDL): seq_lens
// may be written by the kernel before.
template <typename Cfg>
struct Work {
  int mg, split, kvh, b;
  int G, QL, row0, rows_here, seq_len;
  int lo;  // first key of draft row 0's window (0 without a window)
  int kv_begin, n_tiles, tps, t_first, my_tiles;
  const int* pt;
  int lg, ps_mask;
  bool one_page;  // a thread's RPT rows of a tile lie in one page
  __device__ __forceinline__ explicit Work(const XqaParams& p) {
    ac::grid_dep_wait();
    mg = blockIdx.x;
    split = blockIdx.y % p.num_splits;
    kvh = blockIdx.y / p.num_splits;
    b = blockIdx.z;
    G = p.group, QL = p.q_len;
    row0 = mg * Cfg::ROWS;
    rows_here = min(Cfg::ROWS, p.rows - row0);
    seq_len = (int)min((unsigned)p.seq_lens[b], (unsigned)p.kv_cap);  // a bad length reads no table entry past it
    lo = 0;
    if (p.window_left >= 0) lo = max(0, seq_len - QL - p.window_left);
    kv_begin = (lo / Cfg::TILE) * Cfg::TILE;
    n_tiles = seq_len > kv_begin ? (seq_len - kv_begin + Cfg::TILE - 1) / Cfg::TILE : 0;
    tps = (n_tiles + p.num_splits - 1) / p.num_splits;
    t_first = split * tps;
    my_tiles = max(0, min(n_tiles, t_first + tps) - t_first);
    pt = p.page_table + (p.page_table_indptr ? (int64_t)p.page_table_indptr[b] : (int64_t)b * p.page_table_stride);
    lg = p.page_size_log2;
    ps_mask = (1 << lg) - 1;
    one_page = (1 << lg) >= Cfg::RPT;
  }
};

// The CTA's shared memory, as Config carves it: Q, (SD) P, the warps' (m, l) per row, the rows' weights and
// (M, L), the split-KV arrival flag, and the K/V ring, which the warps' merge reuses.
template <typename Cfg>
struct Smem {
  uint8_t* const q;
  uint8_t* const pt;  // SD: P's tile
  float* const ml;    // [NW][ROWS][2]
  float* const stat;  // [ROWS][NW + 2]
  int* const flag;
  uint8_t* const big;  // the ring, then the merge buffer
  float* const red;    // [SLOTS][ROWS][RED_PITCH]
  __device__ __forceinline__ explicit Smem(uint8_t* base)
      : q(base), pt(base + Cfg::Q_BYTES), ml(reinterpret_cast<float*>(base + Cfg::Q_BYTES + Cfg::P_BYTES)),
        stat(ml + NW * Cfg::ROWS * 2), flag(reinterpret_cast<int*>(stat + Cfg::ROWS * (NW + 2))),
        big(base + Cfg::BIG_OFF), red(reinterpret_cast<float*>(big)) {}
};

}  // namespace xqa
