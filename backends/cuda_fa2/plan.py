"""cuda_fa2's plan: the kernel config, the split-KV schedule (attncore.core.schedule) and the scratch.

Scratch comes from the caller's workspaces (attncore.core.workspace): the split partials ``part_o`` /
``part_lse`` from the float workspace (run-scoped), the tables (work items, the merge table, the two
live counts, ALiBi slopes) from the int workspace (plan-scoped, the wrapper's own).  The tables are
written into a pinned host staging buffer and uploaded with one non-blocking copy: no device sync
and, with the caller's workspaces, no device allocation in ``plan()``.

CUDA-graph mode (``problem.cuda_graph``): a captured launch keeps its grid and its params struct by
value, so both must stay the same across re-plans.  The first graph-mode plan of a caller fixes the
kernel config and the tables' capacities (upper bounds for any batch with the same batch size and
query rows: see ``_capacities``); every region then sits at the same address, the grids are the
capacities and the kernels read the live counts from ``counts`` (CTAs past them exit).  A re-plan
that needs more is an error naming the capacity.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from attncore.core import schedule as sched
from attncore.core.backend import BatchMeta
from attncore.core.mask import alibi_slopes
from attncore.core.problem import AttentionProblem
from attncore.core.workspace import ALIGN, WorkspaceLayout

WORK_COLS = 5  # request, first packed row, kv_lo, kv_hi, partial row (-1: writes out / lse)
MERGE_COLS = 4  # out row, first partial row, partial row stride, splits


@dataclass
class GraphState:
    """What the first CUDA-graph-mode plan of one caller fixed (the config and the capacities)."""

    config: str
    key: Any  # specs.Fa2Key
    cap_items: int  # work items (grid.x of the main kernel)
    cap_part: int  # partial rows (float workspace)
    cap_merge: int  # merge-table rows (grid.x of the merge kernel)
    batch_size: int
    nnz_q: int
    sm90_reasons: List[str] = field(default_factory=list)  # the first plan's (why not prefill90)
    own_int: Optional[torch.Tensor] = None  # the table buffer when the caller gave no int workspace
    own_float: Optional[torch.Tensor] = None  # the partials' buffer when the caller gave no float workspace
    anchor: Any = None  # weakref to the buffer keying this state (its root tensor)


@dataclass
class Fa2Plan:
    problem: AttentionProblem
    meta: BatchMeta
    lib: Any
    device: torch.device
    paged: bool
    page_size: int
    nnz_q: int
    config: str
    schedule: sched.Schedule
    num_items: int  # live work items
    work_grid: int  # grid.x of the main kernel: num_items, or the capacity in graph mode
    merge_rows: int  # live merge-table rows
    merge_grid: int  # grid.x of the merge kernel (0: no merge launch)
    work: torch.Tensor  # int32 [work capacity, 5] (device)
    merge_table: Optional[torch.Tensor]  # int32 [merge capacity, 4] (device)
    counts: torch.Tensor  # int32 [2] (device): live items, live merge rows (read in graph mode)
    part_o: Optional[torch.Tensor]  # float32 [part rows, Hq, D]
    part_lse: Optional[torch.Tensor]  # float32 [part rows, Hq]
    alibi_slopes: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    mask_indptr: Optional[torch.Tensor]
    graph: Optional[GraphState] = None
    sm90_reasons: Any = None  # why the Hopper kernel (prefill90) was not used, [] when it was
    base: Any = None  # binding.Fa2Params with the plan-constant fields
    merge_base: Any = None
    checked_sig: Any = None  # signature of the last run() tensors that passed the checks
    kv_strides: Any = None
    upload_event: Any = field(default=None, repr=False)

    @property
    def needs_merge(self) -> bool:
        return self.merge_grid > 0


# ------------------------------------------------------------------------------ graph-mode state
# Keyed by the caller's identity in graph mode: its int workspace (a wrapper's own buffer) or, when
# driven directly without one (tests, the conformance suite), its fixed qo_indptr buffer; plus the
# problem and device.  A state holds a weak reference to that buffer (``anchor``): once the caller's
# buffer is freed its state is dropped, so a later allocation at the same address starts afresh, and
# no state keeps a caller's memory alive.  Bounded: the oldest states go first.
_GRAPH_STATES: "OrderedDict[tuple, GraphState]" = OrderedDict()
_MAX_GRAPH_STATES = 64


def _graph_key(problem: AttentionProblem, meta: BatchMeta, dev: torch.device) -> tuple:
    ident = ("int", meta.int_workspace.data_ptr()) if meta.int_workspace is not None \
        else ("qo", meta.qo_indptr.data_ptr())
    return ident + (str(dev), problem)


def _capacities(lib, nnz_q: int, batch: int, group: int, hkv: int) -> Tuple[int, int, int]:
    """The tables' capacities for a caller whose batches have ``batch`` requests and ``nnz_q`` query rows.

    Items: unsplit, at most ``nnz_q * G // cta_q + batch`` row tiles (every batch of that size fits);
    split, ``P = slots // Hkv`` (what schedule.choose_chunk aims at).  Partial rows: ``P * cta_q // G``
    (a split request's items ``ns * tiles <= P`` cover ``qo <= tiles * cta_q / G`` rows), at most ``P``
    splits of every query row; merge rows: the split rows, each with >= 2 partials.  A split schedule
    over these is coarsened to fit (``fit_schedule``); an unsplit one always fits the items."""
    per_head = max(1, lib.num_sms * lib.ctas_per_sm // hkv)
    items = max(nnz_q * group // lib.cta_q + batch, per_head)
    part = min(nnz_q * per_head, per_head * lib.cta_q // group)
    return items, part, min(nnz_q, part // 2)


def fit_schedule(s: sched.Schedule, tiles, qo_lens, st: GraphState) -> sched.Schedule:
    """Graph mode: ``s`` with its split chunk doubled until its items and partial rows fit the capacities
    (schedule.build gives each tile of a request as many splits as its longest tile, so a ragged batch
    can exceed what choose_chunk counted).  Any chunk is exact; only the parallelism changes."""
    def merge_rows(sc):
        return sum(q for q, ns in zip(qo_lens, sc.num_splits) if ns > 1)

    while s.chunk and (s.num_items > st.cap_items or s.part_rows > st.cap_part or merge_rows(s) > st.cap_merge):
        longest = max(t.kv_hi - t.kv_lo for t in tiles)
        s = sched.build(tiles, qo_lens, chunk=s.chunk * 2 if s.chunk * 2 < longest else None)
    return s


def _anchor(meta: BatchMeta) -> torch.Tensor:
    """The caller's buffer that identifies it in graph mode: the root tensor of its int workspace or
    of its fixed ``qo_indptr`` buffer (a plan sees a new view of it each time)."""
    t = meta.int_workspace if meta.int_workspace is not None else meta.qo_indptr
    while t._base is not None:
        t = t._base
    return t


def find_graph_state(problem, meta, dev) -> Optional[GraphState]:
    """The caller's graph state, or None before its first graph-mode plan (or once its buffer died)."""
    k = _graph_key(problem, meta, dev)
    st = _GRAPH_STATES.get(k)
    if st is not None and st.anchor() is None:
        del _GRAPH_STATES[k]
        st = None
    if st is not None:
        _GRAPH_STATES.move_to_end(k)
    return st


def new_graph_state(problem, meta, dev, st: GraphState) -> GraphState:
    """Record ``st`` as the caller's graph state (dropping the states whose callers are gone)."""
    for k in [k for k, v in _GRAPH_STATES.items() if v.anchor() is None]:
        del _GRAPH_STATES[k]
    st.anchor = weakref.ref(_anchor(meta))
    _GRAPH_STATES[_graph_key(problem, meta, dev)] = st
    while len(_GRAPH_STATES) > _MAX_GRAPH_STATES:
        _GRAPH_STATES.popitem(last=False)
    return st


# ------------------------------------------------------------------------------------ tables
class _Staging:
    """Pinned host buffers per device, reused across plans: a small ring, each slot guarded by the event
    of its last upload.  A plan takes a slot whose copy has run (event.query(), no wait); only when every
    slot's copy is still queued does the host wait, for the next slot in ring order."""

    SLOTS = 4

    def __init__(self) -> None:
        self.bufs: List[Optional[torch.Tensor]] = [None] * self.SLOTS
        self.events: list = [None] * self.SLOTS
        self.next = 0

    def get(self, nbytes: int, dev: torch.device) -> Tuple[int, torch.Tensor]:
        i = next((j for j in range(self.SLOTS) if self.events[j] is None or self.events[j].query()), None)
        if i is None:
            i = self.next
            self.events[i].synchronize()
        self.next = (i + 1) % self.SLOTS
        self.events[i] = None
        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            n = max(nbytes, 4096, 2 * (buf.numel() if buf is not None else 0))
            buf = torch.empty(n, dtype=torch.uint8)
            self.bufs[i] = buf = buf.pin_memory() if dev.type == "cuda" else buf
        return i, buf

    def uploaded(self, i: int, dev: torch.device) -> Any:
        if dev.type != "cuda":
            return None
        ev = self.events[i] = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        return ev


_STAGING: dict = {}


def upload(layout: WorkspaceLayout, dev_views: dict, fill, dev: torch.device) -> Any:
    """Write the int tables on the host (``fill(host_views)``) and copy the whole span of ``layout`` to
    ``dev_views`` in one non-blocking copy.  Returns the event of the copy (None off CUDA)."""
    st = _STAGING.setdefault(str(dev), _Staging())
    slot, hbuf = st.get(layout.nbytes + ALIGN, dev)
    host = layout.carve(hbuf, "staging")
    fill(host)
    first, last = layout.regions[0][0], layout.regions[-1][0]

    def span(views):
        lo = views[first].data_ptr()
        hi = views[last].data_ptr() + views[last].numel() * views[last].element_size()
        return lo, hi

    hlo, hhi = span(host)
    hoff = hlo - hbuf.data_ptr()
    src = hbuf[hoff: hoff + (hhi - hlo)]
    dbase = dev_views[first].view(-1).view(torch.uint8)
    dst = torch.as_strided(dbase, (hhi - hlo,), (1,))  # the same span, from the first region on
    dst.copy_(src, non_blocking=True)
    return st.uploaded(slot, dev)


def build_schedule(lib, problem: AttentionProblem, meta: BatchMeta, key, min_split_chunk: int):
    """(the work items of this batch on ``lib``'s tile, its row tiles): attncore.core.schedule, the
    schedule the Triton backend uses too."""
    qo_lens = meta.qo_lens_host
    tiles = sched.row_tiles(qo_lens, meta.kv_lens_host, problem.group_size, lib.cta_q,
                            causal=key.mask == "causal", window_left=meta.params.window_left)
    chunk = sched.choose_chunk([t.kv_hi - t.kv_lo for t in tiles], problem.num_kv_heads,
                               slots=lib.num_sms * lib.ctas_per_sm, kv_tile=lib.kv_tile, min_chunk=min_split_chunk)
    return sched.build(tiles, qo_lens, chunk=chunk), tiles


def make_plan(backend, problem: AttentionProblem, meta: BatchMeta, dev: torch.device, choose_lib) -> Fa2Plan:
    """The plan of one batch.  ``choose_lib()`` -> (library, config, sm90 reasons): the kernel chosen
    for this batch (backend.py); in graph mode only the first plan of a caller calls it."""
    B, G, Hkv, Hq, D = (meta.batch_size, problem.group_size, problem.num_kv_heads, problem.num_qo_heads,
                        problem.head_dim_vo)
    qo = meta.qo_indptr_host
    nnz_q = qo[B] if B else 0
    graph = None
    if problem.cuda_graph:
        from attncore.backends.cuda_fa2 import binding

        graph = find_graph_state(problem, meta, dev)
        if graph is None:
            lib, config, why = choose_lib()
            graph = new_graph_state(problem, meta, dev, GraphState(config, lib.key, *_capacities(lib, nnz_q, B, G, Hkv),
                                                                   batch_size=B, nnz_q=nnz_q, sm90_reasons=why))
        lib, config, why = binding.get_library(graph.key, dev), graph.config, graph.sm90_reasons
    else:
        lib, config, why = choose_lib()
    s, tiles = build_schedule(lib, problem, meta, lib.key, backend.min_split_chunk)
    if graph is not None:
        s = fit_schedule(s, tiles, meta.qo_lens_host, graph)
    merge = s.merge_table(qo)
    n_items, n_part, n_merge = s.num_items, s.part_rows, len(merge)
    if graph is not None:
        sched.check_capacity("cuda_fa2", "work items", n_items, graph.cap_items, graph.batch_size, graph.nnz_q)
        sched.check_capacity("cuda_fa2", "split partial rows", n_part, graph.cap_part, graph.batch_size, graph.nnz_q)
        sched.check_capacity("cuda_fa2", "merge rows", n_merge, graph.cap_merge, graph.batch_size, graph.nnz_q)
        cap_items, cap_part, cap_merge = graph.cap_items, graph.cap_part, graph.cap_merge
    else:
        cap_items, cap_part, cap_merge = max(n_items, 1), n_part, n_merge

    # float workspace: the split partials (run-scoped)
    parts = {}
    if cap_part:
        flay = WorkspaceLayout("cuda_fa2")
        flay.add("part_o", (cap_part, Hq, D), torch.float32)
        flay.add("part_lse", (cap_part, Hq), torch.float32)
        fbuf = meta.workspace
        if fbuf is None and graph is not None:  # a captured graph keeps writing here: one buffer per caller
            if graph.own_float is None:
                graph.own_float = torch.empty(flay.nbytes + ALIGN, dtype=torch.uint8, device=dev)
            fbuf = graph.own_float
        parts = flay.carve(fbuf, "float_workspace_buffer", device=dev)
    # int workspace: the tables (plan-scoped), one upload
    ilay = WorkspaceLayout("cuda_fa2")
    ilay.add("counts", (2,), torch.int32)
    ilay.add("work", (cap_items, WORK_COLS), torch.int32)
    if cap_merge:
        ilay.add("merge", (cap_merge, MERGE_COLS), torch.int32)
    if lib.key.alibi:
        ilay.add("alibi", (Hq,), torch.float32)
    ibuf = meta.int_workspace
    if ibuf is None and graph is not None:
        if graph.own_int is None or graph.own_int.numel() < ilay.nbytes + ALIGN:
            graph.own_int = torch.empty(ilay.nbytes + ALIGN, dtype=torch.uint8, device=dev)
        ibuf = graph.own_int
    tabs = ilay.carve(ibuf, "int_workspace_buffer", device=dev)

    def fill(h):
        h["counts"].copy_(torch.tensor([n_items, n_merge], dtype=torch.int32))
        if n_items:
            h["work"][:n_items].copy_(torch.tensor(s.items, dtype=torch.int32))
        else:
            h["work"][:1].copy_(torch.tensor([[0, 0, 0, 0, -1]], dtype=torch.int32))
        if n_merge:
            h["merge"][:n_merge].copy_(torch.tensor(merge, dtype=torch.int32))
        if "alibi" in h:
            h["alibi"].copy_(alibi_slopes(Hq))

    event = upload(ilay, tabs, fill, dev)
    custom = lib.key.mask == "custom"
    paged = meta.kv_indices is not None
    return Fa2Plan(
        problem=problem, meta=meta, lib=lib, device=dev, paged=paged, page_size=meta.page_size if paged else 0,
        nnz_q=nnz_q, config=config, schedule=s, num_items=n_items,
        work_grid=cap_items if graph is not None else n_items,
        merge_rows=n_merge, merge_grid=cap_merge if graph is not None else n_merge,
        work=tabs["work"], merge_table=tabs.get("merge"), counts=tabs["counts"],
        part_o=parts.get("part_o"), part_lse=parts.get("part_lse"), alibi_slopes=tabs.get("alibi"),
        mask=meta.packed_mask if custom else None, mask_indptr=meta.mask_indptr if custom else None,
        graph=graph, sm90_reasons=why, upload_event=event)
