# The preamble the GPU scripts share.  Source it from the repo root on the device machine, after setting
# PHASES where the script has phases:   PHASES=${1:-"a b"}; source scripts/gpu_common.sh
# It sets the shell options, the kernel cache, $OUT (what comes back from a device call) and the clock,
# and defines:
#   stamp MSG            a line "[seconds since the start] MSG"
#   has PHASE            whether PHASE is one of $PHASES
#   gpu_header [FIELDS]  the GPU(s) (nvidia-smi --query-gpu FIELDS, default name,driver_version) and the date
#   install_tree [PATH]  pip install -e . (and -e PATH for each PATH, e.g. plugins/attncore-sdpa), no deps
#   pod_gpu_checks       the fused POD GPU tests (CUDA-graph capture included) -> $OUT/tests.txt, and the conformance
#                        suite's POD graph cases on Triton -> $OUT/pod_graph_conformance.txt
set -uo pipefail
export PYTHONUNBUFFERED=1 ATTNCORE_CACHE_DIR=${ATTNCORE_CACHE_DIR:-/tmp/attncore-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
has() { [[ " ${PHASES:-} " == *" $1 "* ]]; }
gpu_header() { nvidia-smi --query-gpu="${1:-name,driver_version}" --format=csv,noheader; date -u; }
install_tree() {
  local a=(-e .) p
  for p in "$@"; do a+=(-e "$p"); done
  python3 -m pip install -q --no-deps --no-build-isolation "${a[@]}" 2>&1 | grep -v WARNING
}
# The device tool brings back at most 8 files from $OUT: the text logs go into one archive (logs.tgz), so the JSON
# and plots a script writes come back beside it.  Call last, once the logs are printed.
bundle_logs() {
  (cd "$OUT" && shopt -s nullglob && f=(*.txt *.err *.log) && [ ${#f[@]} -gt 0 ] && tar czf logs.tgz "${f[@]}" \
    && rm -f "${f[@]}")
}
pod_gpu_checks() {
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pod_fused.py tests/test_triton_pod_graphs.py \
    "tests/test_pod_streams.py::test_streams_graph_capture_replay_after_replan_gpu" > "$OUT/tests.txt" 2>&1
  stamp "POD GPU tests (rc $?)"
  # Triton's fused op in CUDA-graph mode: the conformance suite's POD graph cases captured for real
  timeout 120 python3 -m attncore.cli conformance triton -q -rfE -p no:cacheprovider --attncore-device cuda \
    -k "pod and graph" > "$OUT/pod_graph_conformance.txt" 2>&1
  stamp "POD graph conformance (rc $?)"
}
