"""Issue 16: is a POD column's spread in do_bench the host's enqueue time?  For POD points (attncore bench's PD
rows and sweep ids), serial / sm_split / auto on one set of inputs, each timed four ways:
  do_bench   triton.testing.do_bench's median, three times (median, min-max): what `attncore bench` reports
  padded     events around each run with a sleep kernel queued before the start event: the host always ahead,
             so the GPU's own time
  b2b        runs back to back for 0.4 s (bench.sustained)
  host us    the enqueue time per run (median of 5 loops of 50), the GPU held busy by a sleep kernel meanwhile
A column whose do_bench or b2b time exceeds its padded time while its host time is above the GPU's is
host-bound.  --switch times one stream switch and launch (current.on against torch.cuda.stream, on a side
stream and on a green context's) and the fork / join events (alone: only those).

    python scripts/gpu_pod_host.py [--switch] [PD1,S-p2048-b8-kv16384,...]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import triton.testing

import attncore
from attncore.cli.bench import sustained
from attncore.cli.bench_pod import POD_WORKLOADS, SWEEP, _inputs, _setup
from attncore.core import current, green

SLEEP_100US = 200_000  # torch.cuda._sleep cycles: ~100 us at the H200's clock


def padded(fn, flush, n=60):
    s = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    e = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    fn()
    torch.cuda.synchronize()
    for i in range(n):
        flush.zero_()
        torch.cuda._sleep(2 * SLEEP_100US)
        s[i].record()
        fn()
        e[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(s, e))


def host_us(fn, n=100, rounds=1):
    out = []
    for _ in range(rounds):
        fn()
        torch.cuda.synchronize()
        # busy for longer than the loop's enqueues take (< 300 us a run), at most ~10 ms: the loop's launches
        # stay under the launch queue's ~1,000 entries, so a launch behind the sleep never blocks the host
        torch.cuda._sleep(min(3 * SLEEP_100US * n, 100 * SLEEP_100US))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def points(ids):
    known = {w.id: w for w in POD_WORKLOADS + SWEEP}
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    print(f"{'point':22s} {'column':9s} {'do_bench':>9s} {'min':>8s}-{'max':>8s} {'padded':>8s} {'b2b':>7s} "
          f"{'host us':>8s}")
    for pid in ids:
        w = known[pid]
        x = _inputs(w, "cuda", torch.bfloat16)
        cols = {name: _setup(w, x, torch.bfloat16, attncore, kw)
                for name, kw in (("serial", dict(fuse=False, overlap="serial")),
                                 ("sm_split", dict(fuse=False, overlap="sm_split")), ("auto", {}))}
        for _ in range(2):
            for name, (run, wr) in cols.items():
                db = [float(triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")) for _ in range(3)]
                tag = f"{wr.mode}{wr.sm_split or ''}" if name == "auto" else name
                print(f"{pid:22s} {tag[:9]:9s} {statistics.median(db):9.4f} {min(db):8.4f}-{max(db):8.4f} "
                      f"{padded(run, flush):8.4f} {sustained(run, 0.4):7.4f} {host_us(run, n=50, rounds=5):8.1f}",
                      flush=True)
        del x, cols
        torch.cuda.empty_cache()


def switch():
    dev = torch.device("cuda", current.device_index())
    (sp, _), _ = green.split(dev, 40)
    cur, side, ev = current.current_stream(dev.index), torch.cuda.Stream(), torch.cuda.Event()

    def on(s, ctx):
        def f():
            with ctx(s):
                torch.cuda._sleep(1)
        return f

    def fork(a, b):
        def f():
            ev.record(a)
            b.wait_event(ev)
        return f

    rows = [("launch on the current stream", lambda: torch.cuda._sleep(1)),
            ("current.on(side stream) + launch", on(side, current.on)),
            ("current.on(green stream) + launch", on(sp, current.on)),
            ("torch.cuda.stream(green stream) + launch", on(sp, torch.cuda.stream)),
            ("event on current, green waits", fork(cur, sp)), ("event on green, current waits", fork(sp, cur)),
            ("current.current_stream", lambda: current.current_stream(dev.index)),
            ("torch.cuda.current_stream", lambda: torch.cuda.current_stream(dev))]
    for what, fn in rows:
        print(f"{what:42s} {host_us(fn, n=500, rounds=5):6.2f} us")


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--switch" in args:  # alone: the switch rows only
        args.remove("--switch")
        switch()
        if not args:
            sys.exit(0)
    points((args[0].split(",") if args else None)
           or ["PD1", "S-p2048-b8-kv16384", "S-p2048-b128-kv1024", "S-p2048-b32-kv4096", "S-p2048-b8-kv4096", "PD2"])
