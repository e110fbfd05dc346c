"""Machinery shared by the public API modules: the plan-time scalars, problem building, the index helpers
the ``BatchMeta`` constructors use (the batches themselves are built by ``BatchMeta.ragged/paged/
from_block_tables``), and the planned dispatch that remembers the backend chosen at plan time.  The
argument checks live in ``attncore.core.checks``, the one-call functions' plan cache and workspace in
``attncore.core.plan_cache``.

Every check raises ``ValueError``/``TypeError`` naming the argument, what was given and what is
accepted (semantics.md, "Bad input").
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Optional, Tuple

import torch

from attncore.core import params as _params
from attncore.core import selector
from attncore.core import tables
from attncore.core.backend import AttnParams, Backend, BatchMeta, RunArgs
from attncore.core.checks import SUPPORTED_KV_DTYPES, SUPPORTED_Q_DTYPES, check_choice, check_tensor, plain_key
from attncore.core.problem import LAYOUTS, POS_ENCODINGS, AttentionProblem, device_info, dtype_name

log = logging.getLogger("attncore")


def _fp8_upcast(buf, args, fold):
    from attncore.core.fp8_query import upcast  # only plans of an fp8 q (or per-head q/k scales) come here

    return upcast(buf, args, fold)


def _scale_out(out, o_heads):
    from attncore.core.head_scales import scale_out  # only plans with per-head v scales come here

    scale_out(out, o_heads)


# ----------------------------------------------------------------------------- argument checks
_PARAMS: Dict[tuple, AttnParams] = {}  # make_params' memo by plain_key (AttnParams is frozen: shared safely)


def make_params(*, head_dim: int, sm_scale, logits_soft_cap, window_left, pos_encoding_mode: str, rope_scale,
                rope_theta) -> AttnParams:
    """The plan-time scalars, each checked by its rule in ``attncore.core.params``, and RoPE's even head dim
    (the mask is the batch's: ``BatchMeta.mask``).  Memoized by value and type of every argument (host time:
    a serving loop re-plans with the same scalars every step); a value that is not a plain scalar is checked
    every time, and an error is never memoized."""
    key = plain_key(head_dim, sm_scale, logits_soft_cap, window_left, pos_encoding_mode, rope_scale, rope_theta)
    hit = _PARAMS.get(key) if key is not None else None
    if hit is not None:
        return hit
    params = _make_params(head_dim=head_dim, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                          window_left=window_left, pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                          rope_theta=rope_theta)
    if key is not None:
        if len(_PARAMS) > 1024:
            _PARAMS.clear()
        _PARAMS[key] = params
    return params


def _make_params(*, head_dim: int, sm_scale, logits_soft_cap, window_left, pos_encoding_mode: str, rope_scale,
                 rope_theta) -> AttnParams:
    check_choice("pos_encoding_mode", pos_encoding_mode, POS_ENCODINGS)
    params = AttnParams(
        sm_scale=_params.sm_scale(sm_scale, head_dim),
        logits_soft_cap=_params.logits_soft_cap(logits_soft_cap), window_left=_params.window_left(window_left),
        pos_encoding_mode=pos_encoding_mode, rope_scale=_params.rope("rope_scale", rope_scale),
        rope_theta=_params.rope("rope_theta", rope_theta),
    )
    if pos_encoding_mode == "ROPE_LLAMA" and head_dim % 2:
        raise ValueError(f"head_dim: got {head_dim}, ROPE_LLAMA needs an even head_dim")
    return params


# ----------------------------------------------------------------------------- masks
def pack_batch_mask(custom_mask, packed_custom_mask, qo_lens: List[int], kv_lens: List[int], device
                    ) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """Validate a batch custom mask and return (packed uint8, mask_indptr int32, host offsets).

    ``custom_mask``: bool, each request's [qo_i, kv_i] flattened, concatenated.
    ``packed_custom_mask``: uint8, each request packed LSB-first from a byte boundary
    (``segment_packbits(..., bitorder="little")``); it wins over custom_mask.
    """
    from attncore.quantization import packbits

    sizes = [q * k for q, k in zip(qo_lens, kv_lens)]
    byte_sizes = [(s + 7) // 8 for s in sizes]
    offsets = [0]
    for b in byte_sizes:
        offsets.append(offsets[-1] + b)
    if packed_custom_mask is not None:
        check_tensor("packed_custom_mask", packed_custom_mask, ndim=1, dtype=torch.uint8)
        if packed_custom_mask.numel() != offsets[-1]:
            raise ValueError(f"packed_custom_mask: got {packed_custom_mask.numel()} bytes, expected {offsets[-1]} "
                             f"(sum of ceil(qo_len*kv_len/8) per request, each request starting on a byte boundary)")
        packed = packed_custom_mask.to(device).contiguous()
    else:
        check_tensor("custom_mask", custom_mask, ndim=1, what="(flattened bool mask)")
        if custom_mask.dtype != torch.bool:
            raise TypeError(f"custom_mask: got dtype {dtype_name(custom_mask.dtype)}, expected bool")
        if custom_mask.numel() != sum(sizes):
            raise ValueError(f"custom_mask: got {custom_mask.numel()} elements, expected {sum(sizes)} "
                             f"(sum of qo_len*kv_len per request)")
        parts, start = [], 0
        for s in sizes:
            parts.append(packbits(custom_mask[start:start + s], bitorder="little"))
            start += s
        packed = (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)).to(device)
    indptr = small_index(offsets, device)
    return packed, indptr, offsets


# ----------------------------------------------------------------------------- problems
def build_problem(op: str, device: torch.device, *, q_dtype, kv_dtype, out_dtype=None, num_qo_heads: int,
                  num_kv_heads: int, head_dim: int, head_dim_vo: Optional[int] = None,
                  page_size: Optional[int] = None, kv_layout: str = "NHD", mask: str = "none",
                  params: Optional[AttnParams] = None, q_len_per_req: int = 1, spec_mask: bool = False,
                  cuda_graph: bool = False, return_lse: bool = False, sinks: bool = False,
                  fp8_scales: bool = False) -> AttentionProblem:
    check_choice("kv_layout", kv_layout, LAYOUTS)
    if q_dtype not in SUPPORTED_Q_DTYPES:
        raise TypeError(f"q_data_type: got {dtype_name(q_dtype)}, expected one of fp16, bf16, fp32")
    if kv_dtype not in SUPPORTED_KV_DTYPES:
        raise TypeError(f"kv_data_type: got {dtype_name(kv_dtype)}, expected one of fp16, bf16, fp32, e4m3, e5m2")
    dev_type, cc = device_info(device)
    p = params or AttnParams(sm_scale=1.0)
    return AttentionProblem(
        op=op, device_type=dev_type, compute_capability=cc, q_dtype=q_dtype, kv_dtype=kv_dtype,
        out_dtype=out_dtype or q_dtype, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim_qk=head_dim, head_dim_vo=head_dim_vo or head_dim, page_size=page_size, kv_layout=kv_layout,
        mask=mask, window_left=p.window_left, soft_cap=p.logits_soft_cap > 0, pos_encoding=p.pos_encoding_mode,
        q_len_per_req=q_len_per_req, spec_mask=spec_mask, cuda_graph=cuda_graph and dev_type == "cuda",
        return_lse=return_lse, sinks=sinks, fp8_scales=fp8_scales,
    )


class Planned:
    """A problem planned on the backend chosen at plan time.

    Run-time features (LSE, sinks, fp8 scales) are only known in ``run()``: when a run needs one
    the plan lacks, ``auto`` re-plans once on the best backend that serves it (cached per feature
    set; a forced backend that refuses raises).  Such a lazily planned variant gets no int workspace
    (it would overwrite the primary plan's tables there): it allocates its own, once.  With ``graph``
    (a wrapper made with ``use_cuda_graph=True``) ``run()`` never plans: a feature that was not planned
    is an error saying to plan with it.  ``prefer_lse``: plan with ``return_lse`` when the chosen backend
    serves it, so that runs with and without LSE share one plan (CUDA-graph wrappers, as FlashInfer's
    kernels take the LSE pointer at run time).
    """

    def __init__(self, problem: AttentionProblem, meta: BatchMeta, backend: str = "auto", *, graph: bool = False,
                 prefer_lse: bool = False, who: str = ""):
        self.meta = meta
        self.graph = graph
        self.who = who
        # FlashInfer's names mapped or refused with their reason, an unknown one listed against the known ones
        # the planned sizes pick the measured bucket (attncore.core.tables); selection is cached per bucket
        # (a forced backend is chosen whatever the sizes: none computed, host time)
        if backend is None or backend == "auto":
            if meta.kv_lens_host is not None:
                max_kv = max(meta.kv_lens_host, default=0)
            else:  # block tables planned inside capture: the longest sequence the batch may hold
                max_kv = (meta.max_seq_len or 0) if meta.batch_size else 0
            sizes = tables.bucket_at(problem.op, meta.batch_size, max(meta.qo_lens_host, default=0), max_kv)
        else:
            sizes = None
        self.requested, self.backend = selector.choose(problem, backend, sizes)
        if prefer_lse and not problem.return_lse:
            with_lse = problem.replace(return_lse=True)
            if self.backend.supports(with_lse):
                problem = with_lse
        self.problem = problem
        self._flags = (problem.return_lse, problem.sinks, problem.fp8_scales)
        self.q_dtype = problem.q_dtype  # the caller's q dtype (an fp8 one: attncore.core.fp8_query.plan)
        self._primary = (self.backend, self.backend.plan(problem, meta))
        self._variants: Dict[AttentionProblem, Tuple[Backend, object]] = {problem: self._primary}
        self._on_sms: Dict[Tuple[int, int], object] = {}  # (id of a variant's plan, SMs) -> Backend.plan_for_sms

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def variant(self, *, return_lse: bool, sinks: bool, fp8_scales: bool) -> Tuple[Backend, object]:
        pl, ps, pf = self._flags
        if (return_lse and not pl) or (sinks and not ps) or (fp8_scales and not pf):
            p = self.problem.replace(return_lse=return_lse or pl, sinks=sinks or ps, fp8_scales=fp8_scales or pf)
        else:  # host time: the plan's own features serve this run, no problem hashed
            return self._primary
        v = self._variants.get(p)
        if v is None:
            if self.graph:
                missing = [(n, kw) for n, kw, need, have in (
                    ("an LSE (return_lse=True)", "return_lse=True", return_lse, pl),
                    ("sinks", "sinks=True", sinks, ps),
                    ("fp8 scales (q_scale/k_scale/v_scale other than 1)", "fp8_scales=True", fp8_scales, pf))
                    if need and not have]
                raise ValueError(
                    f"{missing[0][0].split(' (')[0] if len(missing) == 1 else 'run()'}: {self.who or 'this wrapper'} "
                    f"runs in CUDA-graph mode (use_cuda_graph=True), where run() never plans, and this run needs "
                    f"{' and '.join(m[0] for m in missing)}, which plan() was not given; plan with it: "
                    f"plan(..., {', '.join(m[1] for m in missing)})")
            if self.backend.supports(p):
                b = self.backend
            elif self.requested != "auto":
                reasons = self.backend.reasons(p)
                raise selector.BackendSelectionError(
                    f"backend {self.backend.name!r} (forced at plan) cannot serve this run: "
                    + "; ".join(map(str, reasons)), {self.backend.name: reasons})
            else:
                b = selector.select(p, "auto")
                log.info("attncore: run-time features of %s need backend %s instead of %s",
                         p.describe(), b.name, self.backend.name)
            meta = self.meta if self.meta.int_workspace is None else dataclasses.replace(self.meta, int_workspace=None)
            v = (b, b.plan(p, meta))
            self._variants[p] = v
        return v

    q_upcast: Optional[torch.Tensor] = None  # an fp8 q's upcast buffer (attncore.core.fp8_query)
    q_fold: Optional[torch.Tensor] = None  # per-head q/k scales folded into q (attncore.core.head_scales)
    o_heads: Optional[torch.Tensor] = None  # per-head v scales applied to the output (attncore.core.head_scales)

    def serving(self, args: RunArgs) -> Tuple[Backend, object]:
        """The variant (backend, plan) that serves ``args``: the features this run asks for (an LSE, sinks, fp8
        scales)."""
        return self.variant(return_lse=args.lse is not None, sinks=args.sinks is not None, fp8_scales=args.fp8_scales)

    def relaunch(self, args: RunArgs):
        """The backend's ``relaunch`` of the variant that serves ``args`` (Backend.relaunch), or None: also where
        this plan adds work around the launch (an fp8 q's upcast, per-head scales)."""
        if self.q_upcast is not None or self.o_heads is not None or args.spec_mask is not None:
            return None
        b, plan = self.serving(args)
        return b.relaunch(plan, args)

    def bounds_seq_lens(self, args: RunArgs) -> bool:
        """Whether the backend that serves ``args`` may launch before seq_lens is checked (Backend.bounds_seq_lens)."""
        return self.serving(args)[0].bounds_seq_lens

    def split_runs(self, args: RunArgs, sms: int, tail_sms: int) -> Optional[tuple]:
        """POD's SM split: (first, tail), two callables that together run ``args`` (Backend.split_launches),
        ``first`` on ``sms`` SMs and ``tail`` after the other part on its ``tail_sms``; None where the backend has no
        such pair or this plan adds work around its launch (an fp8 q's upcast, per-head scales; CUDA-graph mode)."""
        if self.graph or self.q_upcast is not None or self.o_heads is not None:
            return None
        b, plan = self.serving(args)
        pair = b.split_launches(plan, sms, tail_sms)
        if pair is None:
            return None
        first, tail = pair
        return (lambda: first(args)), (lambda: tail(args))

    def run(self, args: RunArgs, sms: Optional[int] = None) -> None:
        """``sms``: the run gets only that many of the device's SMs (POD's SM split): the backend's plan for
        them where it has one (``Backend.plan_for_sms``, made once; not in CUDA-graph mode, where run() never
        plans)."""
        if self.q_upcast is not None:
            args = _fp8_upcast(self.q_upcast, args, self.q_fold)
        b, plan = self.serving(args)
        if sms is not None and not self.graph:
            k = (id(plan), sms)
            if k not in self._on_sms:
                self._on_sms[k] = b.plan_for_sms(plan, sms)
            plan = self._on_sms[k] or plan
        b.run(plan, args)
        if self.o_heads is not None:
            _scale_out(args.out, self.o_heads)


# ----------------------------------------------------------------------------- workspaces and outputs
# (the one-call functions' plan cache and workspace: attncore.core.plan_cache)
INT_WORKSPACE_BYTES = 8 << 20  # a wrapper's own int workspace, as FlashInfer 0.2.14 allocates it


def alloc_out(name: str, out, shape, dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return check_tensor(name, out, shape=list(shape), dtype=dtype, device=device)


def alloc_lse(lse, rows: int, heads: int, device) -> torch.Tensor:
    if lse is None:
        return torch.empty((rows, heads), dtype=torch.float32, device=device)
    return check_tensor("lse", lse, shape=[rows, heads], dtype=torch.float32, device=device)


def reject_extra(name: str, args: tuple) -> None:
    if args:
        raise TypeError(f"{name}: got {len(args)} unexpected extra positional argument(s); "
                        f"pass options by keyword")


def alias(where: str, name: str, value, alias_name: str, alias_value):
    """One parameter spelled two ways by different FlashInfer releases (``use_fp16_qk_reduction`` /
    ``allow_fp16_qk_reduction``, ``head_dim_qk`` / ``head_dim``...): the value given, or a ``TypeError``
    naming both when both are (both default to None, so "given" is "not None")."""
    if alias_value is None:
        return value
    if value is not None:
        raise TypeError(f"{where}: got both {name}={value!r} and {alias_name}={alias_value!r}; they are two "
                        f"spellings of one parameter (FlashInfer releases differ): pass only one")
    return alias_value


def ambiguous(where: str, name: str, value, expected: str, order: str, other: str) -> TypeError:
    """The ``TypeError`` for a value that does not fit parameter ``name`` of FlashInfer 0.2.14's positional
    ``order`` but fits ``other`` (another release's parameter at that position): attncore reads positions in
    0.2.14's order and never reinterprets one as another parameter."""
    shown = f"a tensor of dtype {dtype_name(value.dtype)}" if isinstance(value, torch.Tensor) else repr(value)
    return TypeError(f"{where}: got {shown} for {name}, expected {expected}. Positional arguments follow "
                     f"FlashInfer 0.2.14's order ({order}); another release puts {other} at this position. "
                     f"Pass {other.split(' ')[0]} (and what follows it) by keyword")


# ----------------------------------------------------------------------------- batches
# The index uploads (small_index, index_tables...) live in attncore.core.uploads (one staged upload with the
# backend's tables); small_index stays importable from here.
from attncore.core.uploads import small_index  # noqa: E402
