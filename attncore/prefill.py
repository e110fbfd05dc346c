"""Prefill / append attention: single request and batches (paged or ragged KV).

FlashInfer-compatible signatures in FlashInfer 0.2.14's positional order (docs/semantics.md,
"Parameters"): a value that only fits another release's order raises ``TypeError``, it is never read
as another parameter; other releases' spellings are keyword aliases.  Beyond FlashInfer, every entry
point takes ``backend=`` ("auto" or a backend name) and keyword-only ``sinks``, ``q_scale``,
``k_scale``, ``v_scale``, ``out`` and ``lse``; the chosen backend is visible as ``.backend``
(wrappers) or through ``attncore.explain``.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import torch

from attncore.core import _api
from attncore.core import checks as _checks
from attncore.core import fp8_query as _fp8_query
from attncore.core import multi_item as _multi_item
from attncore.core import ops as _ops
from attncore.core import params as _params
from attncore.core.backend import BatchMeta
from attncore.core.page_table import prefetch_paged
from attncore.core import plan_cache as _plan_cache
from attncore.core.single_prefill import (plan_single, run_cached, run_single, single_compat, single_key,
                                         split_head_scales)
from attncore.core.wrapper import _BatchWrapper, _check_split, _run_positional
from attncore.page import unpack_paged_kv_cache

Tensor = torch.Tensor


def single_prefill_with_kv_cache(
    q: Tensor, k: Tensor, v: Tensor, scale_q: Optional[Tensor] = None, scale_k: Optional[Tensor] = None,
    scale_v: Optional[Tensor] = None, o_dtype: Optional[torch.dtype] = None, custom_mask: Optional[Tensor] = None,
    packed_custom_mask: Optional[Tensor] = None, causal: bool = False, kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: Optional[bool] = None, sm_scale: Optional[float] = None,
    window_left: int = -1, logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None, backend: str = "auto", return_lse: bool = False, *,
    sinks: Optional[Tensor] = None, q_scale: Optional[float] = None, k_scale: Optional[float] = None,
    v_scale: Optional[float] = None, out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
    allow_fp16_qk_reduction: Optional[bool] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Prefill/append attention of one request.

    Positional order: FlashInfer 0.2.14's (``q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, ...,
    rope_theta, backend, return_lse``).  A value that fits the older order instead (a bool mask where
    ``scale_q`` goes, a bool where ``backend`` goes...) raises ``TypeError``: pass it by keyword.

    Parameters
    ----------
    q : torch.Tensor
        ``[qo_len, num_qo_heads, head_dim]``, fp16/bf16/fp32, or fp8 (e4m3/e5m2): upcast exactly to
        ``o_dtype`` when that is fp16/bf16/fp32, else fp16, before a backend is selected
        (``attncore.core.fp8_query``).
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND);
        q's dtype or fp8 (then pass ``k_scale``/``v_scale``).  v's last dim is ``head_dim_vo`` and may
        differ from q's and k's (DeepSeek-style 192/128); the output has it.
    scale_q, scale_k, scale_v : float or torch.Tensor, optional
        FlashInfer 0.2.14's names of ``q_scale``/``k_scale``/``v_scale`` (keyword aliases; giving both
        spellings is a ``TypeError``).  Each may also be a per-head float tensor (``[num_qo_heads]`` for q,
        ``[num_kv_heads]`` for k and v), as FlashInfer's per-head fp8 quantization gives: folded into q and
        applied to the output (``attncore.core.head_scales``; semantics.md, "FP8 and scales").
    o_dtype : torch.dtype, optional
        Output dtype (default q's, as in FlashInfer 0.2.14: with an fp8 q an fp8 output, which the prefill
        backends do not write, so pass ``o_dtype`` then); a backend that cannot write it is refused with the
        reason.
    custom_mask : torch.Tensor, optional
        bool ``[qo_len, kv_len]`` (or flattened, as FlashInfer takes it too), True = keep (replaces
        ``causal``, ANDed with the window).
    packed_custom_mask : torch.Tensor, optional
        uint8, the custom mask packed LSB-first (``packbits(mask.flatten(), "little")``).
    causal : bool
        Bottom-right aligned causal mask; needs ``kv_len >= qo_len``.
    use_fp16_qk_reduction : bool
        (alias ``allow_fp16_qk_reduction``) A permission, not a requirement: backends may accumulate QK
        in fp16 (none do today).
    window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, pos_encoding_mode
        As in semantics.md.
    backend : str
        "auto", a backend name, or one of FlashInfer's names (semantics.md, "API surface").
    return_lse : bool
        Also return the base-2 LSE, float32 ``[qo_len, num_qo_heads]``.
    sinks : torch.Tensor, optional
        float32 ``[num_qo_heads]`` attention-sink logits.

    Returns
    -------
    out (``[qo_len, num_qo_heads, head_dim_vo]``, ``o_dtype``), and the LSE when ``return_lse``.
    """
    heads = None
    if (scale_q is not None or scale_k is not None or scale_v is not None or o_dtype is not None
            or backend.__class__ is not str or use_fp16_qk_reduction is not None or allow_fp16_qk_reduction is not None):
        names = tuple(a if x is not None else b for a, b, x in (("scale_q", "q_scale", scale_q),
                                                                ("scale_k", "k_scale", scale_k),
                                                                ("scale_v", "v_scale", scale_v)))
        q_scale, k_scale, v_scale = single_compat(scale_q, scale_k, scale_v, o_dtype, q_scale, k_scale, v_scale,
                                                  backend, use_fp16_qk_reduction, allow_fp16_qk_reduction)
        # per-head tensors on FlashInfer's spellings only (attncore's q_scale/k_scale/v_scale are per tensor)
        if any(isinstance(x, Tensor) and x.numel() > 1 for x in (scale_q, scale_k, scale_v)):
            heads, q_scale, k_scale, v_scale = split_head_scales(q, k, kv_layout, o_dtype, names,
                                                                 (q_scale, k_scale, v_scale))
    if _ops.compiling():  # inside torch.compile: one custom op (attncore::single_prefill), see attncore.core.ops
        if heads is not None:
            raise NotImplementedError(f"{', '.join(names)}: per-head scales with differing values are not "
                                      f"supported under torch.compile; call it eagerly")
        if _fp8_query.is_fp8(q.dtype):
            raise NotImplementedError("q: an fp8 q is not supported under torch.compile (attncore::single_prefill "
                                      "takes q's dtype as the compute dtype); call it eagerly")
        if o_dtype is not None and _checks.to_dtype(o_dtype, "o_dtype") != q.dtype:
            raise NotImplementedError("o_dtype: an output dtype other than q's is not supported under torch.compile "
                                      "(attncore::single_prefill writes q's dtype); call it eagerly")
        if v.shape[-1] != q.shape[-1]:
            raise NotImplementedError(f"v: a last dim ({v.shape[-1]}) other than q's ({q.shape[-1]}) is not supported "
                                      f"under torch.compile (attncore::single_prefill's output has q's shape); call "
                                      f"it eagerly")
        return _ops.single_prefill_traced(
            q=q, k=k, v=v, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, return_lse=return_lse,
            backend=backend, sinks=sinks, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
    # a seen signature runs its cached plan at once (the key: single_key); a miss plans through plan_single
    key = single_key(q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode, sm_scale,
                     window_left, logits_soft_cap, rope_scale, rope_theta, return_lse, backend, sinks, q_scale, k_scale,
                     v_scale, out, lse, o_dtype, heads)
    hit = _plan_cache.ONE_CALL_PLANS.get(key) if key is not None else None
    if hit is not None:
        out, lse = run_cached(hit, q, k, v, out, lse, return_lse, sinks)
        return (out, lse) if return_lse else out
    planned, args = plan_single(  # the same keywords (host time: no dict built and unpacked per call)
        q=q, k=k, v=v, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
        kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
        logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, return_lse=return_lse,
        backend=backend, sinks=sinks, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
        o_dtype=o_dtype, heads=heads, memo_key=key, looked_up=True)
    return run_single(planned, args)[0]


# FlashInfer 0.2.14's own definition: the same positional order, returning (out, lse) by default (so a
# return_lse given by position too is a TypeError, as there)
single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
single_prefill_with_kv_cache_return_lse.__doc__ = (
    "``single_prefill_with_kv_cache`` returning ``(out, lse)`` by default (FlashInfer 0.2.14's "
    "``functools.partial(single_prefill_with_kv_cache, return_lse=True)``).")


_PAGED_ORDER = ("..., num_kv_heads, head_dim_qk, page_size, head_dim_vo, custom_mask, packed_custom_mask, causal, "
                "pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, "
                "rope_theta, q_data_type, kv_data_type, non_blocking, prefix_len_ptr, ...")
_RAGGED_ORDER = ("..., num_kv_heads, head_dim_qk, head_dim_vo, custom_mask, packed_custom_mask, causal, "
                 "pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale, rope_scale, "
                 "rope_theta, q_data_type, kv_data_type, non_blocking, prefix_len_ptr, ...")


def _prefill_plan_compat(where: str, order: str, head_dim_qk, head_dim, head_dim_vo, custom_mask, packed_custom_mask,
                         causal, pos_encoding_mode, use_fp16_qk_reduction, allow_fp16_qk_reduction):
    """The checks both prefill plan()s share: 0.2.14's slots against the older order (which has no head_dim_vo,
    so everything after the head sizes sits one place earlier), the aliases, the refused options.
    Returns (head_dim, use_fp16_qk_reduction)."""
    head_dim = _api.alias(where, "head_dim_qk", head_dim_qk, "head_dim", head_dim)
    if head_dim is None:
        raise TypeError(f"{where}: missing head_dim_qk (also accepted as head_dim=)")
    if head_dim_vo is not None and (not isinstance(head_dim_vo, int) or isinstance(head_dim_vo, bool)):
        raise _api.ambiguous(where, "head_dim_vo", head_dim_vo, "None or an int", order,
                             "custom_mask (releases before 0.2.14, which have no head_dim_vo)")
    for n, t in (("custom_mask", custom_mask), ("packed_custom_mask", packed_custom_mask)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise _api.ambiguous(where, n, t, "None or a tensor", order,
                                 ("packed_custom_mask" if n == "custom_mask" else "causal")
                                 + " (releases before 0.2.14, which have no head_dim_vo)")
    if not isinstance(causal, (bool, int)) or isinstance(causal, str):
        raise _api.ambiguous(where, "causal", causal, "a bool", order,
                             "pos_encoding_mode (releases before 0.2.14, which have no head_dim_vo)")
    if not isinstance(pos_encoding_mode, str):
        raise _api.ambiguous(where, "pos_encoding_mode", pos_encoding_mode, "a string such as 'NONE'", order,
                             "allow_fp16_qk_reduction (releases before 0.2.14, which have no head_dim_vo)")
    fp16 = _api.alias(where, "use_fp16_qk_reduction", use_fp16_qk_reduction, "allow_fp16_qk_reduction",
                      allow_fp16_qk_reduction)
    if head_dim_vo is not None and head_dim_vo <= 0:
        raise ValueError(f"{where}: head_dim_vo: got {head_dim_vo}, expected a positive int (None: head_dim_qk)")
    return head_dim, bool(fp16)


# the plan-time options FlashInfer 0.2.14's prefill wrappers keep as ``_name`` and forward() compares
_PLAN_OPTIONS = ("causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left", "logits_soft_cap", "sm_scale",
                 "rope_scale", "rope_theta")


def _record_prefill_plan(w: _BatchWrapper, args: tuple, kwargs: dict) -> None:
    """``_record_plan`` of a prefill plan() called with ``args``/``kwargs`` (kwargs hold every plan option)."""
    options = {n: kwargs[n] for n in _PLAN_OPTIONS}
    w._record_plan({"__args__": (args, kwargs), **options}, **{"_" + n: x for n, x in options.items()})


class BatchPrefillWithPagedKVCacheWrapper(_BatchWrapper):
    """Batch prefill/append attention over a paged KV cache (FlashInfer-compatible)."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Optional[Tensor] = None, paged_kv_indptr_buf: Optional[Tensor] = None,
                 paged_kv_indices_buf: Optional[Tensor] = None, paged_kv_last_page_len_buf: Optional[Tensor] = None,
                 custom_mask_buf: Optional[Tensor] = None, mask_indptr_buf: Optional[Tensor] = None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None, *, qk_indptr_buf: Optional[Tensor] = None):
        where = "BatchPrefillWithPagedKVCacheWrapper"
        mask_indptr_buf = _api.alias(where, "mask_indptr_buf", mask_indptr_buf, "qk_indptr_buf", qk_indptr_buf)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, graph_buffers=dict(
            qo_indptr=("qo_indptr_buf", qo_indptr_buf), indptr=("paged_kv_indptr_buf", paged_kv_indptr_buf),
            indices=("paged_kv_indices_buf", paged_kv_indices_buf),
            last_page_len=("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf),
            custom_mask=("custom_mask_buf", custom_mask_buf), qk_indptr=("mask_indptr_buf", mask_indptr_buf)),
            jit_kwargs=jit_kwargs)

    def plan(self, qo_indptr: Tensor, paged_kv_indptr: Tensor, paged_kv_indices: Tensor,
             paged_kv_last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: Optional[int] = None,
             page_size: Optional[int] = None, head_dim_vo: Optional[int] = None, custom_mask: Optional[Tensor] = None,
             packed_custom_mask: Optional[Tensor] = None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: Optional[bool] = None, sm_scale: Optional[float] = None, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, q_data_type="float16", kv_data_type=None, non_blocking: bool = True,
             prefix_len_ptr: Optional[Tensor] = None, token_pos_in_items_ptr: Optional[Tensor] = None,
             token_pos_in_items_len: int = 0, max_item_len_ptr: Optional[Tensor] = None,
             seq_lens: Optional[Tensor] = None, seq_lens_q: Optional[Tensor] = None,
             block_tables: Optional[Tensor] = None, max_token_per_sequence: Optional[int] = None,
             max_sequence_kv: Optional[int] = None, *, head_dim: Optional[int] = None,
             allow_fp16_qk_reduction: Optional[bool] = None, o_data_type=None,
             fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
             return_lse: Optional[bool] = None, sinks=False, fp8_scales: bool = False) -> None:
        """Plan a batch over a paged cache.  See FlashInfer's documentation; index tensors are int32
        (host or device), ``1 <= last_page_len <= page_size`` (0 only for an empty request).

        Positional order: FlashInfer 0.2.14's (``..., head_dim_qk, page_size, head_dim_vo, custom_mask, ...``);
        a value that fits the older order instead (no ``head_dim_vo``) raises ``TypeError``.  Keyword aliases:
        ``head_dim`` (``head_dim_qk``), ``allow_fp16_qk_reduction`` (``use_fp16_qk_reduction``).  Newer
        releases' ``o_data_type``, ``fixed_split_size``, ``disable_split_kv`` are keyword-only.  Multi-item
        scoring (``prefix_len_ptr``...) is planned as a custom mask (``attncore.core.multi_item``); the
        trtllm-gen arguments (``seq_lens``, ``block_tables``...) raise when given."""
        where = "BatchPrefillWithPagedKVCacheWrapper.plan"
        head_dim, fp16 = _prefill_plan_compat(
            where, _PAGED_ORDER, head_dim_qk, head_dim, head_dim_vo, custom_mask, packed_custom_mask, causal,
            pos_encoding_mode, use_fp16_qk_reduction, allow_fp16_qk_reduction)
        if page_size is None:
            raise TypeError(f"{where}: missing page_size")
        _check_split(fixed_split_size)
        trt = [n for n, x in (("seq_lens", seq_lens), ("seq_lens_q", seq_lens_q), ("block_tables", block_tables),
                              ("max_token_per_sequence", max_token_per_sequence),
                              ("max_sequence_kv", max_sequence_kv)) if x is not None]
        if trt:
            raise NotImplementedError(f"{where}: {', '.join(trt)}: FlashInfer's trtllm-gen prefill arguments are not "
                                      f"supported; give the page table as paged_kv_indptr/paged_kv_indices/"
                                      f"paged_kv_last_page_len (attncore.page converts block tables)")
        _checks.check_heads(num_qo_heads, num_kv_heads, head_dim)
        # device-side qo_indptr and page table: one read for all (host ones need none)
        qo_read, reads = prefetch_paged(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        qo_host = _checks.check_indptr("qo_indptr", qo_indptr, host=qo_read)
        self._freeze_batch(len(qo_host) - 1)
        multi = _multi_item.parse(where, prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len,
                                  max_item_len_ptr, batch_size=len(qo_host) - 1, causal=causal,
                                  custom_mask=custom_mask, packed_custom_mask=packed_custom_mask)
        params = _api.make_params(head_dim=head_dim, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                                  window_left=window_left, pos_encoding_mode=pos_encoding_mode,
                                  rope_scale=rope_scale, rope_theta=rope_theta)
        meta = BatchMeta.paged(qo_host, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
                               device=self._device, params=params, causal=causal, custom_mask=custom_mask,
                               packed_custom_mask=packed_custom_mask, non_blocking=non_blocking,
                               buffers=self._graph_buffers if self._use_cuda_graph else None,
                               workspace=self._float_workspace_buffer,
                               int_workspace=self._int_workspace_buffer, fixed_split_size=fixed_split_size,
                               disable_split_kv=disable_split_kv, memo=self._plan_memo(), reads=reads)
        _multi_item.attach(where, multi, meta, self._graph_buffers if self._use_cuda_graph else None)
        self._plan_with("batch_prefill_paged", meta, q_data_type, kv_data_type, o_data_type,
                        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                        features=(return_lse, sinks, fp8_scales), head_dim_vo=head_dim_vo)
        _record_prefill_plan(self, (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                                   num_kv_heads, head_dim, page_size, head_dim_vo),
                             dict(custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
                                  pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=fp16, sm_scale=sm_scale,
                                  window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                                  rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type,
                                  non_blocking=non_blocking, o_data_type=o_data_type, fixed_split_size=fixed_split_size,
                                  disable_split_kv=disable_split_kv, prefix_len_ptr=prefix_len_ptr,
                                  token_pos_in_items_ptr=token_pos_in_items_ptr,
                                  token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr))

    def run(self, q: Tensor, paged_kv_cache, *args, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None, out: Optional[Tensor] = None,
            lse: Optional[Tensor] = None, return_lse: bool = False, enable_pdl: Optional[bool] = None,
            window_left: Optional[int] = None, sinks: Optional[Tensor] = None):
        """Run the planned batch.  ``paged_kv_cache``: 5-D ``[pages, 2, page, Hkv, D]`` (NHD) /
        ``[pages, 2, Hkv, page, D]`` (HND) or a tuple of 4-D (k_cache, v_cache) (the only form when
        ``head_dim_vo`` differs from ``head_dim_qk``: v_cache's last dim is ``head_dim_vo``).
        Returns out ``[nnz_qo, Hq, head_dim_vo]`` (and float32 base-2 LSE ``[nnz_qo, Hq]`` with ``return_lse``).
        ``window_left`` must match the plan (a plan-time choice)."""
        if args:
            _run_positional("BatchPrefillWithPagedKVCacheWrapper.run", args, "k_scale, v_scale, return_lse")
        if window_left is not None and self._planned is not None:
            _check_window(self, window_left)
        if _ops.compiling():  # inside torch.compile: attncore::run_planned (attncore.core.ops)
            k, v = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
            return _ops.run_traced(self, q, k, v, out=out, lse=lse, return_lse=return_lse, sinks=sinks,
                                   q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        return self._launch(q, paged_kv_cache, out=out, lse=lse, return_lse=return_lse, sinks=sinks, q_scale=q_scale,
                            k_scale=k_scale, v_scale=v_scale)

    def forward(self, q: Tensor, paged_kv_cache, causal: bool = False, pos_encoding_mode: str = "NONE",
                use_fp16_qk_reduction: bool = False, k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                window_left: int = -1, logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, *, return_lse: bool = False):
        """FlashInfer 0.2.14's deprecated ``forward()``: its options (defaults included) replace the plan's."""
        self._legacy_forward(dict(causal=causal, pos_encoding_mode=pos_encoding_mode,
                                  use_fp16_qk_reduction=use_fp16_qk_reduction, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                                  rope_theta=rope_theta))
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    def forward_return_lse(self, *args, **kwargs):
        return self.forward(*args, return_lse=True, **kwargs)

    def _check_kv(self, k: Tensor, v: Tensor):
        return self._paged_kv((k, v))


def _check_window(w: _BatchWrapper, window_left) -> None:
    planned = w._planned.meta.params.window_left
    if _params.window_left(window_left) != planned:
        raise ValueError(f"window_left: got {window_left} in run(), but plan() used {planned}; plan again to "
                         f"change it")


class BatchPrefillWithRaggedKVCacheWrapper(_BatchWrapper):
    """Batch prefill/append attention over ragged (dense, concatenated) K/V (FlashInfer-compatible)."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Optional[Tensor] = None, kv_indptr_buf: Optional[Tensor] = None,
                 custom_mask_buf: Optional[Tensor] = None, mask_indptr_buf: Optional[Tensor] = None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None, *, qk_indptr_buf: Optional[Tensor] = None):
        where = "BatchPrefillWithRaggedKVCacheWrapper"
        mask_indptr_buf = _api.alias(where, "mask_indptr_buf", mask_indptr_buf, "qk_indptr_buf", qk_indptr_buf)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, graph_buffers=dict(
            qo_indptr=("qo_indptr_buf", qo_indptr_buf), kv_indptr=("kv_indptr_buf", kv_indptr_buf),
            custom_mask=("custom_mask_buf", custom_mask_buf), qk_indptr=("mask_indptr_buf", mask_indptr_buf)),
            jit_kwargs=jit_kwargs)

    def plan(self, qo_indptr: Tensor, kv_indptr: Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: Optional[int] = None, head_dim_vo: Optional[int] = None,
             custom_mask: Optional[Tensor] = None, packed_custom_mask: Optional[Tensor] = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: Optional[bool] = None, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, q_data_type="float16",
             kv_data_type=None, non_blocking: bool = True, prefix_len_ptr: Optional[Tensor] = None,
             token_pos_in_items_ptr: Optional[Tensor] = None, token_pos_in_items_len: int = 0,
             max_item_len_ptr: Optional[Tensor] = None, *, head_dim: Optional[int] = None,
             allow_fp16_qk_reduction: Optional[bool] = None, o_data_type=None,
             fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
             return_lse: Optional[bool] = None, sinks=False, fp8_scales: bool = False) -> None:
        """Plan a ragged batch: request i has q rows ``qo_indptr[i]:qo_indptr[i+1]`` and keys
        ``kv_indptr[i]:kv_indptr[i+1]`` (int32 indptrs).

        Positional order: FlashInfer 0.2.14's (``..., head_dim_qk, head_dim_vo, custom_mask, ...``); see
        ``BatchPrefillWithPagedKVCacheWrapper.plan`` for the aliases and the refused options."""
        where = "BatchPrefillWithRaggedKVCacheWrapper.plan"
        head_dim, fp16 = _prefill_plan_compat(
            where, _RAGGED_ORDER, head_dim_qk, head_dim, head_dim_vo, custom_mask, packed_custom_mask, causal,
            pos_encoding_mode, use_fp16_qk_reduction, allow_fp16_qk_reduction)
        _check_split(fixed_split_size)
        _checks.check_heads(num_qo_heads, num_kv_heads, head_dim)
        params = _api.make_params(head_dim=head_dim, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                                  window_left=window_left, pos_encoding_mode=pos_encoding_mode,
                                  rope_scale=rope_scale, rope_theta=rope_theta)
        with _checks.read_together([qo_indptr, kv_indptr]):  # device-side indptrs: one read for both
            qo_host = _checks.check_indptr("qo_indptr", qo_indptr)
            self._freeze_batch(len(qo_host) - 1)
            multi = _multi_item.parse(where, prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len,
                                      max_item_len_ptr, batch_size=len(qo_host) - 1, causal=causal,
                                      custom_mask=custom_mask, packed_custom_mask=packed_custom_mask)
            meta = BatchMeta.ragged(qo_indptr, kv_indptr, qo_indptr_host=qo_host, device=self._device,
                                    params=params, causal=causal, custom_mask=custom_mask,
                                    packed_custom_mask=packed_custom_mask,
                                    buffers=self._graph_buffers if self._use_cuda_graph else None,
                                    workspace=self._float_workspace_buffer,
                                    int_workspace=self._int_workspace_buffer, memo=self._plan_memo())
        _multi_item.attach(where, multi, meta, self._graph_buffers if self._use_cuda_graph else None)
        # the split-KV hints are kept as given (as the paged plans do), for the backends that read them
        meta.fixed_split_size, meta.disable_split_kv = fixed_split_size, bool(disable_split_kv)
        self._plan_with("batch_prefill_ragged", meta, q_data_type, kv_data_type, o_data_type,
                        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        features=(return_lse, sinks, fp8_scales), head_dim_vo=head_dim_vo)
        _record_prefill_plan(self, (qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, head_dim_vo),
                             dict(custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
                                  pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=fp16,
                                  window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                                  rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
                                  kv_data_type=kv_data_type, non_blocking=non_blocking, o_data_type=o_data_type,
                                  fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
                                  prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                                  token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr))

    def run(self, q: Tensor, k: Tensor, v: Tensor, *args, out: Optional[Tensor] = None,
            lse: Optional[Tensor] = None, return_lse: bool = False, enable_pdl: Optional[bool] = None,
            q_scale: Optional[float] = None, k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            sinks: Optional[Tensor] = None):
        """Run the planned batch.  k, v: ``[nnz_kv, Hkv, D]`` (NHD) or ``[Hkv, nnz_kv, D]`` (HND), v's D
        being ``head_dim_vo``; returns out ``[nnz_qo, Hq, head_dim_vo]``."""
        if args:
            _run_positional("BatchPrefillWithRaggedKVCacheWrapper.run", args, "return_lse")
        if _ops.compiling():  # inside torch.compile: attncore::run_planned (attncore.core.ops)
            return _ops.run_traced(self, q, k, v, out=out, lse=lse, return_lse=return_lse, sinks=sinks,
                                   q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        return self._launch(q, (k, v), out=out, lse=lse, return_lse=return_lse, sinks=sinks, q_scale=q_scale,
                            k_scale=k_scale, v_scale=v_scale)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, pos_encoding_mode: str = "NONE",
                use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap: Optional[float] = None,
                sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                rope_theta: Optional[float] = None, *, return_lse: bool = False):
        """FlashInfer 0.2.14's deprecated ``forward()``: its options (defaults included) replace the plan's."""
        self._legacy_forward(dict(causal=causal, pos_encoding_mode=pos_encoding_mode,
                                  use_fp16_qk_reduction=use_fp16_qk_reduction, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                                  rope_theta=rope_theta))
        return self.run(q, k, v, return_lse=return_lse)

    def forward_return_lse(self, *args, **kwargs):
        return self.forward(*args, return_lse=True, **kwargs)

    def _check_kv(self, k: Tensor, v: Tensor):
        planned = self._planned
        p = planned.problem
        n = planned.meta.kv_indptr_host[-1]
        for name, t, d in (("k", k, p.head_dim_qk), ("v", v, p.head_dim_vo)):
            _checks.check_ragged_kv(name, t, kv_layout=p.kv_layout, n=n, num_kv_heads=p.num_kv_heads,
                                 head_dim=d, kv_dtype=p.kv_dtype, device=self._device)
        return k, v
