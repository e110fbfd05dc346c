"""``attncore bench --latency``: host time per call of tiny problems (issue 15 item 1).

Each cell is the wall time per call of one API entry point on a tiny problem: ``calls`` calls in ``BLOCKS``
blocks, the device synchronised at the end of each block (so a host that stays ahead of the GPU shows its
own cost), the median block's time per call (one stall or collection pause moves one block only): the
one-call ``single_prefill`` and ``single_decode``, a batch decode ``plan()`` and ``run()``, a paged
prefill ``plan()`` and ``run()``.  Rows: one per backend (``auto`` first), and FlashInfer's when asked
for and importable, driven through the same code.  A backend that does not serve an op gets ``n/a``
with the reason.  On the CPU the problems are smaller and the calls fewer (the Triton interpreter).
On a GPU each cell is the median of ``ROUNDS`` timings, taken a column at a time with every row back to back.

FlashInfer's row runs in a child process that times a column when asked, with a time limit.  In the same process
as attncore's rows it stalled in three runs on an H100 (2026-11-25; one of them in its paged prefill plan); in a
process of its own it ran.  A cell it does not finish within the limit says so, and the table is still printed.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from attncore.cli.bench import ROUNDS  # each cell timed this many times, the rows interleaved

COLUMNS = ("single_prefill", "single_decode", "decode plan", "decode run", "paged prefill plan", "prefill run")


def _sizes(device: str) -> dict:
    if device == "cuda":
        return dict(hq=32, hkv=8, d=128, qo=16, kv=128, batch=4, page=16, dtype=torch.bfloat16)
    return dict(hq=4, hkv=2, d=32, qo=4, kv=16, batch=2, page=4, dtype=torch.float16)


def _cells(api, device: str, backend_kw: dict) -> Dict[str, object]:
    """One zero-argument callable per column (inputs and wrappers made once, outside the timing), and under
    ``"ran"`` the wrapper columns' getters of the backend that served them (attncore's wrappers only)."""
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


def _time(fn: Callable[[], object], calls: int, device: str, blocks_out: Optional[list] = None) -> float:
    """us per call of ``fn``: the median over ``_blocks(calls)`` blocks, after 3 warm-up calls (each block's
    figure appended to ``blocks_out`` when given).  The garbage collector is off while the blocks run (as
    ``timeit`` does): a collection the rows' setup left pending would land in one cell of one row."""
    for _ in range(3):  # warm-up: JIT builds, autotuning, caches
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    blocks = _blocks(calls)
    n = calls // blocks
    per_call = []
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(blocks):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
            per_call.append((time.perf_counter() - t) / n * 1e6)
    finally:
        if collecting:
            gc.enable()
    if blocks_out is not None:
        blocks_out += per_call
    return statistics.median(per_call)


def _ran(cells_ran: dict, col: str) -> Optional[str]:
    """The backend that served the attncore cell just timed: the wrapper's, or the newest one-call plan's."""
    if col in cells_ran:
        return cells_ran[col]()
    from attncore.core import plan_cache

    entry = plan_cache.ONE_CALL_PLANS.newest()
    return getattr(entry[0], "backend_name", None) if entry else None


class _LocalRow:
    """One API's cells in this process (``_cells``), timed one column at a time (``time``); ``fastest`` keeps each
    cell's fastest block over its rounds, and for attncore's rows (those with a backend argument) ``ran`` which
    backend served each cell."""

    def __init__(self, api, device: str, backend_kw: dict, calls: int):
        self.device, self.calls, self.ran, self.keep_ran = device, calls, {}, bool(backend_kw)
        self.fastest: Dict[str, float] = {}
        try:
            self.cells, self.error = _cells(api, device, backend_kw), None
        except Exception as e:  # a backend that cannot even make the wrappers here
            self.cells, self.error = None, f"n/a: {type(e).__name__}: {e}".splitlines()[0]

    def time(self, col: str):
        """us per call of ``col``, or "n/a: reason" (refused, not served, or failed: the first line)."""
        if self.error is not None:
            return self.error
        f = self.cells[col]
        try:
            if isinstance(f, tuple):  # run() timed after one plan()
                f[0]()
                f = f[1]
            blocks: list = []
            v = round(_time(f, self.calls, self.device, blocks), 1)
            self.fastest[col] = round(min([*blocks, self.fastest.get(col, float("inf"))]), 1)
            if self.keep_ran:  # FlashInfer's wrappers have no ``backend``
                self.ran[col] = _ran(self.cells["ran"], col)
            return v
        except Exception as e:
            return f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


FLASHINFER_TIMEOUT_S = 300  # FlashInfer's row, its child process's whole life (its kernels warmed beforehand)

# The child's loop: a column name per line in, [column, result, its fastest block so far] per line out ("ready"
# first, once its cells exist)
_CHILD = """
import importlib, json, sys
from attncore.cli.latency import _LocalRow
api = importlib.import_module(sys.argv[1])
row = _LocalRow(api, sys.argv[2], {}, int(sys.argv[3]))
print(json.dumps(["ready", None]), flush=True)
for line in sys.stdin:
    col = line.strip()
    print(json.dumps([col, row.time(col), row.fastest.get(col)]), flush=True)
"""


class _ChildRow:
    """One API's cells (``module``, imported by that name; no backend argument) in a child process that times a
    column when asked (``time``), so that its row interleaves with this process's rows.  A stall costs the time
    limit (``timeout`` seconds for the child's whole life), not the table: the cell it stopped in says why, the
    cells after it say where it stopped."""

    def __init__(self, module: str, device: str, calls: int, timeout: float):
        import tempfile

        self.module, self.deadline = module, time.monotonic() + timeout
        self.timeout, self.why, self.stopped_in = timeout, None, None
        self.fastest: Dict[str, float] = {}
        self._err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child never blocks on it
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, module, device, str(calls)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err)
        self._ready, self._buf = False, b""

    def _line(self) -> Optional[list]:
        """The child's next result line, or None when it stopped (``why`` says how).  Read from the pipe's file
        descriptor into a buffer of our own: a buffered reader could hold a line that select() no longer sees."""
        import select

        fd = self.proc.stdout.fileno()
        while True:
            if b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                try:
                    got = json.loads(line)
                except ValueError:  # something else the child printed
                    continue
                if isinstance(got, list) and len(got) in (2, 3):
                    return got
                continue
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                self.why = f"did not finish within {self.timeout:g} s (its process was stopped)"
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # EOF: it exited
                status = self.proc.wait()
                self._err.seek(0)
                lines = [x for x in self._err.read().splitlines() if x.strip()]
                self.why = f"its process exited with status {status}" + (f": {lines[-1][:160]}" if lines else "")
                return None
            self._buf += chunk

    def time(self, col: str):
        if self.why is not None:
            return f"n/a: not reached ({self.module} stopped in {self.stopped_in})"
        got = None
        if not self._ready:
            got = self._line()
            self._ready = got is not None
        if self._ready:
            try:
                self.proc.stdin.write(col.encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:  # it exited (a broken pipe): _line() reads why
                pass
            got = self._line()
            while got is not None and got[0] != col:
                got = self._line()
        if got is None:
            self.stopped_in = col
            return f"n/a: {self.why}"
        if len(got) == 3 and got[2] is not None:
            self.fastest[col] = got[2]
        return got[1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def _median(values: list):
    """A cell over its rounds: the median of the times, or the first reason when a round had none."""
    times = [v for v in values if not isinstance(v, str)]
    return round(statistics.median(times), 1) if len(times) == len(values) else next(
        v for v in values if isinstance(v, str))


def default_backends(device: str) -> List[str]:
    from attncore.core import registry

    avail = set(registry.available_backends())
    want = ["auto", "triton", "cuda_fa2", "xqa"] if device == "cuda" else ["auto", "reference", "triton"]
    return [n for n in want if n == "auto" or n in avail]


def run_latency(backends: Optional[Sequence[str]] = None, *, device: Optional[str] = None,
                calls: Optional[int] = None, flashinfer: bool = False,
                progress: Optional[Callable[[str], None]] = None,
                flashinfer_timeout: float = FLASHINFER_TIMEOUT_S, rounds: Optional[int] = None) -> dict:
    """The table: each cell the median of ``rounds`` timings.  A round times one column at a time, every row
    back to back (FlashInfer's in its child process, ``_ChildRow``), so that a host whose speed drifts during
    the run (H100 hosts, 2026-11-25: two rows of one path 35% apart when timed a row at a time) moves every row
    of a cell alike.  ``fastest`` is each cell's fastest block of all its rounds: on a shared host whose
    rounds of one cell spread by half (2026-11-25, both libraries), the least-disturbed figure, printed as a
    second table.  ``progress`` is told each cell before it is timed, and the table so far after each round (a
    run stopped from outside still shows it)."""
    import attncore

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    calls = calls or (300 if device == "cuda" else 5)
    rounds = rounds or ROUNDS.get(device, 1)
    names = list(backends) if backends else default_backends(device)
    timers: Dict[str, object] = {}
    for n in names:
        if progress:
            progress(f"latency: attncore {n}")
        timers[f"attncore {n}"] = _LocalRow(attncore, device, {"backend": n}, calls)
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "calls": calls,
            "blocks": _blocks(calls), "rounds": rounds,
            "sizes": {k: str(v) for k, v in _sizes(device).items()}, "columns": list(COLUMNS), "rows": {},
            "ran": {name: t.ran for name, t in timers.items()}, "samples": {}}
    if flashinfer:
        from attncore.cli.bench import _import_flashinfer

        fi = _import_flashinfer(device)  # the errors (no GPU, not importable, the attncore shim) here
        if progress:
            progress("latency: flashinfer (its own process)")
        timers[f"FlashInfer {getattr(fi, '__version__', '?')}"] = _ChildRow("flashinfer", device, calls,
                                                                            flashinfer_timeout)
    samples = info["samples"] = {name: {c: [] for c in COLUMNS} for name in timers}
    try:
        for r in range(rounds):
            for col in COLUMNS:
                for name, t in timers.items():
                    if progress:
                        progress(f"latency:   {name} / {col}" + (f" (round {r + 1} of {rounds})" if rounds > 1 else ""))
                    samples[name][col].append(t.time(col))
            info["rows"] = {name: {c: _median(v) for c, v in by_col.items()} for name, by_col in samples.items()}
            info["fastest"] = {name: {c: t.fastest[c] for c in COLUMNS if c in t.fastest} for name, t in timers.items()}
            if progress and r + 1 < rounds:
                progress(format_latency(info))
    finally:
        for t in timers.values():
            if isinstance(t, _ChildRow):
                t.close()
    return info


def _table(info: dict, cells: Dict[str, dict], notes: list) -> list:
    """The markdown rows of ``cells`` ({row: {column: us or "n/a: why"}}); a reason goes to ``notes``."""
    cols = info["columns"]
    lines = ["| us per call | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in cells.items():
        out = []
        for c in cols:
            v = row.get(c, "n/a")
            if isinstance(v, str):
                if v != "n/a":
                    notes.append(f"{name} / {c}: {v}")
                v = "n/a"
            out.append(str(v))
        lines.append(f"| {name} | " + " | ".join(out) + " |")
    return lines


def format_latency(info: dict) -> str:
    blocks = info.get("blocks", 1)
    rounds = info.get("rounds", 1)
    how = f"the median of {rounds} rounds, the rows interleaved, of " if rounds > 1 else ""
    notes: list = []
    lines = [f"host time per call, us ({how}{info['calls']} calls: the median of {blocks} blocks, the device synced "
             f"after each; {info['device']})"] + _table(info, info["rows"], notes)
    fastest = info.get("fastest")
    if fastest and (rounds > 1 or blocks > 1):  # a cell without one (refused) reads n/a; its reason is above
        lines += [f"the fastest block of each cell, us (of {rounds * blocks})"] + _table(info, fastest, [])
    for name, by_col in info.get("ran", {}).items():
        if by_col and name.endswith(" auto"):  # what auto picked, per cell (a forced row ran its own backend)
            notes.append(f"{name} ran: " + ", ".join(f"{c} {b}" for c, b in by_col.items()))
    return "\n".join(lines + notes)
