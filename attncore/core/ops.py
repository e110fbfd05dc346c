"""attncore's ``torch.library`` custom ops: ``wrapper.run()`` and the one-call functions inside
``torch.compile(fullgraph=True)`` without graph breaks (docs/semantics.md, "torch.compile").

In eager mode nothing here runs: the public functions take their usual Python path (the only cost is
one ``torch.compiler.is_compiling()`` call).  While Dynamo (or ``torch.export``) traces them, they
allocate ``out``/``lse`` in the traced region and call one op that writes them in place:

* ``attncore::run_planned(handle, q, k, v, out!, lse!?, sinks?, scales...)``: the batch wrappers'
  ``run()``.  A wrapper is a Python object and cannot be an op argument, so each wrapper gets an
  integer handle at construction, and a registry of weak references maps the handle back to it.  The
  op runs whatever the wrapper's *current* plan is (as eager ``run()`` does): a re-plan between
  calls of a compiled function changes no graph, and with the same heads, head dims and dtypes needs
  no recompilation either (only new tensor shapes can cause one).
* ``attncore::single_prefill(q, k, v, out!, lse!?, mask?, options...)``: single prefill (and single
  decode, which is a single prefill of one row).  Plan and run are one call, inside the op.

The real implementation of each op is the eager path (every check, backend selection, the launch);
the fake one checks what is static (dtypes, devices, head counts, head dims, the shapes of ``out``
and ``lse`` against q) and allocates nothing.  Lengths that depend on the plan (the rows of q, the
keys) are checked by the real implementation when the op runs, so a symbolic length is never
specialised by a check.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Dict, Optional

import torch

from attncore.core import _api
from attncore.core import checks as _checks
from attncore.core import params as _params

Tensor = torch.Tensor

__all__ = ["compiling", "register", "owns", "lookup", "run_planned", "single_prefill", "run_traced",
           "single_prefill_traced"]

#: True while Dynamo / torch.export trace (bound once: a plain call in eager mode).
compiling = torch.compiler.is_compiling

# ----------------------------------------------------------------------------- live wrappers
_live: Dict[int, "weakref.ref"] = {}
_next_handle = itertools.count(1)
_lock = threading.Lock()


def register(obj) -> int:
    """A new handle naming ``obj`` (held weakly: the registry never keeps a wrapper alive)."""
    with _lock:
        h = next(_next_handle)
        _live[h] = weakref.ref(obj, lambda _ref, h=h: _live.pop(h, None))
    return h


def owns(handle: Optional[int], obj) -> bool:
    """Whether ``handle`` names ``obj`` (False for a copy of a wrapper, which carries its original's handle)."""
    ref = _live.get(handle) if handle is not None else None
    return ref is not None and ref() is obj


def lookup(handle: int):
    """The live object a handle names; ``RuntimeError`` when it was freed (or never existed)."""
    ref = _live.get(handle)
    obj = ref() if ref is not None else None
    if obj is None:
        raise RuntimeError(f"attncore: wrapper handle {handle} names no live wrapper (it was garbage collected); "
                           f"a compiled function must not outlive the wrappers it runs")
    return obj


def _scale_arg(name: str, value):
    """A run-time scale as the op takes it: (float or None, 1-element tensor or None).  Numbers are
    checked here (``attncore.core.params``, a plain Python rule), tensors by the op (reading one is a sync)."""
    if isinstance(value, torch.Tensor):
        return None, value
    return (None if value is None else _params.scale(name, value)), None


# ----------------------------------------------------------------------------- run_planned
@torch.library.custom_op("attncore::run_planned", mutates_args=("out", "lse"))
def run_planned(handle: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor],
                sinks: Optional[Tensor], q_scale: Optional[float], k_scale: Optional[float],
                v_scale: Optional[float], q_scale_t: Optional[Tensor], k_scale_t: Optional[Tensor],
                v_scale_t: Optional[Tensor]) -> None:
    """Run the current plan of wrapper ``handle``: write ``out`` (and ``lse`` when given).  k, v: the
    ragged K/V, or the K and V page caches (4-D views) of a paged wrapper."""
    w = lookup(handle)
    w._run_op(q, k, v, out=out, lse=lse, sinks=sinks,
              q_scale=q_scale if q_scale_t is None else q_scale_t,
              k_scale=k_scale if k_scale_t is None else k_scale_t,
              v_scale=v_scale if v_scale_t is None else v_scale_t)


@run_planned.register_fake
def _run_planned_fake(handle, q, k, v, out, lse, sinks, q_scale, k_scale, v_scale, q_scale_t, k_scale_t,
                      v_scale_t) -> None:
    lookup(handle)._check_static(q, k, v, out=out, lse=lse, sinks=sinks)
    for name, t in (("q_scale", q_scale_t), ("k_scale", k_scale_t), ("v_scale", v_scale_t)):
        if t is not None:
            _check_scale_tensor(name, t)
    return None


def _check_scale_tensor(name: str, t: Tensor) -> None:
    if t.dtype not in _params._SCALE_DTYPES or t.numel() != 1:
        raise ValueError(f"{name}: got a tensor of dtype {t.dtype} and shape {list(t.shape)}, expected a float "
                         f"or a 1-element float32/float16/bfloat16/float64 tensor")


def run_traced(wrapper, q: Tensor, k: Tensor, v: Tensor, *, out, lse, return_lse, sinks, q_scale, k_scale,
               v_scale):
    """``wrapper.run()`` while tracing: allocate out/lse in the graph and call ``run_planned``."""
    spec = wrapper._compile_spec
    if spec is None:
        raise RuntimeError(f"{type(wrapper).__name__}.run() called before plan(); under torch.compile, call plan() "
                           f"outside the compiled function, before it runs")
    handle, num_qo_heads, head_dim_vo, out_dtype = spec
    rows = q.shape[0]
    if out is None:
        out = torch.empty((rows, num_qo_heads, head_dim_vo), dtype=out_dtype, device=q.device)
    if not return_lse:
        lse = None
    elif lse is None:
        lse = torch.empty((rows, num_qo_heads), dtype=torch.float32, device=q.device)
    qs, qs_t = _scale_arg("q_scale", q_scale)
    ks, ks_t = _scale_arg("k_scale", k_scale)
    vs, vs_t = _scale_arg("v_scale", v_scale)
    torch.ops.attncore.run_planned(handle, q, k, v, out, lse, sinks, qs, ks, vs, qs_t, ks_t, vs_t)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- single_prefill
@torch.library.custom_op("attncore::single_prefill", mutates_args=("out", "lse"))
def single_prefill(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor],
                   custom_mask: Optional[Tensor], packed_custom_mask: Optional[Tensor], causal: bool,
                   kv_layout: str, pos_encoding_mode: str, sm_scale: Optional[float], window_left: int,
                   logits_soft_cap: Optional[float], rope_scale: Optional[float], rope_theta: Optional[float],
                   backend: str, sinks: Optional[Tensor], q_scale: Optional[float], k_scale: Optional[float],
                   v_scale: Optional[float], q_scale_t: Optional[Tensor], k_scale_t: Optional[Tensor],
                   v_scale_t: Optional[Tensor]) -> None:
    """Plan and run one single prefill (the eager path of ``single_prefill_with_kv_cache``) into
    ``out`` (and ``lse`` when given)."""
    from attncore.core.single_prefill import plan_single

    planned, args = plan_single(
        q=q, k=k, v=v, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
        kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
        logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, return_lse=lse is not None,
        backend=backend, sinks=sinks, q_scale=q_scale if q_scale_t is None else q_scale_t,
        k_scale=k_scale if k_scale_t is None else k_scale_t, v_scale=v_scale if v_scale_t is None else v_scale_t,
        out=out, lse=lse)
    planned.run(args)


@single_prefill.register_fake
def _single_prefill_fake(q, k, v, out, lse, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode,
                         sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, backend, sinks, q_scale,
                         k_scale, v_scale, q_scale_t, k_scale_t, v_scale_t) -> None:
    _checks.check_choice("kv_layout", kv_layout, ("NHD", "HND"))
    _checks.check_tensor("q", q, ndim=3, dtype=_checks.SUPPORTED_Q_DTYPES, what="([qo_len, num_qo_heads, head_dim])")
    _checks.check_tensor("k", k, ndim=3, dtype=_checks.SUPPORTED_KV_DTYPES)
    device = q.device
    # heads and head dims are specialised (int() guards a symbolic one; kernels are specialised on them too)
    qo_len, hq, d = q.shape[0], int(q.shape[1]), int(q.shape[2])
    hkv = int(k.shape[1] if kv_layout == "NHD" else k.shape[0])
    _checks.check_heads(hq, hkv, d)
    exp = [None, hkv, d] if kv_layout == "NHD" else [hkv, None, d]
    for name, t in (("k", k), ("v", v)):
        _checks.check_tensor(name, t, shape=exp, dtype=k.dtype, device=device)
    _api.make_params(head_dim=d, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
                     pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)  # checks
    _checks.check_tensor("out", out, shape=[qo_len, hq, d], dtype=q.dtype, device=device)
    if lse is not None:
        _checks.check_tensor("lse", lse, shape=[qo_len, hq], dtype=torch.float32, device=device)
    _checks.check_sinks(sinks, hq, device)
    for name, t in (("q_scale", q_scale_t), ("k_scale", k_scale_t), ("v_scale", v_scale_t)):
        if t is not None:
            _check_scale_tensor(name, t)
    return None


def single_prefill_traced(*, q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode, sm_scale,
                          window_left, logits_soft_cap, rope_scale, rope_theta, return_lse, backend, sinks, q_scale,
                          k_scale, v_scale, out, lse):
    """``single_prefill_with_kv_cache`` while tracing: allocate out/lse and call ``single_prefill`` (every
    argument by keyword, as ``single_prefill.plan_single`` takes them)."""
    _checks.check_tensor("q", q, ndim=3, what="([qo_len, num_qo_heads, head_dim])")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not return_lse:
        lse = None
    elif lse is None:
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    qs, qs_t = _scale_arg("q_scale", q_scale)
    ks, ks_t = _scale_arg("k_scale", k_scale)
    vs, vs_t = _scale_arg("v_scale", v_scale)
    torch.ops.attncore.single_prefill(
        q=q, k=k, v=v, out=out, lse=lse, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
        causal=bool(causal), kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
        window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
        backend=backend or "auto", sinks=sinks, q_scale=qs, k_scale=ks, v_scale=vs, q_scale_t=qs_t, k_scale_t=ks_t,
        v_scale_t=vs_t)
    return (out, lse) if return_lse else out
