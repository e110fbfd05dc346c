"""Conformance cases generated from a backend's declared capabilities.

Every case is data (``Case``): a family, an ``AttentionProblem``, a shape tag and a seed.  Inputs
are drawn at run time from the seed (``runner.py``), so collecting the suite is cheap.

How the cases are chosen, for each op the backend claims on the test device:

1. a *base* problem: the first claimed combination in a preference order (fp16, d128, NHD...);
2. *one-axis sweeps* around it over a fixed universe of probe values (dtypes, head dims, GQA
   groups, page sizes, layouts, masks, each feature alone, q_len_per_req, out dtype, op and
   device): a probe the backend accepts (``backend.reasons(p) == []``) becomes a ``numerics``
   case; a probe it refuses becomes a ``refusal`` case.  So a backend is tested on exactly what it
   claims, and everything just outside the claim must be refused;
3. *edge* shapes at the base problem (kv_len 0, qo_len > kv_len, one token, page_size 1, last page
   full or holding one token, non-contiguous views, fully masked rows), always included, and *tiles*
   shapes (lengths at multiples of 16/32/64/128 and one off, qo < kv and qo > kv) with every claimed
   GQA group that does not divide a tile (3, 5, 6, 7, 12);
4. a reproducible random sample of multi-axis combinations of claimed values (``--attncore-full``
   draws many more);
5. ``nonfinite`` (NaN in a query row and left of the window: ``docs/semantics.md``), ``merge`` (LSE
   merging) and ``cuda_graph`` (replay equals eager) cases where claimed.  Every case fills the K/V
   slots no request may read with NaN;
6. ``pod`` cases for a fused POD op (``pod``, ``batch_pod``): the first claimed pair of parts, with and
   without both LSEs and at the edge shapes, both parts checked as their own ops are; where it claims CUDA-graph
   mode, ``cuda_graph`` cases of it (plain, both LSEs, each part with a window, soft cap, ALiBi or RoPE).

Case ids read like ``reference-batch_prefill_paged-fp16-d128-g4-p16-causal-lse-edge`` so that
``-k`` selects them and ``Backend.known_failures`` substrings match them.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from attncore.core.backend import Backend
from attncore.core.problem import (DECODE_OPS, FP8_DTYPES, OPS, PAGED_OPS, POD_OPS, AttentionProblem, device_info,
                                   dims_name, dtype_name, pod_problem)

# ---------------------------------------------------------------------------------------------
# Probe universe: values the suite tries on every axis (claimed -> computed, else -> refused).
# ---------------------------------------------------------------------------------------------
TESTED_OPS = ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode", "xqa_decode")
HEAD_DIMS = (128, 64, 256, 32, 96, 80, 192, 40, 16, 72, 100, 512)
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
# Groups that do not divide a kernel's 16/32/64/128-row tiles of packed (token, head) rows: each one
# the backend claims gets a "tiles" case, whatever quick mode thins from the group sweep.
ODD_GROUPS = (3, 5, 6, 7, 12)
PAGE_SIZES = (16, 1, 2, 8, 32, 64, 128, 3)
Q_LENS = (1, 2, 3, 4, 8, 16)
SWEPT_FEATURES = ("return_lse", "window", "soft_cap", "alibi", "rope", "sinks", "fp8_scales")
POD_GRAPH_FEATURES = ("window", "soft_cap", "alibi", "rope")  # what a POD wrapper's two parts may each be planned with
FEATURE_TAGS = {
    "return_lse": "lse", "window": "window", "soft_cap": "softcap", "alibi": "alibi", "rope": "rope",
    "sinks": "sinks", "fp8_scales": "scales", "spec_mask": "specmask", "cuda_graph": "graph",
}

COMPUTED_FAMILIES = ("numerics", "nonfinite", "merge", "cuda_graph", "pod")  # the families that run a backend
DEFAULT_BUDGET = 10  # random multi-axis cases per op (quick mode)
FULL_BUDGET = 60


def float_dtypes(device_type: str) -> Tuple[torch.dtype, ...]:
    """Input dtypes tried on a device.  bf16 only on GPUs: Triton's CPU interpreter mishandles it."""
    if device_type == "cpu":
        return (torch.float16, torch.float32)
    return (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Case:
    """One conformance test.  ``family``: numerics | nonfinite | refusal | merge | cuda_graph | skip | fail."""

    family: str
    id: str
    backend: Backend
    problem: Optional[AttentionProblem] = None
    device: str = "cpu"
    tag: str = ""  # shape tag: "", "edge", "tok1", "strided", "r<n>"...
    seed: int = 0
    note: str = ""  # skip/fail reason, or what a refusal probe varies

    def __repr__(self) -> str:  # pytest shows this on failure
        return f"<Case {self.family} {self.id}>"


def stable_seed(text: str, salt: int = 0) -> int:
    return (zlib.crc32(text.encode()) ^ (salt * 0x9E3779B1)) & 0x7FFFFFFF


def problem_id(backend_name: str, p: AttentionProblem, *, with_device: bool = False) -> str:
    parts = [backend_name, p.op]
    if with_device:
        parts.append(p.device_type)
    parts.append(dtype_name(p.q_dtype))
    if p.kv_dtype != p.q_dtype:
        parts.append("kv" + dtype_name(p.kv_dtype))
    if p.out_dtype != p.q_dtype:
        parts.append("out" + dtype_name(p.out_dtype))
    parts.append(dims_name(p.head_dim_qk, p.head_dim_vo))
    parts.append(f"g{p.group_size}")
    if p.page_size is not None:
        parts.append(f"p{p.page_size}")
    if p.kv_layout != "NHD":
        parts.append(p.kv_layout)
    parts.append(p.mask)
    if p.q_len_per_req != 1:
        parts.append(f"qlen{p.q_len_per_req}")
    parts += [FEATURE_TAGS.get(f, f) for f in sorted(p.features)]
    return "-".join(parts)


def num_kv_heads_for(group: int) -> int:
    return 2 if group <= 4 else 1


def with_group(p: AttentionProblem, group: int) -> AttentionProblem:
    hkv = num_kv_heads_for(group)
    return p.replace(num_kv_heads=hkv, num_qo_heads=hkv * group)


def with_feature(p: AttentionProblem, feature: str) -> AttentionProblem:
    if feature == "window":
        return p.replace(window_left=5)
    if feature == "soft_cap":
        return p.replace(soft_cap=True)
    if feature == "alibi":
        return p.replace(pos_encoding="ALIBI")
    if feature == "rope":
        return p.replace(pos_encoding="ROPE_LLAMA")
    return p.replace(**{feature: True})


def default_problem(op: str, device_type: str, cc=None) -> AttentionProblem:
    return AttentionProblem(
        op=op, device_type=device_type, compute_capability=cc, q_dtype=torch.float16, kv_dtype=torch.float16,
        out_dtype=torch.float16, num_qo_heads=2, num_kv_heads=2, head_dim_qk=128, head_dim_vo=128,
        page_size=16 if op in PAGED_OPS else None, kv_layout="NHD", mask="none")


def claims(backend: Backend, p: AttentionProblem) -> bool:
    return not backend.reasons(p)


def normalize(p: AttentionProblem) -> AttentionProblem:
    """Make a problem self-consistent and shaped like the API's: decode with q_len_per_req > 1 is
    causal (semantics.md), and the API plans every decode (xqa's spec mask included) as causal."""
    if p.op in DECODE_OPS and p.q_len_per_req > 1 and p.mask == "none" and not p.spec_mask:
        p = p.replace(mask="causal")
    if p.spec_mask and (p.op != "xqa_decode" or p.q_len_per_req < 2):
        p = p.replace(spec_mask=False)
    if p.spec_mask:
        p = p.replace(mask="causal")
    return p


def find_base(backend: Backend, op: str, device_type: str, cc, dtypes) -> Optional[AttentionProblem]:
    """The first claimed problem for ``op`` in a preference order, or None."""
    d0 = default_problem(op, device_type, cc)
    kv_opts = lambda qd: (qd,) + FP8_DTYPES  # noqa: E731
    pages = PAGE_SIZES if op in PAGED_OPS else (None,)
    qlens = (1, 2, 4) if op in DECODE_OPS else (1,)
    tries = 0
    dims = HEAD_DIMS if device_type != "cpu" else (64,) + tuple(x for x in HEAD_DIMS if x != 64)
    for qd in dtypes:
        for kd in kv_opts(qd):
            for d in dims:
                for layout in ("NHD", "HND"):
                    for mask in (("causal", "none", "custom") if op in DECODE_OPS else ("none", "causal", "custom")):
                        for page in pages:
                            for g in (1, 4, 2, 8):
                                for ql in qlens:
                                    tries += 1
                                    if tries > 20000:
                                        return None
                                    p = with_group(d0, g).replace(
                                        q_dtype=qd, kv_dtype=kd, out_dtype=qd, head_dim_qk=d, head_dim_vo=d,
                                        kv_layout=layout, mask=mask, page_size=page, q_len_per_req=ql)
                                    p = normalize(p)
                                    if claims(backend, p):
                                        return p
    return None


def find_pod_base(backend: Backend, op: str, device_type: str, cc, dtypes) -> Optional[AttentionProblem]:
    """The first claimed fused POD problem (``op``: pod or batch_pod) in a preference order: a causal prefill part
    (single prefill for pod, paged batch prefill for batch_pod) and a causal paged decode part, one query row each,
    sharing dtype, heads and head dim; or None."""
    prefill_op = "single_prefill" if op == "pod" else "batch_prefill_paged"
    dims = (64, 128, 32) if device_type == "cpu" else (128, 64)
    for qd in dtypes:
        for d in dims:
            for g in (4, 1):
                for mask in ("causal", "none"):
                    pp = with_group(default_problem(prefill_op, device_type, cc), g).replace(
                        q_dtype=qd, kv_dtype=qd, out_dtype=qd, head_dim_qk=d, head_dim_vo=d, mask=mask)
                    pd = pp.replace(op="batch_decode", page_size=16, mask="causal")
                    try:
                        p = pod_problem(op, pp, pd)
                    except ValueError:  # pragma: no cover - the parts agree by construction
                        continue
                    if claims(backend, p):
                        return p
    return None


def with_pod_lse(p: AttentionProblem) -> AttentionProblem:
    """A fused POD problem with both parts' LSEs."""
    return p.replace(return_lse=True, decode=p.decode.replace(return_lse=True))


def pod_graph_variants(base: AttentionProblem) -> List[AttentionProblem]:
    """CUDA-graph cases of a fused POD problem: the decode part in graph mode (as the POD wrapper plans it with
    ``use_cuda_graph``), plain, with both LSEs, and with each feature of ``POD_GRAPH_FEATURES`` in both parts."""
    pg = base.replace(decode=base.decode.replace(cuda_graph=True))
    out = [pg, with_pod_lse(pg)]
    for f in POD_GRAPH_FEATURES:
        out.append(with_feature(pg, f).replace(decode=with_feature(pg.decode, f)))
    return out


def _sweep(base: AttentionProblem, dtypes) -> List[Tuple[str, AttentionProblem]]:
    """One-axis variations of ``base``: (axis name, problem)."""
    out: List[Tuple[str, AttentionProblem]] = []
    for qd in dtypes:
        if qd != base.q_dtype:
            kd = base.kv_dtype if base.kv_dtype in FP8_DTYPES else qd
            out.append(("q_dtype", base.replace(q_dtype=qd, kv_dtype=kd, out_dtype=qd)))
    for kd in tuple(dtypes) + FP8_DTYPES:
        if kd != base.kv_dtype:
            out.append(("kv_dtype", base.replace(kv_dtype=kd)))
    for od in tuple(dtypes) + FP8_DTYPES:
        if od != base.out_dtype:
            out.append(("out_dtype", base.replace(out_dtype=od)))
    for d in HEAD_DIMS:
        if d != base.head_dim_qk:
            out.append(("head_dim", base.replace(head_dim_qk=d, head_dim_vo=d)))
    vo = 64 if base.head_dim_qk != 64 else 128
    out.append(("head_dim_vo", base.replace(head_dim_vo=vo)))
    out.append(("head_dim_vo", base.replace(head_dim_qk=192, head_dim_vo=128)))  # DeepSeek's prefill pair
    for g in GROUPS:
        if g != base.group_size:
            out.append(("group", with_group(base, g)))
    if base.page_size is not None:
        for ps in PAGE_SIZES:
            if ps != base.page_size:
                out.append(("page_size", base.replace(page_size=ps)))
    for layout in ("NHD", "HND"):
        if layout != base.kv_layout:
            out.append(("kv_layout", base.replace(kv_layout=layout)))
    for mask in ("none", "causal", "custom"):
        if mask != base.mask:
            out.append(("mask", base.replace(mask=mask)))
    for f in SWEPT_FEATURES:
        if f not in base.features:
            out.append((f, with_feature(base, f)))
    if base.op in DECODE_OPS:
        for ql in Q_LENS:
            if ql != base.q_len_per_req:
                out.append(("q_len_per_req", base.replace(q_len_per_req=ql)))
    if base.op == "xqa_decode":
        out.append(("spec_mask", base.replace(q_len_per_req=max(2, base.q_len_per_req), spec_mask=True)))
    return [(a, normalize(p)) for a, p in out]


def sweep_claims(backend: Backend, base: AttentionProblem, dtypes
                 ) -> Tuple[Dict[str, List[AttentionProblem]], List[Tuple[str, AttentionProblem]]]:
    """The one-axis variations of ``base``: per axis those the backend claims, and the refused ones
    as (axis, problem).  The suite computes the first and checks the refusal of the second; the
    fuzzer (``fuzz.py``) combines the first."""
    claimed: Dict[str, List[AttentionProblem]] = {}
    refused: List[Tuple[str, AttentionProblem]] = []
    for axis, p in _sweep(base, dtypes):
        if claims(backend, p):
            claimed.setdefault(axis, []).append(p)
        else:
            refused.append((axis, p))
    return claimed, refused


def _thin(values: Sequence, keep: int, rng: random.Random) -> List:
    """Quick mode: keep the first, the last and a random few of a claimed value list."""
    values = list(values)
    if len(values) <= keep:
        return values
    picked = [values[0], values[-1]]
    rest = values[1:-1]
    rng.shuffle(rest)
    return picked + rest[: keep - 2]


def pick_device(backend: Backend, forced: Optional[str] = None) -> Tuple[Optional[str], str]:
    """(device to test on: ``cpu``, ``cuda`` or a forced ``cuda:N``; or None), why."""
    claimed = set()
    for e in backend.capabilities:
        claimed |= set(e.devices)
    if forced:
        return forced, f"--attncore-device {forced}"
    if "cuda" in claimed and torch.cuda.is_available():
        return "cuda", "CUDA available and claimed"
    if "cpu" in claimed:
        return "cpu", "CPU claimed" + ("" if torch.cuda.is_available() else " (no CUDA device here)")
    return None, f"{backend.name} claims devices {sorted(claimed)}; none is present here"


def generate(backend: Backend, *, device: Optional[str] = None, full: bool = False,
             budget: Optional[int] = None, seed: int = 0, unavailable: Sequence = ()) -> Dict[str, List[Case]]:
    """All cases for ``backend``, grouped by family.  Deterministic for a given seed."""
    name = backend.name
    fams: Dict[str, List[Case]] = {"numerics": [], "nonfinite": [], "refusal": [], "merge": [], "cuda_graph": [],
                                   "pod": [], "skip": [], "fail": []}
    dev, why = pick_device(backend, device)
    rng = random.Random(stable_seed(name, seed))
    budget = budget if budget is not None else (FULL_BUDGET if full else DEFAULT_BUDGET)
    seen_ids: Dict[str, int] = {}

    def add(family: str, p: Optional[AttentionProblem], tag: str = "", note: str = "", cid: Optional[str] = None,
            with_device: bool = False):
        base_id = cid or problem_id(name, p, with_device=with_device)
        if tag:
            base_id += "-" + tag
        n = seen_ids.get((family, base_id), 0)
        seen_ids[(family, base_id)] = n + 1
        if n:
            base_id += f"-{n + 1}"
        fams[family].append(Case(family, base_id, backend, p, dev or "cpu", tag,
                                 stable_seed(family + base_id, seed), note))

    dev_type, cc = device_info(dev or "cpu")  # dev may name an index (cuda:1); problems speak of its type
    dtypes = float_dtypes(dev_type)
    claimed_ops = {op for e in backend.capabilities for op in e.ops}

    # Refusal of ops and devices (host-only checks: run everywhere).
    for op in OPS:
        if op not in claimed_ops:
            add("refusal", default_problem(op, dev_type, cc), note="op")
    for other in ("cpu", "cuda"):
        if other == dev_type:
            continue
        if not any(other in e.devices for e in backend.capabilities):
            op = sorted(claimed_ops)[0] if claimed_ops else "single_prefill"
            add("refusal", default_problem(op, other), note="device", with_device=True)

    if dev is None:
        add("skip", None, cid=f"{name}-no-device", note=why)
        return fams
    if unavailable:
        add("skip", None, cid=f"{name}-unavailable",
            note=f"{name} is unavailable here, nothing computed: " + "; ".join(map(str, unavailable)))
        return fams

    def nothing_claimed(op: str, tried: str) -> None:
        add("fail", None, cid=f"{name}-{op}-nothing-claimed",
            note=f"{name} lists op {op!r} but refuses every tried {op} problem on {dev} ({tried})")

    found_any = False
    for op in TESTED_OPS:
        if op not in claimed_ops:
            continue
        base = find_base(backend, op, dev_type, cc, dtypes)
        if base is None:
            nothing_claimed(op, f"dtypes {[dtype_name(d) for d in dtypes]}, head dims {HEAD_DIMS}, pages {PAGE_SIZES}")
            continue
        found_any = True
        numerics: List[Tuple[AttentionProblem, str]] = [(base, "")]
        axis_values, refused = sweep_claims(backend, base, dtypes)
        for axis, p in refused:
            add("refusal", p, note=axis)
        for axis, ps in axis_values.items():
            if not full and axis in ("head_dim", "group", "page_size", "q_len_per_req", "kv_dtype", "out_dtype"):
                ps = _thin(ps, 3, rng)
            numerics += [(p, "") for p in ps]
        # Edge shapes at the base problem, on every claimed mask, plus page_size 1 and strided views.
        masks = [base] + [p for p in axis_values.get("mask", [])]
        for p in masks:
            numerics.append((p, "edge"))
            pl = p.replace(return_lse=True)
            if pl != p and claims(backend, pl):
                numerics.append((pl, "edge"))
        numerics.append((base, "strided"))
        numerics.append((base, "tok1"))
        if base.page_size is not None:
            for p in axis_values.get("page_size", []):
                if p.page_size == 1:
                    numerics.append((p, "edge"))
        if base.op in DECODE_OPS:
            for p in axis_values.get("q_len_per_req", [])[:1]:
                numerics.append((p, "edge"))
        # Lengths at tile multiples and one off, with every claimed group that does not divide a tile.
        tile_mask = next((p.mask for p in masks if p.mask == "causal"), base.mask)
        for p in [base] + [p for p in axis_values.get("group", []) if p.group_size in ODD_GROUPS]:
            pt = normalize(p.replace(mask=tile_mask))
            if claims(backend, pt):
                numerics.append((pt, "tiles"))
        # Random multi-axis combinations of claimed values.
        pools = {axis: ps for axis, ps in axis_values.items()}
        claimed_features = [f for f in SWEPT_FEATURES if f in axis_values]
        made = 0
        for i in range(budget * 8):
            if made >= budget:
                break
            p = base
            for axis in ("q_dtype", "kv_dtype", "head_dim", "group", "page_size", "kv_layout", "mask",
                         "q_len_per_req"):
                opts = pools.get(axis)
                if opts and rng.random() < 0.5:
                    v = rng.choice(opts)
                    p = copy_axis(p, v, axis)
            for f in claimed_features:
                if rng.random() < 0.35:
                    p = with_feature(p, f)
            if base.op == "xqa_decode" and "spec_mask" in pools and rng.random() < 0.3:
                p = p.replace(spec_mask=True, q_len_per_req=max(2, p.q_len_per_req))
            p = normalize(p)
            if claims(backend, p):
                made += 1
                numerics.append((p, f"r{made}"))
        for p, tag in numerics:
            add("numerics", p, tag=tag)
        # Non-finite inputs (docs/semantics.md): NaN in one query row, and in the keys left of the
        # window of every row where a window is claimed (every case already poisons out-of-range keys).
        for p in [base] + axis_values.get("window", []):
            pl = p.replace(return_lse=True)
            add("nonfinite", pl if claims(backend, pl) else p, tag="nf")
        # LSE merging: split the keys, merge the two partial states, compare with the full golden.
        if op in ("single_prefill", "batch_prefill_ragged"):
            pm = base.replace(mask="none", return_lse=True, sinks=False)
            if claims(backend, pm):
                add("merge", pm)
        # CUDA graphs: the base problem, with LSE, and with each claimed feature, mask and KV dtype in turn
        # (issue 15: replay equals eager for every feature a backend claims in graph mode).
        pg = base.replace(cuda_graph=True)
        if claims(backend, pg):
            add("cuda_graph", pg, tag="edge")
            variants = [pg.replace(return_lse=True)]
            variants += [normalize(with_feature(pg, f)) for f in claimed_features if f != "return_lse"]
            variants += [p.replace(cuda_graph=True) for axis in ("mask", "kv_dtype") for p in axis_values.get(axis, [])]
            for pv in variants:
                if pv != pg and claims(backend, pv):
                    add("cuda_graph", pv, tag="edge")
    # Fused POD ops: both parts in one run, each checked as its own op is (plain, both LSEs, edge shapes).
    for op in POD_OPS:
        if op not in claimed_ops:
            continue
        base = find_pod_base(backend, op, dev_type, cc, dtypes)
        if base is None:
            nothing_claimed(op, f"causal or plain prefill beside a causal paged decode, dtypes "
                                f"{[dtype_name(d) for d in dtypes]}")
            continue
        found_any = True
        pl = with_pod_lse(base)
        for p, tag in ((base, ""), (pl, ""), (pl if claims(backend, pl) else base, "edge")):
            if claims(backend, p):
                add("pod", p, tag=tag)
        # CUDA graphs (the API's graph-mode POD plans its decode part so): plain, both LSEs, each feature in turn
        for p in pod_graph_variants(base):
            if claims(backend, p):
                add("cuda_graph", p, tag="edge")
    if not found_any and not unavailable:
        add("fail", None, cid=f"{name}-no-cases",
            note=f"{name} claims no op the conformance suite can run on {dev} "
                 f"(claimed ops: {sorted(claimed_ops) or 'none'})")
    for op in sorted(claimed_ops - set(TESTED_OPS) - set(POD_OPS)):
        add("skip", None, cid=f"{name}-{op}-untested", note=f"op {op!r} has no conformance cases yet")
    return fams


def copy_axis(p: AttentionProblem, src: AttentionProblem, axis: str) -> AttentionProblem:
    if axis == "q_dtype":
        kd = p.kv_dtype if p.kv_dtype in FP8_DTYPES else src.q_dtype
        return p.replace(q_dtype=src.q_dtype, out_dtype=src.q_dtype, kv_dtype=kd)
    if axis == "kv_dtype":
        return p.replace(kv_dtype=src.kv_dtype)
    if axis == "out_dtype":
        return p.replace(out_dtype=src.out_dtype)
    if axis == "head_dim":
        return p.replace(head_dim_qk=src.head_dim_qk, head_dim_vo=src.head_dim_vo)
    if axis == "head_dim_vo":
        return p.replace(head_dim_vo=src.head_dim_vo)
    if axis == "group":
        return p.replace(num_qo_heads=src.num_qo_heads, num_kv_heads=src.num_kv_heads)
    if axis == "page_size":
        return p.replace(page_size=src.page_size)
    if axis == "kv_layout":
        return p.replace(kv_layout=src.kv_layout)
    if axis == "mask":
        return p.replace(mask=src.mask)
    if axis == "q_len_per_req":
        return p.replace(q_len_per_req=src.q_len_per_req)
    return p
