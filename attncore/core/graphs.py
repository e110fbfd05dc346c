"""What the Triton and cuda_fa2 plans share about CUDA-graph mode and about sending their tables.

Graph states: a captured launch keeps its grid, scalars and pointers, so the first graph-mode plan of a
*caller* fixes a backend's config and table capacities (a backend-defined state object), and later plans
of that caller reuse them.  The caller is identified by a buffer it owns for its lifetime: its int
workspace (a wrapper's own) or, driven directly without one (tests, the conformance suite), the buffer
behind its fixed ``qo_indptr``.  A state holds a weak reference to that buffer (``state.anchor``): a
state whose buffer died, or whose key (an address) now belongs to another buffer, starts afresh, and no
state keeps a caller's memory alive.  Bounded: the oldest states go first.

Tables: a plan writes its int tables into a host image laid out like their span of the int workspace
and sends it, with the batch's staged index tables, in one non-blocking copy (attncore.core.uploads: from
pageable memory, which the driver stages before the call returns, or from torch's caching host allocator for
large images): no device sync, and no event or ring is kept.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Optional

import torch


def anchor(meta) -> torch.Tensor:
    """The buffer that identifies a caller in graph mode: the root tensor of its int workspace, else of its
    fixed ``qo_indptr`` buffer (a plan sees a new view of it each time)."""
    t = meta.int_workspace if meta.int_workspace is not None else meta.qo_indptr
    while t._base is not None:
        t = t._base
    return t


class GraphStates:
    """One backend's graph states by (caller, device, problem); a state object has an ``anchor`` attribute
    (set by ``add``)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self.states: "OrderedDict[tuple, Any]" = OrderedDict()

    @staticmethod
    def key(problem, meta) -> tuple:
        ident = (("int", meta.int_workspace.data_ptr()) if meta.int_workspace is not None
                 else ("qo", meta.qo_indptr.data_ptr()))
        return ident + (meta.device, problem)

    def find(self, problem, meta) -> Optional[Any]:
        """The caller's state, or None before its first graph-mode plan (or once its buffer died or another
        buffer took its address)."""
        k = self.key(problem, meta)
        st = self.states.get(k)
        if st is None:
            return None
        if st.anchor() is not anchor(meta):
            del self.states[k]
            return None
        self.states.move_to_end(k)
        return st

    def add(self, problem, meta, st: Any) -> Any:
        """Record ``st`` as the caller's state (dropping the states whose callers are gone)."""
        for k in [k for k, v in self.states.items() if v.anchor() is None]:
            del self.states[k]
        st.anchor = weakref.ref(anchor(meta))
        self.states[self.key(problem, meta)] = st
        while len(self.states) > self.limit:
            self.states.popitem(last=False)
        return st

    def __len__(self) -> int:
        return len(self.states)
