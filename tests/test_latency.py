"""``attncore bench --latency`` (issue 15 item 1) runs on the CPU: every column, a row per backend, --json."""

import json
import os

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


def test_latency_says_which_backend_auto_ran_per_cell():
    """auto's row comes with the backend that served each cell (the wrappers', the one-calls' plans); a forced
    row's is its own and is not printed."""
    info = run_latency(["auto", "reference"], device="cpu", calls=1)
    assert info["ran"]["attncore reference"] == {c: "reference" for c in COLUMNS}
    assert set(info["ran"]["attncore auto"]) == set(COLUMNS) and all(info["ran"]["attncore auto"].values())
    text = format_latency(info)
    assert "attncore auto ran: single_prefill " in text and "attncore reference ran" not in text


def test_latency_reports_each_cell_before_timing_it():
    said = []
    run_latency(["reference"], device="cpu", calls=1, progress=said.append)
    assert said == ["latency: attncore reference"] + [f"latency:   {c}" for c in COLUMNS]


_FAKE_FI = """
import time
from attncore import *  # FlashInfer's API, served here by attncore (the reference backend on the CPU)

STALL = {stall!r}


def single_decode_with_kv_cache(*a, **kw):
    if STALL:
        time.sleep(600)  # a cell that never finishes
    raise RuntimeError("refused here")
"""


@pytest.mark.parametrize("stall", [False, True])
def test_flashinfer_row_runs_in_a_child_process_with_a_time_limit(tmp_path, monkeypatch, stall):
    """FlashInfer's row (stood in for by a module of FlashInfer's API) is timed in a child process: its cells
    come back one by one, an exception is its cell's reason, and a stall costs the time limit, not the table."""
    from attncore.cli import latency

    (tmp_path / "fakefi.py").write_text(_FAKE_FI.format(stall=stall))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    said = []
    row = latency._child_row("fakefi", "cpu", 1, timeout=60 if not stall else 25, progress=said.append)
    assert list(row) == list(COLUMNS)
    assert isinstance(row["single_prefill"], float) and row["single_prefill"] > 0
    assert said[:2] == ["latency:   single_prefill", "latency:   single_decode"]
    if stall:
        assert row["single_decode"] == "n/a: did not finish within 25 s (its process was stopped)"
        assert all(row[c] == "n/a: not reached (fakefi stopped in single_decode)" for c in COLUMNS[2:])
    else:
        assert row["single_decode"] == "n/a: RuntimeError: refused here"
        assert all(isinstance(row[c], float) for c in COLUMNS[2:]), row


def test_flashinfer_row_whose_process_fails_says_why():
    from attncore.cli import latency

    row = latency._child_row("no_such_module_xyz", "cpu", 1, timeout=60)
    assert row["single_prefill"] == ("n/a: its process exited with status 1: ModuleNotFoundError: No module named "
                                     "'no_such_module_xyz'")
    assert all(row[c] == "n/a: not reached (no_such_module_xyz stopped in single_prefill)" for c in COLUMNS[1:])


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


def test_attncore_rows_are_shown_before_flashinfers_child_starts(monkeypatch):
    """A run stopped from outside while FlashInfer's child process runs still shows attncore's rows."""
    from types import SimpleNamespace

    from attncore.cli import bench, latency

    monkeypatch.setattr(bench, "_import_flashinfer", lambda device: SimpleNamespace(__version__="0.0"))
    monkeypatch.setattr(latency, "_child_row", lambda *a, **kw: {c: 1.0 for c in COLUMNS})
    said = []
    info = run_latency(["reference"], device="cpu", calls=1, flashinfer=True, progress=said.append)
    i = said.index("latency: flashinfer (its own process)")
    assert said[i - 1].startswith("host time per call") and "| attncore reference | " in said[i - 1]
    assert "FlashInfer 0.0" not in said[i - 1] and "FlashInfer 0.0" in format_latency(info)
