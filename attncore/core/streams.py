"""How the POD wrappers (attncore.pod) run their composed parts: one after the other on the current stream,
at the same time on two CUDA streams, or at the same time on two disjoint sets of SMs (``overlap=``), and the
float workspace split that lets two parts run at once without sharing scratch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from attncore.core import current, green
from attncore.core.problem import measured_rows
from attncore.core.workspace import ALIGN

Tensor = torch.Tensor

# Under torch.compile the wrappers trace the serial composition: the stream fork/join is not expressed in a
# compiled region (Dynamo's stream support does not cover a side stream kept across calls and its join).
OVERLAPS = ("auto", "sm_split", "streams", "serial")
PREFILL_FIRST = True  # the launch order on two streams or an SM split (Streams.compose; scripts/gpu_pod_streams.sh)
# The SM split's tail (Streams.run_parts, Backend.split_launches): the prefill's work left when the decode is done
# taken over on the decode's SMs, where the prefill's backend can share its work between two launches.  H200
# (2026-11-29, BENCHMARKS.md 2z, same run, with / without): PD2 0.381 / 0.396 ms, PD1 0.308 / 0.314, prefill 2k +
# 32 x 4k 0.193 / 0.190 (the decode the longer part: the tail's launch costs); a split that starves the prefill
# loses 10-32% less.
SPLIT_TAIL = True
# ... but only where the model has the prefill on its share taking at least this share of the decode's time on its
# share: where the decode clearly ends last, the tail finds no work and its launch (two waves of CTAs that exit at once)
# sits between the decode's end and the join.  H200 (2026-11-30, BENCHMARKS.md 2ax, PD1 at 40 / 92 SMs, 5 interleaved
# rounds): 0.2864 ms with the tail, 0.2817 without (serial 0.3222); the model's ratio there is 0.89.
SPLIT_TAIL_MIN_RATIO = 0.9
# Why overlap="auto" never picks "streams": measured on an H100 (2026-11-24, scripts/gpu_pod_streams.sh, bf16
# 32/8 heads d128 page 16), streams / serial 1.01 on PD1 (0.447 vs 0.452 ms) and PD2 (0.465 vs 0.470), a median
# of 1.005 over the 27-point sweep, 1.02-1.04 at best and 0.57-0.83 beside short decodes (kv 1k, batch <= 32:
# the fork, the join and half-size workspaces cost more than the overlap gives; the prefill kernels fill every
# SM, so the decode overlaps little).  Either launch order measured the same.
STREAMS_MEASURED = ("two streams measured a median 1.005x over serial on the H100 POD sweep, down to 0.57x beside "
                    "short decodes; pass overlap='streams' to run the parts on two streams")

# The SM split (overlap="sm_split"; "auto" on sm_90).  Two streams on disjoint SMs (attncore.core.green): the
# prefill on S SMs, the decode on the rest, each part's own kernels.  Measured on an H100 (2026-11-25,
# scripts/gpu_pod_smsplit.py, bf16 32/8 heads d128 page 16, Triton prefill + xqa decode, 29 points: PD1, PD2 and the
# 27-point sweep, S in steps of 8 or 16): the prefill slows about as 132/S; the decode keeps its speed down to ~68
# SMs, then slows as its SMs shrink (PD1's decode: 0.369 ms on 132 SMs, 0.399 on 68, 0.453 on 60; planned for 60
# SMs, 0.444: its bandwidth per SM, not its grid, session 16); the split ran PD1 (prefill 2k + 64 x 4k) in 0.415 ms
# against 0.454 serial (S = 40), PD2 (4k + 32 x 4k) in 0.419 against 0.474 (S = 96), and lost where one part is
# short (prefill 512) or dwarfs the other.  The model below: each part's time on the whole GPU from its FLOPs or
# bytes, the split's time as the slower part on its share plus a fixed cost.  On those 29 points it picked a split
# on 8 (PD1 40, PD2 96; 1.09-1.21x over serial where a time was measured at its S) and serial on the other 21, where
# the best split measured at most 1.07x.
# Tried and dropped (session 16, same probe): planning each part's split-KV for its share of the SMs (PD1 0.415 ms
# either way, PD2 0.420 against 0.418); holding only the shorter part to its SMs, the other on a plain stream free
# to take every SM (PD2 0.397 ms in the probe, but 0.603 through the wrapper, and up to 1.4x slower than both held
# where the prefill held few SMs: the free part's CTAs can take the held part's SMs first, so it depends on timing).
PREFILL_FLOPS_PER_SM = 500e12 / 132  # the composed prefill kernels' rate on large problems
PREFILL_FIXED_S = 30e-6  # ... and what a short prefill costs beyond its FLOPs (512 rows: 45 us)
DECODE_BYTES_PER_SM = 3.0e12 / 132
DECODE_FIXED_S = 10e-6
DECODE_SATURATION = 68 / 132  # the share of the SMs below which the decode slows (as its SMs shrink)
SPLIT_COST_S = 20e-6  # the fork, the join and each part's tail
# auto splits only a prefill of at least this much work.  H200 (2026-11-30, BENCHMARKS.md 2ar, same runs): at 13 pairs
# with prefills of 256-1024 rows (32 heads, d128, causal: up to 8.6 GFLOP) beside decodes of 134-537 MB the split
# auto took ran 0.75-0.99x serial (once 1.05x, 0.84x in the next run), also where the model gave it 0.81-0.91 of
# serial; at 1,536 rows (19 GFLOP) and up it ran 1.00-1.17x (the H100's sweep lost at 512 rows too, session 15).
# (A split run also costs ~100 us of host time against serial's ~55: pairs of ~0.1 ms are host-bound on it when run
# back to back.)
SPLIT_MIN_PREFILL_FLOPS = 15e9
# auto splits where the model says the split takes at most this share of serial, per GPU model (problem.measured_rows).
# H100 (before the split's tail): 0.9, fitted above. H200 with the tail (2026-11-29, BENCHMARKS.md 2aa, the 27-point
# sweep): the two points the model put at 0.904 (p2k + 32 x 16k, p2k + 128 x 4k) measured 1.045x and 1.051x over
# serial; the next ones up (0.931-0.936, p512 beside 8-128 decodes) lost 1.5-2.9x, none lies between.
SPLIT_MARGINS = {"H200": 0.92, "default": 0.9}
SPLIT_MEASURED_ON = (9, 0)  # auto splits on the compute capability the model was fitted on


def check_overlap(overlap) -> str:
    if overlap.__class__ is not str or overlap not in OVERLAPS:
        raise ValueError(f"overlap: got {overlap!r}, expected one of " + ", ".join(repr(o) for o in OVERLAPS))
    return overlap


@dataclass(frozen=True)
class SplitChoice:
    """The SM split for one pair of parts: ``prefill_sms``, the best split by the model (None: the device is
    too small to split), the model's times in seconds, whether auto takes it (``worth``) and the figures."""
    prefill_sms: Optional[int]
    split_s: float
    serial_s: float
    worth: bool
    reason: str
    prefill_share_s: float = 0.0  # the model's time of each part on its share of the SMs
    decode_share_s: float = 0.0

    @property
    def tail_pays(self) -> bool:
        """Whether the prefill's tail (SPLIT_TAIL) is launched: the model does not have the decode clearly ending last."""
        return SPLIT_TAIL and self.prefill_share_s >= SPLIT_TAIL_MIN_RATIO * self.decode_share_s


def prefill_flops(lens, causal: bool, num_qo_heads: int, head_dim_qk: int, head_dim_vo: int) -> float:
    """FLOPs of a prefill batch: ``lens`` is [(qo, kv)] per request; a causal mask is bottom-right (a window or
    custom mask is counted as no mask: an upper bound)."""
    pairs = 0
    for qo, kv in lens:
        pairs += (qo * kv - qo * (qo - 1) // 2 if kv >= qo else kv * (kv + 1) // 2) if causal else qo * kv
    return 2.0 * pairs * num_qo_heads * (head_dim_qk + head_dim_vo)


def decode_bytes(kv_lens, num_kv_heads: int, head_dim_qk: int, head_dim_vo: int, kv_dtype) -> float:
    """K and V bytes a decode batch reads."""
    return float(sum(kv_lens)) * num_kv_heads * (head_dim_qk + head_dim_vo) * kv_dtype.itemsize


def part_work(prefill_problem, prefill_lens, decode_problem, decode_kv_lens) -> tuple:
    """(prefill FLOPs, decode bytes read) of a POD pair of planned problems (see the two above)."""
    p, d = prefill_problem, decode_problem
    return (prefill_flops(prefill_lens, p.mask == "causal", p.num_qo_heads, p.head_dim_qk, p.head_dim_vo),
            decode_bytes(decode_kv_lens, d.num_kv_heads, d.head_dim_qk, d.head_dim_vo, d.kv_dtype))


def split_margin(device=None) -> float:
    """SPLIT_MARGINS' entry for ``device``'s GPU model (None: the current CUDA device; "default" off CUDA)."""
    return measured_rows(SPLIT_MARGINS, device)[0]


def choose_split(flops: float, nbytes: float, sms: int, granularity: int = green.GRANULARITY,
                 margin: float = SPLIT_MARGINS["default"]) -> SplitChoice:
    """The SMs to give the prefill (a multiple of ``granularity``) so that the slower part ends first, by the
    model above; ``worth`` where the split saves at least ``1 - margin`` of the serial time (``split_margin``) and the
    prefill has at least SPLIT_MIN_PREFILL_FLOPS of work."""
    p_all = flops / (PREFILL_FLOPS_PER_SM * sms) + PREFILL_FIXED_S
    d_all = nbytes / (DECODE_BYTES_PER_SM * sms) + DECODE_FIXED_S
    serial = p_all + d_all
    best = None
    for s in range(granularity, sms - granularity + 1, granularity):
        p_s, d_s = p_all * sms / s, d_all * max(1.0, DECODE_SATURATION * sms / (sms - s))
        t = max(p_s, d_s) + SPLIT_COST_S
        if best is None or t < best[0]:
            best = (t, s, p_s, d_s)
    if best is None:
        return SplitChoice(None, serial, serial, False, f"{sms} SMs: too few to split in groups of {granularity}")
    t, s, p_s, d_s = best
    fig = (f"model: prefill {p_all * 1e6:.0f} us + decode {d_all * 1e6:.0f} us one after the other, "
           f"{t * 1e6:.0f} us with the prefill on {s} of {sms} SMs")
    if flops < SPLIT_MIN_PREFILL_FLOPS:
        return SplitChoice(s, t, serial, False, f"{fig}: a prefill of {flops / 1e9:.1f} GFLOP, under the "
                           f"{SPLIT_MIN_PREFILL_FLOPS / 1e9:.0f} below which the split measured slower than serial",
                           p_s, d_s)
    worth = t <= margin * serial
    return SplitChoice(s, t, serial, worth, fig if worth else f"{fig}: under {1 - margin:.0%} saved", p_s, d_s)


def _fitted_elsewhere(cc) -> str:
    return (f"overlap='auto': serial on sm_{cc[0]}{cc[1]} (the SM split's model was fitted on "
            f"sm_{SPLIT_MEASURED_ON[0]}{SPLIT_MEASURED_ON[1]})")


def describe_split(flops: float, nbytes: float, sms: int, compute_capability,
                   margin: float = SPLIT_MARGINS["default"]) -> str:
    """What overlap="auto" does with a POD pair of this work on a GPU of ``sms`` SMs and this compute capability,
    and why (``attncore explain --pod-sizes``; ``margin``: ``split_margin`` of the GPU)."""
    c = choose_split(flops, nbytes, sms, margin=margin)
    cc = tuple(compute_capability)
    if cc != SPLIT_MEASURED_ON:
        return (f"{_fitted_elsewhere(cc)}; overlap='sm_split' would put the prefill on {c.prefill_sms} of {sms} SMs "
                f"({c.reason})")
    if c.prefill_sms is None or not c.worth:
        return f"overlap='auto': serial ({c.reason})"
    if c.tail_pays:
        tail = ("; the prefill's work left when the decode ends then moves to the decode's SMs where its backend "
                "splits its launch (Backend.split_launches: cuda_fa2's prefill90)")
    elif SPLIT_TAIL:
        tail = (f"; no tail for the prefill: the model has it ending first ({c.prefill_share_s * 1e6:.0f} us on its "
                f"SMs against the decode's {c.decode_share_s * 1e6:.0f})")
    else:
        tail = ""
    return (f"overlap='auto': SM split, the prefill on {c.prefill_sms} SMs, the decode on {sms - c.prefill_sms} "
            f"({c.reason}){tail}")


class Streams:
    """How one POD wrapper runs its composed parts (``overlap``): the prefill and the decode on disjoint sets of
    SMs (``"sm_split"``; ``"auto"`` where the model above says it gains), the decode on a side stream forked
    from the current one (``"streams"``), or both in turn on the current stream (``"serial"``).  ``mode``,
    ``reason`` and ``sms`` describe the last run (``reason``: why composed parts ran serially, else None;
    ``sms``: (prefill SMs, decode SMs) of an SM split, else None)."""

    def __init__(self, overlap, device: torch.device):
        self.overlap = check_overlap(overlap)
        self.device = device
        self._side: dict = {}  # (device index, priority) -> the side stream, created once and reused
        self._why: Optional[tuple] = None  # (unavailable()'s answer,): fixed per wrapper, asked every run
        self._decided: Optional[tuple] = None  # (prefill meta, decode meta, choice, pair, why)
        self._events: Optional[tuple] = None  # the split's fork and join events, made once (host time)
        self.choice: Optional[SplitChoice] = None  # the split the next compose() runs (None: not a split)
        self.pair: Optional[tuple] = None  # ... and its green.split() streams and SM counts, kept (host time)
        self.mode: Optional[str] = None
        self.reason: Optional[str] = None
        self.sms: Optional[tuple] = None

    def unavailable(self) -> Optional[str]:
        """Why the composed parts never run at the same time here (None: they may; for ``"auto"`` and
        ``"sm_split"``, ``decide()`` says for each pair of parts)."""
        if self._why is None:
            self._why = (self._unavailable(),)
        return self._why[0]

    def _unavailable(self) -> Optional[str]:
        if self.overlap == "serial":
            return "overlap='serial': the composed parts run one after the other"
        if self.device.type != "cuda":
            return f"overlap={self.overlap!r}: no CUDA streams on {self.device.type}: the parts run in turn"
        if self.overlap == "streams":
            return None
        cc = torch.cuda.get_device_capability(self.device)
        if self.overlap == "auto" and cc != SPLIT_MEASURED_ON:
            return f"{_fitted_elsewhere(cc)}: pass overlap='sm_split' to split anyway; {STREAMS_MEASURED}"
        why = green.unavailable(self.device)
        return None if why is None else f"overlap={self.overlap!r}: {why}; the parts run one after the other"

    def decide(self, problem_p, meta_p, problem_d, meta_d) -> Optional[str]:
        """Choose how the next compose() runs this pair of planned parts; the reason they will run one after
        the other (None: at the same time).  Kept for the last pair of metas (a serving step runs the same
        plans in every layer)."""
        hit = self._decided
        if hit is not None and hit[0] is meta_p and hit[1] is meta_d:
            self.choice, self.pair = hit[2], hit[3]
            return hit[4]

        def work():
            kv_d = meta_d.kv_lens_host
            if kv_d is None:  # block tables planned in graph capture: bounded by the longest
                kv_d = [meta_d.max_seq_len or 0] * meta_d.batch_size
            kv_p = meta_p.kv_lens_host or [0] * meta_p.batch_size
            return part_work(problem_p, zip(meta_p.qo_lens_host, kv_p), problem_d, kv_d)
        why = self.decide_work(work)
        self._decided = (meta_p, meta_d, self.choice, self.pair, why)
        return why

    def decide_work(self, work: Callable[[], tuple]) -> Optional[str]:
        """decide() from the parts' work: ``work()`` gives (prefill FLOPs, decode bytes), asked only where a
        split is to be chosen.  Sets ``choice`` and ``pair``; the reason the parts will run one after the
        other, or None."""
        self.choice = self.pair = None
        why = self.unavailable()
        if why is not None or self.overlap == "streams":
            return why
        c = choose_split(*work(), green.sm_count(self.device), margin=split_margin(self.device))
        if c.prefill_sms is None or (self.overlap == "auto" and not c.worth):
            return f"overlap={self.overlap!r}: serial ({c.reason})"
        self.choice, self.pair = c, green.split(self.device, c.prefill_sms)
        return None

    def split_sms(self, why_serial: Optional[str]) -> Optional[tuple]:
        """(prefill SMs, decode SMs) of the split ``decide()`` chose (None: the parts will not run on an SM split,
        ``why_serial`` being decide()'s answer)."""
        return None if why_serial is not None or self.pair is None else (self.pair[0][1], self.pair[1][1])

    def run_parts(self, planned_p, args_p, planned_d, args_d, why_serial: Optional[str]) -> None:
        """compose() of two planned parts (attncore.core._api.Planned) with ``decide()``'s answer: on an SM split
        the decode runs a plan for its share (``Planned.run``'s sms) and, where the prefill's backend can
        (``Planned.split_runs``; ``SPLIT_TAIL``), the prefill's work left when the decode is done is taken over on
        the decode's SMs, unless the model has the decode ending last (``SplitChoice.tail_pays``)."""
        sms = self.split_sms(why_serial)
        if sms is None:
            return self.compose(lambda: planned_p.run(args_p), lambda: planned_d.run(args_d), why_serial)
        c = self.choice  # (None: a pair set without the model's figures keeps the tail)
        pair = planned_p.split_runs(args_p, *sms) if (c.tail_pays if c is not None else SPLIT_TAIL) else None
        first, tail = pair or ((lambda: planned_p.run(args_p)), None)
        self.compose(first, lambda: planned_d.run(args_d, sms[1]), why_serial, tail=tail)

    def side(self, cur) -> "torch.cuda.Stream":
        """The side stream for ``cur``'s device, with ``cur``'s priority (a low-priority side stream would
        let the decode starve behind the prefill; a high one would preempt the caller's other work)."""
        key = (cur.device.index, cur.priority)
        s = self._side.get(key)
        while s is None or s == cur:  # torch hands out pooled streams: never fork onto the current one
            s = self._side[key] = torch.cuda.Stream(device=cur.device, priority=cur.priority)
        return s

    def compose(self, prefill, decode, why_serial: Optional[str] = None, prefill_first: Optional[bool] = None,
                tail: Optional[Callable[[], None]] = None) -> None:
        """Run the parts (callables that launch them; everything they write is allocated already): on the
        split ``decide()`` chose, on the current and a side stream (``"streams"``), or in turn with the reason
        ``why_serial`` (or ``unavailable()``'s).  ``prefill_first``: the launch order on two streams or an SM split
        (None: ``PREFILL_FIRST``; measurement scripts time both, scripts/gpu_pod_coresident.py).  ``tail`` (an SM
        split only): launched on the decode's stream after the decode, before the join (run_parts); in any other
        mode it runs after both parts.

        Memory: the outputs (out, lse) were allocated on the current stream before the fork, the inputs
        are the caller's, used as if on the current stream; the current stream waits for every stream it
        forked before this returns (the join).  The caching allocator hands a freed block back only to the
        stream it was allocated on (or after the events of record_stream, recorded later on the current
        stream), so any reuse is queued after the join: after the parts read or wrote it; no record_stream is
        needed.  What a part allocates under another stream goes back to that stream's pool, whose later
        users queue after it.  Under CUDA-graph capture the forked streams join the capture through the
        fork's event and leave it at the join."""
        why = why_serial or self.unavailable()
        if why is None and self.overlap != "streams" and self.pair is None:
            why = f"overlap={self.overlap!r}: no split chosen for these parts (decide() was not called)"
        if why is not None:
            prefill(), decode()
            if tail is not None:
                tail()
            self.mode, self.reason, self.sms = "serial", why, None
            return
        cur = current.current_stream(current.index_of(self.device))
        if self.overlap != "streams":
            (sp, n_p), (sd, n_d) = self.pair
            if self._events is None:
                self._events = tuple(torch.cuda.Event() for _ in range(3))
            fork, join_p, join_d = self._events
            fork.record(cur)  # fork both before either part is queued
            sp.wait_event(fork)
            sd.wait_event(fork)
            first = PREFILL_FIRST if prefill_first is None else bool(prefill_first)
            queued = []
            try:
                for stream, part in ((sp, prefill), (sd, decode))[::1 if first else -1]:
                    with current.on(stream):
                        part()
                    queued.append(part)
            finally:
                try:  # the tail once the prefill's first launch is queued, even when the decode raised: it
                    # finishes the prefill's shared work (and so resets what the two launches share)
                    if tail is not None and prefill in queued:
                        with current.on(sd):
                            tail()
                finally:  # join, even when a launch raised: nothing forked dangles
                    join_p.record(sp)
                    join_d.record(sd)
                    cur.wait_event(join_p)
                    cur.wait_event(join_d)
            self.mode, self.reason, self.sms = "sm_split", None, (n_p, n_d)
            return
        side = self.side(cur)
        side.wait_stream(cur)  # fork, before the prefill is queued: the decode must not wait for it
        try:
            # the prefill first, so that its CTAs (large shared memory, one or two per SM) take their SMs and
            # the light decode CTAs fill what is left beside them (decode first measured the same on the
            # H100: PD1 0.445 vs 0.446 ms, BENCHMARKS 2f)
            first = PREFILL_FIRST if prefill_first is None else bool(prefill_first)
            if first:
                prefill()
            with current.on(side):
                decode()
            if not first:
                prefill()
        finally:
            cur.wait_stream(side)  # join, even when a launch raised: nothing of the side stream dangles
        if tail is not None:
            tail()
        self.mode, self.reason, self.sms = "streams", None, None


def halves(ws: Tensor) -> Optional[tuple]:
    """The caller's float workspace as (head, tail) uint8 views, split at a 256-byte multiple: the
    prefill part's and the decode part's scratch when they run at the same time; None when the buffer
    is not contiguous (no byte views of it)."""
    if not ws.is_contiguous():
        return None
    b = ws.view(-1).view(torch.uint8)
    h = b.numel() // 2 // ALIGN * ALIGN
    return b[:h], b[h:]
