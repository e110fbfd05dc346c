// attncore xqa: the params struct shared by the kernel and the ctypes mirror in binding.py.
// Declared from the field list below, which also generates xqa_params_offsets / xqa_params_fields
// (attncore/abi.h): binding.XqaParams is checked against it field by field at load, so a field
// added, reordered or retyped on one side only is an error naming it, not a kernel reading garbage.
// No torch headers: plain pointers, strides and sizes.
#pragma once
#include <stdint.h>

#include "attncore/abi.h"

#define XQA_PARAMS_FIELDS(F)                                                                              \
  /* Tensors (device pointers). */                                                                        \
  F(const void*, q)                /* [B*QL, Hq, D] q dtype, last dim contiguous */                       \
  F(const void*, k)                /* paged K cache, element (page, head, slot, d) at */                  \
  F(const void*, v)                /*   page*stride_page + head*stride_head + slot*stride_tok + d */      \
  F(void*, out)                    /* [B*QL, Hq, D] out dtype */                                          \
  F(float*, lse)                   /* [B*QL, Hq] float32 base 2, or null */                               \
  F(const int*, page_table)        /* block_tables [B, stride] or kv_indices (CSR, with indptr) */        \
  F(const int*, page_table_indptr) /* null: row b starts at b*page_table_stride; else at indptr[b] */     \
  F(const int*, seq_lens)          /* [B] kv length of each request (new draft tokens included) */        \
  F(const float*, sinks)           /* [Hq] natural-log sink logits, or null */                            \
  F(const uint16_t*, spec_mask)    /* [B, QL, mask_words16] packed draft mask (LSB first), or null */     \
  F(float*, ws_partial_o)          /* split-KV partial outputs (fp32) */                                  \
  F(float*, ws_partial_lse)        /* split-KV partial LSE (base 2) */                                    \
  F(int*, ws_counters)             /* one arrival counter per (b, kv head, m-group); 0 between launches */ \
  /* Strides in elements. */                                                                              \
  F(int64_t, q_stride_tok)                                                                                \
  F(int64_t, q_stride_head)                                                                               \
  F(int64_t, o_stride_tok)                                                                                \
  F(int64_t, o_stride_head)                                                                               \
  F(int64_t, lse_stride_tok)                                                                              \
  F(int64_t, lse_stride_head)                                                                             \
  F(int64_t, k_stride_page)                                                                               \
  F(int64_t, k_stride_head)                                                                               \
  F(int64_t, k_stride_tok)                                                                                \
  F(int64_t, v_stride_page)                                                                               \
  F(int64_t, v_stride_head)                                                                               \
  F(int64_t, v_stride_tok)                                                                                \
  F(int64_t, page_table_stride)                                                                           \
  /* Sizes. */                                                                                            \
  F(int32_t, batch)                                                                                       \
  F(int32_t, num_q_heads)                                                                                 \
  F(int32_t, num_kv_heads)                                                                                \
  F(int32_t, group)                                                                                       \
  F(int32_t, q_len)                                                                                       \
  F(int32_t, rows)                                                                                        \
  F(int32_t, m_groups)                                                                                    \
  F(int32_t, num_splits)                                                                                  \
  F(int32_t, page_size_log2)                                                                              \
  F(int32_t, window_left)                                                                                 \
  F(int32_t, causal)                                                                                      \
  F(int32_t, mask_words16)                                                                                \
  F(int32_t, kv_cap)               /* seq_lens[b] read as at most this: the block table's tokens */       \
  F(int32_t, max_page)             /* page ids read as at most this (unsigned): the caches' last page */  \
  /* Scales: logits in base 2 are qk * qk_scale_log2; out = softmax @ v * out_scale. */                   \
  F(float, qk_scale_log2)                                                                                 \
  F(float, out_scale)                                                                                     \
  F(int32_t, enable_pdl)                                                                                  \
  F(int32_t, device)

struct XqaParams {
  XQA_PARAMS_FIELDS(AC_FIELD_DECL)
};
