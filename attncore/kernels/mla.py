"""Paged MLA (DeepSeek multi-head latent attention, absorbed form) as one Triton kernel.

Every query head attends to one shared latent KV head (MQA): keys are ``concat(ckv, kpe)``, values are
``ckv``.  A program owns one tile of a request's query tokens and a block of heads; its ``BLOCK_Q *
BLOCK_H`` query rows (row ``r``: token ``r // BLOCK_H``, head ``r % BLOCK_H``) share every KV tile it
loads, so the 576-wide keys are read once per head block instead of once per head.

Layout choices (sm90, the default config of ``attncore.mla``: 32 rows, BLOCK_N 32, 8 warps, 2 stages):

* The 576-wide score is two ``tl.dot``s, ``q_nope @ ckv^T + q_pe @ kpe^T``: each head dim is a power
  of two (Triton's aranges must be), their sum is not.
* The 512-wide V is not split across programs: splitting would read every key twice (the score needs
  all 576 dims in each half) for a decode that is bound by reading the KV.  The fp32 accumulator
  [32, 512] is 64 registers per thread at 8 warps, q [32, 576] fp16 36 more; a KV stage
  (32 x 576 x 2 bytes = 36 KiB) twice fits shared memory with room for q.
* Page table indirection per key (``kv_indices[kv_indptr[b] + pos // PAGE_SIZE]``, slot
  ``pos % PAGE_SIZE``), so any page size works, 1 included; keys past ``kv_len`` are never loaded
  (masked loads), so whatever the unused slots of the last page hold (NaN) never reaches a result.
* Online softmax in fp32 in base 2 (scores pre-multiplied by ``sm_scale * log2(e)``); a row that sees
  no key (``kv_len`` 0, or causal with fewer keys than queries) writes 0 and LSE ``-inf``.
* Grid (head blocks, query tiles, requests): the head blocks of one request are launched next to each
  other, so its KV comes from HBM about once and from L2 for the other head blocks.
* Causal is bottom-right aligned: token ``i`` of a request sees positions ``<= kv_len - qo_len + i``;
  the KV loop stops at the last position any row of the tile sees.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_paged_fwd(
    QN, QP, CKV, KPE, OUT, LSE,
    QO_INDPTR, KV_INDPTR, KV_INDICES, KV_LENS,
    qk_scale_log2, num_heads,
    s_qn_t, s_qn_h, s_qp_t, s_qp_h,
    s_ckv_p, s_ckv_s, s_kpe_p, s_kpe_s,
    s_o_t, s_o_h, s_lse_t, s_lse_h,
    PAGE_SIZE: tl.constexpr, D_CKV: tl.constexpr, D_KPE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    h0 = tl.program_id(0) * BLOCK_H
    q_start = tl.program_id(1) * BLOCK_Q
    b = tl.program_id(2)
    q_begin = tl.load(QO_INDPTR + b)
    qo_len = tl.load(QO_INDPTR + b + 1) - q_begin
    if q_start >= qo_len:  # the grid covers the longest request (fixed under CUDA graphs)
        return
    kv_len = tl.load(KV_LENS + b)
    page_base = tl.load(KV_INDPTR + b)

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    rows = tl.arange(0, BLOCK_M)
    qi = q_start + rows // BLOCK_H  # token within the request
    head = h0 + rows % BLOCK_H
    row_ok = (qi < qo_len) & (head < num_heads)
    tok = (q_begin + qi).to(tl.int64)
    dc = tl.arange(0, D_CKV)
    dp = tl.arange(0, D_KPE)
    qn = tl.load(QN + tok[:, None] * s_qn_t + head[:, None] * s_qn_h + dc[None, :], mask=row_ok[:, None], other=0.0)
    qp = tl.load(QP + tok[:, None] * s_qp_t + head[:, None] * s_qp_h + dp[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_CKV], tl.float32)
    last_visible = kv_len - qo_len + qi  # causal: the last position each row sees
    kv_end = kv_len
    if CAUSAL:
        kv_end = tl.minimum(kv_len, kv_len - qo_len + q_start + BLOCK_Q)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < kv_len
        page = tl.load(KV_INDICES + page_base + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        ckv = tl.load(CKV + page[:, None] * s_ckv_p + slot[:, None] * s_ckv_s + dc[None, :],
                      mask=valid[:, None], other=0.0)
        kpe = tl.load(KPE + page[:, None] * s_kpe_p + slot[:, None] * s_kpe_s + dp[None, :],
                      mask=valid[:, None], other=0.0)
        s = tl.dot(qn, tl.trans(ckv)) + tl.dot(qp, tl.trans(kpe))
        s = s * qk_scale_log2
        keep = valid[None, :]
        if CAUSAL:
            keep = keep & (pos[None, :] <= last_visible[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet: no NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(ckv.dtype), ckv)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(OUT + tok[:, None] * s_o_t + head[:, None] * s_o_h + dc[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(LSE + tok * s_lse_t + head * s_lse_h, lse, mask=row_ok)
