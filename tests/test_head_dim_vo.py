"""head_dim_qk != head_dim_vo (DeepSeek-style 192/128; issue 18): q and k have head_dim_qk, v and the output
head_dim_vo, sm_scale defaults to 1/sqrt(head_dim_qk) (FlashInfer 0.2.14).  Ragged and paged prefill (tuple
(K, V) caches) and single prefill, on Triton (the CPU interpreter here, fp16/fp32; bf16 on a GPU) against the
fp64 golden with the project's tolerance rule; the refusals (5-D cache, cuda_fa2, xqa) with their reasons."""

import pytest
import torch

import attncore
from attncore.backends.triton.backend import TritonBackend
from attncore.core import capabilities as caps
from attncore.core.problem import AttentionProblem
from attncore.page import append_paged_kv_cache, unpack_paged_kv_cache
from attncore.testing.golden import golden_and_baseline, max_error, tolerance

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DIMS = [(192, 128), (128, 64), (64, 128)]


def _indptr(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _check(out, lse, q, ks, vs, qi, causal, dtype, **kw):
    """Each request against the fp64 golden (``ks``/``vs``: per-request [kv, Hkv, D] / [kv, Hkv, Dv])."""
    assert out.shape == (q.shape[0], q.shape[1], vs[0].shape[-1])
    for i in range(len(ks)):
        a, b = int(qi[i]), int(qi[i + 1])
        go, gl, bo, bl = golden_and_baseline(q[a:b].cpu(), ks[i].cpu(), vs[i].cpu(), dtype=dtype, causal=causal, **kw)
        err = max_error(out[a:b], go)
        assert err <= tolerance(bo, go, out.dtype), (i, err)
        if lse is not None and b > a:
            assert max_error(lse[a:b], gl) <= tolerance(bl, gl, dtype, kind="lse"), i


def _ragged(dq, dv, qo, kv, *, hq=6, hkv=2, dtype=torch.float16, causal=False, layout="NHD", split=None, seed=0,
            backend="triton"):
    g = torch.Generator().manual_seed(seed)
    qi, ki = _indptr(qo), _indptr(kv)
    q = torch.randn(sum(qo), hq, dq, generator=g).to(dtype).to(DEV)
    k = torch.randn(sum(kv), hkv, dq, generator=g).to(dtype).to(DEV)
    v = torch.randn(sum(kv), hkv, dv, generator=g).to(dtype).to(DEV)
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV),
                                                      kv_layout=layout, backend=backend)
    w.plan(qi, ki, hq, hkv, dq, dv, causal=causal, q_data_type=dtype, fixed_split_size=split)
    kl, vl = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    out, lse = w.run(q, kl, vl, return_lse=True)
    ks = [k[int(ki[i]):int(ki[i + 1])] for i in range(len(kv))]
    vs = [v[int(ki[i]):int(ki[i + 1])] for i in range(len(kv))]
    return w, out, lse, (q, ks, vs, qi)


@pytest.mark.parametrize("dq,dv", DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_matches_the_golden(dq, dv, causal):
    # qo > kv (request 0), kv 0 (request 1), an empty request, a long one; GQA group 3
    qo, kv = [9, 3, 0, 6], [4, 0, 5, 70]
    w, out, lse, (q, ks, vs, qi) = _ragged(dq, dv, qo, kv, causal=causal, seed=dq + dv)
    assert w._planned.problem.head_dim_vo == dv and w.backend == "triton"
    _check(out, lse, q, ks, vs, qi, causal, torch.float16)


@pytest.mark.parametrize("dq,dv", [(192, 128), (64, 128)])
def test_ragged_split_kv_merges_partials_of_head_dim_vo(dq, dv):
    w, out, lse, (q, ks, vs, qi) = _ragged(dq, dv, [5, 1], [100, 60], causal=True, split=32, seed=3)
    stats = w._planned._primary[1].stats
    assert stats["max_splits"] > 1 and stats["part_rows"] > 0, stats
    _check(out, lse, q, ks, vs, qi, True, torch.float16)


@pytest.mark.skipif(DEV == "cuda", reason="fp32 q: Triton serves it on the CPU only (not validated on a GPU)")
def test_ragged_fp32_and_hnd():
    w, out, lse, (q, ks, vs, qi) = _ragged(128, 64, [4, 7], [11, 7], dtype=torch.float32, layout="HND", causal=True)
    _check(out, lse, q, ks, vs, qi, True, torch.float32)


def _paged(dq, dv, qo, kv, page, *, hq=6, hkv=2, dtype=torch.float16, causal=True, layout="NHD", split=None,
           seed=0):
    """A paged batch over a tuple (k_cache, v_cache) with shuffled pages; returns the wrapper, the run's
    (out, lse) and the per-request K/V for the golden."""
    g = torch.Generator().manual_seed(seed)
    npages = [-(-n // page) for n in kv]
    pool = sum(npages) + 3
    perm = torch.randperm(pool, generator=g)[:sum(npages)].to(torch.int32)
    shape = (pool, page, hkv) if layout == "NHD" else (pool, hkv, page)
    kc = torch.randn(*shape, dq, generator=g).to(dtype).to(DEV)
    vc = torch.randn(*shape, dv, generator=g).to(dtype).to(DEV)
    last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv], dtype=torch.int32)
    qi = _indptr(qo)
    q = torch.randn(sum(qo), hq, dq, generator=g).to(dtype).to(DEV)
    w = attncore.BatchPrefillWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV),
                                                     kv_layout=layout, backend="triton")
    w.plan(qi, _indptr(npages), perm, last, hq, hkv, dq, page, dv, causal=causal, q_data_type=dtype,
           fixed_split_size=split)
    out, lse = w.run(q, (kc, vc), return_lse=True)
    ks, vs, p0 = [], [], 0
    for n, c in zip(kv, npages):
        pages = perm[p0:p0 + c].long().to(DEV)
        p0 += c
        for cache, dst in ((kc, ks), (vc, vs)):
            t = cache[pages] if layout == "NHD" else cache[pages].transpose(1, 2)
            dst.append(t.reshape(-1, hkv, cache.shape[-1])[:n])
    return w, out, lse, (q, ks, vs, qi)


@pytest.mark.parametrize("dq,dv", DIMS)
@pytest.mark.parametrize("page", [1, 16])
def test_paged_tuple_cache_matches_the_golden(dq, dv, page):
    w, out, lse, ref = _paged(dq, dv, [7, 2, 0, 5], [3, 0, 9, 37], page, seed=page + dq)
    _check(out, lse, *ref, True, torch.float16)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_split_kv_and_layouts(layout):
    w, out, lse, ref = _paged(192, 128, [3, 1], [90, 50], 16, layout=layout, split=2, causal=False, seed=5)
    assert w._planned._primary[1].stats["max_splits"] > 1
    _check(out, lse, *ref, False, torch.float16)


def test_legacy_forward_replans_with_head_dim_vo():
    w, out, lse, (q, ks, vs, qi) = _ragged(192, 128, [3, 4], [5, 9], causal=False)
    k, v = torch.cat(ks), torch.cat(vs)
    out2 = w.forward(q, k, v, causal=True)  # other options than the plan's: plans again, head_dim_vo kept
    assert w._planned.problem.head_dim_vo == 128 and w._planned.meta.params is not None
    _check(out2, None, q, ks, vs, qi, True, torch.float16)


def test_a_replan_with_another_head_dim_vo_is_a_new_problem():
    # the same wrapper, indptrs and everything but head_dim_vo (a plan memo must key on it)
    w, out, lse, (q, ks, vs, qi) = _ragged(192, 128, [3, 2], [6, 4], causal=True)
    ki = _indptr([6, 4])
    for dv in (64, 128):
        v = torch.randn(10, 2, dv, dtype=torch.float16, device=DEV)
        w.plan(qi, ki, 6, 2, 192, dv, causal=True, q_data_type=torch.float16)
        out = w.run(q, torch.cat(ks), v)
        _check(out, None, q, ks, [v[:6], v[6:]], qi, True, torch.float16)


@pytest.mark.parametrize("dq,dv", [(192, 128), (64, 128)])
def test_single_prefill_with_a_wider_or_narrower_v(dq, dv):
    g = torch.Generator().manual_seed(dq)
    q = torch.randn(5, 6, dq, generator=g).half().to(DEV)
    k = torch.randn(12, 2, dq, generator=g).half().to(DEV)
    v = torch.randn(12, 2, dv, generator=g).half().to(DEV)
    out, lse = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="triton", return_lse=True)
    _check(out, lse, q, [k], [v], torch.tensor([0, 5]), True, torch.float16)
    again = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="triton")  # the cached plan
    assert torch.equal(again, out)


def test_single_prefill_plan_cache_keys_on_v():
    q, k = torch.randn(3, 2, 64).half().to(DEV), torch.randn(7, 2, 64).half().to(DEV)
    for dv in (64, 128, 64, 32):
        v = torch.randn(7, 2, dv).half().to(DEV)
        out = attncore.single_prefill_with_kv_cache(q, k, v, backend="triton")
        _check(out, None, q, [k], [v], torch.tensor([0, 3]), False, torch.float16)


def test_sm_scale_defaults_to_head_dim_qk():
    w, out, lse, (q, ks, vs, qi) = _ragged(192, 128, [4], [6])
    assert abs(w._planned.meta.params.sm_scale - 192 ** -0.5) < 1e-12


def test_append_paged_kv_cache_into_a_tuple_cache_of_two_head_dims():
    kc, vc = torch.zeros(3, 4, 2, 192), torch.zeros(3, 4, 2, 128)
    key, val = torch.randn(5, 2, 192), torch.randn(5, 2, 128)
    append_paged_kv_cache(key, val, torch.zeros(5, dtype=torch.int32), torch.arange(5, dtype=torch.int32),
                          (kc, vc), torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                          torch.tensor([1], dtype=torch.int32))
    assert torch.equal(kc[2], key[:4]) and torch.equal(vc[0, 0], val[4])
    k, v = unpack_paged_kv_cache((kc, vc))
    assert k.shape[-1] == 192 and v.shape[-1] == 128
    with pytest.raises(ValueError, match=r"append_value: got shape \(5, 2, 192\); accepted: \[nnz, 2, 128\]"):
        append_paged_kv_cache(key, key, torch.zeros(5, dtype=torch.int32), torch.arange(5, dtype=torch.int32),
                              (kc, vc), torch.tensor([2, 0], dtype=torch.int32),
                              torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))


# ------------------------------------------------------------------------------------------------ bad input
def test_ragged_run_names_v_with_the_wrong_last_dim():
    w, out, lse, (q, ks, vs, qi) = _ragged(192, 128, [3], [5])
    k = ks[0]
    with pytest.raises(ValueError, match=r"^v: .*128"):
        w.run(q, k, torch.zeros(5, 2, 192, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=r"^k: .*192"):
        w.run(q, torch.zeros(5, 2, 128, dtype=torch.float16, device=DEV), vs[0])
    with pytest.raises(ValueError, match=r"^out: .*128"):
        w.run(q, k, vs[0], out=torch.empty(3, 6, 192, dtype=torch.float16, device=DEV))


def test_paged_run_refuses_a_5d_cache_and_names_the_v_cache():
    w, out, lse, (q, ks, vs, qi) = _paged(192, 128, [3], [20], 16)
    five_d = torch.zeros(4, 2, 16, 2, 192, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match=r"paged_kv_cache: got one tensor of shape \(4, 2, 16, 2, 192\).*"
                                         r"head_dim_qk 192 and head_dim_vo 128.*pass a tuple \(k_cache, v_cache\)"):
        w.run(q, five_d)
    kc = torch.zeros(4, 16, 2, 192, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match=r"paged_kv_cache \(v\).*128"):
        w.run(q, (kc, torch.zeros(4, 16, 2, 192, dtype=torch.float16, device=DEV)))
    with pytest.raises(ValueError, match=r"paged_kv_cache \(k\).*192"):
        w.run(q, (torch.zeros(4, 16, 2, 128, dtype=torch.float16, device=DEV),
                  torch.zeros(4, 16, 2, 128, dtype=torch.float16, device=DEV)))
    with pytest.raises(ValueError, match=r"k_cache shape \(4, 16, 2, 192\) and v_cache shape \(4, 8, 2, 128\)"):
        w.run(q, (kc, torch.zeros(4, 8, 2, 128, dtype=torch.float16, device=DEV)))


def test_plan_rejects_a_non_positive_head_dim_vo():
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="head_dim_vo: got 0, expected a positive int"):
        w.plan(_indptr([1]), _indptr([1]), 2, 2, 64, 0)


def test_single_prefill_names_v():
    q = torch.randn(2, 2, 64).half()
    k = torch.randn(3, 2, 64).half()
    with pytest.raises(ValueError, match=r"^v: "):
        attncore.single_prefill_with_kv_cache(q, k, torch.randn(4, 2, 128).half(), backend="triton")
    with pytest.raises(ValueError, match=r"^v: "):
        attncore.single_prefill_with_kv_cache(q, k, torch.randn(3, 2), backend="triton")


# ------------------------------------------------------------------------------------------------ claims
def _problem(op, dev="cuda", dq=192, dv=128, **kw):
    return AttentionProblem(op=op, device_type=dev, compute_capability=(9, 0) if dev == "cuda" else None,
                            q_dtype=torch.float16, kv_dtype=torch.float16, out_dtype=torch.float16, num_qo_heads=8,
                            num_kv_heads=2, head_dim_qk=dq, head_dim_vo=dv,
                            page_size=16 if "paged" in op or "decode" in op else None, **kw)


@pytest.mark.parametrize("dev", ["cuda", "cpu"])
def test_triton_claims_head_dim_vo_for_prefill_and_decode_not_xqa(dev):
    tb = TritonBackend()
    for op in ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode"):
        assert caps.check(tb.capabilities, _problem(op, dev)) == [], op
    why = caps.check(tb.capabilities, _problem("xqa_decode", dev))
    assert any(r.axis == "head_dim_vo" and "equal to head_dim_qk (192)" in str(r) for r in why), why
    assert not tb._dense_serves(_problem("batch_prefill_ragged", dev, dq=128, dv=64))  # the generic kernel serves it


@pytest.mark.parametrize("name", ["cuda_fa2", "xqa"])
def test_cuda_backends_refuse_with_a_readable_reason(name):  # (cuda_fa2: decode; it serves 192 / 128 prefill on sm90)
    from attncore.core import registry

    be = registry.get_entry(name).backend
    op = "batch_decode" if name == "cuda_fa2" else "xqa_decode"
    why = caps.check(be.capabilities, _problem(op))
    assert any(r.axis == "head_dim_vo" and "128" in str(r) and "head_dim_qk" in str(r) for r in why), why


def test_auto_picks_a_backend_that_serves_it():
    w, out, lse, ref = _ragged(192, 128, [3], [5], backend="auto")
    # xqa refuses it, cuda_fa2 serves it on sm90 only (prefill90): auto picks one that serves it
    sm90 = DEV == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert w.backend == "cuda_fa2" if sm90 else w.backend not in ("cuda_fa2", "xqa"), w.backend
    _check(out, lse, *ref, False, torch.float16)


def test_conformance_suite_computes_the_head_dim_vo_cases_on_triton():
    """What `attncore conformance triton` generates for the head_dim_vo axis: numerics for the prefill and
    decode ops (run here, through the interpreter), a refusal for xqa."""
    from attncore.testing import cases, runner

    fams = cases.generate(TritonBackend(), device=DEV)
    two = [c for c in fams["numerics"] if c.problem.head_dim_vo != c.problem.head_dim_qk]
    assert {c.problem.op for c in two} == {"single_prefill", "batch_prefill_ragged", "batch_prefill_paged",
                                             "batch_decode"}, [c.id for c in two]
    assert any(c.problem.op == "xqa_decode" and c.problem.head_dim_vo != c.problem.head_dim_qk
               for c in fams["refusal"])
    for c in two:
        runner.run_numerics(c)


# ------------------------------------------------------------------------------------------------ GPU (bf16)
@pytest.mark.gpu
@pytest.mark.parametrize("dq,dv", DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bf16_ragged_and_paged(dq, dv, causal):
    for split in (None, 64):
        w, out, lse, ref = _ragged(dq, dv, [300, 17, 1, 0], [300, 40, 700, 9], hq=16, hkv=4,
                                   dtype=torch.bfloat16, causal=causal, split=split, seed=dq)
        _check(out, lse, *ref, causal, torch.bfloat16)
    for page in (1, 16):
        w, out, lse, ref = _paged(dq, dv, [200, 1, 33], [260, 500, 40], page, hq=12, hkv=4, dtype=torch.bfloat16,
                                  causal=causal, seed=page)
        _check(out, lse, *ref, causal, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_bf16_deepseek_shape_long_prefill():
    # DeepSeek-V3 MHA prefill shape: 128 heads (16 here), 192/128, one long causal request
    w, out, lse, ref = _ragged(192, 128, [2048], [2048], hq=16, hkv=16, dtype=torch.bfloat16, causal=True)
    _check(out, lse, *ref, True, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_a_new_plan():
    """Graph mode: the split partials (TmpO) are sized by head_dim_vo; a captured run replays a later plan."""
    b, page, hq, hkv, dq, dv = 4, 16, 16, 4, 192, 128
    g = torch.Generator().manual_seed(7)
    kc = torch.randn(b * 40, page, hkv, dq, generator=g).to(torch.bfloat16).cuda()
    vc = torch.randn(b * 40, page, hkv, dv, generator=g).to(torch.bfloat16).cuda()
    bufs = dict(qo_indptr_buf=torch.zeros(b + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indptr_buf=torch.zeros(b + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buf=torch.zeros(b * 40, dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buf=torch.zeros(b, dtype=torch.int32, device="cuda"))
    w = attncore.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                                     use_cuda_graph=True, backend="triton", **bufs)
    qo = [8, 1, 3, 8]

    def plan(seed):
        r = torch.Generator().manual_seed(seed)
        npages = torch.randint(1, 40, (b,), generator=r).tolist()
        kv = [(n - 1) * page + int(torch.randint(1, page + 1, (1,), generator=r)) for n in npages]
        idx = torch.randperm(b * 40, generator=r)[:sum(npages)].to(torch.int32)
        last = torch.tensor([(n - 1) % page + 1 for n in kv], dtype=torch.int32)
        w.plan(_indptr(qo), _indptr(npages), idx, last, hq, hkv, dq, page, dv, causal=True,
               q_data_type=torch.bfloat16)
        ks, vs, p0 = [], [], 0
        for n, c in zip(kv, npages):
            pages = idx[p0:p0 + c].long().cuda()
            p0 += c
            ks.append(kc[pages].reshape(-1, hkv, dq)[:n])
            vs.append(vc[pages].reshape(-1, hkv, dv)[:n])
        return ks, vs

    q = torch.randn(sum(qo), hq, dq, generator=g).to(torch.bfloat16).cuda()
    out = torch.empty(sum(qo), hq, dv, dtype=torch.bfloat16, device="cuda")
    plan(1)
    w.run(q, (kc, vc), out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, (kc, vc), out=out)
    ks, vs = plan(2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, None, q, ks, vs, _indptr(qo), True, torch.bfloat16)
