"""Per-head scale_q / scale_k / scale_v in single prefill (issue 18, attncore.core.head_scales), as FlashInfer
0.2.14's tests/test_hopper_fp8_attention.py calls it: q, k, v quantized to fp8 per head, one scale per head.

Each case is checked against the fp64 golden of the dequantized tensors (q8 * s_q[h], ...) with the project's
tolerance rule.  The yardstick (the same math in the compute dtype) takes the q the backend is given: q folded
with s_q[h] * s_k[h // group] / c and rounded once to the compute dtype (semantics.md, "FP8 and scales").  It
must: the folded q is not an fp8 value, so that rounding is part of the method's error, and a yardstick that
rounded the dequantized q and k instead would carry different (not larger) input errors, which the rule's
factor 2 is not meant to absorb.  Likewise its output is multiplied by s_v per head and rounded again, as the
implementation does.  CPU: reference and Triton (interpreter), fp16/fp32 compute; GPU (``@pytest.mark.gpu``):
FlashInfer's shape (seq 509, 32 heads, d128, causal) on triton, cuda_fa2 and auto with FlashInfer's MSE check
and the golden check."""

import math

import pytest
import torch

import attncore
from attncore.core import head_scales
from attncore.testing.golden import dtype_attention, golden_attention, max_error, tolerance

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
gpu = pytest.mark.gpu


def quantize_per_head(x: torch.Tensor, dtype: torch.dtype):
    """Symmetric per-head quantization of x ``[n, H, D]``: s[h] = max|x[:, h]| / the dtype's max (float32)."""
    fmax = torch.finfo(dtype).max
    s = (x.abs().amax(dim=(0, 2)).float() / fmax).clamp(min=1e-6)
    return (x.float() / s[None, :, None]).clamp(-fmax, fmax).to(dtype), s


def _data(g, n, heads, d, device="cpu"):
    """fp16 data whose heads differ in magnitude (so their scales differ)."""
    mag = 2.0 ** (torch.rand(heads, generator=g) * 4 - 2)
    return (torch.randn(n, heads, d, generator=g) * mag[None, :, None]).half().to(device)


def _deq(x8, s):
    return x8.double() * s.double().to(x8.device)[None, :, None]


def _check(out, lse, q8, k8, v8, sq, sk, sv, *, compute, out_dtype, causal, device="cpu"):
    """out/lse against the fp64 golden of the dequantized tensors, the yardstick as the module docstring says."""
    group = q8.shape[1] // k8.shape[1]
    go, gl = golden_attention(_deq(q8, sq), _deq(k8, sk), _deq(v8, sv), causal=causal, device=device)
    c = 2.0 ** round(math.log2(float(sk.max())))
    fold = (sq.double() * sk.double().repeat_interleave(group) / c).to(q8.device)
    q_up = (q8.double() * fold[None, :, None]).to(compute)
    bo, bl = dtype_attention(q_up, k8, v8, dtype=compute, out_dtype=out_dtype, causal=causal, k_scale=c,
                             device=device)
    bo = (bo * sv.double().cpu().repeat_interleave(group)[None, :, None]).to(out_dtype).double()
    err = max_error(out, go)
    assert err <= tolerance(bo, go, out_dtype), (err, tolerance(bo, go, out_dtype))
    if lse is not None:
        assert max_error(lse, gl) <= tolerance(bl, gl, compute, kind="lse")


# ----------------------------------------------------------------------------- CPU: reference and Triton
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("qd", FP8)
@pytest.mark.parametrize("compute", [torch.float16, torch.float32])
@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_per_head(backend, qd, compute, group, causal):
    g = torch.Generator().manual_seed(11 + group)
    hkv, d = 2, 64
    q8, sq = quantize_per_head(_data(g, 7, hkv * group, d), qd)
    k8, sk = quantize_per_head(_data(g, 13, hkv, d), qd)
    v8, sv = quantize_per_head(_data(g, 13, hkv, d), qd)
    assert len(set(sq.tolist())) > 1 and len(set(sk.tolist())) > 1 and len(set(sv.tolist())) > 1
    out, lse = attncore.single_prefill_with_kv_cache(q8, k8, v8, sq, sk, sv, causal=causal, backend=backend,
                                                     o_dtype=compute, return_lse=True)
    assert out.dtype == compute and out.shape == (7, hkv * group, d) and lse.shape == (7, hkv * group)
    _check(out, lse, q8, k8, v8, sq, sk, sv, compute=compute, out_dtype=compute, causal=causal)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp16_q_per_head_and_out_in_place(backend):
    """A 16-bit q is folded too (copied into the upcast buffer); a per-head scale_v scales ``out=`` in place;
    HND layout; per-head scale_q with a per-tensor k_scale, and per-head scale_v alone."""
    g = torch.Generator().manual_seed(3)
    q = _data(g, 5, 6, 32)
    k8, sk = quantize_per_head(_data(g, 9, 2, 32), torch.float8_e4m3fn)
    v8, sv = quantize_per_head(_data(g, 9, 2, 32), torch.float8_e4m3fn)
    sq = torch.tensor([0.5, 1.0, 2.0, 0.75, 1.5, 3.0])
    out = torch.empty(5, 6, 32, dtype=torch.float16)
    r = attncore.single_prefill_with_kv_cache(q, k8.transpose(0, 1).contiguous(), v8.transpose(0, 1).contiguous(),
                                              sq, sk, sv, kv_layout="HND", backend=backend, out=out)
    assert r.data_ptr() == out.data_ptr()
    _check(out, None, q, k8, v8, sq, sk, sv, compute=torch.float16, out_dtype=torch.float16, causal=False)
    one = torch.tensor([1.0, 1.0])
    r = attncore.single_prefill_with_kv_cache(q, k8, v8, scale_q=sq, k_scale=0.25, backend=backend)
    _check(r, None, q, k8, v8, sq, torch.full((2,), 0.25), one, compute=torch.float16, out_dtype=torch.float16,
           causal=False)
    r = attncore.single_prefill_with_kv_cache(q, k8, v8, scale_v=sv, scale_k=0.5, backend=backend, causal=True)
    _check(r, None, q, k8, v8, torch.ones(6), torch.full((2,), 0.5), sv, compute=torch.float16,
           out_dtype=torch.float16, causal=True)


def test_row_chunks(monkeypatch):
    """The fp64 temporaries are bounded: with a chunk of 2 rows' worth, the result is the same bit for bit."""
    g = torch.Generator().manual_seed(4)
    q8, sq = quantize_per_head(_data(g, 7, 4, 32), torch.float8_e5m2)
    k8, sk = quantize_per_head(_data(g, 9, 2, 32), torch.float8_e5m2)
    v8, sv = quantize_per_head(_data(g, 9, 2, 32), torch.float8_e5m2)
    kw = dict(backend="reference", o_dtype=torch.float16, causal=True)
    a = attncore.single_prefill_with_kv_cache(q8, k8, v8, sq, sk, sv, **kw)
    monkeypatch.setattr(head_scales, "CHUNK", 2 * 4 * 32 + 1)
    assert [r for r in head_scales._rows(q8)] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert torch.equal(a, attncore.single_prefill_with_kv_cache(q8, k8, v8, sq, sk, sv, **kw))


def test_per_head_values_are_read_per_call():
    """Per-head scales are planned every call: the same shapes with other values give the other result."""
    g = torch.Generator().manual_seed(5)
    q8, sq = quantize_per_head(_data(g, 4, 4, 32), torch.float8_e4m3fn)
    k8, sk = quantize_per_head(_data(g, 6, 2, 32), torch.float8_e4m3fn)
    v8, sv = quantize_per_head(_data(g, 6, 2, 32), torch.float8_e4m3fn)
    for f in (1.0, 4.0):
        s2 = sv * torch.tensor([1.0, f])
        out = attncore.single_prefill_with_kv_cache(q8, k8, v8, sq, sk, s2, backend="reference",
                                                    o_dtype=torch.float16)
        _check(out, None, q8, k8, v8, sq, sk, s2, compute=torch.float16, out_dtype=torch.float16, causal=False)


def test_all_equal_keeps_per_tensor_path(monkeypatch):
    """Per-head tensors whose entries are equal take the per-tensor path: no fold, no output pass, and the
    result equals the per-tensor call bit for bit."""
    def boom(*a, **k):
        raise AssertionError("per-head pass ran for equal scales")

    monkeypatch.setattr(head_scales, "fold_q", boom)
    monkeypatch.setattr(head_scales, "scale_out", boom)
    g = torch.Generator().manual_seed(9)
    q8 = _data(g, 5, 4, 32).to(torch.float8_e5m2)
    k8, v8 = _data(g, 8, 2, 32).to(torch.float8_e5m2), _data(g, 8, 2, 32).to(torch.float8_e5m2)
    for backend in ("reference", "triton"):
        a = attncore.single_prefill_with_kv_cache(q8, k8, v8, torch.full((4,), 0.5), torch.full((2,), 0.25),
                                                  torch.full((2,), 2.0), backend=backend, o_dtype=torch.float16)
        b = attncore.single_prefill_with_kv_cache(q8, k8, v8, 0.5, 0.25, 2.0, backend=backend, o_dtype=torch.float16)
        assert torch.equal(a, b)
    with pytest.raises(AssertionError, match="per-head pass"):  # and the patch does catch a per-head run
        attncore.single_prefill_with_kv_cache(q8, k8, v8, torch.tensor([0.5, 1.0, 1.0, 1.0]), backend="reference",
                                              o_dtype=torch.float16)


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(scale_q=torch.ones(3)), ValueError, r"scale_q: .*shape \[3\].*num_qo_heads\] = \[4\]"),
    (dict(scale_k=torch.ones(4)), ValueError, r"scale_k: .*shape \[4\].*num_kv_heads\] = \[2\]"),
    (dict(scale_v=torch.ones(2, 1)), ValueError, r"scale_v: .*shape \[2, 1\]"),
    (dict(q_scale=torch.tensor([1.0, 2.0, 1.0, 1.0])), ValueError,  # attncore's spellings stay per tensor
     r"q_scale: got a tensor of shape \[4\], expected a float or a 1-element tensor"),
    (dict(scale_k=torch.tensor([0.5, -1.0])), ValueError, r"scale_k\[1\]: got -1\.0.*finite number > 0"),
    (dict(scale_q=torch.tensor([0.5, float("nan"), 1.0, 1.0])), ValueError, r"scale_q\[1\]: got nan"),
    (dict(scale_v=torch.tensor([1.0, float("inf")])), ValueError, r"scale_v\[1\]: got inf"),
    (dict(scale_q=torch.tensor([0.0, 1.0, 1.0, 1.0])), ValueError, r"scale_q\[0\]: got 0\.0"),
    (dict(scale_k=torch.tensor([True, False])), TypeError, r"scale_k"),
    (dict(scale_k=torch.tensor([1, 2])), TypeError, r"scale_k: got a tensor of dtype int64"),
    (dict(scale_v=torch.tensor([1.0, 2.0]), o_dtype=torch.float8_e4m3fn), ValueError,
     r"scale_v: .*per-head.*rounded twice.*o_dtype=torch.float16"),
])
def test_bad_per_head_scales(kw, exc, msg):
    g = torch.Generator().manual_seed(1)
    q, k, v = _data(g, 3, 4, 16), _data(g, 5, 2, 16), _data(g, 5, 2, 16)
    with pytest.raises(exc, match=msg):
        attncore.single_prefill_with_kv_cache(q, k, v, backend="reference", **kw)


@gpu
def test_scale_on_other_device():
    q = torch.randn(3, 4, 16).half()
    k = v = torch.randn(5, 2, 16).half()
    with pytest.raises(ValueError, match=r"scale_q: got a tensor on cuda"):
        attncore.single_prefill_with_kv_cache(q, k, v, torch.tensor([1.0, 2.0, 1.0, 1.0], device="cuda"),
                                              backend="reference")


# ----------------------------------------------------------------------------- GPU: FlashInfer's shape
@gpu
@pytest.mark.parametrize("backend", ["triton", "cuda_fa2", "auto"])
@pytest.mark.parametrize("qd", FP8)
def test_gpu_flashinfer_shape(backend, qd):
    torch.manual_seed(0)
    seq, heads, d = 509, 32, 128
    q, k, v = (torch.randn(seq, heads, d, dtype=torch.half, device="cuda") for _ in range(3))
    o_ref = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend=backend)
    q8, sq = quantize_per_head(q, qd)
    k8, sk = quantize_per_head(k, qd)
    v8, sv = quantize_per_head(v, qd)
    out, lse = attncore.single_prefill_with_kv_cache(q8, k8, v8, sq, sk, sv, causal=True, backend=backend,
                                                     o_dtype=torch.half, return_lse=True)
    mse = torch.mean((o_ref.float() - out.float()) ** 2)
    assert mse < 1.0, f"MSE too high: {mse.item()}"  # FlashInfer's check
    _check(out, lse, q8, k8, v8, sq, sk, sv, compute=torch.half, out_dtype=torch.half, causal=True, device="cuda")
