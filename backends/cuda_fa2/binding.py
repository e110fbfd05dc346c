"""The one binding of cuda_fa2: argument checks, the ctypes params struct, launches.

Mirrors ``csrc/fa2_params.h`` (``check_params_layout`` compares every field's name and offset with
the library's at load).  Launches on ``torch.cuda.current_stream()`` of the input's device; the
library sets that device itself.
"""

from __future__ import annotations

import ctypes
import math
from typing import Dict, Optional, Tuple

import torch

from attncore.build import jit
from attncore.core import current
from attncore.build.abi import check_layout

from attncore.backends.cuda_fa2.specs import Fa2Key

LOG2E = 1.4426950408889634

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32
_f32 = ctypes.c_float


class Fa2Params(ctypes.Structure):
    _fields_ = [
        ("q", _p), ("k", _p), ("v", _p), ("o", _p), ("lse", _p), ("o_part", _p), ("lse_part", _p),
        ("qo_indptr", _p), ("kv_indptr", _p), ("kv_indices", _p), ("kv_lens", _p),
        ("mask", _p), ("mask_indptr", _p), ("sinks", _p), ("alibi_slopes", _p), ("work", _p),
        ("work_count", _p), ("sched", _p),
        ("q_stride_n", _i64), ("q_stride_h", _i64),
        ("k_stride_p", _i64), ("k_stride_n", _i64), ("k_stride_h", _i64),
        ("v_stride_p", _i64), ("v_stride_n", _i64), ("v_stride_h", _i64),
        ("o_stride_n", _i64), ("o_stride_h", _i64),
        ("num_qo_heads", _i32), ("num_kv_heads", _i32), ("group", _i32), ("page_size", _i32),
        ("num_work", _i32), ("window_left", _i32), ("device", _i32),
        ("one_req", _i32), ("one_qo_start", _i32), ("one_qo_len", _i32), ("one_kv_len", _i32), ("one_kv_base", _i32),
        ("scale_log2", _f32), ("softcap_pre", _f32), ("softcap_post", _f32), ("out_scale", _f32),
        ("rope_rcp_scale", _f32), ("rope_log2_theta", _f32), ("page_shift", _i32), ("kv_same_strides", _i32),
        ("k_row_unit", _i32), ("k_row_sp", _i32), ("k_row_sn", _i32),
        ("v_row_unit", _i32), ("v_row_sp", _i32), ("v_row_sn", _i32),
        ("sched_base", _i32), ("sched_ctas", _i32), ("sched_steal", _i32), ("head_group", _i32),
        ("kv_rows", _i64),
    ]


class Fa2MergeParams(ctypes.Structure):
    _fields_ = [
        ("o_part", _p), ("lse_part", _p), ("o", _p), ("lse", _p), ("merge_table", _p), ("merge_count", _p),
        ("sinks", _p),
        ("o_stride_n", _i64), ("o_stride_h", _i64),
        ("num_qo_heads", _i32), ("num_rows", _i32), ("device", _i32), ("out_scale", _f32),
    ]


def check_params_layout(cdll) -> None:
    """Both params structs of a loaded cuda_fa2 library against Fa2Params / Fa2MergeParams."""
    check_layout(cdll, "fa2_params", Fa2Params, "cuda_fa2")
    check_layout(cdll, "fa2_merge_params", Fa2MergeParams, "cuda_fa2")


class Fa2Library:
    """A loaded specialization: typed entry points and its tile config."""

    def __init__(self, key: Fa2Key, device: torch.device):
        self.key = key
        arch = jit.current_arch(device)
        self.lib = jit.load(key.spec(), arch)
        lib = self.lib
        lib.fa2_error_string.restype = ctypes.c_char_p
        lib.fa2_error_string.argtypes = [ctypes.c_int]
        lib.fa2_info.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.fa2_run.argtypes = [ctypes.POINTER(Fa2Params), ctypes.c_void_p]
        lib.fa2_merge.argtypes = [ctypes.POINTER(Fa2MergeParams), ctypes.c_void_p]
        if key.config == "pod90":
            lib.fa2_run_pod.argtypes = [ctypes.POINTER(Fa2Params), ctypes.POINTER(Fa2Params), ctypes.c_void_p,
                                        ctypes.c_int, ctypes.c_void_p]
        check_params_layout(lib)
        info = (ctypes.c_int * 8)()
        self._check(lib.fa2_info(info, device.index if device.index is not None else torch.cuda.current_device()),
                    "fa2_info")
        self.cta_q, self.kv_tile, self.threads, self.smem, self.head_dim, self.ctas_per_sm, self.num_sms = \
            info[0], info[1], info[2], info[3], info[4], max(1, info[5]), max(1, info[6])
        self.persistent = bool(info[7])  # prefill90's persistent grid (CudaFa2Backend.split_launches sizes by it)

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            msg = self.lib.fa2_error_string(err).decode()
            raise RuntimeError(f"cuda_fa2 {self.key.uri}: {what} failed: CUDA error {err} ({msg})")

    def run(self, params: Fa2Params, stream: int) -> None:
        self._check(self.lib.fa2_run(ctypes.byref(params), ctypes.c_void_p(stream)), "launch")

    def run_pod(self, prefill: Fa2Params, decode: Fa2Params, order: int, n: int, stream: int) -> None:
        """pod90: both parts' items in one grid of ``n`` CTA columns, ``order`` (int32 [n], device) naming each."""
        self._check(self.lib.fa2_run_pod(ctypes.byref(prefill), ctypes.byref(decode), ctypes.c_void_p(order), n,
                                         ctypes.c_void_p(stream)), "POD launch")

    def merge(self, params: Fa2MergeParams, stream: int) -> None:
        self._check(self.lib.fa2_merge(ctypes.byref(params), ctypes.c_void_p(stream)), "merge launch")


_LIBS: Dict[Tuple[Fa2Key, int], Fa2Library] = {}


def get_library(key: Fa2Key, device: torch.device) -> Fa2Library:
    device = torch.device(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    lib = _LIBS.get((key, idx))
    if lib is None:
        lib = _LIBS[(key, idx)] = Fa2Library(key, torch.device("cuda", idx))
    return lib


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError("cuda_fa2: " + msg)


def kv_strides(t: torch.Tensor, paged: bool, layout: str) -> Tuple[int, int, int]:
    """(page, token, head) strides in elements of a K or V tensor."""
    if paged:
        _need(t.dim() == 4, f"paged k/v must be 4-D [pages, ...], got shape {tuple(t.shape)}")
        if layout == "NHD":
            return t.stride(0), t.stride(1), t.stride(2)
        return t.stride(0), t.stride(2), t.stride(1)
    _need(t.dim() == 3, f"ragged k/v must be 3-D, got shape {tuple(t.shape)}")
    if layout == "NHD":
        return 0, t.stride(0), t.stride(1)
    return 0, t.stride(1), t.stride(0)


def row_units(name: str, t: torch.Tensor, sp: int, sn: int, page_size: int) -> Tuple[int, int, int]:
    """(unit, page, slot) for prefill90's 32-bit paged row offsets: row (p, s) of a K or V cache starts
    at (p * page + s * slot) * unit elements.  The unit is the token stride when it divides the page
    stride (every usual layout: the offset counts rows), else 16 bytes."""
    pages = t.shape[0]
    sp = sp if pages > 1 else 0
    sn = sn if page_size > 1 else 0
    if sn > 0 and sp % sn == 0:
        unit = sn
    elif sn == 0 and sp > 0:
        unit = sp
    else:
        unit = 16 // t.element_size()  # strides are multiples of 16 bytes (check_run_tensors)
    unit = max(unit, 1)
    rsp, rsn = sp // unit, sn // unit
    _need((pages - 1) * rsp + (page_size - 1) * rsn < 2 ** 31,
          f"{name}: the paged cache is too large for 32-bit row offsets ({pages} pages of stride {sp} elements)")
    return unit, rsp, rsn


def check_run_tensors(plan, args) -> None:
    """Checks that protect memory safety of the launch (the API checks the rest)."""
    pr = plan.problem
    q, k, v, out = args.q, args.k, args.v, args.out
    dev = plan.device
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        _need(t.device == dev, f"{name} is on {t.device}, plan was made for {dev}")
        _need(t.stride(-1) == 1, f"{name} last dim must be contiguous (stride {t.stride(-1)})")
        _need(t.data_ptr() % 16 == 0, f"{name} must be 16-byte aligned")
    _need(q.dtype == pr.q_dtype, f"q dtype {q.dtype}, plan has {pr.q_dtype}")
    _need(k.dtype == pr.kv_dtype and v.dtype == pr.kv_dtype, f"k/v dtype {k.dtype}/{v.dtype}, plan has {pr.kv_dtype}")
    _need(out.dtype == pr.q_dtype, f"out dtype {out.dtype}, expected {pr.q_dtype}")
    _need(q.dim() == 3 and q.shape[0] == plan.nnz_q and q.shape[1] == pr.num_qo_heads and q.shape[2] == pr.head_dim_qk,
          f"q shape {tuple(q.shape)}, plan expects [{plan.nnz_q}, {pr.num_qo_heads}, {pr.head_dim_qk}]")
    want = (plan.nnz_q, pr.num_qo_heads, pr.head_dim_vo)
    _need(tuple(out.shape) == want, f"out shape {tuple(out.shape)}, plan expects {list(want)}")
    _need(k.shape[-1] == pr.head_dim_qk and v.shape[-1] == pr.head_dim_vo, "k/v head dim mismatch")
    for name, t in (("q", q), ("out", out)):
        _need(t.stride(1) % 8 == 0 and t.stride(0) % 8 == 0, f"{name} strides must be multiples of 8 elements")
    for name, t in (("k", k), ("v", v)):
        _need(all((s * t.element_size()) % 16 == 0 or d == 1 for s, d in zip(t.stride()[:-1], t.shape[:-1])),
              f"{name} strides {t.stride()} must be multiples of 16 bytes")
    if args.lse is not None:
        _need(args.lse.dtype == torch.float32 and args.lse.is_contiguous() and
              tuple(args.lse.shape) == (plan.nnz_q, pr.num_qo_heads) and args.lse.device == dev,
              f"lse must be contiguous float32 [{plan.nnz_q}, {pr.num_qo_heads}] on {dev}")
    if args.sinks is not None:
        _need(args.sinks.dtype == torch.float32 and args.sinks.numel() == pr.num_qo_heads and args.sinks.is_contiguous()
              and args.sinks.device == dev, f"sinks must be contiguous float32 [{pr.num_qo_heads}] on {dev}")
    _need(pr.sinks == (args.sinks is not None), "sinks given at run() but not planned (or planned but missing)")


def base_params(plan) -> Tuple[Fa2Params, Optional[Fa2MergeParams]]:
    """The plan-constant part of the structs (index tensors, tables, heads); filled once in plan().
    In CUDA-graph mode every field here is the same across re-plans of one caller (fixed buffers,
    capacity grids, the live counts read through ``work_count`` / ``merge_count``)."""
    pr, meta, ap = plan.problem, plan.meta, plan.meta.params
    graph = plan.graph is not None
    p = Fa2Params()
    p.o_part, p.lse_part = _ptr(plan.part_o), _ptr(plan.part_lse)
    p.qo_indptr, p.kv_indptr = meta.qo_indptr.data_ptr(), meta.kv_indptr.data_ptr()
    p.kv_indices = _ptr(meta.kv_indices) if plan.paged else None
    p.kv_lens = meta.kv_lens.data_ptr()
    p.mask, p.mask_indptr = _ptr(plan.mask), _ptr(plan.mask_indptr)
    p.alibi_slopes = _ptr(plan.alibi_slopes)
    p.work = plan.work.data_ptr()
    p.work_count = plan.counts[0:1].data_ptr() if graph else None
    p.sched = plan.sched.data_ptr()
    p.num_qo_heads, p.num_kv_heads, p.group = pr.num_qo_heads, pr.num_kv_heads, pr.group_size
    p.page_size = plan.page_size if plan.paged else 0
    ps = p.page_size
    p.page_shift = ps.bit_length() - 1 if ps > 0 and ps & (ps - 1) == 0 else -1
    p.num_work = plan.work_grid
    p.head_group = plan.head_group
    p.one_req = plan.one_req
    if plan.one_req:
        p.one_qo_start, p.one_qo_len = meta.qo_indptr_host[0], meta.qo_lens_host[0]
        p.one_kv_len, p.one_kv_base = meta.kv_lens_host[0], meta.kv_indptr_host[0]
    p.window_left = ap.window_left if ap.window_left is not None and ap.window_left >= 0 else -1
    p.device = plan.device.index
    p.rope_rcp_scale = 1.0 / ap.rope_scale
    p.rope_log2_theta = math.log2(ap.rope_theta)
    mp = None
    if plan.needs_merge:
        mp = Fa2MergeParams()
        mp.o_part, mp.lse_part = plan.part_o.data_ptr(), plan.part_lse.data_ptr()
        mp.merge_table = plan.merge_table.data_ptr()
        mp.merge_count = plan.counts[1:2].data_ptr() if graph else None
        mp.num_qo_heads, mp.num_rows, mp.device = pr.num_qo_heads, plan.merge_grid, plan.device.index
    return p, mp


def _signature(args) -> tuple:
    q, k, v, out, lse, sinks = args.q, args.k, args.v, args.out, args.lse, args.sinks
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
            v.dtype, out.shape, out.stride(), out.dtype, out.device,
            None if lse is None else (lse.shape, lse.stride(), lse.dtype, lse.device),
            None if sinks is None else (sinks.shape, sinks.stride(), sinks.dtype, sinks.device))


def build_params(plan, args) -> Tuple[Optional[Fa2Params], Optional[Fa2MergeParams]]:
    """The launch structs of one run(): ``plan.base`` / ``plan.merge_base`` with the run's tensors and
    scales (None, None when there is no query row).  What ``launch`` passes by value to the kernels
    (and what a CUDA graph captures): split from the launch so it can be checked without a GPU.

    Full argument checks run on the first call and whenever shapes/strides/dtypes/devices change;
    the plan-constant part of the struct is prebuilt, so a steady-state run() is a few field stores.
    """
    sig = _signature(args)
    if sig != plan.checked_sig:
        check_run_tensors(plan, args)
        pr = plan.problem
        plan.kv_strides = kv_strides(args.k, plan.paged, pr.kv_layout) + kv_strides(args.v, plan.paged, pr.kv_layout)
        plan.base.kv_same_strides = int(plan.kv_strides[:3] == plan.kv_strides[3:])
        if plan.paged:
            b, ks = plan.base, plan.kv_strides
            b.k_row_unit, b.k_row_sp, b.k_row_sn = row_units("k", args.k, ks[0], ks[1], plan.page_size)
            b.v_row_unit, b.v_row_sp, b.v_row_sn = row_units("v", args.v, ks[3], ks[4], plan.page_size)
        else:  # the tokens of ragged K / V (prefill90's TMA maps)
            tok = 0 if pr.kv_layout == "NHD" else 1
            plan.base.kv_rows = min(args.k.shape[tok], args.v.shape[tok])
        plan.checked_sig = sig
    if plan.nnz_q == 0:
        return None, None
    _check_aligned(args.q, args.k, args.v, args.out)
    # the structs of this signature and these scales, made once per plan: a launch passes them by value (a
    # captured graph keeps the values), so the next run() may overwrite the pointers
    key = (sig, args.q_scale, args.k_scale, args.v_scale, args.o_scale)
    hit = plan.structs.get(key)
    if hit is None:
        if len(plan.structs) > 16:
            plan.structs.clear()
        hit = plan.structs[key] = _structs(plan, args)
    p, mp = hit
    _set_pointers(p, mp, args.q, args.k, args.v, args.out, args.lse, args.sinks)
    return p, mp


def _check_aligned(q, k, v, out) -> None:
    # test the ints: a c_void_p field reads back None for 0, the data_ptr() of an empty K/V (kv_len 0)
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & 15:
        raise ValueError("cuda_fa2: q, k, v and out must be 16-byte aligned")


def _set_pointers(p, mp, q, k, v, out, lse, sinks) -> None:
    """A run's tensors' addresses into its launch structs (the merge's too)."""
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    if lse is not None:
        p.lse = lse.data_ptr()
    if sinks is not None:
        p.sinks = sinks.data_ptr()
    if mp is not None:
        mp.o = out.data_ptr()
        if lse is not None:
            mp.lse = lse.data_ptr()
        if sinks is not None:
            mp.sinks = sinks.data_ptr()


def _structs(plan, args) -> Tuple[Fa2Params, Optional[Fa2MergeParams]]:
    """The launch structs of a run's signature and scales: the plan's base with strides and scales (the
    pointers are set per run by build_params)."""
    ap = plan.meta.params
    q, out = args.q, args.out
    p = Fa2Params.from_buffer_copy(plan.base)
    p.q_stride_n, p.q_stride_h = q.stride(0), q.stride(1)
    p.k_stride_p, p.k_stride_n, p.k_stride_h, p.v_stride_p, p.v_stride_n, p.v_stride_h = plan.kv_strides
    p.o_stride_n, p.o_stride_h = out.stride(0), out.stride(1)
    scale = ap.sm_scale * args.q_scale * args.k_scale
    cap = ap.logits_soft_cap if ap.logits_soft_cap and ap.logits_soft_cap > 0 else 0.0
    p.scale_log2 = scale * LOG2E
    if cap:
        p.softcap_pre = scale / cap
        p.softcap_post = cap * LOG2E
    p.out_scale = args.v_scale / args.o_scale
    mp = None
    if plan.needs_merge:
        mp = Fa2MergeParams.from_buffer_copy(plan.merge_base)
        mp.o_stride_n, mp.o_stride_h = out.stride(0), out.stride(1)
        mp.out_scale = p.out_scale
    return p, mp


def relaunch(plan, args):
    """Backend.relaunch: the launch structs run() made for ``args``'s signature and scales, behind a fresh
    pointer store and the alignment check (the one-call key holds shapes and strides, not addresses); None
    before a run() of that signature, and where there is nothing to launch."""
    sig = _signature(args)
    hit = plan.structs.get((sig, args.q_scale, args.k_scale, args.v_scale, args.o_scale))
    if hit is None or sig != plan.checked_sig or plan.nnz_q == 0:
        return None
    p, mp = hit
    run, merge, index = plan.lib.run, plan.lib.merge, plan.device.index

    def go(q, k, v, out, lse, sinks) -> None:
        _check_aligned(q, k, v, out)
        _set_pointers(p, mp, q, k, v, out, lse, sinks)
        stream = current.stream(index)
        run(p, stream)
        if mp is not None:
            merge(mp, stream)
    return go


def launch(plan, args, shared: Optional[Tuple[int, int, int, int]] = None) -> None:
    """Launch a plan (plan.Fa2Plan) on ``RunArgs``: the main kernel, then the merge of split partials.  ``shared``:
    (sched_base, sched_ctas, sched_steal, head_group) of prefill90's grid sharing its units with a second launch
    (Fa2Params.sched_*; CudaFa2Backend.split_launches: a plan without a merge)."""
    p, mp = build_params(plan, args)
    if p is None:
        return
    if shared is not None:
        p = Fa2Params.from_buffer_copy(p)  # (the struct is kept per signature: leave it as it was)
        p.sched_base, p.sched_ctas, p.sched_steal, p.head_group = shared
    stream = current.stream(plan.device.index)
    plan.lib.run(p, stream)
    if mp is not None:
        plan.lib.merge(mp, stream)
