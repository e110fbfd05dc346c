"""POD in one launch: the prefill part's q-tiles and the decode part's items share one grid.

Each program runs the items ``Work[Offs[pid]:Offs[pid+1]]`` (a schedule planned on the host,
backends/triton/pod.py): item = (part, req, first packed row, kv head).  ``part`` 0 runs the prefill
code path (its tile sizes, mask, window, soft cap, RoPE, ALiBi, sinks, KV addressing), part 1 the
decode path (small tiles for the G packed rows of a request, causal over its draft rows).  Both paths
are compiled into the one kernel and picked per item by a scalar branch, so a program may interleave
compute-bound prefill tiles with bandwidth-bound decode items and an SM holds both kinds at once.

The per-item body is ``_attn_fwd``'s own (kernels/attention.py's ``_attn_item``) without split-KV: a
decode item covers its whole request, so no merge launch follows.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from attncore.backends.triton.kernels.attention import _attn_item, _kv_addr, _next_pow2
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
    """_attn_item over the request's whole KV (no split: no partial row, so TmpO / TmpLse are never written), one
    head dim for Q/K and V, 16-bit dots."""
    kv_len = tl.load(KvLens + req)
    zero = kv_len * 0  # a tensor, as a loaded kv_lo (min / max in _attn_item mix it with tensors)
    _attn_item(
        req, row0, zero, kv_len, zero - 1, hkv, Q, K, V, Out, Lse, Out, Lse,
        QoIndptr, KvIndptr, KvIndices, KvLens, MaskBytes, MaskIndptr, Sinks, Slopes,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_lt, stride_lh, 0, 0, 0, 0,
        qk_scale, cap_inv, cap_l2, out_scale, window_left, rope_log2_theta, rope_inv_scale, 0, 0,
        G, HEAD_DIM, BLOCK_D, HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF, BLOCK_M, BLOCK_N, PAGE, MASK_MODE,
        HAS_WINDOW, SOFT_CAP, ALIBI, ROPE, HAS_SINKS, STORE_LSE, DOT_PREC, PREFETCH, False, KV_ADDR)


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
