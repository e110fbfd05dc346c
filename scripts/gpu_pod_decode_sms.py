"""Issue 16 probe: a POD workload's decode part alone on the SMs an SM split leaves it (CUDA green contexts,
attncore.core.green), for xqa kernel variants (specs.XqaKey.tune): which keeps the read bandwidth on fewer SMs.
Session 28 (H200, BENCHMARKS.md 2x): PD1's decode on 92 SMs 0.301 ms as shipped, 0.276 with two stages (three
CTAs per SM).

    python3 scripts/gpu_pod_decode_sms.py [--workload PD1] [--prefill-sms 0,40,56,64,72] [--variants base,st2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_pod_coresident import WORKLOADS, Inputs  # noqa: E402
from gpu_pod_smsplit import on  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "backends", "xqa", "bench"))
from xqa_tune import backend_with  # noqa: E402

# name -> kernel options and backend knobs, as xqa_tune.py's variants (its backend_with reads them): ("sw16", 1) the
# swapped-product kernel for 16-bit KV (XqaBackend.swap_for_16bit), ("sw16", 0) the main kernel.
M, SW = ("sw16", 0), ("sw16", 1)
VARIANTS = {"base": (M,), "st2": (M, ("st", 2)), "st4": (M, ("st", 4)), "kpw16": (M, ("kpw", 16)),
            "kpw16st6": (M, ("kpw", 16), ("st", 6)), "sw": (SW,), "swst2": (SW, ("st", 2)),
            "swst2l2256": (SW, ("st", 2), ("l2", 256)), "swst2l20": (SW, ("st", 2), ("l2", 0))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="PD1", choices=sorted(WORKLOADS))
    ap.add_argument("--prefill-sms", default="0,40,56,64,72", help="SMs held for the prefill (0: none, no split)")
    ap.add_argument("--variants", default="base,st2,st4")
    a = ap.parse_args()
    from attncore.core import green

    dev = torch.device("cuda")
    w = WORKLOADS[a.workload]
    inp = Inputs(w, "cuda", torch.bfloat16)
    runs = {}
    for name in a.variants.split(","):
        runs[name] = inp.part("decode", backend_with(VARIANTS[name]))[0]
    p = inp.dec._planned.problem
    nbytes = sum(inp.dec._planned.meta.kv_lens_host) * p.num_kv_heads * (p.head_dim_qk + p.head_dim_vo) * 2
    print(f"{a.workload} decode alone, ms (GB/s per decode SM); {nbytes / 1e9:.3f} GB of K/V")
    print(f"{'prefill SMs -> decode SMs':>26s} " + " ".join(f"{n:>16s}" for n in runs))
    for s in (int(x) for x in a.prefill_sms.split(",")):
        sd, nd = ((torch.cuda.current_stream(), green.sm_count(dev)) if s == 0 else green.split(dev, s)[1])
        cells = []
        for r in runs.values():
            ms = triton.testing.do_bench(lambda r=r: on(sd, r), warmup=20, rep=200)
            cells.append(f"{ms:.4f} ({nbytes / (ms * 1e-3) / 1e9 / nd:4.1f})")
        print(f"{s:>10d} -> {nd:>3d} SMs        " + " ".join(f"{c:>16s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
