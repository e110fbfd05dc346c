"""``flashinfer.jit.attention`` in the attncore shim: warm-up spec generators only (see ``pytorch``)."""

from . import pytorch  # noqa: F401
from .pytorch import gen_batch_mla_module, gen_batch_prefill_module, gen_pod_module, gen_single_prefill_module  # noqa: F401


def __getattr__(name: str):
    raise AttributeError(f"flashinfer.jit.attention.{name}: not provided by the attncore shim (FlashInfer JIT "
                         f"internals; attncore compiles on demand)")
