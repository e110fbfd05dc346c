"""Cascade attention wrappers (FlashInfer 0.2.14's ``flashinfer.cascade`` wrappers), built on attncore's
public wrappers and the fused state merge of :mod:`attncore.cascade`.

* :class:`MultiLevelCascadeAttentionWrapper`: ``num_levels`` paged prefills over one paged cache, each
  with its own ``qo_indptr`` and page table (typically level 0: the whole batch as one request over
  the shared prefix pages; the last level: each request over its own pages). Every level covers the
  same query rows. ``causal`` applies to the last level only (bottom-right aligned within that
  level's request); the other levels are fully visible. The other options (``window_left``, soft cap,
  ``pos_encoding_mode``, scales) apply to every level as they would to a batch prefill over that
  level's keys alone (positions counted within the level), as in FlashInfer. ``run`` merges the
  levels' outputs through their base-2 LSEs in one launch of the fused merge kernel.
* :class:`BatchDecodeWithSharedPrefixPagedKVCacheWrapper` and
  :class:`BatchPrefillWithSharedPrefixPagedKVCacheWrapper` (deprecated in FlashInfer, kept for its
  users): a shared prefix given as contiguous ``k_shared``/``v_shared`` that every query row sees
  (a non-causal single prefill), merged with a batch decode / batch prefill over each request's
  paged suffix.

Signatures and positional order are FlashInfer 0.2.14's. attncore's extensions are keyword-only:
``backend=`` on the constructors ("auto" or a backend name, for every level), and ``return_lse``,
``out``, ``lse`` on ``run``/``forward`` (FlashInfer returns the output only; with ``return_lse=True``
the result is ``(out, lse)``, lse float32 base 2 ``[nnz, num_qo_heads]``, ``-inf`` where a row sees no
key at any level). A level's error is re-raised with ``level i:`` in front of its message.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from attncore.cascade.merge import _merge_stacked
from attncore.core import checks as _checks
from attncore.core.page_table import read_whole
from attncore.decode import BatchDecodeWithPagedKVCacheWrapper
from attncore.prefill import BatchPrefillWithPagedKVCacheWrapper, single_prefill_with_kv_cache

Tensor = torch.Tensor

__all__ = [
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
]


def _at_level(i: int, fn, *args, **kwargs):
    """Call ``fn``; a ValueError/TypeError it raises comes back with ``level i:`` in front (subclasses,
    such as ``BackendSelectionError``, keep their type and their message, with a note)."""
    try:
        return fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        if type(e) in (TypeError, ValueError):
            raise type(e)(f"level {i}: {e}") from e
        e.add_note(f"(level {i} of the cascade)")
        raise


def _check_levels(name: str, arr, num_levels: int, *, optional: bool = False) -> Optional[list]:
    if arr is None and optional:
        return None
    if not isinstance(arr, (list, tuple)):
        raise TypeError(f"{name}: got {type(arr).__name__}; accepted: a list of num_levels = {num_levels} "
                        f"tensors (one per level)")
    if len(arr) != num_levels:
        raise ValueError(f"{name}: got {len(arr)} entries; accepted: num_levels = {num_levels} (one tensor per "
                         f"level)")
    return list(arr)


def _check_3d(name: str, t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}; accepted: a torch.Tensor {what}")
    if t.dim() != 3:
        raise ValueError(f"{name}: got shape {tuple(t.shape)}; accepted: a 3-D tensor {what}")


def _check_result(name: str, t, shape, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}; accepted: a torch.Tensor {list(shape)}")
    if list(t.shape) != list(shape):
        raise ValueError(f"{name}: got shape {tuple(t.shape)}; accepted: {list(shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: got dtype {t.dtype}; accepted: {dtype}")
    if t.device != device:
        raise ValueError(f"{name}: got device {t.device}; accepted: {device} (q's device)")


def _merge_levels(vbuf: Tensor, sbuf: Tensor, q: Tensor, out, lse, return_lse: bool):
    """Merge ``vbuf [n, rows, H, D]`` / ``sbuf [n, rows, H]`` into ``out``/``lse`` (checked, or allocated)."""
    n, rows, heads, dim = vbuf.shape
    if out is not None:
        _check_result("out", out, (rows, heads, dim), vbuf.dtype, q.device)
    if lse is not None:
        _check_result("lse", lse, (rows, heads), torch.float32, q.device)
    out, lse = _merge_stacked(vbuf.permute(1, 0, 2, 3), sbuf.permute(1, 0, 2), out, lse)
    return (out, lse) if return_lse else out


def _kv_dtype(paged_kv_cache) -> Optional[torch.dtype]:
    if isinstance(paged_kv_cache, torch.Tensor):
        return paged_kv_cache.dtype
    if isinstance(paged_kv_cache, (tuple, list)) and paged_kv_cache and isinstance(paged_kv_cache[0], torch.Tensor):
        return paged_kv_cache[0].dtype
    return None


# --------------------------------------------------------------------------------------------------
# multi-level cascade
# --------------------------------------------------------------------------------------------------
class MultiLevelCascadeAttentionWrapper:
    """Multi-level cascade attention over one paged KV cache (FlashInfer-compatible).

    Level ``i`` is a paged batch prefill with ``qo_indptr_arr[i]`` and its own page table; every level
    covers the same ``nnz`` query rows (``qo_indptr_arr[i][-1]`` equal). The result is attention over
    the union of every level's keys for each row: the levels' states merged through their LSEs.
    """

    def __init__(self, num_levels, float_workspace_buffer: Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr: Optional[List[Tensor]] = None,
                 paged_kv_indptr_buf_arr: Optional[List[Tensor]] = None,
                 paged_kv_indices_buf_arr: Optional[List[Tensor]] = None,
                 paged_kv_last_page_len_buf_arr: Optional[List[Tensor]] = None, *, backend: str = "auto") -> None:
        """``num_levels >= 1``. In CUDA-graph mode (``use_cuda_graph=True``) the ``*_buf_arr`` give each
        level's fixed index buffers (one tensor per level; None: allocated at the first plan)."""
        if isinstance(num_levels, bool) or not isinstance(num_levels, int):
            raise TypeError(f"num_levels: got {num_levels!r}; accepted: an int >= 1")
        if num_levels < 1:
            raise ValueError(f"num_levels: got {num_levels}; accepted: an int >= 1")
        bufs = [_check_levels(name, arr, num_levels, optional=True) or [None] * num_levels
                for name, arr in (("qo_indptr_buf_arr", qo_indptr_buf_arr),
                                  ("paged_kv_indptr_buf_arr", paged_kv_indptr_buf_arr),
                                  ("paged_kv_indices_buf_arr", paged_kv_indices_buf_arr),
                                  ("paged_kv_last_page_len_buf_arr", paged_kv_last_page_len_buf_arr))]
        self._batch_prefill_wrappers = [
            _at_level(i, BatchPrefillWithPagedKVCacheWrapper, float_workspace_buffer, kv_layout,
                      use_cuda_graph=use_cuda_graph, qo_indptr_buf=bufs[0][i], paged_kv_indptr_buf=bufs[1][i],
                      paged_kv_indices_buf=bufs[2][i], paged_kv_last_page_len_buf=bufs[3][i], backend=backend)
            for i in range(num_levels)
        ]
        self._num_levels = num_levels
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._planned = False

    @property
    def num_levels(self) -> int:
        return self._num_levels

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def backend(self):
        """The backend of each level's last plan (a tuple, one name per level; None before plan)."""
        return tuple(w.backend for w in self._batch_prefill_wrappers) if self._planned else None

    def reset_workspace_buffer(self, float_workspace_buffer: Tensor,
                               int_workspace_buffers: Optional[Sequence[Tensor]] = None) -> None:
        """A new float workspace for every level; ``int_workspace_buffers``: one per level (or None)."""
        ints = _check_levels("int_workspace_buffers", int_workspace_buffers, self._num_levels, optional=True)
        for i, w in enumerate(self._batch_prefill_wrappers):
            _at_level(i, w.reset_workspace_buffer, float_workspace_buffer, ints[i] if ints else None)

    def plan(self, qo_indptr_arr: List[Tensor], paged_kv_indptr_arr: List[Tensor],
             paged_kv_indices_arr: List[Tensor], paged_kv_last_page_len: List[Tensor], num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1, logits_soft_cap: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             q_data_type="float16", kv_data_type=None) -> None:
        """Plan every level (host work: reads the index tensors). Each ``*_arr`` holds one int32 tensor
        per level, as a batch prefill plan takes them; ``causal`` applies to the last level only.
        ``use_fp16_qk_reduction`` is a permission (attncore's backends accumulate in fp32)."""
        self._planned = False
        L = self._num_levels
        arrs = [_check_levels(name, arr, L) for name, arr in (
            ("qo_indptr_arr", qo_indptr_arr), ("paged_kv_indptr_arr", paged_kv_indptr_arr),
            ("paged_kv_indices_arr", paged_kv_indices_arr), ("paged_kv_last_page_len", paged_kv_last_page_len))]
        nnz0 = None
        tables = [t for arr in (arrs[0], arrs[1], arrs[3]) for t in arr]
        tables += [t for t in arrs[2] if read_whole(t)]
        with _checks.read_together(tables):  # every level's tables in one device read
            for i, w in enumerate(self._batch_prefill_wrappers):
                _at_level(i, w.plan, arrs[0][i], arrs[1][i], arrs[2][i], arrs[3][i], num_qo_heads, num_kv_heads,
                          head_dim, page_size, causal=bool(causal) and i == L - 1,
                          pos_encoding_mode=pos_encoding_mode, allow_fp16_qk_reduction=use_fp16_qk_reduction,
                          sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                          rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
                          kv_data_type=kv_data_type)
                nnz = _checks.read_host([arrs[0][i]])[0][-1]  # checked by the level's plan: a 1-D int32 indptr
                if nnz0 is None:
                    nnz0 = nnz
                elif nnz != nnz0:
                    raise ValueError(f"qo_indptr_arr[{i}]: got qo_indptr[-1] = {nnz}; accepted: {nnz0}, as "
                                     f"qo_indptr_arr[0][-1] (every level covers the same query rows)")
        self._planned = True

    begin_forward = plan

    def run(self, q: Tensor, paged_kv_cache, *, return_lse: bool = False, out: Optional[Tensor] = None,
            lse: Optional[Tensor] = None):
        """Cascade attention of ``q [nnz, num_qo_heads, head_dim]`` over ``paged_kv_cache`` (5-D, or a
        tuple ``(k_cache, v_cache)``, in the wrapper's layout). Returns out ``[nnz, num_qo_heads,
        head_dim]`` in q's dtype (and the float32 base-2 LSE with ``return_lse=True``)."""
        if not self._planned:
            raise RuntimeError("MultiLevelCascadeAttentionWrapper.run() called before plan()")
        wrappers = self._batch_prefill_wrappers
        if self._num_levels == 1:
            return _at_level(0, wrappers[0].run, q, paged_kv_cache, return_lse=return_lse, out=out, lse=lse)
        _check_3d("q", q, "[nnz, num_qo_heads, head_dim]")
        p = wrappers[-1].problem
        rows = q.shape[0]
        vbuf = torch.empty(self._num_levels, rows, p.num_qo_heads, p.head_dim_vo, dtype=p.out_dtype, device=q.device)
        sbuf = torch.empty(self._num_levels, rows, p.num_qo_heads, dtype=torch.float32, device=q.device)
        for i, w in enumerate(wrappers):
            _at_level(i, w.run, q, paged_kv_cache, return_lse=True, out=vbuf[i], lse=sbuf[i])
        return _merge_levels(vbuf, sbuf, q, out, lse, return_lse)

    forward = run


# --------------------------------------------------------------------------------------------------
# shared prefix (deprecated in FlashInfer)
# --------------------------------------------------------------------------------------------------
def _check_shared(k_shared, v_shared, kv_layout: str, num_kv_heads: int, head_dim: int) -> None:
    form = "[shared_prefix_len, num_kv_heads, head_dim]" if kv_layout == "NHD" else \
        "[num_kv_heads, shared_prefix_len, head_dim]"
    for name, t in (("k_shared", k_shared), ("v_shared", v_shared)):
        _check_3d(name, t, f"{form} ({kv_layout})")
        heads = t.shape[1] if kv_layout == "NHD" else t.shape[0]
        if heads != num_kv_heads or t.shape[2] != head_dim:
            raise ValueError(f"{name}: got shape {tuple(t.shape)}; accepted: {form} ({kv_layout}) with "
                             f"num_kv_heads = {num_kv_heads} and head_dim = {head_dim}, as planned")


class _SharedPrefix:
    """The shared-prefix state (a non-causal single prefill) merged with the paged suffix's."""

    _inner = None  # the paged wrapper
    _backend = "auto"
    _kv_layout = "NHD"

    @property
    def backend(self) -> Optional[str]:
        """The backend of the paged suffix's last plan (None before it)."""
        return self._inner.backend

    def reset_workspace_buffer(self, float_workspace_buffer: Tensor, int_workspace_buffer=None) -> None:
        self._inner.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def end_forward(self) -> None:
        """Deprecated in FlashInfer; no effect."""

    def _run(self, q, k_shared, v_shared, unique_kv_cache, suffix, shared_kw, *, return_lse, out, lse):
        p = self._inner.problem
        _check_3d("q", q, "[nnz, num_qo_heads, head_dim]")
        _check_shared(k_shared, v_shared, self._kv_layout, p.num_kv_heads, p.head_dim_qk)
        rows = q.shape[0]
        vbuf = torch.empty(2, rows, p.num_qo_heads, p.head_dim_vo, dtype=p.out_dtype, device=q.device)
        sbuf = torch.empty(2, rows, p.num_qo_heads, dtype=torch.float32, device=q.device)
        suffix(q, unique_kv_cache, out=vbuf[1], lse=sbuf[1])  # checks q against the plan
        single_prefill_with_kv_cache(q, k_shared, v_shared, causal=False, kv_layout=self._kv_layout,
                                     return_lse=True, backend=self._backend, out=vbuf[0], lse=sbuf[0], **shared_kw)
        return _merge_levels(vbuf, sbuf, q, out, lse, return_lse)


class BatchDecodeWithSharedPrefixPagedKVCacheWrapper(_SharedPrefix):
    """Batch decode over a shared prefix (contiguous K/V every request sees) and each request's paged
    suffix (FlashInfer-compatible; deprecated there in favour of :class:`MultiLevelCascadeAttentionWrapper`).
    Default ``sm_scale`` (``1/sqrt(head_dim)``), no positional encoding."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", *, backend: str = "auto") -> None:
        self._inner = self._batch_decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(
            float_workspace_buffer, kv_layout, backend=backend)
        self._kv_layout = kv_layout
        self._backend = backend
        self._planned = False

    def begin_forward(self, unique_kv_indptr: Tensor, unique_kv_indices: Tensor, unique_kv_last_page_len: Tensor,
                      num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                      data_type="float16") -> None:
        """Plan the decode over the unique suffixes (int32 ``indptr [B+1]``, ``indices``,
        ``last_page_len [B]``). ``data_type``: the dtype of q and of the KV cache (FlashInfer
        0.2.14's shared-prefix wrapper plans both with it)."""
        self._planned = False
        self._inner.plan(unique_kv_indptr, unique_kv_indices, unique_kv_last_page_len, num_qo_heads, num_kv_heads,
                         head_dim, page_size, pos_encoding_mode="NONE", q_data_type=data_type,
                         kv_data_type=data_type)
        self._planned = True

    plan = begin_forward

    def forward(self, q: Tensor, k_shared: Tensor, v_shared: Tensor, unique_kv_cache, *, return_lse: bool = False,
                out: Optional[Tensor] = None, lse: Optional[Tensor] = None):
        """Decode ``q [batch_size, num_qo_heads, head_dim]`` over the shared prefix ``k_shared``/``v_shared``
        (``[shared_prefix_len, Hkv, D]`` NHD or ``[Hkv, shared_prefix_len, D]`` HND) and each request's
        paged suffix ``unique_kv_cache``. Returns out ``[batch_size, num_qo_heads, head_dim]`` (and the
        LSE with ``return_lse=True``)."""
        if not self._planned:
            raise RuntimeError("BatchDecodeWithSharedPrefixPagedKVCacheWrapper.forward() called before "
                               "begin_forward()")

        def suffix(q, cache, *, out, lse):
            self._inner.run(q, cache, return_lse=True, out=out, lse=lse)

        return self._run(q, k_shared, v_shared, unique_kv_cache, suffix, {}, return_lse=return_lse, out=out,
                         lse=lse)

    run = forward


class BatchPrefillWithSharedPrefixPagedKVCacheWrapper(_SharedPrefix):
    """Batch prefill/append over a shared prefix (contiguous K/V every query row sees in full) and each
    request's paged suffix (causal there when ``forward(..., causal=True)``); FlashInfer-compatible,
    deprecated there in favour of :class:`MultiLevelCascadeAttentionWrapper`.

    ``begin_forward`` takes no options, ``forward`` does (``causal``, ``sm_scale``, ...) and q's and the
    cache's dtypes are first seen there: the suffix is planned at ``begin_forward`` for the defaults
    (non-causal, float16) and planned again, from the tensors given to ``begin_forward``, when a
    ``forward`` brings other options or dtypes (host work: keep them fixed across layers)."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", *, backend: str = "auto") -> None:
        self._inner = self._batch_prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(
            float_workspace_buffer, kv_layout, backend=backend)
        self._kv_layout = kv_layout
        self._backend = backend
        self._plan_args = None
        self._plan_key = None

    def begin_forward(self, qo_indptr: Tensor, paged_kv_indptr: Tensor, paged_kv_indices: Tensor,
                      paged_kv_last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                      page_size: int) -> None:
        """Plan over the unique suffixes: int32 ``qo_indptr [B+1]``, ``paged_kv_indptr [B+1]``,
        ``paged_kv_indices``, ``paged_kv_last_page_len [B]`` (copied: later changes to them do not
        affect this plan)."""
        self._plan_args = self._plan_key = None
        args = tuple(t.clone() if isinstance(t, torch.Tensor) else t
                     for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)) + (
            num_qo_heads, num_kv_heads, head_dim, page_size)
        key = (False, False, None, None, None, torch.float16, torch.float16)
        self._plan(args, key)

    plan = begin_forward

    def _plan(self, args, key) -> None:
        causal, fp16_qk, sm_scale, rope_scale, rope_theta, q_dtype, kv_dtype = key
        self._inner.plan(*args, causal=causal, allow_fp16_qk_reduction=fp16_qk, sm_scale=sm_scale,
                         rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._plan_args, self._plan_key = args, key

    def forward(self, q: Tensor, k_shared: Tensor, v_shared: Tensor, unique_kv_cache, causal: bool = False,
                use_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, *,
                return_lse: bool = False, out: Optional[Tensor] = None, lse: Optional[Tensor] = None):
        """Prefill ``q [qo_indptr[-1], num_qo_heads, head_dim]`` over the shared prefix (every row sees
        all of it) and each request's paged suffix (bottom-right causal with ``causal=True``). Returns
        out ``[qo_indptr[-1], num_qo_heads, head_dim]`` (and the LSE with ``return_lse=True``)."""
        if self._plan_args is None:
            raise RuntimeError("BatchPrefillWithSharedPrefixPagedKVCacheWrapper.forward() called before "
                               "begin_forward()")
        _check_3d("q", q, "[qo_indptr[-1], num_qo_heads, head_dim]")
        kv_dtype = _kv_dtype(unique_kv_cache) or self._plan_key[6]
        key = (bool(causal), bool(use_fp16_qk_reduction), sm_scale, rope_scale, rope_theta, q.dtype, kv_dtype)
        if key != self._plan_key:
            self._plan(self._plan_args, key)

        def suffix(q, cache, *, out, lse):
            self._inner.run(q, cache, return_lse=True, out=out, lse=lse)

        shared_kw = dict(allow_fp16_qk_reduction=bool(use_fp16_qk_reduction), sm_scale=sm_scale,
                         rope_scale=rope_scale, rope_theta=rope_theta)
        return self._run(q, k_shared, v_shared, unique_kv_cache, suffix, shared_kw, return_lse=return_lse, out=out,
                         lse=lse)

    run = forward
