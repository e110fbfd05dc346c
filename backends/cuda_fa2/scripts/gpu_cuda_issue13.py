#!/usr/bin/env python3
"""Issue 13, CUDA part, on a GPU (H100): cuda_fa2 (the Hopper prefill90 kernel and the FA2 kernel's
tiles) and xqa against the reference backend, through the public API.

    python backends/cuda_fa2/scripts/gpu_cuda_issue13.py               # every check: one PASS / FAIL / SKIP line each
    python backends/cuda_fa2/scripts/gpu_cuda_issue13.py -k window     # the checks whose name contains "window"
    python backends/cuda_fa2/scripts/gpu_cuda_issue13.py --list
    python backends/cuda_fa2/scripts/gpu_cuda_issue13.py --harness-cpu # dry run of this harness on the CPU (every target
                                                     # is the reference backend: kernels untested)

Exit status 1 when a check fails.  Checks (docs/semantics.md "Non-finite inputs"):
  A   gqa_*   GQA groups 3/5/7/12 (packed rows r = tok * G + g that do not divide a tile), causal,
              qo < kv, lengths 127/128/129/255/256/257: paged and single prefill, speculative decode.
  B   kv0     single prefill with kv_len 0: output exactly 0, LSE -inf.
  C1  unused  NaN in the unused slots of last pages, in spare pages, in block-table padding (rule 1).
  C2  window  NaN in the keys left of the window of every row (rule 2).
  C3  nanq    NaN in one query row (one token, one head): that row NaN with NaN LSE (0 / -inf when it
              sees no key), every other row unchanged (rules 3, 4); split-KV merges and sinks too.
Every output and LSE is NaN-filled before a run (an unwritten element fails).  A poisoned run is
compared with the same backend on the same inputs where the poisoned values are finite (must match);
that clean run is compared with backend="reference".  Tolerance per request: the conformance suite's
rule (attncore.testing.golden: golden_and_baseline, tolerance) + the reference's own error against the
fp64 golden, for outputs and LSE (which must also have the same -inf pattern).  Each line names the kernels that ran (cuda_fa2:
<config>[+merge], xqa:s<splits>); a check fails if cuda_fa2 ran another kernel than it asks for.
Kernels are built first ("prebuild", in parallel); the fp64 golden runs on the CPU (about 5 s a
check): with a time limit, run the families apart (-k A. / -k B. / -k C1 / -k C2 / -k C3).
ISSUE13_TRACEBACK=1 prints tracebacks of failures.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import traceback

import torch

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("-k", default="", help="run only the checks whose name contains this")
ap.add_argument("--list", action="store_true", help="list the checks")
ap.add_argument("--seed", type=int, default=0, help="offset of every check's random seed (fresh inputs)")
ap.add_argument("--harness-cpu", action="store_true", help="CPU dry run (targets replaced by the reference)")
ARGS = ap.parse_args()

import attncore  # noqa: E402
from attncore.testing.contract import offsets, page_table  # noqa: E402
from attncore.testing.golden import golden_and_baseline, max_error, tolerance  # noqa: E402

HARNESS = ARGS.harness_cpu
DEV = torch.device("cpu") if HARNESS else torch.device("cuda", torch.cuda.current_device())
CC = None if HARNESS else tuple(torch.cuda.get_device_capability(DEV))
DT = torch.bfloat16
D = 128
PS = 16
SCALE = 1.0 / math.sqrt(D)
NAN = float("nan")
WS = torch.empty(256 << 20 if not HARNESS else 1 << 20, dtype=torch.uint8, device=DEV)


def target(name: str) -> str:
    return "reference" if HARNESS else name


# ------------------------------------------------------------------ which kernel ran (bookkeeping)
SEEN: list = []  # "cuda_fa2:<config>[+merge]" / "xqa:s<splits>" per run of the check


def _record_runs():
    try:
        from attncore.backends.cuda_fa2.backend import CudaFa2Backend

        orig = CudaFa2Backend.run

        def run(self, plan, args):
            SEEN.append("cuda_fa2:" + plan.config + ("+merge" if plan.needs_merge else ""))
            return orig(self, plan, args)

        CudaFa2Backend.run = run
    except Exception as e:  # noqa: BLE001
        print(f"note: cuda_fa2 runs not recorded ({e})")
    try:
        from attncore.backends.xqa.backend import XqaBackend

        orig_x = XqaBackend.run

        def run_x(self, plan, args):
            SEEN.append(f"xqa:s{plan.num_splits}")
            return orig_x(self, plan, args)

        XqaBackend.run = run_x
    except Exception as e:  # noqa: BLE001
        print(f"note: xqa runs not recorded ({e})")


_record_runs()

# cuda_fa2 kernel choice: "sm90" the default (prefill90 on an H100 where it serves), "fa2" the FA2
# kernel through ATTNCORE_FA2_SM90=0 (plan's tile), "prefill" / "prefill64" a forced FA2 tile.
KINDS = {"sm90": ("1", None), "fa2": ("0", None), "prefill": ("0", "prefill"), "prefill64": ("0", "prefill64")}


@contextlib.contextmanager
def fa2_kernel(kind: str):
    from attncore.backends.cuda_fa2.backend import CudaFa2Backend

    env, force = KINDS[kind]
    old_env, old_force = os.environ.get("ATTNCORE_FA2_SM90"), CudaFa2Backend.force_config
    os.environ["ATTNCORE_FA2_SM90"] = env
    CudaFa2Backend.force_config = force
    try:
        yield
    finally:
        CudaFa2Backend.force_config = old_force
        if old_env is None:
            os.environ.pop("ATTNCORE_FA2_SM90", None)
        else:
            os.environ["ATTNCORE_FA2_SM90"] = old_env


@contextlib.contextmanager
def xqa_splits(n):
    from attncore.backends.xqa.backend import XqaBackend

    old = XqaBackend.split_override
    XqaBackend.split_override = n
    try:
        yield
    finally:
        XqaBackend.split_override = old


def expect_kernel(kind: str) -> None:
    """The cuda_fa2 runs of this check used the kernel `kind` asks for (prefill problems)."""
    if HARNESS:
        return
    runs = [s.split(":")[1].split("+")[0] for s in SEEN if s.startswith("cuda_fa2:")]
    pre = [c for c in runs if c != "decode"]
    assert runs, "no cuda_fa2 run recorded"
    if kind == "sm90":
        assert all(c == "prefill90" for c in pre), f"expected prefill90, ran {runs}"
    elif kind == "fa2":
        assert "prefill90" not in runs, f"expected the FA2 kernel, ran {runs}"
    else:
        assert all(c == kind for c in pre) and pre, f"expected {kind}, ran {runs}"


class Skip(Exception):
    pass


def need_sm90(kind: str) -> None:
    if kind == "sm90" and not HARNESS and CC != (9, 0):
        raise Skip(f"prefill90 needs sm90, device is sm{CC[0]}{CC[1]}")


# ------------------------------------------------------------------------------------ test data
class Paged:
    """A batch of requests [(qo, kv)] over an NHD paged cache [pages, 2, PS, Hkv, D] whose pages are
    shuffled, with `spare` pages in no page table.  q [sum qo, Hq, D]."""

    def __init__(self, lens, hq, hkv, seed, spare=3, ps=PS):
        g = torch.Generator().manual_seed(seed + 7919 * ARGS.seed)
        self.lens, self.hq, self.hkv, self.ps = list(lens), hq, hkv, ps
        self.pt = page_table([kv for _, kv in self.lens], ps, spare, generator=g)
        self.total, self.pages, self.spare = self.pt.total, self.pt.pages, self.pt.spare
        self.cache = torch.randn(self.total, 2, ps, hkv, D, generator=g).to(DT).to(DEV)
        self.q = torch.randn(sum(qo for qo, _ in self.lens), hq, D, generator=g).to(DT).to(DEV)
        self.sinks = (torch.randn(hq, generator=g) * 2).float().to(DEV)
        i32 = dict(dtype=torch.int32, device=DEV)
        self.qo_host = offsets([qo for qo, _ in self.lens])
        self.qo_indptr, self.kv_indptr = torch.tensor(self.qo_host, **i32), torch.tensor(self.pt.indptr, **i32)
        self.indices, self.last = torch.tensor(self.pt.indices, **i32), torch.tensor(self.pt.last_page_len, **i32)
        self.seq_lens = torch.tensor([kv for _, kv in self.lens], **i32)

    def rows(self, i):
        return self.qo_host[i], self.qo_host[i + 1]

    def slots(self, i, t0=0, t1=None):
        """(page, slot) index tensors of keys t0 <= t < t1 of request i."""
        return self.pt.slots(i, t0, t1)

    def dense(self, i, cache):
        pg, sl = self.slots(i)
        kv = cache[pg.to(DEV), :, sl.to(DEV)]  # [kv, 2, Hkv, D]
        return kv[:, 0], kv[:, 1]

    def unused_mask(self):
        """bool [pages, PS]: slots holding no key of any request (last-page tails, spare pages)."""
        used = torch.zeros(self.total, self.ps, dtype=torch.bool)
        for i in range(len(self.lens)):
            pg, sl = self.slots(i)
            used[pg, sl] = True
        return ~used

    def left_of_window_mask(self, wl):
        """bool [pages, PS]: keys left of the window of every row (t < kv - qo - wl)."""
        m = torch.zeros(self.total, self.ps, dtype=torch.bool)
        for i, (qo, kv) in enumerate(self.lens):
            pg, sl = self.slots(i, 0, max(0, kv - qo - wl))
            m[pg, sl] = True
        return m

    def poisoned(self, mask):
        c = self.cache.clone()
        c.transpose(1, 2)[mask.to(DEV)] = NAN  # K and V of those slots, every head
        return c

    def block_tables(self, pad_page):
        width = max([len(p) for p in self.pages] + [1]) + 1  # one padding column at least
        bt = torch.full((len(self.lens), width), pad_page, dtype=torch.int32)
        for i, pg in enumerate(self.pages):
            bt[i, :len(pg)] = torch.tensor(pg, dtype=torch.int32)
        return bt.to(DEV)


def nan_out(q):
    return torch.full_like(q, NAN), torch.full((q.shape[0], q.shape[1]), NAN, dtype=torch.float32, device=DEV)


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)


def run_prefill(b, backend, cache, q, *, causal=True, wl=-1, sinks=None):
    w = attncore.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", backend=backend)
    w.plan(b.qo_indptr, b.kv_indptr, b.indices, b.last, b.hq, b.hkv, D, b.ps, causal=causal, window_left=wl,
           sm_scale=SCALE, q_data_type=DT)
    out, lse = nan_out(q)
    w.run(q, cache, out=out, lse=lse, return_lse=True, sinks=sinks)
    sync()
    return out, lse


def run_single(b, backend, q, *, causal=True, wl=-1):
    """Each request of `b` through single_prefill_with_kv_cache (ragged K/V, dense copies)."""
    out, lse = nan_out(q)
    for i in range(len(b.lens)):
        s, e = b.rows(i)
        k, v = b.dense(i, b.cache)
        attncore.single_prefill_with_kv_cache(q[s:e], k.contiguous(), v.contiguous(), causal=causal, window_left=wl,
                                              sm_scale=SCALE, return_lse=True, backend=backend, out=out[s:e],
                                              lse=lse[s:e])
    sync()
    return out, lse


def run_decode(b, backend, cache, q, *, wl=-1, ql=1, sinks=None):
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", backend=backend)
    w.plan(b.kv_indptr, b.indices, b.last, b.hq, b.hkv, D, b.ps, window_left=wl, sm_scale=SCALE, q_data_type=DT,
           q_len_per_req=ql)
    out, lse = nan_out(q)
    w.run(q, cache, out=out, lse=lse, return_lse=True, sinks=sinks)
    sync()
    return out, lse


def run_xqa(b, backend, cache, q, *, wl=-1, ql=1, pad_page=0, sinks=None):
    out, _ = nan_out(q)
    attncore.xqa_batch_decode_with_kv_cache(q, cache, WS, b.block_tables(pad_page), b.seq_lens,
                                            max([kv for _, kv in b.lens] + [0]), bmm1_scale=SCALE,
                                            window_left=wl, out=out, sinks=sinks, q_len_per_req=ql, backend=backend)
    sync()
    return out, None


# ----------------------------------------------------------------------------------- comparing
_GOLDEN: dict = {}  # per check: (batch, request, mask) -> (golden out, lse, their tolerances); q is always b.q


def _golden(b, i, q, *, causal, wl, sinks):
    key = (id(b), i, causal, wl, sinks is None)
    if key in _GOLDEN:
        return _GOLDEN[key]
    s, e = b.rows(i)
    k, v = b.dense(i, b.cache)
    kw = dict(causal=causal, window_left=wl, sm_scale=SCALE, sinks=None if sinks is None else sinks.cpu())
    gold, glse, bo, bl = golden_and_baseline(q[s:e], k, v, dtype=DT, **kw)
    _GOLDEN[key] = gold, glse, tolerance(bo, gold, DT), tolerance(bl, glse, DT, kind="lse")
    return _GOLDEN[key]


def compare(b, got, want, *, q, causal, wl=-1, sinks=None, skip=(), what="") -> list:
    """got / want: (out, lse or None).  Per request, max_error(got, want) <= the golden tolerance
    (+ want's own error against the golden), for the output and the LSE (same -inf pattern too).
    skip: (token, head) pairs left out (checked elsewhere)."""
    errs = []
    (o, lse), (ro, rlse) = got, want
    o, ro = o.double().cpu(), ro.double().cpu()
    keep = torch.ones(o.shape[0], o.shape[1], dtype=torch.bool)
    for t, h in skip:
        keep[t, h] = False
    for i, (qo, kv) in enumerate(b.lens):
        s, e = b.rows(i)
        if s == e:
            continue
        gold, glse, tol, ltol = _golden(b, i, q, causal=causal, wl=wl, sinks=sinks)
        kp = keep[s:e, :, None]  # skipped rows: 0 in all three
        oi, ri = torch.where(kp, o[s:e], 0.0), torch.where(kp, ro[s:e], 0.0)
        gi = torch.where(kp, gold, 0.0)
        tol_i = tol + max_error(ri, gi)
        err = max_error(oi, ri)
        if not err <= tol_i:
            bad = (oi - ri).abs().nan_to_num(float("inf")).amax(-1)
            t, h = divmod(int(bad.argmax()), o.shape[1])
            errs.append(f"{what}req {i} ({qo}x{kv}): out err {err:.3g} > {tol_i:.3g} (worst token {t} head {h})")
        if lse is not None and rlse is not None:
            li, rli = lse[s:e].double().cpu(), rlse[s:e].double().cpu()
            k2 = keep[s:e]
            if not torch.equal(torch.isneginf(li)[k2], torch.isneginf(rli)[k2]):
                errs.append(f"{what}req {i} ({qo}x{kv}): LSE -inf pattern differs")
            fin = torch.isfinite(rli) & k2
            if torch.isnan(li[k2]).any():
                errs.append(f"{what}req {i} ({qo}x{kv}): NaN LSE in a clean row")
            elif fin.any():
                lerr = (li[fin] - rli[fin]).abs().max().item()
                ltol_i = ltol + max_error(rli[fin], glse[fin])
                if not lerr <= ltol_i:
                    errs.append(f"{what}req {i} ({qo}x{kv}): LSE err {lerr:.3g} > {ltol_i:.3g}")
    return errs


def exact(a, b_) -> bool:
    x, y = a[0], b_[0]
    same = torch.equal(torch.nan_to_num(x.float(), 7.0), torch.nan_to_num(y.float(), 7.0))
    if a[1] is not None:
        same &= torch.equal(torch.nan_to_num(a[1], 7.0), torch.nan_to_num(b_[1], 7.0))
    return bool(same)


def poison_vs_clean(b, run, cache_p, *, causal, wl=-1, sinks=None, ref_run=None):
    """run(cache) -> (out, lse).  Poisoned vs clean (same backend), clean vs the reference."""
    got_p = run(cache_p)
    got_c = run(b.cache)
    errs = compare(b, got_p, got_c, q=b.q, causal=causal, wl=wl, sinks=sinks, what="poisoned vs clean: ")
    want = ref_run(b.cache)
    errs += compare(b, got_c, want, q=b.q, causal=causal, wl=wl, sinks=sinks, what="clean vs reference: ")
    assert not errs, "; ".join(errs[:4])
    return "bitwise equal to the clean run" if exact(got_p, got_c) else "within tolerance of the clean run"


# ------------------------------------------------------------------------------------ the checks
CHECKS = []


def check(name):
    def deco(fn):
        CHECKS.append((name, fn))
        return fn
    return deco


A_LENS = [(127, 255), (128, 256), (129, 257), (255, 256), (256, 257), (127, 128), (129, 255), (1, 129)]
SINGLE_LENS = [(127, 255), (128, 256), (129, 257), (255, 257), (256, 256), (257, 257)]
DECODE_KV = [127, 128, 129, 255, 256, 257]


def _a_paged(kind, G):
    def fn():
        need_sm90(kind)
        b = Paged(A_LENS, hq=2 * G, hkv=2, seed=G)
        with fa2_kernel(kind):
            got = run_prefill(b, target("cuda_fa2"), b.cache, b.q)
        expect_kernel(kind)
        errs = compare(b, got, run_prefill(b, "reference", b.cache, b.q), q=b.q, causal=True)
        assert not errs, "; ".join(errs[:4])
    return fn


def _a_single(kind, G):
    def fn():
        need_sm90(kind)
        b = Paged(SINGLE_LENS, hq=2 * G, hkv=2, seed=100 + G)
        with fa2_kernel(kind):
            got = run_single(b, target("cuda_fa2"), b.q)
        expect_kernel(kind)
        errs = compare(b, got, run_single(b, "reference", b.q), q=b.q, causal=True)
        assert not errs, "; ".join(errs[:4])
    return fn


def _a_spec_decode(backend, G):
    def fn():
        ql = 3
        b = Paged([(ql, kv) for kv in DECODE_KV], hq=2 * G, hkv=2, seed=200 + G)
        got = run_decode(b, target(backend), b.cache, b.q, ql=ql)
        errs = compare(b, got, run_decode(b, "reference", b.cache, b.q, ql=ql), q=b.q, causal=True)
        assert not errs, "; ".join(errs[:4])
    return fn


for _k in ("sm90", "prefill", "prefill64"):
    for _g in (3, 5, 7, 12):
        check(f"A.gqa_causal.paged.{_k}.G{_g}")(_a_paged(_k, _g))
for _k in ("sm90", "fa2"):
    for _g in (3, 5, 7, 12):
        check(f"A.gqa_causal.single.{_k}.G{_g}")(_a_single(_k, _g))
for _bk in ("cuda_fa2", "xqa"):
    for _g in (3, 5, 7, 12):
        check(f"A.gqa_spec_decode.{_bk}.G{_g}")(_a_spec_decode(_bk, _g))


def _b_kv0(kind, qo):
    def fn():
        need_sm90(kind)
        q = torch.randn(qo, 6, D, generator=torch.Generator().manual_seed(ARGS.seed)).to(DT).to(DEV)
        k = torch.empty(0, 2, D, dtype=DT, device=DEV)
        out, lse = nan_out(q)
        with fa2_kernel(kind):
            attncore.single_prefill_with_kv_cache(q, k, torch.empty_like(k), causal=False, return_lse=True,
                                                  backend=target("cuda_fa2"), out=out, lse=lse)
        sync()
        if qo * 3 > 16:
            expect_kernel(kind)
        assert torch.equal(out, torch.zeros_like(out)), \
            f"out not exactly 0 (NaN {int(out.isnan().sum())}, max |out| {out.float().nan_to_num(9).abs().max():.3g})"
        assert bool(torch.isneginf(lse).all()), f"LSE not -inf everywhere: {lse.flatten()[:4].tolist()}"
    return fn


for _k in ("sm90", "fa2"):
    for _qo in (5, 40):
        check(f"B.kv0.single.{_k}.qo{_qo}")(_b_kv0(_k, _qo))

PREFILL_LENS = [(37, 200), (5, 0), (70, 40), (16, 64), (129, 129), (1, 17), (100, 333)]
SPLIT_LENS = [(20, 3000)]
DECODE_LENS = [(1, n) for n in (1, 17, 300, 1000, 0, 2047, 129)]
LONG_DECODE = [(1, 5000)]


def _c1_prefill(kind, lens, hq, hkv):
    def fn():
        need_sm90(kind)
        b = Paged(lens, hq=hq, hkv=hkv, seed=300 + len(lens))
        cp = b.poisoned(b.unused_mask())
        with fa2_kernel(kind):
            note = poison_vs_clean(b, lambda c: run_prefill(b, target("cuda_fa2"), c, b.q), cp, causal=True,
                                   ref_run=lambda c: run_prefill(b, "reference", c, b.q))
        expect_kernel(kind)
        return note
    return fn


def _c1_decode(backend, lens, ql=1):
    def fn():
        b = Paged(lens, hq=16, hkv=2, seed=400 + len(lens) + ql)
        cp = b.poisoned(b.unused_mask())
        return poison_vs_clean(b, lambda c: run_decode(b, target(backend), c, b.q, ql=ql), cp, causal=True,
                               ref_run=lambda c: run_decode(b, "reference", c, b.q, ql=ql))
    return fn


def _c1_xqa_bt(lens, ql=1):
    def fn():
        b = Paged(lens, hq=16, hkv=2, seed=500 + len(lens) + ql)
        cp = b.poisoned(b.unused_mask())
        pad = b.spare[0]  # block-table padding points at a poisoned spare page
        return poison_vs_clean(b, lambda c: run_xqa(b, target("xqa"), c, b.q, ql=ql, pad_page=pad), cp,
                               causal=True, ref_run=lambda c: run_xqa(b, "reference", c, b.q, ql=ql, pad_page=pad))
    return fn


for _k in ("sm90", "fa2"):
    check(f"C1.unused.prefill.{_k}")(_c1_prefill(_k, PREFILL_LENS, 12, 4))
    check(f"C1.unused.prefill_split.{_k}")(_c1_prefill(_k, SPLIT_LENS, 4, 1))
for _bk in ("cuda_fa2", "xqa"):
    check(f"C1.unused.decode.{_bk}")(_c1_decode(_bk, DECODE_LENS))
    check(f"C1.unused.decode_split.{_bk}")(_c1_decode(_bk, LONG_DECODE))
    check(f"C1.unused.decode_spec3.{_bk}")(_c1_decode(_bk, [(3, n) for n in (3, 50, 700, 129)], ql=3))
XQA_BT_LENS = [lk for lk in DECODE_LENS if lk[1] > 0]  # xqa_batch_decode takes no empty request
check("C1.unused.xqa_block_tables")(_c1_xqa_bt(XQA_BT_LENS))
check("C1.unused.xqa_block_tables_split")(_c1_xqa_bt(LONG_DECODE))

WINDOW_DECODE = [(1, n) for n in (1000, 333, 129, 77, 4000, 0, 101)]
WINDOW_PREFILL = [(64, 500), (200, 300), (1, 257), (129, 129), (37, 1000), (20, 3000)]


def _c2_decode(backend, wl, ql=1):
    def fn():
        lens = [(ql, kv) for _, kv in WINDOW_DECODE if kv == 0 or kv >= ql]
        b = Paged(lens, hq=16, hkv=2, seed=600 + wl + ql)
        cp = b.poisoned(b.left_of_window_mask(wl) | b.unused_mask())
        return poison_vs_clean(b, lambda c: run_decode(b, target(backend), c, b.q, wl=wl, ql=ql), cp, causal=True,
                               wl=wl, ref_run=lambda c: run_decode(b, "reference", c, b.q, wl=wl, ql=ql))
    return fn


def _c2_xqa_bt(wl, ql=1):
    def fn():
        lens = [(ql, kv) for _, kv in WINDOW_DECODE if kv >= ql]
        b = Paged(lens, hq=16, hkv=2, seed=700 + wl + ql)
        cp = b.poisoned(b.left_of_window_mask(wl) | b.unused_mask())
        pad = b.spare[0]
        return poison_vs_clean(b, lambda c: run_xqa(b, target("xqa"), c, b.q, wl=wl, ql=ql, pad_page=pad), cp,
                               causal=True, wl=wl,
                               ref_run=lambda c: run_xqa(b, "reference", c, b.q, wl=wl, ql=ql, pad_page=pad))
    return fn


def _c2_prefill(kind, wl):
    def fn():
        b = Paged(WINDOW_PREFILL, hq=12, hkv=4, seed=800 + wl)
        cp = b.poisoned(b.left_of_window_mask(wl) | b.unused_mask())
        with fa2_kernel(kind):
            note = poison_vs_clean(b, lambda c: run_prefill(b, target("cuda_fa2"), c, b.q, wl=wl), cp, causal=True,
                                   wl=wl, ref_run=lambda c: run_prefill(b, "reference", c, b.q, wl=wl))
        expect_kernel("fa2")  # prefill90 does not serve a window: the FA2 kernel
        return note
    return fn


# windows whose left edge is no multiple of xqa's tile, and one of exactly a page
for _bk in ("cuda_fa2", "xqa"):
    for _wl in (100, 63):
        check(f"C2.window.decode.{_bk}.wl{_wl}")(_c2_decode(_bk, _wl))
    check(f"C2.window.decode_spec3.{_bk}.wl100")(_c2_decode(_bk, 100, ql=3))
for _wl in (100, 16):
    check(f"C2.window.xqa_block_tables.wl{_wl}")(_c2_xqa_bt(_wl))
check("C2.window.xqa_block_tables_spec3.wl100")(_c2_xqa_bt(100, ql=3))
for _k in ("fa2", "prefill64"):
    for _wl in (37, 500):
        check(f"C2.window.prefill.{_k}.wl{_wl}")(_c2_prefill(_k, _wl))


def nan_query_check(b, run, ref_run, picks, *, causal, wl=-1, sinks=None, has_lse=True):
    """picks: (request, token of the request, head); q[token, head, 0] = NaN.  Causal, no window."""
    rows = []
    for i, tok, h in picks:
        qo, kv = b.lens[i]
        rows.append((b.rows(i)[0] + tok, h, kv > 0 and tok + kv - qo >= 0))  # sees a key
    qp = b.q.clone()
    for t, h, _ in rows:
        qp[t, h, 0] = NAN
    got_p, got_c = run(qp), run(b.q)
    o, lse = got_p
    errs = []
    for t, h, sees in rows:
        ot = o[t, h].float()
        if sees:
            if not bool(ot.isnan().all()):
                errs.append(f"token {t} head {h}: output not NaN ({int(ot.isnan().sum())}/{D} NaN)")
            if has_lse and not math.isnan(lse[t, h].item()):
                errs.append(f"token {t} head {h}: LSE {lse[t, h].item():.4g}, expected NaN")
        else:
            if not bool((ot == 0).all()):
                errs.append(f"token {t} head {h} (sees no key): output not 0")
            if has_lse and not lse[t, h].item() == float("-inf"):
                errs.append(f"token {t} head {h} (sees no key): LSE {lse[t, h].item():.4g}, expected -inf")
    skip = [(t, h) for t, h, _ in rows]
    errs += compare(b, got_p, got_c, q=b.q, causal=causal, wl=wl, sinks=sinks, skip=skip, what="other rows: ")
    errs += compare(b, got_c, ref_run(b.q), q=b.q, causal=causal, wl=wl, sinks=sinks, what="clean vs reference: ")
    assert not errs, "; ".join(errs[:4])


def _c3_prefill(kind, lens, hq, hkv, rows, sinks=False):
    def fn():
        need_sm90(kind)
        b = Paged(lens, hq=hq, hkv=hkv, seed=900 + len(lens))
        sk = b.sinks if sinks else None
        with fa2_kernel(kind):
            nan_query_check(b, lambda q: run_prefill(b, target("cuda_fa2"), b.cache, q, sinks=sk),
                            lambda q: run_prefill(b, "reference", b.cache, q, sinks=sk), rows, causal=True, sinks=sk)
        expect_kernel(kind)
    return fn


def _c3_decode(backend, lens, rows, splits=None, sinks=False, ql=1):
    def fn():
        b = Paged(lens, hq=16, hkv=2, seed=1000 + len(lens) + ql)
        sk = b.sinks if sinks else None
        with contextlib.ExitStack() as st:
            if splits is not None and backend == "xqa":
                st.enter_context(xqa_splits(splits))
            nan_query_check(b, lambda q: run_decode(b, target(backend), b.cache, q, ql=ql, sinks=sk),
                            lambda q: run_decode(b, "reference", b.cache, q, ql=ql, sinks=sk), rows, causal=True,
                            sinks=sk)
    return fn


def _c3_xqa_bt(lens, rows, splits=None):
    def fn():
        b = Paged(lens, hq=16, hkv=2, seed=1100 + len(lens))
        with contextlib.ExitStack() as st:
            if splits is not None:
                st.enter_context(xqa_splits(splits))
            nan_query_check(b, lambda q: run_xqa(b, target("xqa"), b.cache, q),
                            lambda q: run_xqa(b, "reference", b.cache, q), rows, causal=True, has_lse=False)
    return fn


# (request, token, head): PREFILL_LENS has rows that see no key (5x0; 70x40 tokens < 30); Hq 12, Hkv 4
C3_PREFILL_ROWS = [(0, 5, 4), (1, 1, 0), (2, 0, 7), (2, 58, 11), (6, 99, 5), (4, 128, 2)]
C3_SPLIT_ROWS = [(0, 7, 2), (0, 19, 0)]
for _k in ("sm90", "prefill", "prefill64"):
    check(f"C3.nanq.prefill.{_k}")(_c3_prefill(_k, PREFILL_LENS, 12, 4, C3_PREFILL_ROWS))
    check(f"C3.nanq.prefill_split.{_k}")(_c3_prefill(_k, SPLIT_LENS, 4, 1, C3_SPLIT_ROWS))
check("C3.nanq.prefill_sinks.sm90")(_c3_prefill("sm90", PREFILL_LENS, 12, 4, C3_PREFILL_ROWS, sinks=True))
check("C3.nanq.prefill_sinks.prefill")(_c3_prefill("prefill", PREFILL_LENS, 12, 4, C3_PREFILL_ROWS, sinks=True))
check("C3.nanq.prefill_split_sinks.sm90")(_c3_prefill("sm90", SPLIT_LENS, 4, 1, C3_SPLIT_ROWS, sinks=True))
# decode: DECODE_LENS (1 token each); request 4 has kv 0 (sees no key); Hq 16, Hkv 2 (G 8)
C3_DECODE_ROWS = [(0, 0, 3), (3, 0, 9), (4, 0, 1), (5, 0, 15)]
for _bk, _sp in (("cuda_fa2", None), ("xqa", 1), ("xqa", 4), ("xqa", None)):
    _tag = _bk + ("" if _sp is None else f".splits{_sp}")
    check(f"C3.nanq.decode.{_tag}")(_c3_decode(_bk, DECODE_LENS, C3_DECODE_ROWS, _sp))
    check(f"C3.nanq.decode_sinks.{_tag}")(_c3_decode(_bk, DECODE_LENS, C3_DECODE_ROWS, _sp, sinks=True))
    check(f"C3.nanq.decode_long.{_tag}")(_c3_decode(_bk, LONG_DECODE, [(0, 0, 6)], _sp))
    check(f"C3.nanq.decode_spec3.{_tag}")(_c3_decode(_bk, [(3, n) for n in (3, 700, 129)],
                                                     [(0, 1, 2), (1, 0, 15), (2, 2, 0)], _sp, ql=3))
C3_XQA_BT_ROWS = [(0, 0, 3), (3, 0, 9), (4, 0, 15)]  # XQA_BT_LENS
check("C3.nanq.xqa_block_tables")(_c3_xqa_bt(XQA_BT_LENS, C3_XQA_BT_ROWS))
check("C3.nanq.xqa_block_tables_split4")(_c3_xqa_bt(XQA_BT_LENS, C3_XQA_BT_ROWS, splits=4))


# ------------------------------------------------------------------------------------------ main
def prebuild() -> str:
    """Build the specializations the checks load, in parallel (the checks would build them one by one)."""
    from attncore.build import jit
    from attncore.backends.cuda_fa2 import specs as fs
    from attncore.backends.xqa import specs as xs

    keys = [fs.Fa2Key(c, "bf16", "same", D, m) for c in ("prefill", "decode") for m in ("causal", "none")]
    keys.append(fs.Fa2Key("prefill64", "bf16", "same", D, "causal"))
    if CC == (9, 0):
        keys += [fs.Fa2Key("prefill90", "bf16", "same", D, m, ws=True) for m in ("causal", "none")]
    t = time.time()
    jit.build("cuda_fa2", [k.spec() for k in keys])
    jit.build("xqa", [xs.XqaKey("bf16", "same", "same", D, mt).spec() for mt in (1, 2)])
    return f"{len(keys) + 2} specializations in {time.time() - t:.0f} s"


def main() -> int:
    todo = [(n, f) for n, f in CHECKS if ARGS.k in n]
    if ARGS.list:
        print("\n".join(n for n, _ in todo))
        return 0
    if not HARNESS:
        print(f"device: {torch.cuda.get_device_name(DEV)} sm{CC[0]}{CC[1]}, torch {torch.__version__}, "
              f"attncore from {os.path.dirname(attncore.__file__)}", flush=True)
        todo.insert(0, ("prebuild", prebuild))
    n_fail = n_skip = 0
    t_all = time.time()
    for name, fn in todo:
        SEEN.clear()
        _GOLDEN.clear()
        t = time.time()
        try:
            note = fn()
            runs = " ".join(sorted(set(SEEN)))
            print(f"PASS {name}  ({time.time() - t:.1f}s{'; ' + note if note else ''}{'; ' + runs if runs else ''})",
                  flush=True)
        except Skip as e:
            n_skip += 1
            print(f"SKIP {name}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001  every failure is a FAIL line, then the next check
            n_fail += 1
            runs = " ".join(sorted(set(SEEN)))
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:800]
            print(f"FAIL {name}: {msg}{'  [' + runs + ']' if runs else ''}", flush=True)
            if os.environ.get("ISSUE13_TRACEBACK"):
                traceback.print_exc()
        finally:
            if DEV.type == "cuda":
                try:
                    torch.cuda.synchronize(DEV)
                except Exception as e:  # noqa: BLE001  a sticky CUDA error: later checks cannot run
                    print(f"FAIL {name}: CUDA error after the check ({e}); stopping", flush=True)
                    return 1
    total = len(todo)
    print(f"{total - n_fail - n_skip} passed, {n_fail} failed, {n_skip} skipped in {time.time() - t_all:.0f} s")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
