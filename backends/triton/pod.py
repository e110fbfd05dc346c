"""The fused POD op of the Triton backend: a prefill part and a decode part in one launch.

``plan_pod`` turns the two parts (``PODBatch``: one ``BatchMeta`` each) into one work list of items
(part, request, first packed row, kv head): the prefill part's row tiles and the decode part's
requests, each tile over its whole visible KV range (no split-KV, so no merge launch).  Items are
ordered so that both kinds are in flight together: each part's items longest first, merged in
proportion to each part's estimated time, so the bandwidth-bound decode items run beside the
compute-bound prefill tiles on the same SMs.  Two launch shapes (``mode``):

* ``grid``: one program per item, in that order; the hardware dispatches programs to SMs as they
  free up (dynamic balance).  The default.
* ``persistent``: ``ctas_per_sm`` x SMs programs, each running a list of items planned by greedy
  longest-first assignment to the least-loaded program (the grid size no longer depends on the batch).

plan() declines (``PODDeclined``: the API composes the parts) when its cost estimate says the fused
launch would not beat the two launches of the composed path by 2% (a decode part that needs split-KV
to fill the GPU, mostly), unless forced (``fused="always"``).  The tables (work list, schedule, ALiBi slopes)
are carved from the caller's int workspace (``BatchMeta.int_workspace`` of the decode part) when given and sent in
one non-blocking copy.

CUDA-graph mode (a part planned with ``cuda_graph``): a captured launch keeps its grid, scalars and pointers.  The
first graph-mode plan of a caller (its int workspace, else its fixed decode ``qo_indptr``: attncore.core.graphs)
fixes each part's launch config, the work list's capacity and the grid; later plans of that caller fuse too (the
captured launch is fused), write their tables at the same addresses and pad the grid's unused programs with
empty item lists.  An item is (part, request, first row, kv head) and the kernel reads each request's lengths
from the index tables, so a re-plan with new kv lengths and the same query rows (a decode step) has the same
items: a replay after it is correct even before the next run() re-plans the fused op.  A re-plan needing more
items than the capacity is an error naming it.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional

import torch

from attncore.core import current, graphs, uploads
from attncore.core import schedule as _schedule
from attncore.backends.triton.backend import TritonBackend, _interpreting
from attncore.backends.triton.plan import LOG2E, slopes_log2
from attncore.core.capabilities import Capabilities, Reason
from attncore.core.problem import (POD_OPS, AttentionProblem, PODBatch, PODDeclined, PODRunArgs,
                                   outside_measured_wins, outside_region, pod_parts)
from attncore.core.workspace import ALIGN, WorkspaceLayout

_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# every feature of the parts but spec masks
POD_FEATURES = frozenset({"window", "soft_cap", "alibi", "rope", "sinks", "fp8_scales", "return_lse", "cuda_graph"})
POD_CAPABILITIES = (
    Capabilities(
        ops=frozenset(POD_OPS), devices=frozenset({"cuda"}), min_compute_capability=(8, 0),
        q_dtypes=frozenset({_F16, _BF16}), kv_dtypes=frozenset({_F16, _BF16, _E4M3, _E5M2}),
        kv_dtype_must_match_q=True, head_dim_multiple=16, max_head_dim=256,
        masks=frozenset({"none", "causal", "custom"}), features=POD_FEATURES),
    Capabilities(  # Triton's interpreter: as the backend's other CPU entry (no bf16)
        ops=frozenset(POD_OPS), devices=frozenset({"cpu"}),
        q_dtypes=frozenset({_F16, _F32}), kv_dtypes=frozenset({_F16, _F32, _E4M3, _E5M2}),
        kv_dtype_must_match_q=True, head_dim_multiple=16, max_head_dim=256,
        masks=frozenset({"none", "causal", "custom"}), features=POD_FEATURES),
)
MASK_IDS = {"none": 0, "causal": 1, "custom": 2}

# Cost model, in seconds on one SM: what each SM gets of an H100's throughput when every SM is busy
# (the generic kernel's ~430 TFLOP/s; ~3.0 TB/s of the 3.35 read bandwidth; 132 SMs).  A prefill tile
# costs MMA time (its K/V mostly comes from L2: other tiles of the request read the same keys), a decode
# item read time.  Composed, the parts run one after the other, each at its own bound; fused, the two
# resources overlap: the larger total plus (1 - OVERLAP) of the smaller, the prefill's MMAs at
# PREFILL_EFF of the composed path's rate (64-row tiles beside decode items vs the dense kernels the
# composed prefill gets), and never below the longest item.  OVERLAP and PREFILL_EFF are estimates to
# fit from `attncore bench --pod-sweep` on the GPU (POD-Attention, arXiv 2410.18038, measures about
# half of the smaller part hidden on an A100).
SM_FLOPS = 430e12 / 132
SM_BYTES = 3.0e12 / 132
OVERLAP = 0.5
PREFILL_EFF = 0.8
# (block_m, block_n, num_warps, num_stages) of each path on a GPU; the kernel takes the prefill path's
# warps and the smaller stage count.  Both paths live in one kernel, so its registers are the larger
# path's plus what stays live across the branch: compiled offline for sm90 (Triton 3.9, d128 bf16,
# causal), prefill 64x32 + decode 16x64 on 8 warps takes 254 registers without spills, where 64x64 on
# 4 warps spills 1.2 KB per thread and 128x64 on 8 warps 0.5 KB.  One CTA per SM, then: the parts
# share the GPU across SMs (decode items on some while prefill tiles run on others), not within one.
GPU_CONFIG = {"prefill": (64, 32, 8, 2), "decode": (16, 64, 8, 2)}
MARGIN = 0.98  # fused must beat composed by 2% (issue 16: auto never slower than serial by more than 2%)


# Where the fused launch won, measured (`attncore bench --pod-sweep`, H100, bf16, 32/8 heads, d128, page 16).
# 2026-11-24 06:20 UTC: fused / composed-serial 2.63 (prefill 512 + decode 8 x 1k), 2.95 (512 + 8 x 4k), 2.07
# (512 + 32 x 1k), 1.59 (512 + 128 x 1k), 1.14 (2k + 8 x 1k), losing everywhere else (median 0.70, 0.28-0.33 at
# prefill 8k: the one-CTA-per-SM kernel runs the prefill at a third of the composed kernels' rate).  12:26 UTC,
# with the composed path's host time cut since (issue 15: serial PD1 0.552 -> 0.452 ms): only 512 + 8 x 1k still
# wins (1.42); 512 + 8 x 4k 0.69, 512 + 32 x 1k 0.89, 512 + 128 x 1k 0.79, 2k + 8 x 1k 0.46 (median 0.465).  The
# cost model above does not tell these apart, so on a GPU auto fuses only inside this region; elsewhere plan()
# declines.
# Not measured on an H200 (there auto ranks cuda_fa2's pod90 first; Triton's fused op serves graph mode), so every
# GPU takes these rows.
MEASURED_WINS = {"default": ((512, 8, 1024),)}  # GPU model: rows, as problem.measured_rows reads them
WHERE = "MEASURED_WINS in backends/triton/pod.py"


def _outside_measured_wins(batch: "PODBatch") -> Optional[str]:
    """Why auto composes this batch on a GPU (None: it is inside a measured winning region)."""
    return outside_measured_wins(batch, MEASURED_WINS, WHERE)


@dataclass
class PODGraph:
    """What the first CUDA-graph-mode plan of one caller fixed (see the module's docstring)."""

    configs: tuple  # each part's LaunchConfig
    mode: str  # "grid" or "persistent"
    cap_items: int  # work-list rows
    programs: int  # the grid
    batch_size: int  # of the decode part, for the capacity error
    nnz_q: int  # query rows of both parts, for the capacity error
    own_int: Optional[torch.Tensor] = None  # the tables when the caller gave no int workspace
    anchor: Any = None  # weak reference to the caller's buffer (attncore.core.graphs)


_GRAPH_STATES = graphs.GraphStates()
CAPTURING = ("triton pod: plan() during CUDA-graph capture (its tables cannot be sent there): run() once with "
             "these parts before capturing, so that the fused op is planned outside the capture")


@dataclass
class PODPlan:
    problem: AttentionProblem
    batch: PODBatch
    device: torch.device
    parts: tuple  # (prefill, decode) dicts: problem, meta, block_m, block_n, prefetch, mask_mode, nnz_q
    work: torch.Tensor
    offs: torch.Tensor
    num_programs: int
    num_warps: int
    num_stages: int
    slopes: Optional[torch.Tensor]
    stats: dict = field(default_factory=dict)
    launch_cache: dict = field(default_factory=dict)
    graph: Optional[PODGraph] = None


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _tiles(meta, G: int, bm: int):
    causal = meta.mask == "causal"
    return _schedule.row_tiles(meta.qo_lens_host, meta.kv_lens_host, G, bm, causal=causal,
                               window_left=meta.params.window_left)


def _cost(part: int, rows: int, keys: int, d: int, kv_bytes: int) -> float:
    """Seconds of one item on one SM: MMA time of a prefill tile (part 0), read time of a decode item."""
    if part == 0:
        return 4.0 * rows * keys * d / SM_FLOPS + 1e-7
    return 2.0 * keys * d * kv_bytes / SM_BYTES + 1e-7


def estimate(totals, longest, sms: int):
    """(fused, composed) seconds from each part's total item time and longest item (see above)."""
    comp = max(totals[0] / sms, longest[0]) + totals[1] / sms  # composed decode: split-KV fills the GPU
    a, b = totals[0] / PREFILL_EFF / sms, totals[1] / sms
    fused = max(max(a, b) + (1.0 - OVERLAP) * min(a, b), longest[0] / PREFILL_EFF, longest[1])
    return fused, comp


def _interleave(a: list, b: list) -> list:
    """Merge two lists of (cost, ...) each sorted longest first, so that each part's share of its
    total cost done stays level: both kinds of items are in flight throughout."""
    ta, tb = sum(x[0] for x in a) or 1.0, sum(x[0] for x in b) or 1.0
    out, i, j, da, db = [], 0, 0, 0.0, 0.0
    while i < len(a) or j < len(b):
        if j >= len(b) or (i < len(a) and da / ta <= db / tb):
            out.append(a[i])
            da += a[i][0]
            i += 1
        else:
            out.append(b[j])
            db += b[j][0]
            j += 1
    return out


def plan_pod(problem: AttentionProblem, batch: PODBatch, *, interpret: bool, fused: str = "auto",
             mode: str = "grid", ctas_per_sm: int = 1, config: Optional[dict] = None) -> PODPlan:
    from attncore.backends.triton import config as _cfg

    if not isinstance(batch, PODBatch):
        raise TypeError(f"batch: a {problem.op} problem is planned from a PODBatch, got {type(batch).__name__}")
    mp, md = batch.prefill, batch.decode
    device = md.device
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(CAPTURING)
    graph_mode = "cuda_graph" in problem.features
    graph = _GRAPH_STATES.find(problem, md) if graph_mode else None
    if graph is not None:  # the caller's captured launch is fused: so is every later plan of it
        fused, mode = "always", graph.mode
    # the measured rule first: a batch it declines costs no work list (a serving step plans one each step)
    measured = _outside_measured_wins(batch) if device.type == "cuda" else None
    if fused == "auto" and measured:
        raise PODDeclined(measured)
    G, D = problem.group_size, problem.head_dim_qk
    hkv = problem.num_kv_heads
    parts = []
    for k, (which, meta, pp) in enumerate(zip(("prefill", "decode"), (mp, md), pod_parts(problem))):
        rows = max([q * G for q in meta.qo_lens_host] + [1])
        if graph is not None:
            c = graph.configs[k]
        elif config is not None:
            c = _cfg.LaunchConfig(**config[which])
        elif interpret:
            c = _cfg.candidates(pp, rows, interpret=True)[0]
        elif which == "prefill":  # see GPU_CONFIG
            c = _cfg.LaunchConfig(*GPU_CONFIG["prefill"], prefetch=pp.page_size is not None)
        else:
            c = _cfg.LaunchConfig(max(16, _cfg._pow2(min(rows, 64))), *GPU_CONFIG["decode"][1:])
        parts.append(dict(problem=pp, meta=meta, config=c, block_m=c.block_m, block_n=c.block_n,
                          prefetch=c.prefetch, num_warps=c.num_warps, num_stages=c.num_stages,
                          mask_mode=MASK_IDS[meta.mask], nnz_q=meta.qo_indptr_host[-1]))
    kvb = problem.kv_dtype.itemsize
    items = ([], [])
    for k, part in enumerate(parts):
        for t in _tiles(part["meta"], G, part["block_m"]):
            if part["meta"].qo_lens_host[t.req] == 0:
                continue
            cost = _cost(k, part["block_m"], t.kv_hi - t.kv_lo, D, kvb)
            items[k].extend((cost, k, t.req, t.row0, h) for h in range(hkv))
        items[k].sort(key=lambda x: -x[0])
    sms = _num_sms(device)
    # time estimates: composed = each part alone on the GPU (the decode part split as the composed
    # path would, so only its total counts); fused = the one list on the GPU
    total = [sum(x[0] for x in its) for its in items]
    longest = [max((x[0] for x in its), default=0.0) for its in items]
    t_fused, t_composed = estimate(total, longest, sms)
    stats = dict(items=[len(i) for i in items], est_fused_us=t_fused * 1e6, est_composed_us=t_composed * 1e6)
    stats["measured_rule"] = measured or "inside the region where fused won (MEASURED_WINS)"
    if fused == "auto" and device.type != "cuda" and t_fused > MARGIN * t_composed:
        raise PODDeclined(
            f"estimated fused {t_fused * 1e6:.1f} us vs composed {t_composed * 1e6:.1f} us on {sms} SMs: the "
            f"longest decode item ({longest[1] * 1e6:.1f} us) needs split-KV" if longest[1] >= t_fused * 0.99
            else f"estimated fused {t_fused * 1e6:.1f} us vs composed {t_composed * 1e6:.1f} us on {sms} SMs")
    flat, offs = _program_lists(_interleave(items[0], items[1]), mode, sms * ctas_per_sm)
    nprog = len(offs) - 1
    if graph_mode:
        nnz = parts[0]["nnz_q"] + parts[1]["nnz_q"]
        if graph is None:
            graph = _GRAPH_STATES.add(problem, md, PODGraph(
                configs=tuple(p["config"] for p in parts), mode=mode, cap_items=max(len(flat), 1),
                programs=max(nprog, 1), batch_size=md.batch_size, nnz_q=nnz))
        _schedule.check_capacity("triton pod", "work items", len(flat), graph.cap_items, graph.batch_size,
                                 graph.nnz_q)
        if nprog > graph.programs:  # persistent: the SM count is the device's; grid: one item per program
            raise ValueError(f"triton pod: this CUDA-graph plan needs {nprog} programs, the captured grid has "
                             f"{graph.programs}")
        offs += [offs[-1]] * (graph.programs - nprog)  # the grid's other programs run no item
        nprog, cap = graph.programs, graph.cap_items
    else:
        cap = max(len(flat), 1)
    alibi = problem.pos_encoding == "ALIBI" or problem.decode.pos_encoding == "ALIBI"
    lay = _int_layout(cap, nprog + 1, problem.num_qo_heads if alibi else 0)
    ws = md.int_workspace
    if ws is None and graph is not None:  # driven directly (tests, the conformance suite): the state's own
        if graph.own_int is None:
            graph.own_int = torch.empty(lay.nbytes + ALIGN, dtype=torch.uint8, device=device)
        ws = graph.own_int
    # one host image of the tables, one non-blocking copy (attncore.core.uploads); without a workspace the
    # tables get their own allocation (the backend driven directly)
    tabs, image, h, span = uploads.carve_tables(lay, ws, None, device, md.memo)
    if flat:
        h["work"][:len(flat)] = [it[1:] for it in flat]
    h["offs"][:] = offs
    if alibi:
        h["slopes"][:] = slopes_log2(problem.num_qo_heads)
    uploads.send_image(image, span)
    stats.update(mode=mode, programs=nprog, config=[{k: p[k] for k in ("block_m", "block_n")} for p in parts])
    if graph is not None:
        stats["graph"] = dict(programs=graph.programs, cap_items=graph.cap_items)
    return PODPlan(problem=problem, batch=batch, device=device, parts=tuple(parts), work=tabs["work"],
                   offs=tabs["offs"], num_programs=nprog, num_warps=parts[0]["num_warps"],
                   num_stages=min(parts[0]["num_stages"], parts[1]["num_stages"]), slopes=tabs.get("slopes"),
                   stats=stats, graph=graph)


def _program_lists(order: list, mode: str, programs: int):
    """(the work items grouped by program, each program's first item and the end: ``offs``): ``grid`` one
    item per program in ``order``; ``persistent`` ``programs`` lists by greedy longest-first assignment to
    the least-loaded program, each list's parts interleaved."""
    if mode == "grid":
        return order, list(range(len(order) + 1))
    if mode != "persistent":
        raise ValueError(f"mode: got {mode!r}, expected 'grid' or 'persistent'")
    nprog = max(1, programs)
    heap = [(0.0, p) for p in range(nprog)]
    lists: List[list] = [[] for _ in range(nprog)]
    for it in sorted(order, key=lambda x: -x[0]):
        load, p = heapq.heappop(heap)
        lists[p].append(it)
        heapq.heappush(heap, (load + it[0], p))
    lists = [_interleave([x for x in lst if x[1] == 0], [x for x in lst if x[1] == 1]) for lst in lists]
    offs = [0]
    for lst in lists:
        offs.append(offs[-1] + len(lst))
    return [it for lst in lists for it in lst], offs


@functools.lru_cache(maxsize=256)
def _int_layout(cap_items: int, offs: int, slopes: int) -> WorkspaceLayout:
    """The int workspace's layout of a plan by its sizes (0: absent), made once per sizes and never changed
    after (``uploads.carve_tables`` keys its memo by the object)."""
    lay = WorkspaceLayout("triton pod")
    lay.add("work", (cap_items, 4), torch.int32)
    lay.add("offs", (offs,), torch.int32)
    if slopes:
        lay.add("slopes", (slopes,), torch.float32)
    return lay


def _kv_strides(k, v, paged: bool, layout: str):
    """(page, slot-or-token, head) element strides of K and V (as the backend's _first_run)."""
    if paged:
        if layout == "NHD":
            return (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))
        return (k.stride(0), k.stride(2), k.stride(1)), (v.stride(0), v.stride(2), v.stride(1))
    if layout == "NHD":
        return (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1))
    return (0, k.stride(1), k.stride(0)), (0, v.stride(1), v.stride(0))


def _check(part: dict, a, name: str, device: torch.device) -> None:
    p = part["problem"]
    q, k, v, out = a.q, a.k, a.v, a.out
    if q.dtype != p.q_dtype or k.dtype != p.kv_dtype or v.dtype != p.kv_dtype or out.dtype != p.out_dtype:
        raise TypeError(f"{name}: q/k/v/out dtypes {q.dtype}/{k.dtype}/{v.dtype}/{out.dtype} differ from the "
                        f"plan's {p.q_dtype}/{p.kv_dtype}/{p.out_dtype}")
    want = (part["nnz_q"], p.num_qo_heads, p.head_dim_qk)
    if tuple(q.shape) != want or tuple(out.shape) != want:
        raise ValueError(f"{name}: q {tuple(q.shape)} / out {tuple(out.shape)}: planned {want}")
    for n, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.device != device:
            raise ValueError(f"{name}: {n} is on {t.device}, planned for {device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {n}: last dim must be contiguous (stride {t.stride()})")
    if a.lse is not None and (a.lse.dtype != torch.float32 or tuple(a.lse.shape) != want[:2]):
        raise ValueError(f"{name}: lse must be float32 {list(want[:2])}, got {a.lse.dtype} {tuple(a.lse.shape)}")
    if p.sinks != (a.sinks is not None):
        raise ValueError(f"{name}: sinks: planned {'with' if p.sinks else 'without'} sinks")
    if a.sinks is not None and (a.sinks.dtype != torch.float32 or a.sinks.numel() != p.num_qo_heads):
        raise ValueError(f"{name}: sinks must be float32 [{p.num_qo_heads}], got {a.sinks.dtype} "
                         f"{tuple(a.sinks.shape)}")
    if a.spec_mask is not None:
        raise ValueError(f"{name}: spec_mask: the POD op takes no speculative-decoding mask")


def _key(a) -> tuple:
    t = lambda x: None if x is None else (x.shape, x.stride(), x.dtype, x.device)  # noqa: E731
    return (t(a.q), t(a.k), t(a.v), t(a.out), t(a.lse), None if a.sinks is None else a.sinks.numel(),
            a.q_scale, a.k_scale, a.v_scale, a.o_scale)


def run_pod(plan: PODPlan, args: PODRunArgs) -> None:
    key = (_key(args.prefill), _key(args.decode))
    fast = plan.launch_cache.get(key)
    tensors = tuple((a.q, a.k, a.v, a.out, a.lse, a.sinks) for a in (args.prefill, args.decode))
    if fast is not None:
        fast(*tensors)
        return
    for part, a, name in zip(plan.parts, (args.prefill, args.decode), ("prefill", "decode")):
        _check(part, a, name, plan.device)
    if args.prefill.q.is_cuda and args.prefill.q.device.index != current.device_index():
        with torch.cuda.device(args.prefill.q.device):
            plan.launch_cache[key] = _first_run(plan, args)
    else:
        plan.launch_cache[key] = _first_run(plan, args)


def _first_run(plan: PODPlan, args: PODRunArgs) -> Any:
    from attncore.backends.triton.kernels.pod import Part, pod_fwd

    built = []
    for part, a in zip(plan.parts, (args.prefill, args.decode)):
        p, meta = part["problem"], part["meta"]
        prm = meta.params
        paged = p.page_size is not None
        ks, vs = _kv_strides(a.k, a.v, paged, p.kv_layout)
        sm = prm.sm_scale * a.q_scale * a.k_scale
        cap = prm.logits_soft_cap or 0.0
        kv_indices = meta.kv_indices if paged else None
        if kv_indices is not None and kv_indices.numel() == 0 and (plan.graph is None or not kv_indices.data_ptr()):
            # never read (no request has a page): any valid int32 pointer; in graph mode the caller's fixed
            # buffer stays (a re-plan with pages fills it)
            kv_indices = meta.kv_lens
        built.append(Part(
            q=a.q, k=a.k, v=a.v, out=a.out, lse=a.lse, qo_indptr=meta.qo_indptr, kv_indptr=meta.kv_indptr,
            kv_indices=kv_indices, kv_lens=meta.kv_lens, mask_bytes=meta.packed_mask,
            mask_indptr=meta.mask_indptr, sinks=a.sinks, kv_strides=ks, v_strides=vs, page_size=p.page_size,
            mask_mode=part["mask_mode"], window_left=prm.window_left, soft_cap=cap > 0,
            rope=prm.pos_encoding_mode == "ROPE_LLAMA", rope_theta=prm.rope_theta, rope_scale=prm.rope_scale,
            qk_scale=sm * LOG2E, cap_inv=(sm / cap) if cap > 0 else 0.0, cap_l2=cap * LOG2E,
            out_scale=a.v_scale / a.o_scale, block_m=part["block_m"], block_n=part["block_n"],
            prefetch=part["prefetch"]))
    return pod_fwd(plan.work, plan.offs, plan.num_programs, plan.slopes, built[0], built[1],
                   group_size=plan.problem.group_size, head_dim=plan.problem.head_dim_qk,
                   alibi=plan.slopes is not None, num_warps=plan.num_warps, num_stages=plan.num_stages)


class TritonPODBackend(TritonBackend):
    """``TritonBackend`` plus the ``pod`` / ``batch_pod`` ops (this module).

    pod : {"auto", "always"}, default "auto"
        "auto": plan() declines a batch the cost model says would not gain (the API composes the
        parts); "always": fuse every batch (tests).
    pod_mode : {"grid", "persistent"}, default "grid"; pod_ctas_per_sm: programs per SM (persistent; 1
        by default: the kernel holds one CTA per SM, see GPU_CONFIG).
    pod_config : dict, optional: {"prefill": LaunchConfig kwargs, "decode": ...} (tuning).
    Every other keyword goes to ``TritonBackend``.
    """

    capabilities = tuple(TritonBackend.capabilities) + POD_CAPABILITIES
    description = TritonBackend.description + "; fused POD (prefill + decode in one launch)"

    def __init__(self, *, pod: str = "auto", pod_mode: str = "grid", pod_ctas_per_sm: int = 1,
                 pod_config: Optional[dict] = None, **kw):
        super().__init__(**kw)
        if pod not in ("auto", "always"):
            raise ValueError(f"pod: got {pod!r}, expected 'auto' or 'always'")
        if pod_mode not in ("grid", "persistent"):
            raise ValueError(f"pod_mode: got {pod_mode!r}, expected 'grid' or 'persistent'")
        if not isinstance(pod_ctas_per_sm, int) or pod_ctas_per_sm < 1:
            raise ValueError(f"pod_ctas_per_sm: got {pod_ctas_per_sm!r}, expected an int >= 1")
        self._pod = (pod, pod_mode, pod_ctas_per_sm, pod_config)

    @property
    def pod_fuse(self) -> str:
        """The ``pod`` knob ("auto" or "always"), by the name cuda_fa2's fused op has for it (``attncore bench``
        forces either backend's fused op through it)."""
        return self._pod[0]

    @pod_fuse.setter
    def pod_fuse(self, value: str) -> None:
        if value not in ("auto", "always"):
            raise ValueError(f"pod_fuse: got {value!r}, expected 'auto' or 'always'")
        self._pod = (value,) + tuple(self._pod[1:])

    def fused_pod_reason(self, prefill_tokens: int, decode_batch: int, decode_kv: int) -> Optional[str]:
        """Why the fused POD op would compose a batch of these sizes on a GPU (None: it fuses them)."""
        if self.pod_fuse == "always":
            return None
        return outside_region(prefill_tokens, decode_batch, decode_kv, MEASURED_WINS, WHERE)

    def extra_reasons(self, p: AttentionProblem) -> List[Reason]:
        r = super().extra_reasons(p)
        if p.decode is not None:  # the decode part's own (the device ones are the same)
            r += [replace(x, axis="decode " + x.axis) for x in super().extra_reasons(p.decode)
                  if x.axis != "device"]
        return r

    def plan(self, problem: AttentionProblem, meta):
        if problem.op in POD_OPS:
            fused, mode, ctas, cfg = self._pod
            return plan_pod(problem, meta, interpret=_interpreting(), fused=fused, mode=mode,
                            ctas_per_sm=ctas, config=cfg)
        return super().plan(problem, meta)

    def run(self, plan, args) -> None:
        if isinstance(plan, PODPlan):
            return run_pod(plan, args)
        return super().run(plan, args)

    def relaunch(self, plan, args):
        return None if isinstance(plan, PODPlan) else super().relaunch(plan, args)
