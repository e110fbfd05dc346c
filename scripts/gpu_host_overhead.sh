#!/usr/bin/env bash
# Host overhead of plan(), run() and the one-call functions (issue 15 item 1) on one GPU.  Phases:
#   tests   the gpu-marked tests of tests/test_host_overhead.py (plan() with host index tensors makes no
#           device sync, with device ones at most one; the values planned from device tensors), of
#           tests/test_workspace_api.py (no sync, memory flat across plan/run cycles) and of
#           tests/test_uploads.py (triton / cuda_fa2 plan() makes one host-to-device copy, runs correct)
#   graphs  the gpu-marked CUDA-graph tests of triton and cuda_fa2 (their graph-state registry and table
#           upload moved to attncore/core/graphs.py): replay after a re-plan equals eager
#   bench   `attncore bench --latency` for auto, triton, cuda_fa2, xqa (us per call, 300 calls, tiny
#           problems); with FI=1 and FlashInfer importable, its row too; then scripts/profile_plan.py's
#           plan()/run() host time per backend, batch 4 and 64 (profile_plan.txt)
# cuda_fa2 builds each specialization on first use (into $ATTNCORE_CACHE_DIR): on a cold machine run
# `tests graphs` and `bench` as two calls on the warm machine.  Logs under $OUT; the table last.
# Usage on the device machine:  bash scripts/gpu_host_overhead.sh [PHASES]   (default: "tests graphs bench")
PHASES=${1:-"tests graphs bench"}
source scripts/gpu_common.sh
gpu_header
install_tree plugins/attncore-sdpa
stamp "installed"
LINES=()
run_tests() {  # name, timeout, pytest args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE -m gpu "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  grep -h "^FAILED\|^ERROR" "$OUT/$name.txt" | head -20
  LINES+=("$name (exit $rc): $(tail -1 "$OUT/$name.txt")")
  stamp "$name done"
}
if has tests; then
  run_tests host_overhead "${TESTS_TIMEOUT:-300}" tests/test_host_overhead.py \
    tests/test_workspace_api.py -k "sync or memory or host"
  run_tests uploads "${TESTS_TIMEOUT:-300}" tests/test_uploads.py  # one host-to-device copy per plan()
fi
if has graphs; then
  run_tests graphs "${GRAPHS_TIMEOUT:-400}" tests/test_triton_graphs.py tests/test_cuda_fa2_graphs.py \
    tests/test_cuda_graph_api.py
fi
if has bench; then
  FI_ARG=""
  if [ "${FI:-0}" = 1 ] && python3 -c "import flashinfer" > /dev/null 2>&1; then FI_ARG="--flashinfer"; fi
  timeout "${BENCH_TIMEOUT:-400}" attncore bench --latency --backend auto --backend triton --backend cuda_fa2 \
    --backend xqa $FI_ARG --json "$OUT/latency.json" > "$OUT/latency.txt" 2> "$OUT/latency.err"
  LINES+=("bench --latency (exit $?)")
  for op in decode paged_prefill; do for be in triton cuda_fa2 xqa; do for b in 4 64; do  # plan()/run() alone
    timeout 120 python3 scripts/profile_plan.py --op $op --backend $be --batch $b --reps 300 2>&1 | tail -1
  done; done; done > "$OUT/profile_plan.txt"
  stamp "bench done"
fi
printf '%s\n' "${LINES[@]}"
[ -f "$OUT/profile_plan.txt" ] && cat "$OUT/profile_plan.txt"
[ -f "$OUT/latency.txt" ] && cat "$OUT/latency.txt"
stamp "done"
