"""``attncore bench --latency``: host time per call of tiny problems (issue 15 item 1).

Each cell is the wall time per call of one API entry point on a tiny problem: ``calls`` calls in ``BLOCKS``
blocks, the device synchronised at the end of each block (so a host that stays ahead of the GPU shows its
own cost), the median block's time per call (one stall or collection pause moves one block only): the
one-call ``single_prefill`` and ``single_decode``, a batch decode ``plan()`` and ``run()``, a paged
prefill ``plan()`` and ``run()``.  Rows: one per backend (``auto`` first), and FlashInfer's when asked
for and importable, driven through the same code.  A backend that does not serve an op gets ``n/a``
with the reason.  On the CPU the problems are smaller and the calls fewer (the Triton interpreter).

FlashInfer's row runs in a child process, after attncore's rows, with a time limit.  In the same process as
attncore's rows it stalled in three runs on an H100 (2026-11-25; one of them in its paged prefill plan); in a
process of its own it ran.  A cell it does not finish within the limit says so, and the table is still printed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

COLUMNS = ("single_prefill", "single_decode", "decode plan", "decode run", "paged prefill plan", "prefill run")


def _sizes(device: str) -> dict:
    if device == "cuda":
        return dict(hq=32, hkv=8, d=128, qo=16, kv=128, batch=4, page=16, dtype=torch.bfloat16)
    return dict(hq=4, hkv=2, d=32, qo=4, kv=16, batch=2, page=4, dtype=torch.float16)


def _cells(api, device: str, backend_kw: dict) -> Dict[str, object]:
    """One zero-argument callable per column (inputs and wrappers made once, outside the timing), and under
    ``"ran"`` the wrapper columns' getters of the backend that served them."""
    s = _sizes(device)
    hq, hkv, d, qo, kv, b, page, dt = (s[k] for k in ("hq", "hkv", "d", "qo", "kv", "batch", "page", "dtype"))
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dt)  # noqa: E731
    q1, k1, v1 = rnd(qo, hq, d), rnd(kv, hkv, d), rnd(kv, hkv, d)
    qd = rnd(hq, d)
    pages = kv // page
    indptr = torch.arange(b + 1, dtype=torch.int32) * pages  # host-side index tensors (FlashInfer's convention)
    indices = torch.randperm(b * pages, generator=g).to(torch.int32)
    last = torch.full((b,), page, dtype=torch.int32)
    qo_indptr = torch.arange(b + 1, dtype=torch.int32) * qo
    cache = rnd(b * pages, 2, page, hkv, d)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    dw = api.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **backend_kw)
    pw = api.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **backend_kw)
    one = {"backend": backend_kw["backend"]} if backend_kw else {}

    def dplan():
        dw.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dt, kv_data_type=dt)

    def pplan():
        pw.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=True, q_data_type=dt, kv_data_type=dt)

    qb, qp = rnd(b, hq, d), rnd(b * qo, hq, d)
    return {
        "ran": {"decode plan": lambda: dw.backend, "decode run": lambda: dw.backend,  # who served a wrapper cell
                "paged prefill plan": lambda: pw.backend, "prefill run": lambda: pw.backend},
        "single_prefill": lambda: api.single_prefill_with_kv_cache(q1, k1, v1, causal=True, **one),
        "single_decode": lambda: api.single_decode_with_kv_cache(qd, k1, v1, **one),
        "decode plan": dplan,
        "decode run": (dplan, lambda: dw.run(qb, cache)),
        "paged prefill plan": pplan,
        "prefill run": (pplan, lambda: pw.run(qp, cache)),
    }


BLOCKS = 5


def _blocks(calls: int) -> int:
    """How many blocks ``calls`` calls are timed in (fewer calls than ``BLOCKS``: one block of them all)."""
    return BLOCKS if calls >= BLOCKS else 1


def _time(fn: Callable[[], object], calls: int, device: str) -> float:
    for _ in range(3):  # warm-up: JIT builds, autotuning, caches
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    blocks = _blocks(calls)
    n = calls // blocks
    per_call = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(per_call)


def _ran(cells_ran: dict, col: str) -> Optional[str]:
    """The backend that served the attncore cell just timed: the wrapper's, or the newest one-call plan's."""
    if col in cells_ran:
        return cells_ran[col]()
    from attncore.core import plan_cache

    entry = plan_cache.ONE_CALL_PLANS.newest()
    return getattr(entry[0], "backend_name", None) if entry else None


def _row(api, device: str, backend_kw: dict, calls: int, progress: Optional[Callable[[str], None]] = None,
         done: Optional[Callable[[str, object], None]] = None, ran: Optional[Dict[str, str]] = None
         ) -> Dict[str, object]:
    """{column: us per call, or "n/a: reason"}; ``progress`` is told each column before it is timed (a cell
    that stalls shows which), ``done`` each column's result, ``ran`` (filled in) which backend served it."""
    try:
        cells = _cells(api, device, backend_kw)
    except Exception as e:  # a backend that cannot even make the wrappers here
        return {c: f"n/a: {type(e).__name__}: {e}".splitlines()[0] for c in COLUMNS}
    row: Dict[str, object] = {}
    for col in COLUMNS:
        f = cells[col]
        if progress:
            progress(f"latency:   {col}")
        try:
            if isinstance(f, tuple):  # run() timed after one plan()
                f[0]()
                f = f[1]
            row[col] = round(_time(f, calls, device), 1)
            if ran is not None:
                ran[col] = _ran(cells["ran"], col)
        except Exception as e:  # refused (not served) or failed: the reason, first line
            row[col] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if done:
            done(col, row[col])
    return row


FLASHINFER_TIMEOUT_S = 300  # FlashInfer's row, its child process included (its kernels warmed beforehand)

_CHILD = """
import importlib, json, sys
from attncore.cli.latency import _row
api = importlib.import_module(sys.argv[1])
_row(api, sys.argv[2], {}, int(sys.argv[3]), progress=lambda s: print(s, file=sys.stderr, flush=True),
     done=lambda col, v: print(json.dumps([col, v]), flush=True))
"""


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _child_row(module: str, device: str, calls: int, timeout: float,
               progress: Optional[Callable[[str], None]] = None) -> Dict[str, object]:
    """``_row`` of the API of ``module`` (imported by that name; no backend argument), run in a child process
    stopped after ``timeout`` seconds.  Cells finished before a stop or a crash keep their times; the cell it
    stopped in and those after say why."""
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD, module, device, str(calls)], capture_output=True,
                           text=True, timeout=timeout)
        out, err = r.stdout, r.stderr
        why = None if r.returncode == 0 else f"its process exited with status {r.returncode}"
    except subprocess.TimeoutExpired as e:
        out, err = _text(e.stdout), _text(e.stderr)
        why = f"did not finish within {timeout:g} s (its process was stopped)"
    row: Dict[str, object] = {}
    for line in out.splitlines():
        try:
            col, value = json.loads(line)
        except ValueError:
            continue
        if col in COLUMNS:
            row[col] = value
    if progress:
        for line in err.splitlines():
            if line.startswith("latency:"):
                progress(line)
    if why is not None:
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith("latency:")]
        if lines and "exited" in why:
            why += f": {lines[-1][:160]}"
        stopped = next((c for c in COLUMNS if c not in row), None)
        for c in COLUMNS:
            if c not in row:
                row[c] = f"n/a: {why}" if c == stopped else f"n/a: not reached ({module} stopped in {stopped})"
    return {c: row[c] for c in COLUMNS}


def default_backends(device: str) -> List[str]:
    from attncore.core import registry

    avail = set(registry.available_backends())
    want = ["auto", "triton", "cuda_fa2", "xqa"] if device == "cuda" else ["auto", "reference", "triton"]
    return [n for n in want if n == "auto" or n in avail]


def run_latency(backends: Optional[Sequence[str]] = None, *, device: Optional[str] = None,
                calls: Optional[int] = None, flashinfer: bool = False,
                progress: Optional[Callable[[str], None]] = None,
                flashinfer_timeout: float = FLASHINFER_TIMEOUT_S) -> dict:
    import attncore

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    calls = calls or (300 if device == "cuda" else 5)
    names = list(backends) if backends else default_backends(device)
    rows: Dict[str, Dict[str, object]] = {}
    ran: Dict[str, Dict[str, str]] = {}
    for n in names:
        if progress:
            progress(f"latency: attncore {n}")
        ran[f"attncore {n}"] = {}
        rows[f"attncore {n}"] = _row(attncore, device, {"backend": n}, calls, progress, ran=ran[f"attncore {n}"])
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "calls": calls,
            "blocks": _blocks(calls),
            "sizes": {k: str(v) for k, v in _sizes(device).items()}, "columns": list(COLUMNS), "rows": rows,
            "ran": ran}
    if flashinfer:
        from attncore.cli.bench import _import_flashinfer

        fi = _import_flashinfer(device)  # the errors (no GPU, not importable, the attncore shim) here
        if progress:
            # attncore's rows before FlashInfer's child starts: a run stopped from outside while the child runs
            # (H100, 2026-11-25: its row took over 200 s on one host) still shows them
            progress(format_latency(info))
            progress("latency: flashinfer (its own process)")
        rows[f"FlashInfer {getattr(fi, '__version__', '?')}"] = _child_row("flashinfer", device, calls,
                                                                           flashinfer_timeout, progress)
    return info


def format_latency(info: dict) -> str:
    cols = info["columns"]
    blocks = info.get("blocks", 1)
    lines = [f"host time per call, us ({info['calls']} calls: the median of {blocks} blocks, the device synced after "
             f"each; {info['device']})", "| us per call | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    notes = []
    for name, row in info["rows"].items():
        cells = []
        for c in cols:
            v = row[c]
            if isinstance(v, str):
                notes.append(f"{name} / {c}: {v}")
                v = "n/a"
            cells.append(str(v))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, by_col in info.get("ran", {}).items():
        if by_col and name.endswith(" auto"):  # what auto picked, per cell (a forced row ran its own backend)
            notes.append(f"{name} ran: " + ", ".join(f"{c} {b}" for c, b in by_col.items()))
    return "\n".join(lines + notes)
