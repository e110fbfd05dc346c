#!/usr/bin/env bash
# One device call: install, cold-build the specializations (timed), GPU tests, benchmarks.
# Usage on the GPU machine (repo root): bash backends/cuda_fa2/scripts/gpu_cuda_fa2.sh [--quick] ; results under $OUT.
source scripts/gpu_common.sh
PY=python3
gpu_header name,driver_version,clocks.sm,clocks.mem
install_tree

echo "== cold build (cache $ATTNCORE_CACHE_DIR, $(nproc) cores)"
$PY - <<'PYEOF' 2>&1 | tee "$OUT/build.log"
import json, os, sys, time
sys.path.insert(0, "tests")
from attncore import jit
from test_cuda_fa2 import gpu_test_uris
uris = gpu_test_uris()
t0 = time.time()
res = jit.build("cuda_fa2", uris, jobs=os.cpu_count())
wall = time.time() - t0
rows = [{"uri": r.spec.uri_for(r.arch), "seconds": round(r.seconds, 2), "built": r.built} for r in res]
for r in sorted(rows, key=lambda r: -r["seconds"]):
    print(f"  {r['uri']:60s} {r['seconds']:6.1f} s")
print(f"built {len(rows)} specializations in {wall:.1f} s wall ({os.cpu_count()} cores); "
      f"per-spec max {max(r['seconds'] for r in rows):.1f} s")
json.dump({"wall_s": wall, "specs": rows}, open(os.path.join(os.environ["OUT"] if "OUT" in os.environ else "/tmp", "build.json"), "w"), indent=1)
PYEOF

echo "== GPU tests"
timeout 300 $PY -m pytest -q -m gpu tests/test_cuda_fa2.py -rfE -x --tb=short 2>&1 | tee "$OUT/tests.log" | tail -40

echo "== benchmarks"
timeout 240 $PY backends/cuda_fa2/bench/cuda_fa2_bench.py "$OUT/cuda_fa2-h100.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -30

if [ "${FA2_TUNE:-0}" = "1" ]; then
  echo "== tuning sweep"
  timeout 240 $PY backends/cuda_fa2/bench/cuda_fa2_tune.py "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | tail -20
fi
