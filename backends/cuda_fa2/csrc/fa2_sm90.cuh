// attncore cuda_fa2: Hopper (sm_90a) prefill kernel, "prefill90".
//
// Notation as in fa2_attention.cuh (packed rows r = tok * G + g, logits in base 2, LSE base 2).
//   NWG      consumer warpgroups per CTA; each owns 64 packed rows     CTA_Q = 64 * NWG
//   KVT      keys per K/V tile (the N of S = Q K^T)                    STAGES  K/V smem ring depth
//
// Per CTA: one work item (request, packed-row tile, kv range) of one kv head (blockIdx.y), the same
// work list and params struct as the FA2 kernel.  fa2_sm90_pod_kernel (at the end) runs the items of a
// prefill part and a decode part, each with its own params struct, in one grid ("pod90").
//   Q tile and K/V tiles -> smem with cp.async (KvTileCopy: page-table gather in the copy as 32-bit
//   row offsets, zero-fill past the end; the warp-specialized producer copies whole ragged K/V tiles by
//   TMA where the launcher gave it tensor maps, tma_kv_tile), in the 128-byte swizzled layout wgmma reads:
//   a [rows][D] 16-bit tile is D/64 column blocks of [rows][64 elements], 16-byte chunk c of row r
//   stored at chunk (c ^ (r % 8)) (tile bases 1024-byte aligned).
//   S = Q K^T: wgmma m64n{KVT}k16, A = Q and B = K from smem, both K-major (D/16 steps; D = head_dim_qk).
//   Online softmax in registers (exp2, scale folded, the row max moved lazily: ac::next_max; once a warp's rows have
//   a max, P from it without the tile's max, checked by the row sums: sm90_cta's softmax), mask only on
//   tiles that cross the causal diagonal or the kv end.  P is converted to 16-bit in the register-A layout.
//   O += P V: wgmma m64n{DV}k16, A = P from registers, B = V from smem, MN-major (transpose bit; DV = head_dim_vo,
//   D but for DeepSeek's 192 / 128).  A stage holds a K tile and then a V tile.
//   Epilogue straight from registers: O / l (+ sink, out_scale) and LSE, or a float partial (split).
// Not served here (plan() keeps them on the FA2 kernel): custom masks, window, soft cap, ALiBi,
// RoPE, fp8 KV, head dims other than 64 / 128 / 256 and 192 / 128 (qk / vo; the warp-specialized loops).
// Parts: fa2_sm90_wgmma.h (wgmma, fences, smem descriptors, mbarriers, TMA loads, setmaxnreg), fa2_sm90_load.cuh
// (KvTileCopy, KvTma), fa2_kernel_traits.cuh (the work item, shared with the FA2 kernel), fa2_sm90_trace.cuh (a
// clock64 timeline of the loops, built only with -DFA2_TRACE=1).
#pragma once
#include "fa2_kernel_traits.cuh"
#include "fa2_sm90_load.cuh"
#include "fa2_sm90_trace.cuh"
#include "fa2_sm90_wgmma.h"

#ifndef FA2_H_OSMEM
#define FA2_H_OSMEM 1  // 0: every epilogue from registers (Cfg90::OSMEM)
#endif
#ifndef FA2_H_LEAN
#define FA2_H_LEAN 1  // 0: the paged producer's plain copies in every loop (Cfg90::LEAN)
#endif
#ifndef FA2_H_OTILE
#define FA2_H_OTILE 1  // 0: the persistent SEPKV grid's epilogue from registers (Cfg90::OTILE)
#endif
#ifndef FA2_H_UWG
#define FA2_H_UWG -1  // Cfg90::UWG: 1 / 0 forced, -1 the rule (d64, the persistent d128 grid)
#endif
#ifndef FA2_H_OZERO
#define FA2_H_OZERO 1  // 0: O rescaled on a unit's first tile too (sm90_cta's rescale)
#endif
#ifndef FA2_H_QLEAN
#define FA2_H_QLEAN 1  // 0: every Q tile by the general copy (sm90_cta's copy_q)
#endif
#ifndef FA2_H_FASTP
#define FA2_H_FASTP 1  // 0: every tile's softmax waits for the tile's row max (sm90_cta's softmax)
#endif

namespace fa2 {
namespace sm90 {

// D: Q and K's head dim (head_dim_qk), DV: V and O's (head_dim_vo; 128 under D = 192, DeepSeek's prefill shape)
template <int D_, int KVT_, int NWG_, int STAGES_, bool PIPE_, bool WS_ = false, int PREG_ = 56, bool SEPKV_ = false,
          bool PERSIST_ = false, int DV_ = D_>
struct Cfg90 {
  static constexpr int D = D_, DV = DV_, KVT = KVT_, NWG = NWG_, STAGES = STAGES_;
  // D != DV: the warp-specialized ring only (the copies of a thread without a producer assume one row shape)
  static_assert(DV == D || (WS_ && DV % 64 == 0 && DV < D), "head_dim_vo below head_dim_qk: warp-specialized");
  static constexpr bool PIPE = PIPE_;  // software-pipelined loop (S of the next tile overlaps softmax)
  // WS: warp-specialized, one producer warpgroup (warpgroup 0, PREG registers) issues every copy
  // (Q, K/V page gather) and hands stages over with mbarriers; the NWG consumer warpgroups only compute.
  static constexpr bool WS = WS_;
  static constexpr int PREG = PREG_;
  // PP: the pipelined warp-specialized loop takes turns at the tensor cores (FlashAttention-3's ping-pong):
  // a consumer warpgroup issues S of its next tile and P V of its current one, then hands the turn to the
  // other, whose GEMMs then queue behind; each softmax runs while the other warpgroup's GEMMs execute.
  // Measured on H100 (2026-11-25, session 18) with the producer's early arrival: P1 non-causal 0.476 ms
  // against 0.478 without turns and 0.519 for the plain loop; P1 causal 0.276 / 0.284 / 0.295.
  static constexpr bool PP = WS && PIPE && NWG == 2;
  // FASTP: the softmax's fast path (sm90_cta's softmax), where the consumers have the registers for its redo (without
  // a producer the pipelined d128 loop spills 40 bytes with it, d64's persistent 192-key tiles 4, d256 40)
  static constexpr bool FASTP = FA2_H_FASTP && WS && KVT <= 128 && DV <= 128;
  // WS: the producer arrives on a stage's `full` barrier as soon as its copies land (cp.async.mbarrier.arrive), not
  // after waiting for them a tile later.  The pipelined loop needs it (it holds two of three stages); so does a
  // two-stage ring (d256's plain loop), where a waited arrival would hold tile t behind the producer's wait for
  // tile t + 1's stage.  The three-stage plain loop keeps the waited arrival (the early one spills there).
  static constexpr bool EARLY_ARRIVE = WS && (PIPE || STAGES_ < 3);
  // SEPKV (WS; fa2_attention.cu's FA2_H_SEPKV turns it on for two stages: d256, whose 64 KiB Q tile leaves room for
  // two stages of 80 keys): K and V of a stage are handed over on their own barriers, K freed once S is computed,
  // V once P V is, as FlashAttention-3 does.  The pipelined loop holds K of tile j + 1 and V of tile j at once: with
  // one barrier per stage a two-stage ring would leave the producer nothing to copy meanwhile.
  static constexpr bool SEPKV = SEPKV_;
  static_assert(!SEPKV || (WS && EARLY_ARRIVE), "SEPKV: the warp-specialized ring, early arrivals");
  static_assert(!(WS && PIPE) || STAGES >= 3 || SEPKV, "the pipelined loop holds two stages");
  // PERSIST (WS): one CTA per resident slot runs work units u = (kv head u / items, item u % items), the launch
  // order of the one-unit grid (the CTAs running at once read the K/V tiles of one head: L2 reuse).  CTA c starts
  // with unit c and then takes the next unit not yet taken (an atomic counter, as the hardware hands out the CTAs
  // of a grid: a static share per CTA left 12% of P1 causal in one CTA's tail).  The K/V ring and its barriers
  // run on across units, so the producer copies the next unit's tiles (and, once the consumers have run the last
  // S of a unit, its Q) while the consumers finish the current one.
  static constexpr bool PERSIST = PERSIST_;
  static_assert(!PERSIST || WS, "PERSIST: the warp-specialized ring");
  // QLATE (the persistent pipelined loop): the producer copies a unit's Q after the K and V of its first tile, not
  // before, so that those are in flight while it waits for the previous unit's last S to free the Q tile.  H200
  // 2026-11-29, same run: P2 d64 0.181 ms against 0.191 with Q first (one unit per CTA: 0.186); in the plain loop
  // (P3 0.729 against 0.715, P4 1.177 against 1.149) and the one-unit grids (P1 0.292 against 0.278) it lost.
  static constexpr bool QLATE = PERSIST && PIPE;
  // LEAN: the paged producer's lean copies (fa2_sm90_load.cuh's KvTileCopy) in the plain loop and in the pipelined
  // loop at d128 on the one-unit grid, which the plan gives paged K/V at d128 (CudaFa2Backend.sm90_pipe), and at
  // d192 / 128 (0 spills; paged K/V takes the plain loop there: H200 2026-11-30, same run, 5 rounds, plain /
  // pipelined: 8 x 2k causal page 16 0.700 / 0.728 ms, page 1 0.702 / 0.733, 16 x 512 on 4k 1.263 / 1.295, 4 x 4k
  // non-causal 2.419 / 2.353).  Not in the persistent pipelined loop (its producer spills with them, 84 / 104 bytes
  // at d128; paged K/V never takes it) nor in d256's (paged K/V takes the plain loop there; its build is left as
  // measured).
  static constexpr bool LEAN = FA2_H_LEAN && (!PIPE || ((D == 128 || DV != D) && !PERSIST));
  // HANDOVER (the persistent ping-pong loop): warpgroup 1 hands the turn to warpgroup 0 at its last P V of a unit, as
  // at every other turn, and not at its start of the next unit (after its epilogue): warpgroup 0's first S of the next
  // unit no longer waits for warpgroup 1's epilogue.  H200 2026-11-30, same run, 9 rounds (with / without): 16k x 1k
  // 0.518 / 0.526 ms; P1 non-causal, P1 causal and ragged 8 x 2k level; P2 d64 level (7 rounds, 0.1640 / 0.1643).
  // The turn it opens when no unit follows is never taken (a named barrier's phase left open at exit).
  static constexpr bool HANDOVER = PP && PERSIST;
  // UWG: the consumer warpgroup's index broadcast from lane 0, so that ptxas knows it is warp-uniform and keeps the
  // Q operand's wgmma descriptors in uniform registers (4 instructions per k-step of S instead of 7).  On at d64,
  // where it removes the pipelined loop's 60 bytes of spills; at d128 the producer spills 10 more instructions.
  // H200 2026-11-29, same run: P2 d64 0.176 ms against 0.186; d128 P1 non-causal 0.500 against 0.482, P4 1.137
  // against 1.099 (P1 causal 0.270 against 0.277); d256 0.290 against 0.289.
  // Since session 45's lean Q copy no build spills with it (d128, d192 / 128, d256, pod90), and the persistent d128
  // tile drops from 746 to 697 instructions (R2UR 48 -> 0), the one-unit one's from 672 to 634.  H200 2026-11-30,
  // same run, sustained windows: on for the persistent d128 grid, ragged 8 x 2k 0.5458 ms against 0.5551, 16 x 1k
  // 0.3274 / 0.3297; the one-unit grid left as is (P1 causal 0.2498 / 0.2514, non-causal 0.4574 / 0.4552).
  // FA2_H_UWG=1 / 0 forces it on / off (-1: this rule).
  static constexpr bool UWG = FA2_H_UWG < 0 ? D == 64 || (D == 128 && PERSIST) : FA2_H_UWG != 0;
  // OSMEM: the final epilogue's 16-bit O goes out through shared memory (sm90_cta's epilogue_staged): the one-unit
  // grid stages it in the warpgroup's own rows of the Q tile (its S are done; nothing copies Q again), the persistent
  // grid in the K tile of the unit's last stage (free once every S of the unit has run, bar_qempty), whose release
  // to the producer then follows the epilogue.  SEPKV frees K after each S (OTILE below), and d256's K tile is too
  // small: off there.
  // The register epilogue's quad transposes (shuffles and selects) go: 354 instructions from the last P V to the exit
  // at d128 against 433.  H200 2026-11-30, same run, 9 rounds, against FA2_H_OSMEM=0: P1 non-causal 0.435 ms against
  // 0.445, causal 0.238 / 0.241, P3 page 16 0.605 / 0.617, page 1 0.606 / 0.625, P2 d64 and P4 level; with the paged
  // copies' full-tile path (fa2_sm90_load.cuh) in both, 11 rounds: P3 page 16 0.599 / 0.605, paged d64 and P4 level.
  static constexpr bool OSMEM = FA2_H_OSMEM && (!PERSIST || (!SEPKV && KVT >= 128));
  static constexpr int CTA_Q = 64 * NWG, NTHREADS = 128 * (NWG + (WS ? 1 : 0));
  // setmaxnreg moves registers within what the CTA got at launch (the 1-CTA cap, 168 for 384
  // threads): an increase beyond that pool never returns (a hang), so the consumers get the rest.
  static constexpr int LAUNCH_REG = (65536 / NTHREADS) / 8 * 8;
  static constexpr int CREG_ = ((LAUNCH_REG * NTHREADS - 128 * PREG) / (128 * NWG)) / 8 * 8;
  static constexpr int CREG = CREG_ > 240 ? 240 : CREG_;
  static_assert(!WS || 128 * PREG + 128 * NWG * CREG <= LAUNCH_REG * NTHREADS, "setmaxnreg pool");
  static constexpr int q_bytes = CTA_Q * D * 2;
  static constexpr int k_bytes = KVT * D * 2, v_bytes = KVT * DV * 2;  // a K tile, a V tile (after it in a stage)
  static constexpr int stage_bytes = k_bytes + v_bytes;
  // OTILE: the persistent grid with K and V on their own barriers (d128's _persist) frees K after each S, so OSMEM's
  // staging in the last stage's K tile is out there: it stages the epilogue in an output tile of its own after the
  // ring where that fits (d128: 32 KiB beside Q's 32 and the ring's 128), a warpgroup's 64 rows at o_off + wg x
  // 64 x DV x 2, each warp reading back only its own 16 rows (no barrier; a unit's stores do not wait for the
  // next unit's).  The register epilogue it replaces took 378 instructions a warp per unit (H200 ncu, ragged 16 x 1k
  // causal: 10% of the kernel's).
  // WS extras after the ring (and the output tile): full[STAGES], empty[STAGES] mbarriers (SEPKV: those of K, then
  // V's full and empty); PERSIST: then the Q tile's `empty` barrier, the next-unit ring (full[2], empty[2]) and,
  // 16-byte aligned, its two slots of UNIT_INTS ints (sm90_cta's publish / take).  Sized before they are placed (they
  // start 16-byte aligned), so that OTILE can ask whether the output tile fits in front of them.
  static constexpr int UNIT_INTS = 16;
  static constexpr int bars_bytes = 16 * STAGES * (SEPKV ? 2 : 1);
  static constexpr int slot_rel = (bars_bytes + 40 + 15) / 16 * 16;  // the slots, from bar_off
  static constexpr int ws_bytes = WS ? (PERSIST ? slot_rel + 2 * 4 * UNIT_INTS : bars_bytes) : 0;
  static constexpr int o_off = q_bytes + STAGES * stage_bytes, o_bytes = CTA_Q * DV * 2;
  static constexpr bool OTILE =
      FA2_H_OSMEM && FA2_H_OTILE && PERSIST && SEPKV && o_off + o_bytes + ws_bytes + 1024 <= 227 * 1024;
  static constexpr int bar_off = o_off + (OTILE ? o_bytes : 0), slot_off = bar_off + slot_rel;
  static_assert(bar_off % 16 == 0, "the barriers and slots 16-byte aligned");
  static constexpr int smem_bytes = bar_off + ws_bytes + 1024;  // + alignment slack
  static_assert(smem_bytes <= 227 * 1024, "sm_90 shared memory per block");
};

// the launch's work items (CUDA-graph mode: the live count, read on the device)
__device__ __forceinline__ unsigned live_items(const Fa2Params& p) {
  return (unsigned)(p.work_count != nullptr ? __ldg(p.work_count) : p.num_work);
}
// PERSIST: the units handed out before the counter's (the first round: one per CTA of the first launch), and the
// CTAs sharing the counters (Fa2Params.sched_ctas: a second launch takes over leftover units)
__device__ __forceinline__ unsigned sched_first(const Fa2Params& p) {
  return p.sched_ctas ? (unsigned)p.sched_base : gridDim.x;
}
// PERSIST, one thread per CTA once it has no unit left: the last CTA of the launch(es) zeroes the counters for the
// next (every CTA has taken its last unit by then)
__device__ __forceinline__ void sched_done(const Fa2Params& p) {
  if (atomicAdd(p.sched + 1, 1) == (p.sched_ctas ? p.sched_ctas : (int)gridDim.x) - 1) {
    atomicExch(p.sched, 0);
    atomicExch(p.sched + 1, 0);
  }
}

// a[0] = max(a[0 .. N-1]) and b[0] likewise, as trees of depth ceil(log2 N), the two side by side
template <int N, int M>
__device__ __forceinline__ void max_fold(float (&a)[M], float (&b)[M]) {
  if constexpr (N > 1) {
    constexpr int H = (N + 1) / 2;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      a[j] = fmaxf(a[j], a[j + H]);
      b[j] = fmaxf(b[j], b[j + H]);
    }
    max_fold<H>(a, b);
  }
}

// One CTA of work item `item` of `p` (kv head `kvh0`; PERSIST: unit `item`, its kv head item / items): the whole
// kernel body, so that the POD kernel below can run the items of two params structs (two loop variants) in one grid.
// KVSPLIT (the POD kernel's decode part: warp-specialized, plain loop, two consumer warpgroups): an item whose
// rows all lie in the first 64 (a decode request's G rows) is computed by both consumer warpgroups on those same
// rows, each on every other K/V tile, and the two partial softmax states are merged through shared memory at the
// end.  The second warpgroup's rows would otherwise be empty: this doubles the tensor-core and softmax rate per
// K/V tile of a bandwidth-bound item, so that it can draw more than its SM's share of the read bandwidth while
// prefill tiles compute on the other SMs.
template <typename Cfg, typename T, int MASK, bool KVSPLIT = false>
__device__ __forceinline__ void sm90_cta(const Fa2Params& p, const unsigned item, const int kvh0,
                                         const KvTma* tma = nullptr) {
  constexpr int D = Cfg::D, DV = Cfg::DV, KVT = Cfg::KVT, CTA_Q = Cfg::CTA_Q, STAGES = Cfg::STAGES;
  constexpr int NT = 128 * Cfg::NWG;  // compute threads
  constexpr int CPR = D / 8;          // 16-byte chunks per row of Q and K
  constexpr int NS = KVT / 2;         // S accumulators per thread (KVT/8 n8 blocks x 4)
  constexpr int NO = DV / 2;          // O accumulators per thread
  static_assert(Cfg::WS || (NT % CPR == 0 && KVT % (NT / CPR) == 0), "tile copy shape");
  constexpr int RSTEP = NT / CPR;     // rows between a thread's successive chunks
  constexpr int LROWS = KVT / RSTEP;  // chunks per thread per K (or V) tile

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  const uint32_t sQa = raw + pad;                      // smem addresses
  const uint32_t sKVa = sQa + Cfg::q_bytes;

  const int tid = threadIdx.x, lane = tid & 31, wq = (tid >> 5) & 3;
  // consumer warpgroup (-1: the WS producer)
  const int wg = (Cfg::UWG ? __shfl_sync(0xffffffffu, tid >> 7, 0) : (tid >> 7)) - (Cfg::WS ? 1 : 0);
#ifdef FA2_TRACE
  const int tslot = trace_slot();
#endif
  const int G = p.group;

  // The work unit: item `item` of kv head kvh0.  PERSIST: unit `item` first, then each unit take() moves the CTA on
  // to (Cfg90::PERSIST).
  const unsigned items = Cfg::PERSIST ? live_items(p) : 0u, units = items * p.num_kv_heads;
  int kvh = Cfg::PERSIST ? (int)(item / items) : kvh0;
  WorkItem<CTA_Q, KVT, MASK> w(p, Cfg::PERSIST ? item % items : item, G, -1);  // no sliding window here
  const int &req = w.req, &row0 = w.row0, &slot = w.slot, &qo_start = w.qo_start;
  const int &delta = w.delta, &rows_here = w.rows_here, &tok_lo = w.tok_lo;
  const int &kv_lo = w.kv_lo, &kv_hi = w.kv_hi, &n_tiles = w.n_tiles;
  static_assert(!KVSPLIT || (Cfg::WS && !Cfg::PIPE && !Cfg::SEPKV && Cfg::NWG == 2 && !Cfg::PERSIST),
                "KVSPLIT: the warp-specialized plain loop (one barrier per stage), 2 WGs, one item");
  const bool split = KVSPLIT && rows_here <= 64;
  const int wrow = split ? 0 : wg * 64;  // this consumer warpgroup's first local row
  const bool idle = split && wq * 16 >= rows_here;  // KVSPLIT: this warp holds no live row

  const T* qg = reinterpret_cast<const T*>(p.q);
  const uint8_t* kg = reinterpret_cast<const uint8_t*>(p.k);
  const uint8_t* vg = reinterpret_cast<const uint8_t*>(p.v);
  // ---- the unit's request base and, per thread, the tokens of rows h2 = 0 / 1 (local rows wg*64 + wq*16 + lane/4
  // (+ 8))
  int kv_base = kv_base_of(p, req), row_tok[2];
  auto unit_rows = [&]() {
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) row_tok[h2] = (row0 + wrow + wq * 16 + (lane >> 2) + h2 * 8) / G;
  };
  unit_rows();
  // PERSIST: the next unit, handed over in a shared-memory slot: its work item, kv head, request base and id, which
  // producer thread 0 reads from global memory once (publish) and every thread then takes from the slot (take:
  // false once no unit is left), so that the consumers' unit boundary waits on no global load
  using Item = WorkItem<CTA_Q, KVT, MASK>;
  static_assert(sizeof(Item) + 3 * 4 <= 4 * Cfg::UNIT_INTS, "a unit's slot");
  // (The slot moves as whole ints: a memcpy between shared memory and the item, whose alignment it cannot see, went
  // byte by byte, ~40 LDS.U8 and 20 PRMT a thread per unit: H200 ncu, session 45.  As 16-byte words through a
  // register array it spilled 44-52 bytes.)
  auto publish = [&](int sl, unsigned u) {
    if constexpr (Cfg::PERSIST) {  // (the one-unit build has no unit arithmetic: items is 0 there)
      int* d = reinterpret_cast<int*>(smem + Cfg::slot_off) + Cfg::UNIT_INTS * sl;
      if (u < units) {
        const Item wi(p, u % items, G, -1);
        *reinterpret_cast<Item*>(d) = wi;
        d[Cfg::UNIT_INTS - 3] = (int)(u / items);
        d[Cfg::UNIT_INTS - 2] = kv_base_of(p, wi.req);
      }
      d[Cfg::UNIT_INTS - 1] = (int)u;
    }
  };
  auto take = [&](int sl) {
    if constexpr (Cfg::PERSIST) {
      const int* d = reinterpret_cast<const int*>(smem + Cfg::slot_off) + Cfg::UNIT_INTS * sl;
      const unsigned u = (unsigned)d[Cfg::UNIT_INTS - 1];
      if (u >= units) return false;
      w = *reinterpret_cast<const Item*>(d);
      kvh = d[Cfg::UNIT_INTS - 3];
      kv_base = d[Cfg::UNIT_INTS - 2];
      unit_rows();
      return true;
    } else {
      return false;
    }
  };

  float o[NO], s[NS];
  bool o_zero = true;  // no P V in o yet (this unit's): rescale skips it
#pragma unroll
  for (int i = 0; i < NO; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < NS; ++i) s[i] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  const float sc = p.scale_log2;

  const uint32_t qbase = sQa + wrow * 128;  // this warpgroup's 64 rows in each column block
  // S = Q K^T for the K tile in `stage` (issued, not waited)
  auto issue_s = [&](int stage) {
    const uint32_t kbase = sKVa + stage * Cfg::stage_bytes;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // Q column blocks are CTA_Q rows tall; this warpgroup's rows start 64 * wg rows in
      mma_ss<T, KVT>(s, desc_k<CTA_Q>(qbase, kk), desc_k<KVT>(kbase, kk), kk > 0);
    }
  };
  // O += P V for the V tile in `stage` (issued, not waited)
  uint32_t a[KVT / 16][4];
  auto issue_pv = [&](int stage) {
    const uint32_t vbase = sKVa + stage * Cfg::stage_bytes + Cfg::k_bytes;
#pragma unroll
    for (int kk = 0; kk < KVT / 16; ++kk) mma_rs_t<T, DV>(o, a[kk], desc_mn<KVT>(vbase, kk));
    o_zero = false;
  };
  // the mask of tile `tile` on s (boundary tiles only)
  auto mask_s = [&](int tile) {
    const int t0 = kv_lo + tile * KVT;
    const int tile_end = t0 + KVT;
    bool need_mask = tile_end > kv_hi;
    if (MASK == kMaskCausal) need_mask |= (tile_end - 1 > tok_lo + delta);
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < KVT / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kv = t0 + j * 8 + 2 * (lane & 3) + (e & 1);
          bool keep = kv < kv_hi;
          if (MASK == kMaskCausal) keep &= kv <= row_tok[e >> 1] + delta;
          if (!keep) s[j * 4 + e] = kNegInf;
        }
    }
  };
  // row h2's p = exp2(s * sc - mu) in place; returns this thread's sum of them
  auto exp_row = [&](int h2, float mu) {
    float rs = 0.f;
#pragma unroll
    for (int j = 0; j < KVT / 8; ++j) {
      const float p0 = ac::ex2(fmaf(s[j * 4 + 2 * h2], sc, -mu)), p1 = ac::ex2(fmaf(s[j * 4 + 2 * h2 + 1], sc, -mu));
      s[j * 4 + 2 * h2] = p0;
      s[j * 4 + 2 * h2 + 1] = p1;
      rs += p0 + p1;
    }
    return rs;
  };
  // the online softmax of a masked S tile in s, in place (s becomes exp2(s * sc - m), fp32), the row max first
  float alpha[2];
  bool moved = false;
  auto exact_softmax = [&]() {
    moved = false;
    // the two rows' maxima as trees (depth log2(KVT / 4), both rows side by side), not one chain of KVT / 8 dependent
    // max per row: the chain's latency sat in front of every exp2 (max is exact: the same bits)
    float mx2[2];
    {
      float v[2][KVT / 8];
#pragma unroll
      for (int j = 0; j < KVT / 8; ++j)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) v[h2][j] = fmaxf(s[j * 4 + 2 * h2], s[j * 4 + 2 * h2 + 1]);
      max_fold<KVT / 8>(v[0], v[1]);
      mx2[0] = ac::quad_max(v[0][0]);
      mx2[1] = ac::quad_max(v[1][0]);
    }
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const float mnew = ac::next_max(m[h2], mx2[h2] * sc);
      const float mu = mnew == kNegInf ? 0.f : mnew;
      alpha[h2] = ac::ex2(m[h2] - mu);
      moved |= mnew != m[h2];
      m[h2] = mnew;
      l[h2] = l[h2] * alpha[h2] + exp_row(h2, mu);
    }
  };
  // S of this warp's 16 rows again, by mma.sync from the Q tile and the K tile at `kbase` in shared memory (the fast
  // path below has overwritten wgmma's S with P).  ldmatrix reads the 128-byte swizzle wgmma reads, and the m16n8 C
  // fragments of each 8 keys are wgmma's accumulator layout, so s comes back as issue_s left it.
  auto redo_s = [&](uint32_t kbase) {
#pragma unroll
    for (int i = 0; i < NS; ++i) s[i] = 0.f;
#pragma unroll 1  // (a rare path: kept short)
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[4];
      ac::ldsm_x4(qa, sQa + sw128<CTA_Q>(wrow + wq * 16 + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
      for (int n = 0; n < KVT / 16; ++n) {
        uint32_t kb[4];
        ac::ldsm_x4(kb, kbase + sw128<KVT>(16 * n + (lane & 7) + ((lane >> 4) << 3), 2 * kk + ((lane >> 3) & 1)));
        ac::mma16816<T>(*reinterpret_cast<float(*)[4]>(&s[8 * n]), qa, kb[0], kb[1]);
        ac::mma16816<T>(*reinterpret_cast<float(*)[4]>(&s[8 * n + 4]), qa, kb[2], kb[3]);
      }
    }
  };
  // mask + online softmax of tile `tile` in s.  `kbase`: the tile's K in shared memory, 0 where it (or the Q tile)
  // may be handed back by now: then the exact path.  The fast path (Cfg90::FASTP), once every row of the warp has a
  // finite max: P from the row's running max, without the tile's max, and l += the row sums.  A thread's row sum at or
  // below kMaxP proves each of its p <= kMaxP (p >= 0), the bound next_max keeps, so m need not move; where a sum
  // exceeds it (or is inf), the warp computes S again and takes the exact path.  Against FA2_H_FASTP=0, H200
  // 2026-12-01, same run, sustained windows: P1 non-causal 0.419 / 0.456 ms, causal 0.234 / 0.254, P3 page 16
  // 0.608 / 0.626, P4 level (1.008 / 1.012): under the board's power cap the tile's max cost more than its share of
  // instructions (its tree and shuffles stood in front of every exponential).
  bool fast_ok = false;  // warp-uniform: every row of the warp has a finite m
  auto softmax = [&](int tile, uint32_t kbase) {
    if constexpr (KVSPLIT) {
      if (idle) {  // a warp without a live row (a decode item's G rows in the first warp): no softmax, P = 0 (pack)
        moved = false;
        return;
      }
    }
    mask_s(tile);
    if (Cfg::FASTP && fast_ok && kbase != 0u) {
      float rs[2];
      bool over = false;
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        rs[h2] = exp_row(h2, m[h2]);
        over |= rs[h2] > ac::kMaxP;  // (a NaN row stays here: its NaN reaches l, as on the exact path)
      }
      if (!__any_sync(0xffffffffu, over)) {
        l[0] += rs[0];
        l[1] += rs[1];
        moved = false;
        return;
      }
      redo_s(kbase);
      mask_s(tile);
    }
    exact_softmax();
    if (Cfg::FASTP) fast_ok = __all_sync(0xffffffffu, m[0] != kNegInf && m[1] != kNegInf);
  };
  // O *= alpha (only when some row max of the warp moved, and never before a unit's first P V: O is zero then, and
  // every unit's first tile moved the max from -inf, so that the rescale ran there and almost nowhere else: 64 FMUL a
  // thread per unit, H200 ncu on ragged 16 x 1k causal, session 45).  With the whole-int slot copy and mbar_wait's
  // suspend hint, against FA2_H_OZERO=0,FA2_SM90_WAIT_NS=0, H200 2026-11-30, same run, sustained windows: ragged 8 x 2k
  // 0.5551 / 0.5588 ms, 16 x 1k 0.3297 / 0.3320, P1 causal 0.2514 / 0.2522, non-causal 0.4552 / 0.4562.
  auto rescale = [&]() {
    if (!(FA2_H_OZERO && o_zero) && __any_sync(0xffffffff, moved)) {
#pragma unroll
      for (int j = 0; j < DV / 8; ++j) {
        o[j * 4 + 0] *= alpha[0];
        o[j * 4 + 1] *= alpha[0];
        o[j * 4 + 2] *= alpha[1];
        o[j * 4 + 3] *= alpha[1];
      }
    }
  };
  // P (s) -> 16-bit register-A fragments
  auto pack = [&]() {
    if constexpr (KVSPLIT) {
      if (idle) {
#pragma unroll
        for (int kk = 0; kk < KVT / 16; ++kk) a[kk][0] = a[kk][1] = a[kk][2] = a[kk][3] = 0u;
        return;
      }
    }
#pragma unroll
    for (int kk = 0; kk < KVT / 16; ++kk) {
      a[kk][0] = ac::pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      a[kk][1] = ac::pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      a[kk][2] = ac::pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      a[kk][3] = ac::pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  auto rescale_pack = [&]() {
    rescale();
    pack();
  };

  // The tensor-core steps both loop variants (warp-specialized or not) share; they differ only in
  // how a stage is known to be full and handed back.
  // Ping-pong turns (Cfg::PP): warpgroup w waits on named barrier 1 + w before its GEMMs and arrives on
  // the other's after issuing them.  Turns: S of tile 0, then one per pipe_step, then P V of the last tile
  // (turn n_tiles); warpgroup 1 opens turn 0 for warpgroup 0 and skips its last hand-over, so that every
  // barrier phase completes (both warpgroups of a CTA run the same n_tiles).  Cfg::HANDOVER (the persistent grid):
  // warpgroup 1 opens turn 0 of the CTA's first unit with keys only, and its last hand-over of a unit opens the next's.
  auto turn_begin = [&]() {
    if constexpr (Cfg::PP) named_sync(1 + wg, 256);
  };
  auto turn_end = [&](int turn) {
    if constexpr (Cfg::PP) {
      if (wg == 0 || turn < n_tiles || Cfg::HANDOVER) named_arrive(2 - wg, 256);
    }
  };
  // PERSIST: every S of the unit has run (the consumers, each once per unit with keys): the producer may copy the
  // next unit's Q tile
  const uint32_t bar_qempty = sQa + Cfg::bar_off + 16 * STAGES * (Cfg::SEPKV ? 2 : 1);
  auto release_q = [&]() {
    if constexpr (Cfg::PERSIST) mbar_arrive(bar_qempty);
  };
  // S of `stage` alone, waited (the plain loop's first half, the pipelined loop's first tile)
  auto s_step = [&](int stage) {
    reg_fence<NS>(s);
    turn_begin();
    wg_fence();
    issue_s(stage);
    wg_commit();
    turn_end(0);
    wg_wait<0>();
    reg_fence<NS>(s);
  };
  // O += P V of `stage` alone, waited (the plain loop's second half, the pipelined loop's last tile)
  auto pv_step = [&](int stage) {
    reg_fence<NO>(o);
    turn_begin();
    wg_fence();
    issue_pv(stage);
    wg_commit();
    turn_end(n_tiles);
    wg_wait<0>();
    reg_fence<NO>(o);
  };
  // pipelined: S of tile `nx` and O += P V of tile `cur` on the tensor cores while the softmax of
  // `nx` runs (P of `cur` already packed; `early`: O rescaled for `cur` here, between the two issues,
  // not after the P V wait; H100 2026-11-25: P1 causal -2%, P2 d64 -3%); returns with both waited.  `base`: the
  // CTA's count of tiles before this unit's (PERSIST), which places the unit's tiles in the ring
  auto pipe_step = [&](int cur, int nx, bool early, int base = 0) {
    reg_fence<NS>(s);
    reg_fence<NO>(o);
    turn_begin();
    FA2_TR(base + nx, 7);
    wg_fence();
    issue_s((base + nx) % STAGES);
    wg_commit();
    if (early) rescale();  // O *= alpha of `cur` while S executes (the issue below waits for it anyway)
    wg_fence();
    issue_pv((base + cur) % STAGES);
    wg_commit();
    turn_end(nx);
    FA2_TR(base + nx, 6);
    wg_wait<1>();
    reg_fence<NS>(s);
    if (nx == n_tiles - 1) release_q();  // the unit's last S has run
    FA2_TR(base + nx, 2);
    // (ptxas 13.0 schedules this wait, and the stage's release after it, before the softmax: the stage goes back to the
    // producer a softmax earlier.  Kept to the source order by a clock read, the softmax overlaps this P V but P2 d64
    // took 8% longer: bench/cuda_fa2.md, session 31)
    // (PERSIST: the unit's last tile takes the exact path, its Q tile handed back above)
    softmax(nx, Cfg::PERSIST && nx == n_tiles - 1 ? 0u : sKVa + ((base + nx) % STAGES) * Cfg::stage_bytes);
    FA2_TR(base + nx, 3);
    wg_wait<0>();
    reg_fence<NO>(o);
    FA2_TR(base + nx, 5);
  };

  // ---- epilogue.  A row's scale (1 / l, + sink, out_scale), LSE, token and head first (h2: this thread's rows lane / 4
  // + 8 h2 of its warp; row_tok[h2] is pr / G: unit_rows() divided once per unit.  L >= 1 where a key was seen, the
  // largest term being 2^0: a fast log2 and division are exact enough, and a NaN still goes through both)
  struct OutRow {
    float scale, lse;
    int tok, h;
    bool live;  // (a quad's lanes share their row: the transpose's shuffles run in every lane)
  };
  auto out_row = [&](int h2, bool final_out) {
    OutRow r;
    float L = ac::quad_sum(l[h2]);
    const int lr = wrow + wq * 16 + (lane >> 2) + h2 * 8;
    r.live = lr < rows_here;
    r.tok = row_tok[h2];
    r.h = kvh * G + (row0 + lr - r.tok * G);
    float Mu = m[h2] == kNegInf ? 0.f : m[h2];  // (fold_sink updates L and Mu)
    r.lse = kNegInf;
    r.scale = 0.f;
    if (L != 0.f) {  // 0: no key; NaN (a NaN query row) must reach out and LSE (fa2_attention.cuh)
      float f = 1.f;
      if (final_out && r.live && p.sinks != nullptr) f = fold_sink(L, Mu, p.sinks[r.h] * kLog2e);
      r.lse = Mu + ac::lg2(L);
      r.scale = __fdividef((final_out ? p.out_scale : 1.f) * f, L);
    }
    return r;
  };
  auto out_ptr = [&](const OutRow& r) {
    return reinterpret_cast<T*>(p.o) + (int64_t)(qo_start + r.tok) * p.o_stride_n + (int64_t)r.h * p.o_stride_h;
  };
  auto store_lse = [&](const OutRow& r) {
    if (r.live && (lane & 3) == 0 && p.lse != nullptr)
      p.lse[(int64_t)(qo_start + r.tok) * p.num_qo_heads + r.h] = r.lse;
  };
  // Staged (Cfg90::OSMEM): the warp's 16 rows of 16-bit O go to shared memory by stmatrix, straight from the
  // accumulator layout, into a 128B-swizzled tile (this warpgroup's row 0 at ob; column blocks OCB bytes apart: 64
  // rows of the last stage's K tile on the persistent grid, the Q tile's CTA_Q rows otherwise), and come back as
  // 16-byte chunks of whole rows: no shuffles.  Pass k: a lane reads chunk 4 (k ^ b) + lane % 4 of its two rows, b the
  // row's parity (the two rows of a quarter-warp then fall in different banks), so every address is one of two
  // registers plus an immediate.
  constexpr uint32_t OCB = Cfg::PERSIST ? 64 * 128 : CTA_Q * 128;
  auto epilogue_staged = [&](uint32_t ob) {
    const OutRow rw[2] = {out_row(0, true), out_row(1, true)};
    {
      const int sr = lane & 15;  // the row this lane addresses (lanes 16-31: the odd column block's matrices)
      const uint32_t srow = ob + (wq * 16 + sr) * 128;
      const int sx = ((lane >> 4) ^ sr) & 7;
#pragma unroll
      for (int j = 0; j < DV / 16; ++j) {  // n8 blocks 2 j and 2 j + 1, rows 0-7 and 8-15 of each
        uint32_t w[4];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const float* oi = o + (2 * j + b) * 4;
          w[2 * b] = ac::pack2<T>(oi[0] * rw[0].scale, oi[1] * rw[0].scale);
          w[2 * b + 1] = ac::pack2<T>(oi[2] * rw[1].scale, oi[3] * rw[1].scale);
        }
        stmatrix_x4(srow + (j >> 2) * OCB + ((((2 * j) & 7) ^ sx) << 4), w);
      }
    }
    __syncwarp();
    const int q = lane & 3, b = (lane >> 2) & 1;
    const uint32_t rb = ob + (wq * 16 + (lane >> 2)) * 128;       // row lane / 4; row + 8 is 1024 bytes on
    const uint32_t x0 = ((4 * b) ^ q ^ ((lane >> 2) & 7)) << 4;  // the physical chunk of even passes (odd: ^ 4)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      T* const dst = out_ptr(rw[h2]);
      T* const ge = dst + (q + 4 * b) * 8;  // pass k even: chunk 4 k + q + 4 b; odd: 4 k + q - 4 b
      T* const go = dst + (q - 4 * b) * 8;
#pragma unroll
      for (int k = 0; k < DV / 32; ++k) {
        const uint4 v = lds128(rb + h2 * 1024 + (k >> 1) * OCB + ((k & 1) ? (x0 ^ 64) : x0));
        if (rw[h2].live) stg128(((k & 1) ? go : ge) + 32 * k, v);
      }
      store_lse(rw[h2]);
    }
  };
  // From registers.  16-bit out: a quad's four lanes hold 4 bytes each of every 8-column block; a 4 x 4 transpose
  // over the quad per four blocks gives each lane one whole block, stored as 16 bytes: a quarter of the stores
  // (with one 4-byte store per pair of columns the epilogue took ~3,700 clocks per unit at d128; with these and the
  // lean row / LSE / scale ~2,600; nothing else runs on the tensor cores meanwhile: sessions 32-33's timelines)
  // RP rows per pass: at d128 both rows' scales first, then their packs, transposes and stores interleaved (two
  // independent chains; H200 2026-11-30, same run, 15 rounds: P1 non-causal 0.4467 ms against 0.4537 one row after
  // the other, P3 page 16 0.6235 / 0.6271; 9 rounds: P1 causal, P4 level); d64 one row at a time (P2 d64 0.1644
  // against 0.1667 with both), d256 likewise (not measured; its O takes 128 registers).
  constexpr int RP = DV == 128 ? 2 : 1;
  auto epilogue = [&](bool staged, uint32_t ob) {
    const bool final_out = slot < 0;
    if ((Cfg::OSMEM || Cfg::OTILE) && staged && final_out) {
      epilogue_staged(ob);
      return;
    }
  #pragma unroll
    for (int h0 = 0; h0 < 2; h0 += RP) {
      OutRow rw[RP];
  #pragma unroll
      for (int r = 0; r < RP; ++r) rw[r] = out_row(h0 + r, final_out);
      if (final_out) {
        T* dst[RP];
  #pragma unroll
        for (int r = 0; r < RP; ++r) dst[r] = out_ptr(rw[r]);
  #pragma unroll
        for (int k = 0; k < DV / 32; ++k) {
          uint32_t w[RP][4];
  #pragma unroll
          for (int r = 0; r < RP; ++r) {
            const int h2 = h0 + r;
  #pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float* oi = o + (4 * k + i) * 4 + 2 * h2;
              w[r][i] = ac::pack2<T>(oi[0] * rw[r].scale, oi[1] * rw[r].scale);
            }
          }
  #pragma unroll
          for (int r = 0; r < RP; ++r) ac::quad_transpose(w[r]);
  #pragma unroll
          for (int r = 0; r < RP; ++r)
            if (rw[r].live) stg128(dst[r] + (4 * k + (lane & 3)) * 8, make_uint4(w[r][0], w[r][1], w[r][2], w[r][3]));
        }
  #pragma unroll
        for (int r = 0; r < RP; ++r) store_lse(rw[r]);
      } else {
  #pragma unroll
        for (int r = 0; r < RP; ++r) {
          if (!rw[r].live) continue;
          const int h2 = h0 + r;
          float* dst = p.o_part + ((int64_t)(slot + rw[r].tok) * p.num_qo_heads + rw[r].h) * DV + 2 * (lane & 3);
  #pragma unroll
          for (int j = 0; j < DV / 8; ++j)
            *reinterpret_cast<float2*>(dst + j * 8) =
                make_float2(o[j * 4 + 2 * h2] * rw[r].scale, o[j * 4 + 2 * h2 + 1] * rw[r].scale);
          if ((lane & 3) == 0) p.lse_part[(int64_t)(slot + rw[r].tok) * p.num_qo_heads + rw[r].h] = rw[r].lse;
        }
      }
    }
  };

  // KVSPLIT: warpgroup 1's partial state (o, m, l per thread) -> smem -> folded into warpgroup 0's, whose
  // threads hold the same rows and columns.  Every tile was waited full by its warpgroup and computed (the
  // wgmma waited) before the first barrier, so the K/V ring is free.
  auto merge_halves = [&]() {
    float* xch = reinterpret_cast<float*>(smem + Cfg::q_bytes);
    static_assert((NO + 4) * 128 * 4 <= Cfg::STAGES * Cfg::stage_bytes, "merge buffer in the K/V ring");
    const int t = tid & 127;
    named_sync(3, 256);
    if (wg == 1) {
#pragma unroll
      for (int i = 0; i < NO; ++i) xch[i * 128 + t] = o[i];
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        xch[(NO + h2) * 128 + t] = m[h2];
        xch[(NO + 2 + h2) * 128 + t] = l[h2];
      }
    }
    named_sync(3, 256);
    if (wg == 0) {
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const float m1 = xch[(NO + h2) * 128 + t], l1 = xch[(NO + 2 + h2) * 128 + t];
        const float mn = fmaxf(m[h2], m1), mu = mn == kNegInf ? 0.f : mn;
        const float a0 = ac::ex2(m[h2] - mu), a1 = ac::ex2(m1 - mu);
        l[h2] = l[h2] * a0 + l1 * a1;
        m[h2] = mn;
#pragma unroll
        for (int j = 0; j < DV / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = j * 4 + 2 * h2 + e;
            o[i] = o[i] * a0 + xch[i * 128 + t] * a1;
          }
      }
    }
  };

  // Q tile -> smem by the QTH copying threads (the producer warpgroup, or every thread without one; rows past the
  // request zero-filled).  A thread copies chunk column tid % CPR of rows r0 + k * QRS; a step of QRS packed rows moves
  // dt tokens and dg heads (and one token more where the head wraps past G), so the addresses advance by adds: one
  // division by G per unit, not one per chunk.  (With a division and a 64-bit address per chunk the producer took
  // ~6,000-8,000 clocks to issue a unit's Q at d128, on the persistent grid's critical path: session 32's timeline.)
  // A row's CPR chunks by QC threads, QNC each 8 QC chunks apart (QC = 8, QNC = 3: d192's 24 chunks by 128 threads).
  constexpr int QTH = Cfg::WS ? 128 : NT, QC = QTH % CPR == 0 ? CPR : 8, QNC = CPR / QC, QRS = QTH / QC;
  static_assert(QTH % QC == 0 && CPR % QC == 0 && CTA_Q % QRS == 0 && QC % 8 == 0, "Q copy shape");
  auto copy_q = [&]() {
    const int c = tid % QC, r0 = tid / QC, pr0 = row0 + r0;
    int tok = pr0 / G, g = pr0 - tok * G;
    const int dt = QRS / G, dg = QRS - dt * G;
    const T* src = qg + (int64_t)(qo_start + tok) * p.q_stride_n + (int64_t)(kvh * G + g) * p.q_stride_h + c * 8;
    const int64_t step = (int64_t)dt * p.q_stride_n + (int64_t)dg * p.q_stride_h;
    // Every row in range and a pass of whole tokens (QRS % G == 0: G = 1, 2, 4, 8 at d128 / d64): one constant step
    // per pass, no predicate, no head wrap, and (QRS a multiple of 8, the swizzle's period) one constant step in
    // shared memory.  The general loop below took 25 instructions per 16-byte copy at d128 (H200 ncu, ragged 16 x 1k
    // causal: 5.4% of the kernel's instructions) and ~2,300 clocks to issue a unit's Q, on the persistent grid's
    // unit boundary (its consumers waited ~2,000 clocks for it).  (Unrolled by 2 or 4 it spills 64 bytes in the
    // persistent pipelined loop's producer.)
    if (FA2_H_QLEAN && dg == 0 && rows_here >= CTA_Q) {
      uint32_t dst = sQa + sw128<CTA_Q>(r0, c);
#pragma unroll 1
      for (int r = r0; r < CTA_Q; r += QRS) {
        const uint32_t d = QRS % 8 == 0 ? dst : sQa + sw128<CTA_Q>(r, c);
#pragma unroll
        for (int b = 0; b < QNC; ++b) ac::cp_async16(d + b * (QC / 8) * (CTA_Q * 128), src + b * QC * 8, true);
        src += step;
        dst += QRS * 128;
      }
      return;
    }
    const int64_t wrap = p.q_stride_n - (int64_t)G * p.q_stride_h;
    // (a loop: unrolled, ptxas held every row's address and spilled in the producer's 56 registers, for no gain)
#pragma unroll 1
    for (int r = r0; r < CTA_Q; r += QRS) {
      const bool ok = r < rows_here;
#pragma unroll
      for (int b = 0; b < QNC; ++b) ac::cp_async16(sQa + sw128<CTA_Q>(r, c + b * QC), (ok ? src : qg) + b * QC * 8, ok);
      src += step;
      g += dg;
      if (g >= G) {
        g -= G;
        src += wrap;
      }
    }
  };

  if constexpr (Cfg::WS) {
    // ===== warp-specialized: warpgroup 0 copies, warpgroups 1..NWG compute
    constexpr int PT = 128;  // producer threads
    // producer threads per row: a pass covers >= 8 rows (the swizzle period); 8 where 16 do not divide a K row
    constexpr int PCOLS = CPR <= 16 ? CPR : CPR % 16 == 0 ? 16 : 8;
    constexpr int PNC = CPR / PCOLS;      // chunk columns per producer thread of K (2 at d256, 16 apart; 3 at d192)
    constexpr int PNCV = DV / 8 / PCOLS;  // and of V (PNC but under head_dim_vo < head_dim_qk)
    static_assert(CPR % PCOLS == 0 && (DV / 8) % PCOLS == 0, "producer copy shape");
    constexpr int PRSTEP = PT / PCOLS;    // rows between a producer thread's chunks
    constexpr int PLROWS = KVT / PRSTEP;  // chunks per producer thread per K (or V) tile and column
    static_assert(KVT % PRSTEP == 0, "producer tile copy shape");
    // bar_full / bar_empty: the stage's (SEPKV: its K tile's); bar_full_v / bar_empty_v: SEPKV, its V tile's;
    // bar_qempty: PERSIST, the Q tile read by every S of its unit (the next unit's Q may then be copied).
    // PERSIST: producer thread 0 takes the next unit and hands it to the producer warps (named barrier 4) and to
    // the consumers through a two-slot ring (unit_full / unit_empty: the consumers free a slot once read).
    const uint32_t bar_full = sQa + Cfg::bar_off, bar_empty = bar_full + 8 * STAGES;
    const uint32_t bar_full_v = bar_empty + 8 * STAGES, bar_empty_v = bar_full_v + 8 * STAGES;
    const uint32_t unit_full = bar_qempty + 8, unit_empty = unit_full + 16;
    if (tid == 0) {
      const int consumers = 128 * (split ? 1 : Cfg::NWG);  // split: one warpgroup per tile
#pragma unroll
      for (int st = 0; st < STAGES; ++st) {
        mbar_init(bar_full + 8 * st, PT);
        mbar_init(bar_empty + 8 * st, consumers);
        if constexpr (Cfg::SEPKV) {
          mbar_init(bar_full_v + 8 * st, PT);
          mbar_init(bar_empty_v + 8 * st, consumers);
        }
      }
      if constexpr (Cfg::PERSIST) {
        mbar_init(bar_qempty, consumers);
#pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          mbar_init(unit_full + 8 * sl, 1);
          mbar_init(unit_empty + 8 * sl, consumers);
        }
      }
    }
    __syncthreads();
    // The ring runs on across a CTA's units (PERSIST): tile t of a unit is the CTA's tile it0 + t, whose stage
    // and barrier phase follow from that count; nq counts the units with tiles so far (each loads Q once).
    int it0 = 0, nq = 0, j = 0;  // j: PERSIST's next-unit handovers so far
    bool more = false;           // PERSIST: another unit taken
    if (wg < 0) {
      // ---------------- producer
      setmaxnreg_dec<Cfg::PREG>();
      const int pr0 = tid / PCOLS, pcc = tid % PCOLS;
      do {
        if (n_tiles > 0) {  // (a unit without keys: no copies, its rows are written empty)
          if constexpr (!Cfg::QLATE) {
            if (Cfg::PERSIST && nq > 0) mbar_wait(bar_qempty, (nq - 1) & 1);
            copy_q();  // joins the first K/V group
          }
          KvTileCopy<KVT, PLROWS, PRSTEP, T, PNC, PCOLS, Cfg::LEAN, PNCV> kv(
              p, reinterpret_cast<const T*>(kg), reinterpret_cast<const T*>(vg), kvh, kv_base, pr0, pcc, kv_lo, kv_hi);
          for (int tile = 0; tile < n_tiles; ++tile) {
            const int t = it0 + tile, stage = t % STAGES;
            FA2_TR(t, 0);
            if (t >= STAGES) mbar_wait(bar_empty + 8 * stage, ((t / STAGES) - 1) & 1);
            FA2_TR(t, 1);
            uint8_t* dk = smem + Cfg::q_bytes + stage * Cfg::stage_bytes;
            // page ids of this tile just before its copies: read-only-cache hits after the first tile.  Held a
            // tile ahead (by shuffles, or staged in shared memory) they were slower: the loop is bound by its
            // instruction count (bench/cuda_fa2.md, sessions 3 and 19)
            kv.prefetch(tile);
            // a tile whose keys all lie in the unit's range by TMA where the launcher encoded maps (ragged K/V): one
            // thread's few instructions instead of every producer thread's cp.async (1-3.5% on ragged prefill, H200,
            // session 33); a unit's last, partial tile by cp.async (a box would read the next request's rows, which
            // zero-fill must hide)
            const bool by_tma = tma != nullptr && kv_lo + (tile + 1) * KVT <= kv_hi;
            const uint32_t sk = sKVa + stage * Cfg::stage_bytes, sv = sk + Cfg::k_bytes;
            const int token = kv_base + kv_lo + tile * KVT;
            if (!by_tma)
              kv.template issue<Cfg::SEPKV ? 1 : 3>(tile, dk, dk + Cfg::k_bytes);  // SEPKV: K alone, V below
            else if (tid == 0)
              tma_kv_tile<Cfg, Cfg::SEPKV ? 1 : 3>(*tma, kvh, token, sk, sv, bar_full + 8 * stage);
            if (Cfg::QLATE && tile == 0) {  // the unit's Q (joins this tile's group), once the last unit's last S ran
              if (nq > 0) mbar_wait(bar_qempty, (nq - 1) & 1);
              FA2_TR(t, 5);
              copy_q();
              FA2_TR(t, 6);
            }
            ac::cp_async_commit();
            if constexpr (Cfg::EARLY_ARRIVE) {
              // the stage's (SEPKV: K's) arrival fires as soon as this thread's copies of the tile (and of Q) have
              // landed, and the producer goes on at once.  (Arriving after waiting for them, one tile late, starved
              // the pipelined loop: 650-1200 clocks per tile on H100.)
              mbar_arrive_on_copies(bar_full + 8 * stage);
            } else if (tile > 0) {  // the three-stage plain loop keeps the waited arrival (the early one spills there)
              ac::cp_async_wait<1>();  // tile - 1 (and Q) landed
              fence_async_smem();
              mbar_arrive(bar_full + 8 * ((t - 1) % STAGES));
            }
            if constexpr (Cfg::SEPKV) {  // V once its slot is free, arriving on its own barrier
              FA2_TR(t, 3);
              if (t >= STAGES) mbar_wait(bar_empty_v + 8 * stage, ((t / STAGES) - 1) & 1);
              FA2_TR(t, 4);
              if (!by_tma)
                kv.template issue<2>(tile, dk, dk + Cfg::k_bytes);
              else if (tid == 0)
                tma_kv_tile<Cfg, 2>(*tma, kvh, token, sk, sv, bar_full_v + 8 * stage);
              ac::cp_async_commit();
              mbar_arrive_on_copies(bar_full_v + 8 * stage);
            }
            FA2_TR(t, 2);
          }
          if constexpr (!Cfg::EARLY_ARRIVE) {
            ac::cp_async_wait<0>();
            fence_async_smem();
            mbar_arrive(bar_full + 8 * ((it0 + n_tiles - 1) % STAGES));
          }
          it0 += n_tiles;
          ++nq;
        }
        if constexpr (!Cfg::PERSIST) break;
        const int sl = j & 1;
        if (tid == 0) {
          if (j >= 2) mbar_wait(unit_empty + 8 * sl, ((j >> 1) - 1) & 1);
          const unsigned nu = sched_first(p) + (unsigned)atomicAdd(p.sched, 1);
          if (nu >= units) sched_done(p);
          publish(sl, nu);
          mbar_arrive(unit_full + 8 * sl);  // (release: the slot's stores before it)
          if (n_tiles > 0) FA2_TR(it0 - 1, 7);
        }
        named_sync(4, 128);
        more = take(sl);
        ++j;
      } while (more);
      ac::cp_async_wait<0>();  // no thread leaves with copies in flight
    } else {
      // ---------------- consumers
      setmaxnreg_inc<Cfg::CREG>();
      // until tile `tile`'s copies into its stage have landed (`bar`: bar_full, or SEPKV's bar_full_v for its V)
      auto stg = [&](int tile) { return (it0 + tile) % STAGES; };
      auto wait_full = [&](uint32_t bar, int tile) { mbar_wait(bar + 8 * stg(tile), ((it0 + tile) / STAGES) & 1); };
      do {
        if constexpr (Cfg::PERSIST) {  // the state of the previous unit (unconditional: two registers an instruction)
#pragma unroll
          for (int i = 0; i < NO; ++i) o[i] = 0.f;
          m[0] = m[1] = kNegInf;
          l[0] = l[1] = 0.f;
          o_zero = true;
          fast_ok = false;
        }
        if constexpr (Cfg::PP) {
          if (wg == 1 && n_tiles > 0 && (!Cfg::HANDOVER || nq == 0)) named_arrive(1, 256);  // warpgroup 0 goes first
        }
        if (n_tiles > 0) {
          if constexpr (Cfg::PIPE) {
            FA2_TR(it0, 0);
            wait_full(bar_full, 0);
            fence_async_smem();  // the producer's cp.async writes, seen by wgmma (the async proxy)
            FA2_TR(it0, 1);
            s_step(stg(0));
            if (n_tiles == 1) release_q();
            if constexpr (Cfg::SEPKV) mbar_arrive(bar_empty + 8 * stg(0));  // K of tile 0 consumed
            FA2_TR(it0, 2);
            softmax(0, 0u);
            FA2_TR(it0, 3);
            pack();  // O is rescaled for each tile in pipe_step, before its P V
            FA2_TR(it0, 4);
            for (int tile = 0; tile < n_tiles - 1; ++tile) {
              const int nx = tile + 1;
              FA2_TR(it0 + nx, 0);
              wait_full(bar_full, nx);
              if constexpr (Cfg::SEPKV) wait_full(bar_full_v, tile);
              fence_async_smem();
              FA2_TR(it0 + nx, 1);
              pipe_step(tile, nx, true, it0);
              if constexpr (Cfg::SEPKV) {
                mbar_arrive(bar_empty + 8 * stg(nx));     // K of `nx` consumed
                mbar_arrive(bar_empty_v + 8 * stg(tile));  // V of `tile` consumed
              } else {
                mbar_arrive(bar_empty + 8 * stg(tile));  // K and V of `tile` consumed
              }
              pack();
              FA2_TR(it0 + nx, 4);
            }
            rescale();
            if constexpr (Cfg::SEPKV) {
              wait_full(bar_full_v, n_tiles - 1);
              fence_async_smem();
            }
            pv_step(stg(n_tiles - 1));
            FA2_TR(it0 + n_tiles - 1, 8);
            if constexpr (Cfg::PERSIST && !Cfg::OSMEM) {  // the last tile's stage, for the producer's next unit
              mbar_arrive((Cfg::SEPKV ? bar_empty_v : bar_empty) + 8 * stg(n_tiles - 1));
            }
          } else {
            // split: a warpgroup waits on every other tile's `full` only.  Its parity wait on tile t is sound because
            // the producer's arrivals (each thread's, after its copies of the tile landed, in tile order) complete
            // the phases in tile order, so tile t - 3's phase of the same stage is complete by then.  A producer
            // whose tiles may land out of order (TMA: session 21, cuda_fa2.md) must keep that order, or the wait
            // passes on tile t - 3's phase while tile t - 3 is still landing.
            for (int tile = split ? wg : 0; tile < n_tiles; tile += split ? 2 : 1) {
              const int stage = stg(tile);
              FA2_TR(it0 + tile, 0);
              wait_full(bar_full, tile);
              if constexpr (Cfg::EARLY_ARRIVE) fence_async_smem();  // the copies, seen by wgmma (the async proxy)
              FA2_TR(it0 + tile, 1);
              s_step(stage);
              if constexpr (Cfg::SEPKV) mbar_arrive(bar_empty + 8 * stage);  // K consumed
              if (tile == n_tiles - 1) release_q();
              FA2_TR(it0 + tile, 2);
              // (SEPKV has handed K back, PERSIST the unit's Q at its last tile: the exact path there)
              softmax(tile, Cfg::SEPKV || (Cfg::PERSIST && tile == n_tiles - 1) ? 0u
                                                                                 : sKVa + stage * Cfg::stage_bytes);
              FA2_TR(it0 + tile, 3);
              rescale_pack();
              FA2_TR(it0 + tile, 4);
              if constexpr (Cfg::SEPKV) {
                wait_full(bar_full_v, tile);
                fence_async_smem();
              }
              pv_step(stage);
              FA2_TR(it0 + tile, 5);
              if (!(Cfg::PERSIST && Cfg::OSMEM) || tile < n_tiles - 1)  // (OSMEM: the last after the epilogue)
                mbar_arrive((Cfg::SEPKV ? bar_empty_v : bar_empty) + 8 * stage);
            }
          }
        }
        if constexpr (KVSPLIT) {
          if (split) merge_halves();
          if (split && wg == 1) return;
        }
        if constexpr (Cfg::OTILE) {
          epilogue(true, sQa + Cfg::o_off + wg * (64 * Cfg::DV * 2));
        } else if constexpr (!Cfg::OSMEM) {
          epilogue(false, 0u);
        } else if constexpr (!Cfg::PERSIST) {
          epilogue(true, qbase);
        } else if (n_tiles > 0) {  // the last stage's K tile, once every S of the unit has run; then the stage is free
          mbar_wait(bar_qempty, nq & 1);
          const uint32_t last = sKVa + stg(n_tiles - 1) * Cfg::stage_bytes;
          epilogue(true, last + wg * (64 * D * 2));
          mbar_arrive(bar_empty + 8 * stg(n_tiles - 1));
        } else {
          epilogue(false, 0u);  // no keys: no stage of its own (and the next unit's Q may be landing in the Q tile)
        }
        if (n_tiles > 0) FA2_TR(it0 + n_tiles - 1, 9);
        it0 += n_tiles;
        nq += n_tiles > 0;
        if constexpr (!Cfg::PERSIST) break;
        const int sl = j & 1;
        mbar_wait(unit_full + 8 * sl, (j >> 1) & 1);
        if (it0 > 0) FA2_TR(it0 - 1, 10);
        more = take(sl);
        mbar_arrive(unit_empty + 8 * sl);  // the slot read
        if (it0 > 0) FA2_TR(it0 - 1, 11);
        ++j;
      } while (more);
    }
  } else {
    copy_q();
    ac::cp_async_commit();

    // ---- K/V tile copy: thread's chunk column c, rows r0 + it * RSTEP
    const int r0 = tid / CPR, cc = tid % CPR;
    KvTileCopy<KVT, LROWS, RSTEP, T> kv(p, reinterpret_cast<const T*>(kg), reinterpret_cast<const T*>(vg), kvh,
                                        kv_base, r0, cc, kv_lo, kv_hi);
    auto load_tile = [&](int tile, int stage) {
      uint8_t* dk = smem + Cfg::q_bytes + stage * Cfg::stage_bytes;
      kv.issue(tile, dk, dk + Cfg::k_bytes);
    };

    if (n_tiles > 0) {
  #pragma unroll
      for (int st = 0; st < STAGES - 1; ++st) {
        if (st < n_tiles) {
          kv.prefetch(st);
          load_tile(st, st);
        }
        ac::cp_async_commit();
      }
      kv.prefetch(STAGES - 1);

      if constexpr (Cfg::PIPE) {
        // Software pipeline (STAGES >= 3): S of tile j+1 runs on the tensor cores while ... O += P_j V_j
        // runs while the softmax of tile j+1 runs on the FP units.  Tile j+2 is copied meanwhile.
        static_assert(STAGES == 3, "the pipelined loop keeps tiles j (V), j+1 (K) and j+2 (copy) resident");
        ac::cp_async_wait<STAGES - 2>();
        fence_async_smem();
        __syncthreads();
        s_step(0);
        softmax(0, 0u);
        rescale_pack();
        // (the last tile is peeled off so that no wgmma sits under a branch: ptxas would serialize)
        for (int tile = 0; tile < n_tiles - 1; ++tile) {
          ac::cp_async_wait<0>();  // tile + 1 landed (the only group in flight)
          fence_async_smem();
          __syncthreads();     // and every warp is done with tile - 1: its stage takes tile + 2
          if (tile + 2 < n_tiles) {
            load_tile(tile + 2, (tile + 2) % STAGES);
            kv.prefetch(tile + 3);
          }
          ac::cp_async_commit();
          pipe_step(tile, tile + 1, false);
          rescale_pack();
        }
        pv_step((n_tiles - 1) % STAGES);
      } else {
        for (int tile = 0; tile < n_tiles; ++tile) {
          ac::cp_async_wait<STAGES - 2>();
          fence_async_smem();
          __syncthreads();
          {
            const int nt = tile + STAGES - 1;
            if (nt < n_tiles) {
              load_tile(nt, nt % STAGES);
              kv.prefetch(nt + 1);
            }
            ac::cp_async_commit();
          }
          s_step(tile % STAGES);
          softmax(tile, sKVa + (tile % STAGES) * Cfg::stage_bytes);
          rescale_pack();
          pv_step(tile % STAGES);
        }
      }
    }
    ac::cp_async_wait<0>();
    // (without keys no barrier has passed since the Q copy, whose rows other threads' cp.async may still be filling)
    epilogue(n_tiles > 0, qbase);
  }
}

template <typename Cfg, typename T, int MASK>
__global__ void __launch_bounds__(Cfg::NTHREADS, 1) fa2_sm90_kernel(const Fa2Params p,
                                                                    const __grid_constant__ KvTma tma) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Counters shared with a second launch (Fa2Params.sched_*): the persistent grid's second launch takes its first
  // unit from them too; the one-unit grid takes every CTA's unit from them (in the order of unit_of),
  // in both launches, and each CTA is done with the counters once it has taken one
  const uint2 unit = Cfg::PERSIST ? make_uint2(blockIdx.x, blockIdx.y) : grid_unit(p);
  unsigned first = unit.x;
  int kvh = (int)unit.y;
  if (p.sched_ctas && (p.sched_steal || !Cfg::PERSIST)) {
    __shared__ unsigned taken;
    if (threadIdx.x == 0) {
      taken = (Cfg::PERSIST ? sched_first(p) : 0u) + (unsigned)atomicAdd(p.sched, 1);
      if (!Cfg::PERSIST) sched_done(p);
    }
    __syncthreads();
    first = taken;
    if constexpr (!Cfg::PERSIST) {
      if (first >= (unsigned)(p.num_work * p.num_kv_heads)) return;
      unit_of(p, first, first, kvh);
    }
  }
  // CUDA-graph mode: a capacity grid; CTAs without work leave before any barrier or copy
  if constexpr (Cfg::PERSIST) {
    if (first >= live_items(p) * p.num_kv_heads) {  // (a capacity grid: CTAs past the live units; none left)
      if (threadIdx.x == 0) sched_done(p);
      return;
    }
  } else if (past_work_count(p)) {
    return;
  }
  sm90_cta<Cfg, T, MASK>(p, first, kvh, tma.on ? &tma : nullptr);  // (on: WS builds only)
#else
  __trap();  // built for another target than sm_90a
#endif
}

// POD in one launch: a prefill part (p0: its loop variant CfgP, mask MASKP) and a decode part (p1: the plain
// loop, causal: a decode row sees its request's keys up to its own position) share one grid of the same CTA
// shape.  order[blockIdx.x] names a CTA's item: e >= 0 item e of p0, e < 0 item ~e of p1.  The host interleaves
// the two parts in that order (the hardware starts CTAs in blockIdx order), so that compute-bound prefill tiles
// and bandwidth-bound decode items run on the GPU at the same time; a decode item's two consumer warpgroups split
// its K/V tiles (KVSPLIT).  The prefill part is never split across CTAs; long decodes may be (their partials merged
// by the split-KV merge launch after this one: backends/cuda_fa2/pod.py).  No graph mode.
template <typename CfgP, typename CfgD, typename T, int MASKP>
__global__ void __launch_bounds__(CfgP::NTHREADS, 1)
    fa2_sm90_pod_kernel(const __grid_constant__ Fa2Params p0, const __grid_constant__ Fa2Params p1,
                        const int32_t* __restrict__ order) {
  static_assert(CfgP::NTHREADS == CfgD::NTHREADS && CfgP::smem_bytes == CfgD::smem_bytes, "one launch shape");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int e = __ldg(order + blockIdx.x);
  if (e >= 0) {
    sm90_cta<CfgP, T, MASKP>(p0, (unsigned)e, blockIdx.y);
  } else {
    sm90_cta<CfgD, T, kMaskCausal, true>(p1, (unsigned)~e, blockIdx.y);
  }
#else
  __trap();
#endif
}

}  // namespace sm90
}  // namespace fa2
