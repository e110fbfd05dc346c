// attncore cuda_fa2: the params structs, the one contract between binding.py (ctypes) and the kernels.
//
// Notation
//   B      requests in the batch            Hq / Hkv  query / kv heads,  G = Hq / Hkv (GQA group)
//   D      head dim (64, 128, 256)          qo_len_i / kv_len_i  rows / keys of request i
//   packed row   r = tok * G + g: query token `tok` of request i, head `kvh * G + g` (GQA rows packed)
//   work item    one CTA: (request, first packed row, kv range [kv_begin, kv_end), partial slot)
//   split        a kv range of a request computed by its own CTA; partials merged by fa2_merge
//   page         paged KV: token t of request i is page kv_indices[kv_indptr[i] + t / page_size],
//                slot t % page_size; ragged KV (page_size 0): token kv_indptr[i] + t
//
// Layout is expressed by strides (elements): K element (page p, slot s, head h, d) is at
//   k + p * k_stride_p + s * k_stride_n + h * k_stride_h + d      (ragged: p = 0, s = token index)
// so NHD and HND paged/ragged caches, tuple caches and non-contiguous views all go through the
// same code.  Only the last dim must be contiguous.
//
// Keep in sync with binding.py (_Fa2Params / _Fa2MergeParams); fa2_params_size() guards it.
#pragma once
#include <stdint.h>

struct Fa2Params {
  const void* q;            // [nnz_q, Hq, D] strides q_stride_n, q_stride_h
  const void* k;            // see above
  const void* v;
  void* o;                  // [nnz_q, Hq, D] strides o_stride_n, o_stride_h (q dtype)
  float* lse;               // [nnz_q, Hq] base 2, or null
  float* o_part;            // [tmp_rows, Hq, D] float32 partial outputs of split work items
  float* lse_part;          // [tmp_rows, Hq]
  const int32_t* qo_indptr; // [B + 1]
  const int32_t* kv_indptr; // [B + 1] page offsets (paged) or token offsets (ragged)
  const int32_t* kv_indices;// [nnz_pages] or null (ragged)
  const int32_t* kv_lens;   // [B]
  const uint8_t* mask;      // packed custom mask (LSB first) or null
  const int32_t* mask_indptr; // [B + 1] byte offsets
  const float* sinks;       // [Hq] natural-log sink logits, or null
  const float* alibi_slopes;// [Hq] or null
  const int32_t* work;      // [num_work, 5]: request, first packed row, kv_begin, kv_end, slot (-1: final)
  int64_t q_stride_n, q_stride_h;
  int64_t k_stride_p, k_stride_n, k_stride_h;
  int64_t v_stride_p, v_stride_n, v_stride_h;
  int64_t o_stride_n, o_stride_h;
  int32_t num_qo_heads, num_kv_heads, group, page_size;
  int32_t num_work, window_left, device, causal_override;  // causal_override unused (reserved)
  float scale_log2;         // sm_scale * q_scale * k_scale * log2(e)   (no soft cap)
  float softcap_pre;        // sm_scale * q_scale * k_scale / cap       (soft cap)
  float softcap_post;       // cap * log2(e)
  float out_scale;          // v_scale / o_scale
  float rope_rcp_scale;     // 1 / rope_scale
  float rope_log2_theta;    // log2(rope_theta)
  int32_t page_shift;       // log2(page_size) when it is a power of two, else -1 (prefill90 only)
  int32_t kv_same_strides;  // 1: K and V share page/token/head strides (prefill90: one offset per row)
  // prefill90 paged copies: row (page p, slot s) of K at k + (p * k_row_sp + s * k_row_sn) * k_row_unit
  // (+ head, column), the bracket a 32-bit product; binding.py picks the unit (the token stride when it
  // divides the page stride, else 16 bytes) and checks that every row of the cache fits.
  int32_t k_row_unit, k_row_sp, k_row_sn;
  int32_t v_row_unit, v_row_sp, v_row_sn;
};

struct Fa2MergeParams {
  const float* o_part;      // [tmp_rows, Hq, D]
  const float* lse_part;    // [tmp_rows, Hq]
  void* o;                  // [nnz_q, Hq, D]
  float* lse;               // [nnz_q, Hq] or null
  const int32_t* qo_indptr; // [B + 1]
  const int32_t* num_splits;// [B]: splits of request i (1: written directly by the main kernel)
  const int32_t* tmp_off;   // [B]: first tmp row of request i (split s, token t: tmp_off + s * qo_len + t)
  const float* sinks;       // [Hq] or null
  int64_t o_stride_n, o_stride_h;
  int32_t num_qo_heads, batch, nnz_q, device;
  float out_scale;
  int32_t pad0;
};
