"""trtllm_batch_decode_with_kv_cache (FlashInfer 0.2.14's flashinfer.decode entry point), served by the xqa
path: HND caches, one query token per request, bmm1/bmm2 scales; NVFP4 output refused (issue 18)."""

import math

import pytest
import torch

import attncore
from attncore.decode import trtllm_batch_decode_with_kv_cache
from attncore.testing.golden import golden_and_baseline, tolerance


def _case(seed=0, b=3, hq=8, hkv=2, d=64, page=16, pages_per_req=3, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(b * pages_per_req, 2, hkv, page, d, generator=g).to(dtype)  # HND, [:, 0] K, [:, 1] V
    bt = torch.randperm(b * pages_per_req, generator=g).to(torch.int32).reshape(b, pages_per_req)
    seq = torch.tensor([1, 17, page * pages_per_req][:b], dtype=torch.int32)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    return q, cache, bt, seq


def _check(out, q, cache, bt, seq, scale, v_scale):
    """Each request against the fp64 golden with the project's one tolerance rule."""
    page = cache.shape[3]
    for i in range(q.shape[0]):
        n = int(seq[i])
        pages = bt[i, : -(-n // page)].long()
        k, v = (cache[pages, j].permute(0, 2, 1, 3).reshape(-1, cache.shape[2], cache.shape[4])[:n] for j in (0, 1))
        go, _, bo, _ = golden_and_baseline(q[i:i + 1], k, v, dtype=q.dtype, causal=True, sm_scale=scale)
        go, bo = go * v_scale, bo * v_scale
        err = (out[i:i + 1].double() - go).abs().max().item()
        assert err <= tolerance(bo, go, q.dtype), (i, err)


@pytest.mark.parametrize("tuple_cache", [False, True])
def test_matches_the_golden_through_the_xqa_path(tuple_cache):
    q, cache, bt, seq = _case()
    ws = torch.zeros(32 << 20, dtype=torch.uint8)
    scale, v_scale = 1 / math.sqrt(q.shape[-1]), 0.5
    kv = (cache[:, 0], cache[:, 1]) if tuple_cache else cache
    out = trtllm_batch_decode_with_kv_cache(q, kv, ws, bt, seq, int(seq.max()), scale, v_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, q, cache, bt, seq, scale, v_scale)


def test_sinks_as_flashinfers_list_of_one_tensor():
    q, cache, bt, seq = _case(1)
    ws = torch.zeros(32 << 20, dtype=torch.uint8)
    sinks = torch.randn(q.shape[1])
    scale = 1 / math.sqrt(q.shape[-1])
    a = trtllm_batch_decode_with_kv_cache(q, cache, ws, bt, seq, int(seq.max()), scale, 1.0, sinks=[sinks])
    b = attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, int(seq.max()), scale, 1.0, sinks=sinks,
                                                kv_layout="HND")
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="sinks: got a list of 2 tensors"):
        trtllm_batch_decode_with_kv_cache(q, cache, ws, bt, seq, int(seq.max()), scale, 1.0, sinks=[sinks, sinks])


def test_nvfp4_output_is_refused_with_the_reason():
    q, cache, bt, seq = _case()
    ws = torch.zeros(32 << 20, dtype=torch.uint8)
    for kw in (dict(out_dtype="nvfp4"), dict(o_sf_scale=1.0), dict(o_sf_vec_size=16)):
        with pytest.raises(NotImplementedError, match="NVFP4 output"):
            trtllm_batch_decode_with_kv_cache(q, cache, ws, bt, seq, int(seq.max()), 1.0, 1.0, **kw)
    with pytest.raises(ValueError, match="out_dtype: got 'fp4'"):
        trtllm_batch_decode_with_kv_cache(q, cache, ws, bt, seq, int(seq.max()), 1.0, 1.0, out_dtype="fp4")
