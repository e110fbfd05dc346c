"""Side by side: `attncore bench --json` files of several trees (and FlashInfer rows), one table.

    python3 scripts/compare_bench.py OUT/bench_before13.json OUT/bench_now.json ...

Columns: each file's time (ms) per workload x backend in the order given, the last file over each
earlier one (>1: the last is slower), and FlashInfer's time with FlashInfer over the last file
(>1: attncore is faster) where a file holds FlashInfer rows.
"""

import json
import os
import sys


def main(paths):
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append((os.path.basename(p).replace("bench_", "").replace(".json", ""), json.load(f)))
    keys, times, fi = [], {}, {}
    for name, info in runs:
        for r in info["results"]:
            k = (r["workload"], r["backend"])
            if r["backend"] == "flashinfer":
                fi[r["workload"]] = r.get("time_ms")
                continue
            if k not in keys:
                keys.append(k)
            times[(name, k)] = r.get("time_ms")
    names = [n for n, _ in runs]
    dev = {info.get("device") for _, info in runs}
    print(f"device: {', '.join(sorted(map(str, dev)))}; date: {runs[-1][1].get('date')}; times in ms (median)")
    head = ["workload", "backend"] + names + [f"{names[-1]}/{n}" for n in names[:-1]] + (["flashinfer", "fi/attncore"] if fi else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    last = names[-1]
    for k in keys:
        cells = [k[0], k[1]]
        for n in names:
            t = times.get((n, k))
            cells.append(f"{t:.4f}" if t else "n/a")
        t_last = times.get((last, k))
        for n in names[:-1]:
            t = times.get((n, k))
            cells.append(f"{t_last / t:.3f}" if t and t_last else "-")
        if fi:
            f = fi.get(k[0])
            cells += [f"{f:.4f}" if f else "n/a", f"{f / t_last:.2f}" if f and t_last else "-"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
