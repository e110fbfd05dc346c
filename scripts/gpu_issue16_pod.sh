#!/usr/bin/env bash
# Issue 16 (POD in one launch) on one GPU, within ~500 s: install, the fused POD tests in bf16 on the
# GPU (tests/test_pod_fused.py, marked gpu, plus its CPU-shaped cases run on the GPU's interpreter-free
# path), then `attncore bench` for PD1/PD2 (fused vs composed-serial vs auto) and the sweep (prefill
# 512/2k/8k x decode batch 8/32/128 x kv 1k/4k/16k), once with the default grid launch and once with
# the persistent one (POD_MODE), and a short table last.  FI=1 adds FlashInfer's POD (needs
# .anchors/fi_setup.sh, see scripts/gpu_before_after.sh).  Logs, JSON and the plot under $OUT.
# Usage on the device machine:  [FI=0] [SWEEP=1] bash scripts/gpu_issue16_pod.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 ATTNCORE_CACHE_DIR=/tmp/attncore-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/attncore-sdpa 2>&1 | grep -v WARNING
python3 -m pip install -q matplotlib > /dev/null 2>&1 || echo "matplotlib not installable: no plot"
FIARG=""
if [ "${FI:-0}" = 1 ]; then
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
  # shellcheck disable=SC1091
  ANCHORS_DIR=.anchors source .anchors/fi_setup.sh && FIARG="--flashinfer"
fi
stamp "installed"
timeout 200 python3 -m pytest -q -m gpu tests/test_pod_fused.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
stamp "gpu tests done"
SW=""; [ "${SWEEP:-1}" = 1 ] && SW="--pod-sweep"
# the persistent launch shape, selected through the backend's constructor option (one small driver)
cat > /tmp/pod_mode.py <<'PY'
import sys, json
from attncore.core import registry
from attncore.cli import bench_pod
mode = sys.argv[1]
b = registry.entries()["triton"].backend
b._pod = (b._pod[0], mode, 2, None)
info = bench_pod.run_pod_bench(["PD1", "PD2"], device="cuda")
print(bench_pod.format_pod_table(info))
json.dump(info, open(sys.argv[2], "w"), indent=1, default=str)
PY
timeout 120 python3 /tmp/pod_mode.py persistent "$OUT/pod_persistent.json" > "$OUT/pod_persistent.txt" 2>&1
stamp "persistent PD1/PD2 done"
# shellcheck disable=SC2086
timeout 330 python3 -m attncore.cli bench --workload PD1 --workload PD2 $SW $FIARG --device cuda \
  --json "$OUT/pod_bench.json" --plot "$OUT/pod_speedup.png" > "$OUT/pod_bench.txt" 2> "$OUT/pod_bench.err"
stamp "bench done (rc $?)"
tail -5 "$OUT/pod_bench.err"
echo "== persistent launch (PD1/PD2) =="; cat "$OUT/pod_persistent.txt" | tail -4
echo "== tests =="; tail -2 "$OUT/tests.txt"
echo "== POD bench (grid launch; targets: PD1 fused x >= 1.15, PD2 fused < 0.40 ms, sweep worst auto >= 0.98) =="
cat "$OUT/pod_bench.txt"
