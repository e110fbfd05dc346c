#!/usr/bin/env bash
# One device call for issue 13 (no silent wrong results): install, build cuda_fa2's libraries in
# parallel, the defect scripts of each backend, the GPU tests that touch the fixes, the conformance
# suites of the GPU backends (sharded), then `attncore check --fuzz` per backend.  Logs under $OUT.
# Usage on the device machine: [FUZZ_T=300] [JOBS=14] [FUZZ_ARGS="--device cuda:1 --stream side"]
#   bash scripts/gpu_issue13.sh [FUZZ_N] [PHASES]
#   (issue 13's bar: 10,000 problems per backend in under 5 minutes; 14 workers on 16 cores)
#   PHASES: any of "defects tests conformance fuzz" (default: all)
N=${1:-10000}
PHASES=${2:-"defects tests conformance fuzz"}
source scripts/gpu_common.sh
install_tree plugins/attncore-sdpa
gpu_header
python3 scripts/prebuild_conformance.py 2>&1 | tail -1
stamp "cuda_fa2 libraries built"
LOG="$OUT/issue13.log"; : > "$LOG"
if has defects; then
  for s in backends/triton/scripts/gpu_triton_issue13.py backends/cuda_fa2/scripts/gpu_cuda_issue13.py; do
    [ -f "$s" ] || continue
    python3 "$s" >> "$LOG" 2>&1; echo "$s: exit $?" | tee -a "$LOG"
  done
  grep -h "FAIL" "$LOG" | head -20
  stamp "defect scripts done"
fi
if has tests; then
  python3 -m pytest -q -p no:cacheprovider -x tests/test_bad_input.py tests/test_triton_backend.py tests/test_cuda_fa2.py \
    tests/test_xqa.py tests/test_fuzz.py tests/test_reference.py tests/test_sdpa_plugin.py >> "$LOG" 2>&1
  echo "GPU tests: $(tail -1 "$LOG")"
  stamp "tests done"
fi
if has conformance; then
  bash scripts/gpu_conformance.sh cuda_fa2 triton xqa 2>&1 | grep -v WARNING | tee -a "$LOG"
  stamp "conformance done"
fi
if has fuzz; then
  for b in triton cuda_fa2 xqa; do
    s=$(date +%s)
    timeout "${FUZZ_T:-300}" python3 -m attncore.cli check --fuzz "$N" --seed "${SEED:-13}" --backend "$b" \
      --jobs "${JOBS:-14}" --json "$OUT/fuzz_$b.json" ${FUZZ_ARGS:-} > "/tmp/fuzz_$b.txt" 2> "/tmp/fuzz_${b}_err.txt"
    echo "fuzz $b: exit $? in $(( $(date +%s) - s )) s"; head -12 "/tmp/fuzz_$b.txt"
    grep "problems," "/tmp/fuzz_${b}_err.txt" | tail -8
  done >> "$LOG" 2>&1
  cat /tmp/fuzz_*_err.txt | grep -v "problems,\|Warning\|val = self" | head -150 > "$OUT/fuzz_err.txt"
  stamp "fuzz done"
fi
