"""fp64 golden attention: the dense, obviously-correct computation every backend is checked against.

Deliberately independent of the reference backend (no chunking, no online softmax, no shared
helpers beyond plain torch), so the two cross-check each other.  One request at a time:

    golden_attention(q [qo, Hq, D], k [kv, Hkv, D], v [kv, Hkv, Dv], ...) -> (out [qo, Hq, Dv], lse [qo, Hq])

All math in float64, on the CPU unless ``device`` names another.  Semantics: ``docs/semantics.md``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def golden_alibi_slopes(num_heads: int) -> torch.Tensor:
    n = 2 ** math.floor(math.log2(num_heads))
    m0 = 2.0 ** (-8.0 / n)
    slopes = [m0 ** (i + 1) for i in range(n)]
    if n < num_heads:
        m1 = 2.0 ** (-4.0 / n)
        slopes += [m1 ** (2 * i + 1) for i in range(num_heads - n)]
    return torch.tensor(slopes, dtype=torch.float64)


def golden_rope(x: torch.Tensor, pos: torch.Tensor, theta: float, scale: float,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rotate-half (LLaMA) RoPE over the full head dim, computed in ``dtype``.  x [n, H, D], pos [n]."""
    d = x.shape[-1]
    half = d // 2
    x = x.to(dtype)
    inv = torch.tensor([theta ** (-2.0 * i / d) / scale for i in range(half)], dtype=dtype, device=x.device)
    ang = pos.to(dtype)[:, None] * inv[None, :]  # [n, half]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def visible(qo: int, kv: int, *, causal: bool = False, mask: Optional[torch.Tensor] = None,
            window_left: int = -1, device="cpu") -> torch.Tensor:
    """bool [qo, kv]: which key each query row sees (``mask`` replaces causal; the window ANDs)."""
    q_pos = torch.arange(qo, device=device) + (kv - qo)
    k_pos = torch.arange(kv, device=device)
    keep = torch.ones(qo, kv, dtype=torch.bool, device=device)
    if mask is not None:
        keep &= mask.to(device, torch.bool).reshape(qo, kv)
    elif causal:
        keep &= k_pos[None, :] <= q_pos[:, None]
    if window_left is not None and window_left >= 0:
        keep &= k_pos[None, :] >= q_pos[:, None] - window_left
    return keep


def hide_unseen_keys(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Zero the keys (rows of K or V ``[kv, H, D]``) that no query row sees, so that a NaN there
    stays out of ``p @ v`` (``0 * NaN`` is NaN): docs/semantics.md, "Non-finite inputs", rule 2."""
    if keep.shape[0] == 0:
        return x
    return x.masked_fill(~keep.any(dim=0)[:, None, None], 0.0)


def golden_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: Optional[torch.Tensor] = None,
    window_left: int = -1,
    sm_scale: Optional[float] = None,
    logits_soft_cap: float = 0.0,
    pos_encoding_mode: str = "NONE",
    rope_scale: float = 1.0,
    rope_theta: float = 1e4,
    sinks: Optional[torch.Tensor] = None,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    o_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float64,
    device="cpu",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense fp64 attention of one request.  ``mask``: bool [qo, kv], True = keep (replaces causal).

    Returns (out float64 [qo, Hq, Dv], lse float64 [qo, Hq] in base 2).  Rows that see no key
    give out 0 and lse -inf.  ``compute_dtype`` other than float64 returns ``dtype_attention`` in
    that dtype instead: "the same torch math done in the backend's dtype", whose error sets the
    tolerance (``tolerance``; :func:`golden_and_baseline` gives both, with the RoPE rule).
    ``device``: where the math runs (a GPU is much faster in fp64 than the host for the fuzzer's
    volumes); results come back on the CPU.
    """
    if compute_dtype != torch.float64:
        return dtype_attention(q, k, v, dtype=compute_dtype, causal=causal, mask=mask, window_left=window_left,
                               sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                               pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta,
                               sinks=sinks, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=o_scale,
                               device=device)
    q = q.detach().to(device, torch.float64)
    k = k.detach().to(device, torch.float64)
    v = v.detach().to(device, torch.float64)
    qo, hq, d = q.shape
    kv, hkv = v.shape[0], v.shape[1]
    group = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    q_pos = torch.arange(qo, dtype=torch.float64, device=device) + (kv - qo)  # absolute positions
    k_pos = torch.arange(kv, dtype=torch.float64, device=device)
    if pos_encoding_mode == "ROPE_LLAMA":
        q = golden_rope(q, q_pos, rope_theta, rope_scale)
        k = golden_rope(k, k_pos, rope_theta, rope_scale)
    keep = visible(qo, kv, causal=causal, mask=mask, window_left=window_left, device=device)
    k, v = hide_unseen_keys(k, keep), hide_unseen_keys(v, keep)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * (sm_scale * q_scale * k_scale)
    if logits_soft_cap and logits_soft_cap > 0:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    if pos_encoding_mode == "ALIBI":
        rows = torch.arange(qo, dtype=torch.float64, device=device)
        bias = k_pos[None, :] - rows[:, None]  # kv_idx - q_idx (row index)
        s = s + golden_alibi_slopes(hq).to(device)[:, None, None] * bias[None]
    s = s.masked_fill(~keep[None], float("-inf"))
    if sinks is not None:
        sink = sinks.detach().to(device, torch.float64)[:, None, None].expand(hq, qo, 1)
        s_all = torch.cat([s, sink], dim=-1)
    else:
        s_all = s
    lse_e = torch.logsumexp(s_all, dim=-1)  # [hq, qo]
    seen = keep.any(dim=1)  # [qo]
    p = torch.exp(s - lse_e[..., None])
    p = torch.where(seen[None, :, None], p, torch.zeros_like(p))
    out = torch.einsum("hqk,khd->qhd", p, v) * (v_scale / o_scale)
    lse = (lse_e / math.log(2.0)).transpose(0, 1).contiguous()
    lse = torch.where(seen[:, None], lse, torch.full_like(lse, float("-inf")))
    return out.cpu(), lse.cpu()


# ---------------------------------------------------------------------------------------------
# The tolerance rule (docs/writing-a-backend.md), coded once: the conformance suite and the fuzzer
# (runner.check_result), ``attncore check`` and the per-backend tests all call ``tolerance``.
# ---------------------------------------------------------------------------------------------
TOL_FACTOR = 2.0  # times the error of the yardstick (the same torch math in the backend's dtype)
LSE_ATOL = 1e-3  # the base-2 LSE's rounding unit, whatever the dtype


def rounding_unit(dtype: torch.dtype, kind: str = "out") -> float:
    """The atol unit of the rule (scaled by ``max(1, max|golden|)``).  Outputs: eps of the output
    dtype, 16 eps for fp32 (GPU kernels use fast exp2 approximations, relative error ~2^-22, that the
    CPU yardstick does not; fp32 errors are tiny anyway, and TF32 matmuls, ~1e-3, still fail).
    LSE (``kind="lse"``): ``LSE_ATOL``."""
    if kind == "lse":
        return LSE_ATOL
    if kind != "out":
        raise ValueError(f"kind: got {kind!r}, expected 'out' or 'lse'")
    eps = float(torch.finfo(dtype).eps)
    return 16 * eps if dtype == torch.float32 else eps


def finite_error(x: torch.Tensor, golden: torch.Tensor) -> float:
    """Max |x - golden| over the elements where both are finite (0 when there are none)."""
    d = (x.detach().to("cpu", torch.float64) - golden.detach().to("cpu", torch.float64)).abs()
    d = d[torch.isfinite(d)]
    return float(d.max()) if d.numel() else 0.0


def tolerance_terms(baseline: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype, *, kind: str = "out",
                    atol_scale: float = 1.0) -> Tuple[float, float]:
    """(the yardstick's error, atol) of the rule; the bound is ``TOL_FACTOR * error + atol``."""
    g = golden.detach().to("cpu", torch.float64).abs()
    g = g[torch.isfinite(g)]
    atol = rounding_unit(dtype, kind) * max(1.0, float(g.max()) if g.numel() else 1.0) * atol_scale
    return finite_error(baseline, golden), atol


def tolerance(baseline: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype, *, kind: str = "out",
              atol_scale: float = 1.0) -> float:
    """Allowed max |result - golden| of one request: ``TOL_FACTOR`` x the error of the yardstick
    (``baseline``: :func:`golden_and_baseline`'s, or ``dtype_attention``'s) against the fp64
    ``golden``, plus ``rounding_unit(dtype, kind) * max(1, max|golden|)``.  ``dtype``: the output
    dtype (``kind="out"``; ignored for ``kind="lse"``, the base-2 LSE)."""
    berr, atol = tolerance_terms(baseline, golden, dtype, kind=kind, atol_scale=atol_scale)
    return TOL_FACTOR * berr + atol


# Fixed rounding floors per dtype, for comparing two runs of one backend (e.g. compiled against
# eager, tests/test_compile.py); checks against the golden use ``tolerance``.
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3,
        torch.float8_e4m3fn: 0.125, torch.float8_e5m2: 0.25}


def golden_and_baseline(q, k, v, *, dtype: torch.dtype, out_dtype: Optional[torch.dtype] = None, device="cpu",
                        **kw) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request: (golden out, golden lse, yardstick out, yardstick lse), float64 on the CPU.
    ``kw``: ``golden_attention``'s options.  The yardstick is ``dtype_attention`` in ``dtype`` (the
    backend's q dtype), rounded to ``out_dtype``.  With RoPE, rotated q and k are rounded to the
    dtype for the tensor cores, then the scores accumulate in fp32: with a few keys per row the
    yardstick's extra score rounding can cancel its q/k rounding and leave it far more exact than
    any kernel (a 5-key window: 0.0004 vs 0.007 in LSE), so the larger error of the two yardsticks
    (scores rounded to the dtype, scores in fp32) counts."""
    go, gl = golden_attention(q, k, v, device=device, **kw)
    bo, bl = dtype_attention(q, k, v, dtype=dtype, out_dtype=out_dtype, device=device, **kw)
    if kw.get("pos_encoding_mode", "NONE") == "ROPE_LLAMA" and dtype != torch.float32:
        fo, fl = dtype_attention(q, k, v, dtype=dtype, out_dtype=out_dtype, device=device,
                                 score_dtype=torch.float32, **kw)
        bo = fo if finite_error(fo, go) > finite_error(bo, go) else bo
        bl = fl if finite_error(fl, gl) > finite_error(bl, gl) else bl
    return go, gl, bo, bl


def max_error(out: torch.Tensor, golden: torch.Tensor) -> float:
    """Max abs error; NaN (e.g. an unwritten, NaN-poisoned element) counts as infinite."""
    if out.numel() == 0:
        return 0.0
    diff = (out.detach().to("cpu", torch.float64) - golden).abs()
    both_inf = torch.isinf(out.detach().cpu().double()) & torch.isinf(golden) & (
        torch.sign(out.detach().cpu().double()) == torch.sign(golden))
    diff = torch.where(both_inf, torch.zeros_like(diff), diff)
    if torch.isnan(diff).any():
        return float("inf")
    return float(diff.max())


def dtype_attention(q, k, v, *, dtype, out_dtype=None, softmax_dtype=torch.float32, causal=False, mask=None,
                    window_left=-1, sm_scale=None, logits_soft_cap=0.0, pos_encoding_mode="NONE", rope_scale=1.0,
                    rope_theta=1e4, sinks=None, q_scale=1.0, k_scale=1.0, v_scale=1.0, o_scale=1.0, device="cpu",
                    score_dtype=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain eager attention of one request in ``dtype`` (q, k, scores and P@V in ``dtype``, softmax in
    ``softmax_dtype``; ``score_dtype`` keeps the scores in another), on ``device`` (the CPU by
    default): the yardstick of the tolerance rule.  Returns (out float64 [qo, Hq, Dv] rounded to
    ``out_dtype`` (default ``dtype``), lse float64 [qo, Hq] base 2)."""
    out_dtype = out_dtype or dtype
    qo, hq, d = q.shape
    kv, hkv, dv = v.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    qf, kf, vf = (x.detach().to(device, torch.float64) for x in (q, k, v))
    q_pos = torch.arange(qo, dtype=torch.float64, device=device) + (kv - qo)
    k_pos = torch.arange(kv, dtype=torch.float64, device=device)
    if pos_encoding_mode == "ROPE_LLAMA":  # rotated in float32, as kernels do (angles of far positions)
        qf = golden_rope(qf, q_pos, rope_theta, rope_scale, torch.float32).double()
        kf = golden_rope(kf, k_pos, rope_theta, rope_scale, torch.float32).double()
    keep = visible(qo, kv, causal=causal, mask=mask, window_left=window_left, device=device)
    kf, vf = hide_unseen_keys(kf, keep), hide_unseen_keys(vf, keep)
    g = hq // hkv
    qd = qf.to(dtype)
    kd = kf.to(dtype).repeat_interleave(g, dim=1)
    vd = vf.to(dtype).repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", qd, kd)
    if score_dtype is not None:  # the products of the rounded q and k, accumulated in score_dtype
        s = torch.einsum("qhd,khd->hqk", qd.to(score_dtype), kd.to(score_dtype))
    s = s * (sm_scale * q_scale * k_scale)
    if logits_soft_cap and logits_soft_cap > 0:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    if pos_encoding_mode == "ALIBI":
        rows = torch.arange(qo, dtype=torch.float64, device=device)
        bias = golden_alibi_slopes(hq).to(device)[:, None, None] * (k_pos[None, :] - rows[:, None])[None]
        s = s + bias.to(dtype)
    sf = s.to(softmax_dtype).masked_fill(~keep[None], float("-inf"))
    if sinks is not None:
        sf = torch.cat([sf, sinks.detach().to(device, softmax_dtype)[:, None, None].expand(hq, qo, 1)], dim=-1)
    lse_e = torch.logsumexp(sf.float(), dim=-1).to(softmax_dtype)
    p = torch.exp(sf - lse_e[..., None])[..., :kv]
    seen = keep.any(dim=1)
    p = torch.where(seen[None, :, None], p, torch.zeros_like(p)).nan_to_num(0.0)
    o = torch.einsum("hqk,khd->qhd", p.to(dtype), vd)
    o = (o.float() * (v_scale / o_scale)).to(out_dtype).double()
    lse = (lse_e.double() / math.log(2.0)).transpose(0, 1)
    lse = torch.where(seen[:, None], lse, torch.full_like(lse, float("-inf")))
    return o.cpu(), lse.cpu()
