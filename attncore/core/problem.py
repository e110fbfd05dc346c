"""The attention problem: what a backend is asked to compute, as frozen, hashable data.

An ``AttentionProblem`` is built by the public API at plan time (never inside ``run()``) and is
what the selector matches against each backend's declared capabilities.  It holds only the
*kind* of problem (dtypes, heads, layout, features), never sizes that change every step
(batch size, sequence lengths), so one problem serves every layer and step of a model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

# Operations a backend may claim.  The fused ops (pod, batch_pod) are composed from their parts by
# the API when no backend claims them.
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
        d = f"d{self.head_dim_qk}" if self.head_dim_qk == self.head_dim_vo else (
            f"d{self.head_dim_qk}x{self.head_dim_vo}")
        parts += [d, f"{self.num_qo_heads}/{self.num_kv_heads}"]
        if self.page_size is not None:
            parts.append(f"p{self.page_size}")
        parts += [self.kv_layout, self.mask]
        if self.q_len_per_req != 1:
            parts.append(f"qlen{self.q_len_per_req}")
        parts += sorted(self.features)
        return " ".join(parts)


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


def device_info(device: torch.device) -> Tuple[str, Optional[Tuple[int, int]]]:
    """(device type, compute capability or None) of a torch device."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda", tuple(torch.cuda.get_device_capability(device))
    return device.type, None
