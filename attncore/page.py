"""Paged KV-cache utilities (FlashInfer-compatible ``flashinfer.page`` plus converters).

Page table rules (``docs/semantics.md``):

* ``kv_indptr[B+1]`` (page counts, CSR, ``kv_indptr[0] = 0``), ``kv_indices[kv_indptr[-1]]`` (page
  ids; a longer buffer is allowed), ``kv_last_page_len[B]`` with ``1 <= last_page_len <= page_size``
  for a request with pages (for a request with no pages any value in ``[0, page_size]`` is accepted
  and ignored; converters produce 0).
* ``kv_len[i] = (num_pages_i - 1) * page_size + last_page_len[i]``, 0 for no pages.
* Token ``t`` of request ``i`` lives in page ``kv_indices[kv_indptr[i] + t // page_size]``, slot
  ``t % page_size``.
* Paged cache: one 5-D tensor NHD ``[pages, 2, page_size, Hkv, D]`` / HND
  ``[pages, 2, Hkv, page_size, D]`` (``[:, 0]`` = K, ``[:, 1]`` = V) or a tuple ``(k_cache, v_cache)``
  of 4-D tensors. page_size is read from the cache.
* xqa form: ``block_tables[B, max_pages]`` int32 and ``seq_lens[B]`` (int32 or uint32).

Everything is plain torch and runs on the device of the inputs. The functions validate values
(ranges, monotonicity), which reads small tensors on the host (a device sync on CUDA); value checks
are skipped while a CUDA graph is being captured so that :func:`get_seq_lens`,
:func:`append_paged_kv_cache` and :func:`get_batch_indices_positions` stay capturable.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "get_seq_lens",
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "indptr_to_block_tables",
    "block_tables_to_indptr",
    "gather_paged_kv",
    "unpack_paged_kv_cache",
]

PagedKVCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]

_LAYOUTS = ("NHD", "HND")
_INDEX_DTYPES = (torch.int32, torch.int64)
_SEQ_LEN_DTYPES = (torch.int32, torch.int64, torch.uint32)


# --------------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------------


def _check_values() -> bool:
    """Value checks read device memory on the host; never do that inside CUDA graph capture."""
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _tensor(x, name: str, ndim: int, dtypes: Optional[Sequence[torch.dtype]] = None, what: str = ""):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: got {type(x).__name__}; accepted: a torch.Tensor {what}".rstrip())
    if dtypes is not None and x.dtype not in dtypes:
        acc = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: got dtype {x.dtype}; accepted: {acc}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: got shape {tuple(x.shape)}; accepted: a {ndim}-D tensor {what}".rstrip())


def _same_device(ref: torch.Tensor, ref_name: str, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != ref.device:
            raise ValueError(f"{name}: got device {t.device}; accepted: {ref_name}'s device {ref.device}")


def _check_page_size(page_size) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size: got {type(page_size).__name__} {page_size!r}; accepted: an int >= 1")
    if page_size < 1:
        raise ValueError(f"page_size: got {page_size}; accepted: an int >= 1")
    return page_size


def _check_layout(kv_layout) -> str:
    if kv_layout not in _LAYOUTS:
        raise ValueError(f"kv_layout: got {kv_layout!r}; accepted: 'NHD' or 'HND'")
    return kv_layout


def _check_indptr(indptr: torch.Tensor, name: str, num_items: Optional[int], items_name: str) -> None:
    """Shape/dtype of a CSR indptr, and (value check) indptr[0] == 0, non-decreasing, end bound."""
    _tensor(indptr, name, 1, _INDEX_DTYPES, "[batch_size + 1]")
    if indptr.numel() < 1:
        raise ValueError(f"{name}: got shape {tuple(indptr.shape)}; accepted: [batch_size + 1], at least 1 element")
    if not _check_values():
        return
    ip = indptr.to(torch.int64)
    first, last = torch.stack([ip[0], ip[-1]]).tolist()
    if first != 0:
        raise ValueError(f"{name}: got {name}[0] = {first}; accepted: {name}[0] == 0")
    steps = ip[1:] - ip[:-1]
    if steps.numel() and bool((steps < 0).any()):
        i = int(torch.nonzero(steps < 0)[0, 0])
        raise ValueError(
            f"{name}: got a decreasing step at {i} ({int(ip[i])} -> {int(ip[i + 1])}); "
            "accepted: a non-decreasing tensor"
        )
    if num_items is not None and last > num_items:
        raise ValueError(
            f"{name}: got {name}[-1] = {last}; accepted: at most {items_name} = {num_items}"
        )


def _check_page_table(
    kv_indptr: torch.Tensor,
    kv_indices: Optional[torch.Tensor],
    kv_last_page_len: torch.Tensor,
    page_size: int,
    num_pages: Optional[int] = None,
) -> None:
    """Validate (kv_indptr, kv_indices, kv_last_page_len) against the rules in the module doc."""
    _check_page_size(page_size)
    _tensor(kv_indptr, "kv_indptr", 1, _INDEX_DTYPES, "[batch_size + 1]")
    if kv_indices is not None:
        _tensor(kv_indices, "kv_indices", 1, _INDEX_DTYPES, "[kv_indptr[-1]]")
        _same_device(kv_indptr, "kv_indptr", kv_indices=kv_indices)
    _check_indptr(
        kv_indptr, "kv_indptr", None if kv_indices is None else kv_indices.numel(), "kv_indices.numel()"
    )
    batch = kv_indptr.numel() - 1
    _tensor(kv_last_page_len, "kv_last_page_len", 1, _INDEX_DTYPES, "[batch_size]")
    if kv_last_page_len.numel() != batch:
        raise ValueError(
            f"kv_last_page_len: got shape {tuple(kv_last_page_len.shape)}; accepted: [{batch}] "
            f"(batch_size = kv_indptr.numel() - 1)"
        )
    _same_device(kv_indptr, "kv_indptr", kv_last_page_len=kv_last_page_len)
    if not _check_values():
        return
    npages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    last = kv_last_page_len.to(torch.int64)
    lo = (npages > 0).to(torch.int64)  # 1 for a request with pages, 0 for an empty one
    bad = (last < lo) | (last > page_size)
    if batch and bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"kv_last_page_len: got kv_last_page_len[{i}] = {int(last[i])} for a request with "
            f"{int(npages[i])} pages; accepted: 1 <= kv_last_page_len <= page_size = {page_size} "
            "(0 allowed only for a request with no pages)"
        )
    if kv_indices is not None and num_pages is not None:
        used = kv_indices[: int(kv_indptr[-1])].to(torch.int64)
        if used.numel():
            lo_id, hi_id = torch.stack([used.min(), used.max()]).tolist()
            if lo_id < 0 or hi_id >= num_pages:
                raise ValueError(
                    f"kv_indices: got page ids in [{lo_id}, {hi_id}]; accepted: page ids in "
                    f"[0, {num_pages}) (the number of pages in paged_kv_cache)"
                )


# --------------------------------------------------------------------------------------------------
# cache unpacking
# --------------------------------------------------------------------------------------------------


def unpack_paged_kv_cache(
    paged_kv_cache: PagedKVCache, kv_layout: str = "NHD"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split a paged KV cache into its K and V 4-D views.

    Parameters
    ----------
    paged_kv_cache : torch.Tensor or tuple of torch.Tensor
        Either one 5-D tensor, NHD ``[pages, 2, page_size, Hkv, D]`` or HND
        ``[pages, 2, Hkv, page_size, D]``, or a tuple/list ``(k_cache, v_cache)`` of two 4-D tensors,
        NHD ``[pages, page_size, Hkv, D]`` or HND ``[pages, Hkv, page_size, D]``, with equal shapes,
        dtypes and devices. Any dtype.
    kv_layout : str
        ``"NHD"`` (default) or ``"HND"``.

    Returns
    -------
    k_cache, v_cache : torch.Tensor
        4-D views (no copy) sharing storage with the input: ``paged_kv_cache[:, 0]`` and
        ``paged_kv_cache[:, 1]`` for a 5-D tensor; the tuple's elements unchanged otherwise.

    Raises
    ------
    TypeError
        Not a tensor or a pair of tensors.
    ValueError
        Bad ``kv_layout``, wrong ``ndim``, dimension 1 of a 5-D cache is not 2, or K and V differ in
        shape, dtype or device.
    """
    _check_layout(kv_layout)
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            form = "[pages, 2, page_size, Hkv, D]" if kv_layout == "NHD" else "[pages, 2, Hkv, page_size, D]"
            raise ValueError(
                f"paged_kv_cache: got a tensor of shape {tuple(paged_kv_cache.shape)}; accepted: a 5-D "
                f"tensor {form} ({kv_layout}) or a tuple (k_cache, v_cache) of 4-D tensors"
            )
        return paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2 or not all(isinstance(t, torch.Tensor) for t in paged_kv_cache):
            kinds = [type(t).__name__ for t in paged_kv_cache]
            raise TypeError(
                f"paged_kv_cache: got a {type(paged_kv_cache).__name__} of {kinds}; accepted: a tuple "
                "(k_cache, v_cache) of two torch.Tensor"
            )
        k_cache, v_cache = paged_kv_cache
        form = "[pages, page_size, Hkv, D]" if kv_layout == "NHD" else "[pages, Hkv, page_size, D]"
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dim() != 4:
                raise ValueError(
                    f"paged_kv_cache ({name}): got shape {tuple(t.shape)}; accepted: a 4-D tensor {form} "
                    f"({kv_layout})"
                )
        if k_cache.shape != v_cache.shape:
            raise ValueError(
                f"paged_kv_cache: got k_cache shape {tuple(k_cache.shape)} and v_cache shape "
                f"{tuple(v_cache.shape)}; accepted: equal shapes"
            )
        if k_cache.dtype != v_cache.dtype:
            raise TypeError(
                f"paged_kv_cache: got k_cache dtype {k_cache.dtype} and v_cache dtype {v_cache.dtype}; "
                "accepted: equal dtypes"
            )
        if k_cache.device != v_cache.device:
            raise ValueError(
                f"paged_kv_cache: got k_cache on {k_cache.device} and v_cache on {v_cache.device}; "
                "accepted: the same device"
            )
        return k_cache, v_cache
    raise TypeError(
        f"paged_kv_cache: got {type(paged_kv_cache).__name__}; accepted: a 5-D torch.Tensor or a tuple "
        "(k_cache, v_cache) of 4-D tensors"
    )


def _cache_geometry(k_cache: torch.Tensor, kv_layout: str) -> Tuple[int, int, int, int]:
    """(num_pages, page_size, num_kv_heads, head_dim) of a 4-D K (or V) cache."""
    if kv_layout == "NHD":
        pages, page_size, heads, dim = k_cache.shape
    else:
        pages, heads, page_size, dim = k_cache.shape
    return pages, page_size, heads, dim


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    """Index-put is not implemented for every dtype (fp8); move 1-byte floats as raw bytes."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def _token_slots(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, batch_indices: torch.Tensor,
    positions: torch.Tensor, page_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(page id, slot) for tokens given by (request, position), as int64."""
    b = batch_indices.to(torch.int64)
    p = positions.to(torch.int64)
    page = kv_indices.to(torch.int64)[kv_indptr.to(torch.int64)[b] + p // page_size]
    return page, p % page_size


# --------------------------------------------------------------------------------------------------
# FlashInfer API
# --------------------------------------------------------------------------------------------------


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV length of every request of a paged KV cache.

    Parameters
    ----------
    kv_indptr : torch.Tensor
        ``[batch_size + 1]``, int32 (int64 accepted): page counts in CSR form, ``kv_indptr[0] = 0``.
    kv_last_page_len : torch.Tensor
        ``[batch_size]``, int32 (int64 accepted): tokens in the last page of each request, in
        ``[1, page_size]`` (any value in ``[0, page_size]`` for a request with no pages).
    page_size : int
        Tokens per page, >= 1.

    Returns
    -------
    torch.Tensor
        ``[batch_size]`` int32 on ``kv_indptr.device``:
        ``(num_pages - 1) * page_size + kv_last_page_len``, 0 for a request with no pages.

    Raises
    ------
    TypeError, ValueError
        Bad dtype, shape, device or page table values (see module doc).
    """
    _check_page_table(kv_indptr, None, kv_last_page_len, page_size)
    npages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    lens = (npages - 1).clamp(min=0) * page_size + kv_last_page_len.to(torch.int64)
    return torch.where(npages > 0, lens, torch.zeros_like(lens)).to(torch.int32)


def get_batch_indices_positions(
    append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Request index and absolute KV position of every appended token.

    Request ``i`` appends ``append_indptr[i+1] - append_indptr[i]`` tokens that end its KV sequence
    (``seq_lens`` are the KV lengths *after* the append), so its ``j``-th appended token goes to
    position ``seq_lens[i] - append_len_i + j``.

    Parameters
    ----------
    append_indptr : torch.Tensor
        ``[batch_size + 1]`` int32 (int64 accepted), CSR offsets of the appended tokens,
        ``append_indptr[0] = 0`` and ``append_indptr[-1] = nnz``.
    seq_lens : torch.Tensor
        ``[batch_size]`` int32 (int64/uint32 accepted), KV lengths after the append, each
        ``>= append_len_i``.
    nnz : int
        Total number of appended tokens (passed so no device sync is needed).

    Returns
    -------
    batch_indices : torch.Tensor
        ``[nnz]`` int32, the request of each token.
    positions : torch.Tensor
        ``[nnz]`` int32, the KV position of each token inside its request.

    Raises
    ------
    TypeError, ValueError
        Bad dtype, shape, device, ``nnz`` not ``append_indptr[-1]`` or a ``seq_len`` smaller than the
        number of tokens its request appends.
    """
    if isinstance(nnz, bool) or not isinstance(nnz, int):
        raise TypeError(f"nnz: got {type(nnz).__name__} {nnz!r}; accepted: an int >= 0")
    if nnz < 0:
        raise ValueError(f"nnz: got {nnz}; accepted: an int >= 0")
    _check_indptr(append_indptr, "append_indptr", None, "")
    batch = append_indptr.numel() - 1
    _tensor(seq_lens, "seq_lens", 1, _SEQ_LEN_DTYPES, "[batch_size]")
    if seq_lens.numel() != batch:
        raise ValueError(
            f"seq_lens: got shape {tuple(seq_lens.shape)}; accepted: [{batch}] "
            "(batch_size = append_indptr.numel() - 1)"
        )
    _same_device(append_indptr, "append_indptr", seq_lens=seq_lens)
    ip = append_indptr.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    append_len = ip[1:] - ip[:-1]
    if _check_values():
        last = int(ip[-1])
        if last != nnz:
            raise ValueError(f"nnz: got {nnz}; accepted: append_indptr[-1] = {last}")
        short = lens < append_len
        if batch and bool(short.any()):
            i = int(torch.nonzero(short)[0, 0])
            raise ValueError(
                f"seq_lens: got seq_lens[{i}] = {int(lens[i])} for a request appending "
                f"{int(append_len[i])} tokens; accepted: seq_lens >= append length (KV lengths after "
                "the append)"
            )
    tok = torch.arange(nnz, dtype=torch.int64, device=append_indptr.device)
    batch_indices = torch.searchsorted(ip[1:].contiguous(), tok, right=True)
    if batch:
        batch_indices = batch_indices.clamp(max=batch - 1)
        positions = lens[batch_indices] - append_len[batch_indices] + (tok - ip[batch_indices])
    else:
        positions = tok
    return batch_indices.to(torch.int32), positions.to(torch.int32)


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    """Write new key/value tokens into a paged KV cache, in place.

    Token ``j`` goes to request ``b = batch_indices[j]`` at KV position ``p = positions[j]``: page
    ``kv_indices[kv_indptr[b] + p // page_size]``, slot ``p % page_size``. The page table must
    already describe the sequences *including* the appended tokens (``p < kv_len[b]``); use
    :func:`get_batch_indices_positions` to build ``batch_indices``/``positions``.

    Parameters
    ----------
    append_key, append_value : torch.Tensor
        ``[nnz, Hkv, D]`` (always token-major), same dtype and device as the cache.
    batch_indices, positions : torch.Tensor
        ``[nnz]`` int32 (int64 accepted).
    paged_kv_cache : torch.Tensor or tuple of torch.Tensor
        5-D ``[pages, 2, page_size, Hkv, D]`` (NHD) / ``[pages, 2, Hkv, page_size, D]`` (HND), or a
        tuple ``(k_cache, v_cache)`` of 4-D tensors; see :func:`unpack_paged_kv_cache`. Modified in place.
    kv_indices : torch.Tensor
        ``[>= kv_indptr[-1]]`` int32 page ids, in ``[0, pages)``.
    kv_indptr : torch.Tensor
        ``[batch_size + 1]`` int32.
    kv_last_page_len : torch.Tensor
        ``[batch_size]`` int32, in ``[1, page_size]``.
    kv_layout : str
        ``"NHD"`` (default) or ``"HND"``.

    Returns
    -------
    None

    Raises
    ------
    TypeError, ValueError
        Bad dtype, shape, device, page table values, a token outside its request's KV length, a
        request index outside ``[0, batch_size)`` or two tokens written to the same slot.
    """
    k_cache, v_cache = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    num_pages, page_size, heads, dim = _cache_geometry(k_cache, kv_layout)
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        _tensor(t, name, 3, None, "[nnz, Hkv, D]")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name}: got dtype {t.dtype}; accepted: the cache dtype {k_cache.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name}: got device {t.device}; accepted: the cache device {k_cache.device}")
        if tuple(t.shape[1:]) != (heads, dim):
            raise ValueError(
                f"{name}: got shape {tuple(t.shape)}; accepted: [nnz, {heads}, {dim}] (Hkv, D of the cache)"
            )
    nnz = append_key.shape[0]
    if append_value.shape[0] != nnz:
        raise ValueError(
            f"append_value: got shape {tuple(append_value.shape)}; accepted: [{nnz}, {heads}, {dim}] "
            "(same nnz as append_key)"
        )
    for name, t in (("batch_indices", batch_indices), ("positions", positions)):
        _tensor(t, name, 1, _INDEX_DTYPES, "[nnz]")
        if t.numel() != nnz:
            raise ValueError(f"{name}: got shape {tuple(t.shape)}; accepted: [{nnz}] (nnz of append_key)")
        if t.device != k_cache.device:
            raise ValueError(f"{name}: got device {t.device}; accepted: the cache device {k_cache.device}")
    _tensor(kv_indptr, "kv_indptr", 1, _INDEX_DTYPES, "[batch_size + 1]")
    _same_device(k_cache, "the cache", kv_indptr=kv_indptr)
    _check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
    if nnz == 0:
        return
    if _check_values():
        batch = kv_indptr.numel() - 1
        b = batch_indices.to(torch.int64)
        p = positions.to(torch.int64)
        b_lo, b_hi = torch.stack([b.min(), b.max()]).tolist()
        if b_lo < 0 or b_hi >= batch:
            raise ValueError(
                f"batch_indices: got values in [{b_lo}, {b_hi}]; accepted: [0, {batch}) (batch_size)"
            )
        kv_len = get_seq_lens(kv_indptr, kv_last_page_len, page_size).to(torch.int64)[b]
        bad = (p < 0) | (p >= kv_len)
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"positions: got positions[{j}] = {int(p[j])} for request {int(b[j])} of kv length "
                f"{int(kv_len[j])}; accepted: 0 <= position < kv length (the page table must include "
                "the appended tokens)"
            )
        page, slot = _token_slots(kv_indptr, kv_indices, batch_indices, positions, page_size)
        flat = page * page_size + slot
        if torch.unique(flat).numel() != nnz:
            raise ValueError(
                "positions: got two tokens written to the same cache slot; accepted: distinct "
                "(batch index, position) pairs"
            )
    else:
        page, slot = _token_slots(kv_indptr, kv_indices, batch_indices, positions, page_size)
    for cache, new in ((k_cache, append_key), (v_cache, append_value)):
        dst, src = _storage_view(cache), _storage_view(new)
        if kv_layout == "NHD":
            dst[page, slot] = src
        else:
            dst[page, :, slot] = src


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
