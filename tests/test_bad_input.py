"""Every bad input raises ValueError/TypeError naming the argument, what was given and what is accepted."""

import pytest
import torch

import attncore

H = torch.float16


def _paged_wrapper(**kw):
    return attncore.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16), "NHD", **kw)


def _plan_paged(w, indptr=(0, 2, 3), last=(5, 16), indices=None, qo=(0, 4, 6), **kw):
    indptr_t = torch.tensor(indptr, dtype=torch.int32)
    indices_t = torch.arange(indptr[-1], dtype=torch.int32) if indices is None else torch.tensor(indices, dtype=torch.int32)
    w.plan(torch.tensor(qo, dtype=torch.int32), indptr_t, indices_t, torch.tensor(last, dtype=torch.int32),
           4, 2, 64, 16, **kw)


def test_q_shape_dtype_device():
    k = torch.randn(5, 2, 64).half()
    with pytest.raises(ValueError, match=r"q: got a 2-D tensor of shape \(4, 64\), expected 3-D"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 64).half(), k, k)
    with pytest.raises(TypeError, match=r"q: got dtype int32, expected fp16, bf16, fp32"):
        attncore.single_prefill_with_kv_cache(torch.zeros(4, 4, 64, dtype=torch.int32), k, k)
    with pytest.raises(TypeError, match=r"v: got dtype fp32, expected fp16"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 4, 64).half(), k, k.float())
    with pytest.raises(ValueError, match=r"v: got shape \[6, 2, 64\], expected \[5, 2, 64\]"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 4, 64).half(), k, torch.randn(6, 2, 64).half())


def test_heads_and_layout():
    q = torch.randn(4, 6, 64).half()
    k = torch.randn(5, 4, 64).half()
    with pytest.raises(ValueError, match=r"num_qo_heads: got 6 with num_kv_heads 4; num_qo_heads must be a multiple"):
        attncore.single_prefill_with_kv_cache(q, k, k)
    with pytest.raises(ValueError, match=r"kv_layout: got 'NDH', expected one of \['NHD', 'HND'\]"):
        attncore.single_prefill_with_kv_cache(q, k, k, kv_layout="NDH")
    with pytest.raises(ValueError, match=r"pos_encoding_mode: got 'ROPE', expected one of"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 4, 64).half(), k, k, pos_encoding_mode="ROPE")
    with pytest.raises(ValueError, match=r"window_left: got -3, expected -1 \(off\) or an int >= 0"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 4, 64).half(), k, k, window_left=-3)
    with pytest.raises(ValueError, match=r"causal: single prefill with causal=True needs kv_len >= qo_len"):
        attncore.single_prefill_with_kv_cache(torch.randn(9, 4, 64).half(), k, k, causal=True)


def test_non_contiguous_last_dim():
    q = torch.randn(4, 4, 128).half()[..., ::2]
    k = torch.randn(5, 2, 64).half()
    with pytest.raises(ValueError, match=r"q: the last dimension must be contiguous"):
        attncore.single_prefill_with_kv_cache(q, k, k)


def test_head_dim_a_forced_backend_cannot_serve():
    q, k = torch.randn(4, 4, 72).half(), torch.randn(5, 2, 72).half()
    # the reference serves any head dim; a forced backend with a fixed set refuses with its reason
    from attncore import registry
    from attncore.capabilities import Capabilities
    from attncore.reference.backend import ReferenceBackend

    class D128(ReferenceBackend):
        name = "d128"
        capabilities = (Capabilities(ops=frozenset({"single_prefill"}), devices=frozenset({"cpu"}),
                                     head_dims=frozenset({64, 128, 256})),)

    registry.register_backend(D128())
    try:
        with pytest.raises(ValueError, match=r"head_dim: got 72, supported \{64, 128, 256\}"):
            attncore.single_prefill_with_kv_cache(q, k, k, backend="d128")
    finally:
        registry.unregister_backend("d128")


def test_indptr_checks():
    w = _paged_wrapper()
    with pytest.raises(ValueError, match=r"qo_indptr: not non-decreasing: qo_indptr\[1\] = 4 > qo_indptr\[2\] = 3"):
        _plan_paged(w, qo=(0, 4, 3))
    with pytest.raises(ValueError, match=r"paged_kv_indptr: not non-decreasing: paged_kv_indptr\[1\] = 3 > "):
        _plan_paged(w, indptr=(0, 3, 2))
    with pytest.raises(ValueError, match=r"paged_kv_indptr: got 4 entries, expected 3 \(batch_size \+ 1\)"):
        _plan_paged(w, indptr=(0, 1, 2, 3), last=(5, 16))
    with pytest.raises(ValueError, match=r"qo_indptr: got qo_indptr\[0\] = 1, expected 0"):
        _plan_paged(w, qo=(1, 4, 6))
    with pytest.raises(TypeError, match=r"qo_indptr: got dtype int64, expected int32"):
        w.plan(torch.tensor([0, 4]), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
               torch.tensor([3], dtype=torch.int32), 4, 2, 64, 16)


def test_last_page_len_and_page_ids():
    w = _paged_wrapper()
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len: got paged_kv_last_page_len\[1\] = 17, "
                                         r"expected 1 <= last_page_len <= page_size \(16\)"):
        _plan_paged(w, last=(5, 17))
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len\[0\] = 0, expected 1 <= last_page_len"):
        _plan_paged(w, last=(0, 3))
    with pytest.raises(ValueError, match=r"paged_kv_indices: got a negative page id -1"):
        _plan_paged(w, indices=(0, -1, 2))
    with pytest.raises(ValueError, match=r"paged_kv_indices: got 2 entries, expected at least paged_kv_indptr\[-1\] = 3"):
        _plan_paged(w, indices=(0, 1))
    _plan_paged(w, indices=(0, 1, 9), causal=True)
    cache = torch.randn(4, 2, 16, 2, 64).half()
    with pytest.raises(ValueError, match=r"paged_kv_indices: page id 9 is out of range for a cache of 4 pages"):
        w.run(torch.randn(6, 4, 64).half(), cache)


def test_mask_length():
    w = _paged_wrapper()
    with pytest.raises(ValueError, match=r"custom_mask: got 10 elements, expected 116 \(sum of qo_len\*kv_len"):
        _plan_paged(w, custom_mask=torch.ones(10, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"packed_custom_mask: got 3 bytes, expected 15"):
        _plan_paged(w, packed_custom_mask=torch.zeros(3, dtype=torch.uint8))
    q, k = torch.randn(4, 4, 64).half(), torch.randn(5, 2, 64).half()
    with pytest.raises(ValueError, match=r"custom_mask: got shape \[4, 4\], expected \[4, 5\]"):
        attncore.single_prefill_with_kv_cache(q, k, k, custom_mask=torch.ones(4, 4, dtype=torch.bool))


def test_run_before_plan_and_dtype_mismatch():
    w = _paged_wrapper()
    cache = torch.randn(4, 2, 16, 2, 64).half()
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        w.run(torch.randn(6, 4, 64).half(), cache)
    _plan_paged(w, causal=True)
    with pytest.raises(TypeError, match=r"q: got dtype bf16, expected fp16"):
        w.run(torch.randn(6, 4, 64).bfloat16(), cache)
    with pytest.raises(TypeError, match=r"paged_kv_cache \(k\): got dtype fp32, expected fp16"):
        w.run(torch.randn(6, 4, 64).half(), cache.float())
    with pytest.raises(ValueError, match=r"q: got shape \[7, 4, 64\], expected \[6, 4, 64\]"):
        w.run(torch.randn(7, 4, 64).half(), cache)
    with pytest.raises(ValueError, match=r"paged_kv_cache \(k\): got shape \[4, 8, 2, 64\], expected \[\*, 16, 2, 64\]"):
        w.run(torch.randn(6, 4, 64).half(), torch.randn(4, 2, 8, 2, 64).half())
    with pytest.raises(ValueError, match=r"out: got shape \[6, 4, 32\], expected \[6, 4, 64\]"):
        w.run(torch.randn(6, 4, 64).half(), cache, out=torch.empty(6, 4, 32).half())


def test_decode_and_xqa_bad_input():
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16))
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    last = torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"last_page_len: request 0 holds 1 tokens, fewer than q_len_per_req \(2\)"):
        w.plan(indptr, idx, last, 4, 2, 64, 16, q_len_per_req=2)
    w.plan(indptr, idx, last, 4, 2, 64, 16)
    with pytest.raises(ValueError, match=r"window_left: got 3 in run\(\), but plan\(\) used -1"):
        w.run(torch.randn(2, 4, 64).half(), torch.randn(2, 2, 16, 2, 64).half(), window_left=3)
    q = torch.randn(2, 4, 64).half()
    cache = torch.randn(2, 2, 16, 2, 64).half()
    bt = torch.zeros(2, 1, dtype=torch.int32)
    seq = torch.tensor([3, 4], dtype=torch.int32)
    ws = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_cache_sf: NVFP4 KV caches are not supported"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 4, kv_cache_sf=torch.zeros(1))
    with pytest.raises(ValueError, match=r"query: got 2 rows, expected batch_size \* q_len_per_req = 4"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 4, q_len_per_req=2)
    with pytest.raises(ValueError, match=r"block_tables: 1 pages of 16 tokens cannot hold max_seq_len 40"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 40)
    with pytest.raises(ValueError, match=r"mask: got shape \[2, 1, 1\], expected \[2, 1, 2\]"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 4, mask=torch.zeros(2, 1, 1, dtype=torch.uint16))
    with pytest.raises(ValueError, match=r"sinks: got shape \[3\], expected \[4\]"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 4, sinks=torch.zeros(3))


def test_pod_decode_args_conflicting_with_plan_raise():
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(16))
    w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
           torch.tensor([3], dtype=torch.int32), 4, 2, 64, 16, data_type=torch.float16)
    qp, kp = torch.randn(3, 4, 64).half(), torch.randn(3, 2, 64).half()
    qd, cache = torch.randn(1, 4, 64).half(), torch.randn(1, 2, 16, 2, 64).half()
    for kw, pat in ((dict(sm_scale_d=0.5), "sm_scale_d: got 0.5"), (dict(window_left_d=4), "window_left_d: got 4"),
                    (dict(pos_encoding_mode_d="ALIBI"), "pos_encoding_mode_d: got 'ALIBI'"),
                    (dict(kv_layout_d="HND"), "kv_layout_d: got 'HND'"),
                    (dict(custom_mask_d=torch.ones(16, dtype=torch.bool)), "custom_mask_d: the decode side")):
        with pytest.raises(ValueError, match=pat):
            w.run(qp, kp, kp, qd, cache, **kw)
    # matching values are accepted
    w.run(qp, kp, kp, qd, cache, sm_scale_d=0.125, window_left_d=-1, pos_encoding_mode_d="NONE")
