"""Diagnostic (H100): run one prefill workload on one backend twice (warm-up, then the launch a
profiler should look at), for ncu:
    ncu --clock-control none -k regex:'fa2_sm90|_attn_fwd|_dense_fwd' --launch-skip 1 --launch-count 1 \
        python3 scripts/profile_prefill.py BACKEND CASE
CASE: P3-p16 | P3-p1 | P4 | P3-ragged (P3's shape over ragged K/V) | P1-causal
"""

import sys

import torch

import attncore as ac
from attncore.cli.bench import WORKLOADS, _setup


def main():
    backend, case = sys.argv[1], sys.argv[2]
    dev, dt = "cuda", torch.bfloat16
    if case == "P3-ragged":
        B, n, hq, hkv, d = 8, 2048, 32, 8, 128
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        q = torch.randn(B * n, hq, d, device=dev, dtype=dt)
        k = torch.randn(B * n, hkv, d, device=dev, dtype=dt)
        v = torch.randn(B * n, hkv, d, device=dev, dtype=dt)
        indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * n
        wr = ac.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
        wr.plan(indptr, indptr, hq, hkv, d, causal=True, q_data_type=dt)
        run = lambda: wr.run(q, k, v)  # noqa: E731
    else:
        w = next(w for w in WORKLOADS if w.id == case)
        runs, _ = _setup(w, backend, dev, dt, 1)
        run = runs[0]
    run()
    torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
