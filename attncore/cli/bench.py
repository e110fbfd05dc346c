"""``attncore bench``: the standard workloads of docs/performance.md through the public API.

Ceilings (read-only bandwidth, device copy, bf16 matmul) and torch SDPA are measured in the same
run; with ``--flashinfer`` so is FlashInfer (any importable ``flashinfer``), driven through the
same code as attncore, since the API is the same.  Timing on CUDA uses ``triton.testing.do_bench`` (median), or with
``sustain`` back-to-back windows (``sustained``); decode inputs rotate among several caches so repeated runs do not
measure L2.  A workload's columns (backends, FlashInfer, torch SDPA) are planned first and then timed in interleaved
rounds (``interleave``), each column's figure the median of its rounds.  On a CPU the shapes shrink and the figures
only show that the path runs.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from attncore.core.selector import BackendSelectionError

WORKSPACE_MB = 512  # the float workspace every attncore workload is planned with


@dataclass(frozen=True)
class Workload:
    id: str
    op: str  # prefill | ragged_prefill | paged_prefill | decode | xqa
    batch: int
    qo: int
    kv: int
    hq: int = 32
    hkv: int = 8
    d: int = 128
    page: int = 16
    causal: bool = True
    kv_fp8: bool = False
    q_len: int = 1
    sinks: bool = False
    dv: int = 0  # V's and the output's head dim where it differs from d (prefill only; 0: d)

    @property
    def vo(self) -> int:
        return self.dv or self.d


WORKLOADS = [
    Workload("D1", "decode", 64, 1, 4096),
    Workload("D2-B16", "decode", 16, 1, 16384),
    Workload("D2-B1", "decode", 1, 1, 32768),
    Workload("D3", "decode", 128, 1, 2048, hq=32, hkv=32),
    Workload("D1p1", "decode", 64, 1, 4096, page=1),
    Workload("D5", "decode", 64, 1, 4096, kv_fp8=True),
    Workload("X1-q1", "xqa", 64, 1, 8192, hq=64, hkv=8, sinks=True),
    Workload("X1-q2", "xqa", 64, 2, 8192, hq=64, hkv=8, q_len=2, sinks=True),
    Workload("X1-q4", "xqa", 64, 4, 8192, hq=64, hkv=8, q_len=4, sinks=True),
    Workload("X1-fp8", "xqa", 64, 1, 8192, hq=64, hkv=8, kv_fp8=True, sinks=True),
    Workload("X1-fp8-q2", "xqa", 64, 2, 8192, hq=64, hkv=8, kv_fp8=True, q_len=2, sinks=True),
    Workload("X1-fp8-q4", "xqa", 64, 4, 8192, hq=64, hkv=8, kv_fp8=True, q_len=4, sinks=True),
    Workload("P1-causal", "prefill", 1, 4096, 4096),
    Workload("P1-full", "prefill", 1, 4096, 4096, causal=False),
    Workload("P2-d64", "prefill", 1, 4096, 4096, d=64),
    Workload("P2-d256", "prefill", 1, 4096, 4096, hq=16, hkv=16, d=256),
    Workload("P3-p16", "paged_prefill", 8, 2048, 2048),
    Workload("P3-p1", "paged_prefill", 8, 2048, 2048, page=1),
    Workload("P4", "paged_prefill", 16, 512, 4096),
    Workload("P5-d192", "prefill", 1, 4096, 4096, hq=32, hkv=32, d=192, dv=128),  # DeepSeek's prefill head dims
    Workload("P5-d192-p16", "paged_prefill", 8, 2048, 2048, hq=32, hkv=32, d=192, dv=128),  # (a (K, V) tuple cache)
    # ragged K/V, batches of many 1-2k prompts: where cuda_fa2 trailed FlashInfer on an H200 (BENCHMARKS 2an)
    Workload("R1-8x2k", "ragged_prefill", 8, 2048, 2048),
    Workload("R1-16x1k", "ragged_prefill", 16, 1024, 1024),
]


PAGE_ORDERS = ("shuffled", "sequential")  # --page-order: a fragmented cache (the default), or pages in order


def check_page_order(page_order: str) -> None:
    if page_order not in PAGE_ORDERS:
        raise ValueError(f"page_order {page_order!r}: 'shuffled' or 'sequential'")


def page_ids(n: int, page_order: str, device) -> torch.Tensor:
    """int32 page ids of a paged workload's n pages: shuffled, or in order."""
    return (torch.randperm(n, device=device) if page_order == "shuffled" else torch.arange(n, device=device)).to(
        torch.int32)


def select_workloads(ids: Optional[Sequence[str]] = None) -> List[Workload]:
    """The workloads named by ``ids`` (an id, or its prefix before "-": "P1" is every P1-*); all
    when empty.  An id that names none is a ValueError listing the known ones."""
    if not ids:
        return list(WORKLOADS)
    unknown = [i for i in ids if not any(i in (w.id, w.id.split("-")[0]) for w in WORKLOADS)]
    if unknown:
        raise ValueError(f"unknown workload {', '.join(unknown)}; known: {', '.join(w.id for w in WORKLOADS)}")
    return [w for w in WORKLOADS if w.id in ids or w.id.split("-")[0] in ids]


CPU_SCALE = {"qo": 64, "kv": 256, "batch": 2}


def _shrink(w: Workload) -> Workload:
    from dataclasses import replace

    return replace(w, batch=min(w.batch, CPU_SCALE["batch"]), qo=min(w.qo, CPU_SCALE["qo"] if w.qo > 4 else w.qo),
                   kv=min(w.kv, CPU_SCALE["kv"]), hq=min(w.hq, 8), hkv=min(w.hkv, 2) if w.hkv < w.hq else min(w.hq, 8),
                   d=min(w.d, 64), dv=min(w.dv, 32))


CPU_REPS = 3  # calls a CPU figure is the median of


def _timer(device: str, warmup: int = 25, rep: int = 100, cpu_reps: int = CPU_REPS,
           sustain: Optional[float] = None) -> Callable[[Callable[[], None]], float]:
    """A function timing ``fn`` in ms: on CUDA ``triton.testing.do_bench``'s median (``warmup`` and
    ``rep`` in ms), on the CPU the median of ``cpu_reps`` calls after one warm-up call; with ``sustain``
    (seconds) on either, ``sustained``'s mean over a back-to-back window of that length."""
    if sustain is not None:
        return lambda fn: sustained(fn, sustain, device)
    if device == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))

    def cpu(fn):
        fn()
        ts = []
        for _ in range(cpu_reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[len(ts) // 2]

    return cpu


def sustained(fn: Callable[[], None], secs: float, device: str = "cuda") -> float:
    """ms per call of ``fn`` run back to back for ``secs`` seconds after a warm-up call (on CUDA from events around
    the whole window): the steady state, where a compute-bound kernel runs at the board's power limit (an H200's
    prefill: BENCHMARKS.md 2ak, 2ao), against do_bench's short windows that start from whatever clock the last left."""
    cuda = device == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < secs:
        for _ in range(20):
            fn()
        n += 20
        if cuda:
            torch.cuda.synchronize()
    if not cuda:
        return (time.perf_counter() - t0) * 1e3 / n
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


ROUNDS = {"cuda": 3, "cpu": 1}  # timing rounds per workload (and POD point) unless --rounds says otherwise


def interleave(columns: Dict[str, Callable[[], float]], rounds: int) -> Dict[str, List[float]]:
    """Each column's timings over ``rounds`` rounds: a round times every column once, back to back, each round
    starting one column later than the one before.  A GPU whose speed drifts moves every column of a round alike
    (timed a column at a time, two columns running the same kernel differed by 5%: P1 non-causal, H200,
    2026-11-29; two POD columns of one path by 7%), and no column always follows the same one."""
    names = list(columns)
    times: Dict[str, List[float]] = {k: [] for k in names}
    for r in range(rounds if names else 0):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(columns[k]())
    return times


def copies_for(w: Workload, device: str, back_to_back: bool = False) -> int:
    """How many input copies to rotate so that repeated runs do not read from L2 (1 on the CPU): together
    twice an L2 (50 MB) of bytes, or four times for back-to-back runs, which no flush separates (one
    134 MB cache read again at once may still find its lines there)."""
    span = 4 if back_to_back else 2
    return 1 if device != "cuda" else max(1, min(4, int(span * 50e6 // max(_bytes(w), 1)) + 1))


def time_runs(t: Callable[[Callable[[], None]], float], runs: Sequence[Callable[[], None]]) -> float:
    """Time the run closures of ``_setup`` with timer ``t``, each call taking the next input copy."""
    i = [0]

    def step():
        runs[i[0] % len(runs)]()
        i[0] += 1

    return t(step)


def measure_ceilings(device: str, t: Optional[Callable[[Callable[[], None]], float]] = None) -> Dict[str, float]:
    """Read-only bandwidth (TB/s), device copy (TB/s, read+write), bf16 matmul (TFLOP/s), timed by ``t``
    (default: ``_timer``'s do_bench)."""
    if device != "cuda":
        return {}
    t = t or _timer(device)
    x = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)  # 2 GiB: launch and tail costs vanish
    y = torch.empty_like(x)
    # fp32 accumulation: a bf16-output sum ran at 2.76 TB/s where kernels read at 2.9+ (H100, 2026-11-22)
    read = x.numel() * 2 / (t(lambda: x.sum(dtype=torch.float32)) * 1e-3) / 1e12
    copy = 2 * x.numel() * 2 / (t(lambda: y.copy_(x)) * 1e-3) / 1e12
    del x, y
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm = 2 * 8192 ** 3 / (t(lambda: a @ b) * 1e-3) / 1e12
    return {"read_TBps": read, "copy_TBps": copy, "bf16_matmul_TFLOPs": mm}


def read_at_size(nbytes: float, t: Callable[[Callable[[], None]], float], memo: Dict, device: str = "cuda",
                 copies: int = 1) -> float:
    """ms of a plain read of ``nbytes`` (an fp32-accumulated sum), timed like the workloads, rotating among
    ``copies`` buffers as they do.  do_bench zeroes a 256 MB buffer before each call, so every call starts
    with up to 50 MB of dirty L2 lines to write back; that costs a short read as much as a short kernel
    (H100: a 134 MB read runs at 2.15 TB/s against 3.03 for 2 GiB).  A decode's time over this one is its
    share of what a read of its size gets."""
    n = int(nbytes) // 2
    if n not in memo:
        xs = [torch.empty(n, device=device, dtype=torch.bfloat16).normal_() for _ in range(copies)]
        memo[n] = time_runs(t, [lambda x=x: x.sum(dtype=torch.float32) for x in xs])
        del xs
    return memo[n]


def _flops(w: Workload) -> float:
    pairs = w.qo * w.kv - (w.qo * (w.qo - 1) / 2 if w.causal else 0)
    return 2.0 * pairs * w.hq * (w.d + w.vo) * w.batch


def _bytes(w: Workload) -> float:
    kv_el = 1 if w.kv_fp8 else 2
    return w.batch * w.kv * w.hkv * w.d * 2 * kv_el + 2 * w.batch * w.q_len * w.hq * w.d * 2


def _setup(w: Workload, backend: str, device: str, dtype: torch.dtype, copies: int,
           page_order: str = PAGE_ORDERS[0], api=None):
    """Plan the workload and return a list of run closures (one per input copy).  Paged caches
    get a shuffled page table (a fragmented cache, the default) or pages in order.  ``api``: the
    module to drive (default attncore; ``flashinfer`` for the comparison rows)."""
    import attncore

    ac = api or attncore
    # A serving stack sizes its float workspace once; 512 MiB lets Triton's paged prefill gather the
    # pages of P4 (about 300 MiB of K/V) into it, which a 128 MiB workspace cannot hold (then it
    # reads the pages in place, about 8% slower on P4: BENCHMARKS.md).  Other backends use a few MiB.
    ws = torch.empty(WORKSPACE_MB << 20, dtype=torch.uint8, device=device)
    kv_dtype = torch.float8_e4m3fn if w.kv_fp8 else dtype
    if w.op == "prefill" and api is not None:  # the one-call function (plan + run each call)
        runs = []
        for _ in range(copies):
            q, k, v = (torch.randn(n, h, d, device=device, dtype=dtype)
                       for n, h, d in ((w.qo, w.hq, w.d), (w.kv, w.hkv, w.d), (w.kv, w.hkv, w.vo)))
            ac.single_prefill_with_kv_cache(q, k, v, causal=w.causal)
            runs.append(lambda q=q, k=k, v=v: ac.single_prefill_with_kv_cache(q, k, v, causal=w.causal))
        return runs, None
    if w.op == "prefill":
        from attncore.core.single_prefill import plan_single

        runs, chosen = [], None
        for _ in range(copies):
            q = torch.randn(w.qo, w.hq, w.d, device=device, dtype=dtype)
            k = torch.randn(w.kv, w.hkv, w.d, device=device, dtype=dtype)
            v = torch.randn(w.kv, w.hkv, w.vo, device=device, dtype=dtype)
            planned, args = plan_single(q=q, k=k, v=v, custom_mask=None, packed_custom_mask=None, causal=w.causal,
                                        kv_layout="NHD", pos_encoding_mode="NONE", sm_scale=None, window_left=-1,
                                        logits_soft_cap=None, rope_scale=None, rope_theta=None, return_lse=False,
                                        backend=backend, sinks=None, q_scale=None, k_scale=None, v_scale=None,
                                        out=None, lse=None)
            planned.run(args)  # warm-up (JIT compiles)
            runs.append(lambda p=planned, a=args: p.run(a))
            chosen = planned.backend_name
        return runs, chosen
    if w.op == "ragged_prefill":
        wr = ac.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", **({} if api else {"backend": backend}))
        qo = torch.arange(w.batch + 1, dtype=torch.int32, device=device) * w.qo
        kvp = torch.arange(w.batch + 1, dtype=torch.int32, device=device) * w.kv
        wr.plan(qo, kvp, w.hq, w.hkv, w.d, causal=w.causal, q_data_type=dtype, kv_data_type=kv_dtype,
                **({"head_dim_vo": w.dv} if w.dv else {}))
        q = torch.randn(w.batch * w.qo, w.hq, w.d, device=device, dtype=dtype)
        kvs = [tuple(torch.randn(w.batch * w.kv, w.hkv, d, device=device, dtype=dtype).to(kv_dtype)
                     for d in (w.d, w.vo)) for _ in range(copies)]
        wr.run(q, *kvs[0])
        return [lambda kv=kv: wr.run(q, *kv) for kv in kvs], None if api else wr.backend
    pages = (w.kv + w.page - 1) // w.page
    indptr = torch.arange(w.batch + 1, dtype=torch.int32, device=device) * pages
    last = torch.full((w.batch,), w.kv - (pages - 1) * w.page, dtype=torch.int32, device=device)
    total = w.batch * pages
    indices = page_ids(total, page_order, device)
    if w.dv:  # a (K, V) tuple cache: V's pages of their own width
        caches = [tuple(torch.randn(total, w.page, w.hkv, d, device=device, dtype=dtype).to(kv_dtype)
                        for d in (w.d, w.vo)) for _ in range(copies)]
    else:
        caches = [torch.randn(total, 2, w.page, w.hkv, w.d, device=device, dtype=dtype).to(kv_dtype)
                  for _ in range(copies)]
    rows = w.batch * (w.q_len if w.op in ("decode", "xqa") else w.qo)
    q = torch.randn(rows, w.hq, w.d, device=device, dtype=dtype)
    if w.op == "paged_prefill":
        wr = ac.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **({} if api else {"backend": backend}))
        qo = torch.arange(w.batch + 1, dtype=torch.int32, device=device) * w.qo
        wr.plan(qo, indptr, indices, last, w.hq, w.hkv, w.d, w.page, causal=w.causal, q_data_type=dtype,
                kv_data_type=kv_dtype, **({"head_dim_vo": w.dv} if w.dv else {}))
    elif w.op == "decode":
        # tensor cores for GQA groups of 4+ (FlashInfer's own advice; a hint attncore's backends ignore)
        wr = ac.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=w.hq // w.hkv >= 4,
                                                   **({} if api else {"backend": backend}))
        wr.plan(indptr, indices, last, w.hq, w.hkv, w.d, w.page, q_data_type=dtype, kv_data_type=kv_dtype,
                **({} if w.q_len == 1 else {"q_len_per_req": w.q_len}))
    else:
        if not hasattr(ac, "xqa_batch_decode_with_kv_cache"):
            raise BackendSelectionError(f"{ac.__name__} has no xqa_batch_decode_with_kv_cache", [])
        bt = indices.reshape(w.batch, pages)
        seq = torch.full((w.batch,), w.kv, dtype=torch.int32, device=device)
        sinks = torch.randn(w.hq, device=device) if w.sinks else None
        ws0 = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
        out = torch.empty_like(q)

        def xqa(c):
            return ac.xqa_batch_decode_with_kv_cache(q, c, ws0, bt, seq, w.kv, bmm1_scale=1 / math.sqrt(w.d),
                                                     out=out, sinks=sinks, q_len_per_req=w.q_len,
                                                     **({} if api else {"backend": backend}))

        xqa(caches[0])
        return [lambda c=c: xqa(c) for c in caches], None
    wr.run(q, caches[0])
    return [lambda c=c: wr.run(q, c) for c in caches], None if api else wr.backend


def _sdpa(w: Workload, device: str, dtype: torch.dtype) -> Optional[Callable[[], None]]:
    if w.op != "prefill":
        return None
    import torch.nn.functional as F

    q = torch.randn(1, w.hq, w.qo, w.d, device=device, dtype=dtype)
    k = torch.randn(1, w.hkv, w.kv, w.d, device=device, dtype=dtype)
    v = torch.randn(1, w.hkv, w.kv, w.vo, device=device, dtype=dtype)
    if w.causal and w.qo != w.kv:
        return None
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=w.causal, enable_gqa=w.hkv != w.hq)


def run_bench(backends: Optional[Sequence[str]] = None, *, ids: Optional[Sequence[str]] = None,
              device: Optional[str] = None, progress: Callable[[str], None] = print,
              page_order: str = PAGE_ORDERS[0], flashinfer: bool = False, rounds: Optional[int] = None,
              sustain: Optional[float] = None) -> Dict:
    """``flashinfer``: also time the importable ``flashinfer`` package on each workload (a row
    named ``flashinfer``), in this run.  ``rounds``: each workload's columns timed in that many interleaved
    rounds (``interleave``; default ``ROUNDS``), a row's ``time_ms`` the median of its ``rounds_ms``.
    ``sustain``: every figure, ceilings included, timed by back-to-back windows of that many seconds over
    inputs rotated beyond L2 (no flush between calls, as in a serving step's stream of kernels) instead of
    do_bench's flushed calls."""
    check_page_order(page_order)
    if sustain is not None and not sustain > 0:
        raise ValueError(f"sustain {sustain!r}: a window of seconds > 0")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    fi = _import_flashinfer(device) if flashinfer else None
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    names = list(dict.fromkeys(backends)) if backends else ["auto"]  # a column per backend, named once
    wls = select_workloads(ids)
    if device != "cuda":
        progress("no CUDA GPU: running small shapes on the CPU; the figures only show the paths run")
        wls = [_shrink(w) for w in wls]
    t = _timer(device, sustain=sustain)
    ceil = measure_ceilings(device, t)
    if ceil:
        progress("ceilings: read %.2f TB/s, copy %.2f TB/s, bf16 matmul %.0f TFLOP/s" % (
            ceil["read_TBps"], ceil["copy_TBps"], ceil["bf16_matmul_TFLOPs"]))
    rounds = rounds or ROUNDS.get(device, 1)
    rows, at_size = [], {}
    for w in wls:
        copies = copies_for(w, device, back_to_back=sustain is not None)
        entries = [(n, None) for n in names] + ([("flashinfer", fi)] if fi else [])
        planned: Dict[str, tuple] = {}  # column: (its row, the timing closure)
        for name, api in entries:
            row = {"workload": w.id, "backend": name}
            rows.append(row)
            try:
                runs, chosen = _setup(w, "auto" if api else name, device, dtype, copies, page_order, api=api)
            except BackendSelectionError as e:
                row.update(status="n/a", detail=str(e)[:160])
                progress(f"{w.id:11s} {name:10s} n/a")
                continue
            except Exception as e:
                row.update(status="ERROR", detail=f"{type(e).__name__}: {e}"[:200])
                progress(f"{w.id:11s} {name:10s} ERROR {row['detail']}")
                continue
            row["chosen"] = chosen or name
            planned[name] = (row, lambda runs=runs: time_runs(t, runs))
        sd = _sdpa(w, device, dtype) if device == "cuda" else None
        if sd is not None:
            row = {"workload": w.id, "backend": "torch-sdpa"}
            rows.append(row)
            planned["torch-sdpa"] = (row, lambda: t(sd))
        failed: Dict[str, str] = {}  # column: why a timing raised (its row says so; the other columns go on)

        def guarded(name, fn):
            def timed():
                if name not in failed:
                    try:
                        return fn()
                    except Exception as e:
                        failed[name] = f"{type(e).__name__}: {e}"[:200]
                return math.nan
            return timed

        times = interleave({k: guarded(k, fn) for k, (_, fn) in planned.items()}, rounds)
        for name, (row, _) in planned.items():
            if name in failed:
                row.pop("chosen", None)
                row.update(status="ERROR", detail=failed[name])
                progress(f"{w.id:11s} {name:10s} ERROR {row['detail']}")
                continue
            row.update(time_ms=statistics.median(times[name]), rounds_ms=times[name])
            _figures(row, w, ceil)
            if "TBps" in row and device == "cuda":
                row["read_at_size_ms"] = read_at_size(_bytes(w), t, at_size, copies=copies)
                row["frac_read_at_size"] = row["read_at_size_ms"] / row["time_ms"]
            progress(_fmt_row(row))
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "dtype": str(dtype),
            "page_order": page_order, "rounds": rounds, "timing": timing_name(device, sustain), "ceilings": ceil,
            "results": rows}
    if fi:
        info["flashinfer"] = getattr(fi, "__version__", "?")
    return info


def timing_name(device: str, sustain: Optional[float]) -> str:
    """How the run timed its figures, as its table and JSON say."""
    if sustain is not None:
        return f"back to back for {sustain:g} s" + (", inputs rotated beyond L2" if device == "cuda" else "")
    return "do_bench median, L2 flushed before each call" if device == "cuda" else f"median of {CPU_REPS} calls"


def _import_flashinfer(device: str):
    if device != "cuda":
        raise ValueError("--flashinfer needs a CUDA GPU (FlashInfer has no CPU path)")
    try:
        import flashinfer
    except ImportError as e:
        raise ValueError(f"--flashinfer: cannot import flashinfer ({e}); put its source on PYTHONPATH "
                         "(for the sdist in ../shared/anchors: source its fi_setup.sh)") from None
    if flashinfer.__name__ != "flashinfer" or hasattr(flashinfer, "registry"):
        raise ValueError("--flashinfer: the module named flashinfer is attncore (an import shim); "
                         "the comparison needs the real package")
    return flashinfer


def _figures(row: Dict, w: Workload, ceil: Dict) -> None:
    ms = row["time_ms"]
    if w.op in ("prefill", "ragged_prefill", "paged_prefill"):
        row["TFLOPs"] = _flops(w) / (ms * 1e-3) / 1e12
        if ceil:
            row["frac_matmul"] = row["TFLOPs"] / ceil["bf16_matmul_TFLOPs"]
    else:
        row["TBps"] = _bytes(w) / (ms * 1e-3) / 1e12
        if ceil:
            row["frac_read"] = row["TBps"] / ceil["read_TBps"]


def _fmt_row(row: Dict) -> str:
    fig = ""
    if "TFLOPs" in row:
        fig = f"{row['TFLOPs']:.1f} TFLOP/s" + (f" ({row['frac_matmul']:.0%} of matmul)" if "frac_matmul" in row else "")
    elif "TBps" in row:
        fig = f"{row['TBps']:.3f} TB/s" + (f" ({row['frac_read']:.0%} of read" if "frac_read" in row else "")
        if "frac_read_at_size" in row:
            fig += f", {row['frac_read_at_size']:.0%} of a read of its size"
        fig += ")" if "frac_read" in row else ""
    chosen = f" [{row['chosen']}]" if row.get("chosen") and row["chosen"] != row["backend"] else ""
    return f"{row['workload']:11s} {row['backend']:10s}{chosen} {row['time_ms']:.3f} ms  {fig}"


def format_table(info: Dict) -> str:
    rounds = info.get("rounds", 1)
    lines = [f"device: {info['device']}  date: {info['date']}  dtype: {info['dtype']}  "
             f"pages: {info.get('page_order', 'shuffled')}"
             + (f"  (each figure the median of {rounds} interleaved rounds)" if rounds > 1 else "")]
    if "timing" in info:
        lines.append(f"timing: {info['timing']}")
    c = info.get("ceilings") or {}
    if c:
        lines.append("ceilings: read %.2f TB/s  copy %.2f TB/s  bf16 matmul %.0f TFLOP/s" % (
            c["read_TBps"], c["copy_TBps"], c["bf16_matmul_TFLOPs"]))
    for r in info["results"]:
        if "time_ms" in r:
            lines.append(_fmt_row(r))
        else:
            lines.append(f"{r['workload']:11s} {r['backend']:10s} {r.get('status')} {r.get('detail', '')[:100]}")
    return "\n".join(lines)
