"""attncore.cascade: merging partial attention states (base-2 LSE) against dense fp64 attention."""

import math

import pytest
import torch

from attncore.cascade import merge_state, merge_state_in_place, merge_states

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NINF = float("-inf")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def dense_attention(q, k, v, mask=None):
    """fp64 attention of q [m, H, D] over k, v [n, H, D]; mask [m, n] bool (True = keep).

    Returns (out [m, H, D], lse [m, H] base 2); rows that see no key give out 0 and lse -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    logits = torch.einsum("mhd,nhd->hmn", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = logits.masked_fill(~mask[None], NINF)
    lse = torch.logsumexp(logits, dim=-1)  # [H, m], -inf for an empty row
    p = torch.exp(logits - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    out = torch.einsum("hmn,nhd->mhd", p, v)
    return out, (lse / math.log(2)).transpose(0, 1)


def problem(seed, m=5, n=23, heads=3, dim=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(m, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(n, heads, dim, generator=g, dtype=torch.float64) * 2
    v = torch.randn(n, heads, dim, generator=g, dtype=torch.float64)
    return q, k, v


def state(q, k, v, dtype, device, mask=None):
    out, lse = dense_attention(q, k, v, mask)
    return out.to(dtype).to(device), lse.float().to(device)


def check_close(v, s, v_ref, s_ref, dtype):
    assert not torch.isnan(v).any() and not torch.isnan(s).any()
    torch.testing.assert_close(v.double().cpu(), v_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(s.double().cpu(), s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split", [0, 1, 11, 22, 23])
def test_merge_state_two_halves_equals_full(split, dtype, device):
    q, k, v = problem(split)
    v_a, s_a = state(q, k[:split], v[:split], dtype, device)
    v_b, s_b = state(q, k[split:], v[split:], dtype, device)
    v_m, s_m = merge_state(v_a, s_a, v_b, s_b)
    assert v_m.dtype == dtype and s_m.dtype == torch.float32 and v_m.device.type == device
    assert v_m.shape == v_a.shape and s_m.shape == s_a.shape
    v_ref, s_ref = dense_attention(q, k, v)
    # the fp64 reference is rounded like the inputs/outputs before comparing
    check_close(v_m, s_m, v_ref, s_ref, dtype)
    if split == 0:  # merging with an empty state returns the other one unchanged
        assert torch.isneginf(s_a).all()
        assert torch.equal(v_m, v_b) and torch.equal(s_m, s_b)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_with_masked_rows(device):
    """Causal (bottom-right) mask: early rows 0-1 see no key of the second half -> -inf states."""
    q, k, v = problem(3, m=6, n=8)
    mask = torch.ones(6, 8, dtype=torch.bool).tril(diagonal=8 - 6)
    mask[0] = False  # a row that sees nothing at all
    split = 4
    v_a, s_a = state(q, k[:split], v[:split], torch.float32, device, mask[:, :split])
    v_b, s_b = state(q, k[split:], v[split:], torch.float32, device, mask[:, split:])
    assert torch.isneginf(s_b[:2]).all() and torch.isneginf(s_a[0]).all()
    v_m, s_m = merge_state(v_a, s_a, v_b, s_b)
    v_ref, s_ref = dense_attention(q, k, v, mask)
    check_close(v_m, s_m, v_ref, s_ref, torch.float32)
    assert torch.equal(v_m[1], v_a[1]) and torch.equal(s_m[1], s_a[1])
    assert not torch.isneginf(s_b[2:]).any()
    assert (v_m[0] == 0).all() and torch.isneginf(s_m[0]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_state_inf_cases(dtype, device):
    seq, heads, dim = 4, 2, 8
    g = torch.Generator().manual_seed(0)
    v_a = torch.randn(seq, heads, dim, generator=g).to(dtype).to(device)
    s_a = torch.randn(seq, heads, generator=g).to(device) * 10
    garbage = torch.full((seq, heads, dim), float("nan"), dtype=dtype, device=device)
    empty = torch.full((seq, heads), NINF, device=device)
    # empty on either side: the other state comes back bit-exact, even if the empty state's v is NaN
    for args, expected in (((v_a, s_a, garbage, empty), (v_a, s_a)), ((garbage, empty, v_a, s_a), (v_a, s_a))):
        v_m, s_m = merge_state(*args)
        assert torch.equal(v_m, expected[0]) and torch.equal(s_m, expected[1])
    # both empty: v 0, s -inf, no NaN
    v_m, s_m = merge_state(garbage, empty, garbage, empty)
    assert (v_m == 0).all() and torch.isneginf(s_m).all()
    # mixed per element
    s_b = torch.where(torch.rand(seq, heads, generator=g).to(device) < 0.5, empty, s_a - 1)
    v_m, s_m = merge_state(v_a, empty, v_a, s_b)
    assert not torch.isnan(v_m).any() and not torch.isnan(s_m).any()
    fin = ~torch.isneginf(s_b)
    assert torch.equal(s_m[fin], s_b[fin]) and torch.isneginf(s_m[~fin]).all()
    assert (v_m[~fin] == 0).all() and torch.equal(v_m[fin], v_a[fin])
    # very different magnitudes stay finite (no overflow of 2**s)
    big = torch.full((seq, heads), 1e4, device=device)
    v_m, s_m = merge_state(v_a, big, garbage.nan_to_num(0), -big)
    assert torch.equal(s_m, big) and torch.allclose(v_m.float(), v_a.float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 7])
def test_merge_states_over_chunks(num_chunks, dtype, device):
    q, k, v = problem(num_chunks, n=29)
    g = torch.Generator().manual_seed(num_chunks)
    cuts = sorted(torch.randint(0, 30, (num_chunks - 1,), generator=g).tolist())
    bounds = [0] + cuts + [29]  # may contain empty chunks
    vs, ss = zip(*(state(q, k[a:b], v[a:b], dtype, device) for a, b in zip(bounds[:-1], bounds[1:])))
    v_all, s_all = torch.stack(vs, dim=1), torch.stack(ss, dim=1)  # [seq, chunks, H, D], [seq, chunks, H]
    v_m, s_m = merge_states(v_all, s_all)
    assert v_m.dtype == dtype and s_m.dtype == torch.float32 and v_m.shape == vs[0].shape
    v_ref, s_ref = dense_attention(q, k, v)
    check_close(v_m, s_m, v_ref, s_ref, dtype)
    # same as folding merge_state over the chunks (in float32)
    v_f, s_f = vs[0].float(), ss[0]
    for vc, sc in zip(vs[1:], ss[1:]):
        v_f, s_f = merge_state(v_f, s_f, vc.float(), sc)
    torch.testing.assert_close(v_m.float(), v_f.to(dtype).float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(s_m, s_f, atol=1e-5, rtol=1e-5)


def test_merge_states_empty_and_all_inf():
    v, s = merge_states(torch.randn(3, 0, 2, 4), torch.randn(3, 0, 2))
    assert v.shape == (3, 2, 4) and (v == 0).all() and torch.isneginf(s).all()
    v, s = merge_states(torch.full((3, 4, 2, 4), float("nan")), torch.full((3, 4, 2), NINF))
    assert (v == 0).all() and torch.isneginf(s).all()


@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_in_place(device):
    q, k, v = problem(11)
    v_a, s_a = state(q, k[:9], v[:9], torch.float16, device)
    v_b, s_b = state(q, k[9:], v[9:], torch.float16, device)
    v_exp, s_exp = merge_state(v_a, s_a, v_b, s_b)
    v_ip, s_ip = v_a.clone(), s_a.clone()
    merge_state_in_place(v_ip, s_ip, v_b, s_b)
    assert torch.equal(v_ip, v_exp) and torch.equal(s_ip, s_exp)
    for mask in (torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool), torch.tensor([0, 1, 1, 0, 0], dtype=torch.uint8)):
        mask = mask.to(device)
        v_ip, s_ip = v_a.clone(), s_a.clone()
        merge_state_in_place(v_ip, s_ip, v_b, s_b, mask=mask)
        keep = mask.bool()
        assert torch.equal(v_ip[keep], v_exp[keep]) and torch.equal(s_ip[keep], s_exp[keep])
        assert torch.equal(v_ip[~keep], v_a[~keep]) and torch.equal(s_ip[~keep], s_a[~keep])


def test_bad_input():
    v, s = torch.randn(4, 2, 8), torch.randn(4, 2)
    with pytest.raises(TypeError, match=r"s_b: got dtype torch.float16; accepted: torch.float32"):
        merge_state(v, s, v, s.half())
    with pytest.raises(ValueError, match=r"v_b: got shape \(4, 2, 4\); accepted: \[4, 2, 8\] \(v_a.shape\)"):
        merge_state(v, s, v[..., :4], s)
    with pytest.raises(TypeError, match=r"v_b: got dtype torch.float16; accepted: torch.float32 \(v_a.dtype\)"):
        merge_state(v, s, v.half(), s)
    with pytest.raises(ValueError, match=r"s_a: got shape \(4, 3\); accepted: \[4, 2\]"):
        merge_state(v, torch.randn(4, 3), v, s)
    with pytest.raises(ValueError, match=r"v_a: got shape \(4, 16\); accepted: a 3-D tensor"):
        merge_state(v.view(4, 16), s, v, s)
    with pytest.raises(TypeError, match=r"v_a: got dtype torch.int32"):
        merge_state(v.int(), s, v, s)
    with pytest.raises(TypeError, match=r"v_a: got ndarray"):
        merge_state(v.numpy(), s, v, s)
    with pytest.raises(ValueError, match=r"v: got shape \(4, 2, 8\); accepted: a 4-D tensor"):
        merge_states(v, s)
    with pytest.raises(ValueError, match=r"s: got shape \(4, 2\); accepted: \[4, 1, 2\]"):
        merge_states(v[:, None], s)
    with pytest.raises(ValueError, match=r"mask: got shape \(3,\); accepted: \[4\]"):
        merge_state_in_place(v.clone(), s.clone(), v, s, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask: got dtype torch.float32"):
        merge_state_in_place(v.clone(), s.clone(), v, s, mask=torch.ones(4))


# ------------------------------------------------------------------------------------------------------
# The fused merge kernel (attncore.kernels.merge_states): merge_state(s) run it on CUDA tensors, and on CPU ones
# through Triton's interpreter (tests/conftest.py switches it on without a GPU); plain torch otherwise.
# ------------------------------------------------------------------------------------------------------
from attncore.cascade import merge as cascade  # noqa: E402

FUSED_DEVICES = [d for d in DEVICES if cascade.fused_merge_available(d)]
NAN = float("nan")
# kernel against torch: one rounding step of the output dtype (float32: 8 ulp, GPUs' exp2/log2 are approximate)
EPS = {torch.float32: 2 ** -20, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def test_fused_kernel_serves_cpu_under_the_interpreter():
    """Without a GPU the tests run Triton's interpreter, so the kernel itself is what they check."""
    if torch.cuda.is_available():
        assert cascade.fused_merge_available("cuda")
    else:
        assert cascade.fused_merge_available("cpu")
    assert not cascade.fused_merge_available("meta")


def torch_merge(v, s):
    """The torch path (attncore.cascade._merge), the fused kernel's specification."""
    out, lse = cascade._merge(v.float(), s, dim=1)
    return out.to(v.dtype), lse


def special_states(rows, n, heads, dim, dtype, device, seed=0):
    """Random states [rows, n, H, D] / [rows, n, H] with the edge cases in the first rows."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, n, heads, dim, generator=g)
    s = torch.randn(rows, n, heads, generator=g) * 8
    s[0] = NINF  # every state empty (their v NaN): v 0, s -inf
    v[0] = NAN
    if rows > 7:
        s[1, 1:] = NINF  # one non-empty state: returned as it is
        v[1, 1:] = NAN
        if n > 1:
            s[2, 0, 0] = NINF  # an empty state with NaN v among non-empty ones
            v[2, 0, 0] = NAN
            s[6, :2, 1] = torch.tensor([200.0, -200.0])  # weight 2**-400 underflows: that v is not read
            v[6, 1, 1] = NAN
        s[3, n - 1, 1] = NAN  # a NaN LSE: v and s NaN for that row and head
        s[4, 0, 0] = float("inf")  # +inf: NaN too
        v[5, n - 1, 2 % heads, 3 % dim] = NAN  # NaN in a non-empty v: that element NaN
        s[7] = torch.linspace(-1e4, 1e4, n)[:, None]  # far apart magnitudes stay finite
    return v.to(dtype).to(device), s.to(device)


def check_same(got, want, dtype):
    (v, s), (v_ref, s_ref) = got, want
    assert v.dtype == v_ref.dtype and s.dtype == torch.float32 and v.shape == v_ref.shape
    assert torch.equal(torch.isnan(v), torch.isnan(v_ref)) and torch.equal(torch.isnan(s), torch.isnan(s_ref))
    assert torch.equal(torch.isneginf(s), torch.isneginf(s_ref))
    torch.testing.assert_close(v.float(), v_ref.float(), atol=1e-6, rtol=EPS[dtype], equal_nan=True)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,heads,dim", [(1, 3, 16), (2, 3, 40), (3, 4, 128), (5, 2, 8)])
def test_fused_merge_states_matches_torch(n, heads, dim, dtype, device):
    v, s = special_states(37, n, heads, dim, dtype, device, seed=n)
    got = cascade.merge_states(v, s)
    want = torch_merge(v, s)
    check_same(got, want, dtype)
    v_out, s_out = got
    assert (v_out[0] == 0).all() and torch.isneginf(s_out[0]).all()
    assert torch.equal(v_out[1], v[1, 0]) and torch.equal(s_out[1], s[1, 0])  # one non-empty state: exact
    assert torch.isnan(v_out[3, 1]).all() and torch.isnan(s_out[3, 1]) and torch.isnan(v_out[4, 0]).all()
    assert torch.isnan(v_out[5, 2 % heads, 3 % dim]) and torch.isfinite(s_out[5]).all()
    assert not torch.isnan(v_out[5, 2 % heads]).all()
    nan_rows = {3, 4, 5}
    ok = torch.tensor([r not in nan_rows for r in range(37)], device=device)
    assert not torch.isnan(v_out[ok]).any() and not torch.isnan(s_out[ok]).any()


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_fused_merge_strided_and_many_programs(device):
    """Any strides (a stack laid out state-major, a strided head dim) and more lanes than one program."""
    v, s = special_states(300, 3, 3, 80, torch.float16, device, seed=5)
    v_sm = v.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)  # [rows, n, H, D] over [n, rows, H, D]
    s_sm = s.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    check_same(cascade.merge_states(v_sm, s_sm), torch_merge(v, s), torch.float16)
    v_d = v[..., ::2]  # head dim stride 2
    check_same(cascade.merge_states(v_d, s), torch_merge(v_d, s), torch.float16)
    v256, s256 = special_states(20, 2, 5, 256, torch.float32, device, seed=6)
    check_same(cascade.merge_states(v256, s256), torch_merge(v256, s256), torch.float32)


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_merge_state_and_in_place_match_torch(dtype, device, monkeypatch):
    v, s = special_states(29, 2, 4, 24, dtype, device, seed=7)
    v_a, s_a, v_b, s_b = v[:, 0], s[:, 0], v[:, 1].contiguous(), s[:, 1].contiguous()
    mask = (torch.arange(29, device=device) % 3 != 1)
    fused = merge_state(v_a, s_a, v_b, s_b)
    ip_fused = v_a.clone(), s_a.clone()
    merge_state_in_place(*ip_fused, v_b, s_b, mask=mask)
    monkeypatch.setattr(cascade, "fused_merge_available", lambda device: False)
    ref = merge_state(v_a, s_a, v_b, s_b)
    ip_ref = v_a.clone(), s_a.clone()
    merge_state_in_place(*ip_ref, v_b, s_b, mask=mask)
    check_same(fused, ref, dtype)
    check_same(ip_fused, ip_ref, dtype)
    keep = ~mask  # rows left alone stay bit for bit (their NaNs included)
    assert torch.equal(ip_fused[0][keep].nan_to_num(7.0), v_a[keep].nan_to_num(7.0))
    assert torch.equal(ip_fused[1][keep].nan_to_num(7.0), s_a[keep].nan_to_num(7.0))


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_merge_of_key_chunks_equals_golden(dtype, device):
    """Five chunks of the keys (two empty, one hidden from the early rows by a causal mask) merged in one
    launch equal attention over all keys (attncore.testing.golden)."""
    from attncore.testing.golden import golden_attention

    q, k, v = problem(21, m=6, n=30)
    mask = torch.ones(6, 30, dtype=torch.bool).tril(diagonal=30 - 6)
    bounds = [0, 0, 11, 11, 26, 30]
    states = [state(q, k[a:b], v[a:b], dtype, device, mask[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    v_all = torch.stack([x[0] for x in states], dim=1)
    s_all = torch.stack([x[1] for x in states], dim=1)
    assert torch.isneginf(s_all[0, -1]).all()  # row 0 sees no key of the last chunk
    v_m, s_m = merge_states(v_all, s_all)
    g_out, g_lse = golden_attention(q, k, v, mask=mask)
    check_close(v_m, s_m, g_out, g_lse, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_fallback_keeps_the_same_results(dtype, monkeypatch):
    v, s = special_states(17, 3, 2, 16, dtype, "cpu", seed=9)
    fused = merge_states(v, s)
    monkeypatch.setattr(cascade, "fused_merge_available", lambda device: False)
    check_same(fused, merge_states(v, s), dtype)


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_fused_merge_state_in_place_other_state_overlaps(device, monkeypatch):
    """The other state a view of the same storage (shifted rows): read before any row is written."""
    v, s = special_states(12, 1, 2, 8, torch.float32, device, seed=3)
    v, s = v[:, 0].contiguous(), s[:, 0].contiguous()
    v[:2], s[:2] = 1.0, 0.5  # no NaN, no empty rows here
    s = s.nan_to_num(0.0, posinf=0.0)
    v = v.nan_to_num(0.0)
    v1, s1 = v.clone(), s.clone()
    merge_state_in_place(v1[1:], s1[1:], v1[:-1], s1[:-1])
    monkeypatch.setattr(cascade, "fused_merge_available", lambda device: False)
    v2, s2 = v.clone(), s.clone()
    merge_state_in_place(v2[1:], s2[1:], v2[:-1], s2[:-1])
    check_same((v1, s1), (v2, s2), torch.float32)
