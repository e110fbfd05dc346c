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
:func:`append_paged_kv_cache` checks its index tensors' values once while they stay the same tensors,
unchanged through torch (their version counters): a model's appends on every layer of a step cost one
read.  A buffer rewritten by a custom kernel or through a numpy view is checked on first use only (its
current values are always the ones written with); inference tensors are checked on every call.
"""

from attncore.page.cache import (
    PagedKVCache,  # noqa: F401  (the cache type, for annotations)
    append_paged_kv_cache,
    get_batch_indices_positions,
    get_seq_lens,
    unpack_paged_kv_cache,
)
from attncore.page.convert import block_tables_to_indptr, gather_paged_kv, indptr_to_block_tables

__all__ = [
    "get_seq_lens",
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "indptr_to_block_tables",
    "block_tables_to_indptr",
    "gather_paged_kv",
    "unpack_paged_kv_cache",
]
