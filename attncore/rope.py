"""Rotary position embeddings applied to q and k (FlashInfer 0.2.14's ``flashinfer.rope``), as a Triton
kernel (``attncore.kernels.rope``; on a machine without a CUDA GPU it runs through Triton's CPU
interpreter, which is switched on as for the triton backend).

Layout: ``q [nnz, Hq, D]`` and ``k [nnz, Hk, D]`` (any strides; Hq and Hk may differ), token ``t`` of
both at position ``pos[t]``:

* ``pos_ids[nnz]`` directly, or the ragged form: ``indptr[B+1]`` (CSR over the tokens,
  ``indptr[0] = 0``, ``indptr[-1] = nnz``) and ``offsets[B]``: the tokens
  ``indptr[b] <= t < indptr[b+1]`` of request ``b`` are at ``offsets[b] + t - indptr[b]``.
* Only the first ``rotary_dim`` elements of the head dim (default: all) are rotated; the rest are
  passed through.  Pair ``i < rotary_dim / 2`` is ``(i, i + rotary_dim / 2)`` (``interleave=False``,
  rotate-half / neox) or ``(2i, 2i + 1)`` (``interleave=True``, GPT-J), rotated by the angle
  ``pos * freq_i``: ``(a, b) -> (a cos - b sin, b cos + a sin)``.
* ``freq_i = rope_theta ** (-2i / rotary_dim) / rope_scale`` (:func:`rope_inv_freq`); the Llama 3.1
  variants divide by ``rope_scale`` only the low frequencies: with
  ``s = clamp((old_context_len * f / (2 pi) - low_freq_factor) / (high_freq_factor - low_freq_factor), 0, 1)``
  for the unscaled ``f = rope_theta ** (-2i / rotary_dim)``, ``freq_i = (1 - s) f / rope_scale + s f``.
* ``apply_rope_with_cos_sin_cache``: vLLM/SGLang's form: ``query [nnz, Hq * head_size]``,
  ``key [nnz, Hk * head_size]``, ``cos_sin_cache [max_pos, rotary_dim]`` float32 (cos in the first
  half of a row, sin in the second), ``is_neox=True`` is ``interleave=False``.

Computed in float32; outputs have the inputs' dtype (float16, bfloat16 on CUDA, float32).  The
out-of-place functions return ``(q_rope, k_rope)``; the ``_inplace`` ones overwrite q and k and
return None.  Bad input raises a ``ValueError``/``TypeError`` naming the argument (value checks on
index tensors are skipped during CUDA-graph capture, as in :mod:`attncore.page`).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from attncore.core import params as _params
from attncore.kernels import check_interpreted
from attncore.page.checks import _check_indptr, _check_values, _same_device, _tensor

__all__ = [
    "apply_llama31_rope",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_inplace",
    "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "rope_inv_freq",
]

_INDEX_DTYPES = (torch.int32, torch.int64)
_QK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------------
# frequencies
# --------------------------------------------------------------------------------------------------


def rope_inv_freq(rotary_dim: int, rope_theta: float = 1e4, rope_scale: float = 1.0, *,
                  llama31: Optional[Tuple[float, float, float]] = None, device=None) -> torch.Tensor:
    """float32 ``[rotary_dim // 2]``: ``freq_i = rope_theta ** (-2i / rotary_dim) / rope_scale`` (the
    formula of ``attncore.core.mask.rope_llama``, computed in float64), or, with
    ``llama31=(low_freq_factor, high_freq_factor, old_context_len)``, Llama 3.1's smoothed frequencies
    (module docstring).  Computed on ``device`` without host copies (CUDA-graph capturable)."""
    i = torch.arange(rotary_dim // 2, dtype=torch.float64, device=device)
    f = torch.pow(float(rope_theta), -2.0 * i / rotary_dim)
    if llama31 is None:
        return (f / rope_scale).to(torch.float32)
    low, high, old = llama31
    s = ((old / (2.0 * math.pi)) * f - low) / (high - low)
    s = s.clamp(0.0, 1.0)
    return ((1.0 - s) * (f / rope_scale) + s * f).to(torch.float32)


_INV_FREQ: dict = {}  # _inv_freq's tensors: (rotary_dim, theta, scale, llama31, device) -> frequencies


def _inv_freq(rotary_dim: int, theta: float, scale: float, llama31, device) -> torch.Tensor:
    """:func:`rope_inv_freq`, kept per arguments and device: a model applies RoPE on every layer with the
    same ones (five device ops a call saved).  Nothing is kept from inside CUDA-graph capture (a tensor
    made there holds its values only once the graph replays) or a torch.compile trace."""
    key = (rotary_dim, theta, scale, llama31, device)  # device: a tensor's, always a torch.device
    inv = _INV_FREQ.get(key)
    if inv is None:
        if not _check_values() or torch.compiler.is_compiling():
            return rope_inv_freq(rotary_dim, theta, scale, llama31=llama31, device=device)
        # computed on the host and copied with a wait (a blocking copy): ready for a launch on any stream
        inv = rope_inv_freq(rotary_dim, theta, scale, llama31=llama31).to(device)
        if len(_INV_FREQ) >= 64:
            _INV_FREQ.clear()
        _INV_FREQ[key] = inv
    return inv


# --------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------


def _check_qk(q, k, q_name: str = "q", k_name: str = "k") -> None:
    _tensor(q, q_name, 3, None, "[nnz, num_q_heads, head_dim]")
    _tensor(k, k_name, 3, None, "[nnz, num_k_heads, head_dim]")
    if q.dtype not in _QK_DTYPES:
        raise TypeError(f"{q_name}: got dtype {q.dtype}; accepted: torch.float16, torch.bfloat16 or torch.float32")
    if k.dtype != q.dtype:
        raise TypeError(f"{k_name}: got dtype {k.dtype}; accepted: {q_name}'s dtype {q.dtype}")
    _same_device(q, q_name, **{k_name: k})
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{k_name}: got {k.shape[0]} tokens (shape {tuple(k.shape)}); accepted: "
                         f"{q_name}'s {q.shape[0]} (shape {tuple(q.shape)})")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{k_name}: got head_dim {k.shape[2]} (shape {tuple(k.shape)}); accepted: "
                         f"{q_name}'s head_dim {q.shape[2]}")


def _check_rotary_dim(rotary_dim, head_dim: int, name: str = "rotary_dim") -> int:
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise TypeError(f"{name}: got {type(rotary_dim).__name__} {rotary_dim!r}; accepted: None or an int")
    rotary_dim = int(rotary_dim)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"{name}: got {rotary_dim}; accepted: an even int with 2 <= {name} <= head_dim = {head_dim}")
    return rotary_dim


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{name}: got {type(value).__name__} {value!r}; accepted: a bool")
    return bool(value)


def _rope_param(name: str, value, default: float) -> float:
    return _params.rope(name, default if value is None else value)


def _llama31_params(low_freq_factor, high_freq_factor, old_context_len) -> Tuple[float, float, float]:
    low = _params._positive("low_freq_factor", low_freq_factor, "a finite number > 0")
    high = _params._positive("high_freq_factor", high_freq_factor, "a finite number > 0")
    old = _params._positive("old_context_len", old_context_len, "a finite number > 0")
    if high <= low:
        raise ValueError(f"high_freq_factor: got {high_freq_factor!r} with low_freq_factor = {low_freq_factor!r}; "
                         "accepted: high_freq_factor > low_freq_factor")
    return low, high, old


def _check_pos_ids(pos_ids, nnz: int, ref: torch.Tensor, name: str = "pos_ids") -> None:
    _tensor(pos_ids, name, 1, _INDEX_DTYPES, "[nnz]")
    if pos_ids.shape[0] != nnz:
        raise ValueError(f"{name}: got {pos_ids.shape[0]} positions (shape {tuple(pos_ids.shape)}); "
                         f"accepted: one per token, nnz = {nnz}")
    _same_device(ref, "q", **{name: pos_ids})


def _check_ragged(indptr, offsets, nnz: int, ref: torch.Tensor) -> None:
    _check_indptr(indptr, "indptr", nnz, "nnz")
    _tensor(offsets, "offsets", 1, _INDEX_DTYPES, "[batch_size]")
    _same_device(ref, "q", indptr=indptr, offsets=offsets)
    if offsets.shape[0] != indptr.shape[0] - 1:
        raise ValueError(f"offsets: got shape {tuple(offsets.shape)}; accepted: [batch_size] = "
                         f"[{indptr.shape[0] - 1}] (indptr has batch_size + 1 = {indptr.shape[0]} entries)")
    if _check_values() and indptr.numel():
        last = int(indptr[-1])
        if last != nnz:
            raise ValueError(f"indptr: got indptr[-1] = {last}; accepted: indptr[-1] == nnz = {nnz} "
                             "(every token belongs to a request)")


# --------------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------------


def _kernel():
    global _rope_kernel
    if _rope_kernel is None:  # imported once (host time: a model calls RoPE on every layer)
        from attncore.backends.triton.plugin import _maybe_enable_interpreter

        _maybe_enable_interpreter()  # before the kernel module is first imported (decorated)
        from attncore.kernels.rope import rope_kernel

        _rope_kernel = rope_kernel
    return _rope_kernel


_rope_kernel = None


def _launch(q, k, q_out, k_out, *, rotary_dim: int, interleave: bool, pos_ids=None, indptr=None,
            offsets=None, inv_freq=None, cos_sin=None) -> None:
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: got device {q.device}; accepted: cuda, or cpu through Triton's interpreter")
    kernel = _kernel()
    from attncore.kernels.launch import kept_launcher, launch_at

    interpreted = check_interpreted(kernel, q.device, "attncore.rope", "CPU tensors need TRITON_INTERPRET=1 and "
                                    "CUDA tensors need it unset before attncore's rope kernel is first used")
    if interpreted and q.dtype == torch.bfloat16:
        raise TypeError("q: got dtype torch.bfloat16 on the CPU; accepted there: torch.float16 or torch.float32 "
                        "(Triton's CPU interpreter rounds bfloat16 stores wrongly; bfloat16 runs on CUDA)")
    nnz = q.shape[0]
    if nnz == 0:
        return
    if rotary_dim < q.shape[2] and q_out is not q:  # the pass-through part of the out-of-place variants
        q_out[..., rotary_dim:].copy_(q[..., rotary_dim:])
        k_out[..., rotary_dim:].copy_(k[..., rotary_dim:])
    hq, hk = q.shape[1], k.shape[1]
    if hq + hk == 0:
        return
    ragged = indptr is not None
    batch_size = indptr.shape[0] - 1 if ragged else 0
    search_steps = (batch_size - 1).bit_length() if batch_size > 0 else 0
    half = rotary_dim // 2
    block_n = 64 if interpreted else 32
    strides = (*q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(),
               cos_sin.stride(0) if cos_sin is not None else 0)
    ptrs = (q, k, q_out, k_out, pos_ids, indptr, offsets, inv_freq, cos_sin)
    # the launcher of everything the compiled kernel is specialized on (dtypes, strides, head count, flags)
    key = (q.device, tuple(None if t is None else t.dtype for t in ptrs), strides, hq, half, bool(interleave))
    launch = kept_launcher(kernel, key, lambda: dict(
        HALF=half, BLOCK_N=block_n, BLOCK_P=max(2, 1 << (half - 1).bit_length()),
        INTERLEAVE=bool(interleave), RAGGED=ragged, USE_CACHE=cos_sin is not None))
    launch_at(launch, q.device, (_cdiv(nnz, block_n), hq + hk, 1), *ptrs, nnz, hq, batch_size, search_steps,
              *strides)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _computed(q, k, q_out, k_out, *, rotary_dim, interleave, rope_scale, rope_theta, scale_default,
              theta_default, llama31=None, pos_ids=None, indptr=None, offsets=None) -> None:
    """Checks shared by the computed-frequency variants (after q/k and the positions), then the launch."""
    rotary_dim = _check_rotary_dim(rotary_dim, q.shape[2])
    interleave = _check_bool(interleave, "interleave")
    scale = _rope_param("rope_scale", rope_scale, scale_default)
    theta = _rope_param("rope_theta", rope_theta, theta_default)
    if llama31 is not None:
        llama31 = _llama31_params(*llama31)
    inv = _inv_freq(rotary_dim, theta, scale, llama31, q.device)
    _launch(q, k, q_out, k_out, rotary_dim=rotary_dim, interleave=interleave, pos_ids=pos_ids,
            indptr=indptr, offsets=offsets, inv_freq=inv)


def _ragged(q, k, indptr, offsets, inplace: bool, **kw):
    _check_qk(q, k)
    _check_ragged(indptr, offsets, q.shape[0], q)
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    _computed(q, k, q_out, k_out, indptr=indptr, offsets=offsets, **kw)
    return None if inplace else (q_out, k_out)


def _by_pos_ids(q, k, pos_ids, inplace: bool, **kw):
    _check_qk(q, k)
    _check_pos_ids(pos_ids, q.shape[0], q)
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    _computed(q, k, q_out, k_out, pos_ids=pos_ids, **kw)
    return None if inplace else (q_out, k_out)


# --------------------------------------------------------------------------------------------------
# API (FlashInfer 0.2.14's names, positional order and defaults)
# --------------------------------------------------------------------------------------------------


def apply_rope(q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, offsets: torch.Tensor,
               rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 1,
               rope_theta: float = 1e4) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ragged q/k (positions ``offsets[b] + t - indptr[b]``); returns ``(q_rope, k_rope)``."""
    return _ragged(q, k, indptr, offsets, False, rotary_dim=rotary_dim, interleave=interleave,
                   rope_scale=rope_scale, rope_theta=rope_theta, scale_default=1.0, theta_default=1e4)


def apply_rope_inplace(q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, offsets: torch.Tensor,
                       rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 1,
                       rope_theta: float = 1e4) -> None:
    """:func:`apply_rope`, overwriting q and k."""
    return _ragged(q, k, indptr, offsets, True, rotary_dim=rotary_dim, interleave=interleave,
                   rope_scale=rope_scale, rope_theta=rope_theta, scale_default=1.0, theta_default=1e4)


def apply_rope_pos_ids(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, rotary_dim: Optional[int] = None,
                       interleave: bool = False, rope_scale: float = 1,
                       rope_theta: float = 1e4) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE with token ``t`` at ``pos_ids[t]``; returns ``(q_rope, k_rope)``."""
    return _by_pos_ids(q, k, pos_ids, False, rotary_dim=rotary_dim, interleave=interleave,
                       rope_scale=rope_scale, rope_theta=rope_theta, scale_default=1.0, theta_default=1e4)


def apply_rope_pos_ids_inplace(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                               rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 1,
                               rope_theta: float = 1e4) -> None:
    """:func:`apply_rope_pos_ids`, overwriting q and k."""
    return _by_pos_ids(q, k, pos_ids, True, rotary_dim=rotary_dim, interleave=interleave,
                       rope_scale=rope_scale, rope_theta=rope_theta, scale_default=1.0, theta_default=1e4)


def apply_llama31_rope(q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, offsets: torch.Tensor,
                       rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 8,
                       rope_theta: float = 5e5, low_freq_factor: float = 1, high_freq_factor: float = 4,
                       old_context_len: int = 8192) -> Tuple[torch.Tensor, torch.Tensor]:
    """Llama 3.1 RoPE (smoothed frequencies) on ragged q/k; returns ``(q_rope, k_rope)``."""
    return _ragged(q, k, indptr, offsets, False, rotary_dim=rotary_dim, interleave=interleave,
                   rope_scale=rope_scale, rope_theta=rope_theta, scale_default=8.0, theta_default=5e5,
                   llama31=(low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_inplace(q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, offsets: torch.Tensor,
                               rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 8,
                               rope_theta: float = 5e5, low_freq_factor: float = 1, high_freq_factor: float = 4,
                               old_context_len: int = 8192) -> None:
    """:func:`apply_llama31_rope`, overwriting q and k."""
    return _ragged(q, k, indptr, offsets, True, rotary_dim=rotary_dim, interleave=interleave,
                   rope_scale=rope_scale, rope_theta=rope_theta, scale_default=8.0, theta_default=5e5,
                   llama31=(low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_pos_ids(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                               rotary_dim: Optional[int] = None, interleave: bool = False, rope_scale: float = 8,
                               rope_theta: float = 5e5, low_freq_factor: float = 1, high_freq_factor: float = 4,
                               old_context_len: int = 8192) -> Tuple[torch.Tensor, torch.Tensor]:
    """Llama 3.1 RoPE with token ``t`` at ``pos_ids[t]``; returns ``(q_rope, k_rope)``."""
    return _by_pos_ids(q, k, pos_ids, False, rotary_dim=rotary_dim, interleave=interleave,
                       rope_scale=rope_scale, rope_theta=rope_theta, scale_default=8.0, theta_default=5e5,
                       llama31=(low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_pos_ids_inplace(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                                       rotary_dim: Optional[int] = None, interleave: bool = False,
                                       rope_scale: float = 8, rope_theta: float = 5e5, low_freq_factor: float = 1,
                                       high_freq_factor: float = 4, old_context_len: int = 8192) -> None:
    """:func:`apply_llama31_rope_pos_ids`, overwriting q and k."""
    return _by_pos_ids(q, k, pos_ids, True, rotary_dim=rotary_dim, interleave=interleave,
                       rope_scale=rope_scale, rope_theta=rope_theta, scale_default=8.0, theta_default=5e5,
                       llama31=(low_freq_factor, high_freq_factor, old_context_len))


def _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, inplace: bool):
    _tensor(query, "query", 2, None, "[nnz, num_q_heads * head_size]")
    _tensor(key, "key", 2, None, "[nnz, num_k_heads * head_size]")
    if isinstance(head_size, bool) or not isinstance(head_size, numbers.Integral):
        raise TypeError(f"head_size: got {type(head_size).__name__} {head_size!r}; accepted: an int >= 2")
    head_size = int(head_size)
    if head_size < 2:
        raise ValueError(f"head_size: got {head_size}; accepted: an int >= 2")
    for name, t in (("query", query), ("key", key)):
        if t.shape[1] % head_size:
            raise ValueError(f"{name}: got shape {tuple(t.shape)}; accepted: [nnz, num_heads * head_size] with "
                             f"head_size = {head_size} (shape[1] a multiple of it)")
    if not isinstance(cos_sin_cache, torch.Tensor):
        raise TypeError(f"cos_sin_cache: got {type(cos_sin_cache).__name__}; accepted: a torch.Tensor "
                        "[max_position, rotary_dim]")
    if cos_sin_cache.dtype != torch.float32:  # a ValueError, as FlashInfer raises
        raise ValueError(f"cos_sin_cache: got dtype {cos_sin_cache.dtype}; accepted: torch.float32")
    _tensor(cos_sin_cache, "cos_sin_cache", 2, None, "[max_position, rotary_dim]")
    is_neox = _check_bool(is_neox, "is_neox")
    q = query.view(query.shape[0], query.shape[1] // head_size, head_size)
    k = key.view(key.shape[0], key.shape[1] // head_size, head_size)
    _check_qk(q, k, "query", "key")
    rotary_dim = _check_rotary_dim(cos_sin_cache.shape[1], head_size, "cos_sin_cache.shape[1] (rotary_dim)")
    _same_device(q, "query", cos_sin_cache=cos_sin_cache)
    _check_pos_ids(positions, q.shape[0], q, "positions")
    if cos_sin_cache.stride(1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if _check_values() and positions.numel():
        lo, hi = torch.stack([positions.min(), positions.max()]).tolist()
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError(f"positions: got values in [{lo}, {hi}]; accepted: 0 <= positions < "
                             f"cos_sin_cache.shape[0] = {cos_sin_cache.shape[0]}")
    if inplace:
        query_out, key_out = query, key
    else:
        query_out, key_out = torch.empty_like(query), torch.empty_like(key)
    q_out = q if inplace else query_out.view(q.shape)
    k_out = k if inplace else key_out.view(k.shape)
    _launch(q, k, q_out, k_out, rotary_dim=rotary_dim, interleave=not is_neox, pos_ids=positions,
            cos_sin=cos_sin_cache)
    return None if inplace else (query_out, key_out)


def apply_rope_with_cos_sin_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                                  cos_sin_cache: torch.Tensor,
                                  is_neox: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE with precomputed ``cos_sin_cache [max_position, rotary_dim]`` (float32; cos then sin) on
    2-D ``query [nnz, Hq * head_size]`` / ``key [nnz, Hk * head_size]`` (vLLM's form);
    ``is_neox=False`` is the interleaved layout.  Returns ``(query_out, key_out)``."""
    return _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, False)


def apply_rope_with_cos_sin_cache_inplace(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                          head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
    """:func:`apply_rope_with_cos_sin_cache`, overwriting query and key."""
    return _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, True)
