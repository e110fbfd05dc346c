"""xqa: XQA-style GQA decode on tensor cores (mma.sync m16n8k16, cp.async paged pipeline), sm80/sm90.

All query heads sharing a KV head (times ``q_len_per_req`` draft rows) are packed into the M
dimension of one MMA, so every KV page is read once per group.  One CTA per (request, KV head, KV
chunk); long sequences / small batches split the KV range across CTAs and the last CTA of each
(request, KV head) merges the partials (no second launch).  Serves ``xqa_decode`` (block tables)
and ``batch_decode`` (indptr / indices, read directly: no conversion).  Kernels are built on first
use by :mod:`attncore.build.jit` (or ahead with ``attncore build xqa``).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from attncore.core.backend import Backend, BatchMeta, cuda_device
from attncore.core.capabilities import Capabilities, Reason
from attncore.core.problem import AttentionProblem, dtype_name

_F16 = frozenset({torch.float16, torch.bfloat16})
_KV = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2})
_PAGES = frozenset({1, 2, 4, 8, 16, 32, 64, 128})
_COMMON = dict(
    devices=frozenset({"cuda"}),
    min_compute_capability=(8, 0),
    max_compute_capability=(9, 0),
    q_dtypes=_F16,
    kv_dtypes=_KV,
    head_dims=frozenset({64, 128, 256}),
    same_head_dim_vo=True,
    max_group_size=None,  # any GQA group: rows beyond 32 go to further m-groups
    page_sizes=_PAGES,
    layouts=frozenset({"NHD", "HND"}),
    masks=frozenset({"none", "causal"}),
    max_q_len_per_req=None,
    kv_dtype_must_match_q=True,
)

CAPABILITIES = (
    Capabilities(
        ops=frozenset({"xqa_decode"}),
        out_dtypes=frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn}),  # e4m3 only with fp8 KV
        features=frozenset({"window", "sinks", "fp8_scales", "return_lse", "spec_mask", "cuda_graph"}),
        **_COMMON,
    ),
    Capabilities(
        ops=frozenset({"batch_decode"}),
        out_dtypes=None,  # out dtype == q dtype
        features=frozenset({"window", "sinks", "fp8_scales", "return_lse", "cuda_graph"}),
        **_COMMON,
    ),
)

_SUPPORTED_CC = ((8, 0), (9, 0))


@dataclass
class XqaPlan:
    problem: AttentionProblem
    meta: BatchMeta
    lib: Any  # binding.Library
    device: torch.device
    params: Any  # binding.XqaParams with the static fields filled
    layout: str
    sm_scale: float
    fp8_fold: float
    pdl_ok: bool
    spec_mask_allowed: bool
    check_kv: bool
    num_splits: int
    m_groups: int
    # tensors the launch reads: kept alive here
    page_table: torch.Tensor
    page_table_indptr: Optional[torch.Tensor]
    seq_lens: torch.Tensor
    workspace: Optional[torch.Tensor]


_POOLS: dict = {}
_POOL_LOCK = threading.Lock()


def _graph_pool(kind: str, dev: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-initialised buffer of at least ``numel`` elements for CUDA-graph plans.  Grow-only and
    never freed: every buffer handed out stays valid for graphs captured with it.  The kernel leaves
    the counters at zero after each launch; sharing is safe for launches ordered on one stream."""
    key = (kind, dev.index)
    with _POOL_LOCK:
        bufs = _POOLS.setdefault(key, [])
        if bufs and bufs[-1].numel() >= numel:
            return bufs[-1]
        size = max(numel, 2 * bufs[-1].numel() if bufs else 0, 1 << 16)
        t = torch.zeros(size, dtype=dtype, device=dev)
        bufs.append(t)
        return t


def _kv_name(dt: torch.dtype) -> str:
    return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dt, "same")


class XqaBackend(Backend):
    name = "xqa"
    description = "XQA-style GQA decode (group rows packed into mma.sync M, paged cp.async, split-KV), sm80/sm90"
    capabilities = CAPABILITIES

    # Policy knobs (benchmarks and tests flip them; defaults were chosen from measurements).
    mt2_for_fp8 = True  # 17..32 rows with fp8 KV: one 32-row CTA (True) or two 16-row CTAs
    split_override: Optional[int] = None  # force the split-KV count (None: cost model)
    tune: tuple = ()  # kernel tuning options for every key (specs.XqaKey.tune; tuning runs only)

    def jit_specs(self, arch: str) -> list:
        """What ``attncore build`` prebuilds by default (specs.py; the specs themselves are arch-free)."""
        from attncore.backends.xqa import specs

        return specs.list_specs(arch)

    def parse_jit_spec(self, uri: str):
        from attncore.backends.xqa import specs

        return specs.parse(uri)

    def available(self) -> List[Reason]:
        from attncore.build import jit

        r = list(jit.toolchain_reasons()) + list(jit.gpu_reasons())
        if not r:
            cc = tuple(torch.cuda.get_device_capability())
            if cc not in _SUPPORTED_CC:
                r.append(Reason("compute_capability", "sm%d%d" % cc, "sm80, sm90",
                                "the kernels' shared-memory tiling targets A100/H100"))
        return r

    def extra_reasons(self, problem: AttentionProblem) -> List[Reason]:
        r = []
        cc = problem.compute_capability
        if problem.device_type == "cuda" and cc is not None and tuple(cc) not in _SUPPORTED_CC:
            r.append(Reason("compute_capability", "sm%d%d" % tuple(cc), "sm80, sm90"))
        if problem.kv_dtype == torch.uint8:
            r.append(Reason("kv_dtype", "uint8 (NVFP4 packed KV with kv_cache_sf)", "fp16, bf16, e4m3, e5m2",
                            "NVFP4 KV is not implemented by xqa"))
        if problem.out_dtype != problem.q_dtype:
            if problem.out_dtype != torch.float8_e4m3fn:
                r.append(Reason("out_dtype", dtype_name(problem.out_dtype),
                                f"same as q ({dtype_name(problem.q_dtype)}) or e4m3 with an fp8 KV cache"))
            elif problem.kv_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                r.append(Reason("out_dtype", "e4m3 with a 16-bit KV cache", "e4m3 output only with an fp8 KV cache"))
        return r

    # ------------------------------------------------------------------------------------ plan
    def key_for(self, problem: AttentionProblem, q_len: int):
        from attncore.backends.xqa.specs import XqaKey

        rows = problem.group_size * q_len
        d = problem.head_dim_qk
        fp8 = problem.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        mt = 1 if (rows <= 16 or d == 256 or (fp8 and not self.mt2_for_fp8)) else 2
        return XqaKey("bf16" if problem.q_dtype == torch.bfloat16 else "fp16", _kv_name(problem.kv_dtype),
                      "e4m3" if problem.out_dtype == torch.float8_e4m3fn else "same", d, mt, tuple(self.tune))

    def plan(self, problem: AttentionProblem, meta: BatchMeta) -> XqaPlan:
        from attncore.backends.xqa import binding

        dev = cuda_device(meta.device, "xqa")
        B = meta.batch_size
        QL = meta.q_len_per_req
        G = problem.group_size
        Hkv = problem.num_kv_heads
        D = problem.head_dim_qk
        ps = meta.page_size
        if ps & (ps - 1):
            raise ValueError(f"xqa: page_size {ps} is not a power of two")
        key = self.key_for(problem, QL)
        lib = binding.get_library(key, dev)
        R = G * QL
        m_groups = -(-R // lib.rows)

        # ---- page table and kv lengths (the batch's, int32 on the device: read directly by the kernel)
        seq = meta.kv_lens
        if problem.op == "xqa_decode":
            bt = meta.block_tables
            if bt.stride(-1) != 1:
                bt = bt.contiguous()
            page_table, indptr, pt_stride = bt, None, bt.stride(0)
            max_len = meta.max_seq_len
        else:
            page_table, indptr, pt_stride = meta.kv_indices, meta.kv_indptr, 0
            max_len = max(meta.kv_lens_host, default=0)
        if page_table.data_ptr() == 0:  # empty (no pages at all): never read, but keep a valid pointer
            page_table = torch.zeros(1, dtype=torch.int32, device=dev)

        # ---- split-KV
        wl = meta.params.window_left
        eff = min(max_len, wl + QL + lib.tile) if wl >= 0 else max_len
        max_tiles = -(-eff // lib.tile)
        base = B * Hkv * m_groups
        fixed = meta.fixed_split_size
        if self.split_override:
            splits = max(1, min(128, int(self.split_override)))
        elif meta.disable_split_kv:
            splits = 1
        elif fixed:
            splits = max(1, min(128, -(-max_tiles // max(1, -(-fixed // lib.tile)))))
        elif problem.cuda_graph:
            # A captured launch is replayed after re-planning for new lengths, and must equal an
            # eager run of the new plan bit for bit: the split count (which sets the summation
            # order) may depend on the frozen batch shape only, not on the lengths.  The kernel
            # divides each request's own range by it at run time.
            slots = lib.num_sms * lib.ctas_per_sm
            splits = 1 if 2 * base >= slots else min(64, -(-slots // base))
        else:
            splits = binding.choose_splits(base, max_tiles, lib.num_sms * lib.ctas_per_sm)
        ws = None
        params = binding.XqaParams()
        if splits > 1:
            units = B * Hkv * m_groups
            n_o = units * splits * lib.rows * D
            n_l = units * splits * lib.rows
            n_c = units
            # one zeroed buffer: counters first (reset by the kernel after every merge), then partials
            off_l = -(-n_c // 64) * 64
            off_o = off_l + -(-n_l // 64) * 64
            if problem.cuda_graph:
                # A captured graph keeps these addresses after this plan is dropped (the API
                # re-plans every step and replays): take them from grow-only per-device pools that
                # live as long as the process.  Counters get their own always-zero buffer, so a
                # later plan's partials never land on an earlier plan's counters.
                cnt = _graph_pool("counters", dev, n_c, torch.int32)
                part = _graph_pool("partials", dev, off_o - off_l + n_o, torch.float32)
                params.ws_counters = cnt.data_ptr()
                params.ws_partial_lse = part.data_ptr()
                params.ws_partial_o = part.data_ptr() + 4 * (off_o - off_l)
                ws = part
            else:
                ws = torch.zeros(off_o + n_o, dtype=torch.float32, device=dev)
                base_ptr = ws.data_ptr()
                params.ws_counters = base_ptr
                params.ws_partial_lse = base_ptr + 4 * off_l
                params.ws_partial_o = base_ptr + 4 * off_o

        params.page_table = page_table.data_ptr()
        params.page_table_indptr = indptr.data_ptr() if indptr is not None else None
        params.page_table_stride = pt_stride
        params.seq_lens = seq.data_ptr()
        params.batch = B
        params.num_q_heads = problem.num_qo_heads
        params.num_kv_heads = Hkv
        params.group = G
        params.q_len = QL
        params.rows = R
        params.m_groups = m_groups
        params.num_splits = splits
        params.page_size_log2 = int(math.log2(ps))
        params.window_left = wl
        params.causal = 1 if meta.mask == "causal" else 0
        params.device = dev.index
        fold = 1.0  # the kernel folds its own fp8 widening scale (sm_80 software path)
        return XqaPlan(problem=problem, meta=meta, lib=lib, device=dev, params=params, layout=problem.kv_layout,
                       sm_scale=float(meta.params.sm_scale), fp8_fold=fold,
                       pdl_ok=tuple(torch.cuda.get_device_capability(dev)) >= (9, 0),
                       spec_mask_allowed=problem.op == "xqa_decode", check_kv=True, num_splits=splits,
                       m_groups=m_groups, page_table=page_table, page_table_indptr=indptr, seq_lens=seq,
                       workspace=ws)

    def run(self, plan: XqaPlan, args) -> None:
        from attncore.backends.xqa import binding

        binding.launch(plan, args)
