"""Choosing a backend for a problem, and explaining the choice.

``auto``: the candidates are the available backends that give no reason to refuse; they are ordered
by ``attncore.core.ranking``: by the times ``attncore tune`` measured where a table has data for the
problem's class (fastest first; times within ``ranking.MEASURED_TIE`` of the fastest are a tie, which the rule
table orders; unmeasured candidates after them), elsewhere by the rule table (the
highest rank first; backends the table does not know rank by their own ``priority(problem)``).  Ties:
name order, so the choice is stable.  ``ATTNCORE_TUNE=0`` turns the measured ranking off.

``sizes`` (``tables.Sizes``: batch, longest query, longest KV, as ``plan()`` knows them): the measured
ranking uses the class's entry at the sizes' bucket, or the nearest one(s) (``ranking.Measured.narrow``);
without it, the geometric mean over every bucket of the class.  Selection is cached per bucket, not
per raw lengths, so a re-plan at other lengths of the same bucket is one lookup.

``ATTNCORE_BACKEND`` (used when the caller passes ``backend="auto"``): one name forces that
backend; a comma-separated list orders the candidates (listed ones first, in list order).
An explicit ``backend=`` argument always wins over the environment.
"""

from __future__ import annotations

import logging
import os
import textwrap
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from attncore.core import ranking
from attncore.core import registry
from attncore.core import tables
from attncore.core.backend import Backend
from attncore.core.capabilities import Reason
from attncore.core.problem import AttentionProblem

log = logging.getLogger("attncore")


class BackendSelectionError(ValueError):
    """No backend can serve the problem (or the forced one refuses).  ``reasons`` maps names to
    their reasons."""

    def __init__(self, message: str, reasons: Dict[str, List[Reason]]):
        super().__init__(message)
        self.reasons = reasons


@dataclass
class Explanation:
    """The outcome of selection: the choice, the ranked alternatives with what ranked each, and
    every refusal."""

    problem: AttentionProblem
    requested: str
    chosen: Optional[str]
    ranked: List[Tuple[str, int]] = field(default_factory=list)  # (name, rank by rule or priority()), best first
    refused: Dict[str, List[Reason]] = field(default_factory=dict)
    unavailable: Dict[str, List[Reason]] = field(default_factory=dict)
    note: str = ""
    ranking: str = "rules"  # "rules" (attncore.core.ranking.RULES / priority()) or "measured" (attncore tune)
    source: str = ""  # the measured table used, or why none applies
    details: Dict[str, List[str]] = field(default_factory=dict)  # per ranked backend: why it is there
    sizes: Optional[object] = None  # the sizes hint as given (tables.Sizes or tables.Bucket), None: none
    bucket: Optional["tables.Bucket"] = None  # its bucket
    decided: str = ""  # which measured bucket(s) decided (ranking.Measured.how)

    def __str__(self) -> str:
        lines = [f"problem: {self.problem.describe()}", f"requested: {self.requested}"]
        if self.note:
            lines.append(f"note: {self.note}")
        if self.bucket is not None:
            at = self.sizes.describe() + " -> " if isinstance(self.sizes, tables.Sizes) else ""
            lines.append(f"sizes: {at}bucket {self.bucket.describe()}")
        if self.ranking == "measured":
            lines.append(f"ranking: measured times, fastest first; from the {self.source}")
            lines.append(f"decided by: {self.decided}")
        else:
            lines.append("ranking: rule table (attncore/core/ranking.py), highest rank first"
                         + (f"; measured times: {self.source}" if self.source else ""))
        lines.append(f"chosen: {self.chosen or 'none'}")
        for name, prio in self.ranked:
            mark = "*" if name == self.chosen else " "
            detail = self.details.get(name) or [""]
            lines.append(f"  {mark} {name} (priority {prio})" + (f": {detail[0]}" if detail[0] else ""))
            for d in detail[1:]:
                lines += textwrap.wrap(d, 110, initial_indent="        ", subsequent_indent="          ")
        for name, rs in sorted(self.refused.items()):
            lines.append(f"  refused by {name}:")
            lines += [f"    - {r}" for r in rs]
        for name, rs in sorted(self.unavailable.items()):
            lines.append(f"  unavailable {name}: " + "; ".join(map(str, rs)))
        return "\n".join(lines)


def _env_order() -> List[str]:
    raw = os.environ.get("ATTNCORE_BACKEND", "").strip()
    if not raw or raw == "auto":
        return []
    return [registry.canonical_name(x) for x in raw.split(",") if x.strip()]


def explain(problem: AttentionProblem, backend: str = "auto", sizes=None) -> Explanation:
    """Rank every backend for ``problem`` (planned at ``sizes``: a ``tables.Sizes`` or ``tables.Bucket``,
    or None) and say why the others refuse.  Never raises, but for a ``sizes`` of another type."""
    bucket = tables.bucket_of(problem.op, sizes)
    requested = backend
    forced: Optional[str] = None
    order: List[str] = []
    note = ""
    if backend not in (None, "auto"):
        forced = registry.canonical_name(backend)
    else:
        order = _env_order()
        if len(order) == 1:
            forced = order[0]
            note = f"forced by ATTNCORE_BACKEND={forced}"
        elif order:
            note = "ordered by ATTNCORE_BACKEND=" + ",".join(order)
    ex = Explanation(problem, requested or "auto", None, note=note, sizes=sizes, bucket=bucket)
    found: List[Tuple[str, Backend]] = []
    for name, entry in sorted(registry.entries().items()):
        if forced is not None and name != forced:
            continue
        un = entry.unavailable_reasons()
        if un:
            ex.unavailable[name] = un
            continue
        try:
            rs = list(entry.backend.reasons(problem))
        except Exception as e:  # a buggy plugin refuses rather than breaking selection
            rs = [Reason("reasons", f"{type(e).__name__}: {e}", hint="backend raised in reasons()")]
        if rs:
            ex.refused[name] = rs
            continue
        found.append((name, entry.backend))
    if forced is not None and forced not in registry.entries():
        ex.unavailable[forced] = [Reason("name", forced, ", ".join(sorted(registry.entries())),
                                         "not a known backend")]
    rules = {name: ranking.rule_rank(b, problem) for name, b in found}
    meas, ex.source = (None, "") if forced is not None else ranking.measured(problem)
    if meas is not None:
        meas = meas.narrow(bucket, [name for name, _ in found])
    scores = {name: meas.score(name) for name, _ in found} if meas else {}
    if meas is not None and not any(v is not None for v in scores.values()):
        where = "bucket" if bucket is None else "deciding bucket (" + meas.how + ")"
        ex.source = f"{meas.table.describe()}: no candidate measured in every {where} of {meas.key.describe()}"
        meas = None
    ex.ranking = "measured" if meas is not None else "rules"
    if meas is not None:
        ex.source += f"; {len(meas.entries)} bucket(s) of {meas.key.describe()}"
        ex.decided = meas.how
    best = min((v for v in scores.values() if v is not None), default=None)
    candidates: List[Tuple[int, int, float, float, str]] = []
    for name, _ in found:
        rank = order.index(name) if name in order else len(order)
        score = scores.get(name)
        if score is not None and ranking.ties(score, best):  # a tie with the fastest: by rule
            candidates.append((rank, 0, -rules[name].rank, score, name))
        elif score is not None:
            candidates.append((rank, 1, score, 0, name))
        else:
            candidates.append((rank, 2, -rules[name].rank, 0, name))
    candidates.sort()
    ex.ranked = [(name, rules[name].rank) for *_, name in candidates]
    ex.chosen = ex.ranked[0][0] if ex.ranked else None
    for name, _ in ex.ranked:
        ex.details[name] = _detail(rules[name], meas, name, scores.get(name), best)
    if problem.decode is not None:
        ex.note = (ex.note + "; " if ex.note else "") + _pod_note(problem, backend, ex)
    return ex


def _pod_note(problem: AttentionProblem, backend: str, ex: Explanation) -> str:
    """What the POD wrappers do with this choice: they compose the parts (each chosen on its own)
    when no backend claims the fused op, when auto's pick ranks below the reference, or when the pick's
    plan() declines a batch it estimates would not gain (the wrapper's ``fused_reason`` says which); composed
    parts run at the same time on two CUDA streams where they can (the wrapper's ``mode``)."""
    from attncore.core.problem import pod_parts

    names = [f"{label} -> {explain(p, backend).chosen or 'none'}"
             for label, p in zip(("prefill", "decode"), pod_parts(problem))]
    if ex.chosen is None:
        head = f"no backend claims {problem.op}: the wrappers compose the parts"
    elif backend in (None, "auto") and ex.ranked and ex.ranked[0][1] < 0:
        head = f"{ex.chosen} ranks below the reference here: auto composes the parts"
    else:
        head = (f"fused by {ex.chosen} where its plan() estimates a gain; otherwise (see the wrapper's "
                f"fused_reason) the parts are composed")
    tail = ("; composed parts run at the same time on disjoint SMs where the split's model says it gains (sm_90, "
            "overlap='auto'; always with overlap='sm_split'; attncore.core.streams.choose_split) or with the decode "
            "on a side CUDA stream (overlap='streams'), when the float workspace holds both, else one after the "
            "other (the wrapper's mode, sm_split and overlap_reason say how the last run ran)")
    return head + " (" + ", ".join(names) + ")" + tail


def _fmt_ms(t: float) -> str:
    return f"{t:.4g} ms"


def _detail(rr: "ranking.RuleRank", meas: Optional["ranking.Measured"], name: str, score: Optional[float],
            best: Optional[float]) -> List[str]:
    """What ranked a backend: its measured times, or its rule with the evidence."""
    if meas is not None and score is not None:
        rel = "fastest" if score == best else f"{score / best:.2f}x the fastest"
        if score != best and ranking.ties(score, best):
            rel += f"; within {ranking.MEASURED_TIE:.0%}: a tie, which the rule table orders"
        lines = [f"measured {_fmt_ms(score)} ({rel})" + (f"; by rule it would rank {rr.rank} ({rr.rule.id})"
                                                          if rr.rule is not None else "")]
        if len(meas.deciding) > 1:
            lines[0] = lines[0].replace("measured ", "measured, geometric mean over the buckets, ", 1)
        lines += [f"{meas.bucket(e)}: {_fmt_ms(t)}" for e, t in zip(meas.deciding, meas.times(name))]
        return lines
    lines = []
    if meas is not None:
        why = meas.failure(name)
        got = sum(t is not None for t in meas.times(name))
        state = (f"measured in {got} of {len(meas.deciding)} deciding buckets" if got else
                 "not measured for this class") + (f" ({why})" if why else "")
        lines.append(f"{state}: after the measured ones, by {rr.describe()}")
    else:
        lines.append(rr.describe())
    if rr.rule is not None:
        lines.append(f"evidence: {rr.rule.evidence}")
    for r, why in rr.passed_over:
        lines.append(f"not rule {r.id} ({r.rank}): {r.fast_path.kernel} does not serve it: {why}")
    return lines


_logged: set = set()
_cache: Dict[tuple, Backend] = {}
_chosen: Dict[tuple, Tuple[str, Backend]] = {}

# os.environ.get costs ~1 us (it encodes the key); its live backing dict, where CPython has one, ~50 ns
_ENV_KEYS = ("ATTNCORE_BACKEND", "ATTNCORE_DISABLE_BACKENDS", "ATTNCORE_TUNE", "ATTNCORE_CACHE_DIR")
_ENV_DATA = getattr(os.environ, "_data", None)
if isinstance(_ENV_DATA, dict) and all(isinstance(k, bytes) for k in list(_ENV_DATA)[:1]):
    _ENV_KEYS_RAW = tuple(os.fsencode(k) for k in _ENV_KEYS)
else:  # another platform's os.environ: the plain lookup
    _ENV_DATA, _ENV_KEYS_RAW = os.environ, _ENV_KEYS


def env_key() -> tuple:
    """What selection reads beyond the problem: the environment and the registry and ranking generations
    (a registered backend, a changed ATTNCORE_BACKEND or a new tune table changes it)."""
    g = _ENV_DATA.get
    return (g(_ENV_KEYS_RAW[0]), g(_ENV_KEYS_RAW[1]), g(_ENV_KEYS_RAW[2]), g(_ENV_KEYS_RAW[3]),
            registry.generation(), tables.generation())


def select(problem: AttentionProblem, backend: str = "auto", sizes=None) -> Backend:
    """The backend to use, or ``BackendSelectionError`` listing every reason.  Cached per
    (problem, backend, the bucket of ``sizes``, ``env_key()``) so per-call APIs stay cheap."""
    bucket = tables.bucket_of(problem.op, sizes)
    key = (problem, backend, bucket, env_key())
    hit = _cache.get(key)
    if hit is not None:
        return hit
    b = _select(problem, backend, bucket)
    if len(_cache) > 4096:
        _cache.clear()
    _cache[key] = b
    return b


def choose(problem: AttentionProblem, backend, sizes=None) -> Tuple[str, Backend]:
    """(``registry.resolve(backend)``, ``select(problem, that, sizes)``) for ``backend=`` as an entry point
    got it, cached per (problem, backend, the bucket of ``sizes``, ``env_key()``): plan()'s selection of a
    seen signature and bucket is one lookup.  Errors (an unknown name, no backend) are raised every time,
    never cached."""
    bucket = tables.bucket_of(problem.op, sizes)
    key = (problem, backend, bucket, env_key())
    hit = _chosen.get(key)
    if hit is None:
        requested = "auto" if backend is None or backend == "auto" else registry.resolve(backend)
        hit = (requested, select(problem, requested, bucket))
        if len(_chosen) > 4096:
            _chosen.clear()
        _chosen[key] = hit
    return hit


def _select(problem: AttentionProblem, backend: str, bucket: Optional["tables.Bucket"] = None) -> Backend:
    ex = explain(problem, backend, bucket)
    if ex.chosen is None:
        reasons = {**ex.unavailable, **ex.refused}
        if backend not in (None, "auto") or ex.note.startswith("forced"):
            name = registry.canonical_name(backend) if backend not in (None, "auto") else _env_order()[0]
            rs = reasons.get(name, [])
            raise BackendSelectionError(
                f"backend {name!r} cannot run {problem.describe()}: " + "; ".join(map(str, rs)), reasons)
        detail = "; ".join(f"{n}: " + ", ".join(map(str, rs)) for n, rs in sorted(reasons.items()))
        raise BackendSelectionError(f"no backend can run {problem.describe()}. {detail}", reasons)
    key = (problem, backend, bucket, ex.chosen)  # logged again when the choice changes (a new table, a plugin)
    if key not in _logged:
        _logged.add(key)
        log.info("attncore: %s -> backend %s (candidates: %s; %s)", problem.describe(), ex.chosen,
                 ", ".join(n for n, _ in ex.ranked),
                 f"measured, {ex.decided}" if ex.ranking == "measured" else "by rule")
    return registry.entries()[ex.chosen].backend
