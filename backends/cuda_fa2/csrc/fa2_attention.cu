// attncore cuda_fa2: one specialization per build (compile-time -D flags), plain C entry points.
//
// Notation: see fa2_attention.cuh.  Specialization defines (set by specs.py):
//   FA2_DTYPE    0 fp16, 1 bf16 (q and out)       FA2_KV     0 same as q, 1 e4m3, 2 e5m2
//   FA2_HEAD_DIM 64 / 128 / 256 (192: prefill90)   FA2_MASK   0 none, 1 causal, 2 custom
//   FA2_HEAD_DIM_VO  V's and the output's head dim: FA2_HEAD_DIM, or 128 under 192 (prefill90, DeepSeek's shape)
//   FA2_SOFTCAP, FA2_ALIBI, FA2_ROPE   0 / 1       FA2_CONFIG 0 prefill tile (CTA_Q 128; 64 at d256),
//                                                             1 decode tile (CTA_Q 16, 4 warps on KV),
//                                                             2 prefill64 tile (CTA_Q 64: causal, qo ~ kv)
//                                                             3 prefill90: the sm_90a wgmma kernel
//                                                               (fa2_sm90.cuh; 16-bit KV, d64/d128/d256,
//                                                               mask none/causal, no features)
//                                                             4 pod90: prefill90's POD kernel, a prefill
//                                                               part (FA2_MASK, FA2_H_PIPE) and a decode
//                                                               part (plain loop, causal) in one grid
// Entry points (extern "C", return a cudaError_t as int):
//   fa2_run(const Fa2Params*, cudaStream_t)        main kernel, grid (num_work, Hkv) (not pod90; the persistent
//                                                  prefill90: one CTA per resident slot, Cfg90::PERSIST; prefill90
//                                                  also gets ragged K/V's TMA maps, encoded here: kv_tma)
//   fa2_run_pod(p0, p1, order, n, cudaStream_t)    pod90 only: grid (n, Hkv), order[n] (fa2_sm90_pod_kernel)
//   fa2_merge(const Fa2MergeParams*, cudaStream_t) split-KV merge, grid (num_rows, Hq)
//   (CUDA-graph mode: both grids are capacities, the live counts are read on the device)
//   fa2_info(int* out8)   CTA_Q, KVT, threads, smem bytes, D, max CTAs per SM, SMs (0, 0 without a GPU),
//                         persistent grid (1: prefill90's Cfg90::PERSIST, whose counters a second launch may share)
//   fa2_params_size(), fa2_merge_params_size()     ABI guards for the ctypes mirror: sizeof, and
//   fa2_params_offsets(int*, cap), fa2_params_fields()   every field's offset and name (attncore/abi.h;
//   (likewise fa2_merge_params_*)                         binding.py checks them field by field)
//   fa2_error_string(int)
#include "fa2_attention.cuh"
#if defined(FA2_CONFIG) && (FA2_CONFIG == 3 || FA2_CONFIG == 4)
#include <cudaTypedefs.h>  // cuTensorMapEncodeTiled's type, for the driver entry point (no libcuda link)

#include "fa2_sm90.cuh"
#endif

#ifndef FA2_DTYPE
#define FA2_DTYPE 1
#endif
#ifndef FA2_KV
#define FA2_KV 0
#endif
#ifndef FA2_HEAD_DIM
#define FA2_HEAD_DIM 128
#endif
#ifndef FA2_HEAD_DIM_VO
#define FA2_HEAD_DIM_VO FA2_HEAD_DIM
#endif
#ifndef FA2_MASK
#define FA2_MASK 1
#endif
#ifndef FA2_SOFTCAP
#define FA2_SOFTCAP 0
#endif
#ifndef FA2_ALIBI
#define FA2_ALIBI 0
#endif
#ifndef FA2_ROPE
#define FA2_ROPE 0
#endif
#ifndef FA2_CONFIG
#define FA2_CONFIG 0
#endif

// tile-shape overrides (tuning experiments); defaults are the shipped configs
#ifndef FA2_P_NWQ
#define FA2_P_NWQ 4
#endif
#ifndef FA2_P_NMQ
#define FA2_P_NMQ (FA2_HEAD_DIM == 256 ? 1 : 2)
#endif
#ifndef FA2_P_NNK
#define FA2_P_NNK (FA2_HEAD_DIM == 256 ? 2 : 4)
#endif
#ifndef FA2_P_STAGES
#define FA2_P_STAGES 2
#endif
#ifndef FA2_D_NWKV
#define FA2_D_NWKV 4
#endif
#ifndef FA2_D_NNK
#define FA2_D_NNK 1
#endif
#ifndef FA2_D_STAGES
#define FA2_D_STAGES (FA2_HEAD_DIM == 256 ? 2 : 3)
#endif
#ifndef FA2_D_MINB
#define FA2_D_MINB 2
#endif
#ifndef FA2_D_PF
#define FA2_D_PF 0  // page-id prefetch measured slower on H100 (D1 2.74 vs 2.86 TB/s), kept as an option
#endif
#ifndef FA2_P_MINB
#define FA2_P_MINB 2
#endif
namespace {
using T = std::conditional<FA2_DTYPE == 1, __nv_bfloat16, __half>::type;
constexpr int D = FA2_HEAD_DIM, DV = FA2_HEAD_DIM_VO;
static_assert(((D == 64 || D == 128 || D == 256) && DV == D) || (D == 192 && DV == 128 && FA2_CONFIG == 3),
              "head dims (qk / vo): 64, 128, 256, and 192 / 128 (prefill90)");

#if FA2_CONFIG == 3 || FA2_CONFIG == 4
#ifndef FA2_H_KVT
// keys per K/V tile: 192 at d64 (H100 2026-11-25, pipelined loop: P2 d64 0.187 / 0.188 ms against 0.195 / 0.195
// with 128; the plain loop 0.212 / 0.214 against 0.213), 128 at d128 (three 64 KiB stages and the Q tile fill
// shared memory).  d256: the 64 KiB Q tile leaves room for two stages of 80 keys (H200 2026-11-29, the plain
// loop: P2 d256 0.305 ms against 0.317 with 64); the pipelined loop without a producer holds two stages and needs
// a third, of 48 keys (the warp-specialized one frees K and V apart instead: Cfg90::SEPKV)
// d192 / 128 (warp-specialized only) as d256 in two stages of K and V on their own barriers, of 128 keys: 208 KiB
// (H200 2026-11-30, same run, the pipelined loop: P5-d192 0.286 ms against 0.307 with three stages of 80 keys and
// 0.315 with three or four of 64; ragged 8 x 2k 0.669 against 0.714-0.737; non-causal 1 x 4k 0.524 against 0.550-0.584)
#define FA2_H_KVT (D == 64 ? 192 : D <= 192 ? 128 : (FA2_H_PIPE && !FA2_H_WS ? 48 : 80))
#endif
#ifndef FA2_H_NWG
#define FA2_H_NWG 2
#endif
#ifndef FA2_H_PIPE
#define FA2_H_PIPE 0
#endif
#ifndef FA2_H_WS
#define FA2_H_WS 0  // 1: warp-specialized (a producer warpgroup does every copy, 3-stage mbarrier ring)
#endif
#ifndef FA2_H_PREG
#define FA2_H_PREG 56  // WS: producer registers (setmaxnreg); the consumers get the rest (224 either way)
#endif
#ifndef FA2_H_STAGES
#define FA2_H_STAGES (D >= 192 ? (FA2_H_PIPE && !FA2_H_WS ? 3 : 2) : (FA2_H_PIPE || FA2_H_WS) ? 3 : 2)
#endif
#ifndef FA2_H_SEPKV
#define FA2_H_SEPKV (FA2_H_WS && FA2_H_STAGES == 2)  // K and V on their own barriers (Cfg90::SEPKV)
#endif
#ifndef FA2_H_PERSIST
// WS prefill90: one CTA per resident slot runs the work units in turn (Cfg90::PERSIST).  On for the plain loop
// (paged K/V) and for the pipelined one at d64, off for the pipelined one at d128 / d256 (H200 2026-11-29, same
// run: P3 page 16 0.726 ms against 0.762, P4 1.169 against 1.186; P1 causal 0.284 against 0.278, non-causal 0.521
// against 0.507; P2 d64 0.181 against 0.186 with Cfg90::QLATE, 0.191 without)
#define FA2_H_PERSIST (FA2_H_WS && (!FA2_H_PIPE || D == 64))
#endif
#ifndef FA2_H_TMA
// WS prefill90, ragged K/V: whole tiles by TMA (kv_tma below).  H200 2026-11-29, same run against the cp.async
// copies (0): P1 causal 0.244 / 0.250 ms, non-causal 0.456 / 0.462, P2 d64 0.167 / 0.169, d256 0.260 / 0.269
#define FA2_H_TMA 1
#endif
static_assert(FA2_KV == 0 && FA2_MASK != 2 && !FA2_SOFTCAP && !FA2_ALIBI && !FA2_ROPE && (D <= 128 || FA2_CONFIG == 3),
              "prefill90 serves 16-bit KV, d64/d128/d256/d192x128 (pod90 d64/d128), mask none/causal, no features");
using Cfg90 = fa2::sm90::Cfg90<D, FA2_H_KVT, FA2_H_NWG, FA2_H_STAGES, FA2_H_PIPE != 0, FA2_H_WS != 0, FA2_H_PREG,
                               FA2_H_SEPKV != 0, FA2_H_PERSIST != 0 && FA2_H_WS != 0 && FA2_CONFIG == 3, DV>;
#if FA2_CONFIG == 4
static_assert(FA2_H_WS != 0 && FA2_MASK != 2, "pod90: warp-specialized, prefill mask none/causal");
// the decode part: paged K/V, the plain loop (its producer cannot feed the pipelined one: cuda_fa2.md, session 19)
using Cfg90D = fa2::sm90::Cfg90<D, FA2_H_KVT, FA2_H_NWG, FA2_H_STAGES, false, true, FA2_H_PREG, false>;  // KVSPLIT
auto kernel = fa2::sm90::fa2_sm90_pod_kernel<Cfg90, Cfg90D, T, FA2_MASK>;
#else
auto kernel = fa2::sm90::fa2_sm90_kernel<Cfg90, T, FA2_MASK>;
#endif
constexpr int kCtaQ = Cfg90::CTA_Q, kKvt = Cfg90::KVT, kThreads = Cfg90::NTHREADS, kSmem = Cfg90::smem_bytes;
constexpr bool kPersist = Cfg90::PERSIST;
#else
// <D, NWQ, NWKV, NMQ, NNK, STAGES>
using PrefillCfg = fa2::Config<D, FA2_P_NWQ, 1, FA2_P_NMQ, FA2_P_NNK, FA2_P_STAGES, FA2_P_MINB>;
using Prefill64Cfg = fa2::Config<D, 4, 1, 1, (D == 256 ? 2 : 4), 2, 2>;
using DecodeCfg = fa2::Config<D, 1, FA2_D_NWKV, 1, FA2_D_NNK, FA2_D_STAGES, FA2_D_MINB, FA2_D_PF != 0>;
using Cfg = std::conditional<FA2_CONFIG == 1, DecodeCfg,
                             std::conditional<FA2_CONFIG == 2, Prefill64Cfg, PrefillCfg>::type>::type;
using SM = fa2::Smem<Cfg, FA2_KV == 0 ? 2 : 1>;

auto kernel = fa2::fa2_attention_kernel<Cfg, T, FA2_KV, FA2_MASK, FA2_SOFTCAP != 0, FA2_ALIBI != 0, FA2_ROPE != 0>;
constexpr int kCtaQ = Cfg::CTA_Q, kKvt = Cfg::KVT, kThreads = Cfg::NTHREADS, kSmem = (int)SM::bytes;
constexpr bool kPersist = false;
#endif

// Makes `dev` current for one entry point and gives the caller its device back on return: a
// process serving cuda:1 with cuda:0 current must find cuda:0 current after every launch.
struct DeviceScope {
  int prev = -1;
  int err = 0;
  explicit DeviceScope(int dev) {
    err = (int)cudaGetDevice(&prev);
    if (err == 0 && prev != dev) err = (int)cudaSetDevice(dev);
    else if (err == 0) prev = -1;  // already current: nothing to restore
  }
  ~DeviceScope() {
    if (prev >= 0) cudaSetDevice(prev);
  }
};

#if FA2_CONFIG == 3
// prefill90's TMA maps of ragged K and V (fa2_sm90_load.cuh: KvTma), encoded per launch; none (cp.async copies)
// where the build has no producer warpgroup, K/V are paged, the driver lacks the entry point or refuses a tensor
// (a base or stride not a multiple of 16 bytes)
bool encode_map(fa2::sm90::TmaMap* out, const void* base, int cols, int64_t rows, int heads, int64_t stride_h,
                int64_t stride_n) {
  static_assert(sizeof(fa2::sm90::TmaMap) == sizeof(CUtensorMap), "a tensor map's bytes");
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    const bool ok = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                                     &found) == cudaSuccess && found == cudaDriverEntryPointSuccess;
#else  // (CUDA 12.0-12.4: the unversioned lookup, deprecated since)
    const bool ok = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found) == cudaSuccess &&
                    found == cudaDriverEntryPointSuccess;
#endif
    return ok ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f) : nullptr;
  }();
  if (encode == nullptr) return false;
  // (column, kv head, token); box: one 128-byte column block of KVT tokens, 128B-swizzled as the stage
  const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)heads, (cuuint64_t)rows};
  const cuuint64_t strides[2] = {(cuuint64_t)stride_h * sizeof(T), (cuuint64_t)stride_n * sizeof(T)};
  const cuuint32_t box[3] = {64, 1, (cuuint32_t)kKvt}, step[3] = {1, 1, 1};
  return encode(reinterpret_cast<CUtensorMap*>(out),
                FA2_DTYPE == 1 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                const_cast<void*>(base), dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

fa2::sm90::KvTma kv_tma(const Fa2Params& p) {
  fa2::sm90::KvTma m{};
  m.on = FA2_H_TMA && Cfg90::WS && p.page_size == 0 && p.kv_rows > 0 &&
         encode_map(&m.k, p.k, D, p.kv_rows, p.num_kv_heads, p.k_stride_h, p.k_stride_n) &&
         encode_map(&m.v, p.v, DV, p.kv_rows, p.num_kv_heads, p.v_stride_h, p.v_stride_n);
  return m;
}
#endif

int g_resident[64];  // kPersist: CTAs resident on the whole device at once (the persistent grid), per device

int setup(int dev) {
  static bool done[64] = {false};
  if (dev < 0 || dev >= 64) return (int)cudaErrorInvalidDevice;
  if (!done[dev]) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return (int)e;
    if (kPersist) {
      int per_sm = 0, sms = 0;
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmem);
      if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      if (e != cudaSuccess) return (int)e;
      if (per_sm * sms <= 0) return (int)cudaErrorInvalidConfiguration;
      g_resident[dev] = per_sm * sms;
    }
    done[dev] = true;
  }
  return 0;
}
}  // namespace

#define FA2_EXPORT extern "C" __attribute__((visibility("default")))
#if defined(FA2_TRACE) && (FA2_CONFIG == 3 || FA2_CONFIG == 4)
// prefill90's clock64 timeline (csrc/fa2_sm90_trace.cuh) into `host` (sizeof g_trace bytes), then zeroed: a later
// launch with fewer tiles must not leave the stamps of an earlier, longer one behind
FA2_EXPORT int fa2_trace_dump(void* host) {
  int err = (int)cudaMemcpyFromSymbol(host, fa2::sm90::g_trace, sizeof(fa2::sm90::g_trace));
  void* dev = nullptr;
  if (err == 0) err = (int)cudaGetSymbolAddress(&dev, fa2::sm90::g_trace);
  if (err == 0) err = (int)cudaMemset(dev, 0, sizeof(fa2::sm90::g_trace));
  return err;
}
#endif

// fa2_params_size / _offsets / _fields and the same for fa2_merge_params (attncore/abi.h)
AC_EXPORT_LAYOUT(fa2_params, Fa2Params, FA2_PARAMS_FIELDS)
AC_EXPORT_LAYOUT(fa2_merge_params, Fa2MergeParams, FA2_MERGE_PARAMS_FIELDS)
FA2_EXPORT const char* fa2_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

FA2_EXPORT int fa2_info(int* out, int dev) {
  out[0] = kCtaQ;
  out[1] = kKvt;
  out[2] = kThreads;
  out[3] = kSmem;
  out[4] = D;
  out[5] = 0;
  out[6] = 0;
  out[7] = kPersist ? 1 : 0;
  if (dev >= 0) {
    DeviceScope scope(dev);
    if (scope.err) return scope.err;
    int e = setup(dev);
    if (e) return e;
    int n = 0;
    e = (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, kSmem);
    if (e) return e;
    out[5] = n;
    cudaDeviceProp prop;
    e = (int)cudaGetDeviceProperties(&prop, dev);
    if (e) return e;
    out[6] = prop.multiProcessorCount;
  }
  return 0;
}

#if FA2_CONFIG == 4
FA2_EXPORT int fa2_run(const Fa2Params*, cudaStream_t) { return (int)cudaErrorNotSupported; }  // fa2_run_pod

FA2_EXPORT int fa2_run_pod(const Fa2Params* p0, const Fa2Params* p1, const int32_t* order, int n,
                           cudaStream_t stream) {
  DeviceScope scope(p0->device);
  if (scope.err) return scope.err;
  int e = setup(p0->device);
  if (e) return e;
  if (n <= 0) return 0;
  dim3 grid(n, p0->num_kv_heads);
  kernel<<<grid, kThreads, kSmem, stream>>>(*p0, *p1, order);
  return (int)cudaGetLastError();
}
#else
FA2_EXPORT int fa2_run(const Fa2Params* p, cudaStream_t stream) {
  DeviceScope scope(p->device);
  if (scope.err) return scope.err;
  int e = setup(p->device);
  if (e) return e;
  if (p->num_work <= 0) return 0;
  // kPersist: one CTA per resident slot, each running units (item, kv head) in turn (CUDA-graph mode: num_work is
  // the capacity, the kernel reads the live count).  Units shared with a second launch (sched_ctas, prefill90
  // only): the first has sched_base CTAs, the second the rest.
  const int64_t units = (int64_t)p->num_work * p->num_kv_heads;
  const int64_t ctas = !p->sched_ctas ? (kPersist ? (units < g_resident[p->device] ? units : g_resident[p->device])
                                                  : units)
                                      : (p->sched_steal ? p->sched_ctas - p->sched_base : p->sched_base);
  if (p->sched_ctas && (FA2_CONFIG != 3 || p->sched_base <= 0 || ctas <= 0))
    return (int)cudaErrorInvalidValue;
  dim3 grid = kPersist || p->sched_ctas ? dim3((unsigned)ctas, 1) : dim3(p->num_work, p->num_kv_heads);
#if FA2_CONFIG == 3
  kernel<<<grid, kThreads, kSmem, stream>>>(*p, kv_tma(*p));
#else
  kernel<<<grid, kThreads, kSmem, stream>>>(*p);
#endif
  return (int)cudaGetLastError();
}
#endif

FA2_EXPORT int fa2_merge(const Fa2MergeParams* p, cudaStream_t stream) {
  DeviceScope scope(p->device);
  if (scope.err) return scope.err;
  if (p->num_rows <= 0) return 0;
  dim3 grid(p->num_rows, p->num_qo_heads);
  fa2::fa2_merge_kernel<T, DV><<<grid, DV / 4, 0, stream>>>(*p);  // (the partials' rows: V's head dim)
  return (int)cudaGetLastError();
}
