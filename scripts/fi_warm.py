"""Compile FlashInfer's kernels for `attncore bench` workloads ahead of the timed run, one process
per workload in parallel (FlashInfer JIT-compiles each specialization on first use, 35-120 s).

    PYTHONPATH=<repo>:$FI_ROOT python3 scripts/fi_warm.py P1 D1 ...   (ids or prefixes, as bench takes)
"""

import subprocess
import sys
import time

CHILD = """
import sys, torch, flashinfer
from attncore.cli.bench import _setup, select_workloads
w = select_workloads([sys.argv[1]])[0]
try:
    _setup(w, "auto", "cuda", torch.bfloat16, 1, api=flashinfer)
    print(w.id, "ok")
except Exception as e:
    print(w.id, "n/a:", type(e).__name__, str(e)[:120])
"""


def main(ids):
    from attncore.cli.bench import select_workloads

    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, w.id], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for w in select_workloads(ids)]
    for p in procs:
        out, _ = p.communicate()
        print(out.strip().splitlines()[-1] if out.strip() else f"exit {p.returncode}", flush=True)
    print(f"warmed {len(procs)} workloads in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
