"""One call of a workload's kernel per backend, between cudaProfilerStart / Stop, for Nsight Compute to count
(instructions by opcode, shared-memory wavefronts, per-SASS-line counts): attncore's chosen backend (or
``--backend``) and, with ``--flashinfer``, FlashInfer 0.2.14 on the same workload.  BENCHMARKS.md 2ao.

    ncu --profile-from-start off --metrics sass__inst_executed_per_opcode --print-metric-instances details --csv \\
        python3 scripts/ncu_kernels.py R1-16x1k --flashinfer
    ncu --profile-from-start off -k regex:fa2 --section SourceCounters --page source --print-source sass --csv \\
        python3 scripts/ncu_kernels.py R1-16x1k

(FlashInfer on PYTHONPATH: ``ANCHORS_DIR=.anchors source .anchors/fi_setup.sh; PYTHONPATH=$FI_ROOT ...``.)
"""
import argparse

import torch

from attncore.cli import bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", help="an `attncore bench` workload id")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--flashinfer", action="store_true")
    a = ap.parse_args()
    w = bench.select_workloads([a.workload])[0]
    dt = torch.bfloat16
    runs = [bench._setup(w, a.backend, "cuda", dt, 1)[0][0]]
    if a.flashinfer:
        runs.append(bench._setup(w, "auto", "cuda", dt, 1, api=bench._import_flashinfer("cuda"))[0][0])
    for fn in runs:  # builds, JIT and autotuning outside the profiled range
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in runs:
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
