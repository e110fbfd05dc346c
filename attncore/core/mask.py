"""Masks and position encodings as plain torch: the shared vocabulary of the reference backend,
the API's validation and the tests.

Conventions (semantics.md): causal is bottom-right aligned; the window keeps
``kv_idx >= pos_q - window_left`` with ``pos_q = kv_len - qo_len + row``; custom masks are bool,
True = keep, packed LSB-first per request.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """ALiBi slopes, float32 [num_heads] (geometric; extra heads interleaved as in the paper)."""
    n = 2 ** math.floor(math.log2(num_heads))
    m0 = 2.0 ** (-8.0 / n)
    slopes = torch.pow(torch.tensor(m0, dtype=torch.float64), torch.arange(1, n + 1, dtype=torch.float64))
    if n < num_heads:
        m1 = 2.0 ** (-4.0 / n)
        extra = torch.pow(torch.tensor(m1, dtype=torch.float64),
                          torch.arange(1, 2 * (num_heads - n), 2, dtype=torch.float64))
        slopes = torch.cat([slopes, extra])
    return slopes.to(device=device, dtype=torch.float32)


def rope_llama(x: torch.Tensor, pos: torch.Tensor, rope_theta: float = 1e4, rope_scale: float = 1.0) -> torch.Tensor:
    """Rotate-half (non-interleaved) RoPE over the full head dim, in float32.

    x: [n, H, D]; pos: [n] positions.  ``freq_i = rope_theta**(-2i/D) / rope_scale``.
    """
    d = x.shape[-1]
    half = d // 2
    inv = torch.pow(torch.tensor(float(rope_theta), dtype=torch.float64, device=x.device),
                    -2.0 * torch.arange(half, dtype=torch.float64, device=x.device) / d) / rope_scale
    ang = (pos.to(torch.float64)[:, None] * inv[None, :]).to(torch.float32)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = x.float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def causal_mask(qo_len: int, kv_len: int, device=None) -> torch.Tensor:
    """Bool [qo_len, kv_len], bottom-right aligned (``tril(ones, diagonal=kv-qo)``)."""
    return torch.ones(qo_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - qo_len)


def window_mask(qo_len: int, kv_len: int, window_left: int, device=None) -> torch.Tensor:
    """Bool [qo_len, kv_len]: key kept iff ``kv_idx >= pos_q - window_left`` (all kept if -1)."""
    keep = torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
    if window_left < 0:
        return keep
    return keep.triu(diagonal=kv_len - qo_len - window_left)


def build_mask(qo_len: int, kv_len: int, *, causal: bool = False, custom: Optional[torch.Tensor] = None,
               window_left: int = -1, device=None) -> torch.Tensor:
    """The full keep-mask of one request: custom (replaces causal) AND window."""
    if custom is not None:
        keep = custom.reshape(qo_len, kv_len).to(device=device, dtype=torch.bool)
    elif causal:
        keep = causal_mask(qo_len, kv_len, device)
    else:
        keep = torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
    if window_left >= 0:
        keep = keep & window_mask(qo_len, kv_len, window_left, device)
    return keep


def unpack_bits(packed: torch.Tensor, start_byte: int, num_bits: int) -> torch.Tensor:
    """Bool [num_bits] from LSB-first bytes ``packed[start_byte:]``."""
    nbytes = (num_bits + 7) // 8
    b = packed[start_byte:start_byte + nbytes].to(torch.int32)
    bits = (b[:, None] >> torch.arange(8, device=packed.device, dtype=torch.int32)[None, :]) & 1
    return bits.reshape(-1)[:num_bits].bool()


def spec_mask_rows(mask: torch.Tensor, req: int, q_len: int, kv_len: int) -> torch.Tensor:
    """xqa speculative-decoding mask of request ``req`` as bool [q_len, kv_len].

    ``mask`` is uint16 [B, q_len, ceil(q_len/32)*2]: bit j of row i (LSB-first in uint32 words
    viewed as uint16) lets draft row i see draft token j; the prefix ``kv_len - q_len`` is always
    visible.
    """
    words = mask[req].to(torch.int32) & 0xFFFF  # [q_len, n16]
    bits = (words[..., None] >> torch.arange(16, device=mask.device, dtype=torch.int32)) & 1
    draft = bits.reshape(q_len, -1)[:, :q_len].bool()
    prefix = torch.ones(q_len, max(kv_len - q_len, 0), dtype=torch.bool, device=mask.device)
    return torch.cat([prefix, draft[:, max(q_len - kv_len, 0):]], dim=1)


def pack_spec_mask(bits: torch.Tensor) -> torch.Tensor:
    """The inverse of ``spec_mask_rows`` for the draft part: bool [B, q_len, q_len] (row i may see
    draft token j) -> xqa's uint16 [B, q_len, ceil(q_len/32)*2] (LSB-first uint32 words as uint16)."""
    b, ql, _ = bits.shape
    words = torch.zeros(b, ql, -(-ql // 32) * 2, dtype=torch.int32, device=bits.device)
    for j in range(ql):
        words[:, :, j // 16] |= bits[:, :, j].to(torch.int32) << (j % 16)
    return words.to(torch.uint16)
