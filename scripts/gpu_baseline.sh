#!/usr/bin/env bash
# A fresh device's baseline: install without the sdpa plugin (auto then ranks our own kernels only),
# FlashInfer 0.2.14's kernels warmed in the background while cuda_fa2 builds and the POD GPU tests run (the
# fused launch captured in CUDA graphs, the conformance suite's POD graph cases), then `attncore bench` of
# the standard workloads, FlashInfer beside, in the same run.  Session 24 (H200, 16 cores): the warm of ten
# workloads took 461 s, so on a fresh machine the bench needs a second call on the warm machine (run it at
# once: a machine stays warm 30 s): `SKIP_SETUP=1 bash scripts/gpu_baseline.sh` (the bench, ~420 s).
# PD1/PD2 beside FlashInfer: scripts/gpu_issue16_pod.sh (FlashInfer's POD module JIT-builds inside the bench's
# own process, ~200 s; a warm in another process did not carry over).
# Carry .anchors (../shared/anchors/README.md).  Logs and JSON under $OUT; each step has its own time limit
# and the last one stops at the call's deadline, so a slow step costs the steps after it, not the output.
# TESTS="pytest arguments" runs those GPU tests in place of the POD ones (one step, 300 s at most).
# Usage on the device machine:  [SKIP_SETUP=1] [WORKLOADS="P1 P2 ..."] [BACKENDS="auto cuda_fa2 ..."] [END=590] \
#   [TESTS="tests/test_x.py -k y"] bash scripts/gpu_baseline.sh
source scripts/gpu_common.sh
WORKLOADS=${WORKLOADS:-"P1 P2 P3-p16 P4 D1 D2 D5"}
BACKENDS=${BACKENDS:-"auto cuda_fa2 triton xqa"}
left() { echo $(( ${END:-590} - ($(date +%s) - t0) )); }
gpu_header name,driver_version,clocks.max.sm,memory.total
install_tree
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
# shellcheck disable=SC1091
ANCHORS_DIR=.anchors source .anchors/fi_setup.sh
if [ "${SKIP_SETUP:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  PYTHONPATH="$PWD:$FI_ROOT" python3 scripts/fi_warm.py $WORKLOADS > "$OUT/fi_warm.txt" 2>&1 &
  warm=$!
  timeout 200 python3 -m attncore.cli build cuda_fa2 > "$OUT/build.txt" 2>&1
  stamp "installed, cuda_fa2 built (rc $?)"
  if [ -n "${TESTS:-}" ]; then
    eval "timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS" > "$OUT/tests.txt" 2>&1  # (its quotes)
    stamp "GPU tests (rc $?)"
  else
    pod_gpu_checks
  fi
  wait $warm; stamp "FlashInfer warm"
fi
a=""; for b in $BACKENDS; do a="$a --backend $b"; done
for w in $WORKLOADS; do a="$a --workload $w"; done
# shellcheck disable=SC2086
PYTHONPATH="$FI_ROOT" timeout "$(left)" python3 -m attncore.cli bench $a --flashinfer --device cuda \
  --json "$OUT/bench.json" 2> "$OUT/bench.err" | tee "$OUT/bench.txt" > /dev/null
stamp "bench (rc $?)"
if [ "${SKIP_SETUP:-0}" != 1 ]; then
  echo "== FlashInfer warm =="; cat "$OUT/fi_warm.txt"
  echo "== GPU tests =="; tail -25 "$OUT/tests.txt"
  [ -z "${TESTS:-}" ] && { echo "== POD graph conformance (triton) =="; tail -3 "$OUT/pod_graph_conformance.txt"; }
fi
echo "== bench =="; cat "$OUT/bench.txt"
