"""The reference backend against the independent fp64 golden, feature by feature."""

import math

import pytest
import torch

import attncore
from attncore.reference import core
from attncore.testing.golden import golden_attention, max_error, tolerance

DT = torch.float16


def _rand(*shape, dtype=DT):
    return torch.randn(*shape).to(dtype)


def _check(out, q, k, v, lse=None, **kw):
    g, gl = golden_attention(q, k.float(), v.float(), **kw)
    base, _ = golden_attention(q, k.float(), v.float(), compute_dtype=q.dtype, **kw)
    assert max_error(out, g) <= tolerance(base, g, q.dtype)
    if lse is not None:
        assert max_error(lse, gl) <= 1e-3


FEATURES = [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, window_left=5),
    dict(causal=False, window_left=0),
    dict(causal=True, logits_soft_cap=20.0),
    dict(causal=True, pos_encoding_mode="ALIBI"),
    dict(causal=True, pos_encoding_mode="ROPE_LLAMA", rope_theta=500.0, rope_scale=2.0),
    dict(causal=True, sm_scale=0.3),
]


@pytest.mark.parametrize("kw", FEATURES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (5, 1)])
def test_single_prefill_features(kw, hq, hkv):
    q, k, v = _rand(13, hq, 32), _rand(29, hkv, 32), _rand(29, hkv, 32)
    out, lse = attncore.single_prefill_with_kv_cache(q, k, v, return_lse=True, backend="reference", **kw)
    _check(out, q, k, v, lse, **kw)


def test_custom_mask_and_window_are_anded():
    q, k, v = _rand(8, 2, 16), _rand(20, 2, 16), _rand(20, 2, 16)
    mask = torch.rand(8, 20) < 0.5
    out, lse = attncore.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, window_left=6, causal=True,
                                                     return_lse=True, backend="reference")
    _check(out, q, k, v, lse, mask=mask, window_left=6)


def test_packed_mask_equals_dense_mask():
    q, k, v = _rand(8, 2, 16), _rand(20, 2, 16), _rand(20, 2, 16)
    mask = torch.rand(8, 20) < 0.5
    packed = attncore.packbits(mask.flatten(), bitorder="little")
    a = attncore.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, backend="reference")
    b = attncore.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed, backend="reference")
    assert torch.equal(a, b)


def test_sinks_fp8_and_scales():
    q = _rand(6, 4, 32)
    k = _rand(15, 2, 32).to(torch.float8_e4m3fn)
    v = _rand(15, 2, 32).to(torch.float8_e5m2)
    sinks = torch.randn(4)
    # k and v of different fp8 formats are not an API case; use e4m3 for both
    v = v.float().to(torch.float8_e4m3fn)
    out, lse = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, backend="reference",
                                                     sinks=sinks, k_scale=0.5, v_scale=2.0)
    _check(out, q, k, v, lse, causal=True, sinks=sinks, k_scale=0.5, v_scale=2.0)


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = _rand(4, 2, 16), _rand(6, 2, 16), _rand(6, 2, 16)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1] = False
    out, lse = attncore.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, return_lse=True,
                                                     backend="reference", sinks=torch.randn(2))
    assert torch.all(out[1] == 0) and torch.all(torch.isinf(lse[1])) and torch.all(lse[1] < 0)
    assert not torch.isnan(out).any()


def test_kv_len_zero_and_qo_longer_than_kv_in_batch():
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8), backend="reference")
    qo = torch.tensor([0, 3, 8], dtype=torch.int32)
    kv = torch.tensor([0, 0, 2], dtype=torch.int32)
    w.plan(qo, kv, 2, 1, 16, causal=True)
    q, k, v = _rand(8, 2, 16), _rand(2, 1, 16), _rand(2, 1, 16)
    out, lse = w.run(q, k, v, return_lse=True)
    assert torch.all(out[:3] == 0) and torch.all(torch.isneginf(lse[:3]))
    _check(out[3:], q[3:], k, v, lse[3:], causal=True)
    assert torch.all(out[3:6] == 0)  # rows 0..2 of request 1 see no key (qo 5 > kv 2)


def test_chunking_does_not_change_results(monkeypatch):
    q, k, v = _rand(40, 4, 16), _rand(70, 2, 16), _rand(70, 2, 16)
    full = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference", window_left=30)
    monkeypatch.setattr(core, "SCORE_BUDGET", 64)  # tiny query blocks
    monkeypatch.setattr(core, "KV_CHUNK", 7)
    seen = []
    orig = torch.einsum

    def spy(eq, *ops):
        if eq == "hgqd,hkd->hgqk":
            seen.append(ops[0].shape[2] * ops[1].shape[1] * ops[0].shape[0] * ops[0].shape[1])
        return orig(eq, *ops)

    monkeypatch.setattr(torch, "einsum", spy)
    chunked = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference", window_left=30)
    assert seen and max(seen) <= 4 * 7 * 4  # never the whole [Hq, qo, kv] score matrix
    assert max_error(chunked, full.double()) < 2e-3


def test_long_prefill_memory_is_bounded():
    """The score block size, not qo*kv*H, bounds the reference's memory (32k x 32 heads budget)."""
    hq, kv = 32, 32768
    q_block = max(1, min(kv, core.SCORE_BUDGET // (hq * core.KV_CHUNK)))
    assert q_block * hq * core.KV_CHUNK * 4 <= 64 << 20  # 64 MiB per block, not 128 GiB
