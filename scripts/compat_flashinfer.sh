#!/usr/bin/env bash
# FlashInfer 0.2.14's own test files, read and run straight from its sdist, against attncore through
# the `flashinfer` -> attncore import shim of tests/compat (issue 18).  No FlashInfer test code is
# copied into the project: the sdist's tests/ directory is where pytest collects from.
#
# Usage, from anywhere (normally the repo root; on the GPU machine):
#   [COMPAT_SAMPLE=20] [COMPAT_JOBS=6] bash scripts/compat_flashinfer.sh [--collect-only] [test_x.py ...]
# Files default to the 14 of issue 18.  Logs, JSON lines, JUnit XML and summary.json go to
# $OUT/compat (else /tmp/compat_flashinfer); the per-file table is printed at the end.  Exit 0 when
# every selected case passed or was skipped.  `--have-tests`: only whether FlashInfer's tests can be found
# (unpacked, or an sdist to unpack): exit 0, else 2 with the message; nothing runs.
#
# Environment:
#   COMPAT_SAMPLE=N      keep about 1 in N parametrized cases per test function (default 20; 1 = all)
#   COMPAT_SAMPLE_MIN=K  at least K cases per test function (default 3)
#   COMPAT_SAMPLE_MAX=M  at most M per test function before the coverage pass (default 0: no cap)
#   COMPAT_SEED=S        another deterministic sample (default 0)
#   COMPAT_COVER=0|1     1 (default): also every value of every parameter at least once
#   COMPAT_JOBS=J        test files run as J concurrent pytest processes on the one GPU (default 6; 14 ran
#                        some cases out of an 80 GB GPU's memory, 8 did not)
#   COMPAT_SPLIT="F:N .." file F runs as N processes, each 1/N of its selected cases (compat_sample's
#                        --compat-shard; logs <stem>.s<I>of<N>.*, one row in the table);
#                        default "test_batch_prefill_kernels.py:4 test_batch_decode_kernels.py:3", the files
#                        with the most (and the slowest: Triton compiling RoPE variants) cases
#   COMPAT_FILE_TIMEOUT  seconds per file before SIGINT (pytest then reports what ran; default 500)
#   COMPAT_DEADLINE      seconds from the start by which every file has stopped, so that the table is
#                        printed inside a 600 s device call (default 540); a file that would get
#                        less than 30 s is not started (reported as NOT STARTED)
#   COMPAT_TB            pytest --tb style (default short)
# Cases that fail out of GPU memory (beside the other processes) run again in one process at the end,
# while the deadline allows; the table counts that outcome ("run again alone").
#   COMPAT_SDIST         the sdist (default: .anchors/, then ../shared/anchors/, /work/shared/anchors/)
#   COMPAT_UNPACK_DIR    where the sdist is (or gets) unpacked (default /tmp/fi, as fi_setup.sh does;
#                        only its tests/ directory is extracted when missing)
#   COMPAT_FI_TESTS      an unpacked tests/ directory to use instead
#   COMPAT_INSTALL=0     do not `pip install -e .` when attncore is not installed from this checkout
#   PYTHON               interpreter (default python3)
#   Extra pytest arguments: COMPAT_PYTEST_ARGS (e.g. "-k decode -x").
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
COMPAT=$REPO/tests/compat
PY=${PYTHON:-python3}
SDIST_NAME=flashinfer_python-0.2.14.post1
COLLECT_ONLY=0
HAVE_TESTS=0
FILES=()
for a in "$@"; do
  case $a in
    --collect-only) COLLECT_ONLY=1 ;;
    --have-tests) HAVE_TESTS=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) FILES+=("$(basename "$a")") ;;
  esac
done
# heaviest first, so that concurrent processes finish together
[ ${#FILES[@]} -gt 0 ] || FILES=(
  test_batch_prefill_kernels.py test_batch_decode_kernels.py test_pod_kernels.py test_tensor_cores_decode.py
  test_sliding_window.py test_logits_cap.py test_non_contiguous_prefill.py test_single_prefill.py test_alibi.py
  test_decode_fp8_calibration_scale.py test_non_contiguous_decode.py test_quantization.py test_page.py
  test_decode_prefill_lse.py)
export COMPAT_SAMPLE=${COMPAT_SAMPLE:-20} COMPAT_SAMPLE_MIN=${COMPAT_SAMPLE_MIN:-3} \
  COMPAT_SAMPLE_MAX=${COMPAT_SAMPLE_MAX:-0} COMPAT_SEED=${COMPAT_SEED:-0} \
  COMPAT_COVER=${COMPAT_COVER:-1}
JOBS=${COMPAT_JOBS:-6}
FILE_TIMEOUT=${COMPAT_FILE_TIMEOUT:-500}
DEADLINE=${COMPAT_DEADLINE:-540}
TB=${COMPAT_TB:-short}
WORK=${OUT:+$OUT/compat}; WORK=${WORK:-/tmp/compat_flashinfer}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

# 1. FlashInfer's test files, from the sdist
UNPACK=${COMPAT_UNPACK_DIR:-/tmp/fi}
FI_TESTS=${COMPAT_FI_TESTS:-$UNPACK/$SDIST_NAME/tests}
if [ ! -f "$FI_TESTS/test_single_prefill.py" ]; then
  SDIST=${COMPAT_SDIST:-}
  if [ -z "$SDIST" ]; then
    for c in "$REPO/.anchors" "$REPO/../shared/anchors" /work/shared/anchors; do
      [ -f "$c/$SDIST_NAME.tar.gz" ] && { SDIST=$c/$SDIST_NAME.tar.gz; break; }
    done
  fi
  [ -n "$SDIST" ] && [ -f "$SDIST" ] || { echo "no FlashInfer sdist found: copy $SDIST_NAME.tar.gz into $REPO/.anchors/ (git-ignored; carry it to the GPU machine) or set COMPAT_SDIST" >&2; exit 2; }
  [ "$HAVE_TESTS" = 1 ] && exit 0
  FI_TESTS=$UNPACK/$SDIST_NAME/tests
  mkdir -p "$UNPACK" && tar xzf "$SDIST" -C "$UNPACK" "$SDIST_NAME/tests" || { echo "cannot unpack $SDIST" >&2; exit 2; }
  stamp "unpacked $SDIST_NAME/tests from $SDIST into $UNPACK"
elif [ "$HAVE_TESTS" = 1 ]; then
  exit 0
fi
for f in "${FILES[@]}"; do
  [ -f "$FI_TESTS/$f" ] || { echo "$f: not in $FI_TESTS" >&2; exit 2; }
done

# 2. Python: the shim first and alone on PYTHONPATH (FI_ROOT or anything inherited is dropped), no
# bytecode written into the sdist or the repo, attncore installed from this checkout.
export PYTHONPATH=$COMPAT PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export ATTNCORE_CACHE_DIR=${ATTNCORE_CACHE_DIR:-/tmp/attncore-cache}
cd "$FI_TESTS" || exit 2   # never the sdist root: its flashinfer/ package must not be importable
installed_here() {
  "$PY" - "$REPO" <<'PYEOF' 2>/dev/null
import importlib.metadata as md, os, sys
md.distribution("attncore")
import attncore
sys.exit(0 if os.path.realpath(attncore.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)
PYEOF
}
if ! installed_here; then
  if [ "${COMPAT_INSTALL:-1}" = 1 ]; then
    extra=(); [ -d "$REPO/plugins/attncore-sdpa" ] && extra=(-e "$REPO/plugins/attncore-sdpa")
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO" "${extra[@]}" 2>&1 | grep -v WARNING
    installed_here || { echo "attncore from $REPO is not importable after pip install -e" >&2; exit 2; }
    stamp "installed attncore from $REPO"
  else
    echo "attncore is not installed from $REPO (COMPAT_INSTALL=0)" >&2; exit 2
  fi
fi
"$PY" - "$COMPAT" <<'PYEOF' || exit 2
import importlib.machinery, os, sys
import flashinfer, attncore
if not getattr(flashinfer, "__attncore_shim__", False):
    sys.exit(f"'import flashinfer' gives {flashinfer.__file__}, not the attncore shim of {sys.argv[1]}")
compat = os.path.realpath(sys.argv[1])
others = [p for p in sys.path if os.path.realpath(p or ".") != compat]
spec = importlib.machinery.PathFinder.find_spec("flashinfer", others)
print(f"flashinfer -> attncore shim ({os.path.dirname(flashinfer.__file__)}); attncore {attncore.__version__} "
      f"from {os.path.dirname(attncore.__file__)}")
if spec is not None:
    print(f"note: another flashinfer is installed ({spec.origin}); the shim shadows it")
import torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
print(f"torch {torch.__version__}, GPU: {gpu or 'none (every case fails at its first cuda:0 tensor)'}")
PYEOF
echo "FlashInfer tests: $FI_TESTS; sample 1 in $COMPAT_SAMPLE (min $COMPAT_SAMPLE_MIN, seed $COMPAT_SEED, cover $COMPAT_COVER)"

COMMON=(-p compat_sample -p no:cacheprovider --rootdir "$FI_TESTS" -c /dev/null --confcutdir "$FI_TESTS")
if [ "$COLLECT_ONLY" = 1 ]; then
  # shellcheck disable=SC2086
  tmp=$(mktemp)
  "$PY" -m pytest --collect-only -q "${COMMON[@]}" ${COMPAT_PYTEST_ARGS:-} "${FILES[@]}" > "$tmp" 2>&1
  rc=$?
  grep -v "::" "$tmp" | grep -v "^$"; rm -f "$tmp"
  exit $rc
fi

# 3. One pytest process per file (or per shard of a split file), JOBS at a time
mkdir -p "$WORK"
for f in "${FILES[@]}"; do rm -f "$WORK/${f%.py}".{jsonl,rc,xml,log,log.gz} "$WORK/${f%.py}".s*of*.*; done
JOBLIST=()
for f in "${FILES[@]}"; do
  n=1
  for s in ${COMPAT_SPLIT-test_batch_prefill_kernels.py:4 test_batch_decode_kernels.py:3}; do [ "${s%%:*}" = "$f" ] && n=${s##*:}; done
  if [ "$n" -gt 1 ]; then
    for ((i = 0; i < n; i++)); do JOBLIST+=("$f:$i/$n"); done
  else
    JOBLIST+=("$f")
  fi
done
run_one() {  # $1: FILE or FILE:I/N (one shard)
  local f=${1%%:*} shard="" stem=${1%%:*} start rc limit
  stem=${stem%.py}
  if [ "$f" != "$1" ]; then shard=${1##*:}; stem="$stem.s${shard%/*}of${shard#*/}"; fi
  start=$(date +%s)
  limit=$(( DEADLINE - (start - t0) - 15 ))   # 15 s for pytest to wind down after SIGINT
  [ "$limit" -gt "$FILE_TIMEOUT" ] && limit=$FILE_TIMEOUT
  if [ "$limit" -lt 30 ]; then
    echo "125 0" > "$WORK/$stem.rc"; echo "[$(( start - t0 )) s] $f: NOT STARTED (COMPAT_DEADLINE ${DEADLINE} s)"
    return
  fi
  # shellcheck disable=SC2086
  timeout -s INT -k 10 "$limit" "$PY" -m pytest -q -rf --tb="$TB" "${COMMON[@]}" \
    --compat-log "$WORK/$stem.jsonl" --junitxml "$WORK/$stem.xml" ${shard:+--compat-shard "$shard"} \
    ${COMPAT_PYTEST_ARGS:-} "$f" > "$WORK/$stem.log" 2>&1
  rc=$?
  echo "$rc $(( $(date +%s) - start ))" > "$WORK/$stem.rc"
  echo "[$(( $(date +%s) - t0 )) s] $1: rc $rc, $(grep -E '(passed|failed|error|skipped|deselected|no tests ran)' "$WORK/$stem.log" | tail -1)"
  if [ "$(stat -c %s "$WORK/$stem.log")" -gt 1000000 ]; then gzip -f "$WORK/$stem.log"; fi
}
export -f run_one
export PY WORK FILE_TIMEOUT DEADLINE TB t0 COMPAT_PYTEST_ARGS
export COMMON_STR="${COMMON[*]}"
printf '%s\n' "${JOBLIST[@]}" | xargs -P "$JOBS" -I{} bash -c 'COMMON=($COMMON_STR); run_one "$1"' _ {}
stamp "all files done"

# 3b. Cases that ran out of GPU memory beside the other processes, again in one process (the report counts
# their outcome there)
"$PY" "$COMPAT/compat_report.py" --work "$WORK" --out-of-memory > "$WORK/retry.txt"
rm -f "$WORK/retry.jsonl"
left=$(( DEADLINE - ($(date +%s) - t0) - 15 ))
if [ -s "$WORK/retry.txt" ] && [ "$left" -ge 30 ]; then
  stamp "$(wc -l < "$WORK/retry.txt") cases out of GPU memory: again, alone"
  mapfile -t RETRY < "$WORK/retry.txt"
  timeout -s INT -k 10 "$left" "$PY" -m pytest -q -rf --tb="$TB" "${COMMON[@]}" --compat-sample 1 --compat-cover 0 \
    --compat-log "$WORK/retry.jsonl" "${RETRY[@]}" > "$WORK/retry.log" 2>&1
  stamp "retried: rc $?, $(grep -E '(passed|failed|error|skipped)' "$WORK/retry.log" | tail -1)"
fi

# 4. The table
"$PY" "$COMPAT/compat_report.py" --work "$WORK" --json "$WORK/summary.json" "${FILES[@]}"
