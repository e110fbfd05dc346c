"""torch.compile: wrapper.run() and the one-call functions inside torch.compile(fullgraph=True) with no
graph break, equal to eager (docs/semantics.md, "torch.compile").  CPU: the reference backend and "auto"."""

import copy
import gc
import shutil

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import attncore
from attncore.core import ops
from attncore.testing.golden import ATOL, max_error

HQ, HKV, D, PAGE = 4, 2, 16, 4
DT = torch.float16
# "auto" picks the reference on a CPU; Triton runs through its interpreter (CPU-only machines)
_TRITON_CPU = "triton" in attncore.available_backends() and not torch.cuda.is_available()
BACKENDS = ["reference", "auto",
            pytest.param("triton", marks=pytest.mark.skipif(not _TRITON_CPU, reason="no Triton CPU interpreter"))]
COMPILERS = ["eager", "aot_eager"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiled(fn, compiler="eager", **kw):
    return torch.compile(fn, fullgraph=True, backend=compiler, **kw)


def _no_graph_breaks():
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def _close(got, want, dtype=DT):
    """Compiled against eager: the tolerance rule's rounding floor (golden.ATOL) of the output dtype;
    -inf LSEs must match exactly."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert max_error(got, want.detach().to(torch.float64)) <= ATOL[dtype]


def _table(lens, page=PAGE, spare=2, seed=0):
    """(indptr, indices, last_page_len, num_pages) of requests with KV lengths ``lens``, pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    npages = [(n + page - 1) // page for n in lens]
    total = sum(npages) + spare
    indices = torch.randperm(total, generator=g)[:sum(npages)].to(torch.int32)
    indptr = torch.tensor([0] + list(torch.tensor(npages).cumsum(0)), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in lens], dtype=torch.int32)
    return indptr, indices, last, total


def _cache(num_pages, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, 2, PAGE, HKV, D, generator=g).to(DT)


def _ws():
    return torch.empty(1 << 20, dtype=torch.uint8)


# --------------------------------------------------------------------------------------------- decode
def _decode_wrapper(backend, lens=(5, 8, 1), seed=0):
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD", backend=backend)
    indptr, indices, last, total = _table(lens, seed=seed)
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DT)
    return w, total


def _attention_layer(wrapper, wq, wo):
    """A small attention layer: projection, wrapper.run() on the paged cache, output projection."""

    def layer(x, cache):
        q = (x @ wq).view(x.shape[0], HQ, D)
        o = wrapper.run(q, cache)
        return o, o.reshape(x.shape[0], HQ * D) @ wo

    return layer


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_layer_no_graph_break_equals_eager(backend, compiler):
    w, total = _decode_wrapper(backend)
    wq = (torch.randn(HQ * D, HQ * D) / D).to(DT)
    wo = (torch.randn(HQ * D, HQ * D) / D).to(DT)
    layer = _attention_layer(w, wq, wo)
    x, cache = torch.randn(3, HQ * D).to(DT), _cache(total)
    o, y = _compiled(layer, compiler)(x, cache)
    _no_graph_breaks()
    eo, ey = layer(x, cache)
    _close(o, eo)
    torch.testing.assert_close(y, ey)
    if backend == "reference" and compiler == "eager":  # the same verdict from torch._dynamo.explain
        torch._dynamo.reset()
        ex = torch._dynamo.explain(layer)(x, cache)
        assert ex.graph_break_count == 0 and ex.graph_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_return_lse_out_given_scales_sinks(backend):
    w, total = _decode_wrapper(backend)
    cache, q = _cache(total), torch.randn(3, HQ, D).to(DT)
    sinks = torch.randn(HQ)

    def fn(q, cache, out, k_scale):
        o, lse = w.run(q, cache, out=out, return_lse=True, k_scale=k_scale, v_scale=0.5, sinks=sinks)
        return o, lse

    out = torch.full((3, HQ, D), float("nan"), dtype=DT)
    for k_scale in (0.75, torch.tensor([0.75])):  # a number, and a 1-element tensor (read inside the op)
        torch._dynamo.reset()
        o, lse = _compiled(fn)(q, cache, out, k_scale)
        _no_graph_breaks()
        assert o.data_ptr() == out.data_ptr()  # written in place
        eo, else_ = w.run(q, cache, return_lse=True, k_scale=0.75, v_scale=0.5, sinks=sinks)
        _close(out, eo)
        _close(lse, else_, torch.float32)


# --------------------------------------------------------------------------------------------- prefill
def _paged_prefill(backend, qo=(3, 0, 5), kv=(6, 4, 9), causal=True, seed=0):
    w = attncore.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD", backend=backend)
    indptr, indices, last, total = _table(kv, seed=seed)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo).cumsum(0)), dtype=torch.int32)
    w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, PAGE, causal=causal, q_data_type=DT)
    return w, total, sum(qo)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_prefill_return_lse(backend, compiler):
    w, total, nnz = _paged_prefill(backend)
    cache = _cache(total)
    k_cache, v_cache = cache[:, 0], cache[:, 1]
    q = torch.randn(nnz, HQ, D).to(DT)

    def fn(q, k_cache, v_cache):
        o, lse = w.run(q, (k_cache, v_cache), return_lse=True)  # the tuple form of the cache
        return o.float().sum(-1), o, lse

    s, o, lse = _compiled(fn, compiler)(q, k_cache, v_cache)
    _no_graph_breaks()
    es, eo, else_ = fn(q, k_cache, v_cache)
    _close(o, eo)
    _close(lse, else_, torch.float32)
    torch.testing.assert_close(s, es)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_prefill_out_and_lse_given(backend):
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD", backend=backend)
    qo_indptr = torch.tensor([0, 4, 6], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 7, 9], dtype=torch.int32)
    w.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=True, q_data_type=DT)
    q, k, v = torch.randn(6, HQ, D).to(DT), torch.randn(9, HKV, D).to(DT), torch.randn(9, HKV, D).to(DT)
    out = torch.empty(6, HQ, D, dtype=DT)
    lse = torch.empty(6, HQ)

    def fn(q, k, v, out, lse):
        return w.run(q, k, v, out=out, lse=lse, return_lse=True)

    o, l_ = _compiled(fn)(q, k, v, out, lse)
    _no_graph_breaks()
    assert o.data_ptr() == out.data_ptr() and l_.data_ptr() == lse.data_ptr()
    eo, else_ = w.run(q, k, v, return_lse=True)
    _close(out, eo)
    _close(lse, else_, torch.float32)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_single_prefill_and_decode(backend, compiler):
    q, k, v = torch.randn(5, HQ, D).to(DT), torch.randn(8, HKV, D).to(DT), torch.randn(8, HKV, D).to(DT)
    qd = torch.randn(HQ, D).to(DT)
    mask = torch.rand(5, 8) > 0.3

    def fn(q, k, v, qd, out_d):
        o, lse = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, backend=backend,
                                                       logits_soft_cap=30.0, window_left=5)
        om = attncore.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, backend=backend, sm_scale=0.3)
        od, lse_d = attncore.single_decode_with_kv_cache(qd, k, v, return_lse=True, backend=backend, out=out_d)
        return o, lse, om, od, lse_d

    out_d = torch.empty(HQ, D, dtype=DT)
    got = _compiled(fn, compiler)(q, k, v, qd, out_d)
    _no_graph_breaks()
    assert got[3].data_ptr() == out_d.data_ptr()
    want = fn(q, k, v, qd, torch.empty(HQ, D, dtype=DT))
    for g, e in zip(got, want):
        _close(g, e, e.dtype)


def test_single_prefill_dynamic_lengths_one_graph():
    cnt = CompileCounter()
    fn = torch.compile(lambda q, k, v: attncore.single_prefill_with_kv_cache(q, k, v, causal=True,
                                                                              backend="reference"),
                       fullgraph=True, backend=cnt, dynamic=True)
    for qo, kv in ((3, 5), (4, 9), (2, 2), (6, 6)):  # (sizes 0 and 1 are specialised by Dynamo)
        q, k, v = torch.randn(qo, HQ, D).to(DT), torch.randn(kv, HKV, D).to(DT), torch.randn(kv, HKV, D).to(DT)
        _close(fn(q, k, v), attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference"))
    assert cnt.frame_count == 1
    _no_graph_breaks()


def test_cascade_merge_of_two_single_prefills():
    """Two partial states (shared prefix, then the request's own keys) merged in the same graph, against the same
    merge run eagerly.  (Against one pass over all 11 keys the fp16 partial outputs' rounding may move an element
    by 2 ulps, over the rounding floor: that comparison failed on some random draws.)"""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, HQ, D, generator=g).to(DT)
    k, v = torch.randn(11, HKV, D, generator=g).to(DT), torch.randn(11, HKV, D, generator=g).to(DT)

    def fn(q, k, v):
        oa, la = attncore.single_prefill_with_kv_cache(q, k[:7], v[:7], return_lse=True, backend="reference")
        ob, lb = attncore.single_prefill_with_kv_cache(q, k[7:], v[7:], return_lse=True, backend="reference")
        return attncore.merge_state(oa, la, ob, lb)

    got = _compiled(fn, "aot_eager")(q, k, v)
    _no_graph_breaks()
    want = fn(q, k, v)
    _close(got[0], want[0])
    assert max_error(got[1], want[1].double()) <= 1e-6
    one_pass_lse = attncore.single_prefill_with_kv_cache(q, k, v, return_lse=True, backend="reference")[1]
    assert max_error(got[1], one_pass_lse.double()) <= 1e-3  # the merge's LSE is the whole row's


# --------------------------------------------------------------------------------------------- POD
def test_pod_wrappers():
    q_p, k_p, v_p = torch.randn(5, HQ, D).to(DT), torch.randn(7, HKV, D).to(DT), torch.randn(7, HKV, D).to(DT)
    pod = attncore.PODWithPagedKVCacheWrapper(_ws(), "NHD", backend="reference")
    indptr, indices, last, total = _table((5, 8, 1))
    pod.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DT)
    cache, q_d = _cache(total), torch.randn(3, HQ, D).to(DT)

    def fn(q_p, k_p, v_p, q_d, cache):
        return pod.run(q_p, k_p, v_p, q_d, cache, causal_p=True, return_lse_p=True)

    (o_p, lse_p), o_d = _compiled(fn)(q_p, k_p, v_p, q_d, cache)
    _no_graph_breaks()
    (eo_p, else_p), eo_d = fn(q_p, k_p, v_p, q_d, cache)
    _close(o_p, eo_p)
    _close(lse_p, else_p, torch.float32)
    _close(o_d, eo_d)

    bpod = attncore.BatchPODWithPagedKVCacheWrapper(_ws(), "NHD", backend="reference")
    p_indptr, p_indices, p_last, p_total = _table((6, 4), seed=3)
    qo_p = torch.tensor([0, 2, 5], dtype=torch.int32)
    qo_d = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    bpod.plan(qo_p, p_indptr, p_indices, p_last, qo_d, indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DT)
    cache_p, qb_p = _cache(p_total, seed=4), torch.randn(5, HQ, D).to(DT)

    def bfn(q_p, cache_p, q_d, cache_d):
        return bpod.run(q_p, cache_p, q_d, cache_d, return_lse=True)

    got = _compiled(bfn)(qb_p, cache_p, q_d, cache)
    _no_graph_breaks()
    want = bfn(qb_p, cache_p, q_d, cache)
    for g, e in zip(got[0] + got[1], want[0] + want[1]):
        _close(g, e, e.dtype)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"prefill side must already be planned with causal_p=True"):
        _compiled(lambda *a: bpod.run(*a, causal_p=True))(qb_p, cache_p, q_d, cache)


# --------------------------------------------------------------------------------------------- inductor
def _cxx():
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def test_default_inductor_backend():
    """torch.compile's default backend (inductor; aot_eager when no C++ compiler is on the machine)."""
    compiler = "inductor" if _cxx() else "aot_eager"
    w, total = _decode_wrapper("reference")
    cache, q = _cache(total), torch.randn(3, HQ, D).to(DT)
    k, v = torch.randn(8, HKV, D).to(DT), torch.randn(8, HKV, D).to(DT)

    def fn(q, cache, k, v):
        o, lse = w.run(q, cache, return_lse=True)
        os_, lse_s = attncore.single_prefill_with_kv_cache(q, k, v, return_lse=True, backend="auto")
        return o, lse, os_, lse_s

    got = _compiled(fn, compiler)(q, cache, k, v)
    _no_graph_breaks()
    for g, e in zip(got, fn(q, cache, k, v)):
        _close(g, e, e.dtype)


# --------------------------------------------------------------------------------------------- re-plan
def test_replan_reuses_graph_or_recompiles_cleanly():
    w, total = _decode_wrapper("reference", lens=(5, 8, 1))
    cache = _cache(64)
    cnt = CompileCounter()
    fn = torch.compile(lambda q, cache: w.run(q, cache, return_lse=True), fullgraph=True, backend=cnt)
    q = torch.randn(3, HQ, D).to(DT)

    def check():
        got, want = fn(q, cache), w.run(q, cache, return_lse=True)
        _close(got[0], want[0])
        _close(got[1], want[1], torch.float32)

    check()
    assert cnt.frame_count == 1
    # same batch size, other lengths and pages: the same graph (it runs the wrapper's current plan)
    for seed, lens in ((5, (1, 16, 9)), (6, (12, 0, 3))):
        w.plan(*_table(lens, seed=seed)[:3], HQ, HKV, D, PAGE, q_data_type=DT)
        check()
    assert cnt.frame_count == 1
    # another batch size: q has other rows, one recompilation (then dynamic in that dimension)
    for b in (5, 2, 7):
        w.plan(*_table(tuple(range(1, b + 1)), seed=b)[:3], HQ, HKV, D, PAGE, q_data_type=DT)
        q = torch.randn(b, HQ, D).to(DT)
        check()
    assert cnt.frame_count == 2
    # other heads: a new graph, still equal to eager
    w.plan(*_table((3, 4), seed=9)[:3], 2 * HKV * 2, HKV, D, PAGE, q_data_type=DT)
    q = torch.randn(2, 2 * HKV * 2, D).to(DT)
    check()
    _no_graph_breaks()


# --------------------------------------------------------------------------------------------- errors
def test_run_before_plan_under_compile():
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD", backend="reference")
    q, cache = torch.randn(3, HQ, D).to(DT), _cache(4)
    with pytest.raises(Exception, match=r"BatchDecodeWithPagedKVCacheWrapper.run\(\) called before plan\(\); "
                                        r"under torch.compile, call plan\(\) outside the compiled function"):
        _compiled(lambda q, c: w.run(q, c))(q, cache)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):  # no fullgraph: the plain error
        torch.compile(lambda q, c: w.run(q, c), backend="eager")(q, cache)


def test_bad_input_under_compile_names_the_argument():
    w, total = _decode_wrapper("reference")
    cache = _cache(total)
    with pytest.raises(Exception, match=r"q: got dtype fp32, expected fp16"):
        _compiled(lambda q, c: w.run(q, c))(torch.randn(3, HQ, D), cache)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"q: got shape \[4, 4, 16\], expected \[3, 4, 16\]"):  # checked at run time
        _compiled(lambda q, c: w.run(q, c))(torch.randn(4, HQ, D).to(DT), cache)


def test_handles_do_not_keep_wrappers_alive():
    w, _ = _decode_wrapper("reference")
    h = w._op_handle
    assert ops.lookup(h) is w
    c = copy.copy(w)  # a copy gets its own handle at its next plan
    c.plan(*_table((3, 4))[:3], HQ, HKV, D, PAGE, q_data_type=DT)
    assert c._op_handle != h and ops.lookup(c._op_handle) is c and c._compile_spec[0] == c._op_handle
    del w
    gc.collect()
    with pytest.raises(RuntimeError, match="names no live wrapper"):
        ops.lookup(h)


def test_eager_path_does_not_use_the_ops():
    w, total = _decode_wrapper("reference")
    cache, q = _cache(total), torch.randn(3, HQ, D).to(DT)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        w.run(q, cache)
    assert not any(e.name.startswith("attncore::") for e in prof.events())


def test_op_names_in_profiler_trace():
    w, total = _decode_wrapper("reference")
    cache, q = _cache(total), torch.randn(3, HQ, D).to(DT)
    k = torch.randn(8, HKV, D).to(DT)
    fn = _compiled(lambda q, c, k: (w.run(q, c), attncore.single_prefill_with_kv_cache(q, k, k)), "aot_eager")
    fn(q, cache, k)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(q, cache, k)
    names = {e.name for e in prof.events()}
    assert {"attncore::run_planned", "attncore::single_prefill"} <= names


# --------------------------------------------------------------------------------------------- opcheck
def test_opcheck_run_planned():
    w, total = _decode_wrapper("reference")
    cache, q = _cache(total), torch.randn(3, HQ, D).to(DT)
    out, lse = torch.empty(3, HQ, D, dtype=DT), torch.empty(3, HQ)
    torch.library.opcheck(torch.ops.attncore.run_planned.default,
                          (w._op_handle, q, cache[:, 0], cache[:, 1], out, lse, None, None, 0.5, None, None, None,
                           None))
    wr = attncore.BatchPrefillWithRaggedKVCacheWrapper(_ws(), "HND", backend="reference")
    wr.plan(torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 6], dtype=torch.int32), HQ, HKV, D,
            causal=True, q_data_type=DT)
    k, v = torch.randn(HKV, 6, D).to(DT), torch.randn(HKV, 6, D).to(DT)
    torch.library.opcheck(torch.ops.attncore.run_planned.default,
                          (wr._op_handle, torch.randn(5, HQ, D).to(DT), k, v, torch.empty(5, HQ, D, dtype=DT), None,
                           torch.randn(HQ), None, None, None, None, None, torch.tensor([2.0])))


def test_opcheck_single_prefill():
    q, k, v = torch.randn(5, HQ, D).to(DT), torch.randn(8, HKV, D).to(DT), torch.randn(8, HKV, D).to(DT)
    out, lse = torch.empty(5, HQ, D, dtype=DT), torch.empty(5, HQ)
    torch.library.opcheck(torch.ops.attncore.single_prefill.default,
                          (q, k, v, out, lse, None, None, True, "NHD", "NONE", None, -1, None, None, None, "reference",
                           None, None, None, None, None, None, None))
    torch.library.opcheck(torch.ops.attncore.single_prefill.default,
                          (q, k, v, out, None, torch.rand(5, 8) > 0.5, None, False, "NHD", "ROPE_LLAMA", 0.2, 3, 20.0,
                           None, 1e4, "auto", None, None, None, None, None, None, None))


# --------------------------------------------------------------------------------------------- GPU
def _gpu_backends():
    if not torch.cuda.is_available():
        return ["-"]
    return ["auto"] + [n for n in ("triton", "cuda_fa2", "xqa", "sdpa") if n in attncore.available_backends()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("op", ["decode", "paged_prefill", "single_prefill"])
@pytest.mark.parametrize("backend", _gpu_backends())
def test_gpu_layer_compiles_fullgraph_inductor(backend, op, mode, request):
    """A layer (projection, attention, projection) under torch.compile(fullgraph=True) with inductor on
    the GPU, every backend that serves the op: no graph break, equal to eager (also replayed from
    CUDA graphs with mode="reduce-overhead"); the op's name shows in the profiler."""
    from attncore.core.selector import BackendSelectionError

    if op == "single_prefill" and mode == "reduce-overhead" and backend in ("triton", "cuda_fa2"):
        # H100 2026-11-24: the one-call op plans on every call, and a plan copies its index tensors to the
        # GPU, which CUDA-graph capture forbids; a cached plan per problem signature (issue 15 item 1) fixes it
        request.applymarker(pytest.mark.xfail(reason="single_prefill plans inside the op: no host-to-device "
                                                     "copy is allowed under capture", strict=True))
    dev, dt, hq, hkv, d, page = "cuda", torch.bfloat16, 32, 8, 128, 16
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev, dt)  # noqa: E731
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    lens = [300, 17, 1000]
    npages = [-(-n // page) for n in lens]
    indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    indices = torch.randperm(sum(npages), generator=g).to(dev, torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, npages)], dtype=torch.int32, device=dev)
    cache = rnd(sum(npages), 2, page, hkv, d)
    wq, wo = rnd(hq * d, hq * d) / d, rnd(hq * d, hq * d) / d
    rows = 3 if op == "decode" else 40
    k, v = rnd(500, hkv, d), rnd(500, hkv, d)
    try:
        if op == "decode":
            w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dt)
            attend = lambda q: w.run(q, cache)  # noqa: E731
        elif op == "paged_prefill":
            w = attncore.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            qo = torch.tensor([0, 10, 20, 40], dtype=torch.int32, device=dev)
            w.plan(qo, indptr, indices, last, hq, hkv, d, page, causal=True, q_data_type=dt)
            attend = lambda q: w.run(q, cache)  # noqa: E731
        else:
            attend = lambda q: attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend=backend)  # noqa: E731
        x = rnd(rows, hq * d)
        attend((x @ wq).view(rows, hq, d))
    except BackendSelectionError as e:
        pytest.skip(f"{backend} does not serve {op}: {str(e)[:100]}")

    def layer(x):
        return attend((x @ wq).view(x.shape[0], hq, d)).reshape(x.shape[0], hq * d) @ wo

    want = layer(x)
    fn = torch.compile(layer, fullgraph=True, mode=None if mode == "default" else mode)
    for _ in range(3):  # reduce-overhead records its graph on the first calls, then replays
        got = fn(x)
    _no_graph_breaks()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    if mode == "default":  # (a CUDA-graph replay calls no op)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn(x)
        names = {e.name for e in prof.events()}
        assert any(n.startswith("attncore::") for n in names), sorted(n for n in names if "::" in n)[:20]
