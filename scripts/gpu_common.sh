# The preamble the GPU scripts share.  Source it from the repo root on the device machine, after setting
# PHASES where the script has phases:   PHASES=${1:-"a b"}; source scripts/gpu_common.sh
# It sets the shell options, the kernel cache, $OUT (what comes back from a device call) and the clock,
# and defines:
#   stamp MSG            a line "[seconds since the start] MSG"
#   has PHASE            whether PHASE is one of $PHASES
#   gpu_header [FIELDS]  the GPU(s) (nvidia-smi --query-gpu FIELDS, default name,driver_version) and the date
#   install_tree [PATH]  pip install -e . (and -e PATH for each PATH, e.g. plugins/attncore-sdpa), no deps
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
