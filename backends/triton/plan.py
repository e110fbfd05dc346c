"""The Triton backend's plan: the launch config, the split-KV schedule (attncore.core.schedule, shared
with cuda_fa2), the dense / gather decisions and the scratch.

Scratch comes from the caller's workspaces (attncore.core.workspace): the split partials ``part_o`` /
``part_lse`` and the gathered K/V from the float workspace (run-scoped), the tables (work items, the
merge table, the live counts, ALiBi slopes, the dense kernel's work lists, xqa's page offsets) from
the int workspace (plan-scoped, the wrapper's own).  The tables are written into a host image and
uploaded with one non-blocking copy (attncore.core.uploads): no device sync and, with the caller's
workspaces, no device allocation in ``plan()``.  Without a workspace (the backend driven directly)
``carve`` allocates.  The paged-KV gather is an optimisation: where its buffers do not fit the float
workspace the generic kernel reads the pages (``stats["gather_skipped"]`` says why).

CUDA-graph mode (``problem.cuda_graph``): a captured launch keeps its grid, its scalars and its
pointers, so all must stay the same across re-plans.  The first graph-mode plan of a caller (its int
workspace, else its fixed ``qo_indptr`` buffer) fixes the launch config and the capacities of the
tables and partials (see ``_capacities``); every region then sits at the same address, the kernels
run on a persistent grid and read the live counts from ``counts``.  A re-plan whose row tiles exceed
the capacity is an error naming it; split-KV shrinks (a larger chunk) to fit the capacities.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from attncore.core import graphs
from attncore.core import schedule as sched
from attncore.core import uploads
from attncore.core.backend import BatchMeta
from attncore.core.mask import alibi_slopes
from attncore.core.problem import AttentionProblem
from attncore.core.workspace import ALIGN, WorkspaceLayout
from attncore.kernels import interpreting

LOG2E = 1.4426950408889634
MASK_NONE, MASK_CAUSAL, MASK_CUSTOM, MASK_SPEC = 0, 1, 2, 3
WORK_COLS = 5  # request, first packed row, kv_lo, kv_hi, partial row (-1: writes out / lse)
MERGE_COLS = 4  # out row, first partial row, partial row stride, splits
COUNT_FIELDS = 4  # live items, live merge rows, heads-first flag, spare
GATHER_FLOP_PER_BYTE = 1500  # auto gathers paged prefill above this (break-even ~1000 on an H100)
PROGRAMS_PER_SM = 4  # graph mode: persistent programs per SM
DENSE_SCRATCH_PER_PROGRAM = 4096  # bytes per program for the TMA descriptors the dense kernel builds (4 x 128) with room


_DEVICE_INFO: Dict[torch.device, Tuple[int, Optional[Tuple[int, int]]]] = {}


def device_info(device: torch.device) -> Tuple[int, Optional[Tuple[int, int]]]:
    """(SM count, compute capability) of ``device``, asked once (host time): 4 SMs and no capability on
    the CPU interpreter, which has none (small enough to exercise splits)."""
    info = _DEVICE_INFO.get(device)
    if info is None:
        if device.type == "cuda":
            info = (torch.cuda.get_device_properties(device).multi_processor_count,
                    tuple(torch.cuda.get_device_capability(device)))
        else:
            info = (4, None)
        _DEVICE_INFO[device] = info
    return info


@dataclass
class GraphState:
    """What the first CUDA-graph-mode plan of one caller fixed: the config, capacities, the grid."""

    cfg: Any
    cap_items: int  # work-table rows
    cap_part: int  # split partial rows (float workspace)
    cap_merge: int  # merge-table rows
    grid: int  # programs of the main kernel (persistent)
    merge_grid: int  # programs per head of the merge kernel (persistent)
    batch_size: int
    nnz_q: int
    own_int: Optional[torch.Tensor] = None  # the tables when the caller gave no int workspace
    own_float: Optional[torch.Tensor] = None  # the partials when the caller gave no float workspace
    anchor: Any = None  # weak reference to the caller's buffer (attncore.core.graphs)


@dataclass
class TritonPlan:
    problem: AttentionProblem
    meta: BatchMeta
    device: torch.device
    nnz_q: int
    mask_mode: int
    cfg: Any
    schedule: Optional[sched.Schedule]
    num_items: int  # live work items
    work: Optional[torch.Tensor]  # int32 [work capacity, 5] (device)
    counts: Optional[torch.Tensor]  # int32 [4] (device): live items, merge rows, heads-first flag
    qo_indptr: Optional[torch.Tensor]
    kv_indptr: Optional[torch.Tensor]
    kv_indices: Optional[torch.Tensor]
    kv_lens: Optional[torch.Tensor]
    slopes: Optional[torch.Tensor]  # fp32 [Hq] ALiBi slopes times log2(e)
    merge_table: Optional[torch.Tensor] = None  # int32 [merge capacity, 4] (device)
    num_merge_rows: int = 0
    max_splits: int = 1
    part_o: Optional[torch.Tensor] = None  # fp32 [part rows, Hq, Dv]
    part_lse: Optional[torch.Tensor] = None  # fp32 [part rows, Hq]
    graph: Optional[GraphState] = None  # CUDA-graph mode: persistent grids of graph.grid programs
    stats: dict = field(default_factory=dict)
    launch_cache: dict = field(default_factory=dict)  # run() key -> prepared launchers
    dense: list = field(default_factory=list)  # Hopper dense-prefill configs to try, in order
    dense_work: dict = field(default_factory=dict)  # block_m -> (work [n, 2] int32, n, heads_first)
    heads_first: bool = False  # program ids run over the heads first (_heads_first)
    gather: Optional[dict] = None  # paged prefill via the dense kernel: buffers and indices
    dense_scratch: Optional[torch.Tensor] = None  # uint8: the dense kernel's TMA descriptors
    upload: Optional["Upload"] = None  # the tables' bytes, re-sent by run() if another plan overwrote them


def _heads_first(costs: list, num_heads: int, num_sms_: int) -> bool:
    """Launch order of the programs (see kernels): heads first when the spread of item costs is
    over a tenth of one SM's share of the work.  Items first launches each head's list heaviest
    first in turn, so the last head's heaviest items start near the end and leave a tail (P1
    causal on an H100: 424 -> 448 TFLOP/s heads first); where each SM's share dwarfs the spread,
    items first wins by keeping one head's K/V in L2 (P3 paged: 336 items first, 307 heads first)."""
    if not costs:
        return False
    return (max(costs) - min(costs)) * num_sms_ * 10 > sum(costs) * num_heads


# ------------------------------------------------------------------------------ graph-mode state
# Keyed by the caller in graph mode (attncore.core.graphs): its int workspace or its fixed qo_indptr buffer.
_GRAPH_STATES = graphs.GraphStates()


def _capacities(nnz_q: int, batch: int, group: int, hkv: int, block_m: int, sms: int) -> Tuple[int, int, int]:
    """Capacities for any batch of ``batch`` requests and ``nnz_q`` query rows: items, the unsplit row
    tiles (at most ``nnz_q * G / BM + batch``) or the split-KV target (``2 * SMs / Hkv``), whichever is
    larger; partial rows, ``sum(ns_i * qo_i)`` with ``qo_i <= tiles_i * BM / G`` and ``sum(ns_i * tiles_i)``
    within the split target; merge rows, the split requests' rows (each >= 2 partial rows).  The
    schedule is held to them (a larger chunk) in make_plan."""
    per_head = max(1, 2 * sms // max(hkv, 1))
    items = max(-(-nnz_q * group // block_m) + batch, per_head, 1)
    part = per_head * min(-(-block_m // group), max(nnz_q, 1))
    return items, part, max(1, min(nnz_q, part // 2))


# ------------------------------------------------------------------------------ table upload
# which upload last wrote each table span (device, pointer of the int workspace): a plan whose tables another
# plan overwrote (two plans of one wrapper, a plan cache) re-sends its bytes at run().  One _Span per key, shared
# by the uploads into it (weakly held here): run() compares the span's last sender with its own token, a list
# read instead of a dictionary lookup by (device, pointer) per run (host time).
class _Span:
    __slots__ = ("sender", "__weakref__")

    def __init__(self) -> None:
        self.sender = 0  # the token of the upload that wrote the span last


_SPANS: "weakref.WeakValueDictionary[Tuple[torch.device, int], _Span]" = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


class Upload:
    """The host image of a plan's tables (attncore.core.uploads) and where it goes (one
    contiguous span of the int workspace: the tables, then the batch's index tables when they were staged), so
    a re-send restores both."""

    def __init__(self, image, dst: torch.Tensor, key: Optional[tuple]) -> None:
        self.dst = dst  # uint8 view of the device span
        self.key = key  # (device, address of the int workspace) when other plans may write there
        self.token = next(_TOKENS)
        self.span: Optional[_Span] = None
        if key is not None:
            span = _SPANS.get(key)
            if span is None:
                span = _SPANS[key] = _Span()
            self.span = span
        self.host = uploads.send_image(image, dst)  # uint8: the plan's own copy, sent again by ensure()
        if self.span is not None:
            self.span.sender = self.token

    def send(self) -> None:
        self.dst.copy_(self.host, non_blocking=True)  # no device sync (uploads._source); never captured: ensure()
        if self.span is not None:
            self.span.sender = self.token

    def ensure(self) -> None:
        """Re-send the tables if another plan wrote over them since."""
        span = self.span
        if span is not None and span.sender != self.token:
            if self.dst.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "triton: this plan's tables were overwritten by a later plan() into the same int workspace, "
                    "and a CUDA graph cannot capture sending them again: plan this batch again before capturing")
            self.send()


# ------------------------------------------------------------------------------ the plan
def make_plan(be, problem: AttentionProblem, meta: BatchMeta) -> TritonPlan:
    """The plan of one batch on backend ``be`` (TritonBackend: its forced config, chunk, dense and gather
    settings)."""
    device = meta.device
    B, G, Hkv, Hq = meta.batch_size, problem.group_size, problem.num_kv_heads, problem.num_qo_heads
    interp = interpreting()
    qo_host = meta.qo_indptr_host
    qo_lens = meta.qo_lens_host
    nnz_q = qo_host[-1]
    paged = problem.page_size is not None
    graph_mode = bool(problem.cuda_graph) and problem.op != "xqa_decode"

    # ---- KV addressing: kv_indptr (token or page offsets), kv_indices, kv_lens (all from the batch)
    kv_lens, kv_host = meta.kv_lens, meta.kv_lens_host
    xqa_width = None
    if problem.op == "xqa_decode":
        bt = meta.block_tables
        if bt.dtype != torch.int32 or bt.stride(-1) != 1:
            bt = bt.to(torch.int32).contiguous()
        kv_indices = bt.reshape(-1) if bt.is_contiguous() else bt.contiguous().reshape(-1)
        kv_indptr = None  # [B + 1] page offsets i * width: an int-workspace table
        xqa_width = bt.shape[1]
        if kv_host is None:
            # seq_lens not read on the host (planned inside CUDA-graph capture, where the xqa API reads
            # nothing back): plan for max_seq_len, no device sync; the kernel clamps each request's
            # range to its seq_len and a split past it merges as empty
            kv_host = [meta.max_seq_len] * B
    else:
        kv_indptr = meta.kv_indptr
        kv_indices = meta.kv_indices if paged else None

    # ---- mask mode (the batch's mask is resolved: decode with no mask is causal)
    if problem.spec_mask:
        mask_mode = MASK_SPEC
    elif meta.mask == "custom":
        mask_mode = MASK_CUSTOM
    elif meta.mask == "causal":
        mask_mode = MASK_CAUSAL
    else:
        mask_mode = MASK_NONE
    causal = mask_mode == MASK_CAUSAL

    # ---- launch config (graph mode: the first plan's)
    sms, cc = device_info(device)
    rows_max = max(max(qo_lens, default=0) * G, 1)
    graph = None
    if graph_mode:
        graph = _GRAPH_STATES.find(problem, meta)
        if graph is None:
            cfg = _pick_config(be, problem, rows_max, device, interp, cc)
            caps = _capacities(nnz_q, B, G, Hkv, cfg.block_m, sms)
            if meta.workspace is not None:  # split-KV partials only as far as the float workspace holds them
                row = Hq * problem.head_dim_vo * 4 + Hq * 4
                fit = max(0, (meta.workspace.numel() - 3 * ALIGN) // row)
                caps = (caps[0], min(caps[1], fit if fit >= 2 else 0), caps[2])
            grid = max(1, min(caps[0] * Hkv, PROGRAMS_PER_SM * sms))
            graph = _GRAPH_STATES.add(problem, meta, GraphState(
                cfg, *caps, grid=grid, merge_grid=max(1, min(caps[2], PROGRAMS_PER_SM * sms)), batch_size=B,
                nnz_q=nnz_q))
        cfg = graph.cfg
    else:
        cfg = _pick_config(be, problem, rows_max, device, interp, cc)
    BM, BN = cfg.block_m, cfg.block_n

    # ---- the schedule: row tiles (causal bound; the window is applied in the kernel), split-KV
    tiles = sched.row_tiles(qo_lens, kv_host, G, BM, causal=causal)
    extents = [t.kv_hi - t.kv_lo for t in tiles]
    if be._kv_chunk is not None:
        chunk = be._kv_chunk or None
    else:
        chunk = sched.caller_chunk(meta, problem.page_size)  # the user's hint
        if chunk is None and len(tiles) * Hkv < sms:  # ~2 programs per SM where the unsplit items leave SMs idle
            chunk = sched.choose_chunk(extents, Hkv, slots=2 * sms, kv_tile=BN, min_chunk=4 * BN)
    chunk = -(-chunk // BN) * BN if chunk else None
    s = sched.build(tiles, qo_lens, chunk=chunk)
    if graph is not None:
        sched.check_capacity("triton", "work items (row tiles)", len(tiles), graph.cap_items, graph.batch_size,
                             graph.nnz_q)
        while s.chunk and (s.num_items > graph.cap_items or s.part_rows > graph.cap_part
                           or sum(qo_lens[i] for i in range(B) if s.num_splits[i] > 1) > graph.cap_merge):
            bigger = s.chunk * 2  # fewer splits until the schedule fits the captured capacities
            s = sched.build(tiles, qo_lens, chunk=bigger if any(e > bigger for e in extents) else None)
    merge = s.merge_table(qo_host)
    n_items, n_merge = s.num_items, len(merge)
    heads_first = _heads_first(s.costs, Hkv, sms)
    split = n_merge > 0

    plan = TritonPlan(problem=problem, meta=meta, device=device, nnz_q=nnz_q, mask_mode=mask_mode, cfg=cfg,
                      schedule=s, num_items=n_items, work=None, counts=None, qo_indptr=meta.qo_indptr,
                      kv_indptr=kv_indptr, kv_indices=kv_indices, kv_lens=kv_lens, slopes=None,
                      num_merge_rows=n_merge, max_splits=s.max_splits, graph=graph, heads_first=heads_first)
    plan.stats = dict(items=n_items, tiles=len(tiles) * Hkv, chunk=s.chunk or 0, max_splits=s.max_splits,
                      part_rows=s.part_rows, config=cfg.as_dict(), heads_first=heads_first)

    # ---- dense kernel (Hopper prefill) and the paged gather: not in graph mode (exact grids)
    forced = isinstance(be._dense, dict)  # a forced config also runs where auto would not
    gather_bytes = 0
    dense_lists: Dict[int, tuple] = {}
    if (graph is None and be._dense and be._config is None and not split
            and (forced or (not interp and cc is not None and cc[0] == 9 and rows_max > 64))
            and be._dense_serves(problem)):
        gather_bytes = _gather_bytes(be, plan, qo_lens, kv_host, causal) if paged else 0
        if not paged or gather_bytes:
            dense_lists = _dense_lists(be, plan, qo_lens, kv_host, causal, sms)
    elif graph is not None:
        plan.stats["dense"] = "off: CUDA-graph mode runs the generic kernel on a persistent grid"

    # ---- float workspace (run-scoped): split partials, gathered K/V
    if graph is not None:
        cap_part, cap_items, cap_merge = graph.cap_part, graph.cap_items, graph.cap_merge
    else:
        cap_part, cap_items, cap_merge = s.part_rows, max(n_items, 1), n_merge
    flay = WorkspaceLayout("triton")
    if cap_part:
        flay.add("part_o", (cap_part, Hq, problem.head_dim_vo), torch.float32)
        flay.add("part_lse", (cap_part, Hq), torch.float32)
    opt = []  # optional regions (optimisations), taken only where they fit the float workspace
    if dense_lists:  # the dense kernel's on-device TMA descriptors (Triton's global scratch)
        progs = max(len(v[0]) for v in dense_lists.values()) * Hq
        opt.append(("dense_scratch", (progs * DENSE_SCRATCH_PER_PROGRAM,), torch.uint8))
    if gather_bytes:
        shape = (meta.kv_indptr_host[-1], problem.page_size, Hkv, problem.head_dim_qk)
        opt += [("gather_k", shape, problem.kv_dtype), ("gather_v", shape, problem.kv_dtype)]
    if opt:
        olay = WorkspaceLayout("triton")
        olay.regions, olay.nbytes = list(flay.regions), flay.nbytes
        for r in opt:
            olay.add(*r)
        ws = meta.workspace
        if ws is None or olay.nbytes + ALIGN <= ws.numel():
            flay = olay
            if gather_bytes:
                plan.stats["gather_mb"] = gather_bytes / 2 ** 20
        elif gather_bytes:
            plan.stats["gather_skipped"] = (f"gathered K/V need {olay.nbytes / 2 ** 20:.1f} MiB of the float "
                                            f"workspace, it has {ws.numel() / 2 ** 20:.1f} MiB: the generic kernel "
                                            f"reads the pages")
            dense_lists, gather_bytes = {}, 0
        else:
            plan.stats["dense_scratch"] = "Triton's allocator (the float workspace has no room for it)"
    fbuf = meta.workspace
    if graph is not None and fbuf is None and flay.regions:
        if graph.own_float is None:
            graph.own_float = torch.empty(flay.nbytes + ALIGN, dtype=torch.uint8, device=device)
        fbuf = graph.own_float
    fviews = flay.carve(fbuf, "float_workspace_buffer", device=device, memo=meta.memo) if flay.regions else {}
    plan.part_o, plan.part_lse = fviews.get("part_o"), fviews.get("part_lse")

    # ---- int workspace (plan-scoped): the tables, one upload
    ilay = _int_layout(cap_items, cap_merge, Hq if problem.pos_encoding == "ALIBI" else 0,
                       B + 1 if xqa_width is not None else 0,
                       tuple([(bm, max(len(items), 1)) for bm, (items, _, _) in dense_lists.items()]),
                       max(B, 1) if gather_bytes else 0)
    ibuf, shared = meta.int_workspace, meta.int_workspace is not None
    if ibuf is None and graph is not None:
        if graph.own_int is None:
            graph.own_int = torch.empty(ilay.nbytes + ALIGN, dtype=torch.uint8, device=device)
        ibuf, shared = graph.own_int, True
    # the batch's index tables still on the host (not in graph mode): the tables go right before them and
    # one copy sends both (attncore.core.uploads)
    staged = meta.staged if graph is None and shared else None
    owner = (device, ibuf.data_ptr()) if shared else None  # any plan into this workspace overwrites the tables
    # the tables on the host (numpy views of one image: one conversion per table), then one copy
    tabs, image, h, span = uploads.carve_tables(ilay, ibuf, staged, device, meta.memo)
    h["counts"][:3] = (n_items, n_merge, int(heads_first))
    s.write_work(h["work"])
    if n_merge:
        h["merge"][:n_merge] = merge
    if "slopes" in h:
        h["slopes"][:] = slopes_log2(Hq)
    if "xqa_indptr" in h:
        h["xqa_indptr"][:] = range(0, (B + 1) * xqa_width, xqa_width) if xqa_width else 0
    for bm, (items, _, _) in dense_lists.items():
        if items:
            h[f"dense_{bm}"][:] = items
    if "kv_start" in h and B:
        h["kv_start"][:B] = [x * problem.page_size for x in meta.kv_indptr_host[:-1]]
    plan.upload = Upload(image, span, owner)
    plan.counts, plan.work = tabs["counts"], tabs["work"]
    plan.merge_table, plan.slopes = tabs.get("merge"), tabs.get("slopes")
    if xqa_width is not None:
        plan.kv_indptr = tabs["xqa_indptr"]
    if plan.kv_indices is not None and plan.kv_indices.numel() == 0 and (graph is None or not plan.kv_indices.data_ptr()):
        # never read (no pages): any valid int32 pointer; in graph mode the caller's fixed buffer stays
        # (a re-plan with pages fills it)
        plan.kv_indices = plan.counts
    if dense_lists:
        plan.dense = list(next(iter(dense_lists.values()))[1])
        plan.dense_work = {bm: (tabs[f"dense_{bm}"], len(items), first)
                           for bm, (items, _, first) in dense_lists.items()}
        plan.stats["dense"] = plan.dense[0].as_dict()
    if dense_lists:
        plan.dense_scratch = fviews.get("dense_scratch")
    if gather_bytes:
        plan.gather = dict(k=fviews["gather_k"], v=fviews["gather_v"],
                           pages=plan.kv_indices[:meta.kv_indptr_host[-1]], kv_start=tabs["kv_start"])
    if graph is not None:
        plan.stats["graph"] = dict(grid=graph.grid, merge_grid=graph.merge_grid, cap_items=graph.cap_items,
                                   cap_part=graph.cap_part, cap_merge=graph.cap_merge)
    plan.stats["workspace"] = dict(float_bytes=flay.nbytes if flay.regions else 0, int_bytes=ilay.nbytes)
    return plan


def slopes_log2(num_heads: int):
    """ALiBi slopes as Triton's kernels take them (times log2(e): their softmax is base 2), fp32 numpy."""
    return (alibi_slopes(num_heads).float() * LOG2E).numpy()


@functools.lru_cache(maxsize=256)
def _int_layout(cap_items: int, cap_merge: int, slopes: int, xqa_indptr: int, dense: tuple, kv_start: int
                ) -> WorkspaceLayout:
    """The int workspace's layout of a plan (its tables), by their sizes (0: absent); made once per sizes (host
    time) and never changed after."""
    lay = WorkspaceLayout("triton")
    lay.add("counts", (COUNT_FIELDS,), torch.int32)
    lay.add("work", (cap_items, WORK_COLS), torch.int32)
    if cap_merge:
        lay.add("merge", (cap_merge, MERGE_COLS), torch.int32)
    if slopes:
        lay.add("slopes", (slopes,), torch.float32)
    if xqa_indptr:
        lay.add("xqa_indptr", (xqa_indptr,), torch.int32)
    for bm, rows in dense:
        lay.add(f"dense_{bm}", (rows, 2), torch.int32)
    if kv_start:
        lay.add("kv_start", (kv_start,), torch.int32)
    return lay


_CONFIG_KEYS: Dict[tuple, tuple] = {}  # config.config_key by (problem, rows, device): its str(device) costs us


def _pick_config(be, problem, rows_max, device, interp, cc):
    """``config.pick`` (its cache read here first, with the cache key memoized: host time); a pinned config
    (``config.set_config``) is in that cache, so it still wins."""
    from attncore.backends.triton import config as _cfg

    if be._config is not None:
        return _cfg.LaunchConfig(**be._config)
    memo = (problem, rows_max, device)
    key = _CONFIG_KEYS.get(memo)
    if key is None:
        if len(_CONFIG_KEYS) > 1024:
            _CONFIG_KEYS.clear()
        key = _CONFIG_KEYS[memo] = _cfg.config_key(problem, rows_max, device)
    cfg = _cfg._CACHE.get(key)
    return cfg if cfg is not None else _cfg.pick(problem, rows_max, device, interpret=interp, cc=cc)


def _gather_bytes(be, plan: TritonPlan, qo_lens, kv_host, causal: bool) -> int:
    """Bytes of the gathered K/V if paged prefill should go through the dense kernel (pages copied to
    contiguous K/V), else 0.  The copy reads and writes every page once (about 2 x bytes / 2.7 TB/s on
    an H100) and saves the generic kernel's pointer gathers (P3 333 -> 397, P4 382 -> 414 TFLOP/s with
    the copy included, backends/triton/bench/triton.md session 4), so auto requires enough FLOPs per
    byte; the cap (gather_cap_mb) bounds it, and the float workspace must hold it (make_plan)."""
    if be._gather is False:
        return 0
    p, meta = plan.problem, plan.meta
    n_pages, page = meta.kv_indptr_host[-1], p.page_size
    nbytes = 2 * n_pages * page * p.num_kv_heads * p.head_dim_qk * p.kv_dtype.itemsize
    if n_pages == 0 or nbytes > be._gather_cap:
        return 0
    pairs = sum((qo * kv - qo * (qo - 1) // 2 if qo <= kv else kv * (kv + 1) // 2) if causal
                else qo * kv for qo, kv in zip(qo_lens, kv_host))  # bottom-right causal
    flops = 4 * pairs * p.num_qo_heads * p.head_dim_qk
    if be._gather is None and flops < GATHER_FLOP_PER_BYTE * nbytes:
        return 0
    return nbytes


def _dense_lists(be, plan: TritonPlan, qo_lens, kv_host, causal: bool, sms: int) -> Dict[int, tuple]:
    """The dense kernel's configs and, per block_m among them, its work list (request, first row),
    heaviest first, and program order: {block_m: (items, configs, heads_first)}."""
    from attncore.backends.triton import config as _cfg

    cands = ([_cfg.DenseConfig(**be._dense)] if isinstance(be._dense, dict)
             else _cfg.dense_candidates(plan.problem, causal))
    out = {}
    for bm in sorted({c.block_m for c in cands}):
        items = []
        for i, (qo, kv) in enumerate(zip(qo_lens, kv_host)):
            for m0 in range(0, qo, bm):
                cost = max(0, min(kv, m0 + bm + kv - qo)) if causal else kv
                items.append((cost, i, m0))
        items.sort(key=lambda t: -t[0])
        first = _heads_first([t[0] for t in items], plan.problem.num_qo_heads, sms)
        out[bm] = ([t[1:] for t in items], cands, first)
    return out
