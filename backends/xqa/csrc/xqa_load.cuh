// attncore xqa: what the kernel copies into shared memory.
//
//   load_q    the CTA's Q rows -> registers -> smem, read once, as the 16-bit MMA type CT, 16-byte
//             chunks swizzled; for fp8 KV the pairs of each 16-dim group are permuted the way the fp8 K
//             fragments are (xqa_decode.cuh), and bf16 q is converted to fp16 with a power-of-two
//             prescale 2^-k chosen from max |q| of the CTA's rows (k > 0 only above 2^14: no overflow),
//             2^k returned in q_unscale for the logit scale.
//   KvCopy    K/V tiles -> the STAGES-deep cp.async ring: each thread copies chunk ld_c of RPT
//             consecutive key rows; the page-table gather happens in the copy, with the page ids of
//             the next tile fetched a tile ahead into registers (pg, the caller's array).
//             prologue / advance: the ring's schedule, for every kernel; tile: a step's tile in the ring.
#pragma once
#include "attncore/ptx.cuh"
#include "xqa_config.cuh"

namespace xqa {

template <typename Cfg, typename QT, bool FP8>
__device__ __forceinline__ void load_q(uint8_t* sm_q, float* sm_ml, const XqaParams& p, const Work<Cfg>& w, int tid,
                                       int lane, int warp, float& q_unscale) {
  constexpr int D = Cfg::D, ROWS = Cfg::ROWS;
  const int G = w.G, QL = w.QL, row0 = w.row0, rows_here = w.rows_here, b = w.b, kvh = w.kvh;
  constexpr int GROUPS16 = D / 16;
  constexpr int ITEMS = (ROWS * GROUPS16 + NT - 1) / NT;  // 16-dim groups per thread
  constexpr bool CONVERT = FP8 && std::is_same<QT, __nv_bfloat16>::value;
  // every group read once, into registers (the prescale needs max |q| before anything is stored)
  uint32_t u[ITEMS][8];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int i = tid + it * NT;
    const int r = i / GROUPS16, gi = i % GROUPS16;
    uint4 lo4 = make_uint4(0, 0, 0, 0), hi4 = make_uint4(0, 0, 0, 0);
    if (i < ROWS * GROUPS16 && r < rows_here) {
      const int rr = row0 + r;
      const QT* src = reinterpret_cast<const QT*>(p.q) + (int64_t)(b * QL + rr / G) * p.q_stride_tok +
                      (int64_t)(kvh * G + rr % G) * p.q_stride_head + gi * 16;
      lo4 = *reinterpret_cast<const uint4*>(src);
      hi4 = *reinterpret_cast<const uint4*>(src + 8);
    }
    const uint32_t v[8] = {lo4.x, lo4.y, lo4.z, lo4.w, hi4.x, hi4.y, hi4.z, hi4.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) u[it][j] = v[j];
  }
  if constexpr (CONVERT) {
    float mx = 0.f;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 f = ac::unpack2<QT>(u[it][j]);
        mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    mx = ac::warp_max(mx);
    if (lane == 0) sm_ml[warp] = mx;
    __syncthreads();
    mx = fmaxf(fmaxf(sm_ml[0], sm_ml[1]), fmaxf(sm_ml[2], sm_ml[3]));
    __syncthreads();
    int k = 0;
    if (mx > 16384.f) k = (int)ceilf(log2f(mx / 16384.f));
    if (!(k < 128)) k = 0;  // inf / nan in q: leave unscaled (propagates like the reference)
    const float q_prescale = exp2f((float)-k);
    q_unscale = exp2f((float)k);
#pragma unroll
    for (int it = 0; it < ITEMS; ++it)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 f = ac::unpack2<QT>(u[it][j]);
        u[it][j] = ac::pack2<__half>(f.x * q_prescale, f.y * q_prescale);
      }
  }
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int i = tid + it * NT;
    if (i >= ROWS * GROUPS16) break;
    const int r = i / GROUPS16, gi = i % GROUPS16;
    uint4 lo4 = make_uint4(u[it][0], u[it][1], u[it][2], u[it][3]);
    uint4 hi4 = make_uint4(u[it][4], u[it][5], u[it][6], u[it][7]);
    if constexpr (FP8) {
      // pair j (dims 2j, 2j+1) -> position j/2 (j even) or 4 + j/2 (j odd)
      lo4 = make_uint4(u[it][0], u[it][2], u[it][4], u[it][6]);
      hi4 = make_uint4(u[it][1], u[it][3], u[it][5], u[it][7]);
    }
    uint8_t* rowp = sm_q + r * Cfg::QRB;
    *reinterpret_cast<uint4*>(rowp + (ac::swz_chunk<D / 8>(r, 2 * gi) << 4)) = lo4;
    *reinterpret_cast<uint4*>(rowp + (ac::swz_chunk<D / 8>(r, 2 * gi + 1) << 4)) = hi4;
  }
}

template <typename Cfg>
struct KvCopy {
  static constexpr int RPT = Cfg::RPT, C = Cfg::C, RB = Cfg::RB, TILE = Cfg::TILE;
  const XqaParams& p;
  const Work<Cfg>& w;
  uint8_t* const& sm_big;  // the ring: STAGES x (K tile, V tile)
  const int ld_c, ld_r0;   // this thread's chunk column and first key row of a tile
  const uint8_t* kbase;    // this thread's column of this kv head
  const uint8_t* vbase;
  const int64_t k_tok_bytes, v_tok_bytes;

  __device__ __forceinline__ KvCopy(const XqaParams& p_, const Work<Cfg>& w_, uint8_t* const& sm_big_, int tid)
      : p(p_), w(w_), sm_big(sm_big_), ld_c(tid % C), ld_r0((tid / C) * RPT),
        kbase(reinterpret_cast<const uint8_t*>(p.k) + ((int64_t)w_.kvh * p.k_stride_head) * Cfg::KVB + ld_c * 16),
        vbase(reinterpret_cast<const uint8_t*>(p.v) + ((int64_t)w_.kvh * p.v_stride_head) * Cfg::KVB + ld_c * 16),
        k_tok_bytes(p.k_stride_tok * Cfg::KVB), v_tok_bytes(p.v_stride_tok * Cfg::KVB) {}

  // The ring's first STAGES - 1 tiles (of the CTA's my_tiles from t_first), and the page ids of the next.
  // DIAG 2 (compute only) zero-fills the ring instead.
  __device__ __forceinline__ void prologue(int (&pg)[RPT], int tid) const {
    if constexpr (Cfg::DIAG == 2) {
      for (int i = tid; i < Cfg::PIPE_BYTES / 16; i += NT) reinterpret_cast<uint4*>(sm_big)[i] = make_uint4(0, 0, 0, 0);
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < Cfg::STAGES - 1; ++i) {
      if (i < w.my_tiles) {
        fetch_pages(pg, w.t_first + i);
        if (i == 0) issue(pg, i, w.t_first + i, std::true_type{});
        else issue(pg, i, w.t_first + i, std::false_type{});
      }
      ac::cp_async_commit();
    }
    if (Cfg::STAGES - 1 < w.my_tiles) fetch_pages(pg, w.t_first + Cfg::STAGES - 1);
  }

  // Main-loop step it: wait for tile it (stage it % STAGES; the CTA syncs, so the stage read last
  // step is free), then issue tile it + STAGES - 1 into it and fetch the page ids of the one after.
  __device__ __forceinline__ void advance(int (&pg)[RPT], int it) const {
    ac::cp_async_wait<Cfg::STAGES - 2>();
    __syncthreads();
    const int ni = it + Cfg::STAGES - 1;
    if (ni < w.my_tiles) {
      issue(pg, ni % Cfg::STAGES, w.t_first + ni, std::false_type{});
      if (ni + 1 < w.my_tiles) fetch_pages(pg, w.t_first + ni + 1);
    }
    ac::cp_async_commit();
  }

  // Step it's tile: its K and V tiles in the ring (shared-space addresses) and its first key.
  struct Tile {
    uint32_t ks, vs;
    int start;
  };
  __device__ __forceinline__ Tile tile(int it) const {
    const uint32_t ks = ac::smem_u32(sm_big + (it % Cfg::STAGES) * Cfg::STAGE_BYTES);
    return {ks, ks + TILE * RB, w.kv_begin + (w.t_first + it) * TILE};
  }

  // Page ids of this thread's rows of `tile` into pg (one load, into pg[0], when they share a page).
  __device__ __forceinline__ void fetch_pages(int (&pg)[RPT], int tile) const {
    if constexpr (Cfg::DIAG == 2) return;
    const int tok0 = w.kv_begin + tile * TILE + ld_r0;
    if (w.one_page) {
      // pg[0] only: issue's one-page path reads no other, and copying the id into pg[1..] made the warp wait for
      // the load right here instead of at the next tile (X1 q4 e4m3, ncu: 16% of its stall samples, H200 s52)
      pg[0] = tok0 < w.seq_len ? __ldg(w.pt + (tok0 >> w.lg)) : 0;
    } else {
#pragma unroll
      for (int k = 0; k < RPT; ++k) pg[k] = (tok0 + k) < w.seq_len ? __ldg(w.pt + ((tok0 + k) >> w.lg)) : 0;
    }
  }

  // cp.async of `tile` (page ids in pg) into `stage`.  EDGE (std::true_type: the first tile of a
  // split, issued in the prologue): keys left of draft row 0's window (kv_begin rounds lo down to a
  // tile) are zero-filled too.  They are masked in S, but 0 * NaN is NaN in P V (semantics.md rule
  // 2); the main loop's copies never need the test.
  template <typename Edge>
  __device__ __forceinline__ void issue(const int (&pg)[RPT], int stage, int tile, Edge) const {
    if constexpr (Cfg::DIAG == 2) return;
    constexpr bool EDGE = Edge::value;
    const int tok0 = w.kv_begin + tile * TILE + ld_r0;
    const uint32_t ks = ac::smem_u32(sm_big + stage * Cfg::STAGE_BYTES);
    const uint32_t vs = ks + TILE * RB;
    if (w.one_page) {
      // RPT consecutive slots of one page: one address, then constant steps.  Rows past seq_len
      // (zero-filled, nothing read) still point inside that page (or page 0 when the whole run is
      // past the end), so no select is needed.
      const int64_t page = min((unsigned)pg[0], (unsigned)p.max_page);  // a bad id reads no page past the caches
      const int64_t slot = tok0 & w.ps_mask;
      const uint8_t* ksrc = kbase + (page * p.k_stride_page + slot * p.k_stride_tok) * Cfg::KVB;
      const uint8_t* vsrc = vbase + (page * p.v_stride_page + slot * p.v_stride_tok) * Cfg::KVB;
#pragma unroll
      for (int k = 0; k < RPT; ++k) {
        const int r = ld_r0 + k;
        const bool valid = tok0 + k < w.seq_len && (!EDGE || tok0 + k >= w.lo);
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
      const bool valid = tok < w.seq_len && (!EDGE || tok >= w.lo);
      const int64_t slot = tok & w.ps_mask;
      const int64_t page = min((unsigned)pg[k], (unsigned)p.max_page);
      const uint8_t* ksrc = kbase + (page * p.k_stride_page + slot * p.k_stride_tok) * Cfg::KVB;
      const uint8_t* vsrc = vbase + (page * p.v_stride_page + slot * p.v_stride_tok) * Cfg::KVB;
      const uint32_t off = r * RB + (ac::swz_chunk<C>(r, ld_c) << 4);
      ac::cp_async16<Cfg::L2PF>(ks + off, valid ? (const void*)ksrc : p.k, valid);
      ac::cp_async16<Cfg::L2PF>(vs + off, valid ? (const void*)vsrc : p.v, valid);
    }
  }
};

}  // namespace xqa
