"""Testing tools shipped with attncore: the fp64 golden and the backend conformance suite.

``run_conformance(name, extra_args)`` runs the suite on one backend (``attncore conformance``).
"""

from __future__ import annotations

import importlib
import os
from typing import List, Optional, Sequence

from attncore.testing.golden import golden_alibi_slopes, golden_attention, golden_rope

__all__ = ["golden_attention", "golden_alibi_slopes", "golden_rope", "run_conformance", "resolve_backend"]


def resolve_backend(name: str):
    """(backend, unavailable reasons) for a registered name or ``module:attr``.

    ``module:attr`` may name a ``Backend`` instance, a class or a zero-argument factory; the
    backend is then registered (``attncore.core.registry.register_backend``) so the selector sees it.
    A registered backend that failed to load raises; one unavailable here (no GPU, no compiler)
    is returned with its reasons, and the suite skips what needs running it.
    """
    from attncore.core.backend import Backend

    if not name:
        raise ValueError("no backend name given")
    if ":" in name:
        mod, _, attr = name.partition(":")
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, Backend):
            obj = obj()
        if not isinstance(obj, Backend):
            raise TypeError(f"{name} is not an attncore.core.backend.Backend")
        try:
            from attncore.core.registry import register_backend

            register_backend(obj, origin=f"conformance {name}")
        except ImportError:
            pass
        return obj, list(obj.available())
    from attncore.core import registry

    entry = registry.get_entry(name)
    if entry.backend is None:
        raise ValueError(f"backend {entry.name!r} failed to load: {entry.load_error}")
    return entry.backend, list(entry.unavailable_reasons())


def _plugin_autoloaded() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    try:
        from importlib.metadata import entry_points

        return any(ep.value == "attncore.testing.pytest_plugin" for ep in entry_points(group="pytest11"))
    except Exception:
        return False


def run_conformance(name: str, extra_args: Optional[Sequence[str]] = None) -> int:
    """Run the conformance suite on backend ``name``; returns pytest's exit code (0: all passed)."""
    import pytest

    args: List[str] = ["--pyargs", "attncore.testing.test_conformance", "--attncore-backend", name,
                       "-p", "no:cacheprovider"]
    if not _plugin_autoloaded():
        args += ["-p", "attncore.testing.pytest_plugin"]
    args += list(extra_args or [])
    return int(pytest.main(args))
