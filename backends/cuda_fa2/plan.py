"""cuda_fa2's plan: the kernel config, the split-KV schedule (attncore.core.schedule) and the scratch.

Scratch comes from the caller's workspaces (attncore.core.workspace): the split partials ``part_o`` /
``part_lse`` from the float workspace (run-scoped), the tables (work items, the merge table, the two
live counts, ALiBi slopes) from the int workspace (plan-scoped, the wrapper's own).  The tables are
written into a host image and uploaded with one non-blocking copy (attncore.core.uploads): no device sync
and, with the caller's workspaces, no device allocation in ``plan()``.

CUDA-graph mode (``problem.cuda_graph``): a captured launch keeps its grid and its params struct by
value, so both must stay the same across re-plans.  The first graph-mode plan of a caller fixes the
kernel config and the tables' capacities (upper bounds for any batch with the same batch size and
query rows: see ``_capacities``); every region then sits at the same address, the grids are the
capacities and the kernels read the live counts from ``counts`` (CTAs past them exit).  A re-plan
that needs more is an error naming the capacity.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

from attncore.core import graphs
from attncore.core import schedule as sched
from attncore.core import uploads
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
    anchor: Any = None  # weakref to the buffer keying this state (attncore.core.graphs)


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
    sched: torch.Tensor  # int32 [2] (device): the persistent grid's counters (Fa2Params.sched), zero between launches
    part_o: Optional[torch.Tensor]  # float32 [part rows, Hq, D]
    part_lse: Optional[torch.Tensor]  # float32 [part rows, Hq]
    alibi_slopes: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    mask_indptr: Optional[torch.Tensor]
    graph: Optional[GraphState] = None
    sm90_reasons: Any = None  # why the Hopper kernel (prefill90) was not used, [] when it was
    head_group: int = 0  # Fa2Params.head_group: launch_group
    one_req: int = 0  # Fa2Params.one_req (build_schedule): one request's items, 1 in tile order, -1 reversed
    base: Any = None  # binding.Fa2Params with the plan-constant fields
    merge_base: Any = None
    checked_sig: Any = None  # signature of the last run() tensors that passed the checks
    kv_strides: Any = None
    # run()'s launch structs by (tensor signature, scales): a repeated run() sets only the pointers (host time)
    structs: dict = field(default_factory=dict)

    @property
    def needs_merge(self) -> bool:
        return self.merge_grid > 0


# ------------------------------------------------------------------------------ graph-mode state
# Keyed by the caller's identity in graph mode (attncore.core.graphs): its int workspace, or its fixed
# qo_indptr buffer when driven directly without one.
_GRAPH_STATES = graphs.GraphStates()


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


def build_schedule(lib, problem: AttentionProblem, meta: BatchMeta, key, min_split_chunk: int):
    """(the work items of this batch on ``lib``'s tile, its row tiles, Fa2Params.one_req): attncore.core.schedule,
    the schedule the Triton backend uses too.  The caller's split-KV hints first (``disable_split_kv``; a
    ``fixed_split_size`` in pages, tokens for ragged KV, rounded up to whole K/V tiles), else the chunk that
    fills the GPU.  One request, unsplit, without a window, not in CUDA-graph mode (a captured launch keeps the params
    struct, where the request's offsets and lengths would go stale): its row tiles in order, reversed when causal,
    the longest-first order schedule.build's sort gives (row tile k sees every key, or when causal a range that grows
    with k), fixed so that the kernels derive each CTA's item from its index (one_req 1 / -1)."""
    qo_lens = meta.qo_lens_host
    tiles = sched.row_tiles(qo_lens, meta.kv_lens_host, problem.group_size, lib.cta_q,
                            causal=key.mask == "causal", window_left=meta.params.window_left)
    chunk = sched.caller_chunk(meta, problem.page_size)
    if chunk is None:
        chunk = sched.choose_chunk([t.kv_hi - t.kv_lo for t in tiles], problem.num_kv_heads,
                                   slots=lib.num_sms * lib.ctas_per_sm, kv_tile=lib.kv_tile,
                                   min_chunk=min_split_chunk)
    chunk = -(-chunk // lib.kv_tile) * lib.kv_tile if chunk else None
    wl = meta.params.window_left
    if (len(qo_lens) == 1 and not problem.cuda_graph and meta.kv_indptr_host is not None and (wl is None or wl < 0)
            and (chunk is None or max((t.kv_hi - t.kv_lo for t in tiles), default=0) <= chunk)):
        s = sched.build(tiles, qo_lens, chunk=None, sort=False)
        if key.mask != "causal":
            return s, tiles, 1
        return dataclasses.replace(s, items=s.items[::-1], costs=s.costs[::-1]), tiles, -1
    return sched.build(tiles, qo_lens, chunk=chunk), tiles, 0


# launch_group's model: a unit costs its K/V tiles and this many more (a CTA's start and end: BENCHMARKS.md 2w,
# ~2.7 tiles at d128; the model then gives the measured causal / non-causal ratios of P1 and P2 d256)
UNIT_OVERHEAD_TILES = 2.5
# a group must shorten the model's time by this much: item-major order spreads the CTAs at work over more heads'
# K/V (H200, BENCHMARKS.md 2ag: where the model saw no gain, groups ran up to 9% slower: P1 causal, ragged 8 x 2k)
GROUP_GAIN = 1.05
MAX_WAVES = 8  # past this many units per slot the last round is a small part of the launch
# prefill90's pipelined loop at d128 runs on the persistent grid (specs: _persist; CudaFa2Backend.choose_library) past
# this many units per slot, where a unit's start and end weigh most and launch_group keeps head-major order anyway.
# H200, BENCHMARKS.md 2ah, same runs, persistent / one unit per CTA: ragged 8 x 2k causal (31 units per slot) 0.556 /
# 0.592 ms and 0.559 / 0.591, 16k x 1k (31) 0.540 / 0.548, 8k causal (15.5) and ragged 16 x 512 on 4k (15.5) level;
# below it P1 causal (7.8) 1% faster, P1 non-causal level, and where the one-unit grid's kv-head groups pay slower:
# MHA 2k (3.9) 0.085 / 0.076, MHA 4k (7.8) 0.270 / 0.261, 1 x 1k (1.9) 0.035 / 0.029
PERSIST_UNITS = MAX_WAVES


def launch_group(costs: Sequence[int], kv_tile: int, hkv: int, slots: int) -> int:
    """Fa2Params.head_group of a one-unit prefill grid: 0 (head-major), or the kv-head group whose item-major
    launch order a greedy model finishes ``GROUP_GAIN`` x sooner (the smallest within 1% of the best group).

    ``costs``: the items' KV extents, longest first (Schedule.costs).  The hardware starts CTAs in launch order as
    slots free up, so head-major order starts the last heads' longest items last: P2 d256 causal (16 heads of 32
    items on 132 SMs) finishes its busiest SM at 1.26x the mean head-major, at 1.00x in groups of 4.  The cases
    with nothing to model return before the costs are copied and hashed (POD's SM split asks on every run)."""
    n = len(costs)
    if hkv < 2 or n < 2 or costs[0] == costs[-1] or n * hkv > MAX_WAVES * slots:
        return 0
    return _modelled_group(tuple(costs), kv_tile, hkv, slots)


@functools.lru_cache(maxsize=256)
def _modelled_group(costs: Tuple[int, ...], kv_tile: int, hkv: int, slots: int) -> int:
    """launch_group where the model runs: cached by the items' extents (host time)."""
    runs = [(-(-c // kv_tile) + UNIT_OVERHEAD_TILES, len(list(r))) for c, r in itertools.groupby(costs)]

    def makespan(g: int) -> float:
        # each unit goes to a slot that frees first; slots that free at the same time take a run of equal units
        # together (host time): a min-heap of the distinct finish times, and how many slots finish at each
        count, heap = {0.0: slots}, [0.0]
        for t, k in runs * (hkv // g):
            k *= g
            while k:
                f = heap[0]
                c = count[f]
                take = min(c, k)
                k -= take
                e = f + t
                if take == c:
                    del count[f]
                    if e in count:
                        heapq.heappop(heap)
                    else:
                        heapq.heapreplace(heap, e)
                else:
                    count[f] = c - take
                    if e not in count:
                        heapq.heappush(heap, e)
                count[e] = count.get(e, 0) + take
        return max(count)

    bound = max(sum(t * k for t, k in runs) * hkv / slots, runs[0][0])  # no order finishes sooner
    head_major = makespan(1)
    if head_major < bound * GROUP_GAIN:
        return 0
    times = {}
    for g in (g for g in range(2, hkv + 1) if hkv % g == 0):
        times[g] = makespan(g)
        if times[g] <= bound * 1.01:  # (host time: no group would be more than 1% better)
            break
    best = min(times.values())
    if best * GROUP_GAIN > head_major:
        return 0
    return min(g for g, t in times.items() if t <= best * 1.01)


@functools.lru_cache(maxsize=256)
def _layouts(cap_part: int, heads: int, head_dim: int, cap_items: int, cap_merge: int, alibi: bool
             ) -> Tuple[WorkspaceLayout, WorkspaceLayout]:
    """(the float workspace's layout: the split partials; the int workspace's: the tables) of a plan, by their
    sizes; made once per sizes (host time) and never changed after."""
    flay = WorkspaceLayout("cuda_fa2")
    if cap_part:
        flay.add("part_o", (cap_part, heads, head_dim), torch.float32)
        flay.add("part_lse", (cap_part, heads), torch.float32)
    ilay = WorkspaceLayout("cuda_fa2")
    ilay.add("counts", (2,), torch.int32)
    ilay.add("work", (cap_items, WORK_COLS), torch.int32)
    if cap_merge:
        ilay.add("merge", (cap_merge, MERGE_COLS), torch.int32)
    if alibi:
        ilay.add("alibi", (heads,), torch.float32)
    ilay.add("sched", (2,), torch.int32)
    return flay, ilay


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

        graph = _GRAPH_STATES.find(problem, meta)
        if graph is None:
            lib, config, why = choose_lib()
            graph = _GRAPH_STATES.add(problem, meta, GraphState(config, lib.key, *_capacities(lib, nnz_q, B, G, Hkv),
                                                                batch_size=B, nnz_q=nnz_q, sm90_reasons=why))
        lib, config, why = binding.get_library(graph.key, dev), graph.config, graph.sm90_reasons
    else:
        lib, config, why = choose_lib()
    s, tiles, one_req = build_schedule(lib, problem, meta, lib.key, backend.min_split_chunk)
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
    flay, ilay = _layouts(cap_part, Hq, D, cap_items, cap_merge, bool(lib.key.alibi))
    if cap_part:
        fbuf = meta.workspace
        if fbuf is None and graph is not None:  # a captured graph keeps writing here: one buffer per caller
            if graph.own_float is None:
                graph.own_float = torch.empty(flay.nbytes + ALIGN, dtype=torch.uint8, device=dev)
            fbuf = graph.own_float
        parts = flay.carve(fbuf, "float_workspace_buffer", device=dev, memo=meta.memo)
    # int workspace: the tables (plan-scoped), one upload
    ibuf = meta.int_workspace
    if ibuf is None and graph is not None:
        if graph.own_int is None or graph.own_int.numel() < ilay.nbytes + ALIGN:
            graph.own_int = torch.empty(ilay.nbytes + ALIGN, dtype=torch.uint8, device=dev)
        ibuf = graph.own_int
    # the batch's index tables still on the host (never in graph mode): the tables go right before them
    staged = meta.staged if graph is None and ibuf is not None else None
    # the tables on the host (numpy views of one image: one conversion per table), then one copy
    tabs, image, h, span = uploads.carve_tables(ilay, ibuf, staged, dev, meta.memo)
    h["counts"][:] = (n_items, n_merge)  # (and "sched" stays zero: the image is sent zeroed, then filled)
    s.write_work(h["work"])
    if n_merge:
        h["merge"][:n_merge] = merge
    if "alibi" in h:
        h["alibi"][:] = alibi_slopes(Hq).float().numpy()
    uploads.send_image(image, span)
    custom = lib.key.mask == "custom"
    paged = meta.kv_indices is not None
    # a one-unit prefill grid (not the decode tile: many short items, bandwidth-bound)
    one_unit = lib.key.config in ("prefill", "prefill64") or lib.key.config == "prefill90" and not lib.persistent
    one_unit = one_unit and graph is None
    slots = lib.num_sms * lib.ctas_per_sm
    group = launch_group(s.costs, lib.kv_tile, Hkv, slots) if one_unit else 0
    return Fa2Plan(
        problem=problem, meta=meta, lib=lib, device=dev, paged=paged, page_size=meta.page_size if paged else 0,
        nnz_q=nnz_q, config=config, schedule=s, num_items=n_items,
        work_grid=cap_items if graph is not None else n_items,
        merge_rows=n_merge, merge_grid=cap_merge if graph is not None else n_merge,
        work=tabs["work"], merge_table=tabs.get("merge"), counts=tabs["counts"], sched=tabs["sched"],
        part_o=parts.get("part_o"), part_lse=parts.get("part_lse"), alibi_slopes=tabs.get("alibi"),
        mask=meta.packed_mask if custom else None, mask_indptr=meta.mask_indptr if custom else None,
        graph=graph, sm90_reasons=why, head_group=group, one_req=one_req)
