"""plan()'s host-time memos (issue 15 item 1): the plan-time scalars (``_api.make_params``), a wrapper's problem
of a plan signature (``_BatchWrapper._plan_with``), cuda_fa2's kernel keys and workspace layouts, a batch's
query lengths; and the faster host paths (page table through numpy, index tables through ``np.fromiter``, the
KV lengths without a loop).  Each memo: a hit, and a miss when any argument it is keyed by changes, with every
check still made (no argument accepted and ignored, errors never memoized)."""

import numpy as np
import pytest
import torch

import attncore
from attncore.core import _api, selector, uploads
from attncore.core.backend import AttnParams, BatchMeta
from attncore.core.checks import plain_key
from attncore.core.page_table import _TINY_TABLE, _paged_kv_lens, _read_page_table
from attncore.testing.golden import golden_and_baseline, max_error, tolerance

H, HKV, D, PAGE = 4, 2, 16, 4
P = dict(head_dim=64, sm_scale=None, logits_soft_cap=None, window_left=-1, pos_encoding_mode="NONE",
         rope_scale=None, rope_theta=None)


def _table(b, seed=0, max_pages=3):
    g = torch.Generator().manual_seed(seed)
    npages = torch.randint(1, max_pages + 1, (b,), generator=g)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), npages.cumsum(0)]).to(torch.int32)
    n = int(indptr[-1])
    return indptr, torch.randperm(n, generator=g).to(torch.int32), torch.randint(1, PAGE + 1, (b,), generator=g).to(
        torch.int32)


# ----------------------------------------------------------------------------- plain_key / make_params
def test_plain_key_tells_types_apart_and_refuses_tensors():
    assert plain_key(1, "a", None, torch.float16) == plain_key(1, "a", None, torch.float16)
    assert plain_key(True) != plain_key(1) and plain_key(1) != plain_key(1.0)
    assert plain_key(torch.tensor(1.0)) is None and plain_key(np.float32(1.0)) is None


def test_make_params_memo_hit_and_miss():
    a, b = _api.make_params(**P), _api.make_params(**P)
    assert a is b  # a hit: the same (frozen) object
    for name, value in (("head_dim", 128), ("sm_scale", 0.5), ("logits_soft_cap", 3.0), ("window_left", 7),
                        ("pos_encoding_mode", "ALIBI"), ("rope_scale", 2.0), ("rope_theta", 5e5)):
        c = _api.make_params(**{**P, name: value})
        assert c is not a
        field = {"head_dim": "sm_scale", "pos_encoding_mode": "pos_encoding_mode"}.get(name, name)
        expect = 1 / 128 ** 0.5 if name == "head_dim" else value
        assert getattr(c, field) == expect


def test_make_params_checks_every_call():
    _api.make_params(**{**P, "window_left": 1})  # memoized under the int 1 ...
    for _ in range(2):  # ... so True (a bool, refused) is not served from it; errors are never memoized
        with pytest.raises(ValueError, match=r"window_left: got True"):
            _api.make_params(**{**P, "window_left": True})
        with pytest.raises(ValueError, match=r"sm_scale: got -1"):
            _api.make_params(**{**P, "sm_scale": -1})
        with pytest.raises(ValueError, match=r"head_dim: got 63, ROPE_LLAMA needs an even head_dim"):
            _api.make_params(**{**P, "head_dim": 63, "pos_encoding_mode": "ROPE_LLAMA"})
    t = _api.make_params(**{**P, "sm_scale": np.float64(0.25)})  # not plain: checked and built, not memoized
    assert t.sm_scale == 0.25
    with pytest.raises(ValueError, match=r"sm_scale: got"):
        _api.make_params(**{**P, "sm_scale": np.float64(-0.25)})


# ----------------------------------------------------------------------------- the wrapper's problem memo
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_replan_reuses_the_problem_and_misses_on_any_change(backend, cpu_backend):
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend=backend)
    base = dict(q_data_type=torch.float16)
    w.plan(*_table(3, seed=1), H, HKV, D, PAGE, **base)
    first = w.problem
    w.plan(*_table(5, seed=2), H, HKV, D, PAGE, **base)  # new lengths and batch size, same signature
    assert w.problem is first and w._planned.meta.batch_size == 5
    changes = [  # (plan() change, what the problem must then say)
        (dict(q_data_type="float32"), lambda p: p.q_dtype == torch.float32),
        (dict(kv_data_type=torch.float32), lambda p: p.kv_dtype == torch.float32),
        (dict(o_data_type=torch.float32), lambda p: p.out_dtype == torch.float32),
        (dict(logits_soft_cap=5.0), lambda p: p.soft_cap),
        (dict(window_left=3), lambda p: p.window_left == 3),
        (dict(pos_encoding_mode="ALIBI"), lambda p: p.pos_encoding == "ALIBI"),
        (dict(return_lse=True), lambda p: p.return_lse),
        (dict(sinks=True), lambda p: p.sinks),
        (dict(fp8_scales=True), lambda p: p.fp8_scales),
        (dict(q_len_per_req=2), lambda p: p.q_len_per_req == 2),
    ]
    for change, ok in changes:
        try:
            w.plan(*_table(3, seed=3, max_pages=3), H, HKV, D, PAGE, **{**base, **change})
        except selector.BackendSelectionError as e:  # refused on this backend: refused for the changed value
            assert "fp32" in str(e) or "float32" in str(e), (change, str(e))
        else:
            assert w.problem is not first and ok(w.problem), change
        w.plan(*_table(3, seed=4), H, HKV, D, PAGE, **base)
        assert w.problem is first  # back to the first signature: a hit again
    w.plan(*_table(3, seed=5), 2 * H, HKV, D, PAGE, **base)
    assert w.problem.num_qo_heads == 2 * H
    w.plan(*_table(3, seed=5), H, H, D, PAGE, **base)
    assert w.problem.num_kv_heads == H
    w.plan(*_table(3, seed=5), H, HKV, 2 * D, PAGE, **base)
    assert w.problem.head_dim_qk == 2 * D
    w.plan(*_table(3, seed=5), H, HKV, D, 2 * PAGE, **base)
    assert w.problem.page_size == 2 * PAGE


def test_replan_still_checks_after_a_hit():
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="reference")
    w.plan(*_table(3), H, HKV, D, PAGE, q_data_type=torch.float16)
    for _ in range(2):
        with pytest.raises(TypeError, match=r"q_data_type: got 'float17'"):
            w.plan(*_table(3), H, HKV, D, PAGE, q_data_type="float17")
        with pytest.raises(TypeError, match=r"return_lse: got 1, expected None or a bool"):
            w.plan(*_table(3), H, HKV, D, PAGE, q_data_type=torch.float16, return_lse=1)
        with pytest.raises(TypeError, match=r"q_data_type: got int64"):
            w.plan(*_table(3), H, HKV, D, PAGE, q_data_type=torch.int64)
    indptr, indices, last = _table(3)
    bad = last.clone()
    bad[1] = PAGE + 1
    with pytest.raises(ValueError, match=r"last_page_len: got last_page_len\[1\] = 5"):
        w.plan(indptr, indices, bad, H, HKV, D, PAGE, q_data_type=torch.float16)
    # the sinks tensor in plan() plans "with sinks", as a bool would
    w.plan(indptr, indices, last, H, HKV, D, PAGE, q_data_type=torch.float16, sinks=torch.zeros(H))
    assert w.problem.sinks


def test_replan_prefill_mask_misses():
    w = attncore.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="reference")
    qo = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    w.plan(qo, *_table(3), H, HKV, D, PAGE, causal=True, q_data_type=torch.float16)
    causal = w.problem
    w.plan(qo, *_table(3, seed=2), H, HKV, D, PAGE, causal=True, q_data_type=torch.float16)
    assert w.problem is causal
    w.plan(qo, *_table(3, seed=2), H, HKV, D, PAGE, causal=False, q_data_type=torch.float16)
    assert w.problem.mask == "none" and w.problem is not causal


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_replans_with_new_lengths_stay_correct(backend, cpu_backend):
    """A serving loop's re-plans (same signature, new lengths and batch sizes) each give this step's result."""
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend=backend)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(40, 2, PAGE, HKV, D, generator=g).half()
    for step, b in enumerate((3, 3, 5, 1)):
        indptr, indices, last = _table(b, seed=10 + step, max_pages=4)
        w.plan(indptr, indices, last, H, HKV, D, PAGE, q_data_type=torch.float16)
        q = torch.randn(b, H, D, generator=g).half()
        out = w.run(q, cache)
        for i in range(b):
            pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
            n = (len(pages) - 1) * PAGE + int(last[i])
            k = cache[pages, 0].reshape(-1, HKV, D)[:n]
            v = cache[pages, 1].reshape(-1, HKV, D)[:n]
            go, _, bo, _ = golden_and_baseline(q[i:i + 1], k, v, dtype=torch.float16, causal=True)
            assert max_error(out[i:i + 1].double(), go) <= tolerance(bo, go, torch.float16)


# ----------------------------------------------------------------------------- cuda_fa2's memos (no GPU needed)
def test_cuda_fa2_key_for_memo_follows_every_knob(monkeypatch):
    from attncore.backends.cuda_fa2.backend import CudaFa2Backend
    from attncore.core.problem import AttentionProblem

    b = CudaFa2Backend()
    p = AttentionProblem(op="batch_decode", device_type="cuda", compute_capability=(9, 0), q_dtype=torch.bfloat16,
                         kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_qo_heads=8, num_kv_heads=2,
                         head_dim_qk=128, head_dim_vo=128, page_size=16)
    k = b.key_for(p, "decode", 16)
    assert b.key_for(p, "decode", 16) is k
    assert b.key_for(p, "decode", 4).prefetch and not k.prefetch
    assert b.key_for(p.replace(soft_cap=True), "decode", 16).softcap
    assert b.key_for(p.replace(q_dtype=torch.float16, kv_dtype=torch.float16), "decode", 16).dtype == "fp16"
    pf = p.replace(op="batch_prefill_paged", mask="causal")
    assert b.key_for(pf, "prefill90", 16).ws
    # the loop rule: pipelined (ping-pong) for contiguous K/V and paged d128, plain for paged d64; the memo keeps them
    # apart
    pf64 = pf.replace(head_dim_qk=64, head_dim_vo=64)
    assert b.key_for(pf64, "prefill90", 16, True).pipe is False and b.key_for(pf64, "prefill90", 0, False).pipe is True
    assert b.key_for(pf, "prefill90", 16, True).pipe is True
    monkeypatch.setattr(CudaFa2Backend, "sm90_ws", False)
    assert not b.key_for(pf, "prefill90", 0, False).pipe
    assert not b.key_for(pf, "prefill90", 16).ws
    monkeypatch.setattr(CudaFa2Backend, "sm90_pipe", True)
    assert b.key_for(pf, "prefill90", 16).pipe
    monkeypatch.setattr(CudaFa2Backend, "tune", (("cta_q", 64),))
    assert b.key_for(pf, "prefill90", 16).tune == (("cta_q", 64),)


def test_cuda_fa2_layouts_by_sizes():
    from attncore.backends.cuda_fa2.plan import _layouts

    f, i = _layouts(0, 8, 128, 4, 0, False)
    assert _layouts(0, 8, 128, 4, 0, False) == (f, i) and _layouts(0, 8, 128, 4, 0, False)[1] is i
    assert f.regions == [] and [r[0] for r in i.regions] == ["counts", "work", "sched"] and i.regions[1][1] == (4, 5)
    f2, i2 = _layouts(6, 8, 128, 9, 3, True)
    assert [r[0] for r in f2.regions] == ["part_o", "part_lse"] and f2.regions[0][1] == (6, 8, 128)
    assert [r[0] for r in i2.regions] == ["counts", "work", "merge", "alibi", "sched"] and i2.regions[2][1] == (3, 4)


def test_cuda_fa2_replans_on_the_cpu_fakes():
    """The wrapper's re-plans through cuda_fa2's real plan() (device, library and stream faked): the work table
    of every step is that step's, other sizes get other layouts."""
    import os
    import sys
    import unittest.mock as um

    from attncore.core import registry

    sys.path.insert(0, os.path.dirname(__file__))
    from test_cuda_fa2 import cpu_patches

    with cpu_patches() as stack:
        stack.enter_context(um.patch.object(_api, "device_info", lambda d: ("cuda", (9, 0))))
        stack.enter_context(um.patch.object(registry.entries()["cuda_fa2"], "_available", []))
        w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8), backend="cuda_fa2")
        for b, seed in ((4, 0), (4, 1), (7, 2)):
            indptr, indices, last = _table(b, seed=seed, max_pages=3)
            w.plan(indptr, indices, last, 8, 2, 128, PAGE, q_data_type=torch.bfloat16)
            plan = w._planned._primary[1]
            kv = w._planned.meta.kv_lens_host
            work = plan.work[:plan.num_items].tolist()
            assert sorted((r[0], r[3]) for r in work) == sorted(enumerate(kv))  # one item per request, its length
            assert plan.counts.tolist()[0] == plan.num_items == b


# ----------------------------------------------------------------------------- faster host paths
def test_qo_lens_follow_the_indptr_list():
    meta = BatchMeta.ragged(qo_indptr_host=[0, 2, 5], kv_indptr_host=[0, 3, 9], device="cpu",
                            params=AttnParams(1.0))
    assert meta.qo_lens_host == [2, 3] and meta.qo_lens_host is meta.qo_lens_host
    meta.qo_indptr_host = [0, 1, 5]  # a new list: new lengths
    assert meta.qo_lens_host == [1, 4]


@pytest.mark.parametrize("b", [1, 3, 40])
def test_paged_kv_lens_fast_path_equals_the_loop(b):
    g = torch.Generator().manual_seed(b)
    npages = torch.randint(0, 4, (b,), generator=g).tolist()
    indptr = [0]
    for n in npages:
        indptr.append(indptr[-1] + n)
    last = [int(x) if n else 0 for x, n in zip(torch.randint(1, PAGE + 1, (b,), generator=g), npages)]
    want = [(n - 1) * PAGE + lp if n else 0 for n, lp in zip(npages, last)]
    assert _paged_kv_lens(indptr, last, PAGE, "last") == want
    full = [max(n, 1) for n in npages]  # every request with pages: the path without a loop
    indptr = [0]
    for n in full:
        indptr.append(indptr[-1] + n)
    last = [max(x, 1) for x in last]
    assert _paged_kv_lens(indptr, last, PAGE, "last") == [(n - 1) * PAGE + lp for n, lp in zip(full, last)]
    for bad, msg in ((0, r"last\[0\] = 0, expected 1 <= last_page_len"), (PAGE + 1, r"last\[0\] = 5")):
        with pytest.raises(ValueError, match=msg):
            _paged_kv_lens(indptr, [bad] + last[1:], PAGE, "last")


@pytest.mark.parametrize("pages", [3, _TINY_TABLE + 1, 700])
def test_page_table_read_sizes(pages):
    """Tiny tables as Python ints, larger ones through numpy: the same min/max, ids and index tables."""
    indptr = torch.tensor([0, 1, pages], dtype=torch.int32)
    indices = torch.randperm(pages + 9)[:pages + 2].to(torch.int32)  # more entries than used
    last = torch.tensor([2, 3], dtype=torch.int32)
    ip, lp, used, (lo, hi), _ = _read_page_table(indptr, indices, last)
    assert ip == [0, 1, pages] and lp == [2, 3]
    ids = indices[:pages]
    assert (lo, hi) == (int(ids.min()), int(ids.max()))
    assert (used if isinstance(used, list) else used.tolist()) == ids.tolist()
    iw = torch.zeros(1 << 16, dtype=torch.uint8)
    meta = BatchMeta.paged([0, 1, 2], indptr, indices, last, PAGE, device="cpu", params=AttnParams(1.0),
                           int_workspace=iw, memo={})
    assert meta.kv_indices.tolist() == ids.tolist() and meta.max_page_id == hi
    assert meta.kv_lens.tolist() == [2, (pages - 2) * PAGE + 3] == meta.kv_lens_host


def test_index_tables_mixed_parts_and_overflow():
    iw = torch.zeros(4096, dtype=torch.uint8)
    t = torch.tensor([7, 8, 9], dtype=torch.int32)
    views, rest, staged = uploads.index_tables(iw, torch.device("cpu"), [[0, 1], t, [5]], memo={})
    assert [v.tolist() for v in views] == [[0, 1], [7, 8, 9], [5]] and staged.data.tolist() == [0, 1, 7, 8, 9, 5]
    with pytest.raises(OverflowError, match="out of bounds for int32"):
        uploads.index_tables(iw, torch.device("cpu"), [[0, 2 ** 31]], memo={})


def test_carve_tables_memo_hit_and_miss():
    """A re-plan of the same layout into the same buffer reuses the device views and span; another buffer,
    another layout or other staged index tables carve anew; the image always carries this plan's tables."""
    from attncore.core.workspace import WorkspaceLayout

    lay = WorkspaceLayout("t")
    lay.add("counts", (2,), torch.int32)
    lay.add("work", (3, 5), torch.int32)
    iw, memo = torch.zeros(1 << 16, dtype=torch.uint8), {}
    dev = torch.device("cpu")

    def staged(values):
        views, rest, st = uploads.index_tables(iw, dev, [values], memo=memo)
        return rest, st

    rest, st = staged([1, 2, 3])
    tabs, image, h, span = uploads.carve_tables(lay, rest, st, dev, memo)
    assert st.sent and image.view(np.int32)[-3:].tolist() == [1, 2, 3]
    rest2, st2 = staged([4, 5, 6])  # same sizes: same region, a hit
    tabs2, image2, h2, span2 = uploads.carve_tables(lay, rest2, st2, dev, memo)
    assert tabs2 is tabs and span2 is span and image2 is not image and image2.view(np.int32)[-3:].tolist() == [4, 5, 6]
    h2["work"][:] = 7
    uploads.send_image(image2, span2)
    assert tabs2["work"].tolist() == [[7] * 5] * 3 and iw[-12:].view(torch.int32).tolist() == [4, 5, 6]
    rest3, st3 = staged([1, 2, 3, 4])  # other staged sizes: another region, a miss (same aligned table address)
    tabs3, image3, _, span3 = uploads.carve_tables(lay, rest3, st3, dev, memo)
    assert image3.view(np.int32)[-4:].tolist() == [1, 2, 3, 4] and span3.numel() == image3.size
    assert sum(k[0] == "carve_tables" for k in memo if isinstance(k, tuple)) == 2
    lay2 = WorkspaceLayout("t")
    lay2.add("counts", (2,), torch.int32)
    lay2.add("work", (4, 5), torch.int32)
    rest4, st4 = staged([1, 2, 3])
    tabs4, *_ = uploads.carve_tables(lay2, rest4, st4, dev, memo)
    assert tabs4 is not tabs and tabs4["work"].shape == (4, 5)
    with pytest.raises(ValueError, match=r"int_workspace_buffer: t needs"):  # the size check on a miss
        uploads.carve_tables(lay, torch.zeros(64, dtype=torch.uint8), None, dev, memo)


# ----------------------------------------------------------------------------- xqa's memos (no GPU needed)
def test_xqa_key_for_memo_follows_every_knob(monkeypatch):
    from attncore.backends.xqa.backend import XqaBackend
    from attncore.core.problem import AttentionProblem

    b = XqaBackend()
    p = AttentionProblem(op="batch_decode", device_type="cuda", compute_capability=(9, 0), q_dtype=torch.bfloat16,
                         kv_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16, num_qo_heads=32, num_kv_heads=8,
                         head_dim_qk=128, head_dim_vo=128, page_size=16)
    k = b.key_for(p, 5)  # 20 rows of fp8 KV: one 32-row CTA by default
    assert b.key_for(p, 5) is k and k.mt == 2
    assert b.key_for(p, 1).mt == 1  # 4 rows
    monkeypatch.setattr(XqaBackend, "mt2_for_fp8", False)
    assert b.key_for(p, 5).mt == 1
    monkeypatch.setattr(XqaBackend, "tune", (("x", 1),))
    assert b.key_for(p, 5).tune == (("x", 1),)
    assert b.key_for(p.replace(kv_dtype=torch.bfloat16), 5).kv != k.kv


def test_xqa_layouts_by_sizes():
    from types import SimpleNamespace

    from attncore.backends.xqa import plan as xplan
    from attncore.core.problem import AttentionProblem

    p = AttentionProblem(op="xqa_decode", device_type="cuda", compute_capability=(9, 0), q_dtype=torch.bfloat16,
                         kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_qo_heads=32, num_kv_heads=8,
                         head_dim_qk=128, head_dim_vo=128, page_size=16)
    meta = SimpleNamespace(batch_size=3, q_len_per_req=2)
    a, offs = xplan.float_layout(p, meta, 24, 16, 4)
    assert xplan.float_layout(p, meta, 24, 16, 4)[0] is a
    assert [r[0] for r in a.regions] == ["stage", "part_lse", "part_o"] and a.regions[2][1] == (24, 4, 16, 128)
    assert offs["out"] == (3 * 2 * 32 * 128 * 2, 3 * 2 * 32 * 128 * 2) and "spec_mask" in offs
    b, offs_b = xplan.float_layout(p.replace(op="batch_decode", out_dtype=torch.float32), meta, 24, 16, 1)
    assert [r[0] for r in b.regions] == ["stage"] and "spec_mask" not in offs_b
    assert offs_b["out"][1] == 3 * 2 * 32 * 128 * 4
    assert xplan.choose_splits(8, 512, 264) == xplan.choose_splits(8, 512, 264) >= 16
    assert xplan.int_layout(24, 4, True) is xplan.int_layout(24, 4, True)
    assert [r[0] for r in xplan.int_layout(24, 1, False).regions] == []


# ----------------------------------------------------------------------------- GPU (the task-giver's H100)
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda_fa2", "xqa", "auto"])
@pytest.mark.parametrize("op", ["decode", "paged"])
def test_gpu_replans_of_one_signature_hit_the_memos_and_stay_correct(backend, op):
    """A serving loop's re-plans on a GPU: the same signature and batch size with new lengths each step (every
    memo hits: the problem, the layouts, the carved views) give each step's result (fp64 golden)."""
    from attncore.core import registry

    if backend != "auto" and backend not in registry.available_backends():
        pytest.skip(f"{backend} is not available here")
    if backend == "xqa" and op == "paged":
        pytest.skip("xqa serves decode only")
    dev, dt, d, b = "cuda", torch.float16, 128, 4
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    cache = torch.randn(64, 2, PAGE, HKV, d, device=dev, dtype=dt)
    n = 1 if op == "decode" else 3
    w = (attncore.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend=backend) if op == "decode"
         else attncore.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend))
    first = None
    for step in range(4):
        indptr, indices, last = _table(b, seed=20 + step, max_pages=4)
        kv_lens = [(int(indptr[i + 1] - indptr[i]) - 1) * PAGE + int(last[i]) for i in range(b)]
        if op == "decode":
            w.plan(indptr, indices, last, 2 * HKV, HKV, d, PAGE, q_data_type=dt)
        else:
            qo = torch.arange(b + 1, dtype=torch.int32) * n
            w.plan(qo, indptr, indices, last, 2 * HKV, HKV, d, PAGE, q_data_type=dt, causal=True)
        first = first or w.problem
        assert w.problem is first
        q = torch.randn(b * n, 2 * HKV, d, device=dev, dtype=dt)
        out = w.run(q, cache).cpu()
        k, v, qc = cache[:, 0].cpu(), cache[:, 1].cpu(), q.cpu()
        for i in range(b):
            pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
            ki = k[pages].reshape(-1, HKV, d)[:kv_lens[i]]
            vi = v[pages].reshape(-1, HKV, d)[:kv_lens[i]]
            rows = slice(i * n, (i + 1) * n)
            go, _, bo, _ = golden_and_baseline(qc[rows], ki, vi, dtype=dt, causal=True)
            assert max_error(out[rows].double(), go) <= tolerance(bo, go, dt), f"{backend} step {step} request {i}"


# ----------------------------------------------------------------------------- one read per plan
def test_read_together_answers_from_one_read(monkeypatch):
    """Inside the block read_host answers for the tensors read on entry (copies of their values); anything
    else, a tensor of another dtype, or a mix with one that was not read, reads as usual; the block ends."""
    from attncore.core import checks

    reads = []
    real = checks._read
    monkeypatch.setattr(checks, "_read", lambda ts: reads.append(len(ts)) or real(ts))
    a, b = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32)
    c, wide = torch.tensor([7], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int64)
    with checks.read_together([a, b, wide, "not a tensor"]):
        assert reads == [2]  # a and b, in one read; the int64 one is not read
        got = checks.read_host([b, a])
        assert got == [[3, 1], [0, 2, 5]] and reads == [2]
        got[0].append(9)  # the caller's copy
        assert checks.read_host([b]) == [[3, 1]]
        assert checks.read_host([a, c]) == [[0, 2, 5], [7]] and reads == [2, 2]
        assert checks.read_host([wide]) == [[0, 1]] and reads == [2, 2, 1]
        with checks.read_together([c]):  # nested: the outer block's values stay
            assert checks.read_host([a]) == [[0, 2, 5]] and reads == [2, 2, 1]
    assert checks.read_host([a]) == [[0, 2, 5]] and reads == [2, 2, 1, 1]


def _pod_tables(device, kv_p=(9,), kv_d=(5, 9, 1)):
    (ip, xp, lp), (idd, xd, ld) = _table(len(kv_p), seed=1), _table(len(kv_d), seed=2)
    qo_p = torch.tensor([0, 6], dtype=torch.int32)
    qo_d = torch.arange(len(kv_d) + 1, dtype=torch.int32)
    return [t.to(device) for t in (qo_p, ip, xp, lp, qo_d, idd, xd, ld)]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_ragged_plan_reads_both_indptrs_once(monkeypatch, device):
    """The ragged prefill plan reads qo_indptr and kv_indptr in one read (``checks.read_together``), and
    plans what they say."""
    from attncore.core import checks

    reads = []
    real = checks._read
    monkeypatch.setattr(checks, "_read", lambda ts: reads.append(len(ts)) or real(ts))
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8, device=device),
                                                      backend="reference" if device == "cpu" else "auto")
    qo, kv = (torch.tensor(x, dtype=torch.int32, device=device) for x in ([0, 3, 7], [0, 5, 12]))
    w.plan(qo, kv, H, HKV, D, causal=True, q_data_type=torch.float16)
    assert reads == [2]
    assert w._planned.meta.qo_indptr_host == [0, 3, 7] and w._planned.meta.kv_indptr_host == [0, 5, 12]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_batch_pod_plan_reads_its_tables_once(monkeypatch, device):
    """BatchPOD's plan() reads both parts' tables and its decode query lengths in one read (issue 15: at most
    one copy per plan with device-side tables), and plans what the tables say."""
    from attncore.core import checks
    from attncore.core.page_table import read_whole

    reads = []
    real = checks._read
    monkeypatch.setattr(checks, "_read", lambda ts: reads.append(len(ts)) or real(ts))
    ws = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    w = attncore.BatchPODWithPagedKVCacheWrapper(ws, "NHD", backend="reference" if device == "cpu" else "auto")
    t = _pod_tables(device)
    w.plan(*t, H, HKV, D, PAGE, q_data_type=torch.float16)
    assert reads == [6 + sum(read_whole(x) for x in (t[2], t[6]))]  # host page ids: read where used, no copy
    assert w._decode._planned.meta.kv_indptr_host == t[5].tolist()
    assert w._prefill._planned.meta.kv_indptr_host == t[1].tolist()
    assert w._prefill._planned.meta.qo_indptr_host == [0, 6]
