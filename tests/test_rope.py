"""attncore.rope (FlashInfer 0.2.14's rotary-embedding API, a Triton kernel) against a float64 reference.

The reference below is written from the definitions, not from the kernel: frequencies one by one in
Python floats (Llama 3.1's as the piecewise rule of Meta's reference: keep / divide by the scale /
interpolate by wavelength), the rotation as a complex multiplication of the pairs.  CPU cases run
through Triton's interpreter (float16, float32; its bfloat16 is broken, so bfloat16 runs only on CUDA).
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import attncore  # noqa: E402
from attncore import rope  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEV = "cpu" if INTERP or not HAS_CUDA else "cuda"
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol


# ----------------------------------------------------------------------------- reference (float64)
def ref_freqs(rotary_dim, theta, scale, llama31=None):
    out = []
    for i in range(rotary_dim // 2):
        f = 1.0 / theta ** (2 * i / rotary_dim)
        if llama31 is None:
            f /= scale
        else:
            low, high, old = llama31
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                pass
            elif wavelen > old / low:
                f /= scale
            else:
                s = (old / wavelen - low) / (high - low)
                f = (1 - s) * f / scale + s * f
        out.append(f)
    return torch.tensor(out, dtype=torch.float64)


def ref_positions(indptr, offsets):
    ip, off = indptr.tolist(), offsets.tolist()
    return torch.tensor([off[b] + j for b in range(len(off)) for j in range(ip[b + 1] - ip[b])], dtype=torch.int64)


def ref_rotate(x, rot, rotary_dim, interleave):
    """x [n, H, D]; rot [n, rotary_dim // 2] complex128 (unit) rotations of the pairs."""
    y = x.detach().cpu().double().clone()
    rot = rot.cpu()[:, None, :]
    half = rotary_dim // 2
    if interleave:
        pairs = y[..., :rotary_dim].reshape(*y.shape[:-1], half, 2)
        z = torch.complex(pairs[..., 0], pairs[..., 1]) * rot
        y[..., 0:rotary_dim:2], y[..., 1:rotary_dim:2] = z.real, z.imag
    else:
        z = torch.complex(y[..., :half], y[..., half:rotary_dim]) * rot
        y[..., :half], y[..., half:rotary_dim] = z.real, z.imag
    return y


def ref_rope(x, pos, rotary_dim, interleave, theta, scale, llama31=None):
    ang = pos.cpu().double()[:, None] * ref_freqs(rotary_dim, theta, scale, llama31)[None, :]
    return ref_rotate(x, torch.polar(torch.ones_like(ang), ang), rotary_dim, interleave)


def assert_rope_close(out, ref, x, rotary_dim):
    assert out.dtype == x.dtype and out.shape == x.shape and out.device == x.device
    tol = TOL[x.dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
    # the pass-through part is a copy, bit for bit
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


# ----------------------------------------------------------------------------- inputs
def make_qk(nnz, hq=4, hk=2, d=16, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nnz, hq, d, generator=g).to(DEV, dtype)
    k = torch.randn(nnz, hk, d, generator=g).to(DEV, dtype)
    return q, k


def ragged(lens=(3, 0, 5, 1), offs=(0, 7, 2, 30), idtype=torch.int32):
    indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=idtype, device=DEV)
    return indptr, torch.tensor(offs, dtype=idtype, device=DEV)


# ----------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_apply_rope(dtype, interleave, rotary_dim):
    indptr, offsets = ragged()
    q, k = make_qk(int(indptr[-1]), dtype=dtype)
    q0, k0 = q.clone(), k.clone()
    qr, kr = rope.apply_rope(q, k, indptr, offsets, rotary_dim, interleave, 2.0, 500.0)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # inputs untouched
    rd = rotary_dim or q.shape[-1]
    pos = ref_positions(indptr.cpu(), offsets.cpu())
    assert_rope_close(qr, ref_rope(q, pos, rd, interleave, 500.0, 2.0), q, rd)
    assert_rope_close(kr, ref_rope(k, pos, rd, interleave, 500.0, 2.0), k, rd)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleave", [False, True])
def test_apply_rope_pos_ids(dtype, interleave):
    q, k = make_qk(11, hq=3, hk=1, d=32, dtype=dtype, seed=1)
    pos = torch.randint(0, 100, (11,), generator=torch.Generator().manual_seed(2)).to(DEV)  # any order
    qr, kr = rope.apply_rope_pos_ids(q, k, pos, rotary_dim=24, interleave=interleave)
    assert_rope_close(qr, ref_rope(q, pos, 24, interleave, 1e4, 1.0), q, 24)
    assert_rope_close(kr, ref_rope(k, pos, 24, interleave, 1e4, 1.0), k, 24)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("idtype", [torch.int32, torch.int64], ids=str)
def test_pos_ids_equal_ragged(interleave, idtype):
    indptr, offsets = ragged(idtype=idtype)
    q, k = make_qk(int(indptr[-1]), hq=2, hk=2, seed=3)
    pos = ref_positions(indptr.cpu(), offsets.cpu()).to(DEV, idtype)
    a = rope.apply_rope(q, k, indptr, offsets, 12, interleave)
    b = rope.apply_rope_pos_ids(q, k, pos, 12, interleave)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    kw = dict(rotary_dim=12, interleave=interleave, rope_scale=4, old_context_len=64)
    a = rope.apply_llama31_rope(q, k, indptr, offsets, **kw)
    b = rope.apply_llama31_rope_pos_ids(q, k, pos, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_inv_freq():
    for rd, theta, scale in [(16, 1e4, 1.0), (6, 500.0, 3.0), (128, 5e5, 8.0)]:
        torch.testing.assert_close(rope.rope_inv_freq(rd, theta, scale).double(), ref_freqs(rd, theta, scale),
                                   atol=0, rtol=1e-6)
    ll = (1.0, 4.0, 64.0)
    got = rope.rope_inv_freq(16, 1e4, 8.0, llama31=ll).double()
    torch.testing.assert_close(got, ref_freqs(16, 1e4, 8.0, ll), atol=0, rtol=1e-6)


def test_frequencies_kept_per_arguments():
    """The frequencies are computed once per (rotary_dim, theta, scale, llama31, device) and kept: calls
    that alternate between settings each get their own."""
    q, k = make_qk(9, hq=2, hk=1, d=16, seed=7)
    pos = torch.arange(9).to(DEV) * 37
    settings = [(16, 1e4, 1.0, None), (8, 500.0, 2.0, None), (16, 1e4, 8.0, (1.0, 4.0, 64.0)), (16, 1e4, 1.0, None)]
    for rd, theta, scale, ll in settings:
        if ll is None:
            qr, kr = rope.apply_rope_pos_ids(q, k, pos, rd, False, scale, theta)
        else:
            qr, kr = rope.apply_llama31_rope_pos_ids(q, k, pos, rd, False, scale, theta, *ll)
        assert_rope_close(qr, ref_rope(q, pos, rd, False, theta, scale, ll), q, rd)
        assert_rope_close(kr, ref_rope(k, pos, rd, False, theta, scale, ll), k, rd)
    assert (8, 500.0, 2.0, None, q.device) in rope._INV_FREQ


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleave", [False, True])
def test_llama31(dtype, interleave):
    # old_context_len = 64 puts the 8 pairs of rotary_dim 16 (theta 1e4) in all three regions: pair 0
    # kept (wavelength 6.3 < 64 / 4), pairs 1-2 interpolated, pairs 3-7 scaled (wavelength > 64)
    indptr, offsets = ragged(lens=(4, 6), offs=(150, 3))
    q, k = make_qk(10, hq=2, hk=1, d=24, dtype=dtype, seed=4)
    ll = (1.0, 4.0, 64)
    pos = ref_positions(indptr.cpu(), offsets.cpu())
    qr, kr = rope.apply_llama31_rope(q, k, indptr, offsets, 16, interleave, 8, 1e4, *ll)
    assert_rope_close(qr, ref_rope(q, pos, 16, interleave, 1e4, 8.0, ll), q, 16)
    assert_rope_close(kr, ref_rope(k, pos, 16, interleave, 1e4, 8.0, ll), k, 16)
    # defaults (scale 8, theta 5e5, 1, 4, 8192) through pos_ids
    qr, kr = rope.apply_llama31_rope_pos_ids(q, k, pos.to(DEV), interleave=interleave)
    assert_rope_close(qr, ref_rope(q, pos, 24, interleave, 5e5, 8.0, (1.0, 4.0, 8192)), q, 24)
    assert_rope_close(kr, ref_rope(k, pos, 24, interleave, 5e5, 8.0, (1.0, 4.0, 8192)), k, 24)


def _packed_qk(nnz, hq, hk, d, dtype, seed):
    """q and k as strided views of one packed qkv buffer (FlashInfer's example layout)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(nnz, (hq + 2 * hk) * d, generator=g).to(DEV, dtype)
    return qkv[:, :hq * d].view(nnz, hq, d), qkv[:, hq * d:(hq + hk) * d].view(nnz, hk, d)


@pytest.mark.parametrize("interleave", [False, True])
def test_inplace_variants(interleave):
    indptr, offsets = ragged()
    nnz = int(indptr[-1])
    pos = ref_positions(indptr.cpu(), offsets.cpu()).to(DEV)
    cases = [
        (rope.apply_rope, rope.apply_rope_inplace, (indptr, offsets), dict(rope_theta=100.0)),
        (rope.apply_rope_pos_ids, rope.apply_rope_pos_ids_inplace, (pos,), dict(rotary_dim=8)),
        (rope.apply_llama31_rope, rope.apply_llama31_rope_inplace, (indptr, offsets), dict(old_context_len=64)),
        (rope.apply_llama31_rope_pos_ids, rope.apply_llama31_rope_pos_ids_inplace, (pos,), dict(rotary_dim=4)),
    ]
    for n, (fn, fn_inplace, idx, kw) in enumerate(cases):
        q, k = _packed_qk(nnz, 4, 2, 16, torch.float16, seed=10 + n)
        assert not q.is_contiguous()
        want_q, want_k = fn(q, k, *idx, interleave=interleave, **kw)
        ptrs = (q.data_ptr(), k.data_ptr())
        assert fn_inplace(q, k, *idx, interleave=interleave, **kw) is None
        assert (q.data_ptr(), k.data_ptr()) == ptrs
        assert torch.equal(q, want_q) and torch.equal(k, want_k), fn_inplace.__name__


def _cache(max_pos, rotary_dim, theta=1e4):
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * ref_freqs(rotary_dim, theta, 1.0)[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_cos_sin_cache(dtype, is_neox, rotary_dim):
    nnz, hq, hk, hs = 9, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    query = torch.randn(nnz, hq * hs, generator=g).to(DEV, dtype)
    key = torch.randn(nnz, hk * hs, generator=g).to(DEV, dtype)
    cache = _cache(64, rotary_dim)
    positions = torch.randint(0, 64, (nnz,), generator=g)
    rot = torch.complex(cache[positions, :rotary_dim // 2].double(), cache[positions, rotary_dim // 2:].double())
    qo, ko = rope.apply_rope_with_cos_sin_cache(positions.to(DEV), query, key, hs, cache.to(DEV), is_neox)
    assert qo.shape == query.shape and ko.shape == key.shape
    for out, x, h in ((qo, query, hq), (ko, key, hk)):
        x3 = x.view(nnz, h, hs)
        assert_rope_close(out.view(nnz, h, hs), ref_rotate(x3, rot, rotary_dim, not is_neox), x3, rotary_dim)
    # the same rotation as the computed-frequency kernel
    qp, kp = rope.apply_rope_pos_ids(query.view(nnz, hq, hs), key.view(nnz, hk, hs), positions.to(DEV),
                                     rotary_dim, not is_neox)
    tol = TOL[dtype]
    torch.testing.assert_close(qo.view(nnz, hq, hs), qp, atol=2 * tol, rtol=2 * tol)
    torch.testing.assert_close(ko.view(nnz, hk, hs), kp, atol=2 * tol, rtol=2 * tol)
    # in place
    q2, k2 = query.clone(), key.clone()
    assert rope.apply_rope_with_cos_sin_cache_inplace(positions.to(DEV), q2, k2, hs, cache.to(DEV), is_neox) is None
    assert torch.equal(q2, qo) and torch.equal(k2, ko)


def test_empty_batch():
    for indptr, offsets in (ragged(lens=(), offs=()), ragged(lens=(0, 0), offs=(3, 4))):
        q, k = make_qk(0)
        qr, kr = rope.apply_rope(q, k, indptr, offsets)
        assert qr.shape == q.shape and kr.shape == k.shape
        assert rope.apply_rope_inplace(q, k, indptr, offsets) is None
        qr, kr = rope.apply_llama31_rope(q, k, indptr, offsets, 8)
        assert qr.shape == q.shape
    q, k = make_qk(0)
    pos = torch.zeros(0, dtype=torch.int64, device=DEV)
    assert rope.apply_rope_pos_ids(q, k, pos)[0].shape == q.shape
    assert rope.apply_llama31_rope_pos_ids_inplace(q, k, pos) is None
    query, key = q.reshape(0, 64), k.reshape(0, 32)
    qo, ko = rope.apply_rope_with_cos_sin_cache(pos, query, key, 16, _cache(4, 16).to(DEV))
    assert qo.shape == (0, 64) and ko.shape == (0, 32)


def test_one_request_many_tokens():
    # one request longer than a kernel block, and a batch of more requests than a block of tokens
    q, k = make_qk(150, hq=1, hk=1, d=8, dtype=torch.float32, seed=6)
    indptr = torch.tensor([0, 150], dtype=torch.int64, device=DEV)
    offsets = torch.tensor([5], dtype=torch.int64, device=DEV)
    qr, _ = rope.apply_rope(q, k, indptr, offsets)
    assert_rope_close(qr, ref_rope(q, torch.arange(5, 155), 8, False, 1e4, 1.0), q, 8)
    lens = [1 + (i % 3) for i in range(70)]
    indptr, offsets = ragged(lens=lens, offs=[7 * i for i in range(70)])
    q, k = make_qk(sum(lens), hq=1, hk=1, d=8, dtype=torch.float32, seed=7)
    _, kr = rope.apply_rope(q, k, indptr, offsets, interleave=True)
    assert_rope_close(kr, ref_rope(k, ref_positions(indptr.cpu(), offsets.cpu()), 8, True, 1e4, 1.0), k, 8)


# ----------------------------------------------------------------------------- API surface
_RAGGED = ["q", "k", "indptr", "offsets"]
_POS = ["q", "k", "pos_ids"]
_COMMON = [("rotary_dim", None), ("interleave", False)]
_PLAIN = _COMMON + [("rope_scale", 1), ("rope_theta", 1e4)]
_LLAMA = _COMMON + [("rope_scale", 8), ("rope_theta", 5e5), ("low_freq_factor", 1), ("high_freq_factor", 4),
                    ("old_context_len", 8192)]
_CACHE = ["positions", "query", "key", "head_size", "cos_sin_cache"]
SIGNATURES = {  # FlashInfer 0.2.14: positional order and defaults
    "apply_rope": (_RAGGED, _PLAIN), "apply_rope_inplace": (_RAGGED, _PLAIN),
    "apply_rope_pos_ids": (_POS, _PLAIN), "apply_rope_pos_ids_inplace": (_POS, _PLAIN),
    "apply_llama31_rope": (_RAGGED, _LLAMA), "apply_llama31_rope_inplace": (_RAGGED, _LLAMA),
    "apply_llama31_rope_pos_ids": (_POS, _LLAMA), "apply_llama31_rope_pos_ids_inplace": (_POS, _LLAMA),
    "apply_rope_with_cos_sin_cache": (_CACHE, [("is_neox", True)]),
    "apply_rope_with_cos_sin_cache_inplace": (_CACHE, [("is_neox", True)]),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_and_export(name):
    required, defaults = SIGNATURES[name]
    fn = getattr(rope, name)
    assert getattr(attncore, name) is fn and name in attncore.__all__
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params] == required + [n for n, _ in defaults]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    assert all(p.default is p.empty for p in params[:len(required)])
    assert [(p.name, p.default) for p in params[len(required):]] == defaults


def test_positional_call_matches_keywords():
    indptr, offsets = ragged()
    q, k = make_qk(int(indptr[-1]), dtype=torch.float32, seed=8)
    a = rope.apply_llama31_rope(q, k, indptr, offsets, 8, True, 4.0, 1e3, 2.0, 6.0, 128)
    b = rope.apply_llama31_rope(q, k, indptr, offsets, rotary_dim=8, interleave=True, rope_scale=4.0,
                                rope_theta=1e3, low_freq_factor=2.0, high_freq_factor=6.0, old_context_len=128)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------- bad input
def _bad_cases():
    indptr, offsets = ragged()
    nnz = int(indptr[-1])
    q, k = make_qk(nnz)
    pos = torch.arange(nnz, device=DEV)
    cache = _cache(16, 8).to(DEV)
    query, key = q.reshape(nnz, -1), k.reshape(nnz, -1)
    f = rope
    return [
        ("q list", lambda: f.apply_rope(q.tolist(), k, indptr, offsets), TypeError, r"q: got list"),
        ("q 2-D", lambda: f.apply_rope(q[0], k, indptr, offsets), ValueError,
         r"q: got shape \(4, 16\); accepted: a 3-D"),
        ("q float64", lambda: f.apply_rope_pos_ids(q.double(), k.double(), pos), TypeError,
         r"q: got dtype torch.float64; accepted: torch.float16, torch.bfloat16 or torch.float32"),
        ("k dtype", lambda: f.apply_rope_pos_ids(q, k.float(), pos), TypeError,
         r"k: got dtype torch.float32; accepted: q's dtype torch.float16"),
        ("k tokens", lambda: f.apply_rope_pos_ids(q, k[:3], pos), ValueError, r"k: got 3 tokens .*accepted: q's 9"),
        ("k head_dim", lambda: f.apply_rope_pos_ids(q, k[..., :8], pos), ValueError,
         r"k: got head_dim 8 .*q's head_dim 16"),
        ("rotary_dim odd", lambda: f.apply_rope(q, k, indptr, offsets, 7), ValueError,
         r"rotary_dim: got 7; accepted: an even int with 2 <= rotary_dim <= head_dim = 16"),
        ("rotary_dim big", lambda: f.apply_rope_pos_ids(q, k, pos, 18), ValueError, r"rotary_dim: got 18"),
        ("rotary_dim 0", lambda: f.apply_llama31_rope_pos_ids(q, k, pos, 0), ValueError, r"rotary_dim: got 0"),
        ("rotary_dim float", lambda: f.apply_rope_pos_ids(q, k, pos, 8.0), TypeError, r"rotary_dim: got float 8.0"),
        ("interleave str", lambda: f.apply_rope_pos_ids(q, k, pos, None, "yes"), TypeError, r"interleave: got str"),
        ("pos_ids length", lambda: f.apply_rope_pos_ids(q, k, pos[:-1]), ValueError,
         r"pos_ids: got 8 positions .*accepted: one per token, nnz = 9"),
        ("pos_ids float", lambda: f.apply_llama31_rope_pos_ids(q, k, pos.float()), TypeError,
         r"pos_ids: got dtype torch.float32; accepted: torch.int32 or torch.int64"),
        ("pos_ids 2-D", lambda: f.apply_rope_pos_ids(q, k, pos[None]), ValueError, r"pos_ids: got shape \(1, 9\)"),
        ("indptr float", lambda: f.apply_rope(q, k, indptr.float(), offsets), TypeError,
         r"indptr: got dtype torch.float32; accepted: torch.int32 or torch.int64"),
        ("indptr start", lambda: f.apply_rope(q, k, indptr + 1, offsets), ValueError, r"indptr\[0\] == 0"),
        ("indptr decreasing", lambda: f.apply_rope(q, k, torch.tensor([0, 5, 3, 9], device=DEV), offsets[:3]),
         ValueError, r"indptr: got a decreasing step"),
        ("indptr short", lambda: f.apply_rope(q, k, indptr[:-1], offsets[:-1]), ValueError,
         r"indptr: got indptr\[-1\] = 8; accepted: indptr\[-1\] == nnz = 9"),
        ("indptr long", lambda: f.apply_llama31_rope(q[:5], k[:5], indptr, offsets), ValueError,
         r"indptr: got indptr\[-1\] = 9; accepted: at most nnz = 5"),
        ("offsets length", lambda: f.apply_rope(q, k, indptr, offsets[:2]), ValueError,
         r"offsets: got shape \(2,\); accepted: \[batch_size\] = \[4\]"),
        ("offsets dtype", lambda: f.apply_rope_inplace(q, k, indptr, offsets.float()), TypeError,
         r"offsets: got dtype torch.float32"),
        ("rope_theta", lambda: f.apply_rope(q, k, indptr, offsets, rope_theta=0), ValueError,
         r"rope_theta: got 0, expected .*a finite number > 0"),
        ("rope_scale", lambda: f.apply_rope_pos_ids(q, k, pos, rope_scale=float("nan")), ValueError,
         r"rope_scale: got nan"),
        ("llama factors", lambda: f.apply_llama31_rope(q, k, indptr, offsets, low_freq_factor=4, high_freq_factor=4),
         ValueError, r"high_freq_factor: got 4 with low_freq_factor = 4; accepted: high_freq_factor > low_freq_factor"),
        ("old_context_len", lambda: f.apply_llama31_rope_pos_ids(q, k, pos, old_context_len=-1), ValueError,
         r"old_context_len: got -1"),
        ("cache dtype", lambda: f.apply_rope_with_cos_sin_cache(pos, query, key, 16, cache.half()), ValueError,
         r"cos_sin_cache: got dtype torch.float16; accepted: torch.float32"),
        ("cache 1-D", lambda: f.apply_rope_with_cos_sin_cache(pos, query, key, 16, cache[0]), ValueError,
         r"cos_sin_cache: got shape \(8,\)"),
        ("cache odd", lambda: f.apply_rope_with_cos_sin_cache(pos, query, key, 16, cache[:, :7]), ValueError,
         r"cos_sin_cache.shape\[1\] \(rotary_dim\): got 7"),
        ("cache wide", lambda: f.apply_rope_with_cos_sin_cache(pos, query, key, 4, _cache(16, 8).to(DEV)), ValueError,
         r"cos_sin_cache.shape\[1\] \(rotary_dim\): got 8; accepted: .*head_dim = 4"),
        ("positions range", lambda: f.apply_rope_with_cos_sin_cache_inplace(pos + 10, query, key, 16, cache),
         ValueError, r"positions: got values in \[10, 18\]; accepted: 0 <= positions < cos_sin_cache.shape\[0\] = 16"),
        ("head_size", lambda: f.apply_rope_with_cos_sin_cache(pos, query, key, 24, cache), ValueError,
         r"query: got shape \(9, 64\); accepted: .*head_size = 24"),
        ("query 3-D", lambda: f.apply_rope_with_cos_sin_cache(pos, q, key, 16, cache), ValueError, r"query: got shape"),
        ("key dtype", lambda: f.apply_rope_with_cos_sin_cache(pos, query, key.float(), 16, cache), TypeError,
         r"key: got dtype torch.float32; accepted: query's dtype torch.float16"),
    ]


_BAD = _bad_cases()


@pytest.mark.parametrize("case", _BAD, ids=[c[0] for c in _BAD])
def test_bad_input(case):
    _, call, exc, msg = case
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.skipif(not INTERP, reason="the CPU interpreter's bf16 refusal")
def test_bf16_refused_on_cpu():
    q, k = make_qk(3, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"q: got dtype torch.bfloat16 on the CPU"):
        rope.apply_rope_pos_ids(q.bfloat16(), k.bfloat16(), torch.arange(3))


# ----------------------------------------------------------------------------- FlashInfer itself (GPU)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_matches_flashinfer(dtype):
    flashinfer = pytest.importorskip("flashinfer")
    indptr, offsets = ragged(lens=(40, 0, 77, 3), offs=(0, 5, 1000, 9))
    nnz = int(indptr[-1])
    q, k = make_qk(nnz, hq=8, hk=2, d=128, dtype=dtype, seed=9)
    pos = ref_positions(indptr.cpu(), offsets.cpu()).to(DEV, torch.int32)
    tol = 2 * TOL[dtype]
    for interleave in (False, True):
        for name, idx in (("apply_rope", (indptr, offsets)), ("apply_rope_pos_ids", (pos,)),
                          ("apply_llama31_rope", (indptr, offsets)), ("apply_llama31_rope_pos_ids", (pos,))):
            for rd in (None, 64):
                ours = getattr(rope, name)(q, k, *idx, rd, interleave)
                theirs = getattr(flashinfer, name)(q, k, *idx, rd, interleave)
                for a, b in zip(ours, theirs):
                    torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"{name} {interleave} {rd}")
        cache = _cache(2048, 64).to(DEV)
        query, key = q.reshape(nnz, -1), k.reshape(nnz, -1)
        ours = rope.apply_rope_with_cos_sin_cache(pos, query, key, 128, cache, not interleave)
        theirs = flashinfer.apply_rope_with_cos_sin_cache(pos, query, key, 128, cache, not interleave)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
