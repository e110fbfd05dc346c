"""xqa tuning sweep (one device call): kernel variants (specs.XqaKey.tune) on D5 / X1 fp8, the
defaults on D1 / D2 / X1 bf16, a correctness check of every non-diagnostic variant, and the split
counts around the cost model's choice.

Each variant is a set of compile-time options (``kpw`` keys per warp per tile, ``st`` ring depth,
``mb`` CTAs per SM of register budget, ``dg`` diagnostics: 1 = stream the KV only, 2 = compute
only).  Timings: ``triton.testing.do_bench`` medians (L2 cleared), same method and bytes as
``xqa_bench.py``.  Usage::

    python backends/xqa/bench/xqa_tune.py --json OUT.json [--variants a,b] [--prebuild-tests a,b]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from xqa_bench import ceilings, make  # noqa: E402

E4M3 = torch.float8_e4m3fn

# name -> tune options applied to the fp8 specializations (the 16-bit ones keep their defaults); the
# pseudo-options ("swap", 0) and ("sw16", b) set the backend's swapped-product knobs (XqaBackend.swap_for_fp8,
# swap_for_16bit: the latter for --tune16's 16-bit runs), ("sd", b) its split-dims kernel's (sd_for_fp8).
VARIANTS = {  # in the order they run (most informative first).  Run 1 (H100 2026-11-22, -s2-run1.json)
    # measured on the then default (64-key tiles): kpw32st2, st3mb4, st6, kpw32 (now the default).
    "base": (),                                  # the shipped default
    "noswap": (("swap", 0),),                    # the main kernel at <= 8 rows (16-row MMAs)
    "st2": (("st", 2),),                         # two stages (the fp8 d128 default since session 50)
    "kpw16sw": (("kpw", 16),),                   # 64-key tiles (16 KB stages, 4 of them: 3 CTAs per SM)
    "kpw16st6": (("kpw", 16), ("st", 6)),         # 64-key tiles, 6 stages, 2 CTAs per SM
    "dg2": (("dg", 2),),                         # diagnostics: compute only (zeroed tiles, nothing loaded)
    "noswapdg2": (("swap", 0), ("dg", 2)),
    "l2256": (("l2", 256),),                     # cp.async L2 prefetch 256 B (neighbouring head's row)
    "kpw16": (("kpw", 16),),                     # the previous fp8 default (64-key tiles, 4 stages, 3 CTAs/SM)
    "dg1": (("dg", 1),),                         # diagnostics: default geometry, KV streamed only
    "dg1l2256": (("dg", 1), ("l2", 256)),
    "kpw16st3mb4l2256": (("kpw", 16), ("st", 3), ("mb", 4), ("l2", 256)),
    "main16": (("sw16", 0),),                    # --tune16: the main kernel for 16-bit KV at <= 8 rows
    "sw16": (("sw16", 1),),                      # --tune16: the swapped kernel for 16-bit KV at <= 8 rows
    "sw16dg2": (("sw16", 1), ("dg", 2)),         # --tune16: its compute alone
    "main16dg2": (("sw16", 0), ("dg", 2)),
    "s49": (("kpw", 32), ("st", 3)),             # the fp8 d128 default before session 50 (swapped and 16-row CTAs)
    "st3": (("st", 3),),
    "mb3": (("mb", 3),),                         # the register budget of 3 CTAs per SM
    "mb3st2": (("mb", 3), ("st", 2)),
    "mb5": (("mb", 5),),
    "l264": (("l2", 64),),
    "nosd": (("sd", 0),),                        # 9-32 fp8 rows on the main kernel, not the split-dims one
    "nosddg2": (("sd", 0), ("dg", 2)),
}
PSEUDO = ("swap", "sw16", "sd")  # backend knobs, not kernel options


def is_diag(tune) -> bool:
    """A diagnostic variant (``dg``): its results are wrong by design, so they are not checked."""
    return any(k == "dg" for k, _ in tune)


def backend_with(tune=(), splits=None, mt2=True):
    from attncore.backends.xqa.backend import XqaBackend

    be = XqaBackend()
    be.swap_for_fp8 = dict(tune).get("swap", 1) != 0
    if "sw16" in dict(tune):
        be.swap_for_16bit = dict(tune)["sw16"] != 0
    be.sd_for_fp8 = dict(tune).get("sd", 1) != 0
    be.tune = tuple((k, v) for k, v in tune if k not in PSEUDO)
    be.split_override = splits
    be.mt2_for_fp8 = mt2
    return be


def reference(problem, meta, args, cache, n_req=4):
    n_req = min(n_req, meta.batch_size)
    """fp32 attention of the first ``n_req`` requests on the GPU (bench problems: full causal
    range, every key visible to draft row 0 ... with the draft rows' causal mask)."""
    q = args.q.float()
    B = meta.batch_size
    ql = problem.q_len_per_req
    hq, hkv, d = problem.num_qo_heads, problem.num_kv_heads, problem.head_dim_qk
    g = hq // hkv
    ps = problem.page_size
    if meta.block_tables is not None:
        pages = meta.block_tables
    else:
        pages = meta.kv_indices.view(B, -1)
    n = int(meta.kv_lens[0].item())
    outs = []
    for b in range(n_req):
        pg = pages[b].long()
        k, v = args.k, args.v
        if k.element_size() == 1:  # index fp8 through its bytes
            k = k.view(torch.uint8)[pg].view(args.k.dtype)
            v = v.view(torch.uint8)[pg].view(args.v.dtype)
        else:
            k, v = k[pg], v[pg]
        k = k.float().reshape(-1, hkv, d)[:n]  # NHD [pages, ps, hkv, d]
        v = v.float().reshape(-1, hkv, d)[:n]
        qb = q[b * ql:(b + 1) * ql]  # [ql, hq, d]
        kf = k.repeat_interleave(g, dim=1)
        vf = v.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qb, kf) * meta.params.sm_scale
        qpos = torch.arange(ql, device=q.device)[:, None] + (n - ql)
        kpos = torch.arange(n, device=q.device)[None, :]
        s = s.masked_fill(~(kpos <= qpos)[None], float("-inf"))
        m = s.amax(-1, keepdim=True)
        if args.sinks is not None:
            m = torch.maximum(m, args.sinks.float()[:, None, None])
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        if args.sinks is not None:
            l = l + torch.exp(args.sinks.float()[:, None, None] - m)
        outs.append((torch.einsum("hqk,khd->qhd", p, vf) / l.transpose(0, 1)))
    return torch.cat(outs, 0)


def run_case(wid, op, read, tune=(), splits=None, mt2=True, check=True, **kw):
    from triton.testing import do_bench

    be = backend_with(tune, splits, mt2)
    problem, meta, args, nbytes, cache = make(op, **kw)
    plan = be.plan(problem, meta)
    err = None
    if check:
        args.out.fill_(float("nan"))
        be.run(plan, args)
        torch.cuda.synchronize()
        ref = reference(problem, meta, args, cache)
        got = args.out[:ref.shape[0]].float()
        err = float(((got - ref).norm() / ref.norm()).item()) if not torch.isnan(args.out.float()).any() else float("nan")
    else:
        be.run(plan, args)
        torch.cuda.synchronize()
    t = do_bench(lambda: be.run(plan, args), warmup=30, rep=200, return_mode="median")
    tbps = nbytes / (t * 1e-3) / 1e12
    res = {"id": wid, "time_ms": round(t, 4), "TBps": round(tbps, 3), "frac_read_ceiling": round(tbps / read, 4),
           "splits": plan.num_splits, "ctas_per_sm": plan.lib.ctas_per_sm, "tile": plan.lib.tile,
           "stages": plan.lib.stages, "smem": plan.lib.smem, "spec": plan.lib.key.uri, "rel_err": err}
    print(f"{wid:<34} {t:8.4f} ms {tbps:6.3f} TB/s {100 * tbps / read:5.1f}%  s{plan.num_splits} "
          f"cta/sm {plan.lib.ctas_per_sm} tile {plan.lib.tile} st {plan.lib.stages}"
          + (f" err {err:.2e}" if err is not None else ""), flush=True)
    del cache, args
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prebuild-tests", default="", help="variants whose fp8 test specializations to prebuild")
    ap.add_argument("--no-defaults", action="store_true", help="skip the 16-bit default workloads")
    ap.add_argument("--tune16", default="", help="variants also run on the 16-bit D1 / D2-B1")
    ap.add_argument("--split-sweep", default="base", help="variants timed at the split counts around the model's")
    a = ap.parse_args()
    from attncore.build import jit
    from attncore.backends.xqa.specs import XqaKey

    names = [v for v in a.variants.split(",") if v]
    arch = jit.current_arch()
    specs = {}

    def add(*args, tune=(), **kw):  # the key with the variant's kernel options (PSEUDO options are the backend's knobs)
        k = XqaKey(*args, tuple(x for x in tune if x[0] not in PSEUDO), **kw)
        specs[k.uri] = k

    for nm in names:
        for sw in (False, True):
            add("bf16", "e4m3", "same", 128, 1, tune=VARIANTS[nm], swap=sw)
    for mt in (1, 2):
        for kv in ("same", "e4m3"):
            add("bf16", kv, "same", 128, mt)
    for nm in [v for v in a.tune16.split(",") if v]:
        add("bf16", "same", "same", 128, 1, tune=VARIANTS[nm], swap=dict(VARIANTS[nm]).get("sw16", 0) != 0)
    for nm in [v for v in a.prebuild_tests.split(",") if v]:  # what -k gpu_fp8 builds
        tune = VARIANTS[nm]
        for sw in (False, True):
            for dt in ("bf16", "fp16"):
                for kv in ("e4m3", "e5m2"):
                    add(dt, kv, "same", 128, 1, tune=tune, swap=sw)
            for d in (64, 256):
                add("bf16", "e4m3", "same", d, 1, tune=tune, swap=sw)
            add("bf16", "e4m3", "e4m3", 128, 1, tune=tune, swap=sw)
        add("bf16", "e4m3", "same", 128, 2, tune=tune)
    t0 = time.time()
    res = jit.build("xqa", [k.spec() for k in specs.values()], arch=arch)
    print(f"built {sum(1 for r in res if r.built)} of {len(specs)} specializations in {time.time() - t0:.1f} s",
          flush=True)

    name = torch.cuda.get_device_name()
    read, copy = ceilings()
    print(f"device {name}; read-only ceiling {read:.3f} TB/s, device copy {copy:.3f} TB/s", flush=True)
    d5 = dict(B=64, kv_len=4096, hq=32, hkv=8, kv_dtype=E4M3)
    x1 = dict(B=64, kv_len=8192, hq=64, hkv=8, sinks=True)
    results = []

    def go(wid, op, **kw):
        try:
            r = run_case(wid, op, read, **kw)
        except Exception as e:  # keep going: report what failed
            print(f"{wid}: FAILED {type(e).__name__}: {e}", flush=True)
            r = {"id": wid, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        return r

    if not a.no_defaults:  # 16-bit defaults (regression check of the shared code)
        go("D1", "batch_decode", B=64, kv_len=4096, hq=32, hkv=8)
        go("D2-B16", "batch_decode", B=16, kv_len=16384, hq=32, hkv=8)
        go("D2-B1", "batch_decode", B=1, kv_len=32768, hq=32, hkv=8)
        for t16 in [v for v in a.tune16.split(",") if v]:  # 16-bit runs of a variant (its kernel options only)
            diag = is_diag(VARIANTS[t16])
            go(f"D1/{t16}", "batch_decode", tune=VARIANTS[t16], check=not diag, B=64, kv_len=4096, hq=32, hkv=8)
            go(f"D2-B16/{t16}", "batch_decode", tune=VARIANTS[t16], check=not diag, B=16, kv_len=16384, hq=32, hkv=8)
            go(f"D2-B1/{t16}", "batch_decode", tune=VARIANTS[t16], check=not diag, B=1, kv_len=32768, hq=32, hkv=8)
            go(f"D3/{t16}", "batch_decode", tune=VARIANTS[t16], check=not diag, B=128, kv_len=2048, hq=32, hkv=32)
            go(f"X1-q1-bf16/{t16}", "xqa_decode", tune=VARIANTS[t16], check=not diag, q_len=1, **x1)
        for ql in (1, 2, 4):
            go(f"X1-q{ql}-bf16", "xqa_decode", q_len=ql, **x1)
    for nm in names:
        tune = VARIANTS[nm]
        diag = is_diag(tune)
        r = go(f"D5/{nm}", "batch_decode", tune=tune, check=not diag, **d5)
        go(f"X1-q1-e4m3/{nm}", "xqa_decode", tune=tune, check=not diag, q_len=1, kv_dtype=E4M3, **x1)
        go(f"D2-B1-e4m3/{nm}", "batch_decode", tune=tune, check=not diag, B=1, kv_len=32768, hq=32, hkv=8,
           kv_dtype=E4M3)
        go(f"D2-B16-e4m3/{nm}", "batch_decode", tune=tune, check=not diag, B=16, kv_len=16384, hq=32, hkv=8,
           kv_dtype=E4M3)
        go(f"X1-q2-e4m3/{nm}", "xqa_decode", tune=tune, check=not diag, q_len=2, kv_dtype=E4M3, **x1)
        go(f"X1-q4-e4m3/{nm}", "xqa_decode", tune=tune, check=not diag, q_len=4, kv_dtype=E4M3, **x1)
        if diag or nm not in a.split_sweep.split(","):
            continue
        go(f"X1-q4-e4m3-2x16/{nm}", "xqa_decode", tune=tune, mt2=False, q_len=4, kv_dtype=E4M3, **x1)
        s0 = r.get("splits")
        if s0:  # split counts around the cost model's choice
            for s_ in sorted({1, max(1, s0 - 1), s0 + 1} - {s0}):
                go(f"D5/{nm}/s{s_}", "batch_decode", tune=tune, splits=s_, check=False, **d5)
    if "base" not in names:  # (each variant times X1 q4 above)
        go("X1-q4-e4m3/base", "xqa_decode", q_len=4, kv_dtype=E4M3, **x1)
    go("D5-fp16q/base", "batch_decode", dtype=torch.float16, **d5)
    go("D5-HND/base", "batch_decode", layout="HND", check=False, **d5)

    doc = {"device": name, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "ceilings": {"read_only_sum_TBps": round(read, 3), "device_copy_TBps": round(copy, 3)},
           "variants": {k: [list(x) for x in VARIANTS[k]] for k in names}, "workloads": results}
    print("\n| workload/variant | ms | % read | splits | CTA/SM | err |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['id']} | FAILED | | | | |")
        else:
            e = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
            print(f"| {r['id']} | {r['time_ms']:.4f} | {100 * r['frac_read_ceiling']:.1f} | {r['splits']} | "
                  f"{r['ctas_per_sm']} | {e} |")
    print(f"ceilings: read {read:.3f} TB/s, copy {copy:.3f} TB/s ({name})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
