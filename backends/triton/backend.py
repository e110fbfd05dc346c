"""The Triton backend: paged/ragged attention, GQA-packed, split-KV decode, on sm80+ or Triton's
CPU interpreter (``TRITON_INTERPRET=1``).

Roles, as in every backend: this file holds the capabilities, the refusal reasons and the Backend
class; ``plan.py`` the schedule (work items and split-KV through attncore.core.schedule, the
dense / gather decisions, the workspace layout); ``binding.py`` the argument checks and launches;
``kernels/`` the Triton kernels.  ``plan()`` and ``run()`` delegate to them.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

import torch

from attncore.backends.triton import binding
from attncore.backends.triton import plan as _plan
from attncore.backends.triton.plan import GATHER_FLOP_PER_BYTE, TritonPlan, _heads_first  # noqa: F401
from attncore.core.backend import Backend, BatchMeta, RunArgs
from attncore.core.capabilities import Capabilities, Reason
from attncore.core.problem import FP8_DTYPES, AttentionProblem, dtype_name
from attncore.kernels import interpreting as _interpreting

_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FEATURES = frozenset({"window", "soft_cap", "alibi", "rope", "sinks", "fp8_scales", "return_lse"})
_OPS = frozenset({"single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode"})
DENSE_HEAD_DIMS = (64, 128, 256)  # the Hopper dense kernel's (config.dense_candidates: measured configs per head dim)
# CUDA graphs (issue 15): every op but xqa_decode, with every feature: in graph mode the plan fixes
# the launch (config, persistent grid, table addresses) at the caller's first graph-mode plan.
# (POD ops: backends/triton/pod.py adds its capabilities to TritonPODBackend.)

CAPABILITIES = (
    # CUDA, every op but xqa: out dtype = q dtype.  fp32 q and fp8 output are implemented in the
    # kernels but not yet validated on a GPU, so they are refused there for now.  head_dim_vo may
    # differ from head_dim_qk (a separate V / output head dim in kernels/attention.py; the dense
    # kernel does not serve it: _dense_serves).  xqa (FlashInfer's xqa API) has one head dim.
    Capabilities(
        ops=_OPS, devices=frozenset({"cuda"}), min_compute_capability=(8, 0),
        q_dtypes=frozenset({_F16, _BF16}), kv_dtypes=frozenset({_F16, _BF16, _E4M3, _E5M2}),
        kv_dtype_must_match_q=True, head_dim_multiple=16, max_head_dim=256, same_head_dim_vo=False,
        layouts=frozenset({"NHD", "HND"}), masks=frozenset({"none", "causal", "custom"}),
        features=_FEATURES | {"cuda_graph"},
    ),
    # CUDA xqa decode: same kernels; spec-decode mask.
    Capabilities(
        ops=frozenset({"xqa_decode"}), devices=frozenset({"cuda"}), min_compute_capability=(8, 0),
        q_dtypes=frozenset({_F16, _BF16}), kv_dtypes=frozenset({_F16, _BF16, _E4M3, _E5M2}),
        kv_dtype_must_match_q=True, head_dim_multiple=16, max_head_dim=256,
        layouts=frozenset({"NHD", "HND"}), masks=frozenset({"none", "causal", "custom"}),
        features=_FEATURES | {"spec_mask"},
    ),
    # CPU through Triton's interpreter: no bf16 (the interpreter rounds bf16 stores wrongly),
    # no fp8 output (same); fp8 KV is read correctly.  xqa as on CUDA: one head dim.
    *(Capabilities(
        ops=ops, devices=frozenset({"cpu"}),
        q_dtypes=frozenset({_F16, _F32}), kv_dtypes=frozenset({_F16, _F32, _E4M3, _E5M2}),
        kv_dtype_must_match_q=True, head_dim_multiple=16, max_head_dim=256, same_head_dim_vo=same_vo,
        layouts=frozenset({"NHD", "HND"}), masks=frozenset({"none", "causal", "custom"}),
        features=_FEATURES | {"spec_mask"},
    ) for ops, same_vo in ((_OPS, False), (frozenset({"xqa_decode"}), True))),
)

class TritonBackend(Backend):
    """Triton kernels for prefill (ragged/paged), batch decode (split-KV) and xqa decode.

    Parameters
    ----------
    config : dict, optional
        Force a launch config (block_m, block_n, num_warps, num_stages) for every plan (tuning, tests).
    kv_chunk : int, optional
        Force split-KV with partitions of this many keys (rounded up to block_n) for requests
        longer than it (tests); 0 disables splitting.  Default: decided per plan from the SM count.
    dense : bool or dict, default True
        Use the Hopper dense-prefill kernel (TMA + warp specialization, kernels/dense.py) where it
        applies; a dict forces one of its configs (tuning).  False: always the generic kernel.
    gather : bool, optional
        Paged prefill through the dense kernel: copy the batch's pages into contiguous K/V
        buffers carved from the float workspace, then run the dense kernel on them.  None
        (default): where it pays (enough FLOPs per gathered byte, see ``GATHER_FLOP_PER_BYTE``) and
        the buffers fit in ``gather_cap_mb`` and the float workspace; True: wherever the dense
        kernel serves the problem and the buffers fit (tests); False: never.
    gather_cap_mb : int, optional
        Largest pair of gather buffers a plan may use, in MiB; default: the environment
        variable ``ATTNCORE_TRITON_GATHER_MB``, else 512 (0 turns the gather off).
    """

    name = "triton"
    description = "Triton kernels: GQA-packed paged/ragged attention, split-KV decode, fp8 KV"
    capabilities = CAPABILITIES
    sends_index_tables = True  # one copy with its own tables (plan.make_plan, attncore.core.uploads)

    def __init__(self, *, config: Optional[dict] = None, kv_chunk: Optional[int] = None,
                 dense: Any = True, gather: Optional[bool] = None, gather_cap_mb: Optional[int] = None):
        self._config = config
        self._kv_chunk = kv_chunk
        self._dense = dense
        self._gather = gather
        self._env_error: Optional[Reason] = None
        if gather_cap_mb is None:
            env = os.environ.get("ATTNCORE_TRITON_GATHER_MB", "").strip()
            try:
                gather_cap_mb = int(env) if env else 512
            except ValueError:  # reported by available(): the registry must not lose the backend
                gather_cap_mb = 0
                self._env_error = Reason("ATTNCORE_TRITON_GATHER_MB", repr(env), "an integer (MiB)",
                                         "fix or unset the variable")
        self._gather_cap = int(gather_cap_mb) << 20

    # ------------------------------------------------------------------ availability
    def available(self) -> List[Reason]:
        if self._env_error is not None:
            return [self._env_error]
        try:
            import triton  # noqa: F401
        except Exception as e:  # ImportError, or a broken install
            # name the module that is really missing (numpy, which Triton's interpreter imports, say)
            missing = getattr(e, "name", None) if isinstance(e, ImportError) else None
            return [Reason("import", f"triton not importable ({type(e).__name__}: {e})",
                           "triton >= 3.0", f"pip install {missing or 'triton'}")]
        if _interpreting():
            return []
        try:
            has_cuda = torch.cuda.is_available()
        except Exception:
            has_cuda = False
        if not has_cuda:
            return [Reason("device", "no CUDA GPU and TRITON_INTERPRET unset",
                           "a CUDA GPU sm80+, or the CPU through TRITON_INTERPRET=1",
                           "set TRITON_INTERPRET=1 before importing attncore to run on the CPU (slow)")]
        ccs = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        if not any(cc >= (8, 0) for cc in ccs):
            return [Reason("compute_capability", ",".join("sm%d%d" % c for c in ccs), ">= sm80")]
        return []

    def extra_reasons(self, p: AttentionProblem) -> List[Reason]:
        r: List[Reason] = []
        interp = _interpreting()
        if p.device_type == "cpu" and not interp:
            r.append(Reason("device", "cpu without TRITON_INTERPRET=1",
                            "cuda; cpu only through Triton's interpreter",
                            "set TRITON_INTERPRET=1 before importing attncore"))
        if p.device_type == "cuda" and interp:
            r.append(Reason("device", "cuda while TRITON_INTERPRET=1", "cpu under the interpreter",
                            "unset TRITON_INTERPRET to compile for the GPU"))
        if (p.device_type == "cuda" and p.kv_dtype in FP8_DTYPES and p.compute_capability is not None
                and tuple(p.compute_capability) < (8, 9)):
            r.append(Reason("kv_dtype", dtype_name(p.kv_dtype), "fp8 KV on sm89+ (Triton's fp8 conversions)"))
        if p.spec_mask and p.op != "xqa_decode":
            r.append(Reason("feature:spec_mask", p.op, "xqa_decode only"))
        if p.op == "single_prefill" and p.page_size is not None:
            r.append(Reason("page_size", str(p.page_size), "None for single_prefill (ragged KV)"))
        if p.pos_encoding not in ("NONE", "ROPE_LLAMA", "ALIBI"):
            r.append(Reason("pos_encoding", p.pos_encoding, "{NONE, ROPE_LLAMA, ALIBI}"))
        if p.num_kv_heads <= 0 or p.num_qo_heads % p.num_kv_heads:
            r.append(Reason("num_qo_heads", f"{p.num_qo_heads}/{p.num_kv_heads}", "a multiple of num_kv_heads"))
        return r

    # ------------------------------------------------------------------ plan / run
    # POD ops (pod / batch_pod, backends/triton/pod.py): their capabilities join CAPABILITIES above and
    # their plans dispatch here, before the generic plan / run below.
    def plan(self, problem: AttentionProblem, meta: BatchMeta) -> TritonPlan:
        return _plan.make_plan(self, problem, meta)

    def run(self, plan: TritonPlan, args: RunArgs) -> None:
        binding.run(plan, args)

    def relaunch(self, plan: TritonPlan, args: RunArgs):
        return binding.relaunch(plan, args)

    @staticmethod
    def _dense_serves(p: AttentionProblem) -> bool:
        """The dense kernel serves plain prefill over ragged KV (see kernels/dense.py), and over
        paged KV once gathered (plan._gather_bytes); auto uses it on Hopper for prefill-shaped batches
        (more than 64 packed rows in some request)."""
        return (p.op in ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged")
                and p.mask in ("none", "causal") and not p.spec_mask
                and p.q_dtype in (_F16, _BF16) and p.kv_dtype == p.q_dtype and p.out_dtype == p.q_dtype
                and p.head_dim_qk == p.head_dim_vo and p.head_dim_qk in DENSE_HEAD_DIMS
                and p.pos_encoding == "NONE" and not p.soft_cap and p.window_left < 0)
