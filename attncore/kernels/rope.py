"""The Triton kernel behind :mod:`attncore.rope` (imported on first use, so that ``TRITON_INTERPRET``
can still be set before ``@triton.jit`` decorates it).

One program rotates ``BLOCK_N`` tokens of one head: q heads are ``0 .. Hq-1`` on grid axis 1, k heads
follow.  Pair ``i`` (``0 <= i < HALF``, ``HALF = rotary_dim / 2``) is the element pair
``(i, i + HALF)`` (neox, rotate-half) or ``(2i, 2i + 1)`` (interleaved), rotated by the angle
``pos * inv_freq[i]`` (or by ``cos_sin_cache[pos, i]`` / ``cos_sin_cache[pos, HALF + i]``)::

    out_a = x_a * cos - x_b * sin        out_b = x_b * cos + x_a * sin

in float32, stored in the output's dtype.  Elements past ``rotary_dim`` are not touched (the API
copies them for the out-of-place variants).  Positions come from ``pos_ids[token]`` or, for the
ragged form, from ``offsets[b] + token - indptr[b]`` with ``b`` found by a binary search of
``indptr`` (``search_steps = ceil(log2(batch_size))`` halvings).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_head(X, Out, x_base, o_base, stride_xd, stride_od, d_a, d_b, mask, cos, sin):
    xa = tl.load(X + x_base + d_a * stride_xd, mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(X + x_base + d_b * stride_xd, mask=mask, other=0.0).to(tl.float32)
    ya = xa * cos - xb * sin
    yb = xb * cos + xa * sin
    tl.store(Out + o_base + d_a * stride_od, ya.to(Out.dtype.element_ty), mask=mask)
    tl.store(Out + o_base + d_b * stride_od, yb.to(Out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["nnz", "batch_size", "search_steps"])  # per call: the launcher is reused
def rope_kernel(
    Q, K, QOut, KOut, PosIds, Indptr, Offsets, InvFreq, CosSin,
    nnz, num_q_heads, batch_size, search_steps,
    stride_qn, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd,
    stride_qon, stride_qoh, stride_qod, stride_kon, stride_koh, stride_kod, stride_cs,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    INTERLEAVE: tl.constexpr, RAGGED: tl.constexpr, USE_CACHE: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    head = tl.program_id(1)
    tmask = tok < nnz

    if RAGGED:
        # the segment b with indptr[b] <= tok < indptr[b + 1]: lo = 0, hi = batch_size (search_steps
        # halvings, hi - lo = 1 at the end)
        lo = tl.zeros([BLOCK_N], dtype=tl.int32)
        hi = lo + batch_size
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            start = tl.load(Indptr + mid, mask=tmask, other=0)
            go = start <= tok
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        seg_start = tl.load(Indptr + lo, mask=tmask, other=0)
        pos = tl.load(Offsets + lo, mask=tmask, other=0) + (tok - seg_start)
    else:
        pos = tl.load(PosIds + tok, mask=tmask, other=0)

    i = tl.arange(0, BLOCK_P)
    pmask = i < HALF
    mask = tmask[:, None] & pmask[None, :]
    if USE_CACHE:
        cs = CosSin + pos.to(tl.int64)[:, None] * stride_cs + i[None, :]
        cos = tl.load(cs, mask=mask, other=1.0)
        sin = tl.load(cs + HALF, mask=mask, other=0.0)
    else:
        inv = tl.load(InvFreq + i, mask=pmask, other=0.0)
        ang = pos.to(tl.float32)[:, None] * inv[None, :]
        cos = tl.cos(ang)
        sin = tl.sin(ang)

    if INTERLEAVE:
        d_a = 2 * i[None, :]
        d_b = d_a + 1
    else:
        d_a = i[None, :]
        d_b = d_a + HALF
    row = tok.to(tl.int64)[:, None]
    if head < num_q_heads:
        _rotate_head(Q, QOut, row * stride_qn + head * stride_qh, row * stride_qon + head * stride_qoh,
                     stride_qd, stride_qod, d_a, d_b, mask, cos, sin)
    else:
        kh = head - num_q_heads
        _rotate_head(K, KOut, row * stride_kn + kh * stride_kh, row * stride_kon + kh * stride_koh,
                     stride_kd, stride_kod, d_a, d_b, mask, cos, sin)
