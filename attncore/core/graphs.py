"""What the Triton and cuda_fa2 plans share about CUDA-graph mode and about sending their tables.

Graph states: a captured launch keeps its grid, scalars and pointers, so the first graph-mode plan of a
*caller* fixes a backend's config and table capacities (a backend-defined state object), and later plans
of that caller reuse them.  The caller is identified by a buffer it owns for its lifetime: its int
workspace (a wrapper's own) or, driven directly without one (tests, the conformance suite), the buffer
behind its fixed ``qo_indptr``.  A state holds a weak reference to that buffer (``state.anchor``): a
state whose buffer died, or whose key (an address) now belongs to another buffer, starts afresh, and no
state keeps a caller's memory alive.  Bounded: the oldest states go first.

Tables: a plan writes its int tables into a host image laid out like their span of the int workspace
and sends it in one non-blocking copy from pinned memory (``send_tables``): no device sync.  The pinned
buffer comes from torch's caching host allocator, which records the copy's stream and reuses the block
only once the copy ran (the same fact ``_api.index_tables`` relies on), so no event or ring is kept here.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import torch

from attncore.core.workspace import WorkspaceLayout


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


# ------------------------------------------------------------------------------ table upload
_NP = {torch.int32: np.dtype(np.int32), torch.float32: np.dtype(np.float32), torch.uint8: np.dtype(np.uint8),
       torch.int64: np.dtype(np.int64)}


def host_views(layout: WorkspaceLayout) -> tuple:
    """(a zeroed numpy host image of ``layout``, {region: numpy view}): writing a Python list or tuple of
    rows into a view is one conversion, no tensor made per table (host time)."""
    raw = np.zeros(layout.nbytes, dtype=np.uint8)
    return raw, {name: np.ndarray(shape, dtype=_NP[dtype], buffer=raw, offset=off)
                 for name, shape, dtype, off in layout.regions}


def span(layout: WorkspaceLayout, dev_views: dict, memo: Optional[dict] = None) -> torch.Tensor:
    """The uint8 device span of ``layout`` (views carved from one buffer), from its first region on;
    ``memo``: the caller's (``BatchMeta.memo``), keeping it per address and size."""
    base = dev_views[layout.regions[0][0]]
    key = ("span", base.data_ptr(), base.device, layout.nbytes)
    hit = memo.get(key) if memo is not None else None
    if hit is None:
        hit = torch.as_strided(base.view(-1).view(torch.uint8), (layout.nbytes,), (1,))
        if memo is not None:
            memo[key] = hit
    return hit


def staged(image: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host image as the tensor to send to ``device``: pinned for CUDA (one copy into memory of torch's
    caching host allocator), else the image itself."""
    t = torch.from_numpy(image)
    return t.pin_memory() if device.type == "cuda" else t


def send(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy a staged host image to its device span: non-blocking from pinned memory (no device sync)."""
    dst.copy_(src, non_blocking=True)
