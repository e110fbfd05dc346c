"""Converters between the page-table forms (CSR indptr/indices/last_page_len and xqa's block tables),
and gathering a batch's pages into contiguous K/V."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from attncore.page.checks import _INDEX_DTYPES, _SEQ_LEN_DTYPES, _tensor, _same_device, _check_page_size, _check_page_table
from attncore.page.cache import unpack_paged_kv_cache, _cache_geometry, _storage_view, _token_slots, PagedKVCache, get_seq_lens, get_batch_indices_positions

# --------------------------------------------------------------------------------------------------
# converters
# --------------------------------------------------------------------------------------------------


def indptr_to_block_tables(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    *,
    max_pages: Optional[int] = None,
    pad_value: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Convert a CSR page table to the xqa form ``(block_tables, seq_lens)``.

    Parameters
    ----------
    kv_indptr : torch.Tensor
        ``[batch_size + 1]`` int32 (int64 accepted).
    kv_indices : torch.Tensor
        ``[>= kv_indptr[-1]]`` int32 (int64 accepted) page ids.
    kv_last_page_len : torch.Tensor
        ``[batch_size]`` int32 (int64 accepted).
    page_size : int
        Tokens per page, >= 1.
    max_pages : int, optional
        Columns of ``block_tables``; default the largest page count of any request. Must be at least
        that.
    pad_value : int
        Value of the unused entries of ``block_tables`` (default 0).

    Returns
    -------
    block_tables : torch.Tensor
        ``[batch_size, max_pages]`` int32; row ``i`` holds request ``i``'s page ids, then ``pad_value``.
    seq_lens : torch.Tensor
        ``[batch_size]`` int32 KV lengths (:func:`get_seq_lens`).

    Raises
    ------
    TypeError, ValueError
        Bad dtype, shape, device or page table values, or ``max_pages`` too small.
    """
    _tensor(kv_indptr, "kv_indptr", 1, _INDEX_DTYPES, "[batch_size + 1]")
    _check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size)
    if isinstance(pad_value, bool) or not isinstance(pad_value, int):
        raise TypeError(f"pad_value: got {type(pad_value).__name__} {pad_value!r}; accepted: an int")
    npages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    batch = npages.numel()
    longest = int(npages.max()) if batch else 0
    if max_pages is None:
        max_pages = longest
    elif isinstance(max_pages, bool) or not isinstance(max_pages, int):
        raise TypeError(f"max_pages: got {type(max_pages).__name__} {max_pages!r}; accepted: an int or None")
    elif max_pages < longest:
        raise ValueError(
            f"max_pages: got {max_pages}; accepted: None or an int >= {longest} (the most pages of a request)"
        )
    device = kv_indptr.device
    col = torch.arange(max_pages, dtype=torch.int64, device=device)
    valid = col[None, :] < npages[:, None]
    src = kv_indptr[:-1].to(torch.int64)[:, None] + col[None, :]
    table = torch.full((batch, max_pages), pad_value, dtype=torch.int64, device=device)
    table[valid] = kv_indices.to(torch.int64)[src[valid]]
    seq_lens = get_seq_lens(kv_indptr, kv_last_page_len, page_size)
    return table.to(torch.int32), seq_lens


def block_tables_to_indptr(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert the xqa form ``(block_tables, seq_lens)`` to a CSR page table.

    Parameters
    ----------
    block_tables : torch.Tensor
        ``[batch_size, max_pages]`` int32 (int64 accepted); the first ``ceil(seq_lens[i] / page_size)``
        entries of row ``i`` are its page ids, the rest is ignored.
    seq_lens : torch.Tensor
        ``[batch_size]`` int32 or uint32 (int64 accepted), KV lengths, ``>= 0``.
    page_size : int
        Tokens per page, >= 1.

    Returns
    -------
    kv_indptr : torch.Tensor
        ``[batch_size + 1]`` int32.
    kv_indices : torch.Tensor
        ``[kv_indptr[-1]]`` int32.
    kv_last_page_len : torch.Tensor
        ``[batch_size]`` int32, in ``[1, page_size]``; 0 for an empty request.

    Raises
    ------
    TypeError, ValueError
        Bad dtype, shape or device, a negative length, or a length needing more pages than
        ``block_tables`` has columns.
    """
    _check_page_size(page_size)
    _tensor(block_tables, "block_tables", 2, _INDEX_DTYPES, "[batch_size, max_pages]")
    batch, max_pages = block_tables.shape
    _tensor(seq_lens, "seq_lens", 1, _SEQ_LEN_DTYPES, "[batch_size]")
    if seq_lens.numel() != batch:
        raise ValueError(
            f"seq_lens: got shape {tuple(seq_lens.shape)}; accepted: [{batch}] (block_tables.shape[0])"
        )
    _same_device(block_tables, "block_tables", seq_lens=seq_lens)
    lens = seq_lens.to(torch.int64)
    npages = (lens + page_size - 1) // page_size
    if batch:
        lo, hi = torch.stack([lens.min(), npages.max()]).tolist()
        if lo < 0:
            raise ValueError(f"seq_lens: got a negative length {lo}; accepted: lengths >= 0")
        if hi > max_pages:
            raise ValueError(
                f"seq_lens: got a length needing {hi} pages of {page_size} tokens; accepted: at most "
                f"block_tables.shape[1] = {max_pages} pages"
            )
    device = block_tables.device
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    kv_indptr[1:] = torch.cumsum(npages, dim=0)
    col = torch.arange(max_pages, dtype=torch.int64, device=device)
    kv_indices = block_tables[col[None, :] < npages[:, None]]  # row-major: request by request
    last = lens - (npages - 1).clamp(min=0) * page_size
    return kv_indptr.to(torch.int32), kv_indices.to(torch.int32), last.to(torch.int32)


def gather_paged_kv(
    paged_kv_cache: PagedKVCache,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the tokens of a paged KV cache into dense ragged NHD tensors.

    Parameters
    ----------
    paged_kv_cache : torch.Tensor or tuple of torch.Tensor
        5-D or ``(k_cache, v_cache)``, see :func:`unpack_paged_kv_cache`; any dtype.
    kv_indptr : torch.Tensor
        ``[batch_size + 1]`` int32 (int64 accepted).
    kv_indices : torch.Tensor
        ``[>= kv_indptr[-1]]`` int32 page ids in ``[0, pages)``.
    kv_last_page_len : torch.Tensor
        ``[batch_size]`` int32 in ``[1, page_size]``.
    kv_layout : str
        Layout of the cache, ``"NHD"`` (default) or ``"HND"``.

    Returns
    -------
    k, v : torch.Tensor
        ``[nnz_kv, Hkv, D]`` (NHD, contiguous) in the cache dtype; request ``i``'s tokens in order
        occupy rows ``kv_indptr_tokens[i]:kv_indptr_tokens[i+1]``.
    kv_indptr_tokens : torch.Tensor
        ``[batch_size + 1]`` int32, CSR offsets in tokens (cumulative :func:`get_seq_lens`).

    Raises
    ------
    TypeError, ValueError
        Bad cache, layout, dtype, shape, device or page table values.
    """
    k_cache, v_cache = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    num_pages, page_size, _, _ = _cache_geometry(k_cache, kv_layout)
    _tensor(kv_indptr, "kv_indptr", 1, _INDEX_DTYPES, "[batch_size + 1]")
    _same_device(k_cache, "the cache", kv_indptr=kv_indptr)
    _check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
    seq_lens = get_seq_lens(kv_indptr, kv_last_page_len, page_size)
    tok_indptr = torch.zeros(seq_lens.numel() + 1, dtype=torch.int64, device=kv_indptr.device)
    tok_indptr[1:] = torch.cumsum(seq_lens.to(torch.int64), dim=0)
    nnz = int(tok_indptr[-1])
    batch_indices, positions = get_batch_indices_positions(tok_indptr, seq_lens, nnz)
    page, slot = _token_slots(kv_indptr, kv_indices, batch_indices, positions, page_size)
    out = []
    for cache in (k_cache, v_cache):
        src = _storage_view(cache)
        g = src[page, slot] if kv_layout == "NHD" else src[page, :, slot]
        out.append(g.contiguous().view(cache.dtype))
    return out[0], out[1], tok_indptr.to(torch.int32)
