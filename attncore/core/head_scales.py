"""Per-head ``scale_q`` / ``scale_k`` / ``scale_v`` (FlashInfer 0.2.14's single prefill with fp8 tensors
quantized per head): softmax(sm_scale * (q*s_q[h]) . (k*s_k[hk])) @ (v*s_v[hk]), ``hk = h // group``.

Backends take one scale per tensor (``RunArgs.q_scale/k_scale/v_scale``); per-head values are folded
around them, here, once (docs/semantics.md, "FP8 and scales"):

* **q and k**: ``fold[h] = s_q[h] * s_k[h // group] / c`` multiplies q before the backend sees it, and
  the backend gets ``q_scale = 1``, ``k_scale = c``.  ``c`` is the power of two nearest the largest
  k scale: the folded q then has the magnitude of the dequantized q (folding a scale like 57344^-1
  into q would push an fp16 q into subnormals), and dividing by it is exact.  The fold is computed in
  fp64, where it is exact for an fp8 q (a 4-bit significand times the 48-bit product of two fp32
  scales), and the folded q is rounded to the compute dtype once, into the plan's upcast buffer
  (``attncore.core.fp8_query``); a 16/32-bit q is folded the same way (its fp64 product may round at
  2^-53 first).
* **v**: the backend gets ``v_scale = 1`` and the output is multiplied per head after it ran, in fp64
  (exact: a 16-bit value times an fp32 scale), rounded once to the output dtype, in place (``out=``
  included).  The LSE does not depend on v.  An fp8 output is refused: it would be rounded to fp8 twice.
* A per-head tensor whose entries are all equal is one per-tensor scale: today's path, no extra pass.

PyTorch converts fp64 to fp16/bf16 through fp32, so "rounded once" can be one ulp off the correctly
rounded value when the fp32 step lands on a tie; the tolerance rule's atol covers an ulp.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

from attncore.core import params as _params
from attncore.core.problem import FP8_DTYPES, dtype_name


@dataclasses.dataclass(frozen=True)
class HeadScales:
    """What a plan applies around the backend: ``q_fold`` (fp64 ``[num_qo_heads]``, multiplies q) and
    ``o_heads`` (fp64 ``[num_qo_heads]``, multiplies the output); either may be None."""
    q_fold: Optional[torch.Tensor]
    o_heads: Optional[torch.Tensor]


def _check(name: str, value, heads: int, what: str, device: torch.device):
    """A multi-element scale tensor, checked: returns None when all its entries are equal (the caller keeps
    its first element, a per-tensor scale), else its values as fp64 ``[heads]`` on ``device``."""
    if value.dtype not in _params._SCALE_DTYPES:
        _params.scale(name, value)  # raises the one scale rule's TypeError (the dtype is checked first)
    if value.dim() != 1 or value.shape[0] != heads:
        raise ValueError(f"{name}: got a tensor of shape {list(value.shape)}, expected [{what}] = [{heads}] "
                         f"(one scale per head) or 1 element")
    if value.device.type != "cpu" and value.device != device:
        raise ValueError(f"{name}: got a tensor on {value.device}, expected one on q's device ({device}) or the CPU")
    vals = value.tolist()  # one host read (the per-tensor path reads its scale with .item() as well)
    for i, x in enumerate(vals):
        _params.scale(f"{name}[{i}]", x)  # finite and > 0, the message naming the entry
    if all(x == vals[0] for x in vals):
        return None
    return torch.tensor(vals, dtype=torch.float64).to(device)


def _pow2(x: float) -> float:
    return 2.0 ** round(math.log2(x))


def split(names: Tuple[str, str, str], scales: tuple, *, num_qo_heads: int, num_kv_heads: int,
          device: torch.device, out_dtype: torch.dtype):
    """``scales`` (q, k, v: None, a float or a tensor) as (HeadScales or None, q_scale, k_scale, v_scale) for the
    backend.  ``names``: how the caller spelled the three arguments (for the messages).  HeadScales is None
    when no tensor holds differing values: the scales are then returned as given (a tensor whose entries are
    all equal as its first element), for the per-tensor path."""
    group = num_qo_heads // num_kv_heads
    per_head = []
    out = list(scales)
    for i, (name, value, heads, what) in enumerate(zip(names, scales, (num_qo_heads, num_kv_heads, num_kv_heads),
                                                       ("num_qo_heads", "num_kv_heads", "num_kv_heads"))):
        t = None
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            t = _check(name, value, heads, what, device)
            if t is None:
                out[i] = value.reshape(-1)[:1]
        per_head.append(t)
    sq, sk, sv = per_head
    if sq is None and sk is None and sv is None:
        return None, out[0], out[1], out[2]
    q_fold = o_heads = None
    q_scale, k_scale, v_scale = out
    if sq is not None or sk is not None:
        qs = sq if sq is not None else _params.scale(names[0], q_scale)
        ks = sk.repeat_interleave(group) if sk is not None else _params.scale(names[1], k_scale)
        c = _pow2(float(sk.max()) if sk is not None else ks)
        q_fold = (torch.as_tensor(qs, dtype=torch.float64) * ks / c).expand(num_qo_heads).to(device).contiguous()
        q_scale, k_scale = 1.0, c
    if sv is not None:
        if out_dtype in FP8_DTYPES:
            raise ValueError(f"{names[2]}: a per-head v scale is applied to the output after the kernel, and an "
                             f"{dtype_name(out_dtype)} output would be rounded twice; pass o_dtype=torch.float16 "
                             f"or torch.bfloat16")
        o_heads = sv.repeat_interleave(group)
        v_scale = 1.0
    return HeadScales(q_fold, o_heads), q_scale, k_scale, v_scale


#: elements per fp64 temporary (32 MiB): long prompts are processed in row chunks, not one 8-byte copy
CHUNK = 1 << 22


def _rows(x: torch.Tensor):
    """Row ranges of ``x`` ``[rows, heads, dim]`` of at most CHUNK elements (at least one row)."""
    step = max(1, CHUNK // max(1, x[0].numel())) if x.shape[0] else 1
    return ((i, min(i + step, x.shape[0])) for i in range(0, x.shape[0], step))


def fold_q(buf: torch.Tensor, q: torch.Tensor, fold: torch.Tensor) -> None:
    """``buf = q * fold[h]``: exact in fp64 for an fp8 q, rounded once to ``buf``'s dtype."""
    f = fold[:, None]
    for a, b in _rows(q):
        buf[a:b].copy_(q[a:b].to(torch.float64).mul_(f))


def scale_out(out: torch.Tensor, o_heads: torch.Tensor) -> None:
    """``out[:, h] *= o_heads[h]`` in place: exact in fp64, rounded once to ``out``'s dtype."""
    f = o_heads[:, None]
    for a, b in _rows(out):
        out[a:b].copy_(out[a:b].to(torch.float64).mul_(f))
