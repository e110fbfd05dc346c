"""The attncore command, run as a subprocess the way users run it."""

import json
import os
import subprocess
import sys

import pytest


def _run(*args, timeout=600, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "attncore.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


def test_info_lists_backends_with_origin_and_state():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "attncore 0.1.0" in out and "torch" in out
    assert "reference [built-in] available" in out
    for name in ("triton", "cuda_fa2", "xqa"):
        assert f"{name} [built-in]" in out
    assert "single_prefill" in out  # capability summary


def test_explain_shows_choice_and_refusals():
    r = _run("explain", "--op", "batch_decode", "--device", "cpu", "--q-dtype", "float16", "--heads", "32/8",
             "--sinks")
    assert r.returncode == 0, r.stderr
    assert "chosen: reference" in r.stdout
    assert "batch_decode cpu fp16/fp16->fp16 d128 32/8 p16 NHD causal sinks" in r.stdout


def test_explain_cuda_problem_without_gpu_lists_refusals():
    r = _run("explain", "--op", "single_prefill", "--device", "cuda", "--cc", "9.0", "--backend", "auto")
    assert "chosen:" in r.stdout
    assert "unavailable" in r.stdout or "refused" in r.stdout


def test_check_quick_reference_passes_and_writes_json(tmp_path):
    j = tmp_path / "check.json"
    r = _run("check", "--backend", "reference", "--quick", "--device", "cpu", "--json", str(j))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "single-causal-float16" in r.stdout and " passed, 0 failed" in r.stdout
    data = json.loads(j.read_text())
    assert data and all(d["status"] == "pass" for d in data)


def test_check_fails_with_exit_1_on_a_wrong_backend(tmp_path):
    plugin = tmp_path / "wrongplug.py"
    plugin.write_text(
        "from attncore.reference.backend import ReferenceBackend\n"
        "class Wrong(ReferenceBackend):\n"
        "    name = 'wrong'\n"
        "    def priority(self, p): return -5\n"
        "    def run(self, plan, args):\n"
        "        super().run(plan, args)\n"
        "        args.out.mul_(1.01)\n"
        "import attncore\n"
        "attncore.register_backend(Wrong())\n")
    code = ("import sys; sys.path.insert(0, %r); import wrongplug; from attncore.cli import main; "
            "sys.exit(main(['check', '--backend', 'wrong', '--quick', '--device', 'cpu']))" % str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL" in r.stdout


def test_bench_on_cpu_says_so(tmp_path):
    j = tmp_path / "bench.json"
    r = _run("bench", "--workload", "D1", "--workload", "P1-causal", "--json", str(j), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stderr
    data = json.loads(j.read_text())
    assert {x["workload"] for x in data["results"]} == {"D1", "P1-causal"}
    assert all("time_ms" in x for x in data["results"])


def test_bench_sequential_pages(tmp_path):
    j = tmp_path / "bench.json"
    r = _run("bench", "--workload", "D1", "--page-order", "sequential", "--json", str(j), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "pages: sequential" in r.stdout
    assert json.loads(j.read_text())["page_order"] == "sequential"
    from attncore.bench import run_bench
    with pytest.raises(ValueError, match="page_order"):
        run_bench(ids=["D1"], device="cpu", page_order="random")


def test_unknown_backend_is_a_clear_error():
    r = _run("check", "--backend", "nosuch")
    assert r.returncode != 0 and "'nosuch' is not a known backend" in r.stderr


def test_build_lists_specializations_without_a_gpu():
    r = _run("build", "cuda_fa2", "--list", "--arch", "90")
    assert r.returncode == 0, r.stderr
    assert "cuda_fa2_prefill_bf16_d128_causal_sm90" in r.stdout
    r = _run("build", "fa2", "--list", "--arch", "80")
    assert r.returncode == 0 and "_sm80" in r.stdout


def test_sdpa_plugin_is_listed_and_explained_when_installed():
    from importlib import metadata

    try:
        version = metadata.version("attncore-sdpa")
    except metadata.PackageNotFoundError:
        pytest.skip("plugins/attncore-sdpa is not installed (CI installs it)")
    r = _run("info")
    assert f"sdpa [plugin attncore-sdpa {version}] available" in r.stdout
    r = _run("explain", "--op", "single_prefill", "--device", "cpu", "--q-dtype", "float16")
    assert "sdpa (priority -1)" in r.stdout  # a candidate on CPU, ranked below the reference
    r = _run("explain", "--op", "batch_decode", "--device", "cpu", "--q-dtype", "float16")
    assert "refused by sdpa:" in r.stdout and "op: got batch_decode" in r.stdout
    r = _run("info", env={"ATTNCORE_PLUGINS": ""})  # the allow-list can switch third-party plugins off
    assert r.returncode == 0 and "sdpa [plugin" not in r.stdout
