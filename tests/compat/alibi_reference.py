"""``alibi_reference`` for FlashInfer's ALiBi test run through the attncore shim (the sdist does not
ship one).  Written for attncore from the definition of ALiBi; no FlashInfer code.

``alibi_attention(q, k, v, mask)`` is dense attention with an ALiBi bias:

* q ``[qo_len, Hq, D]``, k and v ``[kv_len, Hkv, D]`` (``Hq`` a multiple of ``Hkv``: grouped-query
  heads share a KV head), mask bool ``[qo_len, kv_len]`` with True = the key is visible;
* logit ``s[h, i, j] = (q_i . k_j) * sm_scale + slope[h] * (j - i)``, ``sm_scale = 1/sqrt(D)``;
* slopes (Press et al.): with ``n`` the largest power of two <= ``Hq``, head ``h < n`` gets
  ``2**(-8 (h+1) / n)``; the remaining heads take every other slope of the ``2n`` sequence,
  ``2**(-4 (2m+1) / n)`` for ``m = 0, 1, ...``;
* softmax over the visible keys, then the weighted sum of V; a row that sees no key gives zeros.

The bias is relative to the query's row, so it differs from a bias on absolute positions only by a
constant per row, which softmax cancels: the output is the same for any alignment of q to the keys.
Computed in float64 on the inputs' device; returns ``[qo_len, Hq, D]`` in q's dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """float64 ``[num_heads]`` ALiBi slopes."""
    n = 1 << (num_heads.bit_length() - 1)  # largest power of two <= num_heads
    slopes = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    slopes += [2.0 ** (-4.0 * (2 * m + 1) / n) for m in range(num_heads - n)]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    sm_scale: Optional[float] = None) -> torch.Tensor:
    qo_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"alibi_attention: {hq} query heads is not a multiple of {hkv} KV heads")
    if tuple(mask.shape) != (qo_len, kv_len):
        raise ValueError(f"alibi_attention: mask has shape {tuple(mask.shape)}, expected {(qo_len, kv_len)}")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    dev = q.device
    qf = q.to(torch.float64)
    kf = k.to(torch.float64).repeat_interleave(hq // hkv, dim=1)
    vf = v.to(torch.float64).repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("ihd,jhd->hij", qf, kf) * scale
    rel = (torch.arange(kv_len, device=dev)[None, :] - torch.arange(qo_len, device=dev)[:, None]).to(torch.float64)
    logits = logits + alibi_slopes(hq).to(dev)[:, None, None] * rel[None]
    keep = mask.to(device=dev, dtype=torch.bool)[None]
    logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows that see no key: all -inf -> NaN -> 0
    out = torch.einsum("hij,jhd->ihd", probs, vf)
    return out.to(q.dtype)
