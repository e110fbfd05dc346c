#!/usr/bin/env bash
# One device call for issue 19 (any CUDA device, any stream) on a machine with 2 GPUs: the device
# tests (side-stream ordering on both GPUs, cuda:1 with cuda:0 current, plan/run on different
# GPUs, two processes building the JIT cache once), `attncore check` and the conformance suites
# with every tensor on cuda:1, that device's current stream a side stream and the current device
# left at 0, then the tensor-parallel example over NCCL.  Logs under $OUT.
# Usage on the device machine: [DEV=cuda:1] bash scripts/gpu_issue19.sh [PHASES]
#   (DEV=cuda:0 on a one-GPU machine: the side stream still counts, the 2-GPU tests skip)
#   PHASES: any of "tests check conformance example" (default: all)
PHASES=${1:-"tests check conformance example"}
source scripts/gpu_common.sh
# NVLink multicast stays off (the device tool's KINDS.md says why)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEV=${DEV:-cuda:1}
LOG="$OUT/issue19.log"; : > "$LOG"
install_tree plugins/attncore-sdpa
gpu_header index,name,driver_version
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'
python3 scripts/prebuild_conformance.py 2>&1 | tail -1
stamp "cuda_fa2 libraries built"
if has tests; then
  python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_devices.py tests/test_cuda_fa2.py::test_second_device \
    > "$OUT/tests.txt" 2>&1
  echo "device tests: $(tail -1 "$OUT/tests.txt")"; grep -h "^FAILED\|^ERROR" "$OUT/tests.txt" | head -20
  stamp "tests done"
fi
if has check; then
  python3 -m attncore.cli check --device "$DEV" --stream side --json "$OUT/check_side.json" \
    > "$OUT/check.txt" 2> /tmp/check_err.txt
  echo "check --device $DEV --stream side: exit $?"; tail -1 /tmp/check_err.txt
  grep -o "pass [0-9.e+-]* / \|FAIL\|ERROR" "$OUT/check.txt" | cut -c1-4 | sort | uniq -c
  stamp "check done"
fi
if has conformance; then
  CONF_ARGS="--attncore-device $DEV --attncore-stream side" SHARDS=${SHARDS:-6} \
    bash scripts/gpu_conformance.sh cuda_fa2 triton xqa sdpa 2>&1 | grep -v WARNING | tee -a "$LOG"
  stamp "conformance done"
fi
if has example; then
  timeout 300 python3 examples/tensor_parallel.py 2>&1 | grep -v WARNING | tail -5 | tee -a "$LOG"
  stamp "example done"
fi
