#!/usr/bin/env bash
# fp8 queries (issue 18 item 2, attncore/core/fp8_query.py) on one GPU: an e4m3/e5m2 q is upcast exactly to
# the compute dtype (o_dtype when fp16/bf16/fp32, else fp16) before selection.  Runs tests/test_fp8_query.py:
#   gpu   the gpu-marked tests: batch decode and paged/single prefill on cuda_fa2, triton and auto with bf16
#         and fp16 compute (fp8 and 16-bit KV), trtllm/xqa decode with an e4m3 query and cache (fp16, bf16 and
#         e4m3 output) on xqa and auto; each against the fp64 golden of q.to(fp16) with the tolerance rule,
#         and bit for bit against the same backend run with the upcast q
#   cpu   the other tests of the file with tensors on the GPU (reference, triton; bad input)
# cuda_fa2 and xqa build their specializations on first use (into $ATTNCORE_CACHE_DIR).  Logs under $OUT;
# the table last: one line per phase, "N passed" expected, no FAILED lines.
# Usage on the device machine:  bash scripts/gpu_fp8_query.sh [PHASES]   (default: "gpu cpu")
PHASES=${1:-"gpu cpu"}
source scripts/gpu_common.sh
gpu_header
install_tree
stamp "installed"
LINES=()
run_tests() {  # name, timeout, pytest args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE "$@" > "$OUT/fp8_query_$name.txt" 2>&1
  local rc=$?
  grep -h "^FAILED\|^ERROR" "$OUT/fp8_query_$name.txt" | head -30
  LINES+=("$(printf '%-4s exit %-3s %s' "$name" "$rc" "$(tail -1 "$OUT/fp8_query_$name.txt")")")
  stamp "$name done"
}
has gpu && run_tests gpu "${GPU_TIMEOUT:-500}" -m gpu tests/test_fp8_query.py
has cpu && run_tests cpu "${CPU_TIMEOUT:-300}" -m "not gpu" tests/test_fp8_query.py
echo "phase exit summary"
printf '%s\n' "${LINES[@]}"
stamp "done"
