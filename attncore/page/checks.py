"""Argument checks of the paged-KV utilities (and of ``attncore.rope``, which takes the same kinds of
index tensors): types, shapes and, outside CUDA-graph capture, values."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


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


def _check_indptr(indptr: torch.Tensor, name: str, num_items: Optional[int], items_name: str,
                  values: bool = True) -> None:
    """Shape/dtype of a CSR indptr, and (value check) indptr[0] == 0, non-decreasing, end bound.
    ``values=False``: shapes and dtypes only (a caller that reads the values itself)."""
    _tensor(indptr, name, 1, _INDEX_DTYPES, "[batch_size + 1]")
    if indptr.numel() < 1:
        raise ValueError(f"{name}: got shape {tuple(indptr.shape)}; accepted: [batch_size + 1], at least 1 element")
    if not values or not _check_values():
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
    values: bool = True,
) -> None:
    """Validate (kv_indptr, kv_indices, kv_last_page_len) against the rules in the module doc.
    ``values=False``: shapes, dtypes and devices only (a caller that reads the values itself)."""
    _check_page_size(page_size)
    _tensor(kv_indptr, "kv_indptr", 1, _INDEX_DTYPES, "[batch_size + 1]")
    if kv_indices is not None:
        _tensor(kv_indices, "kv_indices", 1, _INDEX_DTYPES, "[kv_indptr[-1]]")
        _same_device(kv_indptr, "kv_indptr", kv_indices=kv_indices)
    _check_indptr(
        kv_indptr, "kv_indptr", None if kv_indices is None else kv_indices.numel(), "kv_indices.numel()", values
    )
    batch = kv_indptr.numel() - 1
    _tensor(kv_last_page_len, "kv_last_page_len", 1, _INDEX_DTYPES, "[batch_size]")
    if kv_last_page_len.numel() != batch:
        raise ValueError(
            f"kv_last_page_len: got shape {tuple(kv_last_page_len.shape)}; accepted: [{batch}] "
            f"(batch_size = kv_indptr.numel() - 1)"
        )
    _same_device(kv_indptr, "kv_indptr", kv_last_page_len=kv_last_page_len)
    if not values or not _check_values():
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
