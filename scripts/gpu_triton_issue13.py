#!/usr/bin/env python3
"""Issue 13, Triton part, on a CUDA GPU (H100): the Triton backend's generic kernel (prefill, paged,
decode, split-KV merge), its Hopper dense kernel (TMA descriptors, also behind the page gather) and
the fp8-KV decode path, in fp16 and bf16.

    python scripts/gpu_triton_issue13.py              # every check: one PASS / FAIL line each
    python scripts/gpu_triton_issue13.py -k dense     # the checks whose name contains "dense"
    python scripts/gpu_triton_issue13.py --list
    python scripts/gpu_triton_issue13.py --seed 7     # the inputs of an earlier run (it prints its seed)

Exit status 1 when a check fails.  Checks (docs/semantics.md, "Non-finite inputs"):
  A.*       GQA groups 3/5/7/12, causal, qo < kv, lengths 127/128/129/255/256/257: the dense kernel
            (d64 / d128, required to run: an sm90 GPU; split-KV off), the generic kernel on 128 x 64 tiles with
            requests picked (by a mirror of its range code) where the old last-token formula
            (end // G - 1 instead of (end - 1) // G) cut a tile, and paged prefill.
  B.nanq.*  NaN in one element of some query rows: those rows NaN out and NaN LSE when they see a
            key, exactly 0 and -inf when they see none (qo > kv, kv 0); every other row unchanged.
            Dense, generic, split-KV merge, sinks, fp8 KV with bf16 q (the fp16-dot clamp).
  B.window.*  NaN in the K and V of every key left of the window of all rows of its request.
Every check also has rule 1: K/V rows outside each request's range hold NaN in the poisoned run
(other requests' rows of a ragged cache, TMA tiles past kv_len, unused slots of last pages, spare
pages, block-table padding, the gathered copy of all of them) and random finite values in the clean
run.  Each case runs one plan twice, outputs and LSE NaN-filled first: clean inputs, then poisoned
ones; the poisoned run must give the clean run's bits outside the NaN query rows.  The clean run is
checked against the fp64 golden (attncore.testing.golden: max_error <= tolerance(the same math in
the dtype, golden); LSE: same -inf pattern, error <= 2 x the dtype math's + 2e-2).
Inputs are fresh random draws (--seed, default from the clock).  ISSUE13_TRACEBACK=1: tracebacks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("-k", default="", help="run only the checks whose name contains this")
ap.add_argument("--list", action="store_true", help="list the checks")
ap.add_argument("--seed", type=int, default=None, help="base seed (default: from the clock)")
ARGS = ap.parse_args()

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels

from attncore.backend import AttnParams, BatchMeta, RunArgs  # noqa: E402
from attncore.problem import AttentionProblem  # noqa: E402
from attncore.testing.golden import dtype_attention, golden_attention, max_error, tolerance  # noqa: E402

NAN = float("nan")
SEED = ARGS.seed if ARGS.seed is not None else int(time.time()) % 1000003


# ------------------------------------------------------------------ the old slip, mirrored
def _tiles(qo, kv, G, bm, bn, causal, window, old=False):
    """KV tiles (start, masked) each row tile visits: _attn_fwd's range code ("KV range of this
    item") in Python; ``old``: with the last-token slip."""
    tdiv = lambda a, b: a // b if a >= 0 else -(-a // b)  # noqa: E731  (Triton truncates)
    out = []
    for row0 in range(0, qo * G, bm):
        end = min(row0 + bm, qo * G)
        q_first = row0 // G
        q_last = max(end // G - 1 if old else (end - 1) // G, q_first)
        off = kv - qo
        lo, hi, f_lo, f_hi = 0, kv, 0, kv // bn * bn
        if causal:
            hi = min(hi, q_last + off + 1)
            f_hi = min(f_hi, tdiv(q_first + off + 1, bn) * bn)
        if window >= 0:
            lo = max(lo, max(q_first + off - window, 0) // bn * bn)
            f_lo = max(lo, (max(q_last + off - window, 0) + bn - 1) // bn * bn)
        hi = max(hi, lo)
        f_lo = min(max(f_lo, lo), (hi + bn - 1) // bn * bn)
        f_hi = max(f_hi, f_lo)
        out.append([(a, m) for a, b, m in ((lo, f_lo, 1), (f_lo, f_hi, 0), (f_hi, hi, 1)) for a in range(a, b, bn)])
    return out


def slip_requests(G, bm, bn, qo_range, n=2):
    """Up to n (qo, kv > qo) requests whose tiles the old formula got wrong."""
    found = []
    for qo in qo_range:
        for kv in range(qo + 1, qo + 2 * bn + 1):
            if _tiles(qo, kv, G, bm, bn, True, -1) != _tiles(qo, kv, G, bm, bn, True, -1, old=True):
                found.append((qo, kv))
                break
        if len(found) == n:
            break
    return found


# ------------------------------------------------------------------ one case
class Fail(Exception):
    pass


def poison(x, mask):
    """x[mask] = NaN through an integer view (fp8 has no masked_fill / index_put on the CPU)."""
    ity = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    x.view(ity)[mask] = torch.full((1,), NAN, dtype=x.dtype).view(ity)


def run_case(op, qo_lens, kv_lens, *, hq, hkv, d, dt, kv_dt=None, page_size=None, layout="NHD",
             causal=None, window=-1, sinks=False, junk=(), nan_q=(), nan_window=False, be_kw=None,
             want_dense=None, seed=0):
    """Returns a note (kernel, worst error / tolerance); raises Fail.  ``junk``: requests (with no
    query rows) whose K/V are NaN in the poisoned run; ``nan_q``: (request, token, head) rows that
    get a NaN; ``nan_window``: NaN in the keys left of the window of all rows of each request."""
    from attncore.backends.triton.backend import TritonBackend

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv_dt = kv_dt or dt
    fp8 = kv_dt.itemsize == 1
    B = len(qo_lens)
    decode = op in ("batch_decode", "xqa_decode")
    qlen = qo_lens[0] if decode else 1
    causal = not decode if causal is None else causal  # decode: causal within the draft anyway
    sm_scale = 1.0 / math.sqrt(d)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    qs = [rnd(n, hq, d).to(dt) for n in qo_lens]
    ks = [(rnd(n, hkv, d) * (4 if fp8 else 1)).to(kv_dt) for n in kv_lens]
    vs = [(rnd(n, hkv, d) * (4 if fp8 else 1)).to(kv_dt) for n in kv_lens]
    sinks_t = (rnd(hq) * 2).float().to(dev) if sinks else None
    i32 = dict(dtype=torch.int32, device=dev)
    qo_ip = [0]
    for n in qo_lens:
        qo_ip.append(qo_ip[-1] + n)
    nnz = qo_ip[-1]

    def hidden(b, t):  # rows 1-2 keys: left of every row's window, or another request's / junk
        return b in junk or (nan_window and window >= 0 and t < kv_lens[b] - qo_lens[b] - window)

    if page_size is None:
        kv_ip = [0]
        for n in kv_lens:
            kv_ip.append(kv_ip[-1] + n)
        n_rows = kv_ip[-1]
        k_c = rnd(n_rows, hkv, d).to(kv_dt)  # NHD view of the storage, written below
        v_c = rnd(n_rows, hkv, d).to(kv_dt)
        keep = torch.ones(n_rows, dtype=torch.bool)
        for b in range(B):
            if b not in junk:
                k_c[kv_ip[b]: kv_ip[b + 1]] = ks[b]
                v_c[kv_ip[b]: kv_ip[b + 1]] = vs[b]
            for t in range(kv_lens[b]):
                keep[kv_ip[b] + t] = not hidden(b, t)
        k_p, v_p = k_c.clone(), v_c.clone()
        poison(k_p, ~keep)
        poison(v_p, ~keep)
        if layout == "HND":
            k_c, v_c, k_p, v_p = (x.transpose(0, 1).contiguous() for x in (k_c, v_c, k_p, v_p))
        meta_kw = dict(kv_indptr=torch.tensor(kv_ip, **i32), kv_indptr_host=kv_ip,
                       kv_lens=torch.tensor(kv_lens, **i32), kv_lens_host=list(kv_lens))
    else:
        npages = [(n + page_size - 1) // page_size for n in kv_lens]
        total = sum(npages) + 5  # spare pages
        perm = torch.randperm(total, generator=g).tolist()
        k_c = rnd(total, page_size, hkv, d).to(kv_dt)  # NHD; random finite junk in the clean run
        v_c = rnd(total, page_size, hkv, d).to(kv_dt)
        keep = torch.zeros(total, page_size, dtype=torch.bool)
        indices, ip, last = [], [0], []
        for b in range(B):
            pages = perm[ip[-1]: ip[-1] + npages[b]]
            indices += pages
            ip.append(ip[-1] + npages[b])
            last.append(kv_lens[b] - (npages[b] - 1) * page_size if npages[b] else 0)
            for t in range(kv_lens[b]):
                pg, sl = pages[t // page_size], t % page_size
                k_c[pg, sl] = ks[b][t]
                v_c[pg, sl] = vs[b][t]
                keep[pg, sl] = not hidden(b, t)
        k_p, v_p = k_c.clone(), v_c.clone()
        poison(k_p, ~keep)
        poison(v_p, ~keep)
        if layout == "HND":
            k_c, v_c, k_p, v_p = (x.transpose(1, 2).contiguous() for x in (k_c, v_c, k_p, v_p))
        if op == "xqa_decode":
            maxp = max(npages) + 2
            spare = perm[ip[-1]]  # block-table padding points at a spare (NaN) page
            bt = torch.full((B, maxp), spare, dtype=torch.int32)
            for b in range(B):
                bt[b, : npages[b]] = torch.tensor(indices[ip[b]: ip[b + 1]], dtype=torch.int32)
            meta_kw = dict(block_tables=bt.to(dev), seq_lens=torch.tensor(kv_lens, **i32),
                           max_seq_len=max(kv_lens))
        else:
            meta_kw = dict(kv_indptr=torch.tensor(ip, **i32), kv_indptr_host=ip,
                           kv_indices=torch.tensor(indices, **i32), kv_last_page_len=torch.tensor(last, **i32),
                           kv_lens=torch.tensor(kv_lens, **i32), kv_lens_host=list(kv_lens))
    k_c, v_c, k_p, v_p = (x.to(dev) for x in (k_c, v_c, k_p, v_p))
    q_c = torch.cat(qs).to(dev)
    q_p = q_c.clone()
    bad = torch.zeros(nnz, hq, dtype=torch.bool)
    for b, t, h in nan_q:
        q_p[qo_ip[b] + t, h, (3 * t + h) % d] = NAN
        bad[qo_ip[b] + t, h] = True

    params = AttnParams(sm_scale=sm_scale, causal=causal, window_left=window)
    meta = BatchMeta(batch_size=B, qo_indptr=torch.tensor(qo_ip, **i32), qo_indptr_host=qo_ip,
                     page_size=page_size, params=params, q_len_per_req=qlen if decode else 1, device=dev,
                     **meta_kw)
    problem = AttentionProblem(
        op=op, device_type="cuda", compute_capability=tuple(torch.cuda.get_device_capability()),
        q_dtype=dt, kv_dtype=kv_dt, out_dtype=dt, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d,
        head_dim_vo=d, page_size=page_size, kv_layout=layout, mask="causal" if causal else "none",
        window_left=window, sinks=sinks, return_lse=True, q_len_per_req=qlen if decode else 1)
    be_kw = dict(be_kw or {})
    if want_dense:  # small batches are split-KV by default, which the dense kernel does not serve
        be_kw.setdefault("kv_chunk", 0)
    be = TritonBackend(**be_kw)
    reasons = be.reasons(problem)
    if reasons:
        raise Fail("refused: " + "; ".join(map(str, reasons)))
    plan = be.plan(problem, meta)

    def run(q, k, v):
        out = torch.full((nnz, hq, d), NAN, dtype=dt, device=dev)
        lse = torch.full((nnz, hq), NAN, dtype=torch.float32, device=dev)
        be.run(plan, RunArgs(q=q, k=k, v=v, out=out, lse=lse, sinks=sinks_t))
        torch.cuda.synchronize()
        return out.cpu().double(), lse.cpu().double()

    o_c, l_c = run(q_c, k_c, v_c)
    o_p, l_p = run(q_p, k_p, v_p)
    kernel = ("dense " + str(plan.stats.get("dense")) + (" +gather" if plan.gather is not None else "")
              if plan.dense else "generic " + str(plan.cfg.as_dict()) + (f" splits {plan.max_splits}"
                                                                         if plan.max_splits > 1 else ""))
    if want_dense is not None and bool(plan.dense) != want_dense:
        raise Fail(f"wanted the {'dense' if want_dense else 'generic'} kernel, ran {kernel}; "
                   f"stats {plan.stats}")
    if "dense_failed" in plan.stats:
        raise Fail(f"a dense config failed to compile: {plan.stats['dense_failed']}")

    # rules 1-3: the poisoned run gives the clean run's bits outside the NaN query rows
    good = ~bad
    if not (torch.equal(o_p[good].isnan(), o_c[good].isnan())
            and torch.equal(o_p[good].nan_to_num(), o_c[good].nan_to_num())):
        diff = (o_p[good] - o_c[good]).abs().nan_to_num(float("inf")).max().item()
        raise Fail(f"NaN keys / rows changed other rows' output (max diff {diff:.3g}) [{kernel}]")
    if not torch.equal(l_p[good].nan_to_num(), l_c[good].nan_to_num()):
        raise Fail(f"NaN keys / rows changed other rows' LSE [{kernel}]")

    worst = 0.0
    for b in range(B):
        r0, r1 = qo_ip[b], qo_ip[b + 1]
        if r0 == r1:
            continue
        kw = dict(causal=causal or (decode and qlen > 1), window_left=window, sm_scale=sm_scale,
                  sinks=sinks_t.cpu() if sinks else None, device=dev)
        go, gl = golden_attention(qs[b], ks[b], vs[b], **kw)
        ro, rl = dtype_attention(qs[b], ks[b], vs[b], dtype=dt, softmax_dtype=torch.float32, **kw)
        err, tol = max_error(o_c[r0:r1], go), tolerance(ro, go, dt)
        if not err <= tol:
            raise Fail(f"request {b} (qo {qo_lens[b]}, kv {kv_lens[b]}): out err {err:.3g} > tol {tol:.3g} [{kernel}]")
        worst = max(worst, err / tol)
        lc = l_c[r0:r1]
        if lc.isnan().any() or not torch.equal(lc.isinf(), gl.isinf()):
            raise Fail(f"request {b}: LSE NaN or -inf pattern differs from the golden [{kernel}]")
        fin = gl.isfinite()
        if fin.any():
            lerr = (lc[fin] - gl[fin]).abs().max().item()
            ltol = 2 * (rl[fin] - gl[fin]).abs().max().item() + 2e-2
            if lerr > ltol:
                raise Fail(f"request {b}: LSE err {lerr:.3g} > {ltol:.3g} [{kernel}]")
        for t, h in bad[r0:r1].nonzero().tolist():  # rules 3-4
            o, l = o_p[r0 + t, h], l_p[r0 + t, h]
            if torch.isfinite(gl[t, h]):
                if not (o.isnan().all() and l.isnan()):
                    raise Fail(f"request {b} row {t} head {h}: NaN query that sees keys gave out "
                               f"NaN {o.isnan().all().item()}, LSE {l.item()} [{kernel}]")
            elif not ((o == 0).all() and l == float("-inf")):
                raise Fail(f"request {b} row {t} head {h}: NaN query that sees no key gave out "
                           f"{o.abs().max().item()}, LSE {l.item()} (want 0, -inf) [{kernel}]")
    return f"{kernel}; worst err/tol {worst:.2f}"


# ------------------------------------------------------------------ the checks
CHECKS = []


def check(name, fn):
    CHECKS.append((name, fn))


DTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
GEN128 = dict(config=dict(block_m=128, block_n=64, num_warps=8, num_stages=3))  # forced: generic kernel
A_QO, A_KV = [127, 0, 128, 129, 255, 256, 257], [255, 130, 256, 257, 256, 257, 385]  # request 1: junk


def _seed(name):
    return (SEED * 1000003 + sum(map(ord, name)) * 7919) % (2 ** 31)


for dn, dt in DTS.items():
    for d in (64, 128):
        for G in (3, 5, 7, 12):
            nm = f"A.dense.d{d}.g{G}.{dn}"
            check(nm, lambda nm=nm, d=d, G=G, dt=dt: run_case(
                "batch_prefill_ragged", A_QO, A_KV, hq=G * 2, hkv=2, d=d, dt=dt, junk=(1,),
                want_dense=True, seed=_seed(nm)))
        nm = f"A.dense.single.d{d}.g7.{dn}"
        check(nm, lambda nm=nm, d=d, dt=dt: run_case(
            "single_prefill", [257], [385], hq=7, hkv=1, d=d, dt=dt, layout="HND", want_dense=True, seed=_seed(nm)))
        nm = f"A.dense.gather.d{d}.g5.{dn}"
        check(nm, lambda nm=nm, d=d, dt=dt: run_case(
            "batch_prefill_paged", [127, 129, 256], [255, 257, 257], hq=10, hkv=2, d=d, dt=dt, page_size=16,
            be_kw=dict(gather=True), want_dense=True, seed=_seed(nm)))
    for G in (3, 5, 7, 12):
        slips = slip_requests(G, 128, 64, range(40, 200))
        qo_l, kv_l = A_QO + [s[0] for s in slips], A_KV + [s[1] for s in slips]
        for layout in ("NHD", "HND"):
            nm = f"A.generic.ragged.{layout}.g{G}.{dn}"
            check(nm, lambda nm=nm, G=G, dt=dt, qo_l=qo_l, kv_l=kv_l, layout=layout: run_case(
                "batch_prefill_ragged", qo_l, kv_l, hq=G * 2, hkv=2, d=128, dt=dt, layout=layout, junk=(1,),
                be_kw=GEN128, want_dense=False, seed=_seed(nm)))
        nm = f"A.generic.paged.g{G}.{dn}"  # auto config (paged: page ids prefetched)
        check(nm, lambda nm=nm, G=G, dt=dt, qo_l=qo_l, kv_l=kv_l: run_case(
            "batch_prefill_paged", qo_l, kv_l, hq=G * 2, hkv=2, d=128, dt=dt, page_size=16,
            be_kw=dict(dense=False), want_dense=False, seed=_seed(nm)))
        nm = f"A.generic.decode_q4.g{G}.{dn}"  # 4 draft tokens: 12 to 48 packed rows; split KV
        check(nm, lambda nm=nm, G=G, dt=dt: run_case(
            "batch_decode", [4] * 4, [129, 4, 1000, 257], hq=G * 2, hkv=2, d=128, dt=dt, page_size=16,
            be_kw=dict(kv_chunk=128), seed=_seed(nm)))

    # B: NaN query rows.  Request 0: qo 40 > kv 20, rows 0-19 see no key (causal); request 2: kv 0
    NQ_QO, NQ_KV = [40, 0, 3, 300], [20, 77, 0, 513]
    NQ = [(0, 0, 1), (0, 19, 4), (0, 20, 2), (0, 39, 5), (2, 1, 0), (3, 0, 3), (3, 150, 1), (3, 299, 5)]
    for d in (64, 128):
        nm = f"B.nanq.dense.d{d}.{dn}"
        check(nm, lambda nm=nm, d=d, dt=dt: run_case(
            "batch_prefill_ragged", NQ_QO, NQ_KV, hq=6, hkv=2, d=d, dt=dt, sinks=True, junk=(1,), nan_q=NQ,
            want_dense=True, seed=_seed(nm)))
    nm = f"B.nanq.generic.{dn}"
    check(nm, lambda nm=nm, dt=dt: run_case(
        "batch_prefill_paged", NQ_QO, NQ_KV, hq=6, hkv=2, d=128, dt=dt, page_size=16, sinks=True, nan_q=NQ,
        be_kw=dict(dense=False), want_dense=False, seed=_seed(nm)))
    for sinks in (False, True):
        nm = f"B.nanq.split{'.sinks' if sinks else ''}.{dn}"
        check(nm, lambda nm=nm, dt=dt, sinks=sinks: run_case(
            "batch_decode", [1] * 4, [2000, 0, 700, 33], hq=12, hkv=2, d=128, dt=dt, page_size=16, sinks=sinks,
            nan_q=[(0, 0, 1), (1, 0, 0), (2, 0, 11), (3, 0, 6)], be_kw=dict(kv_chunk=256), seed=_seed(nm)))
    for kv_dn, kv_dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        nm = f"B.nanq.fp8_{kv_dn}.{dn}"  # bf16 q + fp8 KV: dots in fp16 behind a clamp of q
        check(nm, lambda nm=nm, dt=dt, kv_dt=kv_dt: run_case(
            "batch_decode", [1] * 3, [300, 0, 64], hq=8, hkv=2, d=128, dt=dt, kv_dt=kv_dt, page_size=16,
            nan_q=[(0, 0, 1), (1, 0, 2), (2, 0, 7)], seed=_seed(nm)))

    # B: NaN left of the window (whole tiles and part of one hidden from every row)
    for w in (5, 100):
        nm = f"B.window.prefill.w{w}.{dn}"
        check(nm, lambda nm=nm, dt=dt, w=w: run_case(
            "batch_prefill_paged", [7, 129, 0, 64], [400, 257, 50, 64], hq=10, hkv=2, d=128, dt=dt,
            page_size=16, window=w, nan_window=True, junk=(2,), seed=_seed(nm)))
        nm = f"B.window.ragged_hnd.w{w}.{dn}"
        check(nm, lambda nm=nm, dt=dt, w=w: run_case(
            "batch_prefill_ragged", [7, 129, 0, 64], [400, 257, 50, 64], hq=14, hkv=2, d=64, dt=dt,
            layout="HND", causal=False, window=w, nan_window=True, junk=(2,), seed=_seed(nm)))
        for chunk in (None, 128):
            nm = f"B.window.decode.w{w}{'.split' if chunk else ''}.{dn}"
            check(nm, lambda nm=nm, dt=dt, w=w, chunk=chunk: run_case(
                "batch_decode", [1] * 3, [1500, 77, 1], hq=8, hkv=2, d=128, dt=dt, page_size=16, window=w,
                nan_window=True, sinks=True, be_kw=dict(kv_chunk=chunk) if chunk else None, seed=_seed(nm)))
        nm = f"B.window.xqa.w{w}.{dn}"
        check(nm, lambda nm=nm, dt=dt, w=w: run_case(
            "xqa_decode", [1] * 3, [1000, 130, 17], hq=8, hkv=1, d=128, dt=dt, page_size=16, window=w,
            nan_window=True, seed=_seed(nm)))


def main() -> int:
    sel = [(n, f) for n, f in CHECKS if ARGS.k in n]
    if ARGS.list:
        print("\n".join(n for n, _ in sel))
        return 0
    if not torch.cuda.is_available():
        print("FAIL setup: no CUDA GPU")
        return 1
    import triton

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"seed {SEED} ({len(sel)} checks)", flush=True)
    fails = 0
    for name, fn in sel:
        t0 = time.time()
        try:
            note = fn()
            print(f"PASS {name}  ({note}; {time.time() - t0:.1f} s)", flush=True)
        except Exception as e:  # Fail, or an error in the backend: both are failures
            fails += 1
            print(f"FAIL {name}: {type(e).__name__ + ': ' if not isinstance(e, Fail) else ''}{e}", flush=True)
            if os.environ.get("ISSUE13_TRACEBACK"):
                traceback.print_exc()
    print(f"# {len(sel) - fails} passed, {fails} failed (seed {SEED})")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
