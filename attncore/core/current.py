"""The current CUDA device and stream, read the cheap way (host time, issue 15: every launch asks).

``torch.cuda.current_device()`` and ``torch.cuda.current_stream()`` go through lazy-init checks and build a
Stream object (a few us a call); torch's raw accessors answer in a fraction of that.  A torch without them
falls back to the public calls.
"""

from __future__ import annotations

import torch

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream
    _raw_device = torch._C._cuda_getDevice
except AttributeError:  # a CPU-only build, or a torch without the private accessors
    _raw_stream = _raw_device = None


def device_index() -> int:
    """The current CUDA device's index."""
    if _raw_device is not None:
        return _raw_device()
    return torch.cuda.current_device()


def stream(index: int) -> int:
    """The handle (an int) of device ``index``'s current stream."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream
