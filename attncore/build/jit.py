"""JIT build machinery shared by every CUDA backend: nvcc through ninja into plain shared libraries.

Kernels include no torch headers.  Each specialization is a :class:`Spec`: a readable URI
(``cuda_fa2_prefill_bf16_d128_causal_sm90``), a list of ``.cu`` sources and ``-D`` defines.  It
compiles to one ``.so`` exposing ``extern "C"`` launch functions that take a plain params struct
and a ``cudaStream_t``; Python loads it with :mod:`ctypes`.  No torch headers means a cold build
is only the kernel itself.

Cache layout (``ATTNCORE_CACHE_DIR`` overrides the root ``~/.cache/attncore``)::

    <root>/<attncore version>/sm<arch>/<uri>/build.ninja, *.o, <uri>.<hash>.so, build.log
    <root>/<attncore version>/sm<arch>/<uri>.lock

``<hash>`` covers the source and header contents, the flags and the nvcc version, so an edited
kernel rebuilds and a library another process has loaded is never overwritten in place.  A file
lock per URI makes concurrent processes build once: the second waits, then reuses the library.

API
---
Backends:

* ``Spec(backend, uri, sources, defines=(), include_dirs=(), extra_flags=(), description="", arch_suffix="")``:
  ``arch_suffix="a"`` compiles for the arch-specific target (``-gencode arch=compute_90a,code=sm_90a``
  on sm90), which ``wgmma`` needs; such a library runs only on that exact arch.
* ``load(spec, arch=None) -> ctypes.CDLL``: build if needed (locked, progress on stderr), load once
  per process.  ``arch`` defaults to the current CUDA device's ``"90"``/``"80"``...
* ``library_path(spec, arch)``: where the built library lives (exists or not).
* ``toolchain_reasons() -> list[Reason]``: nvcc / ninja missing.  ``gpu_reasons()``: no CUDA GPU
  (torch not built with CUDA, no device).  Use both in ``Backend.available()``.
* ``compile_check(specs, archs=("80", "90"), jobs=None) -> list[CheckResult]``: compile (``-c``,
  no link, no GPU needed) each spec for each arch; raises :class:`CompileError` on the first
  failure.  For CI on CPU machines.
* A backend offers its specializations through its own ``Backend.jit_specs(arch)`` and
  ``Backend.parse_jit_spec(uri)``; the CLI finds them through the registry (names and aliases as
  the registry knows them), so no module here names a backend.

CLI (``attncore build``):

* ``list_specs(backend=None, arch=None) -> list[Spec]``; ``parse_uri(backend, uri) -> Spec``;
  ``default_arch(arch=None) -> "90"``
* ``build(backend, items=None, arch=None, jobs=None, force=False) -> list[BuildResult]``: ``items``
  are Specs or URI strings (``None``: the backend's listed set); builds in parallel.

Environment: ``ATTNCORE_CACHE_DIR`` (cache root), ``ATTNCORE_NVCC`` (nvcc path, else
``$CUDA_HOME/bin/nvcc``, else ``PATH``), ``ATTNCORE_JIT_QUIET=1`` (no progress lines),
``ATTNCORE_NVCC_FLAGS`` (extra flags appended), ``ATTNCORE_BUILD_JOBS`` (parallel builds).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from attncore.core.backend import Backend
from attncore.core.capabilities import Reason

__all__ = [
    "Spec", "BuildResult", "CheckResult", "CompileError", "cache_root", "cache_dir", "find_nvcc",
    "nvcc_version", "toolchain_reasons", "gpu_reasons", "current_arch", "library_path", "load",
    "build_spec", "compile_check", "list_specs", "build", "parse_uri", "default_arch",
]

# attncore/include: the device helpers the CUDA backends share ("attncore/ptx.cuh", "attncore/abi.h"); a
# backend passes it as an include dir, so the JIT hash covers every header in it (an edited shared
# header rebuilds).
INCLUDE_DIR = str(Path(__file__).resolve().parents[1] / "include")

DEFAULT_FLAGS = (
    "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
    "-DNDEBUG",
)


class CompileError(RuntimeError):
    """nvcc failed.  ``log`` holds the compiler output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message + ("\n" + log if log else ""))
        self.log = log


@dataclass(frozen=True)
class Spec:
    """One specialization: compiled into one shared library named ``uri``.

    backend: owning backend name (``cuda_fa2``).  uri: readable unique name *without* the
    ``_sm<arch>`` suffix (added per arch by :meth:`uri_for`).  sources: ``.cu`` files (absolute).
    defines: ``(("NAME", "VALUE"), ...)`` passed as ``-DNAME=VALUE``.  include_dirs: ``-I`` dirs; every
    file in them is hashed (edit a header, rebuild).  description: progress text
    (``cuda_fa2 prefill bf16 d128 causal``).
    """

    backend: str
    uri: str
    sources: Tuple[str, ...]
    defines: Tuple[Tuple[str, str], ...] = ()
    include_dirs: Tuple[str, ...] = ()
    extra_flags: Tuple[str, ...] = ()
    description: str = ""
    arch_suffix: str = ""  # "a": build for the arch-specific target (sm_90a: wgmma, setmaxnreg)

    def uri_for(self, arch: str) -> str:
        return f"{self.uri}_sm{arch}"

    def text(self) -> str:
        return self.description or self.uri


@dataclass
class BuildResult:
    spec: Spec
    arch: str
    path: Path
    seconds: float  # wall time of the build, 0.0 when reused from the cache
    built: bool


@dataclass
class CheckResult:
    spec: Spec
    arch: str
    seconds: float
    log: str = ""


# ----------------------------------------------------------------------------------- toolchain

def _version() -> str:
    try:
        from importlib.metadata import version

        return version("attncore")
    except Exception:  # not installed (source checkout)
        return "dev"


def cache_root() -> Path:
    env = os.environ.get("ATTNCORE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attncore"


def cache_dir(arch: str) -> Path:
    """``<root>/<attncore version>/sm<arch>``."""
    return cache_root() / _version() / f"sm{arch}"


def find_nvcc() -> Optional[str]:
    env = os.environ.get("ATTNCORE_NVCC")
    if env:
        return env if os.path.exists(env) else None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            p = os.path.join(home, "bin", "nvcc")
            if os.path.exists(p):
                return p
    return shutil.which("nvcc")


def _find_ninja() -> Optional[str]:
    p = shutil.which("ninja")
    if p:
        return p
    try:
        import ninja  # pip package ships the binary

        cand = os.path.join(ninja.BIN_DIR, "ninja")
        return cand if os.path.exists(cand) else None
    except Exception:
        return None


_NVCC_VERSION: Dict[str, str] = {}


def nvcc_version(nvcc: Optional[str] = None) -> str:
    nvcc = nvcc or find_nvcc()
    if not nvcc:
        return ""
    if nvcc not in _NVCC_VERSION:
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
            _NVCC_VERSION[nvcc] = out.strip().splitlines()[-1] if out.strip() else ""
        except Exception:
            _NVCC_VERSION[nvcc] = ""
    return _NVCC_VERSION[nvcc]


def toolchain_reasons() -> List[Reason]:
    """Reasons the JIT cannot build here (empty when nvcc and ninja are found)."""
    r = []
    if not find_nvcc():
        r.append(Reason("toolchain:nvcc", "not found", "CUDA toolkit nvcc >= 12",
                        "install the CUDA toolkit, or set CUDA_HOME / ATTNCORE_NVCC"))
    if not _find_ninja():
        r.append(Reason("toolchain:ninja", "not found", "ninja", "pip install ninja"))
    return r


def gpu_reasons() -> List[Reason]:
    """Reasons there is no usable CUDA GPU (empty when torch sees one)."""
    try:
        import torch
    except Exception as e:  # pragma: no cover
        return [Reason("import:torch", str(e))]
    if torch.version.cuda is None:
        return [Reason("device:cuda", f"torch {torch.__version__} built without CUDA", "a CUDA build of torch")]
    if not torch.cuda.is_available():
        return [Reason("device:cuda", "no CUDA device visible", ">= 1 CUDA GPU")]
    return []


def current_arch(device=None) -> str:
    """``"90"`` for an H100 (compute capability of ``device`` or the current CUDA device)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def _gencode(arch: str) -> List[str]:
    return ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]


# --------------------------------------------------------------------------------- hashing

def _spec_files(spec: Spec) -> List[str]:
    files = list(spec.sources)
    for d in spec.include_dirs:
        for root, _, names in os.walk(d):
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith((".cuh", ".h", ".hpp", ".cu", ".inc"))]
    return sorted(set(files))


def _flags(spec: Spec, arch: Optional[str]) -> List[str]:
    flags = list(DEFAULT_FLAGS)
    if arch is not None:
        flags += _gencode(arch + spec.arch_suffix)
    flags += [f"-D{k}={v}" if v != "" else f"-D{k}" for k, v in spec.defines]
    flags += [f"-I{d}" for d in spec.include_dirs]
    flags += list(spec.extra_flags)
    extra = os.environ.get("ATTNCORE_NVCC_FLAGS")
    if extra:
        flags += extra.split()
    return flags


def _hash(spec: Spec, arch: str, nvcc: str) -> str:
    h = hashlib.sha256()
    h.update(nvcc_version(nvcc).encode())
    h.update("\0".join(_flags(spec, arch)).encode())
    for f in _spec_files(spec):
        h.update(os.path.basename(f).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:12]


def library_path(spec: Spec, arch: str) -> Path:
    """Final library path for ``spec`` on ``arch`` (may not exist yet)."""
    nvcc = find_nvcc() or "nvcc"
    uri = spec.uri_for(arch)
    return cache_dir(arch) / uri / f"{uri}.{_hash(spec, arch, nvcc)}.so"


# ----------------------------------------------------------------------------------- build

_PRINT_LOCK = threading.Lock()


def _say(msg: str) -> None:
    if os.environ.get("ATTNCORE_JIT_QUIET") == "1":
        return
    with _PRINT_LOCK:
        print(msg, file=sys.stderr, flush=True)


def _ninja_file(spec: Spec, arch: str, nvcc: str, build_dir: Path, out: Path) -> str:
    flags = " ".join(_q(f) for f in _flags(spec, arch))
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {_q(nvcc)}",
        f"flags = {flags}",
        "rule cu",
        "  command = $nvcc $flags -MD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = nvcc $in",
        "rule link",
        "  command = $nvcc -shared $flags $in -o $out",
        "  description = link $out",
    ]
    objs = []
    for i, src in enumerate(spec.sources):
        obj = f"{i}_{Path(src).stem}.o"
        objs.append(obj)
        lines.append(f"build {obj}: cu {_ninja_escape(src)}")
    lines.append(f"build {_ninja_escape(str(out))}: link {' '.join(objs)}")
    lines.append(f"default {_ninja_escape(str(out))}")
    return "\n".join(lines) + "\n"


def _q(s: str) -> str:
    import shlex

    return _ninja_escape(shlex.quote(s))


def _ninja_escape(s: str) -> str:
    return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _lock(path: Path):
    from filelock import FileLock

    return FileLock(str(path))


def build_spec(spec: Spec, arch: str, *, force: bool = False, verbose: bool = False) -> BuildResult:
    """Build ``spec`` for ``arch`` unless a matching library is cached.  Thread- and process-safe."""
    nvcc = find_nvcc()
    ninja = _find_ninja()
    if not nvcc or not ninja:
        raise CompileError("cannot build " + spec.uri_for(arch) + ": " + "; ".join(map(str, toolchain_reasons())))
    final = library_path(spec, arch)
    if final.exists() and not force:
        return BuildResult(spec, arch, final, 0.0, False)
    d = final.parent
    d.mkdir(parents=True, exist_ok=True)
    lock = _lock(d.parent / f"{spec.uri_for(arch)}.lock")
    t_wait = time.time()
    try:
        lock.acquire(timeout=0)
    except Exception:
        _say(f"waiting for another process building {spec.text()} sm{arch} ...")
        lock.acquire()
    try:
        if final.exists() and not force:  # built by the process we waited for
            _say(f"reusing {spec.text()} sm{arch} (built by another process, waited {time.time() - t_wait:.0f} s)")
            return BuildResult(spec, arch, final, 0.0, False)
        tmp_out = d / f"{spec.uri_for(arch)}.so"
        (d / "build.ninja").write_text(_ninja_file(spec, arch, nvcc, d, tmp_out))
        _say(f"building {spec.text()} sm{arch} ...")
        t0 = time.time()
        cmd = [ninja, "-C", str(d), "-f", "build.ninja"] + (["-v"] if verbose else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        dt = time.time() - t0
        (d / "build.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            _say(f"building {spec.text()} sm{arch} ... FAILED after {dt:.0f} s (log: {d / 'build.log'})")
            raise CompileError(f"nvcc failed for {spec.uri_for(arch)}", proc.stdout + proc.stderr)
        # Publish under the content-hashed name atomically: a library another process has
        # mapped is never rewritten in place.
        staging = d / f".{final.name}.{os.getpid()}.tmp"
        shutil.copyfile(tmp_out, staging)
        os.replace(staging, final)
        _say(f"building {spec.text()} sm{arch} ... {dt:.0f} s")
        return BuildResult(spec, arch, final, dt, True)
    finally:
        lock.release()


_LOADED: Dict[Tuple[str, str], ctypes.CDLL] = {}
_LOAD_LOCK = threading.Lock()


def load(spec: Spec, arch: Optional[str] = None) -> ctypes.CDLL:
    """Return the loaded library of ``spec`` for ``arch`` (default: current device), building it first
    if needed.  Loaded once per process."""
    if arch is None:
        arch = current_arch()
    key = (spec.uri_for(arch), spec.sources[0] if spec.sources else "")
    lib = _LOADED.get(key)
    if lib is not None:
        return lib
    with _LOAD_LOCK:
        lib = _LOADED.get(key)
        if lib is None:
            res = build_spec(spec, arch)
            lib = ctypes.CDLL(str(res.path))
            _LOADED[key] = lib
    return lib


def compile_check(specs: Sequence[Spec], archs: Sequence[str] = ("80", "90"), *, jobs: Optional[int] = None,
                  ptxas_verbose: bool = False) -> List[CheckResult]:
    """Compile each spec's sources for each arch (``nvcc -c``, no link, no GPU).  Raises
    :class:`CompileError` naming the spec and arch on the first failure.  ``ptxas_verbose`` keeps the
    register/spill report in each result's ``log``."""
    import tempfile

    nvcc = find_nvcc()
    if not nvcc:
        raise CompileError("nvcc not found: " + "; ".join(map(str, toolchain_reasons())))

    def one(item):
        spec, arch = item
        t0 = time.time()
        logs = []
        with tempfile.TemporaryDirectory(prefix="attncore-check-") as tmp:
            for i, src in enumerate(spec.sources):
                cmd = [nvcc] + _flags(spec, arch) + (["-Xptxas", "-v"] if ptxas_verbose else []) + [
                    "-c", src, "-o", os.path.join(tmp, f"{i}.o")]
                p = subprocess.run(cmd, capture_output=True, text=True)
                logs.append(p.stdout + p.stderr)
                if p.returncode != 0:
                    raise CompileError(f"compile check failed: {spec.uri_for(arch)} ({src})", p.stdout + p.stderr)
        return CheckResult(spec, arch, time.time() - t0, "".join(logs))

    items = [(s, a) for s in specs for a in archs]
    jobs = jobs or int(os.environ.get("ATTNCORE_BUILD_JOBS", 0)) or max(1, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        return list(ex.map(one, items))


# ------------------------------------------------------------------------- spec registry (CLI)

def _jit_backend(name: str):
    """The registered backend ``name`` (aliases resolved by the registry) that builds JIT kernels."""
    from attncore.core import registry

    try:
        entry = registry.get_entry(name)
    except ValueError:
        raise ValueError(f"backend {name!r} is not a known backend; known: {', '.join(_known_backends())} "
                         "(the backends that build JIT kernels)") from None
    if entry.backend is None:
        raise ValueError(f"backend {entry.name!r} failed to load: {entry.load_error}")
    if type(entry.backend).jit_specs is Backend.jit_specs:
        raise ValueError(f"backend {entry.name!r} builds no JIT kernels; those that do: "
                         + ", ".join(_known_backends()))
    return entry.backend


def _known_backends() -> List[str]:
    from attncore.core import registry

    return sorted(n for n, e in registry.entries().items()
                  if e.backend is not None and type(e.backend).jit_specs is not Backend.jit_specs)


def _default_arch(arch: Optional[str]) -> str:
    if arch:
        return str(arch).replace("sm_", "").replace("sm", "")
    try:
        return current_arch()
    except Exception:
        return "90"


def default_arch(arch: Optional[str] = None) -> str:
    """``arch`` normalised (``"sm_90"``/``"sm90"``/``"90"`` -> ``"90"``); None: the current GPU's, else ``"90"``."""
    return _default_arch(arch)


def list_specs(backend: Optional[str] = None, arch: Optional[str] = None) -> List[Spec]:
    """Specializations offered by ``backend`` (all backends when None) for ``arch``."""
    arch = _default_arch(arch)
    names = [backend] if backend else _known_backends()
    out: List[Spec] = []
    for n in names:
        out += _jit_backend(n).jit_specs(arch)
    return out


def parse_uri(backend: str, uri: str) -> Spec:
    return _jit_backend(backend).parse_jit_spec(uri)


def build(backend: str, items: Optional[Sequence[Union[Spec, str]]] = None, *, arch: Optional[str] = None,
          jobs: Optional[int] = None, force: bool = False) -> List[BuildResult]:
    """Build (or reuse) specializations of ``backend`` for ``arch`` in parallel.  ``items``: Specs or
    URI strings; None builds ``list_specs(backend)``.  Returns one BuildResult each (seconds 0 when
    reused).  Raises CompileError if any build fails (after the others finish)."""
    arch = _default_arch(arch)
    if items is None:
        specs = list_specs(backend, arch)
    else:
        specs = [it if isinstance(it, Spec) else parse_uri(backend, it) for it in items]
    jobs = jobs or int(os.environ.get("ATTNCORE_BUILD_JOBS", 0)) or max(1, os.cpu_count() or 1)
    errors: List[BaseException] = []

    def one(s):
        try:
            return build_spec(s, arch, force=force)
        except BaseException as e:  # collect, report all
            errors.append(e)
            return None

    with ThreadPoolExecutor(max_workers=jobs) as ex:
        results = list(ex.map(one, specs))
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]
