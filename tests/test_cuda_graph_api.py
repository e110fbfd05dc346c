"""use_cuda_graph=True: plan copies the page table into the caller's fixed buffers; batch size frozen."""

import pytest
import torch

import attncore


def _table(b, pages_per_req, page):
    indptr = torch.arange(b + 1, dtype=torch.int32) * pages_per_req
    indices = torch.randperm(b * pages_per_req).to(torch.int32)
    last = torch.randint(1, page + 1, (b,), dtype=torch.int32)
    return indptr, indices, last


def test_plan_writes_into_user_buffers_and_freezes_batch():
    indptr_buf = torch.zeros(5, dtype=torch.int32)
    indices_buf = torch.zeros(64, dtype=torch.int32)
    last_buf = torch.zeros(4, dtype=torch.int32)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8), "NHD", use_cuda_graph=True,
                                                    paged_kv_indptr_buffer=indptr_buf,
                                                    paged_kv_indices_buffer=indices_buf,
                                                    paged_kv_last_page_len_buffer=last_buf)
    indptr, indices, last = _table(4, 3, 16)
    w.plan(indptr, indices, last, 4, 2, 64, 16)
    assert torch.equal(indptr_buf, indptr) and torch.equal(indices_buf[:12], indices) and torch.equal(last_buf, last)
    assert w._planned.meta.kv_indices.data_ptr() == indices_buf.data_ptr()  # the kernel reads the fixed buffer
    with pytest.raises(ValueError, match="frozen batch size of 4"):
        w.plan(*_table(3, 3, 16), 4, 2, 64, 16)
    with pytest.raises(ValueError, match=r"paged_kv_indices_buffer|indices: needs 80 entries"):
        w.plan(*_table(4, 20, 16), 4, 2, 64, 16)


@pytest.mark.gpu
def test_decode_graph_replay_equals_eager():
    dev = "cuda"
    b, page, hq, hkv, d = 8, 16, 32, 8, 128
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(b * 64, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32, device=dev))
    # 128 MiB, FlashInfer's usual size: split-KV partials of 8 requests x 32 heads need a few MiB
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD",
                                                    use_cuda_graph=True, **bufs)
    cache = torch.randn(b * 64, 2, page, hkv, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    indptr, indices, last = (t.to(dev) for t in _table(b, 32, page))
    w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16)
    w.run(q, cache, out=out)  # warm-up compiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out)
    # new page table with the same batch size, planned into the same buffers; replay must follow it
    indptr2, indices2, last2 = (t.to(dev) for t in _table(b, 32, page))
    w.plan(indptr2, indices2, last2, hq, hkv, d, page, q_data_type=torch.bfloat16)
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    g.replay()
    eager = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD")
    eager.plan(indptr2, indices2, last2, hq, hkv, d, page, q_data_type=torch.bfloat16)
    ref = eager.run(q, cache)
    assert not torch.isnan(out).any()
    assert (out.float() - ref.float()).abs().max() < 2e-2


def test_ragged_and_mask_buffers_are_used():
    qo_buf = torch.zeros(3, dtype=torch.int32)
    kv_buf = torch.zeros(3, dtype=torch.int32)
    mask_buf = torch.zeros(64, dtype=torch.uint8)
    qk_buf = torch.zeros(3, dtype=torch.int32)
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8), "NHD", use_cuda_graph=True, qo_indptr_buf=qo_buf,
                                                      kv_indptr_buf=kv_buf, custom_mask_buf=mask_buf,
                                                      qk_indptr_buf=qk_buf)
    qo = torch.tensor([0, 3, 5], dtype=torch.int32)
    kv = torch.tensor([0, 4, 10], dtype=torch.int32)
    mask = torch.rand(3 * 4 + 2 * 6) < 0.5
    w.plan(qo, kv, 2, 1, 16, custom_mask=mask)
    meta = w._planned.meta
    assert meta.packed_mask.data_ptr() == mask_buf.data_ptr() and meta.mask_indptr.data_ptr() == qk_buf.data_ptr()
    assert torch.equal(qo_buf, qo) and torch.equal(kv_buf, kv) and qk_buf.tolist() == [0, 2, 4]
    q, k, v = torch.randn(5, 2, 16).half(), torch.randn(10, 1, 16).half(), torch.randn(10, 1, 16).half()
    ref = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8))
    ref.plan(qo, kv, 2, 1, 16, custom_mask=mask)
    assert torch.equal(w.run(q, k, v), ref.run(q, k, v))


def test_one_call_apis_reuse_their_small_index_tensors():
    """single prefill and xqa build index tensors per call: cached, so no host-to-device copy (and
    stream sync) repeats across layers."""
    from attncore.core import _api

    q, k = torch.randn(3, 4, 16).half(), torch.randn(7, 2, 16).half()
    attncore.single_prefill_with_kv_cache(q, k, k, causal=True)
    a = _api.small_index([0, 7], "cpu")
    attncore.single_prefill_with_kv_cache(q, k, k, causal=True)
    assert _api.small_index([0, 7], "cpu") is a and a.tolist() == [0, 7]


# ----------------------------------------------------------------------------- issue 15: graph-mode API
def test_cuda_graph_decode_wrapper_has_flashinfer_signature_and_uses_the_buffers():
    import inspect

    params = list(inspect.signature(attncore.CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__init__).parameters)
    assert params[:7] == ["self", "workspace_buffer", "indptr_buffer", "indices_buffer", "last_page_len_buffer",
                          "kv_layout", "use_tensor_cores"]
    bufs = torch.zeros(5, dtype=torch.int32), torch.zeros(64, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    w = attncore.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 16, dtype=torch.uint8), *bufs)
    assert w.is_cuda_graph_enabled and isinstance(w, attncore.BatchDecodeWithPagedKVCacheWrapper)
    indptr, indices, last = _table(4, 3, 16)
    w.plan(indptr, indices, last, 4, 2, 16, 16)
    assert torch.equal(bufs[0], indptr) and torch.equal(bufs[1][:12], indices) and torch.equal(bufs[2], last)
    with pytest.raises(TypeError, match="indices_buffer: got dtype fp32"):
        attncore.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(8), bufs[0], bufs[1].float(), bufs[2])


def _graph_decode(**plan_kw):
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 16, dtype=torch.uint8), "NHD",
                                                    use_cuda_graph=True, backend="reference")
    indptr, indices, last = _table(2, 2, 4)
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type=torch.float16, **plan_kw)
    return w, torch.randn(2, 4, 16).half(), torch.randn(4, 2, 4, 2, 16).half()


def test_graph_mode_run_never_plans_a_feature_it_lacks():
    w, q, cache = _graph_decode(return_lse=False)
    n_variants = len(w._planned._variants)
    with pytest.raises(ValueError, match=r"an LSE \(return_lse=True\), which plan\(\) was not given; plan with it: "
                                         r"plan\(\.\.\., return_lse=True\)"):
        w.run(q, cache, return_lse=True)
    with pytest.raises(ValueError, match=r"sinks: BatchDecodeWithPagedKVCacheWrapper runs in CUDA-graph mode "
                                         r"\(use_cuda_graph=True\), where run\(\) never plans.*plan\(\.\.\., sinks=True\)"):
        w.run(q, cache, sinks=torch.randn(4))
    with pytest.raises(ValueError, match=r"fp8 scales .*plan\(\.\.\., fp8_scales=True\)"):
        w.run(q, cache, k_scale=0.5)
    with pytest.raises(ValueError, match=r"run\(\): .*an LSE .* and sinks.*plan\(\.\.\., return_lse=True, sinks=True\)"):
        w.run(q, cache, return_lse=True, sinks=torch.randn(4))
    with pytest.raises(ValueError, match=r"q: got shape \[3, 4, 16\], expected \[2, 4, 16\]"):
        w.run(torch.randn(3, 4, 16).half(), cache)
    assert len(w._planned._variants) == n_variants  # nothing was planned by run()


def test_graph_mode_runs_what_was_planned():
    w, q, cache = _graph_decode(sinks=True, fp8_scales=True)  # return_lse None: planned where the backend writes one
    sinks = torch.randn(4)
    eager = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 16, dtype=torch.uint8), backend="reference")
    eager.plan(*(t.clone() for t in (w._graph_buffers["indptr"], w._graph_buffers["indices"],
                                     w._graph_buffers["last_page_len"])), 4, 2, 16, 4, q_data_type=torch.float16)
    out, lse = w.run(q, cache, return_lse=True, sinks=sinks, k_scale=0.5)
    ref_out, ref_lse = eager.run(q, cache, return_lse=True, sinks=sinks, k_scale=0.5)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(w.run(q, cache, sinks=sinks, k_scale=0.5), ref_out)  # without the LSE: the same plan
    assert w._planned.problem.return_lse and len(w._planned._variants) == 1
    with pytest.raises(TypeError, match="sinks: got 'yes', expected a bool"):
        _graph_decode(sinks="yes")
