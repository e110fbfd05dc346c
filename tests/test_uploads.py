"""attncore.core.uploads: a batch's host index tables are staged and sent with the backend's own tables in one
copy (triton), or around plan() for any other backend (issue 15 item 1: host time of plan())."""

import numpy as np
import pytest
import torch

import attncore
from attncore.core import uploads
from attncore.core.backend import AttnParams, Backend, BatchMeta
from attncore.testing.golden import golden_and_baseline, max_error, tolerance

H, HKV, D, PAGE = 4, 2, 32, 4


def _table(b, seed):
    g = torch.Generator().manual_seed(seed)
    npages = torch.randint(1, 4, (b,), generator=g)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), npages.cumsum(0)]).to(torch.int32)
    indices = torch.randperm(int(indptr[-1]), generator=g).to(torch.int32)
    last = torch.randint(1, PAGE + 1, (b,), generator=g, dtype=torch.int32)
    return indptr, indices, last


def _check_golden(out, q, cache, indptr, indices, kv_lens, qo_per_req):
    """Each request of a paged batch (causal, bottom-right) against the fp64 golden, by the project's rule."""
    k, v = cache[:, 0].cpu(), cache[:, 1].cpu()
    q, out = q.cpu(), out.cpu()
    for i in range(len(kv_lens)):
        pages = indices[indptr[i]:indptr[i + 1]].long()
        ki = k[pages].reshape(-1, HKV, k.shape[-1])[:kv_lens[i]]
        vi = v[pages].reshape(-1, HKV, v.shape[-1])[:kv_lens[i]]
        rows = slice(i * qo_per_req, (i + 1) * qo_per_req)
        go, _, bo, _ = golden_and_baseline(q[rows], ki, vi, dtype=q.dtype, causal=True)
        assert max_error(out[rows].double(), go) <= tolerance(bo, go, q.dtype), f"request {i}"


def test_host_tables_are_staged_and_a_plain_backend_gets_them_sent_before_plan():
    iw = torch.empty(1 << 16, dtype=torch.uint8)
    indptr, indices, last = _table(3, 0)
    meta = BatchMeta.paged([0, 1, 2, 3], indptr, indices, last, PAGE, device="cpu", params=AttnParams(1.0),
                           decode=True, int_workspace=iw, memo={})
    st = meta.staged
    assert isinstance(st, uploads.Staged) and not st.sent
    assert meta.kv_indices.tolist() == indices.tolist()  # on the CPU readable at once, as before
    seen = []

    class Plain(Backend):
        name = "plain_test"

        def plan(self, problem, meta):
            seen.append(meta.staged.sent)
            return meta

    Plain().plan(None, meta)
    assert seen == [True] and st.sent


def test_a_backend_that_sends_them_gets_them_unsent_and_they_are_sent_after_plan_anyway():
    iw = torch.empty(1 << 16, dtype=torch.uint8)
    meta = BatchMeta.paged([0, 1], *_table(1, 1), PAGE, device="cpu", params=AttnParams(1.0), decode=True,
                           int_workspace=iw)
    seen = []

    class Merging(Backend):
        name = "merging_test"
        sends_index_tables = True

        def plan(self, problem, meta):
            seen.append(meta.staged.sent)
            raise ValueError("refused")

    try:
        Merging().plan(None, meta)
    except ValueError:
        pass
    assert seen == [False] and meta.staged.sent


def test_device_parts_are_not_staged():
    iw = torch.empty(1 << 12, dtype=torch.uint8)
    views, rest, st = uploads.index_tables(iw, torch.device("cpu"), [[0, 1, 2], torch.tensor([5, 6], dtype=torch.int32)])
    assert st is not None and [v.tolist() for v in views] == [[0, 1, 2], [5, 6]]
    assert rest.numel() < iw.numel() and views[0].data_ptr() >= rest.data_ptr() + rest.numel()


def test_merged_image_needs_the_tables_before_the_staged_ones():
    iw = torch.empty(1 << 12, dtype=torch.uint8)
    views, rest, st = uploads.index_tables(iw, torch.device("cpu"), [[0, 7, 9]])
    buf = uploads.tables_buffer(rest, st, 100)
    assert buf.data_ptr() % 256 == 0 and buf.data_ptr() + 100 <= views[0].data_ptr()
    raw, size = uploads.merged_image(st, buf[:100], 100)
    assert st.sent and size == views[0].data_ptr() + 12 - buf.data_ptr()
    assert raw[-12:].view("int32").tolist() == [0, 7, 9]
    st.sent = False
    try:
        uploads.merged_image(st, rest[:100], rest.numel() + 8)  # ends inside the index tables
        raise AssertionError("expected an error")
    except RuntimeError as e:
        assert "tables_buffer" in str(e)


def test_triton_sends_index_and_work_tables_in_one_copy_and_stays_correct():
    from attncore.kernels import interpreting

    if not interpreting():  # CPU tensors: Triton's interpreter (a GPU run leaves TRITON_INTERPRET unset)
        pytest.skip("CPU tensors through Triton's interpreter, which TRITON_INTERPRET (unset here) selects")
    ws = torch.empty(1 << 22, dtype=torch.uint8)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="triton")
    cache = torch.randn(16, 2, PAGE, HKV, D).half()
    for b, seed in ((3, 2), (1, 3), (5, 4), (3, 5)):
        indptr, indices, last = _table(b, seed)
        w.plan(indptr, indices, last, H, HKV, D, PAGE, q_data_type=torch.float16)
        plan = w._planned._primary[1]
        meta = plan.meta
        assert meta.staged.sent
        end = meta.kv_lens.data_ptr() + 4 * meta.kv_lens.numel()  # the last index table
        up = plan.upload
        assert up.dst.data_ptr() == plan.counts.data_ptr() and up.dst.data_ptr() + up.dst.numel() == end
        q = torch.randn(b, H, D).half()
        _check_golden(w.run(q, cache), q, cache, indptr, indices, meta.kv_lens_host, 1)


def test_cuda_fa2_run_structs_are_made_once_per_signature_and_scales():
    """cuda_fa2's build_params (checkable without a GPU): a repeated run() of one signature reuses its launch
    structs and sets only the pointers; other scales get their own structs (host time of run())."""
    from types import SimpleNamespace

    from attncore.backends.cuda_fa2 import binding

    q, k, v, out = (torch.empty(4, 2, 16) for _ in range(4))
    args = SimpleNamespace(q=q, k=k, v=v, out=out, lse=None, sinks=None, q_scale=1.0, k_scale=1.0, v_scale=1.0,
                           o_scale=1.0)
    plan = SimpleNamespace(checked_sig=binding._signature(args), nnz_q=4, base=binding.Fa2Params(),
                           merge_base=binding.Fa2MergeParams(), needs_merge=True, structs={},
                           kv_strides=(0, 32, 16, 0, 32, 16), meta=SimpleNamespace(params=AttnParams(0.5)))
    p1, m1 = binding.build_params(plan, args)
    assert (p1.q, p1.o, m1.o) == (q.data_ptr(), out.data_ptr(), out.data_ptr()) and p1.q_stride_n == 32
    q2, out2 = torch.empty_like(q), torch.empty_like(out)
    p2, m2 = binding.build_params(plan, SimpleNamespace(**{**vars(args), "q": q2, "out": out2}))
    assert p2 is p1 and m2 is m1 and (p2.q, p2.o, m2.o) == (q2.data_ptr(), out2.data_ptr(), out2.data_ptr())
    p3, _ = binding.build_params(plan, SimpleNamespace(**{**vars(args), "k_scale": 2.0}))
    assert p3 is not p1 and abs(p3.scale_log2 - 2 * p1.scale_log2) < 1e-6 and len(plan.structs) == 2


class _CountUploads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts host-to-device copies (aten copy_ from a CPU tensor into a CUDA one)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ == "copy_" and args[0].is_cuda and not args[1].is_cuda:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
@pytest.mark.parametrize("backend,op", [("triton", "decode"), ("triton", "paged"), ("cuda_fa2", "decode"),
                                        ("cuda_fa2", "paged"), ("xqa", "decode")])
def test_gpu_plan_sends_one_copy_and_stays_correct(backend, op):
    """On a GPU, plan() with host index tensors makes ONE host-to-device copy (the index tables and the backend's
    tables together) and the runs of re-plans with other batch sizes equal the reference backend's."""
    from attncore.core import registry

    if backend not in registry.available_backends():
        pytest.skip(f"{backend} is not available here")
    dev, dt = "cuda", torch.float16
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    cache = torch.randn(64, 2, PAGE, HKV, 64, device=dev, dtype=dt)
    make = (attncore.BatchDecodeWithPagedKVCacheWrapper if op == "decode"
            else attncore.BatchPrefillWithPagedKVCacheWrapper)
    w = make(ws, "NHD", backend=backend)
    n = 1 if op == "decode" else 3
    for b, seed in ((3, 0), (8, 1), (1, 2), (5, 3)):
        indptr, indices, last = _table(b, seed)
        qo = torch.arange(b + 1, dtype=torch.int32) * n
        q = torch.randn(b * n, H, 64, device=dev, dtype=dt)
        args = (indptr, indices, last, H, HKV, 64, PAGE) if op == "decode" else (qo, indptr, indices, last, H, HKV,
                                                                                  64, PAGE)
        kw = dict(q_data_type=dt) if op == "decode" else dict(q_data_type=dt, causal=True)
        w.plan(*args, **kw)  # warm: JIT builds, caches
        with _CountUploads() as c:
            w.plan(*args, **kw)
        assert c.n == 1, f"{backend} {op} batch {b}: {c.n} host-to-device copies in plan()"
        _check_golden(w.run(q, cache), q, cache, indptr, indices, w._planned.meta.kv_lens_host, n)


@pytest.mark.gpu
def test_gpu_upload_source_is_pageable_when_small_and_pinned_when_large_or_capturing():
    """Small host images go to the device from pageable memory (the driver stages them, no sync); images over
    PAGEABLE_MAX, and any copy while a CUDA graph captures (where a pageable copy is an error), from pinned memory.
    Each arrives intact although the host array changes right after the copy returns."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = torch.device("cuda")
    for n, pinned in ((256, False), (uploads.PAGEABLE_MAX // 4, False), (uploads.PAGEABLE_MAX // 4 + 1, True)):
        arr = np.arange(n, dtype=np.int32)
        src = uploads._source(arr, dev)
        assert src.is_pinned() == pinned, n
        dst = torch.empty(n, dtype=torch.int32, device=dev)
        torch.cuda._sleep(int(5e7))
        dst.copy_(src, non_blocking=True)
        arr[:] = -1
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), torch.arange(n, dtype=torch.int32)), n
    x = torch.zeros(1, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)  # something to capture
        assert uploads._source(np.arange(16, dtype=np.int32), dev).is_pinned()
