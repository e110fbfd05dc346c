"""The argument checks the public API modules share (attncore.prefill, decode, pod, cascade and the wrappers'
base): dtypes by name, tensors (type, rank, dtype, device, shape), heads, indptrs, sinks, and a batch's K/V
as a paged cache or ragged tensors; and the one host read of device-side index tensors the indptr checks
need (``read_host``, ``read_together``).

Every check raises ``ValueError``/``TypeError`` naming the argument, what was given and what is accepted
(semantics.md, "Bad input").  The paged-KV utilities (``attncore.page``, ``attncore.rope``) have their own
checks in ``attncore/page/checks.py``: other rules (int64 indices, value checks skipped under CUDA-graph
capture) and FlashInfer's wording there.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from typing import List, Optional, Sequence, Tuple

import torch

from attncore.core.problem import FP8_DTYPES, dtype_name


_DTYPE_ALIASES = {
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "e5m2": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2,
}
SUPPORTED_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_KV_DTYPES = SUPPORTED_Q_DTYPES + FP8_DTYPES
ACCEPTED_Q_DTYPES = SUPPORTED_KV_DTYPES  # an fp8 q is upcast before selection (attncore.core.fp8_query)


def to_dtype(value, name: str, default: Optional[torch.dtype] = None) -> torch.dtype:
    if value is None:
        if default is None:
            raise TypeError(f"{name}: got None, expected a torch dtype or its name")
        return default
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.replace("torch.", "")
        if key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
    raise TypeError(f"{name}: got {value!r}, expected a torch dtype or one of {sorted(_DTYPE_ALIASES)}")


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name}: got {value!r}, expected one of {list(choices)}")


def check_tensor(name: str, t, *, ndim: Optional[int] = None, dtype=None, device=None,
                 shape: Optional[Sequence[Optional[int]]] = None, what: str = "") -> torch.Tensor:
    """Check a tensor argument.  ``shape`` entries of None are free; dtype may be a tuple."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor{' ' + what if what else ''}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: got a {t.dim()}-D tensor of shape {tuple(t.shape)}, expected {ndim}-D"
                         f"{' ' + what if what else ''}")
    if dtype is not None:
        ok = t.dtype in dtype if isinstance(dtype, tuple) else t.dtype == dtype
        if not ok:
            exp = ", ".join(dtype_name(d) for d in dtype) if isinstance(dtype, tuple) else dtype_name(dtype)
            raise TypeError(f"{name}: got dtype {dtype_name(t.dtype)}, expected {exp}")
    # host time (plan() and run() check several tensors): no torch.device made when one is given, and a shape
    # without free entries compared as one tuple
    if device is not None and t.device != (device if device.__class__ is torch.device else torch.device(device)):
        raise ValueError(f"{name}: got a tensor on {t.device}, expected one on {device}")
    if shape is not None:
        if len(shape) != t.dim() or (t.shape != tuple(shape) if None not in shape else
                                     any(s is not None and s != ts for s, ts in zip(shape, t.shape))):
            exp = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: got shape {list(t.shape)}, expected {exp}{' ' + what if what else ''}")
    return t


_PLAIN_KEY = (type(None), bool, int, float, str, torch.dtype)


def plain_key(*values) -> Optional[tuple]:
    """A memo key of plain scalars (None, bool, int, float, str, torch.dtype): the values and their types, so
    ``True``, ``1`` and ``1.0`` are different keys (each meets its own check); None when a value is not plain (a
    tensor, a numpy scalar): such a call is not memoized and runs every check."""
    for x in values:
        if x.__class__ not in _PLAIN_KEY:
            return None
    return values + tuple([x.__class__ for x in values])


def norm_device(d: torch.device) -> torch.device:
    """``d`` as a torch.device, a CUDA one with its index (the current device when it has none)."""
    if not isinstance(d, torch.device):  # host time: torch.device(d) costs ~2 us even when d is one
        d = torch.device(d)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def check_indptr(name: str, t: torch.Tensor, *, length: Optional[int] = None, host=None,
                 checked: bool = False) -> List[int]:
    """Validate a CSR indptr (int32, 1-D, starts at 0, non-decreasing); returns it as host ints.  ``host``:
    its values already read (``read_host``); ``checked``: the caller has checked it is a 1-D int32 tensor."""
    if not checked:
        check_tensor(name, t, ndim=1, dtype=torch.int32)
    if t.numel() < 1:
        raise ValueError(f"{name}: got an empty tensor, expected [batch_size + 1] entries starting at 0")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name}: got {t.numel()} entries, expected {length} (batch_size + 1)")
    host = host if host is not None else read_host([t])[0]
    if host[0] != 0:
        raise ValueError(f"{name}: got {name}[0] = {host[0]}, expected 0")
    if all(map(operator.le, host, host[1:])):  # in C (host time); the loop below finds the first fault
        return host
    for i in range(len(host) - 1):
        if host[i + 1] < host[i]:
            raise ValueError(f"{name}: not non-decreasing: {name}[{i}] = {host[i]} > {name}[{i + 1}] = {host[i + 1]}")
    return host


_together = threading.local()  # read_together()'s values while its block runs: id(tensor) -> (tensor, ints)


def read_host(tensors: Sequence[torch.Tensor]) -> List[List[int]]:
    """The values of int32 tensors as lists of Python ints: host tensors directly, the device ones (on one
    device) with one copy into pinned memory and one wait for it: plan()'s only device sync when the
    caller passes device-side index tensors (with host-side ones, FlashInfer's convention, none).  Inside a
    ``read_together`` block, tensors it read are answered from that read."""
    memo = getattr(_together, "values", None)
    if memo is not None:
        hits = [memo.get(id(t)) for t in tensors]
        if all(h is not None and h[0] is t for h, t in zip(hits, tensors)):
            return [list(h[1]) for h in hits]
    return _read(tensors)


@contextlib.contextmanager
def read_together(tensors: Sequence):
    """Within the block, ``read_host`` answers for ``tensors`` from one read made on entry: a plan() that
    reads several tables (BatchPOD's two parts and its decode query lengths) makes one device copy, not one
    per table.  Only 1-D int32 tensors on the first one's device are read (anything else is read and checked
    as usual when asked for); nothing during CUDA-graph capture; a nested block keeps the outer one's."""
    ts = [t for t in tensors if isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1]
    ts = [t for t in ts if t.device == ts[0].device]
    if (getattr(_together, "values", None) is not None or not ts
            or (ts[0].is_cuda and torch.cuda.is_current_stream_capturing())):
        yield
        return
    _together.values = {id(t): (t, v) for t, v in zip(ts, _read(ts))}
    try:
        yield
    finally:
        _together.values = None


def _read(tensors: Sequence[torch.Tensor]) -> List[List[int]]:
    """``read_host`` itself: every value read (one copy per device)."""
    out: List[Optional[List[int]]] = [t.tolist() if t.is_cpu else None for t in tensors]
    dev = [t for t, a in zip(tensors, out) if a is None]
    if len({t.device for t in dev}) > 1:  # rare: index tensors on several devices, one copy each
        return [a if a is not None else _read([t])[0] for t, a in zip(tensors, out)]
    if dev:
        flat = torch.cat([t.reshape(-1) for t in dev]) if len(dev) > 1 else dev[0].reshape(-1)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.device.type == "cuda")
        host.copy_(flat, non_blocking=True)
        if flat.device.type == "cuda":
            torch.cuda.current_stream(flat.device).synchronize()
        vals, a = host.tolist(), 0
        it = iter(dev)
        for i, x in enumerate(out):
            if x is None:
                n = next(it).numel()
                out[i], a = vals[a:a + n], a + n
    return out


def check_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
    for n, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{n}: got {v!r}, expected a positive int")
    if num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"num_qo_heads: got {num_qo_heads} with num_kv_heads {num_kv_heads}; "
                         f"num_qo_heads must be a multiple of num_kv_heads")


def check_sinks(sinks, num_qo_heads: int, device) -> Optional[torch.Tensor]:
    if sinks is None:
        return None
    check_tensor("sinks", sinks, ndim=1, shape=[num_qo_heads], device=device,
                 dtype=(torch.float32, torch.float16, torch.bfloat16))
    return sinks.float()


def check_paged_cache(paged_kv_cache, *, kv_layout: str, num_kv_heads: int, head_dim: int, page_size: int,
                      kv_dtype, device, max_page_id: int, name: str = "paged_kv_cache",
                      head_dim_vo: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split a paged cache into (k_cache, v_cache) 4-D views and check them against the plan (V's last
    dim against ``head_dim_vo``, default ``head_dim``)."""
    from attncore.page import unpack_paged_kv_cache

    dv = head_dim if head_dim_vo is None else head_dim_vo
    if dv != head_dim and isinstance(paged_kv_cache, torch.Tensor):
        raise ValueError(f"{name}: got one tensor of shape {tuple(paged_kv_cache.shape)}, but this plan has "
                         f"head_dim_qk {head_dim} and head_dim_vo {dv}, and a single 5-D cache holds K and V with "
                         f"one head dim; pass a tuple (k_cache, v_cache) of 4-D tensors")
    k_cache, v_cache = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    for n, t, d in ((name + " (k)", k_cache, head_dim), (name + " (v)", v_cache, dv)):
        exp = [None, page_size, num_kv_heads, d] if kv_layout == "NHD" else [None, num_kv_heads, page_size, d]
        check_tensor(n, t, shape=exp, dtype=kv_dtype, device=device,
                     what=f"({kv_layout}: [pages, {'page_size, Hkv' if kv_layout == 'NHD' else 'Hkv, page_size'}, D])")
        if t.stride(-1) != 1:
            raise ValueError(f"{n}: the last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")
    if max_page_id >= k_cache.shape[0]:
        raise ValueError(f"paged_kv_indices: page id {max_page_id} is out of range for a cache of "
                         f"{k_cache.shape[0]} pages")
    return k_cache, v_cache


def check_ragged_kv(name: str, t: torch.Tensor, *, kv_layout: str, n: int, num_kv_heads: int, head_dim: int,
                    kv_dtype, device) -> torch.Tensor:
    exp = [n, num_kv_heads, head_dim] if kv_layout == "NHD" else [num_kv_heads, n, head_dim]
    check_tensor(name, t, shape=exp, dtype=kv_dtype, device=device,
                 what=f"({kv_layout}: {'[kv_len, Hkv, D]' if kv_layout == 'NHD' else '[Hkv, kv_len, D]'})")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")
    return t
