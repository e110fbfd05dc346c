#!/usr/bin/env bash
# xqa, issue 15 items 2-3 and issue 14 item 3, in ONE device call (about 4-5 minutes with a cold JIT):
# install, xqa tests (workspace, graphs, numerics), the conformance suite for xqa, and the decode
# timings that compare with the figures before this change (BENCHMARKS.md).  Short table last.
# Usage (device machine, repo root): bash backends/xqa/scripts/gpu_issue15.sh   -> logs under $OUT
set -uo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1 ATTNCORE_JIT_QUIET=1
OUT=${OUT:-/tmp/xqa_issue15}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/attncore-sdpa 2>&1 | tail -3
status() { if [ "$1" = 0 ]; then echo pass; else echo "FAIL(rc=$1)"; fi; }
echo "== tests/test_xqa_workspace.py" | tee "$OUT/log.txt"
timeout 90 python3 -m pytest tests/test_xqa_workspace.py -q -rf -p no:cacheprovider 2>&1 | tail -15 | tee -a "$OUT/log.txt"
r_ws=${PIPESTATUS[0]}
echo "== tests/test_xqa.py" | tee -a "$OUT/log.txt"
timeout 120 python3 -m pytest tests/test_xqa.py -q -rf -p no:cacheprovider 2>&1 | tail -15 | tee -a "$OUT/log.txt"
r_x=${PIPESTATUS[0]}
echo "== conformance xqa" | tee -a "$OUT/log.txt"
timeout 90 python3 -m attncore.cli conformance xqa -q 2>&1 | tail -15 | tee -a "$OUT/log.txt"
r_c=${PIPESTATUS[0]}
echo "== bench --backend xqa (D1 D2-B1 D5 X1-*)" | tee -a "$OUT/log.txt"
timeout 60 python3 -m attncore.cli bench --backend xqa --workload D1 --workload D2-B1 --workload D5 --workload X1 \
  --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tee -a "$OUT/log.txt"
r_b=${PIPESTATUS[0]}
echo
echo "| step | result |"
echo "|---|---|"
echo "| test_xqa_workspace.py (no alloc over 100 cycles, graph replay == eager, plan invariants) | $(status $r_ws) |"
echo "| test_xqa.py | $(status $r_x) |"
echo "| conformance xqa | $(status $r_c) |"
echo "| bench D1 D2-B1 D5 X1 | $(status $r_b) (table above; compare with BENCHMARKS.md) |"
