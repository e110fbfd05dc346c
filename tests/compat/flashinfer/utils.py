"""``flashinfer.utils`` in the attncore shim: the two hardware queries FlashInfer 0.2.14's tests import
(test_deepseek_mla.py skips its fa3 cases with them).  They answer about the device, as FlashInfer's do
(compute capability and the CUDA toolkit torch was built with); every other name raises ``AttributeError``."""

from __future__ import annotations

import torch


def _cuda_at_least(major: int, minor: int) -> bool:
    v = torch.version.cuda
    return v is not None and tuple(int(x) for x in v.split(".")[:2]) >= (major, minor)


def is_sm90a_supported(device: torch.device) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9 and _cuda_at_least(12, 3)


def is_sm100a_supported(device: torch.device) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 10 and _cuda_at_least(12, 8)


def __getattr__(name: str):
    raise AttributeError(f"flashinfer.utils.{name}: not provided by the attncore shim (only is_sm90a_supported and "
                         f"is_sm100a_supported, which FlashInfer's tests import)")
