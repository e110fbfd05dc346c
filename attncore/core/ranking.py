"""How ``backend="auto"`` orders the backends that can serve a problem: one rule table, with the
measurement behind each row, and the measured tables that ``attncore tune`` writes
(``attncore.core.tables``: where they live, how they are read, the buckets).

Rule table
----------
``RULES`` ranks the backends attncore ships (the built-in ``reference``, ``triton``, ``cuda_fa2``,
``xqa`` and the ``plugins/attncore-sdpa`` plugin).  A row is (backend, rank, conditions, evidence):

* the conditions are data: ops, device types, exact compute capabilities or a minimum one, features
  the problem must not need, and optionally a *fast path*: the name of a method of the backend
  object that says whether the backend's fast kernel serves the problem (called through the object,
  so the backend stays the one place that knows what its kernel does);
* the evidence is the measurement behind the rank (device, date, figures, where the raw data is), or
  says that the rank is a policy that nothing measured.

A backend's rank is that of its first row (in table order) whose conditions hold; every backend has
a last row without conditions.  Higher ranks come first; the reference backend is 0.  The ranks are
on the scale of ``Backend.priority()``: a backend the table does not know (a third-party plugin, an
object registered by hand) is ranked by its own ``priority()`` on the same scale.  The table is
authoritative for the backends it knows: their ``priority()`` methods are not called.  A row applies
to a backend object only when its name matches and its class comes from the package that ships it
(``OWNERS``), so another plugin that happens to call itself ``triton`` keeps its own ``priority()``.

Measured selection
------------------
Where a table holds data for the problem's class (``tables.problem_class``), the measured candidates
come first, fastest first, except that times within ``MEASURED_TIE`` (3%) of the fastest are a tie, ordered
by rule; candidates without a measurement follow, in rule order.  Elsewhere the rule table decides.  Which of
the class's entries (one per ``tables.Bucket``) decide:

* with planned sizes (``selector.choose(problem, backend, sizes)``, ``tables.Sizes``): the entry of the
  sizes' own bucket when a candidate was measured there; otherwise the nearest bucket(s) among those
  where a candidate was measured: the same shape bucket first, then the fewest length buckets away,
  then the fewest batch buckets away (``Bucket.distance``); buckets at an equal distance (one shorter,
  one longer) decide together, by the geometric mean of their times;
* without sizes: every bucket of the class, by the geometric mean of a candidate's times.

Either way a candidate is ranked by time only when it was measured in every deciding bucket.
``attncore explain --sizes B,QO,KV`` prints the deciding bucket(s) and the times behind them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

from attncore.core.problem import AttentionProblem
from attncore.core.tables import Bucket, ProblemClass, Table, enabled, entry_bucket, problem_class, tables_for

log = logging.getLogger("attncore")

# The package that ships each backend the table ranks: a row applies to a backend object only when
# its class is defined in that package.
OWNERS: Dict[str, str] = {
    "reference": "attncore.reference",
    "triton": "attncore.backends.triton",
    "cuda_fa2": "attncore.backends.cuda_fa2",
    "xqa": "attncore.backends.xqa",
    "sdpa": "attncore_sdpa",
}

H100 = "NVIDIA H100 80GB HBM3"

# ---------------------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Evidence:
    """Why a row has its rank.  ``device`` None: nothing was measured (a policy)."""

    figures: str
    device: Optional[str] = None
    date: Optional[str] = None
    source: str = ""

    @property
    def measured(self) -> bool:
        return self.device is not None

    def __str__(self) -> str:
        if not self.measured:
            return f"not measured: {self.figures}"
        where = f" ({self.source})" if self.source else ""
        return f"{self.device}, {self.date}{where}: {self.figures}"


@dataclass(frozen=True)
class FastPath:
    """A method of the backend object, called with the problem, saying whether the backend's fast
    kernel serves it: ``returns="bool"`` (true: it does) or ``"reasons"`` (a list of reasons why
    not; empty: it does)."""

    method: str
    returns: str
    kernel: str  # what the fast path is, in words

    def check(self, backend, problem: AttentionProblem) -> Tuple[bool, str]:
        """(served, why not)."""
        fn = getattr(backend, self.method, None)
        if fn is None:
            return False, f"{type(backend).__name__} has no {self.method}()"
        try:
            got = fn(problem)
        except Exception as e:  # a bug in the predicate ranks lower, never breaks selection
            return False, f"{self.method}() raised {type(e).__name__}: {e}"
        if self.returns == "reasons":
            got = list(got or ())
            return (not got), ", ".join(map(str, got))
        return bool(got), f"{self.method}() is false"


@dataclass(frozen=True)
class Rule:
    id: str
    backend: str
    rank: int
    evidence: Evidence
    ops: Optional[FrozenSet[str]] = None
    devices: Optional[FrozenSet[str]] = None
    compute_capabilities: Optional[FrozenSet[Tuple[int, int]]] = None  # exact
    min_compute_capability: Optional[Tuple[int, int]] = None
    without_features: FrozenSet[str] = frozenset()
    fast_path: Optional[FastPath] = None

    def conditions(self) -> str:
        parts = []
        if self.ops is not None:
            parts.append(", ".join(sorted(self.ops)))
        if self.devices is not None:
            parts.append("/".join(sorted(self.devices)))
        if self.compute_capabilities is not None:
            parts.append("/".join("sm%d%d" % cc for cc in sorted(self.compute_capabilities)))
        if self.min_compute_capability is not None:
            parts.append("sm%d%d+" % self.min_compute_capability)
        if self.without_features:
            parts.append("without " + ", ".join(sorted(self.without_features)))
        if self.fast_path is not None:
            parts.append(f"{self.fast_path.kernel} serves it ({self.fast_path.method})")
        return "; ".join(parts) or "any problem"

    def static_match(self, problem: AttentionProblem) -> bool:
        """The conditions other than the fast path."""
        cc = tuple(problem.compute_capability) if problem.compute_capability is not None else None
        if self.ops is not None and problem.op not in self.ops:
            return False
        if self.devices is not None and problem.device_type not in self.devices:
            return False
        if self.compute_capabilities is not None and cc not in self.compute_capabilities:
            return False
        if self.min_compute_capability is not None and (cc is None or cc < self.min_compute_capability):
            return False
        return not (self.without_features & problem.features)


_PREFILL_DENSE = frozenset({"single_prefill", "batch_prefill_ragged"})
_PREFILL = _PREFILL_DENSE | {"batch_prefill_paged"}
_CUDA = frozenset({"cuda"})
_SM90 = frozenset({(9, 0)})

TRITON_DENSE = FastPath("_dense_serves", "bool", "Triton's Hopper dense prefill kernel")
FA2_PREFILL90 = FastPath("_problem_sm90_reasons", "reasons", "cuda_fa2's Hopper prefill kernel (prefill90)")

# Per backend, the first row whose conditions hold gives the rank: specific rows first, each
# backend's last row without conditions.  Ranks: higher first, the reference 0 (priority()'s scale).
RULES: Tuple[Rule, ...] = (
    # ---- xqa
    Rule("xqa/sm90", "xqa", 70, devices=_CUDA, compute_capabilities=_SM90, evidence=Evidence(
        "decode: D1 0.368 ms (96% of read) vs Triton 0.373 (95%) and cuda_fa2 0.377 (94%); D5 fp8 KV "
        "0.204 ms (87%) vs 0.228 (78%) and 0.330 (54%); X1 q_len 1 through the xqa function 0.718 ms "
        "(99%) vs Triton 0.888 (80%). (xqa's priority() had no comment: these are the integrated-run "
        "figures that BENCHMARKS.md gives for 'decode goes to xqa on sm_90'.) xqa serves only decode ops",
        H100, "2026-11-22", "BENCHMARKS.md section 1, session 4; benchmarks/results/integrated-h100-2026-11-22-s4.json")),
    Rule("xqa/cuda", "xqa", 40, devices=_CUDA, evidence=Evidence(
        "no GPU other than the H100 was measured; equal to cuda_fa2's FA2 kernel (40), below Triton (50)")),
    Rule("xqa/other", "xqa", 0, evidence=Evidence("CUDA only: it refuses other devices; equal to the reference")),
    # ---- sdpa plugin (plugins/attncore-sdpa)
    Rule("sdpa/sm80-no-lse", "sdpa", 55, devices=_CUDA, min_compute_capability=(8, 0),
         without_features=frozenset({"return_lse"}), evidence=Evidence(
             "cuDNN / flash SDPA is among the fastest dense prefill kernels on sm80+ (cuDNN on Hopper): P1 "
             "causal 0.286 ms, 481 TFLOP/s (0.279 ms, 493 as auto's pick) vs Triton 0.285 ms, 483 and "
             "cuda_fa2 470; P1 non-causal 0.454 ms, 605 (0.451, 609) vs Triton 0.519 ms, 530 and cuda_fa2 "
             "516. Causal is a tie within the run's noise, non-causal a 14% lead; sm80 not measured",
             H100, "2026-11-22", "BENCHMARKS.md section 1, session 4; benchmarks/results/integrated-h100-2026-11-22-s4.json")),
    Rule("sdpa/cuda", "sdpa", 5, devices=_CUDA, evidence=Evidence(
        "the LSE path goes through the slower mem-efficient kernel (and before sm80 there is no flash "
        "kernel), so it only beats the reference: above it (0), below the built-in CUDA backends")),
    Rule("sdpa/other", "sdpa", -1, evidence=Evidence("on CPU the reference backend stays the default")),
    # ---- triton
    Rule("triton/sm90-dense", "triton", 53, ops=_PREFILL_DENSE, devices=_CUDA, compute_capabilities=_SM90,
         fast_path=TRITON_DENSE, evidence=Evidence(
             "dense prefill on Hopper (the dense kernel's features): measured above cuda_fa2's prefill90 "
             "(52) in the same run: P1 causal 483 vs 470, non-causal 530 vs 516, P2 d64 360 vs 317-331 "
             "TFLOP/s. Paged prefill stays below it: the gather pays on P3 but not P4 (414 vs 424), and "
             "the batch shape is not known at selection",
             H100, "2026-11-22", "BENCHMARKS.md session 4; backends/triton/bench/triton.md 'Session 4'")),
    Rule("triton/cuda", "triton", 50, devices=_CUDA, evidence=Evidence(
        "decode and the problems only cuda_fa2's FA2 kernel serves stay below Triton (D1 94% vs 95% of "
        "read; cuda_fa2 40); paged prefill below cuda_fa2's prefill90 (52: P4 424 vs 414 TFLOP/s); "
        "decode on sm90 below xqa (70). Other GPUs not measured: the same order is assumed",
        H100, "2026-11-22", "BENCHMARKS.md section 1, sessions 3-4")),
    Rule("triton/other", "triton", -1, evidence=Evidence(
        "the interpreter is far slower than the reference backend: auto on CPU keeps the reference")),
    # ---- cuda_fa2
    Rule("cuda_fa2/sm90-single", "cuda_fa2", 54, ops=frozenset({"single_prefill"}), devices=_CUDA,
         compute_capabilities=_SM90, fast_path=FA2_PREFILL90, evidence=Evidence(
             "single prefill on Hopper: prefill90's pipelined ping-pong loop measured above Triton's dense "
             "kernel (53) in the same run: P1 causal 0.276 vs 0.284 ms, non-causal 0.494 vs 0.515; P2 d64 "
             "0.190 vs 0.191 with its 192-key tiles (another call). Ragged batches stay below Triton (B8 x 2k "
             "causal 0.670 vs 0.636 ms, the sm90 table). d256 (prefill90 from 2026-11-29): a tie, P2 d256 0.298-0.315 "
             "vs Triton 0.299-0.304 ms over three calls (H200, BENCHMARKS.md 2u). Head dims 192 / 128 (prefill90 from "
             "2026-11-30): P5-d192 0.290 ms vs Triton's generic kernel 0.58 (Triton's dense kernel does not serve the "
             "pair; H200, BENCHMARKS.md 2am)",
             H100, "2026-11-25", "BENCHMARKS.md 2o; backends/cuda_fa2/bench/cuda_fa2.md 'Session 18'")),
    Rule("cuda_fa2/sm90-prefill90", "cuda_fa2", 52, ops=_PREFILL, devices=_CUDA, compute_capabilities=_SM90,
         fast_path=FA2_PREFILL90, evidence=Evidence(
             "the Hopper prefill90 kernel beats Triton's generic kernel on the prefill it serves (P1 causal "
             "465 vs 430 TFLOP/s, P3 page 16 359 vs 299, P4 446 vs 353, session 3); Triton's dense kernel "
             "later measured above it for dense prefill (triton/sm90-dense, 53), not for paged prefill "
             "(P4 424 vs 414, session 4). Paged d256 (prefill90 from 2026-11-29; H200, BENCHMARKS.md 2u): 8 x 2k "
             "causal, page 16, 0.699-0.709 vs Triton 0.928 ms. Head dims 192 / 128 (2026-11-30, BENCHMARKS.md 2am): "
             "paged 8 x 2k causal 0.711 vs Triton 1.405 ms; ragged as single prefill (cuda_fa2/sm90-single)",
             H100, "2026-11-22", "BENCHMARKS.md section 1, sessions 3-4")),
    Rule("cuda_fa2/sm90-pod", "cuda_fa2", 56, ops=frozenset({"pod", "batch_pod"}), devices=_CUDA,
         compute_capabilities=_SM90, evidence=Evidence(
             "POD in one launch on Hopper: prefill90's POD kernel beat Triton's fused launch where either fuses "
             "(prefill 512 + decode 8 x 1k: 0.041 vs 0.071 ms) and the composed parts inside its measured region "
             "(backends/cuda_fa2/pod.py MEASURED_WINS); elsewhere its plan declines and the parts are composed",
             H100, "2026-11-25", "BENCHMARKS.md 2q")),
    Rule("cuda_fa2/cuda", "cuda_fa2", 40, devices=_CUDA, evidence=Evidence(
        "decode and the FA2 kernel's features stay below Triton (D1 94% vs 95% of read): auto ranks it "
        "above Triton (50) only for what prefill90 serves",
        H100, "2026-11-22", "BENCHMARKS.md section 1, session 3")),
    Rule("cuda_fa2/other", "cuda_fa2", 0, evidence=Evidence(
        "CUDA only: it refuses other devices; equal to the reference")),
    # ---- reference
    Rule("reference/any", "reference", 0, evidence=Evidence(
        "the zero of the scale: the pure-torch ground truth runs everywhere; every other rank says "
        "whether a backend is faster (above) or slower (below) than it")),
)


def rules_for(name: str) -> List[Rule]:
    return [r for r in RULES if r.backend == name]


def governs(backend) -> bool:
    """Whether the rule table ranks this backend object (else its own ``priority()`` does)."""
    owner = OWNERS.get(getattr(backend, "name", None))
    if owner is None:
        return False
    mod = type(backend).__module__
    return mod == owner or mod.startswith(owner + ".")


@dataclass
class RuleRank:
    """A backend's rank by rule: the row that gave it (None: the backend's own ``priority()``), and
    the rows passed over because the backend's fast path does not serve the problem."""

    rank: int
    rule: Optional[Rule] = None
    passed_over: List[Tuple[Rule, str]] = field(default_factory=list)
    note: str = ""

    def describe(self) -> str:
        if self.rule is None:
            return self.note
        return f"rule {self.rule.id}: {self.rule.conditions()}"


def rule_rank(backend, problem: AttentionProblem) -> RuleRank:
    """The backend's rank for ``problem``: from the rule table, or its ``priority()`` if the table
    does not know it."""
    if not governs(backend):
        try:
            prio = int(backend.priority(problem))
            note = f"priority() of {getattr(backend, 'origin', '?')} (not in the rule table)"
        except Exception as e:  # a buggy plugin ranks 0 rather than breaking selection
            prio, note = 0, f"priority() raised {type(e).__name__}: {e}; ranked 0"
        return RuleRank(prio, None, note=note)
    passed = []
    for r in rules_for(backend.name):
        if not r.static_match(problem):
            continue
        if r.fast_path is not None:
            ok, why = r.fast_path.check(backend, problem)
            if not ok:
                passed.append((r, why))
                continue
        return RuleRank(r.rank, r, passed)
    return RuleRank(0, None, passed, note="no row of the rule table matched; ranked 0")  # pragma: no cover


# ------------------------------------------------------------------------------- measured tables
# Measured times within this fraction of the fastest are a tie, which the rule table orders: a kernel's do_bench
# median moves by 1-3% between runs on an H100, and auto's bound is 1.03x the fastest backend (issue 17).  Where a
# small problem's device times tie, the rule table's pick is the one with the cheaper run() on the host (H100,
# 2026-11-25: a 16-row single prefill measured 0.01184 ms on Triton, 0.01190 on cuda_fa2, whose call costs 23 us
# of host time against Triton's 41; BENCHMARKS 2q).
MEASURED_TIE = 0.03


def ties(score: float, best: float) -> bool:
    """Whether measured time ``score`` ties the fastest, ``best`` (within ``MEASURED_TIE``)."""
    return score <= best * (1 + MEASURED_TIE)


def _time(e: Dict, name: str) -> Optional[float]:
    t = (e.get("times_ms") or {}).get(name)
    return float(t) if isinstance(t, (int, float)) and t > 0 and math.isfinite(t) else None


@dataclass
class Measured:
    """What the tables say about one problem class: the table used, its entries for the class, and
    which of them decide (``used``: ``narrow()`` sets it; None: all of them, by the geometric mean)."""

    key: ProblemClass
    table: Optional[Table]
    entries: List[Dict]
    used: Optional[List[Dict]] = None
    wanted: Optional[Bucket] = None  # the planned sizes' bucket (None: no sizes given)
    how: str = ""  # which bucket(s) decided, in words

    @property
    def deciding(self) -> List[Dict]:
        return self.entries if self.used is None else self.used

    def narrow(self, wanted: Optional[Bucket], names: Iterable[str]) -> "Measured":
        """The entries that decide for a problem planned at ``wanted`` among candidates ``names``: the
        bucket itself, else the nearest one(s) where a candidate was measured (see the module
        docstring); without ``wanted``, all of them."""
        n = len(self.entries)
        if wanted is None:
            return replace(self, used=None, wanted=None,
                           how=f"no sizes given: the geometric mean over the class's {n} bucket(s)")
        names = list(names)
        timed = [e for e in self.entries if any(_time(e, x) is not None for x in names)]
        if not timed:
            return replace(self, used=[], wanted=wanted, how=f"no candidate measured in any of the {n} bucket(s)")
        dist = [wanted.distance(entry_bucket(e)) for e in timed]
        best = min(dist)
        used = [e for e, d in zip(timed, dist) if d == best]
        if best == (0, 0, 0):
            how = f"the sizes' own bucket {wanted.describe()}"
        else:
            got = " and ".join(self.bucket(e) for e in used)
            how = (f"no candidate measured in {wanted.describe()}: the nearest bucket" + ("s " if len(used) > 1 else " ")
                   + got + (" (another shape)" if best[0] else ""))
        if n > len(used):
            how += f"; {n - len(used)} other bucket(s) of the class not used"
        return replace(self, used=used, wanted=wanted, how=how)

    def times(self, name: str) -> List[Optional[float]]:
        """The backend's times (ms) in each deciding entry (None where it was not measured)."""
        return [_time(e, name) for e in self.deciding]

    def score(self, name: str) -> Optional[float]:
        """Geometric mean of the backend's times over the deciding entries (None unless measured in
        every one)."""
        ts = self.times(name)
        if not ts or any(t is None for t in ts):
            return None
        return math.exp(sum(math.log(t) for t in ts) / len(ts))

    def failure(self, name: str) -> str:
        for e in self.deciding:
            why = (e.get("failed") or {}).get(name)
            if why:
                return str(why)
        return ""

    @staticmethod
    def bucket(e: Dict) -> str:
        """An entry's bucket and the shape it was measured at, e.g. ``kv257-1024 B2-4 prefill (B4 qo1024
        kv1024)``, and the device when the entry names its own (measured on another GPU than the table's)."""
        s = e.get("shape") if isinstance(e.get("shape"), dict) else {}
        at = f" (B{s['batch']} qo{s['qo']} kv{s['kv']})" if {"batch", "qo", "kv"} <= set(s) else ""
        on = f" on {e['device']}" if e.get("device") else ""
        return entry_bucket(e).describe() + at + on


def measured(problem: AttentionProblem) -> Tuple[Optional[Measured], str]:
    """The measurements for ``problem``'s class from the first table that has any, and a line
    saying where they come from (or why there are none)."""
    if not enabled():
        return None, "measured selection off (ATTNCORE_TUNE=0)"
    key = problem_class(problem)
    if key is None:
        return None, ("no measured class for this problem (tune measures plain problems: no features, NHD, "
                      "no custom mask, window or position encoding)")
    tables, missing = tables_for(problem)
    looked = []
    for t in tables:
        if t.error:
            looked.append(t.describe())
            continue
        es = t.lookup(key)
        if es:
            return Measured(key, t, es), t.describe()
        looked.append(f"{t.kind} table {t.path}: nothing for {key.describe()}"
                      + (" (empty)" if not t.entries else ""))
    return None, "; ".join(looked + missing) or "no tables"
