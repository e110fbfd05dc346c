#!/usr/bin/env bash
# Multi-item scoring (issue 18, prefix_len_ptr / token_pos_in_items_ptr / token_pos_in_items_len /
# max_item_len_ptr) on one GPU, within ~400 s: install, the gpu-marked tests of tests/test_multi_item.py
# (bf16 and fp16, cuda_fa2 / triton / auto, paged and ragged, against the fp64 golden), then FlashInfer
# 0.2.14's own multi-item test (test_batch_prefill_with_paged_kv_cache_multi_item_scoring, all its
# cases) through the `flashinfer` -> attncore shim when the sdist is at hand (.anchors/ or
# ../shared/anchors/, see tests/compat/README.md).  Logs under $OUT; a short table last.
# Usage on the device machine:  bash scripts/gpu_multi_item.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 ATTNCORE_CACHE_DIR=${ATTNCORE_CACHE_DIR:-/tmp/attncore-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
stamp "installed"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_multi_item.py \
  --junitxml "$OUT/multi_item.xml" > "$OUT/multi_item.txt" 2>&1
echo "tests/test_multi_item.py -m gpu: $(tail -1 "$OUT/multi_item.txt")"
grep -h "^FAILED\|^ERROR" "$OUT/multi_item.txt" | head -20
stamp "gpu tests done"
FI_LINE="FlashInfer's multi-item test: not run (no sdist in .anchors/ or ../shared/anchors/)"
if ls .anchors/flashinfer_python-0.2.14*.tar.gz ../shared/anchors/flashinfer_python-0.2.14*.tar.gz \
    /work/shared/anchors/flashinfer_python-0.2.14*.tar.gz \
    > /dev/null 2>&1; then
  COMPAT_SAMPLE=1 COMPAT_COVER=0 COMPAT_DEADLINE=${COMPAT_DEADLINE:-240} \
    COMPAT_PYTEST_ARGS="-k multi_item_scoring" \
    bash scripts/compat_flashinfer.sh test_batch_prefill_kernels.py > "$OUT/compat_multi_item.txt" 2>&1
  FI_LINE="FlashInfer's multi-item test (compat, exit $?): $(grep -m1 "test_batch_prefill_kernels" \
    "$OUT/compat_multi_item.txt" | tr -s ' ')"
  grep -h "FAILED" "$OUT/compat_multi_item.txt" | head -10
  stamp "compat done"
fi
python3 - "$OUT/multi_item.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

rows = defaultdict(lambda: [0, 0, 0])  # name -> passed, failed, skipped
try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except Exception as e:  # the run died before writing its report
    print(f"no JUnit report: {e}")
    cases = []
for c in cases:
    name = c.get("name", "?").split("[")[0]
    r = rows[name]
    if c.find("failure") is not None or c.find("error") is not None:
        r[1] += 1
    elif c.find("skipped") is not None:
        r[2] += 1
    else:
        r[0] += 1
print(f"\n{'test (gpu)':<42} {'pass':>5} {'fail':>5} {'skip':>5}")
for name, (p, f, s) in sorted(rows.items()):
    print(f"{name:<42} {p:>5} {f:>5} {s:>5}")
PY
echo "$FI_LINE"
stamp "done"
