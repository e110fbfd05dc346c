"""The one-call functions' plan cache and float workspace (single prefill, and the single decode that runs
through it).

Host time (issue 15 item 1): a repeated call of a seen signature reuses its plan.  Keys hold everything the
checks look at: each tensor's shape, strides, dtype and device (``tkey``), the scalars, the backend asked for,
and ``selector.env_key()``: what selection depends on beyond the problem (the environment, registry and
ranking generations), so a registered backend, a changed ATTNCORE_BACKEND or a new tune table misses.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional

import torch

from attncore.core._api import Planned
from attncore.core.backend import BatchMeta
from attncore.core.problem import FP8_DTYPES, AttentionProblem
from attncore.core.workspace import WorkspaceTooSmall


def tkey(t: Optional[torch.Tensor]):
    """What the checks read of a tensor: (shape, strides, dtype, device); None for None."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


class PlanCache:
    """A bounded LRU of plans by signature (the one-call functions)."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._d: "OrderedDict[tuple, object]" = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        v = self._d.get(key)
        if v is None:
            self.misses += 1
        else:
            self.hits += 1
        return v

    def peek(self, key):
        """The entry of ``key`` or None, not counted as a hit or a miss."""
        return self._d.get(key)

    def newest(self):
        """The entry put last, or None (``attncore bench --latency``: the plan its last one-call made)."""
        return next(reversed(self._d.values()), None)

    def put(self, key, value) -> None:
        self._d[key] = value
        if len(self._d) > self.size:
            self._d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


#: the one-call functions' plans, keyed as above
ONE_CALL_PLANS = PlanCache()
#: the one-call xqa function's launches (attncore.decode._xqa_key): keyed also by the addresses of the caller's block
#: table, seq_lens and workspace, which its plans keep alive, so few (a serving step reuses one set of buffers)
XQA_LAUNCHES = PlanCache(8)

ONE_CALL_WORKSPACE_BYTES = 32 << 20  # the one-call functions' float workspace per device (FlashInfer: 32 MiB)
_ONE_CALL_WS: Dict[torch.device, torch.Tensor] = {}


def one_call_workspace(device: torch.device) -> torch.Tensor:
    """The float workspace of the one-call functions on ``device`` (FlashInfer's cached buffer): run-scoped
    scratch, shared by every one-call plan there (their runs are sequential on a stream).  Allocated once,
    grown by ``grow_one_call_workspace`` when a plan needs more."""
    ws = _ONE_CALL_WS.get(device)
    if ws is None:
        ws = _ONE_CALL_WS[device] = torch.empty(ONE_CALL_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


def grow_one_call_workspace(device: torch.device, limit: int = 8 << 30) -> bool:
    """Double the one-call workspace of ``device`` (False at ``limit``); cached plans carved from the old one
    are dropped."""
    old = one_call_workspace(device)
    if old.numel() * 2 > limit:
        return False
    _ONE_CALL_WS[device] = torch.empty(old.numel() * 2, dtype=torch.uint8, device=device)
    ONE_CALL_PLANS.clear()
    return True


def plan_one_call(problem: AttentionProblem, meta: BatchMeta, meta_of, backend: str,
                  q_dtype: Optional[torch.dtype] = None, heads=None) -> "Planned":
    """Plan a one-call function's batch ``meta`` (built with the device's one-call workspace), growing that
    workspace when a backend finds it too small (the caller cannot pass one: this is attncore's buffer, as
    FlashInfer's is); ``meta_of()`` builds the batch again with the grown one.  ``q_dtype``: the caller's,
    when it is fp8 (``problem.q_dtype`` is then the compute dtype, attncore.core.fp8_query).  ``heads``:
    per-head scales applied around the backend (attncore.core.head_scales)."""
    while True:
        try:
            if heads is not None or (q_dtype is not None and q_dtype in FP8_DTYPES):
                from attncore.core import fp8_query

                return fp8_query.plan(problem, meta, backend, q_dtype or problem.q_dtype, heads=heads)
            return Planned(problem, meta, backend)
        except WorkspaceTooSmall as e:  # backends name the buffer by FlashInfer's argument name
            if (meta.workspace is None or not str(e).startswith("float_workspace_buffer")
                    or not grow_one_call_workspace(meta.device)):
                raise
            meta = meta_of()
