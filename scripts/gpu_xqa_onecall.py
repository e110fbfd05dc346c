"""Where the one-call xqa API's time goes on X1's fp8 shapes (64 x 8k, 64/8, sinks, q_len 1 and 4): do_bench of the
call as `attncore bench` times it, the wall time per call of 200 calls back to back, and a torch.profiler table of
5 calls (the kernel's own time).  GPU only: python3 scripts/gpu_xqa_onecall.py"""
import math, time, torch
import attncore as ac
from triton.testing import do_bench
dev = "cuda"
B, kv, hq, hkv, d, ps = 64, 8192, 64, 8, 128, 16
pages = kv // ps
for kvd, ql in ((torch.float8_e4m3fn, 1), (torch.float8_e4m3fn, 4)):
    cache = torch.randn(B * pages, 2, ps, hkv, d, device=dev, dtype=torch.bfloat16).to(kvd)
    bt = torch.randperm(B * pages, device=dev, dtype=torch.int64).to(torch.int32).reshape(B, pages)
    seq = torch.full((B,), kv, dtype=torch.int32, device=dev)
    q = torch.randn(B * ql, hq, d, device=dev, dtype=torch.bfloat16)
    sinks = torch.randn(hq, device=dev)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    out = torch.empty_like(q)
    def call(s):
        return ac.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, s, kv, bmm1_scale=1 / math.sqrt(d), out=out,
                                                 sinks=sinks, q_len_per_req=ql)
    for s_name, s in (("seq_lens on device", seq),):  # (read back and checked by every call: a device sync)
        call(s); torch.cuda.synchronize()
        t = do_bench(lambda: call(s), warmup=20, rep=200, return_mode="median")
        n = 200
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(n):
            call(s)
        torch.cuda.synchronize(); wall = (time.perf_counter() - t0) / n * 1e3
        print(f"{kvd} q{ql} {s_name}: do_bench {t:.4f} ms, back-to-back wall {wall:.4f} ms per call")
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    with prof:
        for _ in range(5):
            call(seq)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
