#!/usr/bin/env bash
# One device call for the cuda_fa2 Hopper kernel: build, wgmma primitive selftest (picks the V
# descriptor order), focused GPU tests and prefill benchmarks per kernel variant.
# Usage (H100, repo root): [FA2_SM90_VARIANTS="-DFA2_H_PIPE=0;-DFA2_H_PIPE=1"] bash backends/cuda_fa2/scripts/gpu_cuda_fa2_sm90.sh
# Variants are extra nvcc flags (';'-separated; "" = shipped defaults).  Logs and JSON under $OUT.
source scripts/gpu_common.sh
PY=python3
gpu_header name,driver_version,clocks.sm,clocks.mem
install_tree
echo "== wgmma selftest"
$PY backends/cuda_fa2/scripts/cuda_fa2_sm90_selftest.py 0 "$OUT/vflags" 2>&1 | tee "$OUT/selftest.log"
if [ ! -f "$OUT/vflags" ]; then
  echo "default V descriptor order failed: trying the swapped order (own process)"
  $PY backends/cuda_fa2/scripts/cuda_fa2_sm90_selftest.py 1 "$OUT/vflags" 2>&1 | tee -a "$OUT/selftest.log"
fi
if [ ! -f "$OUT/vflags" ]; then echo "selftest failed: stopping"; exit 1; fi
VF="$(cat $OUT/vflags)"
IFS=';' read -ra VARS <<< "${FA2_SM90_VARIANTS:-}"
[ ${#VARS[@]} -eq 0 ] && VARS=("")
echo "== build (${#VARS[@]} variants, V flags '$VF')"
for v in "${VARS[@]}"; do
  ATTNCORE_NVCC_FLAGS="$VF $v" $PY -c "
import os
from attncore import jit
from attncore.backends.cuda_fa2 import specs
jit.build('cuda_fa2', [k.spec() for k in specs.sm90_keys()], jobs=os.cpu_count())" 2>&1 | tail -1 &
done
wait
i=0
for v in "${VARS[@]}"; do
  export ATTNCORE_NVCC_FLAGS="$VF $v"
  echo "== variant $i flags '$ATTNCORE_NVCC_FLAGS': focused GPU tests"
  timeout ${FA2_TEST_TIMEOUT:-110} $PY -m pytest -q -m gpu tests/test_cuda_fa2.py -k "prefill90 or single_prefill or split_kv_prefill" \
    -rfE -x --tb=short 2>&1 | tee "$OUT/tests$i.log" | tail -8
  echo "== variant $i benchmarks"
  timeout ${FA2_BENCH_TIMEOUT:-90} $PY backends/cuda_fa2/bench/cuda_fa2_sm90_bench.py "$OUT/cuda_fa2_sm90_v$i.json" 2>&1 | tee "$OUT/bench$i.log" | tail -14
  i=$((i+1))
done
