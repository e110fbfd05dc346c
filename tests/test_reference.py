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
    v = _rand(15, 2, 32).to(torch.float8_e4m3fn)
    sinks = torch.randn(4)
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


def _dense_spec_rows(words_row, q_len, kv_len):
    """Independent decoding of one request's xqa uint16 mask rows: bit j of row i, LSB-first."""
    keep = torch.zeros(q_len, kv_len, dtype=torch.bool)
    keep[:, : kv_len - q_len] = True
    for i in range(q_len):
        for j in range(q_len):
            word = int(words_row[i, j // 16]) & 0xFFFF
            keep[i, kv_len - q_len + j] = bool((word >> (j % 16)) & 1)
    return keep


def test_xqa_spec_mask_fp8_kv_and_fp8_output():
    b, q_len, hq, hkv, d, page = 2, 3, 4, 2, 32, 8
    kv_lens = [11, 5]
    cache = torch.randn(6, 2, page, hkv, d).to(torch.float8_e4m3fn)
    bt = torch.tensor([[0, 3], [5, 0]], dtype=torch.int32)
    seq = torch.tensor(kv_lens, dtype=torch.int32)
    q = torch.randn(b * q_len, hq, d).half()
    mask = torch.randint(0, 1 << 15, (b, q_len, 2), dtype=torch.int32).to(torch.uint16)
    out = torch.full((b * q_len, hq, d), float("nan")).to(torch.float8_e4m3fn)
    attncore.xqa_batch_decode_with_kv_cache(q, cache, torch.zeros(64, dtype=torch.uint8), bt, seq, 11,
                                            bmm1_scale=0.2, bmm2_scale=0.5, out=out, q_len_per_req=q_len,
                                            mask=mask, o_scale=0.25, backend="reference")
    for i in range(b):
        pages = bt[i, : (kv_lens[i] + page - 1) // page].long()
        k = cache[pages, 0].float().reshape(-1, hkv, d)[: kv_lens[i]]
        v = cache[pages, 1].float().reshape(-1, hkv, d)[: kv_lens[i]]
        keep = _dense_spec_rows(mask[i], q_len, kv_lens[i])
        g, _ = golden_attention(q[i * q_len:(i + 1) * q_len], k, v, mask=keep, sm_scale=0.2, v_scale=0.5,
                                o_scale=0.25)
        got = out[i * q_len:(i + 1) * q_len].float().double()
        # e4m3 keeps 3 mantissa bits: a relative rounding of 2^-4
        assert torch.all((got - g).abs() <= g.abs() * 2 ** -4 + 2 ** -9)


def test_preallocated_out_and_lse_are_written():
    q, k, v = _rand(6, 4, 16), _rand(9, 2, 16), _rand(9, 2, 16)
    out = torch.full((6, 4, 16), float("nan")).half()
    lse = torch.full((6, 4), float("nan"))
    res = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, out=out, lse=lse,
                                                backend="reference")
    assert res[0] is out and res[1] is lse
    _check(out, q, k, v, lse, causal=True)


def test_mask_materialization_matches_the_rules():
    from attncore.mask import build_mask

    qo, kv = 5, 9
    custom = torch.rand(qo, kv) < 0.5
    for causal, use_custom, window in [(True, False, -1), (False, False, 2), (True, False, 3), (True, True, 4),
                                       (False, True, -1)]:
        m = build_mask(qo, kv, causal=causal, custom=custom if use_custom else None, window_left=window)
        for i in range(qo):
            pos = kv - qo + i
            for j in range(kv):
                want = bool(custom[i, j]) if use_custom else (j <= pos if causal else True)
                if window >= 0:
                    want = want and j >= pos - window
                assert bool(m[i, j]) == want


def test_spec_mask_packing_round_trips():
    from attncore.mask import pack_spec_mask, spec_mask_rows

    for q_len in (1, 3, 17, 33):
        bits = torch.rand(2, q_len, q_len) < 0.5
        words = pack_spec_mask(bits)
        assert words.shape == (2, q_len, ((q_len + 31) // 32) * 2) and words.dtype == torch.uint16
        for i in range(2):
            rows = spec_mask_rows(words, i, q_len, q_len + 5)
            assert rows[:, :5].all() and torch.equal(rows[:, 5:], bits[i])
            assert torch.equal(_dense_spec_rows(words[i], q_len, q_len + 5), rows)
