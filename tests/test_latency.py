"""``attncore bench --latency`` (issue 15 item 1) runs on the CPU: every column, a row per backend, --json."""

import json
import os

import pytest

from attncore.cli.latency import COLUMNS, format_latency, run_latency


def test_latency_table_on_cpu(tmp_path, capsys):
    from attncore.cli.main import main

    out = tmp_path / "lat.json"
    assert main(["bench", "--latency", "--device", "cpu", "--calls", "2", "--rounds", "2", "--backend", "reference",
                 "--backend", "xqa", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| us per call | " + " | ".join(COLUMNS) + " |" in text
    info = json.loads(out.read_text())
    assert info["rounds"] == 2 and len(info["samples"]["attncore reference"]["decode plan"]) == 2
    ref = info["rows"]["attncore reference"]
    assert set(ref) == set(COLUMNS) and all(isinstance(v, float) and v > 0 for v in ref.values())
    xqa = info["rows"]["attncore xqa"]  # not available on the CPU: every cell says why
    assert all(isinstance(v, str) and v.startswith("n/a: ") for v in xqa.values())
    assert "attncore xqa / decode plan: n/a:" in text
    # each cell's fastest block of its rounds (one block per round here: 2 calls), as a second table
    fast = info["fastest"]["attncore reference"]
    assert fast == {c: min(info["samples"]["attncore reference"][c]) for c in COLUMNS}
    assert info["fastest"]["attncore xqa"] == {}
    second = text.split("the fastest block of each cell, us (of 2)\n")[1].splitlines()
    assert second[2].startswith("| attncore reference | ") and second[3] == "| attncore xqa |" + " n/a |" * len(COLUMNS)


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
    assert said == ["latency: attncore reference"] + [f"latency:   attncore reference / {c}" for c in COLUMNS]


_FAKE_FI = """
import time
import attncore
from attncore import *  # FlashInfer's API, served here by attncore (the reference backend on the CPU)

STALL = {stall!r}


def _no_backend(cls):  # attncore's wrapper without its ``backend`` attribute, as FlashInfer's wrappers are
    def missing(self):
        raise AttributeError(f"{{type(self).__name__!r}} object has no attribute 'backend'")
    return type(cls.__name__, (cls,), {{"backend": property(missing)}})


BatchDecodeWithPagedKVCacheWrapper = _no_backend(attncore.BatchDecodeWithPagedKVCacheWrapper)
BatchPrefillWithPagedKVCacheWrapper = _no_backend(attncore.BatchPrefillWithPagedKVCacheWrapper)


def single_decode_with_kv_cache(*a, **kw):
    if STALL:
        time.sleep(600)  # a cell that never finishes
    raise RuntimeError("refused here")
"""


def _child_row(latency, module: str, timeout: float) -> dict:
    """``module``'s row, column by column, from one child process (``_ChildRow``), as ``run_latency`` asks it."""
    child = latency._ChildRow(module, "cpu", 1, timeout)
    try:
        return {c: child.time(c) for c in COLUMNS}
    finally:
        child.close()


@pytest.mark.parametrize("stall", [False, True])
def test_flashinfer_row_runs_in_a_child_process_with_a_time_limit(tmp_path, monkeypatch, stall):
    """FlashInfer's row (stood in for by a module of FlashInfer's API) is timed in a child process: its cells
    come back one by one as asked, an exception is its cell's reason, and a stall costs the time limit, not the table."""
    from attncore.cli import latency

    (tmp_path / "fakefi.py").write_text(_FAKE_FI.format(stall=stall))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    row = _child_row(latency, "fakefi", timeout=60 if not stall else 25)
    assert list(row) == list(COLUMNS)
    assert isinstance(row["single_prefill"], float) and row["single_prefill"] > 0
    if stall:
        assert row["single_decode"] == "n/a: did not finish within 25 s (its process was stopped)"
        assert all(row[c] == "n/a: not reached (fakefi stopped in single_decode)" for c in COLUMNS[2:])
    else:
        assert row["single_decode"] == "n/a: RuntimeError: refused here"
        assert all(isinstance(row[c], float) for c in COLUMNS[2:]), row


def test_flashinfer_row_whose_process_fails_says_why():
    from attncore.cli import latency

    row = _child_row(latency, "no_such_module_xyz", timeout=60)
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


def test_latency_timing_runs_without_the_garbage_collector():
    """The timed calls run with the collector off (a pending collection would land in one cell); it is on again
    afterwards, also when a call raises."""
    import gc

    from attncore.cli import latency

    seen = []
    latency._time(lambda: seen.append(gc.isenabled()), 5, "cpu")
    assert seen[:3] == [True] * 3 and seen[3:] == [False] * 5 and gc.isenabled()

    def boom():
        if len(seen) > 10:
            raise RuntimeError("x")
        seen.append(0)

    with pytest.raises(RuntimeError):
        latency._time(boom, 5, "cpu")
    assert gc.isenabled()


def test_rounds_interleave_every_row_of_a_cell_flashinfers_child_included(tmp_path, monkeypatch):
    """Each round times one column at a time with every row back to back (FlashInfer's, stood in for by a module of
    its API, in its child process); a cell is the median of its rounds, a refusal stays its reason, and the table so
    far is shown after each round but the last."""
    from types import SimpleNamespace

    from attncore.cli import bench

    (tmp_path / "flashinfer.py").write_text(_FAKE_FI.format(stall=False))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(bench, "_import_flashinfer", lambda device: SimpleNamespace(__version__="0.0"))
    said = []
    info = run_latency(["reference"], device="cpu", calls=1, flashinfer=True, rounds=2, progress=said.append)
    cells = [x for x in said if x.startswith("latency:   ")]
    assert cells[:4] == ["latency:   attncore reference / single_prefill (round 1 of 2)",
                         "latency:   FlashInfer 0.0 / single_prefill (round 1 of 2)",
                         "latency:   attncore reference / single_decode (round 1 of 2)",
                         "latency:   FlashInfer 0.0 / single_decode (round 1 of 2)"]
    assert len(cells) == 2 * 2 * len(COLUMNS)
    tables = [x for x in said if x.startswith("host time per call")]
    assert len(tables) == 1 and said.index(tables[0]) == said.index(
        "latency:   attncore reference / single_prefill (round 2 of 2)") - 1
    ref, fi = info["rows"]["attncore reference"], info["rows"]["FlashInfer 0.0"]
    for name, row in (("attncore reference", ref), ("FlashInfer 0.0", fi)):
        for c in COLUMNS:
            got = info["samples"][name][c]
            assert len(got) == 2
            if not isinstance(row[c], str):
                assert row[c] == round((got[0] + got[1]) / 2, 1)
    assert fi["single_decode"] == "n/a: RuntimeError: refused here" and isinstance(fi["decode plan"], float)
    # the child sends each cell's fastest block back with its time
    assert info["fastest"]["FlashInfer 0.0"] == {c: min(info["samples"]["FlashInfer 0.0"][c]) for c in COLUMNS
                                                 if c != "single_decode"}
    assert format_latency(info).startswith("host time per call, us (the median of 2 rounds, the rows interleaved, of 1 "
                                           "calls")
