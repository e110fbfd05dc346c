"""Decode attention: single request, batches over a paged cache, and the xqa entry point.

FlashInfer-compatible signatures.  Speculative decoding (``q_len_per_req > 1``): the new tokens
are already in the cache and each request's draft rows are causal (bottom-right) among
themselves, unless xqa's ``mask`` says otherwise.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from attncore.core import _api
from attncore.core import checks as _checks
from attncore.core import current
from attncore.core import fp8_query as _fp8_query
from attncore.core import ops as _ops
from attncore.core import params as _params
from attncore.core import plan_cache as _plan_cache
from attncore.core import selector as _selector
from attncore.core.single_prefill import run_cached, single_key
from attncore.core.backend import BatchMeta, RunArgs
from attncore.core.page_table import _check_seq_lens
from attncore.page import unpack_paged_kv_cache
from attncore.core.wrapper import _BatchWrapper, _plain, _run_positional
from attncore.prefill import single_prefill_with_kv_cache

Tensor = torch.Tensor

# FlashInfer 0.2.14's positional order of the decode plan() (for the messages); newer releases insert
# o_data_type after kv_data_type, so a call in their order has a dtype where 0.2.14 has sm_scale.
_PLAN_ORDER = ("indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, "
               "window_left, logits_soft_cap, q_data_type, kv_data_type, data_type, sm_scale, rope_scale, rope_theta, "
               "non_blocking, block_tables, seq_lens")
_PLAN = "BatchDecodeWithPagedKVCacheWrapper.plan"
_NEWER = "data_type (newer releases insert o_data_type after kv_data_type)"


def _is_dtype_like(x) -> bool:
    return isinstance(x, (torch.dtype, str))


def _plan_slots(data_type, sm_scale, rope_scale, rope_theta, non_blocking) -> None:
    """0.2.14's slots after kv_data_type checked against the newer order (everything one place later)."""
    if data_type is not None and not _is_dtype_like(data_type):
        raise _api.ambiguous(_PLAN, "data_type", data_type, "None or a dtype", _PLAN_ORDER, "o_data_type " + _NEWER[9:])
    for n, x, other in (("sm_scale", sm_scale, _NEWER), ("rope_scale", rope_scale, "sm_scale " + _NEWER[9:]),
                        ("rope_theta", rope_theta, "rope_scale " + _NEWER[9:])):
        if x is not None and (_is_dtype_like(x) or isinstance(x, bool)):
            raise _api.ambiguous(_PLAN, n, x, "None or a finite number > 0", _PLAN_ORDER, other)
    if not isinstance(non_blocking, bool) and not (isinstance(non_blocking, int) and non_blocking in (0, 1)):
        raise _api.ambiguous(_PLAN, "non_blocking", non_blocking, "a bool", _PLAN_ORDER,
                             "rope_theta " + _NEWER[9:])


def single_decode_with_kv_cache(
    q: Tensor, k: Tensor, v: Tensor, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False, q_scale: Optional[float] = None, k_scale: Optional[float] = None,
    v_scale: Optional[float] = None, window_left: int = -1, logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None, rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
    return_lse: bool = False, *, backend: str = "auto", sinks: Optional[Tensor] = None,
    out: Optional[Tensor] = None, lse: Optional[Tensor] = None, o_dtype: Optional[torch.dtype] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Decode one query token against one request's K/V.

    ``o_dtype`` (attncore, keyword-only): the output dtype, default q's (FlashInfer 0.2.14's
    ``empty_like(q)``); an fp8 q (e4m3/e5m2) is upcast exactly to it when it is fp16/bf16/fp32, else to
    fp16 (``attncore.core.fp8_query``), so pass ``o_dtype`` with an fp8 q.

    q: ``[num_qo_heads, head_dim]``; k, v: ``[kv_len, Hkv, D]`` (NHD) or ``[Hkv, kv_len, D]`` (HND).
    Returns out ``[num_qo_heads, head_dim]`` (and LSE ``[num_qo_heads]`` float32 base 2).
    ``use_tensor_cores`` is a performance hint; attncore's backends choose their own kernels.
    """
    # a seen signature (every tensor's shape, strides, dtype and device, every scalar, the backend asked for and
    # what selection reads: the key of single prefill's cache, one dimension less) runs its cached plan at once
    key = None
    if (not _ops.compiling() and backend.__class__ is str and (o_dtype is None or o_dtype.__class__ is torch.dtype)
            and _plain(sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_scale, k_scale, v_scale)):
        tk = _plan_cache.tkey
        key = ("single_decode", tk(q), tk(k), tk(v), kv_layout, pos_encoding_mode, sm_scale, window_left,
               logits_soft_cap, rope_scale, rope_theta, bool(return_lse), backend, tk(sinks), q_scale, k_scale,
               v_scale, tk(out), tk(lse), o_dtype, _selector.env_key())
        hit = _plan_cache.ONE_CALL_PLANS.get(key)
        if hit is not None:
            out, lse = run_cached(hit, q, k, v, out, lse, return_lse, sinks)
            return (out, lse) if return_lse else out
    res = _single_decode(q, k, v, kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                         window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                         rope_theta=rope_theta, return_lse=return_lse, backend=backend, sinks=sinks, q_scale=q_scale,
                         k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, o_dtype=o_dtype)
    if key is not None:  # single prefill cached the plan of the call it made (one row): keep it under this key too
        q3 = q.unsqueeze(0)
        entry = _plan_cache.ONE_CALL_PLANS.peek(single_key(
            q3, k, v, None, None, False, kv_layout, pos_encoding_mode, sm_scale, window_left, logits_soft_cap,
            rope_scale, rope_theta, return_lse, backend, sinks, q_scale, k_scale, v_scale,
            None if out is None else out.unsqueeze(0), None if lse is None else lse.unsqueeze(0), o_dtype, None))
        if entry is not None:  # its own relaunch slot: this key's run passes 2-D q and out
            _plan_cache.ONE_CALL_PLANS.put(key, (*entry[:4], [None]))
    return res


def _single_decode(q, k, v, *, kv_layout, pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale,
                   rope_theta, return_lse, backend, sinks, q_scale, k_scale, v_scale, out, lse, o_dtype):
    """single_decode_with_kv_cache's checked path: q as one row of single prefill."""
    _checks.check_tensor("q", q, ndim=2, what="([num_qo_heads, head_dim])")
    if out is not None:
        _checks.check_tensor("out", out, shape=list(q.shape), device=q.device,
                          dtype=q.dtype if o_dtype is None else _checks.to_dtype(o_dtype, "o_dtype"))
        out = out.unsqueeze(0)
    if lse is not None:
        _checks.check_tensor("lse", lse, shape=[q.shape[0]], dtype=torch.float32, device=q.device)
        lse = lse.unsqueeze(0)
    res = single_prefill_with_kv_cache(
        q.unsqueeze(0), k, v, kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
        window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
        return_lse=return_lse, backend=backend, sinks=sinks, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        out=out, lse=lse, o_dtype=o_dtype)
    if return_lse:
        return res[0].squeeze(0), res[1].squeeze(0)
    return res.squeeze(0)


class BatchDecodeWithPagedKVCacheWrapper(_BatchWrapper):
    """Batch decode over a paged KV cache (FlashInfer-compatible), any GQA group size."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: Optional[Tensor] = None,
                 paged_kv_indices_buffer: Optional[Tensor] = None,
                 paged_kv_last_page_len_buffer: Optional[Tensor] = None, backend: str = "auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, graph_buffers=dict(
            indptr=("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
            indices=("paged_kv_indices_buffer", paged_kv_indices_buffer),
            last_page_len=("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)))
        self._use_tensor_cores = bool(use_tensor_cores)

    @property
    def use_tensor_cores(self) -> bool:
        """As given to the constructor: a performance hint (attncore's backends choose their own kernels)."""
        return self._use_tensor_cores

    def plan(self, indptr: Tensor, indices: Tensor, last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: Optional[float] = None, q_data_type="float16", kv_data_type=None, data_type=None,
             sm_scale: Optional[float] = None, rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             non_blocking: bool = True, block_tables: Optional[Tensor] = None, seq_lens: Optional[Tensor] = None, *,
             o_data_type=None, fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
             q_len_per_req: int = 1, return_lse: Optional[bool] = None, sinks=False,
             fp8_scales: bool = False) -> None:
        """Plan a decode batch: ``indptr [B+1]``, ``indices``, ``last_page_len [B]`` (int32).
        ``q_len_per_req`` rows per request (speculative decoding).

        Positional order: FlashInfer 0.2.14's (``..., q_data_type, kv_data_type, data_type, sm_scale,
        rope_scale, rope_theta, non_blocking, block_tables, seq_lens``); a call in a newer release's order
        (``o_data_type`` after ``kv_data_type``) that puts a dtype where 0.2.14 has ``sm_scale`` raises
        ``TypeError``.  Newer releases' ``o_data_type``, ``fixed_split_size``, ``disable_split_kv`` and
        attncore's ``q_len_per_req`` are keyword-only.  ``data_type`` (deprecated) fills ``q_data_type`` and
        ``kv_data_type`` only where they are None, as in 0.2.14 (whose ``q_data_type`` defaults to float16)."""
        if (data_type is not None or sm_scale is not None or rope_scale is not None or rope_theta is not None
                or non_blocking is not True):
            _plan_slots(data_type, sm_scale, rope_scale, rope_theta, non_blocking)
        if block_tables is not None or seq_lens is not None:
            raise ValueError("block_tables/seq_lens: attncore's plan() takes the page table as indptr/indices/"
                             "last_page_len; convert with attncore.page.block_tables_to_indptr")
        if fixed_split_size is not None and (not isinstance(fixed_split_size, int) or isinstance(fixed_split_size, bool)
                                             or fixed_split_size <= 0):
            raise ValueError(f"fixed_split_size: got {fixed_split_size!r}, expected None or a positive int")
        _checks.check_heads(num_qo_heads, num_kv_heads, head_dim)
        if not isinstance(q_len_per_req, int) or q_len_per_req < 1:
            raise ValueError(f"q_len_per_req: got {q_len_per_req!r}, expected an int >= 1")
        b = indptr.numel() - 1 if isinstance(indptr, torch.Tensor) else 0
        self._freeze_batch(b)
        call_q, call_kv = q_data_type, kv_data_type
        if data_type is not None:  # FlashInfer 0.2.14: fills only what is None
            if q_data_type is None:
                q_data_type = data_type
            if kv_data_type is None:
                kv_data_type = data_type
        params = _api.make_params(head_dim=head_dim, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                                  window_left=window_left, pos_encoding_mode=pos_encoding_mode,
                                  rope_scale=rope_scale, rope_theta=rope_theta)
        qo_host = list(range(0, (b + 1) * q_len_per_req, q_len_per_req))
        meta = BatchMeta.paged(qo_host, indptr, indices, last_page_len, page_size, device=self._device, params=params,
                               decode=True, q_len_per_req=q_len_per_req, names=("indptr", "indices", "last_page_len"),
                               non_blocking=non_blocking, buffers=self._graph_buffers if self._use_cuda_graph else None,
                               workspace=self._float_workspace_buffer,
                               int_workspace=self._int_workspace_buffer, fixed_split_size=fixed_split_size,
                               disable_split_kv=disable_split_kv, memo=self._plan_memo())
        self._plan_with("batch_decode", meta, q_data_type, kv_data_type, o_data_type, num_qo_heads=num_qo_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, q_len_per_req=q_len_per_req,
                        features=(return_lse, sinks, fp8_scales))
        self._record_plan(
            {"__args__": ((indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size),
                          dict(q_data_type=call_q, kv_data_type=call_kv, data_type=data_type,
                               non_blocking=non_blocking, o_data_type=o_data_type, fixed_split_size=fixed_split_size,
                               disable_split_kv=disable_split_kv, q_len_per_req=q_len_per_req,
                               pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                               rope_theta=rope_theta)),
             "pos_encoding_mode": pos_encoding_mode, "window_left": window_left, "logits_soft_cap": logits_soft_cap,
             "sm_scale": sm_scale, "rope_scale": rope_scale, "rope_theta": rope_theta},
            _pos_encoding_mode=pos_encoding_mode, _window_left=window_left, _logits_soft_cap=logits_soft_cap,
            _sm_scale=sm_scale, _rope_scale=rope_scale, _rope_theta=rope_theta)

    def run(self, q: Tensor, paged_kv_cache, *args, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None, out: Optional[Tensor] = None,
            lse: Optional[Tensor] = None, return_lse: bool = False, enable_pdl: Optional[bool] = None,
            window_left: Optional[int] = None, sinks: Optional[Tensor] = None):
        """Run the planned decode.  q: ``[B * q_len_per_req, Hq, D]``.  ``window_left`` here must
        match the plan (it is a plan-time choice)."""
        if args:
            _run_positional("BatchDecodeWithPagedKVCacheWrapper.run", args, "q_scale, k_scale, v_scale, return_lse")
        if _ops.compiling():  # inside torch.compile: attncore::run_planned (attncore.core.ops)
            if window_left is not None and self._planned is not None:
                self._check_window(window_left)
            k, v = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
            return _ops.run_traced(self, q, k, v, out=out, lse=lse, return_lse=return_lse, sinks=sinks,
                                   q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        if window_left is not None:
            self._require_plan()
            self._check_window(window_left)
        return self._launch(q, paged_kv_cache, out=out, lse=lse, return_lse=return_lse, sinks=sinks, q_scale=q_scale,
                            k_scale=k_scale, v_scale=v_scale)

    def forward(self, q: Tensor, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale: Optional[float] = None,
                k_scale: Optional[float] = None, v_scale: Optional[float] = None, window_left: int = -1,
                logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, *, return_lse: bool = False):
        """FlashInfer 0.2.14's deprecated ``forward()``: its options (defaults included) replace the plan's."""
        self._legacy_forward(dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                                  rope_theta=rope_theta))
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    def forward_return_lse(self, *args, **kwargs):
        return self.forward(*args, return_lse=True, **kwargs)

    def _check_window(self, window_left) -> None:
        planned = self._planned.meta.params.window_left
        if _params.window_left(window_left) != planned:
            raise ValueError(f"window_left: got {window_left} in run(), but plan() used {planned}; plan again to "
                             f"change it")

    def _check_kv(self, k: Tensor, v: Tensor):
        return self._paged_kv((k, v))


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer 0.2.14's CUDA-graph decode wrapper: a ``BatchDecodeWithPagedKVCacheWrapper`` with
    ``use_cuda_graph=True`` over the caller's fixed index buffers.  ``plan()`` copies each step's page
    table into them (the batch size frozen at the first plan) and cannot be captured; ``run()`` never
    plans, so it can be: a run-time feature the plan lacks is an error saying to plan with it."""

    def __init__(self, workspace_buffer: Tensor, indptr_buffer: Tensor, indices_buffer: Tensor,
                 last_page_len_buffer: Tensor, kv_layout: str = "NHD", use_tensor_cores: bool = False, *,
                 backend: str = "auto") -> None:
        for name, buf in (("indptr_buffer", indptr_buffer), ("indices_buffer", indices_buffer),
                          ("last_page_len_buffer", last_page_len_buffer)):
            _checks.check_tensor(name, buf, ndim=1, dtype=torch.int32, what="(the caller's fixed CUDA-graph buffer)")
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer, backend=backend)


# xqa's batch was a BatchMeta subclass that checked seq_lens where a backend first read them on the host;
# BatchMeta.host_kv_lens() does that for every batch built from block tables now.
_XqaBatch = BatchMeta


def xqa_batch_decode_with_kv_cache(
    query: Tensor, kv_cache, workspace_buffer: Tensor, block_tables: Tensor, seq_lens: Tensor, max_seq_len: int,
    bmm1_scale: Union[float, Tensor] = 1.0, bmm2_scale: Union[float, Tensor] = 1.0, window_left: int = -1,
    out: Optional[Tensor] = None, sinks: Optional[Tensor] = None, kv_layout: str = "NHD",
    enable_pdl: Optional[bool] = None, q_len_per_req: Optional[int] = 1, o_scale: Optional[float] = 1.0,
    mask: Optional[Tensor] = None, kv_cache_sf=None, *, backend: str = "auto",
) -> Tensor:
    """XQA-style GQA decode over block tables (FlashInfer-compatible).

    query ``[B * q_len_per_req, Hq, D]``; kv_cache 5-D ``[pages, 1 or 2, page, Hkv, D]`` (NHD) or a
    (k_cache, v_cache) tuple; block_tables int32 ``[B, max_pages]``; seq_lens ``[B]`` (uint32 or
    int32) total KV lengths including the draft tokens.  logit = ``qk * bmm1_scale``;
    out = ``softmax @ v * bmm2_scale / o_scale``.  mask: uint16 ``[B, q_len, ceil(q_len/32)*2]``.
    """
    # a seen signature runs its cached launch at once (host time: plan and checks were ~0.2 ms a call, near the
    # kernel's own time at X1's sizes); the key holds every tensor's layout and the addresses the plan baked in
    key = _xqa_key(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale,
                   window_left, out, sinks, kv_layout, enable_pdl, q_len_per_req, o_scale, mask, kv_cache_sf, backend)
    hit = None if key is None else _plan_cache.XQA_LAUNCHES.get(key)
    if hit is not None:
        go, lens = hit
        k, v = unpack_paged_kv_cache(_shared_kv(kv_cache), kv_layout)
        if out is None:
            out = torch.empty_like(query)
        at = current.mark(query.device.index)
        go(query, k, v, out, None, None if sinks is None else sinks.float())
        _check_seq_lens(current.read_at(at, seq_lens), *lens)
        return out
    if kv_cache_sf is not None:
        raise ValueError("kv_cache_sf: NVFP4 KV caches are not supported by attncore yet (no backend "
                         "implements them); pass an fp16/bf16/fp8 cache")
    _checks.check_choice("kv_layout", kv_layout, ("NHD", "HND"))
    _checks.check_tensor("query", query, ndim=3, dtype=_checks.ACCEPTED_Q_DTYPES,
                      what="([batch_size * q_len_per_req, num_heads, head_dim])")
    device = _checks.norm_device(query.device)
    q_len = 1 if q_len_per_req is None else q_len_per_req
    if not isinstance(q_len, int) or q_len < 1:
        raise ValueError(f"q_len_per_req: got {q_len_per_req!r}, expected an int >= 1")
    _checks.check_tensor("block_tables", block_tables, ndim=2, dtype=torch.int32, device=device)
    b = block_tables.shape[0]
    _checks.check_tensor("seq_lens", seq_lens, ndim=1, shape=[b], dtype=(torch.int32, torch.uint32), device=device)
    if query.shape[0] != b * q_len:
        raise ValueError(f"query: got {query.shape[0]} rows, expected batch_size * q_len_per_req = {b * q_len}")
    _checks.check_tensor("workspace_buffer", workspace_buffer, device=device)
    kv_cache = _shared_kv(kv_cache)
    k_cache, _ = unpack_paged_kv_cache(kv_cache, kv_layout)
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    hkv = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    hq, d = query.shape[1], query.shape[2]
    _checks.check_heads(hq, hkv, d)
    k, v = _checks.check_paged_cache(kv_cache, kv_layout=kv_layout, num_kv_heads=hkv, head_dim=d, page_size=page_size,
                                  kv_dtype=k_cache.dtype, device=device, max_page_id=-1, name="kv_cache")
    if k.dtype not in _checks.SUPPORTED_KV_DTYPES:
        raise TypeError(f"kv_cache: got dtype {k.dtype}, expected fp16, bf16, fp32, e4m3 or e5m2")
    if not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise ValueError(f"max_seq_len: got {max_seq_len!r}, expected an int >= 0")
    if block_tables.shape[1] * page_size < max_seq_len:
        raise ValueError(f"block_tables: {block_tables.shape[1]} pages of {page_size} tokens cannot hold "
                         f"max_seq_len {max_seq_len}")
    if mask is not None:
        words = ((q_len + 31) // 32) * 2
        _checks.check_tensor("mask", mask, shape=[b, q_len, words], dtype=torch.uint16, device=device,
                          what="([batch_size, q_len_per_req, ceil(q_len/32)*2] uint16)")
    # bmm1_scale is the whole QK scale (1/sqrt(D) included): a float or a 1-element tensor (params.scale)
    sm_scale = _params.scale("bmm1_scale", bmm1_scale)
    params = _api.make_params(head_dim=d, sm_scale=sm_scale, logits_soft_cap=None, window_left=window_left,
                              pos_encoding_mode="NONE", rope_scale=None, rope_theta=None)
    out_dtype = query.dtype
    if out is not None:
        _checks.check_tensor("out", out, shape=list(query.shape), device=device,  # an fp8 query: any (fp8_query)
                          dtype=_checks.ACCEPTED_Q_DTYPES if _fp8_query.is_fp8(query.dtype)
                          else (query.dtype, torch.float8_e4m3fn, torch.float8_e5m2))
        out_dtype = out.dtype
    # seq_lens' values (q_len_per_req <= seq_lens[i] <= max_seq_len, so within the block table too) are
    # checked in every call: a mismatch is an error naming the request, never "attend over what fits"
    # (issue 13). On the CPU they are read here without a copy; on a device, one copy of B ints (a device
    # sync, the price of that guarantee) at the launch (below), so that the checks, the selection and the
    # plan above it run while the stream's earlier kernels do (selection and plan take max_seq_len as the
    # batch's longest; xqa's plan reads no lengths). Inside CUDA-graph capture nothing can be read back:
    # there the values are the caller's responsibility (docs/semantics.md).
    on_host = seq_lens.device.type == "cpu"
    meta = BatchMeta.from_block_tables(block_tables, seq_lens, max_seq_len, page_size, device=device, params=params,
                                       q_len_per_req=q_len, workspace=workspace_buffer, read_seq_lens=on_host)
    sinks = _checks.check_sinks(sinks, hq, device)
    v_scale, o_scale = _params.scale("bmm2_scale", bmm2_scale), _params.scale("o_scale", o_scale)
    # one call plans and runs: select with the run-time features
    compute = _fp8_query.compute_dtype(query.dtype, out_dtype)  # an fp8 query is upcast to it (fp8_query)
    problem = _api.build_problem("xqa_decode", device, q_dtype=compute, kv_dtype=k.dtype, out_dtype=out_dtype,
                                 num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size,
                                 kv_layout=kv_layout, mask=meta.mask, params=params, q_len_per_req=q_len,
                                 spec_mask=mask is not None, sinks=sinks is not None,
                                 fp8_scales=v_scale != 1.0 or o_scale != 1.0)
    planned = (_api.Planned(problem, meta, backend) if compute is query.dtype
               else _fp8_query.plan(problem, meta, backend, query.dtype, out_name="out"))
    if out is None:
        out = torch.empty_like(query)
    args = RunArgs(q=query, k=k, v=v, out=out, sinks=sinks, v_scale=v_scale, o_scale=o_scale, spec_mask=mask,
                   enable_pdl=bool(enable_pdl))
    if on_host or torch.cuda.is_current_stream_capturing():
        planned.run(args)
        return out
    # A backend whose kernels read nothing outside the table and the caches (Backend.bounds_seq_lens: xqa) launches
    # first and the lengths are read behind that launch, so the GPU goes from the work before it straight to it; a
    # bad length still raises here (``out`` then holds undefined values).  Otherwise the launch is made ready (the
    # backend's relaunch), so that after the readback the GPU waits only for the check and the launch itself.
    go = planned.relaunch(args)
    if go and planned.bounds_seq_lens(args):
        at = current.mark(current.index_of(device))
        go(query, k, v, out, None, sinks)
        meta.host_kv_lens(at)
        if key is not None:  # checked and run once: later calls of this signature take the launch alone
            _plan_cache.XQA_LAUNCHES.put(key, (go, (q_len, max_seq_len, block_tables.shape[1], page_size)))
        return out
    meta.host_kv_lens()  # read back and checked (above); a backend's plan may have done it already
    if go:
        go(query, k, v, out, None, sinks)
    else:
        planned.run(args)
    return out


def _shared_kv(kv_cache):
    """xqa's 5-D cache of one K/V slot (``[pages, 1, ...]``: K and V share storage) as a (K, V) pair of views; any
    other cache as given."""
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 5 and kv_cache.shape[1] == 1:
        return kv_cache[:, 0], kv_cache[:, 0]
    return kv_cache


def _xqa_key(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale,
             window_left, out, sinks, kv_layout, enable_pdl, q_len_per_req, o_scale, mask, kv_cache_sf, backend):
    """The one-call xqa cache key (``_plan_cache.XQA_LAUNCHES``), or None where a call is planned every time: a
    spec mask, tensor scales, CPU tensors (no launch to cache), torch.compile or CUDA-graph capture.  Its entry is
    made only where the launch runs before the lengths' check (Backend.bounds_seq_lens), so a hit needs nothing
    else.  Besides each tensor's layout it holds the addresses the plan baked in: the block table's, seq_lens' and
    the workspace's."""
    if (mask is not None or kv_cache_sf is not None or not isinstance(query, torch.Tensor)
            or query.device.type != "cuda" or backend.__class__ is not str
            or not _plain(bmm1_scale, bmm2_scale, o_scale, window_left, max_seq_len, q_len_per_req, enable_pdl)
            or _ops.compiling() or torch.cuda.is_current_stream_capturing()):
        return None
    tk = _plan_cache.tkey
    cache = (tk(kv_cache) if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 5 else
             tuple(tk(c) for c in kv_cache) if kv_cache.__class__ is tuple and len(kv_cache) == 2
             and all(isinstance(c, torch.Tensor) for c in kv_cache) else None)
    if cache is None or not all(isinstance(t, torch.Tensor) for t in (workspace_buffer, block_tables, seq_lens)):
        return None
    return ("xqa", tk(query), cache, tk(workspace_buffer), workspace_buffer.data_ptr(), tk(block_tables),
            block_tables.data_ptr(), tk(seq_lens), seq_lens.data_ptr(), max_seq_len, bmm1_scale, bmm2_scale,
            window_left, tk(out), tk(sinks), kv_layout, enable_pdl, q_len_per_req, o_scale, backend,
            _selector.env_key())


def trtllm_batch_decode_with_kv_cache(
    query: Tensor, kv_cache, workspace_buffer: Tensor, block_tables: Tensor, seq_lens: Tensor, max_seq_len: int,
    bmm1_scale: float, bmm2_scale: float, window_left: int = -1, out: Optional[Tensor] = None,
    out_dtype=None, o_sf_scale: Optional[float] = None, o_sf_vec_size: Optional[int] = None,
    sinks: Optional[Tensor] = None, enable_pdl: Optional[bool] = None, *, backend: str = "auto",
) -> Tensor:
    """FlashInfer 0.2.14's TRT-LLM-gen decode entry point, served by the xqa path
    (:func:`xqa_batch_decode_with_kv_cache`): one query token per request, ``query [B, Hq, D]``, the cache
    in HND form (``[pages, 1 or 2, Hkv, page_size, D]`` or a ``(k_cache, v_cache)`` tuple of
    ``[pages, Hkv, page_size, D]``), ``logit = qk * bmm1_scale``, ``out = softmax @ v * bmm2_scale``.
    NVFP4 output (``out_dtype="nvfp4"``, ``o_sf_scale``, ``o_sf_vec_size``) is refused: no attncore backend
    writes NVFP4 (an sm100 format)."""
    if out_dtype == "nvfp4" or o_sf_scale is not None or o_sf_vec_size is not None:
        raise NotImplementedError("trtllm_batch_decode_with_kv_cache: NVFP4 output (out_dtype='nvfp4', o_sf_scale, "
                                  "o_sf_vec_size) is not supported: no attncore backend writes NVFP4; use an "
                                  "fp16/bf16 output")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise ValueError(f"out_dtype: got {out_dtype!r}, expected a torch.dtype, 'nvfp4' (refused) or None")
    if out is None and out_dtype is not None and out_dtype != query.dtype:
        out = torch.empty(query.shape, dtype=out_dtype, device=query.device)
    if isinstance(sinks, (list, tuple)):  # FlashInfer types it as a list of tensors: one per call
        if len(sinks) != 1:
            raise ValueError(f"sinks: got a list of {len(sinks)} tensors, expected one [num_qo_heads] tensor")
        sinks = sinks[0]
    return xqa_batch_decode_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len,
                                          bmm1_scale, bmm2_scale, window_left, out, sinks, "HND", enable_pdl,
                                          1, 1.0, None, None, backend=backend)
