"""The conformance suite's CUDA-graph family covers every feature, mask and KV dtype a backend claims in graph
mode, one at a time on the op's base problem (issue 15: replay equals eager for every op x backend x feature
claimed).  Generation only: replay needs a GPU (runner.run_cuda_graph)."""

import dataclasses

from attncore.reference.backend import ReferenceBackend
from attncore.testing import cases


class _GraphClaimer(ReferenceBackend):
    """The reference's capabilities, plus CUDA graphs (claimed here on the CPU so that cases are generated)."""
    name = "graph_claimer"
    capabilities = tuple(dataclasses.replace(c, features=c.features | {"cuda_graph"}, devices=frozenset({"cpu"}))
                         for c in ReferenceBackend.capabilities)


class _NoRopeInGraphs(_GraphClaimer):
    name = "graph_claimer_norope"
    capabilities = tuple(dataclasses.replace(c, features=c.features - {"rope"}) for c in _GraphClaimer.capabilities)


def _graph_cases(backend):
    fams = cases.generate(backend, device="cpu")
    return fams["cuda_graph"]


def test_every_claimed_feature_mask_and_kv_dtype_gets_a_graph_case_per_op():
    got = _graph_cases(_GraphClaimer())
    assert got and all(c.problem.cuda_graph for c in got)
    for op in ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode"):
        ps = [c.problem for c in got if c.problem.op == op]
        assert ps, op
        seen = {
            "lse": any(p.return_lse for p in ps),
            "window": any(p.window_left >= 0 for p in ps),
            "soft_cap": any(p.soft_cap for p in ps),
            "alibi": any(p.pos_encoding == "ALIBI" for p in ps),
            "rope": any(p.pos_encoding == "ROPE_LLAMA" for p in ps),
            "sinks": any(p.sinks for p in ps),
            "fp8_scales": any(p.fp8_scales for p in ps),
            "custom mask": any(p.mask == "custom" for p in ps),
            "fp8 kv": any(p.kv_dtype.itemsize == 1 for p in ps),
        }
        assert all(seen.values()), (op, [k for k, v in seen.items() if not v])


def test_a_feature_not_claimed_in_graph_mode_gets_no_graph_case():
    got = _graph_cases(_NoRopeInGraphs())
    assert got and not any(c.problem.pos_encoding == "ROPE_LLAMA" for c in got)
