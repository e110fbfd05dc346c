"""Index tensors from the host to the device: the batch's index tables (``BatchMeta``'s qo/kv indptr, page
ids, last-page lengths, kv lengths) and the small cached tensors of the one-call APIs, with no device sync.

Host time (issue 15 item 1): a batch's index tables and a backend's own tables (work items, merge rows,
counts) each cost a host-to-device copy (``_source``: staged by the driver from pageable memory, no
sync).  So a batch whose index data are all
on the host *stages* its tables (``Staged``, ``BatchMeta.staged``) instead of sending them, and a backend
that declares ``Backend.sends_index_tables`` carves its tables right before them (``tables_buffer``) and
sends both in one copy (``merged_image`` / ``merged_span``).  Every other backend gets them sent before its
``plan()`` runs, and every backend after it (``Backend``'s plan hook; sending is idempotent), so no
backend can see unsent tables.  (On the CPU the tables are also written at once, so a ``BatchMeta`` read
before any plan sees them; the merged copy then rewrites the same bytes, the path tested on the CPU.)

In the int workspace the index tables sit at the END (``index_tables``); a backend carves its tables from
the front of what is left (``BatchMeta.int_workspace``) unless it merges the upload, and always in
CUDA-graph mode (no staging there: the tables go into the caller's fixed buffers, ``into``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from attncore.core.workspace import ALIGN, WorkspaceTooSmall

_SMALL: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def small_index(values: Sequence[int], device) -> torch.Tensor:
    """A small read-only int32 tensor on ``device``, cached by value.

    The one-call APIs (single prefill, xqa) build index tensors on every call; a plain host-to-device
    copy of a Python list synchronises the stream, so these are cached (the same shapes repeat
    across layers) and copied from pinned memory without blocking.  Backends never mutate them.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    key = (device, tuple(values))  # host time: hashing a torch.device is ~10x cheaper than str(device)
    t = _SMALL.get(key)
    if t is None:
        host = torch.tensor(values, dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory()
        t = host.to(device, non_blocking=True)
        _SMALL[key] = t
        if len(_SMALL) > 512:
            _SMALL.popitem(last=False)
    else:
        _SMALL.move_to_end(key)
    return t


def host_int32(values: Sequence[int], device, non_blocking: bool = False) -> torch.Tensor:
    """A new int32 tensor of ``values`` on ``device`` (a copy from the host unless it is the CPU)."""
    t = torch.tensor(values, dtype=torch.int32)
    return t if device.type == "cpu" else t.to(device, non_blocking=non_blocking)


def to_device_int32(t: torch.Tensor, device, non_blocking: bool = False) -> torch.Tensor:
    """An index tensor as a ``BatchMeta`` keeps it: int32, contiguous, on ``device`` (no copy when it
    already is)."""
    return t.to(device=device, dtype=torch.int32, non_blocking=non_blocking).contiguous()


# Host-to-device copies from pageable memory up to this size: the driver stages them and returns, the stream
# keeps running (measured on an H100 host, 2026-11-25: 512 B to 1 MiB, the stream still busy after the call and
# the data intact when the host array changed right after it) at 6.0 us per 1 KB copy, against 20.0 for
# pin_memory() and a copy.  Larger images, and copies while a stream captures a CUDA graph (where a pageable
# copy is an error), go through pinned memory.
PAGEABLE_MAX = 1 << 20


def _source(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as the source of a non-blocking copy to ``device``: the array itself where the copy is
    small enough to stage (``PAGEABLE_MAX``), else pinned (torch's caching host allocator keeps the block until
    the copy ran)."""
    t = torch.from_numpy(arr)
    if device.type != "cuda" or (arr.nbytes <= PAGEABLE_MAX and not torch.cuda.is_current_stream_capturing()):
        return t
    return t.pin_memory()


class Staged:
    """A batch's index tables written on the host (``data``, int32) and not yet sent to ``region`` (their
    int32 span at the end of the int workspace).  ``send()`` copies them once; a backend that sends them with
    its own tables (``merged_image``) marks them sent."""

    __slots__ = ("data", "region", "sent")

    def __init__(self, data: np.ndarray, region: torch.Tensor) -> None:
        self.data, self.region, self.sent = data, region, False

    def send(self) -> None:
        if not self.sent:
            self.sent = True
            if not self.region.is_cpu:  # on the CPU index_tables wrote them already
                self.region.copy_(_source(self.data, self.region.device), non_blocking=True)


def index_tables(int_workspace: torch.Tensor, device: torch.device, parts: Sequence, non_blocking: bool = False,
                 memo: Optional[dict] = None) -> Tuple[List[torch.Tensor], torch.Tensor, Optional[Staged]]:
    """A batch's int32 index tensors carved from the END of the wrapper's int workspace: ``parts`` are host
    lists or int32 tensors (host or ``device``).  Returns (one view per part, the rest of the buffer, the
    staged host data or None).  When every part is host data it is written into one host array and *staged*,
    not sent (see the module docstring: the caller keeps the ``Staged`` on its ``BatchMeta``); else the host
    data go in one copy now (``_source``) and device parts are copied on the device after it (no stream
    sync either way).  ``memo``: the caller's dict (``BatchMeta.memo``) keeping the views of the same sizes at
    the same address.

    Tables too large for the buffer (FlashInfer sizes it at 8 MiB: a page table of 2M ids does not fit) are
    read in place where they already are int32 and contiguous on ``device``, as FlashInfer reads its
    caller's page table (the caller keeps them unchanged until the last ``run()`` of the plan); the rest
    must fit, else ``WorkspaceTooSmall`` names the bytes."""
    sizes = tuple([len(x) if x.__class__ is list else x.numel() for x in parts])
    key = ("index_tables", int_workspace.data_ptr(), int_workspace.numel(), int_workspace.device, sizes)
    hit = memo.get(key) if memo is not None else None
    if hit is None:
        total = sum(sizes)
        off = int_workspace.numel() - 4 * total
        off -= (int_workspace.data_ptr() + off) % 4
        if off < 0:
            return _in_place(int_workspace, device, parts, sizes, non_blocking)
        region = int_workspace[off:off + 4 * total].view(torch.int32)
        hit = (region, region.split_with_sizes(sizes), int_workspace[:off])  # host time: one call for every view
        if memo is not None:
            memo[key] = hit
    region, views, rest = hit
    on_device = [i for i, x in enumerate(parts) if x.__class__ is not list and not x.is_cpu]
    staged = None
    if len(on_device) < len(parts):  # host data into one array
        if not on_device and region.numel() <= 256:  # small: one flat list, one conversion
            flat: list = []
            for x in parts:
                flat += x if x.__class__ is list else x.tolist()
            arr = np.array(flat, dtype=np.int32)
        else:  # lists by np.fromiter, host tensors as numpy views (no Python int per entry)
            arr, a = (np.zeros if on_device else np.empty)(region.numel(), dtype=np.int32), 0
            for x, n in zip(parts, sizes):
                if x.__class__ is list:
                    arr[a:a + n] = np.fromiter(x, np.int32, n)
                elif x.is_cpu:
                    arr[a:a + n] = x.numpy()
                a += n
        staged = Staged(arr, region)
        if device.type == "cpu":  # readable at once, as before (a merged copy later rewrites the same bytes)
            region.numpy()[:] = arr
        if on_device:  # sent now: the device parts are copied over their (unwritten) spans below, on the same stream
            staged.send()
            staged = None
    for i in on_device:
        views[i].copy_(parts[i], non_blocking=True)
    return list(views), rest, staged


def _in_place(int_workspace: torch.Tensor, device: torch.device, parts: Sequence, sizes: tuple,
              non_blocking: bool) -> Tuple[List[torch.Tensor], torch.Tensor, Optional[Staged]]:
    """``index_tables`` when its parts do not all fit: the int32 contiguous tensors already on ``device`` are
    their own views, the others are carved as usual (or the error names the bytes)."""
    keep = [i for i, x in enumerate(parts) if x.__class__ is not list and x.device == device
            and x.dtype == torch.int32 and x.is_contiguous() and x.numel()]
    rest = [i for i in range(len(parts)) if i not in keep]
    need = 4 * sum(sizes[i] for i in rest)
    if not keep or need > int_workspace.numel() - 4:
        raise WorkspaceTooSmall(
            f"int_workspace_buffer: the batch's index tables need {4 * sum(sizes)} bytes (without the ones read in "
            f"place: {need}), the buffer has {int_workspace.numel()}; pass a larger int_workspace_buffer, or the page "
            f"table as an int32 tensor on {device} (read in place)")
    views, left, staged = index_tables(int_workspace, device, [parts[i] for i in rest], non_blocking) if rest \
        else ([], int_workspace, None)
    out: List[Optional[torch.Tensor]] = [None] * len(parts)
    for i in keep:
        out[i] = parts[i]
    for i, v in zip(rest, views):
        out[i] = v
    return out, left, staged


def sending_staged(fn):
    """``plan`` with the batch's staged index tables sent before it (unless the backend sends them itself) and
    after it in any case (a no-op once sent)."""
    def plan(self, problem, meta, *a, **kw):
        st = getattr(meta, "staged", None)
        if st is None:
            return fn(self, problem, meta, *a, **kw)
        if not self.sends_index_tables:
            st.send()
        try:
            return fn(self, problem, meta, *a, **kw)
        finally:
            st.send()
    plan._sends_staged = True
    plan.__doc__, plan.__name__, plan.__qualname__, plan.__wrapped__ = fn.__doc__, fn.__name__, fn.__qualname__, fn
    return plan


# ------------------------------------------------------------------------------ one upload for both
def tables_buffer(rest: torch.Tensor, staged: Optional[Staged], nbytes: int, memo: Optional[dict] = None
                  ) -> torch.Tensor:
    """Where a backend that merges the upload carves a layout of ``nbytes`` (``WorkspaceLayout.carve``): the end
    of ``rest`` (``BatchMeta.int_workspace``), the layout's start on an ``ALIGN`` boundary, so that its tables
    and the staged index tables after them form one short span; ``rest`` itself when nothing is staged, or when
    ``rest`` is too small (carve then names the bytes needed).  ``memo``: the caller's (``BatchMeta.memo``)."""
    if staged is None or staged.sent:
        return rest
    ptr, n = rest.data_ptr(), rest.numel()
    key = ("tables_buffer", ptr, n, rest.device, nbytes)
    hit = memo.get(key) if memo is not None else None
    if hit is None:
        start = (ptr + n - nbytes) // ALIGN * ALIGN - ptr
        hit = rest[start:] if start >= 0 else rest
        if memo is not None:
            memo[key] = hit
    return hit


def merged_image(staged: Optional[Staged], first: torch.Tensor, nbytes: int) -> Tuple[np.ndarray, int]:
    """(a zeroed host image of the span from ``first`` (the device view of a layout's first region) over the
    layout's ``nbytes`` and on to the end of the staged index tables, with their data already at its end, the
    image's size); the index tables are then marked sent: the caller sends the image (``merged_span``).  With
    nothing staged: an image of ``nbytes``."""
    if staged is None or staged.sent:
        return np.zeros(nbytes, dtype=np.uint8), nbytes
    end = staged.region.data_ptr() + 4 * staged.region.numel()
    size = end - first.data_ptr()
    if first.device != staged.region.device or size < nbytes + 4 * staged.region.numel():
        raise RuntimeError("merged_image: the layout was not carved before the staged index tables "
                           "(carve it from uploads.tables_buffer)")
    raw = np.zeros(size, dtype=np.uint8)
    raw[size - 4 * staged.region.numel():] = staged.data.view(np.uint8)
    staged.sent = True
    return raw, size


def carve_tables(layout, buffer: Optional[torch.Tensor], staged: Optional[Staged], device: torch.device,
                 memo: Optional[dict] = None) -> Tuple[dict, np.ndarray, dict, torch.Tensor]:
    """A backend's int tables (``layout``, a ``WorkspaceLayout``) carved from ``buffer`` right before the batch's
    ``staged`` index tables (``tables_buffer``), for one copy of both: (the device views, the zeroed host image
    with the staged tables at its end, its numpy view per table, the device span to send the image to).  The
    staged tables are marked sent: the caller fills the views and sends the image (``send_image``)."""
    live = staged is not None and not staged.sent
    key = None
    if memo is not None and buffer is not None:  # a re-plan of the same sizes: the same views and span (host time)
        reg = staged.region if live else None
        key = ("carve_tables", layout, buffer.data_ptr(), buffer.numel(), buffer.dtype, buffer.device,
               None if reg is None else (reg.data_ptr(), reg.numel()))
        hit = memo.get(key)
        if hit is not None:
            tabs, first, span = hit
            image, _ = merged_image(staged, first, layout.nbytes)
            return tabs, image, layout_views(layout, image), span
    tabs = layout.carve(tables_buffer(buffer, staged, layout.nbytes, memo), "int_workspace_buffer", device=device,
                        memo=memo)
    first = tabs[layout.regions[0][0]]
    image, size = merged_image(staged, first, layout.nbytes)
    span = merged_span(first, size, memo)
    if key is not None:  # layouts are made once per sizes and never changed (the key holds the object)
        memo[key] = (tabs, first, span)
    return tabs, image, layout_views(layout, image), span


def merged_span(first: torch.Tensor, size: int, memo: Optional[dict] = None) -> torch.Tensor:
    """The uint8 device span of ``size`` bytes from ``first`` (a view carved from a workspace); ``memo``: the
    caller's (``BatchMeta.memo``), keeping it per address and size."""
    key = ("merged_span", first.data_ptr(), first.device, size)
    hit = memo.get(key) if memo is not None else None
    if hit is None:
        hit = torch.as_strided(first.view(-1).view(torch.uint8), (size,), (1,))
        if memo is not None:
            memo[key] = hit
    return hit


def send_image(image: np.ndarray, dst: torch.Tensor) -> torch.Tensor:
    """Send a host image to its device span ``dst`` in one non-blocking copy (``_source``); returns the source
    tensor (a plan keeps it to send again)."""
    src = _source(image, dst.device)
    dst.copy_(src, non_blocking=True)
    return src


# ------------------------------------------------------------------------------ CUDA-graph buffers
def into(buffers: dict, key: str, src: torch.Tensor, name: str) -> torch.Tensor:
    """Copy ``src`` into the user's CUDA-graph buffer ``buffers[key]`` (allocated on first use)."""
    buf = buffers.get(key)
    if buf is None:
        buf = torch.empty(max(src.numel(), 1), dtype=src.dtype, device=src.device)
        buffers[key] = buf
    if buf.numel() < src.numel():
        raise ValueError(f"{name}: needs {src.numel()} entries but the CUDA-graph buffer holds {buf.numel()}")
    buf[:src.numel()].copy_(src)
    return buf[:src.numel()]


_NP = {torch.int32: np.dtype(np.int32), torch.float32: np.dtype(np.float32), torch.uint8: np.dtype(np.uint8),
       torch.int64: np.dtype(np.int64)}


def layout_views(layout, raw: np.ndarray) -> dict:
    """{region: numpy view} of a ``WorkspaceLayout`` over a host image ``raw`` that starts at the layout's
    start (``merged_image``): a table is written as one conversion, no tensor made per table."""
    return {name: np.ndarray(shape, dtype=_NP[dtype], buffer=raw, offset=off)
            for name, shape, dtype, off in layout.regions}
