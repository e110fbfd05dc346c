"""Time the Triton backend on the standard workloads (shared/docs/performance.md) in one run.

Measures in the same process: the ceilings (read-only bandwidth, device copy, bf16 8192^3 matmul),
torch SDPA for prefill, each workload's first-call time (compile included, fresh Triton cache),
a correctness check of each workload against torch math, and a config sweep for a few workloads.
Writes JSON to $OUT (or ./triton-bench.json) and prints a table last.

    python backends/triton/bench/triton_bench.py [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import triton
from triton.testing import do_bench

from attncore.core.backend import AttnParams, BatchMeta, RunArgs
from attncore.core.problem import AttentionProblem
from attncore.backends.triton.backend import TritonBackend
from attncore.backends.triton import config as tcfg

DEV = torch.device("cuda")
BF16 = torch.bfloat16
CC = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
RESULTS = {"workloads": {}, "ceilings": {}, "sdpa": {}, "sweep": {}, "compile_s": {}, "errors": {}}


def _sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def bench(fn, warmup=25, rep=100):
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")  # ms


def ceilings():
    n = 1 << 30  # 2 GiB of bf16
    x = torch.randn(n, device=DEV, dtype=BF16)
    y = torch.empty_like(x)
    t_copy = bench(lambda: y.copy_(x))
    t_read = bench(lambda: x.sum(dtype=torch.float32))
    del y
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    t_mm = bench(lambda: a @ b)
    del x, a, b
    torch.cuda.empty_cache()
    c = dict(copy_TBps=4 * n / t_copy / 1e9, read_TBps=2 * n / t_read / 1e9,
             matmul_TFLOPs=2 * 8192 ** 3 / t_mm / 1e9)
    RESULTS["ceilings"] = c
    return c


# ------------------------------------------------------------------ problem builders
def paged_setup(op, B, qo, kv, hq, hkv, d, page, *, kv_dtype=BF16, causal=False, sinks=False,
                spec=False, layout="NHD", sm_scale=None):
    npg = (kv + page - 1) // page
    total = B * npg
    cache = torch.randn(total, 2, page, hkv, d, device=DEV, dtype=BF16)
    if kv_dtype != BF16:
        cache = cache.to(kv_dtype)
    k, v = cache[:, 0], cache[:, 1]
    indices = torch.randperm(total, device=DEV).int()
    indptr = torch.arange(B + 1, device=DEV, dtype=torch.int32) * npg
    last = torch.full((B,), kv - (npg - 1) * page, device=DEV, dtype=torch.int32)
    kv_lens = torch.full((B,), kv, device=DEV, dtype=torch.int32)
    q = torch.randn(B * qo, hq, d, device=DEV, dtype=BF16)
    qo_indptr_h = [i * qo for i in range(B + 1)]
    params = AttnParams(sm_scale=sm_scale or 1 / math.sqrt(d), causal=causal)
    decode = op in ("batch_decode", "xqa_decode")
    kw = {}
    if op == "xqa_decode":
        kw = dict(block_tables=indices.view(B, npg), seq_lens=kv_lens, max_seq_len=kv)
    else:
        kw = dict(kv_indptr=indptr, kv_indptr_host=indptr.tolist(), kv_indices=indices,
                  kv_last_page_len=last, kv_lens=kv_lens, kv_lens_host=[kv] * B)
    meta = BatchMeta(batch_size=B, qo_indptr=torch.tensor(qo_indptr_h, device=DEV, dtype=torch.int32),
                     qo_indptr_host=qo_indptr_h, page_size=page, params=params,
                     q_len_per_req=qo if decode else 1, device=DEV, **kw)
    problem = AttentionProblem(op=op, device_type="cuda", compute_capability=CC,
                               q_dtype=BF16, kv_dtype=kv_dtype, out_dtype=BF16, num_qo_heads=hq,
                               num_kv_heads=hkv, head_dim_qk=d, head_dim_vo=d, page_size=page,
                               kv_layout=layout, mask="causal" if causal else "none", sinks=sinks,
                               q_len_per_req=qo if decode else 1, spec_mask=spec,
                               fp8_scales=kv_dtype != BF16, return_lse=False)
    args = RunArgs(q=q, k=k, v=v, out=torch.empty_like(q),
                   sinks=torch.randn(hq, device=DEV) if sinks else None,
                   k_scale=0.5 if kv_dtype != BF16 else 1.0, v_scale=0.5 if kv_dtype != BF16 else 1.0)
    if spec:
        w16 = (qo + 31) // 32 * 2
        bits = torch.tril(torch.ones(qo, qo, dtype=torch.int64))
        words = (bits * (2 ** torch.arange(qo))[None, :]).sum(1).to(torch.int32)  # qo <= 16 here
        m = torch.zeros(B, qo, w16, dtype=torch.int32)
        m[:, :, 0] = words[None, :] & 0xFFFF
        args.spec_mask = m.to(torch.int16).view(torch.uint16).to(DEV)
    ref = dict(k=k, v=v, indices=indices, npg=npg, page=page, kv=kv, qo=qo, kv_dtype=kv_dtype)
    return problem, meta, args, ref


def ragged_setup(qo, kv, hq, hkv, d, causal):
    q = torch.randn(qo, hq, d, device=DEV, dtype=BF16)
    k = torch.randn(kv, hkv, d, device=DEV, dtype=BF16)
    v = torch.randn(kv, hkv, d, device=DEV, dtype=BF16)
    i32 = dict(device=DEV, dtype=torch.int32)
    meta = BatchMeta(batch_size=1, qo_indptr=torch.tensor([0, qo], **i32), qo_indptr_host=[0, qo],
                     kv_indptr=torch.tensor([0, kv], **i32), kv_indptr_host=[0, kv],
                     kv_lens=torch.tensor([kv], **i32), kv_lens_host=[kv],
                     params=AttnParams(sm_scale=1 / math.sqrt(d), causal=causal), device=DEV)
    problem = AttentionProblem(op="single_prefill", device_type="cuda",
                               compute_capability=CC, q_dtype=BF16,
                               kv_dtype=BF16, out_dtype=BF16, num_qo_heads=hq, num_kv_heads=hkv,
                               head_dim_qk=d, head_dim_vo=d, mask="causal" if causal else "none")
    args = RunArgs(q=q, k=k, v=v, out=torch.empty_like(q))
    return problem, meta, args


def prefill_flops(qo, kv, hq, d, causal, B=1):
    pairs = qo * kv - (qo * (qo - 1) // 2 if causal else 0)
    return 4 * pairs * hq * d * B


def check_paged(args, ref, causal_in_draft, req_ids=(0, -1)):
    """Max rel error of a few requests against fp32 torch math on gathered K/V (no sinks/spec)."""
    q, out = args.q, args.out
    B = q.shape[0] // ref["qo"]
    errs = []
    for b in req_ids:
        b = b % B
        pages = ref["indices"][b * ref["npg"]:(b + 1) * ref["npg"]].long()
        k = ref["k"][pages].reshape(-1, *ref["k"].shape[2:])[: ref["kv"]].float() * args.k_scale
        v = ref["v"][pages].reshape(-1, *ref["v"].shape[2:])[: ref["kv"]].float() * args.v_scale
        qb = q[b * ref["qo"]:(b + 1) * ref["qo"]].float()
        g = qb.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qb, k) / math.sqrt(qb.shape[-1])
        qo, kv = qb.shape[0], k.shape[0]
        if causal_in_draft:
            keep = torch.ones(qo, kv, dtype=torch.bool, device=DEV).tril(kv - qo)
            s = s.masked_fill(~keep, float("-inf"))
        if args.sinks is not None:
            s = torch.cat([s, args.sinks[:, None, None].expand(-1, qo, 1)], -1)
        p = torch.softmax(s, -1)[..., :kv]
        o = torch.einsum("hqk,khd->qhd", p, v)
        ob = out[b * ref["qo"]:(b + 1) * ref["qo"]].float()
        errs.append(((ob - o).norm() / o.norm()).item())
    return max(errs)


def time_backend(name, problem, meta, args, be=None, flops=None, nbytes=None, check=None):
    try:
        return _time_backend(name, problem, meta, args, be, flops, nbytes, check)
    except Exception as e:  # keep going: one broken workload must not hide the others
        import traceback
        traceback.print_exc()
        RESULTS["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        return None


def _time_backend(name, problem, meta, args, be, flops, nbytes, check):
    be = be or TritonBackend()
    rs = [r for r in be.reasons(problem) if not (DEV.type == "cpu" and r.axis == "device")]
    if rs:
        RESULTS["errors"][name] = "refused: " + "; ".join(map(str, rs))
        return None
    t0 = time.perf_counter()
    plan = be.plan(problem, meta)
    t_plan = time.perf_counter() - t0
    _sync()
    t0 = time.perf_counter()
    be.run(plan, args)
    _sync()
    t_first = time.perf_counter() - t0
    err = check() if check else None
    ms = bench(lambda: be.run(plan, args))
    r = dict(ms=ms, plan_ms=t_plan * 1e3, first_call_s=t_first, stats=plan.stats, rel_err=err)
    if nbytes and DEV.type == "cuda":  # decode: also replayed from a CUDA graph (no launch gaps)
        try:
            r["graph_ms"] = triton.testing.do_bench_cudagraph(lambda: be.run(plan, args), rep=100,
                                                              return_mode="median")
        except Exception as e:
            r["graph_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    if flops:
        r["TFLOPs"] = flops / ms / 1e9
    if nbytes:
        r["TBps"] = nbytes / ms / 1e9
    RESULTS["workloads"][name] = r
    print(f"{name:28s} {ms:8.3f} ms  " + (f"{r['TFLOPs']:6.0f} TFLOP/s " if flops else "") +
          (f"{r['TBps']:5.2f} TB/s " if nbytes else "") + f"first {t_first:5.2f}s err {err}"
          f" cfg {plan.stats.get('dense') or plan.stats['config']} splits {plan.stats['max_splits']}"
          + (f" dense_failed {plan.stats['dense_failed']}" if plan.stats.get("dense_failed") else ""), flush=True)
    return r


def decode_bytes(B, kv, hkv, d, elt, hq, qo=1):
    return B * kv * hkv * d * elt * 2 + 2 * B * qo * hq * d * 2


def sdpa(name, qo, kv, hq, hkv, d, causal, flops):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    q = torch.randn(1, hq, qo, d, device=DEV, dtype=BF16)
    k = torch.randn(1, hkv, kv, d, device=DEV, dtype=BF16)
    v = torch.randn(1, hkv, kv, d, device=DEV, dtype=BF16)
    res = {}
    for bname, bk in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel([bk]):
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)  # noqa
                fn()
                ms = bench(fn)
            res[bname] = dict(ms=ms, TFLOPs=flops / ms / 1e9)
        except Exception as e:
            res[bname] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
    RESULTS["sdpa"][name] = res
    print(f"  sdpa {name}: " + ", ".join(f"{k} {v.get('ms', float('nan')):.3f} ms {v.get('TFLOPs', 0):.0f} TFLOP/s"
                                          for k, v in res.items()), flush=True)
    return res


def sweep(name, problem, meta, args, rows, check=None, flops=None):
    """Time every candidate config of the problem; each is checked first (output poisoned)."""
    cands = [dict(config=c.as_dict()) for c in
             tcfg.candidates(problem, rows, interpret=False, cc=torch.cuda.get_device_capability())]
    if problem.page_size is None:  # the Hopper dense kernel's configs too
        cands = [dict(dense=c.as_dict()) for c in tcfg.dense_candidates(
            problem, problem.mask == "causal", sweep=True)] + cands
    elif rows > 64:  # paged prefill: tile shapes and depths beyond the shipped candidates
        seen = [c["config"] for c in cands]
        cands += [dict(config=c.as_dict()) for c in (
            tcfg.LaunchConfig(bm, bn, w, st, True) for bm, bn, w, sts in (
                (128, 64, 8, (2,)), (128, 128, 8, (2, 3)), (64, 64, 4, (3, 4)), (128, 32, 8, (4, 5)),
                (64, 128, 4, (2, 3))) for st in sts) if c.as_dict() not in seen]
    out = []
    for kw in cands:  # {"config": generic-kernel config} or {"dense": dense-kernel config}
        be = TritonBackend(**kw)
        try:
            plan = be.plan(problem, meta)
            args.out.fill_(float("nan"))
            be.run(plan, args)
            err = check() if check else None
            ms = bench(lambda: be.run(plan, args), warmup=10, rep=50)
            out.append(dict(config=kw, ms=ms, rel_err=err, stats=plan.stats,
                            TFLOPs=flops / ms / 1e9 if flops else None))
            if plan.stats.get("dense_failed"):
                print(f"    {name} dense failed: {plan.stats['dense_failed']}", flush=True)
            print(f"    {name} {kw} {ms:.3f} ms" + (f" {flops / ms / 1e9:.0f} TFLOP/s" if flops else "")
                  + f" err {err}", flush=True)
        except Exception as e:
            out.append(dict(config=kw, error=f"{type(e).__name__}: {str(e)[:160]}"))
    RESULTS["sweep"][name] = out
    ok = [o for o in out if "ms" in o]
    if ok:
        best = min(ok, key=lambda o: o["ms"])
        print(f"  sweep {name}: best {best['config']} {best['ms']:.3f} ms (default {out[0].get('ms')})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    RESULTS["device"] = dict(name=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                             triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(RESULTS["device"], flush=True)
    c = ceilings()
    print("ceilings", c, flush=True)
    only = set(a.only.split(",")) if a.only else None

    def want(n):
        return only is None or n in only

    # ---------------- decode
    for name, B, kv, hq, hkv, kvd in (("D1", 64, 4096, 32, 8, BF16), ("D2_B16", 16, 16384, 32, 8, BF16),
                                      ("D2_B1", 1, 32768, 32, 8, BF16), ("D3", 128, 2048, 32, 32, BF16),
                                      ("D5_fp8", 64, 4096, 32, 8, torch.float8_e4m3fn)):
        if not want(name.split("_")[0]):
            continue
        pr, me, ar, ref = paged_setup("batch_decode", B, 1, kv, hq, hkv, 128, 16, kv_dtype=kvd)
        time_backend(name, pr, me, ar, nbytes=decode_bytes(B, kv, hkv, 128, kvd.itemsize, hq),
                     check=lambda: check_paged(ar, ref, False))
        if a.sweep and name in ("D5_fp8",):
            sweep(name, pr, me, ar, hq // hkv)
        if a.sweep and name in ("D5_fp8", "D1"):  # does a KV split (more, shorter programs) help?
            for chunk in (2048, 1024):
                be = TritonBackend(kv_chunk=chunk)
                plan = be.plan(pr, me)
                be.run(plan, ar)
                RESULTS["sweep"][f"{name}_kvchunk{chunk}"] = [dict(config=plan.stats, ms=bench(lambda: be.run(plan, ar)))]
                print(f"  {name} kv_chunk {chunk}: {RESULTS['sweep'][name + '_kvchunk' + str(chunk)][0]['ms']:.3f} ms", flush=True)
        del pr, me, ar, ref
        torch.cuda.empty_cache()
    if want("X1"):
        for kvd in (BF16, torch.float8_e4m3fn):
            for ql in (1, 2, 4):
                name = f"X1_q{ql}_{'fp8' if kvd != BF16 else 'bf16'}"
                pr, me, ar, ref = paged_setup("xqa_decode", 64, ql, 8192, 64, 8, 128, 16, kv_dtype=kvd,
                                              sinks=True, spec=ql > 1)
                time_backend(name, pr, me, ar, nbytes=decode_bytes(64, 8192, 8, 128, kvd.itemsize, 64, ql),
                             check=lambda: check_paged(ar, ref, True))
                del pr, me, ar, ref
                torch.cuda.empty_cache()
    # ---------------- prefill
    for name, qo, kv, hq, hkv, d, causal in (("P1_causal", 4096, 4096, 32, 8, 128, True),
                                             ("P1_noncausal", 4096, 4096, 32, 8, 128, False),
                                             ("P2_d64_causal", 4096, 4096, 32, 8, 64, True),
                                             ("P2_d256_causal", 4096, 4096, 16, 16, 256, True)):
        if not want(name.split("_")[0]):
            continue
        pr, me, ar = ragged_setup(qo, kv, hq, hkv, d, causal)
        fl = prefill_flops(qo, kv, hq, d, causal)

        def chk(ar=ar, causal=causal, hq=hq, hkv=hkv):
            import torch.nn.functional as F
            q = ar.q.transpose(0, 1)[None].float()
            k = ar.k.transpose(0, 1)[None].float().repeat_interleave(hq // hkv, 1)
            vv = ar.v.transpose(0, 1)[None].float().repeat_interleave(hq // hkv, 1)
            o = F.scaled_dot_product_attention(q[:, :, -512:], k, vv, attn_mask=torch.ones(
                512, k.shape[2], dtype=torch.bool, device=DEV).tril(k.shape[2] - 512) if causal else None)
            ob = ar.out[-512:].transpose(0, 1)[None].float()
            return ((ob - o).norm() / o.norm()).item()
        time_backend(name, pr, me, ar, flops=fl, check=chk)
        sdpa(name, qo, kv, hq, hkv, d, causal, fl)
        if a.sweep:
            sweep(name, pr, me, ar, qo * hq // hkv, check=chk, flops=fl)
        del pr, me, ar
        torch.cuda.empty_cache()
    for name, B, qo, kv, page in (("P3_p16", 8, 2048, 2048, 16), ("P3_p1", 8, 2048, 2048, 1),
                                  ("P4", 16, 512, 4096, 16)):
        if not want(name.split("_")[0]):
            continue
        pr, me, ar, ref = paged_setup("batch_prefill_paged", B, qo, kv, 32, 8, 128, page, causal=True)
        fl = prefill_flops(qo, kv, 32, 128, True, B)
        chk = lambda: check_paged(ar, ref, True)  # noqa: E731
        time_backend(name, pr, me, ar, flops=fl, check=chk)
        if a.sweep:
            sweep(name, pr, me, ar, qo * 4, check=chk, flops=fl)
        del pr, me, ar, ref
        torch.cuda.empty_cache()

    if want("P3"):  # diagnostic: the P3 shape with ragged KV (paged-gather cost = P3_p16 / this)
        B, qo = 8, 2048
        q = torch.randn(B * qo, 32, 128, device=DEV, dtype=BF16)
        k = torch.randn(B * qo, 8, 128, device=DEV, dtype=BF16)
        v = torch.randn_like(k)
        ind = torch.arange(B + 1, device=DEV, dtype=torch.int32) * qo
        me = BatchMeta(batch_size=B, qo_indptr=ind, qo_indptr_host=ind.tolist(), kv_indptr=ind,
                       kv_indptr_host=ind.tolist(), kv_lens=torch.full((B,), qo, device=DEV, dtype=torch.int32),
                       kv_lens_host=[qo] * B, params=AttnParams(sm_scale=1 / math.sqrt(128), causal=True), device=DEV)
        pr = AttentionProblem(op="batch_prefill_ragged", device_type="cuda", compute_capability=CC, q_dtype=BF16,
                              kv_dtype=BF16, out_dtype=BF16, num_qo_heads=32, num_kv_heads=8, mask="causal")
        ar = RunArgs(q=q, k=k, v=v, out=torch.empty_like(q))
        time_backend("P3_ragged", pr, me, ar, flops=prefill_flops(qo, qo, 32, 128, True, B))
        if a.sweep:
            sweep("P3_ragged", pr, me, ar, qo * 4, flops=prefill_flops(qo, qo, 32, 128, True, B))
        del q, k, v
        torch.cuda.empty_cache()

    # ---------------- run() host overhead on a tiny decode
    pr, me, ar, ref = paged_setup("batch_decode", 1, 1, 16, 32, 8, 128, 16)
    be = TritonBackend()
    plan = be.plan(pr, me)
    be.run(plan, ar)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        be.run(plan, ar)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    RESULTS["run_overhead_us"] = (t1 - t0) / 200 * 1e6
    print(f"run() host time per call (tiny decode): {RESULTS['run_overhead_us']:.1f} us", flush=True)
    # the bare Triton launch of the same kernel (what run() adds on top of Triton's own launcher)
    from attncore.backends.triton.kernels import attention as K
    grid = (plan.num_items * pr.num_kv_heads,)
    kargs = dict(G=4, HEAD_DIM=128, BLOCK_D=128, HALF=64, BLOCK_HALF=64, BLOCK_M=16, BLOCK_N=64, PAGE=16,
                 MASK_MODE=0, HAS_WINDOW=False, SOFT_CAP=False, ALIBI=False, ROPE=False, HAS_SINKS=False,
                 STORE_LSE=False, DOT_PREC="tf32", PREFETCH=False, DOT_F16=False, KV_ADDR=0,
                 PERSISTENT=False, HEAD_DIM_VO=128, BLOCK_DV=128)
    pos = (ar.q, ar.k, ar.v, ar.out, plan.kv_lens, plan.kv_lens, plan.kv_lens, plan.work, plan.counts, plan.qo_indptr,
           plan.kv_indptr, plan.kv_indices, plan.kv_lens, plan.kv_lens, plan.kv_lens, plan.kv_lens, plan.kv_lens,
           ar.q.stride(0), ar.q.stride(1), ar.k.stride(0), ar.k.stride(1), ar.k.stride(2), ar.v.stride(0),
           ar.v.stride(1), ar.v.stride(2), ar.out.stride(0), ar.out.stride(1), 0, 0, 0, 0, 0, 0,
           0.1, 0.0, 0.0, 1.0, -1, 13.3, 1.0, 0, 0, pr.num_kv_heads, plan.num_items, 0)  # ..., heads_first
    K._attn_fwd[grid](*pos, **kargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        K._attn_fwd[grid](*pos, **kargs)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    RESULTS["bare_triton_launch_us"] = (t1 - t0) / 200 * 1e6
    print(f"bare Triton launch of the same kernel: {RESULTS['bare_triton_launch_us']:.1f} us", flush=True)

    # ---------------- summary
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "triton-bench.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    print("\n=== summary", RESULTS["device"]["name"], RESULTS["device"]["date"])
    print(f"ceilings: read {c['read_TBps']:.2f} TB/s, copy {c['copy_TBps']:.2f} TB/s, "
          f"bf16 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s")
    for n, r in RESULTS["workloads"].items():
        extra = ""
        if "TBps" in r:
            extra = f"{r['TBps']:.2f} TB/s = {100 * r['TBps'] / c['read_TBps']:.0f}% read"
        if "TFLOPs" in r:
            extra = f"{r['TFLOPs']:.0f} TFLOP/s = {100 * r['TFLOPs'] / c['matmul_TFLOPs']:.0f}% mm"
            s = RESULTS["sdpa"].get(n)
            if s:
                best = min((v["ms"] for v in s.values() if "ms" in v), default=None)
                if best:
                    extra += f", {best / r['ms']:.2f}x SDPA best"
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
        g = f" graph {r['graph_ms']:.3f} ms" if r.get("graph_ms") else ""
        print(f"{n:18s} {r['ms']:8.3f} ms  {extra:45s} first {r['first_call_s']:.1f}s err {err}{g}")
    for n, e in RESULTS["errors"].items():
        print("ERROR", n, e)


if __name__ == "__main__":
    main()
