"""The Triton backend's run(): argument checks against the plan, then the launches (no decision, no
host sync, no device allocation).

The first run() of a plan with given strides / scales checks the tensors and prepares the launchers
(attncore/kernels/launch.py); later runs with the same key only relaunch.  In CUDA-graph mode the launches use
the plan's persistent grids (plan.graph), so a captured run() replays any later plan of the same
caller.
"""

from __future__ import annotations

import torch

from attncore.backends.triton.plan import LOG2E, MASK_CAUSAL, MASK_CUSTOM, MASK_SPEC, TritonPlan
from attncore.core import current
from attncore.core.backend import RunArgs
from attncore.kernels import check_interpreted


def _noop(*a) -> None:
    return None


def _key(args: RunArgs) -> tuple:
    """Everything check() and the launchers' specialization look at, so that a cached key needs no further check."""
    q, k, v, out, lse, sinks, spec = args.q, args.k, args.v, args.out, args.lse, args.sinks, args.spec_mask
    return (q.shape, q.stride(), q.dtype, q.device, k.stride(), k.dtype, k.device, v.stride(), v.dtype,
            v.device, out.shape, out.stride(), out.dtype, out.device,
            None if lse is None else (lse.shape, lse.stride(), lse.dtype),
            None if sinks is None else (sinks.dtype, sinks.numel()), args.q_scale, args.k_scale,
            args.v_scale, args.o_scale, None if spec is None else (spec.shape, spec.stride(), spec.dtype))


def run(plan: TritonPlan, args: RunArgs) -> None:
    q, k, v, out = args.q, args.k, args.v, args.out
    lse, sinks, spec = args.lse, args.sinks, args.spec_mask
    if plan.upload is not None:
        plan.upload.ensure()  # another plan wrote over this plan's tables: send them again
    key = _key(args)  # host time: a seen key is launched without the checks
    fast = plan.launch_cache.get(key)
    if fast is None:
        check(plan, args)
        plan.launch_cache[key] = first_run(plan, args)
        return
    # same strides and scales as an earlier run: launch only
    if plan.mask_mode == MASK_SPEC:
        mb = (spec if spec.is_contiguous() else spec.contiguous()).view(torch.uint8)
    else:
        mb = plan.meta.packed_mask if plan.mask_mode == MASK_CUSTOM else None
    _launch_pair(fast, q.device.index if q.is_cuda else None, q, k, v, out, lse, mb, sinks)


def _launch_pair(fast, index, q, k, v, out, lse, mb, sinks) -> None:
    """The attention and merge relaunchers on CUDA device ``index`` (None: the CPU), whichever device is
    current (a tensor-parallel rank's tensors may sit on cuda:1 while cuda:0 stays current)."""
    if index is not None and index != current.device_index():
        with torch.cuda.device(index):
            fast[0](q, k, v, out, lse, mb, sinks)
            fast[1](out, lse, sinks)
    else:
        fast[0](q, k, v, out, lse, mb, sinks)
        fast[1](out, lse, sinks)


def relaunch(plan: TritonPlan, args: RunArgs):
    """Backend.relaunch: the launchers run() prepared for ``args``'s key, behind the table re-send that run()
    does; None before a run() of that key, and for masks read per run."""
    fast = plan.launch_cache.get(_key(args))
    if fast is None or plan.mask_mode in (MASK_CUSTOM, MASK_SPEC):
        return None
    up = plan.upload
    index = plan.device.index if plan.device.type == "cuda" else None

    def go(q, k, v, out, lse, sinks) -> None:
        if up is not None:
            up.ensure()
        _launch_pair(fast, index, q, k, v, out, lse, None, sinks)
    return go


def first_run(plan: TritonPlan, args: RunArgs):
    """Launch once through Triton (compiling if needed); returns the (attention, merge) relaunchers."""
    from attncore.backends.triton.kernels.attention import _attn_fwd

    p = plan.problem
    q, k, v = args.q, args.k, args.v
    check_interpreted(_attn_fwd, q.device, "triton backend", "set TRITON_INTERPRET before attncore's triton kernels "
                      "are first imported", subject="kernels were")
    paged = p.page_size is not None
    # element strides (page, slot/token, head) of K and V
    if paged:
        if p.kv_layout == "NHD":  # [pages, page_size, Hkv, D]
            ks = (k.stride(0), k.stride(1), k.stride(2))
            vs = (v.stride(0), v.stride(1), v.stride(2))
        else:  # [pages, Hkv, page_size, D]
            ks = (k.stride(0), k.stride(2), k.stride(1))
            vs = (v.stride(0), v.stride(2), v.stride(1))
    else:
        if p.kv_layout == "NHD":  # [n, Hkv, D]
            ks = (0, k.stride(0), k.stride(1))
            vs = (0, v.stride(0), v.stride(1))
        else:  # [Hkv, n, D]
            ks = (0, k.stride(1), k.stride(0))
            vs = (0, v.stride(1), v.stride(0))
    if q.shape[0] == 0:
        return _noop, _noop
    if q.is_cuda and q.device.index != current.device_index():
        with torch.cuda.device(q.device):  # launch on the tensors' device (cuda:1 works)
            return _launch(plan, args, ks, vs)
    return _launch(plan, args, ks, vs)


def _mask_args(plan: TritonPlan, args: RunArgs):
    meta = plan.meta
    if plan.mask_mode == MASK_CUSTOM:
        return meta.packed_mask, meta.mask_indptr, 0, 0
    if plan.mask_mode == MASK_SPEC:
        sm_t = args.spec_mask
        if not sm_t.is_contiguous():
            sm_t = sm_t.contiguous()
        return sm_t.view(torch.uint8), None, sm_t.shape[1], sm_t.shape[2] * 2
    return None, None, 0, 0


def _launch(plan: TritonPlan, args: RunArgs, ks, vs):
    from attncore.backends.triton.kernels.attention import attention_fwd
    from attncore.backends.triton.kernels.merge import merge_splits

    p, prm, c, g = plan.problem, plan.meta.params, plan.cfg, plan.graph
    q, k, v, out = args.q, args.k, args.v, args.out
    sm = prm.sm_scale * args.q_scale * args.k_scale
    cap = prm.logits_soft_cap or 0.0
    out_scale = args.v_scale / args.o_scale
    mask_bytes, mask_indptr, spec_q_len, spec_row_bytes = _mask_args(plan, args)
    # graph mode: the split path and the merge launch are always there (the live counts decide)
    split = g is not None or plan.num_merge_rows > 0
    if plan.dense:
        fwd = _launch_dense(plan, args, ks, vs, sm * LOG2E, out_scale)
        if fwd is not None:
            return fwd, _noop
    fwd = attention_fwd(
        q, k, v, out, args.lse, plan.part_o, plan.part_lse, plan.work, plan.counts,
        g.cap_items if g is not None else plan.num_items,
        plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_lens, mask_bytes, mask_indptr,
        args.sinks, plan.slopes, num_kv_heads=p.num_kv_heads, group_size=p.group_size,
        head_dim=p.head_dim_qk, head_dim_vo=p.head_dim_vo, page_size=p.page_size, kv_strides=ks, v_strides=vs,
        mask_mode=plan.mask_mode, window_left=prm.window_left, soft_cap=cap > 0,
        alibi=prm.pos_encoding_mode == "ALIBI", rope=prm.pos_encoding_mode == "ROPE_LLAMA",
        rope_theta=prm.rope_theta, rope_scale=prm.rope_scale,
        qk_scale=sm * LOG2E, cap_inv=(sm / cap) if cap > 0 else 0.0,
        cap_l2=cap * LOG2E, out_scale=out_scale, spec_q_len=spec_q_len,
        spec_row_bytes=spec_row_bytes, split=split and plan.part_o is not None, block_m=c.block_m,
        block_n=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages, prefetch=c.prefetch,
        dot_f16=c.dot_f16, heads_first=plan.heads_first, persistent_grid=g.grid if g is not None else 0,
    )
    merge = _noop
    if split and plan.merge_table is not None and plan.part_o is not None:
        merge = merge_splits(plan.part_o, plan.part_lse, out, args.lse, plan.merge_table, plan.counts, args.sinks,
                             num_rows=plan.num_merge_rows, head_dim=p.head_dim_vo, out_scale=out_scale,
                             max_splits=16 if g is not None else plan.max_splits,
                             persistent_grid=g.merge_grid if g is not None else 0)
    return fwd, merge


def _page_gather(g: dict, layout: str):
    """The copy of the paged gather: pages of the caches, in kv_indices order, into g's [pages,
    page_size, Hkv, D] buffers (HND caches are read through a transposed view)."""
    pages = g["pages"]

    def gather(k, v):
        if layout != "NHD":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        torch.index_select(k, 0, pages, out=g["k"])
        torch.index_select(v, 0, pages, out=g["v"])
    return gather


def _launch_dense(plan: TritonPlan, args: RunArgs, ks, vs, qk_scale, out_scale):
    """Launch the dense kernel with the first config that compiles; None: not applicable to
    these tensors (alignment, scale sign) or no config compiled -> the generic kernel."""
    from attncore.backends.triton.kernels.dense import dense_fwd, tma_ready

    q, k, v, out = args.q, args.k, args.v, args.out
    g = plan.gather
    if g is None and plan.problem.page_size is not None:
        return None  # paged KV without the gather (dropped below): the generic kernel
    if g is not None:  # paged: the dense kernel reads the gathered copies
        hkv, d = plan.problem.num_kv_heads, plan.problem.head_dim_qk
        gather = _page_gather(g, plan.problem.kv_layout)
        k, v = g["k"].view(-1, hkv, d), g["v"].view(-1, hkv, d)
        ks = vs = (0, k.stride(0), k.stride(1))
        kv_start = g["kv_start"]
    else:
        kv_start = plan.kv_indptr
    if qk_scale <= 0 or not tma_ready(q, k, v, out):
        plan.stats["dense_skipped"] = "unaligned tensors or sm_scale <= 0"
        plan.gather = None  # the generic kernel reads the pages itself
        return None
    if g is not None:
        gather(args.k, args.v)  # before the first dense launch below
    while plan.dense:
        c = plan.dense[0]
        work, n, heads_first = plan.dense_work[c.block_m]
        try:
            fwd = dense_fwd(q, k, v, out, args.lse, args.sinks, work, n, plan.qo_indptr,
                            kv_start, plan.kv_lens, group_size=plan.problem.group_size,
                            head_dim=plan.problem.head_dim_qk, kv_strides=ks[1:], v_strides=vs[1:],
                            causal=plan.mask_mode == MASK_CAUSAL, qk_scale=qk_scale,
                            out_scale=out_scale, heads_first=heads_first, scratch=plan.dense_scratch,
                            **c.as_dict())
        except Exception as e:  # a config Triton cannot compile here: try the next one
            plan.stats.setdefault("dense_failed", []).append(f"{c.as_dict()}: {type(e).__name__}: {str(e)[:200]}")
            plan.dense = plan.dense[1:]
            continue
        plan.stats["dense"] = c.as_dict()
        plan.stats["heads_first"] = heads_first
        if g is None:
            return fwd
        kg, vg = k, v

        def gather_fwd(q, k, v, out, lse, mask_bytes, sinks):
            gather(k, v)
            fwd(q, kg, vg, out, lse, mask_bytes, sinks)
        return gather_fwd
    if g is not None:
        plan.gather = None  # the generic kernel reads the pages itself
    return None


def check(plan: TritonPlan, args: RunArgs) -> None:
    """Cheap attribute checks: run() with other dtypes, shapes or devices than planned raises."""
    p = plan.problem
    q, k, v, out = args.q, args.k, args.v, args.out
    if q.dtype != p.q_dtype or k.dtype != p.kv_dtype or v.dtype != p.kv_dtype:
        raise TypeError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} differ from the plan's "
                        f"{p.q_dtype}/{p.kv_dtype}")
    if out.dtype != p.out_dtype:
        raise TypeError(f"out dtype {out.dtype} differs from the plan's {p.out_dtype}")
    want = (plan.nnz_q, p.num_qo_heads, p.head_dim_qk)
    if tuple(q.shape) != want or tuple(out.shape) != (plan.nnz_q, p.num_qo_heads, p.head_dim_vo):
        raise ValueError(f"q {tuple(q.shape)} / out {tuple(out.shape)}: planned {want}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.device.type != plan.device.type or (t.device.type == "cuda" and t.device.index != plan.device.index):
            raise ValueError(f"{name} is on {t.device}, planned for {plan.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous (stride {t.stride()})")
    if args.lse is not None:
        if args.lse.dtype != torch.float32 or tuple(args.lse.shape) != (plan.nnz_q, p.num_qo_heads):
            raise ValueError(f"lse must be float32 [{plan.nnz_q}, {p.num_qo_heads}], got "
                             f"{args.lse.dtype} {tuple(args.lse.shape)}")
    if p.sinks != (args.sinks is not None):
        raise ValueError(f"sinks: planned {'with' if p.sinks else 'without'} sinks, got "
                         f"{'none' if args.sinks is None else 'a tensor'}")
    if args.sinks is not None and (args.sinks.dtype != torch.float32 or args.sinks.numel() != p.num_qo_heads):
        raise ValueError(f"sinks must be float32 [{p.num_qo_heads}], got {args.sinks.dtype} "
                         f"{tuple(args.sinks.shape)}")
    if plan.mask_mode == MASK_SPEC:
        m = args.spec_mask
        B = plan.meta.batch_size
        qlen = p.q_len_per_req
        if m is None or m.dtype != torch.uint16 or tuple(m.shape) != (B, qlen, (qlen + 31) // 32 * 2):
            raise ValueError(f"spec_mask must be uint16 [{B}, {qlen}, {(qlen + 31) // 32 * 2}], got "
                             f"{None if m is None else (m.dtype, tuple(m.shape))}")
