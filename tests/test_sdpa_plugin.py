"""The example third-party plugin ``plugins/attncore-sdpa`` against the core.

Works whether or not the plugin is pip-installed: its source directory is put on ``sys.path`` and
the backend registered directly; the entry-point test runs only where it is installed.
"""

import os
import subprocess
import sys
from importlib import metadata

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_SRC = os.path.join(ROOT, "plugins", "attncore-sdpa")
if PLUGIN_SRC not in sys.path:
    sys.path.insert(0, PLUGIN_SRC)

import attncore  # noqa: E402
from attncore.core.problem import AttentionProblem  # noqa: E402
from attncore_sdpa import SdpaBackend  # noqa: E402


def _rank(backend, problem) -> int:
    """auto's rank of a shipped backend: the rule table (attncore.core.ranking)."""
    from attncore.core.ranking import rule_rank

    return rule_rank(backend, problem).rank


@pytest.fixture(scope="module")
def sdpa():
    from attncore.core import registry

    registry.register_backend(SdpaBackend(), origin="test")
    yield registry.get_backend("sdpa")
    registry.unregister_backend("sdpa")


def _p(**kw):
    base = dict(op="single_prefill", device_type="cpu", q_dtype=torch.float16, kv_dtype=torch.float16,
                out_dtype=torch.float16, num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, head_dim_vo=128)
    base.update(kw)
    return AttentionProblem(**base)


@pytest.mark.parametrize("change, axis", [
    (dict(op="batch_prefill_paged", page_size=16), "op"),
    (dict(op="batch_decode", page_size=16), "op"),
    (dict(mask="custom"), "mask"),
    (dict(window_left=4), "feature:window"),
    (dict(soft_cap=True), "feature:soft_cap"),
    (dict(pos_encoding="ALIBI"), "feature:alibi"),
    (dict(pos_encoding="ROPE_LLAMA"), "feature:rope"),
    (dict(sinks=True), "feature:sinks"),
    (dict(kv_dtype=torch.float8_e4m3fn), "kv_dtype"),
    (dict(fp8_scales=True), "feature:fp8_scales"),
    (dict(kv_dtype=torch.float32), "kv_dtype"),
])
def test_refuses_what_sdpa_cannot_do(change, axis):
    rs = SdpaBackend().reasons(_p(**change))
    assert rs and any(r.axis == axis for r in rs), rs


def test_claims_dense_prefill():
    b = SdpaBackend()
    for kw in (dict(), dict(mask="causal"), dict(op="batch_prefill_ragged", return_lse=True),
               dict(kv_layout="HND", q_dtype=torch.float32, kv_dtype=torch.float32, out_dtype=torch.float32)):
        assert b.reasons(_p(**kw)) == [], kw
    assert b.reasons(_p(device_type="cuda", compute_capability=(9, 0), head_dim_qk=100, head_dim_vo=100))


def test_priority():
    b = SdpaBackend()
    assert _rank(b, _p()) == -1  # below the reference (0) on CPU
    assert _rank(b, _p(device_type="cuda", compute_capability=(9, 0))) == 55
    assert _rank(b, _p(device_type="cuda", compute_capability=(7, 5))) < 55
    assert _rank(b, _p(device_type="cuda", compute_capability=(9, 0), return_lse=True)) < 55


def test_priority_ranks_as_the_plugin_readme_says():
    """plugins/attncore-sdpa/README.md: first for dense prefill without LSE on sm80+ GPUs; with the
    LSE, above the reference and below the built-in CUDA backends."""
    from attncore.backends.cuda_fa2.backend import CudaFa2Backend
    from attncore.backends.triton.backend import TritonBackend
    from attncore.reference.backend import ReferenceBackend

    b, builtins = SdpaBackend(), (CudaFa2Backend(), TritonBackend())
    for op in ("single_prefill", "batch_prefill_ragged"):
        for cc in ((8, 0), (9, 0)):
            p = _p(op=op, device_type="cuda", compute_capability=cc, mask="causal", q_dtype=torch.bfloat16,
                   kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
            assert all(_rank(b, p) > _rank(o, p) for o in builtins), p.describe()
            lse = p.replace(return_lse=True)
            assert all(_rank(ReferenceBackend(), lse) < _rank(b, lse) < _rank(o, lse) for o in builtins)


@pytest.mark.parametrize("qo, kv", [(5, 5), (3, 11), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_public_api_matches_reference(sdpa, qo, kv, causal):
    g = torch.Generator().manual_seed(qo * 100 + kv)
    q = torch.randn(qo, 8, 64, generator=g).half()
    k = torch.randn(kv, 2, 64, generator=g).half()
    v = torch.randn(kv, 2, 64, generator=g).half()
    o, lse = attncore.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True, backend="sdpa")
    ro, rlse = attncore.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True, backend="reference")
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o, ro, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, rlse, atol=1e-3, rtol=1e-4)


def test_batch_ragged_qo_longer_than_kv(sdpa):
    """Batch prefill allows qo_len > kv_len: rows that see no key give 0 and LSE -inf."""
    qo_indptr = torch.tensor([0, 4, 6], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 2, 2], dtype=torch.int32)  # request 1 has no keys
    q = torch.randn(6, 4, 64).half()
    k = torch.randn(2, 2, 64).half()
    v = torch.randn(2, 2, 64).half()
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="sdpa")
    w.plan(qo_indptr, kv_indptr, 4, 2, 64, causal=True, q_data_type=torch.float16)
    assert w.backend == "sdpa"
    o, lse = w.run(q, k, v, return_lse=True)
    assert torch.equal(o[:2], torch.zeros_like(o[:2])) and torch.isneginf(lse[:2]).all()
    assert torch.equal(o[4:], torch.zeros_like(o[4:])) and torch.isneginf(lse[4:]).all()
    assert torch.isfinite(lse[2:4]).all()


@pytest.mark.parametrize("qo, kv, causal", [(6, 6, False), (6, 6, True), (3, 7, True), (4, 9, False), (16, 16, True)])
def test_nan_query_row_gives_nan_and_touches_no_other_row(sdpa, qo, kv, causal):
    """docs/semantics.md, "Non-finite inputs", rule 3.  torch's CPU flash kernel returns 0 (LSE 0) for a
    NaN query row at some lengths (kv < 8); the backend puts the NaN back."""
    g = torch.Generator().manual_seed(qo * 10 + kv)
    q = torch.randn(qo, 4, 64, generator=g)
    k = torch.randn(kv, 2, 64, generator=g)
    v = torch.randn(kv, 2, 64, generator=g)
    clean, clean_lse = attncore.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True, backend="sdpa")
    q[0] = float("nan")
    q[qo - 1, 1, 3] = float("nan")  # one head of the last row
    bad = torch.zeros(qo, 4, dtype=torch.bool)
    bad[0], bad[qo - 1, 1] = True, True
    for return_lse in (False, True):
        res = attncore.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=return_lse, backend="sdpa")
        out = res[0] if return_lse else res
        assert torch.isnan(out[bad]).all() and torch.equal(out[~bad], clean[~bad])
        if return_lse:
            assert torch.isnan(res[1][bad]).all() and torch.equal(res[1][~bad], clean_lse[~bad])


def test_nan_query_row_that_sees_no_key_gives_zero_and_minus_inf(sdpa):
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="sdpa")
    w.plan(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 4, 2, 64, causal=True,
           q_data_type=torch.float32)
    q = torch.randn(4, 4, 64)
    q[0] = float("nan")  # qo 4 > kv 2: rows 0 and 1 see no key
    q[3] = float("nan")
    o, lse = w.run(q, torch.randn(2, 2, 64), torch.randn(2, 2, 64), return_lse=True)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    assert torch.isnan(o[3]).all() and torch.isnan(lse[3]).all()
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[2]).all() and not torch.isnan(o[:3]).any()


@pytest.mark.parametrize("op, qo, kv, causal, relaunches", [
    ("single_decode", 1, 9, False, True),
    ("single_prefill", 6, 6, True, True),  # square causal: SDPA's is_causal
    ("single_prefill", 4, 9, False, True),
    ("single_prefill", 3, 9, True, False),  # bottom-right: a planned bias, so run() each time
])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("lse", [False, True])
def test_one_call_hits_relaunch_where_one_sdpa_call_serves(sdpa, monkeypatch, op, qo, kv, causal, relaunches, layout,
                                                          lse):
    """From a signature's second hit on, a one-call that is one SDPA call over the whole q and K/V runs through
    SdpaBackend.relaunch (run()'s piece without its loops and slices), right against the golden on fresh inputs,
    a NaN query row included; the others keep calling run()."""
    from attncore.testing.golden import golden_and_baseline, max_error, tolerance

    calls = []
    real = SdpaBackend.relaunch

    def counted(self, plan, args):
        go = real(self, plan, args)
        return None if go is None else (lambda *a: (calls.append(1), go(*a)))
    monkeypatch.setattr(SdpaBackend, "relaunch", counted)
    g = torch.Generator().manual_seed(qo * 31 + kv)
    fn = getattr(attncore, f"{op}_with_kv_cache")
    kw = dict(backend="sdpa", return_lse=lse, kv_layout=layout, **({} if op == "single_decode" else {"causal": causal}))
    for i in range(4):
        q = torch.randn(qo, 8, 64, generator=g).half()
        if i == 3:
            q[0, 2] = float("nan")
        k, v = torch.randn(kv, 2, 64, generator=g).half(), torch.randn(kv, 2, 64, generator=g).half()
        kk, vv = (t.transpose(0, 1).contiguous() for t in (k, v)) if layout == "HND" else (k, v)
        res = fn(q[0] if op == "single_decode" else q, kk, vv, **kw)
        out, got_lse = (res if lse else (res, None))
        out = out.reshape(qo, 8, 64).double()
        go, glse, bo, blse = golden_and_baseline(q, k, v, dtype=q.dtype, causal=causal or op == "single_decode")
        ok = torch.ones(qo, 8, dtype=torch.bool)
        if i == 3:
            ok[0, 2] = False
            assert torch.isnan(out[0, 2]).all()
        assert max_error(out[ok], go[ok]) <= tolerance(bo[ok], go[ok], q.dtype)
        if lse:
            got_lse = got_lse.reshape(qo, 8).double()
            assert max_error(got_lse[ok], glse[ok]) <= tolerance(blse[ok], glse[ok], torch.float32)
    # the first call plans and runs, the second runs and asks for the relaunch, the last two relaunch
    assert len(calls) == (2 if relaunches else 0)


def test_forced_sdpa_refuses_with_reasons(sdpa):
    q = torch.randn(3, 4, 64).half()
    k = torch.randn(5, 2, 64).half()
    with pytest.raises(ValueError, match="sdpa"):
        attncore.single_prefill_with_kv_cache(q, k, k, window_left=2, backend="sdpa")


def test_conformance_suite_passes():
    env = dict(os.environ, PYTHONPATH=PLUGIN_SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import sys; from attncore.testing import run_conformance; "
            "sys.exit(run_conformance('attncore_sdpa:SdpaBackend', ['-q', '--attncore-device', 'cpu']))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_entry_point_declared():
    text = open(os.path.join(PLUGIN_SRC, "pyproject.toml")).read()
    assert '[project.entry-points."attncore.backends"]' in text
    assert 'sdpa = "attncore_sdpa.plugin"' in text
    from attncore_sdpa import plugin

    (b,) = plugin.attncore_backends()
    assert isinstance(b, SdpaBackend) and b.name == "sdpa"
    installed = [ep for ep in metadata.entry_points(group="attncore.backends") if ep.name == "sdpa"]
    if installed:  # pip-installed: the registry finds it on its own
        from attncore.core import registry

        assert installed[0].value == "attncore_sdpa.plugin"
        assert "sdpa" in registry.entries()
