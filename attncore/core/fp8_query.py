"""fp8 queries (issue 18 item 2): a q of dtype e4m3 or e5m2 is upcast, exactly, before a backend sees it.

Every e4m3 value (max 448) and every e5m2 value (max 57344 < 65504) is representable in fp16, bf16 and
fp32, so attention of an fp8 q equals attention of that q converted to a 16/32-bit float: no backend
needs an fp8-q kernel.  The rule, in one place:

* the **compute dtype** (the q dtype the problem is selected and planned for) is the output dtype when
  that is fp16, bf16 or fp32, else fp16;
* the **output dtype** defaults to q's dtype, as in FlashInfer 0.2.14 (``o_dtype`` / ``o_data_type``
  None: an fp8 output, which only some backends write, e.g. xqa with an fp8 KV cache); a backend that
  cannot write it refuses, and the error says that q was upcast and which ``o_dtype`` to pass;
* the per-tensor ``q_scale`` applies as for any q (``RunArgs.q_scale``);
* the upcast buffer is carved once at plan time from the END of the plan's float workspace (the backend
  carves its regions from the front of what is left; without a workspace it is allocated once per plan),
  so ``run()`` allocates nothing and the buffer keeps its address across runs (CUDA graphs; a re-plan
  with the same number of q rows keeps it too).  ``Planned.run`` copies q into it: one elementwise
  kernel.

``Planned.q_dtype`` is the caller's q dtype that ``run()`` checks q against; ``Planned.problem.q_dtype`` the
compute dtype.  Nothing here runs for a q that is not fp8 (the hot path reads ``Planned.q_upcast``, None),
except where per-head q/k scales are folded into q (``attncore.core.head_scales``): that q uses the buffer too.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from attncore.core.problem import FP8_DTYPES, dtype_name
from attncore.core.workspace import ALIGN, WorkspaceTooSmall

#: dtypes a q may be computed in (and that an fp8 q is upcast to)
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def compute_dtype(q_dtype: torch.dtype, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype an fp8 q is upcast to (module docstring): ``out_dtype`` (default q's) when it is fp16, bf16
    or fp32, else fp16.  A q that is not fp8 is its own compute dtype."""
    if q_dtype not in FP8_DTYPES:
        return q_dtype
    out = q_dtype if out_dtype is None else out_dtype
    return out if out in COMPUTE_DTYPES else torch.float16


def note(q_dtype: torch.dtype, compute: torch.dtype, out_dtype: torch.dtype, out_name: str) -> str:
    """What an error about a problem with an upcast q adds, so the dtypes it names make sense."""
    s = (f"q has dtype {dtype_name(q_dtype)}: attncore upcasts an fp8 q exactly to {dtype_name(compute)} (the "
         f"output dtype when it is fp16/bf16/fp32, else fp16) and selects a backend for that")
    if out_dtype in FP8_DTYPES:
        s += (f"; the output dtype is {dtype_name(out_dtype)} ({out_name}, default q's dtype as in FlashInfer "
              f"0.2.14): for a backend that does not write fp8 output pass {out_name}=torch.float16 or "
              f"torch.bfloat16")
    return s


def reserve(meta, rows: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> Tuple[object, torch.Tensor]:
    """Carve the upcast q ``[rows, heads, head_dim]`` of ``dtype`` from the end of ``meta.workspace`` (the
    float workspace); returns (the batch with the rest of the workspace, the buffer).  Without a workspace
    the buffer is allocated (once: it belongs to the plan)."""
    ws = meta.workspace
    n = rows * heads * head_dim * dtype.itemsize
    if ws is None:
        return meta, torch.empty((rows, heads, head_dim), dtype=dtype, device=device)
    if ws.dtype != torch.uint8 and ws.is_contiguous():
        ws = ws.view(-1).view(torch.uint8)
    if ws.dtype != torch.uint8 or not ws.is_contiguous():
        raise ValueError(f"float_workspace_buffer: got a {ws.dtype} tensor that is not contiguous, expected a "
                         f"contiguous uint8 buffer")
    off = ws.numel() - n
    off -= (ws.data_ptr() + off) % ALIGN
    if off < 0:
        raise WorkspaceTooSmall(f"float_workspace_buffer: the fp8 q upcast to {dtype_name(dtype)} needs {n} bytes "
                                f"({n / 2 ** 20:.1f} MiB) besides the backend's regions, the buffer has {ws.numel()}; "
                                f"pass a larger float_workspace_buffer")
    buf = ws[off:off + n].view(dtype).view(rows, heads, head_dim)
    return dataclasses.replace(meta, workspace=ws[:off]), buf


def plan(problem, meta, backend, q_dtype: torch.dtype, out_name: str = "o_dtype", heads=None, **kwargs):
    """``Planned(problem, meta, backend, **kwargs)`` for a caller's fp8 ``q_dtype`` (``problem.q_dtype`` is
    already the compute dtype): the upcast buffer reserved first (so the backend plans around it), the
    caller's dtype recorded for run()'s checks, a selection error completed with the upcast rule.
    ``heads``: per-head scales (``attncore.core.head_scales.HeadScales``) the plan applies around the
    backend; a q folded with them (any dtype) is written into the upcast buffer too."""
    from attncore.core import _api
    from attncore.core.selector import BackendSelectionError

    fp8 = q_dtype in FP8_DTYPES
    buf = None
    if fp8 or (heads is not None and heads.q_fold is not None):
        rows = meta.qo_indptr_host[-1]
        meta, buf = reserve(meta, rows, problem.num_qo_heads, problem.head_dim_qk, problem.q_dtype, meta.device)
    try:
        planned = _api.Planned(problem, meta, backend, **kwargs)
    except BackendSelectionError as e:
        if not fp8:
            raise
        raise BackendSelectionError(f"{e} ({note(q_dtype, problem.q_dtype, problem.out_dtype, out_name)})",
                                    e.reasons) from None
    planned.q_dtype = q_dtype
    planned.q_upcast = buf
    if heads is not None:
        planned.q_fold, planned.o_heads = heads.q_fold, heads.o_heads
    return planned


def upcast(buf: torch.Tensor, args, fold: Optional[torch.Tensor] = None):
    """``args`` with q copied (converted) into the plan's buffer ``buf``, multiplied by ``fold`` (per head)
    where the plan folds per-head scales (``attncore.core.head_scales``); q has the planned shape (checked
    by the entry point)."""
    q = args.q
    if fold is not None:
        from attncore.core.head_scales import fold_q

        fold_q(buf, q, fold)
        return dataclasses.replace(args, q=buf)
    if q.dtype not in FP8_DTYPES:  # the backend reads buf: a q of another dtype would be ignored
        raise TypeError(f"q: got dtype {dtype_name(q.dtype)}, but this plan was made for an fp8 q "
                        f"(upcast to {dtype_name(buf.dtype)}); plan again for this dtype")
    buf.copy_(q)
    return dataclasses.replace(args, q=buf)
