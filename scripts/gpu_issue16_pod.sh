#!/usr/bin/env bash
# Issue 16 (POD in one launch) on one GPU, within ~500 s: install, the fused POD tests in bf16 on the
# GPU (the gpu-marked tests of tests/test_pod_fused.py, the fused launch captured in a CUDA graph through the
# POD wrapper and the conformance suite's POD graph cases on Triton), fused-launch variants on PD1/PD2 (grid vs
# persistent, prefill tile configs), then `attncore bench` for PD1/PD2 (fused vs composed-serial vs
# auto) and the sweep (prefill 512/2k/8k x decode batch 8/32/128 x kv 1k/4k/16k), a short table last.
# FI=1 adds FlashInfer's POD (needs .anchors/fi_setup.sh, see scripts/gpu_before_after.sh).  JSON, the plot (when
# matplotlib imports) and the logs (logs.tgz: gpu_common.sh's bundle_logs) under $OUT.
# SPLIT=1 adds scripts/gpu_pod_smsplit.py on PD1/PD2 (fits attncore/core/streams.py's split model to a new GPU).
# Usage on the device machine:  [FI=0] [SWEEP=1] [SPLIT=0] bash scripts/gpu_issue16_pod.sh
source scripts/gpu_common.sh
gpu_header
install_tree plugins/attncore-sdpa
PLOT=""; python3 -c "import matplotlib" 2> /dev/null && PLOT="--plot $OUT/pod_speedup.png"
FIARG=""
if [ "${FI:-0}" = 1 ]; then
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
  # shellcheck disable=SC1091
  ANCHORS_DIR=.anchors source .anchors/fi_setup.sh && FIARG="--flashinfer"
fi
stamp "installed"
pod_gpu_checks
if [ "${SPLIT:-0}" = 1 ]; then  # the SM split probe: each part alone on N SMs, both split at each S (streams.py's model)
  timeout 200 python3 scripts/gpu_pod_smsplit.py --workloads PD1,PD2 --prefill auto --json "$OUT/pod_smsplit.json" \
    > "$OUT/pod_smsplit.txt" 2>&1
  stamp "SM split probe (rc $?)"
fi
# fused launch variants on PD1/PD2 (fused time only): grid vs persistent, a prefill tile config
cat > /tmp/pod_variants.py <<'PY'
import torch
import attncore
from attncore.core import registry
from attncore.cli import bench_pod
from attncore.cli.bench import _timer
b = registry.entries()["triton"].backend
t = _timer("cuda")
p64 = {"prefill": dict(block_m=64, block_n=64, num_warps=8, num_stages=2),
       "decode": dict(block_m=16, block_n=64, num_warps=8, num_stages=2)}
variants = [("grid default", ("always", "grid", 1, None)), ("persistent x1", ("always", "persistent", 1, None)),
            ("grid p64x64 w8", ("always", "grid", 1, p64))]
print(f"{'variant':<18} {'PD1 ms':>8} {'PD2 ms':>8}")
for name, v in variants:
    b._pod = v
    ms = []
    for w in bench_pod.POD_WORKLOADS:
        try:
            x = bench_pod._inputs(w, "cuda", torch.bfloat16)
            run, wr = bench_pod._setup(w, x, torch.bfloat16, attncore, dict(backend="triton"))
            ms.append(f"{t(run):8.3f}")
        except Exception as e:
            ms.append(f"{type(e).__name__}"[:8])
    print(f"{name:<18} {ms[0]:>8} {ms[1]:>8}", flush=True)
PY
timeout 80 python3 /tmp/pod_variants.py > "$OUT/pod_variants.txt" 2>&1
stamp "fused variants done"
# with FI=1 FlashInfer's POD module JIT-builds in this process first (~200 s on the H200's 16 cores, session 24)
PYTHONPATH="${FI_ROOT:-}" timeout $(( ${FI:-0} == 1 ? 400 : 200 )) python3 -m attncore.cli bench --workload PD1 --workload PD2 $FIARG --device cuda \
  --json "$OUT/pod_pd.json" > "$OUT/pod_pd.txt" 2> "$OUT/pod_pd.err"
stamp "PD1/PD2 done (rc $?)"
if [ "${SWEEP:-1}" = 1 ]; then  # rows also go to pod_sweep.err as they are measured
  # shellcheck disable=SC2086
  timeout 180 python3 -m attncore.cli bench --pod-sweep --device cuda --json "$OUT/pod_sweep.json" $PLOT \
    > "$OUT/pod_sweep.txt" 2> "$OUT/pod_sweep.err"
  stamp "sweep done (rc $?)"
fi
echo "== tests =="; tail -3 "$OUT/tests.txt"
[ -s "$OUT/pod_smsplit.txt" ] && { echo "== SM split probe =="; grep -v '^{' "$OUT/pod_smsplit.txt"; }
echo "== POD graph conformance (triton) =="; tail -3 "$OUT/pod_graph_conformance.txt"
echo "== fused launch variants (PD1/PD2, ms) =="; tail -4 "$OUT/pod_variants.txt"
[ -s "$OUT/pod_sweep.txt" ] && { echo "== sweep =="; cat "$OUT/pod_sweep.txt"; } \
  || { echo "== sweep (cut short: rows measured) =="; grep "pod bench:" "$OUT/pod_sweep.err" 2>/dev/null; }
echo "== PD1/PD2 (targets: PD1 fused x >= 1.15 and below FlashInfer's 0.414 ms; PD2 fused < 0.40 ms) =="
cat "$OUT/pod_pd.txt"; tail -3 "$OUT/pod_pd.err" | grep -v "pod bench:"
bundle_logs
