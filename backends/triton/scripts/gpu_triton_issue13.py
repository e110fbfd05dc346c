#!/usr/bin/env python3
"""Issue 13, Triton part, on a CUDA GPU (H100): the Triton backend's generic kernel (prefill, paged,
decode, split-KV merge), its Hopper dense kernel (TMA descriptors, also behind the page gather) and
the fp8-KV decode path, in fp16 and bf16.

    python backends/triton/scripts/gpu_triton_issue13.py              # every check: one PASS / FAIL line each
    python backends/triton/scripts/gpu_triton_issue13.py -k dense     # the checks whose name contains "dense"
    python backends/triton/scripts/gpu_triton_issue13.py --list
    python backends/triton/scripts/gpu_triton_issue13.py --seed 7     # the inputs of an earlier run (it prints its seed)

Exit status 1 when a check fails.  Checks (docs/semantics.md, "Non-finite inputs"):
  A.*       GQA groups 3/5/7/12, causal, qo < kv, lengths 127/128/129/255/256/257: the dense kernel
            (d64 / d128, required to run: an sm90 GPU; split-KV off), the generic kernel on 128 x 64 tiles with
            requests picked (attncore.testing.tile_model, a mirror of its range code) where the old
            last-token formula (end // G - 1 instead of (end - 1) // G) cut a tile, and paged prefill.
  B.nanq.*  NaN in one element of some query rows: those rows NaN out and NaN LSE when they see a
            key, exactly 0 and -inf when they see none (qo > kv, kv 0); every other row unchanged.
            Dense, generic, split-KV merge, sinks, fp8 KV with bf16 q (the fp16-dot clamp).
  B.window.*  NaN in the K and V of every key left of the window of all rows of its request.
Every check also has rule 1: K/V slots no request may read hold NaN in both runs (TMA tiles past
kv_len, unused slots of last pages, spare pages, block-table padding, the gathered copy of all of
them), and other requests' rows of a ragged cache (``junk``) in the poisoned one.  Each case
(attncore.testing.contract.run_case, as tests/test_triton_backend.py) runs one plan twice, outputs
and LSE NaN-filled first: clean inputs, then poisoned ones; the poisoned run must give the clean
run's bits outside the NaN query rows.  The clean run (and the NaN rows of the poisoned one) is
checked by the conformance suite's checker: fp64 golden, its tolerance rule (attncore.testing.golden
.tolerance) on outputs and LSE, rows that see no key exactly 0 / -inf.
Inputs are fresh random draws (--seed, default from the clock).  ISSUE13_TRACEBACK=1: tracebacks.
"""

from __future__ import annotations

import argparse
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

from attncore.testing import contract  # noqa: E402
from attncore.testing.tile_model import slip_requests  # noqa: E402

SEED = ARGS.seed if ARGS.seed is not None else int(time.time()) % 1000003


# ------------------------------------------------------------------ one case
class Fail(Exception):
    pass


def run_case(op, qo_lens, kv_lens, *, hq, hkv, d, dt, kv_dt=None, page_size=None, layout="NHD",
             causal=None, window=-1, sinks=False, junk=(), nan_q=(), nan_window=False, be_kw=None,
             want_dense=None, seed=0):
    """``attncore.testing.contract.run_case`` on the compiled Triton backend; returns a note naming the
    kernel that ran.  ``junk``: requests (with no query rows) whose K/V are NaN in the poisoned run;
    ``nan_q``: (request, token, head) rows that get a NaN; ``nan_window``: NaN in the keys left of the
    window of all rows of each request.  Raises AssertionError (a check failed) or Fail (another
    kernel ran than ``want_dense`` asks, or a dense config failed to compile)."""
    from attncore.backends.triton.backend import TritonBackend

    decode = op in ("batch_decode", "xqa_decode")
    be_kw = dict(be_kw or {})
    if want_dense:  # small batches are split-KV by default, which the dense kernel does not serve
        be_kw.setdefault("kv_chunk", 0)
    plan = contract.run_case(op, backend=TritonBackend(**be_kw), qo_lens=qo_lens, kv_lens=kv_lens, hq=hq, hkv=hkv,
                             d=d, dtype=dt, kv_dtype=kv_dt, page_size=page_size, layout=layout,
                             causal=not decode if causal is None else causal,  # decode: causal within the draft
                             window_left=window, sinks=sinks, nan_q=nan_q, nan_window=nan_window, nan_reqs=junk,
                             device="cuda", seed=seed)
    kernel = ("dense " + str(plan.stats.get("dense")) + (" +gather" if plan.gather is not None else "")
              if plan.dense else "generic " + str(plan.cfg.as_dict()) + (f" splits {plan.max_splits}"
                                                                         if plan.max_splits > 1 else ""))
    if want_dense is not None and bool(plan.dense) != want_dense:
        raise Fail(f"wanted the {'dense' if want_dense else 'generic'} kernel, ran {kernel}; "
                   f"stats {plan.stats}")
    if "dense_failed" in plan.stats:
        raise Fail(f"a dense config failed to compile: {plan.stats['dense_failed']}")
    return kernel


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
        slips = slip_requests(G, 128, 64, range(40, 200), n=2)
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
        except Exception as e:  # Fail, a failed check, or an error in the backend: all are failures
            fails += 1
            msg = f"{type(e).__name__ + ': ' if not isinstance(e, Fail) else ''}{e}".replace("\n", " ")
            print(f"FAIL {name}: {msg}", flush=True)
            if os.environ.get("ISSUE13_TRACEBACK"):
                traceback.print_exc()
    print(f"# {len(sel) - fails} passed, {fails} failed (seed {SEED})")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
