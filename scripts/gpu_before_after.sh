#!/usr/bin/env bash
# One device call: `attncore bench` of the GPU backends for earlier trees of attncore and for this
# one, in one run on one machine, with FlashInfer 0.2.14 beside the current tree (warm its kernels
# first with scripts/fi_warm.py in an earlier call on the same warm machine: they JIT-compile for
# minutes, and compiling beside a timed run disturbs it).  Earlier trees travel as
# archives in the ignored .old/ folder (`git archive -o .old/NAME.tar REV attncore backends
# pyproject.toml README.md plugins`); FlashInfer's sdist in .anchors/ (../shared/anchors/README.md).
# Carry: .old .anchors.   Logs and JSON under $OUT.
# Usage on the device machine:
#   [TREES="before13 before14"] [NOW=1] [BACKENDS="cuda_fa2 triton xqa"] [WORKLOADS="P1 P2 ..."] [FI=1]
#   bash scripts/gpu_before_after.sh
source scripts/gpu_common.sh
BENCH=${BENCH:-/tmp/bench}; mkdir -p "$BENCH"  # kept across calls on a warm machine
REPO=$PWD
TREES=${TREES:-}
BACKENDS=${BACKENDS:-"cuda_fa2 triton xqa"}
WORKLOADS=${WORKLOADS:-"P1 P2 P3 P4 D1 D2 D3 D5 X1"}
bargs() {
  local a=""; for b in $BACKENDS; do a="$a --backend $b"; done
  for w in $WORKLOADS; do a="$a --workload $w"; done; echo "$a"
}
gpu_header
if [ "${FI:-1}" = 1 ]; then  # FlashInfer, its JIT cache in /tmp (kept while the machine stays warm)
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
  # shellcheck disable=SC1091
  ANCHORS_DIR=.anchors source .anchors/fi_setup.sh
fi
install() {  # $1: a directory holding an attncore tree
  (cd "$1" && install_tree plugins/attncore-sdpa)
  (cd "$1" && python3 -m attncore.cli build cuda_fa2 > /dev/null 2>&1)  # the common specializations, in parallel
}
for t in $TREES; do
  rm -rf "/tmp/tree_$t"; mkdir -p "/tmp/tree_$t" && tar xf ".old/$t.tar" -C "/tmp/tree_$t"
  install "/tmp/tree_$t"; stamp "$t installed"
  # shellcheck disable=SC2046
  (cd "/tmp/tree_$t" && python3 -m attncore.cli bench $(bargs) --json "$BENCH/bench_$t.json" > "$BENCH/bench_$t.txt" 2>/dev/null)
  stamp "$t benched: exit $?"
done
[ "${NOW:-1}" = 1 ] || { cp "$BENCH"/bench_* "$OUT"/; exit 0; }
NOWDIR=$REPO  # NOW_TAR=NAME: the current tree from .old/NAME.tar (a committed state, not the working copy)
if [ -n "${NOW_TAR:-}" ]; then
  NOWDIR=/tmp/tree_now; rm -rf "$NOWDIR"; mkdir -p "$NOWDIR" && tar xf ".old/$NOW_TAR.tar" -C "$NOWDIR"
fi
install "$NOWDIR"; stamp "current tree installed"
cd "$NOWDIR" || exit 1
if [ "${FI:-1}" = 1 ]; then  # warm first (scripts/fi_warm.py, e.g. beside a correctness run), or it compiles here
  # shellcheck disable=SC2046
  PYTHONPATH="$FI_ROOT" python3 -m attncore.cli bench $(bargs) --flashinfer --json "$BENCH/bench_now.json" \
    > "$BENCH/bench_now.txt" 2>/dev/null
else
  # shellcheck disable=SC2046
  python3 -m attncore.cli bench $(bargs) --json "$BENCH/bench_now.json" > "$BENCH/bench_now.txt" 2>/dev/null
fi
stamp "current tree benched: exit $?"
cp "$BENCH"/bench_* "$OUT"/
python3 "$REPO/scripts/compare_bench.py" $(for t in $TREES; do echo "$BENCH/bench_$t.json"; done) "$BENCH/bench_now.json"
