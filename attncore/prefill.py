"""Prefill / append attention: single request and batches (paged or ragged KV).

FlashInfer-compatible signatures.  The wrappers' plan() options after the head sizes are keyword-only
(FlashInfer releases order them differently: a positional one raises ``TypeError``, it is never read
as another parameter).  Beyond FlashInfer, every entry
point takes ``backend=`` ("auto" or a backend name) and keyword-only ``sinks``, ``q_scale``,
``k_scale``, ``v_scale``, ``out`` and ``lse``; the chosen backend is visible as ``.backend``
(wrappers) or through ``attncore.explain``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _api
from . import ops as _ops
from . import params as _params
from .backend import BatchMeta, RunArgs
from .page import unpack_paged_kv_cache

Tensor = torch.Tensor


def _plan_single(*, q: Tensor, k: Tensor, v: Tensor, custom_mask: Optional[Tensor], packed_custom_mask: Optional[Tensor],
                 causal: bool, kv_layout: str, pos_encoding_mode: str, sm_scale, window_left, logits_soft_cap,
                 rope_scale, rope_theta, return_lse: bool, backend: str, sinks: Optional[Tensor], q_scale, k_scale,
                 v_scale, out: Optional[Tensor], lse: Optional[Tensor]) -> Tuple[_api.Planned, RunArgs]:
    """Validate a single prefill and plan it; returns the plan and the run's arguments.  Every argument is
    passed by keyword (the public functions, ``attncore.ops`` and POD all come here)."""
    _api.check_choice("kv_layout", kv_layout, ("NHD", "HND"))
    _api.check_tensor("q", q, ndim=3, dtype=_api.SUPPORTED_Q_DTYPES, what="([qo_len, num_qo_heads, head_dim])")
    _api.check_tensor("k", k, ndim=3, dtype=_api.SUPPORTED_KV_DTYPES)
    device = _api.norm_device(q.device)
    qo_len, hq, d = q.shape
    kv_len = k.shape[0] if kv_layout == "NHD" else k.shape[1]
    hkv = k.shape[1] if kv_layout == "NHD" else k.shape[0]
    _api.check_heads(hq, hkv, d)
    if q.stride(-1) != 1:
        raise ValueError(f"q: the last dimension must be contiguous (stride 1), got stride {q.stride(-1)}")
    _api.check_ragged_kv("k", k, kv_layout=kv_layout, n=kv_len, num_kv_heads=hkv, head_dim=d, kv_dtype=k.dtype,
                         device=device)
    _api.check_ragged_kv("v", v, kv_layout=kv_layout, n=kv_len, num_kv_heads=hkv, head_dim=d, kv_dtype=k.dtype,
                         device=device)
    has_mask = custom_mask is not None or packed_custom_mask is not None
    if causal and not has_mask and kv_len < qo_len:
        raise ValueError(f"causal: single prefill with causal=True needs kv_len >= qo_len, got kv_len {kv_len} "
                         f"< qo_len {qo_len}")
    params = _api.make_params(head_dim=d, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
                              pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
    if custom_mask is not None and packed_custom_mask is None:
        _api.check_tensor("custom_mask", custom_mask, shape=[qo_len, kv_len], what="([qo_len, kv_len] bool)")
        custom_mask = custom_mask.reshape(-1)
    meta = BatchMeta.ragged(qo_indptr_host=[0, qo_len], kv_indptr_host=[0, kv_len], device=device, params=params,
                            causal=causal, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask)
    sinks = _api.check_sinks(sinks, hq, device)
    scales = [_params.scale(n, x) for n, x in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale))]
    # plan and run are one call here: the run-time features are known, so select with them
    problem = _api.build_problem("single_prefill", device, q_dtype=q.dtype, kv_dtype=k.dtype, num_qo_heads=hq,
                                 num_kv_heads=hkv, head_dim=d, kv_layout=kv_layout, mask=meta.mask, params=params,
                                 return_lse=bool(return_lse), sinks=sinks is not None,
                                 fp8_scales=any(x != 1.0 for x in scales))
    planned = _api.Planned(problem, meta, backend)
    out = _api.alloc_out("out", out, (qo_len, hq, d), q.dtype, device)
    lse_t = _api.alloc_lse(lse, qo_len, hq, device) if return_lse else None
    args = RunArgs(q=q, k=k, v=v, out=out, lse=lse_t, sinks=sinks, q_scale=scales[0], k_scale=scales[1],
                   v_scale=scales[2])
    return planned, args


def _run_single(planned: _api.Planned, args: RunArgs):
    """Run a planned single prefill; returns (out or (out, lse), name of the backend that ran it)."""
    planned.run(args)
    return ((args.out, args.lse) if args.lse is not None else args.out), planned.backend_name


def single_prefill_with_kv_cache(
    q: Tensor, k: Tensor, v: Tensor, custom_mask: Optional[Tensor] = None,
    packed_custom_mask: Optional[Tensor] = None, causal: bool = False, kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE", allow_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None,
    window_left: int = -1, logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None, return_lse: bool = False, *, backend: str = "auto",
    sinks: Optional[Tensor] = None, q_scale: Optional[float] = None, k_scale: Optional[float] = None,
    v_scale: Optional[float] = None, out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
    use_fp16_qk_reduction: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Prefill/append attention of one request.

    Parameters
    ----------
    q : torch.Tensor
        ``[qo_len, num_qo_heads, head_dim]``, fp16/bf16/fp32.
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND);
        q's dtype or fp8 (then pass ``k_scale``/``v_scale``).
    custom_mask : torch.Tensor, optional
        bool ``[qo_len, kv_len]``, True = keep (replaces ``causal``, ANDed with the window).
    packed_custom_mask : torch.Tensor, optional
        uint8, the custom mask packed LSB-first (``packbits(mask.flatten(), "little")``).
    causal : bool
        Bottom-right aligned causal mask; needs ``kv_len >= qo_len``.
    allow_fp16_qk_reduction : bool
        A permission, not a requirement: backends may accumulate QK in fp16 (none do today).
    window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, pos_encoding_mode
        As in semantics.md.
    return_lse : bool
        Also return the base-2 LSE, float32 ``[qo_len, num_qo_heads]``.
    backend : str
        "auto" or a backend name.
    sinks : torch.Tensor, optional
        float32 ``[num_qo_heads]`` attention-sink logits.

    Returns
    -------
    out (``[qo_len, num_qo_heads, head_dim]``, q's dtype), and the LSE when ``return_lse``.
    """
    if _ops.compiling():  # inside torch.compile: one custom op (attncore::single_prefill), see attncore.ops
        return _ops.single_prefill_traced(
            q=q, k=k, v=v, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, return_lse=return_lse,
            backend=backend, sinks=sinks, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
    planned, args = _plan_single(  # the same keywords (host time: no dict built and unpacked per call)
        q=q, k=k, v=v, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
        kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
        logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, return_lse=return_lse,
        backend=backend, sinks=sinks, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
    return _run_single(planned, args)[0]


def single_prefill_with_kv_cache_return_lse(
    q: Tensor, k: Tensor, v: Tensor, custom_mask: Optional[Tensor] = None,
    packed_custom_mask: Optional[Tensor] = None, causal: bool = False, kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE", allow_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None,
    window_left: int = -1, logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None, *, return_lse: bool = True, backend: str = "auto",
    sinks: Optional[Tensor] = None, q_scale: Optional[float] = None, k_scale: Optional[float] = None,
    v_scale: Optional[float] = None, out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
    use_fp16_qk_reduction: bool = False,
):
    """``single_prefill_with_kv_cache`` returning ``(out, lse)`` by default."""
    return single_prefill_with_kv_cache(
        q, k, v, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal, kv_layout=kv_layout,
        pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
        logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, return_lse=return_lse,
        backend=backend, sinks=sinks, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)


class _BatchWrapper:
    """plan()/run() lifecycle shared by the batch wrappers."""

    _op = ""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", jit_args=None, graph_buffers: Optional[dict] = None):
        """``graph_buffers``: {role: (argument name, tensor or None)} of the caller's CUDA-graph buffers."""
        _api.check_tensor("float_workspace_buffer", float_workspace_buffer)
        _api.check_choice("kv_layout", kv_layout, ("NHD", "HND"))
        if jit_args is not None:
            raise ValueError("jit_args: got a value, but attncore does not take FlashInfer JIT arguments; "
                             "select a backend with backend= instead")
        self._float_workspace_buffer = float_workspace_buffer
        self._device = _api.norm_device(float_workspace_buffer.device)
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._requested_backend = backend
        self._planned: Optional[_api.Planned] = None
        self._fixed_batch_size: Optional[int] = None
        # torch.compile (attncore.ops): the handle that names this wrapper to attncore::run_planned, and
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
                    _api.check_tensor(name, buf, ndim=1, dtype=dtype, device=self._device)
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
        _api.check_tensor("float_workspace_buffer", float_workspace_buffer, device=self._device)
        self._float_workspace_buffer = float_workspace_buffer

    def _freeze_batch(self, batch_size: int) -> None:
        if not self._use_cuda_graph:
            return
        if self._fixed_batch_size is None:
            self._fixed_batch_size = batch_size
        elif batch_size != self._fixed_batch_size:
            raise ValueError(f"batch_size: got {batch_size}, but this wrapper uses CUDA graphs with a frozen "
                             f"batch size of {self._fixed_batch_size}")

    def _plan_with(self, op: str, meta: BatchMeta, q_data_type, kv_data_type, o_data_type, *, num_qo_heads: int,
                   num_kv_heads: int, head_dim: int, page_size: Optional[int] = None, q_len_per_req: int = 1) -> None:
        """Build the problem of this plan (dtype names parsed, kv/out default to q; the mask and the
        window are the batch's) and plan it."""
        q_dtype = _api.to_dtype(q_data_type, "q_data_type")
        problem = _api.build_problem(
            op, self._device, q_dtype=q_dtype, kv_dtype=_api.to_dtype(kv_data_type, "kv_data_type", q_dtype),
            out_dtype=_api.to_dtype(o_data_type, "o_data_type", q_dtype), num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, kv_layout=self._kv_layout,
            mask=meta.mask, params=meta.params, q_len_per_req=q_len_per_req, cuda_graph=self._use_cuda_graph)
        self._planned = _api.Planned(problem, meta, self._requested_backend)
        if not _ops.owns(self._op_handle, self):  # a copied wrapper gets its own handle
            self._op_handle = _ops.register(self)
        self._compile_spec = (self._op_handle, problem.num_qo_heads, problem.head_dim_vo, problem.out_dtype)

    def _require_plan(self) -> _api.Planned:
        if self._planned is None:
            raise RuntimeError(f"{type(self).__name__}.run() called before plan()")
        return self._planned

    def _check_q(self, q: Tensor) -> None:
        p = self._planned.problem
        meta = self._planned.meta
        _api.check_tensor("q", q, dtype=p.q_dtype, device=self._device,
                          shape=[meta.qo_indptr_host[-1], p.num_qo_heads, p.head_dim_qk],
                          what="(as planned: [nnz_qo, num_qo_heads, head_dim])")
        if q.stride(-1) != 1:
            raise ValueError(f"q: the last dimension must be contiguous (stride 1), got stride {q.stride(-1)}")

    def _paged_kv(self, paged_kv_cache):
        """(k_cache, v_cache) views of a paged cache, checked against the plan."""
        planned = self._planned
        p = planned.problem
        return _api.check_paged_cache(paged_kv_cache, kv_layout=p.kv_layout, num_kv_heads=p.num_kv_heads,
                                      head_dim=p.head_dim_qk, page_size=p.page_size, kv_dtype=p.kv_dtype,
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
        _api.check_tensor("q", q, ndim=3, dtype=p.q_dtype, device=self._device, shape=[None, hq, d],
                          what="(as planned: [nnz_qo, num_qo_heads, head_dim])")
        nhd = p.kv_layout == "NHD"
        if p.page_size is not None:
            exp = [None, p.page_size, hkv, d] if nhd else [None, hkv, p.page_size, d]
        else:
            exp = [None, hkv, d] if nhd else [hkv, None, d]
        for name, t in (("k", k), ("v", v)):
            _api.check_tensor(name, t, shape=exp, dtype=p.kv_dtype, device=self._device,
                              what=f"(as planned, {p.kv_layout})")
        rows = q.shape[0]
        _api.check_tensor("out", out, shape=[rows, hq, p.head_dim_vo], dtype=p.out_dtype, device=self._device)
        if lse is not None:
            _api.check_tensor("lse", lse, shape=[rows, hq], dtype=torch.float32, device=self._device)
        _api.check_sinks(sinks, hq, self._device)

    def _finish(self, q, k, v, *, out, lse, return_lse, sinks, q_scale, k_scale, v_scale):
        planned = self._planned
        p = planned.problem
        rows = q.shape[0]
        out = _api.alloc_out("out", out, (rows, p.num_qo_heads, p.head_dim_vo), p.out_dtype, self._device)
        lse_t = _api.alloc_lse(lse, rows, p.num_qo_heads, self._device) if return_lse else None
        planned.run(RunArgs(
            q=q, k=k, v=v, out=out, lse=lse_t, sinks=_api.check_sinks(sinks, p.num_qo_heads, self._device),
            q_scale=_params.scale("q_scale", q_scale), k_scale=_params.scale("k_scale", k_scale),
            v_scale=_params.scale("v_scale", v_scale)))
        return (out, lse_t) if return_lse else out

    # FlashInfer's legacy names
    def begin_forward(self, *args, **kwargs):
        return self.plan(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.run(*args, **kwargs)

    def end_forward(self) -> None:
        pass

    def run_return_lse(self, *args, **kwargs):
        return self.run(*args, return_lse=True, **kwargs)


# What follows the head sizes in the prefill plan()s: keyword-only (FlashInfer 0.2.14 inserts head_dim_vo
# first, older releases do not, so no position is shared).
_PREFILL_PLAN_KEYWORDS = ("custom_mask", "packed_custom_mask", "causal", "pos_encoding_mode", "sm_scale",
                          "window_left", "logits_soft_cap", "rope_scale", "rope_theta", "q_data_type",
                          "kv_data_type", "...")


class BatchPrefillWithPagedKVCacheWrapper(_BatchWrapper):
    """Batch prefill/append attention over a paged KV cache (FlashInfer-compatible)."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Optional[Tensor] = None, paged_kv_indptr_buf: Optional[Tensor] = None,
                 paged_kv_indices_buf: Optional[Tensor] = None, paged_kv_last_page_len_buf: Optional[Tensor] = None,
                 custom_mask_buf: Optional[Tensor] = None, qk_indptr_buf: Optional[Tensor] = None,
                 backend: str = "auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, graph_buffers=dict(
            qo_indptr=("qo_indptr_buf", qo_indptr_buf), indptr=("paged_kv_indptr_buf", paged_kv_indptr_buf),
            indices=("paged_kv_indices_buf", paged_kv_indices_buf),
            last_page_len=("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf),
            custom_mask=("custom_mask_buf", custom_mask_buf), qk_indptr=("qk_indptr_buf", qk_indptr_buf)))

    def plan(self, qo_indptr: Tensor, paged_kv_indptr: Tensor, paged_kv_indices: Tensor,
             paged_kv_last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             *args, custom_mask: Optional[Tensor] = None, packed_custom_mask: Optional[Tensor] = None,
             causal: bool = False, pos_encoding_mode: str = "NONE", allow_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1, logits_soft_cap: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, q_data_type="float16",
             kv_data_type=None, non_blocking: bool = False, o_data_type=None) -> None:
        """Plan a batch over a paged cache.  See FlashInfer's documentation; index tensors are int32
        (host or device), ``1 <= last_page_len <= page_size`` (0 only for an empty request).

        Everything after ``page_size`` is keyword-only (a positional one raises ``TypeError``):
        FlashInfer 0.2.14 puts ``head_dim_vo`` there, other releases ``custom_mask``."""
        _api.settled_positional("BatchPrefillWithPagedKVCacheWrapper.plan", args, "page_size", (),
                                _PREFILL_PLAN_KEYWORDS)
        _api.check_heads(num_qo_heads, num_kv_heads, head_dim)
        qo_host = _api.check_indptr("qo_indptr", qo_indptr)
        self._freeze_batch(len(qo_host) - 1)
        params = _api.make_params(head_dim=head_dim, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                                  window_left=window_left, pos_encoding_mode=pos_encoding_mode,
                                  rope_scale=rope_scale, rope_theta=rope_theta)
        meta = BatchMeta.paged(qo_host, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
                               device=self._device, params=params, causal=causal, custom_mask=custom_mask,
                               packed_custom_mask=packed_custom_mask, non_blocking=non_blocking,
                               buffers=self._graph_buffers if self._use_cuda_graph else None,
                               workspace=self._float_workspace_buffer)
        self._plan_with("batch_prefill_paged", meta, q_data_type, kv_data_type, o_data_type,
                        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size)

    def run(self, q: Tensor, paged_kv_cache, *args, k_scale: Optional[float] = None,
            v_scale: Optional[float] = None, return_lse: bool = False, q_scale: Optional[float] = None,
            out: Optional[Tensor] = None, lse: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
            enable_pdl: Optional[bool] = None):
        """Run the planned batch.  ``paged_kv_cache``: 5-D ``[pages, 2, page, Hkv, D]`` (NHD) /
        ``[pages, 2, Hkv, page, D]`` (HND) or a tuple of 4-D (k_cache, v_cache).
        Returns out ``[nnz_qo, Hq, D]`` (and float32 base-2 LSE ``[nnz_qo, Hq]`` with ``return_lse``)."""
        if args:  # FlashInfer's positional (k_scale, v_scale, return_lse)
            if len(args) > 3:
                _api.reject_extra("run", args[3:])
            k_scale, v_scale, return_lse = (list(args) + [k_scale, v_scale, return_lse][len(args):])[:3]
        if _ops.compiling():  # inside torch.compile: attncore::run_planned (attncore.ops)
            k, v = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
            return _ops.run_traced(self, q, k, v, out=out, lse=lse, return_lse=return_lse, sinks=sinks,
                                   q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        self._require_plan()
        self._check_q(q)
        k, v = self._paged_kv(paged_kv_cache)
        return self._finish(q, k, v, out=out, lse=lse, return_lse=return_lse, sinks=sinks, q_scale=q_scale,
                            k_scale=k_scale, v_scale=v_scale)

    def _check_kv(self, k: Tensor, v: Tensor):
        return self._paged_kv((k, v))


class BatchPrefillWithRaggedKVCacheWrapper(_BatchWrapper):
    """Batch prefill/append attention over ragged (dense, concatenated) K/V (FlashInfer-compatible)."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Optional[Tensor] = None, kv_indptr_buf: Optional[Tensor] = None,
                 custom_mask_buf: Optional[Tensor] = None, qk_indptr_buf: Optional[Tensor] = None,
                 backend: str = "auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, graph_buffers=dict(
            qo_indptr=("qo_indptr_buf", qo_indptr_buf), kv_indptr=("kv_indptr_buf", kv_indptr_buf),
            custom_mask=("custom_mask_buf", custom_mask_buf), qk_indptr=("qk_indptr_buf", qk_indptr_buf)))

    def plan(self, qo_indptr: Tensor, kv_indptr: Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             *args, custom_mask: Optional[Tensor] = None, packed_custom_mask: Optional[Tensor] = None,
             causal: bool = False, pos_encoding_mode: str = "NONE", allow_fp16_qk_reduction: bool = False,
             window_left: int = -1, logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, non_blocking: bool = False) -> None:
        """Plan a ragged batch: request i has q rows ``qo_indptr[i]:qo_indptr[i+1]`` and keys
        ``kv_indptr[i]:kv_indptr[i+1]`` (int32 indptrs).

        Everything after ``head_dim`` is keyword-only (a positional one raises ``TypeError``):
        FlashInfer 0.2.14 puts ``head_dim_vo`` there, other releases ``custom_mask``."""
        _api.settled_positional("BatchPrefillWithRaggedKVCacheWrapper.plan", args, "head_dim", (),
                                _PREFILL_PLAN_KEYWORDS)
        _api.check_heads(num_qo_heads, num_kv_heads, head_dim)
        params = _api.make_params(head_dim=head_dim, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                                  window_left=window_left, pos_encoding_mode=pos_encoding_mode,
                                  rope_scale=rope_scale, rope_theta=rope_theta)
        qo_host = _api.check_indptr("qo_indptr", qo_indptr)
        self._freeze_batch(len(qo_host) - 1)
        meta = BatchMeta.ragged(qo_indptr, kv_indptr, qo_indptr_host=qo_host, device=self._device, params=params,
                                causal=causal, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                                buffers=self._graph_buffers if self._use_cuda_graph else None,
                                workspace=self._float_workspace_buffer)
        self._plan_with("batch_prefill_ragged", meta, q_data_type, kv_data_type, o_data_type,
                        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)

    def run(self, q: Tensor, k: Tensor, v: Tensor, *args, return_lse: bool = False,
            q_scale: Optional[float] = None, k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            out: Optional[Tensor] = None, lse: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
            enable_pdl: Optional[bool] = None):
        """Run the planned batch.  k, v: ``[nnz_kv, Hkv, D]`` (NHD) or ``[Hkv, nnz_kv, D]`` (HND)."""
        if args:
            if len(args) > 1:
                _api.reject_extra("run", args[1:])
            return_lse = args[0]
        if _ops.compiling():  # inside torch.compile: attncore::run_planned (attncore.ops)
            return _ops.run_traced(self, q, k, v, out=out, lse=lse, return_lse=return_lse, sinks=sinks,
                                   q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        self._require_plan()
        self._check_q(q)
        k, v = self._check_kv(k, v)
        return self._finish(q, k, v, out=out, lse=lse, return_lse=return_lse, sinks=sinks, q_scale=q_scale,
                            k_scale=k_scale, v_scale=v_scale)

    def _check_kv(self, k: Tensor, v: Tensor):
        planned = self._planned
        p = planned.problem
        n = planned.meta.kv_indptr_host[-1]
        for name, t in (("k", k), ("v", v)):
            _api.check_ragged_kv(name, t, kv_layout=p.kv_layout, n=n, num_kv_heads=p.num_kv_heads,
                                 head_dim=p.head_dim_qk, kv_dtype=p.kv_dtype, device=self._device)
        return k, v
