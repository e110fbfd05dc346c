"""The rule table of attncore.core.ranking: it ranks every problem exactly as the backends' priority()
methods did when it replaced them (a frozen ranking over a broad grid), every row carries its
evidence, and the selector ranks by it (not by priority()) for the backends it knows."""

import os
import sys

import pytest
import torch

import attncore
from attncore.core import ranking
from attncore.core import registry
from attncore.core import selector
from attncore.core import tables
from attncore.core.backend import Backend
from attncore.core.capabilities import Capabilities
from attncore.core.problem import OPS, PAGED_OPS, AttentionProblem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_SRC = os.path.join(ROOT, "plugins", "attncore-sdpa")
if PLUGIN_SRC not in sys.path:
    sys.path.insert(0, PLUGIN_SRC)

from attncore.backends.cuda_fa2.backend import CudaFa2Backend  # noqa: E402
from attncore.backends.triton.backend import TritonBackend  # noqa: E402
from attncore.backends.xqa.backend import XqaBackend  # noqa: E402
from attncore.reference.backend import ReferenceBackend  # noqa: E402
from attncore_sdpa import SdpaBackend  # noqa: E402

BF16, FP16, FP32, E4M3 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn


def backends():
    return [ReferenceBackend(), TritonBackend(), CudaFa2Backend(), XqaBackend(), SdpaBackend()]


DEVICES = [("cpu", None), ("cuda", None), ("cuda", (7, 5)), ("cuda", (8, 0)), ("cuda", (9, 0)), ("cuda", (10, 0))]
VARIANTS = {
    "base": {},
    "fp16": dict(q_dtype=FP16, kv_dtype=FP16, out_dtype=FP16),
    "fp32": dict(q_dtype=FP32, kv_dtype=FP32, out_dtype=FP32),
    "kv-e4m3": dict(kv_dtype=E4M3),
    "kv-e4m3-out-e4m3": dict(kv_dtype=E4M3, out_dtype=E4M3),
    "out-fp16": dict(out_dtype=FP16),
    "causal": dict(mask="causal"),
    "causal-lse": dict(mask="causal", return_lse=True),
    "lse": dict(return_lse=True),
    "custom": dict(mask="custom"),
    "window": dict(window_left=128),
    "softcap": dict(soft_cap=True),
    "alibi": dict(pos_encoding="ALIBI"),
    "rope": dict(pos_encoding="ROPE_LLAMA"),
    "sinks": dict(sinks=True),
    "fp8-scales": dict(fp8_scales=True),
    "d64": dict(head_dim_qk=64, head_dim_vo=64),
    "d256": dict(head_dim_qk=256, head_dim_vo=256),
    "d192x128": dict(head_dim_qk=192, head_dim_vo=128),
    "mha": dict(num_kv_heads=32),
    "hnd": dict(kv_layout="HND"),
    "qlen4": dict(q_len_per_req=4),
    "spec": dict(spec_mask=True),
    "graph": dict(cuda_graph=True),
    "page1": dict(page_size=1),
}


def grid():
    """(id, problem, ATTNCORE_FA2_SM90=0?) over ops x devices x VARIANTS (bf16, d128, 32/8, NHD, no
    mask, page 16 for paged ops, then the variant's change), plus cuda_fa2's switch on sm90.  The id
    names the op, the device and the variant: regenerate FROZEN after editing VARIANTS."""
    out = []
    for op in OPS:
        for dev, cc in DEVICES:
            names = [(n, False) for n in VARIANTS if n != "page1" or op in PAGED_OPS]
            if cc == (9, 0):
                names += [(n, True) for n in ("base", "causal", "d64")]
            for name, fa2_off in names:
                p = AttentionProblem(op=op, device_type=dev, compute_capability=cc, q_dtype=BF16, kv_dtype=BF16,
                                     out_dtype=BF16, num_qo_heads=32, num_kv_heads=8,
                                     page_size=16 if op in PAGED_OPS else None).replace(**VARIANTS[name])
                where = dev + ("" if cc is None else " sm%d%d" % cc)
                out.append((f"{op} {where} {name}" + (" ATTNCORE_FA2_SM90=0" if fa2_off else ""), p, fa2_off))
    return out


def order_string(ranks: dict) -> str:
    """Ranks as the selector orders them: highest first, ties by name."""
    return " > ".join(f"{n} {r}" for n, r in sorted(ranks.items(), key=lambda kv: (-kv[1], kv[0])))


def table_ranks(p: AttentionProblem) -> dict:
    return {b.name: ranking.rule_rank(b, p).rank for b in backends()}


def _frozen():
    out = {}
    for order, ids in FROZEN.items():
        for pid in ids.strip().splitlines():
            assert pid not in out, pid
            out[pid] = order
    return out


def test_rule_table_reproduces_the_frozen_ranking(monkeypatch):
    """Fails whenever a rank changes for any problem of the grid: the frozen ranking below was
    generated on 2026-11-24 from the backends' priority() methods, before the table replaced them.
    A deliberate change (a new measurement) regenerates FROZEN and says why in the commit."""
    frozen = _frozen()
    seen = set()
    for pid, p, fa2_off in grid():
        monkeypatch.delenv("ATTNCORE_FA2_SM90", raising=False)
        if fa2_off:
            monkeypatch.setenv("ATTNCORE_FA2_SM90", "0")
        assert pid in frozen, f"grid point without a frozen ranking: {pid}"
        assert order_string(table_ranks(p)) == frozen[pid], pid
        seen.add(pid)
    assert seen == set(frozen), "frozen rankings the grid no longer produces"
    assert len(seen) > 1000


def test_the_grid_covers_every_rule():
    used = set()
    for _, p, _ in grid():
        for b in backends():
            rr = ranking.rule_rank(b, p)
            used.add(rr.rule.id)
    assert used == {r.id for r in ranking.RULES}


def test_every_shipped_backend_has_rows_ending_in_a_catch_all_and_evidence():
    for name in ranking.OWNERS:
        rows = ranking.rules_for(name)
        assert rows, name
        last = rows[-1]
        assert last.conditions() == "any problem", name  # every problem gets a rank from the table
        assert all(r.conditions() != "any problem" for r in rows[:-1]), name
    for r in ranking.RULES:
        assert r.evidence.figures, r.id
        if r.evidence.measured:  # a measurement names its device, date and where the data is
            assert r.evidence.date and r.evidence.source and any(c.isdigit() for c in r.evidence.figures), r.id
    assert len({r.id for r in ranking.RULES}) == len(ranking.RULES)


def test_fast_path_predicates_exist_on_the_backends():
    """The table calls these through the backend object: renaming one must fail here, not silently
    lower a rank."""
    classes = {b.name: type(b) for b in backends()}
    for r in ranking.RULES:
        if r.fast_path is not None:
            assert callable(getattr(classes[r.backend], r.fast_path.method, None)), (r.id, r.fast_path.method)


def test_fast_path_that_does_not_serve_is_shown():
    p = AttentionProblem(op="single_prefill", device_type="cuda", compute_capability=(9, 0), q_dtype=BF16,
                         kv_dtype=BF16, out_dtype=BF16, num_qo_heads=32, num_kv_heads=8, soft_cap=True)
    rr = ranking.rule_rank(CudaFa2Backend(), p)
    assert rr.rank == 40 and rr.rule.id == "cuda_fa2/cuda"
    assert [row.id for row, _ in rr.passed_over] == ["cuda_fa2/sm90-single", "cuda_fa2/sm90-prefill90"]
    assert all("soft cap" in why for _, why in rr.passed_over)
    rr = ranking.rule_rank(TritonBackend(), p)
    assert rr.rank == 50 and rr.passed_over[0][0].id == "triton/sm90-dense"
    assert ranking.rule_rank(TritonBackend(), p.replace(soft_cap=False)).rule.id == "triton/sm90-dense"


def test_a_raising_or_missing_fast_path_ranks_lower_without_breaking():
    class Broken(TritonBackend):
        @staticmethod
        def _dense_serves(p):
            raise RuntimeError("boom")

    Broken.__module__ = TritonBackend.__module__  # as if shipped in the package
    p = AttentionProblem(op="single_prefill", device_type="cuda", compute_capability=(9, 0), q_dtype=BF16,
                         kv_dtype=BF16, out_dtype=BF16)
    rr = ranking.rule_rank(Broken(), p)
    assert rr.rank == 50 and "boom" in rr.passed_over[0][1]


class Mine(Backend):
    """A third-party backend: ranked by its own priority()."""

    def __init__(self, name="mine", prio=1):
        self.name, self._prio = name, prio
        self.capabilities = (Capabilities(ops=frozenset({"single_prefill"}), devices=frozenset({"cpu"}),
                                          q_dtypes=frozenset({FP16}), kv_dtypes=frozenset({FP16})),)

    def priority(self, problem):
        return self._prio


P_CPU = AttentionProblem(op="single_prefill", device_type="cpu", q_dtype=FP16, kv_dtype=FP16, out_dtype=FP16,
                         num_qo_heads=4, num_kv_heads=2, head_dim_qk=64, head_dim_vo=64)


def test_table_governs_only_the_code_attncore_ships():
    assert all(ranking.governs(b) for b in backends())
    assert not ranking.governs(Mine())
    impostor = Mine("triton", prio=99)  # a plugin of another package that calls itself triton
    assert not ranking.governs(impostor)
    rr = ranking.rule_rank(impostor, P_CPU)
    assert rr.rank == 99 and rr.rule is None and "priority()" in rr.note


@pytest.fixture
def no_tables(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNCORE_CACHE_DIR", str(tmp_path / "cache"))
    tables.reload()
    yield
    tables.reload()


def test_selector_ranks_shipped_backends_by_the_table_not_priority(clean_registry, no_tables, monkeypatch):
    monkeypatch.setattr(ReferenceBackend, "priority", lambda self, p: -100, raising=False)
    monkeypatch.setattr(TritonBackend, "priority", lambda self, p: 999, raising=False)
    registry.reload()
    ex = attncore.explain(P_CPU)
    ranks = dict(ex.ranked)
    assert ranks["reference"] == 0 and ranks.get("triton", -1) == -1
    assert ex.chosen != "triton" and ex.ranking == "rules"


def test_plugin_priority_interleaves_with_the_table(clean_registry, no_tables):
    registry.register_backend(Mine("mine", prio=1))  # above the reference (0)
    ex = attncore.explain(P_CPU)
    assert ex.chosen == "mine"
    assert "priority() of registered (not in the rule table)" in str(ex)
    registry.register_backend(Mine("mine", prio=-5))
    ex = attncore.explain(P_CPU)
    names = [n for n, _ in ex.ranked]
    assert names.index("reference") < names.index("mine")


def test_explain_prints_each_rule_with_its_evidence(clean_registry, no_tables):
    text = str(attncore.explain(P_CPU))
    assert "ranking: rule table" in text
    assert "reference (priority 0): rule reference/any: any problem" in text
    assert "evidence: not measured: the zero of the scale" in text
    p = P_CPU.replace(device_type="cuda", compute_capability=(9, 0))
    ex = attncore.explain(p, "reference")  # forced: still says what its rank rests on
    assert ex.chosen == "reference" and "rule reference/any" in str(ex)


def test_select_cache_follows_ranking_reload(clean_registry, no_tables):
    b1 = selector.select(P_CPU)
    assert selector.select(P_CPU) is b1
    g = tables.generation()
    tables.reload()
    assert tables.generation() == g + 1


# The ranking of every grid point, as the backends' priority() methods gave it on 2026-11-24 (before
# attncore.core.ranking replaced them): rank order before refusals (a backend that refuses a problem is
# still listed here; the selector drops it).  Generated by calling each backend's priority() on grid().  Changed
# since, each by a measurement: 2026-11-25 (session 18), single prefill on sm90 where prefill90 serves it ranks
# cuda_fa2 54 (rule cuda_fa2/sm90-single), above Triton's dense kernel (15 points).
FROZEN = {
    'triton 50 > cuda_fa2 40 > xqa 40 > sdpa 5 > reference 0': """
single_prefill cuda base
single_prefill cuda fp16
single_prefill cuda fp32
single_prefill cuda kv-e4m3
single_prefill cuda kv-e4m3-out-e4m3
single_prefill cuda out-fp16
single_prefill cuda causal
single_prefill cuda causal-lse
single_prefill cuda lse
single_prefill cuda custom
single_prefill cuda window
single_prefill cuda softcap
single_prefill cuda alibi
single_prefill cuda rope
single_prefill cuda sinks
single_prefill cuda fp8-scales
single_prefill cuda d64
single_prefill cuda d256
single_prefill cuda d192x128
single_prefill cuda mha
single_prefill cuda hnd
single_prefill cuda qlen4
single_prefill cuda spec
single_prefill cuda graph
single_prefill cuda sm75 base
single_prefill cuda sm75 fp16
single_prefill cuda sm75 fp32
single_prefill cuda sm75 kv-e4m3
single_prefill cuda sm75 kv-e4m3-out-e4m3
single_prefill cuda sm75 out-fp16
single_prefill cuda sm75 causal
single_prefill cuda sm75 causal-lse
single_prefill cuda sm75 lse
single_prefill cuda sm75 custom
single_prefill cuda sm75 window
single_prefill cuda sm75 softcap
single_prefill cuda sm75 alibi
single_prefill cuda sm75 rope
single_prefill cuda sm75 sinks
single_prefill cuda sm75 fp8-scales
single_prefill cuda sm75 d64
single_prefill cuda sm75 d256
single_prefill cuda sm75 d192x128
single_prefill cuda sm75 mha
single_prefill cuda sm75 hnd
single_prefill cuda sm75 qlen4
single_prefill cuda sm75 spec
single_prefill cuda sm75 graph
single_prefill cuda sm80 causal-lse
single_prefill cuda sm80 lse
single_prefill cuda sm100 causal-lse
single_prefill cuda sm100 lse
batch_prefill_ragged cuda base
batch_prefill_ragged cuda fp16
batch_prefill_ragged cuda fp32
batch_prefill_ragged cuda kv-e4m3
batch_prefill_ragged cuda kv-e4m3-out-e4m3
batch_prefill_ragged cuda out-fp16
batch_prefill_ragged cuda causal
batch_prefill_ragged cuda causal-lse
batch_prefill_ragged cuda lse
batch_prefill_ragged cuda custom
batch_prefill_ragged cuda window
batch_prefill_ragged cuda softcap
batch_prefill_ragged cuda alibi
batch_prefill_ragged cuda rope
batch_prefill_ragged cuda sinks
batch_prefill_ragged cuda fp8-scales
batch_prefill_ragged cuda d64
batch_prefill_ragged cuda d256
batch_prefill_ragged cuda d192x128
batch_prefill_ragged cuda mha
batch_prefill_ragged cuda hnd
batch_prefill_ragged cuda qlen4
batch_prefill_ragged cuda spec
batch_prefill_ragged cuda graph
batch_prefill_ragged cuda sm75 base
batch_prefill_ragged cuda sm75 fp16
batch_prefill_ragged cuda sm75 fp32
batch_prefill_ragged cuda sm75 kv-e4m3
batch_prefill_ragged cuda sm75 kv-e4m3-out-e4m3
batch_prefill_ragged cuda sm75 out-fp16
batch_prefill_ragged cuda sm75 causal
batch_prefill_ragged cuda sm75 causal-lse
batch_prefill_ragged cuda sm75 lse
batch_prefill_ragged cuda sm75 custom
batch_prefill_ragged cuda sm75 window
batch_prefill_ragged cuda sm75 softcap
batch_prefill_ragged cuda sm75 alibi
batch_prefill_ragged cuda sm75 rope
batch_prefill_ragged cuda sm75 sinks
batch_prefill_ragged cuda sm75 fp8-scales
batch_prefill_ragged cuda sm75 d64
batch_prefill_ragged cuda sm75 d256
batch_prefill_ragged cuda sm75 d192x128
batch_prefill_ragged cuda sm75 mha
batch_prefill_ragged cuda sm75 hnd
batch_prefill_ragged cuda sm75 qlen4
batch_prefill_ragged cuda sm75 spec
batch_prefill_ragged cuda sm75 graph
batch_prefill_ragged cuda sm80 causal-lse
batch_prefill_ragged cuda sm80 lse
batch_prefill_ragged cuda sm100 causal-lse
batch_prefill_ragged cuda sm100 lse
batch_prefill_paged cuda base
batch_prefill_paged cuda fp16
batch_prefill_paged cuda fp32
batch_prefill_paged cuda kv-e4m3
batch_prefill_paged cuda kv-e4m3-out-e4m3
batch_prefill_paged cuda out-fp16
batch_prefill_paged cuda causal
batch_prefill_paged cuda causal-lse
batch_prefill_paged cuda lse
batch_prefill_paged cuda custom
batch_prefill_paged cuda window
batch_prefill_paged cuda softcap
batch_prefill_paged cuda alibi
batch_prefill_paged cuda rope
batch_prefill_paged cuda sinks
batch_prefill_paged cuda fp8-scales
batch_prefill_paged cuda d64
batch_prefill_paged cuda d256
batch_prefill_paged cuda d192x128
batch_prefill_paged cuda mha
batch_prefill_paged cuda hnd
batch_prefill_paged cuda qlen4
batch_prefill_paged cuda spec
batch_prefill_paged cuda graph
batch_prefill_paged cuda page1
batch_prefill_paged cuda sm75 base
batch_prefill_paged cuda sm75 fp16
batch_prefill_paged cuda sm75 fp32
batch_prefill_paged cuda sm75 kv-e4m3
batch_prefill_paged cuda sm75 kv-e4m3-out-e4m3
batch_prefill_paged cuda sm75 out-fp16
batch_prefill_paged cuda sm75 causal
batch_prefill_paged cuda sm75 causal-lse
batch_prefill_paged cuda sm75 lse
batch_prefill_paged cuda sm75 custom
batch_prefill_paged cuda sm75 window
batch_prefill_paged cuda sm75 softcap
batch_prefill_paged cuda sm75 alibi
batch_prefill_paged cuda sm75 rope
batch_prefill_paged cuda sm75 sinks
batch_prefill_paged cuda sm75 fp8-scales
batch_prefill_paged cuda sm75 d64
batch_prefill_paged cuda sm75 d256
batch_prefill_paged cuda sm75 d192x128
batch_prefill_paged cuda sm75 mha
batch_prefill_paged cuda sm75 hnd
batch_prefill_paged cuda sm75 qlen4
batch_prefill_paged cuda sm75 spec
batch_prefill_paged cuda sm75 graph
batch_prefill_paged cuda sm75 page1
batch_prefill_paged cuda sm80 causal-lse
batch_prefill_paged cuda sm80 lse
batch_prefill_paged cuda sm100 causal-lse
batch_prefill_paged cuda sm100 lse
batch_decode cuda base
batch_decode cuda fp16
batch_decode cuda fp32
batch_decode cuda kv-e4m3
batch_decode cuda kv-e4m3-out-e4m3
batch_decode cuda out-fp16
batch_decode cuda causal
batch_decode cuda causal-lse
batch_decode cuda lse
batch_decode cuda custom
batch_decode cuda window
batch_decode cuda softcap
batch_decode cuda alibi
batch_decode cuda rope
batch_decode cuda sinks
batch_decode cuda fp8-scales
batch_decode cuda d64
batch_decode cuda d256
batch_decode cuda d192x128
batch_decode cuda mha
batch_decode cuda hnd
batch_decode cuda qlen4
batch_decode cuda spec
batch_decode cuda graph
batch_decode cuda page1
batch_decode cuda sm75 base
batch_decode cuda sm75 fp16
batch_decode cuda sm75 fp32
batch_decode cuda sm75 kv-e4m3
batch_decode cuda sm75 kv-e4m3-out-e4m3
batch_decode cuda sm75 out-fp16
batch_decode cuda sm75 causal
batch_decode cuda sm75 causal-lse
batch_decode cuda sm75 lse
batch_decode cuda sm75 custom
batch_decode cuda sm75 window
batch_decode cuda sm75 softcap
batch_decode cuda sm75 alibi
batch_decode cuda sm75 rope
batch_decode cuda sm75 sinks
batch_decode cuda sm75 fp8-scales
batch_decode cuda sm75 d64
batch_decode cuda sm75 d256
batch_decode cuda sm75 d192x128
batch_decode cuda sm75 mha
batch_decode cuda sm75 hnd
batch_decode cuda sm75 qlen4
batch_decode cuda sm75 spec
batch_decode cuda sm75 graph
batch_decode cuda sm75 page1
batch_decode cuda sm80 causal-lse
batch_decode cuda sm80 lse
batch_decode cuda sm100 causal-lse
batch_decode cuda sm100 lse
xqa_decode cuda base
xqa_decode cuda fp16
xqa_decode cuda fp32
xqa_decode cuda kv-e4m3
xqa_decode cuda kv-e4m3-out-e4m3
xqa_decode cuda out-fp16
xqa_decode cuda causal
xqa_decode cuda causal-lse
xqa_decode cuda lse
xqa_decode cuda custom
xqa_decode cuda window
xqa_decode cuda softcap
xqa_decode cuda alibi
xqa_decode cuda rope
xqa_decode cuda sinks
xqa_decode cuda fp8-scales
xqa_decode cuda d64
xqa_decode cuda d256
xqa_decode cuda d192x128
xqa_decode cuda mha
xqa_decode cuda hnd
xqa_decode cuda qlen4
xqa_decode cuda spec
xqa_decode cuda graph
xqa_decode cuda page1
xqa_decode cuda sm75 base
xqa_decode cuda sm75 fp16
xqa_decode cuda sm75 fp32
xqa_decode cuda sm75 kv-e4m3
xqa_decode cuda sm75 kv-e4m3-out-e4m3
xqa_decode cuda sm75 out-fp16
xqa_decode cuda sm75 causal
xqa_decode cuda sm75 causal-lse
xqa_decode cuda sm75 lse
xqa_decode cuda sm75 custom
xqa_decode cuda sm75 window
xqa_decode cuda sm75 softcap
xqa_decode cuda sm75 alibi
xqa_decode cuda sm75 rope
xqa_decode cuda sm75 sinks
xqa_decode cuda sm75 fp8-scales
xqa_decode cuda sm75 d64
xqa_decode cuda sm75 d256
xqa_decode cuda sm75 d192x128
xqa_decode cuda sm75 mha
xqa_decode cuda sm75 hnd
xqa_decode cuda sm75 qlen4
xqa_decode cuda sm75 spec
xqa_decode cuda sm75 graph
xqa_decode cuda sm75 page1
xqa_decode cuda sm80 causal-lse
xqa_decode cuda sm80 lse
xqa_decode cuda sm100 causal-lse
xqa_decode cuda sm100 lse
pod cuda base
pod cuda fp16
pod cuda fp32
pod cuda kv-e4m3
pod cuda kv-e4m3-out-e4m3
pod cuda out-fp16
pod cuda causal
pod cuda causal-lse
pod cuda lse
pod cuda custom
pod cuda window
pod cuda softcap
pod cuda alibi
pod cuda rope
pod cuda sinks
pod cuda fp8-scales
pod cuda d64
pod cuda d256
pod cuda d192x128
pod cuda mha
pod cuda hnd
pod cuda qlen4
pod cuda spec
pod cuda graph
pod cuda page1
pod cuda sm75 base
pod cuda sm75 fp16
pod cuda sm75 fp32
pod cuda sm75 kv-e4m3
pod cuda sm75 kv-e4m3-out-e4m3
pod cuda sm75 out-fp16
pod cuda sm75 causal
pod cuda sm75 causal-lse
pod cuda sm75 lse
pod cuda sm75 custom
pod cuda sm75 window
pod cuda sm75 softcap
pod cuda sm75 alibi
pod cuda sm75 rope
pod cuda sm75 sinks
pod cuda sm75 fp8-scales
pod cuda sm75 d64
pod cuda sm75 d256
pod cuda sm75 d192x128
pod cuda sm75 mha
pod cuda sm75 hnd
pod cuda sm75 qlen4
pod cuda sm75 spec
pod cuda sm75 graph
pod cuda sm75 page1
pod cuda sm80 causal-lse
pod cuda sm80 lse
pod cuda sm100 causal-lse
pod cuda sm100 lse
batch_pod cuda base
batch_pod cuda fp16
batch_pod cuda fp32
batch_pod cuda kv-e4m3
batch_pod cuda kv-e4m3-out-e4m3
batch_pod cuda out-fp16
batch_pod cuda causal
batch_pod cuda causal-lse
batch_pod cuda lse
batch_pod cuda custom
batch_pod cuda window
batch_pod cuda softcap
batch_pod cuda alibi
batch_pod cuda rope
batch_pod cuda sinks
batch_pod cuda fp8-scales
batch_pod cuda d64
batch_pod cuda d256
batch_pod cuda d192x128
batch_pod cuda mha
batch_pod cuda hnd
batch_pod cuda qlen4
batch_pod cuda spec
batch_pod cuda graph
batch_pod cuda page1
batch_pod cuda sm75 base
batch_pod cuda sm75 fp16
batch_pod cuda sm75 fp32
batch_pod cuda sm75 kv-e4m3
batch_pod cuda sm75 kv-e4m3-out-e4m3
batch_pod cuda sm75 out-fp16
batch_pod cuda sm75 causal
batch_pod cuda sm75 causal-lse
batch_pod cuda sm75 lse
batch_pod cuda sm75 custom
batch_pod cuda sm75 window
batch_pod cuda sm75 softcap
batch_pod cuda sm75 alibi
batch_pod cuda sm75 rope
batch_pod cuda sm75 sinks
batch_pod cuda sm75 fp8-scales
batch_pod cuda sm75 d64
batch_pod cuda sm75 d256
batch_pod cuda sm75 d192x128
batch_pod cuda sm75 mha
batch_pod cuda sm75 hnd
batch_pod cuda sm75 qlen4
batch_pod cuda sm75 spec
batch_pod cuda sm75 graph
batch_pod cuda sm75 page1
batch_pod cuda sm80 causal-lse
batch_pod cuda sm80 lse
batch_pod cuda sm100 causal-lse
batch_pod cuda sm100 lse
""",
    'sdpa 55 > triton 50 > cuda_fa2 40 > xqa 40 > reference 0': """
single_prefill cuda sm80 base
single_prefill cuda sm80 fp16
single_prefill cuda sm80 fp32
single_prefill cuda sm80 kv-e4m3
single_prefill cuda sm80 kv-e4m3-out-e4m3
single_prefill cuda sm80 out-fp16
single_prefill cuda sm80 causal
single_prefill cuda sm80 custom
single_prefill cuda sm80 window
single_prefill cuda sm80 softcap
single_prefill cuda sm80 alibi
single_prefill cuda sm80 rope
single_prefill cuda sm80 sinks
single_prefill cuda sm80 fp8-scales
single_prefill cuda sm80 d64
single_prefill cuda sm80 d256
single_prefill cuda sm80 d192x128
single_prefill cuda sm80 mha
single_prefill cuda sm80 hnd
single_prefill cuda sm80 qlen4
single_prefill cuda sm80 spec
single_prefill cuda sm80 graph
single_prefill cuda sm100 base
single_prefill cuda sm100 fp16
single_prefill cuda sm100 fp32
single_prefill cuda sm100 kv-e4m3
single_prefill cuda sm100 kv-e4m3-out-e4m3
single_prefill cuda sm100 out-fp16
single_prefill cuda sm100 causal
single_prefill cuda sm100 custom
single_prefill cuda sm100 window
single_prefill cuda sm100 softcap
single_prefill cuda sm100 alibi
single_prefill cuda sm100 rope
single_prefill cuda sm100 sinks
single_prefill cuda sm100 fp8-scales
single_prefill cuda sm100 d64
single_prefill cuda sm100 d256
single_prefill cuda sm100 d192x128
single_prefill cuda sm100 mha
single_prefill cuda sm100 hnd
single_prefill cuda sm100 qlen4
single_prefill cuda sm100 spec
single_prefill cuda sm100 graph
batch_prefill_ragged cuda sm80 base
batch_prefill_ragged cuda sm80 fp16
batch_prefill_ragged cuda sm80 fp32
batch_prefill_ragged cuda sm80 kv-e4m3
batch_prefill_ragged cuda sm80 kv-e4m3-out-e4m3
batch_prefill_ragged cuda sm80 out-fp16
batch_prefill_ragged cuda sm80 causal
batch_prefill_ragged cuda sm80 custom
batch_prefill_ragged cuda sm80 window
batch_prefill_ragged cuda sm80 softcap
batch_prefill_ragged cuda sm80 alibi
batch_prefill_ragged cuda sm80 rope
batch_prefill_ragged cuda sm80 sinks
batch_prefill_ragged cuda sm80 fp8-scales
batch_prefill_ragged cuda sm80 d64
batch_prefill_ragged cuda sm80 d256
batch_prefill_ragged cuda sm80 d192x128
batch_prefill_ragged cuda sm80 mha
batch_prefill_ragged cuda sm80 hnd
batch_prefill_ragged cuda sm80 qlen4
batch_prefill_ragged cuda sm80 spec
batch_prefill_ragged cuda sm80 graph
batch_prefill_ragged cuda sm100 base
batch_prefill_ragged cuda sm100 fp16
batch_prefill_ragged cuda sm100 fp32
batch_prefill_ragged cuda sm100 kv-e4m3
batch_prefill_ragged cuda sm100 kv-e4m3-out-e4m3
batch_prefill_ragged cuda sm100 out-fp16
batch_prefill_ragged cuda sm100 causal
batch_prefill_ragged cuda sm100 custom
batch_prefill_ragged cuda sm100 window
batch_prefill_ragged cuda sm100 softcap
batch_prefill_ragged cuda sm100 alibi
batch_prefill_ragged cuda sm100 rope
batch_prefill_ragged cuda sm100 sinks
batch_prefill_ragged cuda sm100 fp8-scales
batch_prefill_ragged cuda sm100 d64
batch_prefill_ragged cuda sm100 d256
batch_prefill_ragged cuda sm100 d192x128
batch_prefill_ragged cuda sm100 mha
batch_prefill_ragged cuda sm100 hnd
batch_prefill_ragged cuda sm100 qlen4
batch_prefill_ragged cuda sm100 spec
batch_prefill_ragged cuda sm100 graph
batch_prefill_paged cuda sm80 base
batch_prefill_paged cuda sm80 fp16
batch_prefill_paged cuda sm80 fp32
batch_prefill_paged cuda sm80 kv-e4m3
batch_prefill_paged cuda sm80 kv-e4m3-out-e4m3
batch_prefill_paged cuda sm80 out-fp16
batch_prefill_paged cuda sm80 causal
batch_prefill_paged cuda sm80 custom
batch_prefill_paged cuda sm80 window
batch_prefill_paged cuda sm80 softcap
batch_prefill_paged cuda sm80 alibi
batch_prefill_paged cuda sm80 rope
batch_prefill_paged cuda sm80 sinks
batch_prefill_paged cuda sm80 fp8-scales
batch_prefill_paged cuda sm80 d64
batch_prefill_paged cuda sm80 d256
batch_prefill_paged cuda sm80 d192x128
batch_prefill_paged cuda sm80 mha
batch_prefill_paged cuda sm80 hnd
batch_prefill_paged cuda sm80 qlen4
batch_prefill_paged cuda sm80 spec
batch_prefill_paged cuda sm80 graph
batch_prefill_paged cuda sm80 page1
batch_prefill_paged cuda sm100 base
batch_prefill_paged cuda sm100 fp16
batch_prefill_paged cuda sm100 fp32
batch_prefill_paged cuda sm100 kv-e4m3
batch_prefill_paged cuda sm100 kv-e4m3-out-e4m3
batch_prefill_paged cuda sm100 out-fp16
batch_prefill_paged cuda sm100 causal
batch_prefill_paged cuda sm100 custom
batch_prefill_paged cuda sm100 window
batch_prefill_paged cuda sm100 softcap
batch_prefill_paged cuda sm100 alibi
batch_prefill_paged cuda sm100 rope
batch_prefill_paged cuda sm100 sinks
batch_prefill_paged cuda sm100 fp8-scales
batch_prefill_paged cuda sm100 d64
batch_prefill_paged cuda sm100 d256
batch_prefill_paged cuda sm100 d192x128
batch_prefill_paged cuda sm100 mha
batch_prefill_paged cuda sm100 hnd
batch_prefill_paged cuda sm100 qlen4
batch_prefill_paged cuda sm100 spec
batch_prefill_paged cuda sm100 graph
batch_prefill_paged cuda sm100 page1
batch_decode cuda sm80 base
batch_decode cuda sm80 fp16
batch_decode cuda sm80 fp32
batch_decode cuda sm80 kv-e4m3
batch_decode cuda sm80 kv-e4m3-out-e4m3
batch_decode cuda sm80 out-fp16
batch_decode cuda sm80 causal
batch_decode cuda sm80 custom
batch_decode cuda sm80 window
batch_decode cuda sm80 softcap
batch_decode cuda sm80 alibi
batch_decode cuda sm80 rope
batch_decode cuda sm80 sinks
batch_decode cuda sm80 fp8-scales
batch_decode cuda sm80 d64
batch_decode cuda sm80 d256
batch_decode cuda sm80 d192x128
batch_decode cuda sm80 mha
batch_decode cuda sm80 hnd
batch_decode cuda sm80 qlen4
batch_decode cuda sm80 spec
batch_decode cuda sm80 graph
batch_decode cuda sm80 page1
batch_decode cuda sm100 base
batch_decode cuda sm100 fp16
batch_decode cuda sm100 fp32
batch_decode cuda sm100 kv-e4m3
batch_decode cuda sm100 kv-e4m3-out-e4m3
batch_decode cuda sm100 out-fp16
batch_decode cuda sm100 causal
batch_decode cuda sm100 custom
batch_decode cuda sm100 window
batch_decode cuda sm100 softcap
batch_decode cuda sm100 alibi
batch_decode cuda sm100 rope
batch_decode cuda sm100 sinks
batch_decode cuda sm100 fp8-scales
batch_decode cuda sm100 d64
batch_decode cuda sm100 d256
batch_decode cuda sm100 d192x128
batch_decode cuda sm100 mha
batch_decode cuda sm100 hnd
batch_decode cuda sm100 qlen4
batch_decode cuda sm100 spec
batch_decode cuda sm100 graph
batch_decode cuda sm100 page1
xqa_decode cuda sm80 base
xqa_decode cuda sm80 fp16
xqa_decode cuda sm80 fp32
xqa_decode cuda sm80 kv-e4m3
xqa_decode cuda sm80 kv-e4m3-out-e4m3
xqa_decode cuda sm80 out-fp16
xqa_decode cuda sm80 causal
xqa_decode cuda sm80 custom
xqa_decode cuda sm80 window
xqa_decode cuda sm80 softcap
xqa_decode cuda sm80 alibi
xqa_decode cuda sm80 rope
xqa_decode cuda sm80 sinks
xqa_decode cuda sm80 fp8-scales
xqa_decode cuda sm80 d64
xqa_decode cuda sm80 d256
xqa_decode cuda sm80 d192x128
xqa_decode cuda sm80 mha
xqa_decode cuda sm80 hnd
xqa_decode cuda sm80 qlen4
xqa_decode cuda sm80 spec
xqa_decode cuda sm80 graph
xqa_decode cuda sm80 page1
xqa_decode cuda sm100 base
xqa_decode cuda sm100 fp16
xqa_decode cuda sm100 fp32
xqa_decode cuda sm100 kv-e4m3
xqa_decode cuda sm100 kv-e4m3-out-e4m3
xqa_decode cuda sm100 out-fp16
xqa_decode cuda sm100 causal
xqa_decode cuda sm100 custom
xqa_decode cuda sm100 window
xqa_decode cuda sm100 softcap
xqa_decode cuda sm100 alibi
xqa_decode cuda sm100 rope
xqa_decode cuda sm100 sinks
xqa_decode cuda sm100 fp8-scales
xqa_decode cuda sm100 d64
xqa_decode cuda sm100 d256
xqa_decode cuda sm100 d192x128
xqa_decode cuda sm100 mha
xqa_decode cuda sm100 hnd
xqa_decode cuda sm100 qlen4
xqa_decode cuda sm100 spec
xqa_decode cuda sm100 graph
xqa_decode cuda sm100 page1
pod cuda sm80 base
pod cuda sm80 fp16
pod cuda sm80 fp32
pod cuda sm80 kv-e4m3
pod cuda sm80 kv-e4m3-out-e4m3
pod cuda sm80 out-fp16
pod cuda sm80 causal
pod cuda sm80 custom
pod cuda sm80 window
pod cuda sm80 softcap
pod cuda sm80 alibi
pod cuda sm80 rope
pod cuda sm80 sinks
pod cuda sm80 fp8-scales
pod cuda sm80 d64
pod cuda sm80 d256
pod cuda sm80 d192x128
pod cuda sm80 mha
pod cuda sm80 hnd
pod cuda sm80 qlen4
pod cuda sm80 spec
pod cuda sm80 graph
pod cuda sm80 page1
pod cuda sm100 base
pod cuda sm100 fp16
pod cuda sm100 fp32
pod cuda sm100 kv-e4m3
pod cuda sm100 kv-e4m3-out-e4m3
pod cuda sm100 out-fp16
pod cuda sm100 causal
pod cuda sm100 custom
pod cuda sm100 window
pod cuda sm100 softcap
pod cuda sm100 alibi
pod cuda sm100 rope
pod cuda sm100 sinks
pod cuda sm100 fp8-scales
pod cuda sm100 d64
pod cuda sm100 d256
pod cuda sm100 d192x128
pod cuda sm100 mha
pod cuda sm100 hnd
pod cuda sm100 qlen4
pod cuda sm100 spec
pod cuda sm100 graph
pod cuda sm100 page1
batch_pod cuda sm80 base
batch_pod cuda sm80 fp16
batch_pod cuda sm80 fp32
batch_pod cuda sm80 kv-e4m3
batch_pod cuda sm80 kv-e4m3-out-e4m3
batch_pod cuda sm80 out-fp16
batch_pod cuda sm80 causal
batch_pod cuda sm80 custom
batch_pod cuda sm80 window
batch_pod cuda sm80 softcap
batch_pod cuda sm80 alibi
batch_pod cuda sm80 rope
batch_pod cuda sm80 sinks
batch_pod cuda sm80 fp8-scales
batch_pod cuda sm80 d64
batch_pod cuda sm80 d256
batch_pod cuda sm80 d192x128
batch_pod cuda sm80 mha
batch_pod cuda sm80 hnd
batch_pod cuda sm80 qlen4
batch_pod cuda sm80 spec
batch_pod cuda sm80 graph
batch_pod cuda sm80 page1
batch_pod cuda sm100 base
batch_pod cuda sm100 fp16
batch_pod cuda sm100 fp32
batch_pod cuda sm100 kv-e4m3
batch_pod cuda sm100 kv-e4m3-out-e4m3
batch_pod cuda sm100 out-fp16
batch_pod cuda sm100 causal
batch_pod cuda sm100 custom
batch_pod cuda sm100 window
batch_pod cuda sm100 softcap
batch_pod cuda sm100 alibi
batch_pod cuda sm100 rope
batch_pod cuda sm100 sinks
batch_pod cuda sm100 fp8-scales
batch_pod cuda sm100 d64
batch_pod cuda sm100 d256
batch_pod cuda sm100 d192x128
batch_pod cuda sm100 mha
batch_pod cuda sm100 hnd
batch_pod cuda sm100 qlen4
batch_pod cuda sm100 spec
batch_pod cuda sm100 graph
batch_pod cuda sm100 page1
""",
    'cuda_fa2 0 > reference 0 > xqa 0 > sdpa -1 > triton -1': """
single_prefill cpu base
single_prefill cpu fp16
single_prefill cpu fp32
single_prefill cpu kv-e4m3
single_prefill cpu kv-e4m3-out-e4m3
single_prefill cpu out-fp16
single_prefill cpu causal
single_prefill cpu causal-lse
single_prefill cpu lse
single_prefill cpu custom
single_prefill cpu window
single_prefill cpu softcap
single_prefill cpu alibi
single_prefill cpu rope
single_prefill cpu sinks
single_prefill cpu fp8-scales
single_prefill cpu d64
single_prefill cpu d256
single_prefill cpu d192x128
single_prefill cpu mha
single_prefill cpu hnd
single_prefill cpu qlen4
single_prefill cpu spec
single_prefill cpu graph
batch_prefill_ragged cpu base
batch_prefill_ragged cpu fp16
batch_prefill_ragged cpu fp32
batch_prefill_ragged cpu kv-e4m3
batch_prefill_ragged cpu kv-e4m3-out-e4m3
batch_prefill_ragged cpu out-fp16
batch_prefill_ragged cpu causal
batch_prefill_ragged cpu causal-lse
batch_prefill_ragged cpu lse
batch_prefill_ragged cpu custom
batch_prefill_ragged cpu window
batch_prefill_ragged cpu softcap
batch_prefill_ragged cpu alibi
batch_prefill_ragged cpu rope
batch_prefill_ragged cpu sinks
batch_prefill_ragged cpu fp8-scales
batch_prefill_ragged cpu d64
batch_prefill_ragged cpu d256
batch_prefill_ragged cpu d192x128
batch_prefill_ragged cpu mha
batch_prefill_ragged cpu hnd
batch_prefill_ragged cpu qlen4
batch_prefill_ragged cpu spec
batch_prefill_ragged cpu graph
batch_prefill_paged cpu base
batch_prefill_paged cpu fp16
batch_prefill_paged cpu fp32
batch_prefill_paged cpu kv-e4m3
batch_prefill_paged cpu kv-e4m3-out-e4m3
batch_prefill_paged cpu out-fp16
batch_prefill_paged cpu causal
batch_prefill_paged cpu causal-lse
batch_prefill_paged cpu lse
batch_prefill_paged cpu custom
batch_prefill_paged cpu window
batch_prefill_paged cpu softcap
batch_prefill_paged cpu alibi
batch_prefill_paged cpu rope
batch_prefill_paged cpu sinks
batch_prefill_paged cpu fp8-scales
batch_prefill_paged cpu d64
batch_prefill_paged cpu d256
batch_prefill_paged cpu d192x128
batch_prefill_paged cpu mha
batch_prefill_paged cpu hnd
batch_prefill_paged cpu qlen4
batch_prefill_paged cpu spec
batch_prefill_paged cpu graph
batch_prefill_paged cpu page1
batch_decode cpu base
batch_decode cpu fp16
batch_decode cpu fp32
batch_decode cpu kv-e4m3
batch_decode cpu kv-e4m3-out-e4m3
batch_decode cpu out-fp16
batch_decode cpu causal
batch_decode cpu causal-lse
batch_decode cpu lse
batch_decode cpu custom
batch_decode cpu window
batch_decode cpu softcap
batch_decode cpu alibi
batch_decode cpu rope
batch_decode cpu sinks
batch_decode cpu fp8-scales
batch_decode cpu d64
batch_decode cpu d256
batch_decode cpu d192x128
batch_decode cpu mha
batch_decode cpu hnd
batch_decode cpu qlen4
batch_decode cpu spec
batch_decode cpu graph
batch_decode cpu page1
xqa_decode cpu base
xqa_decode cpu fp16
xqa_decode cpu fp32
xqa_decode cpu kv-e4m3
xqa_decode cpu kv-e4m3-out-e4m3
xqa_decode cpu out-fp16
xqa_decode cpu causal
xqa_decode cpu causal-lse
xqa_decode cpu lse
xqa_decode cpu custom
xqa_decode cpu window
xqa_decode cpu softcap
xqa_decode cpu alibi
xqa_decode cpu rope
xqa_decode cpu sinks
xqa_decode cpu fp8-scales
xqa_decode cpu d64
xqa_decode cpu d256
xqa_decode cpu d192x128
xqa_decode cpu mha
xqa_decode cpu hnd
xqa_decode cpu qlen4
xqa_decode cpu spec
xqa_decode cpu graph
xqa_decode cpu page1
pod cpu base
pod cpu fp16
pod cpu fp32
pod cpu kv-e4m3
pod cpu kv-e4m3-out-e4m3
pod cpu out-fp16
pod cpu causal
pod cpu causal-lse
pod cpu lse
pod cpu custom
pod cpu window
pod cpu softcap
pod cpu alibi
pod cpu rope
pod cpu sinks
pod cpu fp8-scales
pod cpu d64
pod cpu d256
pod cpu d192x128
pod cpu mha
pod cpu hnd
pod cpu qlen4
pod cpu spec
pod cpu graph
pod cpu page1
batch_pod cpu base
batch_pod cpu fp16
batch_pod cpu fp32
batch_pod cpu kv-e4m3
batch_pod cpu kv-e4m3-out-e4m3
batch_pod cpu out-fp16
batch_pod cpu causal
batch_pod cpu causal-lse
batch_pod cpu lse
batch_pod cpu custom
batch_pod cpu window
batch_pod cpu softcap
batch_pod cpu alibi
batch_pod cpu rope
batch_pod cpu sinks
batch_pod cpu fp8-scales
batch_pod cpu d64
batch_pod cpu d256
batch_pod cpu d192x128
batch_pod cpu mha
batch_pod cpu hnd
batch_pod cpu qlen4
batch_pod cpu spec
batch_pod cpu graph
batch_pod cpu page1
""",
    'xqa 70 > sdpa 55 > triton 50 > cuda_fa2 40 > reference 0': """
single_prefill cuda sm90 kv-e4m3
single_prefill cuda sm90 kv-e4m3-out-e4m3
single_prefill cuda sm90 custom
single_prefill cuda sm90 window
single_prefill cuda sm90 softcap
single_prefill cuda sm90 alibi
single_prefill cuda sm90 rope
batch_prefill_ragged cuda sm90 kv-e4m3
batch_prefill_ragged cuda sm90 kv-e4m3-out-e4m3
batch_prefill_ragged cuda sm90 custom
batch_prefill_ragged cuda sm90 window
batch_prefill_ragged cuda sm90 softcap
batch_prefill_ragged cuda sm90 alibi
batch_prefill_ragged cuda sm90 rope
batch_prefill_paged cuda sm90 kv-e4m3
batch_prefill_paged cuda sm90 kv-e4m3-out-e4m3
batch_prefill_paged cuda sm90 custom
batch_prefill_paged cuda sm90 window
batch_prefill_paged cuda sm90 softcap
batch_prefill_paged cuda sm90 alibi
batch_prefill_paged cuda sm90 rope
batch_prefill_paged cuda sm90 base ATTNCORE_FA2_SM90=0
batch_prefill_paged cuda sm90 causal ATTNCORE_FA2_SM90=0
batch_prefill_paged cuda sm90 d64 ATTNCORE_FA2_SM90=0
batch_decode cuda sm90 base
batch_decode cuda sm90 fp16
batch_decode cuda sm90 fp32
batch_decode cuda sm90 kv-e4m3
batch_decode cuda sm90 kv-e4m3-out-e4m3
batch_decode cuda sm90 out-fp16
batch_decode cuda sm90 causal
batch_decode cuda sm90 custom
batch_decode cuda sm90 window
batch_decode cuda sm90 softcap
batch_decode cuda sm90 alibi
batch_decode cuda sm90 rope
batch_decode cuda sm90 sinks
batch_decode cuda sm90 fp8-scales
batch_decode cuda sm90 d64
batch_decode cuda sm90 d256
batch_decode cuda sm90 d192x128
batch_decode cuda sm90 mha
batch_decode cuda sm90 hnd
batch_decode cuda sm90 qlen4
batch_decode cuda sm90 spec
batch_decode cuda sm90 graph
batch_decode cuda sm90 page1
batch_decode cuda sm90 base ATTNCORE_FA2_SM90=0
batch_decode cuda sm90 causal ATTNCORE_FA2_SM90=0
batch_decode cuda sm90 d64 ATTNCORE_FA2_SM90=0
xqa_decode cuda sm90 base
xqa_decode cuda sm90 fp16
xqa_decode cuda sm90 fp32
xqa_decode cuda sm90 kv-e4m3
xqa_decode cuda sm90 kv-e4m3-out-e4m3
xqa_decode cuda sm90 out-fp16
xqa_decode cuda sm90 causal
xqa_decode cuda sm90 custom
xqa_decode cuda sm90 window
xqa_decode cuda sm90 softcap
xqa_decode cuda sm90 alibi
xqa_decode cuda sm90 rope
xqa_decode cuda sm90 sinks
xqa_decode cuda sm90 fp8-scales
xqa_decode cuda sm90 d64
xqa_decode cuda sm90 d256
xqa_decode cuda sm90 d192x128
xqa_decode cuda sm90 mha
xqa_decode cuda sm90 hnd
xqa_decode cuda sm90 qlen4
xqa_decode cuda sm90 spec
xqa_decode cuda sm90 graph
xqa_decode cuda sm90 page1
xqa_decode cuda sm90 base ATTNCORE_FA2_SM90=0
xqa_decode cuda sm90 causal ATTNCORE_FA2_SM90=0
xqa_decode cuda sm90 d64 ATTNCORE_FA2_SM90=0
""",
    'xqa 70 > sdpa 55 > cuda_fa2 52 > triton 50 > reference 0': """
batch_prefill_paged cuda sm90 d192x128
batch_prefill_ragged cuda sm90 d192x128
batch_prefill_paged cuda sm90 d256
batch_prefill_ragged cuda sm90 fp32
batch_prefill_ragged cuda sm90 out-fp16
batch_prefill_ragged cuda sm90 spec
batch_prefill_paged cuda sm90 base
batch_prefill_paged cuda sm90 fp16
batch_prefill_paged cuda sm90 fp32
batch_prefill_paged cuda sm90 out-fp16
batch_prefill_paged cuda sm90 causal
batch_prefill_paged cuda sm90 sinks
batch_prefill_paged cuda sm90 fp8-scales
batch_prefill_paged cuda sm90 d64
batch_prefill_paged cuda sm90 mha
batch_prefill_paged cuda sm90 hnd
batch_prefill_paged cuda sm90 qlen4
batch_prefill_paged cuda sm90 spec
batch_prefill_paged cuda sm90 graph
batch_prefill_paged cuda sm90 page1
""",
    'xqa 70 > sdpa 55 > triton 53 > cuda_fa2 52 > reference 0': """
batch_prefill_ragged cuda sm90 d256
batch_prefill_ragged cuda sm90 base
batch_prefill_ragged cuda sm90 fp16
batch_prefill_ragged cuda sm90 causal
batch_prefill_ragged cuda sm90 sinks
batch_prefill_ragged cuda sm90 fp8-scales
batch_prefill_ragged cuda sm90 d64
batch_prefill_ragged cuda sm90 mha
batch_prefill_ragged cuda sm90 hnd
batch_prefill_ragged cuda sm90 qlen4
batch_prefill_ragged cuda sm90 graph
""",
    'xqa 70 > triton 50 > cuda_fa2 40 > sdpa 5 > reference 0': """
batch_decode cuda sm90 causal-lse
batch_decode cuda sm90 lse
xqa_decode cuda sm90 causal-lse
xqa_decode cuda sm90 lse
""",
    'xqa 70 > sdpa 55 > triton 53 > cuda_fa2 40 > reference 0': """
single_prefill cuda sm90 base ATTNCORE_FA2_SM90=0
single_prefill cuda sm90 causal ATTNCORE_FA2_SM90=0
single_prefill cuda sm90 d64 ATTNCORE_FA2_SM90=0
batch_prefill_ragged cuda sm90 base ATTNCORE_FA2_SM90=0
batch_prefill_ragged cuda sm90 causal ATTNCORE_FA2_SM90=0
batch_prefill_ragged cuda sm90 d64 ATTNCORE_FA2_SM90=0
""",
    'xqa 70 > triton 53 > cuda_fa2 52 > sdpa 5 > reference 0': """
batch_prefill_ragged cuda sm90 causal-lse
batch_prefill_ragged cuda sm90 lse
""",
    'xqa 70 > cuda_fa2 52 > triton 50 > sdpa 5 > reference 0': """
batch_prefill_paged cuda sm90 causal-lse
batch_prefill_paged cuda sm90 lse
""",
    'xqa 70 > sdpa 55 > cuda_fa2 54 > triton 53 > reference 0': """
single_prefill cuda sm90 d256
single_prefill cuda sm90 base
single_prefill cuda sm90 fp16
single_prefill cuda sm90 causal
single_prefill cuda sm90 sinks
single_prefill cuda sm90 fp8-scales
single_prefill cuda sm90 d64
single_prefill cuda sm90 mha
single_prefill cuda sm90 hnd
single_prefill cuda sm90 qlen4
single_prefill cuda sm90 graph
""",
    'xqa 70 > sdpa 55 > cuda_fa2 54 > triton 50 > reference 0': """
single_prefill cuda sm90 d192x128
single_prefill cuda sm90 fp32
single_prefill cuda sm90 out-fp16
single_prefill cuda sm90 spec
""",
    'xqa 70 > cuda_fa2 54 > triton 53 > sdpa 5 > reference 0': """
single_prefill cuda sm90 causal-lse
single_prefill cuda sm90 lse
""",
    'xqa 70 > cuda_fa2 56 > sdpa 55 > triton 50 > reference 0': """
pod cuda sm90 base
pod cuda sm90 fp16
pod cuda sm90 fp32
pod cuda sm90 kv-e4m3
pod cuda sm90 kv-e4m3-out-e4m3
pod cuda sm90 out-fp16
pod cuda sm90 causal
pod cuda sm90 custom
pod cuda sm90 window
pod cuda sm90 softcap
pod cuda sm90 alibi
pod cuda sm90 rope
pod cuda sm90 sinks
pod cuda sm90 fp8-scales
pod cuda sm90 d64
pod cuda sm90 d256
pod cuda sm90 d192x128
pod cuda sm90 mha
pod cuda sm90 hnd
pod cuda sm90 qlen4
pod cuda sm90 spec
pod cuda sm90 graph
pod cuda sm90 page1
pod cuda sm90 base ATTNCORE_FA2_SM90=0
pod cuda sm90 causal ATTNCORE_FA2_SM90=0
pod cuda sm90 d64 ATTNCORE_FA2_SM90=0
batch_pod cuda sm90 base
batch_pod cuda sm90 fp16
batch_pod cuda sm90 fp32
batch_pod cuda sm90 kv-e4m3
batch_pod cuda sm90 kv-e4m3-out-e4m3
batch_pod cuda sm90 out-fp16
batch_pod cuda sm90 causal
batch_pod cuda sm90 custom
batch_pod cuda sm90 window
batch_pod cuda sm90 softcap
batch_pod cuda sm90 alibi
batch_pod cuda sm90 rope
batch_pod cuda sm90 sinks
batch_pod cuda sm90 fp8-scales
batch_pod cuda sm90 d64
batch_pod cuda sm90 d256
batch_pod cuda sm90 d192x128
batch_pod cuda sm90 mha
batch_pod cuda sm90 hnd
batch_pod cuda sm90 qlen4
batch_pod cuda sm90 spec
batch_pod cuda sm90 graph
batch_pod cuda sm90 page1
batch_pod cuda sm90 base ATTNCORE_FA2_SM90=0
batch_pod cuda sm90 causal ATTNCORE_FA2_SM90=0
batch_pod cuda sm90 d64 ATTNCORE_FA2_SM90=0
""",
    'xqa 70 > cuda_fa2 56 > triton 50 > sdpa 5 > reference 0': """
pod cuda sm90 causal-lse
pod cuda sm90 lse
batch_pod cuda sm90 causal-lse
batch_pod cuda sm90 lse
""",
}
