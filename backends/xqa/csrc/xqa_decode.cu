// attncore xqa: one specialization per build (compile-time -D flags), plain C entry points.
//
// Notation: see xqa_decode.cuh.  Specialization defines (set by specs.py):
//   XQA_DTYPE     0 fp16, 1 bf16 (q and out; the MMA operand type unless the KV is fp8)
//   XQA_KV        0 same as q, 1 fp8 e4m3, 2 fp8 e5m2
//   XQA_OUT       0 q dtype, 1 fp8 e4m3
//   XQA_HEAD_DIM  64 / 128 / 256
//   XQA_MT        m16 tiles per CTA: 1 (R <= 16 rows per CTA) or 2 (32 rows)
//   XQA_SWAP      1: the swapped-product kernel (xqa_swap.cuh; 8 rows per CTA, MT 1)
//   XQA_SD        1: the split-dims kernel (xqa_splitd.cuh; fp8 KV, d128, 16 MT rows per CTA)
// Entry points (extern "C", return a cudaError_t as int):
//   xqa_run(const XqaParams*, cudaStream_t)  grid (m_groups, num_splits * Hkv, B), 128 threads
//   xqa_info(int* out8)     rows per CTA, keys per tile, threads, smem bytes, stages, D, kv bytes,
//                           max CTAs per SM on the current device (0 without a GPU)
//   xqa_params_size(), xqa_params_offsets(int*, cap), xqa_params_fields()
//                           ABI guards for the ctypes mirror: sizeof, every field's offset and name
//                           (attncore/abi.h; binding.py checks them field by field)
//   xqa_error_string(int)
#include "xqa_decode.cuh"
#include "xqa_splitd.cuh"
#include "xqa_swap.cuh"

#ifndef XQA_DTYPE
#define XQA_DTYPE 1
#endif
#ifndef XQA_KV
#define XQA_KV 0
#endif
#ifndef XQA_OUT
#define XQA_OUT 0
#endif
#ifndef XQA_HEAD_DIM
#define XQA_HEAD_DIM 128
#endif
#ifndef XQA_MT
#define XQA_MT 1
#endif
// Tuning options (specs.XqaKey.tune; 0 = the default derived in the kernel's Config).
#ifndef XQA_KPW
#define XQA_KPW 0
#endif
#ifndef XQA_STAGES
#define XQA_STAGES 0
#endif
#ifndef XQA_MINB
#define XQA_MINB 0
#endif
#ifndef XQA_DIAG
#define XQA_DIAG 0
#endif
#ifndef XQA_L2
#define XQA_L2 128
#endif
#ifndef XQA_SWAP
#define XQA_SWAP 0
#endif
#ifndef XQA_SD
#define XQA_SD 0
#endif

namespace {
using QT = std::conditional<XQA_DTYPE == 1, __nv_bfloat16, __half>::type;
// Keys per warp per tile (XQA_KPW overrides): 32 for fp8 KV with 16-row CTAs and D <= 128 (128-key,
// 32 KB stages like the 16-bit kernels: half the barriers and softmax reductions per key; measured
// on H100 D5 80.9% -> 85.7-86.7% of the read ceiling, bench/xqa.md), else 16 (64-key tiles; 32-row
// fp8 CTAs would spill, d256 fp8 stages would not fit twice per SM).  The ring's depth (XQA_STAGES
// overrides; 0: Config's, from the stage size), and both for fp8 KV at d128 in a 16-row or swapped CTA, from
// the H200 (bench/xqa.md, session 50): more CTAs per SM stream faster than deeper rings.  The swapped kernel
// in 64-key tiles and two 16 KB stages, 4 CTAs per SM (D5 81% -> 88.5% of the read ceiling, X1 q1 87% ->
// 94.5%); the 16-row main kernel in two 32 KB stages, 3 CTAs per SM (X1 q2 82.7% -> 84.7%); the split-dims kernel
// as the swapped one.
constexpr bool kFp8D128 = XQA_KV != 0 && XQA_HEAD_DIM == 128;
constexpr bool kSmallTiles = kFp8D128 && (XQA_SWAP || XQA_SD);  // 64-key tiles, 4 CTAs per SM
constexpr int kKpw = XQA_KPW > 0 ? XQA_KPW
                                 : ((XQA_KV != 0 && XQA_MT == 1 && XQA_HEAD_DIM <= 128 && !kSmallTiles) ? 32 : 16);
constexpr int kStages = XQA_STAGES > 0 ? XQA_STAGES : (kFp8D128 && (XQA_MT == 1 || XQA_SD) ? 2 : 0);
// (their register budget pinned to 4 CTAs per SM: a change that needs more registers spills, which
// tests/test_cuda_sources.py reports, instead of losing a CTA per SM unseen)
constexpr int kMinb = XQA_MINB > 0 ? XQA_MINB : ((kSmallTiles && kStages == 2 && kKpw == 16) ? 4 : 0);
using Cfg = xqa::Config<XQA_HEAD_DIM, XQA_KV == 0 ? 2 : 1, XQA_MT, kKpw, kStages, kMinb, XQA_DIAG, XQA_L2,
                        XQA_SWAP, XQA_SD>;
static_assert(XQA_HEAD_DIM == 64 || XQA_HEAD_DIM == 128 || XQA_HEAD_DIM == 256, "head dim");
static_assert(XQA_MT == 1 || XQA_MT == 2, "MT");
static_assert(XQA_OUT == 0 || XQA_KV != 0, "fp8 output needs fp8 KV");

template <bool SWAP, bool SD>  // a template, so that the kernels not picked are not instantiated
constexpr auto pick_kernel() {
  if constexpr (SWAP) return xqa::xqa_decode_swap_kernel<QT, XQA_KV, XQA_OUT, Cfg>;
  else if constexpr (SD) return xqa::xqa_decode_sd_kernel<QT, XQA_KV, XQA_OUT, Cfg>;
  else return xqa::xqa_decode_kernel<QT, XQA_KV, XQA_OUT, Cfg>;
}
auto kernel = pick_kernel<Cfg::SWAP, Cfg::SD>();

constexpr int kMaxDevices = 64;
int g_smem_set[kMaxDevices] = {0};

}  // namespace

// xqa_params_size / xqa_params_offsets / xqa_params_fields (attncore/abi.h)
AC_EXPORT_LAYOUT(xqa_params, XqaParams, XQA_PARAMS_FIELDS)

extern "C" const char* xqa_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

extern "C" int xqa_info(int* out) {
  out[0] = Cfg::ROWS;
  out[1] = Cfg::TILE;
  out[2] = xqa::NT;
  out[3] = Cfg::SMEM;
  out[4] = Cfg::STAGES;
  out[5] = Cfg::D;
  out[6] = Cfg::KVB;
  out[7] = 0;
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM);
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, xqa::NT, Cfg::SMEM) == cudaSuccess) out[7] = n;
  }
  cudaGetLastError();  // clear a sticky "no device" error
  return 0;
}

extern "C" int xqa_run(const XqaParams* p, cudaStream_t stream) {
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e != cudaSuccess) return (int)e;
  if (prev != p->device) {
    e = cudaSetDevice(p->device);
    if (e != cudaSuccess) return (int)e;
  }
  if (p->device >= 0 && p->device < kMaxDevices && !g_smem_set[p->device]) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM);
    if (e == cudaSuccess) g_smem_set[p->device] = 1;
  }
  if (e == cudaSuccess) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)p->m_groups, (unsigned)(p->num_splits * p->num_kv_heads), (unsigned)p->batch);
    cfg.blockDim = dim3(xqa::NT, 1, 1);
    cfg.dynamicSmemBytes = Cfg::SMEM;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    cfg.numAttrs = 0;
    if (p->enable_pdl) {
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
    }
    e = cudaLaunchKernelEx(&cfg, kernel, *p);
  }
  if (prev != p->device) cudaSetDevice(prev);
  return (int)e;
}
