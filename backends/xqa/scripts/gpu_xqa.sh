#!/usr/bin/env bash
# xqa backend on the GPU box, in ONE device call: install, cold build (timed), GPU tests, timings.
# Usage (device machine, repo root): bash backends/xqa/scripts/gpu_xqa.sh   -> logs and JSON under $OUT
# Parameters (environment), to fit shorter device calls:
#   XQA_COLD_BUILD=0         skip the cold-build timing
#   XQA_TEST_GROUPS="a;b"    pytest -k groups to run (default: all of them, one process each);
#                            "none" runs no tests
#   XQA_TEST_TUNES="t1 t2"   also run the groups on tuning variants (XQA_TEST_TUNE, e.g. kpw32st2)
#   XQA_TUNE_TEST_GROUPS="a;b"  the groups of those tuned runs (default: XQA_TEST_GROUPS)
#   XQA_TEST_PARALLEL=1      run the test processes at the same time (correctness only; no timing)
#   XQA_TUNE=1               run backends/xqa/bench/xqa_tune.py first (args in XQA_TUNE_ARGS)
#   XQA_BENCH=0              skip backends/xqa/bench/xqa_bench.py (timeout XQA_BENCH_TIMEOUT, default 200 s)
set -uo pipefail
cd "$(dirname "$0")/../../.."  # the repo root
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/xqa_out}
mkdir -p "$OUT"
date -u | tee "$OUT/log.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$OUT/log.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
export ATTNCORE_CACHE_DIR=$(mktemp -d /tmp/attncore-cache.XXXX)   # empty: the build below is cold
export ATTNCORE_JIT_QUIET=1
if [ "${XQA_COLD_BUILD:-1}" != 0 ]; then
  echo "== cold build" | tee -a "$OUT/log.txt"
  python3 backends/xqa/bench/xqa_bench.py --build-only --json "$OUT/build.json" 2>&1 | tee -a "$OUT/log.txt"
fi
if [ "${XQA_TUNE:-0}" != 0 ]; then
  echo "== tuning sweep" | tee -a "$OUT/log.txt"
  # shellcheck disable=SC2086
  timeout ${XQA_TUNE_TIMEOUT:-150} python3 backends/xqa/bench/xqa_tune.py --json "$OUT/xqa_tune.json" ${XQA_TUNE_ARGS:-} 2>&1 \
    | tee "$OUT/tune.txt" | tee -a "$OUT/log.txt" >/dev/null
fi
TGROUPS_DEFAULT="not gpu_;gpu_basic;gpu_page_sizes or gpu_head_dims;gpu_spec or gpu_large;gpu_window or gpu_sinks;gpu_fp8;gpu_split or gpu_scales;gpu_batch_decode or gpu_noncontig or gpu_out_pre or gpu_cuda_graph or gpu_cuda_graph_replan;gpu_sm80"
TGROUPS=${XQA_TEST_GROUPS:-$TGROUPS_DEFAULT}   # (not GROUPS: a bash builtin)
if [ "$TGROUPS" != none ]; then
  echo "== GPU tests${XQA_TEST_PARALLEL:+ (groups in parallel)}" | tee -a "$OUT/log.txt"
  # groups in separate processes: a device fault in one group cannot poison the others
  mkdir -p /tmp/xqa_tests
  n=0
  for tune in "" ${XQA_TEST_TUNES:-}; do
    gl=$TGROUPS
    [ -n "$tune" ] && gl=${XQA_TUNE_TEST_GROUPS:-$TGROUPS}
    IFS=';' read -ra GL <<< "$gl"
    for k in "${GL[@]}"; do
      n=$((n + 1))
      log=/tmp/xqa_tests/$n.txt
      echo "-- pytest -k '$k' ${tune:+(XQA_TEST_TUNE=$tune)}" > "$log"
      cmd=(env XQA_TEST_TUNE="$tune" timeout "${XQA_TEST_TIMEOUT:-150}" python3 -m pytest tests/test_xqa.py -q -rf
           -p no:cacheprovider -k "$k")
      if [ -n "${XQA_TEST_PARALLEL:-}" ]; then
        ("${cmd[@]}" 2>&1 | tail -25 >> "$log") &
      else
        "${cmd[@]}" 2>&1 | tail -25 >> "$log"
        cat "$log" | tee -a "$OUT/log.txt"
      fi
    done
  done
  if [ -n "${XQA_TEST_PARALLEL:-}" ]; then
    wait
    for i in $(seq 1 $n); do cat /tmp/xqa_tests/$i.txt | tee -a "$OUT/log.txt"; done
  fi
fi
if [ "${XQA_BENCH:-1}" != 0 ]; then
  echo "== timings" | tee -a "$OUT/log.txt"
  timeout ${XQA_BENCH_TIMEOUT:-200} python3 backends/xqa/bench/xqa_bench.py --json "$OUT/xqa_bench.json" 2>&1 | tee -a "$OUT/log.txt"
fi
[ -f "$OUT/tune.txt" ] && sed -n '/^| workload/,$p' "$OUT/tune.txt"
