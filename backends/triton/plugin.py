"""Registers the Triton backend with attncore (entry point ``attncore.backends: triton``).

Imports cheaply: triton itself is imported lazily (``available()`` reports a missing or broken
install); an error importing the backend module reaches the registry, which lists the backend as
unavailable with that reason.  On a machine without a CUDA GPU, Triton's interpreter is switched on
(``TRITON_INTERPRET=1``) unless the variable is already set: Triton reads it when ``@triton.jit``
decorates a function (``triton.knobs.runtime.interpret``, an env-backed knob read at access time in
triton 3.9, checked here; the same knob exists since 3.4), and our kernel modules are imported only
on first use, so setting it here is early enough.  If the variable is set but triton was imported
and our kernels decorated before, they stay compiled ones and ``run()`` says so instead of
computing (it checks the kernels' mode against the tensors' device).
"""

import os

from attncore.core.hooks import hookimpl


def _maybe_enable_interpreter() -> None:
    if "TRITON_INTERPRET" in os.environ:
        return
    try:
        import torch

        if torch.cuda.is_available():
            return
    except Exception:
        pass
    os.environ["TRITON_INTERPRET"] = "1"


@hookimpl
def attncore_backends():
    _maybe_enable_interpreter()
    # an import error propagates: the registry lists triton as unavailable with the reason
    from attncore.backends.triton.backend import TritonBackend  # noqa: F401 (its import error, first)
    # TritonBackend with the fused pod / batch_pod op (backends/triton/pod.py)
    from attncore.backends.triton.pod import TritonPODBackend

    return [TritonPODBackend()]
