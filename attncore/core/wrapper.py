"""The batch wrappers' shared machinery (``BatchPrefillWith{Paged,Ragged}KVCacheWrapper``,
``BatchDecodeWithPagedKVCacheWrapper`` and their CUDA-graph variants derive from ``_BatchWrapper``): the
workspaces, CUDA-graph buffers, the plan of one batch and its run-time fast path, and the checks of
run() arguments that every wrapper shares."""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch

from attncore.core import _api
from attncore.core import checks as _checks
from attncore.core import plan_cache as _plan_cache
from attncore.core import fp8_query as _fp8_query
from attncore.core import ops as _ops
from attncore.core import params as _params
from attncore.core.backend import BatchMeta, RunArgs

Tensor = torch.Tensor


_PLAIN = (type(None), bool, int, float, str)


def _plain(*values) -> bool:
    """Whether every value is a plain scalar (hashable, compared by value): a tensor is not."""
    for x in values:
        if x.__class__ not in _PLAIN:
            return False
    return True


class _BatchWrapper:
    """plan()/run() lifecycle shared by the batch wrappers."""

    _op = ""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", jit_args=None, graph_buffers: Optional[dict] = None, jit_kwargs=None):
        """``graph_buffers``: {role: (argument name, tensor or None)} of the caller's CUDA-graph buffers."""
        _checks.check_tensor("float_workspace_buffer", float_workspace_buffer)
        _checks.check_choice("kv_layout", kv_layout, ("NHD", "HND"))
        for name, given in (("jit_args", jit_args), ("jit_kwargs", jit_kwargs)):
            if given is not None:
                raise ValueError(f"{name}: got a value, but attncore does not take FlashInfer JIT arguments; "
                                 "select a backend with backend= instead")
        self._float_workspace_buffer = float_workspace_buffer
        self._device = _checks.norm_device(float_workspace_buffer.device)
        # The wrapper's own int workspace (plan-scoped: the batch's index tables and the backend's work tables,
        # BatchMeta.int_workspace), allocated once as FlashInfer 0.2.14 does; reset_workspace_buffer replaces it.
        self._int_workspace_buffer = torch.empty(_api.INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self._device)
        # run()'s fast path: {signature of a run's arguments: the checked scales}, emptied by every plan()
        self._run_cache: dict = {}
        self._kv_views = _KVViews()  # run()'s views of a combined paged cache
        # plan()'s memo (BatchMeta.memo): workspace views by address and layout, the problem and backend of a
        # plan signature (_plan_with); emptied when the workspaces change, bounded
        self._memo: dict = {}
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._requested_backend = backend
        self._planned: Optional[_api.Planned] = None
        self._fixed_batch_size: Optional[int] = None
        # torch.compile (attncore.core.ops): the handle that names this wrapper to attncore::run_planned, and
        # what a traced run() needs from the plan, (handle, num_qo_heads, head_dim_vo, out dtype), or None
        # before plan(). Compiled graphs guard on this tuple only: a re-plan that keeps it reuses them.
        self._op_handle = _ops.register(self)
        self._compile_spec: Optional[tuple] = None
        # In CUDA-graph mode plan() copies into these (the caller's, or allocated on first plan).
        self._graph_buffers: dict = {}
        if self._use_cuda_graph:
            for role, (name, buf) in (graph_buffers or {}).items():
                if buf is not None:
                    dtype = torch.uint8 if role == "custom_mask" else torch.int32
                    _checks.check_tensor(name, buf, ndim=1, dtype=dtype, device=self._device)
                    self._graph_buffers[role] = buf

    @property
    def backend(self) -> Optional[str]:
        """Name of the backend chosen at the last plan() (None before plan)."""
        return self._planned.backend_name if self._planned else None

    @property
    def problem(self):
        """The ``AttentionProblem`` of the last plan() (for ``attncore.explain``)."""
        return self._planned.problem if self._planned else None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: Tensor, int_workspace_buffer: Optional[Tensor] = None
                               ) -> None:
        """Replace the float workspace and (when given) the int workspace; the next ``plan()`` carves from them
        (a plan made before keeps the buffers it was made with)."""
        _checks.check_tensor("float_workspace_buffer", float_workspace_buffer, device=self._device)
        if int_workspace_buffer is not None:
            _checks.check_tensor("int_workspace_buffer", int_workspace_buffer, device=self._device, dtype=torch.uint8,
                              ndim=1, what="(a uint8 buffer, FlashInfer recommends 8 MiB)")
            self._int_workspace_buffer = int_workspace_buffer
        self._float_workspace_buffer = float_workspace_buffer
        self._memo = {}

    def _plan_memo(self) -> dict:
        """``BatchMeta.memo`` for this plan: the wrapper's memo, emptied when it grew past 256 entries."""
        if len(self._memo) > 256:
            self._memo = {}
        return self._memo

    def _freeze_batch(self, batch_size: int) -> None:
        if not self._use_cuda_graph:
            return
        if self._fixed_batch_size is None:
            self._fixed_batch_size = batch_size
        elif batch_size != self._fixed_batch_size:
            raise ValueError(f"batch_size: got {batch_size}, but this wrapper uses CUDA graphs with a frozen "
                             f"batch size of {self._fixed_batch_size}")

    def _plan_with(self, op: str, meta: BatchMeta, q_data_type, kv_data_type, o_data_type, *, num_qo_heads: int,
                   num_kv_heads: int, head_dim: int, page_size: Optional[int] = None, q_len_per_req: int = 1,
                   features: tuple = (None, False, False), head_dim_vo: Optional[int] = None) -> None:
        """Build the problem of this plan (dtype names parsed, kv/out default to q; the mask and the
        window are the batch's) and plan it.  ``features``: plan()'s (return_lse, sinks, fp8_scales), the
        run-time features planned up front (a CUDA-graph run never plans one); return_lse None: with an LSE
        in CUDA-graph mode when the chosen backend writes one (runs with and without it share the plan)."""
        return_lse, sinks, fp8_scales = _run_features(features)
        self._run_cache = {}
        # the problem of a plan signature, memoized (host time: a serving loop re-plans the same signature with
        # new lengths every step): keyed by every argument it is built from, by value and type (plain_key), and
        # the batch's mask and params; the layout, device and graph mode are the wrapper's own
        key = _checks.plain_key(op, q_data_type, kv_data_type, o_data_type, num_qo_heads, num_kv_heads, head_dim,
                                head_dim_vo, page_size, q_len_per_req, return_lse, sinks, fp8_scales)
        memo = self._plan_memo()
        hit = memo.get(("problem", key, meta.mask, meta.params)) if key is not None else None
        if hit is None:
            hit = self._build_problem(op, meta, q_data_type, kv_data_type, o_data_type, num_qo_heads, num_kv_heads,
                                      head_dim, head_dim_vo, page_size, q_len_per_req, return_lse, sinks, fp8_scales)
            if key is not None:
                memo[("problem", key, meta.mask, meta.params)] = hit
        problem, q_dtype = hit
        compute = problem.q_dtype
        make = _api.Planned if compute is q_dtype else functools.partial(_fp8_query.plan, q_dtype=q_dtype,
                                                                           out_name="o_data_type")
        self._planned = make(problem, meta, self._requested_backend, graph=self._use_cuda_graph,
                             prefer_lse=self._use_cuda_graph and return_lse is None, who=type(self).__name__)
        if not _ops.owns(self._op_handle, self):  # a copied wrapper gets its own handle
            self._op_handle = _ops.register(self)
        self._compile_spec = (self._op_handle, problem.num_qo_heads, problem.head_dim_vo, problem.out_dtype)

    def _build_problem(self, op, meta, q_data_type, kv_data_type, o_data_type, num_qo_heads, num_kv_heads, head_dim,
                       head_dim_vo, page_size, q_len_per_req, return_lse, sinks, fp8_scales) -> tuple:
        """(the problem of a plan, the caller's q dtype): dtype names parsed, kv/out default to q, an fp8 q
        computed in its upcast dtype (fp8_query)."""
        q_dtype = _checks.to_dtype(q_data_type, "q_data_type")
        out_dtype = _checks.to_dtype(o_data_type, "o_data_type", q_dtype)
        compute = _fp8_query.compute_dtype(q_dtype, out_dtype)  # an fp8 q is upcast to it (fp8_query)
        problem = _api.build_problem(
            op, self._device, q_dtype=compute, kv_dtype=_checks.to_dtype(kv_data_type, "kv_data_type", q_dtype),
            out_dtype=out_dtype, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_vo=head_dim_vo, page_size=page_size,
            kv_layout=self._kv_layout,
            mask=meta.mask, params=meta.params, q_len_per_req=q_len_per_req, cuda_graph=self._use_cuda_graph,
            return_lse=bool(return_lse), sinks=sinks, fp8_scales=fp8_scales)
        return problem, q_dtype

    def _require_plan(self) -> _api.Planned:
        if self._planned is None:
            raise RuntimeError(f"{type(self).__name__}.run() called before plan()")
        return self._planned

    def _check_q(self, q: Tensor) -> None:
        p = self._planned.problem
        meta = self._planned.meta
        _checks.check_tensor("q", q, dtype=self._planned.q_dtype, device=self._device,
                          shape=[meta.qo_indptr_host[-1], p.num_qo_heads, p.head_dim_qk],
                          what="(as planned: [nnz_qo, num_qo_heads, head_dim])")
        if q.stride(-1) != 1:
            raise ValueError(f"q: the last dimension must be contiguous (stride 1), got stride {q.stride(-1)}")

    def _paged_kv(self, paged_kv_cache):
        """(k_cache, v_cache) views of a paged cache, checked against the plan."""
        planned = self._planned
        p = planned.problem
        return _checks.check_paged_cache(paged_kv_cache, kv_layout=p.kv_layout, num_kv_heads=p.num_kv_heads,
                                      head_dim=p.head_dim_qk, head_dim_vo=p.head_dim_vo, page_size=p.page_size,
                                      kv_dtype=p.kv_dtype,
                                      device=self._device, max_page_id=planned.meta.max_page_id)

    def _check_kv(self, k: Tensor, v: Tensor):
        """(k, v) checked against the plan (ragged K/V, or the K and V page caches)."""
        raise NotImplementedError

    def _run_op(self, q, k, v, *, out, lse, sinks, q_scale, k_scale, v_scale) -> None:
        """The real implementation of ``attncore::run_planned``: the eager run() into ``out``/``lse``."""
        self._require_plan()
        self._check_q(q)
        k, v = self._check_kv(k, v)
        self._finish(q, k, v, out=out, lse=lse, return_lse=lse is not None, sinks=sinks, q_scale=q_scale,
                     k_scale=k_scale, v_scale=v_scale)

    def _check_static(self, q, k, v, *, out, lse, sinks) -> None:
        """The fake implementation's checks of ``attncore::run_planned``: what does not depend on
        lengths (dtypes, devices, heads, head dims, page size; out and lse against q's rows)."""
        planned = self._require_plan()
        p = planned.problem
        hq, hkv, d = p.num_qo_heads, p.num_kv_heads, p.head_dim_qk
        _checks.check_tensor("q", q, ndim=3, dtype=planned.q_dtype, device=self._device, shape=[None, hq, d],
                          what="(as planned: [nnz_qo, num_qo_heads, head_dim])")
        nhd = p.kv_layout == "NHD"
        for name, t, dim in (("k", k, d), ("v", v, p.head_dim_vo)):
            if p.page_size is not None:
                exp = [None, p.page_size, hkv, dim] if nhd else [None, hkv, p.page_size, dim]
            else:
                exp = [None, hkv, dim] if nhd else [hkv, None, dim]
            _checks.check_tensor(name, t, shape=exp, dtype=p.kv_dtype, device=self._device,
                              what=f"(as planned, {p.kv_layout})")
        rows = q.shape[0]
        _checks.check_tensor("out", out, shape=[rows, hq, p.head_dim_vo], dtype=p.out_dtype, device=self._device)
        if lse is not None:
            _checks.check_tensor("lse", lse, shape=[rows, hq], dtype=torch.float32, device=self._device)
        _checks.check_sinks(sinks, hq, self._device)

    def _launch(self, q, kv, *, out, lse, return_lse, sinks, q_scale, k_scale, v_scale):
        """run()'s eager path; ``kv``: the paged cache, or (k, v).  A run whose arguments have the signature of
        an earlier run of this plan (shapes, strides, dtypes, devices, scales: what the checks read) skips
        the checks and goes straight to the backend chosen for it, from its third run on through the backend's
        ``relaunch`` where it has one (host time); every plan() starts afresh."""
        planned = self._require_plan()
        key = None
        if _plain(q_scale, k_scale, v_scale):
            tk = _plan_cache.tkey
            kvk = tk(kv) if kv.__class__ is torch.Tensor else tuple(map(tk, kv))
            key = (tk(q), kvk, tk(out), tk(lse), return_lse, tk(sinks), q_scale, k_scale, v_scale)
            hit = self._run_cache.get(key)
            if hit is not None:
                scales, run, go = hit
                p = planned.problem
                if kv.__class__ is torch.Tensor:
                    k, v = self._kv_views.of(kv) if p.page_size is not None else kv
                else:
                    k, v = kv
                rows = q.shape[0]
                if out is None:
                    out = torch.empty((rows, p.num_qo_heads, p.head_dim_vo), dtype=p.out_dtype, device=self._device)
                if return_lse:
                    if lse is None:
                        lse = torch.empty((rows, p.num_qo_heads), dtype=torch.float32, device=self._device)
                else:
                    lse = None
                sk = None if sinks is None else sinks.float()
                if go:  # the backend's relaunch (Backend.relaunch): the key made run()'s checks redundant
                    go(q, k, v, out, lse, sk)
                else:
                    args = RunArgs(q, k, v, out, lse, sk, *scales)
                    run(args)
                    if go is None:  # the second run of this key: take the backend's relaunch, if it has one
                        hit[2] = (type(planned) is _api.Planned and planned.relaunch(args)) or False
                return (out, lse) if return_lse else out
        self._check_q(q)
        k, v = self._check_kv(*kv) if isinstance(kv, (tuple, list)) else self._paged_kv(kv)
        res = self._finish(q, k, v, out=out, lse=lse, return_lse=return_lse, sinks=sinks, q_scale=q_scale,
                           k_scale=k_scale, v_scale=v_scale)
        if key is not None:
            if len(self._run_cache) > 64:
                self._run_cache.clear()
            scales = tuple(_params.scale(n, x) for n, x in (("q_scale", q_scale), ("k_scale", k_scale),
                                                           ("v_scale", v_scale)))
            self._run_cache[key] = [scales, _direct_run(planned, return_lse, sinks is not None, scales), None]
        return res

    def _finish(self, q, k, v, *, out, lse, return_lse, sinks, q_scale, k_scale, v_scale):
        planned = self._planned
        p = planned.problem
        rows = q.shape[0]
        out = _api.alloc_out("out", out, (rows, p.num_qo_heads, p.head_dim_vo), p.out_dtype, self._device)
        lse_t = _api.alloc_lse(lse, rows, p.num_qo_heads, self._device) if return_lse else None
        planned.run(RunArgs(
            q=q, k=k, v=v, out=out, lse=lse_t, sinks=_checks.check_sinks(sinks, p.num_qo_heads, self._device),
            q_scale=_params.scale("q_scale", q_scale), k_scale=_params.scale("k_scale", k_scale),
            v_scale=_params.scale("v_scale", v_scale)))
        return (out, lse_t) if return_lse else out

    def _record_plan(self, call: dict, **attrs) -> None:
        """After a successful plan(): the attributes FlashInfer 0.2.14's wrappers keep and serving stacks read
        (``_sm_scale`` as given, ``_logits_soft_cap`` 0.0 for None, ...), and the call itself, which the
        legacy ``forward()`` plans again with its own options."""
        self._plan_call = call
        if attrs.get("_logits_soft_cap") is None:
            attrs["_logits_soft_cap"] = 0.0
        self.__dict__.update(attrs)

    def _legacy_forward(self, options: dict) -> None:
        """FlashInfer 0.2.14's ``forward()`` sets the plan-time options it is given (its defaults included)
        before running; attncore plans them, so a forward() whose options differ from the plan's plans again."""
        call = getattr(self, "_plan_call", None)
        if call is None:
            raise RuntimeError(f"{type(self).__name__}.forward() called before begin_forward()/plan()")
        norm = {"logits_soft_cap": lambda x: 0.0 if x is None else x, "use_fp16_qk_reduction": bool}
        if any(norm.get(n, lambda x: x)(call.get(n)) != norm.get(n, lambda x: x)(v) for n, v in options.items()):
            args, kwargs = call["__args__"]
            self.plan(*args, **{**kwargs, **options})

    # FlashInfer's legacy names
    def begin_forward(self, *args, **kwargs):
        return self.plan(*args, **kwargs)

    def end_forward(self) -> None:
        pass

    def run_return_lse(self, *args, **kwargs):
        return self.run(*args, return_lse=True, **kwargs)


def _direct_run(planned: _api.Planned, return_lse: bool, sinks: bool, scales: tuple):
    """What a cached run() calls with its ``RunArgs``: the backend's run bound to the plan variant these
    features chose (``Planned.variant``, already made by the checked run), or ``Planned.run`` itself where it
    does more around the backend (an fp8 q's upcast, per-head scales)."""
    if type(planned) is not _api.Planned or planned.q_upcast is not None or planned.o_heads is not None:
        return planned.run
    b, plan = planned.variant(return_lse=return_lse, sinks=sinks, fp8_scales=any(x != 1.0 for x in scales))
    return lambda args: b.run(plan, args)  # b.run read per call: a backend patched later is still called


class _KVViews:
    """The (k, v) views of the last combined paged cache a wrapper ran on (``unbind(1)`` costs a few us per
    run()): reused while the same tensor object is passed with the same data pointer (its shape, strides and
    dtype are in the run key); held through a weak reference, so that the views (which keep the cache's memory
    alive) are dropped with the cache."""

    __slots__ = ("ref", "ptr", "k", "v", "__weakref__")

    def __init__(self) -> None:
        self.ref = self.k = self.v = None
        self.ptr = -1

    def _drop(self, _ref=None) -> None:
        self.ref = self.k = self.v = None

    def of(self, kv: Tensor):
        ref = self.ref
        if ref is not None and ref() is kv and self.ptr == kv.data_ptr():
            return self.k, self.v
        k, v = (t.detach() for t in kv.unbind(1))  # detached: a view's _base would keep kv alive
        me = weakref.ref(self)
        self.ref = weakref.ref(kv, lambda r: (m := me()) is not None and m.ref is r and m._drop())
        self.ptr, self.k, self.v = kv.data_ptr(), k, v
        return k, v


# FlashInfer 0.2.14's positional orders of the prefill plan()s after the head sizes (for the messages)


def _run_features(features: tuple) -> tuple:
    """plan()'s keyword-only (return_lse, sinks, fp8_scales), checked: return_lse None or a bool; sinks a bool
    or the sinks tensor itself (only whether there are sinks is planned); fp8_scales a bool."""
    return_lse, sinks, fp8_scales = features
    if return_lse is not None and not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: got {return_lse!r}, expected None or a bool")
    if isinstance(sinks, torch.Tensor):
        sinks = True
    if not isinstance(sinks, bool):
        raise TypeError(f"sinks: got {sinks!r}, expected a bool (or the sinks tensor) in plan()")
    if not isinstance(fp8_scales, bool):
        raise TypeError(f"fp8_scales: got {fp8_scales!r}, expected a bool")
    return return_lse, sinks, fp8_scales


def _check_split(fixed_split_size) -> None:
    if fixed_split_size is not None and (not isinstance(fixed_split_size, int) or isinstance(fixed_split_size, bool)
                                         or fixed_split_size <= 0):
        raise ValueError(f"fixed_split_size: got {fixed_split_size!r}, expected None or a positive int")


def _run_positional(where: str, args: tuple, older: str) -> None:
    """0.2.14's run() takes positional arguments after the KV only for JIT custom kernels (attncore has none);
    releases before it read them as ``older``: neither reading is taken silently."""
    if args:
        raise TypeError(f"{where}: got {len(args)} positional argument(s) after the KV; FlashInfer 0.2.14 passes "
                        f"them to JIT custom kernels (attncore has none), older releases read them as {older}: "
                        f"pass {older} by keyword")
