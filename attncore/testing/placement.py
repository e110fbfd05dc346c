"""Where checks run: which device, and on which stream.

Serving stacks run attention on ``cuda:1``, ``cuda:2``, ... (one process per GPU, often with the
current device left at 0) and on non-default streams.  ``attncore check --device cuda:1 --stream
side`` and the conformance suite's ``--attncore-device`` / ``--attncore-stream`` run every case that
way: tensors on the named device, that device's current stream set to a fresh side stream, the
current device left where it was.  A backend that launches on the wrong device or stream reads
inputs not yet written or writes where the check does not look; one that moves the current device
fails the case.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Optional

import torch

STREAMS = ("default", "side")


def parse_device(text: str, *, present: bool = True) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (with ``present``, checked against the GPUs here); ValueError
    otherwise."""
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", text or "")
    if not m:
        raise ValueError(f"{text!r}: expected cpu, cuda or cuda:N")
    if present and text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"{text}: no CUDA GPU here (torch {torch.__version__})")
        n = torch.cuda.device_count()
        if m.group(1) is not None and int(m.group(1)) >= n:
            raise ValueError(f"{text}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    return text


def device_type(device: Optional[str]) -> str:
    """``cuda`` for ``cuda:1``: the type that capabilities and problems speak of."""
    return torch.device(device or "cpu").type


@contextlib.contextmanager
def placed(device: str, stream: str = "default") -> Iterator[None]:
    """Run the body with ``device``'s current stream set to a side stream (``stream="side"``),
    leaving the current device as it was; on exit fail if the body moved the current device."""
    if stream not in STREAMS:
        raise ValueError(f"stream {stream!r}: expected one of {STREAMS}")
    dev = torch.device(device)
    if dev.type != "cuda":
        yield
        return
    before = torch.cuda.current_device()
    prev = side = None
    if stream == "side":
        prev = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(prev)
        torch.cuda.set_stream(side)  # this also makes dev current; put the caller's device back
        torch.cuda.set_device(before)
    try:
        yield
        moved = torch.cuda.current_device()
    finally:
        if side is not None:
            prev.wait_stream(side)
            torch.cuda.set_stream(prev)
        torch.cuda.set_device(before)
    if moved != before:
        raise AssertionError(f"the current CUDA device moved from cuda:{before} to cuda:{moved} "
                             f"(running on {dev}): a backend must restore it")
