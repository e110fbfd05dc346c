# RoPE in the Triton kernels (H100, session 11: BENCHMARKS.md 2h): first-call (compile) time and time per call, and the max error against
# the reference backend, for one tree (whatever `attncore` imports).  Usage: TRITON_CACHE_DIR=<empty dir> python3 scripts/bench_triton_rope.py TAG (JSON in /tmp/rope_TAG.json)
import sys, time, json, torch
import attncore
from triton.testing import do_bench
tag = sys.argv[1]
torch.manual_seed(0)
dev = "cuda"
res = {}

def timed(name, fn, ref):
    torch.cuda.synchronize(); t = time.perf_counter(); o = fn(); torch.cuda.synchronize()
    first = time.perf_counter() - t
    r = ref()
    err = (o.float() - r.float()).abs().max().item()
    ms = do_bench(fn, warmup=5, rep=50)
    res[name] = dict(first_s=round(first, 2), ms=round(ms, 4), max_err=err)
    print(f"[{tag}] {name}: first call {first:.2f} s, {ms*1e3:.1f} us/call, max err vs reference {err:.2e}", flush=True)

# A: single decode, fp8 KV, d256, 32/4 heads, kv 4096, RoPE
q = torch.randn(32, 256, device=dev, dtype=torch.float16)
k = torch.randn(4096, 4, 256, device=dev).to(torch.float8_e4m3fn)
v = torch.randn(4096, 4, 256, device=dev).to(torch.float8_e4m3fn)
f = lambda b: (lambda: attncore.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA", backend=b))
timed("single_decode fp8 d256 rope", f("triton"), f("reference"))
# B: batch decode wrapper, fp16, d128, 32/8, B16 x kv 4096, page 16, RoPE
B, L, P, H, Hk, D = 16, 4096, 16, 32, 8, 128
pages = B * L // P
cache = torch.randn(pages, 2, P, Hk, D, device=dev, dtype=torch.float16)
indptr = torch.arange(B + 1, dtype=torch.int32) * (L // P)
indices = torch.randperm(pages, dtype=torch.int32)
last = torch.full((B,), P, dtype=torch.int32)
qb = torch.randn(B, H, D, device=dev, dtype=torch.float16)
def wrap(b):
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend=b)
    w.plan(indptr, indices, last, H, Hk, D, P, pos_encoding_mode="ROPE_LLAMA", q_data_type=torch.float16)
    return lambda: w.run(qb, cache)
timed("batch decode fp16 d128 rope B16x4k", wrap("triton"), wrap("reference"))
# C: single prefill causal 1k, fp16, d128, 32/8, RoPE
qp = torch.randn(1024, 32, 128, device=dev, dtype=torch.float16)
kp = torch.randn(1024, 8, 128, device=dev, dtype=torch.float16)
vp = torch.randn(1024, 8, 128, device=dev, dtype=torch.float16)
g = lambda b: (lambda: attncore.single_prefill_with_kv_cache(qp, kp, vp, causal=True, pos_encoding_mode="ROPE_LLAMA", backend=b))
timed("single_prefill fp16 d128 rope causal 1k", g("triton"), g("reference"))
json.dump(res, open(f"/tmp/rope_{tag}.json", "w"))
