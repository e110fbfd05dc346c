"""xqa's scratch comes from the caller's workspaces (issue 15 item 2) and keeps its addresses across
re-plans in CUDA-graph mode (item 3).  CPU: the plan side (backends/xqa/plan.py) with a stand-in for
the loaded library; GPU: no allocation over 100 plan/run cycles, graph replay == eager."""

from __future__ import annotations

import ctypes
import random
from types import SimpleNamespace

import pytest
import torch

from attncore.core.backend import AttnParams, BatchMeta
from attncore.core.problem import AttentionProblem
from attncore.core.workspace import WorkspaceTooSmall
from attncore.backends.xqa import binding
from attncore.backends.xqa import plan as xplan

LIB = SimpleNamespace(rows=16, tile=64, num_sms=132, ctas_per_sm=2)  # what plan() reads of a Library
CPU = torch.device("cpu")


def _problem(op="xqa_decode", *, graph=False, hq=32, hkv=8, d=128, ps=16, q_len=1):
    return AttentionProblem(op=op, device_type="cuda", compute_capability=(9, 0), q_dtype=torch.bfloat16,
                            kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_qo_heads=hq, num_kv_heads=hkv,
                            head_dim_qk=d, head_dim_vo=d, page_size=ps, kv_layout="NHD", mask="causal",
                            q_len_per_req=q_len, spec_mask=q_len > 1, cuda_graph=graph)


def _meta(lens, *, ps=16, width=None, ws=None, iws=None, fixed=None, q_len=1, bt=None, seq=None):
    B = len(lens)
    width = width or max([-(-n // ps) for n in lens] + [1])
    if bt is None:
        bt = torch.arange(B * width, dtype=torch.int32).view(B, width)
    if seq is None:
        seq = torch.tensor(lens, dtype=torch.int32)
    else:
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
    qo = [i * q_len for i in range(B + 1)]
    return BatchMeta(batch_size=B, qo_indptr=torch.tensor(qo, dtype=torch.int32), qo_indptr_host=qo,
                     block_tables=bt, seq_lens=seq, kv_lens=seq, max_seq_len=max(lens), page_size=ps,
                     params=AttnParams(sm_scale=0.1, causal=True), q_len_per_req=q_len, device=CPU,
                     workspace=ws, int_workspace=iws, fixed_split_size=fixed)


def _ws(mib=8):
    return torch.zeros(mib << 20, dtype=torch.uint8)


def _inside(t, buf):
    lo = buf.data_ptr()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + buf.numel()


def test_scratch_is_carved_from_the_callers_workspaces():
    ws, iws = _ws(), torch.full((4096,), 0xFF, dtype=torch.uint8)
    p = xplan.make_plan(_problem(), _meta([5000, 17], ws=ws, iws=iws), LIB, CPU)
    assert p.num_splits > 1
    assert p.num_items == 2 * 8 * p.m_groups * p.num_splits
    for t in (p.part_o, p.part_lse, p.stage):
        assert _inside(t, ws)
    assert _inside(p.counters, iws)
    assert (p.counters == 0).all(), "counters are zeroed at plan time (the caller's buffer held 0xFF)"
    assert p.params.ws_partial_o == p.part_o.data_ptr() and p.params.ws_counters == p.counters.data_ptr()
    assert p.part_o.shape == (2 * 8, p.num_splits, 16, 128) and p.part_lse.shape == (2 * 8, p.num_splits, 16)


def test_staged_index_tables_and_zeroed_counters_go_in_one_copy():
    """Host index tables (staged by BatchMeta.paged): the counters are carved right before them, and one image of
    both (the counters' zeros, the tables) is written; the caller's buffer held 0xFF."""
    lens = [5000, 17]
    npages = [-(-n // 16) for n in lens]
    indptr = torch.tensor([0, npages[0], sum(npages)], dtype=torch.int32)
    indices = torch.randperm(sum(npages)).to(torch.int32)
    last = torch.tensor([n - 16 * (p - 1) for n, p in zip(lens, npages)], dtype=torch.int32)
    iws = torch.full((1 << 16,), 0xFF, dtype=torch.uint8)
    meta = BatchMeta.paged([0, 1, 2], indptr, indices, last, 16, device=CPU, params=AttnParams(0.1), decode=True,
                           workspace=_ws(), int_workspace=iws)
    assert meta.staged is not None and not meta.staged.sent
    p = xplan.make_plan(_problem("batch_decode"), meta, LIB, CPU)
    assert p.num_splits > 1 and meta.staged.sent
    assert (p.counters == 0).all(), "the counters' zeros went with the tables"
    region = meta.staged.region
    assert p.counters.data_ptr() < region.data_ptr() <= p.counters.data_ptr() + 4096, "carved right before them"
    assert torch.equal(meta.kv_indices.cpu(), indices) and meta.kv_lens.tolist() == lens


@pytest.mark.parametrize("graph", [False, True])
def test_same_layout_same_addresses_across_replans(graph):
    """Re-plans with new lengths (same batch shape) give byte-identical params in graph mode: the
    captured launch stays valid; outside it, the same split count gives the same addresses."""
    ws, iws = _ws(), _ws(1)
    bt = torch.arange(2 * 400, dtype=torch.int32).view(2, 400)
    seq = torch.zeros(2, dtype=torch.int32)
    a = xplan.make_plan(_problem(graph=graph), _meta([6000, 40], ws=ws, iws=iws, bt=bt, seq=seq), LIB, CPU)
    b = xplan.make_plan(_problem(graph=graph), _meta([3500, 45], ws=ws, iws=iws, bt=bt, seq=seq), LIB, CPU)
    if graph:
        assert bytes(a.params) == bytes(b.params)
    elif a.num_splits == b.num_splits:
        assert (a.params.ws_partial_o, a.params.ws_counters) == (b.params.ws_partial_o, b.params.ws_counters)


def test_graph_replan_beyond_the_captured_layout_names_the_capacity():
    ws, iws = _ws(64), _ws(1)
    bt = torch.arange(2 * 600, dtype=torch.int32).view(2, 600)
    seq = torch.zeros(2, dtype=torch.int32)
    g = _problem(graph=True)
    a = xplan.make_plan(g, _meta([2000, 40], ws=ws, iws=iws, bt=bt, seq=seq, fixed=512), LIB, CPU)
    small = xplan.make_plan(g, _meta([600, 40], ws=ws, iws=iws, bt=bt, seq=seq, fixed=512), LIB, CPU)
    assert small.num_splits < a.num_splits
    assert small.part_o.data_ptr() == a.part_o.data_ptr() and small.counters.data_ptr() == a.counters.data_ptr()
    with pytest.raises(ValueError, match=rf"holds .* x {a.num_splits} splits"):
        xplan.make_plan(g, _meta([9000, 40], ws=ws, iws=iws, bt=bt, seq=seq, fixed=512), LIB, CPU)


def test_workspace_too_small_names_the_bytes():
    with pytest.raises(WorkspaceTooSmall, match=r"float_workspace_buffer: xqa needs \d+ bytes .*part_o"):
        xplan.make_plan(_problem(), _meta([5000, 17], ws=torch.zeros(4096, dtype=torch.uint8)), LIB, CPU)
    with pytest.raises(WorkspaceTooSmall, match=r"int_workspace_buffer: xqa needs \d+ bytes .*counters"):
        xplan.make_plan(_problem(), _meta([5000, 17], ws=_ws(), iws=torch.zeros(8, dtype=torch.uint8)), LIB, CPU)


def test_without_int_workspace_counters_come_from_the_grow_only_own_buffer():
    """The API's wrappers pass no int workspace yet: counters must still keep their address after
    the plan that placed them is dropped (a captured graph keeps using it)."""
    ws = _ws()
    a = xplan.make_plan(_problem(graph=True), _meta([6000, 40], ws=ws), LIB, CPU)
    ptr = a.params.ws_counters
    del a
    b = xplan.make_plan(_problem(graph=True), _meta([3000, 40], ws=ws), LIB, CPU)
    assert b.params.ws_counters == ptr
    assert any(_inside(b.counters, t) for t in xplan._POOLS[("int", None)])


def test_split_decision_unchanged():
    """Outside graph mode the cost model decides; graph mode depends on the batch shape only."""
    p = xplan.make_plan(_problem(), _meta([8000], ws=_ws()), LIB, CPU)
    assert p.num_splits == xplan.choose_splits(8, -(-8000 // LIB.tile), LIB.num_sms * LIB.ctas_per_sm)
    full = xplan.make_plan(_problem(), _meta([300] * 64, ws=_ws(32)), LIB, CPU)
    assert full.num_splits == 1 and full.part_o is None and full.counters is None
    assert xplan.choose_splits(512, 64, 264) == 1 and xplan.choose_splits(8, 512, 264) >= 16


def test_empty_batch_page_table_stub_is_carved():
    bt = torch.empty((2, 0), dtype=torch.int32)
    meta = _meta([0, 0], bt=bt, ws=_ws(), iws=_ws(1))
    meta.max_seq_len = 0
    p = xplan.make_plan(_problem(), meta, LIB, CPU)
    assert p.params.page_table == p.page_table.data_ptr() != 0 and _inside(p.page_table, meta.int_workspace)


def test_run_side_staging_uses_the_plan_slots():
    ws = _ws()
    p = xplan.make_plan(_problem(q_len=2), _meta([100, 200], ws=ws, q_len=2), LIB, CPU)
    q = torch.randn(4, 32, 192).to(torch.bfloat16)[:, :, 32:160]  # misaligned view
    st = binding._staged(p, "q", q)
    assert _inside(st, ws) and st.is_contiguous() and torch.equal(st, q)
    s = binding._staged(p, "sinks", torch.randn(32, dtype=torch.float16), torch.float32)
    assert s.dtype == torch.float32 and _inside(s, ws)
    m = torch.zeros(2, 2, 4, dtype=torch.int16).view(torch.uint16)[:, :, ::2]
    assert _inside(binding._staged(p, "spec_mask", m), ws)
    with pytest.raises(ValueError, match=r"q: got shape \(8, 32, 128\) .* staging slot of \d+ bytes"):
        binding._staged(p, "q", torch.randn(8, 32, 128).to(torch.bfloat16))


def test_params_struct_is_the_checked_mirror():
    p = xplan.make_plan(_problem(), _meta([100], ws=_ws()), LIB, CPU)
    assert isinstance(p.params, binding.XqaParams) and ctypes.sizeof(p.params) == ctypes.sizeof(binding.XqaParams)


# ------------------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.gpu


def _paged(B_lens, ps, hkv, d, dev, pool_pages):
    pages = [-(-n // ps) for n in B_lens]
    perm = torch.randperm(pool_pages)[:sum(pages)].to(torch.int32)
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * ps if p else 0 for n, p in zip(B_lens, pages)], dtype=torch.int32)
    return indptr.to(dev), perm.to(dev), last.to(dev)


@gpu
def test_gpu_no_allocation_over_100_plan_run_cycles():
    """Through the backend contract with the caller's workspaces: after the first plan, 100 plan/run
    cycles over different batch sizes and lengths make no allocation call at all."""
    from attncore.backends.xqa.backend import XqaBackend
    from attncore.core.backend import RunArgs

    dev = torch.device("cuda", torch.cuda.current_device())
    be = XqaBackend()
    rng = random.Random(0)
    hq, hkv, d, ps = 32, 8, 128, 16
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    iws = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
    cache = torch.randn(4096, 2, ps, hkv, d, device=dev, dtype=torch.bfloat16)
    cases = []
    for i in range(100):
        B = rng.choice([1, 3, 16, 64])
        lens = [rng.randint(1, 4000) for _ in range(B)]
        width = max(-(-n // ps) for n in lens)
        bt = torch.randint(0, 4096, (B, width), dtype=torch.int32, device=dev)
        seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        qo = [j for j in range(B + 1)]
        meta = BatchMeta(batch_size=B, qo_indptr=torch.tensor(qo, dtype=torch.int32, device=dev), qo_indptr_host=qo,
                         block_tables=bt, seq_lens=seq, kv_lens=seq, max_seq_len=max(lens), page_size=ps,
                         params=AttnParams(sm_scale=d ** -0.5, causal=True), device=dev, workspace=ws,
                         int_workspace=iws)
        q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
        cases.append((meta, RunArgs(q=q, k=cache[:, 0], v=cache[:, 1], out=torch.empty_like(q))))
    problem = AttentionProblem(op="xqa_decode", device_type="cuda", compute_capability=torch.cuda.get_device_capability(),
                               q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                               num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, head_dim_vo=d, page_size=ps,
                               kv_layout="NHD", mask="causal")
    be.run(be.plan(problem, cases[0][0]), cases[0][1])  # first plan: JIT load, library state
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
    mem = torch.cuda.memory_allocated(dev)
    for meta, args in cases:
        be.run(be.plan(problem, meta), args)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats(dev)["allocation.all.allocated"] == before
    assert torch.cuda.memory_allocated(dev) == mem


@gpu
def test_gpu_api_memory_flat_over_100_cycles():
    """The issue's test, through the public API: memory_allocated() is the same after every round of
    plan/run cycles over different batch sizes and lengths."""
    import attncore

    dev = torch.device("cuda")
    rng = random.Random(1)
    hq, hkv, d, ps, pool = 32, 8, 128, 16, 8192
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wr = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="xqa")
    cache = torch.randn(pool, 2, ps, hkv, d, device=dev, dtype=torch.bfloat16)
    rounds = []
    shapes = [[rng.randint(1, 3000) for _ in range(rng.choice([1, 4, 32]))] for _ in range(10)]
    qs = {len(s): torch.randn(len(s), hq, d, device=dev, dtype=torch.bfloat16) for s in shapes}
    for r in range(10):
        for lens in shapes:
            ip, ix, last = _paged(lens, ps, hkv, d, dev, pool)
            wr.plan(ip, ix, last, hq, hkv, d, ps, q_data_type=torch.bfloat16)
            wr.run(qs[len(lens)], cache)
            del ip, ix, last
        torch.cuda.synchronize()
        rounds.append(torch.cuda.memory_allocated())
    assert len(set(rounds[1:])) == 1, f"memory_allocated after each round of 10 plan/run cycles: {rounds}"


@gpu
def test_gpu_api_graph_replay_equals_eager():
    """use_cuda_graph=True: capture after plan A, re-plan B (other lengths), replay == eager B."""
    import attncore

    dev = torch.device("cuda")
    hq, hkv, d, ps, pool, B = 32, 8, 128, 16, 2048, 4
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    ind_buf = torch.zeros(pool, dtype=torch.int32, device=dev)
    ip_buf = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    last_buf = torch.zeros(B, dtype=torch.int32, device=dev)
    wr = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=ip_buf,
                                                     paged_kv_indices_buffer=ind_buf,
                                                     paged_kv_last_page_len_buffer=last_buf, backend="xqa")
    cache = torch.randn(pool, 2, ps, hkv, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    wr.plan(*_paged([7000, 30, 900, 1], ps, hkv, d, dev, pool), hq, hkv, d, ps, q_data_type=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        wr.run(q, cache, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        wr.run(q, cache, out=out)
    for lens in ([3000, 3000, 5, 17], [1, 1, 8000, 64]):
        wr.plan(*_paged(lens, ps, hkv, d, dev, pool), hq, hkv, d, ps, q_data_type=torch.bfloat16)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        replay = out.clone()
        eager = wr.run(q, cache)
        assert torch.equal(replay, eager), f"replay != eager after re-plan to {lens}"


def test_graph_capacity_follows_the_memory_not_the_view():
    """A new view of the same int workspace each plan (what the API may pass) keeps the captured layout."""
    ws, iws = _ws(64), _ws(1)
    bt = torch.arange(2 * 600, dtype=torch.int32).view(2, 600)
    seq = torch.zeros(2, dtype=torch.int32)
    g = _problem(graph=True)
    a = xplan.make_plan(g, _meta([2000, 40], ws=ws, iws=iws[:], bt=bt, seq=seq, fixed=512), LIB, CPU)
    with pytest.raises(ValueError, match="captured layout"):
        xplan.make_plan(g, _meta([9000, 40], ws=ws, iws=iws[:], bt=bt, seq=seq, fixed=512), LIB, CPU)
    del a


@gpu
def test_gpu_host_tables_with_split_kv_over_a_poisoned_int_workspace():
    """Host index tables (FlashInfer's convention) and split KV: the counters' zeros travel in the tables' copy.
    The wrapper's int workspace is filled with 0xFF before each plan; outputs equal the fp64 golden."""
    import attncore
    from attncore.testing.golden import golden_and_baseline, max_error, tolerance

    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, ps, pool = 32, 8, 128, 16, 1024
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wr = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="xqa")
    cache = torch.randn(pool, 2, ps, hkv, d, device=dev, dtype=dt)
    for lens in ([6000, 17], [3000, 2500, 1]):
        ip, ix, last = _paged(lens, ps, hkv, d, "cpu", pool)
        wr._int_workspace_buffer.fill_(0xFF)
        wr.plan(ip, ix, last, hq, hkv, d, ps, q_data_type=dt)
        assert wr._planned._primary[1].num_splits > 1
        q = torch.randn(len(lens), hq, d, device=dev, dtype=dt)
        out = wr.run(q, cache)
        for i, n in enumerate(lens):
            pages = ix[ip[i]:ip[i + 1]].long().to(dev)
            k, v = (cache[pages, j].reshape(-1, hkv, d)[:n] for j in (0, 1))
            go, _, bo, _ = golden_and_baseline(q[i:i + 1], k, v, dtype=dt, causal=True, device="cuda")
            assert max_error(out[i:i + 1], go) <= tolerance(bo, go, dt), f"lens {lens} request {i}"
