"""The reference backend against the independent fp64 golden, feature by feature."""

import pytest
import torch

import attncore
from attncore.reference import core
from attncore.testing.contract import assert_batch
from attncore.testing.golden import golden_attention, max_error

DT = torch.float16


def _rand(*shape, dtype=DT):
    return torch.randn(*shape).to(dtype)


def _check(out, q, k, v, lse=None, causal=False, mask=None, **kw):
    """One request against the fp64 golden: the conformance suite's checker and tolerance rule."""
    assert_batch([(q, k, v)], out, lse, causal=causal, masks=None if mask is None else [mask], **kw)


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
    from attncore.core.mask import build_mask

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
    from attncore.core.mask import pack_spec_mask, spec_mask_rows

    for q_len in (1, 3, 17, 33):
        bits = torch.rand(2, q_len, q_len) < 0.5
        words = pack_spec_mask(bits)
        assert words.shape == (2, q_len, ((q_len + 31) // 32) * 2) and words.dtype == torch.uint16
        for i in range(2):
            rows = spec_mask_rows(words, i, q_len, q_len + 5)
            assert rows[:, :5].all() and torch.equal(rows[:, 5:], bits[i])
            assert torch.equal(_dense_spec_rows(words[i], q_len, q_len + 5), rows)


# ----------------------------------------------------------------------------- non-finite inputs (docs/semantics.md)
NAN = float("nan")


def _nan_rows_only(out, lse, clean_out, clean_lse, nan_rows):
    """Rows in ``nan_rows`` are NaN (out and LSE, every head), every other row equals the clean run."""
    others = [i for i in range(out.shape[0]) if i not in nan_rows]
    assert torch.isnan(out[nan_rows]).all() and torch.isnan(lse[nan_rows]).all()
    assert torch.equal(out[others], clean_out[others]) and torch.equal(lse[others], clean_lse[others])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [1024, 3])
def test_nan_left_of_the_window_and_nan_query_rows(monkeypatch, causal, chunk):
    """Keys left of every row's window never matter, even NaN (they are zeroed, not only masked: 0 * NaN
    is NaN); a NaN query row gives NaN out and LSE and touches no other row, also across KV chunks
    (the NaN survives the running max and the rescaling)."""
    monkeypatch.setattr(core, "KV_CHUNK", chunk)
    q, k, v = _rand(6, 4, 16), _rand(20, 2, 16), _rand(20, 2, 16)
    clean = attncore.single_prefill_with_kv_cache(q, k, v, causal=causal, window_left=4, return_lse=True,
                                                  backend="reference")
    # row 0 sits at position 14: with a window of 4 no row sees keys 0..9
    kn, vn = k.clone(), v.clone()
    kn[:10], vn[:10] = NAN, NAN
    out, lse = attncore.single_prefill_with_kv_cache(q, kn, vn, causal=causal, window_left=4, return_lse=True,
                                                     backend="reference")
    assert torch.equal(out, clean[0]) and torch.equal(lse, clean[1])
    qn = q.clone()
    qn[0], qn[5] = NAN, NAN  # row 5 sees keys 15..19 only: chunks [15, 18) and [18, 20) with chunk 3
    out, lse = attncore.single_prefill_with_kv_cache(qn, kn, vn, causal=causal, window_left=4, return_lse=True,
                                                     backend="reference")
    _nan_rows_only(out, lse, clean[0], clean[1], [0, 5])


def test_nan_query_in_one_head_stays_in_that_head():
    q, k, v = _rand(3, 4, 16), _rand(7, 2, 16), _rand(7, 2, 16)
    clean, clean_lse = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True,
                                                             backend="reference")
    q[1, 2, 5] = NAN
    out, lse = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, backend="reference")
    bad = torch.zeros(3, 4, dtype=torch.bool)
    bad[1, 2] = True
    assert torch.isnan(out[bad]).all() and torch.isnan(lse[bad]).all()
    assert torch.equal(out[~bad], clean[~bad]) and torch.equal(lse[~bad], clean_lse[~bad])


def test_nan_query_row_that_sees_no_key_gives_zero_and_minus_inf():
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8), backend="reference")
    w.plan(torch.tensor([0, 2, 7], dtype=torch.int32), torch.tensor([0, 0, 2], dtype=torch.int32), 2, 1, 16,
           causal=True)
    q, k, v = _rand(7, 2, 16), _rand(2, 1, 16), _rand(2, 1, 16)
    q[0] = NAN  # request 0 has no keys
    q[3] = NAN  # request 1: qo 5 > kv 2, its rows 0..2 see no key
    q[6] = NAN  # request 1's last row sees both keys
    out, lse = w.run(q, k, v, return_lse=True)
    for r in (0, 3):
        assert torch.all(out[r] == 0) and torch.isneginf(lse[r]).all()
    assert torch.isnan(out[6]).all() and torch.isnan(lse[6]).all()
    assert not torch.isnan(out[:6]).any() and not torch.isnan(lse[:6]).any()


def test_nan_outside_the_kv_range_and_left_of_the_window_in_paged_caches():
    """Slots past kv_len, pages outside the page table and keys left of the window (decode: all but
    the last window_left + 1) never matter: batch prefill, batch decode and xqa."""
    page, hkv, d = 4, 2, 16
    cache = _rand(8, 2, page, hkv, d)
    # request 0: pages 1, 2, 3 (kv 10: page 3 holds 2 tokens); request 1: pages 5, 6 (kv 7)
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
    indices = torch.tensor([1, 2, 3, 5, 6], dtype=torch.int32)
    last = torch.tensor([2, 3], dtype=torch.int32)
    poisoned = cache.clone()
    poisoned[[0, 4, 7]] = NAN  # pages in no page table
    poisoned[3, :, 2:] = NAN  # past request 0's kv_len
    poisoned[6, :, 3:] = NAN  # past request 1's kv_len
    poisoned[1] = NAN  # request 0's keys 0..3: left of every row's window below
    poisoned[5, :, :2] = NAN  # request 1's keys 0..1

    def prefill(c):
        w = attncore.BatchPrefillWithPagedKVCacheWrapper(torch.empty(8), backend="reference")
        w.plan(torch.tensor([0, 3, 5], dtype=torch.int32), indptr, indices, last, 4, hkv, d, page, causal=True,
               window_left=2)  # request 0: first row at position 7 sees 5..7; request 1: row 0 at 5 sees 3..5
        return w.run(torch.ones(5, 4, d).half(), c, return_lse=True)

    def decode(c):
        w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8), backend="reference")
        w.plan(indptr, indices, last, 4, hkv, d, page, window_left=3, q_data_type=DT)
        return w.run(torch.ones(2, 4, d).half(), c, return_lse=True)

    def xqa(c):
        bt = torch.tensor([[1, 2, 3], [5, 6, 0]], dtype=torch.int32)  # request 1's third entry is unused
        return attncore.xqa_batch_decode_with_kv_cache(torch.ones(2, 4, d).half(), c, torch.zeros(8, dtype=torch.uint8),
                                                       bt, torch.tensor([10, 7], dtype=torch.int32), 10,
                                                       window_left=3, backend="reference"), None

    for fn in (prefill, decode, xqa):
        (out, lse), (clean, clean_lse) = fn(poisoned), fn(cache)
        assert not torch.isnan(out).any(), fn.__name__
        assert torch.equal(out, clean), fn.__name__
        assert lse is None or torch.equal(lse, clean_lse)
