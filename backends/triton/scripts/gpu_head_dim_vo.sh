#!/usr/bin/env bash
# One device call (H100, under 400 s): head_dim_qk != head_dim_vo (DeepSeek-style 192/128, issue 18 item 2)
# on the Triton backend.
#   1. tests/test_head_dim_vo.py on the GPU (the bf16 `gpu` tests and the fp16 ones, now on CUDA);
#   2. the triton conformance suite's head_dim_vo cases (one-axis sweep: d<base>x<other>) and the
#      refusals of cuda_fa2 / xqa for them;
#   3. a timing of one causal bf16 prefill (B=1, 4096 tokens, 16 heads) at 128/128, 192/128 and 192/192,
#      so the 192/128 cost sits between its two neighbours;
#   4. a short table last.
# Usage on the device machine:  bash backends/triton/scripts/gpu_head_dim_vo.sh
source scripts/gpu_common.sh
export TRITON_CACHE_DIR=/tmp/triton-cache
unset TRITON_INTERPRET
gpu_header
install_tree
stamp "installed"

PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 300 python3 -m pytest -q tests/test_head_dim_vo.py -p no:cacheprovider \
  -rfEs > "$OUT/tests.txt" 2>&1 &
K="d64x128 or d128x64 or d256x64 or d192x128"
timeout 300 python3 -m attncore.cli conformance triton -q -p no:cacheprovider -rA --attncore-device cuda \
  -k "$K" > "$OUT/conformance_triton.txt" 2>&1 &
wait
for be in cuda_fa2 xqa; do
  timeout 120 python3 -m attncore.cli conformance "$be" -q -p no:cacheprovider -rA --attncore-device cuda \
    -k "$K" > "$OUT/conformance_$be.txt" 2>&1
done
stamp "tests and conformance done"

timeout 200 python3 - > "$OUT/timing.txt" 2>&1 <<'EOF'
import torch, attncore
torch.manual_seed(0)
n, h = 4096, 16
ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
qi = torch.tensor([0, n], dtype=torch.int32)
for dq, dv in ((128, 128), (192, 128), (192, 192)):
    q = torch.randn(n, h, dq, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(n, h, dq, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(n, h, dv, dtype=torch.bfloat16, device="cuda")
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="triton")
    w.plan(qi, qi, h, h, dq, dv, causal=True, q_data_type=torch.bfloat16)
    for _ in range(3):
        w.run(q, k, v)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        w.run(q, k, v)
    b.record()
    torch.cuda.synchronize()
    ms = a.elapsed_time(b) / 20
    flops = 2 * (n * (n + 1) / 2) * h * (dq + dv)
    kernel = "dense" if w._planned._primary[1].dense else "generic"
    print(f"TIMING {dq}/{dv} {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s {kernel}")
EOF
stamp "timing done"

echo "=== failures (first 30)"
grep -h "^FAILED\|^ERROR" "$OUT"/tests.txt "$OUT"/conformance_*.txt | head -30
echo "=== summary"
echo "| check | result |"
echo "|---|---|"
echo "| tests/test_head_dim_vo.py (GPU: bf16 gpu tests + fp16) | $(tail -1 "$OUT/tests.txt") |"
for be in triton cuda_fa2 xqa; do
  echo "| conformance $be, head_dim_vo cases ($(grep -c '^PASSED' "$OUT/conformance_$be.txt") passed ids) |" \
       "$(tail -1 "$OUT/conformance_$be.txt") |"
done
grep "^TIMING" "$OUT/timing.txt" | awk '{print "| causal prefill 4096 tok, 16 heads, bf16, " $2 " | " $3 " ms, " $5 " TFLOP/s (" $7 ") |"}'
grep -q "^TIMING" "$OUT/timing.txt" || { echo "| timing | failed: see below |"; tail -5 "$OUT/timing.txt"; }
stamp "total"
