"""xqa backend: cold build time, read / copy ceilings and decode timings (D1, D2, D5, X1).

Timings use ``triton.testing.do_bench`` (median; it clears L2 between repetitions) on inputs far
larger than L2.  Bytes = K + V bytes actually read (the visible keys of every request) + q + out.
Ceilings measured in the same run: a read-only sum over 2 GiB and a 1 GiB device copy (read +
write counted).  Usage::

    python backends/xqa/bench/xqa_bench.py --build-only --json build.json   # cold build (empty cache)
    python backends/xqa/bench/xqa_bench.py --json results.json
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

from attncore.core.backend import AttnParams, BatchMeta, RunArgs
from attncore.core.problem import AttentionProblem


def build_keys():
    from attncore.backends.xqa.specs import XqaKey

    keys = set()
    for dt in ("bf16", "fp16"):
        for kv in ("same", "e4m3", "e5m2"):
            for d in (64, 128, 256):
                for mt in ((1,) if d == 256 else (1, 2)):
                    keys.add(XqaKey(dt, kv, "same", d, mt))
    keys.add(XqaKey("bf16", "e4m3", "e4m3", 128, 1))
    return sorted(keys, key=lambda k: k.uri)


def cold_build(path):
    from attncore.build import jit
    from attncore.backends.xqa.specs import XqaKey

    arch = jit.current_arch()
    first = XqaKey("bf16", "same", "same", 128, 1).spec()
    t0 = time.time()
    jit.build_spec(first, arch, force=True)
    one = time.time() - t0
    keys = build_keys()
    t0 = time.time()
    res = jit.build("xqa", [k.spec() for k in keys], arch=arch)
    allt = time.time() - t0
    out = {"arch": arch, "one_spec_s": round(one, 2), "one_spec": first.uri,
           "n_specs": len(keys), "all_specs_parallel_s": round(allt, 2), "jobs": os.cpu_count(),
           "built": sum(1 for r in res if r.built)}
    print(f"cold build: {first.uri} {one:.1f} s; {len(keys)} specializations in parallel "
          f"({os.cpu_count()} jobs) {allt:.1f} s", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def ceilings():
    from triton.testing import do_bench

    x = torch.randn(2 ** 29, device="cuda", dtype=torch.float32)  # 2 GiB
    t = do_bench(lambda: x.sum(), warmup=25, rep=200, return_mode="median")
    read = x.numel() * 4 / (t * 1e-3) / 1e12
    a = torch.randn(2 ** 28, device="cuda", dtype=torch.float32)  # 1 GiB
    b = torch.empty_like(a)
    t2 = do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    copy = 2 * a.numel() * 4 / (t2 * 1e-3) / 1e12
    del x, a, b
    torch.cuda.empty_cache()
    return read, copy


def make(op, B, kv_len, hq, hkv, d=128, ps=16, q_len=1, dtype=torch.bfloat16, kv_dtype=None, sinks=False,
         spec=False, seed=0, pdl=False, layout="NHD"):
    dev = torch.device("cuda")
    torch.manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    npages = -(-kv_len // ps)
    total = B * npages
    shape = (total, 2, ps, hkv, d) if layout == "NHD" else (total, 2, hkv, ps, d)
    cache = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    if kv_dtype != torch.bfloat16:
        cache = cache.to(kv_dtype)
    perm = torch.randperm(total, device=dev, dtype=torch.int64).to(torch.int32)
    q = torch.randn(B * q_len, hq, d, device=dev).to(dtype)
    out = torch.empty_like(q)
    seq = torch.full((B,), kv_len, dtype=torch.int32, device=dev)
    params = AttnParams(sm_scale=1 / math.sqrt(d), causal=True)
    qo_host = [i * q_len for i in range(B + 1)]
    qo = torch.tensor(qo_host, dtype=torch.int32, device=dev)
    if op == "xqa_decode":
        meta = BatchMeta(batch_size=B, qo_indptr=qo, qo_indptr_host=qo_host, block_tables=perm.view(B, npages),
                         seq_lens=seq, kv_lens=seq, max_seq_len=kv_len, page_size=ps, params=params,
                         q_len_per_req=q_len, device=dev)
    else:
        indptr_h = [i * npages for i in range(B + 1)]
        last = kv_len - (npages - 1) * ps
        meta = BatchMeta(batch_size=B, qo_indptr=qo, qo_indptr_host=qo_host,
                         kv_indptr=torch.tensor(indptr_h, dtype=torch.int32, device=dev), kv_indptr_host=indptr_h,
                         kv_indices=perm, kv_last_page_len=torch.full((B,), last, dtype=torch.int32, device=dev),
                         kv_lens=seq, kv_lens_host=[kv_len] * B, page_size=ps, params=params,
                         q_len_per_req=q_len, device=dev)
    mask = None
    if spec:
        words = ((q_len + 31) // 32) * 2
        lower = torch.tril(torch.ones(q_len, q_len, dtype=torch.int64))
        m32 = (lower << torch.arange(q_len)[None, :]).sum(-1).to(torch.int32)  # causal bits, q_len <= 31
        mask = m32[None, :, None].expand(B, q_len, words // 2).contiguous().to(dev).view(torch.uint16)
    problem = AttentionProblem(op=op, device_type="cuda", compute_capability=tuple(torch.cuda.get_device_capability()),
                               q_dtype=dtype, kv_dtype=kv_dtype, out_dtype=dtype, num_qo_heads=hq, num_kv_heads=hkv,
                               head_dim_qk=d, head_dim_vo=d, page_size=ps, kv_layout=layout, mask="causal",
                               sinks=sinks, q_len_per_req=q_len, spec_mask=spec)
    args = RunArgs(q=q, k=cache[:, 0], v=cache[:, 1], out=out,
                   sinks=torch.randn(hq, device=dev) if sinks else None, spec_mask=mask, enable_pdl=pdl)
    nbytes = 2 * B * kv_len * hkv * d * cache.element_size() + q.numel() * q.element_size() * 2
    return problem, meta, args, nbytes, cache


def bench_one(backend, wid, desc, op, read_ceiling, splits=None, mt2_for_fp8=True, **kw):
    from triton.testing import do_bench

    backend.split_override = splits
    backend.mt2_for_fp8 = mt2_for_fp8

    problem, meta, args, nbytes, cache = make(op, **kw)
    reasons = backend.reasons(problem)
    if reasons:
        print(f"{wid}: refused: {[str(r) for r in reasons]}")
        return None
    plan = backend.plan(problem, meta)
    backend.run(plan, args)
    torch.cuda.synchronize()
    assert not torch.isnan(args.out.float()).any()
    t = do_bench(lambda: backend.run(plan, args), warmup=50, rep=300, return_mode="median")
    tbps = nbytes / (t * 1e-3) / 1e12
    res = {"id": wid, "desc": desc, "op": op, "time_ms": round(t, 4), "bytes": nbytes, "TBps": round(tbps, 3),
           "frac_read_ceiling": round(tbps / read_ceiling, 3), "splits": plan.num_splits,
           "m_groups": plan.m_groups, "spec": plan.lib.key.uri}
    print(f"{wid:<22} {t:8.4f} ms {tbps:6.3f} TB/s {100 * tbps / read_ceiling:5.1f}% of read "
          f"(splits {plan.num_splits}, {plan.lib.key.uri})", flush=True)
    del cache, args
    torch.cuda.empty_cache()
    backend.split_override = None
    backend.mt2_for_fp8 = True
    return res


def run_overhead(backend):
    problem, meta, args, _, cache = make("batch_decode", B=8, kv_len=256, hq=32, hkv=8)
    plan = backend.plan(problem, meta)
    for _ in range(20):
        backend.run(plan, args)
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        backend.run(plan, args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t_plan0 = time.perf_counter()
    for _ in range(20):
        backend.plan(problem, meta)
    t_plan = (time.perf_counter() - t_plan0) / 20
    return (t1 - t0) / n * 1e6, t_plan * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--build-only", action="store_true")
    a = ap.parse_args()
    if a.build_only:
        cold_build(a.json)
        return
    from attncore.backends.xqa.backend import XqaBackend

    be = XqaBackend()
    name = torch.cuda.get_device_name()
    read, copy = ceilings()
    print(f"device {name}; read-only ceiling {read:.3f} TB/s, device copy {copy:.3f} TB/s", flush=True)
    e4m3 = torch.float8_e4m3fn
    W = [
        ("D1", "batch decode B64 kv4096 32/8 bf16 p16", "batch_decode", dict(B=64, kv_len=4096, hq=32, hkv=8)),
        ("D2-B16", "batch decode B16 kv16384 32/8", "batch_decode", dict(B=16, kv_len=16384, hq=32, hkv=8)),
        ("D2-B1", "batch decode B1 kv32768 32/8", "batch_decode", dict(B=1, kv_len=32768, hq=32, hkv=8)),
        ("D5", "D1 with fp8 e4m3 KV, bf16 q", "batch_decode", dict(B=64, kv_len=4096, hq=32, hkv=8, kv_dtype=e4m3)),
        ("D1-xqa", "D1 through xqa_decode (block tables)", "xqa_decode", dict(B=64, kv_len=4096, hq=32, hkv=8)),
        ("D1-pdl", "D1 with enable_pdl", "batch_decode", dict(B=64, kv_len=4096, hq=32, hkv=8, pdl=True)),
        ("D2-B1-pdl", "D2 B1 with enable_pdl", "batch_decode", dict(B=1, kv_len=32768, hq=32, hkv=8, pdl=True)),
        ("D5-fp16q", "D1 with fp8 e4m3 KV, fp16 q", "batch_decode",
         dict(B=64, kv_len=4096, hq=32, hkv=8, kv_dtype=e4m3, dtype=torch.float16)),
    ]
    for ql in (1, 2, 4):
        for kvn, kvd in (("bf16", None), ("e4m3", e4m3)):
            W.append((f"X1-q{ql}-{kvn}", f"xqa B64 kv8192 64/8 q_len {ql} {kvn} KV, sinks", "xqa_decode",
                      dict(B=64, kv_len=8192, hq=64, hkv=8, q_len=ql, kv_dtype=kvd, sinks=True)))
    W.append(("X1-q4-bf16-mask", "xqa B64 kv8192 64/8 q_len 4 bf16, sinks, spec mask", "xqa_decode",
              dict(B=64, kv_len=8192, hq=64, hkv=8, q_len=4, sinks=True, spec=True)))
    # policy sweeps (diagnostics: split count, 32-row vs 2x16-row CTAs for fp8, HND locality)
    d5 = dict(B=64, kv_len=4096, hq=32, hkv=8, kv_dtype=e4m3)
    x1f = dict(B=64, kv_len=8192, hq=64, hkv=8, kv_dtype=e4m3, sinks=True)
    for s_ in (1, 2, 4, 6):
        W.append((f"sweep-D5-s{s_}", f"D5 with {s_} splits", "batch_decode", dict(d5, splits=s_)))
    for s_ in (1, 2, 4):
        W.append((f"sweep-X1q1e4m3-s{s_}", f"X1 q1 e4m3 with {s_} splits", "xqa_decode", dict(x1f, q_len=1, splits=s_)))
    W.append(("sweep-X1q4e4m3-s2", "X1 q4 e4m3, 32-row CTAs, 2 splits", "xqa_decode", dict(x1f, q_len=4, splits=2)))
    W.append(("sweep-X1q4e4m3-2x16", "X1 q4 e4m3, two 16-row CTAs", "xqa_decode", dict(x1f, q_len=4, mt2_for_fp8=False)))
    W.append(("sweep-X1q4e4m3-2x16-s1", "X1 q4 e4m3, two 16-row CTAs, 1 split", "xqa_decode",
              dict(x1f, q_len=4, mt2_for_fp8=False, splits=1)))
    W.append(("sweep-X1q2e4m3-s1", "X1 q2 e4m3 (16 rows), 1 split", "xqa_decode", dict(x1f, q_len=2, splits=1)))
    W.append(("sweep-D5-HND", "D5 with an HND cache", "batch_decode", dict(d5, layout="HND")))
    W.append(("sweep-D1-HND", "D1 with an HND cache", "batch_decode", dict(B=64, kv_len=4096, hq=32, hkv=8, layout="HND")))
    for s_ in (16, 64):
        W.append((f"sweep-D2B1-s{s_}", f"D2 B1 with {s_} splits", "batch_decode",
                  dict(B=1, kv_len=32768, hq=32, hkv=8, splits=s_)))
    results = []
    for wid, desc, op, kw in W:
        try:
            r = bench_one(be, wid, desc, op, read, **kw)
        except Exception as e:  # keep going: report what failed
            print(f"{wid}: FAILED {type(e).__name__}: {e}", flush=True)
            r = {"id": wid, "desc": desc, "error": f"{type(e).__name__}: {e}"}
        if r:
            results.append(r)
    ovh, planus = run_overhead(be)
    print(f"run() host overhead {ovh:.1f} us/call; plan() {planus:.0f} us", flush=True)
    doc = {"device": name, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "ceilings": {"read_only_sum_TBps": round(read, 3), "device_copy_TBps": round(copy, 3)},
           "run_overhead_us": round(ovh, 1), "plan_us": round(planus, 1), "workloads": results}
    print("\n| workload | time ms | TB/s | % read ceiling | splits |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['id']} | FAILED | | | |")
        else:
            print(f"| {r['id']} | {r['time_ms']:.4f} | {r['TBps']:.3f} | {100 * r['frac_read_ceiling']:.1f} | "
                  f"{r['splits']} |")
    print(f"ceilings: read {read:.3f} TB/s, copy {copy:.3f} TB/s ({name})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
