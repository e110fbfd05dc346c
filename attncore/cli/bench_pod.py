"""``attncore bench`` for POD (issue 16): PD1/PD2 and a sweep, fused vs composed-serial in one run.

Every point runs through ``PODWithPagedKVCacheWrapper`` (a causal single prefill with qo = kv, plus a paged
decode batch; bf16, 32/8 heads, d128, page 16 on CUDA): ``fused`` forces the fused op of ``--pod-backend``
(default: the one auto ranks first, ``default_pod_backend``) on every batch, ``serial`` composes the parts one
after the other (``fuse=False, overlap="serial"``, each part on auto's backend), ``streams`` composes them on
two CUDA streams at the same time (``fuse=False, overlap="streams"``; serial on a CPU), ``sm_split`` on two
disjoint sets of SMs (``fuse=False, overlap="sm_split"``: the split its model picks; serial on a CPU),
``auto`` is what the wrapper does by default (fused where the backend's plan estimates a gain, else the SM
split where its model says it gains, else serial; the table says which ran), and ``flashinfer`` (with
``--flashinfer``) is FlashInfer's POD wrapper on the same inputs. The sweep (``--pod-sweep``; alone, without
PD ids, it runs only the sweep): prefill 512 / 2k / 8k x decode batch 8 / 32 / 128 x decode kv 1k / 4k / 16k,
with the median speedup and, with ``--plot``, a plot of the speedup over serial (matplotlib, optional). A
point's columns share its inputs and are timed in interleaved rounds (``measure``). On a CPU the shapes shrink
(Triton's interpreter) and the figures only show that the paths run.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional

import torch

from attncore.cli.bench import PAGE_ORDERS, ROUNDS, _timer, check_page_order, interleave, page_ids


@dataclass(frozen=True)
class PODWorkload:
    id: str
    qo: int  # prefill rows = its kv (causal)
    batch: int  # decode requests
    kv: int  # decode kv per request
    hq: int = 32
    hkv: int = 8
    d: int = 128
    page: int = 16


POD_WORKLOADS = [PODWorkload("PD1", 2048, 64, 4096), PODWorkload("PD2", 4096, 32, 4096)]
SWEEP = [PODWorkload(f"S-p{qo}-b{b}-kv{kv}", qo, b, kv)
         for qo in (512, 2048, 8192) for b in (8, 32, 128) for kv in (1024, 4096, 16384)]


def _shrink(w: PODWorkload) -> PODWorkload:
    return replace(w, qo=min(w.qo, 32), batch=min(w.batch, 2), kv=min(w.kv, 64), hq=4, hkv=2, d=32, page=4)


def _inputs(w: PODWorkload, device: str, dtype, page_order: str = PAGE_ORDERS[0]) -> dict:
    """The workload's tensors, made once and shared by every column (one KV cache: the sweep's largest point
    holds 8.6 GB of it); the decode's pages shuffled (a fragmented cache) or in order, as ``attncore bench``'s."""
    pages = (w.kv + w.page - 1) // w.page
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    return dict(
        ws=torch.empty(128 << 20, dtype=torch.uint8, device=device),
        indptr=torch.arange(w.batch + 1, dtype=torch.int32, device=device) * pages,
        last=torch.full((w.batch,), w.kv - (pages - 1) * w.page, dtype=torch.int32, device=device),
        indices=page_ids(w.batch * pages, page_order, device),
        cache=rnd(w.batch * pages, 2, w.page, w.hkv, w.d), qp=rnd(w.qo, w.hq, w.d), kp=rnd(w.qo, w.hkv, w.d),
        vp=rnd(w.qo, w.hkv, w.d), qd=rnd(w.batch, w.hq, w.d))


def _setup(w: PODWorkload, x: dict, dtype, api, kwargs: dict) -> tuple:
    """Plan the POD workload on ``api`` (attncore or flashinfer) over the inputs ``x`` and return (run closure,
    wrapper)."""
    wr = api.PODWithPagedKVCacheWrapper(x["ws"], "NHD", **kwargs)
    wr.plan(x["indptr"], x["indices"], x["last"], w.hq, w.hkv, w.d, w.page, q_data_type=dtype)

    def run():
        wr.run(x["qp"], x["kp"], x["vp"], x["qd"], x["cache"], causal_p=True)
    run()  # warm-up (JIT compiles, plans)
    return run, wr


@contextlib.contextmanager
def _forced(name: str):
    """The registered backend ``name`` with its fused op forced on every batch while in the block; ValueError
    when it has no fused POD op."""
    from attncore.core import registry

    entry = registry.entries().get(name)
    if entry is None or entry.backend is None or not any("pod" in c.ops for c in entry.backend.capabilities):
        raise ValueError(f"--pod-backend: {name!r} has no fused POD op")
    b = entry.backend
    if not hasattr(b, "pod_fuse"):
        raise ValueError(f"--pod-backend: {name!r} has no pod_fuse knob to force its fused op with")
    old = b.pod_fuse
    b.pod_fuse = "always"
    try:
        yield
    finally:
        b.pod_fuse = old


def default_pod_backend(device: str) -> str:
    """The backend whose fused op auto ranks first for a POD problem of the workloads' shape on ``device`` (the
    bench's fused column): cuda_fa2's pod90 on sm_90, Triton's fused launch elsewhere."""
    from attncore.core import _api, selector
    from attncore.core.problem import pod_problem

    w = POD_WORKLOADS[0] if device == "cuda" else _shrink(POD_WORKLOADS[0])
    dt = torch.bfloat16 if device == "cuda" else torch.float16
    kw = dict(q_dtype=dt, kv_dtype=dt, num_qo_heads=w.hq, num_kv_heads=w.hkv, head_dim=w.d)
    pp = _api.build_problem("single_prefill", torch.device(device), mask="causal", **kw)
    pd = _api.build_problem("batch_decode", torch.device(device), page_size=w.page, mask="causal", **kw)
    try:
        return selector.select(pod_problem("pod", pp, pd), "auto").name
    except selector.BackendSelectionError:
        return "triton"


def measure(w: PODWorkload, *, device: str, pod_backend: str = "triton", fi=None,
            time_fn: Optional[Callable] = None, rounds: Optional[int] = None, page_order: str = PAGE_ORDERS[0]) -> Dict:
    """One row: ms of fused / serial / streams / sm_split / auto (/ flashinfer) and the speedups over serial.
    Every column is planned first on the same inputs, then timed in ``rounds`` interleaved rounds (bench's
    ``interleave``), a column's figure the median of its rounds (in one sweep before the rounds rotated, auto,
    timed after the SM split in every round, ran the serial path 2.4% slower than serial)."""
    import attncore

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    t = time_fn or _timer(device)
    rounds = rounds or ROUNDS.get(device, 1)
    row: Dict = {"id": w.id, "shape": f"p{w.qo} + {w.batch}x{w.kv}", "rounds": rounds}
    x = _inputs(w, device, dtype, page_order)
    runs: Dict[str, tuple] = {}  # column: (run closure, the context it is timed in)
    try:
        with _forced(pod_backend):
            run, wr = _setup(w, x, dtype, attncore, dict(backend=pod_backend))
        if wr.fused_reason is not None:
            raise RuntimeError(f"{pod_backend} did not fuse: {wr.fused_reason}")
        runs["fused"] = (run, lambda: _forced(pod_backend))
    except Exception as e:  # a row says why, the others still run
        row["fused_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    run, wr = _setup(w, x, dtype, attncore, dict(fuse=False, overlap="serial"))
    runs["serial"] = (run, contextlib.nullcontext)
    row["serial_backends"] = wr.backend
    run, wr = _setup(w, x, dtype, attncore, dict(fuse=False, overlap="streams"))
    runs["streams"] = (run, contextlib.nullcontext)
    row["streams_mode"] = wr.mode  # "serial" where the device has no streams (overlap_reason says why)
    if wr.overlap_reason:
        row["streams_reason"] = wr.overlap_reason
    run, wr = _setup(w, x, dtype, attncore, dict(fuse=False, overlap="sm_split"))
    runs["sm_split"] = (run, contextlib.nullcontext)
    row["sm_split_sms"] = wr.sm_split  # None where the device cannot split (overlap_reason says why)
    if wr.overlap_reason:
        row["sm_split_reason"] = wr.overlap_reason
    run, wr = _setup(w, x, dtype, attncore, {})
    runs["auto"] = (run, contextlib.nullcontext)
    row["auto_ran"] = wr.backend if wr.mode == "fused" else f"{wr.mode}{wr.sm_split or ''}: {wr.backend}"
    row["auto_reason"] = wr.fused_reason
    if fi is not None:
        try:
            runs["flashinfer"] = (_setup(w, x, dtype, fi, {})[0], contextlib.nullcontext)
        except Exception as e:
            row["flashinfer_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    def timed(run, ctx):
        with ctx():
            return t(run)

    times = interleave({k: (lambda rc=rc: timed(*rc)) for k, rc in runs.items()}, rounds)
    for k, v in times.items():
        row[k] = statistics.median(v)
        row[f"{k}_rounds"] = v
    for k in ("fused", "streams", "sm_split", "auto", "flashinfer"):
        if k in row:
            row[f"{k}_speedup"] = row["serial"] / row[k]
    return row


def run_pod_bench(ids: Optional[List[str]] = None, *, sweep: bool = False, device: Optional[str] = None,
                  pod_backend: Optional[str] = None, flashinfer: bool = False, progress=None,
                  page_order: str = PAGE_ORDERS[0], rounds: Optional[int] = None) -> Dict:
    check_page_order(page_order)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    pod_backend = pod_backend or default_pod_backend(device)
    fi = None
    if flashinfer:
        from attncore.cli.bench import _import_flashinfer

        fi = _import_flashinfer(device)
    known = {w.id: w for w in POD_WORKLOADS}
    unknown = [i for i in ids or () if i not in known]
    if unknown:
        raise ValueError(f"unknown POD workload {', '.join(unknown)}; known: {', '.join(known)}")
    todo = [known[i] for i in ids] if ids else ([] if sweep else list(POD_WORKLOADS))
    if sweep:
        todo += SWEEP if device == "cuda" else SWEEP[:1]
    if device != "cuda":
        todo = [_shrink(w) for w in todo]
    rows = []
    for w in todo:
        rows.append(measure(w, device=device, pod_backend=pod_backend, fi=fi, page_order=page_order, rounds=rounds))
        if progress:  # each row as it is measured: a run cut short still shows what it measured
            progress("pod bench: " + _fmt_row(rows[-1]))
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "pod_backend": pod_backend,
            "page_order": page_order, "rows": rows}
    info.update(sweep_summary(rows))
    return info


def sweep_summary(rows: List[Dict]) -> Dict:
    """The sweep rows' (``S-`` ids) median speedups over serial per column, and auto's worst point: its speedup,
    id and what auto ran there (a worst point where auto ran the serial path itself is the timing's spread)."""
    sweep = [r for r in rows if r["id"].startswith("S-")]
    sp = [r["fused_speedup"] for r in sweep if "fused_speedup" in r]
    auto = [r for r in sweep if "auto_speedup" in r]
    streams = [r["streams_speedup"] for r in sweep if "streams_speedup" in r]
    split = [r["sm_split_speedup"] for r in sweep if "sm_split_speedup" in r]
    info: Dict = {}
    if sp:
        info["sweep_median_fused_speedup"] = statistics.median(sp)
    if streams:
        info["sweep_median_streams_speedup"] = statistics.median(streams)
    if split:
        info["sweep_median_sm_split_speedup"] = statistics.median(split)
    if auto:
        info["sweep_median_auto_speedup"] = statistics.median(r["auto_speedup"] for r in auto)
        worst = min(auto, key=lambda r: r["auto_speedup"])
        info["sweep_worst_auto_speedup"] = worst["auto_speedup"]
        info["sweep_worst_auto"] = f"{worst['id']}, auto ran {worst.get('auto_ran')}"
    return info


def _num(x, digits: int = 3) -> str:
    """A figure, or "-" where the column was not measured (a missing speedup is not 0)."""
    return f"{x:.{digits}f}" if isinstance(x, float) else "-"


def _fmt_row(r: Dict) -> str:
    return (f"{r['id']:<20} {r['shape']:<18} {_num(r.get('fused')):>8} {_num(r.get('serial')):>8} "
            f"{_num(r.get('streams')):>8} {_num(r.get('sm_split')):>8} {_num(r.get('auto')):>8} "
            f"{_num(r.get('flashinfer')):>8} {_num(r.get('fused_speedup'), 2):>8} "
            f"{_num(r.get('streams_speedup'), 2):>9} {_num(r.get('sm_split_speedup'), 2):>7} "
            f"{_num(r.get('auto_speedup'), 2):>7} {_num(r.get('flashinfer_speedup'), 2):>6}  {r.get('auto_ran')}")


def format_pod_table(info: Dict) -> str:
    rounds = sorted({r["rounds"] for r in info["rows"] if "rounds" in r})
    per = f", the median of {'/'.join(map(str, rounds))} interleaved rounds" if rounds else ""
    lines = [f"POD on {info['device']} (ms{per}; speedup = serial / x; fused: {info.get('pod_backend', '?')})",
             f"{'id':<20} {'shape':<18} {'fused':>8} {'serial':>8} {'streams':>8} {'sm_split':>8} {'auto':>8} "
             f"{'flashinf':>8} {'fused x':>8} {'streams x':>9} {'split x':>7} {'auto x':>7} {'fi x':>6}  auto ran"]
    for r in info["rows"]:
        lines.append(_fmt_row(r))
        for k in ("fused_error", "streams_reason", "sm_split_reason", "flashinfer_error"):
            if k in r:
                lines.append(f"    {k}: {r[k]}")
    if "sweep_median_auto_speedup" in info:
        lines.append(f"sweep: median speedup over serial: fused {_num(info.get('sweep_median_fused_speedup'))}, "
                     f"streams {_num(info.get('sweep_median_streams_speedup'))}, "
                     f"sm_split {_num(info.get('sweep_median_sm_split_speedup'))}, auto "
                     f"{info['sweep_median_auto_speedup']:.3f}; worst auto {info['sweep_worst_auto_speedup']:.3f} "
                     f"(target: >= 0.98) at {info.get('sweep_worst_auto', '?')}")
    return "\n".join(lines)


def check_plot():
    """matplotlib's pyplot (Agg), or ValueError saying how to get it: --plot checks it before timing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError(f"--plot: matplotlib is not importable ({e}); pip install matplotlib") from None
    return plt


def plot(info: Dict, path: str) -> None:
    """Speedup over serial of fused, streams, sm_split and auto (and FlashInfer) per point; matplotlib is
    optional."""
    plt = check_plot()
    rows = info["rows"]
    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(max(6, 0.4 * len(rows)), 4))
    for key, mark in (("fused_speedup", "o"), ("streams_speedup", "^"), ("sm_split_speedup", "v"),
                      ("auto_speedup", "x"), ("flashinfer_speedup", "s")):
        ys = [r.get(key) for r in rows]
        if any(y is not None for y in ys):
            ax.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], mark,
                    label=key.replace("_speedup", ""))
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(xs)
    ax.set_xticklabels([r["id"] for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("speedup over serial")
    ax.set_title(f"POD on {info['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
