"""attncore.core.uploads: a batch's host index tables are staged and sent with the backend's own tables in one
copy (triton), or around plan() for any other backend (issue 15 item 1: host time of plan())."""

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
        out = w.run(q, cache)
        k, v = cache[:, 0], cache[:, 1]
        kv_len = meta.kv_lens_host
        for i in range(b):
            pages = indices[indptr[i]:indptr[i + 1]].long()
            ki = k[pages].reshape(-1, HKV, D)[:kv_len[i]]
            vi = v[pages].reshape(-1, HKV, D)[:kv_len[i]]
            go, _, bo, _ = golden_and_baseline(q[i:i + 1], ki, vi, dtype=torch.float16, causal=True)
            assert max_error(out[i:i + 1].double(), go) <= tolerance(bo, go, torch.float16)


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
