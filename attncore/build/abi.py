"""The ABI check of the CUDA backends' ctypes mirrors (the Python side of include/attncore/abi.h).

A library built with ``AC_EXPORT_LAYOUT`` exports ``<prefix>_size()``, ``<prefix>_offsets(int*, cap)``
(offsetof of every field in declaration order) and ``<prefix>_fields()`` (their names), generated
from the struct's one field list; ``check_layout`` compares them with the ctypes mirror at load.
"""

from __future__ import annotations

import ctypes


def check_layout(cdll, prefix: str, struct, what: str) -> None:
    """Check the ctypes mirror ``struct`` against the C struct the library was built with, field by field.

    The library exports ``<prefix>_size()``, ``<prefix>_offsets(int*, cap)`` (offsetof of every field in
    declaration order) and ``<prefix>_fields()`` (their names), generated from the struct's field list
    (the backend's params header, attncore/abi.h).  Raises RuntimeError naming the first field that differs."""
    off_fn, names_fn, size_fn = (getattr(cdll, f"{prefix}_{s}") for s in ("offsets", "fields", "size"))
    off_fn.restype, off_fn.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    names_fn.restype, size_fn.restype = ctypes.c_char_p, ctypes.c_int
    offs = (ctypes.c_int * 256)()
    n = off_fn(offs, 256)
    c_fields = list(zip(names_fn().decode().split(), offs[:min(n, 256)]))
    py_fields = [(f[0], getattr(struct, f[0]).offset) for f in struct._fields_]
    for i in range(max(len(c_fields), len(py_fields))):
        c = c_fields[i] if i < len(c_fields) else ("(none)", -1)
        py = py_fields[i] if i < len(py_fields) else ("(none)", -1)
        if c != py:
            name = py[0] if i < len(py_fields) else c[0]
            raise RuntimeError(f"{what}: {struct.__name__} field {name!r} does not match the C struct (field {i}: "
                               f"ctypes {py[0]!r} at offset {py[1]}, C {c[0]!r} at offset {c[1]}); "
                               "binding.py and the params header differ")
    if size_fn() != ctypes.sizeof(struct):
        raise RuntimeError(f"{what}: sizeof {struct.__name__} is {ctypes.sizeof(struct)} in ctypes, {size_fn()} in C")
