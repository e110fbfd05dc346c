"""Every bad input raises ValueError/TypeError naming the argument, what was given and what is accepted."""

import pytest
import torch

import attncore

H = torch.float16


def _paged_wrapper(**kw):
    return attncore.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16), "NHD", **kw)


def _plan_paged(w, indptr=(0, 2, 3), last=(5, 16), indices=None, qo=(0, 4, 6), **kw):
    indptr_t = torch.tensor(indptr, dtype=torch.int32)
    indices_t = torch.arange(indptr[-1], dtype=torch.int32) if indices is None else torch.tensor(indices, dtype=torch.int32)
    w.plan(torch.tensor(qo, dtype=torch.int32), indptr_t, indices_t, torch.tensor(last, dtype=torch.int32),
           4, 2, 64, 16, **kw)


def test_q_shape_dtype_device():
    k = torch.randn(5, 2, 64).half()
    with pytest.raises(ValueError, match=r"q: got a 2-D tensor of shape \(4, 64\), expected 3-D"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 64).half(), k, k)
    with pytest.raises(TypeError, match=r"q: got dtype int32, expected fp16, bf16, fp32"):
        attncore.single_prefill_with_kv_cache(torch.zeros(4, 4, 64, dtype=torch.int32), k, k)
    with pytest.raises(TypeError, match=r"v: got dtype fp32, expected fp16"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 4, 64).half(), k, k.float())
    with pytest.raises(ValueError, match=r"v: got shape \[6, 2, 64\], expected \[5, 2, 64\]"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 4, 64).half(), k, torch.randn(6, 2, 64).half())


def test_heads_and_layout():
    q = torch.randn(4, 6, 64).half()
    k = torch.randn(5, 4, 64).half()
    with pytest.raises(ValueError, match=r"num_qo_heads: got 6 with num_kv_heads 4; num_qo_heads must be a multiple"):
        attncore.single_prefill_with_kv_cache(q, k, k)
    with pytest.raises(ValueError, match=r"kv_layout: got 'NDH', expected one of \['NHD', 'HND'\]"):
        attncore.single_prefill_with_kv_cache(q, k, k, kv_layout="NDH")
    with pytest.raises(ValueError, match=r"pos_encoding_mode: got 'ROPE', expected one of"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 4, 64).half(), k, k, pos_encoding_mode="ROPE")
    with pytest.raises(ValueError, match=r"window_left: got -3, expected -1 \(off\) or an int >= 0"):
        attncore.single_prefill_with_kv_cache(torch.randn(4, 4, 64).half(), k, k, window_left=-3)
    with pytest.raises(ValueError, match=r"causal: single prefill with causal=True needs kv_len >= qo_len"):
        attncore.single_prefill_with_kv_cache(torch.randn(9, 4, 64).half(), k, k, causal=True)


def test_non_contiguous_last_dim():
    q = torch.randn(4, 4, 128).half()[..., ::2]
    k = torch.randn(5, 2, 64).half()
    with pytest.raises(ValueError, match=r"q: the last dimension must be contiguous"):
        attncore.single_prefill_with_kv_cache(q, k, k)


def test_head_dim_a_forced_backend_cannot_serve():
    q, k = torch.randn(4, 4, 72).half(), torch.randn(5, 2, 72).half()
    # the reference serves any head dim; a forced backend with a fixed set refuses with its reason
    from attncore.core import registry
    from attncore.core.capabilities import Capabilities
    from attncore.reference.backend import ReferenceBackend

    class D128(ReferenceBackend):
        name = "d128"
        capabilities = (Capabilities(ops=frozenset({"single_prefill"}), devices=frozenset({"cpu"}),
                                     head_dims=frozenset({64, 128, 256})),)

    registry.register_backend(D128())
    try:
        with pytest.raises(ValueError, match=r"head_dim: got 72, supported \{64, 128, 256\}"):
            attncore.single_prefill_with_kv_cache(q, k, k, backend="d128")
    finally:
        registry.unregister_backend("d128")


def test_indptr_checks():
    w = _paged_wrapper()
    with pytest.raises(ValueError, match=r"qo_indptr: not non-decreasing: qo_indptr\[1\] = 4 > qo_indptr\[2\] = 3"):
        _plan_paged(w, qo=(0, 4, 3))
    with pytest.raises(ValueError, match=r"paged_kv_indptr: not non-decreasing: paged_kv_indptr\[1\] = 3 > "):
        _plan_paged(w, indptr=(0, 3, 2))
    with pytest.raises(ValueError, match=r"paged_kv_indptr: got 4 entries, expected 3 \(batch_size \+ 1\)"):
        _plan_paged(w, indptr=(0, 1, 2, 3), last=(5, 16))
    with pytest.raises(ValueError, match=r"qo_indptr: got qo_indptr\[0\] = 1, expected 0"):
        _plan_paged(w, qo=(1, 4, 6))
    with pytest.raises(TypeError, match=r"qo_indptr: got dtype int64, expected int32"):
        w.plan(torch.tensor([0, 4]), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
               torch.tensor([3], dtype=torch.int32), 4, 2, 64, 16)


def test_last_page_len_and_page_ids():
    w = _paged_wrapper()
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len: got paged_kv_last_page_len\[1\] = 17, "
                                         r"expected 1 <= last_page_len <= page_size \(16\)"):
        _plan_paged(w, last=(5, 17))
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len\[0\] = 0, expected 1 <= last_page_len"):
        _plan_paged(w, last=(0, 3))
    with pytest.raises(ValueError, match=r"paged_kv_indices: got a negative page id -1"):
        _plan_paged(w, indices=(0, -1, 2))
    with pytest.raises(ValueError, match=r"paged_kv_indices: got 2 entries, expected at least paged_kv_indptr\[-1\] = 3"):
        _plan_paged(w, indices=(0, 1))
    _plan_paged(w, indices=(0, 1, 9), causal=True)
    cache = torch.randn(4, 2, 16, 2, 64).half()
    with pytest.raises(ValueError, match=r"paged_kv_indices: page id 9 is out of range for a cache of 4 pages"):
        w.run(torch.randn(6, 4, 64).half(), cache)


def test_mask_length():
    w = _paged_wrapper()
    with pytest.raises(ValueError, match=r"custom_mask: got 10 elements, expected 116 \(sum of qo_len\*kv_len"):
        _plan_paged(w, custom_mask=torch.ones(10, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"packed_custom_mask: got 3 bytes, expected 15"):
        _plan_paged(w, packed_custom_mask=torch.zeros(3, dtype=torch.uint8))
    q, k = torch.randn(4, 4, 64).half(), torch.randn(5, 2, 64).half()
    with pytest.raises(ValueError, match=r"custom_mask: got shape \[4, 4\], expected \[4, 5\]"):
        attncore.single_prefill_with_kv_cache(q, k, k, custom_mask=torch.ones(4, 4, dtype=torch.bool))


def test_run_before_plan_and_dtype_mismatch():
    w = _paged_wrapper()
    cache = torch.randn(4, 2, 16, 2, 64).half()
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        w.run(torch.randn(6, 4, 64).half(), cache)
    _plan_paged(w, causal=True)
    with pytest.raises(TypeError, match=r"q: got dtype bf16, expected fp16"):
        w.run(torch.randn(6, 4, 64).bfloat16(), cache)
    with pytest.raises(TypeError, match=r"paged_kv_cache \(k\): got dtype fp32, expected fp16"):
        w.run(torch.randn(6, 4, 64).half(), cache.float())
    with pytest.raises(ValueError, match=r"q: got shape \[7, 4, 64\], expected \[6, 4, 64\]"):
        w.run(torch.randn(7, 4, 64).half(), cache)
    with pytest.raises(ValueError, match=r"paged_kv_cache \(k\): got shape \[4, 8, 2, 64\], expected \[\*, 16, 2, 64\]"):
        w.run(torch.randn(6, 4, 64).half(), torch.randn(4, 2, 8, 2, 64).half())
    with pytest.raises(ValueError, match=r"out: got shape \[6, 4, 32\], expected \[6, 4, 64\]"):
        w.run(torch.randn(6, 4, 64).half(), cache, out=torch.empty(6, 4, 32).half())


def test_decode_and_xqa_bad_input():
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16))
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    last = torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"last_page_len: request 0 holds 1 tokens, fewer than q_len_per_req \(2\)"):
        w.plan(indptr, idx, last, 4, 2, 64, 16, q_len_per_req=2)
    w.plan(indptr, idx, last, 4, 2, 64, 16)
    with pytest.raises(ValueError, match=r"window_left: got 3 in run\(\), but plan\(\) used -1"):
        w.run(torch.randn(2, 4, 64).half(), torch.randn(2, 2, 16, 2, 64).half(), window_left=3)
    q = torch.randn(2, 4, 64).half()
    cache = torch.randn(2, 2, 16, 2, 64).half()
    bt = torch.zeros(2, 1, dtype=torch.int32)
    seq = torch.tensor([3, 4], dtype=torch.int32)
    ws = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_cache_sf: NVFP4 KV caches are not supported"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 4, kv_cache_sf=torch.zeros(1))
    with pytest.raises(ValueError, match=r"query: got 2 rows, expected batch_size \* q_len_per_req = 4"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 4, q_len_per_req=2)
    with pytest.raises(ValueError, match=r"block_tables: 1 pages of 16 tokens cannot hold max_seq_len 40"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 40)
    with pytest.raises(ValueError, match=r"mask: got shape \[2, 1, 1\], expected \[2, 1, 2\]"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 4, mask=torch.zeros(2, 1, 1, dtype=torch.uint16))
    with pytest.raises(ValueError, match=r"sinks: got shape \[3\], expected \[4\]"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 4, sinks=torch.zeros(3))


def test_pod_decode_args_conflicting_with_plan_raise():
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(16))
    w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
           torch.tensor([3], dtype=torch.int32), 4, 2, 64, 16, data_type=torch.float16)
    qp, kp = torch.randn(3, 4, 64).half(), torch.randn(3, 2, 64).half()
    qd, cache = torch.randn(1, 4, 64).half(), torch.randn(1, 2, 16, 2, 64).half()
    for kw, pat in ((dict(sm_scale_d=0.5), "sm_scale_d: got 0.5"), (dict(window_left_d=4), "window_left_d: got 4"),
                    (dict(pos_encoding_mode_d="ALIBI"), "pos_encoding_mode_d: got 'ALIBI'"),
                    (dict(kv_layout_d="HND"), "kv_layout_d: got 'HND'"),
                    (dict(custom_mask_d=torch.ones(16, dtype=torch.bool)), "custom_mask_d: the decode side")):
        with pytest.raises(ValueError, match=pat):
            w.run(qp, kp, kp, qd, cache, **kw)
    # matching values are accepted
    w.run(qp, kp, kp, qd, cache, sm_scale_d=0.125, window_left_d=-1, pos_encoding_mode_d="NONE")


# ----------------------------------------------------------------------------- xqa seq_lens (issue 13)
def _xqa_case():
    """Two requests, block tables of 3 pages of 4 tokens (room for 12 each)."""
    q = torch.randn(2, 4, 64).half()
    cache = torch.randn(6, 2, 4, 2, 64).half()
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    return q, cache, torch.zeros(8, dtype=torch.uint8), bt


@pytest.mark.parametrize("backend", ["reference", "triton", "auto"])
def test_xqa_seq_len_past_max_seq_len_raises(backend):
    """Reproduction: seq_lens [13, 5] with max_seq_len 9 and room for 12 tokens used to attend over
    what fits."""
    q, cache, ws, bt = _xqa_case()
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[0\] = 13 \(request 0\), expected q_len_per_req "
                                         r"\(1\) <= seq_len <= max_seq_len \(9\); each block_tables row holds 12 "
                                         r"tokens \(3 pages of 4\)"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, torch.tensor([13, 5], dtype=torch.int32), 9,
                                                backend=backend)


def test_xqa_seq_lens_range():
    q, cache, ws, bt = _xqa_case()
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[1\] = 10 \(request 1\), expected q_len_per_req "
                                         r"\(1\) <= seq_len <= max_seq_len \(9\)"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, torch.tensor([9, 10], dtype=torch.uint32), 9)
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[1\] = -2 \(request 1\), expected q_len_per_req "
                                         r"\(1\) <= seq_len"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, torch.tensor([3, -2], dtype=torch.int32), 9)
    q2 = torch.randn(4, 4, 64).half()
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[0\] = 1 \(request 0\), expected q_len_per_req "
                                         r"\(2\) <= seq_len <= max_seq_len \(12\)"):
        attncore.xqa_batch_decode_with_kv_cache(q2, cache, ws, bt, torch.tensor([1, 5], dtype=torch.int32), 12,
                                                q_len_per_req=2)
    # the bounds themselves are accepted
    attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, torch.tensor([1, 9], dtype=torch.int32), 9)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "xqa", "auto"])
def test_xqa_device_seq_lens_past_max_seq_len_raise(backend):
    """Device seq_lens reach kernels that read them on the device only: the API checks them first."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, cache, _, bt = (t.cuda() for t in _xqa_case())
    ws = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")  # room for any plan: seq_lens is the one error
    if backend != "auto" and not attncore.core.registry.get_entry(backend).is_available:
        pytest.skip(f"{backend} unavailable")
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[0\] = 13 \(request 0\)"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, torch.tensor([13, 5], dtype=torch.int32).cuda(), 9,
                                                backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,dtype,msg", [
    ([13, 5], torch.int32, r"seq_lens\[0\] = 13 \(request 0\)"), ([3, -2], torch.int32, r"seq_lens\[1\] = -2 "),
    ([2 ** 32 - 1, 5], torch.uint32, r"seq_lens\[0\] = 4294967295 "), ([0, 5], torch.int32, r"seq_lens\[0\] = 0 "),
    ([9, 12], torch.int32, r"seq_lens\[1\] = 12 ")])
@pytest.mark.parametrize("padding", [None, -7, 10 ** 6])
def test_xqa_launch_before_check_reads_nothing_past_the_table(lens, dtype, msg, padding):
    """xqa launches before it reads seq_lens back (Backend.bounds_seq_lens): the call still raises, the kernel
    read nothing outside the block table and the cache (no CUDA error), also where a bad length reaches the table's
    padding (``padding``: request 1's unused last entry), and the next call is right."""
    from attncore.testing.contract import assert_batch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not attncore.core.registry.get_entry("xqa").is_available:
        pytest.skip("xqa unavailable")
    q, cache, _, bt = (t.cuda() for t in _xqa_case())
    if padding is not None:
        bt[1, 2] = padding
    ws = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match=r"seq_lens: got " + msg):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, torch.tensor(lens, dtype=dtype).cuda(), 9,
                                                out=out, backend="xqa")
    torch.cuda.synchronize()  # raises here had the kernel read outside the table or the cache
    out.fill_(float("nan"))
    good = [9, 5]
    attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, torch.tensor(good, dtype=dtype).cuda(), 9, out=out,
                                            backend="xqa")
    kv = [cache[bt[i, :-(-n // 4)].long()].transpose(0, 1).reshape(2, -1, 2, 64)[:, :n] for i, n in enumerate(good)]
    assert_batch([(q[i:i + 1], kv[i][0], kv[i][1]) for i in range(2)], out, causal=True, sm_scale=1.0)


def test_xqa_seq_lens_checked_where_read_on_the_host():
    """seq_lens not read by the API (inside CUDA-graph capture) are checked when a backend first reads
    them on the host."""
    from attncore.decode import _XqaBatch

    bt = torch.zeros(2, 3, dtype=torch.int32)
    meta = _XqaBatch(batch_size=2, qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32), qo_indptr_host=[0, 1, 2],
                     block_tables=bt, seq_lens=torch.tensor([13, 5], dtype=torch.int32), max_seq_len=9,
                     page_size=4)
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[0\] = 13 \(request 0\)"):
        meta.host_kv_lens()
    meta.seq_lens = torch.tensor([9, 5], dtype=torch.int32)
    assert meta.host_kv_lens() == [9, 5]


# ----------------------------------------------------------------------------- scalar parameters (issue 13)
_K = torch.randn(5, 2, 64).half()


def _single_prefill(**kw):
    attncore.single_prefill_with_kv_cache(torch.randn(3, 4, 64).half(), _K, _K, **kw)


def _single_decode(**kw):
    attncore.single_decode_with_kv_cache(torch.randn(4, 64).half(), _K, _K, **kw)


def _paged_plan(**kw):
    _plan_paged(_paged_wrapper(), **kw)


def _ragged_plan(**kw):
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16))
    w.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 4, 2, 64, **kw)


def _decode_table():
    return torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), \
        torch.tensor([3], dtype=torch.int32)


def _decode_plan(**kw):
    attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16)).plan(*_decode_table(), 4, 2, 64, 16, **kw)


def _pod_plan(**kw):
    attncore.PODWithPagedKVCacheWrapper(torch.empty(16)).plan(*_decode_table(), 4, 2, 64, 16, **kw)


def _batch_pod_plan(**kw):
    qo_p, qo_d = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    attncore.BatchPODWithPagedKVCacheWrapper(torch.empty(16)).plan(qo_p, *_decode_table(), qo_d, *_decode_table(),
                                                                   4, 2, 64, 16, **kw)


_PLANS = {"single_prefill": _single_prefill, "single_decode": _single_decode, "paged_plan": _paged_plan,
          "ragged_plan": _ragged_plan, "decode_plan": _decode_plan, "pod_plan": _pod_plan,
          "batch_pod_plan": _batch_pod_plan}
_NO_CAP = {"pod_plan", "batch_pod_plan"}  # POD takes no soft cap

_NAN, _INF = float("nan"), float("inf")
_BAD = [
    ("sm_scale", _NAN, r"sm_scale: got nan, expected None \(1/sqrt\(head_dim\)\) or a finite number > 0"),
    ("sm_scale", 0.0, r"sm_scale: got 0.0, expected None \(1/sqrt\(head_dim\)\) or a finite number > 0"),
    ("sm_scale", -0.5, r"sm_scale: got -0.5, expected"),
    ("sm_scale", _INF, r"sm_scale: got inf, expected"),
    ("logits_soft_cap", -1.0, r"logits_soft_cap: got -1.0, expected None, 0 or inf \(no cap\), or a finite number > 0"),
    ("logits_soft_cap", _NAN, r"logits_soft_cap: got nan, expected None, 0 or inf \(no cap\)"),
    ("logits_soft_cap", -_INF, r"logits_soft_cap: got -inf, expected"),
    ("rope_scale", 0.0, r"rope_scale: got 0.0, expected None \(1\) or a finite number > 0"),
    ("rope_scale", _NAN, r"rope_scale: got nan, expected None \(1\) or a finite number > 0"),
    ("rope_theta", -1e4, r"rope_theta: got -10000.0, expected None \(10000\) or a finite number > 0"),
    ("rope_theta", _INF, r"rope_theta: got inf, expected None \(10000\)"),
    ("window_left", -2, r"window_left: got -2, expected -1 \(off\) or an int >= 0"),
    ("window_left", 2.5, r"window_left: got 2.5, expected -1 \(off\) or an int >= 0"),
]


@pytest.mark.parametrize("entry, name, value, pat", [
    (e, n, v, p) for e in _PLANS for n, v, p in _BAD if not (n == "logits_soft_cap" and e in _NO_CAP)],
    ids=[f"{e}-{n}={v}" for e in _PLANS for n, v, _ in _BAD if not (n == "logits_soft_cap" and e in _NO_CAP)])
def test_scalar_parameters_are_checked_at_every_entry_point(entry, name, value, pat):
    with pytest.raises(ValueError, match=pat):
        _PLANS[entry](**{name: value})


_BAD_SCALES = [
    (_NAN, ValueError, r"{}: got nan, expected None or a finite number > 0"),
    (0.0, ValueError, r"{}: got 0.0, expected None or a finite number > 0"),
    (-2.0, ValueError, r"{}: got -2.0, expected None or a finite number > 0"),
    (torch.tensor([_INF]), ValueError, r"{}: got inf, expected None or a finite number > 0"),
    (torch.ones(2), ValueError, r"{}: got a tensor of shape \[2\], expected a float or a 1-element tensor"),
    (torch.ones(1, dtype=torch.int32), TypeError, r"{}: got a tensor of dtype int32, expected a float or a "
                                                  r"1-element float32/float16/bfloat16/float64 tensor"),
]


@pytest.mark.parametrize("value, exc, pat", _BAD_SCALES, ids=lambda x: None)
def test_scales_are_checked(value, exc, pat):
    q, k = torch.randn(3, 4, 64).half(), torch.randn(5, 2, 64).half()
    for name in ("q_scale", "k_scale", "v_scale"):
        with pytest.raises(exc, match=pat.format(name)):
            attncore.single_prefill_with_kv_cache(q, k, k, **{name: value})
        with pytest.raises(exc, match=pat.format(name)):
            attncore.single_decode_with_kv_cache(q[0], k, k, **{name: value})
    w = _paged_wrapper()
    _plan_paged(w, causal=True)
    cache = torch.randn(4, 2, 16, 2, 64).half()
    for name in ("q_scale", "k_scale", "v_scale"):
        with pytest.raises(exc, match=pat.format(name)):
            w.run(torch.randn(6, 4, 64).half(), cache, **{name: value})
    d = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16))
    d.plan(*_decode_table(), 4, 2, 64, 16)
    with pytest.raises(exc, match=pat.format("k_scale")):
        d.run(torch.randn(1, 4, 64).half(), torch.randn(1, 2, 16, 2, 64).half(), k_scale=value)
    qx, cx, ws, bt = _xqa_case()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    for name in ("bmm1_scale", "bmm2_scale", "o_scale"):
        with pytest.raises(exc, match=pat.format(name)):
            attncore.xqa_batch_decode_with_kv_cache(qx, cx, ws, bt, seq, 9, **{name: value})


def test_xqa_window_left_is_checked():
    q, cache, ws, bt = _xqa_case()
    with pytest.raises(ValueError, match=r"window_left: got -5, expected -1 \(off\) or an int >= 0"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, torch.tensor([5, 9], dtype=torch.int32), 9,
                                                window_left=-5)


def test_pod_run_scalars_are_checked_under_their_names():
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(16))
    w.plan(*_decode_table(), 4, 2, 64, 16, data_type=torch.float16)
    qp, kp = torch.randn(3, 4, 64).half(), torch.randn(3, 2, 64).half()
    qd, cache = torch.randn(1, 4, 64).half(), torch.randn(1, 2, 16, 2, 64).half()
    for kw, pat in ((dict(sm_scale_p=_NAN), r"sm_scale_p: got nan, expected None \(1/sqrt\(head_dim\)\)"),
                    (dict(sm_scale_d=_NAN), r"sm_scale_d: got nan, expected None \(1/sqrt\(head_dim\)\)"),
                    (dict(window_left_p=-4), r"window_left_p: got -4, expected -1 \(off\)"),
                    (dict(window_left_d=-4), r"window_left_d: got -4, expected -1 \(off\)"),
                    (dict(rope_theta_p=0.0), r"rope_theta_p: got 0.0, expected None \(10000\)"),
                    (dict(rope_scale_d=_NAN), r"rope_scale_d: got nan, expected None \(1\)"),
                    (dict(v_scale=-1.0), r"v_scale: got -1.0, expected None or a finite number > 0")):
        with pytest.raises(ValueError, match=pat):
            w.run(qp, kp, kp, qd, cache, **kw)


@pytest.fixture
def with_sdpa():
    import os
    import sys

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins", "attncore-sdpa")
    if src not in sys.path:
        sys.path.insert(0, src)
    from attncore.core import registry
    from attncore_sdpa import SdpaBackend

    if "sdpa" not in registry.available_backends():
        registry.register_backend(SdpaBackend(), origin="test")
        yield
        registry.unregister_backend("sdpa")
    else:
        yield


@pytest.mark.parametrize("backend", ["reference", "triton", "sdpa", "auto"])
def test_sm_scale_nan_raises_on_every_backend(with_sdpa, backend):
    """Reproduction: sm_scale=nan gave NaN on reference/triton and finite numbers on sdpa."""
    q, k = torch.randn(3, 4, 64).half(), torch.randn(5, 2, 64).half()
    with pytest.raises(ValueError, match=r"sm_scale: got nan, expected None \(1/sqrt\(head_dim\)\) or a finite"):
        attncore.single_prefill_with_kv_cache(q, k, k, sm_scale=float("nan"), backend=backend)
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16), backend=backend)
    with pytest.raises(ValueError, match=r"sm_scale: got nan, expected"):
        w.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 4, 2, 64,
               sm_scale=float("nan"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_logits_soft_cap_inf_is_no_cap(backend, cpu_backend):
    """Reproduction: logits_soft_cap=inf computed inf * tanh(x / inf) = NaN everywhere."""
    from attncore.core import params

    if backend not in attncore.available_backends():
        pytest.skip(f"backend {backend} is not available here")

    assert params.logits_soft_cap(float("inf")) == params.logits_soft_cap(0) == params.logits_soft_cap(None) == 0.0
    q, k, v = torch.randn(3, 4, 64).half(), torch.randn(5, 2, 64).half(), torch.randn(5, 2, 64).half()
    capped = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, logits_soft_cap=float("inf"),
                                                   backend=backend)
    assert torch.equal(capped, attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend=backend))
    d = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16), backend=backend)
    cache = torch.randn(1, 2, 16, 2, 64).half()
    qd = torch.randn(1, 4, 64).half()
    outs = []
    for cap in (float("inf"), None):
        d.plan(*_decode_table(), 4, 2, 64, 16, logits_soft_cap=cap)
        outs.append(d.run(qd, cache))
    assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1])


# ----------------------------------------------------------------------------- positional arguments (issue 13)
def test_flashinfer_0_2_14_positional_decode_plan_is_read_in_its_order():
    """0.2.14's order after page_size is pos_encoding_mode, window_left, logits_soft_cap, q_data_type,
    kv_data_type, data_type, sm_scale, rope_scale, rope_theta (attncore once read 8.0 as sm_scale); a call in
    a newer release's order (o_data_type after kv_data_type) puts a dtype at sm_scale and raises."""
    indptr = torch.tensor([0, 1], dtype=torch.int32)
    indices = torch.tensor([0], dtype=torch.int32)
    last = torch.tensor([3], dtype=torch.int32)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16))
    w.plan(indptr, indices, last, 4, 2, 64, 16, "ROPE_LLAMA", -1, None, "float32", None, None, None, 8.0, 5e5)
    p = w._planned.meta.params
    assert (p.rope_scale, p.rope_theta, p.sm_scale) == (8.0, 5e5, 1 / 8)
    with pytest.raises(TypeError, match=r"BatchDecodeWithPagedKVCacheWrapper.plan: got 'float16' for sm_scale.*"
                                        r"FlashInfer 0.2.14's order"):
        w.plan(indptr, indices, last, 4, 2, 64, 16, "NONE", -1, None, "float16", "float16", "float16", "float16")


def test_prefill_plans_read_positions_in_0_2_14_order():
    """FlashInfer 0.2.14 puts head_dim_vo right after the head sizes, older releases custom_mask: a value
    that only fits the older order raises."""
    w = _paged_wrapper()
    qo, indptr = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    idx, last = torch.tensor([0], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"BatchPrefillWithPagedKVCacheWrapper.plan: got True for packed_custom_mask"):
        w.plan(qo, indptr, idx, last, 4, 2, 64, 16, None, None, True)
    r = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16))
    with pytest.raises(TypeError, match=r"BatchPrefillWithRaggedKVCacheWrapper.plan: got a tensor .* for head_dim_vo"):
        r.plan(qo, torch.tensor([0, 5], dtype=torch.int32), 4, 2, 64, torch.ones(20, dtype=torch.bool))
