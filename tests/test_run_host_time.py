"""run()'s and the one-call functions' host-time caches (issue 15 item 1): a wrapper's cached run goes straight to
the backend's run of the planned variant and reuses the (k, v) views of a combined paged cache; a single decode of a
seen signature runs its cached plan at once.  Each: a hit that stays correct (fp64 golden, the project's tolerance
rule), a miss on any change a check reads, and a bad input refused with the cold cache's message on a warm one."""

import gc

import pytest
import torch

import attncore
from attncore.core import plan_cache
from attncore.testing.golden import golden_and_baseline, max_error, tolerance

H, HKV, D, PAGE = 4, 2, 16, 4


@pytest.fixture(autouse=True)
def _fresh_one_call_plans():
    """Each test starts and ends with an empty one-call plan cache (other files count its misses)."""
    plan_cache.ONE_CALL_PLANS.clear()
    yield
    plan_cache.ONE_CALL_PLANS.clear()


def _close(out, q, k, v, **kw):
    go, _, bo, _ = golden_and_baseline(q, k, v, dtype=q.dtype, **kw)
    assert max_error(out.double(), go) <= tolerance(bo, go, q.dtype)


def _batch(backend="reference", pages=(2, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    n = int(indptr[-1])
    indices = torch.randperm(n, generator=g).to(torch.int32)
    last = torch.randint(1, PAGE + 1, (len(pages),), generator=g).to(torch.int32)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend=backend)
    w.plan(indptr, indices, last, H, HKV, D, PAGE, q_data_type=torch.float16)
    cache = torch.randn(n, 2, PAGE, HKV, D, generator=g).half()
    return w, (indptr, indices, last), cache


def _kv_of(cache, table, i):
    """Request i's K and V ([len, Hkv, D]) gathered from a combined NHD cache."""
    indptr, indices, last = table
    pages = indices[indptr[i]:indptr[i + 1]].long()
    n = (len(pages) - 1) * PAGE + int(last[i])
    kv = cache[pages]  # [p, 2, PAGE, Hkv, D]
    return kv[:, 0].reshape(-1, HKV, D)[:n], kv[:, 1].reshape(-1, HKV, D)[:n]


def _check_decode(out, q, cache, table):
    for i in range(q.shape[0]):
        k, v = _kv_of(cache, table, i)
        _close(out[i:i + 1], q[i:i + 1], k, v)


class _Counting:
    """Counts the wrapper's full run() checks (a miss runs them, a hit does not)."""

    def __init__(self, monkeypatch, w):
        self.n = 0
        real = w._paged_kv

        def paged_kv(kv):
            self.n += 1
            return real(kv)
        monkeypatch.setattr(w, "_paged_kv", paged_kv)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cached_run_goes_to_the_backend_and_stays_correct(monkeypatch, backend, cpu_backend):
    w, table, cache = _batch(backend)
    count = _Counting(monkeypatch, w)
    calls = []
    b = w._planned.backend
    real = type(b).run
    monkeypatch.setattr(type(b), "run", lambda self, plan, args: (calls.append(plan), real(self, plan, args))[1])
    for i in range(3):  # new values of one signature: one checked run, then hits
        q = torch.randn(2, H, D).half()
        _check_decode(w.run(q, cache), q, cache, table)
    # run() on the first two; Triton relaunches the third (test_wrapper_hits_relaunch_where_the_backend_offers_it)
    assert count.n == 1 and len(calls) == (3 if backend == "reference" else 2)
    assert all(p is w._planned._primary[1] for p in calls)
    q = torch.randn(2, H, D).half()
    out, lse = w.run(q, cache, return_lse=True)  # LSE: another signature, checked once, then its own hit
    out2, lse2 = w.run(q, cache, return_lse=True)
    assert count.n == 2 and torch.equal(out, out2) and torch.equal(lse, lse2) and lse.shape == (2, H)
    _check_decode(out, q, cache, table)


def test_changed_strides_dtype_or_scale_miss(monkeypatch):
    w, table, cache = _batch()
    count = _Counting(monkeypatch, w)
    q = torch.randn(2, H, D).half()
    w.run(q, cache)
    qt = torch.randn(H, 2, D).half().transpose(0, 1)  # same shape, other strides
    _check_decode(w.run(qt, cache), qt, cache, table)
    assert count.n == 2
    half = w.run(q, cache, v_scale=0.5)  # a scale: another key
    assert count.n == 3
    assert torch.allclose(half.float(), w.run(q, cache).float() * 0.5, atol=2e-3)
    strided = torch.randn(cache.shape[0], 2, PAGE, HKV, 2 * D).half()[..., :D]  # other cache strides: checked
    w.run(q, strided)
    assert count.n == 4  # the v_scale=1 run above hit; this one is checked


def test_warm_cache_refuses_bad_input_with_the_cold_message():
    w, table, cache = _batch()
    q = torch.randn(2, H, D).half()
    bad = {"dtype": (q.float(), cache), "non-contiguous last dim": (torch.randn(2, H, 2 * D).half()[..., ::2], cache),
           "kv dtype": (q, cache.float()), "out dtype": (q, cache)}
    cold = {}
    for name, (qq, cc) in bad.items():
        w._run_cache.clear()
        with pytest.raises((TypeError, ValueError)) as e:
            w.run(qq, cc, out=torch.empty(2, H, D) if name == "out dtype" else None)
        cold[name] = (e.type, str(e.value))
    w.run(q, cache)  # warm
    w.run(q, cache)
    for name, (qq, cc) in bad.items():
        with pytest.raises(cold[name][0]) as e:
            w.run(qq, cc, out=torch.empty(2, H, D) if name == "out dtype" else None)
        assert str(e.value) == cold[name][1], name


def test_kv_views_reused_for_the_same_cache_and_dropped_with_it():
    w, table, cache = _batch()
    q = torch.randn(2, H, D).half()
    w.run(q, cache)
    w.run(q, cache)
    views = w._kv_views
    k = views.k
    w.run(q, cache)
    assert views.k is k  # the same tensor object: its views reused
    other = cache.clone()  # another cache of the same signature: its own views, its own values
    _check_decode(w.run(q, other), q, other, table)
    assert views.k is not k and views.k.data_ptr() == other.data_ptr()
    cache.set_(cache.clone())  # the same object on new memory: new views
    out = w.run(q, cache)
    assert views.k.data_ptr() == cache.data_ptr()
    _check_decode(out, q, cache, table)
    del cache, other, k
    gc.collect()
    assert views.k is None and views.v is None  # the views (which hold the memory) went with the cache


def test_replan_forgets_the_run_cache():
    w, table, cache = _batch()
    q = torch.randn(2, H, D).half()
    w.run(q, cache)
    w.run(q, cache)
    w.plan(table[0][:2], table[1][:int(table[0][1])], table[2][:1], H, HKV, D, PAGE, q_data_type=torch.float16)
    assert w._run_cache == {}
    with pytest.raises(ValueError, match=r"q: got shape \[2, 4, 16\], expected \[1, 4, 16\]"):
        w.run(q, cache)


# ----------------------------------------------------------------------------- single decode
def _decode_kw(**kw):
    return dict(backend="reference", **kw)


def test_single_decode_hit_skips_single_prefill(monkeypatch):
    q, k, v = torch.randn(H, D).half(), torch.randn(7, HKV, D).half(), torch.randn(7, HKV, D).half()
    attncore.single_decode_with_kv_cache(q, k, v, **_decode_kw())
    import attncore.decode as dec

    monkeypatch.setattr(dec, "_single_decode", lambda *a, **kw: pytest.fail("a hit went through the checked path"))
    h = plan_cache.ONE_CALL_PLANS.hits
    for _ in range(3):
        q, k, v = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
        out = attncore.single_decode_with_kv_cache(q, k, v, **_decode_kw())
        assert out.shape == (H, D) and out.dtype == q.dtype
        _close(out.unsqueeze(0), q.unsqueeze(0), k, v)
    assert plan_cache.ONE_CALL_PLANS.hits == h + 3


def _count_relaunches(monkeypatch, cls) -> list:
    """A list that grows by one per call of a ``go`` that ``cls.relaunch`` hands out (patched for the test)."""
    relaunched = []
    real = cls.relaunch

    def counted(self, plan, args):
        go = real(self, plan, args)
        if go is None:
            return None

        def counting(*a):
            relaunched.append(1)
            go(*a)
        return counting
    monkeypatch.setattr(cls, "relaunch", counted)
    return relaunched


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("op", ["single_decode", "single_prefill"])
@pytest.mark.parametrize("backend", ["triton", "cuda_fa2", "reference"])
def test_one_call_hits_relaunch_where_the_backend_offers_it(op, backend, device, monkeypatch):
    """From a signature's second hit on, Triton's and cuda_fa2's plans run through their relaunch (no run() checks)
    and stay correct on fresh inputs, LSE and sinks included; the reference backend has none and keeps calling
    run().  cuda_fa2's relaunch on the CPU: tests/test_cuda_fa2.py (its structs against run()'s)."""
    from attncore.core import registry
    from attncore.kernels import interpreting

    if device == "cpu" and backend == "triton" and not interpreting():
        pytest.skip("CPU tensors through Triton's interpreter, which TRITON_INTERPRET (unset here) selects")
    if device == "cpu" and backend == "cuda_fa2":
        pytest.skip("cuda_fa2 runs on a GPU only")
    cls = type(registry.get_backend(backend))
    d = 64 if backend == "cuda_fa2" else D  # cuda_fa2's head dims start at 64
    g = torch.Generator().manual_seed(3)
    qo = 1 if op == "single_decode" else 5
    fn = getattr(attncore, f"{op}_with_kv_cache")
    kw = dict(backend=backend, return_lse=True, **({} if op == "single_decode" else {"causal": True}))
    relaunched = _count_relaunches(monkeypatch, cls)
    for i in range(4):
        q = torch.randn(qo, H, d, generator=g).half()
        k, v = torch.randn(9, HKV, d, generator=g).half(), torch.randn(9, HKV, d, generator=g).half()
        sinks = torch.randn(H, generator=g)
        dq, dk, dv, ds = (t.to(device) for t in (q, k, v, sinks))
        out, lse = fn(dq[0] if op == "single_decode" else dq, dk, dv, sinks=ds, **kw)
        go, glse, bo, blse = golden_and_baseline(q, k, v, dtype=q.dtype, causal=True, sinks=sinks)
        assert max_error(out.cpu().reshape(qo, H, d).double(), go) <= tolerance(bo, go, q.dtype)
        assert max_error(lse.cpu().reshape(qo, H).double(), glse) <= tolerance(blse, glse, torch.float32)
    # the first call plans and runs, the second runs and asks for the relaunch, the last two relaunch
    assert len(relaunched) == (0 if backend == "reference" else 2)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("wrapper, backend", [("decode", "triton"), ("decode", "cuda_fa2"), ("decode", "xqa"),
                                              ("decode", "reference"),
                                              ("ragged", "triton"), ("ragged", "cuda_fa2"), ("ragged", "sdpa")])
def test_wrapper_hits_relaunch_where_the_backend_offers_it(wrapper, backend, device, monkeypatch):
    """A wrapper's run() of a seen signature runs through the backend's relaunch from the key's second hit on, and
    stays correct on fresh inputs (LSE included); the reference backend has none and keeps calling run()."""
    from attncore.core import registry
    from attncore.kernels import interpreting

    if backend not in registry.available_backends():
        pytest.skip(f"{backend} is not available here")
    if device == "cpu" and backend == "triton" and not interpreting():
        pytest.skip("CPU tensors through Triton's interpreter, which TRITON_INTERPRET (unset here) selects")
    if device == "cpu" and backend in ("cuda_fa2", "xqa"):
        pytest.skip(f"{backend} runs on a GPU only")
    cls = type(registry.get_backend(backend))
    d = 64 if backend in ("cuda_fa2", "xqa") else D
    g = torch.Generator().manual_seed(5)
    relaunched = _count_relaunches(monkeypatch, cls)
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    if wrapper == "decode":
        w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, backend=backend)
        indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
        indices, last = torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([3, PAGE], dtype=torch.int32)
        w.plan(indptr, indices, last, H, HKV, d, PAGE, q_data_type=torch.float16)
    else:
        w = attncore.BatchPrefillWithRaggedKVCacheWrapper(ws, backend=backend)
        w.plan(torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32), H, HKV, d,
               q_data_type=torch.float16)  # not causal: sdpa's relaunch declines a bottom-right causal piece
    for i in range(5):
        if wrapper == "decode":
            q = torch.randn(2, H, d, generator=g).half()
            cache = torch.randn(3, 2, PAGE, HKV, d, generator=g).half()
            dq = q.to(device)
            if i == 4 and backend == "xqa":  # q's signature, 2 bytes off 16: xqa's relaunch hands it to its run()
                dq = torch.empty(dq.numel() + 1, dtype=dq.dtype, device=device)[1:].view(dq.shape).copy_(dq)
            out, lse = w.run(dq, cache.to(device), return_lse=True)
            for i, (pages, n) in enumerate((([2, 0], PAGE + 3), ([1], PAGE))):
                kv = cache[pages]
                k, v = kv[:, 0].reshape(-1, HKV, d)[:n], kv[:, 1].reshape(-1, HKV, d)[:n]
                gold, glse, bo, blse = golden_and_baseline(q[i:i + 1], k, v, dtype=q.dtype)
                assert max_error(out[i:i + 1].cpu().double(), gold) <= tolerance(bo, gold, q.dtype)
                assert max_error(lse[i:i + 1].cpu().double(), glse) <= tolerance(blse, glse, torch.float32)
        else:
            q = torch.randn(5, H, d, generator=g).half()
            k, v = torch.randn(9, HKV, d, generator=g).half(), torch.randn(9, HKV, d, generator=g).half()
            out, lse = w.run(q.to(device), k.to(device), v.to(device), return_lse=True)
            gold, glse, bo, blse = golden_and_baseline(q, k, v, dtype=q.dtype)
            assert max_error(out.cpu().double(), gold) <= tolerance(bo, gold, q.dtype)
            assert max_error(lse.cpu().double(), glse) <= tolerance(blse, glse, torch.float32)
    # the first run is checked, the second hits and asks for the relaunch, the last three relaunch
    assert len(relaunched) == (0 if backend == "reference" else 3)


DECODE_CHANGES = {
    "kv_len": lambda a: dict(a, k=torch.randn(9, HKV, D).half(), v=torch.randn(9, HKV, D).half()),
    "q strides": lambda a: dict(a, q=torch.randn(H, 2 * D).half()[:, :D]),
    "window_left": lambda a: dict(a, window_left=2),
    "logits_soft_cap": lambda a: dict(a, logits_soft_cap=5.0),
    "sm_scale": lambda a: dict(a, sm_scale=0.3),
    "k_scale": lambda a: dict(a, k_scale=0.5),
    "sinks": lambda a: dict(a, sinks=torch.randn(H)),
    "kv_layout": lambda a: dict(a, k=a["k"].transpose(0, 1).contiguous(), v=a["v"].transpose(0, 1).contiguous(),
                                kv_layout="HND"),
}


@pytest.mark.parametrize("what", list(DECODE_CHANGES))
def test_single_decode_a_changed_value_misses(what):
    base = dict(q=torch.randn(H, D).half(), k=torch.randn(7, HKV, D).half(), v=torch.randn(7, HKV, D).half(),
                backend="reference")
    attncore.single_decode_with_kv_cache(**base)
    attncore.single_decode_with_kv_cache(**base)
    m = plan_cache.ONE_CALL_PLANS.misses
    args = DECODE_CHANGES[what](base)
    out = attncore.single_decode_with_kv_cache(**args)
    assert plan_cache.ONE_CALL_PLANS.misses > m  # the decode key missed (and single prefill's too)
    k, v = args["k"], args["v"]
    if args.get("kv_layout") == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    gkw = {n: args[n] for n in ("sm_scale", "window_left", "logits_soft_cap", "sinks", "k_scale") if n in args}
    _close(out.unsqueeze(0), args["q"].unsqueeze(0), k, v, **gkw)
    m = plan_cache.ONE_CALL_PLANS.misses
    again = attncore.single_decode_with_kv_cache(**args)  # that signature now hits
    assert plan_cache.ONE_CALL_PLANS.misses == m and torch.equal(again, out)


def test_single_decode_lse_and_out_on_a_hit():
    q, k, v = torch.randn(H, D).half(), torch.randn(7, HKV, D).half(), torch.randn(7, HKV, D).half()
    out, lse = torch.empty(H, D).half(), torch.empty(H)
    for _ in range(2):
        r = attncore.single_decode_with_kv_cache(q, k, v, out=out, lse=lse, return_lse=True, backend="reference")
        assert r[0].data_ptr() == out.data_ptr() and r[1].data_ptr() == lse.data_ptr()
    _, gl, _, _ = golden_and_baseline(q.unsqueeze(0), k, v, dtype=q.dtype)
    _close(out.unsqueeze(0), q.unsqueeze(0), k, v)
    assert torch.allclose(lse.double(), gl.reshape(-1), atol=1e-2)
    o2, l2 = attncore.single_decode_with_kv_cache(q, k, v, return_lse=True, backend="reference")  # allocated
    assert torch.equal(o2, out) and torch.equal(l2, lse) and l2.shape == (H,)


def test_single_decode_warm_cache_refuses_bad_input_with_the_cold_message():
    q, k, v = torch.randn(H, D).half(), torch.randn(7, HKV, D).half(), torch.randn(7, HKV, D).half()
    bad = {
        "q dtype": dict(q=q.to(torch.int16), k=k, v=v),
        "k dtype": dict(q=q, k=k.float(), v=v),
        "q ndim": dict(q=q.unsqueeze(0), k=k, v=v),
        "q last dim strided": dict(q=torch.randn(H, 2 * D).half()[:, ::2], k=k, v=v),
        "out dtype": dict(q=q, k=k, v=v, out=torch.empty(H, D)),
        "lse shape": dict(q=q, k=k, v=v, lse=torch.empty(H + 1), return_lse=True),
    }

    def err(kw):
        with pytest.raises((TypeError, ValueError)) as e:
            attncore.single_decode_with_kv_cache(**kw, backend="reference")
        return e.type, str(e.value)

    plan_cache.ONE_CALL_PLANS.clear()
    cold = {n: err(kw) for n, kw in bad.items()}
    attncore.single_decode_with_kv_cache(q, k, v, backend="reference")  # warm
    attncore.single_decode_with_kv_cache(q, k, v, backend="reference", out=torch.empty(H, D).half())
    for n, kw in bad.items():
        assert err(kw) == cold[n], n


# ----------------------------------------------------------------------------- single prefill
def test_single_prefill_hit_runs_without_planning(monkeypatch):
    q, k, v = torch.randn(5, H, D).half(), torch.randn(9, HKV, D).half(), torch.randn(9, HKV, D).half()
    attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference")
    import attncore.prefill as pre

    monkeypatch.setattr(pre, "plan_single", lambda **kw: pytest.fail("a hit went through plan_single"))
    m = plan_cache.ONE_CALL_PLANS.misses
    for _ in range(2):
        q, k, v = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
        out = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference")
        _close(out, q, k, v, causal=True)
    assert plan_cache.ONE_CALL_PLANS.misses == m


def test_single_prefill_warm_cache_refuses_bad_input_with_the_cold_message():
    q, k, v = torch.randn(5, H, D).half(), torch.randn(9, HKV, D).half(), torch.randn(9, HKV, D).half()
    bad = {
        "q dtype": dict(q=q.to(torch.int16), k=k, v=v),
        "v dtype": dict(q=q, k=k, v=v.float()),
        "q last dim strided": dict(q=torch.randn(5, H, 2 * D).half()[..., ::2], k=k, v=v),
        "k last dim strided": dict(q=q, k=torch.randn(9, HKV, 2 * D).half()[..., ::2], v=v),
        "out dtype": dict(q=q, k=k, v=v, out=torch.empty(5, H, D)),  # was cached before its check (fixed)
        "out dtype again": dict(q=q, k=k, v=v, out=torch.empty(5, H, D)),
        "lse dtype": dict(q=q, k=k, v=v, lse=torch.empty(5, H).half(), return_lse=True),
        "lse dtype again": dict(q=q, k=k, v=v, lse=torch.empty(5, H).half(), return_lse=True),
        "causal kv < qo": dict(q=torch.randn(10, H, D).half(), k=k, v=v),
        "o_dtype unhashable": dict(q=q, k=k, v=v, o_dtype=[torch.float16]),
    }

    def err(kw):
        with pytest.raises((TypeError, ValueError)) as e:
            attncore.single_prefill_with_kv_cache(**kw, causal=True, backend="reference")
        return e.type, str(e.value)

    plan_cache.ONE_CALL_PLANS.clear()
    cold = {n: err(kw) for n, kw in bad.items()}
    for _ in range(2):  # warm every signature close to the bad ones
        attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference")
        attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference",
                                              out=torch.empty(5, H, D).half())
    for n, kw in bad.items():
        assert err(kw) == cold[n], n
