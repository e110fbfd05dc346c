"""attncore.mla.BatchMLAPagedAttentionWrapper (paged DeepSeek MLA) against the fp64 golden.

CPU: the Triton kernel through the interpreter (fp16, fp32) and the reference backend, small latent dims
(64 + 16) plus one DeepSeek-sized case (512 + 64).  GPU (``-m gpu``): bf16 / fp16 at FlashInfer's sizes,
CUDA-graph capture and replay after a re-plan.
"""

from __future__ import annotations

import math

import pytest
import torch

import attncore
from attncore.reference import mla as ref
from attncore.testing.golden import dtype_attention, max_error, tolerance

GPU = torch.cuda.is_available()


def make_batch(kv_lens, qo_lens, heads, dc=64, dp=16, page_size=16, dtype=torch.float16, device="cpu", seed=0,
               spare_pages=3, nan_tail=False):
    """Random inputs with a shuffled page table (and a few pages no request uses)."""
    g = torch.Generator().manual_seed(seed)
    npages = [math.ceil(n / page_size) for n in kv_lens]
    total = sum(npages) + spare_pages
    perm = torch.randperm(total, generator=g).to(torch.int32)
    kv_indptr = torch.tensor([0] + list(torch.tensor(npages, dtype=torch.int64).cumsum(0)), dtype=torch.int32)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens, dtype=torch.int64).cumsum(0)), dtype=torch.int32)
    nnz = int(qo_indptr[-1])
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    b = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=perm[: int(kv_indptr[-1])].clone(),
             kv_lens=torch.tensor(kv_lens, dtype=torch.int32), q_nope=rnd(nnz, heads, dc), q_pe=rnd(nnz, heads, dp),
             ckv=rnd(total, page_size, dc), kpe=rnd(total, page_size, dp))
    if nan_tail:  # slots past each request's length in its last page
        for i, n in enumerate(kv_lens):
            if n % page_size:
                last = int(b["kv_indices"][int(kv_indptr[i + 1]) - 1])
                b["ckv"][last, n % page_size:] = float("nan")
                b["kpe"][last, n % page_size:] = float("nan")
    return {k: v.to(device) for k, v in b.items()}


def plan(w, b, *, causal, sm_scale=None, dtype=None):
    h, dc = b["q_nope"].shape[1:]
    dtype = dtype or b["q_nope"].dtype
    w.plan(b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["kv_lens"], h, dc, b["q_pe"].shape[2],
           b["ckv"].shape[1], causal, sm_scale or 1.0 / math.sqrt(dc + b["q_pe"].shape[2]), dtype, dtype)


def check(out, lse, b, *, causal, sm_scale=None):
    """Each request against the fp64 reference, within attncore.testing.golden's tolerance rule (the yardstick:
    the same attention in the input dtype, golden.dtype_attention).  Computed where the inputs are (fp64 on a
    GPU is fast), compared on the CPU."""
    dtype, dev = b["q_nope"].dtype, b["q_nope"].device
    dc, dp = b["q_nope"].shape[2], b["q_pe"].shape[2]
    sm_scale = sm_scale or 1.0 / math.sqrt(dc + dp)
    qo, kvp = b["qo_indptr"].tolist(), b["kv_indptr"].tolist()
    for i, n in enumerate(b["kv_lens"].tolist()):
        q0, q1 = qo[i], qo[i + 1]
        if q0 == q1:
            continue
        ckv, kpe = ref.gather_request(b["ckv"], b["kpe"], b["kv_indices"][kvp[i]:kvp[i + 1]], n)
        qn, qp = b["q_nope"][q0:q1], b["q_pe"][q0:q1]
        go, gl = (x.cpu() for x in ref.mla_request(qn, qp, ckv, kpe, causal=causal, sm_scale=sm_scale,
                                                    dtype=torch.float64))
        bo, bl = dtype_attention(torch.cat([qn, qp], -1), torch.cat([ckv, kpe], -1)[:, None], ckv[:, None],
                                 dtype=dtype, causal=causal, sm_scale=sm_scale, device=dev)
        err, tol = max_error(out[q0:q1].cpu(), go), tolerance(bo, go, dtype)
        assert err <= tol, f"request {i} (qo {q1 - q0}, kv {n}): out error {err:.3g} > {tol:.3g}"
        if lse is not None:
            err, tol = max_error(lse[q0:q1].cpu(), gl), tolerance(bl, gl, dtype, kind="lse")
            assert err <= tol, f"request {i} (qo {q1 - q0}, kv {n}): lse error {err:.3g} > {tol:.3g}"


def new(backend="auto", **kw):
    return attncore.BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.int8), backend=backend, **kw)


# --------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("qo", [1, 3])
def test_mla_matches_golden(dtype, causal, page_size, qo):
    # kv 0 (no key: out 0, lse -inf), 1, a page boundary (16), one past it; causal rows with qo > kv see fewer keys
    b = make_batch([0, 1, 16, 17], [qo] * 4, heads=16, page_size=page_size, dtype=dtype, seed=qo + page_size)
    w = new()
    plan(w, b, causal=causal)
    assert w._impl == "triton"
    out, lse = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    check(out, lse, b, causal=causal)
    assert torch.all(out[: qo] == 0) and torch.all(lse[: qo] == float("-inf"))  # the kv_len 0 request


@pytest.mark.parametrize("heads", [3, 40])
def test_mla_heads_not_multiple_of_block(heads):
    # 3: one head block padded to 16 rows; 40: a full block of 32 heads and a partial one
    b = make_batch([5, 33, 70], [2, 1, 4], heads=heads, seed=heads)
    w = new()
    plan(w, b, causal=True)
    out, lse = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], return_lse=True)
    check(out, lse, b, causal=True)


def test_mla_deepseek_dims_batch1():
    b = make_batch([37], [2], heads=16, dc=512, dp=64, page_size=16)
    w = new("fa2")
    plan(w, b, causal=True, sm_scale=1.0 / math.sqrt(192))
    out, lse = w.run_return_lse(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"])
    check(out, lse, b, causal=True, sm_scale=1.0 / math.sqrt(192))


def test_mla_nan_past_kv_len():
    b = make_batch([17, 33, 9], [3, 3, 3], heads=16, page_size=16, nan_tail=True, seed=5)
    w = new()
    plan(w, b, causal=False)
    out, lse = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check(out, lse, b, causal=False)


def test_mla_out_and_lse_given():
    b = make_batch([20, 0, 7], [2, 1, 3], heads=16, seed=7)
    w = new()
    plan(w, b, causal=False)
    o_ref, l_ref = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], return_lse=True)
    out, lse = torch.full_like(o_ref, float("nan")), torch.full_like(l_ref, float("nan"))
    got = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], out=out, lse=lse)  # lse written without return_lse
    assert got is out
    assert torch.equal(out, o_ref) and torch.equal(lse, l_ref)
    o2, l2 = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], out=out, lse=lse, return_lse=True)
    assert o2 is out and l2 is lse
    assert w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"]).shape == o_ref.shape  # no lse asked, none needed


def test_mla_reference_backend():
    b = make_batch([0, 18, 40], [2, 2, 5], heads=6, dc=48, dp=8, dtype=torch.float32, seed=3)  # any head dims
    w = new("reference")
    plan(w, b, causal=True)
    out, lse = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], return_lse=True)
    check(out, lse, b, causal=True)


def test_reference_matches_golden_attention():
    # the MLA reference in fp64 is the generic golden with one KV head, k = ckv|kpe, v = ckv
    from attncore.testing.golden import golden_attention

    g = torch.Generator().manual_seed(1)
    qn, qp = torch.randn(4, 5, 32, generator=g), torch.randn(4, 5, 16, generator=g)
    ckv, kpe = torch.randn(9, 32, generator=g), torch.randn(9, 16, generator=g)
    o, l = ref.mla_request(qn, qp, ckv, kpe, causal=True, sm_scale=0.3, dtype=torch.float64)
    go, gl = golden_attention(torch.cat([qn, qp], -1), torch.cat([ckv, kpe], -1)[:, None], ckv[:, None],
                              causal=True, sm_scale=0.3)
    assert max_error(o, go) < 1e-12 and max_error(l, gl) < 1e-12


def test_mla_cuda_graph_buffers():
    """use_cuda_graph=True: every plan copies into the buffers given at construction (their addresses are what
    a captured launch keeps), re-plans with other lengths and page tables stay correct; the launch is fixed
    at the first plan.  (Capture itself: the GPU test.)"""
    bufs = dict(qo_indptr=torch.empty(4, dtype=torch.int32), kv_indptr=torch.empty(4, dtype=torch.int32),
                kv_indices=torch.empty(64, dtype=torch.int32), kv_len_arr=torch.empty(3, dtype=torch.int32))
    w = new(use_cuda_graph=True, **bufs)
    assert w.is_cuda_graph_enabled
    ptrs = {k: v.data_ptr() for k, v in bufs.items()}
    for seed, lens in enumerate(([0, 0, 0], [17, 1, 40], [33, 16, 2])):
        b = make_batch(lens, [2, 2, 2], heads=16, seed=seed)
        plan(w, b, causal=False)
        assert {k: getattr(w._plan, a).data_ptr() for k, a in (("qo_indptr", "qo_dev"), ("kv_indptr", "kv_indptr_dev"),
                ("kv_indices", "kv_indices_dev"), ("kv_len_arr", "kv_lens_dev"))} == ptrs
        out, lse = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], return_lse=True)
        check(out, lse, b, causal=False)
    b = make_batch([5, 5, 5], [1, 1, 9], heads=16)
    with pytest.raises(ValueError, match="qo_indptr: this use_cuda_graph wrapper's launch was fixed"):
        plan(w, b, causal=False)
    b = make_batch([5, 5], [1, 1], heads=16)
    with pytest.raises(ValueError, match="built for 3"):
        plan(w, b, causal=False)
    with pytest.raises(ValueError, match="kv_len_arr: use_cuda_graph=True needs"):
        new(use_cuda_graph=True, **{**bufs, "kv_len_arr": None})
    with pytest.raises(ValueError, match="kv_indptr: got a buffer of 3 entries, expected 4"):
        new(use_cuda_graph=True, **{**bufs, "kv_indptr": torch.empty(3, dtype=torch.int32)})


@pytest.mark.parametrize("backend, match", [
    ("fa3", "no separate FA3 backend"), ("cutlass", "no CUTLASS"), ("trtllm-gen", "TensorRT-LLM-gen"),
    ("xqa", "has no MLA kernel"), ("nope", "not a known backend")])
def test_mla_backend_refused(backend, match):
    with pytest.raises(ValueError, match=match):
        new(backend)


def test_mla_bad_input():
    b = make_batch([10, 20], [1, 2], heads=16, seed=2)
    q, qp, ckv, kpe = b["q_nope"], b["q_pe"], b["ckv"], b["kpe"]
    w = new()
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(q, qp, ckv, kpe)
    h = q.shape[1]

    def bad_plan(match, exc=ValueError, **over):
        a = dict(qo_indptr=b["qo_indptr"], kv_indptr=b["kv_indptr"], kv_indices=b["kv_indices"],
                 kv_len_arr=b["kv_lens"], num_heads=h, head_dim_ckv=64, head_dim_kpe=16, page_size=16, causal=False,
                 sm_scale=0.1, q_data_type=torch.float16, kv_data_type=torch.float16)
        a.update(over)
        with pytest.raises(exc, match=match):
            w.plan(**a)

    bad_plan("kv_len_arr: got kv_len_arr\\[1\\] = 40 for a request of 2 pages", kv_len_arr=torch.tensor([10, 40], dtype=torch.int32))
    bad_plan("kv_indptr: got 2 entries, expected at least 3", kv_indptr=b["kv_indptr"][:2])
    bad_plan("kv_indptr: not non-decreasing", kv_indptr=torch.tensor([0, 2, 1], dtype=torch.int32))
    bad_plan("qo_indptr: got dtype int64", TypeError, qo_indptr=b["qo_indptr"].long())
    bad_plan("kv_indices: got 2 entries, expected at least kv_indptr\\[-1\\] = 3", kv_indices=b["kv_indices"][:2])
    bad_plan("kv_indices: got a negative page id", kv_indices=-b["kv_indices"] - 1)
    bad_plan("head_dim_ckv: got 48; the Triton MLA kernel takes powers of two", head_dim_ckv=48)
    bad_plan("num_heads: got 0", num_heads=0)
    bad_plan("kv_data_type: got torch.float32, expected q_data_type", TypeError, kv_data_type=torch.float32)
    bad_plan("q_data_type: got torch.bfloat16", TypeError, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    bad_plan("sm_scale: required", TypeError, sm_scale=None)
    bad_plan("sm_scale", ValueError, sm_scale=-1.0)
    bad_plan("use_profiler", use_profiler=True)
    bad_plan("page_size: got 0", page_size=0)

    plan(w, b, causal=False, sm_scale=0.1)
    with pytest.raises(ValueError, match="q_nope: got shape \\[3, 16, 32\\], expected \\[3, 16, 64\\]"):
        w.run(q[..., :32], qp, ckv, kpe)
    with pytest.raises(ValueError, match="q_pe: got shape \\[3, 16\\], expected \\[3, 16, 16\\]"):
        w.run(q, qp[:, 0], ckv, kpe)
    with pytest.raises(TypeError, match="q_nope: got dtype fp32, expected fp16"):
        w.run(q.float(), qp, ckv, kpe)
    with pytest.raises(TypeError, match="ckv_cache: got dtype fp32"):
        w.run(q, qp, ckv.float(), kpe)
    with pytest.raises(ValueError, match="kpe_cache: got shape"):
        w.run(q, qp, ckv, kpe[:2])
    with pytest.raises(ValueError, match="kv_indices: page id \\d+ is out of range for a cache of 2 pages"):
        w.run(q, qp, ckv[:2], kpe[:2])
    with pytest.raises(ValueError, match="out: got shape"):
        w.run(q, qp, ckv, kpe, out=torch.empty(3, 16, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match="lse: got dtype fp16, expected fp32"):
        w.run(q, qp, ckv, kpe, lse=torch.empty(3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="page_table: FlashInfer's cutlass-backend argument"):
        w.run(q, qp, ckv, kpe, page_table=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="profiler_buffer"):
        w.run(q, qp, ckv, kpe, profiler_buffer=torch.zeros(4))


def test_mla_kv_indptr_longer_than_the_batch():
    # FlashInfer reads kv_indptr's first batch_size + 1 entries (the batch is qo_indptr's); its varlen MLA test
    # passes two more.  The result equals the trimmed table's; the extra entries are not checked or read.
    b = make_batch([5, 17, 33], [2, 1, 3], heads=16, seed=4)
    w = new()
    plan(w, b, causal=True)
    ref_out, ref_lse = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], return_lse=True)
    longer = dict(b, kv_indptr=torch.cat([b["kv_indptr"], torch.tensor([999, 0], dtype=torch.int32)]))
    plan(w, longer, causal=True)
    out, lse = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    check(out, lse, b, causal=True)


def test_flashinfer_positional_plan():
    # FlashInfer 0.2.14's positional order, as its test_deepseek_mla.py calls plan()/run()
    b = make_batch([7, 30], [1, 1], heads=16, seed=11)
    w = attncore.mla.BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.int8), False, None, None, None, None, "fa2")
    w.plan(b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["kv_lens"], 16, 64, 16, 16, True, 0.125,
           torch.float16, torch.float16)
    out, lse = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], None, None, True)
    check(out, lse, b, causal=True, sm_scale=0.125)
    assert (w._causal, w._sm_scale, w._page_size) == (True, 0.125, 16)


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("causal, qo", [(False, 1), (True, 5), (False, 17)])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_gpu(dtype, page_size, causal, qo, heads):
    lens = [0, 1, 17, 514, 2743] if not causal else [5, 64, 514, 2743]
    b = make_batch(lens, [qo] * len(lens), heads=heads, dc=512, dp=64, page_size=page_size, dtype=dtype,
                   device="cuda", seed=page_size + qo, nan_tail=True)
    w = attncore.BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.int8, device="cuda"), backend="fa2")
    plan(w, b, causal=causal, sm_scale=1.0 / math.sqrt(192))
    out, lse = w.run(b["q_nope"], b["q_pe"], b["ckv"], b["kpe"], return_lse=True)
    check(out, lse, b, causal=causal, sm_scale=1.0 / math.sqrt(192))


@pytest.mark.gpu
def test_mla_gpu_cuda_graph_replay_after_replan():
    dev = "cuda"
    bufs = dict(qo_indptr=torch.empty(4, dtype=torch.int32, device=dev), kv_indptr=torch.empty(4, dtype=torch.int32, device=dev),
                kv_indices=torch.empty(4096, dtype=torch.int32, device=dev), kv_len_arr=torch.empty(3, dtype=torch.int32, device=dev))
    w = attncore.BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.int8, device=dev), use_cuda_graph=True, **bufs)
    warm = make_batch([0, 0, 0], [1, 1, 1], heads=128, dc=512, dp=64, page_size=16, dtype=torch.bfloat16, device=dev)
    b = make_batch([300, 1, 1000], [1, 1, 1], heads=128, dc=512, dp=64, page_size=16, dtype=torch.bfloat16, device=dev,
                   seed=4, spare_pages=40)
    plan(w, warm, causal=False)
    q, qp = b["q_nope"].clone(), b["q_pe"].clone()
    ckv, kpe = b["ckv"], b["kpe"]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            w.run(q, qp, ckv, kpe, return_lse=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = w.run(q, qp, ckv, kpe, return_lse=True)
    plan(w, b, causal=False)
    out.fill_(0)
    lse.fill_(0)
    g.replay()
    torch.cuda.synchronize()
    check(out, lse, b, causal=False)
