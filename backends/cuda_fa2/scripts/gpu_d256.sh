#!/usr/bin/env bash
# prefill90 at head dim 256 (issue 17: P2 d256), one device call (~3.5 min on a fresh H200): FlashInfer's P2-d256
# kernel warmed in the background, the wgmma primitive selftest (the new S tiles of 48 / 80 keys and P V at n256),
# the d256 GPU tests (outputs NaN-poisoned, against the fp64 golden) and the d64 / d128 prefill90 tests (the
# producer's copy changed shape), then P2-d256 timed per tile variant beside Triton, torch SDPA and FlashInfer in one
# run, a short table last.  Carry .anchors (../shared/anchors/README.md).  Logs under $OUT.
# Usage on the device machine:  bash backends/cuda_fa2/scripts/gpu_d256.sh
source scripts/gpu_common.sh
gpu_header name,driver_version,clocks.max.sm
install_tree
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
# shellcheck disable=SC1091
ANCHORS_DIR=.anchors source .anchors/fi_setup.sh
PYTHONPATH="$PWD:$FI_ROOT" python3 scripts/fi_warm.py P2-d256 > "$OUT/fi_warm.txt" 2>&1 &
warm=$!
timeout 120 python3 backends/cuda_fa2/scripts/cuda_fa2_sm90_selftest.py 0 > "$OUT/selftest.txt" 2>&1
stamp "selftest (rc $?)"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_fa2.py -k "prefill90" -rfE --tb=short \
  > "$OUT/tests.txt" 2>&1
stamp "prefill90 GPU tests (rc $?)"
wait $warm; stamp "FlashInfer warm"
cat > /tmp/d256_bench.py <<'PY'
import sys
from attncore.cli import bench
from attncore.core import plan_cache, registry
b = registry.entries()["cuda_fa2"].backend
variants = [  # (name, sm90_pipe, tune overrides): the defaults are 80 keys x 2 stages, K and V freed apart (SEPKV)
    ("plain ws 80x2", False, ()), ("pipe ws 80x2", True, ()),
    ("plain ws 80x2 one bar", False, (("FA2_H_SEPKV", "0"),)), ("pipe ws 64x2", True, (("FA2_H_KVT", "64"),)),
    ("pipe ws 48x3 one bar", True, (("FA2_H_KVT", "48"), ("FA2_H_STAGES", "3")))]
fi = len(sys.argv) > 1
for i, (name, pipe, tune) in enumerate(variants):
    b.sm90_pipe, b.tune = pipe, tune
    plan_cache.ONE_CALL_PLANS.clear()  # P2 is a one-call single prefill: its plans are cached by signature
    info = bench.run_bench(["cuda_fa2"] + (["triton"] if i == 0 else []), ids=["P2-d256"], device="cuda",
                           flashinfer=fi and i == 0, progress=lambda s: print(s, file=sys.stderr, flush=True))
    for r in info["results"]:
        label = f"prefill90 d256 {name}" if r["backend"] == "cuda_fa2" else r["backend"]
        print(f"{label:<28} {r.get('time_ms', float('nan')):.3f} ms {r.get('TFLOPs', 0):.0f} TFLOP/s "
              f"{r.get('status', '')} {r.get('detail', '')[:120]}", flush=True)
PY
PYTHONPATH="$FI_ROOT" timeout 200 python3 /tmp/d256_bench.py fi > "$OUT/bench.txt" 2> "$OUT/bench.err"
stamp "bench (rc $?)"
echo "== selftest =="; grep -E "FAIL|summary" "$OUT/selftest.txt"
echo "== prefill90 GPU tests =="; tail -4 "$OUT/tests.txt"
echo "== P2-d256 (ms, TFLOP/s) =="; cat "$OUT/bench.txt"; tail -3 "$OUT/bench.err"
