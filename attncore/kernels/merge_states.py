"""The Triton kernel behind the fused state merges of :mod:`attncore.cascade` (imported on first use, so
that ``TRITON_INTERPRET`` can still be set before ``@triton.jit`` decorates it).

One launch merges ``n`` attention states ``(v_i [rows, H, D], s_i [rows, H])`` (base-2 LSEs) into one:
the ``num_stacked`` states of a strided stack ``V [rows, n, H, D]`` / ``S [rows, n, H]`` and, with
``HAS_B``, one more state ``(VB [rows, H, D], SB [rows, H])`` given apart (``merge_state``'s second
operand, so that it needs no copy).  A *lane* is one ``(row, head)`` pair; one program merges
``BLOCK_M`` lanes over the whole head dim (``BLOCK_D >= D``).  In float32, for each lane::

    m     = max_i s_i                       (NaN if any s_i is NaN, as torch.amax)
    m     = 0 if m == -inf else m           (every state empty: no -inf - -inf)
    w_i   = exp2(s_i - m)                   (0 for an empty state, 1 for the largest)
    out   = sum_{w_i > 0} w_i v_i / (sum_i w_i, or 1 where that sum is 0: every state empty)
    lse   = m + log2(sum_i w_i)             (-inf when every state is empty)

which is term for term the torch composition of ``attncore.cascade._merge``: an empty state's ``v``
(``w_i = 0``) is never read, so a NaN there never reaches the result, and two passes over the LSEs
(the maximum first) keep the same weights, hence the same dropped terms, as the torch path. A NaN
(or ``+inf``) LSE makes the sum NaN, hence ``out`` and ``lse`` NaN for that lane.  ``out``
is stored in ``Out``'s dtype and ``lse`` in float32; with ``HAS_MASK``, lanes whose row has
``Mask[row] == 0`` are not written (``merge_state_in_place``'s mask; ``Out``/``Lse`` may then be the
first state itself: every program reads its lanes before it writes them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_states_kernel(
    V, S, VB, SB, Out, Lse, Mask,
    num_lanes, num_heads, head_dim, num_stacked,
    stride_v_row, stride_v_n, stride_v_h, stride_v_d,
    stride_s_row, stride_s_n, stride_s_h,
    stride_vb_row, stride_vb_h, stride_vb_d,
    stride_sb_row, stride_sb_h,
    stride_o_row, stride_o_h, stride_o_d,
    stride_l_row, stride_l_h,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_B: tl.constexpr, HAS_MASK: tl.constexpr,
):
    lane = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    lmask = lane < num_lanes
    row = lane // num_heads
    head = lane % num_heads
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    vmask = lmask[:, None] & dmask[None, :]

    s_off = row * stride_s_row + head * stride_s_h
    v_off = row * stride_v_row + head * stride_v_h
    sb_off = row * stride_sb_row + head * stride_sb_h
    vb_off = row * stride_vb_row + head * stride_vb_h

    # pass 1: the largest LSE of each lane, and whether one is NaN
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    has_nan = tl.zeros([BLOCK_M], dtype=tl.int32)
    for i in range(num_stacked):
        s = tl.load(S + s_off + i * stride_s_n, mask=lmask, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, s)
        has_nan = has_nan | (s != s).to(tl.int32)
    if HAS_B:
        s = tl.load(SB + sb_off, mask=lmask, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, s)
        has_nan = has_nan | (s != s).to(tl.int32)
    m = tl.where(has_nan != 0, float("nan"), m)
    m = tl.where(m == float("-inf"), 0.0, m)

    # pass 2: weights relative to the maximum; a state of weight 0 (empty, or underflowed) is not read
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in range(num_stacked):
        s = tl.load(S + s_off + i * stride_s_n, mask=lmask, other=float("-inf")).to(tl.float32)
        w = tl.exp2(s - m)
        use = w > 0
        v = tl.load(V + v_off[:, None] + i * stride_v_n + d[None, :] * stride_v_d,
                    mask=vmask & use[:, None], other=0.0).to(tl.float32)
        total += w
        acc += tl.where(use[:, None], v * w[:, None], 0.0)
    if HAS_B:
        s = tl.load(SB + sb_off, mask=lmask, other=float("-inf")).to(tl.float32)
        w = tl.exp2(s - m)
        use = w > 0
        v = tl.load(VB + vb_off[:, None] + d[None, :] * stride_vb_d, mask=vmask & use[:, None],
                    other=0.0).to(tl.float32)
        total += w
        acc += tl.where(use[:, None], v * w[:, None], 0.0)

    # IEEE division (not the approximate one of a plain "/" on GPUs): a lone state comes back bit-exact
    denom = tl.where(total == 0, 1.0, total)  # NaN total (a NaN or +inf LSE): NaN out
    out = tl.math.div_rn(acc, tl.broadcast_to(denom[:, None], (BLOCK_M, BLOCK_D)))
    lse = m + tl.log2(total)

    keep = lmask
    if HAS_MASK:
        keep = keep & (tl.load(Mask + row, mask=lmask, other=0) != 0)
    o_off = row * stride_o_row + head * stride_o_h
    tl.store(Out + o_off[:, None] + d[None, :] * stride_o_d, out.to(Out.dtype.element_ty),
             mask=keep[:, None] & dmask[None, :])
    tl.store(Lse + row * stride_l_row + head * stride_l_h, lse, mask=keep)
