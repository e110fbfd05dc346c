"""The measured tables that ``attncore tune`` writes and ``backend="auto"`` ranks by: where they
live, how they are read, and how a problem and its planned sizes are keyed into them.

``attncore tune`` times every available backend on a grid of problem classes (op, mask, head dims, GQA
group, q dtype, KV dtype, page size) at a few sizes on the current device, and writes a table per
device name and attncore version into the cache (``$ATTNCORE_CACHE_DIR`` or ``~/.cache/attncore``:
``<root>/<version>/tune/<device>.json``).  A default table per compute capability may ship with the
package (``attncore/data/tune-sm90.json``).  How the tables rank backends: ``attncore.core.ranking``.

Buckets.  Each entry of a table is one class at one ``Bucket``: a KV length bucket (the longest
request's KV length, ``length_bucket``), a batch bucket (``batch_bucket``) and a shape bucket
(``shape_bucket``): for prefill ops ``"prefill"`` when the longest query is at least half the longest
KV (qo ~ kv: a prompt) and ``"append"`` below that (a few new tokens on a long cache); ``"decode"``
for decode ops.  Entries written before the shape axis existed get it from their recorded ``shape``
(qo, kv), so format-1 tables stay valid.  ``Sizes`` (batch, longest qo, longest kv, from the host
lengths ``plan()`` sees) names a problem's bucket.

Only "plain" problems have a class: no feature flags other than ``cuda_graph`` (which changes no
kernel), NHD layout, one query row per decode request, output dtype equal to the q dtype, and no custom
mask, window or position encoding.  A class has both head dims (QK and VO); an entry without
``head_dim_vo`` has equal ones (tables written before the field existed: still format 1).
``ATTNCORE_TUNE=0`` turns measured selection off.  Tables are read once per process (``reload()``
re-reads them; ``attncore tune`` calls it).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import re
import threading
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from attncore.core.problem import DECODE_OPS, AttentionProblem, dims_name, dtype_name

log = logging.getLogger("attncore")

TABLE_FORMAT = 1  # the shape axis is an optional field (derived where absent): still format 1
DATA_DIR = Path(__file__).resolve().parents[1] / "data"


class ProblemClass(NamedTuple):
    op: str
    mask: str
    head_dim: int
    group: int
    q_dtype: str
    kv_dtype: str
    page_size: Optional[int]
    head_dim_vo: int  # V's and the output's head dim (equal to head_dim but for pairs like DeepSeek's 192 / 128)

    @property
    def dims(self) -> str:
        """``d128``, or ``d192x128`` where the two head dims differ."""
        return dims_name(self.head_dim, self.head_dim_vo)

    def describe(self) -> str:
        page = f" p{self.page_size}" if self.page_size is not None else ""
        return (f"{self.op} {self.mask} {self.dims} g{self.group} {self.q_dtype}/{self.kv_dtype}{page}")


CLASS_FIELDS = ProblemClass._fields


def problem_class(problem: AttentionProblem) -> Optional[ProblemClass]:
    """The class a measured table keys ``problem`` by, or None where tables never apply."""
    if problem.features - {"cuda_graph"} or problem.kv_layout != "NHD" or problem.q_len_per_req != 1:
        return None
    if problem.out_dtype != problem.q_dtype:
        return None
    if problem.mask == "custom" or problem.window_left >= 0 or problem.pos_encoding != "NONE":
        return None
    return ProblemClass(problem.op, problem.mask, problem.head_dim_qk, problem.group_size,
                        dtype_name(problem.q_dtype), dtype_name(problem.kv_dtype), problem.page_size,
                        problem.head_dim_vo)


# ------------------------------------------------------------------------------------ buckets
# Bucket edges: a size is filed under the first edge >= it.
LENGTH_EDGES = (256, 1024, 4096, 16384, 65536)
BATCH_EDGES = (1, 4, 16, 64, 256)
SHAPES = ("prefill", "append", "decode")


def _labels(edges: Sequence[int], unit: str) -> Tuple[str, ...]:
    out, lo = [], 0
    for e in edges:
        out.append(f"{unit}{lo + 1}-{e}" if lo + 1 < e else f"{unit}{e}")
        lo = e
    return tuple(out) + (f"{unit}>{edges[-1]}",)


LENGTH_LABELS = _labels(LENGTH_EDGES, "kv")  # in order: nearness is the distance in this tuple
BATCH_LABELS = _labels(BATCH_EDGES, "B")
_LENGTH_INDEX = {s: i for i, s in enumerate(LENGTH_LABELS)}
_BATCH_INDEX = {s: i for i, s in enumerate(BATCH_LABELS)}


def length_bucket(kv_len: int) -> str:
    """The KV length bucket, e.g. ``kv1025-4096``."""
    return LENGTH_LABELS[bisect_left(LENGTH_EDGES, kv_len)]


def batch_bucket(batch: int) -> str:
    """The batch bucket, e.g. ``B17-64``."""
    return BATCH_LABELS[bisect_left(BATCH_EDGES, batch)]


def shape_bucket(op: str, qo_len: int, kv_len: int) -> str:
    """``"decode"`` for decode ops; for prefill ops ``"prefill"`` when the longest query is at least half
    the longest KV (qo ~ kv), else ``"append"`` (qo < kv / 2)."""
    if op in DECODE_OPS:
        return "decode"
    return "prefill" if 2 * qo_len >= kv_len else "append"


class Bucket(NamedTuple):
    """Where a table files a measurement, and the key selection caches by (not the raw lengths)."""

    length: str
    batch: str
    shape: str

    def describe(self) -> str:
        return f"{self.length} {self.batch} {self.shape}"

    def distance(self, other: "Bucket") -> Tuple[int, int, int]:
        """How far ``other`` is, compared in order: a different shape, then the number of length
        buckets between them, then of batch buckets (an unknown label: farther than any known)."""
        def gap(index, a, b):
            i, j = index.get(a), index.get(b)
            return abs(i - j) if i is not None and j is not None else len(index)

        return (int(self.shape != other.shape), gap(_LENGTH_INDEX, self.length, other.length),
                gap(_BATCH_INDEX, self.batch, other.batch))


class Sizes(NamedTuple):
    """A batch's planned sizes as selection sees them: requests, the longest query, the longest KV."""

    batch: int
    max_qo: int
    max_kv: int

    @classmethod
    def of(cls, qo_lens: Iterable[int], kv_lens: Iterable[int]) -> "Sizes":
        """From the host-side per-request lengths (what ``plan()`` reads, e.g. ``BatchMeta.qo_lens_host``)."""
        qo = qo_lens if isinstance(qo_lens, (list, tuple)) else list(qo_lens)
        kv = kv_lens if isinstance(kv_lens, (list, tuple)) else list(kv_lens)
        if len(qo) != len(kv):
            raise ValueError(f"Sizes.of: qo_lens has {len(qo)} requests, kv_lens {len(kv)}")
        # two C passes (plan() calls this per plan): the lengths are BatchMeta's, validated there
        return cls(len(kv), max(qo, default=0), max(kv, default=0))

    @classmethod
    def parse(cls, text: str) -> "Sizes":
        """``"B,QO,KV"``, e.g. ``"8,2048,2048"`` (the ``--sizes`` of ``attncore explain``)."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"{text!r}: expected B,QO,KV (batch, longest query, longest KV), e.g. 8,2048,2048")
        return cls(*map(int, parts))

    def bucket(self, op: str) -> Bucket:
        return bucket_at(op, self.batch, self.max_qo, self.max_kv)

    def describe(self) -> str:
        return f"B{self.batch} qo{self.max_qo} kv{self.max_kv}"


@functools.lru_cache(maxsize=4096)
def bucket_at(op: str, batch: int, max_qo: int, max_kv: int) -> Bucket:
    """The bucket of a batch of ``batch`` requests, the longest query ``max_qo`` and KV ``max_kv`` (made once per
    sizes: plan() asks for it on every auto plan, host time)."""
    return Bucket(length_bucket(max_kv), batch_bucket(batch), shape_bucket(op, max_qo, max_kv))


def bucket_of(op: str, sizes: Union[Sizes, Bucket, None]) -> Optional[Bucket]:
    """The bucket of a sizes hint (a ``Sizes`` or already a ``Bucket``; None stays None)."""
    if sizes is None or isinstance(sizes, Bucket):
        return sizes
    if isinstance(sizes, Sizes):
        return sizes.bucket(op)
    raise TypeError(f"sizes: expected attncore.core.tables.Sizes or Bucket, got {type(sizes).__name__}")


def entry_class(e: Dict) -> ProblemClass:
    page = e.get("page_size")
    d = int(e["head_dim"])
    return ProblemClass(str(e["op"]), str(e["mask"]), d, int(e["group"]), str(e["q_dtype"]),
                        str(e["kv_dtype"]), None if page is None else int(page), int(e.get("head_dim_vo", d)))


def entry_shape_bucket(e: Dict) -> str:
    """An entry's shape bucket: its ``shape_bucket`` field, else derived from its recorded ``shape``
    (tables written before the field existed), ``"?"`` when neither says."""
    s = e.get("shape_bucket")
    if isinstance(s, str) and s:
        return s
    if e.get("op") in DECODE_OPS:
        return "decode"
    shape = e.get("shape")
    try:
        return shape_bucket(str(e.get("op")), int(shape["qo"]), int(shape["kv"]))
    except (KeyError, TypeError, ValueError):
        return "?"


def entry_bucket(e: Dict) -> Bucket:
    return Bucket(str(e.get("len_bucket", "?")), str(e.get("batch_bucket", "?")), entry_shape_bucket(e))


# ----------------------------------------------------------------------------------- where
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


# ------------------------------------------------------------------------------------ read
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
        # entries measured on another GPU name it (tune's --head-dim / --op re-measures merged into a table)
        others = Counter(e["device"] for e in self.entries if isinstance(e, dict) and e.get("device"))
        own = "".join(f", {n} of them on {d}" for d, n in sorted(others.items()))
        return (f"{self.kind} table {self.path} ({where}, {m.get('date', '?')}, attncore {m.get('attncore', '?')}"
                f"{', quick grid' if m.get('quick') else ''}; {len(self.entries)} entries{own})")


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
