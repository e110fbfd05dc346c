"""Launch configurations of the Triton kernels: candidates pruned by problem, one chosen per plan.

A config is (block_m, block_n, num_warps, num_stages).  ``candidates()`` lists what fits the
problem (shared memory, head dim, dtype); the first entry is the default pick, ordered from
the sweeps measured on an H100 on 2026-11-22 (backends/triton/bench/triton.md, results/triton-h100-*.json):
decode bf16 block_n 64 / 2 stages; fp8 KV block_n 128 / 2 stages, with bf16 q the dots in fp16
(D5 0.229 vs 0.285 ms, session 4); prefill 128x64, 8 warps, 3 stages (d256: 2); paged prefill
gathers the next tile's page ids one iteration ahead.  Picks are cached per (device, key) so that
``plan()`` stays cheap; ``set_config`` lets a tuning script pin a measured best.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool = False  # paged: gather the next tile's page ids one iteration ahead
    dot_f16: bool = False  # fp8 KV + bf16 q: dots in fp16 (cheap fp8 -> fp16 conversion)

    def as_dict(self) -> dict:
        return dict(block_m=self.block_m, block_n=self.block_n, num_warps=self.num_warps,
                    num_stages=self.num_stages, prefetch=self.prefetch, dot_f16=self.dot_f16)


_CACHE: Dict[Tuple, LaunchConfig] = {}
SMEM_BUDGET = 220 * 1024  # sm_90 / sm_80 (A100: 163 KB, pruned below by cc)


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def config_key(problem, rows_per_req: int, device: torch.device) -> Tuple:
    """What a config depends on: device, head dims, dtype width, rope, and the packed rows bucket."""
    small = min(_pow2(max(rows_per_req, 1)), 128)
    return (str(device), problem.head_dim_qk, problem.head_dim_vo, problem.q_dtype, problem.kv_dtype,
            problem.page_size is not None, problem.pos_encoding == "ROPE_LLAMA", small)


def _smem(cfg: LaunchConfig, d: int, elt: int, dv: Optional[int] = None) -> int:
    """Shared memory of a config: the q tile and the pipelined K (d wide) and V (dv wide) tiles."""
    dv = d if dv is None else dv
    return (cfg.block_m * d + max(cfg.num_stages - 1, 1) * cfg.block_n * (d + dv)) * elt


def candidates(problem, rows_per_req: int, *, interpret: bool, cc: Optional[Tuple[int, int]] = None
               ) -> List[LaunchConfig]:
    """Configs that fit the problem, best guess first.  rows_per_req: max packed rows (qo * G)."""
    d = max(16, _pow2(problem.head_dim_qk))
    dv = max(16, _pow2(problem.head_dim_vo))
    dmax = max(d, dv)  # tile sizes follow the wider of the K and V / accumulator tiles
    elt = problem.q_dtype.itemsize
    rows = max(rows_per_req, 1)
    paged = problem.page_size is not None
    fp8 = problem.kv_dtype.itemsize == 1
    if interpret:  # one small config: the interpreter is slow and has no shared memory
        bm = min(64, max(16, _pow2(rows)))
        return [LaunchConfig(bm, 32, 1, 1, prefetch=paged)]
    budget = SMEM_BUDGET if (cc is None or cc >= (9, 0)) else (160 * 1024 if cc == (8, 0) else 99 * 1024)
    out: List[LaunchConfig] = []
    if rows <= 64:  # decode-like: few packed rows, memory bound
        bm = max(16, _pow2(rows))
        if fp8:
            f16 = problem.q_dtype == torch.bfloat16 and problem.pos_encoding != "ROPE_LLAMA"
            out = [LaunchConfig(bm, bn, 4, st, pf, f) for f in ((True, False) if f16 else (False,))
                   for bn in (128, 256) for st in (2, 3) for pf in (False, True)]
        elif dmax <= 128:
            out = [LaunchConfig(bm, bn, 4, st, pf) for bn in (64, 128) for st in (2, 3)
                   for pf in (False, True)]
        else:
            out = [LaunchConfig(bm, bn, 4, st, pf) for bn in (32, 64) for st in (2, 3)
                   for pf in (False, True)]
    else:
        if dmax <= 64:
            base = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)]
        elif dmax <= 128:
            base = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2)]
        else:
            base = [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)]
        if elt == 4:
            base = [(64, 32, 4, 2), (32, 32, 4, 2)]
        out = [LaunchConfig(*b) for b in base]
        if paged:
            out = [LaunchConfig(*b, prefetch=True) for b in base[:2]] + out
    out = [c for c in out if _smem(c, d, elt, dv) <= budget] or [LaunchConfig(32, 32, 4, 1)]
    return out


@dataclass(frozen=True)
class DenseConfig:
    """Launch config of the Hopper dense-prefill kernel (kernels/dense.py)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool
    one_loop: bool = False  # every KV tile through one loop (vs unmasked + masked loops)
    branch: bool = False  # one_loop: mask only the tiles that need it (a scalar branch per tile)

    def as_dict(self) -> dict:
        return dict(block_m=self.block_m, block_n=self.block_n, num_warps=self.num_warps,
                    num_stages=self.num_stages, warp_specialize=self.warp_specialize,
                    one_loop=self.one_loop, branch=self.branch)


def dense_candidates(problem, causal: bool, *, sweep: bool = False) -> List[DenseConfig]:
    """Configs of the dense kernel, best measured first (H100, triton 3.6, 2026-11-22,
    backends/triton/bench/triton.md, session 4).  Head dim 128: 128x64 tiles in one warp-specialized loop
    that masks only the diagonal / tail tiles (P1 causal 480, non-causal 525 TFLOP/s); the same
    loop without warp specialization on 64x64 tiles next (448 / 508).  Head dim 64: that loop on
    128x64 tiles and 8 warps (P2 d64 0.190 ms vs 0.196 on 64x64).  run() falls back down the list, then to
    the generic kernel, if a config fails to compile.  Only one-loop forms are specialized: with
    Triton 3.6 a specialized loop followed (or preceded) by another loop crashes the compiler.  Head dim
    256: 128x64 tiles on 8 warps, two loops (P2 d256 458 TFLOP/s vs the generic kernel's 406).
    ``sweep`` adds configs for measurement."""
    ws = DenseConfig(128, 64, 4, 2, True, True, True)
    plain = DenseConfig(64, 64, 4, 3, False, True, True)
    two_loops = DenseConfig(64, 64, 4, 3, False)
    if problem.head_dim_qk == 256:
        # H100, 2026-11-24 (session 9), P2 d256 causal 16/16 heads: 128x64 tiles on 8 warps, 2 stages, two
        # loops 0.300 ms (458 TFLOP/s), one loop 0.303, warp-specialized on 8 warps 0.303 (on 4: 1.48);
        # 64x64 on 4 warps, 3 stages 0.331; the generic kernel's best (128x64, 8 warps) 0.338 (406)
        out = [DenseConfig(128, 64, 8, 2, False), DenseConfig(128, 64, 8, 2, False, True, True), plain]
        return out + [DenseConfig(128, 64, 8, 2, True, True, True), DenseConfig(64, 32, 4, 3, False, True, True)] \
            if sweep else out
    if problem.head_dim_qk == 128:
        out = [ws, plain, two_loops]
    else:
        # d64, H100 sweeps of 2026-11-24 (sessions 9 and 10, P2 d64 causal): 128x64 tiles on 8 warps, 3 stages,
        # one loop 0.190 ms against 64x64 on 4 warps 0.195-0.196 (the generic kernel's 128x64x8: 0.186-0.187)
        out = [DenseConfig(128, 64, 8, 3, False, True, True), plain, two_loops]
    extra = [DenseConfig(128, 64, 4, 3, True, True, True), DenseConfig(64, 64, 4, 3, True, True, True),
             DenseConfig(128, 128, 4, 2, True, True, True)]
    if problem.head_dim_qk != 128:
        extra += [ws, DenseConfig(128, 64, 8, 2, False)]
    return out + extra if sweep else out


def pick(problem, rows_per_req: int, device: torch.device, *, interpret: bool,
         cc: Optional[Tuple[int, int]] = None) -> LaunchConfig:
    key = config_key(problem, rows_per_req, device)
    cfg = _CACHE.get(key)
    if cfg is None:
        cfg = candidates(problem, rows_per_req, interpret=interpret, cc=cc)[0]
        _CACHE[key] = cfg
    return cfg


def set_config(problem, rows_per_req: int, device: torch.device, cfg: LaunchConfig) -> None:
    """Pin a (measured) config for this device and problem kind."""
    _CACHE[config_key(problem, rows_per_req, device)] = cfg
