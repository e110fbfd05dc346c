"""Host time (issue 15 item 1): the one-call functions reuse the plan of a seen signature (hits), and any
change a check reads misses; a wrapper's run() skips the checks of a seen signature until the next plan()."""

import pytest
import torch

import attncore
from attncore.core import plan_cache
from attncore.testing.golden import golden_and_baseline, max_error, tolerance

H, HKV, D = 4, 2, 16


def _close(out, q, k, v, **kw):
    go, _, bo, _ = golden_and_baseline(q, k, v, dtype=q.dtype, **kw)
    assert max_error(out.double(), go) <= tolerance(bo, go, q.dtype)


def _misses():
    return plan_cache.ONE_CALL_PLANS.misses


def test_repeated_signature_hits_and_stays_correct():
    q, k, v = torch.randn(5, H, D).half(), torch.randn(9, HKV, D).half(), torch.randn(9, HKV, D).half()
    attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference")
    m, h = _misses(), plan_cache.ONE_CALL_PLANS.hits
    for _ in range(3):  # new values, same signature: the cached plan serves them
        q, k, v = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
        _close(attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="reference"), q, k, v, causal=True)
    assert _misses() == m and plan_cache.ONE_CALL_PLANS.hits == h + 3


CHANGES = {
    "qo_len": lambda a: dict(a, q=torch.randn(6, H, D).half()),
    "kv_len": lambda a: dict(a, k=torch.randn(11, HKV, D).half(), v=torch.randn(11, HKV, D).half()),
    "dtype": lambda a: dict(a, q=a["q"].float(), k=a["k"].float(), v=a["v"].float()),
    "k strides": lambda a: dict(a, k=torch.randn(HKV, 9, D).half().transpose(0, 1)),
    "causal": lambda a: dict(a, causal=False),
    "sm_scale": lambda a: dict(a, sm_scale=0.3),
    "window_left": lambda a: dict(a, window_left=2),
    "logits_soft_cap": lambda a: dict(a, logits_soft_cap=5.0),
    "pos_encoding_mode": lambda a: dict(a, pos_encoding_mode="ROPE_LLAMA"),
    "return_lse": lambda a: dict(a, return_lse=True),
    "out": lambda a: dict(a, out=torch.empty(5, H, D).half()),
    "sinks": lambda a: dict(a, sinks=torch.randn(H)),
    "k_scale": lambda a: dict(a, k_scale=0.5),
    "backend": lambda a: dict(a, backend="auto"),  # another string; "triton" would need the interpreter on CPU
}


@pytest.mark.parametrize("what", list(CHANGES))
def test_a_changed_value_misses(what):
    base = dict(q=torch.randn(5, H, D).half(), k=torch.randn(9, HKV, D).half(), v=torch.randn(9, HKV, D).half(),
                causal=True, backend="reference")
    attncore.single_prefill_with_kv_cache(**base)
    m = _misses()
    args = CHANGES[what](base)
    res = attncore.single_prefill_with_kv_cache(**args)
    assert _misses() == m + 1
    out = res[0] if isinstance(res, tuple) else res
    gkw = {n: args[n] for n in ("causal", "sm_scale", "window_left", "logits_soft_cap", "pos_encoding_mode", "sinks",
                                "k_scale") if n in args}
    _close(out.to(args["q"].dtype), args["q"], args["k"], args["v"], **gkw)
    m = _misses()
    attncore.single_prefill_with_kv_cache(**args)  # and that signature now hits
    assert _misses() == m


def test_environment_and_registry_changes_miss(monkeypatch, clean_registry):
    from _carving_backend import NoopBackend

    q, k = torch.randn(3, H, D).half(), torch.randn(7, HKV, D).half()
    attncore.single_prefill_with_kv_cache(q, k, k)
    m = _misses()
    monkeypatch.setenv("ATTNCORE_BACKEND", "reference")
    attncore.single_prefill_with_kv_cache(q, k, k)
    assert _misses() == m + 1
    clean_registry.register_backend(NoopBackend(), origin="test")  # a new registry generation
    attncore.single_prefill_with_kv_cache(q, k, k)
    assert _misses() == m + 2


def test_custom_mask_and_tensor_scales_are_planned_every_call():
    q, k = torch.randn(3, H, D).half(), torch.randn(7, HKV, D).half()
    mask = torch.rand(3, 7) < 0.7
    n = len(plan_cache.ONE_CALL_PLANS)
    m = _misses()
    for _ in range(2):
        attncore.single_prefill_with_kv_cache(q, k, k, custom_mask=mask, backend="reference")
        attncore.single_prefill_with_kv_cache(q, k, k, k_scale=torch.tensor([0.5]), backend="reference")
    assert len(plan_cache.ONE_CALL_PLANS) == n and _misses() == m  # never looked up, never stored


def test_single_decode_hits():
    q, k = torch.randn(H, D).half(), torch.randn(7, HKV, D).half()
    attncore.single_decode_with_kv_cache(q, k, k, backend="reference")
    m = _misses()
    out = attncore.single_decode_with_kv_cache(q, k, k, backend="reference")
    assert _misses() == m
    _close(out.unsqueeze(0), q.unsqueeze(0), k, k)


def test_wrapper_run_fast_path_keeps_the_checks_of_a_new_signature():
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 16, dtype=torch.uint8), backend="reference")
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    w.plan(indptr, torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32), H, HKV, D, 4)
    cache = torch.randn(3, 2, 4, HKV, D).half()
    q = torch.randn(2, H, D).half()
    a = w.run(q, cache)
    assert len(w._run_cache) == 1 and torch.equal(w.run(q, cache), a)  # the cached signature: same result
    with pytest.raises(ValueError, match=r"q: got shape \[3, 4, 16\]"):
        w.run(torch.randn(3, H, D).half(), cache)
    with pytest.raises(TypeError, match="q: got dtype fp32"):
        w.run(q.float(), cache)
    with pytest.raises(ValueError, match="paged_kv_indices: page id 2 is out of range"):
        w.run(q, cache[:2])
    # a new plan forgets the signatures: the old q no longer fits and is refused
    w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
           torch.tensor([2], dtype=torch.int32), H, HKV, D, 4)
    assert w._run_cache == {}
    with pytest.raises(ValueError, match=r"q: got shape \[2, 4, 16\], expected \[1, 4, 16\]"):
        w.run(q, cache)
