"""cuda_fa2's fused POD ops (issue 16): a prefill part and a decode part in ONE launch of prefill90's POD
kernel (csrc/fa2_sm90.cuh ``fa2_sm90_pod_kernel``, spec ``pod90``), on sm_90.

Each part is planned as cuda_fa2 plans it alone for prefill90 (plan.make_plan: its row tiles, tables and launch
struct).  The prefill part has split-KV off (an item covers its whole KV range) and keeps its loop (pipelined for
the ragged K/V of ``pod``, plain for the paged K/V of ``batch_pod``).  The decode part runs the plain loop (paged
K/V), causal, each item's K/V tiles shared between the two consumer warpgroups (``KVSPLIT`` in csrc/fa2_sm90.cuh);
its requests longer than ``LONG_DECODE`` keys are split into ``DECODE_CHUNK``-key items, whose partials a merge
launch after the POD launch combines.  An order table (int32, one entry per CTA column, in the
fused plan's int workspace) interleaves the parts' items by their estimated times, so that compute-bound prefill
tiles and bandwidth-bound decode items run on the GPU side by side: the hardware starts CTAs in that order.

plan() declines (``PODDeclined``: the API composes the parts) what the kernel does not serve: a GPU other than
sm_90, a part prefill90 does not take (``CudaFa2Backend._problem_sm90_reasons``), a decode part whose mask is not
causal, CUDA-graph mode (the order table's size follows the batch); and, unless forced (``fuse="always"``), a
batch outside the region where the one launch was measured to beat the composed parts (``MEASURED_WINS``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from attncore.core import current, uploads
from attncore.core.backend import cuda_device
from attncore.core.problem import (AttentionProblem, PODBatch, PODDeclined, PODRunArgs, outside_measured_wins,
                                   pod_parts)
from attncore.core.problem import outside_region as _outside_region
from attncore.core.workspace import ALIGN, WorkspaceTooSmall

from attncore.backends.cuda_fa2.plan import Fa2Plan, make_plan

# Where the one launch beat what auto composes otherwise (the SM split where its model picks it, else the parts in
# turn), measured with `attncore bench --pod-sweep --pod-backend cuda_fa2` (H100, bf16, 32/8 heads, d128, page 16;
# BENCHMARKS 2q, 2r, 2s), ms, one launch / what auto composed.  Session 22 (two sweeps, 16:59 and 17:11 UTC; auto
# composed serially at each of these): 2k + 32 x 1k 0.133 / 0.155 and 0.132 / 0.155, 2k + 8 x 4k 0.147 / 0.158
# and 0.148 / 0.158; 512 + 8 x 1k, 512 + 8 x 4k, 512 + 32 x 1k and 2k + 8 x 1k won as in session 21 (e.g. 2k + 8 x
# 1k 0.104 / 0.121).  Session 21 compared with the faster of serial and the SM split and so dropped 2k + 32 x 1k
# (0.132 against the split's 0.128), which auto never composes there.  Outside, serial or the split wins or ties:
# 512 + 32 x 4k 0.220 / 0.211, 512 + 128 x 1k 0.217 / 0.212, PD1 0.422 / 0.407 (split), PD2 0.427 / 0.394 (split).
# H200 (session 24, 2026-11-29 05:30 UTC, the same sweep, BENCHMARKS 2t): the faster decode shrinks the region to
# the short decodes: 512 + 8 x 1k 0.036 / 0.040, 512 + 32 x 1k 0.062 / 0.065, 2k + 8 x 1k 0.103 / 0.116, 2k + 32 x 1k
# 0.129 / 0.139 won; 512 + 8 x 4k 0.073 / 0.067 and 2k + 8 x 4k 0.144 / 0.142 lost.
MEASURED_WINS = {  # GPU model: (max prefill tokens, max decode batch, max decode kv) rows (problem.measured_rows)
    "default": ((2048, 8, 4096), (2048, 32, 1024)),  # the H100's, and any sm_90 GPU not measured
    "H200": ((2048, 32, 1024),),
}
WHERE = "MEASURED_WINS in backends/cuda_fa2/pod.py"


def outside_region(prefill_tokens: int, decode_batch: int, decode_kv: int, device=None) -> Optional[str]:
    """Why auto would compose a batch of these sizes on ``device`` (default: the current GPU); None inside
    MEASURED_WINS, where it fuses."""
    return _outside_region(prefill_tokens, decode_batch, decode_kv, MEASURED_WINS, WHERE, device)


# The decode part's KV split (pod90 merges the partials in a second launch): requests longer than LONG_DECODE keys in
# items of DECODE_CHUNK.  Measured on H100 (2026-11-25 15:08 UTC, session 21; forced pod90, ms, chunk 0 / 2048 /
# 1024 / 512): prefill 2k + 8 x 16k 0.313 / 0.250 / 0.266 / 0.294; on 4k requests no chunk won clearly (PD1 0.421 /
# 0.431 / 0.445 / 0.490, PD2 0.416 / 0.417 / 0.445 / 0.469), so they stay whole.
LONG_DECODE, DECODE_CHUNK = 4096, 2048


def decode_chunk_for(decode_kv_lens) -> int:
    """The decode part's chunk in tokens (0: one item per request) for these KV lengths."""
    return DECODE_CHUNK if max(decode_kv_lens, default=0) > LONG_DECODE else 0


# Per-SM rates of an H100 for the order table's time estimates: prefill90's dense rate (~500 TFLOP/s, BENCHMARKS
# 2o) and ~3.0 TB/s of the 3.35 TB/s read bandwidth, over 132 SMs.  Only their ratio orders the items.
SM_FLOPS = 500e12 / 132
SM_BYTES = 3.0e12 / 132


@dataclass
class Fa2PodPlan:
    problem: AttentionProblem
    parts: Tuple[Fa2Plan, Fa2Plan]  # (prefill, decode), each with its launch struct's plan-constant part
    lib: Any  # the pod90 library
    device: torch.device
    order: torch.Tensor  # int32 [num_ctas] (device): e >= 0 prefill item e, e < 0 decode item ~e
    num_ctas: int  # grid.x
    stats: dict = field(default_factory=dict)


def declines(backend, problem: AttentionProblem, batch: PODBatch, dev: torch.device) -> List[str]:
    """Why the pod90 kernel cannot run this batch ([] when it can)."""
    from attncore.backends.cuda_fa2.backend import _capability

    pp, pd = pod_parts(problem)
    r = []
    if "cuda_graph" in problem.features:  # either part's (the single POD's decode part is the graph-mode one)
        r.append("CUDA-graph mode (the order table's size follows the batch)")
    cc = _capability(dev)
    if cc != (9, 0):
        r.append("compute capability %d.%d is not 9.0 (pod90 is built for sm_90a)" % cc)
    for name, prob, meta in (("prefill", pp, batch.prefill), ("decode", pd, batch.decode)):
        r += [f"{name} part: {x}" for x in backend._problem_sm90_reasons(prob, meta.params.window_left, pod=True)]
    if batch.decode.mask != "causal":
        r.append(f"decode part: mask {batch.decode.mask} (causal only)")
    return r


def _tiles_bound(meta, group: int, cta_q: int, chunk: int = 0) -> int:
    """At least the items of a batch: its row tiles, times each request's KV chunks when split by ``chunk`` tokens."""
    return sum(max(1, -(-q * group // cta_q)) * (max(1, -(-k // chunk)) if chunk else 1)
               for q, k in zip(meta.qo_lens_host, meta.kv_lens_host))


def _tables_bytes(n_items: int) -> int:
    """Room for a part's tables (plan._layouts: two counts and the work items) with their alignment."""
    return -(-(8 + 20 * n_items) // ALIGN) * ALIGN + 2 * ALIGN


def interleave(prefill: List[float], decode: List[float], weight: float = 1.0) -> List[int]:
    """The CTA order of two parts' items (each list: the items' estimated times, in the part's order): the
    share of its total time each part has issued stays level, the prefill's at ``weight`` times the decode's
    (> 1: the prefill runs ahead and finishes first).  Entries: e >= 0 prefill item e, e < 0 decode item ~e."""
    ta, tb = sum(prefill) or 1.0, sum(decode) or 1.0
    out, i, j, da, db = [], 0, 0, 0.0, 0.0
    while i < len(prefill) or j < len(decode):
        if j >= len(decode) or (i < len(prefill) and da / ta <= weight * db / tb):
            out.append(i)
            da += prefill[i]
            i += 1
        else:
            out.append(~j)
            db += decode[j]
            j += 1
    return out


def plan_pod(backend, problem: AttentionProblem, batch: PODBatch, weight: float = 1.0, fuse: str = "auto",
             decode_chunk: Optional[int] = None) -> Fa2PodPlan:
    """The fused plan of ``batch``, or ``PODDeclined`` (see the module docstring); ``fuse``: "auto" (the measured
    region decides) or "always" (every batch the kernel serves); ``decode_chunk``: the decode part's KV split into
    items of that many tokens (whole pages, whole K/V tiles), merged by a second launch (0: one item per request;
    None: ``decode_chunk_for``)."""
    from attncore.backends.cuda_fa2 import binding
    from attncore.backends.cuda_fa2.specs import Fa2Key

    if not isinstance(batch, PODBatch):
        raise TypeError(f"batch: a {problem.op} problem is planned from a PODBatch, got {type(batch).__name__}")
    mp, md = batch.prefill, batch.decode
    dev = cuda_device(md.device, "cuda_fa2")
    why = declines(backend, problem, batch, dev)
    if not why and fuse == "auto":
        outside = outside_measured_wins(batch, MEASURED_WINS, WHERE)
        if outside:
            raise PODDeclined(outside)
    if why:
        raise PODDeclined("cuda_fa2's pod90 kernel does not serve it: " + "; ".join(why))
    pp, pd = pod_parts(problem)
    key = Fa2Key("pod90", "bf16" if pp.q_dtype == torch.bfloat16 else "fp16", "same", pp.head_dim_qk, mp.mask,
                 pipe=mp.kv_indices is None, ws=True)
    lib = binding.get_library(key, dev)
    G = problem.group_size
    # the fused plan's int workspace (the decode part's: the POD API's own buffer): the order table first, then
    # each part's tables
    ws = md.int_workspace
    if decode_chunk is None:
        decode_chunk = decode_chunk_for(md.kv_lens_host)
    bounds = [_tiles_bound(mp, G, lib.cta_q), _tiles_bound(md, G, lib.cta_q, decode_chunk)]
    sizes = [-(-4 * sum(bounds) // ALIGN) * ALIGN + ALIGN, _tables_bytes(bounds[0])]
    if ws is None:  # driven directly (tests, benchmarks): a buffer of its own (the merge table: 16 B per item)
        ws = torch.empty(sum(sizes) + _tables_bytes(bounds[1]) + 16 * bounds[1] + ALIGN, dtype=torch.uint8, device=dev)
    if ws.numel() < sum(sizes):  # the decode part's tables: its own carve names what they need
        raise WorkspaceTooSmall(f"int_workspace_buffer: cuda_fa2's fused POD plan needs {sum(sizes)} bytes for its "
                                f"order table and the prefill part's tables before the decode part's, the buffer has "
                                f"{ws.numel()}")
    regions = (ws[:sizes[0]], ws[sizes[0]:sizes[0] + sizes[1]], ws[sizes[0] + sizes[1]:])
    parts = []
    for meta, prob, region, chunk in ((mp, pp, regions[1], 0), (md, pd, regions[2], decode_chunk)):
        if meta.staged is not None:
            meta.staged.send()  # the parts' index tables where the part plans read them
        hints = dict(disable_split_kv=True, fixed_split_size=None) if not chunk else dict(
            disable_split_kv=False, fixed_split_size=-(-chunk // meta.page_size))
        one = dataclasses.replace(meta, int_workspace=region, **hints)
        plan = make_plan(backend, prob, one, dev, lambda: (lib, "prefill90", []))
        plan.base, plan.merge_base = binding.base_params(plan)
        parts.append(plan)
    D, kvb = problem.head_dim_qk, problem.kv_dtype.itemsize
    est_p = [4.0 * lib.cta_q * c * D / SM_FLOPS for c in parts[0].schedule.costs]
    est_d = [2.0 * c * D * kvb / SM_BYTES for c in parts[1].schedule.costs]
    order = np.asarray(interleave(est_p, est_d, weight), dtype=np.int32)
    n = len(order)
    dst = regions[0][:4 * max(n, 1)].view(torch.int32)
    if n:
        uploads.send_image(order, dst)
    stats = dict(items=(parts[0].num_items, parts[1].num_items), weight=weight, decode_chunk=decode_chunk,
                 est_us=(sum(est_p) * 1e6, sum(est_d) * 1e6))
    return Fa2PodPlan(problem=problem, parts=(parts[0], parts[1]), lib=lib, device=dev, order=dst, num_ctas=n,
                      stats=stats)


def run_pod(plan: Fa2PodPlan, args: PODRunArgs) -> None:
    """One launch: each part's struct as ``binding.build_params`` makes it for a run of that part alone (its
    checks included), the order table, the pod90 kernel."""
    from attncore.backends.cuda_fa2 import binding

    p0, _ = binding.build_params(plan.parts[0], args.prefill)
    p1, m1 = binding.build_params(plan.parts[1], args.decode)
    if plan.num_ctas == 0:
        return
    stream = current.stream(plan.device.index)
    # a part without query rows has no entry in the order table: the other's struct stands in, never read
    plan.lib.run_pod(p0 or p1, p1 or p0, plan.order.data_ptr(), plan.num_ctas, stream)
    if m1 is not None:  # the decode part's split partials (decode_chunk)
        plan.lib.merge(m1, stream)
