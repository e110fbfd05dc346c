"""``flashinfer.jit`` in the attncore shim: FlashInfer's warm-up entry points only, as no-ops.

FlashInfer's test modules build their kernel specializations ahead of time in an autouse fixture
(``flashinfer.jit.build_jit_specs(gen_..._modules(...))``).  attncore has no such step: each backend
compiles a specialization the first time a plan needs it (``attncore.build.jit``; ``attncore build`` builds
ahead of time), so these calls have nothing to do.  Any other ``flashinfer.jit`` name is FlashInfer's
JIT internals, which attncore does not have: looking one up raises ``AttributeError``.
"""

from __future__ import annotations

from . import attention  # noqa: F401


def build_jit_specs(specs=(), verbose: bool = False, skip_prebuilt: bool = True) -> None:
    """No-op: attncore compiles on demand.  ``specs`` are the placeholders of ``jit_utils`` /
    ``flashinfer.jit.attention.pytorch`` (never real FlashInfer JIT specs)."""
    return None


def __getattr__(name: str):
    raise AttributeError(
        f"flashinfer.jit.{name}: FlashInfer's JIT internals have no attncore counterpart (attncore compiles "
        f"on demand; see attncore.build.jit and `attncore build`); the shim only provides build_jit_specs and "
        f"flashinfer.jit.attention.pytorch.gen_pod_module as warm-up no-ops")
