"""Issue 17 probe: how much of a short decode's distance from the read ceiling is the timing method's.

``triton.testing.do_bench`` clears L2 before every repetition by zeroing a 256 MB buffer, so every timed call
starts with up to an L2's worth of dirty lines that its own reads must first write back.  Here the same
decodes (and plain fp32-accumulated reads of the same sizes, and of 2 GiB) are timed two ways, each the median of
per-call CUDA events: ``zero`` (do_bench's clear) and ``read`` (L2 emptied by reading a 256 MB buffer instead, so
the lines it leaves are clean).  Every input is far larger than L2 or rotated beyond it by ``bench.copies_for``.

    python3 scripts/gpu_l2_method.py [--workloads D1,D2-B1,D5] [--reps 200]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def timer(clear: str, reps: int):
    """ms per call of ``fn``, the median over ``reps`` calls, L2 cleared before each as ``clear`` says."""
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    as_f32 = buf.view(torch.float32)
    flush = (lambda: buf.zero_()) if clear == "zero" else (lambda: as_f32.sum())

    def t(fn) -> float:
        for _ in range(5):
            flush()
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in ev:
            flush()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in ev)

    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="D1,D2-B1,D5")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    from attncore.cli import bench

    ws = bench.select_workloads(a.workloads.split(","))
    runs = {w.id: (bench._setup(w, "auto", "cuda", torch.bfloat16, bench.copies_for(w, "cuda"))[0], bench._bytes(w))
            for w in ws}
    big = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16).normal_()  # 2 GiB, the ceiling's read
    timers = {c: timer(c, a.reps) for c in ("zero", "read")}
    res = {}
    for c, t in timers.items():
        ceil = big.numel() * 2 / (t(lambda: big.sum(dtype=torch.float32)) * 1e-3) / 1e12
        res[c] = {"ceiling": ceil}
        for wid, (rs, nbytes) in runs.items():
            x = big[: int(nbytes) // 2]
            plain = nbytes / (t(lambda: x.sum(dtype=torch.float32)) * 1e-3) / 1e12
            kern = nbytes / (bench.time_runs(t, rs) * 1e-3) / 1e12
            res[c][wid] = (kern, plain)
    print(f"{'clear':>6s} {'2 GiB read':>11s} " + " ".join(f"{w:>28s}" for w in runs))
    print(f"{'':>6s} {'TB/s':>11s} " + " ".join(f"{'kernel / plain read, TB/s':>28s}" for _ in runs))
    for c, r in res.items():
        cells = [f"{r[w][0]:.3f} ({100 * r[w][0] / r['ceiling']:.0f}%) / {r[w][1]:.3f} ({100 * r[w][1] / r['ceiling']:.0f}%)"
                 for w in runs]
        print(f"{c:>6s} {r['ceiling']:>11.3f} " + " ".join(f"{x:>28s}" for x in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
