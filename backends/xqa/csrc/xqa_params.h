// attncore xqa: the params struct shared by the kernel and the ctypes mirror in binding.py.
// Keep the field order, types and padding in sync with ``binding.XqaParams`` (checked at load
// time through xqa_params_size()).  No torch headers: plain pointers, strides and sizes.
#pragma once
#include <stdint.h>

struct XqaParams {
  // Tensors (device pointers).
  const void* q;             // [B*QL, Hq, D] q dtype, last dim contiguous
  const void* k;             // paged K cache, element (page, head, slot, d) at
  const void* v;             //   page*stride_page + head*stride_head + slot*stride_tok + d
  void* out;                 // [B*QL, Hq, D] out dtype
  float* lse;                // [B*QL, Hq] float32 base 2, or null
  const int* page_table;     // block_tables [B, stride] or kv_indices (CSR, with page_table_indptr)
  const int* page_table_indptr;  // null: row b starts at b*page_table_stride; else at indptr[b]
  const int* seq_lens;       // [B] kv length of each request (new draft tokens included)
  const float* sinks;        // [Hq] natural-log sink logits, or null
  const uint16_t* spec_mask; // [B, QL, mask_words16] packed draft mask (LSB first), or null
  float* ws_partial_o;       // split-KV partial outputs (fp32)
  float* ws_partial_lse;     // split-KV partial LSE (base 2)
  int* ws_counters;          // one arrival counter per (b, kv head, m-group); zero between launches
  // Strides in elements.
  int64_t q_stride_tok, q_stride_head;
  int64_t o_stride_tok, o_stride_head;
  int64_t lse_stride_tok, lse_stride_head;
  int64_t k_stride_page, k_stride_head, k_stride_tok;
  int64_t v_stride_page, v_stride_head, v_stride_tok;
  int64_t page_table_stride;
  // Sizes.
  int32_t batch, num_q_heads, num_kv_heads, group;
  int32_t q_len, rows, m_groups, num_splits;
  int32_t page_size_log2, window_left, causal, mask_words16;
  // Scales: logits in base 2 are qk * qk_scale_log2; out = softmax @ v * out_scale.
  float qk_scale_log2, out_scale;
  int32_t enable_pdl, device;
};
