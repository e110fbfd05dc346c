#!/usr/bin/env bash
# One device call for the integrated stack: install, bench through the public API (ceilings and
# torch SDPA in the same run), the GPU tests of the latest changes, then `attncore check`.
# Usage on the device machine: bash scripts/gpu_check.sh   (writes under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1 ATTNCORE_CACHE_DIR=/tmp/attncore-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/attncore-sdpa 2>&1 | grep -v WARNING
python3 -m attncore.cli info > "$OUT/info.txt" 2>&1; head -3 "$OUT/info.txt"
timeout 240 python3 -m attncore.cli bench --workload P1 --workload P3 --workload P4 --workload D1 --workload D5 \
  --workload X1-q1 --backend auto --backend triton --backend cuda_fa2 --backend xqa --backend sdpa \
  --json "$OUT/bench.json" > "$OUT/bench.txt" 2> "$OUT/bench.log"
cat "$OUT/bench.txt"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_backend.py -k "gpu_dense" \
  > "$OUT/tests.txt" 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_fa2.py \
  -k "single_prefill or batch_prefill_paged_edges or batch_prefill_ragged or split_kv_prefill" >> "$OUT/tests.txt" 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph_api.py tests/test_xqa.py -k "graph" \
  >> "$OUT/tests.txt" 2>&1
timeout 110 python3 -m attncore.cli conformance xqa -q -p no:cacheprovider > "$OUT/conformance_xqa.txt" 2>&1
echo "conformance xqa rc=$?"; tail -1 "$OUT/conformance_xqa.txt"
grep -a "passed\|failed" "$OUT/tests.txt"
timeout 150 python3 -m attncore.cli check --quick --json "$OUT/check.json" > "$OUT/check.txt" 2> "$OUT/check.log"
echo "check rc=$?"; tail -2 "$OUT/check.txt"
