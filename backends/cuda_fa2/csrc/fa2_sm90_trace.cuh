// attncore cuda_fa2: a clock64 timeline of prefill90's warp-specialized loops, for diagnosis only.
//
// Off (no code) unless the library is built with -DFA2_TRACE=1 (ATTNCORE_NVCC_FLAGS; the JIT cache keys
// builds by their flags).  Lane 0 of warp 0 of the producer and of each consumer warpgroup stamps
// clock64() at the phase boundaries of each K/V tile, in four CTAs: blockIdx.x 0 and gridDim.x / 2, each
// with blockIdx.y 0 and gridDim.y / 2 (so two of them in a later wave on a large grid).  The stamps go
// to a __device__ buffer that fa2_trace_dump() copies to the host (fa2_attention.cu);
// backends/cuda_fa2/scripts/sm90_trace.py builds, runs and summarises it.  One SM's clock64 is
// consistent across its warps, so within a CTA the phases of the three roles compare directly.
// ptxas keeps instructions on their side of a clock read (seen in the SASS), so the traced build keeps the source
// order where the shipped one does not: in the pipelined loop ptxas hoists the P V wait and the stage's release above
// the softmax (bench/cuda_fa2.md, session 31), which the traced build's phases 3 / 5 do not show.
//
// Tiles are counted per CTA: a persistent CTA (Cfg90::PERSIST) stamps its units' tiles one after the other, the
// first tile of each unit in the pipelined loop without phases 7 / 6 (its S runs alone).
// Phases: producer 0 before its `empty` wait, 1 after it, 2 once the tile's copies are issued (SEPKV: 1 after K's
// `empty` wait, 3 K's copies issued, 4 V's `empty` waited, 2 V's copies issued); a persistent unit's Q copied late
// (Cfg90::QLATE), in its first tile: 5 once the Q tile is free, 6 once its copies are issued; 7 of a unit's last tile:
// the next unit published (thread 0);
// consumers 0 before the `full` wait, 1 after it, then the plain loop 2 S done, 3 softmax done,
// 4 rescale + pack done, 5 P V done; the pipelined loop 7 turn taken, 6 S and P V issued, 2 S done,
// 3 softmax done, 5 P V done, 4 pack done; a persistent unit's last tile then 8 its last P V done (the pipelined
// loop), 9 its epilogue done, 10 the next unit's slot full, 11 the slot read.
#pragma once

#ifdef FA2_TRACE
namespace fa2 {
namespace sm90 {
constexpr int kTraceSlots = 4, kTraceRoles = 3, kTraceTiles = 256, kTracePhases = 12;
__device__ unsigned long long g_trace[kTraceSlots][kTraceRoles][kTraceTiles][kTracePhases];

__device__ __forceinline__ int trace_slot() {
  const int x = blockIdx.x == 0 ? 0 : (blockIdx.x == gridDim.x / 2 ? 1 : -1);
  const int y = blockIdx.y == 0 ? 0 : (blockIdx.y == gridDim.y / 2 ? 2 : -1);
  return (x < 0 || y < 0) ? -1 : x + y;
}
}  // namespace sm90
}  // namespace fa2
// role: wg + 1 (0 the producer); in the kernel, where tslot, lane, wq and wg are defined
#define FA2_TR(tile, ph)                                                                        \
  do {                                                                                          \
    if (tslot >= 0 && lane == 0 && wq == 0 && (tile) < kTraceTiles)                             \
      g_trace[tslot][wg + 1][(tile)][(ph)] = clock64();                                          \
  } while (0)
#else
#define FA2_TR(tile, ph) \
  do {                   \
  } while (0)
#endif
