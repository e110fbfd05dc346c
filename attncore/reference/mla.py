"""Paged MLA in plain torch: the reference of ``attncore.mla`` (its CPU fallback in float32, the fp64
golden of its tests).

Per request ``b`` (query tokens ``qo_indptr[b]:qo_indptr[b+1]``, ``kv_lens[b]`` keys in the pages
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``): scores ``sm_scale * (q_nope . ckv + q_pe . kpe)`` for every
query head against the one latent KV head, causal bottom-right aligned when asked, softmax, output
``P @ ckv``; LSE base 2.  A row that sees no key gives output 0 and LSE ``-inf`` (docs/semantics.md).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch


def gather_request(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, pages: torch.Tensor,
                   kv_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``kv_len`` keys of a request whose page ids are ``pages``: (ckv [kv_len, Dc], kpe [kv_len, Dp])."""
    page_size = ckv_cache.shape[1]
    pages = pages.to(device=ckv_cache.device, dtype=torch.long)
    ckv = ckv_cache[pages].reshape(-1, ckv_cache.shape[2])[:kv_len]
    kpe = kpe_cache[pages].reshape(-1, kpe_cache.shape[2])[:kv_len]
    if ckv.shape[0] != kv_len:
        raise ValueError(f"kv_len_arr: a request of {kv_len} keys has only {pages.numel()} pages of {page_size}")
    return ckv, kpe


def mla_request(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, *, causal: bool,
                sm_scale: float, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """One request in ``dtype`` (float32 or float64): q_nope [qo, H, Dc], q_pe [qo, H, Dp], ckv [kv, Dc],
    kpe [kv, Dp] -> (out [qo, H, Dc], lse [qo, H] base 2), both in ``dtype``."""
    qo, h, dc = q_nope.shape
    kv = ckv.shape[0]
    qn, qp, c, p = (x.to(dtype) for x in (q_nope, q_pe, ckv, kpe))
    s = (torch.einsum("qhd,kd->hqk", qn, c) + torch.einsum("qhd,kd->hqk", qp, p)) * sm_scale
    keep = torch.ones(qo, kv, dtype=torch.bool, device=s.device)
    if causal:
        keep = torch.arange(kv, device=s.device)[None, :] <= (torch.arange(qo, device=s.device) + (kv - qo))[:, None]
    s = s.masked_fill(~keep[None], float("-inf"))
    lse_e = torch.logsumexp(s, dim=-1)  # [h, qo]; -inf where nothing is seen
    seen = keep.any(dim=1)[None, :].expand(h, qo)
    prob = torch.where(seen[..., None], torch.exp(s - torch.where(seen, lse_e, 0.0)[..., None]), 0.0)
    out = torch.einsum("hqk,kd->qhd", prob, c)
    lse = torch.where(seen, lse_e / math.log(2.0), float("-inf")).transpose(0, 1)
    return out, lse.contiguous()


def mla_paged(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, *,
              qo_indptr: List[int], kv_indptr: List[int], kv_indices: torch.Tensor, kv_lens: List[int], causal: bool,
              sm_scale: float, dtype: torch.dtype = torch.float64, out: Optional[torch.Tensor] = None,
              lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A batch (index arrays as host int lists, ``kv_indices`` a tensor).  Returns (out, lse) in ``dtype`` on
    q's device; when ``out``/``lse`` are given the results are written into them (cast) instead."""
    nnz, h, dc = q_nope.shape
    o = torch.zeros(nnz, h, dc, dtype=dtype, device=q_nope.device)
    ls = torch.full((nnz, h), float("-inf"), dtype=dtype, device=q_nope.device)
    for b in range(len(qo_indptr) - 1):
        q0, q1 = qo_indptr[b], qo_indptr[b + 1]
        if q1 == q0:
            continue
        ckv, kpe = gather_request(ckv_cache, kpe_cache, kv_indices[kv_indptr[b]:kv_indptr[b + 1]], kv_lens[b])
        o[q0:q1], ls[q0:q1] = mla_request(q_nope[q0:q1], q_pe[q0:q1], ckv, kpe, causal=causal, sm_scale=sm_scale,
                                          dtype=dtype)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(ls)
        ls = lse
    return o, ls
