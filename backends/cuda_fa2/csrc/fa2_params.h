// attncore cuda_fa2: the params structs, the one contract between binding.py (ctypes) and the kernels.
//
// Notation
//   B      requests in the batch            Hq / Hkv  query / kv heads,  G = Hq / Hkv (GQA group)
//   D      head dim (64, 128, 256)          qo_len_i / kv_len_i  rows / keys of request i
//   packed row   r = tok * G + g: query token `tok` of request i, head `kvh * G + g` (GQA rows packed)
//   work item    one CTA: (request, first packed row, kv range [kv_begin, kv_end), partial slot), the
//                schedule of attncore/core/schedule.py (shared with the Triton backend)
//   split        a kv range of a request computed by its own CTA; partials merged by fa2_merge
//   CUDA graphs  a captured launch keeps its grid and this struct (by value): in graph mode the grid is
//                the tables' capacity and the kernels read the live counts (work_count, merge_count)
//   page         paged KV: token t of request i is page kv_indices[kv_indptr[i] + t / page_size],
//                slot t % page_size; ragged KV (page_size 0): token kv_indptr[i] + t
//
// Layout is expressed by strides (elements): K element (page p, slot s, head h, d) is at
//   k + p * k_stride_p + s * k_stride_n + h * k_stride_h + d      (ragged: p = 0, s = token index)
// so NHD and HND paged/ragged caches, tuple caches and non-contiguous views all go through the
// same code.  Only the last dim must be contiguous.
//
// binding.py mirrors both structs in ctypes (Fa2Params, Fa2MergeParams) and checks the mirror field
// by field at load (fa2_params_offsets / fa2_merge_params_offsets, attncore/abi.h): the structs are
// declared from the field lists below, which also generate those exports, so the check cannot drift.
#pragma once
#include <stdint.h>

#include "attncore/abi.h"

#define FA2_PARAMS_FIELDS(F)                                                                              \
  F(const void*, q)              /* [nnz_q, Hq, D] strides q_stride_n, q_stride_h */                      \
  F(const void*, k)              /* see above */                                                          \
  F(const void*, v)                                                                                       \
  F(void*, o)                    /* [nnz_q, Hq, D] strides o_stride_n, o_stride_h (q dtype) */            \
  F(float*, lse)                 /* [nnz_q, Hq] base 2, or null */                                        \
  F(float*, o_part)              /* [tmp_rows, Hq, D] float32 partial outputs of split work items */      \
  F(float*, lse_part)            /* [tmp_rows, Hq] */                                                     \
  F(const int32_t*, qo_indptr)   /* [B + 1] */                                                            \
  F(const int32_t*, kv_indptr)   /* [B + 1] page offsets (paged) or token offsets (ragged) */             \
  F(const int32_t*, kv_indices)  /* [nnz_pages] or null (ragged) */                                       \
  F(const int32_t*, kv_lens)     /* [B] */                                                                \
  F(const uint8_t*, mask)        /* packed custom mask (LSB first) or null */                             \
  F(const int32_t*, mask_indptr) /* [B + 1] byte offsets */                                               \
  F(const float*, sinks)         /* [Hq] natural-log sink logits, or null */                              \
  F(const float*, alibi_slopes)  /* [Hq] or null */                                                       \
  F(const int32_t*, work)        /* [num_work, 5]: request, first packed row, kv_begin, kv_end, slot (-1: final) */ \
  F(const int32_t*, work_count)  /* CUDA-graph mode: the number of items (int workspace); CTAs past it exit. */ \
                                 /* null: every CTA of the grid (num_work) is an item */                  \
  F(int32_t*, sched)             /* the persistent grid's two counters (int workspace, zero between launches): */ \
                                 /* units handed out after the first round, CTAs that found none left */  \
  F(int64_t, q_stride_n)                                                                                  \
  F(int64_t, q_stride_h)                                                                                  \
  F(int64_t, k_stride_p)                                                                                  \
  F(int64_t, k_stride_n)                                                                                  \
  F(int64_t, k_stride_h)                                                                                  \
  F(int64_t, v_stride_p)                                                                                  \
  F(int64_t, v_stride_n)                                                                                  \
  F(int64_t, v_stride_h)                                                                                  \
  F(int64_t, o_stride_n)                                                                                  \
  F(int64_t, o_stride_h)                                                                                  \
  F(int32_t, num_qo_heads)                                                                                \
  F(int32_t, num_kv_heads)                                                                                \
  F(int32_t, group)                                                                                       \
  F(int32_t, page_size)                                                                                   \
  F(int32_t, num_work)                                                                                    \
  F(int32_t, window_left)                                                                                 \
  F(int32_t, device)                                                                                      \
  /* one request, unsplit, without a window, not graph mode (backends/cuda_fa2/plan.py: build_schedule): a     \
     CTA's item from its index, no table read.  one_req 1: item i is the request's row tile i; -1: row tile    \
     num_work - 1 - i (causal: the longest first); 0: items from `work`, the request's offsets from the index  \
     tables. */                                                                                            \
  F(int32_t, one_req)                                                                                     \
  F(int32_t, one_qo_start)       /* its first query token (qo_indptr[0]) */                               \
  F(int32_t, one_qo_len)                                                                                  \
  F(int32_t, one_kv_len)                                                                                  \
  F(int32_t, one_kv_base)        /* kv_indptr[0] */                                                       \
  F(float, scale_log2)           /* sm_scale * q_scale * k_scale * log2(e)   (no soft cap) */             \
  F(float, softcap_pre)          /* sm_scale * q_scale * k_scale / cap       (soft cap) */                \
  F(float, softcap_post)         /* cap * log2(e) */                                                      \
  F(float, out_scale)            /* v_scale / o_scale */                                                  \
  F(float, rope_rcp_scale)       /* 1 / rope_scale */                                                     \
  F(float, rope_log2_theta)      /* log2(rope_theta) */                                                   \
  F(int32_t, page_shift)         /* log2(page_size) when a power of two, else -1 (prefill90 only) */      \
  F(int32_t, kv_same_strides)    /* 1: K and V share page/token/head strides (prefill90: one offset) */   \
  /* prefill90 paged copies: row (page p, slot s) of K at k + (p * k_row_sp + s * k_row_sn) * k_row_unit  \
     (+ head, column), the bracket a 32-bit product; binding.py picks the unit (the token stride when it  \
     divides the page stride, else 16 bytes) and checks that every row of the cache fits. */              \
  F(int32_t, k_row_unit)                                                                                  \
  F(int32_t, k_row_sp)                                                                                    \
  F(int32_t, k_row_sn)                                                                                    \
  F(int32_t, v_row_unit)                                                                                  \
  F(int32_t, v_row_sp)                                                                                    \
  F(int32_t, v_row_sn)                                                                                    \
  /* prefill90 sharing its units with a second launch (POD's SM split: the prefill's units left when the     \
     decode is done taken over on the decode's SMs).  sched_ctas 0: a launch of its own.  Else the two       \
     launches have sched_ctas CTAs in all, the first sched_base of them.  The persistent grid's first launch  \
     starts with units 0 .. sched_base - 1, its second (sched_steal 1) takes every unit from the counters;   \
     the one-unit grid takes every CTA's unit from the counters in both. */                              \
  F(int32_t, sched_base)                                                                                  \
  F(int32_t, sched_ctas)                                                                                  \
  F(int32_t, sched_steal)                                                                                 \
  /* a prefill one-unit grid (prefill90's not persistent, the FA2 kernel's; not graph mode): the order its  \
     units start in, launch or counter order u.  0: head-major (unit u: item u % num_work of kv head         \
     u / num_work).  g > 1: item-major within groups of g kv heads (g divides Hkv), so that every head's      \
     longest items start early (backends/cuda_fa2/plan.py: launch_group). */                                \
  F(int32_t, head_group)                                                                                  \
  /* prefill90 ragged K/V: the rows (tokens) of K and V, the extent of the TMA tensor maps the launcher      \
     encodes (fa2_attention.cu: full tiles by TMA); 0 (paged): cp.async copies only */                      \
  F(int64_t, kv_rows)

#define FA2_MERGE_PARAMS_FIELDS(F)                                                                        \
  F(const float*, o_part)        /* [part_rows, Hq, D] */                                                 \
  F(const float*, lse_part)      /* [part_rows, Hq] */                                                    \
  F(void*, o)                    /* [nnz_q, Hq, D] */                                                     \
  F(float*, lse)                 /* [nnz_q, Hq] or null */                                                \
  F(const int32_t*, merge_table) /* [num_rows, 4]: out row, first partial row, partial row stride, splits */ \
                                 /* (split s of the row is partial row first + s * stride; schedule.py) */ \
  F(const int32_t*, merge_count) /* CUDA-graph mode: the rows in the table; CTAs past it exit. null: num_rows */ \
  F(const float*, sinks)         /* [Hq] or null */                                                       \
  F(int64_t, o_stride_n)                                                                                  \
  F(int64_t, o_stride_h)                                                                                  \
  F(int32_t, num_qo_heads)                                                                                \
  F(int32_t, num_rows)           /* grid.x: the table's rows, or its capacity in CUDA-graph mode */       \
  F(int32_t, device)                                                                                      \
  F(float, out_scale)

struct Fa2Params {
  FA2_PARAMS_FIELDS(AC_FIELD_DECL)
};

struct Fa2MergeParams {
  FA2_MERGE_PARAMS_FIELDS(AC_FIELD_DECL)
};
