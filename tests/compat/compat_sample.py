"""pytest plugin of the FlashInfer compatibility run (``-p compat_sample``, with tests/compat on sys.path).

FlashInfer's test files parametrize into thousands of cases.  This plugin keeps a deterministic
subset per test function so that a run fits a few minutes of one GPU, marks cases listed as needing
hardware we do not have, and logs every outcome as it happens (so a run cut short by a timeout
still reports what it did).

Sampling, per test function (``file::function``), over its parametrized items:

* each item gets a rank, ``crc32("<seed>|<file>::<item name>")``: stable across runs and machines,
  independent of collection order and of where the sdist is unpacked;
* the ``max(ceil(n / N), min(K, n))`` lowest-ranked items are kept (at most ``M`` of them when a cap
  is set, but never fewer than ``min(K, n)``);
* with coverage on (the default), more items are added in rank order while one of them holds a
  parameter value that no kept item has, so every value of every axis (dtype, layout, page size,
  head dim, ...) runs at least once;
* unparametrized tests always run.

Options (each also read from the environment):

``--compat-sample N`` (``COMPAT_SAMPLE``, default 1 = keep everything), ``--compat-min K``
(``COMPAT_SAMPLE_MIN``, default 3), ``--compat-max M`` (``COMPAT_SAMPLE_MAX``, default 0 = no cap),
``--compat-seed S`` (``COMPAT_SEED``, default 0),
``--compat-cover 0|1`` (``COMPAT_COVER``, default 1), ``--compat-known PATH`` (``COMPAT_KNOWN``,
default ``known_unsupported.txt`` beside this file when it exists), ``--compat-log PATH``
(``COMPAT_LOG``: JSON lines, one per collection and per test phase).

Known-unsupported file: one entry per line, ``<pattern> | <reason>``, where the pattern is an
glob over ``<test file>::<test name with its parameters>`` in which only ``*`` (any run of characters)
and ``?`` (one character) are wildcards (brackets are literal, as in node ids); ``#`` starts a comment.  A
matching item is skipped with ``known unsupported: <reason>`` (and counted as skipped).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def _env(name, default):
    return os.environ.get(name, default)


def pytest_addoption(parser):
    g = parser.getgroup("compat_sample", "FlashInfer compatibility run: sampling and logging")
    g.addoption("--compat-sample", type=int, default=int(_env("COMPAT_SAMPLE", "1")), metavar="N",
                help="keep about 1 in N parametrized items of each test function (1: all)")
    g.addoption("--compat-min", type=int, default=int(_env("COMPAT_SAMPLE_MIN", "3")), metavar="K",
                help="keep at least K items per test function (default 3)")
    g.addoption("--compat-max", type=int, default=int(_env("COMPAT_SAMPLE_MAX", "0")), metavar="M",
                help="at most M items per test function before the coverage pass (0: no cap; default 0)")
    g.addoption("--compat-seed", type=int, default=int(_env("COMPAT_SEED", "0")), metavar="S",
                help="seed of the sample (default 0)")
    g.addoption("--compat-cover", type=int, default=int(_env("COMPAT_COVER", "1")), choices=(0, 1),
                help="1: add items until every parameter value runs at least once (default 1)")
    default_known = _HERE / "known_unsupported.txt"
    g.addoption("--compat-known", default=_env("COMPAT_KNOWN", str(default_known) if default_known.exists() else ""),
                metavar="PATH", help="known-unsupported list (pattern | reason per line)")
    g.addoption("--compat-shard", default=_env("COMPAT_SHARD", ""), metavar="I/N",
                help="after sampling, keep only every N-th selected item starting at I (one file over N processes)")
    g.addoption("--compat-log", default=_env("COMPAT_LOG", ""), metavar="PATH",
                help="append a JSON line per collection and per test phase to PATH")


def _log(config, record: dict) -> None:
    path = config.getoption("--compat-log")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")


def item_key(item) -> str:
    """``<file>::<name with parameters>``: the item's name independent of where the sdist lives."""
    return f"{item.path.name}::{item.name}"


def function_key(item) -> str:
    return f"{item.path.name}::{getattr(item, 'originalname', None) or item.name.split('[')[0]}"


def _rank(seed: int, item) -> int:
    return zlib.crc32(f"{seed}|{item_key(item)}".encode())


def _features(item) -> set:
    cs = getattr(item, "callspec", None)
    if cs is None:
        return set()
    return {(name, repr(value)) for name, value in cs.params.items()}


def sample(items, n: int, k: int, seed: int, cover: bool, cap: int = 0):
    """The kept items of one test function (in their original order)."""
    if (n <= 1 and cap <= 0) or len(items) <= 1 or all(getattr(it, "callspec", None) is None for it in items):
        return list(items)
    ranked = sorted(items, key=lambda it: (_rank(seed, it), item_key(it)))
    take = max(math.ceil(len(items) / max(n, 1)), min(k, len(items)))
    if cap > 0:
        take = min(take, max(cap, min(k, len(items))))
    chosen = ranked[:take]
    if cover:
        covered = set().union(*(_features(it) for it in chosen))
        for it in ranked[take:]:
            f = _features(it)
            if not f <= covered:
                chosen.append(it)
                covered |= f
    keep = {id(it) for it in chosen}
    return [it for it in items if id(it) in keep]


def shard(items, spec: str):
    """``items`` kept by shard ``spec`` ("I/N": every N-th from the I-th)."""
    try:
        i, n = (int(x) for x in spec.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--compat-shard: expected I/N with 0 <= I < N, got {spec!r}")
    return items[i::n]


def glob_regex(pattern: str):
    """A compiled regex for a known-unsupported pattern: ``*`` and ``?`` wild, everything else literal."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern) + r"\Z",
                      re.DOTALL)


def read_known(path: str):
    """[(pattern, reason)] from a known-unsupported file."""
    entries = []
    if not path:
        return entries
    for n, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "|" not in line:
            raise pytest.UsageError(f"{path}:{n}: expected '<pattern> | <reason>', got {raw!r}")
        pattern, reason = (s.strip() for s in line.split("|", 1))
        if not pattern or not reason:
            raise pytest.UsageError(f"{path}:{n}: both a pattern and a reason are needed, got {raw!r}")
        entries.append((pattern, reason))
    return entries


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    n = config.getoption("--compat-sample")
    k = config.getoption("--compat-min")
    seed = config.getoption("--compat-seed")
    cap = config.getoption("--compat-max")
    cover = bool(config.getoption("--compat-cover"))
    groups = OrderedDict()
    for it in items:
        groups.setdefault(function_key(it), []).append(it)
    kept, per_file = [], OrderedDict()
    for fn, its in groups.items():
        chosen = sample(its, n, k, seed, cover, cap)
        kept.extend(chosen)
        stats = per_file.setdefault(fn.split("::")[0], {"collected": 0, "selected": 0, "functions": OrderedDict()})
        stats["collected"] += len(its)
        stats["selected"] += len(chosen)
        stats["functions"][fn.split("::", 1)[1]] = [len(its), len(chosen)]
    spec = config.getoption("--compat-shard")
    if spec:  # the counts become this process's share
        kept = shard(kept, spec)
        keep_ids = {id(it) for it in kept}
        for fn, its in groups.items():
            stats = per_file[fn.split("::")[0]]
            stats["functions"][fn.split("::", 1)[1]][1] = sum(1 for it in its if id(it) in keep_ids)
        for stats in per_file.values():
            stats["selected"] = sum(v[1] for v in stats["functions"].values())
    keep_ids = {id(it) for it in kept}
    deselected = [it for it in items if id(it) not in keep_ids]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [it for it in items if id(it) in keep_ids]
    known = read_known(config.getoption("--compat-known"))
    marked = 0
    regexes = [(glob_regex(p), reason) for p, reason in known]
    for it in items:
        for rx, reason in regexes:
            if rx.match(item_key(it)):
                it.add_marker(pytest.mark.skip(reason=f"known unsupported: {reason}"))
                marked += 1
                break
    config._compat_stats = dict(sample=n, min=k, max=cap, seed=seed, cover=cover, files=per_file, known_marked=marked)
    _log(config, {"event": "collection", "time": time.time(), "sample": n, "min": k, "max": cap, "seed": seed,
                  "cover": cover, "known_marked": marked, "files": per_file})


def _message(report) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return crash.message
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:  # skip: (file, line, reason)
        reason = str(report.longrepr[2])
        return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    return str(report.longrepr or "")


_CONFIG: dict = {}


def pytest_configure(config):
    _CONFIG["config"] = config


def pytest_unconfigure(config):
    _CONFIG.pop("config", None)


def report_key(nodeid: str) -> str:
    """``<file>::<name>`` of a node id, whatever directory the node id starts with."""
    path, sep, rest = nodeid.partition("::")
    return path.rsplit("/", 1)[-1] + sep + rest


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if config is None or (report.when != "call" and report.outcome == "passed"):
        return
    msg = _message(report) if report.outcome != "passed" else ""
    _log(config, {"event": "test", "key": report_key(report.nodeid), "when": report.when,
                  "outcome": report.outcome, "duration": round(report.duration, 4), "message": msg[:2000]})


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stats = getattr(config, "_compat_stats", None)
    if not stats:
        return
    for name, s in stats["files"].items():
        terminalreporter.write_line(
            f"compat_sample: {name}: {s['selected']} of {s['collected']} items selected (1 in {stats['sample']} per "
            f"test function, at least {stats['min']}"
            f"{', at most %d before coverage' % stats['max'] if stats['max'] else ''}, seed {stats['seed']}, "
            f"{'every parameter value covered' if stats['cover'] else 'no coverage pass'})")
    if stats["known_marked"]:
        terminalreporter.write_line(f"compat_sample: {stats['known_marked']} items skipped as known unsupported")
