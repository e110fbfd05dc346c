#!/usr/bin/env bash
# prefill90 variants in one device call: the prefill90 GPU tests on each variant's defines (FA2_TEST_TUNE, the
# warp-specialized cases: outputs NaN-poisoned, against the fp64 golden), then the variants timed beside each other
# and Triton on the workloads (variants_bench.py, interleaved rounds), a short table last.  Logs under $OUT.
#   WORKLOADS="P1-causal P1-full"  VARIANTS="default: sepkv3:pipe:FA2_H_SEPKV=1"
#   TEST_TUNES="FA2_H_SEPKV=1@pipe;..."  (each: the defines, then after @ an optional pytest -k filter on the loop:
#   "pipe" or "loop"; the warp-specialized cases of test_prefill90 either way; TEST_TIMEOUT seconds each, 240; an entry
#   that starts "persist:" runs with FA2_TEST_PERSIST=1: its contiguous d128 cases on the persistent grid)
#   SUSTAIN=1.5: time back-to-back windows of that many seconds (variants_bench --sustain) instead of do_bench
#   FI=1: FlashInfer 0.2.14 beside (its kernels warmed during the tests; carry .anchors)
# Usage on the device machine:  WORKLOADS=... VARIANTS=... TEST_TUNES=... bash backends/cuda_fa2/scripts/gpu_variants.sh
source scripts/gpu_common.sh
gpu_header name,driver_version,clocks.max.sm
install_tree
IFS=';' read -ra TT <<< "${TEST_TUNES:-}"
i=0
if [ "${FI:-0}" = 1 ]; then
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
  # shellcheck disable=SC1091
  ANCHORS_DIR=.anchors source .anchors/fi_setup.sh
  # shellcheck disable=SC2086
  PYTHONPATH="$PWD:$FI_ROOT" python3 scripts/fi_warm.py ${WORKLOADS:-P1-causal} > "$OUT/fi_warm.txt" 2>&1 &
fi
for tt in "${TT[@]}"; do
  i=$((i + 1))
  persist=0
  [[ "$tt" == persist:* ]] && { persist=1; tt=${tt#persist:}; }
  k="test_prefill90 and ws and not nows and bf16"
  [[ "$tt" == *@* ]] && k="$k and ${tt#*@}"
  FA2_TEST_PERSIST=$persist FA2_TEST_TUNE="${tt%@*}" timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_fa2.py \
    -k "$k" -rfE --tb=short > "$OUT/tests_$i.txt" 2>&1 &
done
wait
stamp "tests"
args=()
for w in ${WORKLOADS:-P1-causal}; do args+=(--workload "$w"); done
for v in ${VARIANTS:-default:}; do args+=(--variant "$v"); done
[ "${FI:-0}" = 1 ] && args+=(--flashinfer)
PYTHONPATH="${FI_ROOT:-}" timeout 400 python3 backends/cuda_fa2/scripts/variants_bench.py "${args[@]}" --rounds "${ROUNDS:-3}" \
  ${SUSTAIN:+--sustain "$SUSTAIN"} > "$OUT/bench.txt" 2> "$OUT/bench.err"
stamp "bench (rc $?)"
i=0
[ "${FI:-0}" = 1 ] && tail -2 "$OUT/fi_warm.txt"
for tt in "${TT[@]}"; do i=$((i + 1)); echo "== tests with $tt: $(tail -1 "$OUT/tests_$i.txt")"; done
cat "$OUT/bench.txt"; tail -3 "$OUT/bench.err"
