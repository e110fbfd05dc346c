"""``attncore check``: cross-check every available backend against the fp64 golden through the
public API, over a fixed suite of cases (every op, masks, GQA groups, page sizes, edge shapes).

Each case draws fresh random inputs, poisons the outputs with NaN, runs the API with
``backend=NAME`` and compares every request's output and LSE with the conformance suite's fp64
golden under its tolerance rule (``attncore.testing.golden.golden_and_baseline`` and ``tolerance``:
2x the error of the same math in the backend's dtype + a rounding atol).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from attncore.core import registry
from attncore.core.mask import pack_spec_mask
from attncore.core.selector import BackendSelectionError
from attncore.testing.contract import page_table
from attncore.testing.golden import golden_and_baseline, max_error, tolerance
from attncore.testing.placement import device_type, placed


@dataclass(frozen=True)
class CheckCase:
    name: str
    op: str
    qo_lens: Tuple[int, ...]
    kv_lens: Tuple[int, ...]
    hq: int = 4
    hkv: int = 2
    d: int = 64
    page_size: int = 16
    layout: str = "NHD"
    mask: str = "none"  # none | causal | custom
    window_left: int = -1
    soft_cap: float = 0.0
    pos: str = "NONE"
    sinks: bool = False
    return_lse: bool = True
    kv_fp8: bool = False
    spec_mask: bool = False
    quick: bool = True


def _cases() -> List[CheckCase]:
    c = CheckCase
    return [
        c("single-causal", "single_prefill", (33,), (57,), mask="causal"),
        c("single-none-g1", "single_prefill", (16,), (40,), hq=4, hkv=4),
        c("single-custom", "single_prefill", (9,), (21,), mask="custom"),
        c("single-window-softcap", "single_prefill", (24,), (48,), mask="causal", window_left=7, soft_cap=30.0),
        c("single-alibi", "single_prefill", (12,), (30,), mask="causal", pos="ALIBI", quick=False),
        c("single-rope-hnd", "single_prefill", (12,), (30,), mask="causal", pos="ROPE_LLAMA", layout="HND"),
        c("single-sinks-g8", "single_prefill", (10,), (26,), hq=8, hkv=1, mask="causal", sinks=True),
        c("single-decode-1tok", "single_prefill", (1,), (37,)),
        c("single-d128", "single_prefill", (20,), (36,), d=128, mask="causal", quick=False),
        # GQA groups that do not divide a 64-row tile of packed (token, head) rows, qo < kv (issue 13)
        c("single-causal-g7", "single_prefill", (21,), (76,), hq=7, hkv=1, mask="causal"),
        c("single-causal-g12-tiles", "single_prefill", (65,), (129,), hq=12, hkv=1, mask="causal", quick=False),
        c("ragged-causal", "batch_prefill_ragged", (5, 17, 1), (9, 17, 30), mask="causal"),
        c("ragged-kv0-qo>kv", "batch_prefill_ragged", (4, 6, 3), (0, 3, 8), mask="causal"),
        c("ragged-custom", "batch_prefill_ragged", (3, 7), (5, 11), mask="custom"),
        c("ragged-causal-g5-tiles", "batch_prefill_ragged", (31, 64, 17), (64, 33, 128), hq=10, hkv=2, mask="causal"),
        c("paged-causal-p16", "batch_prefill_paged", (7, 20), (23, 32), mask="causal"),
        c("paged-p1-hnd", "batch_prefill_paged", (5, 3), (9, 4), page_size=1, layout="HND", mask="causal"),
        c("paged-window-g3", "batch_prefill_paged", (6, 4), (19, 12), hq=6, hkv=2, page_size=4, mask="causal",
          window_left=5),
        c("paged-causal-g3-tiles", "batch_prefill_paged", (43, 1), (128, 17), hq=3, hkv=1, page_size=16,
          mask="causal"),
        c("paged-fp8", "batch_prefill_paged", (6, 8), (14, 8), page_size=8, mask="causal", kv_fp8=True, quick=False),
        c("decode-p16-g4", "batch_decode", (1, 1, 1), (33, 16, 1), hq=8, hkv=2),
        c("decode-p1-g5", "batch_decode", (1, 1), (7, 12), hq=5, hkv=1, page_size=1),
        c("decode-g12-p1", "batch_decode", (1, 1), (65, 128), hq=12, hkv=1, page_size=1, window_left=40),
        c("decode-qlen3-hnd", "batch_decode", (3, 3), (9, 17), layout="HND", page_size=4),
        c("decode-rope-sinks", "batch_decode", (1, 1), (21, 9), pos="ROPE_LLAMA", sinks=True, quick=False),
        c("xqa-g8-sinks", "xqa_decode", (1, 1, 1), (40, 16, 5), hq=16, hkv=2, sinks=True),
        c("xqa-spec-qlen4", "xqa_decode", (4, 4), (19, 33), hq=8, hkv=2, spec_mask=True, window_left=12),
        c("xqa-fp8", "xqa_decode", (1, 1), (30, 17), hq=8, hkv=1, kv_fp8=True, quick=False),
    ]


CASES = _cases()


@dataclass
class CheckResult:
    backend: str
    case: str
    status: str  # pass | FAIL | n/a | ERROR
    max_err: float = float("nan")
    tol: float = float("nan")
    detail: str = ""


def _rand(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def _paged(ks, vs, page_size, layout, device, gen):
    """Scatter per-request dense K/V into a shuffled paged cache (``contract.page_table``)."""
    pt = page_table([k.shape[0] for k in ks], page_size, spare=2, generator=gen)  # spare pages nobody may read
    hkv, d = ks[0].shape[1], ks[0].shape[2]
    # spare pages and the rest of each last page hold NaN: no result may depend on them (docs/semantics.md)
    cache = torch.full((pt.total, 2, page_size, hkv, d), float("nan")).to(ks[0].dtype)
    for k, v, pages in zip(ks, vs, pt.pages):
        for j, pid in enumerate(pages):
            sl = slice(j * page_size, min((j + 1) * page_size, k.shape[0]))
            cache[pid, 0, : sl.stop - sl.start] = k[sl].cpu()
            cache[pid, 1, : sl.stop - sl.start] = v[sl].cpu()
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    i32 = dict(dtype=torch.int32, device=device)
    return (cache.to(device), torch.tensor(pt.indptr, **i32), torch.tensor(pt.indices, **i32),
            torch.tensor(pt.last_page_len, **i32))


def _spec_mask(q_len: int, b: int, gen) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """A random causal-ish draft mask per request: (xqa uint16 words, the dense bool rows)."""
    dense = []
    for _ in range(b):
        m = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool))
        m &= torch.rand(q_len, q_len, generator=gen) < 0.7
        m |= torch.eye(q_len, dtype=torch.bool)
        dense.append(m)
    return pack_spec_mask(torch.stack(dense)), dense


def run_case(case: CheckCase, backend: str, device: str, dtype: torch.dtype, seed: int = 0) -> CheckResult:
    import attncore as ac

    gen = torch.Generator().manual_seed(seed)
    b = len(case.qo_lens)
    kv_dtype = torch.float8_e4m3fn if case.kv_fp8 else dtype
    qs = [_rand((n, case.hq, case.d), dtype, device, gen) for n in case.qo_lens]
    ks = [_rand((n, case.hkv, case.d), dtype, device, gen).to(kv_dtype) for n in case.kv_lens]
    vs = [_rand((n, case.hkv, case.d), dtype, device, gen).to(kv_dtype) for n in case.kv_lens]
    masks = [torch.rand(q, k, generator=gen) < 0.6 for q, k in zip(case.qo_lens, case.kv_lens)]
    sinks = _rand((case.hq,), torch.float32, device, gen) if case.sinks else None
    k_scale, v_scale = (0.7, 1.3) if case.kv_fp8 else (None, None)
    soft_cap = case.soft_cap or None
    ws = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    q_all = torch.cat(qs) if qs else None
    lse = None
    common = dict(pos_encoding_mode=case.pos, window_left=case.window_left, logits_soft_cap=soft_cap)
    gold_kw = dict(window_left=case.window_left, logits_soft_cap=case.soft_cap, pos_encoding_mode=case.pos,
                   sinks=sinks, k_scale=k_scale or 1.0, v_scale=v_scale or 1.0)
    spec_dense = None
    try:
        if case.op == "single_prefill":
            k, v = ks[0], vs[0]
            if case.layout == "HND":
                k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
            out_t = torch.full_like(qs[0], float("nan"))
            res = ac.single_prefill_with_kv_cache(
                qs[0], k, v, custom_mask=masks[0].to(device) if case.mask == "custom" else None,
                causal=case.mask == "causal", kv_layout=case.layout, return_lse=case.return_lse, backend=backend,
                sinks=sinks, k_scale=k_scale, v_scale=v_scale, out=out_t, **common)
        elif case.op == "batch_prefill_ragged":
            w = ac.BatchPrefillWithRaggedKVCacheWrapper(ws, case.layout, backend=backend)
            qo = torch.tensor([0] + list(torch.tensor(case.qo_lens).cumsum(0)), dtype=torch.int32, device=device)
            kvp = torch.tensor([0] + list(torch.tensor(case.kv_lens).cumsum(0)), dtype=torch.int32, device=device)
            k, v = torch.cat(ks), torch.cat(vs)
            if case.layout == "HND":
                k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
            cm = torch.cat([m.flatten() for m in masks]).to(device) if case.mask == "custom" else None
            w.plan(qo, kvp, case.hq, case.hkv, case.d, custom_mask=cm, causal=case.mask == "causal",
                   q_data_type=dtype, kv_data_type=kv_dtype, **common)
            out_t = torch.full_like(q_all, float("nan"))
            res = w.run(q_all, k, v, return_lse=case.return_lse, out=out_t, sinks=sinks, k_scale=k_scale,
                        v_scale=v_scale)
        elif case.op in ("batch_prefill_paged", "batch_decode"):
            cache, indptr, indices, last = _paged(ks, vs, case.page_size, case.layout, device, gen)
            if case.op == "batch_prefill_paged":
                w = ac.BatchPrefillWithPagedKVCacheWrapper(ws, case.layout, backend=backend)
                qo = torch.tensor([0] + list(torch.tensor(case.qo_lens).cumsum(0)), dtype=torch.int32,
                                  device=device)
                cm = torch.cat([m.flatten() for m in masks]).to(device) if case.mask == "custom" else None
                w.plan(qo, indptr, indices, last, case.hq, case.hkv, case.d, case.page_size, custom_mask=cm,
                       causal=case.mask == "causal", q_data_type=dtype, kv_data_type=kv_dtype, **common)
            else:
                w = ac.BatchDecodeWithPagedKVCacheWrapper(ws, case.layout, backend=backend)
                w.plan(indptr, indices, last, case.hq, case.hkv, case.d, case.page_size, q_data_type=dtype,
                       kv_data_type=kv_dtype, q_len_per_req=case.qo_lens[0], **common)
            out_t = torch.full_like(q_all, float("nan"))
            res = w.run(q_all, cache, return_lse=case.return_lse, out=out_t, sinks=sinks, k_scale=k_scale,
                        v_scale=v_scale)
        elif case.op == "xqa_decode":
            cache, indptr, indices, last = _paged(ks, vs, case.page_size, case.layout, device, gen)
            maxp = max(int(indptr[i + 1] - indptr[i]) for i in range(b))
            bt = torch.zeros(b, max(maxp, 1), dtype=torch.int32, device=device)
            for i in range(b):
                n = int(indptr[i + 1] - indptr[i])
                bt[i, :n] = indices[int(indptr[i]):int(indptr[i]) + n]
            seq = torch.tensor(case.kv_lens, dtype=torch.int32, device=device)
            q_len = case.qo_lens[0]
            mask = None
            if case.spec_mask:
                mask, spec_dense = _spec_mask(q_len, b, gen)
                mask = mask.to(device)
            sm = 1.0 / math.sqrt(case.d) * (k_scale or 1.0)
            out_t = torch.full_like(q_all, float("nan"))
            res = ac.xqa_batch_decode_with_kv_cache(
                q_all, cache, ws, bt, seq, max(case.kv_lens), bmm1_scale=sm, bmm2_scale=v_scale or 1.0,
                window_left=case.window_left, out=out_t, sinks=sinks, kv_layout=case.layout,
                q_len_per_req=q_len, mask=mask, backend=backend)
        else:
            raise ValueError(case.op)
    except BackendSelectionError as e:
        return CheckResult(backend, case.name, "n/a", detail=str(e).split(": ", 1)[-1][:200])
    except Exception as e:
        return CheckResult(backend, case.name, "ERROR", detail=f"{type(e).__name__}: {e}"[:300])
    if isinstance(res, tuple):
        out, lse = res
    else:
        out = res
    worst, worst_tol, rows = 0.0, 1.0, 0  # the request with the largest err/tol
    ok = True
    for i in range(b):
        qn = case.qo_lens[i]
        mask_i = None
        causal = case.mask == "causal" or case.op in ("batch_decode", "xqa_decode")
        if case.mask == "custom":
            mask_i = masks[i]
        if spec_dense is not None:
            kvn, qn_ = case.kv_lens[i], case.qo_lens[i]
            mask_i = torch.cat([torch.ones(qn_, kvn - qn_, dtype=torch.bool), spec_dense[i]], dim=1)
        # the conformance suite's golden, yardstick and rule (attncore.testing.golden), per request
        g, gl, bo, bl = golden_and_baseline(qs[i], ks[i], vs[i], dtype=dtype, out_dtype=out.dtype, device=device,
                                            causal=causal, mask=mask_i, **gold_kw)
        checks = [(max_error(out[rows:rows + qn], g), tolerance(bo, g, out.dtype))]
        if lse is not None:
            checks.append((max_error(lse[rows:rows + qn], gl), tolerance(bl, gl, out.dtype, kind="lse")))
        for err, tol in checks:
            ok &= err <= tol
            if err / tol > worst / worst_tol:
                worst, worst_tol = err, tol
        rows += qn
    return CheckResult(backend, case.name, "pass" if ok else "FAIL", worst, worst_tol)


def run_check(backends: Optional[Sequence[str]] = None, *, quick: bool = False, device: Optional[str] = None,
              stream: str = "default", dtypes: Optional[Sequence[torch.dtype]] = None,
              progress: Callable[[str], None] = print) -> List[CheckResult]:
    """Every case on every backend; ``device`` cpu, cuda or cuda:N, ``stream`` default or side
    (``attncore.testing.placement``)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtypes is None:
        dtypes = (torch.float16, torch.bfloat16) if device_type(device) == "cuda" else (torch.float16,)
    names = list(backends) if backends else sorted(registry.available_backends())
    cases = [c for c in CASES if c.quick or not quick]
    results = []
    total = len(names) * len(cases) * len(dtypes)
    n = 0
    for name in names:
        for dt in dtypes:
            for c in cases:
                n += 1
                t0 = time.perf_counter()
                try:
                    with placed(device, stream):
                        r = run_case(c, name, device, dt, seed=n)
                except AssertionError as e:  # the backend moved the current device
                    r = CheckResult(name, c.name, "ERROR", detail=str(e)[:300])
                r.case = f"{c.name}-{str(dt).replace('torch.', '')}"
                results.append(r)
                progress(f"[{n}/{total}] {name:10s} {r.case:32s} {r.status:5s} "
                         f"({time.perf_counter() - t0:.1f} s)")
    return results


def format_table(results: List[CheckResult]) -> str:
    backends = sorted({r.backend for r in results})
    cases = list(dict.fromkeys(r.case for r in results))
    by = {(r.backend, r.case): r for r in results}
    w = max(len(c) for c in cases) + 2 if cases else 10
    lines = ["each cell: status, max abs error / tolerance of the case's worst request (output or LSE),",
             "against the fp64 golden; tolerance = 2x the error of the same math in the backend's dtype",
             "+ a rounding atol (the same rule for the LSE); n/a: the backend refuses the case",
             "",
             "case".ljust(w) + "".join(b.ljust(24) for b in backends)]
    for c in cases:
        row = c.ljust(w)
        for b in backends:
            r = by.get((b, c))
            if r is None:
                cell = "-"
            elif r.status in ("pass", "FAIL"):
                cell = f"{r.status} {r.max_err:.1e} / {r.tol:.1e}"
            else:
                cell = r.status
            row += cell.ljust(24)
        lines.append(row.rstrip())
    fails = [r for r in results if r.status in ("FAIL", "ERROR")]
    lines.append("")
    lines.append(f"{sum(r.status == 'pass' for r in results)} passed, {len(fails)} failed, "
                 f"{sum(r.status == 'n/a' for r in results)} not supported")
    for r in fails:
        lines.append(f"  {r.backend} {r.case}: {r.status} err {r.max_err:.3g} tol {r.tol:.3g} {r.detail}")
    return "\n".join(lines)


def fuzz_command(a, names: List[str]) -> int:
    """``check --fuzz N`` / ``check --replay SEED`` (``a``: the parsed options): randomized problems against the
    fp64 golden; prints the table (and writes ``--json``), returns the exit status."""
    from attncore.testing import fuzz

    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if a.replay is not None:
        failed = False
        for n in names:
            desc, shapes, errs = fuzz.replay(n, a.replay, device=a.device, stream=a.stream)
            print(f"{n} --replay {a.replay}: {desc} {shapes}: " + ("ok" if not errs else "MISMATCH"))
            for e in errs:
                print("  " + e)
            failed |= bool(errs)
        return 1 if failed else 0
    reports = []
    for n in names:
        reports.append(fuzz.fuzz_parallel(n, a.fuzz, seed=a.seed, device=a.device, configs=a.configs,
                                          jobs=a.jobs or 1, progress=say, stream=a.stream))
    print(f"{'backend':12s}{'device':8s}{'problems':>10s}{'configs':>9s}{'mismatches':>12s}{'seconds':>9s}"
          f"{'per s':>8s}   seed {a.seed}")
    for r in reports:
        print(f"{r.backend:12s}{r.device:8s}{r.run:10d}{r.configs:9d}{len(r.mismatches):12d}{r.seconds:9.1f}"
              f"{r.run / max(r.seconds, 1e-9):8.1f}")
        for m in r.mismatches[:20]:
            print(f"  attncore check --backend {r.backend} --replay {m.seed}   # {m.problem} {m.shapes}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dict(r.__dict__, mismatches=[m.__dict__ for m in r.mismatches]) for r in reports], f,
                      indent=1, default=str)
    return 1 if any(r.mismatches for r in reports) or not any(r.run for r in reports) else 0
