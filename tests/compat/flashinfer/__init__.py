"""``flashinfer`` -> attncore import shim, for running FlashInfer 0.2.14's own test files against attncore.

Only ``tests/compat`` (``scripts/compat_flashinfer.sh``) puts this package on ``sys.path``; the project
itself is ``attncore``.  What it does:

* ``from attncore import *``: the top-level API (wrappers, single-request functions, page and
  quantization utilities, cascade merges, RoPE, ...), the very objects attncore exports.
* ``flashinfer.<sub>`` and ``import flashinfer.<sub>`` for attncore's submodules of the same name
  (``decode``, ``prefill``, ``page``, ``quantization``, ``cascade``, ``pod``, ``rope``, ``mla``): these ARE
  attncore's modules (aliases in ``sys.modules``), so a name attncore lacks raises its plain
  ``AttributeError`` and the test that uses it fails.
* ``flashinfer.jit``: FlashInfer's ahead-of-time warm-up entry points, which are no-ops here
  (attncore compiles each specialization on first use); nothing else of FlashInfer's JIT.
* Any other top-level name is looked up on ``attncore``; a name attncore does not have raises
  ``AttributeError`` saying so.  Nothing here implements attention or stands in for a missing feature.
"""

from __future__ import annotations

import importlib as _importlib
import sys as _sys

import attncore as _attncore
from attncore import *  # noqa: F401,F403

__version__ = _attncore.__version__  # attncore's version: this is not FlashInfer
__attncore_shim__ = True
from attncore.core import registry  # noqa: E402  how attncore.bench recognises the shim (it refuses to time it as FlashInfer)

#: FlashInfer submodule names that are attncore modules of the same name and purpose.
ALIASED_SUBMODULES = ("cascade", "decode", "mla", "page", "pod", "prefill", "quantization", "rope")

for _name in ALIASED_SUBMODULES:
    _mod = _importlib.import_module(f"attncore.{_name}")
    _sys.modules[f"{__name__}.{_name}"] = _mod
    globals()[_name] = _mod
del _name, _mod

from . import jit  # noqa: E402  (FlashInfer's JIT warm-up entry points: no-ops)
from . import utils  # noqa: E402  (the two hardware queries FlashInfer's tests import from flashinfer.utils)


def __getattr__(name: str):
    try:
        return getattr(_attncore, name)
    except AttributeError:
        pass
    raise AttributeError(
        f"flashinfer.{name}: attncore has no counterpart of this FlashInfer 0.2.14 API (module 'flashinfer' "
        f"here is the attncore compatibility shim of tests/compat)")
