"""cuda_fa2: FA2-style CUDA attention (mma.sync m16n8k16, cp.async pipeline), sm80+.

Serves single/batch prefill (ragged or paged, NHD/HND) and batch decode (GQA rows packed into the
Q tile, split-KV with a merge kernel when the batch cannot fill the GPU).  Kernels are built on
first use by :mod:`attncore.build.jit` (or ahead with ``attncore build cuda_fa2``).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from attncore.core.backend import Backend, BatchMeta, cuda_device
from attncore.core.capabilities import Capabilities, Reason
from attncore.core.problem import DECODE_OPS, POD_OPS, AttentionProblem

from attncore.backends.cuda_fa2.dims import HEAD_DIMS, POD90_HEAD_DIMS, PREFILL90_HEAD_DIMS, PREFILL90_QK_VO
from attncore.backends.cuda_fa2.plan import PERSIST_UNITS, Fa2Plan, launch_group, make_plan

_F16 = frozenset({torch.float16, torch.bfloat16})
_KV = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2})
_OPS = frozenset({"single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode"})
_FEATURES = frozenset({"window", "soft_cap", "alibi", "rope", "sinks", "fp8_scales", "return_lse"})

_BASE = dict(
    devices=frozenset({"cuda"}),
    min_compute_capability=(8, 0),
    q_dtypes=_F16,
    kv_dtypes=_KV,
    out_dtypes=None,  # out dtype == q dtype
    head_dims=frozenset(HEAD_DIMS),
    same_head_dim_vo=True,
    max_group_size=None,  # any GQA group
    page_sizes=None,  # any page size
    layouts=frozenset({"NHD", "HND"}),
    masks=frozenset({"none", "causal", "custom"}),
    max_q_len_per_req=None,
    kv_dtype_must_match_q=True,
)
# CUDA graphs: the batch ops (plan.py: capacity grids, live counts on the device, tables at fixed
# workspace addresses); single_prefill has no wrapper that re-plans, so it does not claim them.
_BATCH_OPS = frozenset({"batch_prefill_ragged", "batch_prefill_paged", "batch_decode"})
# POD in one launch (pod.py: prefill90's POD kernel, sm_90 only): what prefill90 serves, for both parts (the decode
# part's own checks: extra_reasons); no CUDA graphs (the order table's size follows the batch)
POD_CAPABILITIES = Capabilities(
    ops=frozenset(POD_OPS), features=frozenset({"sinks", "fp8_scales", "return_lse"}),
    **{**_BASE, "min_compute_capability": (9, 0), "max_compute_capability": (9, 0), "kv_dtypes": _F16,
       "head_dims": frozenset(POD90_HEAD_DIMS), "masks": frozenset({"none", "causal"})})
# head dims qk / vo that differ (PREFILL90_QK_VO: 192 / 128, DeepSeek's prefill): prefill90 only, so what it
# serves; extra_reasons refuses other pairs of these dims
_QK_VO = dict(_BASE, min_compute_capability=(9, 0), max_compute_capability=(9, 0), kv_dtypes=_F16,
              head_dims=frozenset(d for pair in PREFILL90_QK_VO for d in pair), same_head_dim_vo=False,
              masks=frozenset({"none", "causal"}))
_QK_VO_FEATURES = frozenset({"sinks", "fp8_scales", "return_lse"})
_QK_VO_TEXT = (" or ".join(f"{a} / {b}" for a, b in PREFILL90_QK_VO)
               + " (prefill90: single, ragged and paged prefill, sm90)")
CAPABILITIES = (
    Capabilities(ops=_BATCH_OPS, features=_FEATURES | {"cuda_graph"}, **_BASE),  # not: spec_mask (xqa)
    Capabilities(ops=_OPS - _BATCH_OPS, features=_FEATURES, **_BASE),
    POD_CAPABILITIES,
    Capabilities(ops=_BATCH_OPS - {"batch_decode"}, features=_QK_VO_FEATURES | {"cuda_graph"}, **_QK_VO),
    Capabilities(ops=frozenset({"single_prefill"}), features=_QK_VO_FEATURES, **_QK_VO),
)


_KEYS: dict = {}  # CudaFa2Backend.key_for's memo


_CAPABILITY: dict = {}


def _capability(dev: torch.device):
    """``torch.cuda.get_device_capability(dev)``, asked once per device (host time: twice per prefill plan
    before); keyed by the function too, so a test that patches it is asked afresh."""
    fn = torch.cuda.get_device_capability
    key = (dev, fn)
    cc = _CAPABILITY.get(key)
    if cc is None:
        if len(_CAPABILITY) > 64:
            _CAPABILITY.clear()
        cc = _CAPABILITY[key] = tuple(fn(dev))
    return cc


def _kv_name(dt: torch.dtype, q: torch.dtype) -> str:
    if dt == torch.float8_e4m3fn:
        return "e4m3"
    if dt == torch.float8_e5m2:
        return "e5m2"
    return "same"


# The FA2 kernel's 64-row tile (prefill64) for causal prefills of fewer 128-row CTAs than this many waves.  Until the
# 128-row grid launched in kv-head groups (plan.launch_group) the bound was 6 waves (H100: P1 causal 255 against 234
# TFLOP/s).  H200, 2026-11-29, 128 / 64 rows, same runs (1 x qo = kv, 32/8 heads, d128 unless stated; waves of 264
# slots): 0.97 waves (1k) 0.0695 / 0.0524 ms, 1.21 (1280) 0.0819 / 0.0781, 1.45 (1536) 0.0928 / 0.1021, ragged 3 x 1k
# 0.1265 / 0.1432, 1.94 (2k) 0.1348 / 0.1586, 3.9 (P1) 0.473 / 0.555; d64 0.97 0.0444 / 0.0347, 1.45 0.0585 / 0.0568,
# 3.9 0.290 / 0.316 (BENCHMARKS.md 2ah)
PREFILL64_WAVES = 1.3


class CudaFa2Backend(Backend):
    name = "cuda_fa2"
    aliases = ("fa2",)
    description = "FA2-style CUDA kernels (mma.sync, cp.async), JIT-built per specialization, sm80+"
    capabilities = CAPABILITIES
    sends_index_tables = True  # one copy with its own tables (plan.make_plan, attncore.core.uploads)

    # split-KV policy knobs (tests may lower them)
    min_split_chunk = 256
    tune = ()  # tile-shape overrides for tuning runs (specs.Fa2Key.tune)
    force_config = None  # "prefill" / "prefill64" / "prefill90" / "decode" for tuning runs; None: chosen per batch
    # The Hopper prefill kernel (prefill90, sm_90a wgmma) for the prefill problems it serves;
    # ATTNCORE_FA2_SM90=0 turns it off (then every prefill takes the FA2 kernel).
    sm90 = True
    # prefill90 main loop: True = the pipelined loop (`_pipe`; warp-specialized: with ping-pong turns), False = the
    # plain loop, None = the rule: pipelined for contiguous K/V (ragged, single) and for paged K/V at d128 (on the
    # one-unit grid), plain for paged K/V at d64 / d256 / d192x128.
    # Measured on H100, 2026-11-25 (session 18, warp-specialized): P1 non-causal 0.476 vs 0.519 ms, causal 0.276 vs
    # 0.295, P2 d64 0.196 vs 0.213.  Paged d128 with the lean paged producer (Cfg90::LEAN), H200 2026-11-30, same
    # run, 7 rounds (pipelined / plain): P4 0.992 / 1.062 ms, 8 x 1k on 4k 0.901 / 0.963, 32 x 128 on 8k 1.057 /
    # 1.194, 4 x 4k 1.073 / 1.116, 8 x 2k non-causal 1.030 / 1.099, P4 page 1 1.023 / 1.050, P3 level (0.613 /
    # 0.610); paged d64 (P3 shape) 0.375 / 0.371.  (Before that producer, on H100: P4 1.217 / 1.175.)
    sm90_pipe: Optional[bool] = None
    # prefill90's pipelined loop at d128 on the persistent grid (`_persist`): True / False forced, None = the plan's
    # rule (contiguous K/V past plan.PERSIST_UNITS units per SM; paged K/V never: P4 1.118 ms against the one-unit
    # grid's 0.992, the persistent loop's producer not lean).  Never in CUDA-graph mode; with a tuning variant
    # (`tune`) only forced (the rule was measured on the shipped builds; variants_bench's `persist` form forces it)
    sm90_persist: Optional[bool] = None
    # prefill90 warp specialization (`_ws`: producer warpgroup + 3-stage mbarrier ring; see specs.py), the
    # default: measured on H100 2026-11-22 (run 4) P1 causal 439 vs 377 TFLOP/s, P3 page16 273 vs 268,
    # P4 328 vs 316 for the non-specialized plain loop, same run.
    sm90_ws = True
    # POD in one launch (pod.py): "auto" fuses inside the measured region (pod.MEASURED_WINS), "always" every
    # batch the kernel serves (tests, benchmarks); the prefill part's items are issued ``pod_weight`` times ahead of
    # their time share in the CTA order (0.5 to 4 measured within 2-10% of each other, PD1 and PD2: no better one)
    pod_fuse = "auto"
    pod_weight = 1.0
    pod_decode_chunk = None  # the decode part's KV chunk in tokens (None: pod.decode_chunk_for; 0: unsplit)

    def jit_specs(self, arch: str) -> list:
        """What ``attncore build`` prebuilds by default (specs.py; the specs themselves are arch-free)."""
        from attncore.backends.cuda_fa2 import specs

        return specs.list_specs(arch)

    def parse_jit_spec(self, uri: str):
        from attncore.backends.cuda_fa2 import specs

        return specs.parse(uri)

    def available(self) -> List[Reason]:
        from attncore.build import jit

        r = list(jit.toolchain_reasons()) + list(jit.gpu_reasons())
        if not r:
            cc = torch.cuda.get_device_capability()
            if cc < (8, 0):
                r.append(Reason("compute_capability", "sm%d%d" % cc, ">= sm80"))
        return r

    def extra_reasons(self, problem: AttentionProblem) -> List[Reason]:
        r = []
        qk, vo = problem.head_dim_qk, problem.head_dim_vo
        if qk != vo and (qk, vo) not in PREFILL90_QK_VO:
            r.append(Reason("head_dim_vo", f"{qk} / {vo} (qk / vo)", f"equal to head_dim_qk, or {_QK_VO_TEXT}"))
        elif qk == vo and qk not in _BASE["head_dims"] and qk in _QK_VO["head_dims"]:  # (the pair's entry took it)
            r.append(Reason("head_dim", str(qk),
                            f"{', '.join(map(str, sorted(_BASE['head_dims'])))}; or {_QK_VO_TEXT}"))
        elif qk != vo and problem.op not in POD_OPS:  # prefill90 alone serves the pair
            r += [Reason("head_dim_vo", f"{qk} / {vo} (qk / vo)", f"prefill90, which cannot serve it: {why}")
                  for why in self._problem_sm90_reasons(problem)]
        if problem.op in ("batch_prefill_paged", "batch_decode") and problem.page_size is not None \
                and problem.page_size < 1:
            r.append(Reason("page_size", str(problem.page_size), ">= 1"))
        if problem.op in POD_OPS and problem.decode is not None:  # the decode part, as the POD kernel runs it
            d = problem.decode
            r += [Reason("decode part", x, "what prefill90 serves (16-bit KV, d64/d128, no features)")
                  for x in self._problem_sm90_reasons(d, pod=True)]
            if d.mask != "causal":
                r.append(Reason("decode mask", d.mask, "causal"))
        return r

    def fused_pod_reason(self, prefill_tokens: int, decode_batch: int, decode_kv: int) -> Optional[str]:
        """Why the fused POD op (pod.py) would compose a batch of these sizes (None: it fuses them)."""
        from attncore.backends.cuda_fa2 import pod

        return None if self.pod_fuse == "always" else pod.outside_region(prefill_tokens, decode_batch, decode_kv)

    def _problem_sm90_reasons(self, problem: AttentionProblem, window_left: Optional[int] = None,
                              pod: bool = False) -> List[str]:
        """The problem-level reasons why prefill90 (``pod``: a part of pod90) cannot serve (device and batch checks
        aside).  ``window_left``: the batch's window (``meta.params``) once there is a batch; before (the rule
        table), the problem's selection key."""
        import os

        dims = POD90_HEAD_DIMS if pod else PREFILL90_HEAD_DIMS
        pair = (problem.head_dim_qk, problem.head_dim_vo)
        r = []
        if not self.sm90 or os.environ.get("ATTNCORE_FA2_SM90", "1") == "0":
            r.append("turned off")
        if problem.kv_dtype != problem.q_dtype:
            r.append(f"kv dtype {problem.kv_dtype} (16-bit KV only)")
        if problem.mask not in ("none", "causal"):
            r.append(f"mask {problem.mask}")
        if pair[0] != pair[1]:
            if pod or pair not in PREFILL90_QK_VO:
                r.append(f"head dims {pair[0]} / {pair[1]} (qk / vo)")
            elif not self.sm90_ws:
                r.append(f"head dims {pair[0]} / {pair[1]}: the warp-specialized loops only")
        elif problem.head_dim_qk not in dims:
            r.append(f"head dim {problem.head_dim_qk} ({', '.join(map(str, dims))})")
        if problem.soft_cap:
            r.append("soft cap")
        if problem.pos_encoding != "NONE":
            r.append(f"pos encoding {problem.pos_encoding}")
        if (problem.window_left if window_left is None else window_left) >= 0:
            r.append("sliding window")
        return r

    # ------------------------------------------------------------------------------------ plan
    def key_for(self, problem: AttentionProblem, config: str, page_size: int = 0, paged: bool = False):
        """The kernel specialization of a problem (also what ``attncore build`` and the prebuild script
        predict from problems alone): its mask is the one a batch of the problem gets,
        ``BatchMeta.resolve_mask`` (decode without a mask is causal)."""
        # memoized (host time: plan() asks for one or two keys per batch): by everything the key reads
        prefetch = config == "decode" and 0 < page_size <= 4
        memo = (problem, config, prefetch, paged, self.sm90_pipe, bool(self.sm90_ws), tuple(self.tune))
        key = _KEYS.get(memo)
        if key is None:
            if len(_KEYS) > 1024:
                _KEYS.clear()
            key = _KEYS[memo] = self._key_for(problem, config, prefetch, paged)
        return key

    def _key_for(self, problem: AttentionProblem, config: str, prefetch: bool, paged: bool):
        from attncore.backends.cuda_fa2.specs import Fa2Key

        mask = BatchMeta.resolve_mask(problem.mask, decode=problem.op in DECODE_OPS)
        dt = "bf16" if problem.q_dtype == torch.bfloat16 else "fp16"
        return Fa2Key(config, dt, _kv_name(problem.kv_dtype, problem.q_dtype), problem.head_dim_qk, mask,
                      softcap=problem.soft_cap, alibi=problem.pos_encoding == "ALIBI",
                      rope=problem.pos_encoding == "ROPE_LLAMA",
                      prefetch=prefetch,
                      pipe=config == "prefill90" and self._sm90_pipe(paged, problem.head_dim_qk),
                      ws=config == "prefill90" and bool(self.sm90_ws),
                      tune=tuple(self.tune),
                      head_dim_vo=problem.head_dim_vo if problem.head_dim_vo != problem.head_dim_qk else 0)

    def _sm90_pipe(self, paged: bool, head_dim: int) -> bool:
        """Whether prefill90 runs its pipelined loop (``sm90_pipe``; None: the rule there)."""
        if self.sm90_pipe is not None:
            return bool(self.sm90_pipe)
        return bool(self.sm90_ws) and (not paged or head_dim == 128)

    def sm90_reasons(self, problem: AttentionProblem, meta: BatchMeta, dev: torch.device) -> List[str]:
        """Why the Hopper prefill kernel (prefill90) cannot take this prefill problem ([] if it can)."""
        r = self._problem_sm90_reasons(problem, meta.params.window_left)
        cc = _capability(dev)
        if cc != (9, 0):
            r.append("compute capability %d.%d is not 9.0 (sm_90a build)" % cc)
        return r

    def choose_library(self, problem: AttentionProblem, meta: BatchMeta, dev: torch.device):
        """(library, config, sm90 reasons) for this batch: the decode tile when every request has at most
        16 packed rows, else prefill90 where it serves (its pipelined loop at d128 on the persistent grid past
        PERSIST_UNITS units per slot on contiguous K/V), else the 128-row (or, causal with few CTAs, the 64-row) FA2
        prefill tile; ``force_config`` overrides within the family."""
        from attncore.backends.cuda_fa2 import binding

        qo_lens = meta.qo_lens_host
        G, Hkv = problem.group_size, problem.num_kv_heads
        paged = meta.kv_indices is not None
        page_size = meta.page_size if paged else 0
        # head dims qk != vo: prefill90 alone has them, whatever the rows (its 128-row tile for decode-sized batches)
        pair = problem.head_dim_qk != problem.head_dim_vo
        config = "decode" if max(qo_lens, default=0) * G <= 16 and not pair else "prefill"
        sm90_why = ["decode tile"] if config == "decode" else self.sm90_reasons(problem, meta, dev)
        if self.force_config and self.force_config != "prefill90":
            sm90_why = sm90_why + [f"force_config {self.force_config}"]
        if not sm90_why:
            config = "prefill90"
        elif pair:
            dims = f"{problem.head_dim_qk} / {problem.head_dim_vo}"
            raise ValueError(f"cuda_fa2: head dims {dims} run on prefill90 only, which cannot take this batch: "
                             f"{'; '.join(sm90_why)}")
        lib = binding.get_library(self.key_for(problem, config, page_size, paged), dev)
        # the waves of this tile's CTAs (units: row tile, kv head) on the GPU
        waves = sum(-(-n * G // lib.cta_q) for n in qo_lens) * Hkv / max(1, lib.num_sms * lib.ctas_per_sm)
        if config == "prefill" and problem.mask == "causal" and problem.head_dim_qk != 256 and not self.force_config:
            # Causal prefill of under PREFILL64_WAVES waves of 128-row CTAs: 64-row tiles, twice the CTAs
            if waves < PREFILL64_WAVES:
                config = "prefill64"
        same_family = (self.force_config == "decode") == (config == "decode")
        if self.force_config and same_family:
            config = self.force_config
        key = self.key_for(problem, config, page_size, paged)
        if key.config == "prefill90" and key.pipe and key.ws and key.head_dim == 128 and not problem.cuda_graph:
            persist = self.sm90_persist
            if persist is None:
                persist = waves > PERSIST_UNITS and not key.tune and not paged
            if persist:  # (the same tile: lib's shape above stands)
                key = dataclasses.replace(key, persist=True)
        if key != lib.key:
            lib = binding.get_library(key, dev)
        return lib, config, sm90_why

    def plan(self, problem: AttentionProblem, meta: BatchMeta) -> Fa2Plan:
        """plan.py: the schedule, the scratch, the tables; binding.py: the plan-constant params.  POD ops
        (``meta``: a PODBatch): pod.py."""
        from attncore.backends.cuda_fa2 import binding

        if problem.op in POD_OPS:
            from attncore.backends.cuda_fa2 import pod

            if self.pod_fuse not in ("auto", "always"):
                raise ValueError(f"pod_fuse: got {self.pod_fuse!r}, expected 'auto' or 'always'")
            return pod.plan_pod(self, problem, meta, self.pod_weight, self.pod_fuse, self.pod_decode_chunk)
        dev = cuda_device(meta.device, "cuda_fa2")
        plan = make_plan(self, problem, meta, dev, lambda: self.choose_library(problem, meta, dev))
        plan.base, plan.merge_base = binding.base_params(plan)
        return plan

    def run(self, plan: Fa2Plan, args) -> None:
        from attncore.backends.cuda_fa2 import binding

        if not isinstance(plan, Fa2Plan):
            from attncore.backends.cuda_fa2 import pod

            return pod.run_pod(plan, args)
        binding.launch(plan, args)

    def split_launches(self, plan, sms: int, tail_sms: int):
        """prefill90 without a merge, not in CUDA-graph mode: two launches sharing the units through the plan's
        counters (Fa2Params.sched_*).  The persistent grid: ``sms`` x the CTAs per SM, starting with units 0.., then
        a tail of ``tail_sms`` x as many, each taking units left until none is.  The one-unit grid: a CTA per unit,
        then two waves of ``tail_sms``; every CTA of either takes the next unit not yet taken, if any, in the order
        plan.launch_group gives for ``sms`` SMs (the plan's is for the whole GPU)."""
        from attncore.backends.cuda_fa2 import binding

        if (not isinstance(plan, Fa2Plan) or plan.lib.key.config != "prefill90" or plan.needs_merge
                or plan.graph is not None or plan.work_grid <= 0):
            return None
        per_sm, hkv = plan.lib.ctas_per_sm, plan.problem.num_kv_heads
        if plan.lib.persistent:
            base, tail, group = sms * per_sm, tail_sms * per_sm, 0
        else:
            base, tail = plan.work_grid * hkv, 2 * tail_sms * per_sm
            group = launch_group(plan.schedule.costs, plan.lib.kv_tile, hkv, sms * per_sm)
        if base <= 0 or tail <= 0:
            return None
        return (lambda args: binding.launch(plan, args, shared=(base, base + tail, 0, group)),
                lambda args: binding.launch(plan, args, shared=(base, base + tail, 1, group)))

    def relaunch(self, plan: Fa2Plan, args):
        from attncore.backends.cuda_fa2 import binding

        return binding.relaunch(plan, args) if isinstance(plan, Fa2Plan) else None
