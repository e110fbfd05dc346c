"""Relaunch a compiled Triton kernel without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument on each call (about
40 us of host time for the ~60 arguments of ``_attn_fwd`` with Triton 3.6) before it reaches the
compiled launcher.  A plan relaunches the same kernel with the same strides and scales, so the
first call goes through Triton (compiling if needed) and later calls hand the arguments straight
to the compiled kernel's launcher, as Triton's own ``CompiledKernel[grid]`` runner does.

What Triton would re-check per call and this keeps: the pointer alignment the kernel was
specialized for (a tensor that is not 16-byte aligned where the first one was goes back through
Triton, which compiles the right variant; the other way round, the variant compiled without the
assumption runs).  The caller keys its launchers by everything else that
selects a variant (strides, scales, which optional tensors are present).  Any Triton without the
expected compiled-kernel interface, and the CPU interpreter, use the plain path.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from attncore.core import current

try:  # Triton's runtime hooks (launch_enter / exit); absent in older Tritons: plain path only
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover
    _knobs = None


class FastLauncher:
    """``launch(*args)`` = ``fn[grid](*args, **constexprs)``; args positional, in the kernel's
    parameter order, constexprs (and num_warps / num_stages) as keywords."""

    def __init__(self, fn, grid: Sequence[int], constexprs: dict):
        self._fn = fn
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._constexprs = constexprs
        self._launcher = fn[tuple(grid)]
        self._kernel = None
        self._aligned = ()  # positions of the tensor arguments the kernel was specialized as 16-byte aligned
        self._other = ()  # and of the other tensor arguments
        self._tail = None
        self.fast_calls = 0  # relaunches that skipped Triton's binding (tests)

    def __call__(self, *args) -> None:
        self.at(self._grid, *args)

    def at(self, grid: tuple, *args) -> None:
        """Launch on ``grid`` (three ints) instead of the one given at construction: kernels whose grid
        follows a per-call count (the tokens of a RoPE or an append) keep one launcher; the count itself
        must be an unspecialized argument (``do_not_specialize``), as the compiled kernel is reused."""
        k = self._kernel
        if k is not None:
            # tensors go to the compiled launcher as their addresses: given a tensor, it would call data_ptr()
            # again and ask the driver about each pointer (cuPointerGetAttribute), ~1 us a tensor
            full = list(args)
            bits = 0
            for i in self._aligned:
                p = full[i] = full[i].data_ptr()
                bits |= p
            if not bits & 15:
                for i in self._other:  # compiled without the alignment assumption: any address runs
                    full[i] = full[i].data_ptr()
                if len(grid) != 3:
                    grid = tuple(grid) + (1,) * (3 - len(grid))
                enter = _knobs.runtime.launch_enter_hook
                stream = current.stream(current.device_index())
                # Triton's metadata for its launch hooks; an empty chain of hooks (Triton >= 3.5) reads none
                meta = (k.launch_metadata(grid, stream, *args, *self._tail)
                        if enter is not None and getattr(enter, "calls", True) else None)
                k.run(*grid, stream, k.function, k.packed_metadata, meta, enter,
                      _knobs.runtime.launch_exit_hook, *full, *self._tail)
                self.fast_calls += 1
                return
        grid = tuple(grid) + (1,) * (3 - len(grid))
        kernel = (self._launcher if grid == self._grid else self._fn[grid])(*args, **self._constexprs)
        names = self._fn.arg_names
        if (self._kernel is None and _has_interface(kernel) and len(names) >= len(args)
                and all(n in self._constexprs for n in names[len(args):])):
            self._kernel = kernel
            tensors = [i for i, a in enumerate(args) if hasattr(a, "data_ptr")]
            self._aligned = tuple(i for i in tensors if args[i].data_ptr() % 16 == 0)
            self._other = tuple(i for i in tensors if args[i].data_ptr() % 16)
            self._tail = tuple(self._constexprs[n] for n in names[len(args):])


def _has_interface(kernel) -> bool:
    return all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))


def fast_launcher(fn, grid, constexprs: dict) -> Callable:
    """A FastLauncher, or Triton's plain launcher where the fast path does not apply (the CPU
    interpreter, a Triton without ``knobs``)."""
    if _knobs is None or type(fn).__name__ == "InterpretedFunction":
        return _Plain(fn, grid, constexprs)
    return FastLauncher(fn, grid, constexprs)


class _Plain:
    """Triton's own launch, with FastLauncher's call forms."""

    def __init__(self, fn, grid: Sequence[int], constexprs: dict):
        self._fn, self._grid, self._constexprs = fn, tuple(grid), constexprs

    def __call__(self, *args) -> None:
        self._fn[self._grid](*args, **self._constexprs)

    def at(self, grid: tuple, *args) -> None:
        self._fn[tuple(grid)](*args, **self._constexprs)


_KEPT: dict = {}  # (id of the kernel, the caller's key) -> its launcher (kernels launched with a per-call grid)


def kept_launcher(fn, key: tuple, constexprs: Callable[[], dict]):
    """The launcher of ``fn`` for ``key``, made once (``fast_launcher(fn, (1,), constexprs())``; the grid is
    given per call, ``at``): ``key`` holds everything the compiled kernel is specialized on that the
    launcher does not check (device, dtypes, strides, specialized ints, constexprs).  At most 256 are kept."""
    k = (id(fn), key)  # kernels are module globals: they live as long as the process
    launch = _KEPT.get(k)
    if launch is None:
        if len(_KEPT) >= 256:
            _KEPT.clear()
        launch = _KEPT[k] = fast_launcher(fn, (1,), constexprs())
    return launch


def launch_at(launcher, device, grid: tuple, *args) -> None:
    """``launcher.at(grid, *args)`` on ``device`` (its current stream), whichever device is current: a
    tensor-parallel rank's tensors may sit on cuda:1 while cuda:0 stays current."""
    if device.type == "cuda" and device.index != current.device_index():
        with torch.cuda.device(device):
            launcher.at(grid, *args)
    else:
        launcher.at(grid, *args)

