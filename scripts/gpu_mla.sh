#!/usr/bin/env bash
# MLA (issue 18 item 4: attncore.mla.BatchMLAPagedAttentionWrapper on Triton) on one GPU.  Phases:
#   tests   the gpu-marked tests of tests/test_mla.py: bf16 / fp16, DeepSeek dims (512 + 64), 16 and 128 heads,
#           pages 1/16/64, causal, kv_len 0 and NaN past each request's length, a CUDA-graph replay after a
#           re-plan; all against the fp64 golden with attncore.testing.golden's tolerance rule
#   compat  FlashInfer 0.2.14's own test_deepseek_mla.py through the `flashinfer` -> attncore shim: its
#           test_batch_mla_page_attention, test_batch_mla_varlen_page_attention and test_batch_mla_oob_kv_nan,
#           backend fa2 only (attncore refuses fa3 by design: docs/semantics.md), sampled 1 in $MLA_SAMPLE
#           (default 8 of its 8736 fa2 cases), when the sdist is in .anchors/ (tests/compat/README.md)
#   bench   decode, B 64 x kv 4096 x 128 heads, qo 1, page 64, bf16: attncore's Triton kernel (a few launch
#           configs, the default marked) and FlashInfer 0.2.14's own MLA (backends in $FI_MLA_BACKENDS,
#           default "fa2 fa3"; JIT-built on first use) when .anchors/fi_setup.sh sets the sdist up
# Triton compiles each launch variant on first use (page size, causal, block shape, dtype: ~30 for the tests)
# and FlashInfer JIT-builds its MLA modules (1-2 min each): the three phases do not fit one 600 s call on a cold
# machine; run them as three calls on the warm machine (`tests`, `compat`, `bench`).
# Logs under $OUT; a short table last.
# Usage on the device machine (carry .anchors):  bash scripts/gpu_mla.sh [PHASES]   (default: "tests compat bench")
PHASES=${1:-"tests compat bench"}
source scripts/gpu_common.sh
gpu_header
install_tree
stamp "installed"
TEST_LINE="tests/test_mla.py -m gpu: not run"
if has tests; then
  timeout "${TESTS_TIMEOUT:-500}" python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_mla.py \
    > "$OUT/mla_tests.txt" 2>&1
  TEST_LINE="tests/test_mla.py -m gpu (exit $?): $(tail -1 "$OUT/mla_tests.txt")"
  grep -h "^FAILED\|^ERROR" "$OUT/mla_tests.txt" | head -20
  stamp "gpu tests done"
fi
FI_LINE="FlashInfer's test_deepseek_mla.py: not run"
if has compat; then
  if bash scripts/compat_flashinfer.sh --have-tests 2> /dev/null; then
    # -k: the three batch MLA functions (test_batch_mla_*), fa2 only; written without spaces because the runner
    # word-splits COMPAT_PYTEST_ARGS (pytest's -k grammar needs none around parentheses)
    COMPAT_SAMPLE=${MLA_SAMPLE:-8} COMPAT_COVER=0 COMPAT_DEADLINE=${COMPAT_DEADLINE:-500} \
      COMPAT_SPLIT="test_deepseek_mla.py:${MLA_PROCS:-4}" COMPAT_PYTEST_ARGS="-k (batch_mla)and(fa2)" \
      bash scripts/compat_flashinfer.sh test_deepseek_mla.py > "$OUT/compat_mla.txt" 2>&1
    rc=$?
    FI_LINE="FlashInfer's test_deepseek_mla.py via the shim, fa2 MLA cases sampled (exit $rc):
$(sed -n '/^file  /,/^TOTAL/p' "$OUT/compat_mla.txt" | grep -v "^---\|^TOTAL")"
    grep -h "FAILED" "$OUT/compat_mla.txt" | head -10
    stamp "compat done"
  else
    FI_LINE="FlashInfer's test_deepseek_mla.py: no sdist in .anchors/ or ../shared/anchors/"
  fi
fi
BENCH_PY=""
if has bench; then
  if [ "${FI:-1}" = 1 ] && [ -f .anchors/fi_setup.sh ]; then
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
    # shellcheck disable=SC1091
    ANCHORS_DIR=.anchors source .anchors/fi_setup.sh > "$OUT/fi_setup.log" 2>&1 || FI_ROOT=""
  fi
  cat > /tmp/mla_bench.py <<'PY'
import math, os, sys, time
import torch
import attncore
import attncore.mla as amla
from triton.testing import do_bench

B, KV, H, PS, DC, DP = 64, 4096, 128, 64, 512, 64
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
pages = B * KV // PS
kv_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * (KV // PS)
kv_indices = torch.randperm(pages, device=dev).to(torch.int32)
kv_lens = torch.full((B,), KV, dtype=torch.int32, device=dev)
qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
qn = torch.randn(B, H, DC, dtype=dt, device=dev)
qp = torch.randn(B, H, DP, dtype=dt, device=dev)
ckv = torch.randn(pages, PS, DC, dtype=dt, device=dev)
kpe = torch.randn(pages, PS, DP, dtype=dt, device=dev)
sm = 1.0 / math.sqrt(192)
nbytes = (ckv.numel() + kpe.numel() + qn.numel() + qp.numel() + B * H * DC) * 2
ws = torch.empty(128 << 20, dtype=torch.int8, device=dev)
rows, ref = [], None

def add(name, fn, out):
    ms = do_bench(fn, warmup=25, rep=200)
    err = (out.float() - ref.float()).abs().max().item() if ref is not None else 0.0
    rows.append((name, ms * 1e3, nbytes / ms / 1e6, err))

default = dict(amla.CONFIG)
configs = [default, {**default, "block_m": 64}, {**default, "block_n": 64}, {**default, "num_warps": 4},
           {**default, "block_m": 16, "num_warps": 4}]
w = attncore.BatchMLAPagedAttentionWrapper(ws, backend="fa2")
for i, cfg in enumerate(configs):
    amla.CONFIG.clear(); amla.CONFIG.update(cfg)
    try:
        w.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, H, DC, DP, PS, False, sm, dt, dt)
        out = w.run(qn, qp, ckv, kpe)
        if ref is None:
            ref = out.clone()
        tag = "m{block_m} n{block_n} w{num_warps} s{num_stages}".format(**cfg) + (" (default)" if i == 0 else "")
        add(f"attncore triton {tag}", lambda: w.run(qn, qp, ckv, kpe, out=out), out)
    except Exception as e:
        rows.append((f"attncore triton {cfg}: {type(e).__name__} {str(e)[:80]}", float("nan"), float("nan"), float("nan")))
amla.CONFIG.clear(); amla.CONFIG.update(default)
if os.environ.get("FI_ROOT"):
    sys.path.insert(0, os.environ["FI_ROOT"])
    try:
        import flashinfer
        assert not getattr(flashinfer, "__attncore_shim__", False)
        for be in os.environ.get("FI_MLA_BACKENDS", "fa2 fa3").split():
            try:
                t = time.time()
                fw = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=be)
                fw.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, H, DC, DP, PS, False, sm, dt, dt)
                fo = fw.run(qn, qp, ckv, kpe)
                print(f"flashinfer {be}: built/ran in {time.time() - t:.0f} s", flush=True)
                add(f"flashinfer 0.2.14 {be}", lambda: fw.run(qn, qp, ckv, kpe, out=fo), fo)
            except Exception as e:
                rows.append((f"flashinfer {be}: {type(e).__name__} {str(e)[:80]}", float("nan"), float("nan"), float("nan")))
    except Exception as e:
        rows.append((f"flashinfer: import failed: {type(e).__name__} {str(e)[:80]}", float("nan"), float("nan"), float("nan")))
print(f"\nMLA decode B {B} x kv {KV} x {H} heads, qo 1, page {PS}, bf16 ({nbytes / 1e6:.0f} MB read+written)")
print(f"{'implementation':<48} {'us':>9} {'GB/s':>8} {'max|diff| vs first':>19}")
for name, us, gbs, err in rows:
    print(f"{name:<48} {us:>9.1f} {gbs:>8.0f} {err:>19.3g}")
PY
  PYTHONPATH="${FI_ROOT:-}" timeout "${BENCH_TIMEOUT:-500}" python3 /tmp/mla_bench.py > "$OUT/mla_bench.txt" 2>&1
  echo "bench exit $?"
  stamp "bench done"
fi
echo
echo "$TEST_LINE"
echo "$FI_LINE"
[ -f "$OUT/mla_bench.txt" ] && sed -n '/^MLA decode/,$p' "$OUT/mla_bench.txt"
[ -f "$OUT/mla_bench.txt" ] && ! grep -q "^MLA decode" "$OUT/mla_bench.txt" && tail -15 "$OUT/mla_bench.txt"
stamp "done"
