#!/usr/bin/env bash
# Multi-item scoring (issue 18: prefix_len_ptr / token_pos_in_items_ptr / token_pos_in_items_len /
# max_item_len_ptr) on one GPU.  Phases:
#   tests   the gpu-marked tests of tests/test_multi_item.py: bf16 on cuda_fa2 / triton / auto, paged and
#           ragged, scoring-sized requests; FlashInfer's test shape in fp16 (d128, RoPE, soft cap 30); a
#           CUDA-graph replay that follows a re-plan with other items; all against the fp64 golden
#   compat  FlashInfer 0.2.14's own test_batch_prefill_with_paged_kv_cache_multi_item_scoring (its 48
#           cases) through the `flashinfer` -> attncore shim, when the sdist is at hand (.anchors/,
#           ../shared/anchors/ or /work/shared/anchors/; see tests/compat/README.md)
# cuda_fa2 builds each specialization on first use (into $ATTNCORE_CACHE_DIR): on a cold machine the
# two phases may not fit one 600 s call; run `tests` then `compat` as two calls on the warm machine.
# Logs under $OUT; a short table last.
# Usage on the device machine:  bash scripts/gpu_multi_item.sh [PHASES]   (default: "tests compat")
PHASES=${1:-"tests compat"}
source scripts/gpu_common.sh
gpu_header
install_tree
stamp "installed"
TEST_LINE="tests/test_multi_item.py -m gpu: not run"
if has tests; then
  timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_multi_item.py \
    --junitxml "$OUT/multi_item.xml" > "$OUT/multi_item.txt" 2>&1
  TEST_LINE="tests/test_multi_item.py -m gpu (exit $?): $(tail -1 "$OUT/multi_item.txt")"
  grep -h "^FAILED\|^ERROR" "$OUT/multi_item.txt" | head -20
  stamp "gpu tests done"
fi
FI_LINE="FlashInfer's multi-item test: not run"
if has compat; then
  if bash scripts/compat_flashinfer.sh --have-tests 2> /dev/null; then
    COMPAT_SAMPLE=1 COMPAT_COVER=0 COMPAT_DEADLINE=$(( ${COMPAT_DEADLINE_CAP:-560} - ($(date +%s) - t0) )) \
      COMPAT_PYTEST_ARGS="-k multi_item_scoring" \
      bash scripts/compat_flashinfer.sh test_batch_prefill_kernels.py > "$OUT/compat_multi_item.txt" 2>&1
    rc=$?
    FI_LINE="FlashInfer's multi-item test via the shim (exit $rc; counts are its 48 multi-item cases):
$(sed -n '/^file  /,/^TOTAL/p' "$OUT/compat_multi_item.txt" | grep -v "^---\|^TOTAL")"
    grep -h "FAILED" "$OUT/compat_multi_item.txt" | head -10
    stamp "compat done"
  else
    FI_LINE="FlashInfer's multi-item test: no sdist in .anchors/ or ../shared/anchors/"
  fi
fi
if [ -f "$OUT/multi_item.xml" ]; then
  python3 - "$OUT/multi_item.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

rows = defaultdict(lambda: [0, 0, 0])  # test function -> passed, failed, skipped
for c in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    r = rows[c.get("name", "?").split("[")[0]]
    if c.find("failure") is not None or c.find("error") is not None:
        r[1] += 1
    elif c.find("skipped") is not None:
        r[2] += 1
    else:
        r[0] += 1
print(f"\n{'test (gpu)':<44} {'pass':>5} {'fail':>5} {'skip':>5}")
for name, (p, f, s) in sorted(rows.items()):
    print(f"{name:<44} {p:>5} {f:>5} {s:>5}")
PY
fi
echo "$TEST_LINE"
echo "$FI_LINE"
stamp "done"
