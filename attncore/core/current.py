"""The current CUDA device and stream, read the cheap way (host time, issue 15: every launch asks), and the
SMs a plan may count on.

``torch.cuda.current_device()`` and ``torch.cuda.current_stream()`` go through lazy-init checks and build a
Stream object (a few us a call); torch's raw accessors answer in a fraction of that.  A torch without them
falls back to the public calls.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

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


# The SMs the kernels of a plan made now will run on, when fewer than the device's: the part of a POD pair
# that runs on its share of an SM split (attncore.pod, attncore.core.green).  Backends size their split-KV
# counts and grids by it (a decode planned for 132 SMs and run on 60 queues a half-empty last wave).
_SM_SHARE: contextvars.ContextVar = contextvars.ContextVar("attncore_sm_share", default=None)


@contextlib.contextmanager
def sm_share(n: Optional[int]) -> Iterator[None]:
    """Plans made inside this block run on ``n`` SMs (None: the whole device)."""
    token = _SM_SHARE.set(n)
    try:
        yield
    finally:
        _SM_SHARE.reset(token)


def share() -> Optional[int]:
    """The SM share plans made now run on (None: the whole device)."""
    return _SM_SHARE.get()


def sms(total: int) -> int:
    """The SMs a plan made now may count on: ``total`` (the device's), or the SM share around it."""
    share = _SM_SHARE.get()
    return total if share is None else max(1, min(total, share))
