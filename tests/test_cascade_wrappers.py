"""Cascade wrappers (attncore.cascade.wrappers, FlashInfer 0.2.14's flashinfer.cascade wrappers) against the
fp64 golden over each row's concatenated keys, through the reference backend and Triton (its CPU
interpreter without a GPU); the levels' states are merged by the fused kernel (attncore.kernels.merge_states)."""

import math

import pytest
import torch

import attncore
from attncore.cascade import merge as cascade
from attncore.cascade import (
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from attncore.core.selector import BackendSelectionError
from attncore.testing.golden import golden_attention, visible

NAN = float("nan")
HQ, HKV, D, PAGE = 4, 2, 16, 4
OUT_TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
LSE_TOL = 1e-3
I32 = torch.int32
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def ws(device=DEV):
    return torch.empty(1 << 20, dtype=torch.uint8, device=device)


def t32(x, device="cpu"):
    return torch.tensor(x, dtype=I32, device=device)


# ----------------------------------------------------------------------------------------- problem building
class Levels:
    """Per level: qo_indptr (host list), per-request kv lengths; pages drawn from one shuffled pool of a
    shared cache whose unused slots (and unused pages) hold NaN."""

    def __init__(self, qo_indptrs, kv_lens, *, dtype, layout="NHD", seed=0, device="cpu", spare_pages=3):
        g = torch.Generator().manual_seed(seed)
        self.qo, self.kv_lens, self.layout, self.dtype = qo_indptrs, kv_lens, layout, dtype
        npages = [[-(-n // PAGE) for n in lens] for lens in kv_lens]
        total = sum(sum(p) for p in npages) + spare_pages
        perm = torch.randperm(total, generator=g).tolist()
        self.indptr, self.indices, self.last = [], [], []
        nxt = 0
        for lens, pages in zip(kv_lens, npages):
            ip = [0]
            for p in pages:
                ip.append(ip[-1] + p)
            self.indptr.append(ip)
            self.indices.append(perm[nxt:nxt + ip[-1]])
            nxt += ip[-1]
            self.last.append([n - (p - 1) * PAGE if p else 0 for n, p in zip(lens, pages)])
        k = torch.full((total, PAGE, HKV, D), NAN, dtype=torch.float64)
        v = torch.full((total, PAGE, HKV, D), NAN, dtype=torch.float64)
        for lvl in range(len(kv_lens)):
            for j, n in enumerate(kv_lens[lvl]):
                for t in range(n):
                    pg, slot = self.indices[lvl][self.indptr[lvl][j] + t // PAGE], t % PAGE
                    k[pg, slot] = torch.randn(HKV, D, generator=g, dtype=torch.float64) * 1.5
                    v[pg, slot] = torch.randn(HKV, D, generator=g, dtype=torch.float64)
        self.k, self.v = k.to(dtype), v.to(dtype)  # NHD [pages, page, Hkv, D], rounded to the dtype
        nnz = qo_indptrs[0][-1]
        self.q = torch.randn(nnz, HQ, D, generator=g, dtype=torch.float64).to(dtype)
        self.device = device

    def cache(self, form="5d"):
        k, v = self.k, self.v
        if self.layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if form == "tuple":
            return k.contiguous().to(self.device), v.contiguous().to(self.device)
        return torch.stack([k, v], dim=1).contiguous().to(self.device)

    def tables(self):
        dev = self.device
        return ([t32(x, dev) for x in self.qo], [t32(x, dev) for x in self.indptr],
                [t32(x, dev) for x in self.indices], [t32(x, dev) for x in self.last])

    def keys(self, lvl, j):
        n = self.kv_lens[lvl][j]
        pages = self.indices[lvl][self.indptr[lvl][j]:self.indptr[lvl][j + 1]]
        if not pages:
            return self.k.new_zeros(0, HKV, D), self.v.new_zeros(0, HKV, D)
        return torch.cat([self.k[p] for p in pages])[:n], torch.cat([self.v[p] for p in pages])[:n]


def golden_rows(q, row_keys, **kw):
    """Golden of each row r over its keys: row_keys(r) -> (k, v, keep [kv] bool)."""
    outs, lses = [], []
    for r in range(q.shape[0]):
        k, v, keep = row_keys(r)
        o, s = golden_attention(q[r:r + 1], k, v, mask=keep[None], **kw)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs), torch.cat(lses)


def golden_levels(lv: Levels, *, causal, window_left=-1, **kw):
    L = len(lv.qo)

    def row_keys(r):
        ks, vs, keeps = [], [], []
        for lvl in range(L):
            qo = lv.qo[lvl]
            j = max(i for i in range(len(qo) - 1) if qo[i] <= r < qo[i + 1])
            k, v = lv.keys(lvl, j)
            vis = visible(qo[j + 1] - qo[j], k.shape[0], causal=causal and lvl == L - 1, window_left=window_left)
            ks.append(k)
            vs.append(v)
            keeps.append(vis[r - qo[j]])
        return torch.cat(ks), torch.cat(vs), torch.cat(keeps)

    return golden_rows(lv.q, row_keys, window_left=-1, **kw)


def check(out, lse, g_out, g_lse, dtype):
    tol = OUT_TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double().cpu(), g_out, atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(g_lse))
    fin = torch.isfinite(g_lse)
    torch.testing.assert_close(lse.double().cpu()[fin], g_lse[fin], atol=LSE_TOL, rtol=0)
    assert (out.cpu()[torch.isneginf(g_lse)] == 0).all()


# Level layouts. Rows: 3 requests of 2, 3 and 1 query rows (nnz 6), or decode (1 row each).
PREFILL_QO = [0, 2, 5, 6]
SHAPES = {
    # one level: a plain batch prefill; request 1 has no key at all (out 0, lse -inf)
    1: ([PREFILL_QO], [[5, 0, 9]]),
    # shared prefix (one request over every row) + unique suffixes; request 1's suffix is empty
    2: ([[0, 6], PREFILL_QO], [[7], [4, 0, 6]]),
    # shared, per-group (requests 0-1, then 2; group 2 has no keys), unique
    3: ([[0, 6], [0, 5, 6], PREFILL_QO], [[6], [5, 0], [3, 5, 2]]),
}


@pytest.mark.parametrize("backend,dtype,num_levels,causal,layout", [
    ("reference", torch.float32, 1, False, "NHD"),
    ("reference", torch.float32, 2, True, "NHD"),
    ("reference", torch.float16, 2, False, "HND"),
    ("reference", torch.float16, 3, True, "NHD"),
    ("reference", torch.float32, 3, False, "HND"),
    ("triton", torch.float16, 1, True, "NHD"),
    ("triton", torch.float16, 2, True, "HND"),
    ("triton", torch.float16 if CUDA else torch.float32, 3, True, "NHD"),  # fp32: the interpreter only
])
def test_multilevel_matches_golden(backend, dtype, num_levels, causal, layout):
    qo, kv = SHAPES[num_levels]
    lv = Levels(qo, kv, dtype=dtype, layout=layout, seed=num_levels * 10 + causal, device=DEV)
    w = MultiLevelCascadeAttentionWrapper(num_levels, ws(), layout, backend=backend)
    assert w.backend is None and w.num_levels == num_levels and not w.is_cuda_graph_enabled
    w.plan(*lv.tables(), HQ, HKV, D, PAGE, causal=causal, q_data_type=dtype)
    assert w.backend == (backend,) * num_levels
    q = lv.q.to(DEV)
    out, lse = w.run(q, lv.cache(), return_lse=True)
    g_out, g_lse = golden_levels(lv, causal=causal)
    check(out, lse, g_out, g_lse, dtype)
    # FlashInfer's return value (out only), the aliases, and a tuple cache give the same
    assert torch.equal(w.forward(q, lv.cache("tuple")), out)
    # the same layer again reuses the plan; out=/lse= are written
    o2, l2 = torch.empty_like(out), torch.empty_like(lse)
    res = w.run(q, lv.cache(), return_lse=True, out=o2, lse=l2)
    assert res[0] is o2 and res[1] is l2 and torch.equal(o2, out) and torch.equal(l2, lse)


def test_multilevel_decode_shaped_flashinfer_example():
    """FlashInfer's docstring example, scaled down: shared pages for the whole batch (top level), one
    query row per request over its unique pages (bottom level), plan/run positional as there."""
    b = 5
    lv = Levels([[0, b], list(range(b + 1))], [[11], [1, 7, 4, 0, 9]], dtype=torch.float16, seed=3, device=DEV)
    w = MultiLevelCascadeAttentionWrapper(2, ws(), "NHD", backend="reference")
    qo, ip, ix, last = lv.tables()
    w.begin_forward(qo, ip, ix, last, HQ, HKV, D, PAGE)  # q_data_type defaults to float16
    out = w.run(lv.q.to(DEV), lv.cache())
    g_out, g_lse = golden_levels(lv, causal=False)
    torch.testing.assert_close(out.double().cpu(), g_out, atol=5e-3, rtol=5e-3)
    # causal on the last level only: a single row sees all its keys, so causal changes nothing here
    w.plan(qo, ip, ix, last, HQ, HKV, D, PAGE, True)
    torch.testing.assert_close(w.run(lv.q.to(DEV), lv.cache()), out, atol=0, rtol=0)


def test_multilevel_plan_reads_every_level_once(monkeypatch):
    """plan() reads every level's tables in one read (one device sync with device-side tables, not two a
    level), and each level is planned from its own tables."""
    from attncore.core import checks
    from attncore.core.page_table import read_whole

    reads = []
    real = checks._read
    monkeypatch.setattr(checks, "_read", lambda ts: reads.append(len(ts)) or real(ts))
    qo, kv = SHAPES[3]
    lv = Levels(qo, kv, dtype=torch.float32, seed=4, device=DEV)
    w = MultiLevelCascadeAttentionWrapper(3, ws(), backend="reference")
    tables = lv.tables()
    w.plan(*tables, HQ, HKV, D, PAGE, q_data_type=torch.float32)
    # 3 levels x (qo_indptr, kv_indptr, last_page_len), and the page ids of device-side tables
    assert reads == [9 + sum(read_whole(t) for t in tables[2])]
    for i, level in enumerate(w._batch_prefill_wrappers):
        assert level._planned.meta.kv_indptr_host == tables[1][i].tolist()
    check(*w.run(lv.q.to(DEV), lv.cache(), return_lse=True), *golden_levels(lv, causal=False), torch.float32)


def test_multilevel_causal_is_last_level_only():
    """Level 0 holds 6 rows as one request over 3 keys (qo > kv): causal there would hide keys from
    the early rows; with causal=True only the last level is masked."""
    lv = Levels([[0, 6], PREFILL_QO], [[3], [2, 4, 1]], dtype=torch.float32, seed=5, device=DEV)
    w = MultiLevelCascadeAttentionWrapper(2, ws(), backend="reference")
    w.plan(*lv.tables(), HQ, HKV, D, PAGE, causal=True, q_data_type=torch.float32)
    out, lse = w.run(lv.q.to(DEV), lv.cache(), return_lse=True)
    check(out, lse, *golden_levels(lv, causal=True), torch.float32)
    # and differs from the non-causal result (request 0 has 2 rows over 2 unique keys: row 0 sees 1)
    w.plan(*lv.tables(), HQ, HKV, D, PAGE, causal=False, q_data_type=torch.float32)
    assert not torch.allclose(w.run(lv.q.to(DEV), lv.cache())[0], out[0])


def test_multilevel_window_soft_cap_scale_apply_to_every_level():
    lv = Levels([[0, 6], PREFILL_QO], [[9], [5, 3, 7]], dtype=torch.float32, seed=7, device=DEV)
    w = MultiLevelCascadeAttentionWrapper(2, ws(), backend="reference")
    w.plan(*lv.tables(), HQ, HKV, D, PAGE, causal=True, window_left=3, logits_soft_cap=4.0, sm_scale=0.4,
           q_data_type=torch.float32)
    out, lse = w.run(lv.q.to(DEV), lv.cache(), return_lse=True)
    check(out, lse, *golden_levels(lv, causal=True, window_left=3, logits_soft_cap=4.0, sm_scale=0.4),
          torch.float32)


def test_multilevel_empty_shared_level_and_nan_query_row():
    """Level 0 with no keys at all (every row's state there is empty), and a NaN query row: NaN in
    its own row only (docs/semantics.md, rule 3)."""
    lv = Levels([[0, 6], PREFILL_QO], [[0], [3, 2, 4]], dtype=torch.float16, seed=9, device=DEV)
    lv.q[3, 1] = NAN
    w = MultiLevelCascadeAttentionWrapper(2, ws(), backend="reference")
    w.plan(*lv.tables(), HQ, HKV, D, PAGE, q_data_type=torch.float16)
    out, lse = w.run(lv.q.to(DEV), lv.cache(), return_lse=True)
    g_out, g_lse = golden_levels(lv, causal=False)
    assert torch.isnan(out[3, 1]).all() and torch.isnan(lse[3, 1])
    keep = torch.ones(6, HQ, dtype=torch.bool)
    keep[3, 1] = False
    torch.testing.assert_close(out.double().cpu()[keep], g_out[keep], atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(lse.double().cpu()[keep], g_lse[keep], atol=LSE_TOL, rtol=0)


def test_multilevel_merges_in_one_fused_launch(monkeypatch):
    if not cascade.fused_merge_available(DEV):
        pytest.skip("the fused merge kernel does not run on this device in this process")
    calls = []
    real = cascade._launch

    def spy(v, s, out, lse, **kw):
        calls.append(tuple(v.shape))
        return real(v, s, out, lse, **kw)

    monkeypatch.setattr(cascade, "_launch", spy)
    qo, kv = SHAPES[3]
    lv = Levels(qo, kv, dtype=torch.float32, seed=1, device=DEV)
    w = MultiLevelCascadeAttentionWrapper(3, ws(), backend="reference")
    w.plan(*lv.tables(), HQ, HKV, D, PAGE, q_data_type=torch.float32)
    fused = w.run(lv.q.to(DEV), lv.cache(), return_lse=True)
    assert calls == [(6, 3, HQ, D)]  # three levels, one launch
    monkeypatch.setattr(cascade, "fused_merge_available", lambda device: False)  # the torch path
    ref = w.run(lv.q.to(DEV), lv.cache(), return_lse=True)
    assert len(calls) == 1
    torch.testing.assert_close(fused[0], ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused[1], ref[1], atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------- shared prefix
def shared_problem(dtype, shared_len, unique_lens, qo_indptr, layout, seed):
    lv = Levels([qo_indptr], [unique_lens], dtype=dtype, layout=layout, seed=seed, device=DEV)
    g = torch.Generator().manual_seed(seed + 100)
    ks = (torch.randn(shared_len, HKV, D, generator=g, dtype=torch.float64) * 1.5).to(dtype)
    vs = torch.randn(shared_len, HKV, D, generator=g, dtype=torch.float64).to(dtype)
    return lv, ks, vs


def shared_inputs(ks, vs, layout):
    if layout == "HND":
        return ks.transpose(0, 1).contiguous().to(DEV), vs.transpose(0, 1).contiguous().to(DEV)
    return ks.to(DEV), vs.to(DEV)


def golden_shared(lv, ks, vs, *, causal, **kw):
    qo = lv.qo[0]

    def row_keys(r):
        j = max(i for i in range(len(qo) - 1) if qo[i] <= r < qo[i + 1])
        k, v = lv.keys(0, j)
        vis = visible(qo[j + 1] - qo[j], k.shape[0], causal=causal)[r - qo[j]]
        return (torch.cat([ks, k]), torch.cat([vs, v]),
                torch.cat([torch.ones(ks.shape[0], dtype=torch.bool), vis]))

    return golden_rows(lv.q, row_keys, **kw)


@pytest.mark.parametrize("backend,dtype,layout,shared_len", [
    ("reference", torch.float32, "NHD", 13),
    ("reference", torch.float16, "HND", 5),
    ("reference", torch.float16, "NHD", 0),  # no shared keys: the decode alone
    ("triton", torch.float16, "NHD", 9),
])
def test_shared_prefix_decode_matches_golden(backend, dtype, layout, shared_len):
    unique = [3, 0, 8, 1]  # request 1 has no unique key
    lv, ks, vs = shared_problem(dtype, shared_len, unique, list(range(5)), layout, seed=shared_len)
    w = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws(), layout, backend=backend)
    qo, ip, ix, last = lv.tables()
    w.begin_forward(ip[0], ix[0], last[0], HQ, HKV, D, PAGE, dtype)  # FlashInfer's positional order
    assert w.backend == backend
    k_sh, v_sh = shared_inputs(ks, vs, layout)
    out, lse = w.forward(lv.q.to(DEV), k_sh, v_sh, lv.cache(), return_lse=True)
    check(out, lse, *golden_shared(lv, ks, vs, causal=False), dtype)
    assert torch.equal(w.run(lv.q.to(DEV), k_sh, v_sh, lv.cache("tuple")), out)
    w.end_forward()


@pytest.mark.parametrize("backend,dtype,layout,causal", [
    ("reference", torch.float32, "NHD", True),
    ("reference", torch.float16, "HND", False),
    ("triton", torch.float16, "NHD", True),
])
def test_shared_prefix_prefill_matches_golden(backend, dtype, layout, causal):
    lv, ks, vs = shared_problem(dtype, 10, [2, 5, 0], [0, 2, 5, 6], layout, seed=4)  # request 2: 1 row, 0 keys
    w = BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws(), layout, backend=backend)
    qo, ip, ix, last = lv.tables()
    w.begin_forward(qo[0], ip[0], ix[0], last[0], HQ, HKV, D, PAGE)
    k_sh, v_sh = shared_inputs(ks, vs, layout)
    out, lse = w.forward(lv.q.to(DEV), k_sh, v_sh, lv.cache(), causal, return_lse=True)
    check(out, lse, *golden_shared(lv, ks, vs, causal=causal), dtype)
    assert w.backend == backend


def test_shared_prefix_prefill_forward_options_replan():
    """forward's options (causal, sm_scale, ...) and q's dtype take effect at each forward."""
    lv, ks, vs = shared_problem(torch.float32, 6, [3, 4], [0, 3, 5], "NHD", seed=8)
    w = BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws(), "NHD", backend="reference")
    qo, ip, ix, last = lv.tables()
    w.begin_forward(qo[0], ip[0], ix[0], last[0], HQ, HKV, D, PAGE)
    ip[0].fill_(0)  # the plan copied the index tensors
    q, k_sh, v_sh, cache = lv.q.to(DEV), ks.to(DEV), vs.to(DEV), lv.cache()
    for causal, sm_scale in ((False, None), (True, None), (True, 0.3), (False, None)):
        out, lse = w.forward(q, k_sh, v_sh, cache, causal, False, sm_scale, return_lse=True)
        check(out, lse, *golden_shared(lv, ks, vs, causal=causal, sm_scale=sm_scale), torch.float32)


@pytest.mark.parametrize("stage", ["decode", "append"])
def test_multilevel_equals_shared_prefix_wrappers(stage):
    """The shared prefix in pages (multi-level) or contiguous (the deprecated wrappers) gives the same
    result, as FlashInfer's own test of these wrappers checks."""
    b, shared_len, unique = 3, 9, [5, 2, 7]
    rows = list(range(b + 1)) if stage == "decode" else [0, 2, 3, 6]
    lv = Levels([[0, rows[-1]], rows], [[shared_len], unique], dtype=torch.float16, seed=13, device=DEV)
    ml = MultiLevelCascadeAttentionWrapper(2, ws(), "NHD", backend="reference")
    ml.plan(*lv.tables(), HQ, HKV, D, PAGE, causal=stage == "append")
    q = lv.q.to(DEV)
    o_ml = ml.run(q, lv.cache())
    ks, vs = (x.to(DEV) for x in lv.keys(0, 0))
    qo, ip, ix, last = lv.tables()
    if stage == "decode":
        sp = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws(), "NHD", backend="reference")
        sp.begin_forward(ip[1], ix[1], last[1], HQ, HKV, D, PAGE)
        o_sp = sp.forward(q, ks, vs, lv.cache())
    else:
        sp = BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws(), "NHD", backend="reference")
        sp.begin_forward(qo[1], ip[1], ix[1], last[1], HQ, HKV, D, PAGE)
        o_sp = sp.forward(q, ks, vs, lv.cache(), causal=True)
    torch.testing.assert_close(o_ml, o_sp, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_input_multilevel():
    lv = Levels(*SHAPES[2], dtype=torch.float16, seed=2, device=DEV)
    qo, ip, ix, last = lv.tables()
    with pytest.raises(ValueError, match=r"num_levels: got 0; accepted: an int >= 1"):
        MultiLevelCascadeAttentionWrapper(0, ws())
    with pytest.raises(TypeError, match=r"num_levels: got '2'"):
        MultiLevelCascadeAttentionWrapper("2", ws())
    with pytest.raises(ValueError, match=r"qo_indptr_buf_arr: got 1 entries; accepted: num_levels = 2"):
        MultiLevelCascadeAttentionWrapper(2, ws(), "NHD", True, [qo[0]])
    with pytest.raises(ValueError, match=r"level 0: kv_layout"):
        MultiLevelCascadeAttentionWrapper(2, ws(), "NDH")
    w = MultiLevelCascadeAttentionWrapper(2, ws(), backend="reference")
    with pytest.raises(RuntimeError, match=r"MultiLevelCascadeAttentionWrapper.run\(\) called before plan\(\)"):
        w.run(lv.q.to(DEV), lv.cache())
    with pytest.raises(ValueError, match=r"paged_kv_indptr_arr: got 1 entries; accepted: num_levels = 2"):
        w.plan(qo, ip[:1], ix, last, HQ, HKV, D, PAGE)
    with pytest.raises(TypeError, match=r"qo_indptr_arr: got Tensor; accepted: a list of num_levels = 2"):
        w.plan(qo[0], ip, ix, last, HQ, HKV, D, PAGE)
    with pytest.raises(ValueError, match=r"qo_indptr_arr\[1\]: got qo_indptr\[-1\] = 5; accepted: 6"):
        w.plan([qo[0], t32([0, 2, 5, 5], DEV)], ip, ix, last, HQ, HKV, D, PAGE)
    with pytest.raises(RuntimeError, match=r"before plan"):  # a failed plan leaves the wrapper unplanned
        w.run(lv.q.to(DEV), lv.cache())
    with pytest.raises(ValueError, match=r"level 1: .*last_page_len"):
        w.plan(qo, ip, ix, [last[0], t32([4, 0, 9], DEV)], HQ, HKV, D, PAGE)
    with pytest.raises(ValueError, match=r"level 0: sm_scale"):
        w.plan(qo, ip, ix, last, HQ, HKV, D, PAGE, sm_scale=-1.0)
    w.plan(qo, ip, ix, last, HQ, HKV, D, PAGE)  # q_data_type float16
    with pytest.raises(TypeError, match=r"level 0: q: got dtype"):
        w.run(lv.q.float().to(DEV), lv.cache())
    with pytest.raises(ValueError, match=r"q: got shape \(6, 64\); accepted: a 3-D tensor"):
        w.run(lv.q.reshape(6, -1).to(DEV), lv.cache())
    with pytest.raises(ValueError, match=r"level 0: q: got shape"):
        w.run(lv.q[:5].to(DEV), lv.cache())
    with pytest.raises(ValueError, match=r"out: got shape \(6, 4, 8\); accepted: \[6, 4, 16\]"):
        w.run(lv.q.to(DEV), lv.cache(), out=torch.empty(6, HQ, 8, dtype=torch.float16, device=DEV))
    with pytest.raises(TypeError, match=r"lse: got dtype torch.float16; accepted: torch.float32"):
        w.run(lv.q.to(DEV), lv.cache(), lse=torch.empty(6, HQ, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=r"int_workspace_buffers: got 3 entries"):
        w.reset_workspace_buffer(ws(), [ws()] * 3)
    w.reset_workspace_buffer(ws(), [ws(), ws()])


@pytest.mark.skipif(CUDA, reason="on a GPU every backend takes bfloat16")
def test_backend_refusal_carries_its_reason():
    lv = Levels(*SHAPES[2], dtype=torch.float16, seed=2)
    w = MultiLevelCascadeAttentionWrapper(2, ws("cpu"), backend="triton")
    with pytest.raises(BackendSelectionError, match=r"backend 'triton' cannot run .*q_dtype: got bf16") as ei:
        w.plan(*lv.tables(), HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
    assert any("level 0" in n for n in getattr(ei.value, "__notes__", []))
    d = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws("cpu"), backend="triton")
    with pytest.raises(BackendSelectionError, match=r"q_dtype: got bf16"):
        d.begin_forward(t32([0, 1]), t32([0]), t32([3]), HQ, HKV, D, PAGE, torch.bfloat16)


def test_bad_input_shared_prefix():
    lv, ks, vs = shared_problem(torch.float16, 4, [3, 2], [0, 1, 2], "NHD", seed=1)
    qo, ip, ix, last = lv.tables()
    d = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws(), backend="reference")
    with pytest.raises(RuntimeError, match=r"forward\(\) called before begin_forward\(\)"):
        d.forward(lv.q.to(DEV), ks.to(DEV), vs.to(DEV), lv.cache())
    d.begin_forward(ip[0], ix[0], last[0], HQ, HKV, D, PAGE, torch.float16)
    with pytest.raises(ValueError, match=r"k_shared: got shape \(4, 1, 16\); accepted: .*num_kv_heads = 2"):
        d.forward(lv.q.to(DEV), ks[:, :1].to(DEV), vs.to(DEV), lv.cache())
    with pytest.raises(ValueError, match=r"v_shared: got shape \(4, 32\); accepted: a 3-D tensor"):
        d.forward(lv.q.to(DEV), ks.to(DEV), vs.reshape(4, -1).to(DEV), lv.cache())
    with pytest.raises(TypeError, match=r"q: got dtype"):
        d.forward(lv.q.float().to(DEV), ks.to(DEV), vs.to(DEV), lv.cache())
    p = BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws(), backend="reference")
    with pytest.raises(RuntimeError, match=r"forward\(\) called before begin_forward\(\)"):
        p.forward(lv.q.to(DEV), ks.to(DEV), vs.to(DEV), lv.cache())
    p.begin_forward(qo[0], ip[0], ix[0], last[0], HQ, HKV, D, PAGE)
    with pytest.raises(ValueError, match=r"sm_scale"):
        p.forward(lv.q.to(DEV), ks.to(DEV), vs.to(DEV), lv.cache(), sm_scale=0.0)
    out = p.forward(lv.q.to(DEV), ks.to(DEV), vs.to(DEV), lv.cache())  # a failed re-plan kept the old one
    assert out.shape == (2, HQ, D) and not torch.isnan(out).any()
    with pytest.raises(TypeError, match=r"k_shared: got list"):
        p.forward(lv.q.to(DEV), [ks], vs.to(DEV), lv.cache())


def test_top_level_exports_and_flashinfer_names():
    for name in ("MultiLevelCascadeAttentionWrapper", "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
                 "BatchPrefillWithSharedPrefixPagedKVCacheWrapper"):
        assert getattr(attncore, name) is getattr(attncore.cascade, name)
        assert name in attncore.cascade.__all__
    import inspect

    sig = inspect.signature(MultiLevelCascadeAttentionWrapper.plan)
    assert list(sig.parameters)[1:] == [
        "qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr", "paged_kv_last_page_len", "num_qo_heads",
        "num_kv_heads", "head_dim", "page_size", "causal", "pos_encoding_mode", "use_fp16_qk_reduction",
        "sm_scale", "window_left", "logits_soft_cap", "rope_scale", "rope_theta", "q_data_type", "kv_data_type"]
    assert list(inspect.signature(MultiLevelCascadeAttentionWrapper).parameters)[:8] == [
        "num_levels", "float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf_arr",
        "paged_kv_indptr_buf_arr", "paged_kv_indices_buf_arr", "paged_kv_last_page_len_buf_arr"]
    assert list(inspect.signature(BatchPrefillWithSharedPrefixPagedKVCacheWrapper.forward).parameters)[1:10] == [
        "q", "k_shared", "v_shared", "unique_kv_cache", "causal", "use_fp16_qk_reduction", "sm_scale",
        "rope_scale", "rope_theta"]
    assert list(inspect.signature(BatchDecodeWithSharedPrefixPagedKVCacheWrapper.begin_forward).parameters)[1:] == [
        "unique_kv_indptr", "unique_kv_indices", "unique_kv_last_page_len", "num_qo_heads", "num_kv_heads",
        "head_dim", "page_size", "data_type"]


# ------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_multilevel_and_shared_prefix(dtype):
    qo, kv = SHAPES[3]
    lv = Levels(qo, kv, dtype=dtype, seed=11, device="cuda")
    w = MultiLevelCascadeAttentionWrapper(3, ws("cuda"))  # backend auto
    w.plan(*lv.tables(), HQ, HKV, D, PAGE, causal=True, q_data_type=dtype)
    out, lse = w.run(lv.q.cuda(), lv.cache(), return_lse=True)
    check(out, lse, *golden_levels(lv, causal=True), dtype)
    lv2, ks, vs = shared_problem(dtype, 9, [3, 0, 8, 1], list(range(5)), "NHD", seed=2)
    d = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws("cuda"))
    _, ip, ix, last = lv2.tables()
    d.begin_forward(ip[0], ix[0], last[0], HQ, HKV, D, PAGE, dtype)
    out, lse = d.forward(lv2.q.cuda(), ks.cuda(), vs.cuda(), lv2.cache(), return_lse=True)
    check(out, lse, *golden_shared(lv2, ks, vs, causal=False), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_multilevel_cuda_graph_capture():
    qo, kv = SHAPES[2]
    dtype = torch.float16
    lv = Levels(qo, kv, dtype=dtype, seed=12, device="cuda")
    w = MultiLevelCascadeAttentionWrapper(2, ws("cuda"), "NHD", True)
    w.plan(*lv.tables(), HQ, HKV, D, PAGE, causal=True, q_data_type=dtype)
    q, cache = lv.q.cuda(), lv.cache()
    eager = w.run(q, cache)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w.run(q, cache)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = w.run(q, cache)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, atol=0, rtol=0)
    assert math.isfinite(float(captured.float().abs().max()))
