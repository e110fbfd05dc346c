"""``flashinfer.jit.attention`` in the attncore shim: warm-up spec generators only (see ``pytorch``)."""

from . import pytorch  # noqa: F401
from .pytorch import gen_pod_module  # noqa: F401


def __getattr__(name: str):
    raise AttributeError(f"flashinfer.jit.attention.{name}: not provided by the attncore shim (FlashInfer JIT "
                         f"internals; attncore compiles on demand)")
