"""The SM clock, board power and power-cap flag (nvidia-smi every 50 ms) while one prefill workload runs back to
back for ~3 s: cuda_fa2 through attncore (with --unit also prefill90's pipelined loop forced onto the one-unit grid),
torch SDPA (cuDNN where torch picks it; single prefill), FlashInfer with --flashinfer, and a bf16 8192^3 matmul; two
rounds.  Shows whether a kernel is bound by the board's power limit (then its speed follows its energy per FLOP, not
its latency).  BENCHMARKS.md 2ak.

    PYTHONPATH=$FI_ROOT python3 scripts/clock_power_probe.py [--workload P1-full] [--flashinfer] [--unit]
"""
import argparse
import statistics
import subprocess
import time

import torch

from attncore.cli import bench

QUERY = "clocks.sm,power.draw,clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown"


def window(name, fn, flop, secs=3.0):
    fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    ms = bench.sustained(fn, secs)
    smi.terminate()
    rows = [r.split(", ") for r in smi.communicate()[0].strip().splitlines() if r.count(",") == 3]
    rows = rows[len(rows) // 5:]  # past the ramp
    share = lambda i: 100 * sum(r[i].strip() == "Active" for r in rows) / max(1, len(rows))  # noqa: E731
    print(f"{name:12s} {ms:8.4f} ms {flop / ms / 1e9:6.0f} TFLOP/s  SM clock median "
          f"{statistics.median(float(r[0]) for r in rows):6.0f} MHz  power {statistics.median(float(r[1]) for r in rows):5.0f} W  "
          f"sw_power_cap {share(2):3.0f}%  hw_slowdown {share(3):3.0f}%  samples {len(rows)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="P1-full", help="a prefill workload of `attncore bench`")
    ap.add_argument("--flashinfer", action="store_true")
    ap.add_argument("--unit", action="store_true", help="also cuda_fa2 with prefill90's pipelined loop on the one-unit "
                    "grid (CudaFa2Backend.sm90_persist False)")
    a = ap.parse_args()
    w = bench.select_workloads([a.workload])[0]
    if w.op not in ("prefill", "ragged_prefill", "paged_prefill"):
        raise SystemExit(f"{a.workload}: a prefill workload (single, ragged or paged) only")
    flop, dt = bench._flops(w), torch.bfloat16
    x, y = (torch.randn(8192, 8192, device="cuda", dtype=dt) for _ in range(2))
    cols = [("cuda_fa2", bench._setup(w, "cuda_fa2", "cuda", dt, 1)[0][0], flop),
            ("torch-sdpa", bench._sdpa(w, "cuda", dt), flop),
            ("matmul8k", lambda: x @ y, 2 * 8192 ** 3)]
    if a.unit:
        from attncore.core import plan_cache, registry

        be = registry.entries()["cuda_fa2"].backend
        be.sm90_pipe, be.sm90_persist = True, False
        plan_cache.ONE_CALL_PLANS.clear()  # one-call workloads cache their plans by signature
        cols.insert(1, ("cuda_fa2-unit", bench._setup(w, "cuda_fa2", "cuda", dt, 1)[0][0], flop))
        be.sm90_pipe, be.sm90_persist = None, None
    if a.flashinfer:
        import flashinfer

        cols.insert(1, ("flashinfer", bench._setup(w, "-", "cuda", dt, 1, api=flashinfer)[0][0], flop))
    for _ in range(2):
        for name, fn, fl in cols:
            if fn is not None:
                window(name, fn, fl)


if __name__ == "__main__":
    main()
