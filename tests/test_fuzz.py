"""``attncore check --fuzz``: the CPU slice that CI runs, replay, and a planted bug it must find."""

import subprocess
import sys

import pytest
import torch

from attncore.testing import fuzz, resolve_backend


def _cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "attncore.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("name,n", [("reference", 150), ("triton", 80)])
def test_cpu_slice_has_no_mismatch(name, n):
    backend, unavailable = resolve_backend(name)
    if unavailable:
        pytest.skip(f"{name} unavailable: {unavailable}")
    rep = fuzz.fuzz(backend, n, seed=20261123, device="cpu")
    assert rep.run == n
    assert not rep.mismatches, "\n".join(f"--replay {m.seed}: {m.problem} {m.shapes}: {m.errors}"
                                         for m in rep.mismatches[:5])


def test_problems_cover_the_claimed_axes():
    backend, _ = resolve_backend("reference")
    pools = fuzz.Pools(backend, "cpu")
    seen = {"op": set(), "group": set(), "mask": set(), "page": set(), "window": set(), "q_len": set()}
    for i in range(400):
        cfg, _ = fuzz.split_seed(fuzz.replay_seed(7, i, 400))
        p = pools.draw(__import__("random").Random(cfg))
        assert not backend.reasons(p), p.describe()
        seen["op"].add(p.op)
        seen["group"].add(p.group_size)
        seen["mask"].add(p.mask)
        seen["page"].add(p.page_size)
        seen["window"].add(p.window_left >= 0)
        seen["q_len"].add(p.q_len_per_req)
    assert seen["op"] == {"single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode",
                          "xqa_decode"}
    assert {3, 5, 6, 7, 12} <= seen["group"]
    assert seen["mask"] == {"none", "causal", "custom"}
    assert {1, 16} <= seen["page"] and seen["window"] == {True, False} and len(seen["q_len"]) > 2


def test_replay_seed_is_one_problem():
    backend, _ = resolve_backend("reference")
    pools = fuzz.Pools(backend, "cpu")
    s = fuzz.replay_seed(3, 5, 2)
    a, b = fuzz.run_one(pools, s), fuzz.run_one(pools, s)
    assert a[0] == b[0] and a[1].qo_lens == b[1].qo_lens and a[1].kv_lens == b[1].kv_lens
    assert torch.equal(a[1].out_buf.nan_to_num(7.0), b[1].out_buf.nan_to_num(7.0))
    # problems 5 and 7 of a 2-configuration run share their configuration, not their shapes
    assert fuzz.split_seed(fuzz.replay_seed(3, 7, 2))[0] == fuzz.split_seed(s)[0]


PLANTED = '''
from attncore.reference.backend import ReferenceBackend

class OddGroupLastRow(ReferenceBackend):
    """Scales the last query row of single prefill by 1.01 when the GQA group is odd (a tail bug)."""
    name = "fuzz_planted"
    def plan(self, problem, meta):
        self._odd = problem.group_size % 2 == 1 and problem.op == "single_prefill"
        return super().plan(problem, meta)
    def run(self, plan, args):
        super().run(plan, args)
        if self._odd and args.out.shape[0]:
            args.out[-1].mul_(1.01)
'''


def test_fuzz_finds_a_planted_bug_and_replays_it(tmp_path, monkeypatch):
    (tmp_path / "fuzz_planted.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    r = _cli("check", "--fuzz", "60", "--seed", "1", "--backend", "fuzz_planted:OddGroupLastRow")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "--replay" in ln]
    assert lines, r.stdout + r.stderr
    assert all("single_prefill" in ln for ln in lines), lines
    seed = lines[0].split("--replay")[1].split()[0]
    rr = _cli("check", "--backend", "fuzz_planted:OddGroupLastRow", "--replay", seed)
    assert rr.returncode == 1 and "MISMATCH" in rr.stdout, rr.stdout + rr.stderr
    assert "max |out - golden|" in rr.stdout


@pytest.mark.parametrize("args,msg", [(["--fuzz", "0"], "expected a positive integer"),
                                      (["--fuzz", "x"], "expected a positive integer"),
                                      (["--fuzz", "2", "--jobs", "-1"], "expected a positive integer")])
def test_bad_fuzz_arguments_are_usage_errors(args, msg):
    r = _cli("check", *args)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
