"""POD in one launch: the prefill part's q-tiles and the decode part's items share one grid.

Each program runs the items ``Work[Offs[pid]:Offs[pid+1]]`` (a schedule planned on the host,
backends/triton/pod.py): item = (part, req, first packed row, kv head).  ``part`` 0 runs the prefill
code path (its tile sizes, mask, window, soft cap, RoPE, ALiBi, sinks, KV addressing), part 1 the
decode path (small tiles for the G packed rows of a request, causal over its draft rows).  Both paths
are compiled into the one kernel and picked per item by a scalar branch, so a program may interleave
compute-bound prefill tiles with bandwidth-bound decode items and an SM holds both kinds at once.

The per-item body is ``_attn_fwd``'s (kernels/attention.py, same notation, same three KV ranges and
epilogue) without split-KV: a decode item covers its whole request, so no merge launch follows.
The KV loop and step are attention.py's device functions, imported.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from attncore.backends.triton.kernels.attention import _cos_sin, _kv_addr, _kv_loop, _next_pow2, with_sink
from attncore.kernels.launch import fast_launcher

WORK_FIELDS = 4  # part, req, row0, hkv


@triton.jit
def _item(
    req, row0, hkv,
    Q, K, V, Out, Lse, QoIndptr, KvIndptr, KvIndices, KvLens, MaskBytes, MaskIndptr, Sinks, Slopes,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh,
    qk_scale, cap_inv, cap_l2, out_scale, window_left, rope_log2_theta, rope_inv_scale,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    MASK_MODE: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr,
    ROPE: tl.constexpr, HAS_SINKS: tl.constexpr, STORE_LSE: tl.constexpr, DOT_PREC: tl.constexpr,
    PREFETCH: tl.constexpr, KV_ADDR: tl.constexpr,
):
    qo_start = tl.load(QoIndptr + req)
    qo_len = tl.load(QoIndptr + req + 1) - qo_start
    kv_len = tl.load(KvLens + req)
    page_base = tl.load(KvIndptr + req)
    off = kv_len - qo_len
    DT: tl.constexpr = Q.dtype.element_ty

    offs_m = row0 + tl.arange(0, BLOCK_M)
    q_tok = offs_m // G
    head = hkv * G + offs_m % G
    row_ok = q_tok < qo_len
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_HALF)
    q_row = (qo_start + q_tok).to(tl.int64) * stride_qt + head * stride_qh
    if ROPE:
        qm = row_ok[:, None] & (offs_h[None, :] < HALF)
        q1 = tl.load(Q + q_row[:, None] + offs_h[None, :], mask=qm, other=0.0).to(tl.float32)
        q2 = tl.load(Q + q_row[:, None] + HALF + offs_h[None, :], mask=qm, other=0.0).to(tl.float32)
        inv_freq = tl.exp2(-(2.0 * offs_h.to(tl.float32) / HEAD_DIM) * rope_log2_theta) * rope_inv_scale
        c, s = _cos_sin((off + q_tok).to(tl.float32)[:, None] * inv_freq[None, :])
        q = (q1 * c - q2 * s).to(DT)
        qb = (q2 * c + q1 * s).to(DT)
    else:
        inv_freq = offs_h.to(tl.float32)  # unused
        qm = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=qm, other=0.0).to(DT)
        qb = q  # unused
    if ALIBI:
        slope = tl.load(Slopes + head)
    else:
        slope = tl.zeros([BLOCK_M], tl.float32)
    if MASK_MODE == 2:
        mask_base = tl.load(MaskIndptr + req).to(tl.int64)
    else:
        mask_base = 0
    spec_row = q_tok.to(tl.int64)  # unused (no speculative mask here)
    Kh = K + hkv.to(tl.int64) * stride_kh
    Vh = V + hkv.to(tl.int64) * stride_vh

    # ---- KV range cut to what some row of the tile can see (as in _attn_fwd)
    q_first = row0 // G
    q_last = (tl.minimum(row0 + BLOCK_M, qo_len * G) - 1) // G
    q_last = tl.maximum(q_last, q_first)
    lo = kv_len * 0  # a tensor, as _attn_fwd's loaded kv_lo (min / max below mix it with tensors)
    hi = kv_len
    f_hi = (hi // BLOCK_N) * BLOCK_N
    f_lo = lo
    w_lo = q_first + off - window_left
    if MASK_MODE == 1:
        hi = tl.minimum(hi, q_last + off + 1)
        f_hi = tl.minimum(f_hi, ((q_first + off + 1) // BLOCK_N) * BLOCK_N)
    if MASK_MODE == 2:
        f_hi = lo
    if HAS_WINDOW:
        lo = tl.maximum(lo, (tl.maximum(w_lo, 0) // BLOCK_N) * BLOCK_N)
        w_full = q_last + off - window_left
        f_lo = tl.maximum(lo, ((tl.maximum(w_full, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    hi = tl.maximum(hi, lo)
    hi_up = ((hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    f_lo = tl.minimum(tl.maximum(f_lo, lo), hi_up)
    f_hi = tl.maximum(f_hi, f_lo)

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if KV_ADDR > 0:
        stride_kp = stride_kp // stride_ks
        stride_vp = stride_vp // stride_vs
    h_end = lo
    if HAS_WINDOW:  # the first tile alone, V left of every row's window zeroed (see _attn_fwd)
        h_end = tl.minimum(lo + BLOCK_N, f_lo)
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, qb, lo, h_end, Kh, Vh, KvIndices, page_base, kv_len,
            stride_kp, stride_ks, stride_vp, stride_vs,
            q_tok, row_ok, off, window_left, w_lo, qk_scale, cap_inv, cap_l2, slope,
            MaskBytes, mask_base, spec_row, inv_freq, offs_n, offs_d, offs_h,
            True, DT, DOT_PREC, HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF, BLOCK_N, PAGE, MASK_MODE,
            HAS_WINDOW, SOFT_CAP, ALIBI, ROPE, PREFETCH, KV_ADDR, True)
    for seg in tl.static_range(3):
        if seg == 0:
            a = h_end
            b = f_lo
        elif seg == 1:
            a = f_lo
            b = f_hi
        else:
            a = f_hi
            b = hi
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, qb, a, b, Kh, Vh, KvIndices, page_base, kv_len,
            stride_kp, stride_ks, stride_vp, stride_vs,
            q_tok, row_ok, off, window_left, w_lo, qk_scale, cap_inv, cap_l2, slope,
            MaskBytes, mask_base, spec_row, inv_freq, offs_n, offs_d, offs_h,
            seg != 1, DT, DOT_PREC, HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF, BLOCK_N, PAGE, MASK_MODE,
            HAS_WINDOW, SOFT_CAP, ALIBI, ROPE, PREFETCH, KV_ADDR, False)

    # ---- epilogue (docs/semantics.md: a row that saw no key: out 0, lse -inf; NaN stays NaN)
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    om = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if HAS_SINKS:
        scale, lse = with_sink(lse, seen, l_safe, tl.load(Sinks + head))
    else:
        scale = 1.0 / l_safe
    o = tl.where(seen[:, None], acc * (scale * out_scale)[:, None], 0.0)
    o_row = (qo_start + q_tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(Out + o_row[:, None] + offs_d[None, :], o.to(Out.dtype.element_ty), mask=om)
    if STORE_LSE:
        l_row = (qo_start + q_tok).to(tl.int64) * stride_lt + head * stride_lh
        tl.store(Lse + l_row, lse, mask=row_ok)


@triton.jit(do_not_specialize=["window_left_p", "window_left_d"])
def _pod_fwd(
    Work, Offs, Slopes,
    # prefill part (P) then decode part (D): tensors, strides, scalars
    Qp, Kp, Vp, Outp, Lsep, QoIndptrP, KvIndptrP, KvIndicesP, KvLensP, MaskBytesP, MaskIndptrP, SinksP,
    sqt_p, sqh_p, skp_p, sks_p, skh_p, svp_p, svs_p, svh_p, sot_p, soh_p, slt_p, slh_p,
    qk_scale_p, cap_inv_p, cap_l2_p, out_scale_p, window_left_p, rope_log2_theta_p, rope_inv_scale_p,
    Qd, Kd, Vd, Outd, Lsed, QoIndptrD, KvIndptrD, KvIndicesD, KvLensD, MaskBytesD, MaskIndptrD, SinksD,
    sqt_d, sqh_d, skp_d, sks_d, skh_d, svp_d, svs_d, svh_d, sot_d, soh_d, slt_d, slh_d,
    qk_scale_d, cap_inv_d, cap_l2_d, out_scale_d, window_left_d, rope_log2_theta_d, rope_inv_scale_d,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, DOT_PREC: tl.constexpr, ALIBI: tl.constexpr,
    BM_P: tl.constexpr, BN_P: tl.constexpr, PAGE_P: tl.constexpr, MASK_P: tl.constexpr,
    WIN_P: tl.constexpr, CAP_P: tl.constexpr, ROPE_P: tl.constexpr, SINKS_P: tl.constexpr,
    LSE_P: tl.constexpr, PREFETCH_P: tl.constexpr, ADDR_P: tl.constexpr,
    BM_D: tl.constexpr, BN_D: tl.constexpr, PAGE_D: tl.constexpr, MASK_D: tl.constexpr,
    WIN_D: tl.constexpr, CAP_D: tl.constexpr, ROPE_D: tl.constexpr, SINKS_D: tl.constexpr,
    LSE_D: tl.constexpr, PREFETCH_D: tl.constexpr, ADDR_D: tl.constexpr,
):
    pid = tl.program_id(0)
    start = tl.load(Offs + pid)
    end = tl.load(Offs + pid + 1)
    for j in range(start, end):
        wp = Work + j * 4
        part = tl.load(wp)
        req = tl.load(wp + 1)
        row0 = tl.load(wp + 2)
        hkv = tl.load(wp + 3)
        if part == 0:
            _item(req, row0, hkv, Qp, Kp, Vp, Outp, Lsep, QoIndptrP, KvIndptrP, KvIndicesP, KvLensP,
                  MaskBytesP, MaskIndptrP, SinksP, Slopes,
                  sqt_p, sqh_p, skp_p, sks_p, skh_p, svp_p, svs_p, svh_p, sot_p, soh_p, slt_p, slh_p,
                  qk_scale_p, cap_inv_p, cap_l2_p, out_scale_p, window_left_p, rope_log2_theta_p,
                  rope_inv_scale_p, G, HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF, BM_P, BN_P, PAGE_P, MASK_P,
                  WIN_P, CAP_P, ALIBI, ROPE_P, SINKS_P, LSE_P, DOT_PREC, PREFETCH_P, ADDR_P)
        else:
            _item(req, row0, hkv, Qd, Kd, Vd, Outd, Lsed, QoIndptrD, KvIndptrD, KvIndicesD, KvLensD,
                  MaskBytesD, MaskIndptrD, SinksD, Slopes,
                  sqt_d, sqh_d, skp_d, sks_d, skh_d, svp_d, svs_d, svh_d, sot_d, soh_d, slt_d, slh_d,
                  qk_scale_d, cap_inv_d, cap_l2_d, out_scale_d, window_left_d, rope_log2_theta_d,
                  rope_inv_scale_d, G, HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF, BM_D, BN_D, PAGE_D, MASK_D,
                  WIN_D, CAP_D, ALIBI, ROPE_D, SINKS_D, LSE_D, DOT_PREC, PREFETCH_D, ADDR_D)


class Part:
    """One part's launch arguments (host side): tensors, element strides and scalars, see ``pod_fwd``."""

    def __init__(self, *, q, k, v, out, lse, qo_indptr, kv_indptr, kv_indices, kv_lens, mask_bytes,
                 mask_indptr, sinks, kv_strides, v_strides, page_size, mask_mode, window_left, soft_cap,
                 rope, rope_theta, rope_scale, qk_scale, cap_inv, cap_l2, out_scale, block_m, block_n,
                 prefetch):
        self.__dict__.update(locals())
        del self.__dict__["self"]


def _part_args(p: Part, dummy):
    ls = tuple(p.lse.stride()) if p.lse is not None else (0, 0)
    none = lambda t: t if t is not None else dummy  # noqa: E731
    tensors = (p.q, p.k, p.v, p.out, none(p.lse), p.qo_indptr, p.kv_indptr, none(p.kv_indices), p.kv_lens,
               none(p.mask_bytes), none(p.mask_indptr), none(p.sinks))
    tail = (p.q.stride(0), p.q.stride(1), *p.kv_strides, *p.v_strides, p.out.stride(0), p.out.stride(1),
            ls[0], ls[1], float(p.qk_scale), float(p.cap_inv), float(p.cap_l2), float(p.out_scale),
            int(p.window_left), math.log2(p.rope_theta), 1.0 / p.rope_scale)
    return tensors, tail


def _part_constexprs(p: Part, suffix: str) -> dict:
    return {f"BM_{suffix}": p.block_m, f"BN_{suffix}": p.block_n, f"PAGE_{suffix}": int(p.page_size or 0),
            f"MASK_{suffix}": p.mask_mode, f"WIN_{suffix}": p.window_left >= 0, f"CAP_{suffix}": bool(p.soft_cap),
            f"ROPE_{suffix}": bool(p.rope), f"SINKS_{suffix}": p.sinks is not None,
            f"LSE_{suffix}": p.lse is not None, f"PREFETCH_{suffix}": bool(p.prefetch) and bool(p.page_size),
            f"ADDR_{suffix}": _kv_addr(p.k, p.v, p.page_size, p.kv_strides, p.v_strides)}


def pod_fwd(work, offs, num_programs: int, slopes, prefill: Part, decode: Part, *, group_size: int,
            head_dim: int, alibi: bool, num_warps: int, num_stages: int):
    """Launch ``_pod_fwd`` on ``num_programs`` programs; returns ``launch(prefill_tensors,
    decode_tensors)`` that relaunches with new (q, k, v, out, lse, sinks) of the same strides.

    work int32 [n, 4] (part, req, row0, hkv) grouped by program; offs int32 [num_programs + 1]."""
    D = head_dim
    for p in (prefill, decode):
        assert p.q.stride(2) == 1 and p.out.stride(2) == 1 and p.k.stride(-1) == 1 and p.v.stride(-1) == 1
        assert p.block_m >= 16 and p.block_n >= 16 and p.mask_mode in (0, 1, 2)
    assert work.dtype.itemsize == 4 and offs.numel() >= num_programs + 1
    if num_programs == 0:
        return lambda *a: None
    dummy = prefill.kv_lens
    q = prefill.q
    cx = dict(G=group_size, HEAD_DIM=D, BLOCK_D=max(16, _next_pow2(D)), HALF=D // 2,
              BLOCK_HALF=max(16, _next_pow2(D // 2)), DOT_PREC="ieee" if q.dtype.itemsize == 4 else "tf32",
              ALIBI=bool(alibi), **_part_constexprs(prefill, "P"), **_part_constexprs(decode, "D"),
              num_warps=num_warps, num_stages=num_stages)
    launcher = fast_launcher(_pod_fwd, (num_programs,), cx)
    sl = slopes if slopes is not None else dummy
    _, tail_p = _part_args(prefill, dummy)
    _, tail_d = _part_args(decode, dummy)

    def launch(tp, td):
        """tp / td: (q, k, v, out, lse, sinks) of each part, same strides and None-ness as planned."""
        ap = (tp[0], tp[1], tp[2], tp[3], tp[4] if tp[4] is not None else dummy, prefill.qo_indptr,
              prefill.kv_indptr, prefill.kv_indices if prefill.kv_indices is not None else dummy,
              prefill.kv_lens, prefill.mask_bytes if prefill.mask_bytes is not None else dummy,
              prefill.mask_indptr if prefill.mask_indptr is not None else dummy,
              tp[5] if tp[5] is not None else dummy)
        ad = (td[0], td[1], td[2], td[3], td[4] if td[4] is not None else dummy, decode.qo_indptr,
              decode.kv_indptr, decode.kv_indices if decode.kv_indices is not None else dummy,
              decode.kv_lens, decode.mask_bytes if decode.mask_bytes is not None else dummy,
              decode.mask_indptr if decode.mask_indptr is not None else dummy,
              td[5] if td[5] is not None else dummy)
        launcher(work, offs, sl, *ap, *tail_p, *ad, *tail_d)

    launch.launcher = launcher
    launch((prefill.q, prefill.k, prefill.v, prefill.out, prefill.lse, prefill.sinks),
           (decode.q, decode.k, decode.v, decode.out, decode.lse, decode.sinks))
    return launch
