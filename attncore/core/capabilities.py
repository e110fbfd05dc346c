"""What a backend declares it can do, as data, and the structured reasons for every refusal.

A backend lists one or more ``Capabilities`` entries (different ops often have different limits).
``check(entries, problem)`` returns the ``Reason``s that rule the problem out; an empty list means
the problem is claimed.  Backends may add reasons the schema cannot express (``extra_reasons``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch

from attncore.core.problem import OPS, PAGED_OPS, AttentionProblem, dtype_name

ANY = None  # an axis left as ANY accepts every value


@dataclass(frozen=True)
class Reason:
    """Why a backend refuses a problem (or is unavailable).

    axis: the problem axis (``head_dim``, ``q_dtype``, ``feature:sinks``, ``import``...).
    got: what the problem has.  supported: what the backend accepts.  hint: what the user can do.
    """

    axis: str
    got: str = ""
    supported: str = ""
    hint: str = ""

    def __str__(self) -> str:
        s = f"{self.axis}: got {self.got}" if self.got else self.axis
        if self.supported:
            s += f", supported {self.supported}"
        if self.hint:
            s += f" ({self.hint})"
        return s


def _names(values) -> str:
    out = []
    numeric = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    for v in sorted(values, key=lambda v: (0, v, "") if numeric(v) else (1, 0, str(v))):
        out.append(dtype_name(v) if isinstance(v, torch.dtype) else str(v))
    return ", ".join(out)


def _fmt(values) -> str:
    return "{" + _names(values) + "}"


@dataclass(frozen=True)
class Capabilities:
    """One capability entry.  Every axis set to ``None`` (ANY) accepts all values.

    ``features`` lists the feature flags (``attncore.core.problem.FEATURES``) served; a problem needing a
    feature outside it is refused.  ``head_dim_multiple`` and ``max_head_dim`` bound head dims when
    ``head_dims`` is ANY.  ``max_group_size`` bounds Hq // Hkv.
    """

    ops: FrozenSet[str]
    devices: FrozenSet[str] = frozenset({"cpu", "cuda"})
    min_compute_capability: Optional[Tuple[int, int]] = None
    max_compute_capability: Optional[Tuple[int, int]] = None
    q_dtypes: FrozenSet[torch.dtype] = frozenset({torch.float16, torch.bfloat16})
    kv_dtypes: FrozenSet[torch.dtype] = frozenset({torch.float16, torch.bfloat16})
    out_dtypes: Optional[FrozenSet[torch.dtype]] = ANY  # ANY: out dtype must equal q dtype
    head_dims: Optional[FrozenSet[int]] = ANY
    head_dim_multiple: int = 1
    max_head_dim: Optional[int] = None
    same_head_dim_vo: bool = True  # head_dim_vo must equal head_dim_qk
    max_group_size: Optional[int] = None
    page_sizes: Optional[FrozenSet[int]] = ANY
    layouts: FrozenSet[str] = frozenset({"NHD", "HND"})
    masks: FrozenSet[str] = frozenset({"none", "causal", "custom"})
    features: FrozenSet[str] = frozenset()
    max_q_len_per_req: Optional[int] = None
    kv_dtype_must_match_q: bool = False  # kv dtype == q dtype unless kv is fp8

    def head_dims_text(self) -> str:
        """The head dims served, in words (refusals and ``attncore info``)."""
        if self.head_dims is not ANY:
            return _names(self.head_dims)
        text = f"multiples of {self.head_dim_multiple}" if self.head_dim_multiple > 1 else ""
        if self.max_head_dim:
            text += (" " if text else "") + f"up to {self.max_head_dim}"
        return text or "any"

    def reasons(self, p: AttentionProblem) -> List[Reason]:
        r: List[Reason] = []
        if p.device_type not in self.devices:
            r.append(Reason("device", p.device_type, _fmt(self.devices)))
        if p.device_type == "cuda" and p.compute_capability is not None:
            cc = tuple(p.compute_capability)
            if self.min_compute_capability and cc < tuple(self.min_compute_capability):
                r.append(Reason("compute_capability", "sm%d%d" % cc,
                                ">= sm%d%d" % tuple(self.min_compute_capability)))
            if self.max_compute_capability and cc > tuple(self.max_compute_capability):
                r.append(Reason("compute_capability", "sm%d%d" % cc,
                                "<= sm%d%d" % tuple(self.max_compute_capability)))
        if p.q_dtype not in self.q_dtypes:
            r.append(Reason("q_dtype", dtype_name(p.q_dtype), _fmt(self.q_dtypes)))
        if p.kv_dtype not in self.kv_dtypes:
            r.append(Reason("kv_dtype", dtype_name(p.kv_dtype), _fmt(self.kv_dtypes)))
        elif self.kv_dtype_must_match_q and p.kv_dtype != p.q_dtype and p.kv_dtype.itemsize != 1:
            r.append(Reason("kv_dtype", dtype_name(p.kv_dtype), f"same as q ({dtype_name(p.q_dtype)}) or fp8"))
        if self.out_dtypes is ANY:
            if p.out_dtype != p.q_dtype:
                r.append(Reason("out_dtype", dtype_name(p.out_dtype), f"same as q ({dtype_name(p.q_dtype)})"))
        elif p.out_dtype not in self.out_dtypes:
            r.append(Reason("out_dtype", dtype_name(p.out_dtype), _fmt(self.out_dtypes)))
        for name, d in (("head_dim", p.head_dim_qk),) + ((("head_dim_vo", p.head_dim_vo),) if p.head_dim_vo != p.head_dim_qk else ()):
            if self.head_dims is not ANY:
                if d not in self.head_dims:
                    r.append(Reason(name, str(d), _fmt(self.head_dims)))
            else:
                bad = d % self.head_dim_multiple != 0 or (self.max_head_dim and d > self.max_head_dim)
                if bad:
                    r.append(Reason(name, str(d), self.head_dims_text()))
        if self.same_head_dim_vo and p.head_dim_vo != p.head_dim_qk:
            r.append(Reason("head_dim_vo", str(p.head_dim_vo), f"equal to head_dim_qk ({p.head_dim_qk})"))
        if self.max_group_size is not None and p.group_size > self.max_group_size:
            r.append(Reason("group_size", str(p.group_size), f"<= {self.max_group_size}"))
        if p.page_size is not None and self.page_sizes is not ANY and p.page_size not in self.page_sizes:
            r.append(Reason("page_size", str(p.page_size), _fmt(self.page_sizes)))
        if p.kv_layout not in self.layouts:
            r.append(Reason("kv_layout", p.kv_layout, _fmt(self.layouts)))
        if p.mask not in self.masks:
            r.append(Reason("mask", p.mask, _fmt(self.masks)))
        for f in sorted(p.features - self.features):
            r.append(Reason("feature:" + f, "requested", "not implemented by this backend"))
        if self.max_q_len_per_req is not None and p.q_len_per_req > self.max_q_len_per_req:
            r.append(Reason("q_len_per_req", str(p.q_len_per_req), f"<= {self.max_q_len_per_req}"))
        if p.decode is not None:  # a POD problem: the decode part's own axes (shared ones checked above)
            seen = {(x.axis, x.got) for x in r}
            for x in self.reasons(p.decode.replace(decode=None)):
                if (x.axis, x.got) not in seen:
                    r.append(replace(x, axis="decode " + x.axis))
        return r


def check(entries: Sequence[Capabilities], problem: AttentionProblem) -> List[Reason]:
    """Reasons the problem is refused by every entry claiming its op.

    The reasons shown are those of the entries for the problem's device (fewest reasons first):
    a backend whose CUDA entry claims bf16 and whose CPU entry does not refuses bf16 on the CPU
    for its dtype, not for the device.  They say which device they are for when the backend has
    entries for other devices too.
    """
    claiming = [e for e in entries if problem.op in e.ops]
    if not claiming:
        all_ops = sorted({op for e in entries for op in e.ops})
        return [Reason("op", problem.op, _fmt(all_ops))]
    here = [e for e in claiming if problem.device_type in e.devices]
    best: Optional[List[Reason]] = None
    for e in here or claiming:
        rs = e.reasons(problem)
        if not rs:
            return []
        if best is None or len(rs) < len(best):
            best = rs
    if here and len(here) < len(claiming):
        on = f" on {problem.device_type}"
        best = [replace(r, supported=r.supported + on) if r.supported else r for r in best]
    return best or []


def summarize(entries: Iterable[Capabilities]) -> List[str]:
    """Two readable lines per entry (ops and devices; what they accept), for ``attncore info``."""
    lines = []
    for e in entries:
        where = _names(e.devices)
        if e.min_compute_capability and e.max_compute_capability:
            where += " sm%d%d" % tuple(e.min_compute_capability) + " to sm%d%d" % tuple(e.max_compute_capability)
        elif e.min_compute_capability:
            where += " sm%d%d+" % tuple(e.min_compute_capability)
        elif e.max_compute_capability:
            where += " up to sm%d%d" % tuple(e.max_compute_capability)
        ops = [op for op in OPS if op in e.ops] + sorted(e.ops - set(OPS))
        accepts = [f"q dtypes: {_names(e.q_dtypes)}", f"kv dtypes: {_names(e.kv_dtypes)}",
                   f"head dims: {e.head_dims_text()}"]
        if e.ops & set(PAGED_OPS):  # page sizes mean nothing to a backend without a paged op
            accepts.append("page sizes: " + ("any" if e.page_sizes is ANY else _names(e.page_sizes)))
        accepts += [f"masks: {_names(e.masks)}", "features: " + (_names(e.features) or "none")]
        lines += [f"{', '.join(ops)} on {where}:", "  " + "; ".join(accepts)]
    return lines
