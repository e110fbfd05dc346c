"""The current CUDA device and stream, read and set the cheap way (host time, issue 15: every launch asks;
issue 16: POD's SM split switches streams three times a run).

``torch.cuda.current_device()`` and ``torch.cuda.current_stream()`` go through lazy-init checks and build a
Stream object (a few us a call), and ``torch.cuda.stream()`` asks for both on entry and sets the stream twice;
torch's raw accessors answer in a fraction of that.  A torch without them falls back to the public calls.
"""

from __future__ import annotations

import torch

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream
    _raw_device = torch._C._cuda_getDevice
    _get_stream = torch._C._cuda_getCurrentStream  # (stream id, device index, device type)
    _set_stream = torch._C._cuda_setStream
except AttributeError:  # a CPU-only build, or a torch without the private accessors
    _raw_stream = _raw_device = _get_stream = _set_stream = None


def device_index() -> int:
    """The current CUDA device's index."""
    if _raw_device is not None:
        return _raw_device()
    return torch.cuda.current_device()


def index_of(device: torch.device) -> int:
    """``device``'s index, the current CUDA device's where it names none (``torch.device("cuda")``)."""
    return device.index if device.index is not None else device_index()


def stream(index: int) -> int:
    """The handle (an int) of device ``index``'s current stream."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def current_stream(index: int) -> "torch.cuda.Stream":
    """Device ``index``'s current stream as a torch Stream (to record or wait for events on)."""
    if _get_stream is None:
        return torch.cuda.current_stream(index)
    sid, dev, kind = _get_stream(index)
    return torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=kind)


class on:
    """``with on(stream):`` queues the block's launches on ``stream``, as ``torch.cuda.stream(stream)`` does, at a
    fraction of its host time where ``stream`` is on the current device (torch's raw setter also switches the
    device, so another device's stream takes torch's context manager)."""

    __slots__ = ("stream", "prev")

    def __init__(self, stream: "torch.cuda.Stream"):
        self.stream = stream
        self.prev = None

    def __enter__(self) -> None:
        s = self.stream
        if _set_stream is None or _raw_device() != s.device_index:
            self.prev = torch.cuda.stream(s)
            self.prev.__enter__()
            return
        self.prev = _get_stream(s.device_index)
        _set_stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)

    def __exit__(self, *exc) -> None:
        prev, self.prev = self.prev, None
        if isinstance(prev, tuple):
            _set_stream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
        elif prev is not None:
            prev.__exit__(*exc)


_marks: dict = {}  # device index -> [event, side stream, pinned buffer], made once (host time)


def mark(index: int) -> list:
    """A mark of what device ``index``'s current stream has queued so far (``read_at``): one event per device,
    recorded again by each mark, so a mark is read before the next is made."""
    hit = _marks.get(index)
    if hit is None:
        hit = _marks[index] = [torch.cuda.Event(), torch.cuda.Stream(device=index), None]
    hit[0].record(current_stream(index))
    return hit


def read_at(at: list, t: torch.Tensor) -> list:
    """``t``'s values (a small device tensor) as Python values once the work queued before the mark ``at`` is
    done: copied on a side stream that waits for the mark, so the host does not wait for what was queued since.
    The copy lands in pinned memory, so that it is asynchronous on the side stream (a copy to pageable memory is
    staged by the driver and may wait for more than the side stream's work)."""
    event, side, buf = at
    n = t.numel() * t.element_size()
    if buf is None or buf.numel() < n:
        buf = at[2] = torch.empty(max(n, 4096), dtype=torch.uint8, pin_memory=True)
    dst = buf[:n].view(t.dtype)
    side.wait_event(event)
    with on(side):
        dst.copy_(t.reshape(-1), non_blocking=True)
    side.synchronize()
    return dst.tolist()
