#!/usr/bin/env bash
# cuda_fa2, issue 15 items 2-3 and issue 14 item 3, in ONE device call (at most ~530 s; an H100):
# install, prebuild the conformance libraries in parallel, the cuda_fa2 tests (tests/test_cuda_fa2*.py:
# numerics, graph replay == eager for every op x feature, memory flat over 100 plan/run cycles), the
# conformance suite for cuda_fa2 (its cuda_graph family now runs: the batch ops claim cuda_graph), and
# the standard timings P1 P3 P4 D1 to compare with BENCHMARKS.md (same speed expected).  Short table last.
# Usage (device machine, repo root): bash backends/cuda_fa2/scripts/gpu_issue15.sh   -> logs under $OUT
set -uo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1 ATTNCORE_JIT_QUIET=1 ATTNCORE_CACHE_DIR=${ATTNCORE_CACHE_DIR:-/tmp/attncore-cache}
OUT=${OUT:-/tmp/cuda_fa2_issue15}
mkdir -p "$OUT"
N=${SHARDS:-4}
T0=$(date +%s)
status() { if [ "$1" = 0 ]; then echo pass; else echo "FAIL(rc=$1)"; fi; }
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/attncore-sdpa 2>&1 | grep -v WARNING | tail -3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

echo "== prebuild (the conformance suite's specializations + the tests', one parallel build)" | tee "$OUT/log.txt"
timeout 220 python3 - <<'PYEOF' 2>&1 | tail -3 | tee -a "$OUT/log.txt"
import os, sys, time
import torch
sys.path[:0] = ["tests", "scripts"]
from attncore.build import jit
from attncore.testing import resolve_backend
from attncore.testing.cases import generate
from prebuild_conformance import candidate_keys
from test_cuda_fa2 import gpu_test_uris
import test_cuda_fa2_graphs as g
backend, _ = resolve_backend("cuda_fa2")
problems = [c.problem for fam, cases in generate(backend).items() if fam in ("numerics", "merge", "cuda_graph")
            for c in cases]
cc = torch.cuda.get_device_capability()
problems += [g._problem(op, compute_capability=cc, **f) for op in g.OPS for f in g.FEATURES.values()]
keys = set()
for p in problems:
    try:
        keys |= candidate_keys(backend, p)
    except ValueError:
        pass
specs = []
for k in sorted(keys, key=lambda k: k.uri):
    try:
        specs.append(k.spec())
    except ValueError:  # a combination no plan() builds
        pass
t = time.time()
res = jit.build("cuda_fa2", gpu_test_uris() + specs, jobs=os.cpu_count())
print(f"prebuilt {len(res)} specializations ({sum(1 for r in res if r.seconds)} built) in {time.time() - t:.0f} s")
PYEOF

echo "== conformance cuda_fa2 ($N shards, in the background) + tests" | tee -a "$OUT/log.txt"
for ((i = 0; i < N; i++)); do
  timeout 210 python3 -m attncore.cli conformance cuda_fa2 -q -p no:cacheprovider -rfE --attncore-shard "$i/$N" \
    > "$OUT/conformance_$i.txt" 2>&1 &
done
(timeout 210 python3 -m pytest tests/test_cuda_fa2_graphs.py -q -rfE -p no:cacheprovider > "$OUT/graphs_full.txt" 2>&1;
 echo $? > "$OUT/graphs.rc") &
timeout 210 python3 -m pytest tests/test_cuda_fa2.py -q -rfE -p no:cacheprovider > "$OUT/tests_full.txt" 2>&1
r_t=$?
wait
r_g=$(cat "$OUT/graphs.rc")
tail -15 "$OUT/graphs_full.txt" > "$OUT/graphs.txt"
tail -15 "$OUT/tests_full.txt" > "$OUT/tests.txt"
cat "$OUT/graphs.txt" "$OUT/tests.txt" | tee -a "$OUT/log.txt"
r_c=0
for ((i = 0; i < N; i++)); do
  last=$(tail -1 "$OUT/conformance_$i.txt")
  echo "conformance shard $i/$N: $last" | tee -a "$OUT/log.txt"
  echo "$last" | grep -q "failed\|error" && r_c=1
  echo "$last" | grep -q "passed" || r_c=1
done
grep -h "^FAILED\|^ERROR" "$OUT"/conformance_*.txt | head -20 | tee -a "$OUT/log.txt"

echo "== bench --backend cuda_fa2 (P1 P3 P4 D1)" | tee -a "$OUT/log.txt"
timeout 80 python3 -m attncore.cli bench --backend cuda_fa2 --workload P1 --workload P3 --workload P4 --workload D1 \
  --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tee -a "$OUT/log.txt"
r_b=${PIPESTATUS[0]}
echo
echo "total $(( $(date +%s) - T0 )) s"
echo "| step | result |"
echo "|---|---|"
echo "| test_cuda_fa2_graphs.py (graph replay == eager, op x feature; memory flat over 100 cycles) | $(status $r_g) |"
echo "| test_cuda_fa2.py (numerics vs the fp64 golden) | $(status $r_t) |"
echo "| conformance cuda_fa2 ($N shards; cuda_graph family included) | $(status $r_c) |"
echo "| bench P1 P3 P4 D1 | $(status $r_b) (table above; compare with BENCHMARKS.md) |"
