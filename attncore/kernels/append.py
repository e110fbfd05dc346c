"""The Triton kernels behind :func:`attncore.page.append_paged_kv_cache` on a GPU, the append and its value
check (imported on first use, so that ``TRITON_INTERPRET`` can still be set before ``@triton.jit`` decorates
them).

``append_kernel``: one program writes the K and V rows of one token (``BLOCK_H`` of its heads: grid axis 1
covers the rest): token ``t`` of request ``b = Batch[t]`` at position ``p = Pos[t]`` goes to page
``Indices[Indptr[b] + p // page_size]``, slot ``p % page_size``, as FlashInfer's append kernel places it, so
one launch replaces the torch composition (index arithmetic, two gathers, two index-puts: about ten launches
of host time).  The values are moved as integers of the element's width (the caller's views), so every dtype
is one copy.  The caller checked the index values (``append_check_kernel``, once per new index tensors); a
token whose request, page slot or page id still falls outside the tables (unchecked: under CUDA-graph
capture) is not written rather than written out of bounds.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_rows(Src, Dst, src_base, dst_base, stride_sh, stride_dh, h, hmask, DIM: tl.constexpr,
               BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    mask = hmask[:, None] & (d < DIM)[None, :]
    x = tl.load(Src + src_base + h[:, None] * stride_sh + d[None, :], mask=mask)
    tl.store(Dst + dst_base + h[:, None] * stride_dh + d[None, :], x, mask=mask)


@triton.jit(do_not_specialize=["batch", "num_indices"])
def append_kernel(
    K, V, KCache, VCache, Batch, Pos, Indptr, Indices,
    batch, num_indices, num_pages, page_size, heads,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kc_page, stride_kc_slot, stride_kc_head, stride_vc_page, stride_vc_slot, stride_vc_head,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.load(Batch + t).to(tl.int64)
    p = tl.load(Pos + t).to(tl.int64)
    ok = (b >= 0) & (b < batch) & (p >= 0)
    start = tl.load(Indptr + b, mask=ok, other=0).to(tl.int64)
    i = start + p // page_size
    ok = ok & (i < num_indices)
    page = tl.load(Indices + i, mask=ok, other=0).to(tl.int64)
    ok = ok & (page >= 0) & (page < num_pages)
    slot = p % page_size
    # the token's verdict as a vector (Triton's interpreter rejects a vector mask and-ed with a scalar)
    hmask = (h < heads) & (tl.zeros([BLOCK_H], dtype=tl.int1) | ok)
    _copy_rows(K, KCache, t * stride_kn, page * stride_kc_page + slot * stride_kc_slot, stride_kh,
               stride_kc_head, h, hmask, DK, BLOCK_DK)
    _copy_rows(V, VCache, t * stride_vn, page * stride_vc_page + slot * stride_vc_slot, stride_vh,
               stride_vc_head, h, hmask, DV, BLOCK_DV)


@triton.jit
def _token_slot(Batch, Pos, Indptr, Indices, Last, u, um, batch, num_indices, page_size):
    """(the flat slot ``page * page_size + slot`` of tokens ``u`` (indices clamped into the tables), whether
    each token's request and position are valid)."""
    b = tl.load(Batch + u, mask=um, other=0).to(tl.int64)
    p = tl.load(Pos + u, mask=um, other=0).to(tl.int64)
    bc = tl.minimum(tl.maximum(b, 0), batch - 1)
    lo = tl.load(Indptr + bc, mask=um, other=0).to(tl.int64)
    npages = tl.load(Indptr + bc + 1, mask=um, other=0).to(tl.int64) - lo
    last = tl.load(Last + bc, mask=um, other=0).to(tl.int64)
    kv_len = tl.where(npages > 0, (npages - 1) * page_size + last, 0)
    ok = (b >= 0) & (b < batch) & (p >= 0) & (p < kv_len)
    pc = tl.maximum(p, 0)
    idx = tl.minimum(tl.maximum(lo + pc // page_size, 0), num_indices - 1)
    page = tl.load(Indices + idx, mask=um, other=0).to(tl.int64)
    return page * page_size + pc % page_size, ok


@triton.jit(do_not_specialize=["nnz", "batch", "num_indices"])
def append_check_kernel(
    Batch, Pos, Indptr, Indices, Last, Bad, nnz, batch, num_indices, num_pages, page_size, BLOCK: tl.constexpr,
):
    """Adds to ``Bad[0]`` the number of broken append rules in this program's block of requests, page ids
    and tokens (``attncore.page.cache._append_values_ok``'s rules, one launch): the page table's (indptr
    starts at 0, ends within the ids, never decreases; last-page lengths in range; page ids in use within the
    pages) and the tokens' (request and position within it; no two tokens on one slot, by comparing every
    pair: the caller keeps this to batches where that is cheap).  Requires ``batch >= 1``,
    ``num_indices >= 1``."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    first = tl.load(Indptr).to(tl.int64)
    end = tl.load(Indptr + batch).to(tl.int64)
    bad = ((first != 0) | (end > num_indices)).to(tl.int32)
    rm = r < batch
    lo = tl.load(Indptr + r, mask=rm, other=0).to(tl.int64)
    npages = tl.load(Indptr + r + 1, mask=rm, other=0).to(tl.int64) - lo
    last = tl.load(Last + r, mask=rm, other=1).to(tl.int64)
    rbad = (npages < 0) | (last < (npages > 0).to(tl.int64)) | (last > page_size)
    im = r < num_indices
    ids = tl.load(Indices + r, mask=im, other=0).to(tl.int64)
    ibad = (r < end) & ((ids < 0) | (ids >= num_pages))
    tm = r < nnz
    flat, ok = _token_slot(Batch, Pos, Indptr, Indices, Last, r, tm, batch, num_indices, page_size)
    dup = tl.zeros([BLOCK], dtype=tl.int32)
    # only a program holding tokens compares them (a long page table adds programs, not comparisons)
    upto = tl.where(tl.program_id(0) * BLOCK < nnz, nnz, 0)
    for start in range(0, upto, BLOCK):
        u = start + tl.arange(0, BLOCK)
        um = u < nnz
        flat_u, _ = _token_slot(Batch, Pos, Indptr, Indices, Last, u, um, batch, num_indices, page_size)
        same = (flat[:, None] == flat_u[None, :]) & (r[:, None] != u[None, :]) & um[None, :]
        dup = tl.maximum(dup, tl.max(same.to(tl.int32), axis=1))
    n = (tl.sum((rm & rbad).to(tl.int32), axis=0) + tl.sum((im & ibad).to(tl.int32), axis=0)
         + tl.sum((tm & ~ok).to(tl.int32), axis=0) + tl.sum(tl.where(tm, dup, 0), axis=0))
    tl.atomic_add(Bad, n + bad)
