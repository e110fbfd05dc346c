#!/usr/bin/env bash
# Issue 16, POD's concurrent mode (the composed parts on two CUDA streams) on one GPU, within ~9 min on an
# H100: install; the gpu-marked tests of tests/test_pod_streams.py (streams == serial bit for bit in bf16 with
# and without LSEs, CUDA-graph capture + replay after re-plan, memory flat, the side stream used) and of
# tests/test_pod_fused.py; `attncore bench` PD1/PD2 and the sweep (fused / serial / streams / auto, speedup
# over serial); a short table last.  Logs and JSON under $OUT (the plot too when matplotlib imports).
# Usage on the device machine:  bash scripts/gpu_pod_streams.sh
source scripts/gpu_common.sh
gpu_header
install_tree
PLOT=""; python3 -c "import matplotlib" 2> /dev/null && PLOT="--plot $OUT/pod_sweep.png"
stamp "installed"
timeout 150 python3 -m pytest -q -m gpu tests/test_pod_streams.py tests/test_pod_fused.py > "$OUT/tests.txt" 2>&1
stamp "gpu tests done (rc $?)"
# streams mode's launch order (attncore.core.streams.PREFILL_FIRST) on PD1/PD2: which to keep
cat > /tmp/pod_order.py <<'PY'
import torch
import attncore
from attncore.core import streams
from attncore.cli import bench_pod
from attncore.cli.bench import _timer
t = _timer("cuda")
print(f"{'streams order':<16} {'PD1 ms':>8} {'PD2 ms':>8}")
for first in (True, False):
    streams.PREFILL_FIRST = first
    ms = []
    for w in bench_pod.POD_WORKLOADS:
        run, wr = bench_pod._setup(w, "cuda", torch.bfloat16, attncore, dict(fuse=False, overlap="streams"))
        ms.append(f"{t(run):8.3f}" if wr.mode == "streams" else wr.overlap_reason[:8])
    print(f"{'prefill first' if first else 'decode first':<16} {ms[0]:>8} {ms[1]:>8}", flush=True)
PY
timeout 60 python3 /tmp/pod_order.py > "$OUT/pod_order.txt" 2>&1
stamp "launch orders done (rc $?)"
timeout 110 python3 -m attncore.cli bench --workload PD1 --workload PD2 --device cuda --json "$OUT/pod_pd.json" \
  > "$OUT/pod_pd.txt" 2> "$OUT/pod_pd.err"
stamp "PD1/PD2 done (rc $?)"
# shellcheck disable=SC2086
timeout 190 python3 -m attncore.cli bench --pod-sweep --device cuda --json "$OUT/pod_sweep.json" $PLOT \
  > "$OUT/pod_sweep.txt" 2> "$OUT/pod_sweep.err"
stamp "sweep done (rc $?)"
echo "== tests =="; grep -E "passed|failed|error" "$OUT/tests.txt" | tail -3; grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -8
[ -s "$OUT/pod_sweep.txt" ] && { echo "== sweep =="; cat "$OUT/pod_sweep.txt"; } \
  || { echo "== sweep (cut short: rows measured) =="; grep "pod bench:" "$OUT/pod_sweep.err" 2>/dev/null; }
echo "== streams launch order (PD1/PD2) =="; tail -3 "$OUT/pod_order.txt"
echo "== PD1/PD2 (ms; streams x = serial / streams; the gain is the decode's KV reads under the prefill) =="
cat "$OUT/pod_pd.txt"; tail -3 "$OUT/pod_pd.err" | grep -v "pod bench:"
