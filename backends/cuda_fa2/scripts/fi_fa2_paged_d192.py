"""P5-d192-p16's shape (8 x 2k causal, page 16, 32 / 32 heads, head dims 192 / 128) through FlashInfer 0.2.14's FA2
paged prefill beside attncore's auto, in interleaved rounds, and the two outputs compared.  FlashInfer's default
(SM90) paged path refuses this pair ("operation not supported", the `attncore bench` row) and its FA2 path needs K and V
with identical strides, so V here is a 128-column view of a 192-column cache.

    PYTHONPATH=$FI_ROOT python3 backends/cuda_fa2/scripts/fi_fa2_paged_d192.py   (.anchors/fi_setup.sh sets FI_ROOT)
"""

import torch
from triton.testing import do_bench

import attncore
import flashinfer

B, L, H, P = 8, 2048, 32, 16
pages = L // P
dev = "cuda"
kc = torch.randn(B * pages, P, H, 192, dtype=torch.bfloat16, device=dev)
vc = torch.randn(B * pages, P, H, 192, dtype=torch.bfloat16, device=dev)[..., :128]  # K's strides
idx = torch.randperm(B * pages, device=dev).int()
ind = torch.arange(B + 1, device=dev, dtype=torch.int32) * pages
qo = torch.arange(B + 1, device=dev, dtype=torch.int32) * L
last = torch.full((B,), P, dtype=torch.int32, device=dev)
q = torch.randn(B * L, H, 192, dtype=torch.bfloat16, device=dev)
res, runs = {}, {}
for name, mod, kw in [("flashinfer fa2", flashinfer, dict(backend="fa2")), ("attncore auto", attncore, {})]:
    w = mod.BatchPrefillWithPagedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8, device=dev), "NHD", **kw)
    w.plan(qo, ind, idx, last, H, H, 192, P, head_dim_vo=128, causal=True, q_data_type=torch.bfloat16)
    res[name] = w.run(q, (kc, vc))
    runs[name] = lambda w=w: w.run(q, (kc, vc))
    print(name, "planned", getattr(w, "backend", ""), flush=True)
for r in range(5):
    print("round", r, {n: round(do_bench(f, warmup=25, rep=100), 4) for n, f in runs.items()}, flush=True)
print("max |diff|", (res["flashinfer fa2"].float() - res["attncore auto"].float()).abs().max().item())
