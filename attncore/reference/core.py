"""One request of attention in plain torch, float32, in chunks.

The score matrix is never materialised whole: keys are processed in chunks with an online
softmax, and query rows in blocks sized so one block's scores stay under ``SCORE_BUDGET``
elements, so a 32k-token prefill with 32 heads fits in memory.

Non-finite inputs (docs/semantics.md): keys no row of a block sees are zeroed before the math, so a
NaN left of the window never reaches a result; a NaN query row that sees a key gives NaN output and
LSE (NaN goes through the running max and the rescaling unchanged), one that sees none 0 and -inf.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from attncore.core.mask import rope_llama

SCORE_BUDGET = 1 << 24  # float32 score elements per block (64 MiB)
KV_CHUNK = 1024

MaskFn = Callable[[int, int, int, int], Optional[torch.Tensor]]  # (q0, q1, k0, k1) -> bool or None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask_fn: MaskFn,
    sm_scale: float,
    logits_soft_cap: float = 0.0,
    alibi: Optional[torch.Tensor] = None,
    rope: Optional[Tuple[float, float]] = None,
    sinks: Optional[torch.Tensor] = None,
    v_scale: float = 1.0,
    kv_chunk: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [qo, Hq, D], k [kv, Hkv, D], v [kv, Hkv, Dv] (NHD, any float dtype incl. fp8).

    mask_fn(q0, q1, k0, k1) returns the bool keep-mask of that block (None = all kept).
    alibi: float32 [Hq] slopes.  rope: (theta, scale).  sinks: float32 [Hq].
    Returns out float32 [qo, Hq, Dv] and lse float32 [qo, Hq] (base 2; -inf for rows that see no
    key, whose output is 0).
    """
    qo, hq, d = q.shape
    kv, hkv, dv = v.shape
    group = hq // hkv
    dev = q.device
    out = torch.zeros(qo, hq, dv, dtype=torch.float32, device=dev)
    lse = torch.full((qo, hq), float("-inf"), dtype=torch.float32, device=dev)
    if qo == 0:
        return out, lse
    kv_chunk = max(1, min(kv_chunk or KV_CHUNK, kv if kv > 0 else 1))
    q_block = max(1, min(qo, SCORE_BUDGET // max(1, hq * kv_chunk)))
    qf_all = q.float()
    if rope is not None:
        qf_all = rope_llama(qf_all, torch.arange(kv - qo, kv, device=dev), rope[0], rope[1])
    log2e = 1.0 / math.log(2.0)
    for q0 in range(0, qo, q_block):
        q1 = min(qo, q0 + q_block)
        # [Hkv, G, rows, D]: query heads of one KV group side by side, as GQA kernels pack them
        qf = qf_all[q0:q1].reshape(q1 - q0, hkv, group, d).permute(1, 2, 0, 3)
        m = torch.full((hkv, group, q1 - q0), float("-inf"), device=dev)
        l = torch.zeros((hkv, group, q1 - q0), device=dev)
        acc = torch.zeros((hkv, group, q1 - q0, dv), device=dev)
        seen = torch.zeros(q1 - q0, dtype=torch.bool, device=dev)
        for k0 in range(0, kv, kv_chunk):
            k1 = min(kv, k0 + kv_chunk)
            keep = mask_fn(q0, q1, k0, k1)
            if keep is not None and not bool(keep.any()):
                continue
            kf = k[k0:k1].float()
            vf = v[k0:k1].float()
            if keep is not None:
                # keys no row of this block sees (left of every row's window, hidden by the mask) are
                # zeroed: masking their logits is not enough, a NaN there would reach P @ V as 0 * NaN
                # (docs/semantics.md, "Non-finite inputs", rule 2)
                unseen = ~keep.any(dim=0)[:, None, None]
                kf, vf = kf.masked_fill(unseen, 0.0), vf.masked_fill(unseen, 0.0)
            if rope is not None:
                kf = rope_llama(kf, torch.arange(k0, k1, device=dev), rope[0], rope[1])
            kf = kf.permute(1, 0, 2)  # [Hkv, n, D]
            vf = vf.permute(1, 0, 2)
            s = torch.einsum("hgqd,hkd->hgqk", qf, kf) * sm_scale
            if logits_soft_cap > 0:
                s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
            if alibi is not None:
                rel = (torch.arange(k0, k1, device=dev)[None, :] - torch.arange(q0, q1, device=dev)[:, None]).float()
                s = s + alibi.reshape(hkv, group, 1, 1) * rel
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
                seen |= keep.any(dim=1)
            else:
                seen[:] = True
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(dim=-1)
            acc = acc * corr[..., None] + torch.einsum("hgqk,hkd->hgqd", p, vf)
            m = m_new
        if sinks is not None:
            sink = sinks.float().reshape(hkv, group, 1).expand_as(m)
            m_new = torch.maximum(m, sink)
            corr = torch.exp(m - m_new)
            l = l * corr + torch.exp(sink - m_new)
            acc = acc * corr[..., None]
            m = m_new
        l_safe = torch.where(l > 0, l, torch.ones_like(l))
        o = acc / l_safe[..., None] * v_scale
        row_lse = (m + torch.log(l_safe)) * log2e
        o = torch.where(seen[None, None, :, None], o, torch.zeros_like(o))
        row_lse = torch.where(seen[None, None, :], row_lse, torch.full_like(row_lse, float("-inf")))
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(q1 - q0, hq, dv)
        lse[q0:q1] = row_lse.permute(2, 0, 1).reshape(q1 - q0, hq)
    return out, lse
