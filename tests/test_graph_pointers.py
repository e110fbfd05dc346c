"""CUDA-graph mode: a captured launch keeps every pointer it was given, so each index tensor a plan hands a
backend must live at the same address across re-plans (the caller's fixed buffers, or buffers the wrapper
allocates at its first graph-mode plan).  A per-plan tensor is freed at the next plan and its memory reused
while a graph still reads it: FlashInfer 0.2.14's test_cuda_graph_batch_decode_with_paged_kv_cache (plan,
capture, re-plan several times, replay) got wrong outputs from the decode's per-plan qo_indptr.  Checked on
the CPU through the same planning code (graph mode on a GPU is tests/test_cuda_graph_api.py)."""

import pytest
import torch

import attncore

B, HQ, HKV, D, P = 3, 8, 2, 32, 4
FIELDS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "packed_mask", "mask_indptr")


def _pointers(w):
    meta = w._planned.meta
    return {f: getattr(meta, f).data_ptr() for f in FIELDS if getattr(meta, f, None) is not None}


def _decode(n_pages_seq):
    ws = torch.empty(16 << 20, dtype=torch.uint8)
    ib, xb, lb = (torch.empty(n, dtype=torch.int32) for n in (B + 1, B * max(n_pages_seq), B))
    w = attncore.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, ib, xb, lb, "NHD", backend="reference")
    for n in n_pages_seq:
        w.plan(torch.arange(B + 1, dtype=torch.int32) * n, torch.arange(B * n, dtype=torch.int32),
               torch.full((B,), 2, dtype=torch.int32), HQ, HKV, D, P, q_data_type=torch.float16)
        yield w


def _paged_prefill(n_pages_seq):
    ws = torch.empty(16 << 20, dtype=torch.uint8)
    qb, ib, xb, lb = (torch.empty(n, dtype=torch.int32) for n in (B + 1, B + 1, B * max(n_pages_seq), B))
    w = attncore.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qb,
                                                     paged_kv_indptr_buf=ib, paged_kv_indices_buf=xb,
                                                     paged_kv_last_page_len_buf=lb, backend="reference")
    for n in n_pages_seq:
        w.plan(torch.arange(B + 1, dtype=torch.int32) * 2, torch.arange(B + 1, dtype=torch.int32) * n,
               torch.arange(B * n, dtype=torch.int32), torch.full((B,), 2, dtype=torch.int32), HQ, HKV, D, P,
               causal=True, q_data_type=torch.float16)
        yield w


def _ragged(n_pages_seq):
    ws = torch.empty(16 << 20, dtype=torch.uint8)
    qb, kb = (torch.empty(B + 1, dtype=torch.int32) for _ in range(2))
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qb,
                                                      kv_indptr_buf=kb, backend="reference")
    for n in n_pages_seq:
        w.plan(torch.arange(B + 1, dtype=torch.int32) * 2, torch.arange(B + 1, dtype=torch.int32) * (n * P),
               HQ, HKV, D, causal=True, q_data_type=torch.float16)
        yield w


@pytest.mark.parametrize("make", [_decode, _paged_prefill, _ragged])
def test_every_index_tensor_keeps_its_address_across_graph_mode_replans(make):
    seen = None
    for w in make([1, 1, 2, 3, 4]):
        ptrs = _pointers(w)
        garbage = [torch.empty(64, dtype=torch.int32) for _ in range(8)]  # churn the allocator between plans
        del garbage
        if seen is None:
            seen = ptrs
            assert {"qo_indptr", "kv_indptr", "kv_lens"} <= set(ptrs)
        assert ptrs == seen, {f: (seen.get(f), ptrs.get(f)) for f in ptrs if seen.get(f) != ptrs.get(f)}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda_fa2", "auto"])
@pytest.mark.parametrize("pos", ["NONE", "ROPE_LLAMA"])
def test_gpu_graph_decode_replayed_after_several_replans_matches_the_golden(backend, pos):
    """FlashInfer's sequence: plan 1 page per request, capture, re-plan 1, 2, 3 pages replaying each, then the
    final lengths (last page partly filled), replay: the output equals the fp64 golden of the final plan."""
    from attncore.testing.golden import golden_and_baseline, max_error, tolerance

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.manual_seed(3)
    b, hq, hkv, d, page, kv_len = 12, 32, 4, 128, 16, 54
    npg = (kv_len + page - 1) // page
    dev = "cuda"
    q = torch.randn(b, hq, d, device=dev, dtype=torch.float16)
    cache = torch.randn(b * npg, 2, page, hkv, d, device=dev, dtype=torch.float16)
    bufs = [torch.empty(n, device=dev, dtype=torch.int32) for n in (b + 1, b * npg, b)]
    w = attncore.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev),
                                                             *bufs, "NHD", backend=backend)

    def plan(n, last):
        w.plan(torch.arange(b + 1, dtype=torch.int32) * n, torch.arange(b * n, dtype=torch.int32),
               torch.full((b,), last, dtype=torch.int32), hq, hkv, d, page, pos_encoding_mode=pos,
               q_data_type=torch.float16)

    plan(1, page)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            w.run(q, cache)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = w.run(q, cache)
    for n in range(1, npg):
        plan(n, page)
        g.replay()
    plan(npg, (kv_len - 1) % page + 1)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    k = cache[:, 0].reshape(b, npg * page, hkv, d)[:, :kv_len].cpu()
    v = cache[:, 1].reshape(b, npg * page, hkv, d)[:, :kv_len].cpu()
    for i in range(b):
        go, _, bo, _ = golden_and_baseline(q[i:i + 1].cpu(), k[i], v[i], dtype=q.dtype, causal=True,
                                           pos_encoding_mode=pos)
        assert max_error(out[i:i + 1].cpu().double(), go) <= tolerance(bo, go, q.dtype), f"request {i}"
