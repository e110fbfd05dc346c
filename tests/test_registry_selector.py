"""Registry and selector with fake backends: forced, disabled, refused, broken plugins, allow-list."""

import logging
import sys
import types
from importlib import metadata

import pytest
import torch

import attncore
from attncore.core import registry
from attncore.core import selector
from attncore.core.backend import Backend
from attncore.core.capabilities import Capabilities, Reason
from attncore.core.problem import AttentionProblem


class Fake(Backend):
    def __init__(self, name, prio=20, ops=("single_prefill",), head_dims=None, fail_available=None):
        self.name = name
        self._prio = prio
        self.capabilities = (Capabilities(ops=frozenset(ops), devices=frozenset({"cpu"}),
                                          q_dtypes=frozenset({torch.float16}), kv_dtypes=frozenset({torch.float16}),
                                          head_dims=frozenset(head_dims) if head_dims else None),)
        self._fail = fail_available
        self.runs = 0

    def available(self):
        return [Reason("toolchain", self._fail)] if self._fail else []

    def priority(self, problem):
        return self._prio

    def run(self, plan, args):
        self.runs += 1
        from attncore.reference.backend import ReferenceBackend

        rb = ReferenceBackend()
        rb.run(rb.plan(plan_problem(args), plan), args)


_last_problem = {}


def plan_problem(args):
    return _last_problem["p"]


class Recording(Fake):
    def plan(self, problem, meta):
        _last_problem["p"] = problem
        return meta


P = AttentionProblem(op="single_prefill", device_type="cpu", q_dtype=torch.float16, kv_dtype=torch.float16,
                     out_dtype=torch.float16, num_qo_heads=4, num_kv_heads=2, head_dim_qk=64, head_dim_vo=64)


def test_builtins_are_discovered_through_entry_points(clean_registry):
    es = registry.entries()
    for name in ("reference", "triton", "cuda_fa2", "xqa"):
        assert name in es and es[name].origin == "built-in"
    assert es["reference"].is_available


@pytest.mark.parametrize("name,module", [("xqa", "attncore.backends.xqa.backend"),
                                         ("cuda_fa2", "attncore.backends.cuda_fa2.backend"),
                                         ("triton", "attncore.backends.triton.backend")])
def test_builtin_whose_import_fails_is_listed_unavailable(clean_registry, monkeypatch, name, module):
    """A built-in backend that cannot import is shown with the reason, not silently dropped."""
    monkeypatch.setitem(sys.modules, module, None)  # `from .backend import X` now raises ImportError
    registry.reload()
    entry = registry.entries()[name]
    assert entry.backend is None and not entry.is_available
    assert "ModuleNotFoundError" in entry.load_error and module in entry.load_error
    assert any(module in str(r) for r in entry.unavailable_reasons())


def test_auto_picks_highest_priority_and_explains(clean_registry):
    registry.register_backend(Recording("fast", prio=50))
    registry.register_backend(Recording("slow", prio=30))
    ex = attncore.explain(P)
    assert ex.chosen == "fast"
    names = [n for n, _ in ex.ranked]
    assert names.index("fast") < names.index("slow") < names.index("reference")
    assert "chosen: fast" in str(ex)


def test_refusal_reasons_are_listed(clean_registry):
    registry.register_backend(Recording("d128only", prio=90, head_dims=[128]))
    ex = attncore.explain(P)
    assert ex.chosen != "d128only"
    (r,) = ex.refused["d128only"]
    assert r.axis == "head_dim" and r.got == "64" and "128" in r.supported
    assert "head_dim: got 64, supported {128}" in str(ex)


def test_forced_backend_that_refuses_raises_with_reasons(clean_registry):
    registry.register_backend(Recording("d128only", prio=90, head_dims=[128]))
    q, k = torch.randn(3, 4, 64).half(), torch.randn(5, 2, 64).half()
    with pytest.raises(attncore.BackendSelectionError, match=r"backend 'd128only' cannot run .*head_dim: got 64"):
        attncore.single_prefill_with_kv_cache(q, k, k, backend="d128only")


def test_nothing_qualifies_lists_every_backend(clean_registry, monkeypatch):
    monkeypatch.setenv("ATTNCORE_DISABLE_BACKENDS", ",".join(registry.entries()))
    registry.reload()
    registry.register_backend(Recording("d128only", prio=90, head_dims=[128]))
    with pytest.raises(attncore.BackendSelectionError) as ei:
        selector.select(P)
    msg = str(ei.value)
    assert "no backend can run" in msg and "d128only: head_dim" in msg and "reference: disabled" in msg
    assert set(ei.value.reasons) >= {"d128only", "reference"}


def test_unknown_backend_name(clean_registry):
    q, k = torch.randn(3, 4, 64).half(), torch.randn(5, 2, 64).half()
    with pytest.raises(ValueError, match="'nosuch'"):
        attncore.single_prefill_with_kv_cache(q, k, k, backend="nosuch")


def test_unavailable_backend_is_listed_with_reason(clean_registry):
    registry.register_backend(Recording("needsnvcc", prio=90, fail_available="nvcc not found"))
    ex = attncore.explain(P)
    assert ex.chosen == "reference" or ex.chosen != "needsnvcc"
    assert "nvcc not found" in str(ex.unavailable["needsnvcc"][0])
    with pytest.raises(attncore.BackendSelectionError, match="nvcc not found"):
        selector.select(P, "needsnvcc")


def test_env_backend_forces_and_orders(clean_registry, monkeypatch):
    registry.register_backend(Recording("a", prio=10))
    registry.register_backend(Recording("b", prio=80))
    monkeypatch.setenv("ATTNCORE_BACKEND", "a")
    assert selector.select(P).name == "a"
    monkeypatch.setenv("ATTNCORE_BACKEND", "reference,a")
    assert selector.select(P).name == "reference"
    monkeypatch.setenv("ATTNCORE_BACKEND", "a,b")
    assert [n for n, _ in attncore.explain(P).ranked][:2] == ["a", "b"]
    # an explicit backend= beats the environment
    assert selector.select(P, "b").name == "b"


def test_disabled_backend_is_not_chosen(clean_registry, monkeypatch):
    monkeypatch.setenv("ATTNCORE_DISABLE_BACKENDS", "fast")
    registry.reload()
    registry.register_backend(Recording("fast", prio=99))
    assert selector.select(P).name != "fast"
    assert "disabled" in str(attncore.explain(P).unavailable["fast"][0])


def test_wrapper_exposes_backend_and_logs_once(clean_registry, caplog):
    registry.register_backend(Recording("fast", prio=99, ops=("batch_prefill_ragged",)))
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1))
    qo = torch.tensor([0, 3], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="attncore"):
        w.plan(qo, qo, 4, 2, 64, causal=True)
        w.plan(qo, qo, 4, 2, 64, causal=True)
    assert w.backend == "fast"
    assert sum("-> backend fast" in r.message for r in caplog.records) == 1


def _fake_eps(monkeypatch, eps):
    real = metadata.entry_points

    def fake(**kw):
        if kw.get("group") == registry.ENTRY_POINT_GROUP:
            return list(real(group=registry.ENTRY_POINT_GROUP)) + eps
        return real(**kw)

    monkeypatch.setattr(metadata, "entry_points", fake)


class _EP:
    def __init__(self, name, value, dist="thirdparty"):
        self.name, self.value = name, value
        self.dist = types.SimpleNamespace(metadata={"Name": dist}, version="9.9")

    def load(self):
        mod = __import__(self.value, fromlist=["x"])
        return mod


def test_broken_plugin_is_isolated(clean_registry, monkeypatch):
    sys.modules.pop("attncore_broken_plugin", None)
    monkeypatch.setitem(sys.modules, "attncore_broken_plugin", None)  # import raises ImportError
    good = types.ModuleType("attncore_good_plugin")

    @attncore.hookimpl
    def attncore_backends():
        return [Recording("goodplug", prio=1)]

    good.attncore_backends = attncore_backends
    monkeypatch.setitem(sys.modules, "attncore_good_plugin", good)
    _fake_eps(monkeypatch, [_EP("broken", "attncore_broken_plugin"), _EP("goodplug", "attncore_good_plugin")])
    registry.reload()
    es = registry.entries()
    assert not es["broken"].is_available and "ModuleNotFoundError" in es["broken"].load_error
    assert es["goodplug"].is_available and es["goodplug"].origin == "plugin thirdparty 9.9"
    assert es["reference"].is_available
    # the allow-list: empty disables third-party plugins, built-ins stay
    monkeypatch.setenv("ATTNCORE_PLUGINS", "")
    registry.reload()
    assert "goodplug" not in registry.entries() and "reference" in registry.entries()
    monkeypatch.setenv("ATTNCORE_PLUGINS", "goodplug")
    registry.reload()
    assert "goodplug" in registry.entries() and "broken" not in registry.entries()


def test_plugin_raising_in_hook_is_isolated(clean_registry, monkeypatch):
    mod = types.ModuleType("attncore_raising_plugin")

    @attncore.hookimpl
    def attncore_backends():
        raise RuntimeError("boom")

    mod.attncore_backends = attncore_backends
    monkeypatch.setitem(sys.modules, "attncore_raising_plugin", mod)
    _fake_eps(monkeypatch, [_EP("raiser", "attncore_raising_plugin")])
    registry.reload()
    assert "RuntimeError: boom" in registry.entries()["raiser"].load_error
    assert selector.select(P).name  # selection still works


def test_run_time_feature_replans_on_a_capable_backend(clean_registry):
    class NoLse(Recording):
        pass

    b = NoLse("nolse", prio=99, ops=("batch_prefill_ragged",))
    registry.register_backend(b)
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1))
    qo = torch.tensor([0, 3], dtype=torch.int32)
    w.plan(qo, qo, 4, 2, 64, causal=True)
    q, k = torch.randn(3, 4, 64).half(), torch.randn(3, 2, 64).half()
    w.run(q, k, k)
    assert b.runs == 1
    out, lse = w.run(q, k, k, return_lse=True)  # nolse does not claim return_lse: auto moves to reference
    assert b.runs == 1 and lse.shape == (3, 4)
    forced = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1), backend="nolse")
    forced.plan(qo, qo, 4, 2, 64, causal=True)
    with pytest.raises(ValueError, match="feature:return_lse"):
        forced.run(q, k, k, return_lse=True)


def test_cuda_device_refuses_other_devices_by_name():
    from attncore.core.backend import cuda_device

    with pytest.raises(ValueError, match="xqa: device cpu is not a CUDA device"):
        cuda_device("cpu", "xqa")


def test_refusal_reasons_come_from_the_entry_for_the_problems_device():
    """A CUDA entry claiming bf16 and a CPU entry without it: bf16 on the CPU is refused for its
    dtype (on cpu), not for the device (issue 14)."""
    both = Capabilities(ops=frozenset({"single_prefill"}), devices=frozenset({"cuda"}),
                        q_dtypes=frozenset({torch.float16, torch.bfloat16}),
                        kv_dtypes=frozenset({torch.float16, torch.bfloat16}))
    cpu = Capabilities(ops=frozenset({"single_prefill"}), devices=frozenset({"cpu"}),
                       q_dtypes=frozenset({torch.float16}), kv_dtypes=frozenset({torch.float16}))
    b = Fake("split")
    b.capabilities = (both, cpu)
    bf16 = P.replace(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    assert [(r.axis, r.supported) for r in b.reasons(bf16)] == [("q_dtype", "{fp16} on cpu"),
                                                                ("kv_dtype", "{fp16} on cpu")]
    assert b.reasons(P) == []
    # no entry for the device: the device is the reason
    assert [r.axis for r in b.reasons(P.replace(device_type="mps"))] == ["device"]
    # a single entry: its limits hold everywhere, nothing to say "on cpu" about
    (r,) = Fake("d128", head_dims=[128]).reasons(P)
    assert r.supported == "{128}"


def test_summarize_is_plain_words():
    from attncore.core.capabilities import summarize

    dense = Capabilities(ops=frozenset({"single_prefill"}), devices=frozenset({"cuda"}),
                         min_compute_capability=(8, 0), head_dim_multiple=16, max_head_dim=256)
    paged = Capabilities(ops=frozenset({"batch_decode"}), head_dims=frozenset({64, 128}),
                         page_sizes=frozenset({1, 16}), features=frozenset({"sinks"}))
    head, body = summarize([dense])
    assert head == "single_prefill on cuda sm80+:"
    assert "head dims: multiples of 16 up to 256" in body and "page" not in body
    assert "features: none" in body and "q dtypes: bf16, fp16" in body
    head, body = summarize([paged])
    assert "head dims: 64, 128" in body and "page sizes: 1, 16" in body and "features: sinks" in body
    anyd = Capabilities(ops=frozenset({"batch_decode"}))
    assert "head dims: any; page sizes: any" in summarize([anyd])[1]
