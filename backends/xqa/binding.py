"""The one binding of the xqa backend: loads a specialization, checks run tensors, fills the
``XqaParams`` struct (ctypes mirror of ``csrc/xqa_params.h``, checked field by field at load by
``check_layout``) and launches on the current stream of the input's device.  No torch headers
anywhere: the kernel sees pointers, strides and sizes.  Inputs the kernel cannot read as given
(misaligned q or out, non-float32 sinks, a strided spec mask) go through the plan's staging slots
of the float workspace (``plan.py``), never a fresh allocation.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from attncore.build import abi
from attncore.core import current

from attncore.backends.xqa.plan import stage_view
from attncore.backends.xqa.specs import XqaKey

LOG2E = 1.4426950408889634


class XqaParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("lse", ctypes.c_void_p), ("page_table", ctypes.c_void_p), ("page_table_indptr", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p), ("sinks", ctypes.c_void_p), ("spec_mask", ctypes.c_void_p),
        ("ws_partial_o", ctypes.c_void_p), ("ws_partial_lse", ctypes.c_void_p), ("ws_counters", ctypes.c_void_p),
        ("q_stride_tok", ctypes.c_int64), ("q_stride_head", ctypes.c_int64),
        ("o_stride_tok", ctypes.c_int64), ("o_stride_head", ctypes.c_int64),
        ("lse_stride_tok", ctypes.c_int64), ("lse_stride_head", ctypes.c_int64),
        ("k_stride_page", ctypes.c_int64), ("k_stride_head", ctypes.c_int64), ("k_stride_tok", ctypes.c_int64),
        ("v_stride_page", ctypes.c_int64), ("v_stride_head", ctypes.c_int64), ("v_stride_tok", ctypes.c_int64),
        ("page_table_stride", ctypes.c_int64),
        ("batch", ctypes.c_int32), ("num_q_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
        ("group", ctypes.c_int32), ("q_len", ctypes.c_int32), ("rows", ctypes.c_int32),
        ("m_groups", ctypes.c_int32), ("num_splits", ctypes.c_int32), ("page_size_log2", ctypes.c_int32),
        ("window_left", ctypes.c_int32), ("causal", ctypes.c_int32), ("mask_words16", ctypes.c_int32),
        ("kv_cap", ctypes.c_int32), ("max_page", ctypes.c_int32),
        ("qk_scale_log2", ctypes.c_float), ("out_scale", ctypes.c_float),
        ("enable_pdl", ctypes.c_int32), ("device", ctypes.c_int32),
    ]


def check_layout(cdll, prefix: str = "xqa_params", struct=XqaParams, what: str = "xqa") -> None:
    """XqaParams of a loaded library against its C struct (``attncore.build.abi.check_layout``)."""
    abi.check_layout(cdll, prefix, struct, what)


@dataclass
class Library:
    """A loaded specialization and what it reports about itself."""

    key: XqaKey
    cdll: ctypes.CDLL
    rows: int  # packed rows per CTA (16 * MT)
    tile: int
    threads: int
    smem: int
    stages: int
    ctas_per_sm: int
    num_sms: int


_LIBS: Dict[Tuple[XqaKey, int], Library] = {}
_LOCK = threading.Lock()


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def get_library(key: XqaKey, device: torch.device) -> Library:
    """Build (first use, through :mod:`attncore.build.jit`) and load the specialization for ``device``."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    lib = _LIBS.get((key, idx))
    if lib is not None:
        return lib
    with _LOCK:
        lib = _LIBS.get((key, idx))
        if lib is None:
            from attncore.build import jit

            lib = wrap_library(key, jit.load(key.spec(), arch_of(torch.device("cuda", idx))), idx)
            _LIBS[(key, idx)] = lib
        return lib


def wrap_library(key: XqaKey, cdll: ctypes.CDLL, idx: int) -> Library:
    """Declare the entry points of a loaded specialization and read its configuration."""
    cdll.xqa_run.restype = ctypes.c_int
    cdll.xqa_run.argtypes = [ctypes.POINTER(XqaParams), ctypes.c_void_p]
    cdll.xqa_info.restype = ctypes.c_int
    cdll.xqa_info.argtypes = [ctypes.POINTER(ctypes.c_int)]
    cdll.xqa_error_string.restype = ctypes.c_char_p
    cdll.xqa_error_string.argtypes = [ctypes.c_int]
    check_layout(cdll, what=f"xqa {key.uri}")
    info = (ctypes.c_int * 8)()
    with torch.cuda.device(idx):
        cdll.xqa_info(info)
    props = torch.cuda.get_device_properties(idx)
    if info[7] == 0:
        raise RuntimeError(f"xqa: {key.uri} cannot be resident on {props.name} "
                           f"({info[3]} bytes of shared memory per CTA)")
    return Library(key, cdll, info[0], info[1], info[2], info[3], info[4], info[7], props.multi_processor_count)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _kv_strides(st, layout: str) -> Tuple[int, int, int]:
    """(page, head, token) strides of a 4-D paged cache from its stride tuple."""
    if layout == "NHD":  # [pages, page_size, Hkv, D]
        return st[0], st[2], st[1]
    return st[0], st[1], st[2]  # HND [pages, Hkv, page_size, D]


def check_kv(name: str, t: torch.Tensor, st=None) -> None:
    st = st if st is not None else t.stride()
    vec = 16 // t.element_size()
    if st[-1] != 1:
        raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {tuple(st)}")
    if t.data_ptr() % 16 or st[0] % vec or st[1] % vec or st[2] % vec:
        raise ValueError(f"{name}: xqa needs 16-byte aligned rows (data pointer and strides multiples of "
                         f"{vec} elements), got strides {tuple(st)}")


def _staged(plan, name: str, t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t`` copied (on the stream, converted to ``dtype``) into the plan's staging slot ``name``
    of the float workspace: the kernel's alignment without an allocation."""
    dst = stage_view(plan, name, t.shape, dtype or t.dtype)
    dst.copy_(t)
    return dst


def _stages_q(qs, q: torch.Tensor) -> bool:
    return qs[2] != 1 or qs[0] % 8 or qs[1] % 8 or q.data_ptr() % 16


def _stages_out(os_, out: torch.Tensor) -> bool:
    return os_[2] != 1 or os_[0] % 4 or os_[1] % 4 or out.data_ptr() % 16


def _stages_sinks(sinks: Optional[torch.Tensor]) -> bool:
    return sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous())


def _set_layout(p: XqaParams, plan, qs, os_, ks, vs, args) -> None:
    """The struct's fields that follow a run's strides and scales (not its addresses)."""
    p.q_stride_tok, p.q_stride_head = qs[0], qs[1]
    p.o_stride_tok, p.o_stride_head = os_[0], os_[1]
    p.k_stride_page, p.k_stride_head, p.k_stride_tok = _kv_strides(ks, plan.layout)
    p.v_stride_page, p.v_stride_head, p.v_stride_tok = _kv_strides(vs, plan.layout)
    if args.lse is not None:
        p.lse_stride_tok, p.lse_stride_head = args.lse.stride()
    p.max_page = min(args.k.shape[0], args.v.shape[0]) - 1  # the caches' pages (a bad id reads no further)
    p.qk_scale_log2 = plan.sm_scale * args.q_scale * args.k_scale * LOG2E * plan.fp8_fold
    p.out_scale = args.v_scale / args.o_scale * plan.fp8_fold
    p.enable_pdl = 1 if (args.enable_pdl and plan.pdl_ok) else 0


def _run(plan, p: XqaParams) -> None:
    err = plan.lib.cdll.xqa_run(ctypes.byref(p), current.stream(plan.device.index))
    if err != 0:
        raise RuntimeError(f"xqa: launch of {plan.lib.key.uri} failed: {plan.lib.cdll.xqa_error_string(err).decode()}")


def launch(plan, args) -> None:
    """Fill the params struct from ``plan`` (static fields) and ``args`` (this run's tensors) and
    launch.  Raises RuntimeError on a launch error."""
    p: XqaParams = plan.params
    q = args.q
    qs = q.stride()
    if _stages_q(qs, q):
        q = _staged(plan, "q", q)
        qs = q.stride()
    out = args.out
    os_ = out.stride()
    target = out
    if _stages_out(os_, out):
        target = stage_view(plan, "out", out.shape, out.dtype)
        os_ = target.stride()
    k, v = args.k, args.v
    ks, vs = k.stride(), v.stride()
    if plan.check_kv:
        check_kv("k_cache", k, ks)
        check_kv("v_cache", v, vs)
    p.q = q.data_ptr()
    p.k = k.data_ptr()
    p.v = v.data_ptr()
    p.out = target.data_ptr()
    _set_layout(p, plan, qs, os_, ks, vs, args)
    lse = args.lse
    p.lse = None if lse is None else lse.data_ptr()
    sinks = args.sinks
    if sinks is not None:
        if _stages_sinks(sinks):
            sinks = _staged(plan, "sinks", sinks, torch.float32)
        p.sinks = sinks.data_ptr()
    else:
        p.sinks = None
    mask = args.spec_mask if plan.spec_mask_allowed else None
    if mask is not None:
        if not mask.is_contiguous():
            mask = _staged(plan, "spec_mask", mask)
        p.spec_mask = mask.data_ptr()
        p.mask_words16 = mask.shape[-1]
    else:
        p.spec_mask = None
        p.mask_words16 = 0
    _run(plan, p)
    if target is not out:
        out.copy_(target)


def relaunch(plan, args):
    """Backend.relaunch: a copy of the plan's struct with ``args``'s strides and scales, behind a fresh pointer
    store.  A call whose tensors are not 16-byte aligned goes through ``launch`` (which stages q or out, or names
    the misaligned cache).  None where run() stages a tensor for its strides or dtype, or reads a spec mask."""
    q, out, sinks = args.q, args.out, args.sinks
    qs, os_ = q.stride(), out.stride()
    if (_stages_q(qs, q) or _stages_out(os_, out) or _stages_sinks(sinks)
            or (plan.spec_mask_allowed and args.spec_mask is not None)):
        return None
    k, v = args.k, args.v
    if plan.check_kv:  # strides are the signature's: checked once here, the addresses per call below
        check_kv("k_cache", k)
        check_kv("v_cache", v)
    p = XqaParams.from_buffer_copy(plan.params)
    _set_layout(p, plan, qs, os_, k.stride(), v.stride(), args)
    p.lse = p.sinks = p.spec_mask = None
    p.mask_words16 = 0

    def go(q, k, v, out, lse, sinks) -> None:
        if (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & 15:
            launch(plan, dataclasses.replace(args, q=q, k=k, v=v, out=out, lse=lse, sinks=sinks))
            return
        p.q, p.k, p.v, p.out = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if lse is not None:
            p.lse = lse.data_ptr()
        if sinks is not None:
            p.sinks = sinks.data_ptr()
        _run(plan, p)
    return go
