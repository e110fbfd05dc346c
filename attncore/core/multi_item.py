"""Multi-item scoring (FlashInfer 0.2.14's ``prefix_len_ptr``, ``token_pos_in_items_ptr``,
``token_pos_in_items_len``, ``max_item_len_ptr``) as a custom mask built at ``plan()`` time.

One request holds a shared prefix, then items, each opened by a delimiter token:
``token_pos_in_items[i*stride + (p - prefix_len[i])]`` is the position of sequence position ``p``
(``p >= prefix_len[i]``) in its item, 0 at the delimiter.  The rule FlashInfer's kernel applies
(``logits_mask_multi_item_scoring`` in its prefill.cuh), for a query at sequence position
``pos = kv_len - qo_len + row``:

* ``pos < prefix_len``: causal, as usual;
* otherwise, with ``t`` its position in its item: key ``j`` is kept when ``j <= pos`` and
  (``j < prefix_len`` or ``j > pos - t``): the prefix plus the item's own tokens up to itself, never
  the delimiter (a delimiter, ``t = 0``, sees the prefix only).

Multi-item scoring is causal by definition (the kernel ignores ``causal``); the sliding window ANDs
as with any mask.  Every backend that takes a custom mask serves it with no kernel change; one that
does not is refused by the capability check (the problem's mask is ``"custom"``).  docs/semantics.md,
"Multi-item scoring".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from attncore.core import _api
from attncore.core import checks as _checks

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64)


@dataclass(frozen=True)
class MultiItem:
    """The validated arguments, on the host: ``prefix_len`` per request, ``token_pos`` (int64, the
    whole 1-D tensor), ``stride`` (``token_pos_in_items_len``), ``max_item_len`` per request or None."""
    prefix_len: List[int]
    token_pos: torch.Tensor
    stride: int
    max_item_len: Optional[List[int]]


def _host_ints(where: str, name: str, t, *, batch_size: Optional[int] = None) -> torch.Tensor:
    """A 1-D integer tensor (any device) as int64 on the host, checked non-negative.  A per-request
    one may be 0-D for a batch of one (FlashInfer's own test passes ``torch.tensor(prefix_len)``)."""
    if batch_size is not None and isinstance(t, torch.Tensor) and t.dim() == 0:
        t = t.reshape(1)
    _checks.check_tensor(f"{where}: {name}", t, ndim=1, dtype=_INT_DTYPES)
    if batch_size is not None and t.numel() != batch_size:
        raise ValueError(f"{where}: {name}: got {t.numel()} entries, expected batch_size = {batch_size} "
                         f"(one per request)")
    h = t.detach().to("cpu").to(torch.int64)
    if h.numel() and int(h.min()) < 0:
        raise ValueError(f"{where}: {name}: got a negative entry {int(h.min())}, expected values >= 0")
    return h


def _stride(where: str, value) -> int:
    """``token_pos_in_items_len``: an int or a one-element integer tensor (FlashInfer's own test passes
    ``torch.tensor(n, dtype=torch.uint32)``), >= 0."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype not in _INT_DTYPES:
            raise TypeError(f"{where}: token_pos_in_items_len: got a tensor of shape {list(value.shape)} and dtype "
                            f"{_api.dtype_name(value.dtype)}, expected an int (or a one-element integer tensor)")
        value = int(value.reshape(-1)[0].to("cpu").to(torch.int64))  # copy first: few casts exist for uint32 on GPUs
    elif isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: token_pos_in_items_len: got {value!r}, expected an int")
    if value < 0:
        raise ValueError(f"{where}: token_pos_in_items_len: got {value}, expected an int >= 0")
    return value


def parse(where: str, prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr, *,
          batch_size: int, causal, custom_mask, packed_custom_mask) -> Optional[MultiItem]:
    """Validate plan()'s multi-item arguments; None when multi-item scoring is off (all four unset:
    None, and ``token_pos_in_items_len`` 0).  ``prefix_len_ptr`` turns it on (as in FlashInfer); the
    others without it are an error, never ignored."""
    stride_given = token_pos_in_items_len is not None and not (
        isinstance(token_pos_in_items_len, int) and not isinstance(token_pos_in_items_len, bool)
        and token_pos_in_items_len == 0)
    if prefix_len_ptr is None:
        extra = [n for n, v in (("token_pos_in_items_ptr", token_pos_in_items_ptr),
                                ("max_item_len_ptr", max_item_len_ptr)) if v is not None]
        if stride_given:
            extra.append("token_pos_in_items_len")
        if extra:
            raise ValueError(f"{where}: {', '.join(extra)}: given without prefix_len_ptr, which turns multi-item "
                             f"scoring on; pass prefix_len_ptr (a [batch_size] integer tensor, 0 for no prefix) "
                             f"or leave the multi-item arguments unset")
        return None
    if token_pos_in_items_ptr is None:
        raise ValueError(f"{where}: token_pos_in_items_ptr: missing; multi-item scoring (prefix_len_ptr given) "
                         f"needs each token's position in its item (0 at each delimiter)")
    if custom_mask is not None or packed_custom_mask is not None:
        name = "custom_mask" if custom_mask is not None else "packed_custom_mask"
        raise ValueError(f"{where}: {name}: cannot be combined with multi-item scoring (prefix_len_ptr), which "
                         f"is itself a mask (FlashInfer 0.2.14 applies the multi-item mask and drops the custom "
                         f"one); fold the items into your custom mask instead, or leave {name} None")
    if not causal:
        raise ValueError(f"{where}: causal: got {causal!r} with multi-item scoring (prefix_len_ptr); its mask is "
                         f"causal by definition (FlashInfer 0.2.14 applies it whatever causal says): pass "
                         f"causal=True")
    prefix = _host_ints(where, "prefix_len_ptr", prefix_len_ptr, batch_size=batch_size).tolist()
    token_pos = _host_ints(where, "token_pos_in_items_ptr", token_pos_in_items_ptr)
    max_len = None
    if max_item_len_ptr is not None:
        max_len = _host_ints(where, "max_item_len_ptr", max_item_len_ptr, batch_size=batch_size).tolist()
    return MultiItem(prefix, token_pos, _stride(where, token_pos_in_items_len), max_len)


def _request_keep(qo: int, kv: int, prefix: int, tpos: torch.Tensor) -> torch.Tensor:
    """bool [qo, kv] of one request; ``tpos``: int64, the positions in items of sequence positions
    ``prefix .. kv-1``.  Vectorised: the first item key each row sees, then one broadcast compare."""
    pos = torch.arange(kv - qo, kv, dtype=torch.int64)
    in_item = pos >= prefix
    t = tpos[(pos - prefix).clamp(min=0)] if tpos.numel() else torch.zeros_like(pos)
    first = torch.where(in_item, pos - t + 1, torch.zeros_like(pos))  # a prefix row: every key up to itself
    j = torch.arange(kv, dtype=torch.int64)[None, :]
    return (j <= pos[:, None]) & ((j < prefix) | (j >= first[:, None]))


def packed_mask(where: str, spec: MultiItem, qo_lens: List[int], kv_lens: List[int]) -> torch.Tensor:
    """The batch's multi-item mask packed as ``packed_custom_mask`` (uint8, LSB-first, each request from
    a byte boundary), on the host.  Checks each request against the arguments first."""
    from attncore.quantization import packbits

    b = len(qo_lens)
    n = spec.token_pos.numel()
    parts = []
    for i in range(b):
        qo, kv, p = qo_lens[i], kv_lens[i], spec.prefix_len[i]
        if qo > kv:
            raise ValueError(f"{where}: request {i} has qo_len {qo} > kv_len {kv}; multi-item scoring needs the "
                             f"queries to be the last qo_len of the request's kv_len tokens")
        if p > kv:
            raise ValueError(f"{where}: prefix_len_ptr[{i}]: got {p}, more than request {i}'s kv_len {kv}")
        span = kv - p  # entries of request i: token_pos_in_items_ptr[i*stride : i*stride + span]
        if b > 1 and span > spec.stride:
            raise ValueError(f"{where}: token_pos_in_items_len: got {spec.stride}, but request {i} has "
                             f"kv_len - prefix_len = {span} tokens after its prefix; each request's positions "
                             f"take token_pos_in_items_len entries (zero-padded), so it must be >= {span}")
        start = i * spec.stride
        if start + span > n:
            raise ValueError(f"{where}: token_pos_in_items_ptr: got {n} entries, but request {i} reads "
                             f"[{start}, {start + span}) (request * token_pos_in_items_len + kv_len - prefix_len)")
        tpos = spec.token_pos[start:start + span]
        if spec.max_item_len is not None and qo:
            read = tpos[max(kv - qo - p, 0):]  # the rows' own positions
            top = int(read.max()) if read.numel() else 0
            if top > spec.max_item_len[i]:
                raise ValueError(f"{where}: max_item_len_ptr[{i}]: got {spec.max_item_len[i]}, but request {i} "
                                 f"has a token at position {top} of its item; it must be at least the longest "
                                 f"item (FlashInfer's kernel skips the keys further back)")
        parts.append(packbits(_request_keep(qo, kv, p, tpos), bitorder="little"))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def attach(where: str, spec: Optional[MultiItem], meta, buffers: Optional[dict]) -> None:
    """Make ``meta`` (a prefill batch built with no custom mask) apply the multi-item mask: its mask
    fields are filled as ``BatchMeta``'s constructors fill them for a packed custom mask (into the
    CUDA-graph buffers ``custom_mask_buf`` / ``mask_indptr_buf`` when the wrapper has them)."""
    if spec is None:
        return
    from attncore.core.backend import _mask_fields

    packed = packed_mask(where, spec, meta.qo_lens_host, meta.host_kv_lens())
    meta.mask, meta.packed_mask, meta.mask_indptr, meta.mask_indptr_host = _mask_fields(
        False, None, packed, meta.qo_indptr_host, meta.host_kv_lens(), meta.device, buffers, decode=False)
