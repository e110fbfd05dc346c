"""The fused POD op (issue 16): both parts in one Triton launch, through the public POD wrappers,
against the fp64 golden (outputs and LSEs of both parts, edge shapes), and the fused-vs-composed choice."""

from __future__ import annotations

import pytest
import torch

import attncore
from attncore.core import registry
from attncore.core.problem import AttentionProblem, PODBatch, PODDeclined, pod_problem
from attncore.testing.golden import golden_and_baseline, max_error, tolerance


@pytest.fixture
def triton_pod():
    """The registered Triton backend, fusing every batch (the cost model is the GPU's)."""
    entry = registry.entries().get("triton")
    if entry is None or entry.unavailable_reasons():
        pytest.skip("triton backend unavailable")
    b = entry.backend
    if not hasattr(b, "_pod"):
        pytest.skip("the triton backend registered has no fused POD op")
    old = b._pod
    b._pod = ("always",) + old[1:]
    yield b
    b._pod = old


def _paged(kv_lens, page, hkv, d, dtype, layout="NHD"):
    pages = [(n + page - 1) // page for n in kv_lens]
    indptr = torch.tensor([0] + torch.tensor(pages, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    n = int(indptr[-1])
    indices = torch.randperm(n + 2)[:n].to(torch.int32)  # shuffled, with unused pages
    last = torch.tensor([(x - 1) % page + 1 if x else 0 for x in kv_lens], dtype=torch.int32)
    shape = (n + 2, 2, page, hkv, d) if layout == "NHD" else (n + 2, 2, hkv, page, d)
    cache = torch.randn(shape, dtype=dtype)
    return indptr, indices, last, cache


def _request_kv(cache, indptr, indices, kv_len, i, layout="NHD"):
    pg = indices[int(indptr[i]):int(indptr[i + 1])].long()
    k, v = cache[pg, 0], cache[pg, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k.reshape(-1, *k.shape[2:])[:kv_len], v.reshape(-1, *v.shape[2:])[:kv_len]


def _check(out, lse, q, k, v, dtype, **kw):
    """One request against the golden, by the project's tolerance rule."""
    go, gl, bo, bl = golden_and_baseline(q, k, v, dtype=dtype, **kw)
    assert max_error(out, go) <= tolerance(bo, go, dtype), (max_error(out, go), tolerance(bo, go, dtype))
    assert max_error(lse, gl) <= tolerance(bl, gl, dtype, kind="lse"), (max_error(lse, gl),)


POD_CASES = {
    "causal": dict(causal_p=True),
    "qo_gt_kv": dict(qo=9, kv=5),
    "window_softcap": dict(causal_p=True, window_left_p=3, window_left=2),
    "alibi": dict(pos_p="ALIBI", pos="ALIBI", causal_p=True),
    "rope": dict(pos_p="ROPE_LLAMA", pos="ROPE_LLAMA", causal_p=True),
    "custom_mask": dict(custom=True),
    "one_request_page1": dict(kv_lens=[13], page=1),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(POD_CASES))
def test_pod_fused_against_golden(triton_pod, case, dtype):
    c = dict(qo=7, kv=12, kv_lens=[5, 0, 17, 1], page=4, causal_p=False, window_left_p=-1, window_left=-1,
             pos_p="NONE", pos="NONE", custom=False)
    c.update(POD_CASES[case])
    torch.manual_seed(hash(case) % 1000)
    hq, hkv, d = 4, 2, 32
    indptr, indices, last, cache = _paged(c["kv_lens"], c["page"], hkv, d, dtype)
    qp = torch.randn(c["qo"], hq, d, dtype=dtype)
    kp, vp = torch.randn(c["kv"], hkv, d, dtype=dtype), torch.randn(c["kv"], hkv, d, dtype=dtype)
    qd = torch.randn(len(c["kv_lens"]), hq, d, dtype=dtype)
    mask = torch.rand(c["qo"], c["kv"]) > 0.4 if c["custom"] else None
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="triton")
    w.plan(indptr, indices, last, hq, hkv, d, c["page"], q_data_type=dtype, window_left=c["window_left"],
           pos_encoding_mode=c["pos"])
    (op, lp), (od, ld) = w.run(qp, kp, vp, qd, cache, custom_mask_p=mask, causal_p=c["causal_p"],
                               window_left_p=c["window_left_p"], pos_encoding_mode_p=c["pos_p"],
                               return_lse_p=True, return_lse_d=True)
    assert w.backend == "fused=triton" and w.fused_reason is None
    _check(op, lp, qp, kp, vp, dtype, causal=c["causal_p"], mask=mask, window_left=c["window_left_p"],
           pos_encoding_mode=c["pos_p"])
    for i, n in enumerate(c["kv_lens"]):
        k, v = _request_kv(cache, indptr, indices, n, i)
        _check(od[i:i + 1], ld[i:i + 1], qd[i:i + 1], k, v, dtype, causal=True, window_left=c["window_left"],
               pos_encoding_mode=c["pos"])
        if n == 0:  # a decode row with no keys: out 0, lse -inf
            assert bool((od[i] == 0).all()) and bool(torch.isinf(ld[i]).all())


@pytest.mark.parametrize("mode", ["grid", "persistent"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_batch_pod_fused_against_golden(triton_pod, mode, layout):
    dtype = torch.float16
    torch.manual_seed(3)
    hq, hkv, d, page = 6, 2, 32, 4  # group 3: packed rows do not align with tiles
    old = triton_pod._pod
    triton_pod._pod = ("always", mode, 1, None)
    try:
        kvp, qop = [10, 3], [4, 6]  # request 1: qo > kv
        kvd = [7, 0, 12]
        ip, xp, lp_, cp = _paged(kvp, page, hkv, d, dtype, layout)
        idd, xd, ld_, cd = _paged(kvd, page, hkv, d, dtype, layout)
        qo_indptr_p = torch.tensor([0, qop[0], sum(qop)], dtype=torch.int32)
        qo_indptr_d = torch.arange(len(kvd) + 1, dtype=torch.int32)
        w = attncore.BatchPODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), layout,
                                                     backend="triton")
        w.plan(qo_indptr_p, ip, xp, lp_, qo_indptr_d, idd, xd, ld_, hq, hkv, d, page, q_data_type=dtype)
        qp = torch.randn(sum(qop), hq, d, dtype=dtype)
        qd = torch.randn(len(kvd), hq, d, dtype=dtype)
        (op, lp), (od, ld) = w.run(qp, cp, qd, cd, causal_p=True, return_lse=True)
        assert w.backend == "fused=triton"
        for i, n in enumerate(kvp):
            k, v = _request_kv(cp, ip, xp, n, i, layout)
            s = slice(int(qo_indptr_p[i]), int(qo_indptr_p[i + 1]))
            _check(op[s], lp[s], qp[s], k, v, dtype, causal=True)
        for i, n in enumerate(kvd):
            k, v = _request_kv(cd, idd, xd, n, i, layout)
            _check(od[i:i + 1], ld[i:i + 1], qd[i:i + 1], k, v, dtype, causal=True)
    finally:
        triton_pod._pod = old


def test_pod_auto_on_cpu_composes_and_says_why():
    dtype = torch.float16
    hq, hkv, d, page = 4, 2, 32, 4
    indptr, indices, last, cache = _paged([5, 9], page, hkv, d, dtype)
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD")
    w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dtype)
    w.run(torch.randn(3, hq, d, dtype=dtype), torch.randn(4, hkv, d, dtype=dtype),
          torch.randn(4, hkv, d, dtype=dtype), torch.randn(2, hq, d, dtype=dtype), cache)
    if "triton" in registry.entries() and not registry.entries()["triton"].unavailable_reasons():
        assert "ranks below the reference" in w.fused_reason
    assert w.backend.startswith("prefill=")
    w2 = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="reference")
    w2.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dtype)
    w2.run(torch.randn(3, hq, d, dtype=dtype), torch.randn(4, hkv, d, dtype=dtype),
           torch.randn(4, hkv, d, dtype=dtype), torch.randn(2, hq, d, dtype=dtype), cache)
    assert "no backend runs pod fused" in w2.fused_reason and "op: got pod" in w2.fused_reason


def test_plan_declines_when_decode_needs_split():
    pod = pytest.importorskip("attncore.backends.triton.pod")
    from attncore.core.backend import AttnParams, BatchMeta

    params = AttnParams(sm_scale=0.1)
    mp = BatchMeta.ragged(qo_indptr_host=[0, 1], kv_indptr_host=[0, 16], device="cpu", params=params)
    n = 64
    md = BatchMeta.paged([0, 1], torch.tensor([0, n], dtype=torch.int32), torch.arange(n, dtype=torch.int32),
                         torch.tensor([16], dtype=torch.int32), 16, device="cpu", params=params, decode=True)
    base = AttentionProblem(op="single_prefill", num_qo_heads=4, num_kv_heads=1, head_dim_qk=32, head_dim_vo=32)
    prob = pod_problem("pod", base, base.replace(op="batch_decode", page_size=16, mask="causal"))
    with pytest.raises(PODDeclined, match="needs split-KV"):
        pod.plan_pod(prob, PODBatch(mp, md), interpret=False)
    plan = pod.plan_pod(prob, PODBatch(mp, md), interpret=True, fused="always")
    assert plan.stats["items"] == [1, 1]


def test_pod_problem_and_refusals():
    base = AttentionProblem(op="single_prefill", num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, head_dim_vo=64)
    with pytest.raises(ValueError, match="num_kv_heads: the prefill part has 2, the decode part 4"):
        pod_problem("pod", base, base.replace(op="batch_decode", num_kv_heads=4))
    with pytest.raises(ValueError, match="op: got 'decode'"):
        pod_problem("decode", base, base)
    p = pod_problem("batch_pod", base.replace(page_size=16),
                    base.replace(op="batch_decode", page_size=16, mask="causal", sinks=True))
    assert "sinks" in p.features and "decode[p16 NHD causal sinks]" in p.describe()
    entry = registry.entries().get("triton")
    if entry is not None and hasattr(entry.backend, "_pod"):
        bad = pod_problem("batch_pod", base.replace(page_size=16),
                          base.replace(op="batch_decode", page_size=16, kv_layout="XYZ", mask="causal"))
        assert any(r.axis == "decode kv_layout" for r in entry.backend.reasons(bad))
