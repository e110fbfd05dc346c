"""How ``backend="auto"`` orders the backends that can serve a problem: one rule table, with the
measurement behind each row, and the measured tables that ``attncore tune`` writes.

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

Measured tables
---------------
``attncore tune`` times every available backend on a grid of problem classes (op, mask, head dim,
GQA group, q dtype, KV dtype, page size) at a few sizes (a length bucket and a batch bucket each) on
the current device, and writes a table per device name and attncore version into the cache
(``$ATTNCORE_CACHE_DIR`` or ``~/.cache/attncore``: ``<root>/<version>/tune/<device>.json``).  A
default table per compute capability may ship with the package (``attncore/data/tune-sm90.json``).

Where a table holds data for the problem's class, the candidates measured in every bucket of the
class come first, fastest first (the geometric mean of their times over the buckets: problems do not
carry lengths or batch sizes, so selection cannot pick one bucket); candidates without a measurement
follow, in rule order.  Elsewhere the rule table decides.  Only "plain" problems have a class: no
feature flags other than ``cuda_graph`` (which changes no kernel), NHD layout, one query row per
decode request, output dtype equal to the q dtype, equal QK and VO head dims, and no custom mask.
``ATTNCORE_TUNE=0`` turns measured selection off.  Tables are read once per process
(``reload()`` re-reads them; ``attncore tune`` calls it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

from attncore.core.problem import AttentionProblem, dtype_name

log = logging.getLogger("attncore")

TABLE_FORMAT = 1
DATA_DIR = Path(__file__).resolve().parents[1] / "data"

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
    Rule("cuda_fa2/sm90-prefill90", "cuda_fa2", 52, ops=_PREFILL, devices=_CUDA, compute_capabilities=_SM90,
         fast_path=FA2_PREFILL90, evidence=Evidence(
             "the Hopper prefill90 kernel beats Triton's generic kernel on the prefill it serves (P1 causal "
             "465 vs 430 TFLOP/s, P3 page 16 359 vs 299, P4 446 vs 353, session 3); Triton's dense kernel "
             "later measured above it for dense prefill (triton/sm90-dense, 53), not for paged prefill "
             "(P4 424 vs 414, session 4)",
             H100, "2026-11-22", "BENCHMARKS.md section 1, sessions 3-4")),
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
class ProblemClass(NamedTuple):
    op: str
    mask: str
    head_dim: int
    group: int
    q_dtype: str
    kv_dtype: str
    page_size: Optional[int]

    def describe(self) -> str:
        page = f" p{self.page_size}" if self.page_size is not None else ""
        return (f"{self.op} {self.mask} d{self.head_dim} g{self.group} {self.q_dtype}/{self.kv_dtype}{page}")


CLASS_FIELDS = ProblemClass._fields


def problem_class(problem: AttentionProblem) -> Optional[ProblemClass]:
    """The class a measured table keys ``problem`` by, or None where tables never apply."""
    if problem.features - {"cuda_graph"} or problem.kv_layout != "NHD" or problem.q_len_per_req != 1:
        return None
    if problem.out_dtype != problem.q_dtype or problem.head_dim_qk != problem.head_dim_vo:
        return None
    if problem.mask == "custom" or problem.window_left >= 0 or problem.pos_encoding != "NONE":
        return None
    return ProblemClass(problem.op, problem.mask, problem.head_dim_qk, problem.group_size,
                        dtype_name(problem.q_dtype), dtype_name(problem.kv_dtype), problem.page_size)


# Bucket edges: a measured shape is filed under the first edge >= its size.
LENGTH_EDGES = (256, 1024, 4096, 16384, 65536)
BATCH_EDGES = (1, 4, 16, 64, 256)


def _bucket(n: int, edges: Sequence[int], unit: str) -> str:
    lo = 0
    for e in edges:
        if n <= e:
            return f"{unit}{lo + 1}-{e}" if lo + 1 < e else f"{unit}{e}"
        lo = e
    return f"{unit}>{edges[-1]}"


def length_bucket(kv_len: int) -> str:
    """The KV length bucket, e.g. ``kv1025-4096``."""
    return _bucket(kv_len, LENGTH_EDGES, "kv")


def batch_bucket(batch: int) -> str:
    """The batch bucket, e.g. ``B17-64``."""
    return _bucket(batch, BATCH_EDGES, "B")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return "cpu " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu " + (platform.processor() or platform.machine() or "unknown")


_device_lock = threading.Lock()
_cuda_cached: Optional[Tuple[str, Tuple[int, int]]] = None
_cuda_probed = False


def cuda_device() -> Optional[Tuple[str, Tuple[int, int]]]:
    """(name, compute capability) of the current CUDA device, or None without one."""
    global _cuda_cached, _cuda_probed
    with _device_lock:
        if not _cuda_probed:
            _cuda_probed = True
            try:
                import torch

                if torch.cuda.is_available():
                    _cuda_cached = (torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability()))
            except Exception:  # no usable CUDA: no local CUDA table
                _cuda_cached = None
        return _cuda_cached


def cache_root() -> Path:
    env = os.environ.get("ATTNCORE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attncore"


def cache_path(device_name: str) -> Path:
    """Where ``attncore tune`` keeps the table of a device: ``<root>/<version>/tune/<device>.json``."""
    from attncore import __version__

    return cache_root() / __version__ / "tune" / f"{_slug(device_name)}.json"


def default_path(cc: Tuple[int, int]) -> Path:
    """The table shipped with the package for a compute capability (may not exist)."""
    return DATA_DIR / ("tune-sm%d%d.json" % tuple(cc))


def enabled() -> bool:
    """Measured selection is on unless ``ATTNCORE_TUNE=0``."""
    return os.environ.get("ATTNCORE_TUNE", "1").strip().lower() not in ("0", "off", "false", "no")


@dataclass
class Table:
    """A measured table as read from a file (or an unreadable one: ``error``)."""

    path: Path
    kind: str  # "cache" (attncore tune on this machine) or "default" (shipped with attncore)
    meta: Dict = field(default_factory=dict)
    entries: List[Dict] = field(default_factory=list)
    error: str = ""
    _index: Dict[ProblemClass, List[Dict]] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for e in self.entries:
            try:
                key = entry_class(e)
            except (KeyError, TypeError, ValueError):
                continue
            self._index.setdefault(key, []).append(e)

    def lookup(self, key: ProblemClass) -> List[Dict]:
        return self._index.get(key, [])

    def describe(self) -> str:
        if self.error:
            return f"{self.kind} table {self.path}: unreadable ({self.error})"
        m = self.meta
        cc = m.get("compute_capability")
        where = m.get("device") or ("sm%d%d" % tuple(cc) if cc else "?")
        return (f"{self.kind} table {self.path} ({where}, {m.get('date', '?')}, attncore {m.get('attncore', '?')}"
                f"{', quick grid' if m.get('quick') else ''}; {len(self.entries)} entries)")


def entry_class(e: Dict) -> ProblemClass:
    page = e.get("page_size")
    return ProblemClass(str(e["op"]), str(e["mask"]), int(e["head_dim"]), int(e["group"]), str(e["q_dtype"]),
                        str(e["kv_dtype"]), None if page is None else int(page))


_tables: Dict[Tuple[str, str], Optional[Table]] = {}
_generation = 0
_lock = threading.RLock()


def generation() -> int:
    return _generation


def reload() -> None:
    """Forget the tables read so far (they are read again on next use)."""
    global _generation
    with _lock:
        _tables.clear()
        _generation += 1


def read_table(path: Path, kind: str = "cache") -> Optional[Table]:
    """The table in ``path`` (None if there is no such file)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
            raise ValueError(f"not a format-{TABLE_FORMAT} attncore tune table")
        entries = [e for e in data.get("entries", []) if isinstance(e, dict)]
        meta = {k: v for k, v in data.items() if k != "entries"}
        return Table(path, kind, meta, entries)
    except (OSError, ValueError) as e:
        log.warning("attncore: ignoring tune table %s: %s", path, e)
        return Table(path, kind, error=str(e))


def _table(path: Path, kind: str) -> Optional[Table]:
    key = (str(path), kind)
    with _lock:
        if key not in _tables:
            _tables[key] = read_table(path, kind)
        return _tables[key]


def tables_for(problem: AttentionProblem) -> Tuple[List[Table], List[str]]:
    """The tables that may hold data for ``problem``, in lookup order (this machine's, then the
    shipped default), and a line for each place looked at without a table."""
    found, missing = [], []
    cc = tuple(problem.compute_capability) if problem.compute_capability is not None else None
    if problem.device_type == "cuda":
        dev = cuda_device()
        if dev is not None and cc == dev[1]:
            p = cache_path(dev[0])
            t = _table(p, "cache")
            (found.append(t) if t else missing.append(f"no tune table for {dev[0]} ({p})"))
        elif dev is None:
            missing.append("no CUDA device here: no table of this machine")
        else:
            missing.append(f"this machine's GPU ({dev[0]}) is sm{dev[1][0]}{dev[1][1]}, not the problem's: "
                           "its table does not apply")
        if cc is not None:
            p = default_path(cc)
            t = _table(p, "default")
            (found.append(t) if t else missing.append("no default table for sm%d%d" % cc))
    elif problem.device_type == "cpu":
        p = cache_path(cpu_name())
        t = _table(p, "cache")
        (found.append(t) if t else missing.append(f"no tune table for this CPU ({p})"))
    else:
        missing.append(f"no tables for device type {problem.device_type}")
    return found, missing


@dataclass
class Measured:
    """What the tables say about one problem class: the table used, its entries for the class, and
    per backend the times (ms) in every entry where it was measured."""

    key: ProblemClass
    table: Table
    entries: List[Dict]

    def times(self, name: str) -> List[Optional[float]]:
        out = []
        for e in self.entries:
            t = (e.get("times_ms") or {}).get(name)
            out.append(float(t) if isinstance(t, (int, float)) and t > 0 and math.isfinite(t) else None)
        return out

    def score(self, name: str) -> Optional[float]:
        """Geometric mean of the backend's times over the class's buckets (None unless measured in
        every bucket)."""
        ts = self.times(name)
        if not ts or any(t is None for t in ts):
            return None
        return math.exp(sum(math.log(t) for t in ts) / len(ts))

    def failure(self, name: str) -> str:
        for e in self.entries:
            why = (e.get("failed") or {}).get(name)
            if why:
                return str(why)
        return ""

    @staticmethod
    def bucket(e: Dict) -> str:
        return f"{e.get('len_bucket', '?')} {e.get('batch_bucket', '?')}"


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
