"""``attncore tune``: time every available backend on a grid of problem classes on this device and
write the table that ``backend="auto"`` then ranks by (``attncore.core.ranking``).

A grid point is a problem class (op, mask, head dims, GQA group, q dtype, KV dtype, page size) at one
size: a ``tables.Bucket`` (KV length bucket, batch bucket, and shape bucket: ``prefill`` qo ~ kv,
``append`` qo < kv / 2, ``decode``), measured at one representative shape.  Each backend is forced on it (``backend=NAME``) through
``attncore.cli.bench``'s set-up and timer: plan once, time ``run()``, input copies rotated beyond L2 on
a GPU.  A backend that refuses is recorded as such; one that fails, with its error.

The table goes to ``tables.cache_path(<device name>)`` (or ``path=``: ``attncore tune --table FILE``),
merged into what is there (a grid point measured again replaces that backend's earlier time;
``fresh=True`` starts over), so the grid can be measured in several runs (``ops=``) and a run with
``done=`` (``--resume``) measures only the grid points and backends the table lacks.  The default table
shipped for sm90 (``attncore/data/tune-sm90.json``) is such a table, measured on an H100: grid points
added later are measured into a copy of it with ``--table COPY --resume`` and the copy replaces it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from dataclasses import dataclass
from itertools import product
from typing import Callable, Dict, List, Optional, Sequence

import torch

from attncore.cli import bench
from attncore.core import registry
from attncore.core import tables
from attncore.core.problem import dtype_name
from attncore.core.selector import BackendSelectionError

_BENCH_OP = {"single_prefill": "prefill", "batch_prefill_ragged": "ragged_prefill",
             "batch_prefill_paged": "paged_prefill", "batch_decode": "decode", "xqa_decode": "xqa"}
TUNE_OPS = tuple(_BENCH_OP)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# do_bench on a GPU (warm-up and repetitions in ms); shorter than `attncore bench`'s 25 / 100 for a
# grid of hundreds of points, still a median of ~100 runs of a 0.3 ms kernel.
GPU_TIMER = dict(warmup=10, rep=50)


@dataclass(frozen=True)
class Case:
    """One grid point: a problem class at one shape."""

    op: str
    mask: str
    head_dim: int
    group: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    page_size: Optional[int]
    batch: int
    qo: int
    kv: int
    hq: int
    head_dim_vo: int = 0  # V's and the output's head dim where it differs from head_dim (0: head_dim's)

    @property
    def hkv(self) -> int:
        return self.hq // self.group

    def key(self) -> tables.ProblemClass:
        return tables.ProblemClass(self.op, self.mask, self.head_dim, self.group, dtype_name(self.q_dtype),
                                    dtype_name(self.kv_dtype), self.page_size, self.head_dim_vo or self.head_dim)

    def bucket(self) -> tables.Bucket:
        return tables.Sizes(self.batch, self.qo, self.kv).bucket(self.op)

    @property
    def len_bucket(self) -> str:
        return self.bucket().length

    @property
    def batch_bucket(self) -> str:
        return self.bucket().batch

    @property
    def shape_bucket(self) -> str:
        return self.bucket().shape

    def describe(self) -> str:
        return (f"{self.key().describe()} {self.bucket().describe()} "
                f"(B{self.batch} qo{self.qo} kv{self.kv} {self.hq}/{self.hkv})")

    def workload(self) -> bench.Workload:
        if self.kv_dtype in _FP8 and self.kv_dtype != torch.float8_e4m3fn:
            raise ValueError("bench's set-up has e4m3 as its only fp8 KV dtype")
        return bench.Workload(self.describe(), _BENCH_OP[self.op], self.batch, self.qo, self.kv, hq=self.hq,
                              hkv=self.hkv, d=self.head_dim, page=self.page_size or 16,
                              causal=self.mask == "causal", kv_fp8=self.kv_dtype in _FP8, dv=self.head_dim_vo)


def _cases(op, masks, dims, groups, dtypes, kv_fp8, pages, shapes, hq) -> List[Case]:
    """The product of the axes; a head dim is one int (QK and VO alike) or a (QK, VO) pair."""
    out = []
    for mask, d, g, dt, fp8, page, (b, qo, kv) in product(masks, dims, groups, dtypes, kv_fp8, pages, shapes):
        qk, vo = d if isinstance(d, tuple) else (d, 0)
        out.append(Case(op, mask, qk, g, dt, torch.float8_e4m3fn if fp8 else dt, page, b, qo, kv, hq, vo))
    return out


# head dims that differ: DeepSeek's prefill (QK 192, VO 128), with as many KV heads as query heads
QK_VO_PAIRS = ((192, 128),)


def _pair_cases(dts, single_shapes, batch_shapes, pages, hq) -> List[Case]:
    """The prefill grid points of the ``QK_VO_PAIRS`` (group 1, as DeepSeek runs them)."""
    return (_cases("single_prefill", ("causal", "none"), QK_VO_PAIRS, (1,), dts, (False,), (None,), single_shapes, hq)
            + _cases("batch_prefill_ragged", ("causal",), QK_VO_PAIRS, (1,), dts, (False,), (None,), batch_shapes, hq)
            + _cases("batch_prefill_paged", ("causal",), QK_VO_PAIRS, (1,), dts, (False,), pages, batch_shapes, hq))


def grid(device: str, quick: bool = False, ops: Optional[Sequence[str]] = None,
         head_dims: Optional[Sequence[int]] = None) -> List[Case]:
    """The grid points timed on ``device`` (``quick``: one point per op, tiny on the CPU), of ``ops`` and
    ``head_dims`` (QK head dims: 192 is the 192 / 128 pair) only when given."""
    bf16, fp16 = torch.bfloat16, torch.float16
    if device != "cuda":  # the CPU: tiny shapes (Triton runs through its interpreter)
        dims, groups, dts = ((64,), (2,), (fp16,)) if quick else ((64, 128), (1, 4), (fp16, torch.float32))
        hq = 4 if quick else 8
        s = 1 if quick else 4  # length scale
        cases = (_cases("single_prefill", ("causal",), dims, groups, dts, (False,), (None,), [(1, 64 * s, 64 * s)], hq)
                 + _cases("batch_prefill_ragged", ("causal",), dims, groups, dts, (False,), (None,),
                          [(2, 32, 64 * s)], hq)
                 + _cases("batch_prefill_paged", ("causal",), dims, groups, dts, (False,), (16,), [(2, 32, 64 * s)], hq)
                 + _cases("batch_decode", ("causal",), dims, groups, dts, (False,), (16,), [(2, 1, 128 * s)], hq)
                 + _cases("xqa_decode", ("causal",), dims, groups, dts, (False,), (16,), [(2, 1, 128 * s)], hq)
                 + ([] if quick else _pair_cases(dts, [(1, 64 * s, 64 * s)], [(2, 32, 64 * s)], (16,), hq)))
    elif quick:  # one class per op (fp8 KV beside bf16 for decode), one shape
        cases = (_cases("single_prefill", ("causal",), (128,), (4,), (bf16,), (False,), (None,), [(1, 4096, 4096)], 32)
                 + _cases("batch_prefill_ragged", ("causal",), (128,), (4,), (bf16,), (False,), (None,),
                          [(16, 512, 4096)], 32)
                 + _cases("batch_prefill_paged", ("causal",), (128,), (4,), (bf16,), (False,), (16,),
                          [(16, 512, 4096)], 32)
                 + _cases("batch_decode", ("causal",), (128,), (4,), (bf16,), (False, True), (16,), [(64, 1, 4096)], 32)
                 + _cases("xqa_decode", ("causal",), (128,), (8,), (bf16,), (False, True), (16,), [(64, 1, 4096)], 64))
    else:
        dims, dts = (64, 128, 256), (bf16, fp16)
        # prefill (qo = kv) at B4 kv1k, B8 kv2k (P3) and B2 kv8k; append at B16 qo512 kv4k (P4): the
        # shape axis splits kv1025-4096 B5-16, where P3 and P4 share length and batch buckets
        prefill_shapes = [(4, 1024, 1024), (16, 512, 4096), (8, 2048, 2048), (2, 8192, 8192)]
        decode_shapes = [(8, 1, 16384), (64, 1, 4096)]  # D2-like and D1
        # single decode (one query row of single prefill, mask none): short, where a call's host time decides
        # (single_decode_with_kv_cache), medium and long
        single_decode_shapes = [(1, 1, 128), (1, 1, 2048), (1, 1, 32768)]
        # short single prefill (128 rows over 128 keys; causal also a 16-row chunk, whose bucket the mask-none
        # single decode over 128 keys holds): launch and host cost decide there, not the 1k-row points
        cases = (_cases("single_prefill", ("causal", "none"), dims, (1, 4), dts, (False,), (None,),
                        [(1, 128, 128), (1, 1024, 1024), (1, 8192, 8192)], 32)
                 + _cases("single_prefill", ("causal",), dims, (1, 4), dts, (False,), (None,), [(1, 16, 128)], 32)
                 + _cases("single_prefill", ("none",), dims, (1, 4), dts, (False,), (None,), single_decode_shapes, 32)
                 + _cases("batch_prefill_ragged", ("causal",), dims, (4,), dts, (False,), (None,), prefill_shapes, 32)
                 + _cases("batch_prefill_paged", ("causal",), dims, (4,), dts, (False,), (1, 16), prefill_shapes, 32)
                 + _cases("batch_decode", ("causal",), dims, (1, 4, 8), dts, (False, True), (1, 16), decode_shapes, 32)
                 + _cases("xqa_decode", ("causal",), dims, (4, 8), dts, (False, True), (16,), decode_shapes, 64)
                 + _pair_cases(dts, [(1, 128, 128), (1, 1024, 1024), (1, 8192, 8192)], prefill_shapes, (1, 16), 32))
    if ops:
        unknown = set(ops) - set(TUNE_OPS)
        if unknown:
            raise ValueError(f"unknown op {', '.join(sorted(unknown))}; tune knows {', '.join(TUNE_OPS)}")
        cases = [c for c in cases if c.op in ops]
    if head_dims:
        cases = [c for c in cases if c.head_dim in head_dims]
    return cases


def device_identity(device: str) -> Dict:
    """Name, type and compute capability of the device a table is measured on."""
    if device == "cuda":
        return {"device": torch.cuda.get_device_name(), "device_type": "cuda",
                "compute_capability": list(torch.cuda.get_device_capability())}
    return {"device": tables.cpu_name(), "device_type": device, "compute_capability": None}


def _entry_id(e: Dict) -> tuple:
    """A grid point: class and bucket (an old entry's shape bucket derived from its recorded shape)."""
    return tuple(tables.entry_class(e)) + tuple(tables.entry_bucket(e))


def default_backends(device: str) -> List[str]:
    """Every available backend; on a GPU not the reference (pure torch: never the fastest there,
    and slow to time; name it with ``backends=`` to include it)."""
    names = sorted(registry.available_backends())
    return [n for n in names if not (device == "cuda" and n == "reference")]


def run_tune(backends: Optional[Sequence[str]] = None, *, quick: bool = False, ops: Optional[Sequence[str]] = None,
             head_dims: Optional[Sequence[int]] = None, device: Optional[str] = None,
             progress: Callable[[str], None] = print,
             done: Optional[Dict] = None, on_entry: Optional[Callable[[Dict], None]] = None) -> Dict:
    """Time ``backends`` (default: ``default_backends``) on the grid; return this run's table.

    ``done``: a table (the cached one): a backend it holds a time or a failure for at a grid point is
    not measured there again, so a run that was cut off resumes.  ``on_entry(table)`` is called
    with a table of that point alone (``attncore tune`` saves it, so a cut-off run keeps what it measured)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    names = [registry.canonical_name(n) for n in backends] if backends else default_backends(device)
    cases = grid(device, quick, ops, head_dims)
    t = bench._timer(device, **GPU_TIMER) if device == "cuda" else bench._timer(device)
    unavailable = {}
    for n in names:
        rs = registry.get_entry(n).unavailable_reasons()
        if rs:
            unavailable[n] = "unavailable: " + "; ".join(map(str, rs))
    if device != "cuda":
        progress("no CUDA GPU: timing tiny shapes on the CPU (Triton through its interpreter)")
    progress(f"attncore tune: {len(cases)} grid points x {len(names)} backends ({', '.join(names)}) on "
             f"{device_identity(device)['device']}")
    seen = {_entry_id(e): set(e.get("times_ms", {})) | set(e.get("failed", {}))
            for e in (done or {}).get("entries", [])}
    entries, t0 = [], time.perf_counter()
    for i, c in enumerate(cases):
        e = dict(zip(tables.CLASS_FIELDS, c.key()))
        e.update(len_bucket=c.len_bucket, batch_bucket=c.batch_bucket, shape_bucket=c.shape_bucket)
        todo = [n for n in names if n not in seen.get(_entry_id(e), set())]
        if not todo:
            continue  # measured by an earlier run
        w = c.workload()
        e.update(shape={"batch": c.batch, "qo": c.qo, "kv": c.kv, "hq": c.hq, "hkv": c.hkv}, times_ms={}, failed={})
        t1 = time.perf_counter()
        for n in todo:
            if n in unavailable:
                e["failed"][n] = unavailable[n]
                continue
            runs = None
            try:
                runs, _ = bench._setup(w, n, device, c.q_dtype, bench.copies_for(w, device))
                e["times_ms"][n] = round(bench.time_runs(t, runs), 6)
                msg = f"{e['times_ms'][n]:.4g} ms"
            except BackendSelectionError as err:
                e["failed"][n] = "refused: " + str(err)[:300]
                msg = "refuses"
            except Exception as err:  # noqa: BLE001 - recorded, the grid goes on
                e["failed"][n] = f"error: {type(err).__name__}: {err}"[:300]
                msg = e["failed"][n][:120]
            finally:
                del runs
            progress(f"[{i + 1}/{len(cases)} {time.perf_counter() - t0:.0f}s] {c.describe()} {n}: {msg}")
        if device == "cuda":
            torch.cuda.empty_cache()
        entries.append(e)
        if on_entry is not None:
            on_entry(_table([e], names, device, quick, time.perf_counter() - t1))
    return _table(entries, names, device, quick, time.perf_counter() - t0)


def _table(entries: List[Dict], names: Sequence[str], device: str, quick: bool, seconds: float) -> Dict:
    return {"format": tables.TABLE_FORMAT, **_versions(), **device_identity(device),
             "date": time.strftime("%Y-%m-%d"), "quick": quick,
             "timer": (f"triton.testing.do_bench median, warmup {GPU_TIMER['warmup']} ms, rep {GPU_TIMER['rep']} ms"
                       if device == "cuda" else "median of 3 calls after a warm-up"),
             "backends": {n: registry.get_entry(n).origin for n in names},
             "seconds": round(seconds, 1), "entries": list(entries)}


def _versions() -> Dict:
    from attncore import __version__

    v = {"attncore": __version__, "torch": torch.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    return v


def merge(old: Optional[Dict], new: Dict) -> Dict:
    """``new`` merged into ``old`` (same device): a grid point measured again replaces the times and
    failures of the backends this run measured; everything else of ``old`` stays (its ``note`` too)."""
    if not old or old.get("device") != new.get("device") or old.get("format") != new.get("format"):
        return new
    out = {**{k: v for k, v in old.items() if k != "entries"}, **{k: v for k, v in new.items() if k != "entries"}}
    out["backends"] = {**old.get("backends", {}), **new.get("backends", {})}
    out["quick"] = bool(old.get("quick")) and bool(new.get("quick"))
    out["seconds"] = round(float(old.get("seconds", 0)) + float(new.get("seconds", 0)), 1)
    entries = {_entry_id(e): e for e in old.get("entries", [])}
    for e in new["entries"]:
        k = _entry_id(e)
        if k in entries:
            o = entries[k]
            measured = set(e["times_ms"]) | set(e["failed"])
            times = {n: v for n, v in o.get("times_ms", {}).items() if n not in measured}
            failed = {n: v for n, v in o.get("failed", {}).items() if n not in measured}
            e = dict(e, times_ms={**times, **e["times_ms"]}, failed={**failed, **e["failed"]})
        entries[k] = e
    out["entries"] = list(entries.values())
    return out


def load_cached(device: str, path=None) -> Optional[Dict]:
    """The cached table of this machine's ``device``, or the table in ``path`` (None if there is none or
    it is unreadable).  A ``path`` measured on another device, or in another format, is an error: merging
    into it would replace it (``merge``)."""
    name = device_identity(device)["device"]
    p = tables.cache_path(name) if path is None else Path(path)
    try:
        t = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if path is not None and (t.get("device") != name or t.get("format") != tables.TABLE_FORMAT):
        raise ValueError(f"table {path} is a format-{t.get('format')} table of {t.get('device')!r}; this run "
                         f"measures {name!r} (format {tables.TABLE_FORMAT}): merging would replace it")
    return t


def save(table: Dict, *, fresh: bool = False, path=None):
    """Write ``table`` (merged into the device's cached table unless ``fresh``) to the cache, or to
    ``path``; return (path, the table written).  The selector re-reads its tables afterwards."""
    path = Path(path) if path is not None else tables.cache_path(table["device"])
    old = None
    if not fresh and path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None
    out = table if fresh else merge(old, table)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(path)
    tables.reload()
    return path, out


def format_table(table: Dict) -> str:
    """One line per grid point: the backends fastest first (failures after)."""
    lines = [f"device: {table['device']}  date: {table['date']}  attncore {table['attncore']}  "
             f"{len(table['entries'])} grid points"]
    for e in table["entries"]:
        key = tables.entry_class(e)
        times = sorted(e.get("times_ms", {}).items(), key=lambda kv: kv[1])
        cells = [f"{n} {t:.4g} ms" for n, t in times]
        if times:
            best = times[0][1]
            cells = [c + (f" ({t / best:.2f}x)" if j else "") for j, (c, (_, t)) in enumerate(zip(cells, times))]
        cells += [f"{n} {why.split(':')[0]}" for n, why in sorted(e.get("failed", {}).items())]
        lines.append(f"{key.describe()} {tables.entry_bucket(e).describe()}: " + ", ".join(cells))
    return "\n".join(lines)


__all__ = ["Case", "grid", "run_tune", "merge", "save", "load_cached", "format_table", "default_backends", "TUNE_OPS"]
