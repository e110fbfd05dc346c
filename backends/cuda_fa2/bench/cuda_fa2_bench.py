"""Times cuda_fa2 on the standard workloads (shared/docs/performance.md) with ceilings and torch SDPA
measured in the same run.  Usage: python backends/cuda_fa2/bench/cuda_fa2_bench.py OUT.json [--quick]

All times are triton.testing.do_bench medians (ms).  Prefill: TFLOP/s with FLOPs =
4 * visible (q, k) pairs * Hq * D.  Decode: TB/s on the K+V (+q, out) bytes read/written.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
from triton.testing import do_bench

from attncore.core.backend import AttnParams, BatchMeta, RunArgs
from attncore.backends.cuda_fa2.backend import CudaFa2Backend
from attncore.core.problem import AttentionProblem

DEV = torch.device("cuda", 0)
BF16 = torch.bfloat16


SEQ_PAGES = False


def bench(fn, rep=200):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def ceilings():
    res = {}
    x = torch.randn(2 * 1024 ** 3 // 4, device=DEV)  # 2 GiB fp32
    t = bench(lambda: x.sum())
    res["read_TBps"] = x.numel() * 4 / t / 1e9
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    res["copy_TBps"] = 2 * x.numel() * 4 / t / 1e9
    del x, y
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    t = bench(lambda: a @ b)
    res["matmul_bf16_TFLOPs"] = 2 * 8192 ** 3 / t / 1e9
    return res


def causal_pairs(qo, kv):
    # bottom-right causal: row i sees min(kv, i + kv - qo + 1) keys
    return sum(max(0, min(kv, i + kv - qo + 1)) for i in range(qo))


def make(op, lens, hq, hkv, d, causal, paged, page_size=16, dtype=BF16, kv_dtype=None, tune=(), force_config=None):
    kv_dtype = kv_dtype or dtype
    B = len(lens)
    qo_lens = [a for a, _ in lens]
    kv_lens = [b for _, b in lens]
    qo_indptr = [0]
    for n in qo_lens:
        qo_indptr.append(qo_indptr[-1] + n)
    q = torch.randn(qo_indptr[-1], hq, d, device=DEV, dtype=dtype)
    i32 = dict(dtype=torch.int32, device=DEV)
    if paged:
        npages = [-(-n // page_size) for n in kv_lens]
        total = sum(npages)
        cache = torch.randn(total, 2, page_size, hkv, d, device=DEV, dtype=torch.float32 if kv_dtype.itemsize == 1 else dtype)
        cache = cache.to(kv_dtype)
        k, v = cache[:, 0], cache[:, 1]
        # SEQ_PAGES (diagnostic): pages in order instead of a random permutation
        perm = (torch.arange(total, device=DEV) if SEQ_PAGES else torch.randperm(total, device=DEV)).to(torch.int32)
        kv_indptr = [0]
        for n in npages:
            kv_indptr.append(kv_indptr[-1] + n)
        last = [n - (p - 1) * page_size for n, p in zip(kv_lens, npages)]
        kv_indices, kv_last = perm, torch.tensor(last, **i32)
    else:
        kv_indptr = [0]
        for n in kv_lens:
            kv_indptr.append(kv_indptr[-1] + n)
        k = torch.randn(kv_indptr[-1], hkv, d, device=DEV, dtype=dtype).to(kv_dtype)
        v = torch.randn(kv_indptr[-1], hkv, d, device=DEV, dtype=dtype).to(kv_dtype)
        kv_indices = kv_last = None
    problem = AttentionProblem(op=op, device_type="cuda", compute_capability=torch.cuda.get_device_capability(DEV),
                               q_dtype=dtype, kv_dtype=kv_dtype, out_dtype=dtype, num_qo_heads=hq, num_kv_heads=hkv,
                               head_dim_qk=d, head_dim_vo=d, page_size=page_size if paged else None,
                               mask="causal" if causal else "none")
    meta = BatchMeta(batch_size=B, qo_indptr=torch.tensor(qo_indptr, **i32), qo_indptr_host=qo_indptr,
                     kv_indptr=torch.tensor(kv_indptr, **i32), kv_indptr_host=kv_indptr, kv_indices=kv_indices,
                     kv_last_page_len=kv_last, kv_lens=torch.tensor(kv_lens, **i32), kv_lens_host=kv_lens,
                     page_size=page_size if paged else None,
                     params=AttnParams(sm_scale=1 / math.sqrt(d), causal=causal), device=DEV)
    be = CudaFa2Backend()
    be.tune = tune
    be.force_config = force_config
    t0 = time.perf_counter()
    plan = be.plan(problem, meta)
    plan_ms = (time.perf_counter() - t0) * 1e3
    out = torch.empty_like(q)
    args = RunArgs(q=q, k=k, v=v, out=out)
    return be, plan, args, plan_ms


def run_overhead_us(be, plan, args, n=200):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        be.run(plan, args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def prefill_case(name, lens, hq, hkv, d, causal, paged, page_size=16, sdpa=False):
    be, plan, args, plan_ms = make("single_prefill" if len(lens) == 1 and not paged else
                                   ("batch_prefill_paged" if paged else "batch_prefill_ragged"),
                                   lens, hq, hkv, d, causal, paged, page_size)
    t = bench(lambda: be.run(plan, args))
    pairs = sum(causal_pairs(a, b) if causal else a * b for a, b in lens)
    flops = 4 * pairs * hq * d
    r = {"name": name, "ms": t, "TFLOPs": flops / t / 1e9, "plan_ms": plan_ms, "config": plan.config,
         "work_items": plan.num_items, "split": plan.needs_merge}
    if sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        (qo, kv), = lens
        q = args.q.view(qo, hq, d).transpose(0, 1)[None]
        # K/V repeated to Hq heads once (same FLOPs; every SDPA backend takes MHA)
        k = args.k.view(kv, hkv, d).repeat_interleave(hq // hkv, 1).transpose(0, 1)[None]
        v = args.v.view(kv, hkv, d).repeat_interleave(hq // hkv, 1).transpose(0, 1)[None]
        for bname, bk in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(bk):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    f()
                    ts = bench(f)
                r[f"sdpa_{bname}_ms"] = ts
                r[f"sdpa_{bname}_TFLOPs"] = flops / ts / 1e9
            except Exception as e:  # backend unavailable for this shape
                r[f"sdpa_{bname}_error"] = str(e)[:200]
    return r


def decode_case(name, B, kv, hq, hkv, d=128, page_size=16, kv_dtype=None):
    be, plan, args, plan_ms = make("batch_decode", [(1, kv)] * B, hq, hkv, d, False, True, page_size, kv_dtype=kv_dtype)
    t = bench(lambda: be.run(plan, args))
    kvb = args.k.element_size()
    nbytes = B * kv * hkv * d * kvb * 2 + 2 * B * hq * d * 2
    return {"name": name, "ms": t, "TBps": nbytes / t / 1e9, "plan_ms": plan_ms, "config": plan.config,
            "work_items": plan.num_items, "split": plan.needs_merge,
            "run_overhead_us": run_overhead_us(be, plan, args)}


def main():
    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    res = {"device": torch.cuda.get_device_name(DEV), "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "ceilings": ceilings(), "prefill": [], "decode": []}
    print("ceilings", res["ceilings"], flush=True)
    P = res["prefill"]
    P.append(prefill_case("P1 causal", [(4096, 4096)], 32, 8, 128, True, False, sdpa=True))
    P.append(prefill_case("P1 non-causal", [(4096, 4096)], 32, 8, 128, False, False, sdpa=True))
    P.append(prefill_case("P2 d64 causal", [(4096, 4096)], 32, 8, 64, True, False, sdpa=True))
    P.append(prefill_case("P2 d256 causal 16/16", [(4096, 4096)], 16, 16, 256, True, False, sdpa=True))
    P.append(prefill_case("P3 page16", [(2048, 2048)] * 8, 32, 8, 128, True, True, 16))
    if not quick:
        P.append(prefill_case("P3 page1", [(2048, 2048)] * 8, 32, 8, 128, True, True, 1))
    P.append(prefill_case("P4 append", [(512, 4096)] * 16, 32, 8, 128, True, True, 16))
    for r in P:
        print(r, flush=True)
    D = res["decode"]
    D.append(decode_case("D1", 64, 4096, 32, 8))
    D.append(decode_case("D2 B16", 16, 16384, 32, 8))
    D.append(decode_case("D2 B1", 1, 32768, 32, 8))
    if not quick:
        D.append(decode_case("D3 MHA", 128, 2048, 32, 32))
        D.append(decode_case("D1 page1", 64, 4096, 32, 8, page_size=1))
        D.append(decode_case("D5 fp8 e4m3", 64, 4096, 32, 8, kv_dtype=torch.float8_e4m3fn))
    for r in D:
        print(r, flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    c = res["ceilings"]
    print(f"\n== cuda_fa2 on {res['device']} {res['date']}: read {c['read_TBps']:.2f} TB/s, copy {c['copy_TBps']:.2f} TB/s, "
          f"bf16 mm {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    for r in P:
        extra = ""
        if "sdpa_cudnn_ms" in r:
            extra += f" | cudnn {r['sdpa_cudnn_ms']:.3f} ms {r['sdpa_cudnn_TFLOPs']:.0f}"
        if "sdpa_flash_ms" in r:
            extra += f" | flash {r['sdpa_flash_ms']:.3f} ms {r['sdpa_flash_TFLOPs']:.0f}"
        print(f"{r['name']:24s} {r['ms']:.3f} ms {r['TFLOPs']:6.0f} TFLOP/s ({r['TFLOPs'] / c['matmul_bf16_TFLOPs']:.0%} of mm)"
              f" [{r['config']}, {r['work_items']} items{', split' if r['split'] else ''}]{extra}")
    for r in D:
        print(f"{r['name']:24s} {r['ms']:.3f} ms {r['TBps']:.2f} TB/s ({r['TBps'] / c['read_TBps']:.0%} of read)"
              f" [{r['config']}, {r['work_items']} items{', split' if r['split'] else ''}] run() {r['run_overhead_us']:.0f} us")


if __name__ == "__main__":
    main()
