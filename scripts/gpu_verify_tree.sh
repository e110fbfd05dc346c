#!/usr/bin/env bash
# One device call: a committed tree (carried as .old/NAME.tar, `git archive -o .old/NAME.tar HEAD`)
# installed on the GPU machine, then its correctness: the conformance suites of the GPU backends
# (sharded), the GPU tests, and `attncore check`; FlashInfer's kernels for `attncore bench
# --flashinfer` warm in the background meanwhile (correctness runs do not mind the load; its JIT
# cache stays in /tmp for later calls on the same warm machine).  Carry: .old .anchors.
# Usage on the device machine: [FI_WARM="P1 D1 ..."] bash scripts/gpu_verify_tree.sh NAME [PHASES]
#   PHASES: any of "conformance tests check" (default: all)
export FLASHINFER_WORKSPACE_BASE=/tmp/fi-cache
REPO=$PWD
NAME=${1:?tree name}
PHASES=${2:-"conformance tests check"}
source scripts/gpu_common.sh
TREE=/tmp/tree_$NAME
rm -rf "$TREE"; mkdir -p "$TREE" && tar xf ".old/$NAME.tar" -C "$TREE"
WARM=
if [ -n "${FI_WARM:-}" ]; then
  # shellcheck disable=SC1091
  ANCHORS_DIR=.anchors source .anchors/fi_setup.sh
  # shellcheck disable=SC2086
  PYTHONPATH="$TREE:$FI_ROOT" python3 "$TREE/scripts/fi_warm.py" $FI_WARM > "$OUT/fi_warm.txt" 2>&1 &
  WARM=$!
fi
cd "$TREE" || exit 1
install_tree plugins/attncore-sdpa
gpu_header
python3 scripts/prebuild_conformance.py 2>&1 | tail -1
stamp "installed, cuda_fa2 libraries built"
if has conformance; then
  OUT=/tmp/conf SHARDS=${SHARDS:-4} bash scripts/gpu_conformance.sh cuda_fa2 triton xqa sdpa 2>&1 | grep -v WARNING \
    | tee "$OUT/conformance.txt" | grep -v "^\(cuda_fa2\|triton\|xqa\|sdpa\) shard" | tail -15
  python3 - /tmp/conf <<'EOF'
import glob, re, sys
tot = {}
for f in glob.glob(sys.argv[1] + "/conformance_*.txt"):
    b = f.rsplit("/", 1)[1].split("_")[1] if "cuda_fa2" not in f else "cuda_fa2"
    last = open(f).read().strip().splitlines()[-1]
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|error|xfailed)", last):
        tot.setdefault(b, {}).setdefault(what, 0)
        tot[b][what] += int(n)
print("conformance:", "; ".join(f"{b} {d}" for b, d in sorted(tot.items())))
EOF
  stamp "conformance done"
fi
if has tests; then
  timeout "${TESTS_T:-300}" python3 -m pytest -q -p no:cacheprovider -rfE ${TESTS:-tests/test_cuda_fa2.py tests/test_xqa.py \
    tests/test_cuda_sources.py tests/test_cascade.py tests/test_cascade_wrappers.py tests/test_devices.py tests/test_rope.py} \
    > "$OUT/tests.txt" 2>&1
  echo "GPU tests: $(tail -1 "$OUT/tests.txt")"; grep -h "^FAILED\|^ERROR" "$OUT/tests.txt" | head -20
  stamp "tests done"
fi
if has check; then
  python3 -m attncore.cli check --json "$OUT/check.json" > "$OUT/check.txt" 2> /dev/null
  echo "check: exit $?"; grep -o "pass [0-9.e+-]* / \|FAIL\|ERROR" "$OUT/check.txt" | cut -c1-4 | sort | uniq -c
  stamp "check done"
fi
if [ -n "$WARM" ]; then
  wait "$WARM"; stamp "FlashInfer warm: $(tail -1 "$OUT/fi_warm.txt")"
fi
