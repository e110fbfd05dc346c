#!/usr/bin/env bash
# One device call (H100, under 550 s): the Triton backend's workspaces and CUDA graphs (issue 15 items
# 2-3) and its plan/binding split (issue 14 item 3).
#   1. `attncore bench` of P1 P3 P4 D1 D2-B1 on the tree before these changes (.old/before15_triton.tar,
#      carried: `git archive -o .old/before15_triton.tar fde3041 attncore backends pyproject.toml
#      README.md plugins`; skipped when absent);
#   2. this tree: the GPU tests of tests/test_triton*.py beside the triton conformance suite in shards;
#   3. `attncore bench` of the same workloads on this tree, alone on the GPU;
#   4. a short table last: tests, conformance shards, bench before / after.
# Usage on the device machine (carry .old):  bash backends/triton/scripts/gpu_issue15.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 ATTNCORE_CACHE_DIR=/tmp/attncore-cache TRITON_CACHE_DIR=/tmp/triton-cache
unset TRITON_INTERPRET
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${SHARDS:-6}
REPO=$PWD
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
WL="--workload P1 --workload P3 --workload P4 --workload D1 --workload D2-B1"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/attncore-sdpa 2>&1 \
  | grep -v WARNING); }

if [ -f .old/before15_triton.tar ]; then
  rm -rf /tmp/tree_before15 && mkdir -p /tmp/tree_before15 && tar xf .old/before15_triton.tar -C /tmp/tree_before15
  install /tmp/tree_before15
  # shellcheck disable=SC2086
  (cd /tmp/tree_before15 && timeout 130 python3 -m attncore.cli bench --backend triton $WL \
    --json "$OUT/bench_before.json" > "$OUT/bench_before.txt" 2>&1)
  stamp "before: bench done"
fi
install "$REPO"
stamp "this tree installed"

PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 280 python3 -m pytest -q -m gpu tests/test_triton_graphs.py \
  tests/test_triton_backend.py -p no:cacheprovider -rfE > "$OUT/tests.txt" 2>&1 &
for ((i = 0; i < N; i++)); do
  timeout 280 python3 -m attncore.cli conformance triton -q -p no:cacheprovider -rfE --attncore-shard "$i/$N" \
    > "$OUT/conformance_triton_$i.txt" 2>&1 &
done
wait
stamp "tests and conformance done"
# shellcheck disable=SC2086
timeout 130 python3 -m attncore.cli bench --backend triton $WL --json "$OUT/bench_after.json" \
  > "$OUT/bench_after.txt" 2>&1
stamp "after: bench done"

echo "=== failures (first 30)"
grep -h "^FAILED\|^ERROR" "$OUT"/tests.txt "$OUT"/conformance_triton_*.txt | head -30
echo "=== summary"
echo "gpu tests (test_triton_graphs + test_triton_backend -m gpu): $(tail -1 "$OUT/tests.txt")"
for ((i = 0; i < N; i++)); do echo "conformance triton shard $i/$N: $(tail -1 "$OUT/conformance_triton_$i.txt")"; done
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    if not os.path.exists(p):
        return {}
    try:
        return {r["workload"]: r for r in json.load(open(p))["results"] if r.get("backend") == "triton"}
    except Exception as e:  # a bench that crashed: say so in the table
        return {"(unreadable %s: %s)" % (name, e): {}}
b, a = load("bench_before.json"), load("bench_after.json")
print("| workload | before ms | after ms | after/before | after TFLOP/s or TB/s |")
print("|---|---|---|---|---|")
for w in sorted(set(b) | set(a)):
    tb, ta = b.get(w, {}).get("time_ms"), a.get(w, {}).get("time_ms")
    fig = a.get(w, {}).get("TFLOPs") or a.get(w, {}).get("TBps")
    ratio = "%.3f" % (ta / tb) if tb and ta else "-"
    print("| %s | %s | %s | %s | %s |" % (w, "%.4f" % tb if tb else "-",
                                          "%.4f" % ta if ta else a.get(w, {}).get("status", "-"), ratio,
                                          "%.1f" % fig if fig else "-"))
EOF
stamp "total"
