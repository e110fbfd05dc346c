"""Backend registry: built-in and third-party backends, discovered the same way.

Every backend, built-in or not, comes from a module named by an entry point in the group
``attncore.backends`` that implements the ``attncore_backends`` hook.  Loading is isolated per
plugin: one that raises on import (or in its hook) is listed as unavailable with its error, and
attncore keeps working.

Environment variables (read when the registry first loads; ``reload()`` re-reads them):

* ``ATTNCORE_PLUGINS``: comma-separated allow-list of third-party entry-point names.  Unset: all
  installed plugins load.  Empty: none do.  Built-in backends are not affected.
* ``ATTNCORE_DISABLE_BACKENDS``: comma-separated backend names to hide from selection.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Dict, List, Optional

import pluggy

from attncore.core.backend import Backend
from attncore.core.capabilities import Reason
from attncore.core.hooks import AttncoreSpec

log = logging.getLogger("attncore")

ENTRY_POINT_GROUP = "attncore.backends"
BUILTIN_DIST = "attncore"
@dataclass
class BackendEntry:
    """A backend as the registry knows it: the object (None if it failed to load) and its state."""

    name: str
    origin: str  # "built-in" or "plugin <dist> <version>"
    backend: Optional[Backend] = None
    load_error: Optional[str] = None
    disabled: bool = False
    _available: Optional[List[Reason]] = field(default=None, repr=False)

    def unavailable_reasons(self) -> List[Reason]:
        """Why this backend cannot be used at all (empty when usable)."""
        if self.load_error is not None:
            return [Reason("import", self.load_error, hint="the plugin failed to load")]
        if self.disabled:
            return [Reason("disabled", "ATTNCORE_DISABLE_BACKENDS", hint="unset it to enable")]
        if self._available is None:
            try:
                self._available = list(self.backend.available())
            except Exception as e:  # a plugin's available() must not break selection
                self._available = [Reason("available", f"{type(e).__name__}: {e}")]
        return self._available

    @property
    def is_available(self) -> bool:
        return not self.unavailable_reasons()


_lock = threading.RLock()
_entries: Optional[Dict[str, BackendEntry]] = None
_manual: Dict[str, Backend] = {}
_generation = 0  # bumped on every change, so caches keyed on it (the selector's) stay valid


def generation() -> int:
    return _generation


def _bump() -> None:
    global _generation
    _generation += 1


def _csv_env(name: str) -> Optional[List[str]]:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return [x.strip() for x in raw.split(",") if x.strip()]


def _dist_of(ep) -> tuple:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown", ""
    return dist.metadata["Name"] or "unknown", dist.version or ""


def _load() -> Dict[str, BackendEntry]:
    entries: Dict[str, BackendEntry] = {}
    allow = _csv_env("ATTNCORE_PLUGINS")
    disabled = set(_csv_env("ATTNCORE_DISABLE_BACKENDS") or [])
    pm = pluggy.PluginManager("attncore")
    pm.add_hookspecs(AttncoreSpec)
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as e:  # pragma: no cover - broken environment metadata
        log.warning("attncore: cannot read entry points: %s", e)
        eps = []
    seen = set()
    for ep in eps:
        if ep.name in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(ep.name)
        dist, version = _dist_of(ep)
        builtin = dist.lower() == BUILTIN_DIST
        origin = "built-in" if builtin else f"plugin {dist} {version}".strip()
        if not builtin and allow is not None and ep.name not in allow:
            continue
        try:
            module = ep.load()
            impl = getattr(module, "attncore_backends", None)
            if impl is None:
                raise TypeError(f"entry point {ep.value!r} has no attncore_backends hook")
            pm.register(module, name=ep.name)
            backends = list(impl())
        except Exception as e:
            entries[ep.name] = BackendEntry(ep.name, origin, load_error=f"{type(e).__name__}: {e}")
            log.warning("attncore: backend plugin %r failed to load: %s", ep.name, e)
            continue
        for b in backends:
            b.origin = origin
            entries[b.name] = BackendEntry(b.name, origin, backend=b, disabled=b.name in disabled)
    for name, b in _manual.items():
        entries[name] = BackendEntry(name, b.origin, backend=b, disabled=name in disabled)
    return entries


def entries() -> Dict[str, BackendEntry]:
    """All known backends (loaded on first use), including unavailable ones."""
    global _entries
    with _lock:
        if _entries is None:
            _entries = _load()
        return _entries


def reload() -> None:
    """Forget loaded backends and re-read entry points and environment variables."""
    global _entries
    with _lock:
        _entries = None
        _bump()


def register_backend(backend: Backend, *, origin: str = "registered") -> Backend:
    """Register a backend object directly (tests, notebooks).  Replaces one of the same name."""
    with _lock:
        _bump()
        backend.origin = origin
        _manual[backend.name] = backend
        if _entries is not None:
            disabled = set(_csv_env("ATTNCORE_DISABLE_BACKENDS") or [])
            _entries[backend.name] = BackendEntry(backend.name, origin, backend=backend,
                                                  disabled=backend.name in disabled)
    return backend


def unregister_backend(name: str) -> None:
    with _lock:
        _bump()
        _manual.pop(name, None)
        if _entries is not None:
            _entries.pop(name, None)


# FlashInfer's backend= values (0.2.14 and later) and what attncore does with each: a name it maps to, or
# the reason it refuses (never a silent stand-in).  "fa2" is cuda_fa2's own alias.
FLASHINFER_MAPPED = {"cudnn": "sdpa"}
FLASHINFER_REFUSED = {
    "fa3": "attncore has no separate FA3 backend: cuda_fa2 ('fa2') already runs its sm90 (wgmma) prefill kernel "
           "on Hopper where that kernel serves the problem; pass backend='fa2' or 'auto'",
    "cutlass": "attncore has no CUTLASS (Blackwell FMHA) backend; pass backend='auto' or a name from "
               "attncore.available_backends()",
    "trtllm-gen": "attncore has no TensorRT-LLM-gen backend (FlashInfer's trtllm-gen kernels are closed cubins); "
                  "pass backend='auto', 'xqa' for XQA-style decode, or 'fa2'",
}


def canonical_name(name: str) -> str:
    name = name.strip()
    for e in entries().values():
        if e.backend is not None and name in getattr(e.backend, "aliases", ()):
            return e.name
    return FLASHINFER_MAPPED.get(name, name)


def resolve(name: str) -> str:
    """``backend=`` as an entry point got it: "auto", or the canonical name of a known backend.  FlashInfer's
    values are mapped ("fa2" -> cuda_fa2, "cudnn" -> the sdpa plugin, whose torch SDPA runs cuDNN among its
    fused kernels) or refused with the reason ("fa3", "cutlass", "trtllm-gen", "cudnn" without the plugin);
    an unknown name is a ``ValueError`` listing the known ones."""
    if name is None or name == "auto":
        return "auto"
    if not isinstance(name, str):
        raise TypeError(f"backend: got {name!r}, expected 'auto' or a backend name")
    key = name.strip()
    if key in FLASHINFER_REFUSED:
        raise ValueError(f"backend={name!r}: {FLASHINFER_REFUSED[key]}")
    canon = canonical_name(key)
    es = entries()
    if canon in es:
        return canon
    if key in FLASHINFER_MAPPED:
        raise ValueError(f"backend={name!r}: FlashInfer's {key} backend maps to attncore's {canon!r} backend, "
                         f"which is not installed (pip install attncore-sdpa); pass backend='auto'")
    aliases = sorted(a for e in es.values() if e.backend is not None for a in getattr(e.backend, "aliases", ()))
    known = ", ".join(["auto"] + sorted(es) + aliases + sorted(FLASHINFER_MAPPED) + sorted(FLASHINFER_REFUSED))
    raise ValueError(f"backend={name!r} is not a known backend; known values: {known} (the last ones are "
                     f"FlashInfer's names, mapped or refused with a reason)")


def get_entry(name: str) -> BackendEntry:
    name = canonical_name(name)
    es = entries()
    if name not in es:
        known = ", ".join(sorted(es)) or "none"
        raise ValueError(f"backend={name!r} is not a known backend; known backends: {known}")
    return es[name]


def get_backend(name: str) -> Backend:
    """The backend object of that name; raises ValueError if unknown or unavailable."""
    e = get_entry(name)
    rs = e.unavailable_reasons()
    if rs:
        raise ValueError(f"backend {e.name!r} is unavailable: " + "; ".join(map(str, rs)))
    return e.backend


def available_backends() -> Dict[str, Backend]:
    return {n: e.backend for n, e in entries().items() if e.is_available}
