"""The "sdpa" backend: attncore's dense prefill ops on torch's scaled_dot_product_attention.

Notation: B requests; request i has qo_i query rows and kv_i keys; Hq query heads, Hkv kv heads,
G = Hq // Hkv; D head dim.  attncore tensors are token-major (``q [nnz_q, Hq, D]``, K/V NHD
``[nnz_kv, Hkv, D]`` or HND ``[Hkv, nnz_kv, D]``); SDPA wants ``[1, H, n, D]``, which is a
transposed *view* of either layout, so nothing is copied on the way in.

What it serves: ``single_prefill`` and ``batch_prefill_ragged`` (no paging), mask ``none`` or
``causal``, any GQA group, fp16/bf16/fp32 with K/V of the q dtype, and base-2 LSE.  Everything else
(paged KV, custom masks, sliding window, soft cap, ALiBi, RoPE, sinks, fp8) is refused with a
``Reason``: SDPA has no such options, and emulating them with a dense bias would be slower than
the built-in backends and no longer "SDPA".

Masks.  attncore's causal mask is *bottom-right* aligned (row i sees ``kv_idx <= i + kv - qo``);
SDPA's ``is_causal`` is *top-left*.  They agree only when ``qo == kv``, so plan() splits each request:

* ``qo == kv``: ``is_causal=True``;
* ``qo < kv`` (append / chunked prefill): torch's ``causal_lower_right`` bias (an additive bias on
  the LSE path);
* ``qo > kv``: the first ``qo - kv`` rows see no key (output 0, LSE -inf, written directly); the
  remaining ``kv`` rows form a square block, ``is_causal=True``.

Non-finite inputs (docs/semantics.md).  Keys outside a request's range are never sliced in, and no
window is claimed.  Every row of an SDPA call sees at least one key (rows that see none are written
directly: 0 and LSE -inf), so a query row holding NaN gives NaN output and LSE; run() enforces it,
as torch's CPU flash kernel drops such a row to 0 for some lengths.

LSE.  The public SDPA returns no LSE; the aten kernels behind it do, in natural log:
``_scaled_dot_product_flash_attention_for_cpu`` on CPU and ``_scaled_dot_product_efficient_attention``
on CUDA.  We call those when the LSE is requested and multiply by ``log2(e)`` (attncore's LSE is
base 2).  They are exact (the LSE of the very softmax that produced the output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn.functional as F

from attncore import AttentionProblem, Backend, BatchMeta, Capabilities, Reason, RunArgs

LOG2E = 1.0 / math.log(2.0)
_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
_OPS = frozenset({"single_prefill", "batch_prefill_ragged"})


@dataclass(frozen=True)
class _Piece:
    """One SDPA call: query rows [q0, q1) against keys [k0, k1); ``mode`` is how to mask."""

    q0: int
    q1: int
    k0: int
    k1: int
    mode: str  # "none" | "top_left" (square causal) | "bottom_right" (qo < kv causal)


@dataclass
class _Plan:
    problem: AttentionProblem
    pieces: Tuple[_Piece, ...]
    dead_rows: Tuple[Tuple[int, int], ...]  # [r0, r1) rows that see no key: out 0, lse -inf
    biases: dict  # (qo, kv) -> additive float bias (LSE path, bottom-right only)
    sm_scale: float


class SdpaBackend(Backend):
    name = "sdpa"
    description = "torch scaled_dot_product_attention (cuDNN / flash / mem-efficient / CPU flash): dense prefill"
    capabilities = (
        Capabilities(
            ops=_OPS, devices=frozenset({"cpu"}), q_dtypes=_DTYPES, kv_dtypes=_DTYPES, kv_dtype_must_match_q=True,
            layouts=frozenset({"NHD", "HND"}), masks=frozenset({"none", "causal"}),
            features=frozenset({"return_lse"}),
        ),
        Capabilities(
            ops=_OPS, devices=frozenset({"cuda"}), q_dtypes=_DTYPES, kv_dtypes=_DTYPES, kv_dtype_must_match_q=True,
            # The fused SDPA kernels (cuDNN, flash, mem-efficient) need D % 8 == 0 and D <= 256;
            # beyond that torch falls back to its slow math path, which is not what "sdpa" promises.
            head_dim_multiple=8, max_head_dim=256,
            layouts=frozenset({"NHD", "HND"}), masks=frozenset({"none", "causal"}),
            # No "cuda_graph": run() loops over requests with slice bounds that plan() computed on
            # the host, so a graph captured after one plan() would replay the old lengths after the
            # next.  A capturable backend reads every per-step value from BatchMeta's device tensors.
            features=frozenset({"return_lse"}),
        ),
    )

    def available(self) -> List[Reason]:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
        if (major, minor) < (2, 5):
            return [Reason("torch", torch.__version__, ">= 2.5", "needs SDPA's enable_gqa")]
        return []

    def extra_reasons(self, problem: AttentionProblem) -> List[Reason]:
        if problem.kv_dtype != problem.q_dtype:  # the schema lets fp8 KV through must_match
            return [Reason("kv_dtype", str(problem.kv_dtype).replace("torch.", ""),
                           f"same as q ({str(problem.q_dtype).replace('torch.', '')})")]
        return []

    # ------------------------------------------------------------------------------------------
    def plan(self, problem: AttentionProblem, meta: BatchMeta) -> _Plan:
        qp, kp = meta.qo_indptr_host, meta.kv_indptr_host
        causal = meta.mask == "causal"
        pieces, dead, biases = [], [], {}
        for i in range(meta.batch_size):
            q0, q1, k0, k1 = qp[i], qp[i + 1], kp[i], kp[i + 1]
            qo, kv = q1 - q0, k1 - k0
            if qo == 0:
                continue
            if kv == 0:
                dead.append((q0, q1))
                continue
            if not causal:
                pieces.append(_Piece(q0, q1, k0, k1, "none"))
            elif qo == kv:
                pieces.append(_Piece(q0, q1, k0, k1, "top_left"))
            elif qo > kv:
                dead.append((q0, q1 - kv))
                pieces.append(_Piece(q1 - kv, q1, k0, k1, "top_left"))
            else:
                pieces.append(_Piece(q0, q1, k0, k1, "bottom_right"))
                if problem.return_lse and (qo, kv) not in biases:
                    biases[(qo, kv)] = _bottom_right_bias(qo, kv, problem.q_dtype, meta.device)
        return _Plan(problem, tuple(pieces), tuple(dead), biases, meta.params.sm_scale)

    def run(self, plan: _Plan, args: RunArgs) -> None:
        scale, out_scale = _scales(plan, args)
        hnd = plan.problem.kv_layout == "HND"
        for r0, r1 in plan.dead_rows:
            args.out[r0:r1].zero_()
            if args.lse is not None:
                args.lse[r0:r1].fill_(float("-inf"))
        for pc in plan.pieces:
            q = args.q[pc.q0:pc.q1]
            if hnd:
                k, v = args.k[:, pc.k0:pc.k1], args.v[:, pc.k0:pc.k1]
            else:
                k, v = args.k[pc.k0:pc.k1], args.v[pc.k0:pc.k1]
            lse = None if args.lse is None else args.lse[pc.q0:pc.q1]
            self._piece(q, k, v, args.out[pc.q0:pc.q1], lse, pc, scale, out_scale, plan)

    def relaunch(self, plan: _Plan, args: RunArgs):
        """Backend.relaunch for a one-call of one request that is one SDPA call over all of q and K/V (no dead
        rows, no bottom-right bias): run()'s piece on the whole tensors, without its loops and slices."""
        if len(plan.pieces) != 1 or plan.dead_rows or plan.pieces[0].mode == "bottom_right":
            return None
        pc = plan.pieces[0]
        scale, out_scale = _scales(plan, args)

        def go(q, k, v, out, lse, sinks) -> None:
            if q.dim() == 2:  # a single decode: q, out (and lse) without their unit first dim
                q, out, lse = q.unsqueeze(0), out.unsqueeze(0), None if lse is None else lse.unsqueeze(0)
            self._piece(q, k, v, out, lse, pc, scale, out_scale, plan)
        return go

    def _piece(self, q, k, v, out, lse, pc: _Piece, scale: float, out_scale: float, plan: _Plan) -> None:
        """One SDPA call: q [qo, Hq, D] token-major, K/V of the problem's layout sliced to the piece's keys,
        written into out [qo, Hq, Dv] (and lse [qo, Hq], base 2)."""
        q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, qo, D]
        if plan.problem.kv_layout == "HND":
            k, v = k.unsqueeze(0), v.unsqueeze(0)  # [1, Hkv, kv, D]
        else:
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        # every row of a piece sees >= 1 key, so a NaN query row must give NaN (out and LSE); torch's
        # CPU flash kernel returns 0 for some lengths (e.g. kv < 8), so the NaN is put back here
        nan_q = q.isnan().any(dim=-1, keepdim=True)  # [1, Hq, qo, 1]
        if lse is None:
            o = self._sdpa(q, k, v, pc, scale)
        else:
            o, lse_e = self._sdpa_lse(q, k, v, pc, scale, plan)
            lse_e = lse_e[..., : q.shape[2]].masked_fill(nan_q[..., 0], float("nan"))
            lse.copy_(lse_e[0].transpose(0, 1).float() * LOG2E)
        o = o.masked_fill(nan_q, float("nan"))
        if out_scale != 1.0:
            o = o * out_scale
        out.copy_(o[0].transpose(0, 1))

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _sdpa(q, k, v, pc: _Piece, scale: float) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if pc.mode == "top_left":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        if pc.mode == "bottom_right":
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(q.shape[2], k.shape[2])
            if gqa:  # CausalBias does not forward enable_gqa
                k, v = _repeat_kv(k, v, q.shape[1])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)

    @staticmethod
    def _sdpa_lse(q, k, v, pc: _Piece, scale: float, plan: _Plan) -> Tuple[torch.Tensor, torch.Tensor]:
        """(out [1, Hq, qo, Dv], natural-log LSE [1, Hq, >= qo]) from the aten kernels behind SDPA."""
        if q.shape[1] != k.shape[1]:
            k, v = _repeat_kv(k, v, q.shape[1])
        qo, kv = q.shape[2], k.shape[2]
        bias = plan.biases.get((qo, kv)) if pc.mode == "bottom_right" else None
        causal = pc.mode == "top_left"
        if q.device.type == "cpu":
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
            return o, lse
        o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.contiguous(), k.contiguous(), v.contiguous(),
            None if bias is None else bias[None, None].expand(1, q.shape[1], qo, kv),
            True, 0.0, causal, scale=scale)
        return o, lse


def _scales(plan: _Plan, args: RunArgs) -> Tuple[float, float]:
    """(SDPA's scale, the factor on its output) from the plan's sm_scale and the run's fp scales."""
    return plan.sm_scale * args.q_scale * args.k_scale, args.v_scale / args.o_scale


def _repeat_kv(k: torch.Tensor, v: torch.Tensor, hq: int):
    g = hq // k.shape[1]
    return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)


def _bottom_right_bias(qo: int, kv: int, dtype, device) -> torch.Tensor:
    """Additive [qo, kv] bias of attncore's causal mask (0 = keep, -inf = drop).

    Stored in a buffer whose rows are padded to 16 elements: the CUDA mem-efficient kernel wants an
    aligned bias row stride.
    """
    keep = torch.ones(qo, kv, dtype=torch.bool, device=device).tril(diagonal=kv - qo)
    padded = torch.zeros(qo, -(-kv // 16) * 16, dtype=dtype, device=device)
    bias = padded[:, :kv]
    bias.masked_fill_(~keep, float("-inf"))
    return bias
