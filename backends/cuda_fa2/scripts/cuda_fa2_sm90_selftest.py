"""wgmma primitive checks for the cuda_fa2 Hopper kernel (csrc/fa2_sm90_selftest.cu) against torch matmul.

Usage (sm90 GPU): python backends/cuda_fa2/scripts/cuda_fa2_sm90_selftest.py SWAP [FLAGS_FILE]
Prints one line per (layout, dtype, N: the S tiles' 48 / 64 / 80 / 128 keys, P V's 64 / 128 / 256 head dims; K 128,
64 where N > 128) and exits 0 when the K-major SS form and the register-A +
MN-major B form (V descriptor LBO/SBO order SWAP: 0 default, 1 swapped) all match.  A wrong order
can fault (it reads past the tile), so each order runs in its own process.  On success FLAGS_FILE
gets the nvcc flag that selects the order ("" or "-DFA2_SM90_VSWAP=1").
"""

from __future__ import annotations

import ctypes
import sys

import torch

from attncore.build import jit
from attncore.backends.cuda_fa2 import specs


def main() -> int:
    lib = jit.load(specs.selftest_spec(), "90")
    fn = lib.fa2_sm90_selftest
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p]
    dev = torch.device("cuda", 0)
    ok = {}
    for mode, name in ((0, "SS K-major A/B  (Q K^T)"), (1, "RS reg-A, MN-major B (P V)")):
        for dt in (torch.bfloat16, torch.float16):
            for n in ((48, 64, 80, 128) if mode == 0 else (64, 128, 256)):
                k = 64 if n > 128 else 128
                for swap in ((0,) if mode == 0 else (int(sys.argv[1]),)):
                    torch.manual_seed(n + mode)
                    a = torch.randn(64, k, device=dev, dtype=dt)
                    b = torch.randn(n, k, device=dev, dtype=dt) if mode == 0 else torch.randn(k, n, device=dev, dtype=dt)
                    c = torch.full((64, n), float("nan"), device=dev)
                    err = fn(mode, 1 if dt == torch.bfloat16 else 0, n, a.data_ptr(), b.data_ptr(), c.data_ptr(), swap,
                             torch.cuda.current_stream().cuda_stream)
                    torch.cuda.synchronize()
                    ref = a.float() @ (b.float().t() if mode == 0 else b.float())
                    rel = ((c - ref).norm() / ref.norm()).item() if err == 0 else float("inf")
                    good = err == 0 and rel < 1e-5 and not c.isnan().any().item()
                    ok[(mode, dt, n, swap)] = good
                    print(f"selftest {name:30s} {str(dt)[6:]:9s} N={n:3d} swap={swap} err={err} rel={rel:.2e} "
                          f"{'PASS' if good else 'FAIL'}", flush=True)
    ss = all(v for (m, *_), v in ok.items() if m == 0)
    rs = all(v for (m, *_), v in ok.items() if m == 1)
    swap = int(sys.argv[1])
    print(f"selftest summary: SS {'ok' if ss else 'FAILED'}, RS (swap={swap}) {'ok' if rs else 'FAILED'}", flush=True)
    if len(sys.argv) > 2 and ss and rs:
        open(sys.argv[2], "w").write("-DFA2_SM90_VSWAP=1" if swap else "")
    return 0 if ss and rs else 1


if __name__ == "__main__":
    sys.exit(main())
