#!/usr/bin/env bash
# One device call: the conformance suites of the GPU backends, to completion.  cuda_fa2's libraries
# are built first in parallel (scripts/prebuild_conformance.py), then each suite runs as N shards in
# parallel processes (--attncore-shard) so Triton's compiles use several cores.
# Usage on the device machine: [CONF_ARGS="--attncore-device cuda:1 --attncore-stream side"] [SHARDS=N]
#   bash scripts/gpu_conformance.sh [backend ...]   (default: cuda_fa2 triton xqa)
set -uo pipefail
export PYTHONUNBUFFERED=1 ATTNCORE_CACHE_DIR=/tmp/attncore-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${SHARDS:-4}
BACKENDS=("$@"); [ ${#BACKENDS[@]} -eq 0 ] && BACKENDS=(cuda_fa2 triton xqa)
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/attncore-sdpa 2>&1 | grep -v WARNING
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in "${BACKENDS[@]}"; do
  [ "$b" = cuda_fa2 ] && python3 scripts/prebuild_conformance.py 2>&1 | tail -2
done
start=$(date +%s)
for b in "${BACKENDS[@]}"; do
  for ((i = 0; i < N; i++)); do
    # shellcheck disable=SC2086  # CONF_ARGS is a list of pytest options
    python3 -m attncore.cli conformance "$b" -q -p no:cacheprovider -rfE --attncore-shard "$i/$N" ${CONF_ARGS:-} \
      > "$OUT/conformance_${b}_$i.txt" 2>&1 &
  done
done
wait
echo "suites took $(( $(date +%s) - start )) s"
for b in "${BACKENDS[@]}"; do
  for ((i = 0; i < N; i++)); do
    echo "$b shard $i/$N: $(tail -1 "$OUT/conformance_${b}_$i.txt")"
  done
  grep -h "^FAILED\|^ERROR" "$OUT"/conformance_"${b}"_*.txt | head -20
done
