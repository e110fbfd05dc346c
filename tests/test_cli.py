"""The attncore command, run as a subprocess the way users run it (argument errors: main() in-process)."""

import json
import os
import subprocess
import sys

import pytest
import torch


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
    r = _run("bench", "--workload", "D1", "--workload", "P1-causal", "--workload", "R1-8x2k", "--json", str(j),
             "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stderr
    data = json.loads(j.read_text())
    assert {x["workload"] for x in data["results"]} == {"D1", "P1-causal", "R1-8x2k"}
    assert all(x["TFLOPs"] > 0 for x in data["results"] if x["workload"] != "D1")
    assert all("time_ms" in x for x in data["results"])


def test_bench_times_auto_beside_named_backends(tmp_path):
    """--backend auto beside named ones: the selector's pick and the backends timed in one run."""
    j = tmp_path / "bench.json"
    r = _run("bench", "--workload", "D1", "--backend", "auto", "--backend", "reference", "--json", str(j),
             "--device", "cpu")
    assert r.returncode == 0, r.stderr
    rows = {x["backend"]: x for x in json.loads(j.read_text())["results"]}
    assert set(rows) == {"auto", "reference"} and rows["auto"]["chosen"] and rows["reference"]["time_ms"] > 0


def test_bench_sequential_pages(tmp_path):
    j = tmp_path / "bench.json"
    r = _run("bench", "--workload", "D1", "--page-order", "sequential", "--json", str(j), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "pages: sequential" in r.stdout
    assert json.loads(j.read_text())["page_order"] == "sequential"
    from attncore.cli.bench import run_bench
    with pytest.raises(ValueError, match="page_order"):
        run_bench(ids=["D1"], device="cpu", page_order="random")


def test_bench_rounds_interleave_the_columns(tmp_path):
    """--rounds: every column of a workload timed once per round, each round starting one column later; a row's
    figure is the median of its rounds (a backend named twice is one column)."""
    from attncore.cli.bench import interleave

    order = []
    clock = iter([5.0, 1.0, 3.0, 2.0, 4.0, 6.0, 9.0, 7.0, 8.0])

    def col(name):
        return lambda: order.append(name) or next(clock)

    times = interleave({"a": col("a"), "b": col("b"), "c": col("c")}, 3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert times == {"a": [5.0, 6.0, 7.0], "b": [1.0, 2.0, 8.0], "c": [3.0, 4.0, 9.0]}
    assert interleave({}, 3) == {}  # every backend refused: nothing to time
    j = tmp_path / "bench.json"
    r = _run("bench", "--workload", "D1", "--backend", "reference", "--backend", "triton", "--backend", "reference",
             "--rounds", "2", "--json", str(j), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "(each figure the median of 2 interleaved rounds)" in r.stdout
    info = json.loads(j.read_text())
    assert info["rounds"] == 2 and [x["backend"] for x in info["results"]] == ["reference", "triton"]
    for x in info["results"]:
        assert len(x["rounds_ms"]) == 2 and x["time_ms"] == pytest.approx(sum(x["rounds_ms"]) / 2)


def test_bench_sustained_is_the_mean_over_a_back_to_back_window():
    """bench.sustained (variants_bench --sustain, clock_power_probe): one warm-up call, then calls in batches of 20
    until the window is over, and the mean ms per call over the window."""
    import time

    from attncore.cli.bench import sustained

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    ms = sustained(fn, 0.1, device="cpu")
    timed = len(calls) - 1  # the warm-up call is not timed
    assert timed >= 20 and timed % 20 == 0
    assert ms >= 2.0  # every call sleeps 2 ms
    # the window: at least the 100 ms asked for, at most one batch of 20 calls past it (plus a loaded machine's slack)
    assert 100 <= ms * timed <= 100 + 20 * ms + 50


def test_bench_sustain_times_every_column_back_to_back(monkeypatch, tmp_path):
    """--sustain: each figure is ``sustained``'s window (not do_bench's flushed calls), the run says so, and
    back-to-back runs rotate twice as many bytes as flushed ones (no flush separates the calls)."""
    from attncore.cli import bench

    windows = []

    def fake(fn, secs, device="cuda"):
        fn()
        windows.append((secs, device))
        return 0.25

    monkeypatch.setattr(bench, "sustained", fake)
    info = bench.run_bench(["reference"], ids=["D2-B1", "P1-causal"], device="cpu", sustain=0.3, rounds=2)
    assert info["timing"] == "back to back for 0.3 s"
    assert [r["time_ms"] for r in info["results"]] == [0.25, 0.25] and windows == [(0.3, "cpu")] * 4
    assert "timing: back to back for 0.3 s" in bench.format_table(info)
    assert bench.run_bench(["reference"], ids=["D1"], device="cpu")["timing"] == "median of 3 calls"
    with pytest.raises(ValueError, match="sustain"):
        bench.run_bench(ids=["D1"], device="cpu", sustain=0)
    d2b1, d1 = (next(w for w in bench.WORKLOADS if w.id == i) for i in ("D2-B1", "D1"))  # 134 MB, 537 MB of K/V
    assert [bench.copies_for(d2b1, "cuda"), bench.copies_for(d2b1, "cuda", back_to_back=True)] == [1, 2]
    assert [bench.copies_for(d1, "cuda"), bench.copies_for(d1, "cuda", back_to_back=True)] == [1, 1]
    assert bench.copies_for(d2b1, "cpu", back_to_back=True) == 1
    j = tmp_path / "b.json"
    r = _run("bench", "--workload", "D2-B1", "--sustain", "0.01", "--json", str(j), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "timing: back to back for 0.01 s" in r.stdout and json.loads(j.read_text())["results"][0]["time_ms"] > 0


@pytest.mark.parametrize("args, message", [
    (["--sustain", "0"], "--sustain: expected a positive number of seconds, got '0'"),
    (["--sustain", "inf"], "--sustain: expected a positive number of seconds, got 'inf'"),
    (["--sustain", "1", "--workload", "PD1"], "--sustain: times the non-POD workloads"),
    (["--sustain", "1", "--pod-sweep"], "--sustain: times the non-POD workloads"),
    (["--sustain", "1", "--latency"], "--sustain: not used with --latency"),
])
def test_bench_sustain_refuses_what_it_would_not_time(args, message, capsys):
    from attncore.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_a_column_that_fails_while_timed_is_an_error_row(monkeypatch):
    """A column whose run raises in a timing round gets an ERROR row with the reason; the others are timed."""
    from attncore.cli import bench

    setup = bench._setup

    def flaky(w, name, *a, **k):
        runs, chosen = setup(w, name, *a, **k)
        if name != "triton":
            return runs, chosen
        calls = [0]

        def run():
            calls[0] += 1
            if calls[0] > 1:  # the warm-up inside _setup passed; the timed calls fail
                raise RuntimeError("launch failed")
        return [run], chosen

    monkeypatch.setattr(bench, "_setup", flaky)
    info = bench.run_bench(["reference", "triton"], ids=["D1"], device="cpu", rounds=2, progress=lambda s: None)
    ref, tri = info["results"]
    assert len(ref["rounds_ms"]) == 2 and ref["time_ms"] > 0
    assert tri["status"] == "ERROR" and tri["detail"] == "RuntimeError: launch failed" and "time_ms" not in tri
    assert "triton     ERROR RuntimeError: launch failed" in bench.format_table(info)


@pytest.mark.parametrize("wid", ["P1-causal", "P3-p16", "D1", "D5", "X1-q4"])
def test_bench_drives_any_flashinfer_api_module(wid):
    """--flashinfer drives the comparison module through the FlashInfer API alone (no backend=,
    no attncore-only arguments); attncore itself, being that API, stands in for it on the CPU."""
    import attncore
    from attncore.cli.bench import _setup, _shrink, select_workloads

    w = _shrink(select_workloads([wid])[0])
    runs, chosen = _setup(w, "auto", "cpu", torch.float16, 1, api=attncore)
    runs[0]()
    assert chosen is None


def test_bench_flashinfer_needs_the_real_package(capsys):
    from attncore.cli.bench import _import_flashinfer

    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        _import_flashinfer("cpu")
    r = _run("bench", "--flashinfer", "--device", "cpu")
    assert r.returncode == 2 and "--flashinfer needs a CUDA GPU" in r.stderr


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


# ---- issue 14: what a newcomer ran into

@pytest.mark.parametrize("args, says", [
    (["explain", "--op", "batch_decode", "--heads", "32"], "argument --heads: expected Hq/Hkv"),
    (["explain", "--heads", "a/b"], "argument --heads"),
    (["explain", "--heads", "32/7"], "multiple of num_kv_heads"),
    (["explain", "--heads", "0/1"], "num_qo_heads: got 0"),
    (["explain", "--q-dtype", "foo"], "argument --q-dtype: expected one of float16"),
    (["explain", "--out-dtype", "int8"], "argument --out-dtype"),  # an fp8 --q-dtype is accepted (fp8_query)
    (["explain", "--kv-dtype", "int8"], "argument --kv-dtype"),
    (["explain", "--head-dim", "-1"], "argument --head-dim"),
    (["explain", "--page-size", "0"], "argument --page-size"),
    (["explain", "--q-len", "0"], "argument --q-len"),
    (["explain", "--window", "-5"], "argument --window"),
    (["explain", "--device", "cuda", "--cc", "x"], "argument --cc: expected MAJOR.MINOR"),
    (["explain", "--backend", "nosuch"], "known backends: "),
    # explain arguments the problem of --op has no use for
    (["explain", "--op", "single_prefill", "--page-size", "16"], "--page-size: --op single_prefill reads no paged"),
    (["explain", "--op", "batch_prefill_ragged", "--page-size", "1"], "--page-size: --op batch_prefill_ragged"),
    (["explain", "--op", "single_prefill", "--q-len", "4"], "--q-len: query tokens per request of a decode op"),
    (["explain", "--op", "pod", "--q-len", "2"], "(a POD's decode part takes one)"),
    (["explain", "--op", "batch_decode", "--pod-sizes", "2048,2048,64,4096"], "--pod-sizes: describes a POD"),
    (["explain", "--op", "pod", "--sms", "100"], "--sms: the GPU size of --pod-sizes' SM split"),
    (["explain", "--op", "batch_pod", "--sizes", "8,2048,2048"], "--sizes: picks a tuned op's measured bucket"),
    (["check", "--backend", "nosuch"], "known backends: "),
    (["check", "--backend", "nosuch", "--fuzz", "2"], "known backends: "),
    (["check", "--backend", "no_such_module:X", "--fuzz", "2"], "no_such_module"),
    # check / tune arguments the run they ask for would not use
    (["check", "--seed", "3", "--backend", "reference"], "--seed: not used without --fuzz (options of a --fuzz run)"),
    (["check", "--configs", "4", "--jobs", "2"], "--configs, --jobs: not used without --fuzz"),
    (["check", "--fuzz", "2", "--quick"], "--quick: not used with --fuzz (it draws its own problems)"),
    (["check", "--replay", "5", "--fuzz", "2", "--json", "x.json"], "--fuzz, --json: not used with --replay"),
    (["tune", "--list", "--json", "x.json"], "--json: not used with --list (it prints the grid"),
    (["tune", "--list", "--backend", "triton", "--fresh"], "--backend, --fresh: not used with --list"),
    (["tune", "--fresh", "--resume"], "--fresh replaces the cached table, --resume skips what it holds"),
    (["bench", "--workload", "ZZ"], "known: D1, "),
    (["bench", "--backend", "nosuch", "--workload", "D1"], "known backends: "),
    # bench arguments the run they ask for would not use
    (["bench", "--latency", "--workload", "D1"], "--workload: not used with --latency (it times tiny problems"),
    (["bench", "--latency", "--pod-sweep", "--page-order", "sequential"],
     "--pod-sweep, --page-order: not used with --latency"),
    (["bench", "--workload", "D1", "--calls", "5"], "--calls: not used without --latency"),
    (["bench", "--workload", "D1", "--pod-backend", "triton"], "--pod-backend: the backend of the POD rows"),
    (["bench", "--workload", "PD1", "--backend", "triton"], "--backend: the POD rows run each composed part"),
    (["build", "nosuch", "--list"], "known: cuda_fa2, xqa"),
    (["build", "cuda_fa2", "bogus"], "not a cuda_fa2 specialization URI: 'bogus'"),
    (["build", "--arch", "x", "--list"], "argument --arch"),
    (["build", "cuda_fa2", "--list", "--force"], "--force: not used with --list (it prints every specialization"),
    (["conformance", "nosuch"], "known backends: "),
])
def test_a_bad_argument_is_a_usage_error(args, says, capsys):
    from attncore.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert says in line and line.startswith(f"attncore {args[0]}: error:"), err
    if "known backends" in says:
        assert "reference" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("cmd", ["check", "bench"])
def test_device_cuda_without_a_gpu_is_a_usage_error(cmd, capsys):
    from attncore.cli import main

    with pytest.raises(SystemExit) as e:
        main([cmd, "--device", "cuda"])
    assert e.value.code == 2 and "--device cuda: no CUDA GPU here" in capsys.readouterr().err


def test_bench_help_lists_the_workloads(capsys):
    from attncore.cli.bench import WORKLOADS, select_workloads
    from attncore.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert e.value.code == 0 and all(w.id in out for w in WORKLOADS)
    assert [w.id for w in select_workloads(["P1"])] == ["P1-causal", "P1-full"]
    with pytest.raises(ValueError, match="unknown workload ZZ; known: D1"):
        select_workloads(["D1", "ZZ"])


def test_explain_names_the_dtype_not_the_device_for_bf16_on_cpu(capsys):
    from attncore.core import registry
    from attncore.cli import main

    if not registry.entries()["triton"].is_available:
        pytest.skip("triton unavailable here")
    main(["explain", "--op", "single_prefill", "--device", "cpu", "--q-dtype", "bfloat16", "--heads", "4/4",
          "--head-dim", "64"])
    out = capsys.readouterr().out
    refusal = out.split("refused by triton:")[1].split("\n  ")[0]
    assert "q_dtype: got bf16, supported {fp16, fp32} on cpu" in out and "device" not in refusal, out


def test_check_table_says_what_its_numbers_are():
    from attncore.cli.check import CheckResult, format_table

    table = format_table([CheckResult("reference", "single-causal-float16", "pass", 3.6e-4, 3.3e-3),
                          CheckResult("sdpa", "single-causal-float16", "n/a")])
    assert "max abs error / tolerance" in table and "fp64 golden" in table and "2x the error" in table
    row = [x for x in table.splitlines() if x.startswith("single-causal-float16")][0]
    assert "pass 3.6e-04 / 3.3e-03" in row and row.endswith("n/a")


def test_info_says_capabilities_in_words():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    assert "head dims: multiples of 16 up to 256" in r.stdout  # triton
    assert " d x" not in r.stdout and "pages any" not in r.stdout
    if "  sdpa [" in r.stdout:  # no paged op: no page sizes
        sdpa = r.stdout.split("  sdpa [")[1].split("\n  triton [")[0]
        assert "head dims: any" in sdpa and "page sizes" not in sdpa


def test_numpy_is_a_runtime_dependency():
    """Triton's CPU interpreter imports numpy: without it, `pip install -e . && attncore check`
    on a CPU checks the reference backend only."""
    tomllib = pytest.importorskip("tomllib")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert any(d.split(";")[0].strip().startswith("numpy") for d in deps), deps


def test_explain_head_dim_vo_describes_the_problem_and_its_refusals(capsys):
    from attncore.cli import main

    main(["explain", "--op", "batch_prefill_ragged", "--device", "cpu", "--q-dtype", "float16", "--heads", "4/4",
          "--head-dim", "192", "--head-dim-vo", "128", "--backend", "sdpa"])
    out = capsys.readouterr().out
    assert "batch_prefill_ragged cpu fp16/fp16->fp16 d192x128 4/4" in out, out
    assert "head_dim_vo: got 128, supported equal to head_dim_qk (192)" in out, out
    main(["explain", "--op", "batch_prefill_ragged", "--device", "cpu", "--q-dtype", "float16", "--heads", "4/4",
          "--head-dim", "64"])
    assert "d64 4/4" in capsys.readouterr().out  # without the option: v's head dim is q's
    with pytest.raises(SystemExit) as e:
        main(["explain", "--head-dim-vo", "0"])
    assert e.value.code == 2 and "--head-dim-vo: expected a positive integer, got '0'" in capsys.readouterr().err


def test_bench_reads_a_decode_against_a_read_of_its_size():
    """The same-size read (timed like the workload) is measured once per size and shown beside the
    2 GiB read ceiling."""
    from attncore.cli import bench

    calls = []
    memo = {}

    def timer(fn):
        fn()
        calls.append(1)
        return 0.05

    assert bench.read_at_size(4e6, timer, memo, device="cpu") == 0.05
    assert bench.read_at_size(4e6, timer, memo, device="cpu") == 0.05 and len(calls) == 1
    assert bench.read_at_size(2e6, timer, memo, device="cpu", copies=2) == 0.05 and len(calls) == 2  # rotated
    row = {"workload": "D1", "backend": "xqa", "time_ms": 0.1, "TBps": 2.9, "frac_read": 0.96,
           "frac_read_at_size": 0.5}
    assert bench._fmt_row(row).endswith("2.900 TB/s (96% of read, 50% of a read of its size)")
    del row["frac_read_at_size"]
    assert bench._fmt_row(row).endswith("2.900 TB/s (96% of read)")


def test_bench_json_keeps_pod_rows_beside_the_others(tmp_path):
    # POD workloads and others in one call: one JSON file with both (the POD run's file was overwritten before)
    j = tmp_path / "bench.json"
    r = _run("bench", "--workload", "PD1", "--workload", "D1", "--json", str(j), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    data = json.loads(j.read_text())
    assert {x["workload"] for x in data["results"]} == {"D1"}
    assert [x["id"] for x in data["pod"]["rows"]] == ["PD1"]
    assert data["page_order"] == data["pod"]["page_order"] == "shuffled"
    j2 = tmp_path / "pod.json"  # POD alone: the POD report itself, as before; --page-order reaches its rows
    r = _run("bench", "--workload", "PD1", "--json", str(j2), "--device", "cpu", "--page-order", "sequential")
    assert r.returncode == 0, r.stderr
    pod = json.loads(j2.read_text())
    assert [x["id"] for x in pod["rows"]] == ["PD1"] and pod["page_order"] == "sequential"
