"""LSE merge of split-KV partials (the second half of flash-decoding).

Notation
  S        KV partitions (splits) of one request, planned on the host (attncore.core.schedule)
  row      one query row (token) of a split request; Hq query heads, D the head dim of v and the
           output (head_dim_vo, which may differ from q's and k's)
  TmpO     [part_rows, Hq, D] fp32, each split's normalized partial output (no v/o scale)
  TmpLse   [part_rows, Hq] fp32 base-2 LSE of each partial (-inf: the split saw no key)
  Merge    int32 [rows, 4] merge table: (out row, first partial row, partial row stride, S); split s
           of the row is partial row first + s * stride
Out = sum_s 2^(lse_s) o_s / (sum_s 2^(lse_s) + 2^(sink)) * out_scale; LSE = log2 of the denominator.
A row whose partials are all -inf gets out 0 and LSE -inf (sinks do not apply to it); a row with
a NaN partial LSE (a NaN query row that saw a key in that split) gets NaN out and LSE.
Grid: one program per (merge row, head), or (CUDA-graph mode, PERSISTENT) a fixed number of programs
per head looping over the live rows, whose count is ``Counts[1]`` on the device.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attncore.kernels.launch import fast_launcher

MERGE_FIELDS = 4


@triton.jit
def _merge_row(
    i, h, TmpO, TmpLse, Out, Lse, Merge, Sinks,
    stride_tt, stride_th, stride_ut, stride_uh, stride_ot, stride_oh, stride_lt, stride_lh, out_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr, STORE_LSE: tl.constexpr,
):
    mp = Merge + i * 4
    row = tl.load(mp).to(tl.int64)
    first = tl.load(mp + 1).to(tl.int64)
    pstride = tl.load(mp + 2).to(tl.int64)
    ns = tl.load(mp + 3)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_S], tl.int32)
    for s0 in range(0, ns, BLOCK_S):
        s = s0 + offs_s
        prow = first + s.to(tl.int64) * pstride
        ls = tl.load(TmpLse + prow * stride_ut + h * stride_uh, mask=s < ns, other=float("-inf"))
        m = tl.maximum(m, ls)
        nan = tl.maximum(nan, (ls != ls).to(tl.int32))
    m_all = tl.max(m, 0)  # max drops NaN: a NaN partial (NaN query row) is counted apart
    if HAS_SINKS:
        sink = tl.load(Sinks + h) * 1.4426950408889634
        m_ref = tl.maximum(m_all, sink)
    else:
        m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
    acc = tl.zeros([BLOCK_D], tl.float32)
    lsum = tl.zeros([BLOCK_S], tl.float32)
    dm = offs_d < HEAD_DIM
    for s0 in range(0, ns, BLOCK_S):
        s = s0 + offs_s
        sm = s < ns
        prow = first + s.to(tl.int64) * pstride
        ls = tl.load(TmpLse + prow * stride_ut + h * stride_uh, mask=sm, other=float("-inf"))
        w = tl.exp2(ls - m_ref)
        lsum += w
        o = tl.load(TmpO + prow[:, None] * stride_tt + h * stride_th + offs_d[None, :],
                    mask=sm[:, None] & dm[None, :], other=0.0)
        acc += tl.sum(o * w[:, None], 0)
    l_tot = tl.sum(lsum, 0)
    seen = (m_all > float("-inf")) | (tl.max(nan, 0) > 0)  # NaN partials: out and LSE NaN
    if HAS_SINKS:
        l_tot += tl.exp2(sink - m_ref)
    l_safe = tl.where(seen, l_tot, 1.0)
    o = tl.where(seen, acc / l_safe * out_scale, 0.0)
    tl.store(Out + row * stride_ot + h * stride_oh + offs_d, o.to(Out.dtype.element_ty), mask=dm)
    if STORE_LSE:
        lse = tl.where(seen, m_ref + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + row * stride_lt + h * stride_lh, lse)


@triton.jit
def _merge_splits(
    TmpO, TmpLse, Out, Lse, Merge, Counts, Sinks,
    stride_tt, stride_th, stride_ut, stride_uh, stride_ot, stride_oh, stride_lt, stride_lh, out_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr, STORE_LSE: tl.constexpr, PERSISTENT: tl.constexpr,
):
    h = tl.program_id(1)
    if PERSISTENT:
        for i in range(tl.program_id(0), tl.load(Counts + 1), tl.num_programs(0)):
            _merge_row(i, h, TmpO, TmpLse, Out, Lse, Merge, Sinks, stride_tt, stride_th, stride_ut, stride_uh,
                       stride_ot, stride_oh, stride_lt, stride_lh, out_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS, STORE_LSE)
    else:
        _merge_row(tl.program_id(0), h, TmpO, TmpLse, Out, Lse, Merge, Sinks, stride_tt, stride_th, stride_ut,
                   stride_uh, stride_ot, stride_oh, stride_lt, stride_lh, out_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS, STORE_LSE)


def merge_splits(tmp_o, tmp_lse, out, lse, merge, counts, sinks, *, num_rows, head_dim, out_scale,
                 max_splits, persistent_grid=0, num_warps=4):
    """Combine the partials of ``num_rows`` query rows (the merge table ``merge`` int32 [>= num_rows,
    4]) into ``out`` [nnz_q, Hq, D] and ``lse`` [nnz_q, Hq] (or None); ``head_dim`` is D, v's and the
    output's (head_dim_vo), the last dim of ``tmp_o`` too.  ``persistent_grid`` > 0
    (CUDA-graph mode): that many programs per head loop over ``counts[1]`` rows read on the device;
    ``max_splits`` then only sizes the split loop's vector (any count is merged)."""
    assert tmp_o.dim() == 3 and tmp_o.stride(2) == 1 and tmp_o.dtype.itemsize == 4
    assert tmp_lse.dim() == 2 and out.stride(2) == 1
    assert tmp_o.shape[2] == head_dim and out.shape[2] == head_dim, "tmp_o / out: last dim head_dim (head_dim_vo)"
    assert merge.dtype.itemsize == 4 and merge.is_contiguous() and counts.numel() >= 2
    assert max_splits >= 1
    if num_rows == 0 and not persistent_grid:
        return lambda *a: None
    hq = out.shape[1]
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    block_s = min(32, max(2, 1 << (max_splits - 1).bit_length()))
    ls = tuple(lse.stride()) if lse is not None else (0, 0)
    cx = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, HAS_SINKS=sinks is not None,
              STORE_LSE=lse is not None, PERSISTENT=bool(persistent_grid), num_warps=num_warps)
    launcher = fast_launcher(_merge_splits, (persistent_grid or num_rows, hq), cx)
    tail = (tmp_o.stride(0), tmp_o.stride(1), tmp_lse.stride(0), tmp_lse.stride(1),
            out.stride(0), out.stride(1), ls[0], ls[1], float(out_scale))

    def launch(out, lse, sinks):
        """Relaunch with new out / lse / sinks of the same strides and None-ness."""
        launcher(tmp_o, tmp_lse, out, lse if lse is not None else tmp_lse, merge, counts,
                 sinks if sinks is not None else tmp_lse, *tail)

    launch(out, lse, sinks)
    return launch
