"""POD (prefill-on-decode): a prefill and a decode batch in one call, in one of four modes (``mode``).

* ``"fused"``: a backend's fused op (``pod`` / ``batch_pod``, ``attncore.core.problem.pod_problem``) runs
  both parts in one launch; ``fuse=False`` skips it.  The parts are composed (the backends chosen for a
  single or batch prefill and a batch decode) when no backend claims it, when ``auto``'s pick ranks below
  the reference (Triton's interpreter on the CPU), or when its plan() declines the batch (``PODDeclined``:
  fused would not win); ``fused_reason`` says which, ``backend`` names what ran.
* ``"sm_split"`` (``overlap="sm_split"``, and ``overlap="auto"`` on sm_90 where its model says the split
  gains): composed at the same time on disjoint sets of SMs, the prefill on one CUDA green context's stream,
  the decode on the other's (``attncore.core.green``), both forked from the current stream and joined back
  before run() returns; the split is chosen per pair of parts (``attncore.core.streams.choose_split``) and
  ``sm_split`` gives the SMs of the last run.  CUDA-graph capture records it.
* ``"streams"`` (``overlap="streams"``): composed at the same time, the prefill on the current stream, the
  decode on a side stream forked from it (one per device and priority per wrapper, at the current stream's
  priority) and joined back before run() returns.  CUDA-graph capture records the fork and the join.
* ``"serial"``: composed one after the other on the current stream: ``overlap="serial"``, ``overlap="auto"``
  where the split's model says it would not gain or off sm_90, on a device without streams (the CPU), under
  torch.compile (no fork in a compiled region), or when the caller's float workspace cannot hold both parts'
  scratch side by side; ``overlap_reason`` says why.

LSEs are returned when asked for (FlashInfer drops them); decode-side ``*_d`` arguments either match the
plan (``None``: as planned) or raise.  Workspaces: parts that run at the same time never share scratch.
The single POD's prefill uses the one-call workspace, its decode the caller's; the batch POD gives each
part half of the caller's float workspace where they may run at the same time, the whole of it to both when
they always run in turn.
Int workspaces are plan-scoped, so each plan has its own: the caller's goes to the decode part, the fused
plan's work list to the wrapper's own (``INT_WORKSPACE_BYTES``), the batch prefill part keeps its wrapper's.
"""

from __future__ import annotations

from typing import Optional

import dataclasses

import torch

from attncore.core import _api
from attncore.core import checks as _checks
from attncore.core import ops as _ops
from attncore.core import params as _params
from attncore.core import plan_cache as _plan_cache
from attncore.core import ranking as _ranking
from attncore.core import selector as _selector
from attncore.core.backend import RunArgs
from attncore.core.page_table import _paged_kv_lens, read_whole
from attncore.core.problem import PODBatch, PODDeclined, PODRunArgs, pod_problem
from attncore.core.streams import Streams, decode_bytes, halves, prefill_flops
from attncore.core.workspace import WorkspaceTooSmall
from attncore.core.single_prefill import plan_single
from attncore.core.wrapper import _plain
from attncore.decode import BatchDecodeWithPagedKVCacheWrapper
from attncore.prefill import BatchPrefillWithPagedKVCacheWrapper

Tensor = torch.Tensor


def _same(name: str, given, planned) -> None:
    if given is not None and given != planned:
        raise ValueError(f"{name}: got {given!r}, but the decode side was planned with {planned!r}; "
                         f"plan again to change it (or pass None)")


INT_WORKSPACE_BYTES = 8 << 20  # the fused plan's work list: 16 B per item, ~500k items


class _Fuser:
    """The fused-op choice of one POD wrapper: the backend and plan for the last pair of parts, or why
    the parts are composed (``reason``)."""

    def __init__(self, requested: str, device: torch.device, fuse: bool = True):
        if not isinstance(fuse, bool):
            raise TypeError(f"fuse: got {fuse!r}, expected True or False")
        self.fuse = fuse
        self.requested = requested
        self.device = device
        self.reason: Optional[str] = None
        self.backend_name: Optional[str] = None
        self._last = None  # (key, metas, result)
        self._chosen: dict = {}  # (op, prefill problem, decode problem) -> _choose_fused's answer
        self._int_ws: Optional[Tensor] = None

    def plan(self, op: str, pp, mp, pd, md):
        """(backend, plan) to run the parts fused, or None (``reason`` says why)."""
        key = (op, pp, pd)
        if self._last is not None and self._last[0] == key and self._last[1][0] is mp and self._last[1][1] is md:
            self.reason, self.backend_name = self._last[3]
            return self._last[2]
        res, self.backend_name = None, None
        if not self.fuse:
            self.reason = "fuse=False: the parts are composed"
            return None
        # the fused problem's backend and rank (or why none), kept per parts' problems: a serving step plans
        # new metas every step with the same problems, and selecting again cost ~1 ms of its first run
        chosen = self._chosen.get(key)
        if chosen is None:
            chosen = self._chosen[key] = _choose_fused(op, pp, pd, self.requested)
            if len(self._chosen) > 64:
                self._chosen = {key: chosen}
        problem, backend, rank, why = chosen
        try:
            if why is not None:
                self.reason = why
            elif self.requested == "auto" and rank.rank < 0:
                self.reason = (f"auto: {backend.name}, the only claimant of {op}, ranks below the reference here "
                               f"({rank.describe()}); the parts are composed")
            else:
                if self._int_ws is None:  # the wrapper's own plan-scoped workspace (work lists)
                    self._int_ws = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
                md_own = dataclasses.replace(md, int_workspace=self._int_ws)
                res = (backend, backend.plan(problem, PODBatch(prefill=mp, decode=md_own)))
                self.reason, self.backend_name = None, backend.name
        except PODDeclined as e:
            self.reason = f"{backend.name} declined to fuse this batch: {e}"
        except ValueError as e:  # the batch cannot be fused (too big for the workspace...): composing serves it
            self.reason = f"parts cannot be fused: {e}"
        self._last = (key, (mp, md), res, (self.reason, self.backend_name))
        return res


def _choose_fused(op: str, pp, pd, requested: str) -> tuple:
    """(the fused problem, its backend, the backend's rank, None), or (None, None, None, why not)."""
    try:
        problem = pod_problem(op, pp, pd)
        backend = _selector.select(problem, requested)
    except _selector.BackendSelectionError as e:
        return None, None, None, f"no backend runs {op} fused: {e}"
    except ValueError as e:  # the parts disagree (pod_problem): composing still serves them
        return None, None, None, f"parts cannot be fused: {e}"
    return problem, backend, _ranking.rule_rank(backend, problem), None


def _ready(planned, args: RunArgs) -> None:
    """Plan the run-time variant ``planned.run(args)`` will use now, on the current stream: a lazy plan
    (LSE, sinks, fp8 scales not planned) uploads its tables, which must not happen on the side stream."""
    planned.serving(args)


def _paged_args(wrapper, q_d, cache, q_scale, k_scale, v_scale, return_lse) -> RunArgs:
    """A part's RunArgs, checked as the wrapper's run() checks them.  A signature the wrapper checked since its
    last plan() (in its run() or here: its run cache, ``_BatchWrapper._launch``) is not checked again."""
    planned = wrapper._planned
    p = planned.problem
    key = hit = None
    if _plain(q_scale, k_scale, v_scale):
        tk = _plan_cache.tkey
        kvk = tk(cache) if cache.__class__ is torch.Tensor else (
            tuple(map(tk, cache)) if isinstance(cache, (tuple, list)) else None)
        if kvk is not None:
            key = (tk(q_d), kvk, None, None, return_lse, None, q_scale, k_scale, v_scale)  # _launch's, no out/lse
            hit = wrapper._run_cache.get(key)
    if hit is None:
        wrapper._check_q(q_d)
        k, v = wrapper._paged_kv(cache)
        scales = tuple(_params.scale(n, x) for n, x in (("q_scale", q_scale), ("k_scale", k_scale),
                                                       ("v_scale", v_scale)))
        if key is not None:  # after every check; the plan's own run(), its relaunch after a second use
            if len(wrapper._run_cache) > 64:
                wrapper._run_cache.clear()
            wrapper._run_cache[key] = [scales, planned.run, None]
    else:
        scales = hit[0]
        k, v = wrapper._kv_views.of(cache) if cache.__class__ is torch.Tensor else cache
    rows = q_d.shape[0]
    out = torch.empty((rows, p.num_qo_heads, p.head_dim_vo), dtype=p.out_dtype, device=q_d.device)
    lse = torch.empty((rows, p.num_qo_heads), dtype=torch.float32, device=q_d.device) if return_lse else None
    return RunArgs(q=q_d, k=k, v=v, out=out, lse=lse, q_scale=scales[0], k_scale=scales[1], v_scale=scales[2])


def _variant(problem, lse: bool, fp8: bool):
    """The problem of a part as a run with (or without) an LSE and fp8 scales needs it, as
    ``_api.Planned.run`` derives it (POD runs take no sinks); the planned problem itself when the run adds
    nothing (so the fuser's memo compares by identity)."""
    if (problem.return_lse or not lse) and (problem.fp8_scales or not fp8):
        return problem
    return problem.replace(return_lse=problem.return_lse or lse, fp8_scales=problem.fp8_scales or fp8)


def _result(args: RunArgs):
    return (args.out, args.lse) if args.lse is not None else args.out


class _Modes:
    """What the last run of a POD wrapper did, and why (both wrappers)."""

    @property
    def fused_reason(self) -> Optional[str]:
        """Why the last run composed the parts (None after a fused run or before any run)."""
        return self._fuser.reason

    @property
    def mode(self) -> Optional[str]:
        """How the last eager run ran: ``"fused"`` (one launch), ``"sm_split"`` (the parts composed at the same
        time on disjoint SMs), ``"streams"`` (composed on two CUDA streams at the same time), ``"serial"``
        (composed, one after the other); None before a run.  Under torch.compile the composed parts run one
        after the other (and ``mode`` is not updated)."""
        return self._streams.mode

    @property
    def sm_split(self) -> Optional[tuple]:
        """(prefill SMs, decode SMs) of the last run when it was an SM split, else None."""
        return self._streams.sms

    @property
    def overlap_reason(self) -> Optional[str]:
        """Why the last run's composed parts ran one after the other (None after a fused or streams run)."""
        return self._streams.reason


class PODWithPagedKVCacheWrapper(_Modes):
    """Single-request prefill (dense K/V) + batch decode (paged) in one call (FlashInfer-compatible)."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 paged_kv_indptr_buffer: Optional[Tensor] = None, paged_kv_indices_buffer: Optional[Tensor] = None,
                 paged_kv_last_page_len_buffer: Optional[Tensor] = None, jit_args=None, *, backend: str = "auto",
                 fuse: bool = True, overlap: str = "auto"):
        """``fuse`` (attncore): False always composes the parts (benchmarks time the composed paths so).
        ``overlap`` (attncore): how composed parts run: ``"sm_split"`` at the same time on disjoint SMs (CUDA
        green contexts), ``"streams"`` on two CUDA streams (the decode on a side stream), ``"serial"`` one after
        the other, ``"auto"`` (the default) split where ``attncore.core.streams.choose_split`` says it gains
        on sm_90, else serial.
        The single prefill's scratch is the one-call workspace, the decode's the caller's: they never
        share one, so running them at the same time needs no split of the caller's workspace."""
        self._decode = BatchDecodeWithPagedKVCacheWrapper(
            float_workspace_buffer, kv_layout, use_cuda_graph, False, paged_kv_indptr_buffer,
            paged_kv_indices_buffer, paged_kv_last_page_len_buffer, backend=backend, jit_args=jit_args)
        self._requested_backend = backend
        self._kv_layout = kv_layout
        self._prefill_backend: Optional[str] = None
        self._fuser = _Fuser(backend, self._decode._device, fuse)
        self._streams = Streams(overlap, self._decode._device)
        # run()'s fast path: {signature of a run's arguments: (decode plan, prefill plan, the prefill's output shape,
        # dtype and LSE, its scales)}, as the checks produced them; emptied by plan()
        self._run_memo: dict = {}

    @property
    def backend(self) -> Optional[str]:
        """``"fused=<name>"`` after a fused run, else ``"prefill=<name> decode=<name>"`` (decode part
        known after plan)."""
        if self._decode.backend is None:
            return None
        if self._fuser.backend_name is not None:
            return f"fused={self._fuser.backend_name}"
        return f"prefill={self._prefill_backend or '?'} decode={self._decode.backend}"

    def reset_workspace_buffer(self, float_workspace_buffer: Tensor, int_workspace_buffer: Optional[Tensor] = None):
        """The decode part takes both (the single prefill has no plan-scoped tables); the fused plan
        keeps its own int workspace (plan-scoped tables must not share one)."""
        self._decode.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def plan(self, indptr: Tensor, indices: Tensor, last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             q_data_type="float16", kv_data_type=None, data_type=None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, non_blocking: bool = True) -> None:
        """Plan the decode side (the prefill side is given whole to ``run``)."""
        self._run_memo = {}  # what the checks of earlier runs produced belongs to the earlier plan
        self._decode.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                          pos_encoding_mode=pos_encoding_mode, window_left=window_left, q_data_type=q_data_type,
                          kv_data_type=kv_data_type, data_type=data_type, sm_scale=sm_scale,
                          rope_scale=rope_scale, rope_theta=rope_theta, non_blocking=non_blocking)

    def run(self, q_p: Tensor, k_p: Tensor, v_p: Tensor, q_d: Tensor, paged_kv_cache_d,
            custom_mask_p: Optional[Tensor] = None, packed_custom_mask_p: Optional[Tensor] = None,
            causal_p: bool = False, kv_layout_p: str = "NHD", pos_encoding_mode_p: str = "NONE",
            sm_scale_p: Optional[float] = None, window_left_p: int = -1, rope_scale_p: Optional[float] = None,
            rope_theta_p: Optional[float] = None, return_lse_p: bool = False,
            custom_mask_d: Optional[Tensor] = None, packed_custom_mask_d: Optional[Tensor] = None,
            causal_d: bool = False, kv_layout_d: Optional[str] = None, pos_encoding_mode_d: Optional[str] = None,
            sm_scale_d: Optional[float] = None, window_left_d: Optional[int] = None,
            rope_scale_d: Optional[float] = None, rope_theta_d: Optional[float] = None,
            q_scale: Optional[float] = None, k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            return_lse_d: bool = False, use_fp16_qk_reduction: bool = False, enable_pdl: Optional[bool] = None,
            *args):
        """Returns ``(out_p, out_d)``; each part becomes ``(out, lse)`` when its ``return_lse_*`` is set.
        q_scale/k_scale/v_scale apply to the decode side.  A run with the signature of an earlier run on the same
        decode plan (every tensor's shape, strides, dtype and device, every scalar, what selection reads) skips
        the checks, which read nothing else (host time: a small POD step is bound by it)."""
        if args:
            _api.reject_extra("run", args)
        key = None
        if (custom_mask_p is None and packed_custom_mask_p is None and custom_mask_d is None
                and packed_custom_mask_d is None and not _ops.compiling()
                and _plain(causal_p, kv_layout_p, pos_encoding_mode_p, sm_scale_p, window_left_p, rope_scale_p,
                           rope_theta_p, return_lse_p, causal_d, kv_layout_d, pos_encoding_mode_d, sm_scale_d,
                           window_left_d, rope_scale_d, rope_theta_d, q_scale, k_scale, v_scale, return_lse_d,
                           use_fp16_qk_reduction, enable_pdl)):
            tk = _plan_cache.tkey
            cache = paged_kv_cache_d
            key = (tk(q_p), tk(k_p), tk(v_p), tk(q_d), tk(cache) if cache.__class__ is torch.Tensor
                   else tuple(map(tk, cache)) if isinstance(cache, (tuple, list)) else None,
                   causal_p, kv_layout_p, pos_encoding_mode_p, sm_scale_p, window_left_p, rope_scale_p, rope_theta_p,
                   return_lse_p, causal_d, kv_layout_d, pos_encoding_mode_d, sm_scale_d, window_left_d, rope_scale_d,
                   rope_theta_d, q_scale, k_scale, v_scale, return_lse_d, use_fp16_qk_reduction, enable_pdl,
                   _selector.env_key())
            hit = self._run_memo.get(key) if key[4] is not None else None
            if hit is not None and hit[0] is self._decode._planned:
                planned, planned_p, (out_shape, out_dtype, lse_p), scales_p = hit
                dev = self._decode._device
                args_p = RunArgs(q_p, k_p, v_p, torch.empty(out_shape, dtype=out_dtype, device=dev),
                                 torch.empty(out_shape[:2], dtype=torch.float32, device=dev) if lse_p else None,
                                 None, *scales_p)
                args_d = _paged_args(self._decode, q_d, cache, q_scale, k_scale, v_scale, return_lse_d)  # a hit too
                return self._run_parts(planned, planned_p, args_p, args_d)
        planned = self._decode._require_plan()
        params = planned.meta.params
        if custom_mask_d is not None or packed_custom_mask_d is not None:
            raise ValueError("custom_mask_d: the decode side takes no custom mask (each decode row sees its "
                             "whole request, within the planned window)")
        # every scalar is checked by its rule (attncore.core.params) under the name it was given; the prefill
        # side's are checked again, under their plain names, by the single prefill
        sm_scale_p = _params.sm_scale(sm_scale_p, None, "sm_scale_p")
        window_left_p = _params.window_left(window_left_p, "window_left_p")
        rope_scale_p = _params.rope("rope_scale_p", rope_scale_p, fill=False)
        rope_theta_p = _params.rope("rope_theta_p", rope_theta_p, fill=False)
        sm_scale_d = _params.sm_scale(sm_scale_d, None, "sm_scale_d")
        window_left_d = None if window_left_d is None else _params.window_left(window_left_d, "window_left_d")
        rope_scale_d = _params.rope("rope_scale_d", rope_scale_d, fill=False)
        rope_theta_d = _params.rope("rope_theta_d", rope_theta_d, fill=False)
        _same("kv_layout_d", kv_layout_d, self._kv_layout)
        _same("pos_encoding_mode_d", pos_encoding_mode_d, params.pos_encoding_mode)
        _same("sm_scale_d", sm_scale_d, params.sm_scale)
        _same("window_left_d", window_left_d, params.window_left)
        if params.pos_encoding_mode == "ROPE_LLAMA":
            _same("rope_scale_d", rope_scale_d, params.rope_scale)
            _same("rope_theta_d", rope_theta_d, params.rope_theta)
        elif rope_scale_d is not None or rope_theta_d is not None:
            raise ValueError("rope_scale_d/rope_theta_d: given, but the decode side was planned without RoPE")
        if causal_d and planned.meta.q_len_per_req == 1:
            pass  # one query row per request: causal is the same as no mask
        prefill = dict(q=q_p, k=k_p, v=v_p, custom_mask=custom_mask_p, packed_custom_mask=packed_custom_mask_p,
                       causal=causal_p, kv_layout=kv_layout_p, pos_encoding_mode=pos_encoding_mode_p,
                       sm_scale=sm_scale_p, window_left=window_left_p, logits_soft_cap=None, rope_scale=rope_scale_p,
                       rope_theta=rope_theta_p, return_lse=return_lse_p, backend=self._requested_backend, sinks=None,
                       q_scale=None, k_scale=None, v_scale=None, out=None, lse=None)
        if _ops.compiling():  # the backend is chosen inside attncore::single_prefill: .backend keeps its last value
            res_p = _ops.single_prefill_traced(**prefill)
            return res_p, self._decode.run(q_d, paged_kv_cache_d, q_scale=q_scale, k_scale=k_scale,
                                           v_scale=v_scale, return_lse=return_lse_d)
        planned_p, args_p = plan_single(**prefill)
        args_d = _paged_args(self._decode, q_d, paged_kv_cache_d, q_scale, k_scale, v_scale, return_lse_d)
        if key is not None and key[4] is not None:  # after every check: an error is never kept
            if len(self._run_memo) > 64:
                self._run_memo.clear()
            self._run_memo[key] = (planned, planned_p, (args_p.out.shape, args_p.out.dtype, args_p.lse is not None),
                                   (args_p.q_scale, args_p.k_scale, args_p.v_scale))
        return self._run_parts(planned, planned_p, args_p, args_d)

    def _run_parts(self, planned, planned_p, args_p: RunArgs, args_d: RunArgs):
        """Run both parts, checked: fused where the fuser plans it, else composed as ``overlap`` says."""
        fused = self._fuser.plan("pod", _variant(planned_p.problem, args_p.lse is not None, False), planned_p.meta,
                                 _variant(planned.problem, args_d.lse is not None, args_d.fp8_scales), planned.meta)
        if fused is not None:
            fused[0].run(fused[1], PODRunArgs(prefill=args_p, decode=args_d))
            self._streams.mode, self._streams.reason = "fused", None
        else:
            _ready(planned_p, args_p)
            _ready(planned, args_d)
            self._prefill_backend = planned_p.backend_name
            why = self._streams.decide(planned_p.problem, planned_p.meta, planned.problem, planned.meta)
            self._streams.run_parts(planned_p, args_p, planned, args_d, why)
        return _result(args_p), _result(args_d)


class BatchPODWithPagedKVCacheWrapper(_Modes):
    """Paged batch prefill + paged batch decode in one call (FlashInfer-compatible)."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", *, backend: str = "auto",
                 fuse: bool = True, overlap: str = "auto"):
        """``fuse`` (attncore): False always composes the parts.  ``overlap`` (attncore): how composed parts
        run: ``"sm_split"`` at the same time on disjoint SMs or ``"streams"`` on two CUDA streams, where the
        device has them and the float workspace holds both parts' scratch side by side (each part plans into
        its half), ``"serial"`` one after the other, sharing the whole float workspace, ``"auto"`` (the
        default) split where ``attncore.core.streams.choose_split`` says it gains on sm_90, else serial."""
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, backend=backend)
        self._decode = BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, backend=backend)
        self._plan_args: Optional[tuple] = None
        self._decode_plan = None  # plan()'s decode-side call, made again when the workspace split changes
        self._prefill_key = None
        self._fuser = _Fuser(backend, self._decode._device, fuse)
        self._streams = Streams(overlap, self._decode._device)
        self._ws = float_workspace_buffer
        self._split: Optional[tuple] = None  # (prefill's, decode's) workspace views while the parts are split
        self._half = halves(float_workspace_buffer)  # made once per buffer: a plan memo is keyed by them
        self._split_reason: Optional[str] = None  # why the parts share the workspace (so run serially)
        self._overlap_why: Optional[str] = None  # plan()'s answer: why the parts will run in turn (None: at once)
        # plan() plans the prefill side with the causal_p of the last eager run without a custom mask (a
        # serving step runs the same mask every step: planning causal_p=False first planned it twice a step)
        self._run_causal = False

    @property
    def backend(self) -> Optional[str]:
        """``"fused=<name>"`` after a fused run, else ``"prefill=<name> decode=<name>"``."""
        if self._decode.backend is None:
            return None
        if self._fuser.backend_name is not None:
            return f"fused={self._fuser.backend_name}"
        return f"prefill={self._prefill.backend or '?'} decode={self._decode.backend}"

    def reset_workspace_buffer(self, float_workspace_buffer: Tensor, int_workspace_buffer: Optional[Tensor] = None):
        """The float workspace is split between the parts at the next plan() when they run on two streams,
        else shared (their runs are sequential); an int workspace is plan-scoped, so only the decode part
        takes the caller's: the prefill part and the fused plan keep their own."""
        self._prefill.reset_workspace_buffer(float_workspace_buffer)
        self._decode.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)
        self._ws, self._split, self._half = float_workspace_buffer, None, halves(float_workspace_buffer)

    def plan(self, qo_indptr_p: Tensor, kv_indptr_p: Tensor, kv_indices_p: Tensor, last_page_len_p: Tensor,
             qo_indptr_d: Tensor, kv_indptr_d: Tensor, kv_indices_d: Tensor, last_page_len_d: Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, q_data_type="float16", kv_data_type=None, data_type=None,
             sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, non_blocking: bool = True) -> None:
        """Plan both sides.  The decode side's query lengths (``qo_indptr_d``) must all be equal
        (that length is its ``q_len_per_req``).  The prefill side is planned with the ``causal_p`` of the
        last eager run without a custom mask (False before any): a run with another mask plans it again.
        Device-side tables are read in one copy (``_checks.read_together``; page ids as
        ``page_table.read_whole`` says: a longer table's ids are reduced on the device, one more copy)."""
        tables = [qo_indptr_d, kv_indptr_d, last_page_len_d, qo_indptr_p, kv_indptr_p, last_page_len_p]
        tables += [t for t in (kv_indices_d, kv_indices_p) if read_whole(t)]
        with _checks.read_together(tables):  # plan()'s one device read
            d_host = _checks.check_indptr("qo_indptr_d", qo_indptr_d)
            lens = {d_host[i + 1] - d_host[i] for i in range(len(d_host) - 1)}
            if len(lens) > 1 or 0 in lens:
                raise ValueError(f"qo_indptr_d: decode requests must all have the same number (>= 1) of query rows, "
                                 f"got lengths {sorted(lens)}")
            q_len = lens.pop() if lens else 1
            if data_type is not None:
                q_data_type = data_type
                kv_data_type = kv_data_type or data_type
            if last_page_len_p.device != kv_indptr_p.device:
                last_page_len_p = last_page_len_p.to(kv_indptr_p.device)
            if last_page_len_d.device != kv_indptr_d.device:
                last_page_len_d = last_page_len_d.to(kv_indptr_d.device)
            self._decode_plan = lambda: self._decode.plan(
                kv_indptr_d, kv_indices_d, last_page_len_d, num_qo_heads, num_kv_heads, head_dim, page_size,
                pos_encoding_mode=pos_encoding_mode, window_left=window_left, q_data_type=q_data_type,
                kv_data_type=kv_data_type, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                non_blocking=non_blocking, q_len_per_req=q_len)
            self._plan_args = (qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p, num_qo_heads, num_kv_heads,
                               head_dim, page_size, pos_encoding_mode, window_left, q_data_type, kv_data_type,
                               sm_scale, rope_scale, rope_theta)
            self._overlap_why = self._concurrency((qo_indptr_p, kv_indptr_p, last_page_len_p, kv_indptr_d,
                                                   last_page_len_d), num_qo_heads, num_kv_heads, head_dim, page_size,
                                                  kv_data_type or q_data_type)
            self._plan_parts(self._run_causal, None, None)

    def _concurrency(self, tables, hq: int, hkv: int, d: int, page_size: int, kv_dtype) -> Optional[str]:
        """Why the parts of this plan will run one after the other (None: at the same time): the overlap mode's
        reason or, for an SM split, ``choose_split``'s answer on the work the index tables describe.  Decided
        before the parts are planned, so that parts which will run in turn plan into the whole float workspace
        (a part planned into a half that then falls back plans twice: host time in every serving step)."""
        def work():
            qo, kv_p, last_p, kv_d, last_d = _checks.read_host(list(tables))
            kv_lens_p = _paged_kv_lens(kv_p, last_p, page_size, "last_page_len_p")
            lens_p = zip([b - a for a, b in zip(qo, qo[1:])], kv_lens_p)
            return (prefill_flops(lens_p, self._run_causal, hq, d, d),
                    decode_bytes(_paged_kv_lens(kv_d, last_d, page_size, "last_page_len_d"), hkv, d, d,
                                 _checks.to_dtype(kv_dtype, "kv_data_type")))
        try:
            return self._streams.decide_work(work)
        except (ValueError, TypeError, IndexError) as e:  # the parts' own plans report bad tables
            return (f"overlap={self._streams.overlap!r}: serial (the index tables could not be read for the split's "
                    f"model: {e})")

    def _assign(self, split: Optional[tuple]) -> None:
        """Give each part its workspace: its half of the split, or the whole buffer (no-op when unchanged:
        reset_workspace_buffer empties a wrapper's plan memo)."""
        fp, fd = split if split is not None else (self._ws, self._ws)
        if self._prefill._float_workspace_buffer is not fp:
            self._prefill.reset_workspace_buffer(fp)
        if self._decode._float_workspace_buffer is not fd:
            self._decode.reset_workspace_buffer(fd)
        self._split = split

    def _plan_parts(self, causal_p: bool, custom_mask_p, packed_custom_mask_p) -> None:
        """Plan both parts: into the halves of the float workspace when they will run at the same time
        (the scratch of one must not be the other's), else into the whole buffer.  A part too big for its
        half (``WorkspaceTooSmall``) sends both back to the whole buffer, run one after the other, and
        ``overlap_reason`` says so."""
        why = self._overlap_why
        if why is None:
            split = self._half
            if split is None:
                why = "float_workspace_buffer: not contiguous, so not split between the parts; they run in turn"
            else:
                try:
                    self._assign(split)
                    self._decode_plan()
                    self._prefill_key = None
                    self._plan_prefill(causal_p, custom_mask_p, packed_custom_mask_p)
                    self._split_reason = None
                    return
                except WorkspaceTooSmall as e:
                    why = (f"float_workspace_buffer: too small for both parts side by side (each gets half, "
                           f"{split[0].numel()} bytes; {e}); the parts share it and run one after the other")
        self._assign(None)
        self._decode_plan()
        self._prefill_key = None
        self._plan_prefill(causal_p, custom_mask_p, packed_custom_mask_p)
        self._split_reason = why

    @staticmethod
    def _mask_key(causal_p: bool, custom_mask_p, packed_custom_mask_p) -> tuple:
        return (bool(causal_p), None if custom_mask_p is None else id(custom_mask_p),
                None if packed_custom_mask_p is None else id(packed_custom_mask_p))

    def _plan_prefill(self, causal_p: bool, custom_mask_p, packed_custom_mask_p) -> None:
        key = self._mask_key(causal_p, custom_mask_p, packed_custom_mask_p)
        if key == self._prefill_key:
            return
        (qo, kvp, kvi, lpl, hq, hkv, d, page, pe, wl, qdt, kvdt, sm, rs, rt) = self._plan_args
        self._prefill.plan(qo, kvp, kvi, lpl, hq, hkv, d, page, custom_mask=custom_mask_p,
                           packed_custom_mask=packed_custom_mask_p, causal=causal_p, pos_encoding_mode=pe,
                           window_left=wl, sm_scale=sm, rope_scale=rs, rope_theta=rt, q_data_type=qdt,
                           kv_data_type=kvdt)
        self._prefill_key = key

    def run(self, q_p: Tensor, paged_kv_cache_p, q_d: Tensor, paged_kv_cache_d,
            custom_mask_p: Optional[Tensor] = None, packed_custom_mask_p: Optional[Tensor] = None,
            causal_p: bool = False, q_scale: Optional[float] = None, k_scale: Optional[float] = None,
            v_scale: Optional[float] = None, return_lse: bool = False, use_fp16_qk_reduction: bool = False,
            enable_pdl: Optional[bool] = None):
        """Returns ``(out_p, out_d)``, or ``((out_p, lse_p), (out_d, lse_d))`` with ``return_lse``.
        The prefill side's mask (``causal_p``, custom masks) is planned on its first use and reused.
        q_scale/k_scale/v_scale apply to the decode side."""
        if self._plan_args is None:
            raise RuntimeError("BatchPODWithPagedKVCacheWrapper.run() called before plan()")
        if _ops.compiling():
            # planning the prefill side's mask is host work that cannot be traced: it must be planned already
            if custom_mask_p is not None or packed_custom_mask_p is not None:
                raise RuntimeError("BatchPODWithPagedKVCacheWrapper.run(): a prefill-side custom mask is not supported "
                                   "under torch.compile yet; run it outside the compiled function")
            if self._prefill_key != self._mask_key(causal_p, None, None):
                raise RuntimeError(f"BatchPODWithPagedKVCacheWrapper.run(): under torch.compile the prefill side must "
                                   f"already be planned with causal_p={bool(causal_p)} (plan() plans it as the last "
                                   f"eager run ran it: causal_p={self._run_causal}); "
                                   f"call run() once outside the compiled function with the same causal_p first")
        else:
            try:
                self._plan_prefill(causal_p, custom_mask_p, packed_custom_mask_p)
            except WorkspaceTooSmall:  # a new prefill mask too big for its half: both parts on the whole buffer
                if self._split is None:
                    raise
                self._plan_parts(causal_p, custom_mask_p, packed_custom_mask_p)
            if custom_mask_p is None and packed_custom_mask_p is None:
                self._run_causal = bool(causal_p)
            pw, dw = self._prefill, self._decode
            fp8 = any(_params.scale(n, x) != 1.0 for n, x in (("q_scale", q_scale), ("k_scale", k_scale),
                                                                ("v_scale", v_scale)))
            fused = self._fuser.plan("batch_pod", _variant(pw._planned.problem, return_lse, False), pw._planned.meta,
                                     _variant(dw._planned.problem, return_lse, fp8), dw._planned.meta)
            why = None if fused is not None else self._split_reason or self._overlap_why
            if why is not None:
                # one part after the other on the current stream: each wrapper's own run(), whose repeated
                # signature skips its checks (host time: a serving step runs this once per layer)
                res_p = pw._launch(q_p, paged_kv_cache_p, out=None, lse=None, return_lse=return_lse, sinks=None,
                                   q_scale=None, k_scale=None, v_scale=None)
                res_d = dw._launch(q_d, paged_kv_cache_d, out=None, lse=None, return_lse=return_lse, sinks=None,
                                   q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
                self._streams.mode, self._streams.reason = "serial", why
                return res_p, res_d
            args_p = _paged_args(pw, q_p, paged_kv_cache_p, None, None, None, return_lse)
            args_d = _paged_args(dw, q_d, paged_kv_cache_d, q_scale, k_scale, v_scale, return_lse)
            if fused is not None:
                fused[0].run(fused[1], PODRunArgs(prefill=args_p, decode=args_d))
                self._streams.mode, self._streams.reason = "fused", None
                return _result(args_p), _result(args_d)
            _ready(pw._planned, args_p)
            _ready(dw._planned, args_d)
            self._streams.run_parts(pw._planned, args_p, dw._planned, args_d, self._split_reason)
            return _result(args_p), _result(args_d)
        res_p = self._prefill.run(q_p, paged_kv_cache_p, return_lse=return_lse)
        res_d = self._decode.run(q_d, paged_kv_cache_d, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                 return_lse=return_lse)
        return res_p, res_d
