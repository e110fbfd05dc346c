"""The scalar parameters of every entry point: one rule per kind, checked once in the core before any
backend sees the value (docs/semantics.md, "Parameters").

Each function takes the argument's name (as the caller spelled it: ``sm_scale``, ``sm_scale_d``,
``bmm1_scale``...) and the value given, and returns the value a backend gets (a float, or an int for
the window) or raises a ``ValueError``/``TypeError`` naming the parameter, the value given and what
is accepted.  Backends may therefore assume: ``sm_scale`` and every scale finite and > 0,
``logits_soft_cap`` 0 (no cap) or finite and > 0, ``rope_*`` finite and > 0, ``window_left >= -1``.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

__all__ = ["logits_soft_cap", "rope", "scale", "sm_scale", "window_left"]


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive(name: str, value, accepted: str) -> float:
    """``value`` (a real number, not a bool) as a finite float > 0."""
    v = float(value) if _real(value) else None
    if v is None or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: got {value!r}, expected {accepted}")
    return v


def sm_scale(value, head_dim: Optional[int], name: str = "sm_scale") -> Optional[float]:
    """``None`` is ``1/sqrt(head_dim)`` (stays None without a head_dim); otherwise a finite number > 0."""
    if value is None:
        return None if head_dim is None else 1.0 / math.sqrt(head_dim)
    return _positive(name, value, "None (1/sqrt(head_dim)) or a finite number > 0")


def logits_soft_cap(value, name: str = "logits_soft_cap") -> float:
    """``None``, ``0`` and ``inf`` all mean "no cap" and become 0.0 (``cap * tanh(x / cap)`` tends to
    ``x`` as the cap grows; computed literally, an infinite cap gives ``inf * 0 = NaN``); otherwise a
    finite number > 0."""
    if value is None or (_real(value) and (value == 0 or value == math.inf)):
        return 0.0
    return _positive(name, value, "None, 0 or inf (no cap), or a finite number > 0")


ROPE_DEFAULTS = {"rope_scale": 1.0, "rope_theta": 1e4}


def rope(name: str, value, *, fill: bool = True) -> Optional[float]:
    """``rope_scale`` (default 1) or ``rope_theta`` (default 1e4), also as ``rope_scale_d`` etc.: ``None``
    is the default (stays None with ``fill=False``), otherwise a finite number > 0."""
    default = ROPE_DEFAULTS["rope_scale" if name.startswith("rope_scale") else "rope_theta"]
    if value is None:
        return default if fill else None
    return _positive(name, value, f"None ({default:g}) or a finite number > 0")


def window_left(value, name: str = "window_left") -> int:
    """-1 (no window) or an int >= 0."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < -1:
        raise ValueError(f"{name}: got {value!r}, expected -1 (off) or an int >= 0")
    return int(value)


_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def scale(name: str, value, default: float = 1.0) -> float:
    """``q_scale``, ``k_scale``, ``v_scale``, ``o_scale``, ``bmm1_scale``, ``bmm2_scale``: ``None`` is
    ``default``, otherwise a finite number > 0, or a 1-element floating-point tensor holding one.

    A tensor's dtype and shape are checked without reading it.  Its value is then read once on the host
    (``.item()``, a device sync for a device tensor): the backends take the scales as host floats, so
    the core reads it anyway, and the value check rides on that read at no extra cost.
    """
    if value is None:
        return default
    if isinstance(value, torch.Tensor):
        if value.dtype not in _SCALE_DTYPES:
            raise TypeError(f"{name}: got a tensor of dtype {str(value.dtype).replace('torch.', '')}, expected a "
                            f"float or a 1-element float32/float16/bfloat16/float64 tensor")
        if value.numel() != 1:
            raise ValueError(f"{name}: got a tensor of shape {list(value.shape)}, expected a float or a "
                             f"1-element tensor")
        value = value.item()
    return _positive(name, value, "None or a finite number > 0")
