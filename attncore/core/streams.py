"""How the POD wrappers (attncore.pod) run their composed parts: one after the other on the current stream,
or at the same time on two CUDA streams (``overlap=``), and the float workspace split that lets two parts
run at once without sharing scratch."""

from __future__ import annotations

from typing import Optional

import torch

from attncore.core.workspace import ALIGN

Tensor = torch.Tensor

# Under torch.compile the wrappers trace the serial composition: the stream fork/join is not expressed in a
# compiled region (Dynamo's stream support does not cover a side stream kept across calls and its join).
OVERLAPS = ("auto", "streams", "serial")
PREFILL_FIRST = True  # the launch order in streams mode (see Streams.compose; scripts/gpu_pod_streams.sh times both)
# What overlap="auto" does on a GPU.  Measured on an H100 (2026-11-24, scripts/gpu_pod_streams.sh, bf16 32/8
# heads d128 page 16): streams / serial 1.01 on PD1 (0.447 vs 0.452 ms) and PD2 (0.465 vs 0.470), a median of
# 1.005 over the 27-point sweep, 1.02-1.04 at best and 0.57-0.83 beside short decodes (kv 1k, batch <= 32: the
# fork, the join and half-size workspaces cost more than the overlap gives; the prefill kernels fill every SM,
# so the decode overlaps little).  Either launch order measured the same.  So auto composes serially.
AUTO_STREAMS = False
AUTO_SERIAL = ("overlap='auto': serial, as measured (two streams: a median 1.005x over the H100 POD sweep, down "
               "to 0.57x beside short decodes; pass overlap='streams' to run the parts on two streams)")


def check_overlap(overlap) -> str:
    if overlap.__class__ is not str or overlap not in OVERLAPS:
        raise ValueError(f"overlap: got {overlap!r}, expected one of 'auto', 'streams', 'serial'")
    return overlap


class Streams:
    """How one POD wrapper runs its composed parts: the decode part on a side stream forked from the
    current stream (``"streams"``) or both in turn on the current stream (``"serial"``).  ``mode`` and
    ``reason`` describe the last run (``reason``: why composed parts ran serially; None otherwise)."""

    def __init__(self, overlap, device: torch.device):
        self.overlap = check_overlap(overlap)
        self.device = device
        self._side: dict = {}  # (device index, priority) -> the side stream, created once and reused
        self.mode: Optional[str] = None
        self.reason: Optional[str] = None

    def unavailable(self) -> Optional[str]:
        """Why the composed parts cannot run on two streams here (None: they can)."""
        if self.overlap == "serial":
            return "overlap='serial': the composed parts run one after the other"
        if self.device.type != "cuda":
            return f"overlap={self.overlap!r}: no CUDA streams on {self.device.type}: the parts run in turn"
        if self.overlap == "auto" and not AUTO_STREAMS:
            return AUTO_SERIAL
        return None

    def side(self, cur) -> "torch.cuda.Stream":
        """The side stream for ``cur``'s device, with ``cur``'s priority (a low-priority side stream would
        let the decode starve behind the prefill; a high one would preempt the caller's other work)."""
        key = (cur.device.index, cur.priority)
        s = self._side.get(key)
        while s is None or s == cur:  # torch hands out pooled streams: never fork onto the current one
            s = self._side[key] = torch.cuda.Stream(device=cur.device, priority=cur.priority)
        return s

    def compose(self, prefill, decode, why_serial: Optional[str] = None, prefill_first: Optional[bool] = None) -> None:
        """Run the parts (callables that launch them; everything they write is allocated already).
        ``prefill_first``: the launch order on two streams (None: ``PREFILL_FIRST``; measurement scripts
        time both, scripts/gpu_pod_coresident.py).

        Memory: the outputs (out, lse) were allocated on the current stream before the fork, the inputs
        are the caller's, used as if on the current stream; the current stream waits for the side stream
        before this returns (the join).  The caching allocator hands a freed block back only to the stream
        it was allocated on (or after the events of record_stream, recorded later on the current stream),
        so any reuse is queued after the join: after the decode read or wrote it; no record_stream is
        needed.  What the decode allocates under the side stream goes back to the side stream's pool,
        whose later users queue after it.  Under CUDA-graph capture the side stream joins the capture
        through the fork's event and leaves it at the join."""
        why = why_serial or self.unavailable()
        if why is not None:
            prefill(), decode()
            self.mode, self.reason = "serial", why
            return
        cur = torch.cuda.current_stream(self.device)
        side = self.side(cur)
        side.wait_stream(cur)  # fork, before the prefill is queued: the decode must not wait for it
        try:
            # the prefill first, so that its CTAs (large shared memory, one or two per SM) take their SMs and
            # the light decode CTAs fill what is left beside them (decode first measured the same on the
            # H100: PD1 0.445 vs 0.446 ms, BENCHMARKS 2f)
            first = PREFILL_FIRST if prefill_first is None else bool(prefill_first)
            if first:
                prefill()
            with torch.cuda.stream(side):
                decode()
            if not first:
                prefill()
        finally:
            cur.wait_stream(side)  # join, even when a launch raised: nothing of the side stream dangles
        self.mode, self.reason = "streams", None


def halves(ws: Tensor) -> Optional[tuple]:
    """The caller's float workspace as (head, tail) uint8 views, split at a 256-byte multiple: the
    prefill part's and the decode part's scratch when they run at the same time; None when the buffer
    is not contiguous (no byte views of it)."""
    if not ws.is_contiguous():
        return None
    b = ws.view(-1).view(torch.uint8)
    h = b.numel() // 2 // ALIGN * ALIGN
    return b[:h], b[h:]
