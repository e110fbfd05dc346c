"""The conformance suite must catch broken backends, each with a named failing case.

Every fake wraps the reference backend and breaks one thing; the suite runs in a subprocess on it
(``--attncore-backend module:attr``) and we read the per-case outcome from its JUnit XML.
"""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

FAKES = textwrap.dedent('''
    import math
    import torch
    from attncore.core.backend import Backend
    from attncore.core.capabilities import Capabilities
    from attncore.reference.backend import ReferenceBackend

    CAPS = (Capabilities(ops=frozenset({"single_prefill", "batch_prefill_ragged"}), devices=frozenset({"cpu"}),
                         q_dtypes=frozenset({torch.float16}), kv_dtypes=frozenset({torch.float16}),
                         head_dims=frozenset({64}), max_group_size=2, layouts=frozenset({"NHD"}),
                         masks=frozenset({"none", "causal"}), features=frozenset({"return_lse"})),)

    class _Fake(ReferenceBackend):
        capabilities = CAPS
        def extra_reasons(self, problem):
            return []

    class WrongNumbers(_Fake):
        name = "fake_wrong"
        def run(self, plan, args):
            super().run(plan, args)
            args.out.mul_(1.02)

    class MissingRefusal(_Fake):
        """Claims sinks (forgot to refuse them) and silently ignores them."""
        name = "fake_nosinks"
        capabilities = (CAPS[0].__class__(**{**CAPS[0].__dict__, "features": frozenset({"return_lse", "sinks"})}),)
        def run(self, plan, args):
            args.sinks = None
            super().run(plan, args)

    class Unwritten(_Fake):
        """Leaves the very last output element unwritten."""
        name = "fake_unwritten"
        def run(self, plan, args):
            tmp = torch.empty_like(args.out)
            real = args.out
            args.out = tmp
            super().run(plan, args)
            args.out = real
            real.view(-1)[:-1].copy_(tmp.view(-1)[:-1])

    class LseBaseE(_Fake):
        name = "fake_lse_e"
        def run(self, plan, args):
            super().run(plan, args)
            if args.lse is not None:
                args.lse.mul_(math.log(2.0))

    class RefusesWrongly(_Fake):
        """reasons() says no while supports() says yes (inconsistent refusal)."""
        name = "fake_supports"
        def supports(self, problem):
            return True

    class MutatesInput(_Fake):
        """Scribbles on q after computing (e.g. an in-place RoPE)."""
        name = "fake_mutates"
        def run(self, plan, args):
            super().run(plan, args)
            args.q.mul_(0.5)

    class WritesOutside(_Fake):
        """Writes one row past the end of out (an off-by-one in a tail tile)."""
        name = "fake_outside"
        def run(self, plan, args):
            super().run(plan, args)
            n = args.out.shape[0]
            torch.as_strided(args.out, (n + 1,) + tuple(args.out.shape[1:]), args.out.stride())[n].zero_()

    class GraphLiar(_Fake):
        """Claims CUDA graphs but its run() uses the host lengths of the plan it was captured with.  Mask none only:
        the reference's causal run skips key chunks its mask hides by a host check, a sync no capture allows."""
        name = "fake_graph"
        capabilities = (CAPS[0].__class__(**{**CAPS[0].__dict__, "devices": frozenset({"cuda"}),
                                             "ops": frozenset({"batch_prefill_ragged"}),
                                             "masks": frozenset({"none"}),
                                             "features": frozenset({"return_lse", "cuda_graph"})}),)

    class TileLastKey(_Fake):
        """Issue 13's Triton bug: a 64-row tile of packed (token, head) rows ends its causal keys at
        token min(row0 + 64, qo * G) // G - 1 instead of (min(row0 + 64, qo * G) - 1) // G."""
        name = "fake_tile"
        capabilities = (CAPS[0].__class__(**{**CAPS[0].__dict__, "max_group_size": 8}),)
        def plan(self, problem, meta):
            self._ptr = (list(meta.qo_indptr_host), list(meta.kv_indptr_host), problem.mask == "causal")
            return super().plan(problem, meta)
        def run(self, plan, args):
            super().run(plan, args)
            qp, kp, causal = self._ptr
            hq, hkv = args.q.shape[1], args.k.shape[1]
            g = hq // hkv
            for i in range(len(qp) - 1):
                qo, kv = qp[i + 1] - qp[i], kp[i + 1] - kp[i]
                if not causal or qo == 0 or kv == 0:
                    continue
                q = args.q[qp[i]:qp[i + 1]].float()
                k = args.k[kp[i]:kp[i + 1]].float().repeat_interleave(g, 1)
                v = args.v[kp[i]:kp[i + 1]].float().repeat_interleave(g, 1)
                s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
                tok = torch.arange(qo)[:, None]
                key = torch.arange(kv)[None, :]
                keep = (key <= tok + kv - qo)[None].repeat(hq, 1, 1)
                for h in range(hq):  # packed row of (token t, head h): (h // g) * qo * g + t * g + h % g
                    rows = torch.arange(qo) * g + h % g
                    last = torch.clamp(rows // 64 * 64 + 64, max=qo * g) // g - 1
                    keep[h] &= key <= last[:, None] + kv - qo
                s = s.masked_fill(~keep, float("-inf"))
                o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).nan_to_num(0.0), v)
                args.out[qp[i]:qp[i + 1]] = o.to(args.out.dtype)

    class NanRowsLookEmpty(_Fake):
        """A row whose query holds NaN reported as a row that saw no key: out 0, LSE -inf."""
        name = "fake_nanrow"
        def run(self, plan, args):
            super().run(plan, args)
            bad = torch.isnan(args.out).any(-1)
            args.out[bad] = 0
            if args.lse is not None:
                args.lse[bad] = float("-inf")

    class ClaimsNothing(Backend):
        """Lists an op, but no dtype: every problem of it is refused."""
        name = "fake_nothing"
        capabilities = (Capabilities(ops=frozenset({"pod"}), q_dtypes=frozenset()),)

    class PodDecodeOffByOne(Backend):
        """A fused POD op whose decode part drops each request's last key (the prefill part is right)."""
        name = "fake_pod"
        capabilities = (Capabilities(ops=frozenset({"pod"}), devices=frozenset({"cpu"}),
                                     q_dtypes=frozenset({torch.float16}), kv_dtypes=frozenset({torch.float16}),
                                     head_dims=frozenset({64}), layouts=frozenset({"NHD"}),
                                     masks=frozenset({"none", "causal"}), features=frozenset({"return_lse"})),)
        def plan(self, problem, batch):
            from attncore.core.problem import pod_parts
            ref = ReferenceBackend()
            pp, pd = pod_parts(problem)
            last = batch.decode.kv_lens_host
            short = batch.decode.__class__(**{**batch.decode.__dict__, "kv_lens_host": [max(0, n - 1) for n in last],
                                              "kv_lens": None, "mask": None})
            return ref, ref.plan(pp, batch.prefill), ref.plan(pd, short)
        def run(self, plan, args):
            ref, pp, pd = plan
            ref.run(pp, args.prefill)
            ref.run(pd, args.decode)

    class KnownBad(WrongNumbers):
        name = "fake_known"
        known_failures = {"fake_known-single_prefill": "declared broken"}
''')


def _run_suite(tmp_path, target, *extra):
    (tmp_path / "conformance_fakes.py").write_text(FAKES)
    xml = tmp_path / f"{target}.xml"
    env = dict(os.environ, PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "attncore.testing.test_conformance",
           "--attncore-backend", f"conformance_fakes:{target}", "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}", "--attncore-budget", "2", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert xml.exists(), proc.stdout + proc.stderr
    outcomes = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        name = tc.get("name")
        status, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                status, msg = "failed", child.get("message", "") + (child.text or "")
            elif child.tag == "skipped":
                status = "xfailed" if "xfail" in (child.get("type", "") + child.get("message", "")) else "skipped"
                msg = child.get("message", "")
        outcomes[name] = (status, msg)
    return proc, outcomes


def _failed(outcomes, test=None):
    return {n: m for n, (s, m) in outcomes.items() if s == "failed" and (test is None or n.startswith(test))}


def test_wrong_numbers_fail_named_cases(tmp_path):
    proc, out = _run_suite(tmp_path, "WrongNumbers")
    assert proc.returncode == 1
    failed = _failed(out, "test_numerics")
    assert "test_numerics[fake_wrong-single_prefill-fp16-d64-g1-none]" in failed, sorted(out)
    assert "test_numerics[fake_wrong-batch_prefill_ragged-fp16-d64-g1-causal-edge]" in failed
    assert "golden" in failed["test_numerics[fake_wrong-single_prefill-fp16-d64-g1-none]"]
    # one-token requests give out = v exactly; 1.02 x v is caught too
    assert "test_numerics[fake_wrong-single_prefill-fp16-d64-g1-none-tok1]" in failed


def test_missing_refusal_is_caught_on_the_claimed_feature(tmp_path):
    proc, out = _run_suite(tmp_path, "MissingRefusal")
    assert proc.returncode == 1
    failed = _failed(out, "test_numerics")
    assert failed, out
    assert all("sinks" in n for n in failed), sorted(failed)
    assert "test_numerics[fake_nosinks-single_prefill-fp16-d64-g1-none-sinks]" in failed
    assert out["test_numerics[fake_nosinks-single_prefill-fp16-d64-g1-none]"][0] == "passed"


def test_unwritten_output_element_is_caught(tmp_path):
    proc, out = _run_suite(tmp_path, "Unwritten", "-k", "numerics")
    assert proc.returncode == 1
    failed = _failed(out, "test_numerics")
    msg = failed["test_numerics[fake_unwritten-single_prefill-fp16-d64-g1-none]"]
    assert "NaN" in msg


def test_lse_in_base_e_is_caught(tmp_path):
    proc, out = _run_suite(tmp_path, "LseBaseE")
    assert proc.returncode == 1
    failed = _failed(out)
    lse_fail = failed["test_numerics[fake_lse_e-single_prefill-fp16-d64-g1-none-lse]"]
    assert "base 2" in lse_fail
    assert any(n.startswith("test_lse_merge") for n in failed)
    assert out["test_numerics[fake_lse_e-single_prefill-fp16-d64-g1-none]"][0] == "passed"


def test_inconsistent_refusal_is_caught(tmp_path):
    proc, out = _run_suite(tmp_path, "RefusesWrongly", "-k", "refusal")
    assert proc.returncode == 1
    failed = _failed(out, "test_refusal")
    assert "test_refusal[fake_supports-single_prefill-fp16-d128-g1-none]" in failed
    assert "supports() is True" in failed["test_refusal[fake_supports-single_prefill-fp16-d128-g1-none]"]


def test_pod_part_bug_is_caught_naming_the_part(tmp_path):
    proc, out = _run_suite(tmp_path, "PodDecodeOffByOne", "-k", "test_pod")
    assert proc.returncode == 1
    failed = _failed(out, "test_pod")
    assert failed and all("decode part: request" in m for m in failed.values()), failed
    assert not any("prefill part" in m for m in failed.values())


def test_backend_with_nothing_to_test_fails(tmp_path):
    proc, out = _run_suite(tmp_path, "ClaimsNothing")
    assert proc.returncode == 1
    assert "test_suite_status[fake_nothing-no-cases]" in _failed(out)


def test_known_failures_show_as_xfail(tmp_path):
    proc, out = _run_suite(tmp_path, "KnownBad", "-k", "numerics and single_prefill")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert out["test_numerics[fake_known-single_prefill-fp16-d64-g1-none]"][0] == "xfailed"


def test_input_mutation_is_caught(tmp_path):
    proc, out = _run_suite(tmp_path, "MutatesInput", "-k", "numerics and single_prefill")
    assert proc.returncode == 1
    msg = _failed(out)["test_numerics[fake_mutates-single_prefill-fp16-d64-g1-none]"]
    assert "modified by run()" in msg


def test_write_outside_out_is_caught(tmp_path):
    proc, out = _run_suite(tmp_path, "WritesOutside", "-k", "numerics and single_prefill")
    assert proc.returncode == 1
    msg = _failed(out)["test_numerics[fake_outside-single_prefill-fp16-d64-g1-none]"]
    assert "outside `out`" in msg


@pytest.mark.gpu
def test_cuda_graph_that_bakes_plan_lengths_is_caught(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    proc, out = _run_suite(tmp_path, "GraphLiar", "-k", "cuda_graph")
    assert proc.returncode == 1, proc.stdout[-3000:]
    failed = _failed(out, "test_cuda_graph")
    assert failed, out
    assert all("re-planned" in m for m in failed.values()), failed


def test_packed_row_tile_bug_is_caught_by_odd_groups(tmp_path):
    """Issue 13: the suite's tile-boundary cases with groups that do not divide a tile find it."""
    proc, out = _run_suite(tmp_path, "TileLastKey", "-k", "numerics")
    assert proc.returncode == 1
    failed = _failed(out, "test_numerics")
    assert failed, sorted(out)
    assert all("causal" in n for n in failed), sorted(failed)
    assert any("-g3-" in n and n.endswith("-tiles]") for n in failed), sorted(failed)
    assert out["test_numerics[fake_tile-single_prefill-fp16-d64-g1-none]"][0] == "passed"


def test_nan_query_row_reported_as_empty_is_caught(tmp_path):
    proc, out = _run_suite(tmp_path, "NanRowsLookEmpty", "-k", "nonfinite or numerics")
    assert proc.returncode == 1
    failed = _failed(out)
    assert set(failed) == {n for n in out if n.startswith("test_nonfinite")}, sorted(failed)
    assert any("must give NaN output" in m for m in failed.values())
