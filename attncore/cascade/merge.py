"""Merging partial attention states (FlashInfer-compatible ``flashinfer.cascade`` state merges).

An attention *state* over a set of keys is the pair ``(v, s)``: ``v`` the softmax-weighted sum of
values over those keys (the attention output) and ``s`` the base-2 log-sum-exp of the logits,
``s = logsumexp_e(logits) * log2(e)`` (``docs/semantics.md``). The state over the union of two
disjoint key sets is

    s = log2(2**s_a + 2**s_b),    v = (2**s_a * v_a + 2**s_b * v_b) / 2**s

An *empty* state (no key seen) has ``s = -inf``; its ``v`` is ignored (even NaN). Merging with an
empty state returns the other state unchanged; merging two empty states gives ``v = 0`` and
``s = -inf``. Results never contain NaN unless a non-empty input does: a NaN in the ``v`` of a
non-empty state makes those elements of the merged ``v`` NaN, and a NaN LSE (or ``+inf``, which is no
LSE of finite logits) makes the merged ``v`` and ``s`` of that row and head NaN, so that a NaN query row
stays NaN through a merge (``docs/semantics.md``, "Non-finite inputs", rule 3).

All math is in float32; ``v`` is returned in the input dtype, ``s`` in float32.

Fused kernel: the merges run as one Triton launch (``attncore.kernels.merge_states``) on CUDA tensors, and on
CPU tensors through Triton's CPU interpreter when it is on (``TRITON_INTERPRET=1`` when the kernel is
first used; attncore switches it on itself on a machine without a CUDA GPU, as for the triton
backend). Plain torch ops serve instead where the kernel cannot run: no Triton, CPU tensors in a
process whose kernel was compiled for the GPU (or CUDA tensors under the interpreter), other devices,
and inside ``torch.compile`` (the merges then trace as torch ops). Both paths compute the same
formula term for term (kernel docstring); they may differ by float32 rounding only.

The cascade wrappers built on these merges live beside this module, in :mod:`attncore.cascade.wrappers`.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from attncore.kernels import interpreted

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
    # total is 0 only for an all-empty group (v 0); NaN when an LSE is NaN or +inf (v NaN, as the LSE)
    out = wv.sum(dim=dim) / torch.where(total == 0, torch.ones_like(total), total).squeeze(dim)[..., None]
    lse = (m + torch.log2(total)).squeeze(dim)  # log2(0) = -inf for an all-empty group
    return out, lse


# --------------------------------------------------------------------------------------------------
# the fused kernel (attncore.kernels.merge_states)
# --------------------------------------------------------------------------------------------------
_KERNEL = []  # [kernel or None], filled on first use


def _kernel():
    """The Triton merge kernel, or None without Triton. Importing it decorates it: on a machine without
    a CUDA GPU, ``TRITON_INTERPRET=1`` is set first (unless the environment says otherwise)."""
    if not _KERNEL:
        try:
            if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
                os.environ["TRITON_INTERPRET"] = "1"
            from attncore.kernels.merge_states import merge_states_kernel
        except Exception:  # no (working) Triton: the torch path serves
            merge_states_kernel = None
        _KERNEL.append(merge_states_kernel)
    return _KERNEL[0]


def fused_merge_available(device) -> bool:
    """Whether the merges on ``device`` run the fused Triton kernel (compiled on CUDA, interpreted on
    the CPU) rather than the torch fallback."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return False
    if torch.compiler.is_compiling():
        return False
    kernel = _kernel()
    if kernel is None:
        return False
    return interpreted(kernel) == (device.type == "cpu")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch(v, s, out, lse, *, v_b=None, s_b=None, mask=None) -> None:
    """Merge the states stacked in ``v [rows, n, H, D]`` / ``s [rows, n, H]`` (and ``(v_b, s_b)`` when
    given, ``[rows, H, D]`` / ``[rows, H]``) into ``out [rows, H, D]`` / ``lse [rows, H]`` float32, in one
    launch; rows with ``mask[row] == 0`` are left as they are. Any strides; no checks (callers check)."""
    kernel = _kernel()
    rows, n, heads, dim = v.shape
    lanes = rows * heads
    if lanes == 0:
        return
    interp = interpreted(kernel)
    target = out
    if interp and out.dtype == torch.bfloat16:
        # Triton's CPU interpreter rounds bfloat16 stores wrongly: store float32, round with torch
        target = out.float() if mask is not None else torch.empty(out.shape, dtype=torch.float32,
                                                                   device=out.device)
    block_d = max(16, _next_pow2(dim))
    budget = 8192 if interp else 2048  # elements of the [BLOCK_M, BLOCK_D] accumulator
    block_m = max(1, min(_next_pow2(lanes), budget // block_d))
    has_b = v_b is not None
    if mask is not None:
        mask = mask.contiguous()
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
    vb, sb = (v_b, s_b) if has_b else (v, s)  # unused pointers when not has_b
    grid = (-(-lanes // block_m),)
    args = (
        v, s, vb, sb, target, lse, mask if mask is not None else s,
        lanes, heads, dim, n,
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        s.stride(0), s.stride(1), s.stride(2),
        vb.stride(0), vb.stride(-2) if has_b else 0, vb.stride(-1) if has_b else 0,
        sb.stride(0), sb.stride(-1) if has_b else 0,
        target.stride(0), target.stride(1), target.stride(2),
        lse.stride(0), lse.stride(1),
    )
    meta = dict(BLOCK_M=block_m, BLOCK_D=block_d, HAS_B=has_b, HAS_MASK=mask is not None)
    if out.device.type == "cuda":
        with torch.cuda.device(out.device):
            kernel[grid](*args, **meta, num_warps=4)
    else:  # Triton's interpreter runs numpy on the lanes: -inf - -inf and log2(0) are expected there
        import numpy as np

        with np.errstate(all="ignore"):
            kernel[grid](*args, **meta)
    if target is not out:
        out.copy_(target)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _merge_stacked(v: torch.Tensor, s: torch.Tensor, out: Optional[torch.Tensor] = None,
                   lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``v [rows, n, H, D]`` / ``s [rows, n, H]`` (checked) into ``out`` / ``lse`` (allocated when
    None; ``out`` in ``v.dtype`` unless given): the fused kernel where it runs, else torch."""
    rows, n, heads, dim = v.shape
    if out is None:
        out = torch.empty(rows, heads, dim, dtype=v.dtype, device=v.device)
    if lse is None:
        lse = torch.empty(rows, heads, dtype=torch.float32, device=v.device)
    if n == 0:
        out.zero_()
        lse.fill_(float("-inf"))
    elif fused_merge_available(v.device):
        _launch(v, s, out, lse)
    else:
        o, l_ = _merge(v.float(), s, dim=1)
        out.copy_(o)
        lse.copy_(l_)
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
    if fused_merge_available(v_a.device):
        out = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
        lse = torch.empty(s_a.shape, dtype=torch.float32, device=v_a.device)
        _launch(v_a[:, None], s_a[:, None], out, lse, v_b=v_b, s_b=s_b)
        return out, lse
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
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask: got {type(mask).__name__}; accepted: None or a torch.Tensor [seq_len]")
        if mask.dtype not in (torch.bool, torch.uint8):
            raise TypeError(f"mask: got dtype {mask.dtype}; accepted: torch.bool or torch.uint8")
        if tuple(mask.shape) != (v.shape[0],):
            raise ValueError(f"mask: got shape {tuple(mask.shape)}; accepted: [{v.shape[0]}] ([seq_len])")
        if mask.device != v.device:
            raise ValueError(f"mask: got device {mask.device}; accepted: v's device {v.device}")
    if fused_merge_available(v.device):  # one launch, written in place (masked-off rows untouched)
        if _shares_memory(v_other, v) or _shares_memory(s_other, s):  # the other state may be overwritten
            v_other, s_other = v_other.clone(), s_other.clone()
        _launch(v[:, None], s[:, None], v, s, v_b=v_other, s_b=s_other, mask=mask)
        return
    merged_v, merged_s = merge_state(v, s, v_other, s_other)
    if mask is not None:
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
    if fused_merge_available(v.device):
        return _merge_stacked(v, s)
    out, lse = _merge(v.float(), s, dim=1)
    return out.to(v.dtype), lse
