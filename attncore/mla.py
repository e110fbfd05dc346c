"""DeepSeek MLA over a paged latent cache: FlashInfer 0.2.14's ``flashinfer.mla.BatchMLAPagedAttentionWrapper``.

The absorbed form (docs/semantics.md, "MLA"): per query token and head, ``q = concat(q_nope, q_pe)``
attends to the keys ``concat(ckv, kpe)`` of its request's pages (one latent KV head shared by every
query head), the values are ``ckv``; ``sm_scale`` is the caller's; causal is bottom-right aligned;
LSE base 2; a row that sees no key gives output 0 and LSE ``-inf``.

Implementations: the Triton kernel ``attncore.kernels.mla`` (CUDA fp16/bf16; the CPU
through Triton's interpreter, fp16/fp32) and the reference ``attncore.reference.mla`` (torch, float32, any
device).  MLA is called directly here rather than through the registry / selector: the registry's
problem model (``AttentionProblem``: Hq/Hkv heads, head_dim_qk/vo, one K and one V cache) has no axis for a
split key (ckv + kpe) whose first part is also the value, and only these two implementations exist.
``backend=``: ``"auto"`` and FlashInfer's ``"fa2"`` (its portable MLA kernel) run Triton (the reference on a
CPU without the interpreter), ``"triton"`` / ``"reference"`` force one, FlashInfer's other values are
refused with the reason (``attncore.core.registry.resolve``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from attncore.core import checks as _checks
from attncore.core import params as _params
from attncore.core import registry as _registry
from attncore.kernels import check_interpreted, interpreting
from attncore.page.checks import _check_page_size
from attncore.reference import mla as _ref

__all__ = ["BatchMLAPagedAttentionWrapper"]

_INT = torch.int32
# Default launch config (kernels/mla.py explains the register / shared-memory budget on sm90): rows per
# program (heads x query tokens), keys per step, warps, pipeline stages.
CONFIG = {"block_m": 32, "block_n": 32, "num_warps": 8, "num_stages": 2}
_TRITON_DTYPES = {"cuda": (torch.float16, torch.bfloat16), "cpu": (torch.float16, torch.float32)}


def _kernel():
    from attncore.backends.triton.plugin import _maybe_enable_interpreter

    _maybe_enable_interpreter()  # before the kernel module is first imported (decorated)
    from attncore.kernels.mla import mla_paged_fwd

    return mla_paged_fwd


def _implementation(backend, device: torch.device) -> str:
    """``backend=`` -> "triton" or "reference" (module docstring)."""
    name = backend.strip() if isinstance(backend, str) else backend
    if name in (None, "auto", "fa2"):
        canon = "auto"
    else:
        canon = _registry.resolve(name)  # FlashInfer's fa3 / cutlass / trtllm-gen refused here, with the reason
    if canon in ("auto", "cuda_fa2"):
        return "triton" if device.type == "cuda" or (device.type == "cpu" and interpreting()) else "reference"
    if canon in ("triton", "reference"):
        return canon
    raise ValueError(f"backend={backend!r}: the {canon!r} backend has no MLA kernel; MLA runs on 'triton' "
                     f"(what 'auto' and 'fa2' pick) or 'reference'")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _Plan:
    __slots__ = ("batch", "num_heads", "dc", "dp", "page_size", "causal", "sm_scale", "q_dtype", "kv_dtype",
                 "qo_host", "kv_indptr_host", "kv_lens_host", "max_page", "qo_dev", "kv_indptr_dev",
                 "kv_indices_dev", "kv_lens_dev", "grid", "block_q", "block_h")


class BatchMLAPagedAttentionWrapper:
    """MLA attention over a paged latent cache (module docstring); FlashInfer 0.2.14's signatures.

    ``use_cuda_graph=True``: ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_len_arr`` are the fixed int32
    device buffers every ``plan()`` copies into (the batch size is fixed by ``kv_len_arr``'s length); the
    launch (grid, block shape) is fixed at the first plan, and a later plan whose longest query needs more
    query tiles than that grid covers is an error.  ``run()`` allocates only ``out``/``lse`` when not given.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: Optional[torch.Tensor] = None, kv_indptr: Optional[torch.Tensor] = None,
                 kv_indices: Optional[torch.Tensor] = None, kv_len_arr: Optional[torch.Tensor] = None,
                 backend: str = "auto") -> None:
        _checks.check_tensor("float_workspace_buffer", float_workspace_buffer)
        self._float_workspace_buffer = float_workspace_buffer  # kept for FlashInfer's API; the kernel needs none
        self.device = _checks.norm_device(float_workspace_buffer.device)
        self._impl = _implementation(backend, self.device)
        self._backend = backend
        self._use_cuda_graph = bool(use_cuda_graph)
        self._buffers = None
        if self._use_cuda_graph:
            bufs = {"qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_len_arr": kv_len_arr}
            for name, t in bufs.items():
                if t is None:
                    raise ValueError(f"{name}: use_cuda_graph=True needs the fixed {name} buffer that every plan() "
                                     f"copies into (a captured launch keeps its address)")
                _checks.check_tensor(name, t, ndim=1, dtype=_INT, device=self.device)
            b = kv_len_arr.numel()
            for name in ("qo_indptr", "kv_indptr"):
                if bufs[name].numel() != b + 1:
                    raise ValueError(f"{name}: got a buffer of {bufs[name].numel()} entries, expected {b + 1} "
                                     f"(batch_size + 1; kv_len_arr's {b} entries fix the batch size)")
            self._buffers = bufs
        self._plan: Optional[_Plan] = None
        self._graph_launch = None  # (grid, block_q, block_h) fixed at the first graph-mode plan

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    # ------------------------------------------------------------------------------------------- plan
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type, kv_data_type, use_profiler: bool = False) -> None:
        """Check the batch and upload its index tensors (FlashInfer 0.2.14's positional order)."""
        if use_profiler:
            raise ValueError("use_profiler: attncore's MLA kernel has no intra-kernel profiler; pass False")
        for name, v in (("num_heads", num_heads), ("head_dim_ckv", head_dim_ckv), ("head_dim_kpe", head_dim_kpe)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: got {v!r}, expected a positive int")
        if self._impl == "triton":
            for name, v in (("head_dim_ckv", head_dim_ckv), ("head_dim_kpe", head_dim_kpe)):
                if v < 16 or v & (v - 1):
                    raise ValueError(f"{name}: got {v}; the Triton MLA kernel takes powers of two >= 16 (DeepSeek's "
                                     f"are 512 and 64); backend='reference' takes any")
        _check_page_size(page_size)
        if not isinstance(causal, bool):
            raise TypeError(f"causal: got {causal!r}, expected a bool")
        if sm_scale is None:
            raise TypeError("sm_scale: required for MLA (FlashInfer's tests use 1/sqrt(192), the head dim before "
                            "absorption); got None")
        sm_scale = _params.scale("sm_scale", sm_scale)
        q_dtype = _checks.to_dtype(q_data_type, "q_data_type")
        kv_dtype = _checks.to_dtype(kv_data_type, "kv_data_type")
        if kv_dtype != q_dtype:
            raise TypeError(f"kv_data_type: got {kv_dtype}, expected q_data_type {q_dtype} (MLA reads one dtype)")
        accepted = _TRITON_DTYPES.get(self.device.type, ()) if self._impl == "triton" else \
            (torch.float16, torch.bfloat16, torch.float32)
        if q_dtype not in accepted:
            raise TypeError(f"q_data_type: got {q_dtype}; the {self._impl} MLA implementation on {self.device.type} "
                            f"takes {', '.join(map(str, accepted))}")
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_len_arr", kv_len_arr)):
            _checks.check_tensor(name, t, ndim=1, dtype=_INT)
        qo_h, kv_h, lens_h = _checks.read_host([qo_indptr, kv_indptr, kv_len_arr])  # one device read
        qo_h = _checks.check_indptr("qo_indptr", qo_indptr, host=qo_h)
        b = len(qo_h) - 1
        _checks.check_tensor("kv_len_arr", kv_len_arr, shape=[b], what="([batch_size])")
        # at least batch_size + 1 entries; those past it are not read, as FlashInfer reads them (its own
        # test_batch_mla_varlen_page_attention passes two extra entries)
        if len(kv_h) < b + 1:
            raise ValueError(f"kv_indptr: got {len(kv_h)} entries, expected at least {b + 1} (batch_size + 1)")
        kv_h = _checks.check_indptr("kv_indptr", kv_indptr[: b + 1], host=kv_h[: b + 1])
        n_used = kv_h[-1]
        if kv_indices.numel() < n_used:
            raise ValueError(f"kv_indices: got {kv_indices.numel()} entries, expected at least kv_indptr[-1] = {n_used}")
        for i, n in enumerate(lens_h):
            pages = kv_h[i + 1] - kv_h[i]
            if n < 0 or n > pages * page_size:
                raise ValueError(f"kv_len_arr: got kv_len_arr[{i}] = {n} for a request of {pages} pages of "
                                 f"{page_size}; expected 0 <= kv_len <= {pages * page_size}")
        lo, hi = _checks.read_host([torch.stack(torch.aminmax(kv_indices[:n_used]))])[0] if n_used else (0, -1)
        if lo < 0:
            raise ValueError(f"kv_indices: got a negative page id {lo}, expected ids >= 0")

        p = _Plan()
        p.batch, p.num_heads, p.dc, p.dp, p.page_size = b, num_heads, head_dim_ckv, head_dim_kpe, page_size
        p.causal, p.sm_scale, p.q_dtype, p.kv_dtype = causal, float(sm_scale), q_dtype, kv_dtype
        p.qo_host, p.kv_indptr_host, p.kv_lens_host, p.max_page = qo_h, kv_h, lens_h, hi
        max_qo = max((qo_h[i + 1] - qo_h[i] for i in range(b)), default=0)
        self._upload(p, kv_indices, n_used)
        if self._impl == "triton":
            self._launch_shape(p, max_qo)
        self._plan = p
        self._causal, self._sm_scale, self._page_size = causal, p.sm_scale, page_size

    def _upload(self, p: _Plan, kv_indices: torch.Tensor, n_used: int) -> None:
        """The index tensors on the device: copies (never the caller's tensors, which may change after plan),
        into the fixed buffers in graph mode."""
        dev = self.device
        host = {"qo_indptr": p.qo_host, "kv_indptr": p.kv_indptr_host, "kv_len_arr": p.kv_lens_host}
        if self._buffers is not None:
            bufs = self._buffers
            if p.batch != bufs["kv_len_arr"].numel():
                raise ValueError(f"qo_indptr: got a batch of {p.batch} requests; this use_cuda_graph wrapper was built "
                                 f"for {bufs['kv_len_arr'].numel()} (its buffers' size)")
            if bufs["kv_indices"].numel() < n_used:
                raise ValueError(f"kv_indices: {n_used} page ids do not fit the fixed kv_indices buffer of "
                                 f"{bufs['kv_indices'].numel()} entries given at construction")
            for name, vals in host.items():
                bufs[name].copy_(torch.tensor(vals, dtype=_INT), non_blocking=False)
            bufs["kv_indices"][:n_used].copy_(kv_indices[:n_used], non_blocking=True)
            p.qo_dev, p.kv_indptr_dev, p.kv_lens_dev = bufs["qo_indptr"], bufs["kv_indptr"], bufs["kv_len_arr"]
            p.kv_indices_dev = bufs["kv_indices"]
            return
        p.qo_dev, p.kv_indptr_dev, p.kv_lens_dev = (torch.tensor(host[n], dtype=_INT).to(dev, non_blocking=True)
                                                    for n in ("qo_indptr", "kv_indptr", "kv_len_arr"))
        p.kv_indices_dev = kv_indices[:n_used].to(dev, copy=True, non_blocking=True) if n_used else \
            torch.zeros(1, dtype=_INT, device=dev)

    def _launch_shape(self, p: _Plan, max_qo: int) -> None:
        """Rows per program = heads x query tokens (``CONFIG['block_m']``): all of a head block's heads first,
        then more tokens of the same request while rows remain."""
        block_h = min(_pow2(p.num_heads), CONFIG["block_m"])
        block_q = max(1, min(CONFIG["block_m"] // block_h, _pow2(max(max_qo, 1))))
        if block_q * block_h < 16:  # tl.dot needs 16 rows: pad with (masked) tokens
            block_q = 16 // block_h
        grid = (-(-p.num_heads // block_h), max(-(-max_qo // block_q), 1), p.batch)  # kernels/mla.py: head blocks first
        if max(grid[1:]) > 65535:
            raise ValueError(f"qo_indptr: {p.batch} requests of up to {max_qo} tokens exceed the launch grid's 65535 "
                             f"requests / query tiles; split the batch")
        if self._use_cuda_graph:
            if self._graph_launch is None:
                self._graph_launch = (grid, block_q, block_h, p.num_heads)
            grid, block_q, block_h, heads = self._graph_launch
            if heads != p.num_heads or max_qo > grid[1] * block_q:
                raise ValueError(f"qo_indptr: this use_cuda_graph wrapper's launch was fixed at its first plan "
                                 f"({grid[1] * block_q} query tokens per request at most, {heads} heads); got a "
                                 f"request of {max_qo} tokens with {p.num_heads} heads: build another wrapper")
        p.grid, p.block_q, p.block_h = grid, block_q, block_h

    # -------------------------------------------------------------------------------------------- run
    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None, return_lse: bool = False,
            profiler_buffer: Optional[torch.Tensor] = None, kv_len: Optional[torch.Tensor] = None,
            page_table: Optional[torch.Tensor] = None):
        """``out [nnz, num_heads, head_dim_ckv]`` (and ``lse [nnz, num_heads]`` float32, base 2, when
        ``return_lse``).  A given ``lse`` is written whether or not ``return_lse`` is set (as FlashInfer does)."""
        p = self._plan
        if p is None:
            raise RuntimeError("BatchMLAPagedAttentionWrapper.run() called before plan()")
        if profiler_buffer is not None:
            raise ValueError("profiler_buffer: attncore's MLA kernel has no intra-kernel profiler")
        for name, t in (("kv_len", kv_len), ("page_table", page_table)):
            if t is not None:
                raise ValueError(f"{name}: FlashInfer's cutlass-backend argument; this wrapper reads the plan's "
                                 f"kv_len_arr and page table (backend='cutlass' is refused at construction)")
        nnz, dev = p.qo_host[-1], self.device
        _checks.check_tensor("q_nope", q_nope, shape=[nnz, p.num_heads, p.dc], dtype=p.q_dtype, device=dev,
                             what="([qo_indptr[-1], num_heads, head_dim_ckv])")
        _checks.check_tensor("q_pe", q_pe, shape=[nnz, p.num_heads, p.dp], dtype=p.q_dtype, device=dev,
                             what="([qo_indptr[-1], num_heads, head_dim_kpe])")
        _checks.check_tensor("ckv_cache", ckv_cache, shape=[None, p.page_size, p.dc], dtype=p.kv_dtype, device=dev,
                             what="([num_pages, page_size, head_dim_ckv])")
        _checks.check_tensor("kpe_cache", kpe_cache, shape=[ckv_cache.shape[0], p.page_size, p.dp], dtype=p.kv_dtype,
                             device=dev, what="([num_pages, page_size, head_dim_kpe], ckv_cache's pages)")
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")
        if p.max_page >= ckv_cache.shape[0]:
            raise ValueError(f"kv_indices: page id {p.max_page} is out of range for a cache of {ckv_cache.shape[0]} "
                             f"pages (ckv_cache.shape[0])")
        if out is None:
            out = torch.empty((nnz, p.num_heads, p.dc), dtype=p.q_dtype, device=dev)
        else:
            _checks.check_tensor("out", out, shape=[nnz, p.num_heads, p.dc], dtype=p.q_dtype, device=dev)
        if lse is None and return_lse:
            lse = torch.empty((nnz, p.num_heads), dtype=torch.float32, device=dev)
        elif lse is not None:
            _checks.check_tensor("lse", lse, shape=[nnz, p.num_heads], dtype=torch.float32, device=dev)
        if self._impl == "reference":
            _ref.mla_paged(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr=p.qo_host, kv_indptr=p.kv_indptr_host,
                           kv_indices=p.kv_indices_dev, kv_lens=p.kv_lens_host, causal=p.causal, sm_scale=p.sm_scale,
                           dtype=torch.float32, out=out, lse=lse)
        elif nnz and ckv_cache.shape[0] == 0:  # no pages at all: every row sees no key (no launch on empty caches)
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        elif nnz:
            self._run_triton(p, q_nope, q_pe, ckv_cache, kpe_cache, out, lse)
        return (out, lse) if return_lse else out

    def run_return_lse(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, **kw):
        """``run(..., return_lse=True)``."""
        return self.run(q_nope, q_pe, ckv_cache, kpe_cache, out=out, lse=lse, return_lse=True, **kw)

    def _run_triton(self, p: _Plan, q_nope, q_pe, ckv_cache, kpe_cache, out, lse) -> None:
        kernel = _kernel()
        check_interpreted(kernel, self.device, "attncore.mla", "CPU tensors need TRITON_INTERPRET=1 and CUDA "
                          "tensors need it unset (or pass backend='reference')")
        write_lse = lse is not None
        lse_arg = lse if write_lse else out  # never written (WRITE_LSE False)
        kernel[p.grid](
            q_nope, q_pe, ckv_cache, kpe_cache, out, lse_arg,
            p.qo_dev, p.kv_indptr_dev, p.kv_indices_dev, p.kv_lens_dev,
            p.sm_scale * math.log2(math.e), p.num_heads,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
            ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1),
            out.stride(0), out.stride(1), lse.stride(0) if write_lse else 0, lse.stride(1) if write_lse else 0,
            PAGE_SIZE=p.page_size, D_CKV=p.dc, D_KPE=p.dp, BLOCK_Q=p.block_q, BLOCK_H=p.block_h,
            BLOCK_N=CONFIG["block_n"], CAUSAL=p.causal, WRITE_LSE=write_lse,
            num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"])

