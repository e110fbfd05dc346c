"""The paged cache itself: unpacking its forms into (K, V), its geometry, token slots; the sequence
lengths and token positions of a page table; appending new tokens."""

from __future__ import annotations

import weakref
from typing import Tuple, Union

import torch

from attncore.page.checks import _INDEX_DTYPES, _SEQ_LEN_DTYPES, _check_values, _tensor, _same_device, _check_layout, _check_indptr, _check_page_table

PagedKVCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


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
        NHD ``[pages, page_size, Hkv, D]`` or HND ``[pages, Hkv, page_size, D]``, with equal shapes
        but for the last dim (V's may differ: head_dim_vo != head_dim_qk), dtypes and devices. Any dtype.
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
        shape (but for the last dim), dtype or device.
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
        if k_cache.shape[:-1] != v_cache.shape[:-1]:
            raise ValueError(
                f"paged_kv_cache: got k_cache shape {tuple(k_cache.shape)} and v_cache shape "
                f"{tuple(v_cache.shape)}; accepted: equal shapes but for the last dim (head_dim_qk / head_dim_vo)"
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
    return _seq_lens(kv_indptr, kv_last_page_len, page_size).to(torch.int32)


def _seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """``get_seq_lens`` without its checks, int64 (callers that checked, or read the values themselves)."""
    npages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    lens = (npages - 1).clamp(min=0) * page_size + kv_last_page_len.to(torch.int64)
    return torch.where(npages > 0, lens, torch.zeros_like(lens))


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
        ``[nnz, Hkv, D]`` (always token-major; append_value's D is v_cache's), same dtype and device
        as the cache.
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
    for name, t, dim in (("append_key", append_key, dim), ("append_value", append_value, v_cache.shape[-1])):
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
    _check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages, values=False)
    if nnz == 0:
        _check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
        return
    kernel = _use_kernel(k_cache, v_cache, append_key, append_value)
    _check_append(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages, batch_indices, positions, nnz,
                  kernel)
    if kernel:
        _append_launch(append_key, append_value, k_cache, v_cache, batch_indices, positions, kv_indptr, kv_indices,
                       page_size, num_pages, kv_layout)
        return
    page, slot = _token_slots(kv_indptr, kv_indices, batch_indices, positions, page_size)
    for cache, new in ((k_cache, append_key), (v_cache, append_value)):
        dst, src = _storage_view(cache), _storage_view(new)
        if kv_layout == "NHD":
            dst[page, slot] = src
        else:
            dst[page, :, slot] = src


class _Checked:
    """The index tensors of the last append whose values passed the checks: a model appends on every layer of
    a step with the same ones, and only the first append of a step need read them (each read is a host-device
    sync: on every layer it stalled a serving step's host).  The tensors are held weakly and matched by
    identity and version counter (bumped by every in-place torch write), so a new tensor, even at a freed
    one's address, or one changed through torch, is checked again.  Writes that bypass the counter (a custom
    kernel or a numpy view writing into a persistent buffer) are not seen: such a buffer is checked when it
    is first used and then trusted as FlashInfer trusts every table, but its values are always the ones
    used (the slots are computed on every call).  Inference tensors (torch.inference_mode) have no version
    counter: they are checked on every call."""

    def __init__(self):
        self.refs, self.versions, self.geometry = (), None, None

    @staticmethod
    def _versions(tensors: tuple):
        return None if any(t.is_inference() for t in tensors) else tuple(t._version for t in tensors)

    def seen(self, tensors: tuple, geometry: tuple) -> bool:
        if geometry != self.geometry or len(tensors) != len(self.refs):
            return False
        if any(r() is not t for r, t in zip(self.refs, tensors)):
            return False
        v = self._versions(tensors)
        return v is not None and v == self.versions

    def add(self, tensors: tuple, geometry: tuple) -> None:
        self.versions = self._versions(tensors)
        self.refs = tuple(weakref.ref(t) for t in tensors) if self.versions is not None else ()
        self.geometry = geometry


_checked = _Checked()


def _check_append(kv_indptr, kv_indices, kv_last_page_len, page_size: int, num_pages: int, batch_indices,
                  positions, nnz: int, kernel: bool = False) -> None:
    """Raise on the first value rule of an append that does not hold; the same tensors, unchanged since they
    were last checked, are not read again (``_Checked``).  Nothing is checked or kept during CUDA-graph capture
    (nothing can be read back) or a torch.compile trace.  ``kernel``: the verdict from the check kernel (one
    launch; the torch composition's ~30 device ops and sort took ~1 ms of a serving step on an H100)."""
    if _check_values() and not torch.compiler.is_compiling():
        tensors = (kv_indptr, kv_indices, kv_last_page_len, batch_indices, positions)
        geometry = (page_size, num_pages)  # the same tensors: the same device
        if not _checked.seen(tensors, geometry):
            # Every value rule in one device read; only when one fails, the checks below read again to name it.
            verdict = _append_values_ok_kernel if kernel and nnz <= PAIRWISE_MAX else _append_values_ok
            if not verdict(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages, batch_indices, positions):
                _check_page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
                _check_append_values(kv_indptr, kv_indices, kv_last_page_len, page_size, batch_indices, positions,
                                     nnz)
            _checked.add(tensors, geometry)


# --------------------------------------------------------------------------------------------------
# the append kernel (a GPU's eager appends: one launch instead of the torch composition's ten)
# --------------------------------------------------------------------------------------------------

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _use_kernel(k_cache, v_cache, append_key, append_value) -> bool:
    """The kernel on CUDA tensors with unit-stride rows, outside a torch.compile trace (which traces the torch
    composition); the torch composition elsewhere (CPU: tests run the kernel through Triton's interpreter)."""
    return (k_cache.is_cuda and not torch.compiler.is_compiling()
            and all(t.stride(-1) == 1 for t in (k_cache, v_cache, append_key, append_value)))


def _append_launch(append_key, append_value, k_cache, v_cache, batch_indices, positions, kv_indptr, kv_indices,
                   page_size: int, num_pages: int, kv_layout: str) -> None:
    from attncore.kernels import check_interpreted
    from attncore.kernels.append import append_kernel
    from attncore.kernels.launch import kept_launcher, launch_at

    check_interpreted(append_kernel, k_cache.device, "append_paged_kv_cache", "CPU tensors need TRITON_INTERPRET=1 "
                      "and CUDA tensors need it unset before attncore's append kernel is first used")
    as_int = _INT_OF_WIDTH[k_cache.element_size()]
    k, v, kc, vc = (t.view(as_int) for t in (append_key, append_value, k_cache, v_cache))
    slot_dim, head_dim = (1, 2) if kv_layout == "NHD" else (2, 1)
    heads, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               kc.stride(0), kc.stride(slot_dim), kc.stride(head_dim), vc.stride(0), vc.stride(slot_dim),
               vc.stride(head_dim))
    idx = (batch_indices, positions, kv_indptr, kv_indices)
    key = (kc.device, as_int, tuple(t.dtype for t in idx), strides, num_pages, page_size, heads, dk, dv)
    block_h = min(_pow2(heads), max(1, 4096 // max(_pow2(dk), _pow2(dv))))
    launch = kept_launcher(append_kernel, key, lambda: dict(
        DK=dk, DV=dv, BLOCK_H=block_h, BLOCK_DK=_pow2(dk), BLOCK_DV=_pow2(dv)))
    launch_at(launch, kc.device, (k.shape[0], -(-heads // block_h), 1),
              k, v, kc, vc, *idx, kv_indptr.shape[0] - 1, kv_indices.shape[0], num_pages, page_size, heads, *strides)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _append_values_ok(kv_indptr, kv_indices, kv_last_page_len, page_size: int, num_pages: int,
                      batch_indices, positions) -> bool:
    """Whether every value rule of ``append_paged_kv_cache`` holds, in one device-to-host read: the page
    table's (``_check_page_table``) and the tokens' (``_check_append_values``).  Indices are clamped so
    that no gather reads out of bounds whatever the values; a False sends the caller to those checks."""
    batch, n_idx = kv_indptr.numel() - 1, kv_indices.numel()
    if batch == 0 or n_idx == 0:
        return False
    ip = kv_indptr.to(torch.int64)
    npages = ip[1:] - ip[:-1]
    last = kv_last_page_len.to(torch.int64)
    ids = kv_indices.to(torch.int64)
    in_use = torch.arange(n_idx, device=ids.device) < ip[-1]
    b = batch_indices.to(torch.int64)
    p = positions.to(torch.int64)
    bc = b.clamp(0, batch - 1)
    kv_len = _seq_lens(kv_indptr, kv_last_page_len, page_size)
    pc = p.clamp(min=0)
    flat = ids[(ip[bc] + pc // page_size).clamp(0, n_idx - 1)] * page_size + pc % page_size
    flat = flat.sort().values
    ok = torch.stack([
        (ip[0] == 0) & (ip[-1] <= n_idx),
        (npages >= 0).all(),
        ((last >= (npages > 0).to(torch.int64)) & (last <= page_size)).all(),
        (((ids >= 0) & (ids < num_pages)) | ~in_use).all(),
        ((b >= 0) & (b < batch)).all(),
        ((p >= 0) & (p < kv_len[bc])).all(),
        (flat[1:] != flat[:-1]).all(),
    ])
    return bool(ok.all())


PAIRWISE_MAX = 16384  # tokens up to which the check kernel compares every pair for a shared slot (not a sort)
_CHECK_BLOCK = 128  # the check kernel's requests, page ids and tokens per program


def _append_values_ok_kernel(kv_indptr, kv_indices, kv_last_page_len, page_size: int, num_pages: int,
                             batch_indices, positions) -> bool:
    """``_append_values_ok``'s verdict from one launch of the check kernel and one read."""
    batch, n_idx, nnz = kv_indptr.numel() - 1, kv_indices.numel(), batch_indices.numel()
    if batch == 0 or n_idx == 0:
        return False
    from attncore.kernels.append import append_check_kernel
    from attncore.kernels.launch import kept_launcher, launch_at

    idx = (batch_indices, positions, kv_indptr, kv_indices, kv_last_page_len)
    key = (kv_indptr.device, tuple(t.dtype for t in idx), num_pages, page_size)
    launch = kept_launcher(append_check_kernel, key, lambda: dict(BLOCK=_CHECK_BLOCK))
    bad = torch.zeros(1, dtype=torch.int32, device=kv_indptr.device)
    launch_at(launch, bad.device, (-(-max(nnz, batch, n_idx) // _CHECK_BLOCK), 1, 1),
              *idx, bad, nnz, batch, n_idx, num_pages, page_size)
    return int(bad) == 0


def _check_append_values(kv_indptr, kv_indices, kv_last_page_len, page_size: int, batch_indices, positions,
                         nnz: int) -> None:
    """The tokens' value rules of ``append_paged_kv_cache``, each naming the first violation."""
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
    if torch.unique(page * page_size + slot).numel() != nnz:
        raise ValueError(
            "positions: got two tokens written to the same cache slot; accepted: distinct "
            "(batch index, position) pairs"
        )
