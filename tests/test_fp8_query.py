"""fp8 queries (issue 18 item 2, attncore.core.fp8_query): a q of dtype e4m3/e5m2 is upcast exactly to the
compute dtype (o_dtype when fp16/bf16/fp32, else fp16) before selection.  Each case is checked against the
fp64 golden of q.to(fp16) with the project's tolerance rule, and bit for bit against the same backend run
with the upcast q (the exactness claim).  CPU: reference and Triton (interpreter), fp16/fp32 compute; GPU
(``@pytest.mark.gpu``): bf16/fp16 compute on cuda_fa2, triton, xqa and auto."""

import pytest
import torch

import attncore
from attncore.core.selector import BackendSelectionError
from attncore.core.workspace import WorkspaceTooSmall
from attncore.testing.golden import golden_and_baseline, max_error, tolerance

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
CPU_BACKENDS = ["reference", "triton"]
gpu = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def _indptr(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _check(out, lse, q, k, v, out_dtype, compute, **kw):
    """One request against the fp64 golden of the upcast q (the yardstick in the compute dtype)."""
    go, gl, bo, bl = golden_and_baseline(q.to(torch.float16).cpu(), k.cpu(), v.cpu(), dtype=compute,
                                         out_dtype=out_dtype, **kw)
    err = max_error(out, go)
    assert err <= tolerance(bo, go, out_dtype), err
    if lse is not None and q.shape[0]:
        assert max_error(lse, gl) <= tolerance(bl, gl, compute, kind="lse")


def _kv_dtype(kind, qd, compute):
    return qd if kind == "fp8" else compute


# ----------------------------------------------------------------------------- single prefill / decode
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("qd", FP8)
@pytest.mark.parametrize("kv", ["fp8", "compute"])
@pytest.mark.parametrize("compute", [torch.float16, torch.float32])
def test_single_prefill(backend, qd, kv, compute):
    if DEV == "cuda" and backend == "triton" and compute == torch.float32:
        pytest.skip("fp32 q: Triton serves it on the CPU only")
    g = torch.Generator().manual_seed(7)
    kvd = _kv_dtype(kv, qd, compute)
    q, k, v = _rand(g, 6, 4, 64, dtype=qd), _rand(g, 11, 2, 64, dtype=kvd), _rand(g, 11, 2, 64, dtype=kvd)
    kw = dict(causal=True, q_scale=0.75, k_scale=1.25 if kv == "fp8" else None)
    out, lse = attncore.single_prefill_with_kv_cache(q, k, v, o_dtype=compute, backend=backend, return_lse=True,
                                                     **kw)
    assert out.dtype == compute and out.shape == (6, 4, 64)
    _check(out, lse, q, k, v, compute, compute, causal=True, q_scale=0.75, k_scale=kw["k_scale"] or 1.0)
    ref, ref_lse = attncore.single_prefill_with_kv_cache(q.to(compute), k, v, backend=backend, return_lse=True, **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)  # the upcast is exact
    again = attncore.single_prefill_with_kv_cache(q, k, v, o_dtype=compute, backend=backend, **kw)  # cached plan
    assert torch.equal(again, out)


def test_single_prefill_scale_q_tensor_and_flashinfer_default_output():
    # FlashInfer 0.2.14's spelling (scale_q as a tensor) and its default o_dtype (q's: an fp8 output, which the
    # reference backend writes)
    g = torch.Generator().manual_seed(3)
    q, k, v = (_rand(g, 4, 2, 32, dtype=torch.float8_e4m3fn) for _ in range(3))
    out = attncore.single_prefill_with_kv_cache(q, k, v, torch.tensor([0.5]), backend="reference")
    assert out.dtype == torch.float8_e4m3fn
    ref = attncore.single_prefill_with_kv_cache(q.half(), k, v, torch.tensor([0.5]), o_dtype=torch.float8_e4m3fn,
                                                backend="reference")
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("qd", FP8)
def test_single_decode(backend, qd):
    g = torch.Generator().manual_seed(11)
    q, k, v = _rand(g, 8, 64, dtype=qd), _rand(g, 37, 2, 64, dtype=qd), _rand(g, 37, 2, 64, dtype=qd)
    out, lse = attncore.single_decode_with_kv_cache(q, k, v, q_scale=2.0, v_scale=0.5, return_lse=True,
                                                    backend=backend, o_dtype=torch.float16)
    assert out.dtype == torch.float16 and out.shape == (8, 64)
    _check(out[None], lse[None], q[None], k, v, torch.float16, torch.float16, q_scale=2.0, v_scale=0.5)
    ref = attncore.single_decode_with_kv_cache(q.half(), k, v, q_scale=2.0, v_scale=0.5, backend=backend)
    assert torch.equal(out, ref)
    dst = torch.empty(8, 64, dtype=torch.float16, device=DEV)
    assert attncore.single_decode_with_kv_cache(q, k, v, q_scale=2.0, v_scale=0.5, backend=backend,
                                                o_dtype=torch.float16, out=dst) is not None
    assert torch.equal(dst, out)


# ----------------------------------------------------------------------------- batch wrappers
def _paged_batch(g, kv_lens, page, hkv, d, dtype):
    npages = [-(-n // page) for n in kv_lens]
    pool = sum(npages) + 2
    perm = torch.randperm(pool, generator=g)[:sum(npages)].to(torch.int32)
    cache = _rand(g, pool, 2, page, hkv, d, dtype=dtype)
    last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv_lens], dtype=torch.int32)
    ks, vs, p0 = [], [], 0
    for n, c in zip(kv_lens, npages):
        pages = perm[p0:p0 + c].long().to(cache.device)
        p0 += c
        ks.append(cache[pages, 0].reshape(-1, hkv, d)[:n])
        vs.append(cache[pages, 1].reshape(-1, hkv, d)[:n])
    return cache, _indptr(npages), perm, last, ks, vs


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("qd", FP8)
@pytest.mark.parametrize("kv", ["fp8", "compute"])
def test_batch_decode(backend, qd, kv):
    g = torch.Generator().manual_seed(5)
    compute = torch.float16
    hq, hkv, d, page, kv_lens = 8, 2, 64, 4, [5, 1, 16, 9]
    cache, indptr, idx, last, ks, vs = _paged_batch(g, kv_lens, page, hkv, d, _kv_dtype(kv, qd, compute))
    q = _rand(g, len(kv_lens), hq, d, dtype=qd)
    ws = torch.empty(32 << 20, dtype=torch.uint8, device=DEV)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, backend=backend)
    w.plan(indptr, idx, last, hq, hkv, d, page, q_data_type=qd, kv_data_type=cache.dtype, o_data_type=compute)
    assert w.problem.q_dtype == compute and w._planned.q_dtype == qd
    out, lse = w.run(q, cache, q_scale=0.5, return_lse=True)
    assert out.dtype == compute
    for i in range(len(kv_lens)):
        _check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], ks[i], vs[i], compute, compute, q_scale=0.5)
    w16 = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, backend=backend)
    w16.plan(indptr, idx, last, hq, hkv, d, page, q_data_type=compute, kv_data_type=cache.dtype)
    ref, ref_lse = w16.run(q.to(compute), cache, q_scale=0.5, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    buf = w._planned.q_upcast
    again = w.run(q, cache, q_scale=0.5)  # the run cache's fast path: the same buffer, the same result
    assert torch.equal(again, out) and w._planned.q_upcast is buf
    # the buffer is carved from the end of the caller's float workspace, not allocated
    assert ws.data_ptr() <= buf.data_ptr() and buf.data_ptr() + buf.numel() * 2 <= ws.data_ptr() + ws.numel()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("qd", FP8)
def test_batch_prefill_paged(backend, qd):
    g = torch.Generator().manual_seed(9)
    hq, hkv, d, page = 6, 2, 64, 16
    qo, kv_lens = [7, 0, 3, 5], [9, 4, 33, 5]
    cache, indptr, idx, last, ks, vs = _paged_batch(g, kv_lens, page, hkv, d, qd)
    qi = _indptr(qo)
    q = _rand(g, sum(qo), hq, d, dtype=qd)
    w = attncore.BatchPrefillWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV),
                                                     backend=backend)
    w.plan(qi, indptr, idx, last, hq, hkv, d, page, causal=True, q_data_type=qd, o_data_type=torch.float16)
    out, lse = w.run(q, cache, q_scale=1.5, k_scale=0.5, return_lse=True)
    for i in range(len(qo)):
        a, b = int(qi[i]), int(qi[i + 1])
        if b > a:
            _check(out[a:b], lse[a:b], q[a:b], ks[i], vs[i], torch.float16, torch.float16, causal=True,
                   q_scale=1.5, k_scale=0.5)
    w.plan(qi, indptr, idx, last, hq, hkv, d, page, causal=True, q_data_type=torch.float16, kv_data_type=qd)
    ref, ref_lse = w.run(q.half(), cache, q_scale=1.5, k_scale=0.5, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batch_prefill_ragged_fp32_compute(backend):
    if DEV == "cuda" and backend == "triton":
        pytest.skip("fp32 q: Triton serves it on the CPU only")
    g = torch.Generator().manual_seed(13)
    qd, hq, hkv, d = torch.float8_e4m3fn, 4, 4, 32
    qo, kv_lens = [3, 6], [8, 6]
    qi, ki = _indptr(qo), _indptr(kv_lens)
    q, k, v = _rand(g, 9, hq, d, dtype=qd), _rand(g, 14, hkv, d, dtype=qd), _rand(g, 14, hkv, d, dtype=qd)
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV),
                                                      backend=backend)
    w.plan(qi, ki, hq, hkv, d, causal=False, q_data_type=qd, o_data_type=torch.float32)
    out = w.run(q, k, v, q_scale=0.25)
    assert out.dtype == torch.float32
    for i in range(2):
        a, b, c, e = int(qi[i]), int(qi[i + 1]), int(ki[i]), int(ki[i + 1])
        _check(out[a:b], None, q[a:b], k[c:e], v[c:e], torch.float32, torch.float32, q_scale=0.25)
    w.plan(qi, ki, hq, hkv, d, q_data_type=torch.float32, kv_data_type=qd)
    assert torch.equal(out, w.run(q.float(), k, v, q_scale=0.25))


def test_xqa_entry_point_with_an_fp8_query():
    g = torch.Generator().manual_seed(17)
    qd, hq, hkv, d, page, kv_lens = torch.float8_e4m3fn, 8, 2, 64, 8, [12, 30, 1]
    npages = [-(-n // page) for n in kv_lens]
    table = torch.zeros(3, max(npages), dtype=torch.int32)
    perm, p0 = torch.randperm(sum(npages) + 1, generator=g).to(torch.int32), 0
    for i, c in enumerate(npages):
        table[i, :c] = perm[p0:p0 + c]
        p0 += c
    cache = _rand(g, sum(npages) + 1, 2, page, hkv, d, dtype=qd)
    q = _rand(g, 3, hq, d, dtype=qd)
    seq, table = torch.tensor(kv_lens, dtype=torch.int32, device=DEV), table.to(DEV)
    ws = torch.empty(32 << 20, dtype=torch.uint8, device=DEV)
    out = torch.empty(3, hq, d, dtype=torch.float16, device=DEV)
    attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, table, seq, max(kv_lens), bmm1_scale=0.1, out=out)
    ref = torch.empty_like(out)
    attncore.xqa_batch_decode_with_kv_cache(q.half(), cache, ws, table, seq, max(kv_lens), bmm1_scale=0.1, out=ref)
    assert torch.equal(out, ref)
    for i, n in enumerate(kv_lens):
        pages = table[i, :npages[i]].long()
        k, v = (cache[pages, j].reshape(-1, hkv, d)[:n] for j in (0, 1))
        _check(out[i:i + 1], None, q[i:i + 1], k, v, torch.float16, torch.float16, sm_scale=0.1)


def test_cuda_graph_wrapper_keeps_the_upcast_buffer_across_replans():
    # CUDA-graph mode (run() never plans): the buffer keeps its address when a re-plan has the same q rows (a
    # frozen decode batch), so a captured copy and kernel keep reading the right memory.  The reference declares
    # graph mode on the CPU only (where there is no capture); on a GPU Triton runs it
    g = torch.Generator().manual_seed(31)
    bufs = [torch.empty(n, dtype=torch.int32, device=DEV) for n in (4, 32, 3)]
    w = attncore.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV),
                                                             *bufs, backend="reference" if DEV == "cpu" else "triton")
    ptrs = []
    for seed, kv_lens in ((1, [5, 9, 2]), (2, [30, 1, 17])):
        cache, indptr, idx, last, ks, vs = _paged_batch(g, kv_lens, 4, 2, 32, torch.float8_e5m2)
        q = _rand(g, 3, 4, 32, dtype=torch.float8_e5m2)
        w.plan(indptr, idx, last, 4, 2, 32, 4, q_data_type="e5m2", o_data_type=torch.float16, return_lse=True)
        out, lse = w.run(q, cache, return_lse=True)
        for i in range(3):
            _check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], ks[i], vs[i], torch.float16, torch.float16)
        ptrs.append(w._planned.q_upcast.data_ptr())
    assert ptrs[0] == ptrs[1]


def test_compiled_wrapper_run_with_an_fp8_q():
    import torch._dynamo

    g = torch.Generator().manual_seed(37)
    cache, indptr, idx, last, ks, vs = _paged_batch(g, [6, 11], 4, 2, 32, torch.float8_e4m3fn)
    q = _rand(g, 2, 4, 32, dtype=torch.float8_e4m3fn)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV),
                                                    backend="reference")
    w.plan(indptr, idx, last, 4, 2, 32, 4, q_data_type="e4m3", o_data_type=torch.float16)
    torch._dynamo.reset()
    try:
        got = torch.compile(lambda q, c: w.run(q, c, q_scale=0.5), fullgraph=True, backend="eager")(q, cache)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, w.run(q, cache, q_scale=0.5))


# ----------------------------------------------------------------------------- bad input
def _decode_plan(qd, od=None, backend="triton"):
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=DEV),
                                                    backend=backend)
    w.plan(_indptr([1, 1]), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32),
           4, 2, 32, 4, q_data_type=qd, kv_data_type=torch.float8_e4m3fn, o_data_type=od)
    return w, torch.randn(2, 2, 4, 2, 32).to(torch.float8_e4m3fn).to(DEV)


def test_q_dtype_against_the_plan():
    w, cache = _decode_plan(torch.float16)
    with pytest.raises(TypeError, match=r"^q: got dtype e4m3, expected fp16"):
        w.run(torch.randn(2, 4, 32).to(torch.float8_e4m3fn).to(DEV), cache)
    w, cache = _decode_plan("e4m3", torch.float16)
    with pytest.raises(TypeError, match=r"^q: got dtype fp16, expected e4m3"):
        w.run(torch.randn(2, 4, 32).half().to(DEV), cache)
    with pytest.raises(TypeError, match=r"^q: got dtype e5m2, expected e4m3"):
        w.run(torch.randn(2, 4, 32).to(torch.float8_e5m2).to(DEV), cache)


def test_fp8_output_refused_with_the_upcast_rule():
    with pytest.raises(BackendSelectionError, match=r"upcasts an fp8 q exactly to fp16.*o_data_type=torch.float16"):
        _decode_plan("e4m3", None)  # default output dtype: q's (e4m3), which Triton does not write
    q, k, v = (torch.randn(3, 2, 32).to(torch.float8_e5m2).to(DEV) for _ in range(3))
    with pytest.raises(BackendSelectionError, match=r"q has dtype e5m2.*output dtype is e5m2 \(o_dtype"):
        attncore.single_prefill_with_kv_cache(q, k, v, o_dtype=torch.float8_e5m2, backend="triton")
    with pytest.raises(TypeError, match=r"^o_dtype: got 'int8'"):
        attncore.single_prefill_with_kv_cache(q, k, v, o_dtype="int8")


def test_single_prefill_under_compile_refuses_an_fp8_q():
    import torch._dynamo

    q, k, v = (torch.randn(3, 2, 32).to(torch.float8_e4m3fn).to(DEV) for _ in range(3))
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match=r"q: an fp8 q is not supported under torch.compile"):
            torch.compile(lambda q: attncore.single_prefill_with_kv_cache(q, k, v, o_dtype=torch.float16),
                          fullgraph=True, backend="eager")(q)
    finally:
        torch._dynamo.reset()


def test_upcast_buffer_needs_workspace_room():
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8, device=DEV),
                                                    backend="reference")
    with pytest.raises(WorkspaceTooSmall, match=r"^float_workspace_buffer: the fp8 q upcast to fp16 needs 65536"):
        w.plan(_indptr([1] * 64), torch.zeros(64, dtype=torch.int32), torch.ones(64, dtype=torch.int32), 4, 2, 128,
               4, q_data_type="e4m3", kv_data_type="e4m3", o_data_type="fp16")


def test_explain_says_the_query_is_upcast(capsys):
    from attncore.cli.main import main

    assert main(["explain", "--op", "batch_decode", "--device", "cpu", "--q-dtype", "e5m2", "--kv-dtype", "e5m2",
                 "--out-dtype", "float32", "--heads", "8/2"]) == 0
    text = capsys.readouterr().out
    assert "problem: batch_decode cpu fp32/e5m2->fp32" in text
    assert "note: q has dtype e5m2: attncore upcasts an fp8 q exactly to fp32" in text


def test_compute_dtype_rule():
    from attncore.core import fp8_query

    assert fp8_query.compute_dtype(torch.float8_e4m3fn, torch.bfloat16) == torch.bfloat16
    assert fp8_query.compute_dtype(torch.float8_e4m3fn, None) == torch.float16
    assert fp8_query.compute_dtype(torch.float8_e5m2, torch.float8_e4m3fn) == torch.float16
    assert fp8_query.compute_dtype(torch.bfloat16, torch.float32) == torch.bfloat16  # not fp8: itself


# ----------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.parametrize("backend", ["cuda_fa2", "triton", "auto"])
@pytest.mark.parametrize("qd", FP8)
@pytest.mark.parametrize("compute", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv", ["fp8", "compute"])
def test_gpu_batch_decode(backend, qd, compute, kv):
    g = torch.Generator().manual_seed(21)
    hq, hkv, d, page, kv_lens = 32, 8, 128, 16, [100, 1, 513, 64]
    cache, indptr, idx, last, ks, vs = _paged_batch(g, kv_lens, page, hkv, d, _kv_dtype(kv, qd, compute))
    q = _rand(g, 4, hq, d, dtype=qd)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, backend=backend)
    w.plan(indptr, idx, last, hq, hkv, d, page, q_data_type=qd, kv_data_type=cache.dtype, o_data_type=compute)
    out, lse = w.run(q, cache, q_scale=0.5, return_lse=True)
    for i in range(4):
        _check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], ks[i], vs[i], compute, compute, q_scale=0.5)
    w.plan(indptr, idx, last, hq, hkv, d, page, q_data_type=compute, kv_data_type=cache.dtype)
    assert torch.equal(out, w.run(q.to(compute), cache, q_scale=0.5))


@gpu
@pytest.mark.parametrize("backend", ["cuda_fa2", "triton", "auto"])
@pytest.mark.parametrize("qd", FP8)
@pytest.mark.parametrize("compute", [torch.float16, torch.bfloat16])
def test_gpu_prefill(backend, qd, compute):
    g = torch.Generator().manual_seed(23)
    hq, hkv, d, page = 16, 4, 128, 16
    qo, kv_lens = [70, 1, 128], [200, 40, 128]
    cache, indptr, idx, last, ks, vs = _paged_batch(g, kv_lens, page, hkv, d, qd)
    qi = _indptr(qo)
    q = _rand(g, sum(qo), hq, d, dtype=qd)
    w = attncore.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV),
                                                     backend=backend)
    w.plan(qi, indptr, idx, last, hq, hkv, d, page, causal=True, q_data_type=qd, o_data_type=compute)
    out = w.run(q, cache, k_scale=0.5)
    for i in range(len(qo)):
        a, b = int(qi[i]), int(qi[i + 1])
        _check(out[a:b], None, q[a:b], ks[i], vs[i], compute, compute, causal=True, k_scale=0.5)
    s_out = attncore.single_prefill_with_kv_cache(q[:70], ks[0], vs[0], o_dtype=compute, causal=True, k_scale=0.5,
                                                  backend=backend)
    _check(s_out, None, q[:70], ks[0], vs[0], compute, compute, causal=True, k_scale=0.5)
    assert torch.equal(s_out, attncore.single_prefill_with_kv_cache(q[:70].to(compute), ks[0], vs[0], causal=True,
                                                                    k_scale=0.5, backend=backend))


@gpu
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("backend", ["xqa", "auto"])
def test_gpu_trtllm_decode_fp8_query(out_dtype, backend):
    # FlashInfer's trtllm decode case ("fp8", "fp8", "fp8"): e4m3 query and cache, e4m3 output (xqa writes it)
    g = torch.Generator().manual_seed(29)
    qd, hq, hkv, d, page, kv_lens = torch.float8_e4m3fn, 32, 8, 128, 32, [300, 7, 1024]
    npages = [-(-n // page) for n in kv_lens]
    table = torch.zeros(3, max(npages), dtype=torch.int32)
    perm, p0 = torch.randperm(sum(npages), generator=g).to(torch.int32), 0
    for i, c in enumerate(npages):
        table[i, :c] = perm[p0:p0 + c]
        p0 += c
    cache = _rand(g, sum(npages), 2, hkv, page, d, dtype=qd)  # HND, as trtllm takes it
    q = _rand(g, 3, hq, d, dtype=qd)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    out = attncore.decode.trtllm_batch_decode_with_kv_cache(q, cache, ws, table.to(DEV), torch.tensor(kv_lens).int().to(DEV),
                                                     max(kv_lens), 0.08, 1.0, out_dtype=out_dtype, backend=backend)
    assert out.dtype == out_dtype
    for i, n in enumerate(kv_lens):
        pages = table[i, :npages[i]].long().to(DEV)
        k, v = (cache[pages, j].transpose(1, 2).reshape(-1, hkv, d)[:n] for j in (0, 1))
        _check(out[i:i + 1], None, q[i:i + 1], k, v, out_dtype, torch.float16, sm_scale=0.08)
