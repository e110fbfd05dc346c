"""One xqa launch of X1 (B 64, kv 8192, 64/8 heads, sinks) between cudaProfilerStart / Stop, for Nsight Compute,
with xqa_tune's kernel options (``name=value``, ``specs.XqaKey.tune``; ``swap`` / ``sw16`` / ``sd`` the backend's
knobs).  scripts/ncu_kernels.py does the same for `attncore bench` workloads; this one takes X1's row counts and
fp8 KV, which bench has no workload for.  BENCHMARKS.md 2au::

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        python3 backends/xqa/bench/xqa_ncu.py 4 e4m3 [dg=2 ...]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from xqa_bench import make  # noqa: E402
from xqa_tune import backend_with  # noqa: E402


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] not in ("e4m3", "bf16"):
        sys.exit("usage: xqa_ncu.py Q_LEN {e4m3|bf16} [option=value ...]")
    q_len, kv = int(sys.argv[1]), sys.argv[2]
    tune = tuple((k, int(v)) for k, v in (a.split("=") for a in sys.argv[3:]))
    be = backend_with(tune)
    kw = dict(B=64, kv_len=8192, hq=64, hkv=8, sinks=True, q_len=q_len)
    if kv == "e4m3":
        kw["kv_dtype"] = torch.float8_e4m3fn
    problem, meta, args, _, _ = make("xqa_decode", **kw)
    plan = be.plan(problem, meta)
    print(plan.lib.key.uri, "splits", plan.num_splits, flush=True)
    for _ in range(3):  # build and warm outside the profiled range
        be.run(plan, args)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    be.run(plan, args)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
