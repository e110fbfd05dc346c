"""Single prefill below the public function (``attncore.prefill.single_prefill_with_kv_cache``): its checks,
plan and run (``plan_single``, also used by ``attncore.core.ops``, POD and ``attncore bench``), and the checks
of FlashInfer 0.2.14's positional slots and scale spellings (``single_compat``, ``split_head_scales``)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from attncore.core import _api
from attncore.core import checks as _checks
from attncore.core import plan_cache as _plan_cache
from attncore.core import selector as _selector
from attncore.core import fp8_query as _fp8_query
from attncore.core import head_scales as _head_scales
from attncore.core import params as _params
from attncore.core.backend import BatchMeta, RunArgs
from attncore.core.wrapper import _plain

Tensor = torch.Tensor


def single_key(q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode, sm_scale,
               window_left, logits_soft_cap, rope_scale, rope_theta, return_lse, backend, sinks, q_scale, k_scale,
               v_scale, out, lse, o_dtype, heads) -> Optional[tuple]:
    """``plan_single``'s cache key (``_plan_cache.ONE_CALL_PLANS``), or None where a call is planned every time
    (see there); ``attncore.decode`` reads a single decode's entry by it after planning one.  Positional
    (host time: the public function computes it per call)."""
    if (heads is not None or custom_mask is not None or packed_custom_mask is not None
            or not _plain(sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_scale, k_scale, v_scale)
            or backend.__class__ is not str or not (o_dtype is None or o_dtype.__class__ in (torch.dtype, str))):
        return None
    tk = _plan_cache.tkey
    return (tk(q), tk(k), tk(v), causal, kv_layout, pos_encoding_mode, sm_scale, window_left, logits_soft_cap,
            rope_scale, rope_theta, bool(return_lse), backend, tk(sinks), q_scale, k_scale, v_scale, tk(out),
            tk(lse), o_dtype, _selector.env_key())


def _hit_outputs(hit: tuple, q: Tensor, out, lse, return_lse: bool):
    """(out, lse or None) of a run of a cached plan (``hit``: its ``ONE_CALL_PLANS`` entry), allocated as planned
    where the caller gave none: out ``[*q's leading dims, head_dim_vo]``, lse ``[*q's leading dims]``."""
    lead = q.shape[:-1]
    if out is None:
        out = torch.empty((*lead, hit[3]), dtype=hit[2], device=q.device)
    if not return_lse:
        lse = None
    elif lse is None:
        lse = torch.empty(lead, dtype=torch.float32, device=q.device)
    return out, lse


def hit_args(hit: tuple, q: Tensor, k: Tensor, v: Tensor, out, lse, return_lse: bool, sinks) -> RunArgs:
    """The run's arguments of a cached plan (``hit``: its ``ONE_CALL_PLANS`` entry): the outputs allocated as
    planned, the scales as checked when it was planned."""
    out, lse = _hit_outputs(hit, q, out, lse, return_lse)
    return RunArgs(q, k, v, out, lse, None if sinks is None else sinks.float(), *hit[1])


def run_cached(hit: tuple, q: Tensor, k: Tensor, v: Tensor, out, lse, return_lse: bool, sinks):
    """Run a cached one-call plan (``hit``: its ``ONE_CALL_PLANS`` entry) on a call of its signature; returns
    (out, lse or None).  A single decode passes q ``[Hq, D]`` (out and lse without their first dim too).  From
    its second run on, a plan whose backend offers one runs through its ``relaunch`` (Backend.relaunch: no
    run() checks, which the key made redundant), kept in the entry's last slot."""
    slot = hit[4]
    go = slot[0]
    if go:
        out, lse = _hit_outputs(hit, q, out, lse, return_lse)
        go(q, k, v, out, lse, None if sinks is None else sinks.float())
        return out, lse
    if q.dim() == 2:  # a single decode: one row of single prefill
        out, lse = _hit_outputs(hit, q, out, lse, return_lse)
        args = RunArgs(q.unsqueeze(0), k, v, out.unsqueeze(0), None if lse is None else lse.unsqueeze(0),
                       None if sinks is None else sinks.float(), *hit[1])
    else:
        args = hit_args(hit, q, k, v, out, lse, return_lse, sinks)
        out, lse = args.out, args.lse
    hit[0].run(args)
    if go is None:
        slot[0] = hit[0].relaunch(args) or False
    return out, lse


def plan_single(*, q: Tensor, k: Tensor, v: Tensor, custom_mask: Optional[Tensor], packed_custom_mask: Optional[Tensor],
                causal: bool, kv_layout: str, pos_encoding_mode: str, sm_scale, window_left, logits_soft_cap,
                rope_scale, rope_theta, return_lse: bool, backend: str, sinks: Optional[Tensor], q_scale, k_scale,
                v_scale, out: Optional[Tensor], lse: Optional[Tensor], o_dtype=None,
                heads=None, memo_key=None, looked_up: bool = False) -> Tuple[_api.Planned, RunArgs]:
    """Validate a single prefill and plan it; returns the plan and the run's arguments.  Every argument is
    passed by keyword (the public functions, ``attncore.core.ops`` and POD all come here).

    A repeated signature reuses its plan (``_plan_cache.ONE_CALL_PLANS``): the key holds every tensor's shape,
    strides, dtype and device and every scalar the checks below read, the backend asked for and
    ``_selector.env_key()``.  A custom mask (its values are planned) or a scale given as a tensor (read per
    call) is planned every time, and so are per-head scales (``heads``, attncore.core.head_scales)."""
    if looked_up:  # the caller looked ``key`` up and missed
        key = memo_key
    else:
        key = single_key(q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode, sm_scale,
                         window_left, logits_soft_cap, rope_scale, rope_theta, return_lse, backend, sinks, q_scale,
                         k_scale, v_scale, out, lse, o_dtype, heads)
        hit = _plan_cache.ONE_CALL_PLANS.get(key) if key is not None else None
        if hit is not None:
            return hit[0], hit_args(hit, q, k, v, out, lse, return_lse, sinks)
    _checks.check_choice("kv_layout", kv_layout, ("NHD", "HND"))
    _checks.check_tensor("q", q, ndim=3, dtype=_checks.ACCEPTED_Q_DTYPES, what="([qo_len, num_qo_heads, head_dim])")
    _checks.check_tensor("k", k, ndim=3, dtype=_checks.SUPPORTED_KV_DTYPES)
    _checks.check_tensor("v", v, ndim=3, what="(its last dim is head_dim_vo, which may differ from q's and k's)")
    device = _checks.norm_device(q.device)
    qo_len, hq, d = q.shape
    dv = v.shape[-1]
    kv_len = k.shape[0] if kv_layout == "NHD" else k.shape[1]
    hkv = k.shape[1] if kv_layout == "NHD" else k.shape[0]
    _checks.check_heads(hq, hkv, d)
    if q.stride(-1) != 1:
        raise ValueError(f"q: the last dimension must be contiguous (stride 1), got stride {q.stride(-1)}")
    _checks.check_ragged_kv("k", k, kv_layout=kv_layout, n=kv_len, num_kv_heads=hkv, head_dim=d, kv_dtype=k.dtype,
                         device=device)
    _checks.check_ragged_kv("v", v, kv_layout=kv_layout, n=kv_len, num_kv_heads=hkv, head_dim=dv, kv_dtype=k.dtype,
                         device=device)
    has_mask = custom_mask is not None or packed_custom_mask is not None
    if causal and not has_mask and kv_len < qo_len:
        raise ValueError(f"causal: single prefill with causal=True needs kv_len >= qo_len, got kv_len {kv_len} "
                         f"< qo_len {qo_len}")
    params = _api.make_params(head_dim=d, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
                              pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
    if custom_mask is not None and packed_custom_mask is None:
        flat = isinstance(custom_mask, torch.Tensor) and custom_mask.dim() == 1  # FlashInfer reads view(-1) too
        _checks.check_tensor("custom_mask", custom_mask, shape=[qo_len * kv_len] if flat else [qo_len, kv_len],
                          what="([qo_len, kv_len] bool, or flattened)")
        custom_mask = custom_mask.reshape(-1)
    def meta_of():  # the one-call workspace (float, run-scoped); no int workspace: each cached plan owns its tables
        return BatchMeta.ragged(qo_indptr_host=[0, qo_len], kv_indptr_host=[0, kv_len], device=device,
                                params=params, causal=causal, custom_mask=custom_mask,
                                packed_custom_mask=packed_custom_mask, workspace=_plan_cache.one_call_workspace(device))

    meta = meta_of()
    sinks = _checks.check_sinks(sinks, hq, device)
    scales = [_params.scale(n, x) for n, x in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale))]
    # plan and run are one call here: the run-time features are known, so select with them
    out_dtype = q.dtype if o_dtype is None else _checks.to_dtype(o_dtype, "o_dtype")
    compute = _fp8_query.compute_dtype(q.dtype, out_dtype)  # an fp8 q is upcast to it (attncore.core.fp8_query)
    problem = _api.build_problem("single_prefill", device, q_dtype=compute, kv_dtype=k.dtype, out_dtype=out_dtype,
                                 num_qo_heads=hq,
                                 num_kv_heads=hkv, head_dim=d, head_dim_vo=dv, kv_layout=kv_layout, mask=meta.mask,
                                 params=params,
                                 return_lse=bool(return_lse), sinks=sinks is not None,
                                 fp8_scales=any(x != 1.0 for x in scales))
    planned = _plan_cache.plan_one_call(problem, meta, meta_of, backend, q_dtype=q.dtype, heads=heads)
    out = _api.alloc_out("out", out, (qo_len, hq, dv), out_dtype, device)
    lse_t = _api.alloc_lse(lse, qo_len, hq, device) if return_lse else None
    if key is not None:  # after every check (out and lse included): an error is never cached
        _plan_cache.ONE_CALL_PLANS.put(key, (planned, scales, out_dtype, dv, [None]))  # run_cached reads it
    args = RunArgs(q=q, k=k, v=v, out=out, lse=lse_t, sinks=sinks, q_scale=scales[0], k_scale=scales[1],
                   v_scale=scales[2])
    return planned, args


def run_single(planned: _api.Planned, args: RunArgs):
    """Run a planned single prefill; returns (out or (out, lse), name of the backend that ran it)."""
    planned.run(args)
    return ((args.out, args.lse) if args.lse is not None else args.out), planned.backend_name


# FlashInfer 0.2.14's positional order of single_prefill_with_kv_cache (for the messages)
_SINGLE_ORDER = ("q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout, "
                 "pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, "
                 "rope_theta, backend, return_lse")
_SINGLE = "single_prefill_with_kv_cache"


def _scale_slot(name: str, value):
    """``scale_q/k/v`` as FlashInfer 0.2.14 passes them: a float, a 1-element tensor, or a per-head tensor
    (checked and applied by ``_head_scales.split``); a bool or a mask-like tensor is the older order's."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype in (torch.bool, torch.uint8)):
        raise _api.ambiguous(_SINGLE, name, value, "None, a float or a float tensor", _SINGLE_ORDER,
                             "custom_mask, packed_custom_mask, causal (releases before 0.2.14, right after v)")
    return value


def single_compat(scale_q, scale_k, scale_v, o_dtype, q_scale, k_scale, v_scale, backend,
                  use_fp16_qk_reduction, allow_fp16_qk_reduction):
    """0.2.14's positional slots checked against the other releases' order, and the aliases merged:
    returns (q_scale, k_scale, v_scale)."""
    if o_dtype is not None and not isinstance(o_dtype, torch.dtype) and (
            isinstance(o_dtype, bool) or o_dtype in ("NHD", "HND") or isinstance(o_dtype, torch.Tensor)):
        raise _api.ambiguous(_SINGLE, "o_dtype", o_dtype, "None or a torch dtype", _SINGLE_ORDER,
                             "kv_layout / causal / packed_custom_mask (releases before 0.2.14)")
    if not isinstance(backend, str):
        raise _api.ambiguous(_SINGLE, "backend", backend, "'auto' or a backend name", _SINGLE_ORDER,
                             "return_lse (releases before 0.2.14, right after rope_theta)")
    _api.alias(_SINGLE, "use_fp16_qk_reduction", use_fp16_qk_reduction, "allow_fp16_qk_reduction",
               allow_fp16_qk_reduction)
    out = []
    for n, canon, alias_n, al in (("scale_q", scale_q, "q_scale", q_scale), ("scale_k", scale_k, "k_scale", k_scale),
                                  ("scale_v", scale_v, "v_scale", v_scale)):
        if canon is not None:
            canon = _scale_slot(n, canon)
        out.append(_api.alias(_SINGLE, n, canon, alias_n, al))
    return out



def split_head_scales(q, k, kv_layout, o_dtype, names, scales):
    """Per-head scale tensors checked against q's and k's heads (``_head_scales.split``)."""
    _checks.check_choice("kv_layout", kv_layout, ("NHD", "HND"))
    _checks.check_tensor("q", q, ndim=3, dtype=_checks.ACCEPTED_Q_DTYPES, what="([qo_len, num_qo_heads, head_dim])")
    _checks.check_tensor("k", k, ndim=3, dtype=_checks.SUPPORTED_KV_DTYPES)
    hkv = k.shape[1] if kv_layout == "NHD" else k.shape[0]
    _checks.check_heads(q.shape[1], hkv, q.shape[2])
    out_dtype = q.dtype if o_dtype is None else _checks.to_dtype(o_dtype, "o_dtype")
    return _head_scales.split(names, scales, num_qo_heads=q.shape[1], num_kv_heads=hkv,
                              device=_checks.norm_device(q.device), out_dtype=out_dtype)

