"""FlashInfer 0.2.14's signatures (issue 18 item 1, "no silent reinterpretation"): every positional order,
the keyword aliases of other releases, alias + canonical conflicts, calls that only fit another release's
order, data_type, the attributes serving stacks read, backend= names, the multi-item arguments' checks.
CPU, reference backend."""

import math

import pytest
import torch

import attncore as flashinfer

I32 = torch.int32
H, HKV, D, PAGE = 4, 2, 16, 4
REF = "reference"


def _t(x):
    return torch.tensor(x, dtype=I32)


def _qkv(qo=5, kv=7, dt=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(qo, H, D, generator=g, dtype=dt), torch.randn(kv, HKV, D, generator=g, dtype=dt),
            torch.randn(kv, HKV, D, generator=g, dtype=dt))


def _paged(seed=1):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(6, 2, PAGE, HKV, D, generator=g)
    return cache, _t([0, 2, 5]), _t([0, 1, 2, 3, 4]), _t([3, 1])  # kv lens 7, 9


def _prefill_wrapper(**kw):
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16), "NHD", backend=REF, **kw)


# ----------------------------------------------------------------------------- single prefill
def test_single_prefill_all_positional_in_0_2_14_order():
    q, k, v = _qkv()
    kw = flashinfer.single_prefill_with_kv_cache(
        q, k, v, scale_q=None, scale_k=torch.tensor([0.5]), scale_v=None, o_dtype=torch.float32, custom_mask=None,
        packed_custom_mask=None, causal=True, kv_layout="NHD", pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
        sm_scale=0.3, window_left=-1, logits_soft_cap=20.0, rope_scale=None, rope_theta=None, backend=REF,
        return_lse=True)
    pos = flashinfer.single_prefill_with_kv_cache(q, k, v, None, torch.tensor([0.5]), None, torch.float32, None, None,
                                                  True, "NHD", "NONE", False, 0.3, -1, 20.0, None, None, REF, True)
    assert torch.equal(kw[0], pos[0]) and torch.equal(kw[1], pos[1])
    ref = flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=0.3, k_scale=0.5,
                                                  logits_soft_cap=20.0, backend=REF)
    assert torch.equal(ref, pos[0])
    lse2 = flashinfer.single_prefill_with_kv_cache_return_lse(q, k, v, None, None, None, None, None, None, True,
                                                              backend=REF)
    assert isinstance(lse2, tuple) and len(lse2) == 2


def test_single_prefill_mask_where_scale_q_goes_raises():
    q, k, v = _qkv()
    mask = torch.ones(5, 7, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"scale_q.*0\.2\.14's order.*custom_mask"):
        flashinfer.single_prefill_with_kv_cache(q, k, v, mask)
    with pytest.raises(TypeError, match=r"scale_v"):  # older (custom_mask, packed_custom_mask, causal)
        flashinfer.single_prefill_with_kv_cache(q, k, v, None, None, True)
    with pytest.raises(TypeError, match=r"o_dtype"):  # older kv_layout position
        flashinfer.single_prefill_with_kv_cache(q, k, v, None, None, None, "NHD")
    with pytest.raises(TypeError, match=r"backend.*return_lse"):  # older: return_lse right after rope_theta
        flashinfer.single_prefill_with_kv_cache(q, k, v, None, None, None, None, None, None, False, "NHD", "NONE",
                                                False, None, -1, None, None, None, True)


def test_single_prefill_aliases_and_conflicts():
    q, k, v = _qkv()
    a = flashinfer.single_prefill_with_kv_cache(q, k, v, scale_k=0.5, scale_v=2.0, backend=REF)
    b = flashinfer.single_prefill_with_kv_cache(q, k, v, k_scale=0.5, v_scale=2.0, backend=REF)
    assert torch.equal(a, b)
    per_head = flashinfer.single_prefill_with_kv_cache(q, k, v, scale_k=torch.full((HKV,), 0.5), backend=REF)
    assert torch.equal(per_head, flashinfer.single_prefill_with_kv_cache(q, k, v, k_scale=0.5, backend=REF))
    with pytest.raises(ValueError, match=r"scale_k: .*shape \[3\].*num_kv_heads"):  # differing values: served
        flashinfer.single_prefill_with_kv_cache(q, k, v, scale_k=torch.tensor([0.5, 0.25, 1.0]), backend=REF)
    flashinfer.single_prefill_with_kv_cache(q, k, v, allow_fp16_qk_reduction=True, backend=REF)
    for kw in (dict(scale_q=1.0, q_scale=1.0), dict(scale_k=1.0, k_scale=2.0), dict(scale_v=1.0, v_scale=1.0),
               dict(use_fp16_qk_reduction=True, allow_fp16_qk_reduction=True)):
        names = list(kw)
        with pytest.raises(TypeError, match=rf"both {names[0]}=.* and {names[1]}="):
            flashinfer.single_prefill_with_kv_cache(q, k, v, backend=REF, **kw)


# ----------------------------------------------------------------------------- paged prefill
def _paged_plan_kw():
    _, kvp, kvi, last = _paged()
    return ((_t([0, 3, 7]), kvp, kvi, last, H, HKV),
            dict(head_dim_qk=D, page_size=PAGE, head_dim_vo=D, custom_mask=None, packed_custom_mask=None, causal=True,
                 pos_encoding_mode="ROPE_LLAMA", use_fp16_qk_reduction=False, sm_scale=0.2, window_left=5,
                 logits_soft_cap=30.0, rope_scale=2.0, rope_theta=5e4, q_data_type=torch.float32,
                 kv_data_type=torch.float32, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
                 token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None,
                 block_tables=None, max_token_per_sequence=None, max_sequence_kv=None))


def test_paged_prefill_plan_all_positional_in_0_2_14_order():
    cache = _paged()[0]
    q = torch.randn(7, H, D)
    args, kw = _paged_plan_kw()
    a, b = _prefill_wrapper(), _prefill_wrapper()
    a.plan(*args, **kw)
    b.plan(*args, *kw.values())
    assert a.problem == b.problem and a._planned.meta.params == b._planned.meta.params
    p = b._planned.meta.params
    assert (p.sm_scale, p.window_left, p.logits_soft_cap, p.rope_scale, p.rope_theta) == (0.2, 5, 30.0, 2.0, 5e4)
    assert torch.equal(a.run(q, cache), b.run(q, cache))
    c = _prefill_wrapper()  # head_dim= (other releases' spelling)
    c.plan(*args, head_dim=D, page_size=PAGE, causal=True, pos_encoding_mode="ROPE_LLAMA", sm_scale=0.2,
           window_left=5, logits_soft_cap=30.0, rope_scale=2.0, rope_theta=5e4, q_data_type=torch.float32)
    assert torch.equal(a.run(q, cache), c.run(q, cache))


def test_paged_prefill_plan_aliases_conflicts_and_refusals():
    args, _ = _paged_plan_kw()
    w = _prefill_wrapper()
    with pytest.raises(TypeError, match=r"both head_dim_qk=16 and head_dim=16"):
        w.plan(*args, D, PAGE, head_dim=D)
    with pytest.raises(TypeError, match=r"both use_fp16_qk_reduction=.* and allow_fp16_qk_reduction="):
        w.plan(*args, D, PAGE, use_fp16_qk_reduction=True, allow_fp16_qk_reduction=True)
    w.plan(*args, D, PAGE, allow_fp16_qk_reduction=True, q_data_type=torch.float32)
    assert w._use_fp16_qk_reduction is True
    with pytest.raises(TypeError, match=r"head_dim_vo.*custom_mask"):  # an older release's order
        w.plan(*args, D, PAGE, torch.ones(40, dtype=torch.bool))
    w.plan(*args, D, PAGE, 8)  # head_dim_vo in 0.2.14's place: V's head dim (tests/test_head_dim_vo.py)
    assert (w._planned.problem.head_dim_qk, w._planned.problem.head_dim_vo) == (D, 8)
    # multi-item scoring (tests/test_multi_item.py): prefix_len_ptr turns it on, the others never go alone
    for name, val in (("token_pos_in_items_ptr", _t([0])), ("token_pos_in_items_len", 3),
                      ("max_item_len_ptr", _t([1, 1]))):
        with pytest.raises(ValueError, match=rf"{name}: given without prefix_len_ptr"):
            w.plan(*args, D, PAGE, **{name: val})
    with pytest.raises(ValueError, match=r"token_pos_in_items_ptr: missing"):
        w.plan(*args, D, PAGE, prefix_len_ptr=_t([0, 0]))
    with pytest.raises(NotImplementedError, match="block_tables"):
        w.plan(*args, D, PAGE, block_tables=torch.zeros(2, 3, dtype=I32))
    w.plan(*args, D, PAGE, q_data_type=torch.float32, fixed_split_size=2, disable_split_kv=True,
           o_data_type=torch.float32)  # newer releases' options, keyword-only
    assert w._planned.meta.disable_split_kv is True
    with pytest.raises(ValueError, match="fixed_split_size"):
        w.plan(*args, D, PAGE, fixed_split_size=0)


def test_paged_prefill_init_order_and_aliases():
    buf = torch.empty(16)
    mib = torch.zeros(8, dtype=I32)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(buf, "NHD", True, None, None, None, None, None, mib, REF)
    assert w._graph_buffers["qk_indptr"] is mib and w.is_cuda_graph_enabled
    w2 = flashinfer.BatchPrefillWithPagedKVCacheWrapper(buf, "NHD", True, qk_indptr_buf=mib)
    assert w2._graph_buffers["qk_indptr"] is mib
    with pytest.raises(TypeError, match=r"both mask_indptr_buf=.* and qk_indptr_buf="):
        flashinfer.BatchPrefillWithPagedKVCacheWrapper(buf, mask_indptr_buf=mib, qk_indptr_buf=mib)
    with pytest.raises(ValueError, match="jit_kwargs: got a value"):  # named as given, also beside jit_args
        flashinfer.BatchPrefillWithPagedKVCacheWrapper(buf, jit_kwargs={"a": 1})
    with pytest.raises(ValueError, match="jit_args: got a value"):
        flashinfer.BatchPrefillWithRaggedKVCacheWrapper(buf, jit_args=[1], jit_kwargs={"a": 1})
    r = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(buf, "NHD", True, None, None, None, mib, REF)
    assert r._graph_buffers["qk_indptr"] is mib
    with pytest.raises(TypeError, match=r"both mask_indptr_buf=.* and qk_indptr_buf="):
        flashinfer.BatchPrefillWithRaggedKVCacheWrapper(buf, mask_indptr_buf=mib, qk_indptr_buf=mib)


# ----------------------------------------------------------------------------- ragged prefill
def test_ragged_prefill_plan_all_positional_in_0_2_14_order():
    qo, kv = _t([0, 3, 7]), _t([0, 5, 11])
    q, k, v = torch.randn(7, H, D), torch.randn(11, HKV, D), torch.randn(11, HKV, D)
    kw = dict(head_dim_qk=D, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=True,
              pos_encoding_mode="NONE", use_fp16_qk_reduction=False, window_left=3, logits_soft_cap=None,
              sm_scale=0.25, rope_scale=None, rope_theta=None, q_data_type="float32", kv_data_type="float32",
              non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
              max_item_len_ptr=None)
    a = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16), backend=REF)
    b = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16), backend=REF)
    a.plan(qo, kv, H, HKV, **kw)
    b.plan(qo, kv, H, HKV, *kw.values())
    assert a.problem == b.problem and b._planned.meta.params.window_left == 3
    assert torch.equal(a.run(q, k, v), b.run(q, k, v))
    with pytest.raises(TypeError, match=r"both head_dim_qk=.* and head_dim="):
        a.plan(qo, kv, H, HKV, D, head_dim=D)
    with pytest.raises(ValueError, match="token_pos_in_items_ptr: missing"):
        a.plan(qo, kv, H, HKV, D, prefix_len_ptr=_t([0, 0]))
    with pytest.raises(TypeError, match=r"positional argument.*return_lse"):
        a.run(q, k, v, True)
    a.plan(qo, kv, H, HKV, head_dim=D, disable_split_kv=True, q_data_type="float32")
    assert a._planned.meta.disable_split_kv is True


# ----------------------------------------------------------------------------- decode
def _decode_args():
    cache, kvp, kvi, last = _paged()
    return cache, (kvp, kvi, last, H, HKV, D, PAGE)


def test_decode_plan_all_positional_in_0_2_14_order():
    cache, args = _decode_args()
    q = torch.randn(2, H, D)
    kw = dict(pos_encoding_mode="ROPE_LLAMA", window_left=-1, logits_soft_cap=None, q_data_type="float32",
              kv_data_type=None, data_type=None, sm_scale=None, rope_scale=8.0, rope_theta=5e5, non_blocking=True,
              block_tables=None, seq_lens=None)
    a = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16), backend=REF)
    b = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16), backend=REF)
    a.plan(*args, **kw)
    # the call: 8.0 is rope_scale and 5e5 rope_theta
    b.plan(*args, "ROPE_LLAMA", -1, None, "float32", None, None, None, 8.0, 5e5)
    p = b._planned.meta.params
    assert (p.rope_scale, p.rope_theta, p.sm_scale) == (8.0, 5e5, 1 / math.sqrt(D))
    assert a.problem == b.problem and torch.equal(a.run(q, cache), b.run(q, cache))
    c = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16), backend=REF)
    c.plan(*args, *kw.values())
    assert c.problem == a.problem and c._planned.meta.params == a._planned.meta.params
    with pytest.raises(TypeError, match=r"sm_scale.*0\.2\.14's order.*o_data_type"):  # a newer release's order
        b.plan(*args, "NONE", -1, None, "float32", "float32", "float32", "float32")
    with pytest.raises(TypeError, match=r"positional argument.*q_scale, k_scale, v_scale, return_lse"):
        b.run(q, cache, 1.0)
    b.plan(*args, q_data_type="float32", fixed_split_size=2, disable_split_kv=True, o_data_type="float32")


def test_decode_data_type_fills_only_none():
    _, args = _decode_args()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16), backend=REF)
    w.plan(*args, data_type=torch.float8_e4m3fn, q_data_type=torch.float16)
    assert (w.problem.q_dtype, w.problem.kv_dtype) == (torch.float16, torch.float8_e4m3fn)
    w.plan(*args, data_type=torch.bfloat16, q_data_type=None)
    assert (w.problem.q_dtype, w.problem.kv_dtype) == (torch.bfloat16, torch.bfloat16)
    w.plan(*args, data_type=torch.bfloat16)  # 0.2.14: q_data_type defaults to float16, so only KV is filled
    assert (w.problem.q_dtype, w.problem.kv_dtype) == (torch.float16, torch.bfloat16)
    w.plan(*args, data_type=torch.float32, q_data_type=torch.float16, kv_data_type=torch.float16)
    assert (w.problem.q_dtype, w.problem.kv_dtype) == (torch.float16, torch.float16)


def test_single_decode_positional_order():
    q, k, v = torch.randn(H, D), torch.randn(7, HKV, D), torch.randn(7, HKV, D)
    a = flashinfer.single_decode_with_kv_cache(q, k, v, "NHD", "NONE", False, None, 0.5, 2.0, 3, 10.0, 0.3, None,
                                               None, True, backend=REF)
    b = flashinfer.single_decode_with_kv_cache(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE",
                                               use_tensor_cores=False, q_scale=None, k_scale=0.5, v_scale=2.0,
                                               window_left=3, logits_soft_cap=10.0, sm_scale=0.3, rope_scale=None,
                                               rope_theta=None, return_lse=True, backend=REF)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------- attributes, legacy names
def test_wrapper_attributes():
    cache, args = _decode_args()
    d = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16), "NHD", False, True, backend=REF)
    assert d.use_tensor_cores is True and d.is_cuda_graph_enabled is False
    d.plan(*args, window_left=4, sm_scale=0.5, q_data_type="float32")
    assert (d._sm_scale, d._window_left, d._logits_soft_cap, d._pos_encoding_mode) == (0.5, 4, 0.0, "NONE")
    pargs, _ = _paged_plan_kw()
    w = _prefill_wrapper()
    w.plan(*pargs, D, PAGE, causal=True, logits_soft_cap=5.0, q_data_type="float32")
    assert (w._causal, w._sm_scale, w._window_left, w._logits_soft_cap, w._pos_encoding_mode) == (
        True, None, -1, 5.0, "NONE")
    for cls in (flashinfer.BatchPrefillWithPagedKVCacheWrapper, flashinfer.BatchPrefillWithRaggedKVCacheWrapper,
                flashinfer.BatchDecodeWithPagedKVCacheWrapper):
        for name in ("begin_forward", "forward", "end_forward", "run_return_lse", "forward_return_lse"):
            assert callable(getattr(cls, name))


def test_legacy_forward_applies_its_options():
    """0.2.14's forward() sets its options (its defaults included) before running."""
    cache = _paged()[0]
    pargs, _ = _paged_plan_kw()
    q = torch.randn(7, H, D)
    w = _prefill_wrapper()
    w.begin_forward(*pargs, D, PAGE, causal=True, q_data_type="float32")
    causal = w.run(q, cache)
    assert torch.equal(w.forward(q, cache, True), causal)
    noncausal = w.forward(q, cache)  # causal=False by default: planned again
    assert w._causal is False and not torch.equal(noncausal, causal)
    ref = _prefill_wrapper()
    ref.plan(*pargs, D, PAGE, causal=False, sm_scale=0.1, q_data_type="float32")
    assert torch.equal(w.forward(q, cache, sm_scale=0.1), ref.run(q, cache))
    _, args = _decode_args()
    d = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16), backend=REF)
    d.begin_forward(*args, q_data_type="float32")
    qd = torch.randn(2, H, D)
    out, lse = d.forward_return_lse(qd, cache, sm_scale=0.2)
    d2 = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16), backend=REF)
    d2.plan(*args, q_data_type="float32", sm_scale=0.2)
    assert torch.equal(out, d2.run(qd, cache))


# ----------------------------------------------------------------------------- backend=
def test_backend_names():
    q, k, v = _qkv()
    from attncore.core import registry
    assert registry.resolve("fa2") == "cuda_fa2" and registry.resolve("auto") == "auto"
    for name, msg in (("fa3", "no separate FA3 backend"), ("cutlass", "no CUTLASS"),
                      ("trtllm-gen", "no TensorRT-LLM-gen backend")):
        with pytest.raises(ValueError, match=msg):
            flashinfer.single_prefill_with_kv_cache(q, k, v, backend=name)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16), backend=name)
        _, args = _decode_args()
        with pytest.raises(ValueError, match=msg):
            w.plan(*args, q_data_type="float32")
    if "sdpa" in registry.entries():
        assert registry.resolve("cudnn") == "sdpa"
    else:
        with pytest.raises(ValueError, match="not installed"):
            registry.resolve("cudnn")
    with pytest.raises(ValueError, match=r"'nosuch' is not a known backend; known values: auto, .*reference.*fa3"):
        flashinfer.single_prefill_with_kv_cache(q, k, v, backend="nosuch")
