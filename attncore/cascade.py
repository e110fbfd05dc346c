"""Merging partial attention states (FlashInfer-compatible ``flashinfer.cascade`` state merges).

An attention *state* over a set of keys is the pair ``(v, s)``: ``v`` the softmax-weighted sum of
values over those keys (the attention output) and ``s`` the base-2 log-sum-exp of the logits,
``s = logsumexp_e(logits) * log2(e)`` (``docs/semantics.md``). The state over the union of two
disjoint key sets is

    s = log2(2**s_a + 2**s_b),    v = (2**s_a * v_a + 2**s_b * v_b) / 2**s

An *empty* state (no key seen) has ``s = -inf``; its ``v`` is ignored (even NaN). Merging with an
empty state returns the other state unchanged; merging two empty states gives ``v = 0`` and
``s = -inf``. Results never contain NaN unless a non-empty input does.

All math is in float32; ``v`` is returned in the input dtype, ``s`` in float32. Plain torch ops on
the inputs' device.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]

_V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_v(v, name: str, ndim: int, form: str) -> None:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name}: got {type(v).__name__}; accepted: a torch.Tensor {form}")
    if v.dtype not in _V_DTYPES:
        raise TypeError(f"{name}: got dtype {v.dtype}; accepted: torch.float16, torch.bfloat16 or torch.float32")
    if v.dim() != ndim:
        raise ValueError(f"{name}: got shape {tuple(v.shape)}; accepted: a {ndim}-D tensor {form}")


def _check_s(s, name: str, v: torch.Tensor, v_name: str, form: str) -> None:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name}: got {type(s).__name__}; accepted: a torch.Tensor {form}")
    if s.dtype != torch.float32:
        raise TypeError(f"{name}: got dtype {s.dtype}; accepted: torch.float32 (base-2 LSE)")
    if tuple(s.shape) != tuple(v.shape[:-1]):
        raise ValueError(
            f"{name}: got shape {tuple(s.shape)}; accepted: {list(v.shape[:-1])} ({v_name}.shape[:-1])"
        )
    if s.device != v.device:
        raise ValueError(f"{name}: got device {s.device}; accepted: {v_name}'s device {v.device}")


def _check_pair(v_a, s_a, v_b, s_b, names) -> None:
    na, sa, nb, sb = names
    form = "[seq_len, num_heads, head_dim]"
    _check_v(v_a, na, 3, form)
    _check_v(v_b, nb, 3, form)
    if v_b.shape != v_a.shape:
        raise ValueError(f"{nb}: got shape {tuple(v_b.shape)}; accepted: {list(v_a.shape)} ({na}.shape)")
    if v_b.dtype != v_a.dtype:
        raise TypeError(f"{nb}: got dtype {v_b.dtype}; accepted: {v_a.dtype} ({na}.dtype)")
    if v_b.device != v_a.device:
        raise ValueError(f"{nb}: got device {v_b.device}; accepted: {na}'s device {v_a.device}")
    _check_s(s_a, sa, v_a, na, "[seq_len, num_heads]")
    _check_s(s_b, sb, v_b, nb, "[seq_len, num_heads]")


def _merge(v: torch.Tensor, s: torch.Tensor, dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge float32 states stacked along ``dim`` of ``s`` (``v`` has one more trailing dim)."""
    m = s.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # all-empty group: avoid -inf - -inf
    w = torch.exp2(s - m)  # 0 for an empty state, 1 for the largest
    total = w.sum(dim=dim, keepdim=True)
    wv = torch.where(w[..., None] > 0, v * w[..., None], torch.zeros_like(v))  # drop empty states' v
    out = wv.sum(dim=dim) / torch.where(total > 0, total, torch.ones_like(total)).squeeze(dim)[..., None]
    lse = (m + torch.log2(total)).squeeze(dim)  # log2(0) = -inf for an all-empty group
    return out, lse


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge the attention states of two disjoint sets of keys.

    Parameters
    ----------
    v_a : torch.Tensor
        ``[seq_len, num_heads, head_dim]``, float16/bfloat16/float32: attention output over keys A.
    s_a : torch.Tensor
        ``[seq_len, num_heads]`` float32: base-2 LSE over keys A (``-inf`` = no key).
    v_b : torch.Tensor
        Same shape, dtype and device as ``v_a``: attention output over keys B.
    s_b : torch.Tensor
        ``[seq_len, num_heads]`` float32: base-2 LSE over keys B.

    Returns
    -------
    v_merged : torch.Tensor
        ``[seq_len, num_heads, head_dim]`` in ``v_a.dtype``: attention output over A and B.
    s_merged : torch.Tensor
        ``[seq_len, num_heads]`` float32: base-2 LSE over A and B.

    Raises
    ------
    TypeError, ValueError
        Wrong type, dtype, shape or device.
    """
    _check_pair(v_a, s_a, v_b, s_b, ("v_a", "s_a", "v_b", "s_b"))
    v = torch.stack([v_a.float(), v_b.float()], dim=1)  # [seq, 2, H, D]
    s = torch.stack([s_a, s_b], dim=1)  # [seq, 2, H]
    out, lse = _merge(v, s, dim=1)
    return out.to(v_a.dtype), lse


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
) -> None:
    """Merge the state ``(v_other, s_other)`` into ``(v, s)`` in place.

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_heads, head_dim]``, float16/bfloat16/float32; overwritten with the merged
        output.
    s : torch.Tensor
        ``[seq_len, num_heads]`` float32 base-2 LSE; overwritten with the merged LSE.
    v_other : torch.Tensor
        Same shape, dtype and device as ``v``.
    s_other : torch.Tensor
        ``[seq_len, num_heads]`` float32.
    mask : torch.Tensor, optional
        ``[seq_len]`` bool or uint8 on ``v.device``: rows where it is False/0 are left unchanged.
        Default: merge every row.

    Returns
    -------
    None

    Raises
    ------
    TypeError, ValueError
        Wrong type, dtype, shape or device.
    """
    _check_pair(v, s, v_other, s_other, ("v", "s", "v_other", "s_other"))
    merged_v, merged_s = merge_state(v, s, v_other, s_other)
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask: got {type(mask).__name__}; accepted: None or a torch.Tensor [seq_len]")
        if mask.dtype not in (torch.bool, torch.uint8):
            raise TypeError(f"mask: got dtype {mask.dtype}; accepted: torch.bool or torch.uint8")
        if tuple(mask.shape) != (v.shape[0],):
            raise ValueError(f"mask: got shape {tuple(mask.shape)}; accepted: [{v.shape[0]}] ([seq_len])")
        if mask.device != v.device:
            raise ValueError(f"mask: got device {mask.device}; accepted: v's device {v.device}")
        keep = mask != 0
        merged_v = torch.where(keep[:, None, None], merged_v, v)
        merged_s = torch.where(keep[:, None], merged_s, s)
    v.copy_(merged_v)
    s.copy_(merged_s)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states of disjoint key sets, per row and head.

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_states, num_heads, head_dim]``, float16/bfloat16/float32.
    s : torch.Tensor
        ``[seq_len, num_states, num_heads]`` float32 base-2 LSEs (``-inf`` = empty state).

    Returns
    -------
    v_merged : torch.Tensor
        ``[seq_len, num_heads, head_dim]`` in ``v.dtype``.
    s_merged : torch.Tensor
        ``[seq_len, num_heads]`` float32. With ``num_states = 0`` (or all states empty) the result is
        ``v = 0``, ``s = -inf``.

    Raises
    ------
    TypeError, ValueError
        Wrong type, dtype, shape or device.
    """
    _check_v(v, "v", 4, "[seq_len, num_states, num_heads, head_dim]")
    _check_s(s, "s", v, "v", "[seq_len, num_states, num_heads]")
    seq, num_states, heads, dim = v.shape
    if num_states == 0:
        return (
            torch.zeros(seq, heads, dim, dtype=v.dtype, device=v.device),
            torch.full((seq, heads), float("-inf"), dtype=torch.float32, device=v.device),
        )
    out, lse = _merge(v.float(), s, dim=1)
    return out.to(v.dtype), lse
