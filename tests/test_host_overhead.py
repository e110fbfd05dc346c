"""Host time of plan() and the one-call functions (issue 15 item 1): a re-plan of a seen signature reuses its
selection and its workspace views, plan() reads index tensors with at most one device copy, the CUDA-graph
state registry shared by triton and cuda_fa2 (attncore.core.graphs), and the cached paths still check."""

import gc
import types
import warnings

import pytest
import torch

import attncore
from attncore.core import checks, graphs, plan_cache, selector
from attncore.core.backend import AttnParams, BatchMeta
from attncore.core.page_table import SMALL_TABLE
from attncore.kernels import interpreting
from attncore.testing.golden import golden_and_baseline, max_error, tolerance

H, HKV, D, PAGE = 4, 2, 16, 4


def _table(b, seed=0, max_pages=3, pool=None):
    g = torch.Generator().manual_seed(seed)
    npages = torch.randint(1, max_pages + 1, (b,), generator=g)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), npages.cumsum(0)]).to(torch.int32)
    n = int(indptr[-1])
    indices = torch.randperm(pool or n, generator=g)[:n].to(torch.int32)
    last = torch.randint(1, PAGE + 1, (b,), generator=g).to(torch.int32)
    return indptr, indices, last


@pytest.fixture
def count_selection(monkeypatch):
    """Counts the selector's real work (explain + ranking), with its caches emptied first."""
    selector._cache.clear()
    selector._chosen.clear()
    plan_cache.ONE_CALL_PLANS.clear()
    calls = []
    real = selector._select

    def counted(problem, backend, bucket=None):  # bucket: the planned sizes' (attncore.core.tables)
        calls.append((problem.op, backend))
        return real(problem, backend, bucket)

    monkeypatch.setattr(selector, "_select", counted)
    return calls


@pytest.mark.parametrize("backend", ["auto", "triton", "reference"])
def test_second_plan_of_a_signature_does_not_select_again(count_selection, backend, cpu_backend):
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend=backend)
    w.plan(*_table(3, seed=1), H, HKV, D, PAGE, q_data_type=torch.float16)
    assert len(count_selection) == 1
    for seed in range(2, 5):  # other lengths, same signature
        w.plan(*_table(3, seed=seed), H, HKV, D, PAGE, q_data_type=torch.float16)
    assert len(count_selection) == 1
    w.plan(*_table(3, seed=5), H, HKV, D, PAGE, q_data_type=torch.float16, logits_soft_cap=5.0)  # another problem
    assert len(count_selection) == 2


def test_selection_cache_misses_when_the_environment_changes(count_selection, monkeypatch):
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(*_table(2), H, HKV, D, PAGE, q_data_type=torch.float16)
    monkeypatch.setenv("ATTNCORE_BACKEND", "reference")
    w.plan(*_table(2), H, HKV, D, PAGE, q_data_type=torch.float16)
    assert len(count_selection) == 2 and w.backend == "reference"
    if not interpreting():  # triton serves CPU tensors only through its interpreter
        return
    monkeypatch.setenv("ATTNCORE_BACKEND", "triton")
    w.plan(*_table(2), H, HKV, D, PAGE, q_data_type=torch.float16)
    assert len(count_selection) == 3 and w.backend == "triton"


def test_an_unknown_backend_is_refused_every_time():
    for _ in range(2):  # errors are never cached
        with pytest.raises(ValueError, match="not a known backend"):
            attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8),
                                                        backend="nope").plan(*_table(2), H, HKV, D, PAGE)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_replans_reuse_workspace_views_and_stay_correct(backend, cpu_backend):
    """The memo keeps the views of equal sizes (no new tensors there); every plan's values are its own."""
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend=backend)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(16, 2, PAGE, HKV, D, generator=g).half()
    seen = None
    for seed in range(3):
        indptr = torch.tensor([0, 2, 4], dtype=torch.int32)
        indices = torch.randperm(16, generator=g)[:4].to(torch.int32)
        last = torch.randint(1, PAGE + 1, (2,), generator=g).to(torch.int32)
        w.plan(indptr, indices, last, H, HKV, D, PAGE, q_data_type=torch.float16)
        meta = w._planned.meta
        if seen is None:
            seen = meta.kv_indices
        assert meta.kv_indices is seen  # the same view...
        assert meta.kv_indices.tolist() == indices.tolist()  # ...holding this plan's pages
        assert meta.kv_last_page_len.tolist() == last.tolist()
        q = torch.randn(2, H, D, generator=g).half()
        out = w.run(q, cache)
        for i in range(2):
            pages = indices[2 * i:2 * i + 2].long()
            n = PAGE + int(last[i])
            k = cache[pages, 0].reshape(-1, HKV, D)[:n]
            v = cache[pages, 1].reshape(-1, HKV, D)[:n]
            go, _, bo, _ = golden_and_baseline(q[i:i + 1], k, v, dtype=torch.float16, causal=True)
            assert max_error(out[i:i + 1].double(), go) <= tolerance(bo, go, torch.float16)
    w.reset_workspace_buffer(torch.empty(1 << 20, dtype=torch.uint8), torch.empty(8 << 20, dtype=torch.uint8))
    assert w._memo == {}
    w.plan(indptr, indices, last, H, HKV, D, PAGE, q_data_type=torch.float16)
    assert w._planned.meta.kv_indices is not seen


@pytest.mark.parametrize("pages", [5, SMALL_TABLE + 7])
def test_page_table_read_small_and_large(pages):
    """BatchMeta.paged reads small tables as Python ints and large ones with tensor reductions: the same
    fields and the same errors either way."""
    memo: dict = {}
    iw = torch.empty(1 << 20, dtype=torch.uint8)
    indptr = torch.tensor([0, 2, pages], dtype=torch.int32)
    indices = torch.randperm(pages + 3)[:pages + 2].to(torch.int32)  # more entries than used
    last = torch.tensor([3, 1], dtype=torch.int32)
    meta = BatchMeta.paged([0, 1, 2], indptr, indices, last, PAGE, device="cpu", params=AttnParams(1.0), decode=True,
                           int_workspace=iw, memo=memo)
    assert meta.kv_lens_host == [PAGE + 3, (pages - 3) * PAGE + 1]
    assert meta.max_page_id == int(indices[:pages].max())
    assert meta.kv_indices.tolist() == indices[:pages].tolist()
    assert meta.kv_indptr.tolist() == indptr.tolist() and meta.kv_lens.tolist() == meta.kv_lens_host
    bad = indices.clone()
    bad[pages - 1] = -4
    with pytest.raises(ValueError, match=r"paged_kv_indices: got a negative page id -4"):
        BatchMeta.paged([0, 1, 2], indptr, bad, last, PAGE, device="cpu", params=AttnParams(1.0), int_workspace=iw,
                        memo=memo)
    bad[pages - 1] = 5
    bad[pages] = -1  # past indptr[-1]: never read, not checked
    BatchMeta.paged([0, 1, 2], indptr, bad, last, PAGE, device="cpu", params=AttnParams(1.0), int_workspace=iw,
                    memo=memo)
    with pytest.raises(ValueError, match=r"paged_kv_indptr: not non-decreasing"):
        BatchMeta.paged([0, 1, 2], torch.tensor([0, 3, 2], dtype=torch.int32), indices, last, PAGE, device="cpu",
                        params=AttnParams(1.0), int_workspace=iw, memo=memo)
    with pytest.raises(ValueError, match=r"paged_kv_indptr: got 2 entries, expected 3"):
        BatchMeta.paged([0, 1, 2], torch.tensor([0, 3], dtype=torch.int32), indices, last, PAGE, device="cpu",
                        params=AttnParams(1.0), int_workspace=iw, memo=memo)


def test_read_host_reads_host_tensors_without_a_copy():
    a, b = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    assert checks.read_host([a, b]) == [[0, 3, 5], [7]]


# ----------------------------------------------------------------------------- one-call functions
def test_cached_one_call_path_still_checks_its_inputs():
    q, k, v = torch.randn(5, H, D).half(), torch.randn(9, HKV, D).half(), torch.randn(9, HKV, D).half()
    for _ in range(2):  # the second call is a cache hit
        attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference")
    hits = plan_cache.ONE_CALL_PLANS.hits
    with pytest.raises(TypeError, match=r"v: got dtype fp32, expected fp16"):
        attncore.single_prefill_with_kv_cache(q, k, v.float(), causal=True, backend="reference")
    with pytest.raises(ValueError, match=r"v: got shape \[8, 2, 16\]"):
        attncore.single_prefill_with_kv_cache(q, k, v[:8], causal=True, backend="reference")
    with pytest.raises(ValueError, match=r"causal: single prefill with causal=True needs kv_len >= qo_len"):
        attncore.single_prefill_with_kv_cache(torch.randn(10, H, D).half(), k, v, causal=True, backend="reference")
    with pytest.raises(ValueError, match=r"out: got shape"):
        attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference",
                                              out=torch.empty(4, H, D).half())
    assert plan_cache.ONE_CALL_PLANS.hits == hits  # none of them was served from the cache
    qd = torch.randn(H, D).half()
    for _ in range(2):
        attncore.single_decode_with_kv_cache(qd, k, v, backend="auto")
    with pytest.raises(ValueError, match=r"q: got a 3-D tensor"):
        attncore.single_decode_with_kv_cache(qd[None], k, v, backend="auto")


def test_one_call_auto_reuses_its_selection(count_selection):
    q, k, v = torch.randn(3, H, D).half(), torch.randn(7, HKV, D).half(), torch.randn(7, HKV, D).half()
    for _ in range(3):
        attncore.single_prefill_with_kv_cache(q, k, v, causal=True)
        attncore.single_decode_with_kv_cache(q[0], k, v)
    assert len(count_selection) == 2  # two problems (causal prefill, decode's one row), each selected once


# ----------------------------------------------------------------------------- graph states (core/graphs.py)
def test_graph_states_follow_their_caller_not_an_address():
    reg = graphs.GraphStates(limit=2)
    buf = torch.zeros(64, dtype=torch.uint8)

    def meta(b):
        return types.SimpleNamespace(int_workspace=b[8:], qo_indptr=None, device=torch.device("cpu"))

    st = reg.add("problem", meta(buf), types.SimpleNamespace(anchor=None, tag=1))
    assert st.anchor() is buf and reg.find("problem", meta(buf)) is st  # a new view of the same buffer
    assert reg.find("other problem", meta(buf)) is None
    st.anchor = lambda: torch.zeros(1)  # as if another buffer had taken this address
    assert reg.find("problem", meta(buf)) is None and len(reg) == 0
    reg.add("problem", meta(buf), types.SimpleNamespace(anchor=None, tag=2))
    other = torch.zeros(64, dtype=torch.uint8)
    reg.add("problem", meta(other), types.SimpleNamespace(anchor=None, tag=3))
    del other
    gc.collect()
    reg.add("p3", meta(buf), types.SimpleNamespace(anchor=None, tag=4))  # drops the dead caller's state
    assert sorted(s.tag for s in reg.states.values()) == [2, 4]
    reg.add("p4", meta(buf), types.SimpleNamespace(anchor=None, tag=5))  # bounded: the oldest goes
    assert sorted(s.tag for s in reg.states.values()) == [4, 5]


def test_backends_share_the_graph_state_registry():
    from attncore.backends.cuda_fa2 import plan as fa2_plan
    from attncore.backends.triton import plan as triton_plan

    assert isinstance(triton_plan._GRAPH_STATES, graphs.GraphStates)
    assert isinstance(fa2_plan._GRAPH_STATES, graphs.GraphStates)
    assert not hasattr(triton_plan, "_Staging") and not hasattr(fa2_plan, "_Staging")


# ----------------------------------------------------------------------------- GPU
def _syncs(fn) -> int:
    """Device synchronizations made by fn() (torch's sync debug mode, warnings counted)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in ws)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda_fa2", "xqa", "auto"])
@pytest.mark.parametrize("kind", ["decode", "paged"])
def test_gpu_plan_syncs(backend, kind):
    """Host index tensors: no sync.  Device index tensors: at most one (one copy to pinned memory)."""
    if backend != "auto" and backend not in attncore.available_backends():
        pytest.skip(f"{backend} unavailable")
    if backend == "xqa" and kind == "paged":
        pytest.skip("xqa serves decode only")
    dev, dt = "cuda", torch.bfloat16
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    if kind == "decode":
        w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, backend=backend)
    else:
        w = attncore.BatchPrefillWithPagedKVCacheWrapper(ws, backend=backend)

    def on(table, where):  # the index tensors where the caller keeps them (copied before counting)
        indptr, indices, last = (t.to(where) for t in table)
        qo = (torch.arange(indptr.numel(), dtype=torch.int32) * 3).to(where)
        return qo, indptr, indices, last

    def plan(tensors):
        qo, indptr, indices, last = tensors
        if kind == "decode":
            w.plan(indptr, indices, last, 32, 8, 128, PAGE, q_data_type=dt)
        else:
            w.plan(qo, indptr, indices, last, 32, 8, 128, PAGE, causal=True, q_data_type=dt)

    plan(on(_table(8, seed=1, max_pages=8, pool=256), "cpu"))  # first plan: builds, compiles, caches
    host = on(_table(8, seed=2, max_pages=8, pool=256), "cpu")
    assert _syncs(lambda: plan(host)) == 0
    # nor one inside the driver, which torch's sync debug mode cannot see: plan() returns while the stream is busy
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time ahead of the plan's copy
    plan(host)
    assert not torch.cuda.current_stream().query(), "plan() waited for the GPU"
    plan(on(_table(8, seed=3, max_pages=8, pool=256), dev))
    device = on(_table(8, seed=4, max_pages=8, pool=256), dev)
    assert _syncs(lambda: plan(device)) <= 1
    # the values planned from device tensors are the table's
    table = _table(8, seed=5, max_pages=8, pool=256)
    plan(on(table, dev))
    meta = w._planned.meta
    assert meta.kv_indptr_host == table[0].tolist() and meta.max_page_id == int(table[1].max())
    assert meta.kv_indices.cpu().tolist() == table[1].tolist()


def test_ragged_plan_names_a_bad_indptr_argument():
    a = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"kv_indptr: got list"):  # not a tensor: its own check names it
        attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8)).plan(
            a, [0, 1, 2], H, HKV, D)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda_fa2", "auto"])
def test_gpu_ragged_plan_syncs(backend):
    """Ragged prefill: host indptrs, no sync; device ones, at most one (both read in one copy)."""
    if backend != "auto" and backend not in attncore.available_backends():
        pytest.skip(f"{backend} unavailable")
    dev, dt = "cuda", torch.bfloat16
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(128 << 20, dtype=torch.uint8, device=dev),
                                                      backend=backend)

    def indptrs(seed, on):  # where the caller keeps them (copied before counting)
        g = torch.Generator().manual_seed(seed)
        qo = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randint(1, 9, (4,), generator=g).cumsum(0)])
        kv = qo + torch.arange(5) * torch.randint(0, 9, (1,), generator=g)
        return qo.to(torch.int32).to(on), kv.to(torch.int32).to(on)

    def plan(tensors):
        w.plan(*tensors, 32, 8, 128, causal=True, q_data_type=dt)
        return [t.tolist() for t in tensors]

    plan(indptrs(1, "cpu"))
    host = indptrs(2, "cpu")
    assert _syncs(lambda: w.plan(*host, 32, 8, 128, causal=True, q_data_type=dt)) == 0
    plan(indptrs(3, dev))
    device = indptrs(4, dev)
    assert _syncs(lambda: w.plan(*device, 32, 8, 128, causal=True, q_data_type=dt)) <= 1
    qo, kv = plan(indptrs(5, dev))
    assert w._planned.meta.qo_indptr_host == qo and w._planned.meta.kv_indptr_host == kv
