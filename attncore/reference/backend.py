"""The pure-torch reference backend: every op and feature of semantics.md, on any device.

Float32 accumulation, keys in chunks (see ``core.attend``).  It is the ground truth the other
backends are cross-checked against, and the fallback ``auto`` uses when nothing faster serves.
"""

from __future__ import annotations

from typing import Optional

import torch

from attncore.core.backend import Backend, BatchMeta, RunArgs
from attncore.core.capabilities import Capabilities
from attncore.core.mask import alibi_slopes, spec_mask_rows, unpack_bits, window_mask
from attncore.core.problem import FEATURES, OPS, AttentionProblem
from attncore.reference.core import attend

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})
_FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


class ReferenceBackend(Backend):
    name = "reference"
    description = "pure torch, float32 accumulation, every feature, any device (the ground truth)"
    capabilities = (
        Capabilities(
            ops=frozenset(o for o in OPS if o not in ("pod", "batch_pod")),
            devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
            q_dtypes=_FLOATS,
            kv_dtypes=_FLOATS | _FP8,
            out_dtypes=_FLOATS | _FP8,
            # run() loops over requests on the host: not capturable in a CUDA graph
            features=frozenset(FEATURES) - {"cuda_graph"},
            same_head_dim_vo=False,
        ),
    )

    def extra_reasons(self, problem):
        from attncore.core.capabilities import Reason

        rs = []
        if problem.out_dtype in _FP8 and problem.kv_dtype not in _FP8:
            rs.append(Reason("out_dtype", str(problem.out_dtype), "fp8 output only with fp8 KV"))
        if problem.out_dtype not in _FP8 and problem.out_dtype != problem.q_dtype:
            rs.append(Reason("out_dtype", str(problem.out_dtype), f"same as q ({problem.q_dtype})"))
        return rs

    def plan(self, problem: AttentionProblem, meta: BatchMeta):
        return problem, meta

    def run(self, plan, args: RunArgs) -> None:
        problem, meta = plan
        p = meta.params
        hq = args.q.shape[1]
        alibi = alibi_slopes(hq, args.q.device) if p.pos_encoding_mode == "ALIBI" else None
        rope = (p.rope_theta, p.rope_scale) if p.pos_encoding_mode == "ROPE_LLAMA" else None
        sm_scale = p.sm_scale * args.q_scale * args.k_scale
        v_scale = args.v_scale / args.o_scale
        qo_ptr = meta.qo_indptr_host
        kv_lens = meta.host_kv_lens()
        for i in range(meta.batch_size):
            q = args.q[qo_ptr[i]:qo_ptr[i + 1]]
            k, v = self._request_kv(problem, meta, args, i, kv_lens)
            mask_fn = self._mask_fn(problem, meta, args, i, q.shape[0], k.shape[0])
            o, lse = attend(q, k, v, mask_fn=mask_fn, sm_scale=sm_scale, logits_soft_cap=p.logits_soft_cap,
                            alibi=alibi, rope=rope, sinks=args.sinks, v_scale=v_scale)
            args.out[qo_ptr[i]:qo_ptr[i + 1]] = o.to(args.out.dtype)
            if args.lse is not None:
                args.lse[qo_ptr[i]:qo_ptr[i + 1]] = lse

    @staticmethod
    def _request_kv(problem, meta: BatchMeta, args: RunArgs, i: int, kv_lens):
        hnd = problem.kv_layout == "HND"
        if problem.op in ("single_prefill", "batch_prefill_ragged"):
            s, e = meta.kv_indptr_host[i], meta.kv_indptr_host[i + 1]
            if hnd:
                return args.k[:, s:e].transpose(0, 1), args.v[:, s:e].transpose(0, 1)
            return args.k[s:e], args.v[s:e]
        n = kv_lens[i]
        page = meta.page_size
        npages = (n + page - 1) // page
        if problem.op == "xqa_decode":
            pages = meta.block_tables[i, :npages].long()
        else:
            s = meta.kv_indptr_host[i]
            pages = meta.kv_indices[s:s + npages].long()

        def gather(cache):
            g = cache[pages]  # [n, page, H, D] or [n, H, page, D]
            if hnd:
                g = g.transpose(1, 2)
            return g.reshape(-1, g.shape[-2], g.shape[-1])[:n]

        return gather(args.k), gather(args.v)

    @staticmethod
    def _mask_fn(problem, meta: BatchMeta, args: RunArgs, i: int, qo: int, kv: int):
        p = meta.params
        dev = args.q.device
        full: Optional[torch.Tensor] = None
        if meta.mask == "custom":
            start = meta.mask_indptr_host[i]
            full = unpack_bits(meta.packed_mask, start, qo * kv).reshape(qo, kv)
        elif problem.op == "xqa_decode" and args.spec_mask is not None:
            full = spec_mask_rows(args.spec_mask, i, qo, kv)
        if full is not None:
            if p.window_left >= 0:
                full = full & window_mask(qo, kv, p.window_left, full.device)
            full = full.to(dev)
            return lambda q0, q1, k0, k1: full[q0:q1, k0:k1]
        causal = meta.mask == "causal"
        if not causal and p.window_left < 0:
            return lambda q0, q1, k0, k1: None

        def block(q0, q1, k0, k1):
            rows = torch.arange(q0, q1, device=dev)[:, None] + (kv - qo)  # absolute query positions
            cols = torch.arange(k0, k1, device=dev)[None, :]
            keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=dev)
            if causal:
                keep &= cols <= rows
            if p.window_left >= 0:
                keep &= cols >= rows - p.window_left
            return keep

        return block
