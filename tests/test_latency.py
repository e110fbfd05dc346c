"""``attncore bench --latency`` (issue 15 item 1) runs on the CPU: every column, a row per backend, --json."""

import json

import pytest

from attncore.cli.latency import COLUMNS, format_latency, run_latency


def test_latency_table_on_cpu(tmp_path, capsys):
    from attncore.cli.main import main

    out = tmp_path / "lat.json"
    assert main(["bench", "--latency", "--device", "cpu", "--calls", "2", "--backend", "reference",
                 "--backend", "xqa", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| us per call | " + " | ".join(COLUMNS) + " |" in text
    info = json.loads(out.read_text())
    ref = info["rows"]["attncore reference"]
    assert set(ref) == set(COLUMNS) and all(isinstance(v, float) and v > 0 for v in ref.values())
    xqa = info["rows"]["attncore xqa"]  # not available on the CPU: every cell says why
    assert all(isinstance(v, str) and v.startswith("n/a: ") for v in xqa.values())
    assert "attncore xqa / decode plan: n/a:" in text


def test_latency_reports_each_cell_before_timing_it():
    said = []
    run_latency(["reference"], device="cpu", calls=1, progress=said.append)
    assert said == ["latency: attncore reference"] + [f"latency:   {c}" for c in COLUMNS]


def test_latency_flashinfer_needs_a_gpu():
    with pytest.raises(ValueError, match="--flashinfer needs a CUDA GPU"):
        run_latency(["reference"], device="cpu", calls=1, flashinfer=True)


def test_format_marks_refusals():
    info = {"device": "cpu", "calls": 1, "columns": list(COLUMNS),
            "rows": {"attncore x": {c: (1.5 if i else "n/a: no") for i, c in enumerate(COLUMNS)}}}
    t = format_latency(info)
    assert "| attncore x | n/a | 1.5 |" in t and "attncore x / single_prefill: n/a: no" in t


def test_one_stall_moves_one_block_not_the_cell():
    """The cell is the median block's time per call: a 50 ms stall in one call of ten (after the warm-up)
    leaves it near the other calls' cost, where the mean over all calls would read 5 ms."""
    import time

    from attncore.cli import latency

    n = [0]

    def fn():
        n[0] += 1
        if n[0] == 3 + 4:  # the 4th timed call
            time.sleep(0.05)

    us = latency._time(fn, 10, "cpu")
    assert n[0] == 13 and us < 1000, us
