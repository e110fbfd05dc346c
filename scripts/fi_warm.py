"""Compile FlashInfer's kernels for `attncore bench` workloads ahead of the timed run, one process
per workload in parallel (FlashInfer JIT-compiles each specialization on first use, 35-120 s).

    PYTHONPATH=<repo>:$FI_ROOT python3 scripts/fi_warm.py P1 D1 ...   (ids or prefixes, as bench takes)

``latency`` among the ids warms the kernels of ``attncore bench --latency --flashinfer`` (its tiny problems,
one process per column that builds a kernel).
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


LATENCY_CHILD = """
import sys, torch, flashinfer
from attncore.cli.latency import _cells
f = _cells(flashinfer, "cuda", {})[sys.argv[1]]
try:
    [g() for g in f] if isinstance(f, tuple) else f()
    torch.cuda.synchronize()
    print("latency", sys.argv[1], "ok")
except Exception as e:
    print("latency", sys.argv[1], "n/a:", type(e).__name__, str(e)[:120])
"""
LATENCY_COLUMNS = ("single_prefill", "single_decode", "decode run", "prefill run")  # the runs plan first


def main(ids):
    from attncore.cli.bench import select_workloads

    t0 = time.time()
    jobs = [(CHILD, w.id) for w in select_workloads([i for i in ids if i != "latency"])] if ids != ["latency"] else []
    jobs += [(LATENCY_CHILD, c) for c in LATENCY_COLUMNS] if "latency" in ids else []
    procs = [subprocess.Popen([sys.executable, "-c", code, arg], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for code, arg in jobs]
    for p in procs:
        out, _ = p.communicate()
        print(out.strip().splitlines()[-1] if out.strip() else f"exit {p.returncode}", flush=True)
    print(f"warmed {len(procs)} workloads / latency columns in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
