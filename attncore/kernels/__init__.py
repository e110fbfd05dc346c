"""Triton kernels behind the public modules (not backends): the fused state merge of
:mod:`attncore.cascade`, the rotary embedding of :mod:`attncore.rope`, MLA's of :mod:`attncore.mla` and the
paged append (and its value check) of :mod:`attncore.page`; and ``launch``, the relauncher of compiled
kernels that they and the Triton backend share.  Each is imported on first use, so that ``TRITON_INTERPRET``
can still be set before ``@triton.jit`` decorates it.  Importing this package imports no kernel (and not
Triton)."""

import os


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (Triton reads it when it decorates)."""
    v = os.environ.get("TRITON_INTERPRET", "0")
    on = _READ.get(v)
    if on is None:  # host time: every plan asks
        on = _READ[v] = v.strip().lower() in ("1", "true", "on", "yes")
    return on


_READ: dict = {}  # TRITON_INTERPRET's values seen -> whether each asks for the interpreter


def interpreted(kernel) -> bool:
    """Whether a ``@triton.jit`` function was decorated under ``TRITON_INTERPRET`` (runs on the CPU)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_interpreted(kernel, device, who: str, hint: str, subject: str = "the Triton kernel was") -> bool:
    """Raise when ``kernel`` cannot run on ``device``: an interpreted kernel takes CPU tensors only, a compiled
    one CUDA tensors only (which one was fixed when it was decorated).  Returns whether it is interpreted."""
    interp = interpreted(kernel)
    if interp != (device.type == "cpu"):
        raise RuntimeError(
            f"{who}: {subject} {'interpreted' if interp else 'compiled'} at import "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} then) but the tensors are on {device}; {hint}")
    return interp
