"""xqa's plan: the split-KV decision and the plan's scratch, carved from the caller's workspaces.

The schedule is xqa's own, not ``attncore.core.schedule``'s: that module lists row tiles of
variable-length query blocks as host-side work items with per-request split counts and a merge
table for a second launch.  xqa has one CTA per (request, KV head, m-group, split) with one split
count for the whole batch (the kernel divides each request's own KV range by it at run time, so a
plan needs no per-request table), and the last CTA of each (request, KV head, m-group) merges the
partials in place.  The field names are the shared ones: ``num_items`` (CTAs), ``part_o`` /
``part_lse`` (split partials).

Scratch (issue 15, "the workspace is the only scratch"), laid out with ``WorkspaceLayout``:

* float workspace (``BatchMeta.workspace``, run-scoped, may be shared by several wrappers):
  ``stage`` (staging for a misaligned q or out, non-float32 sinks, a strided spec mask: copied on
  the stream in ``run()``), ``part_lse``, ``part_o``;
* int workspace (``BatchMeta.int_workspace``, plan-scoped, the wrapper's own): ``counters`` (one
  arrival counter per (request, KV head, m-group): zeroed at plan time, and left at zero by the
  kernel's last CTA after every launch), ``page_table_stub`` (a valid pointer for a batch without
  pages; never read).  While the batch's index tables are staged on the host (``BatchMeta.staged``),
  this layout is carved right before them and both go in one copy, the counters' zeros included
  (``attncore.core.uploads``); else the counters are zeroed by a memset on the stream.

Without a caller's buffer, the float scratch is one fresh allocation per plan (a backend driven
directly), except in CUDA-graph mode; the int scratch always comes from a per-device grow-only pool
(``own_buffer``), since a captured graph keeps using the addresses after its plan is dropped and the
API's wrappers do not hand xqa an int workspace of their own yet.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from attncore.core import uploads
from attncore.core.backend import BatchMeta
from attncore.core.problem import AttentionProblem
from attncore.core.workspace import WorkspaceLayout

MAX_SPLITS = 128


@dataclass
class XqaPlan:
    problem: AttentionProblem
    meta: BatchMeta
    lib: Any  # binding.Library (or anything with rows, tile, num_sms, ctas_per_sm)
    device: torch.device
    params: Any  # binding.XqaParams with the static fields filled
    layout: str
    sm_scale: float
    fp8_fold: float
    pdl_ok: bool
    spec_mask_allowed: bool
    check_kv: bool
    num_splits: int
    m_groups: int
    num_items: int  # CTAs of the launch: B * Hkv * m_groups * num_splits
    # tensors the launch reads: kept alive here
    page_table: torch.Tensor
    page_table_indptr: Optional[torch.Tensor]
    seq_lens: torch.Tensor
    part_o: Optional[torch.Tensor]  # [units, splits, rows, D] float32, or None (no split)
    part_lse: Optional[torch.Tensor]  # [units, splits, rows] float32 base 2, or None
    counters: Optional[torch.Tensor]  # [units] int32, or None
    stage: torch.Tensor  # uint8 staging region of the float workspace (see stage_offsets)
    stage_offsets: Dict[str, Tuple[int, int]]  # name -> (byte offset, bytes) within ``stage``


@functools.lru_cache(maxsize=4096)  # a pure function of ints, up to 128 iterations: once per sizes (host time)
def choose_splits(base_ctas: int, max_tiles: int, slots: int, max_splits: int = MAX_SPLITS) -> int:
    """Split count minimising (waves x tiles per CTA) plus a small merge cost.

    A CTA streams ``ceil(max_tiles / s)`` tiles plus a fixed cost (pipeline fill, Q load,
    epilogue: about two tiles); ``ceil(base * s / slots)`` waves of CTAs run.  A split adds one
    partial write + merge (about one tile) and a little per-split merge traffic."""
    if base_ctas <= 0 or max_tiles <= 1:
        return 1
    best, best_cost = 1, None
    for s in range(1, min(max_splits, max_tiles) + 1):
        cost = math.ceil(base_ctas * s / slots) * (math.ceil(max_tiles / s) + 2) + (1.0 + 0.02 * s if s > 1 else 0.0)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def split_count(problem: AttentionProblem, meta: BatchMeta, lib, base: int, max_len: int, override,
                slots: Optional[int] = None) -> int:
    """The batch's split-KV count (see the module docstring for what a split is); ``slots``: the CTAs resident at
    once (None: ``lib``'s on every SM of the device)."""
    QL = meta.q_len_per_req
    wl = meta.params.window_left
    eff = min(max_len, wl + QL + lib.tile) if wl >= 0 else max_len
    max_tiles = -(-eff // lib.tile)
    fixed = meta.fixed_split_size
    if override:
        return max(1, min(MAX_SPLITS, int(override)))
    if meta.disable_split_kv:
        return 1
    if fixed:
        return max(1, min(MAX_SPLITS, -(-max_tiles // max(1, -(-fixed // lib.tile)))))
    if problem.cuda_graph:
        # A captured launch is replayed after re-planning for new lengths, and must equal an eager
        # run of the new plan bit for bit: the split count (which sets the summation order) may
        # depend on the frozen batch shape only, not on the lengths.
        whole = lib.num_sms * lib.ctas_per_sm
        return 1 if 2 * base >= whole else min(64, -(-whole // base))
    return choose_splits(base, max_tiles, slots or lib.num_sms * lib.ctas_per_sm)


# ------------------------------------------------------------------------------------------ scratch
_POOLS: Dict[Tuple[str, Optional[int]], list] = {}
_POOL_LOCK = threading.Lock()


def own_buffer(kind: str, dev: torch.device, nbytes: int) -> torch.Tensor:
    """A zeroed uint8 buffer of at least ``nbytes`` on ``dev``, for scratch no caller's workspace
    holds.  Grow-only and never freed: every buffer handed out stays valid for graphs captured with
    it, and a plan that fits the current one allocates nothing."""
    key = (kind, dev.index)
    with _POOL_LOCK:
        bufs = _POOLS.setdefault(key, [])
        if bufs and bufs[-1].numel() >= nbytes:
            return bufs[-1]
        size = max(nbytes, 2 * bufs[-1].numel() if bufs else 0, 1 << 16)
        t = torch.zeros(size, dtype=torch.uint8, device=dev)
        bufs.append(t)
        return t


# The layout a CUDA-graph plan set for a caller's int workspace (the wrapper's own buffer): later
# graph-mode plans carve the same layout (same addresses) and may not need more.  Keyed by the
# buffer's address (the API may hand a new view of the same memory each plan), dropped with its
# storage, so a later buffer at a reused address starts afresh.
_GRAPH_CAPACITY: Dict[Tuple[int, int], Tuple[Tuple[int, int, int], int]] = {}


def _graph_capacity(int_ws: torch.Tensor, shape: Tuple[int, int, int], splits: int) -> int:
    """The split count to lay out for a graph-mode plan of ``shape`` (units, rows, D) carved from
    ``int_ws``; raises ValueError when it needs more than the layout first planned there."""
    storage = int_ws.untyped_storage()
    key = (storage.data_ptr(), int_ws.data_ptr())
    have = _GRAPH_CAPACITY.get(key)
    if have is None:
        _GRAPH_CAPACITY[key] = (shape, splits)
        weakref.finalize(storage, _GRAPH_CAPACITY.pop, key, None)
        return splits
    cap_shape, cap_splits = have
    if cap_shape != shape or splits > cap_splits:
        raise ValueError(
            f"xqa: this CUDA-graph plan needs split-KV scratch for (units, rows, head_dim) = {shape} x {splits} "
            f"splits, but the captured layout of this wrapper's int workspace holds {cap_shape} x {cap_splits} "
            f"splits; a captured graph keeps the first plan's addresses: create a new wrapper (and capture "
            f"again) for this batch")
    return cap_splits


def float_layout(problem: AttentionProblem, meta: BatchMeta, units: int, rows: int, splits: int
                 ) -> Tuple[WorkspaceLayout, Dict[str, Tuple[int, int]]]:
    """The float workspace's regions; staging first, so split partials of a re-plan keep their offsets."""
    return _float_layout(problem.op == "xqa_decode", meta.batch_size, meta.q_len_per_req, problem.num_qo_heads,
                         problem.head_dim_qk, problem.head_dim_vo, problem.q_dtype.itemsize,
                         problem.out_dtype.itemsize, units, rows, splits)


@functools.lru_cache(maxsize=256)
def _float_layout(spec_mask: bool, batch: int, ql: int, hq: int, d: int, dv: int, q_size: int, out_size: int,
                  units: int, rows: int, splits: int) -> Tuple[WorkspaceLayout, Dict[str, Tuple[int, int]]]:
    """float_layout by its sizes, made once per sizes (host time); neither result is changed after."""
    n_rows = batch * ql
    parts = [("q", n_rows * hq * d * q_size), ("out", n_rows * hq * d * out_size), ("sinks", hq * 4)]
    if spec_mask:  # the mask is a run-time argument: room for it whenever it may come
        parts.append(("spec_mask", batch * ql * (-(-ql // 32) * 2) * 2))
    offs, off = {}, 0
    for name, n in parts:
        offs[name] = (off, n)
        off += -(-n // 256) * 256
    lay = WorkspaceLayout("xqa")
    lay.add("stage", (off,), torch.uint8)
    if splits > 1:
        lay.add("part_lse", (units, splits, rows), torch.float32)
        lay.add("part_o", (units, splits, rows, dv), torch.float32)
    return lay, offs


@functools.lru_cache(maxsize=256)
def int_layout(units: int, splits: int, need_stub: bool) -> WorkspaceLayout:
    lay = WorkspaceLayout("xqa")
    if splits > 1:
        lay.add("counters", (units,), torch.int32)
    if need_stub:
        lay.add("page_table_stub", (1,), torch.int32)
    return lay


def make_plan(problem: AttentionProblem, meta: BatchMeta, lib, dev: torch.device, *, split_override=None,
              pdl_ok: bool = False, sms: Optional[int] = None) -> XqaPlan:
    """Everything the launch needs that does not depend on the run's tensors.  No device sync, and
    no device allocation once the caller's workspaces (or the own buffers) are in place.  ``sms``: the split
    count chosen for a launch on that many of the device's SMs (None: all of them)."""
    from attncore.backends.xqa.binding import XqaParams

    B = meta.batch_size
    QL = meta.q_len_per_req
    G = problem.group_size
    Hkv = problem.num_kv_heads
    ps = meta.page_size
    if ps & (ps - 1):
        raise ValueError(f"xqa: page_size {ps} is not a power of two")
    R = G * QL
    m_groups = -(-R // lib.rows)

    # ---- page table and kv lengths (the batch's, int32 on the device: read directly by the kernel)
    if problem.op == "xqa_decode":
        bt = meta.block_tables
        if bt.stride(-1) != 1:
            raise ValueError(f"block_tables: the last dim must be contiguous, got strides {tuple(bt.stride())}")
        page_table, indptr, pt_stride = bt, None, bt.stride(0)
        max_len = meta.max_seq_len
    else:
        page_table, indptr, pt_stride = meta.kv_indices, meta.kv_indptr, 0
        max_len = max(meta.kv_lens_host, default=0)

    units = B * Hkv * m_groups
    splits = split_count(problem, meta, lib, units, max_len, split_override,
                         None if sms is None else sms * lib.ctas_per_sm)
    lay_splits = splits
    if problem.cuda_graph and splits > 1 and meta.int_workspace is not None:
        lay_splits = _graph_capacity(meta.int_workspace, (units, lib.rows, problem.head_dim_vo), splits)

    need_stub = page_table.data_ptr() == 0  # no pages at all: never read, but keep a valid pointer
    flay, stage_offsets = float_layout(problem, meta, units, lib.rows, lay_splits)
    ilay = int_layout(units, lay_splits, need_stub)
    fws = meta.workspace
    if fws is None and problem.cuda_graph:
        fws = own_buffer("float", dev, flay.nbytes + 256)
    fb = flay.carve(fws, "float_workspace_buffer", device=dev, memo=meta.memo)
    iws = meta.int_workspace
    if iws is None and ilay.regions:
        iws = own_buffer("int", dev, ilay.nbytes + 256)
    staged = meta.staged if ilay.regions and iws is meta.int_workspace else None  # the wrapper's buffer, not own_buffer
    zeroed = staged is not None and not staged.sent
    if zeroed:  # the zeroed counters go with the batch's index tables in one copy (no memset launch)
        ib, image, _, span = uploads.carve_tables(ilay, iws, staged, dev, meta.memo)
        uploads.send_image(image, span)
    else:
        ib = ilay.carve(iws, "int_workspace_buffer", device=dev, memo=meta.memo) if ilay.regions else {}
    if need_stub:
        page_table = ib["page_table_stub"]

    params = XqaParams()
    counters = ib.get("counters")
    if counters is not None:
        if not zeroed:
            counters.zero_()  # a memset on the stream (capturable): the caller's buffer may hold anything
        params.ws_counters = counters.data_ptr()
        params.ws_partial_lse = fb["part_lse"].data_ptr()
        params.ws_partial_o = fb["part_o"].data_ptr()
    params.page_table = page_table.data_ptr()
    params.page_table_indptr = indptr.data_ptr() if indptr is not None else None
    params.page_table_stride = pt_stride
    params.seq_lens = meta.kv_lens.data_ptr()
    # a length past the block table is read as its end (the table's shape, not max_seq_len: the same for every re-plan
    # a captured graph replays); the paged form's lengths come from its indptr
    params.kv_cap = min(bt.shape[1] * ps, 2 ** 31 - 1) if problem.op == "xqa_decode" else 2 ** 31 - 1
    params.batch = B
    params.num_q_heads = problem.num_qo_heads
    params.num_kv_heads = Hkv
    params.group = G
    params.q_len = QL
    params.rows = R
    params.m_groups = m_groups
    params.num_splits = splits
    params.page_size_log2 = int(math.log2(ps))
    params.window_left = meta.params.window_left
    params.causal = 1 if meta.mask == "causal" else 0
    params.device = dev.index if dev.index is not None else -1
    return XqaPlan(problem=problem, meta=meta, lib=lib, device=dev, params=params, layout=problem.kv_layout,
                   sm_scale=float(meta.params.sm_scale), fp8_fold=1.0,  # the kernel folds its own fp8 scale
                   pdl_ok=pdl_ok, spec_mask_allowed=problem.op == "xqa_decode", check_kv=True, num_splits=splits,
                   m_groups=m_groups, num_items=units * splits, page_table=page_table, page_table_indptr=indptr,
                   seq_lens=meta.kv_lens, part_o=fb.get("part_o"), part_lse=fb.get("part_lse"), counters=counters,
                   stage=fb["stage"], stage_offsets=stage_offsets)


def stage_view(plan: XqaPlan, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The staging slot ``name`` of ``plan`` as a contiguous tensor of ``shape`` (run-time, rare path)."""
    off, n = plan.stage_offsets[name]
    need = math.prod(shape) * dtype.itemsize
    if need > n:
        raise ValueError(f"{name}: got shape {tuple(shape)} ({need} bytes as {dtype}), more than the plan's "
                         f"staging slot of {n} bytes for it")
    return plan.stage[off:off + need].view(dtype).view(shape)
