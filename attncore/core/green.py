"""CUDA green contexts: streams whose kernels run only on a given set of SMs.

POD's ``overlap="sm_split"`` (attncore.core.streams) runs the prefill part on one set of SMs and the decode
part on the rest, at the same time.  The driver API does the partition (CUDA 12.4+): the device's SM resource
is split by count (``cuDevSmResourceSplitByCount``: one group of at least n SMs, rounded up to the device's
granularity, and the remaining SMs), each part becomes a green context (``cuGreenCtxCreate``) and each context
gets a stream (``cuGreenCtxStreamCreate``), which torch sees as an ``ExternalStream``.  Kernels launched on those
streams, by any backend, run on that context's SMs only; CUDA-graph capture records them (measured on an
H100: replay equals eager, bit for bit).

Called through ctypes: torch's own ``torch.cuda.green_contexts`` changed shape between releases and makes
contexts from the whole device each time (two of them overlap), where POD needs two disjoint halves of one
split.  Contexts and streams are made once per (device, split) and kept for the process: the driver caps
how many exist, and a serving loop asks for the same few splits every step.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Dict, Optional, Tuple

import torch

from attncore.core import current

# CUdevResource (cuda.h): ``type`` (int), 92 bytes the driver keeps, then a union whose first field, for an SM
# resource, is ``smCount``.  The struct is 144 bytes in CUDA 12.4-12.9 and may grow; each one here gets a
# generous buffer, and only one resource is ever passed where the API takes an array.
_RES_BYTES = 1024
_SM_COUNT = 4 + 92
_TYPE_SM = 1  # CU_DEV_RESOURCE_TYPE_SM
_GREEN_CTX_DEFAULT_STREAM = 1  # cuGreenCtxCreate requires it
_STREAM_NON_BLOCKING = 1  # cuGreenCtxStreamCreate requires it
# sm_90's partition granularity (sm_80: 2, sm_90: 8 SMs per group); splits are asked for in multiples of it
GRANULARITY = 8

Part = Tuple["torch.cuda.ExternalStream", int]  # (stream, SMs it runs on)


class _Driver:
    """The device's SM resource and the splits made from it (one per device index)."""

    def __init__(self, index: int):
        self.index = index
        self.cu = ctypes.CDLL("libcuda.so.1")
        for name in ("cuDevSmResourceSplitByCount", "cuGreenCtxCreate", "cuGreenCtxStreamCreate"):
            if not hasattr(self.cu, name):
                raise OSError(f"the CUDA driver has no {name} (green contexts need a CUDA 12.4+ driver)")
        self._check(self.cu.cuInit(0), "cuInit")
        self.dev = ctypes.c_int()
        self._check(self.cu.cuDeviceGet(ctypes.byref(self.dev), index), "cuDeviceGet")
        self.whole = ctypes.create_string_buffer(_RES_BYTES)
        self._check(self.cu.cuDeviceGetDevResource(self.dev, self.whole, _TYPE_SM), "cuDeviceGetDevResource")
        self.sms = _sm_count(self.whole)
        self.splits: Dict[int, Tuple[Part, Part]] = {}

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: CUDA driver error {rc} ({(name.value or b'?').decode()})")

    def _stream(self, res) -> "torch.cuda.ExternalStream":
        desc, ctx, st = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cu.cuDevResourceGenerateDesc(ctypes.byref(desc), res, 1), "cuDevResourceGenerateDesc")
        self._check(self.cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, self.dev, _GREEN_CTX_DEFAULT_STREAM),
                    "cuGreenCtxCreate")
        self._check(self.cu.cuGreenCtxStreamCreate(ctypes.byref(st), ctx, _STREAM_NON_BLOCKING, 0),
                    "cuGreenCtxStreamCreate")
        return torch.cuda.ExternalStream(st.value, device=torch.device("cuda", self.index))

    def split(self, n: int) -> Tuple[Part, Part]:
        hit = self.splits.get(n)
        if hit is None:
            group, rest = ctypes.create_string_buffer(_RES_BYTES), ctypes.create_string_buffer(_RES_BYTES)
            groups = ctypes.c_uint(1)
            self._check(self.cu.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), self.whole, rest,
                                                            ctypes.c_uint(0), ctypes.c_uint(n)),
                        f"cuDevSmResourceSplitByCount({n} SMs)")
            hit = self.splits[n] = ((self._stream(group), _sm_count(group)), (self._stream(rest), _sm_count(rest)))
        return hit


def _sm_count(res) -> int:
    return int.from_bytes(res.raw[_SM_COUNT:_SM_COUNT + 4], "little")


_drivers: Dict[int, object] = {}  # device index -> _Driver, or the reason there is none
_lock = threading.Lock()


def _driver(device: torch.device):
    """The device's _Driver, or the reason there is none (made once per device index)."""
    index = current.index_of(device)
    with _lock:
        d = _drivers.get(index)
        if d is None:
            try:
                d = _Driver(index)
            except (OSError, RuntimeError, AttributeError) as e:
                d = f"CUDA green contexts are not available on cuda:{index}: {e}"
            _drivers[index] = d
        return d


def unavailable(device: torch.device) -> Optional[str]:
    """Why the SMs of ``device`` cannot be split between two streams (None: they can)."""
    if device.type != "cuda":
        return f"no SM partitions on {device.type}"
    d = _driver(device)
    return d if isinstance(d, str) else None


def sm_count(device: torch.device) -> int:
    """The SMs a split divides (the device's SM resource)."""
    return _driver(device).sms


def split(device: torch.device, n: int) -> Tuple[Part, Part]:
    """((stream, SMs), (stream, SMs)): a stream on ``n`` SMs (as the driver rounds n up to its granularity)
    and one on the remaining SMs of ``device``; made on first use and kept.  Raises RuntimeError with the
    driver's error when the split cannot be made."""
    d = _driver(device)
    if isinstance(d, str):
        raise RuntimeError(d)
    with _lock:
        return d.split(n)
