#!/usr/bin/env bash
# Issue 15, API side, on one GPU (< 500 s): install, the GPU tests of the workspace / CUDA-graph / plan-cache API
# (memory flat over 100 plan/run cycles per backend, plan() without a sync on host index tensors), then
# `attncore bench --latency`, beside FlashInfer 0.2.14 when .anchors/fi_setup.sh sets it up (as
# scripts/gpu_before_after.sh does; its JIT builds count against the time, so FI=0 skips it). Table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/attncore-sdpa 2>&1 | grep -v WARNING
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_workspace_api.py tests/test_cuda_graph_api.py \
  tests/test_plan_cache.py tests/test_latency.py 2>&1 | tail -25
FIARG=""
if [ "${FI:-1}" = 1 ] && [ -f .anchors/fi_setup.sh ]; then
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
  # shellcheck disable=SC1091
  ANCHORS_DIR=.anchors source .anchors/fi_setup.sh > "$OUT/fi_setup.log" 2>&1 && FIARG="--flashinfer"
fi
PYTHONPATH="${FI_ROOT:-}" timeout 220 python3 -m attncore.cli bench --latency $FIARG --json "$OUT/latency.json" \
  2>"$OUT/latency.err" | tee "$OUT/latency.txt"
