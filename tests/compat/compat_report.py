"""Summary of a FlashInfer compatibility run (``scripts/compat_flashinfer.sh`` calls it).

Reads, for each test file, the JSON lines that ``compat_sample`` logged (``<stem>.jsonl``) and the
exit status and seconds the script recorded (``<stem>.rc``: ``"<rc> <seconds>"``); prints a
per-file table (collected, selected, passed, failed, errors, skipped, not run) and the most common
failure and skip messages, and writes everything as JSON with ``--json``.  A test whose phases were
logged counts once: failed if its call failed, an error if only its setup or teardown failed, else
skipped if skipped, else passed.  Selected tests with no outcome (the file timed out or crashed)
are "not run"; rc 125 means the script did not start the file (its deadline had passed).

    python tests/compat/compat_report.py --work DIR [--json PATH] FILE.py ...
    python tests/compat/compat_report.py --work DIR --out-of-memory     (keys of cases to run again alone)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter, OrderedDict
from pathlib import Path


def stems(work: Path, name: str) -> list:
    """The log stems of one test file: ``<stem>``, or its shards ``<stem>.s<I>of<N>`` when the script
    split the file over processes (COMPAT_SPLIT)."""
    stem = name[:-3] if name.endswith(".py") else name
    shards = sorted(p.name[:-len(".rc")] for p in work.glob(f"{stem}.s*of*.rc"))
    return shards or [stem]


def read_file(work: Path, name: str) -> dict:
    collected = None
    selected = 0
    outcome = OrderedDict()
    messages = {}
    rcs, seconds = [], []
    for stem in stems(work, name):
        collected, selected = _read_log(work / f"{stem}.jsonl", name, outcome, messages, collected, selected)
        rcf = work / f"{stem}.rc"
        if rcf.exists():
            parts = rcf.read_text().split()
            rcs.append(int(parts[0]))
            if len(parts) > 1:
                seconds.append(int(parts[1]))
    # the worst exit status of the shards (a timeout or a failure shows), their longest run
    rc = max(rcs, key=lambda r: (r in (124, 137) or r < 0, r != 0, r)) if rcs else None
    return count({
        "file": name, "collected": collected, "selected": selected,
        "rc": rc, "seconds": max(seconds) if seconds else None,
        "timed_out": any(r in (124, 137) or r < 0 for r in rcs), "not_started": 125 in rcs,
        "shards": len(rcs), "retried": 0,
        "outcomes": outcome, "messages": messages,
    })


def count(row: dict) -> dict:
    """``row``'s passed/failed/errors/skipped/not-run counts, from its outcomes."""
    counts = Counter(row["outcomes"].values())
    row.update(passed=counts["passed"], failed=counts["failed"], errors=counts["error"], skipped=counts["skipped"],
               not_run=max((row["selected"] or 0) - sum(counts.values()), 0))
    return row


def fold_retry(rows: list, log: Path) -> None:
    """Cases the runner ran again alone after failing out of GPU memory beside other processes
    (``retry.jsonl``): their outcome there replaces the first one."""
    if not log.exists():
        return
    by_file = {r["file"]: r for r in rows}
    again: dict = {}
    messages: dict = {}
    _read_log(log, "", again, messages, None, 0)
    for key, out in again.items():
        row = by_file.get(key.split("::")[0])
        if row is None:
            continue
        row["outcomes"][key], row["messages"][key] = out, messages.get(key, "")
        row["retried"] += 1
        count(row)


def _read_log(log: Path, name: str, outcome: dict, messages: dict, collected, selected):
    """Fold one process's JSON lines into ``outcome``/``messages``; returns (collected, selected so far)."""
    if log.exists():
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if r.get("event") == "collection":
                s = r["files"].get(name, {"collected": 0, "selected": 0})
                collected, selected = s["collected"], selected + s["selected"]
            elif r.get("event") == "test":
                key, when, out = r["key"], r["when"], r["outcome"]
                prev = outcome.get(key)
                if out == "failed":
                    new = "failed" if when == "call" else "error"
                    if prev != "failed":
                        outcome[key] = new
                        messages[key] = r.get("message", "")
                elif out == "skipped":
                    if prev is None:
                        outcome[key] = "skipped"
                        messages[key] = r.get("message", "")
                elif out == "passed" and when == "call" and prev is None:
                    outcome[key] = "passed"
    return collected, selected


def out_of_memory(work: Path) -> list:
    """The cases of ``work``'s logs (not the retry's) that failed out of GPU memory, sorted."""
    keys = set()
    for log in work.glob("*.jsonl"):
        if log.name == "retry.jsonl":
            continue
        outcome, messages = OrderedDict(), {}
        _read_log(log, "", outcome, messages, None, 0)
        keys |= {k for k, o in outcome.items() if o in ("failed", "error") and "out of memory" in messages[k].lower()}
    return sorted(keys)


def signature(msg: str) -> str:
    """A failure message with its numbers blanked, first line only: cases that fail alike group together."""
    first = (msg or "").strip().splitlines()[0] if (msg or "").strip() else "(no message)"
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", first)[:200]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--top", type=int, default=8, help="failure messages to show per file (default 8)")
    ap.add_argument("--out-of-memory", action="store_true",
                    help="only print the keys of the cases that failed out of GPU memory (the runner runs them again)")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args(argv)
    if a.out_of_memory:
        keys = out_of_memory(a.work)
        if keys:
            print("\n".join(keys))
        return 0
    if not a.files:
        ap.error("name the test files")
    rows = [read_file(a.work, f) for f in a.files]
    fold_retry(rows, a.work / "retry.jsonl")
    cols = ("collected", "selected", "passed", "failed", "errors", "skipped", "not_run", "seconds", "rc")
    w = max(len(r["file"]) for r in rows + [{"file": "TOTAL"}])
    head = f"{'file':<{w}}  " + "  ".join(f"{c:>9}" for c in cols)
    print(head)
    print("-" * len(head))
    tot = Counter()
    for r in rows:
        vals = []
        for c in cols:
            v = r[c]
            vals.append(f"{'-' if v is None else v:>9}")
            if c not in ("rc",) and isinstance(v, int):
                tot[c] += v
        flag = "  TIMED OUT" if r["timed_out"] else "  NOT STARTED (deadline)" if r["not_started"] else ""
        flag += f"  ({r['retried']} run again alone)" if r["retried"] else ""
        print(f"{r['file']:<{w}}  " + "  ".join(vals) + flag)
    print("-" * len(head))
    print(f"{'TOTAL':<{w}}  " + "  ".join(f"{tot[c] if c != 'rc' else '':>9}" for c in cols))

    summary_files = []
    for r in rows:
        fails = Counter()
        example = {}
        skips = Counter()
        for key, out in r["outcomes"].items():
            if out in ("failed", "error"):
                s = signature(r["messages"].get(key, ""))
                fails[s] += 1
                example.setdefault(s, key)
            elif out == "skipped":
                skips[(r["messages"].get(key, "") or "").strip()[:200]] += 1
        if fails:
            print(f"\n{r['file']}: {sum(fails.values())} failed/error, by message:")
            for s, c in fails.most_common(a.top):
                print(f"  {c:5d}  {s}\n         e.g. {example[s]}")
        r_out = {k: v for k, v in r.items() if k not in ("outcomes", "messages")}
        r_out["failures_by_message"] = [{"count": c, "message": s, "example": example[s]}
                                        for s, c in fails.most_common()]
        r_out["skips_by_reason"] = [{"count": c, "reason": s} for s, c in skips.most_common()]
        r_out["failed_tests"] = [k for k, o in r["outcomes"].items() if o in ("failed", "error")]
        summary_files.append(r_out)
    if any(r["skipped"] for r in rows):
        print("\nskips by reason:")
        allskips = Counter()
        for r in summary_files:
            for s in r["skips_by_reason"]:
                allskips[s["reason"]] += s["count"]
        for s, c in allskips.most_common(a.top):
            print(f"  {c:5d}  {s}")
    # a file whose failures all passed when run again alone exited 1 the first time
    ok = all(r["failed"] == 0 and r["errors"] == 0 and r["not_run"] == 0 and r["selected"] is not None
             and (r["rc"] in (0, 5, None) or (r["rc"] == 1 and r["retried"])) for r in rows)
    if a.json:
        a.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "ok": ok,
                                      "totals": dict(tot), "files": summary_files}, indent=1))
        print(f"\nsummary: {a.json}")
    print(f"\n{'ALL SELECTED TESTS PASSED OR SKIPPED' if ok else 'NOT ALL PASSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
