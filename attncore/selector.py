"""Choosing a backend for a problem, and explaining the choice.

``auto``: the candidates are the available backends that give no reason to refuse; the one with
the highest ``priority(problem)`` wins (ties: name order, so the choice is stable).

``ATTNCORE_BACKEND`` (used when the caller passes ``backend="auto"``): one name forces that
backend; a comma-separated list orders the candidates (listed ones first, in list order).
An explicit ``backend=`` argument always wins over the environment.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from . import registry
from .backend import Backend
from .capabilities import Reason
from .problem import AttentionProblem

log = logging.getLogger("attncore")


class BackendSelectionError(ValueError):
    """No backend can serve the problem (or the forced one refuses).  ``reasons`` maps names to
    their reasons."""

    def __init__(self, message: str, reasons: Dict[str, List[Reason]]):
        super().__init__(message)
        self.reasons = reasons


@dataclass
class Explanation:
    """The outcome of selection: the choice, the ranked alternatives, and every refusal."""

    problem: AttentionProblem
    requested: str
    chosen: Optional[str]
    ranked: List[Tuple[str, int]] = field(default_factory=list)  # (name, priority), best first
    refused: Dict[str, List[Reason]] = field(default_factory=dict)
    unavailable: Dict[str, List[Reason]] = field(default_factory=dict)
    note: str = ""

    def __str__(self) -> str:
        lines = [f"problem: {self.problem.describe()}", f"requested: {self.requested}"]
        if self.note:
            lines.append(f"note: {self.note}")
        lines.append(f"chosen: {self.chosen or 'none'}")
        for name, prio in self.ranked:
            mark = "*" if name == self.chosen else " "
            lines.append(f"  {mark} {name} (priority {prio})")
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


def explain(problem: AttentionProblem, backend: str = "auto") -> Explanation:
    """Rank every backend for ``problem`` and say why the others refuse.  Never raises."""
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
    ex = Explanation(problem, requested or "auto", None, note=note)
    candidates: List[Tuple[int, int, str]] = []
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
        try:
            prio = int(entry.backend.priority(problem))
        except Exception:
            prio = 0
        rank = order.index(name) if name in order else len(order)
        candidates.append((rank, -prio, name))
    if forced is not None and forced not in registry.entries():
        ex.unavailable[forced] = [Reason("name", forced, ", ".join(sorted(registry.entries())),
                                         "not a known backend")]
    candidates.sort()
    ex.ranked = [(name, -negprio) for _, negprio, name in candidates]
    ex.chosen = ex.ranked[0][0] if ex.ranked else None
    return ex


_logged: set = set()
_cache: Dict[tuple, Backend] = {}


def select(problem: AttentionProblem, backend: str = "auto") -> Backend:
    """The backend to use, or ``BackendSelectionError`` listing every reason.  Cached per
    (problem, backend, ATTNCORE_BACKEND, registry generation) so per-call APIs stay cheap."""
    key = (problem, backend, os.environ.get("ATTNCORE_BACKEND"), registry.generation())
    hit = _cache.get(key)
    if hit is not None:
        return hit
    b = _select(problem, backend)
    _cache[key] = b
    return b


def _select(problem: AttentionProblem, backend: str) -> Backend:
    ex = explain(problem, backend)
    if ex.chosen is None:
        reasons = {**ex.unavailable, **ex.refused}
        if backend not in (None, "auto") or ex.note.startswith("forced"):
            name = registry.canonical_name(backend) if backend not in (None, "auto") else _env_order()[0]
            rs = reasons.get(name, [])
            raise BackendSelectionError(
                f"backend {name!r} cannot run {problem.describe()}: " + "; ".join(map(str, rs)), reasons)
        detail = "; ".join(f"{n}: " + ", ".join(map(str, rs)) for n, rs in sorted(reasons.items()))
        raise BackendSelectionError(f"no backend can run {problem.describe()}. {detail}", reasons)
    key = (problem, backend)
    if key not in _logged:
        _logged.add(key)
        log.info("attncore: %s -> backend %s (candidates: %s)", problem.describe(), ex.chosen,
                 ", ".join(n for n, _ in ex.ranked))
    return registry.entries()[ex.chosen].backend
