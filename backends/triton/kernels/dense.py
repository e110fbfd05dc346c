"""Hopper fast path for dense prefill: ragged KV (paged KV once gathered), mask none / causal,
no logit transforms.

The generic kernel (attention.py) packs the query heads of a KV group into the rows of a tile and
gathers K/V with pointer loads.  This kernel reads Q/K/V through tensor descriptors (TMA) built on
the device per (request, head): rows past a request's end are zero-filled by the copy engine, so
no address arithmetic or load masks run in the KV loop.  ``WS`` runs the loop under Triton's
Hopper warp specialization (one loop only: Triton 3.6 cannot specialize a loop next to another);
config.dense_candidates holds the measured configs (H100, backends/triton/bench/triton.md: P1 causal 476-485
TFLOP/s with WS 128x64 tiles, the generic kernel 402-412).

One program per (work item, query head); a work item is (request, first query row), planned on
the host, heaviest first.  ``heads_first`` (a plan decision, see backend._heads_first) orders the
program ids over the heads first, so that the launch is heaviest first across all heads;
otherwise over the items first, so that the items of one head, which share K/V tiles, run
together in L2.  GQA: query head h reads kv head h // G.  Scores are kept in base 2 (LSE base
2), like attention.py.  Requires qk_scale > 0 (the row max is taken before scaling).
"""

from __future__ import annotations

import triton
import triton.language as tl

from attncore.backends.triton.kernels.attention import with_sink
from attncore.kernels.launch import fast_launcher


@triton.jit
def _mask(qk, start_n, m0, kv_len, off, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    # index vectors built from scalars here: inside a warp-specialized loop, a captured index
    # tensor gave wrong causal results with Triton 3.6
    tok = start_n + tl.arange(0, BLOCK_N)
    keep = tok[None, :] < kv_len
    if CAUSAL:
        keep = keep & (tok[None, :] <= (m0 + off + tl.arange(0, BLOCK_M))[:, None])
    return tl.where(keep, qk, float("-inf"))


@triton.jit
def _dense_loop(acc, l_i, m_i, q, desc_k, desc_v, lo, hi, mask_from, m0, kv_len, off, qk_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, WS: tl.constexpr, DT: tl.constexpr):
    """KV tiles [lo, hi).  MASKED: 0 none, 1 every tile, 2 tiles from ``mask_from`` on (a
    scalar branch, so one loop serves the unmasked and the diagonal / tail tiles)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([start_n, 0])
        qk = tl.dot(q, k.T)
        if MASKED == 1:
            qk = _mask(qk, start_n, m0, kv_len, off, CAUSAL, BLOCK_M, BLOCK_N)
        if MASKED == 2:
            if start_n >= mask_from:
                qk = _mask(qk, start_n, m0, kv_len, off, CAUSAL, BLOCK_M, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if MASKED:  # a row masked so far keeps m = -inf: exponentiate against 0 instead
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = desc_v.load([start_n, 0])
        acc = tl.dot(p.to(DT), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["HQ", "NUM_ITEMS", "heads_first", "stride_lt", "stride_lh"])  # see attention._attn_fwd
def _dense_fwd(
    Q, K, V, Out, Lse, Work, QoIndptr, KvStart, KvLens, Sinks,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, out_scale, HQ, NUM_ITEMS, heads_first,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SINKS: tl.constexpr, STORE_LSE: tl.constexpr, WS: tl.constexpr,
    ONE_LOOP: tl.constexpr, BRANCH: tl.constexpr,
):
    pid = tl.program_id(0)
    if heads_first != 0:
        item = pid // HQ
        h = pid - item * HQ
    else:
        h = pid // NUM_ITEMS
        item = pid - h * NUM_ITEMS
    hk = h // G
    req = tl.load(Work + 2 * item)
    m0 = tl.load(Work + 2 * item + 1)
    qo_start = tl.load(QoIndptr + req).to(tl.int64)
    qo_len = tl.load(QoIndptr + req + 1) - qo_start.to(tl.int32)
    kv_start = tl.load(KvStart + req).to(tl.int64)
    kv_len = tl.load(KvLens + req)
    off = kv_len - qo_len  # bottom-right causal alignment
    DT: tl.constexpr = Q.dtype.element_ty
    kv_rows = tl.maximum(kv_len, 1)  # a descriptor needs a non-empty shape (no load runs then)

    desc_q = tl.make_tensor_descriptor(Q + qo_start * stride_qt + h * stride_qh, shape=[qo_len, HEAD_DIM],
                                       strides=[stride_qt, 1], block_shape=[BLOCK_M, HEAD_DIM])
    desc_k = tl.make_tensor_descriptor(K + kv_start * stride_kt + hk * stride_kh, shape=[kv_rows, HEAD_DIM],
                                       strides=[stride_kt, 1], block_shape=[BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V + kv_start * stride_vt + hk * stride_vh, shape=[kv_rows, HEAD_DIM],
                                       strides=[stride_vt, 1], block_shape=[BLOCK_N, HEAD_DIM])
    q = desc_q.load([m0, 0])

    # keys [0, f_hi) are visible to every row of the tile; [f_hi, hi) need the mask
    if CAUSAL:
        hi = tl.minimum(kv_len, m0 + BLOCK_M + off)
        f_hi = tl.minimum(kv_len, m0 + off + 1)
    else:
        hi = kv_len
        f_hi = kv_len
    hi = tl.maximum(hi, 0)
    f_hi = tl.minimum(tl.maximum(f_hi, 0) // BLOCK_N * BLOCK_N, hi)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if ONE_LOOP:  # one (warp-specialized) loop: every tile masked, or a branch per tile
        acc, l_i, m_i = _dense_loop(acc, l_i, m_i, q, desc_k, desc_v, 0, hi, f_hi, m0, kv_len, off,
                                    qk_scale, 2 if BRANCH else 1, CAUSAL, BLOCK_M, BLOCK_N, WS, DT)
    else:  # unmasked tiles, then the masked diagonal / tail tiles
        acc, l_i, m_i = _dense_loop(acc, l_i, m_i, q, desc_k, desc_v, 0, f_hi, f_hi, m0, kv_len, off,
                                    qk_scale, 0, CAUSAL, BLOCK_M, BLOCK_N, WS, DT)
        acc, l_i, m_i = _dense_loop(acc, l_i, m_i, q, desc_k, desc_v, f_hi, hi, f_hi, m0, kv_len, off,
                                    qk_scale, 1, CAUSAL, BLOCK_M, BLOCK_N, False, DT)

    # epilogue: a row that saw no key gets out 0 and LSE -inf (the sink does not apply to it); a
    # NaN query row that saw a key has l_i NaN and keeps NaN out and LSE (`!= 0`, not `> 0`)
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    if HAS_SINKS:
        scale, lse = with_sink(lse, seen, l_safe, tl.load(Sinks + h))
    else:
        scale = 1.0 / l_safe
    o = tl.where(seen[:, None], acc * (scale * out_scale)[:, None], 0.0)
    desc_o = tl.make_tensor_descriptor(Out + qo_start * stride_ot + h * stride_oh, shape=[qo_len, HEAD_DIM],
                                       strides=[stride_ot, 1], block_shape=[BLOCK_M, HEAD_DIM])
    desc_o.store([m0, 0], o.to(Out.dtype.element_ty))  # rows past qo_len are clipped by the copy
    if STORE_LSE:
        rows = m0 + tl.arange(0, BLOCK_M)
        l_ptr = Lse + (qo_start + rows) * stride_lt + h * stride_lh
        tl.store(l_ptr, lse, mask=rows < qo_len)


def _torch_alloc(size: int, alignment: int, stream):
    import torch
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _scratch_alloc(scratch):
    """Triton's global-scratch allocator over ``scratch`` (a uint8 region of the caller's float workspace,
    256-byte aligned), torch's where the request does not fit."""
    def alloc(size: int, alignment: int, stream):
        if scratch is not None and size <= scratch.numel() and scratch.data_ptr() % max(alignment, 1) == 0:
            return scratch[:size]
        return _torch_alloc(size, alignment, stream)
    return alloc


def tma_ready(*tensors) -> bool:
    """Whether these tensors can be read through tensor descriptors (16-byte base and strides)."""
    for t in tensors:
        if t.data_ptr() % 16 or t.stride(-1) != 1:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def dense_fwd(q, k, v, out, lse, sinks, work, num_items, qo_indptr, kv_start, kv_lens, *, group_size,
              head_dim, kv_strides, v_strides, causal, qk_scale, out_scale, block_m, block_n,
              num_warps, num_stages, warp_specialize, one_loop=False, branch=False, heads_first=False,
              scratch=None):
    """Launch ``_dense_fwd`` over ``num_items`` x Hq programs; returns a relaunch closure.

    q/out [nnz_q, Hq, D]; k/v ragged, addressed by (token, head) element strides ``kv_strides`` /
    ``v_strides``, request i's keys at rows [kv_start[i], kv_start[i] + kv_lens[i]); work int32
    [num_items, 2] = (request, first row); lse fp32 [nnz_q, Hq] or None.  ``scratch``: uint8 device
    memory for the descriptors the kernel builds (else torch allocates them per launch).
    """
    from triton.runtime import _allocation

    assert qk_scale > 0, "the fast path takes the row max before scaling"
    hq = q.shape[1]
    ls = tuple(lse.stride()) if lse is not None else (0, 0)
    tail = (q.stride(0), q.stride(1), kv_strides[0], kv_strides[1], v_strides[0], v_strides[1],
            out.stride(0), out.stride(1), ls[0], ls[1], float(qk_scale), float(out_scale), hq, num_items,
            int(bool(heads_first)))
    cx = dict(G=group_size, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
              HAS_SINKS=sinks is not None, STORE_LSE=lse is not None, WS=bool(warp_specialize),
              ONE_LOOP=bool(one_loop), BRANCH=bool(branch),
              num_warps=num_warps, num_stages=num_stages)
    launcher = fast_launcher(_dense_fwd, (num_items * hq,), cx)
    dummy = work
    alloc = _scratch_alloc(scratch)

    def launch(q, k, v, out, lse, mask_bytes, sinks):
        # descriptors are built on the device into a scratch buffer from Triton's allocator: use
        # the caller's allocator if one is set, else the plan's scratch (or torch's) for this launch only
        tok = None
        if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            tok = _allocation._allocator.set(alloc)
        try:
            launcher(q, k, v, out, lse if lse is not None else dummy, work, qo_indptr, kv_start, kv_lens,
                     sinks if sinks is not None else dummy, *tail)
        finally:
            if tok is not None:
                _allocation._allocator.reset(tok)

    if num_items:
        launch(q, k, v, out, lse, None, sinks)
    return launch
