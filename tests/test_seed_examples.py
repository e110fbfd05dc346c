"""The examples of FlashInfer's API pages (shared/seeds), run as ``import attncore as flashinfer`` on
the CPU (sizes reduced where the page's would take minutes), checked against an fp64 golden."""

import torch

import attncore as flashinfer
from attncore.testing.golden import golden_attention, max_error, tolerance

DEV = "cpu"


def _assert_close(out, q, k, v, **kw):
    g, _ = golden_attention(q, k, v, **kw)
    base, _ = golden_attention(q, k, v, compute_dtype=q.dtype, **kw)
    err, tol = max_error(out, g), tolerance(base, g, q.dtype)
    assert err <= tol, (err, tol)


def _pages_to_dense(cache, indptr, indices, last, i, page_size):
    pages = indices[indptr[i]:indptr[i + 1]].long()
    n = (len(pages) - 1) * page_size + int(last[i])
    k = cache[pages, 0].reshape(-1, *cache.shape[-2:])[:n]
    v = cache[pages, 1].reshape(-1, *cache.shape[-2:])[:n]
    return k, v


def test_batch_prefill_paged_example():
    num_layers, num_qo_heads, num_kv_heads, head_dim = 2, 64, 16, 128
    max_num_pages, page_size = 128, 16
    workspace_buffer = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=DEV)
    prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace_buffer, "NHD")
    batch_size, nnz_qo = 7, 100
    qo_indptr = torch.tensor([0, 33, 44, 55, 66, 77, 88, nnz_qo], dtype=torch.int32, device=DEV)
    paged_kv_indices = torch.arange(max_num_pages).int().to(DEV)
    paged_kv_indptr = torch.tensor([0, 17, 29, 44, 48, 66, 100, 128], dtype=torch.int32, device=DEV)
    paged_kv_last_page_len = torch.tensor([1, 7, 14, 4, 3, 1, 16], dtype=torch.int32, device=DEV)
    q_at_layer = torch.randn(num_layers, nnz_qo, num_qo_heads, head_dim).half().to(DEV)
    kv_cache_at_layer = torch.randn(num_layers, max_num_pages, 2, page_size, num_kv_heads, head_dim,
                                    dtype=torch.float16, device=DEV)
    prefill_wrapper.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                         num_kv_heads, head_dim, page_size, causal=True)
    outputs = []
    for i in range(num_layers):
        o = prefill_wrapper.run(q_at_layer[i], kv_cache_at_layer[i])
        outputs.append(o)
    assert outputs[0].shape == torch.Size([100, 64, 128])
    assert prefill_wrapper.backend == "reference"  # auto on a CPU
    for r in (0, 3, 6):
        k, v = _pages_to_dense(kv_cache_at_layer[1], paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, r,
                               page_size)
        rows = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))
        _assert_close(outputs[1][rows], q_at_layer[1][rows], k, v, causal=True)
    # the page's custom-mask variant equals the causal result
    mask_arr = []
    qo_len = (qo_indptr[1:] - qo_indptr[:-1]).cpu().tolist()
    kv_len = (page_size * (paged_kv_indptr[1:] - paged_kv_indptr[:-1] - 1) + paged_kv_last_page_len).cpu().tolist()
    for i in range(batch_size):
        mask_i = torch.tril(torch.full((qo_len[i], kv_len[i]), True, device=DEV), diagonal=(kv_len[i] - qo_len[i]))
        mask_arr.append(mask_i.flatten())
    mask = torch.cat(mask_arr, dim=0)
    prefill_wrapper.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                         num_kv_heads, head_dim, page_size, custom_mask=mask)
    for i in range(num_layers):
        o_custom = prefill_wrapper.run(q_at_layer[i], kv_cache_at_layer[i])
        assert torch.allclose(o_custom, outputs[i], rtol=1e-3, atol=1e-3)


def test_batch_prefill_ragged_example():
    num_layers, num_qo_heads, num_kv_heads, head_dim = 2, 64, 16, 128
    workspace_buffer = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=DEV)
    prefill_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace_buffer, "NHD")
    batch_size, nnz_kv, nnz_qo = 7, 100, 100
    qo_indptr = torch.tensor([0, 33, 44, 55, 66, 77, 88, nnz_qo], dtype=torch.int32, device=DEV)
    kv_indptr = qo_indptr.clone()
    q_at_layer = torch.randn(num_layers, nnz_qo, num_qo_heads, head_dim).half().to(DEV)
    k_at_layer = torch.randn(num_layers, nnz_kv, num_kv_heads, head_dim).half().to(DEV)
    v_at_layer = torch.randn(num_layers, nnz_kv, num_kv_heads, head_dim).half().to(DEV)
    prefill_wrapper.plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, causal=True)
    outputs = [prefill_wrapper.run(q_at_layer[i], k_at_layer[i], v_at_layer[i]) for i in range(num_layers)]
    assert outputs[0].shape == torch.Size([100, 64, 128])
    for r in range(batch_size):
        rows = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))
        _assert_close(outputs[0][rows], q_at_layer[0][rows], k_at_layer[0][rows], v_at_layer[0][rows], causal=True)
    mask_arr = []
    qo_len = (qo_indptr[1:] - qo_indptr[:-1]).cpu().tolist()
    kv_len = (kv_indptr[1:] - kv_indptr[:-1]).cpu().tolist()
    for i in range(batch_size):
        mask_i = torch.tril(torch.full((qo_len[i], kv_len[i]), True, device=DEV), diagonal=(kv_len[i] - qo_len[i]))
        mask_arr.append(mask_i.flatten())
    mask = torch.cat(mask_arr, dim=0)
    prefill_wrapper.plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, custom_mask=mask)
    for i in range(num_layers):
        o_custom = prefill_wrapper.run(q_at_layer[i], k_at_layer[i], v_at_layer[i])
        assert torch.allclose(o_custom, outputs[i], rtol=1e-3, atol=1e-3)


def test_single_prefill_example():
    qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim = 128, 1024, 32, 4, 128
    q = torch.randn(qo_len, num_qo_heads, head_dim).half().to(DEV)
    k = torch.randn(kv_len, num_kv_heads, head_dim).half().to(DEV)
    v = torch.randn(kv_len, num_kv_heads, head_dim).half().to(DEV)
    o = flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, allow_fp16_qk_reduction=True)
    assert o.shape == torch.Size([128, 32, 128])
    mask = torch.tril(torch.full((qo_len, kv_len), True, device=DEV), diagonal=(kv_len - qo_len))
    o_custom = flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask)
    assert torch.allclose(o, o_custom, rtol=1e-3, atol=1e-3)
    _assert_close(o, q, k, v, causal=True)
    o2, lse = flashinfer.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True)
    assert torch.equal(o2, o) and lse.shape == (qo_len, num_qo_heads) and lse.dtype == torch.float32


def test_pod_example():
    num_qo_heads, num_kv_heads, head_dim, max_num_pages, page_size = 64, 8, 128, 128, 16
    workspace_buffer = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=DEV)
    wrapper = flashinfer.PODWithPagedKVCacheWrapper(workspace_buffer, "NHD")
    batch_size = 7
    kv_page_indices = torch.arange(max_num_pages).int().to(DEV)
    kv_page_indptr = torch.tensor([0, 17, 29, 44, 48, 66, 100, 128], dtype=torch.int32, device=DEV)
    kv_last_page_len = torch.tensor([1, 7, 14, 4, 3, 1, 16], dtype=torch.int32, device=DEV)
    kv_cache = torch.randn(max_num_pages, 2, page_size, num_kv_heads, head_dim, dtype=torch.float16, device=DEV)
    wrapper.plan(kv_page_indptr, kv_page_indices, kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 pos_encoding_mode="NONE", data_type=torch.float16)
    q_d = torch.randn(batch_size, num_qo_heads, head_dim).half().to(DEV)
    q_p = torch.randn(40, num_qo_heads, head_dim).half()
    k_p = torch.randn(64, num_kv_heads, head_dim).half()
    v_p = torch.randn(64, num_kv_heads, head_dim).half()
    (o_p, lse_p), (o_d, lse_d) = wrapper.run(q_p, k_p, v_p, q_d, kv_cache, causal_p=True, return_lse_p=True,
                                             return_lse_d=True)
    assert o_d.shape == torch.Size([7, 64, 128]) and lse_d.shape == (7, 64) and lse_p.shape == (40, 64)
    _assert_close(o_p, q_p, k_p, v_p, causal=True)
    for r in range(batch_size):
        k, v = _pages_to_dense(kv_cache, kv_page_indptr, kv_page_indices, kv_last_page_len, r, page_size)
        _assert_close(o_d[r:r + 1], q_d[r:r + 1], k, v)


def test_batch_pod_example():
    num_layers, num_qo_heads, num_kv_heads, head_dim = 2, 64, 8, 128
    device, page_block_size, causal = DEV, 1, True
    workspace_buffer = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPODWithPagedKVCacheWrapper(workspace_buffer, "NHD")
    p_qo_lens, d_qo_lens, p_kv_lens, d_kv_lens = [64] * 2, [1] * 16, [96] * 2, [128] * 16  # page: 2048/128/2048
    p_seq_lens_blocks = torch.ceil(torch.tensor(p_kv_lens, dtype=torch.int32) / page_block_size).int()
    p_q_indptr = torch.cat([torch.tensor([0]), torch.cumsum(torch.tensor(p_qo_lens), 0)], dim=0).int()
    p_kv_indptr = torch.cat([torch.tensor([0]), torch.cumsum(p_seq_lens_blocks, 0)], dim=0).int()
    kv_indices_p = torch.arange(0, p_kv_indptr[-1], device=device, dtype=torch.int32)
    last_page_len_p = (p_seq_lens_blocks - 1) % page_block_size + 1
    d_seq_lens_blocks = torch.ceil(torch.tensor(d_kv_lens, dtype=torch.int32) / page_block_size).int()
    d_q_indptr = torch.cat([torch.tensor([0]), torch.cumsum(torch.tensor(d_qo_lens), 0)], dim=0).int()
    d_kv_indptr = torch.cat([torch.tensor([0]), torch.cumsum(d_seq_lens_blocks, 0)], dim=0).int()
    kv_indices_d = torch.arange(0, d_kv_indptr[-1], device=device, dtype=torch.int32)
    last_page_len_d = (d_seq_lens_blocks - 1) % page_block_size + 1
    wrapper.plan(p_q_indptr.to(device), p_kv_indptr.to(device), kv_indices_p.to(device), last_page_len_p,
                 d_q_indptr.to(device), d_kv_indptr.to(device), kv_indices_d.to(device), last_page_len_d,
                 num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 page_size=page_block_size, q_data_type=torch.float16, kv_data_type=torch.float16)
    q_p = torch.rand(p_q_indptr[-1].item(), num_qo_heads, head_dim).to(device, dtype=torch.float16)
    kv_p = torch.randn(p_kv_indptr[-1], 2, page_block_size, num_kv_heads, head_dim).to(
        device, dtype=torch.float16).unbind(1)
    q_d = torch.rand(d_q_indptr[-1].item(), num_qo_heads, head_dim).to(device, dtype=torch.float16)
    kv_d = torch.randn(d_kv_indptr[-1], 2, page_block_size, num_kv_heads, head_dim).to(
        device, dtype=torch.float16).unbind(1)
    for i in range(num_layers):
        o_p_batch, o_d_batch = wrapper.run(q_p, kv_p, q_d, kv_d, causal_p=causal)
    assert o_p_batch.shape == (128, 64, 128) and o_d_batch.shape == (16, 64, 128)
    k0, v0 = kv_p[0][:96, 0], kv_p[1][:96, 0]
    _assert_close(o_p_batch[:64], q_p[:64], k0, v0, causal=True)
    k5, v5 = kv_d[0][5 * 128:6 * 128, 0], kv_d[1][5 * 128:6 * 128, 0]
    _assert_close(o_d_batch[5:6], q_d[5:6], k5, v5)
    (op, lp), (od, ld) = wrapper.run(q_p, kv_p, q_d, kv_d, causal_p=causal, return_lse=True)
    assert torch.equal(op, o_p_batch) and lp.shape == (128, 64) and ld.shape == (16, 64)


def test_xqa_signature_example():
    b, q_len, hq, hkv, d, page = 3, 2, 8, 2, 64, 16
    kv_lens = [40, 17, 2]
    cache = torch.randn(12, 2, page, hkv, d).half()
    block_tables = torch.tensor([[0, 1, 2], [5, 7, 0], [9, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    q = torch.randn(b * q_len, hq, d).half()
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    sinks = torch.randn(hq)
    out = flashinfer.decode.xqa_batch_decode_with_kv_cache(q, cache, ws, block_tables, seq_lens, 40,
                                                           bmm1_scale=0.1, bmm2_scale=1.5, sinks=sinks,
                                                           q_len_per_req=q_len, o_scale=2.0)
    for i in range(b):
        pages = block_tables[i, : (kv_lens[i] + page - 1) // page].long()
        k = cache[pages, 0].reshape(-1, hkv, d)[: kv_lens[i]]
        v = cache[pages, 1].reshape(-1, hkv, d)[: kv_lens[i]]
        _assert_close(out[i * q_len:(i + 1) * q_len], q[i * q_len:(i + 1) * q_len], k, v, causal=True,
                      sm_scale=0.1, sinks=sinks, v_scale=1.5, o_scale=2.0)
