"""scripts/gpu_pod_coresident.py: the per-SM fit arithmetic, the trace summary (overlap of two streams) and the
CPU smoke run (tiny shapes, Triton's interpreter, serial only; the timings there mean nothing)."""

import importlib.util
import json
import os
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "gpu_pod_coresident.py")


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("gpu_pod_coresident", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m  # dataclasses look their module up
    spec.loader.exec_module(m)
    yield m
    sys.modules.pop(spec.name, None)


def test_fit_offline_sm90_table(mod):
    R = mod.Res
    dense_default = R(255, 128, 98336)  # triton dense 128x64 w4 s2 (offline sm_90 compile)
    dense_w8 = R(139, 256, 131128)  # triton dense 128x64 w8 s3
    xqa, xqa_st2 = R(168, 128, 103424), R(166, 128, 70656)
    assert dense_default.cta_regs() == 32768 and dense_w8.cta_regs() == 144 * 256
    assert mod.fit([], dense_default) == 2 and mod.fit([], dense_w8) == 1
    assert mod.fit([], xqa) == 2 and mod.fit([], xqa_st2) == 3
    f = mod.fits(dense_w8, xqa_st2)
    assert f["decode_beside_one"] == 1 and f["decode_beside_full"] == 1
    f = mod.fits(dense_w8, xqa)  # 3 KB of shared memory short
    assert f["decode_beside_one"] == 0
    f = mod.fits(dense_default, xqa_st2)  # room beside one prefill CTA, none beside the two it runs
    assert f["decode_beside_one"] == 1 and f["decode_beside_full"] == 0
    # every limit counts: threads and CTA slots
    assert mod.fit([R(32, 1024, 0)], R(32, 1024, 0)) == 1 and mod.fit([R(32, 1024, 0)] * 2, R(32, 32, 0)) == 0
    assert mod.fit([R(8, 32, 0)] * 31, R(8, 32, 0)) == 1


def _ev(name, ts, dur, stream, **args):
    return dict(name=name, ts=ts, dur=dur, cat="kernel", args=dict(stream=stream, **args))


def test_summarize_overlap(mod):
    res = dict(grid=[512, 1, 1], block=[256, 1, 1], **{"registers per thread": 139, "shared memory": 131128})
    dres = dict(grid=[512, 1, 1], block=[128, 1, 1], **{"registers per thread": 166, "shared memory": 70656})
    ev = [_ev("_dense_fwd", 0, 10, 7, **res), _ev("xqa_decode_kernel", 5, 20, 13, **dres),
          _ev("_dense_fwd", 100, 10, 7, **res), _ev("xqa_decode_kernel", 100, 4, 13, **dres),
          _ev("xqa_decode_kernel", 106, 4, 13, **dres)]
    s = mod.summarize(ev)
    # stream 7 busy 20 us; both streams busy 5 (first pair) + 8 (second): 13 / 20
    assert s["streams"] == 2 and s["overlap"] == pytest.approx(13 / 20, abs=1e-3)
    k = s["kernels"]["_dense_fwd"]
    assert k["n"] == 2 and k["us"] == 10 and k["grid"] == [512, 1, 1] and k["regs"] == 139
    assert mod.summarize([_ev("a", 0, 5, 1), _ev("b", 10, 5, 1)])["overlap"] == 0.0
    f = mod.fit_from_trace(s["kernels"])
    assert f["prefill"] == "_dense_fwd" and f["decode"] == "xqa_decode_kernel" and f["decode_beside_full"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path (the GPU test runs the real one)")
def test_cpu_smoke_run(mod, tmp_path, capsys):
    path = tmp_path / "r.json"
    assert mod.main(["--cpu", "--workloads", "PD1", "--json", str(path)]) == 0
    info = json.loads(path.read_text())
    rows = info["rows"]
    assert [r["pair"] for r in rows] == mod.CPU_PAIRS
    for r in rows:
        assert "error" not in r, r
        assert r["correct"] and r["serial_equal"] and max(r["golden"].values()) <= 1.0
        assert r["serial"] > 0 and r["bound"] == max(r["prefill_alone"], r["decode_alone"])
    assert rows[1]["prefill_backend"] == "triton" and rows[1]["decode_backend"] == "triton"
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("PD1: best") and "POD co-residency on cpu" in out


def test_bad_arguments_name_the_option(mod):
    with pytest.raises(ValueError, match="--workloads: unknown 'PD9'"):
        mod.run(["PD9"], ["auto+auto"], "cpu", profile=False, progress=lambda s: None)
    with pytest.raises(ValueError, match="--pairs: 'auto'"):
        mod.run(["PD1"], ["auto"], "cpu", profile=False, progress=lambda s: None)


@pytest.mark.gpu
def test_gpu_coresident_pairs_match_serial(mod, tmp_path):
    """On the H100: the default pair and the predicted co-resident pair run in all three modes with outputs
    equal to serial and within tolerance of the golden."""
    info = mod.run(["PD1"], ["auto+auto", "t128x64w8s3+xqa_st2"], "cuda", profile=True, progress=lambda s: None)
    for r in info["rows"]:
        assert "error" not in r, r
        assert r["correct"], r
        assert r["decode_first_equal"] and r["prefill_first_equal"]
        assert "trace" in r and r["trace"]["prefill_first"]["streams"] == 2, r.get("trace_error")
