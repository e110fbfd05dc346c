"""CPU checks of the FlashInfer compatibility kit (the shim, the helper modules, the sampling plugin and
the report).  Deliberately not named ``test_*.py``: the project's suite (``python -m pytest`` from
the repo root) does not collect tests/compat.  Run it explicitly:

    python -m pytest -q -p no:cacheprovider tests/compat/check_shim.py
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import alibi_reference  # noqa: E402
import compat_report  # noqa: E402
import compat_sample  # noqa: E402
import flashinfer  # noqa: E402
import jit_utils  # noqa: E402

import attncore  # noqa: E402
from attncore.testing.golden import golden_alibi_slopes, golden_attention  # noqa: E402

SDIST_TESTS = Path("/tmp/fi/flashinfer_python-0.2.14.post1/tests")


def test_flashinfer_is_the_shim():
    assert flashinfer.__attncore_shim__ is True
    assert Path(flashinfer.__file__).resolve().parent == HERE / "flashinfer"
    assert flashinfer.registry is attncore.core.registry  # how attncore.bench refuses to time the shim


@pytest.mark.parametrize("name", ["cascade", "decode", "mla", "page", "pod", "prefill", "quantization", "rope"])
def test_submodules_are_attncore_modules(name):
    mod = importlib.import_module(f"flashinfer.{name}")
    assert mod is importlib.import_module(f"attncore.{name}")
    assert getattr(flashinfer, name) is mod


def test_top_level_names_are_attncore_objects():
    for name in attncore.__all__:
        assert getattr(flashinfer, name) is getattr(attncore, name), name
    from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
    assert BatchDecodeWithPagedKVCacheWrapper is attncore.BatchDecodeWithPagedKVCacheWrapper
    assert flashinfer.quantization.packbits is attncore.packbits


def test_missing_api_fails_loudly():
    with pytest.raises(AttributeError, match="attncore has no counterpart"):
        flashinfer.surely_not_an_api
    with pytest.raises(AttributeError, match="surely_not_an_api"):
        flashinfer.decode.surely_not_an_api
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flashinfer.surely_not_a_module")
    with pytest.raises(AttributeError, match="JIT internals"):
        flashinfer.jit.gen_jit_spec
    with pytest.raises(AttributeError, match="not provided by the attncore shim"):
        flashinfer.jit.attention.pytorch.gen_batch_decode_module


def test_jit_warmup_is_a_no_op():
    from flashinfer.jit.attention.pytorch import gen_pod_module

    specs = (jit_utils.gen_decode_attention_modules([torch.float16], [torch.float16], [128], [0], [False], [False])
             + jit_utils.gen_prefill_attention_modules([torch.float16], [torch.float16], [128], [0], [False],
                                                       [False], [False])
             + [gen_pod_module(torch.float16, torch.float16, torch.float16, 128, 0, False, False, False,
                               torch.int32, 0, False, False)])
    assert len(specs) == 1 and specs[0].generator == "gen_pod_module"
    assert flashinfer.jit.build_jit_specs(specs, verbose=False) is None


@pytest.mark.parametrize("h", list(range(1, 41)))
def test_alibi_slopes_match_golden(h):
    torch.testing.assert_close(alibi_reference.alibi_slopes(h), golden_alibi_slopes(h), rtol=1e-14, atol=0)


@pytest.mark.parametrize("qo,kv,hq,hkv,causal", [(1, 9, 4, 4, False), (17, 81, 8, 8, True), (81, 17, 8, 2, False),
                                                  (33, 33, 32, 32, True), (5, 40, 12, 4, True)])
def test_alibi_attention_matches_golden(qo, kv, hq, hkv, causal):
    g = torch.Generator().manual_seed(qo * 1000 + kv)
    q = torch.randn(qo, hq, 64, generator=g, dtype=torch.float64)
    k = torch.randn(kv, hkv, 64, generator=g, dtype=torch.float64)
    v = torch.randn(kv, hkv, 64, generator=g, dtype=torch.float64)
    mask = torch.ones(qo, kv, dtype=torch.bool)
    if causal:
        mask = torch.tril(mask, diagonal=kv - qo)
    out = alibi_reference.alibi_attention(q, k, v, mask)
    ref, _ = golden_attention(q, k, v, mask=mask, pos_encoding_mode="ALIBI")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert out.dtype == q.dtype


def test_alibi_attention_row_without_keys_is_zero():
    q, k, v = torch.randn(2, 4, 8), torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    mask = torch.tensor([[False, False, False], [True, True, False]])
    out = alibi_reference.alibi_attention(q, k, v, mask)
    assert torch.all(out[0] == 0) and torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_reference_against_attncore_through_the_shim(causal):
    """The way FlashInfer's ALiBi test uses it, on the CPU reference backend, in float32."""
    torch.manual_seed(0)
    q, k, v = torch.randn(17, 8, 64), torch.randn(81, 8, 64), torch.randn(81, 8, 64)
    o = flashinfer.single_prefill_with_kv_cache(q, k, v, causal=causal, pos_encoding_mode="ALIBI")
    mask = torch.ones(17, 81, dtype=torch.bool)
    if causal:
        mask = torch.tril(mask, diagonal=81 - 17)
    torch.testing.assert_close(o, alibi_reference.alibi_attention(q, k, v, mask), rtol=1e-4, atol=1e-4)
    od = flashinfer.single_decode_with_kv_cache(q[0], k, v, pos_encoding_mode="ALIBI")
    ref = alibi_reference.alibi_attention(q[:1], k, v, torch.ones(1, 81, dtype=torch.bool))[0]
    torch.testing.assert_close(od, ref, rtol=1e-4, atol=1e-4)


SAMPLE_TEST = '''
import pytest

@pytest.mark.parametrize("a", range(10))
@pytest.mark.parametrize("b", ["x", "y", "z"])
def test_grid(a, b):
    assert b != "z" or a != 3

def test_plain():
    pass
'''


def _run_pytest(tmp_path, *args, env=None):
    (tmp_path / "test_grid.py").write_text(SAMPLE_TEST)
    e = dict(os.environ, PYTHONPATH=str(HERE), PYTHONDONTWRITEBYTECODE="1")
    for k in list(e):
        if k.startswith("COMPAT_"):
            del e[k]
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "compat_sample", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", os.devnull, *args, "test_grid.py"],
                          cwd=tmp_path, env=e, capture_output=True, text=True)


def test_sample_plugin_keeps_a_deterministic_covering_subset(tmp_path):
    log = tmp_path / "log.jsonl"
    runs = [_run_pytest(tmp_path, "--collect-only", "-q", env={"COMPAT_SAMPLE": "20", "COMPAT_LOG": str(log)})
            for _ in range(2)]
    ids = [line for line in runs[0].stdout.splitlines() if "::" in line]
    assert ids == [line for line in runs[1].stdout.splitlines() if "::" in line]
    grid = [i for i in ids if "test_grid[" in i]
    assert any("test_plain" in i for i in ids)
    assert 3 <= len(grid) < 30
    params = [i.split("[")[1].rstrip("]").split("-") for i in grid]  # ids are "<b>-<a>"
    assert {p[0] for p in params} == {"x", "y", "z"} and {p[1] for p in params} == {str(a) for a in range(10)}
    rec = json.loads(log.read_text().splitlines()[0])
    assert rec["files"]["test_grid.py"]["collected"] == 31
    assert rec["files"]["test_grid.py"]["selected"] == len(ids)
    no_cover = _run_pytest(tmp_path, "--collect-only", "-q", "--compat-sample", "20", "--compat-cover", "0")
    assert len([x for x in no_cover.stdout.splitlines() if "test_grid[" in x]) == 3  # min K = 3
    everything = _run_pytest(tmp_path, "--collect-only", "-q")
    assert "31 tests collected" in everything.stdout


def test_known_unsupported_and_the_report(tmp_path):
    known = tmp_path / "known.txt"
    known.write_text("# comment\ntest_grid.py::test_grid[x-*] | needs hardware we do not have\n")
    work = tmp_path / "work"
    work.mkdir()
    r = _run_pytest(tmp_path, "-q", "--compat-known", str(known), "--compat-log", str(work / "test_grid.jsonl"))
    assert r.returncode == 1, r.stdout  # test_grid[z-3] fails
    (work / "test_grid.rc").write_text(f"{r.returncode} 1\n")
    (work / "test_other.rc").write_text("124 500\n")  # a file that timed out before collecting
    out = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, str(HERE / "compat_report.py"), "--work", str(work), "--json", str(out),
                          "test_grid.py", "test_other.py"], capture_output=True, text=True)
    assert res.returncode == 1, res.stdout
    s = json.loads(out.read_text())
    g = s["files"][0]
    assert (g["collected"], g["selected"], g["passed"], g["failed"], g["skipped"], g["not_run"]) == (31, 31, 20, 1, 10, 0)
    assert g["failed_tests"] == ["test_grid.py::test_grid[z-3]"]
    assert g["skips_by_reason"][0]["reason"].startswith("known unsupported: needs hardware")
    assert s["files"][1]["timed_out"] and not s["ok"]
    assert "TIMED OUT" in res.stdout


def test_shards_partition_the_sample_and_the_report_folds_them(tmp_path):
    ids = lambda r: [x for x in r.stdout.splitlines() if "::" in x]  # noqa: E731
    whole = ids(_run_pytest(tmp_path, "--collect-only", "-q", "--compat-sample", "5"))
    parts = [ids(_run_pytest(tmp_path, "--collect-only", "-q", "--compat-sample", "5", "--compat-shard", f"{i}/3"))
             for i in range(3)]
    assert sorted(sum(parts, [])) == sorted(whole) and all(parts)
    assert not set(parts[0]) & set(parts[1])
    bad = _run_pytest(tmp_path, "--collect-only", "-q", "--compat-shard", "3/3")
    assert bad.returncode != 0 and "--compat-shard: expected I/N" in bad.stdout + bad.stderr
    work = tmp_path / "work"
    work.mkdir()
    for i in range(2):
        r = _run_pytest(tmp_path, "-q", "--compat-shard", f"{i}/2", "--compat-log", str(work / f"test_grid.s{i}of2.jsonl"))
        (work / f"test_grid.s{i}of2.rc").write_text(f"{r.returncode} {i + 1}\n")
    out = tmp_path / "summary.json"
    subprocess.run([sys.executable, str(HERE / "compat_report.py"), "--work", str(work), "--json", str(out),
                    "test_grid.py"], capture_output=True, text=True)
    g = json.loads(out.read_text())["files"][0]
    assert (g["collected"], g["selected"], g["passed"], g["failed"], g["not_run"]) == (31, 31, 30, 1, 0)
    assert (g["rc"], g["seconds"], g["shards"]) == (1, 2, 2)


def test_cases_out_of_memory_are_listed_and_their_retry_counts(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    r = _run_pytest(tmp_path, "-q", "--compat-log", str(work / "test_grid.jsonl"))
    (work / "test_grid.rc").write_text(f"{r.returncode} 1\n")
    log = (work / "test_grid.jsonl").read_text()  # test_grid[z-3] failed: make it an out-of-memory failure
    lines = [json.loads(x) for x in log.splitlines()]
    for x in lines:
        if x.get("outcome") == "failed":
            x["message"] = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    (work / "test_grid.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = [sys.executable, str(HERE / "compat_report.py"), "--work", str(work)]
    oom = subprocess.run(report + ["--out-of-memory"], capture_output=True, text=True)
    assert oom.returncode == 0 and oom.stdout.split() == ["test_grid.py::test_grid[z-3]"], oom.stdout + oom.stderr
    before = subprocess.run(report + ["test_grid.py"], capture_output=True, text=True)
    assert before.returncode == 1 and "NOT ALL PASSED" in before.stdout
    # the runner's retry: the case alone passed this time
    (work / "retry.jsonl").write_text(json.dumps({"event": "test", "key": "test_grid.py::test_grid[z-3]",
                                                  "when": "call", "outcome": "passed", "duration": 0.1,
                                                  "message": ""}) + "\n")
    out = tmp_path / "summary.json"
    after = subprocess.run(report + ["--json", str(out), "test_grid.py"], capture_output=True, text=True)
    g = json.loads(out.read_text())["files"][0]
    assert (g["passed"], g["failed"], g["retried"]) == (31, 0, 1), g
    assert after.returncode == 0 and "(1 run again alone)" in after.stdout, after.stdout


def test_report_signature_groups_numbers():
    assert compat_report.signature("Mismatched elements: 3 / 4096 (0.1%)\nmore") == \
        compat_report.signature("Mismatched elements: 17 / 8192 (0.2%)")


@pytest.mark.skipif(not SDIST_TESTS.exists(), reason=f"FlashInfer's sdist is not unpacked at {SDIST_TESTS}")
def test_script_collects_the_14_files_through_the_shim():
    env = dict(os.environ, COMPAT_INSTALL="0", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(REPO / "scripts" / "compat_flashinfer.sh"), "--collect-only"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "flashinfer -> attncore shim" in r.stdout
    assert "/17237 tests collected" in r.stdout and "error" not in r.stdout.lower()


def test_script_have_tests_finds_or_names_the_sdist(tmp_path):
    """``--have-tests``: exit 0 when an sdist (or an unpacked tests/) is found, without unpacking; 2 with the
    message otherwise.  The GPU scripts ask it before their compat phase."""
    script = ["bash", str(REPO / "scripts" / "compat_flashinfer.sh"), "--have-tests"]
    sdist = tmp_path / "flashinfer_python-0.2.14.post1.tar.gz"
    sdist.write_bytes(b"")
    unpack = tmp_path / "unpack"
    found = subprocess.run(script, env=dict(os.environ, COMPAT_SDIST=str(sdist), COMPAT_UNPACK_DIR=str(unpack)),
                           capture_output=True, text=True, timeout=60)
    assert found.returncode == 0 and not unpack.exists(), found.stderr
    missing = subprocess.run(script, env=dict(os.environ, COMPAT_SDIST=str(tmp_path / "none.tar.gz"),
                                              COMPAT_UNPACK_DIR=str(unpack)), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no FlashInfer sdist found" in missing.stderr, missing.stderr
