"""The caller's workspace as a plan's only scratch (issue 15: "the workspace is the only scratch").

A backend's ``plan()`` lists the device buffers it needs (split-KV partials, gathered K/V, work tables,
counters) in a ``WorkspaceLayout`` and carves them out of the caller's workspace buffer
(``BatchMeta.workspace`` for float data, ``BatchMeta.int_workspace`` for index tables when the caller
gave one) instead of allocating:

    lay = WorkspaceLayout("triton")
    lay.add("o_part", (splits, rows, heads, dim), torch.float32)
    lay.add("work", (capacity, 5), torch.int32)
    bufs = lay.carve(meta.workspace, "float_workspace_buffer")   # {"o_part": view, "work": view}

Offsets depend only on the order and sizes of ``add()`` calls, so a plan that adds the same regions
with the same capacities gets the same addresses: what a captured CUDA graph keeps using across
re-plans.  A workspace too small for a plan is an error at ``plan()`` naming the bytes needed and
each region, never a silent allocation.  Without a workspace (a backend driven directly through the
contract by tests or benchmarks) ``carve(None, ..., device=...)`` allocates one buffer of the layout's size
(plus room to align its start: a CPU allocation need not start on a 256-byte boundary).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

ALIGN = 256  # bytes: every region starts on a 256-byte boundary (vector loads, TMA, cp.async)


class WorkspaceTooSmall(ValueError):
    """A plan needs more workspace than the caller gave; the message names the bytes needed."""


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize  # no scratch tensor to ask (host time; it would be an allocation)


class WorkspaceLayout:
    """Regions of one plan's scratch, in order (see the module docstring)."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.regions: List[Tuple[str, Tuple[int, ...], torch.dtype, int]] = []  # name, shape, dtype, offset
        self.nbytes = 0

    def add(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        for r in self.regions:
            if r[0] == name:
                raise ValueError(f"{self.who}: workspace region {name!r} added twice")
        off = -(-self.nbytes // ALIGN) * ALIGN
        shape = tuple([int(s) for s in shape])
        self.regions.append((name, shape, dtype, off))
        self.nbytes = off + _nbytes(shape, dtype)

    def describe(self) -> str:
        return ", ".join(f"{n} {list(s)} {str(d).replace('torch.', '')} ({_nbytes(s, d)} B)"
                         for n, s, d, _ in self.regions)

    def carve(self, buffer: Optional[torch.Tensor], arg: str = "float_workspace_buffer",
              device: Optional[torch.device] = None, memo: Optional[dict] = None) -> Dict[str, torch.Tensor]:
        """Views of ``buffer`` (a uint8 tensor; ``arg`` names it in errors), one per region.  ``buffer``
        None: one fresh allocation on ``device`` of the layout's size (plus room to align its start).
        ``memo``: the caller's dict (``BatchMeta.memo``) that keeps the views of a layout carved from the
        same buffer address (host time: a view costs microseconds; the size check runs every time)."""
        if buffer is None:
            if device is None:
                raise ValueError(f"{self.who}: carve(None) needs a device")
            buffer = torch.empty(self.nbytes + ALIGN, dtype=torch.uint8, device=device)  # room to align the start
            memo = None
        if buffer.dtype != torch.uint8 or not buffer.is_contiguous():
            buffer = buffer.view(-1).view(torch.uint8) if buffer.is_contiguous() else buffer
        if buffer.dtype != torch.uint8 or not buffer.is_contiguous():
            raise ValueError(f"{arg}: got a {buffer.dtype} tensor that is not contiguous, expected a contiguous "
                             f"uint8 buffer")
        have = buffer.numel()
        ptr = buffer.data_ptr()
        base = ptr % ALIGN
        need = self.nbytes + (ALIGN - base if base else 0)
        if need > have:
            raise WorkspaceTooSmall(
                f"{arg}: {self.who} needs {need} bytes ({need / 2 ** 20:.1f} MiB) of workspace for this plan, "
                f"the buffer has {have} ({have / 2 ** 20:.1f} MiB); pass a larger {arg} (regions: {self.describe()})")
        key = None
        if memo is not None:
            key = ("carve", ptr, buffer.device, tuple(self.regions))
            hit = memo.get(key)
            if hit is not None:
                return hit
        shift = ALIGN - base if base else 0
        out: Dict[str, torch.Tensor] = {}
        for name, shape, dtype, off in self.regions:
            n = _nbytes(shape, dtype)
            out[name] = buffer[shift + off: shift + off + n].view(dtype).view(shape)
        if key is not None:
            memo[key] = out
        return out
