"""Triton's fused POD op in CUDA-graph mode (issue 16).

CPU (Triton's interpreter): the conformance suite's POD graph cases (``attncore.testing.runner.pod_graph_errors``)
with the capture emulated: plan A's launcher, prepared by its first run, is what a capture bakes in; with B's index
tables in A's fixed buffers and B's inputs in A's tensors it must pass B's golden check, before the fused op is
planned again (as the POD wrapper's plan() leaves it) and after plan B, and equal an eager run of plan B, whose
launch must bake in the same grid, pointers and scalars.  Also: re-plans fuse once the caller's first graph-mode
plan fused, a re-plan needing more work items than the captured capacity is an error naming it, fewer items pad
the captured grid, and the tables are views of the caller's int workspace.  On a GPU the same cases are captured
for real (``attncore conformance triton --attncore-device cuda -k "pod and graph"``), and the POD wrapper's capture
is tests/test_pod_streams.py's graph test (``[fused]``).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from attncore.backends.triton import pod as tpod  # noqa: E402
from attncore.backends.triton.kernels import pod as kpod  # noqa: E402
from attncore.core.problem import PODBatch, PODDeclined, PODRunArgs, pod_parts  # noqa: E402
from attncore.testing import cases, inputs, runner  # noqa: E402
from test_triton_graphs import _record  # noqa: E402

cpu_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests")


def _backend(**kw):
    be = tpod.TritonPODBackend(pod="always", **kw)
    be.name = "triton"
    return be


def _graph_cases():
    fams = cases.generate(_backend(), device="cpu")
    return [c for c in fams["cuda_graph"] if c.problem.op in ("pod", "batch_pod")]


CASES = _graph_cases() if os.environ.get("TRITON_INTERPRET") == "1" else []


def _emulated_capture(be, plan, args):
    """What a capture bakes in: the launcher plan A's first run prepared, with A's tensors."""
    be.run(plan, args)
    launch = next(iter(plan.launch_cache.values()))
    tensors = tuple((a.q, a.k, a.v, a.out, a.lse, a.sinks) for a in (args.prefill, args.decode))
    return lambda: launch(*tensors)


@cpu_only
def test_every_pod_graph_case_is_generated():
    ids = {c.id for c in CASES}
    assert len(ids) == 2 * (2 + len(cases.POD_GRAPH_FEATURES)), sorted(ids)


@cpu_only
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_pod_graph_replan_replays_on_cpu(case, monkeypatch):
    log = _record(monkeypatch, (kpod,))
    be = _backend()
    errs = runner.pod_graph_errors(be, case.problem, case.tag, case.seed, "cpu", _emulated_capture)
    assert not errs, errs
    # launches: plan A's first run, the two "replays", plan B's eager run; B's bakes in what A's did
    assert len(log) == 4, len(log)
    assert log[3] == log[0], "plan B's launch differs from the captured plan A's"


def _base():
    """The plain POD graph case's problem (a single causal prefill beside a paged decode in graph mode)."""
    return next(c.problem for c in CASES if c.problem.op == "pod" and c.id.endswith("-graph-edge"))


def _parts(p, decode_kv, prefill=24, seed=1):
    """Both parts' inputs: a single prefill of ``prefill`` tokens, one decode row per ``decode_kv`` entry."""
    pp, pd = pod_parts(p)
    return (inputs.build(pp, "", seed, "cpu", shapes=([prefill], [prefill])),
            inputs.build(pd, "", seed + 1, "cpu", shapes=([1] * len(decode_kv), decode_kv), min_pages=64,
                         min_bt_width=16))


def _plan(be, p, bp, bd, fixed):
    """Plan both parts with their index tensors in the caller's fixed buffers (``fixed``: one dict per part)."""
    return be.plan(p, PODBatch(runner._into_fixed(bp.meta, fixed[0]), runner._into_fixed(bd.meta, fixed[1])))


def _check(be, plan, bp, bd):
    be.run(plan, PODRunArgs(prefill=bp.args, decode=bd.args))
    errs = runner.check_result(bp, inputs.expected(bp)) + runner.check_result(bd, inputs.expected(bd))
    assert not errs, errs


@cpu_only
def test_replans_fuse_once_the_first_graph_plan_fused():
    # auto composes what its model says would not gain; once the caller's first graph-mode plan fused (its captured
    # launch is fused), a re-plan that the model would compose fuses too, into the same tables and grid
    be = tpod.TritonPODBackend()
    p = _base()
    big = _parts(p, [30, 1500])  # one long decode: split-KV (composed) would win
    with pytest.raises(PODDeclined, match="needs split-KV"):
        be.plan(p.replace(decode=p.decode.replace(cuda_graph=False)), PODBatch(big[0].meta, big[1].meta))
    fixed = ({}, {})
    try:
        plan_a = _plan(be, p, *_parts(p, [200, 180]), fixed)
    except PODDeclined as e:
        pytest.fail(f"this batch must fuse: {e}")
    plan_b = _plan(be, p, *big, fixed)
    assert plan_b.graph is plan_a.graph and plan_b.work.data_ptr() == plan_a.work.data_ptr()
    assert plan_b.num_programs == plan_a.num_programs
    _check(be, plan_b, *big)


@cpu_only
def test_replan_with_more_items_than_captured_names_the_capacity():
    be, p, fixed = _backend(), _base(), ({}, {})
    _plan(be, p, *_parts(p, [3, 5]), fixed)
    with pytest.raises(ValueError, match=r"triton pod: this CUDA-graph plan needs \d+ work items, more than the "
                                         r"capacity \d+ fixed at the first graph-mode plan"):
        _plan(be, p, *_parts(p, [3, 5], prefill=200), fixed)


@cpu_only
@pytest.mark.parametrize("mode", ["grid", "persistent"])
def test_fewer_items_pad_the_captured_grid(mode):
    be, p, fixed = _backend(pod_mode=mode), _base(), ({}, {})
    plan_a = _plan(be, p, *_parts(p, [3, 5, 7]), fixed)
    parts_b = _parts(p, [3, 5, 7], prefill=8)  # fewer prefill row tiles
    plan_b = _plan(be, p, *parts_b, fixed)
    assert plan_b.num_programs == plan_a.num_programs and plan_b.offs.numel() == plan_a.offs.numel()
    offs, n = plan_b.offs.tolist(), sum(plan_b.stats["items"])
    assert offs[-1] == n and offs == sorted(offs) and n < sum(plan_a.stats["items"])
    _check(be, plan_b, *parts_b)


@cpu_only
@pytest.mark.parametrize("graph", [False, True])
def test_tables_are_views_of_the_int_workspace(graph):
    p = _base()
    p = p.replace(pos_encoding="ALIBI", decode=p.decode.replace(pos_encoding="ALIBI", cuda_graph=graph))
    bp, bd = _parts(p, [3, 5])
    iws = torch.zeros(1 << 16, dtype=torch.uint8)
    bd.meta.int_workspace = iws
    be = _backend()
    plan = be.plan(p, PODBatch(bp.meta, bd.meta))
    lo, hi = iws.data_ptr(), iws.data_ptr() + iws.numel()
    for t in (plan.work, plan.offs, plan.slopes):
        assert lo <= t.data_ptr() < hi
    _check(be, plan, bp, bd)

