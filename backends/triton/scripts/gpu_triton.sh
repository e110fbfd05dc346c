#!/usr/bin/env bash
# One device call: install, time the standard workloads (fresh Triton cache, so first-call times
# include compilation), then run the GPU tests of the Triton backend.  Results land in $OUT.
#   bash backends/triton/scripts/gpu_triton.sh [bench args, e.g. --sweep or --only D1,P1]
set -u
OUT=${OUT:-$PWD/.out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export TRITON_CACHE_DIR=$(mktemp -d)
unset TRITON_INTERPRET
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "=== bench"
timeout ${BENCH_TIMEOUT:-330} python3 backends/triton/bench/triton_bench.py "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^  File" | tail -70
echo "=== tests (gpu)"
timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q -x -m gpu tests/test_triton_backend.py -p no:cacheprovider \
  2>&1 | tee "$OUT/tests.log" | tail -25
