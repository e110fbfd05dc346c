"""Times the cuda_fa2 Hopper prefill kernel (prefill90) on the prefill workloads, next to the FA2
kernel and torch SDPA in the same run, and checks the large P1 outputs against torch SDPA.
Usage (H100): python backends/cuda_fa2/bench/cuda_fa2_sm90_bench.py OUT.json
FLOPs and workloads as in cuda_fa2_bench.py (shared/docs/performance.md); do_bench medians.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_fa2_bench as cb  # noqa: E402
from attncore.backends.cuda_fa2.backend import CudaFa2Backend  # noqa: E402


def check_vs_sdpa(lens, hq, hkv, d, causal):
    be, plan, args, _ = cb.make("single_prefill", lens, hq, hkv, d, causal, False)
    args.out.fill_(float("nan"))
    be.run(plan, args)
    (qo, kv), = lens
    q = args.q.view(qo, hq, d).transpose(0, 1)[None]
    k = args.k.view(kv, hkv, d).repeat_interleave(hq // hkv, 1).transpose(0, 1)[None]
    v = args.v.view(kv, hkv, d).repeat_interleave(hq // hkv, 1).transpose(0, 1)[None]
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    ours = args.out.view(qo, hq, d).transpose(0, 1)[None].float()
    return {"config": plan.config, "max_abs": (ours - ref).abs().max().item(),
            "rel": ((ours - ref).norm() / ref.norm()).item(), "nan": bool(ours.isnan().any().item())}


def main():
    out_path = sys.argv[1]
    dev = cb.DEV
    res = {"device": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "nvcc_flags": os.environ.get("ATTNCORE_NVCC_FLAGS", ""), "checks": {}, "prefill": [], "fa2": []}
    for name, lens, d, causal in (("P1 causal", [(4096, 4096)], 128, True), ("P1 non-causal", [(4096, 4096)], 128, False),
                                  ("P2 d64 causal", [(4096, 4096)], 64, True)):
        res["checks"][name] = r = check_vs_sdpa(lens, 32, 8, d, causal)
        print("check vs SDPA fp32", name, r, flush=True)
    CudaFa2Backend.sm90_ws = False  # the non-specialized kernel on the same outputs
    for name, lens, d, causal in (("P1 causal nows", [(4096, 4096)], 128, True),):
        res["checks"][name] = r = check_vs_sdpa(lens, 32, 8, d, causal)
        print("check vs SDPA fp32", name, r, flush=True)
    CudaFa2Backend.sm90_ws = True
    P = res["prefill"]
    # prefill90 variants, each forced: the warp-specialized plain loop, the non-specialized loops, pipelined + ws
    # (the backend's rule takes pipe_ws for contiguous K/V and ws for paged)
    names = os.environ.get("FA2_SM90_BENCH_VARIANTS", "ws,loop,pipe,pipe_ws").split(",")
    for vi, var in enumerate(names):
        pipe, ws = "pipe" in var, "ws" in var
        CudaFa2Backend.sm90_pipe, CudaFa2Backend.sm90_ws = pipe, ws
        sd = vi == 0
        P.append(cb.prefill_case("P1 causal", [(4096, 4096)], 32, 8, 128, True, False, sdpa=sd))
        P.append(cb.prefill_case("P1 non-causal", [(4096, 4096)], 32, 8, 128, False, False, sdpa=sd))
        P.append(cb.prefill_case("P2 d64 causal", [(4096, 4096)], 32, 8, 64, True, False, sdpa=sd))
        P.append(cb.prefill_case("P3 page16", [(2048, 2048)] * 8, 32, 8, 128, True, True, 16))
        P.append(cb.prefill_case("P3 page1", [(2048, 2048)] * 8, 32, 8, 128, True, True, 1))
        P.append(cb.prefill_case("P3 ragged", [(2048, 2048)] * 8, 32, 8, 128, True, False))  # P3 shape, no pages
        P.append(cb.prefill_case("P4 append", [(512, 4096)] * 16, 32, 8, 128, True, True, 16))
        for r in P[-7:]:
            r["pipe"], r["ws"], r["variant"] = pipe, ws, var
            print(r, flush=True)
        if vi == 0:  # diagnostic: the same paged problems with the pages in order (no random placement)
            cb.SEQ_PAGES = True
            P.append(cb.prefill_case("P3 page16 seq", [(2048, 2048)] * 8, 32, 8, 128, True, True, 16))
            P.append(cb.prefill_case("P3 page1 seq", [(2048, 2048)] * 8, 32, 8, 128, True, True, 1))
            P.append(cb.prefill_case("P4 seq", [(512, 4096)] * 16, 32, 8, 128, True, True, 16))
            cb.SEQ_PAGES = False
            for r in P[-3:]:
                r["pipe"], r["ws"], r["variant"] = pipe, ws, var
                print(r, flush=True)
    CudaFa2Backend.sm90_ws = True
    CudaFa2Backend.sm90_pipe = None  # the rule again
    CudaFa2Backend.sm90 = False  # the FA2 kernel on the same day, same process
    F = res["fa2"]
    F.append(cb.prefill_case("P1 causal", [(4096, 4096)], 32, 8, 128, True, False))
    F.append(cb.prefill_case("P3 page16", [(2048, 2048)] * 8, 32, 8, 128, True, True, 16))
    CudaFa2Backend.sm90 = True
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n== cuda_fa2 prefill90 on {res['device']} {res['date']} (flags '{res['nvcc_flags']}')")
    for name, r in res["checks"].items():
        print(f"check {name:16s} [{r['config']}] max|ours-sdpa_fp32| {r['max_abs']:.3e} rel {r['rel']:.2e} nan {r['nan']}")
    for r in P:
        extra = ""
        for b in ("cudnn", "flash"):
            if f"sdpa_{b}_ms" in r:
                extra += f" | {b} {r[f'sdpa_{b}_ms']:.3f} ms {r[f'sdpa_{b}_TFLOPs']:.0f}"
        print(f"{r['name']:16s} {r['variant']:8s} {r['ms']:.3f} ms {r['TFLOPs']:6.0f} TFLOP/s [{r['config']}, {r['work_items']} items"
              f"{', split' if r['split'] else ''}]{extra}")
    for r in F:
        print(f"FA2 {r['name']:12s} {r['ms']:.3f} ms {r['TFLOPs']:6.0f} TFLOP/s [{r['config']}]")


if __name__ == "__main__":
    main()
