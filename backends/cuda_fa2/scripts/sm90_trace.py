"""A clock64 timeline of prefill90's warp-specialized loops on `attncore bench` workloads (GPU, sm90).

Builds cuda_fa2 with ``-DFA2_TRACE=1`` (csrc/fa2_sm90_trace.cuh says what is stamped, where and in which
CTAs), times each workload with the traced build, runs it once more and reads the stamps back.  Prints,
per traced CTA and role, the median clocks of each phase over the steady-state tiles (the first three and
last two left out), and writes the raw stamps with ``--json``.  The stamps cost a few percent of the time.

    python3 backends/cuda_fa2/scripts/sm90_trace.py --workload P1-full --workload P3-p16 [--pipe 0|1] [--json F]
        [--tune FA2_H_PERSIST=1 ...]

``--pipe``: force the plain (0) or the pipelined (1) loop; default: the backend's rule.  ``--tune``: defines of a
tuning variant (``CudaFa2Backend.tune``).  A persistent CTA's tiles are counted across its units; where the pipelined
loop starts a unit, ``unit starts`` lines give the gap from the last pack of one unit to the first `full` wait's end of
the next, and the two periods around it, beside the steady-state period; ``boundary`` lines split that gap (the last
P V, the epilogue, the next unit's hand-over, the wait for its first tile; the producer's Q copy).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics

SLOTS, ROLES, TILES, PHASES = 4, 3, 256, 12  # csrc/fa2_sm90_trace.cuh
PLAIN = {"wait full": (0, 1), "S": (1, 2), "softmax": (2, 3), "rescale+pack": (3, 4), "P V": (4, 5)}
PIPE = {"wait full": (0, 1), "turn": (1, 7), "issue": (7, 6), "S wait": (6, 2), "softmax": (2, 3),
        "P V wait": (3, 5), "pack": (5, 4)}
PRODUCER = {"wait empty": (0, 1), "issue": (1, 2)}
PRODUCER_SEPKV = {"wait K empty": (0, 1), "issue K": (1, 3), "wait V empty": (3, 4), "issue V": (4, 2)}


def _median_gap(pairs) -> str:
    """The median of b - a over the (a, b) stamp pairs both stamped ("-" where none is)."""
    v = [b - a for a, b in pairs if a and b]
    return f"{statistics.median(v):.0f}" if v else "-"


def summary(stamps, label: str) -> list:
    """Lines of the median phase clocks per traced CTA (slots 0 and 2: the first CTA and one a wave later)."""
    def at(slot, role, tile, ph):
        return stamps[((slot * ROLES + role) * TILES + tile) * PHASES + ph]

    out = []
    for slot in range(SLOTS):
        n = sum(1 for t in range(TILES) if at(slot, 1, t, 0))
        if n < 6:
            out.append(f"{label} CTA {slot}: {n} tiles traced, too few for a steady state")
            continue
        tiles = range(3, n - 2)
        for role, name in ((0, "producer"), (1, "consumer 0"), (2, "consumer 1")):
            if role == 0:
                phases = PRODUCER_SEPKV if any(at(slot, role, t, 3) for t in tiles) else PRODUCER
            else:
                phases = PIPE if any(at(slot, role, t, 7) for t in tiles) else PLAIN
            period = statistics.median(at(slot, role, t + 1, 0) - at(slot, role, t, 0) for t in tiles)
            parts = {k: statistics.median(at(slot, role, t, b) - at(slot, role, t, a) for t in tiles)
                     for k, (a, b) in phases.items()}
            out.append(f"{label} CTA {slot} {name:10s} ({n} tiles): period {period:5.0f} | "
                       + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()))
            if role > 0:  # a unit's first tile in the pipelined loop: S alone, no turn stamped (phase 7)
                starts = [t for t in range(1, n - 1) if at(slot, role, t, 1) and not at(slot, role, t, 7)
                          and at(slot, role, t - 1, 7)]
                if starts:
                    gaps = [at(slot, role, t, 1) - at(slot, role, t - 1, 4) for t in starts]
                    spans = [at(slot, role, t + 1, 0) - at(slot, role, t - 1, 0) for t in starts]
                    out.append(f"{label} CTA {slot} {name:10s} unit starts at tiles {starts[:8]}: last pack -> next "
                               f"full {statistics.median(gaps):.0f}, two periods around {statistics.median(spans):.0f}")
                    # the boundary's parts (persistent builds: phases 8-11 of the unit's last tile, the producer's
                    # 5 / 6 of the next unit's first), each a median over the unit starts: (name, from, to), a stamp
                    # as (role, 0 the unit's last tile / 1 the next one's first, phase)
                    parts = (("last P V", (role, 0, 4), (role, 0, 8)), ("epilogue", (role, 0, 8), (role, 0, 9)),
                             ("next unit", (role, 0, 9), (role, 0, 11)), ("wait full", (role, 0, 11), (role, 1, 1)),
                             ("producer: Q free after the last pack", (role, 0, 4), (0, 1, 5)),
                             ("Q copy issued in", (0, 1, 5), (0, 1, 6)))
                    out.append(f"{label} CTA {slot} {name:10s} boundary: " + ", ".join(
                        f"{what} " + _median_gap((at(slot, ra, t - 1 + da, pa), at(slot, rb, t - 1 + db, pb))
                                                 for t in starts)
                        for what, (ra, da, pa), (rb, db, pb) in parts))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", action="append", default=None,
                    help="attncore bench workload id, or variants_bench.py's op:batch:qo:kv[:field=value] (repeatable)")
    ap.add_argument("--pipe", choices=("0", "1"), default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tune", action="append", default=[], help="DEFINE=VALUE of a tuning variant (repeatable)")
    a = ap.parse_args(argv)
    os.environ["ATTNCORE_NVCC_FLAGS"] = (os.environ.get("ATTNCORE_NVCC_FLAGS", "") + " -DFA2_TRACE=1").strip()

    import torch
    import triton

    from attncore.backends.cuda_fa2 import binding
    from attncore.backends.cuda_fa2.backend import CudaFa2Backend
    from attncore.cli import bench
    from attncore.cli.bench import _setup
    from variants_bench import parse_workload

    if a.pipe is not None:
        CudaFa2Backend.sm90_pipe = a.pipe == "1"
    CudaFa2Backend.tune = tuple(tuple(d.split("=", 1)) for d in a.tune)
    raw = {}
    for w in [w for spec in a.workload or ["P1-full"] for w in parse_workload(spec, bench)]:
        runs, _ = _setup(w, "cuda_fa2", "cuda", torch.bfloat16, 1)
        runs[0]()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(runs[0], warmup=50, rep=300)
        libs = [lib for lib in binding._LIBS.values() if hasattr(lib.lib, "fa2_trace_dump")]
        if not libs:
            print(f"{w.id}: {ms:.4f} ms, no traced prefill90 library ran (not a prefill90 problem?)")
            continue
        buf = (ctypes.c_uint64 * (SLOTS * ROLES * TILES * PHASES))()

        def dump():
            err = libs[-1].lib.fa2_trace_dump(buf)  # copies the stamps out and zeroes them
            if err:
                raise RuntimeError(f"fa2_trace_dump: CUDA error {err}")

        dump()  # the same library may have run a longer problem before: start from zeros
        runs[0]()
        torch.cuda.synchronize()
        dump()
        stamps = list(buf)
        raw[w.id] = dict(ms=ms, key=str(libs[-1].key), stamps=stamps)
        print(f"{w.id}: {ms:.4f} ms (traced build)")
        print("\n".join(summary(stamps, w.id)))
        binding._LIBS.clear()  # so that libs[-1] is the next workload's own library
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), layout="[slot][role][tile][phase]", runs=raw), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
