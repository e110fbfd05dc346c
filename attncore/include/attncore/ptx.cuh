// attncore: the PTX / device helpers every CUDA backend (cuda_fa2, xqa) uses, written once.
//
// Header-only, device code only, namespace `ac`; no torch headers.  Every helper is
// __forceinline__ and does exactly what the per-backend copies it replaced did (same PTX, so the
// same SASS: checked with `cuobjdump -sass` before / after, tests/test_cuda_sources.py keeps the
// no-spill check); next_max, the softmaxes' one rule for a row's max, came later.  Include as
// "attncore/ptx.cuh" (the spec's include dirs carry attncore/include, and the JIT hash covers every
// file in it, so an edit here rebuilds every specialization).
//
//   smem_u32(p)                       generic -> shared-space address (what ldmatrix / cp.async take)
//   cp_async16<L2PF>(dst, src, ok)    16-byte cp.async.cg; ok false zero-fills and reads nothing;
//   cp_async_commit / cp_async_wait<N>   L2PF: L2 prefetch hint in bytes (0 none, 64, 128, 256)
//   ldsm_x4 / ldsm_x4_t(r, addr)      ldmatrix x4 (.trans) of four 8x8 b16 matrices
//                                     (dst / addr: a shared-space address or a pointer into smem)
//   mma16816<T>(c, a, b0, b1)         mma.sync m16n8k16, fp32 accumulate, T = __half / __nv_bfloat16
//   movm_t(x)                         movmatrix .trans: this lane's pair of the transposed 8x8 b16 matrix
//   ex2(x)                            ex2.approx.ftz.f32 (2^x; the softmax runs in base 2)
//   lg2(x)                            lg2.approx.ftz.f32 (log2 x: an LSE's, once per row)
//   next_max(m, tile_max)             an online softmax's row max, moved only past kMaxSlack (lazy rescale);
//                                     kMaxP = 2^kMaxSlack, the largest p = 2^(s - m) it lets a row keep
//   pack2<T>(a, b) / unpack2<T>(u)    two floats <-> two 16-bit values in one 32-bit register
//   fp8x2_to<T, KIND>(v)              two fp8 (KIND 1 e4m3, 2 e5m2) -> two T, exact (cuda_fp8 path)
//   cvt_fp8x2_lo / _hi<KIND>(x)       two fp8 -> fp16x2: cvt on sm_89+, integer ops on sm_80 where
//                                     e4m3 comes out scaled by 2^-8 (kFp8Fold undoes it)
//   swz_chunk<C>(r, c)                XOR swizzle of 16-byte chunk c in row r of C chunks per row
//   quad_max / quad_sum / warp_max    reductions over the 4 lanes of an mma row (xor 1, 2) / a warp
//   quad_transpose(a)                 a 4 x 4 transpose of 32-bit words over the 4 lanes of an mma row
//   col_max / col_sum                 ... over the 8 lanes of an mma column pair (xor 4, 8, 16)
//   grid_dep_wait / grid_dep_launch   programmatic dependent launch (sm_90+; no-ops before)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace ac {

constexpr float kLog2e = 1.4426950408889634f;

// ------------------------------------------------------------------------- shared memory, copies
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared async copy.  valid false: src-size 0 zero-fills the 16 bytes and reads
// nothing (src must still be a valid address expression, any will do).
template <int L2PF = 0>
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  static_assert(L2PF == 0 || L2PF == 64 || L2PF == 128 || L2PF == 256, "L2 prefetch size");
  const int n = valid ? 16 : 0;
  if constexpr (L2PF == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
  else if constexpr (L2PF == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
  else if constexpr (L2PF == 64)
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
// The same from a generic pointer into shared memory (converted after the operands are computed).
template <int L2PF = 0>
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16<L2PF>(smem_u32(dst), src, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ------------------------------------------------------------------------------ tensor cores
// ldmatrix: lane i addresses row i % 8 of matrix i / 8; r[j] gets this lane's pair of matrix j.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) { ldsm_x4(r, smem_u32(p)); }
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) { ldsm_x4_t(r, smem_u32(p)); }

// C += A B, m16n8k16, fp32 accumulators.  Not volatile: no side effects, so the compiler may
// schedule it freely (both kernels measured with that).
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value, "mma operand type");
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The 8x8 b16 matrix whose row lane / 4 holds columns 2 (lane % 4), +1 in this lane's register (the
// mma C layout packed to 16 bits), transposed: the lane gets the transpose's row lane / 4, columns
// 2 (lane % 4), +1 (the B layout of a k16 half).  sm_75+.
__device__ __forceinline__ uint32_t movm_t(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ------------------------------------------------------------------------------- arithmetic
// 2^x, flush-to-zero approximate (MUFU.EX2): the online softmax works in base 2 with the scale
// folded into the logits, so exp is one instruction.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// log2 x, approximate (MUFU.LG2; relative error ~2^-22): an epilogue's LSE per row, where log2f's accurate polynomial
// and range checks take ~25 instructions.
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// An online softmax's reference max for a row (base-2 units): it moves to the tile's max only where that exceeds
// it by more than kMaxSlack, as FlashAttention-4 does.  p = 2^(s - m) then stays <= 2^kMaxSlack (16-bit P and
// the fp32 sums hold that with the same relative rounding; O and l share the stale m, so O / l and the LSE are
// unchanged), and O's rescale, skipped while no row max of a warp moves, is skipped on nearly every tile after a
// row's first (cuda_fa2 prefill90 on an H200, 2026-11-29: P1 -2-3%, P2 d256 -5%).  A row with no key yet
// (m = -inf) takes the first finite max.
#ifndef AC_MAX_SLACK
#define AC_MAX_SLACK 8  // a tuning define: 0 moves the max on every increase
#endif
constexpr float kMaxSlack = AC_MAX_SLACK;
__device__ __forceinline__ float next_max(float m, float tile_max) {
  return tile_max > m + kMaxSlack ? tile_max : m;
}
// 2^kMaxSlack: the largest p a row keeps under next_max
constexpr float kMaxP = (float)(1u << AC_MAX_SLACK);

// Lanes 4i..4i+3 hold the columns of one accumulator row (the mma C layout): xor 1 and 2.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}
// Lanes 4i + q (q < 4) hold words a[0..3]; after, lane q holds word q of each: a[j] is lane j's former a[q].  Two
// butterfly steps (xor 1, 2) of two shuffles each.  Every lane of the warp must take part.
__device__ __forceinline__ void quad_transpose(uint32_t (&a)[4]) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int s = 1; s <= 2; s <<= 1) {
    const bool hi = (q & s) != 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i & s) continue;
      const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? a[i] : a[i ^ s], s);
      if (hi) a[i] = got; else a[i ^ s] = got;
    }
  }
}
// Lanes i, i + 4, ..., i + 28 hold the 8 rows of one accumulator column pair: xor 4, 8 and 16.
__device__ __forceinline__ float col_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float col_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// ---------------------------------------------------------------------------------- packing
// (a, b) rounded to nearest into one register, a in the low half (the mma A/B element order).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&u));
  }
}

// ------------------------------------------------------------------------------ fp8 widening
// KIND: 1 e4m3, 2 e5m2 (the kernels' KV kind numbering; 0 = not fp8).
//
// Exact, any arch: two fp8 (low byte first) -> two T.  e4m3 and e5m2 fit fp16 and bf16 exactly.
template <typename T, int KIND>
__device__ __forceinline__ uint32_t fp8x2_to(uint16_t v) {
  static_assert(KIND == 1 || KIND == 2, "fp8 kind");
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, KIND == 1 ? __NV_E4M3 : __NV_E5M2);
  if constexpr (std::is_same<T, __half>::value) {
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 hh = *reinterpret_cast<__half2*>(&h);
    float2 f = __half22float2(hh);
    return pack2<__nv_bfloat16>(f.x, f.y);
  }
}

// Fast, to fp16x2 only.  Software path (sm_80): z holds the two fp8 in the high byte of each 16-bit
// half ([0, b0, 0, b1], one prmt); e5m2 is fp16's top byte; e4m3 becomes value * 2^-8 (fp16
// subnormals are exact in the mma), which the caller folds back with kFp8Fold.
template <int KIND>
__device__ __forceinline__ uint32_t widen_fp8x2_sw(uint32_t z) {
  if constexpr (KIND == 2) return z;
  else return (z & 0x80008000u) | ((z >> 1) & 0x3F803F80u);
}
// The two fp8 in the low (lo) or high (hi) 16 bits of x, first in the lower byte.
template <int KIND>
__device__ __forceinline__ uint32_t cvt_fp8x2_lo(uint32_t x) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (KIND == 2)
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e5m2x2 %0, l; }\n" : "=r"(r) : "r"(x));
  else
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }\n" : "=r"(r) : "r"(x));
#else
  r = widen_fp8x2_sw<KIND>(__byte_perm(x, 0, 0x1404));
#endif
  return r;
}
template <int KIND>
__device__ __forceinline__ uint32_t cvt_fp8x2_hi(uint32_t x) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (KIND == 2)
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e5m2x2 %0, h; }\n" : "=r"(r) : "r"(x));
  else
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }\n" : "=r"(r) : "r"(x));
#else
  r = widen_fp8x2_sw<KIND>(__byte_perm(x, 0, 0x3424));
#endif
  return r;
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr float kFp8Fold = 1.f;
#else
constexpr float kFp8Fold = 256.f;  // software e4m3 widening yields value * 2^-8
#endif

// --------------------------------------------------------------------------------- swizzle
// Physical 16-byte chunk of logical chunk c in row r of a tile with C chunks per row: XOR with the
// row (mod 8) so the 8 rows an ldmatrix phase reads hit distinct bank groups; rows of 4 chunks
// pair rows up, narrower rows are not swizzled.
template <int C>
__device__ __forceinline__ int swz_chunk(int r, int c) {
  if constexpr (C >= 8) return c ^ (r & 7);
  else if constexpr (C == 4) return c ^ ((r >> 1) & 3);
  else return c;
}

// ---------------------------------------------------------------- programmatic dependent launch
// Wait for the previous kernel's memory (a no-op unless launched with PDL) / let the next one
// start its prologue.  sm_90+; nothing before.
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace ac
