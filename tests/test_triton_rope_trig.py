"""RoPE's cos/sin in the Triton kernels (``_cos_sin`` of backends/triton/kernels/attention.py):
the range reduction to [-pi, pi] on the CPU (interpreter: tl.cos / tl.sin on the reduced angle)
and, on a GPU, the hardware approximations after it, against fp64 cos / sin of the same fp32 angle.
The attention-level RoPE cases are in the conformance suite (``-k rope``) and test_triton_backend."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from attncore.backends.triton.kernels.attention import _cos_sin  # noqa: E402


@triton.jit
def _trig_kernel(A, C, S, N: tl.constexpr):
    o = tl.arange(0, N)
    c, s = _cos_sin(tl.load(A + o))
    tl.store(C + o, c)
    tl.store(S + o, s)


def _angles(device):
    g = torch.Generator().manual_seed(7)
    pos = torch.randint(0, 400_000, (2048,), generator=g).float()
    pos[:8] = torch.tensor([0, 1, 2, 3, 4095, 4096, 131071, 399_999], dtype=torch.float32)
    # Llama-style inverse frequencies (theta 5e5, head dim 128) and scale 8 on a quarter of them
    inv = 500000.0 ** (-torch.arange(64).float() / 64)
    freq = inv[torch.randint(0, 64, (2048,), generator=g)]
    freq[::4] /= 8
    ang = (pos * freq).to(torch.float32)
    return ang.to(device)


def _check(device):
    a = _angles(device)
    c = torch.full_like(a, float("nan"))
    s = torch.full_like(a, float("nan"))
    _trig_kernel[(1,)](a, c, s, N=a.numel())
    ref = a.double().cpu()
    err = max((c.double().cpu() - ref.cos()).abs().max().item(), (s.double().cpu() - ref.sin()).abs().max().item())
    # angles up to ~3.8e5 rad here: reducing with one fp32 constant for 2 pi would be off by ~2e-2;
    # the two-constant split measured 3-4e-6 on the CPU; the hardware approximation adds ~1e-6
    assert err < 2e-5, err


def test_cos_sin_range_reduction_cpu():
    if torch.cuda.is_available():
        pytest.skip("the interpreter path; the GPU case below covers this machine")
    _check("cpu")


@pytest.mark.gpu
def test_cos_sin_hardware_gpu():
    _check("cuda")
