"""xqa: XQA-style GQA decode on tensor cores (mma.sync m16n8k16, cp.async paged pipeline), sm80/sm90.

All query heads sharing a KV head (times ``q_len_per_req`` draft rows) are packed into the M
dimension of one MMA, so every KV page is read once per group.  One CTA per (request, KV head, KV
chunk); long sequences / small batches split the KV range across CTAs and the last CTA of each
(request, KV head) merges the partials (no second launch).  Serves ``xqa_decode`` (block tables)
and ``batch_decode`` (indptr / indices, read directly: no conversion).  Kernels are built on first
use by :mod:`attncore.build.jit` (or ahead with ``attncore build xqa``).

Files: this one (capabilities, refusals, the Backend), ``plan.py`` (split-KV decision, scratch
carved from the caller's workspaces), ``binding.py`` (the ctypes params, argument checks, launch),
``specs.py`` (specializations), ``csrc/`` (kernels).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from attncore.core.backend import Backend, BatchMeta, cuda_device
from attncore.core.capabilities import Capabilities, Reason
from attncore.core.problem import AttentionProblem, dtype_name
from attncore.core.workspace import WorkspaceTooSmall

from attncore.backends.xqa.plan import XqaPlan, make_plan

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


def _kv_name(dt: torch.dtype) -> str:
    return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dt, "same")


_KEYS: dict = {}  # key_for's memo
SHARE_STAGES2 = 0.8  # plan_for_sms: at most this share of the SMs, two stages (measured at 92 of 132 and below)
SHARE_SPLITS = True  # plan_for_sms: the split count chosen for the share's SMs (False: the whole GPU's count)
_PDL: dict = {}  # device -> whether it takes programmatic dependent launch (sm90+), asked once (host time)


def _pdl_ok(dev: torch.device) -> bool:
    ok = _PDL.get(dev)
    if ok is None:
        ok = _PDL[dev] = tuple(torch.cuda.get_device_capability(dev)) >= (9, 0)
    return ok


def share_key(lib, sms: int):
    """The two-stage key of ``lib``'s (XqaBackend.plan_for_sms) for a launch on ``sms`` of its device's SMs, or
    None where that was not measured (16-bit KV, d128, <= 16 rows per CTA, at most SHARE_STAGES2 of the SMs)."""
    k = lib.key
    if (sms > SHARE_STAGES2 * lib.num_sms or k.kv != "same" or k.head_dim != 128 or k.mt != 1 or k.tune
            or lib.stages <= 2):
        return None
    return dataclasses.replace(k, tune=(("st", 2),))


class XqaBackend(Backend):
    name = "xqa"
    description = ("XQA-style GQA decode (group rows packed into mma.sync M; at <= 8 rows: keys as M; fp8 KV at "
                   "9-32 rows: O's dims split over the warps; paged cp.async, split-KV), sm80/sm90")
    capabilities = CAPABILITIES
    sends_index_tables = True  # one copy with its zeroed counters (plan.make_plan, attncore.core.uploads)
    bounds_seq_lens = True  # lengths read as at most the table's tokens, page ids as at most the caches' last page

    # Policy knobs (benchmarks and tests flip them; defaults were chosen from measurements).
    mt2_for_fp8 = True  # 17..32 rows with fp8 KV: one 32-row CTA (True) or two 16-row CTAs
    swap_for_fp8 = True  # <= 8 rows with fp8 KV: the swapped-product kernel (specs.XqaKey.swap)
    # <= 8 rows with 16-bit KV: the same (H200: decode on 92 SMs -1.4% two-stage, -5.5% three, PD2's SM
    # split -4.5%, on the whole GPU level to -1%; bench/xqa.md, session 49)
    swap_for_16bit = True
    # 9..32 rows per CTA with fp8 KV at d128: the split-dims kernel (specs.XqaKey.sd: O's dims split over the warps,
    # 4 CTAs per SM; H200: X1 q2 e4m3 0.290 -> 0.266 ms, q4 0.387 -> 0.333; bench/xqa.md, session 50)
    sd_for_fp8 = True
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
        """The kernel specialization of a problem; memoized by everything it reads (host time: one per plan)."""
        memo = (problem, q_len, bool(self.mt2_for_fp8), bool(self.swap_for_fp8), bool(self.swap_for_16bit),
                bool(self.sd_for_fp8), tuple(self.tune))
        key = _KEYS.get(memo)
        if key is None:
            if len(_KEYS) > 1024:
                _KEYS.clear()
            key = _KEYS[memo] = self._key_for(problem, q_len)
        return key

    def _key_for(self, problem: AttentionProblem, q_len: int):
        from attncore.backends.xqa.specs import XqaKey

        rows = problem.group_size * q_len
        d = problem.head_dim_qk
        fp8 = problem.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        mt = 1 if (rows <= 16 or d == 256 or (fp8 and not self.mt2_for_fp8)) else 2
        swap = rows <= 8 and bool(self.swap_for_fp8 if fp8 else self.swap_for_16bit)
        return XqaKey("bf16" if problem.q_dtype == torch.bfloat16 else "fp16", _kv_name(problem.kv_dtype),
                      "e4m3" if problem.out_dtype == torch.float8_e4m3fn else "same", d, mt, tuple(self.tune),
                      swap=swap, sd=fp8 and not swap and d == 128 and bool(self.sd_for_fp8))

    def plan(self, problem: AttentionProblem, meta: BatchMeta) -> XqaPlan:
        from attncore.backends.xqa import binding

        dev = cuda_device(meta.device, "xqa")
        lib = binding.get_library(self.key_for(problem, meta.q_len_per_req), dev)
        return make_plan(problem, meta, lib, dev, split_override=self.split_override,
                         pdl_ok=_pdl_ok(dev))

    def plan_for_sms(self, plan: XqaPlan, sms: int) -> Optional[XqaPlan]:
        """A plan for ``sms`` of the SMs (POD's SM split); None where ``plan`` serves as well.
        - The split count chosen for the CTAs resident on those SMs (``SHARE_SPLITS``): PD1's decode (64 x 4k,
          32/8 heads, one split: 512 CTAs) fits 2 waves on 92 SMs but needs a third of 8 CTAs on 84, each reading a
          whole request (0.33 ms against 0.26, H200 2026-11-29, BENCHMARKS.md 2y).  Where the count differs, the
          summation order does: the result equals the whole-GPU plan's within the tolerance rule, not bit for bit.
        - 16-bit KV at d128 with <= 16 rows per CTA, on at most ``SHARE_STAGES2`` of the SMs: two 32 KB stages
          instead of three, so three CTAs fit an SM instead of two and each SM reads faster.  PD1's decode on 92 /
          76 / 68 SMs: 0.276 / 0.293 / 0.309 ms against 0.301 / 0.360 / 0.355 with three stages; on all 132 SMs
          three stages stay faster (0.252 against 0.258; BENCHMARKS.md 2x)."""
        from attncore.backends.xqa import binding

        lib, key = plan.lib, share_key(plan.lib, sms)
        if key is not None:
            lib = binding.get_library(key, plan.device)
        meta = dataclasses.replace(plan.meta, int_workspace=None)
        new = None
        if SHARE_SPLITS and self.split_override is None:
            try:
                new = make_plan(plan.problem, meta, lib, plan.device, pdl_ok=plan.pdl_ok, sms=sms)
            except WorkspaceTooSmall:  # the caller's float workspace holds the plan's partials, not more
                new = None
        if new is None and lib is not plan.lib:
            new = make_plan(plan.problem, meta, lib, plan.device, split_override=plan.num_splits, pdl_ok=plan.pdl_ok)
        if new is None or (lib is plan.lib and new.num_splits == plan.num_splits):
            return None
        return new

    def run(self, plan: XqaPlan, args) -> None:
        from attncore.backends.xqa import binding

        binding.launch(plan, args)

    def relaunch(self, plan: XqaPlan, args):
        from attncore.backends.xqa import binding

        return binding.relaunch(plan, args)
