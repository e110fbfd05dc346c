"""Reading a batch's page table and lengths to the host for ``BatchMeta``'s constructors (attncore.core.backend):
host tensors need no device sync, device ones at most one copy to pinned memory (``checks.read_host``); the
KV lengths from page counts and last-page lengths, and xqa's ``seq_lens``, checked."""

from __future__ import annotations

import operator
from typing import List

import torch

from attncore.core import checks as _checks


def _host_ints(t: torch.Tensor) -> List[int]:
    return t.cpu().to(torch.int64).tolist()


def _seq_lens_int32(seq_lens: torch.Tensor) -> torch.Tensor:
    """xqa's seq_lens as the batch's int32 ``kv_lens``: a view, no copy (a uint32 is reinterpreted; its
    values are below 2**31), so a captured graph keeps reading the caller's buffer."""
    t = seq_lens.view(torch.int32) if seq_lens.dtype == torch.uint32 else seq_lens.to(torch.int32)
    return t.contiguous()


_TINY_TABLE = 64  # host page tables up to this many ids are read as Python ints (cheaper than numpy calls)
SMALL_TABLE = 4096  # up to this many: host tables min/max through numpy, device tables read whole (else reduced there)


def read_whole(indices) -> bool:
    """Whether plan() reads these page ids whole, in its one copy: a device-side table of at most ``SMALL_TABLE``
    ids (a longer one is reduced on the device first; a host one is read where it is used, without a copy)."""
    return isinstance(indices, torch.Tensor) and not indices.is_cpu and 0 < indices.numel() <= SMALL_TABLE


def _read_page_table(indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, extra=()) -> tuple:
    """(indptr, last_page_len as host ints, the page ids in use as host ints or as a tensor, their (min,
    max), the ``extra`` tensors as host ints), read with at most one device-to-host copy
    (``_checks.read_host``): on a device the ids are reduced there (masked by the count in use,
    ``indptr[-1]``, so that need not be read first).  Shapes were checked.  (min, max) is (2**31 - 1, -1)
    when no id is in use."""
    n = indices.numel()
    empty = (2 ** 31 - 1, -1)
    if read_whole(indices) and indices.device == indptr.device == last.device:
        # a small device table comes back whole in the same copy: its min and max on the host cost less
        # than the eight device ops (each a launch: host time) of the reduction below
        ip, lp, ids, *ex = _checks.read_host([indptr, last, indices, *extra])
        k = min(max(ip[-1], 0), n) if ip else 0
        used = ids if k == n else ids[:k]
        return ip, lp, used, (min(used), max(used)) if k else empty, ex
    if n and not indices.is_cpu:
        count = indptr[-1:].to(indices.device, non_blocking=True)  # stays on the device
        valid = torch.arange(n, device=indices.device, dtype=torch.int32) < count
        lohi = torch.cat([torch.where(valid, indices, 2 ** 31 - 1).min().view(1),
                          torch.where(valid, indices, -1).max().view(1)])
        ip, lp, (lo, hi), *ex = _checks.read_host([indptr, last, lohi, *extra])
        k = min(max(ip[-1], 0), n) if ip else 0
        return ip, lp, indices if k == n else indices[:k], (lo, hi) if k else empty, ex
    ip, lp, *ex = _checks.read_host([indptr, last, *extra])
    k = min(max(ip[-1], 0), n) if ip else 0
    if k <= _TINY_TABLE:
        used = (indices if k == n else indices[:k]).tolist()
        return ip, lp, used, (min(used), max(used)) if k else empty, ex
    used = indices if k == n else indices[:k]
    if k <= SMALL_TABLE:  # through numpy (a view of the host tensor): no Python int per id
        v = used.numpy()
        return ip, lp, used, (int(v.min()), int(v.max())), ex
    lo, hi = torch.aminmax(used)
    return ip, lp, used, (int(lo), int(hi)), ex


def prefetch_paged(qo_indptr, kv_indptr, kv_indices, kv_last_page_len) -> tuple:
    """A paged prefill plan whose ``qo_indptr`` and page table all live on one device: their values in one
    read, ``(qo_indptr as host ints, reads for BatchMeta.paged(reads=))``; else ``(None, None)`` and each is
    checked and read as usual (so a wrong argument gets its own error).  Host tensors need no prefetch."""
    ts = (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1 and t.numel() for t in ts):
        return None, None
    dev = kv_indices.device
    if dev.type == "cpu" or any(t.device != dev for t in ts):
        return None, None
    ip, lp, used, lohi, (qo,) = _read_page_table(kv_indptr, kv_indices, kv_last_page_len, extra=(qo_indptr,))
    return qo, (ip, lp, used, lohi)


def _paged_kv_lens(kv_indptr_host: List[int], last_host: List[int], page_size: int, name: str) -> List[int]:
    """Each request's KV length from its page count and last page (semantics.md, "Page table"),
    checking ``last_page_len`` (``name`` in errors)."""
    b = len(kv_indptr_host) - 1
    if b > 0 and len(last_host) == b:  # every request has pages and a valid last page: no loop in Python (host time)
        npages = list(map(operator.sub, kv_indptr_host[1:], kv_indptr_host[:-1]))
        if min(npages) > 0 and min(last_host) >= 1 and max(last_host) <= page_size:
            return [(n - 1) * page_size + lp for n, lp in zip(npages, last_host)]
    kv_lens = []
    for i in range(len(kv_indptr_host) - 1):
        npages = kv_indptr_host[i + 1] - kv_indptr_host[i]
        lp = last_host[i]
        if npages == 0:
            if lp != 0 and not (1 <= lp <= page_size):
                raise ValueError(f"{name}: got {name}[{i}] = {lp} for an empty request, expected 0")
            kv_lens.append(0)
            continue
        if not 1 <= lp <= page_size:
            raise ValueError(f"{name}: got {name}[{i}] = {lp}, expected 1 <= last_page_len <= page_size ({page_size})")
        kv_lens.append((npages - 1) * page_size + lp)
    return kv_lens


def _check_seq_lens(host: List[int], q_len: int, max_seq_len: int, pages: int, page_size: int) -> List[int]:
    """xqa's seq_lens read to the host (``tolist()`` of the int32 or uint32 tensor), each checked within
    ``[q_len_per_req, max_seq_len]``."""
    if not host or (q_len <= min(host) and max(host) <= max_seq_len):  # host time: the common case in C
        return host
    for i, n in enumerate(host):
        if not q_len <= n <= max_seq_len:
            raise ValueError(
                f"seq_lens: got seq_lens[{i}] = {n} (request {i}), expected q_len_per_req ({q_len}) <= seq_len <= "
                f"max_seq_len ({max_seq_len}); each block_tables row holds {pages * page_size} tokens "
                f"({pages} pages of {page_size})")
    return host
