#!/usr/bin/env bash
# xqa backend on the GPU box, in ONE device call: install, cold build (timed), GPU tests, timings.
# Usage (device machine, repo root): bash scripts/gpu_xqa.sh   -> logs and JSON under $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/xqa_out}
mkdir -p "$OUT"
date -u | tee "$OUT/log.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$OUT/log.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
export ATTNCORE_CACHE_DIR=$(mktemp -d /tmp/attncore-cache.XXXX)   # empty: the build below is cold
export ATTNCORE_JIT_QUIET=1
echo "== cold build" | tee -a "$OUT/log.txt"
python3 benchmarks/xqa_bench.py --build-only --json "$OUT/build.json" 2>&1 | tee -a "$OUT/log.txt"
echo "== GPU tests" | tee -a "$OUT/log.txt"
# groups in separate processes: a device fault in one group cannot poison the others
for k in "not gpu_" "gpu_basic" "gpu_page_sizes or gpu_head_dims" "gpu_spec or gpu_large" "gpu_window or gpu_sinks" \
         "gpu_fp8" "gpu_split or gpu_scales" "gpu_batch_decode or gpu_noncontig or gpu_out_pre or gpu_cuda_graph or gpu_cuda_graph_replan" "gpu_sm80"; do
  echo "-- pytest -k '$k'" | tee -a "$OUT/log.txt"
  timeout 150 python3 -m pytest tests/test_xqa.py -q -rf -p no:cacheprovider -k "$k" 2>&1 | tail -25 | tee -a "$OUT/log.txt"
done
echo "== timings" | tee -a "$OUT/log.txt"
timeout ${XQA_BENCH_TIMEOUT:-200} python3 benchmarks/xqa_bench.py --json "$OUT/xqa_bench.json" 2>&1 | tee -a "$OUT/log.txt"
