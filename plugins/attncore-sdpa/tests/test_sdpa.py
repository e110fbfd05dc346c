"""Tests of the attncore-sdpa plugin, run from its own directory after ``pip install -e .``.

    pytest plugins/attncore-sdpa/tests
"""

import pytest
import torch

import attncore
from attncore.core import registry
from attncore.core.problem import AttentionProblem
from attncore.testing import run_conformance

from attncore_sdpa import SdpaBackend


def test_registry_finds_the_entry_point():
    entry = registry.get_entry("sdpa")
    assert isinstance(entry.backend, SdpaBackend)
    assert entry.origin.startswith("plugin attncore-sdpa")
    assert entry.is_available


def test_refuses_paged_and_unsupported_features():
    b = SdpaBackend()
    base = AttentionProblem(op="single_prefill", num_qo_heads=4, num_kv_heads=2, head_dim_qk=64, head_dim_vo=64)
    assert b.reasons(base) == []
    for change in (dict(op="batch_prefill_paged", page_size=16), dict(mask="custom"), dict(sinks=True),
                   dict(soft_cap=True), dict(window_left=3), dict(pos_encoding="ALIBI")):
        assert b.reasons(base.replace(**change)), change


@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(causal):
    q = torch.randn(7, 8, 64).half()
    k = torch.randn(12, 2, 64).half()
    v = torch.randn(12, 2, 64).half()
    o = attncore.single_prefill_with_kv_cache(q, k, v, causal=causal, backend="sdpa")
    r = attncore.single_prefill_with_kv_cache(q, k, v, causal=causal, backend="reference")
    torch.testing.assert_close(o, r, atol=2e-3, rtol=2e-3)


def test_auto_prefers_reference_on_cpu():
    p = AttentionProblem(op="single_prefill", device_type="cpu", num_qo_heads=4, num_kv_heads=2,
                         head_dim_qk=64, head_dim_vo=64)
    assert attncore.select(p).name != "sdpa"


def test_conformance():
    assert run_conformance("sdpa", ["-q"]) == 0
