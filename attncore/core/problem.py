"""The attention problem: what a backend is asked to compute, as frozen, hashable data.

An ``AttentionProblem`` is built by the public API at plan time (never inside ``run()``) and is
what the selector matches against each backend's declared capabilities.  It holds only the
*kind* of problem (dtypes, heads, layout, features), never sizes that change every step
(batch size, sequence lengths), so one problem serves every layer and step of a model.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

# Operations a backend may claim.  The fused ops (pod, batch_pod) run a prefill part and a decode part
# in one launch; the API composes the parts (two launches) when no backend claims them or the claiming
# backend's plan() declines (``PODDeclined``).
OPS = (
    "single_prefill",
    "batch_prefill_ragged",
    "batch_prefill_paged",
    "batch_decode",
    "xqa_decode",
    "pod",
    "batch_pod",
)
PAGED_OPS = ("batch_prefill_paged", "batch_decode", "xqa_decode", "pod", "batch_pod")
DECODE_OPS = ("batch_decode", "xqa_decode")
POD_OPS = ("pod", "batch_pod")

MASK_KINDS = ("none", "causal", "custom")
POS_ENCODINGS = ("NONE", "ROPE_LLAMA", "ALIBI")
LAYOUTS = ("NHD", "HND")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Feature flags a problem may need; a backend lists the ones it serves in its capabilities.
FEATURES = (
    "window",  # sliding window (window_left >= 0)
    "soft_cap",  # logits soft cap
    "alibi",  # pos_encoding_mode="ALIBI"
    "rope",  # pos_encoding_mode="ROPE_LLAMA" (in-kernel RoPE)
    "sinks",  # per-head attention sinks
    "fp8_scales",  # q/k/v scales other than 1 (or xqa bmm scales)
    "return_lse",  # LSE output
    "spec_mask",  # xqa speculative-decoding mask
    "cuda_graph",  # run() capturable with user buffers
)


@dataclass(frozen=True)
class AttentionProblem:
    """The kind of attention to compute.  Frozen and hashable (used as a cache key).

    Sizes that vary per step (batch size, lengths) are deliberately absent.
    """

    op: str
    device_type: str = "cpu"
    compute_capability: Optional[Tuple[int, int]] = None
    q_dtype: torch.dtype = torch.float16
    kv_dtype: torch.dtype = torch.float16
    out_dtype: torch.dtype = torch.float16
    num_qo_heads: int = 32
    num_kv_heads: int = 32
    head_dim_qk: int = 128
    head_dim_vo: int = 128
    page_size: Optional[int] = None  # None for non-paged ops
    kv_layout: str = "NHD"
    mask: str = "none"
    window_left: int = -1
    soft_cap: bool = False
    pos_encoding: str = "NONE"
    sinks: bool = False
    fp8_scales: bool = False
    return_lse: bool = False
    q_len_per_req: int = 1
    spec_mask: bool = False
    cuda_graph: bool = False
    # pod / batch_pod: the fields above describe the prefill part, ``decode`` the decode part (op
    # batch_decode; same device, dtypes, heads and head dims, see ``pod_problem``).  None otherwise.
    decode: Optional["AttentionProblem"] = None

    def __hash__(self) -> int:
        # host time: a plan hashes its problem several times (selection, config and memo keys); the dataclass's
        # own hash rebuilds the tuple of all fields each time, so it is kept once computed (not pickled: a str's
        # hash differs between processes)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(self.__dict__[f] for f in _FIELDS))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // max(self.num_kv_heads, 1)

    @property
    def features(self) -> frozenset:
        """The feature flags (see ``FEATURES``) this problem needs."""
        f = set()
        if self.window_left >= 0:
            f.add("window")
        if self.soft_cap:
            f.add("soft_cap")
        if self.pos_encoding == "ALIBI":
            f.add("alibi")
        if self.pos_encoding == "ROPE_LLAMA":
            f.add("rope")
        for name in ("sinks", "fp8_scales", "return_lse", "spec_mask", "cuda_graph"):
            if getattr(self, name):
                f.add(name)
        if self.decode is not None:  # a POD problem needs what either part needs
            f |= self.decode.features
        return frozenset(f)

    def replace(self, **changes) -> "AttentionProblem":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A short readable id, e.g. ``batch_decode cuda sm90 bf16/bf16 d128 32/8 p16 NHD causal``."""
        dt = _dtype_name
        parts = [self.op, self.device_type]
        if self.compute_capability:
            parts.append("sm%d%d" % self.compute_capability)
        parts.append(f"{dt(self.q_dtype)}/{dt(self.kv_dtype)}->{dt(self.out_dtype)}")
        parts += [dims_name(self.head_dim_qk, self.head_dim_vo), f"{self.num_qo_heads}/{self.num_kv_heads}"]
        if self.page_size is not None:
            parts.append(f"p{self.page_size}")
        parts += [self.kv_layout, self.mask]
        if self.q_len_per_req != 1:
            parts.append(f"qlen{self.q_len_per_req}")
        if self.decode is None:
            parts += sorted(self.features)
            return " ".join(parts)
        own = self.replace(decode=None).features
        parts += sorted(own)
        d = self.decode
        dparts = [f"p{d.page_size}" if d.page_size is not None else "", d.kv_layout, d.mask]
        if d.q_len_per_req != 1:
            dparts.append(f"qlen{d.q_len_per_req}")
        return " ".join(parts) + " + decode[" + " ".join(x for x in dparts + sorted(d.features) if x) + "]"


class PODDeclined(Exception):
    """Raised by a backend's ``plan()`` for a pod / batch_pod problem it claims but whose batch it
    would run slower fused than composed (or cannot fuse): the API then composes the parts and
    reports ``str(exc)`` as the reason (``PODWithPagedKVCacheWrapper.fused_reason``)."""


def pod_problem(op: str, prefill: AttentionProblem, decode: AttentionProblem) -> AttentionProblem:
    """The fused problem of a prefill part and a decode part (each as planned on its own).  The parts
    share the device, dtypes, heads and head dims (one kernel reads both); each keeps its own mask,
    window, soft cap, positional encoding, layout and page size."""
    if op not in POD_OPS:
        raise ValueError(f"op: got {op!r}, expected one of {list(POD_OPS)}")
    for name in ("device_type", "compute_capability", "q_dtype", "kv_dtype", "out_dtype", "num_qo_heads",
                 "num_kv_heads", "head_dim_qk", "head_dim_vo"):
        a, b = getattr(prefill, name), getattr(decode, name)
        if a != b:
            raise ValueError(f"{name}: the prefill part has {a!r}, the decode part {b!r}; a POD call's parts "
                             f"must agree")
    return prefill.replace(op=op, decode=decode.replace(op="batch_decode", decode=None))


def pod_parts(problem: AttentionProblem) -> Tuple[AttentionProblem, AttentionProblem]:
    """The (prefill, decode) problems a POD problem composes: a single prefill (``pod``: ragged K/V) or a
    paged batch prefill (``batch_pod``), and a batch decode."""
    if problem.decode is None:
        raise ValueError(f"{problem.op}: not a POD problem (no decode part)")
    op = "single_prefill" if problem.op == "pod" else "batch_prefill_paged"
    return problem.replace(op=op, decode=None), problem.decode


_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionProblem))


@dataclass
class PODBatch:
    """What a backend's ``plan()`` receives for a pod / batch_pod problem: one ``BatchMeta`` per part
    (``attncore.core.backend``); the prefill part is ragged (pod) or paged (batch_pod), the decode
    part paged.  Its ``run()`` receives a ``PODRunArgs``."""

    prefill: "object"  # BatchMeta
    decode: "object"  # BatchMeta


def outside_measured_wins(batch: PODBatch, regions, where: str) -> Optional[str]:
    """Why ``batch`` lies outside every region where a backend's fused launch was measured to beat the composed
    parts (None: inside one).  ``regions``: a ``measured_rows`` table; ``where``: its name and home, for the
    message."""
    return outside_region(batch.prefill.qo_indptr_host[-1], batch.decode.batch_size,
                          max(batch.decode.kv_lens_host, default=0), regions, where, batch.decode.device)


def outside_region(p: int, b: int, kv: int, regions, where: str, device=None) -> Optional[str]:
    """``outside_measured_wins`` by the sizes themselves: prefill tokens ``p``, decode requests ``b``, the longest
    decode KV ``kv`` (``attncore explain --pod-sizes``), on ``device`` (None: the current CUDA device)."""
    rows, model = measured_rows(regions, device)
    for max_p, max_b, max_kv in rows:
        if p <= max_p and (max_b is None or b <= max_b) and kv <= max_kv:
            return None
    bounds = "; ".join(f"prefill <= {mp} tokens with decode batch <= {mb} and kv <= {mk}" for mp, mb, mk in rows)
    return (f"prefill {p} tokens + decode {b} x up to {kv} keys is outside the measured region where the fused "
            f"launch beat the composed parts ({where}, {model}: {bounds})")


def measured_rows(table, device=None) -> Tuple[tuple, str]:
    """The rows of a measured-wins table for ``device``'s GPU, and which rows they are.  ``table`` maps a GPU
    model, a word of the GPU's name ("H200" in "NVIDIA H200"), to (max prefill tokens, max decode batch or None,
    max decode kv) rows; ``"default"`` serves any other device.  The same kernels win over different ranges on
    different chips (the H200's bandwidth makes the composed decode cheaper), so each model has its own rows."""
    words = set(gpu_name(device).split())
    for model, rows in table.items():
        if model != "default" and model in words:
            return rows, f"{model} rows"
    return table["default"], "default rows"


def gpu_name(device=None) -> str:
    """The CUDA device's name ("" for a CPU device or without CUDA); None: the current CUDA device."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return ""
    if not torch.cuda.is_available():
        return ""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _gpu_name(index)


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@dataclass
class PODRunArgs:
    """The tensors of one fused run: a ``RunArgs`` per part (``attncore.core.backend``)."""

    prefill: "object"  # RunArgs
    decode: "object"  # RunArgs


_DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
    torch.uint8: "u8",
}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


dtype_name = _dtype_name


def dims_name(head_dim_qk: int, head_dim_vo: int) -> str:
    """The head dims in ids and descriptions: ``d128``, or ``d192x128`` where QK's and VO's differ."""
    return f"d{head_dim_qk}" + (f"x{head_dim_vo}" if head_dim_vo != head_dim_qk else "")


def device_info(device: torch.device) -> Tuple[str, Optional[Tuple[int, int]]]:
    """(device type, compute capability or None) of a torch device."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda", tuple(torch.cuda.get_device_capability(device))
    return device.type, None
