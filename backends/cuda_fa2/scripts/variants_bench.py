"""prefill90 tile / pipeline variants timed beside each other on `attncore bench` workloads, in interleaved
rounds on shared inputs (same process, same run), with Triton (and optionally FlashInfer) as the yardstick.

    python3 backends/cuda_fa2/scripts/variants_bench.py --workload P1-causal --workload ragged_prefill:8:2048:2048 \\
        --variant default: --variant sepkv3:pipe:FA2_H_SEPKV=1 --variant plain:loop: [--rounds 3] [--flashinfer] \
        [--config prefill] [--sustain 2]

A variant is ``name:loop|pipe|unit|persist|:DEFINE=VALUE,...[:CONFIG]`` (the loop forced, or the plan's rule when
empty; ``unit`` / ``persist``: the pipelined loop at d128 on the one-unit or the persistent grid,
``CudaFa2Backend.sm90_persist``; the defines are ``CudaFa2Backend.tune``; CONFIG forces its tile config, e.g.
``prefill``: the FA2 kernel, and ``--config`` that of every variant without one).
``--sustain SECS`` times each column back to back for SECS seconds (``bench.sustained``: the mean over the window,
inputs rotated, no L2 flush between calls) instead of ``do_bench``'s median: the steady state under the board's power
limit, where compute-bound prefill runs on an H200 and where do_bench's short windows drift by a few percent between
rounds (scripts/clock_power_probe.py, BENCHMARKS.md 2ak / 2ao).
Correctness is the GPU tests' job (``FA2_TEST_TUNE`` runs them on a variant, ``FA2_TEST_PERSIST=1`` as well on the
persistent grid: the ``persist`` form's build).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch


def parse_variant(s: str):
    name, _, rest = s.partition(":")
    loop, _, rest = rest.partition(":")
    defs, _, config = rest.partition(":")
    forms = {"": (None, None), "loop": (False, None), "pipe": (True, None), "unit": (True, False),
             "persist": (True, True)}
    if loop not in forms:
        raise SystemExit(f"variant {s!r}: the loop is one of {', '.join(map(repr, forms))}")
    tune = tuple(tuple(d.split("=", 1)) for d in defs.split(",") if d)
    return (name, *forms[loop], tune, config or None)


def parse_workload(s: str, bench):
    """A standard workload id, or an ad-hoc one ``op:batch:qo:kv[:field=value...]`` (bench.Workload's fields, e.g.
    ``ragged_prefill:8:2048:2048`` or ``prefill:1:16384:1024:causal=0:d=64``)."""
    if ":" not in s:
        return bench.select_workloads([s])
    op, b, qo, kv, *rest = s.split(":")
    kinds = {f.name: f.type for f in dataclasses.fields(bench.Workload)}  # "bool" / "int" (string annotations)
    extra = {}
    for k, v in (f.split("=", 1) for f in rest):
        if kinds.get(k) not in ("bool", "int"):
            raise SystemExit(f"workload {s!r}: {k!r} is no integer or boolean field of bench.Workload")
        extra[k] = v != "0" if kinds[k] == "bool" else int(v)
    return [bench.Workload(s, op, int(b), int(qo), int(kv), **extra)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", action="append", required=True)
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flashinfer", action="store_true")
    ap.add_argument("--config", help="the tile config every variant is forced to (e.g. 'prefill': the FA2 kernel)")
    ap.add_argument("--sustain", type=float, default=0.0, help="seconds of back-to-back calls per column and round")
    a = ap.parse_args()
    from attncore.cli import bench
    from attncore.core import plan_cache, registry

    be = registry.entries()["cuda_fa2"].backend
    variants = [parse_variant(v) for v in a.variant]
    t = bench._timer("cuda") if not a.sustain else (lambda fn: bench.sustained(fn, a.sustain))
    dtype = torch.bfloat16
    fi = bench._import_flashinfer("cuda") if a.flashinfer else None
    for w in [w for spec in a.workload for w in parse_workload(spec, bench)]:
        copies = bench.copies_for(w, "cuda")
        runs = {}
        for name, pipe, persist, tune, config in variants:
            be.sm90_pipe, be.sm90_persist, be.tune, be.force_config = pipe, persist, tune, config or a.config
            plan_cache.ONE_CALL_PLANS.clear()  # one-call workloads cache their plans by signature
            try:
                runs[name], _ = bench._setup(w, "cuda_fa2", "cuda", dtype, copies, "shuffled")
            except Exception as e:  # report and go on
                print(f"{w.id} {name}: setup failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        be.sm90_pipe, be.sm90_persist, be.tune, be.force_config = None, None, (), None
        runs["triton"], _ = bench._setup(w, "triton", "cuda", dtype, copies, "shuffled")
        if fi is not None:
            runs["flashinfer"], _ = bench._setup(w, "auto", "cuda", dtype, copies, "shuffled", api=fi)
        times = bench.interleave({k: (lambda r=r: bench.time_runs(t, r)) for k, r in runs.items()}, a.rounds)
        flops = bench._flops(w)
        for k, ts in times.items():
            med = statistics.median(ts)
            tf = f" {flops / med / 1e9:.0f} TFLOP/s" if flops else ""
            print(f"{w.id:<12} {k:<14} {med:.4f} ms{tf}  rounds {' '.join(f'{x:.4f}' for x in ts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
