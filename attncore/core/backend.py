"""The backend contract: capabilities as data, ``plan()`` on the host, ``run()`` launch-only.

Every op reaches a backend in one canonical form, a *batch of requests*:

* query rows ``q[qo_indptr[i]:qo_indptr[i+1]]`` belong to request ``i`` (single prefill is a
  batch of one; batch decode has ``q_len_per_req`` rows per request);
* the keys/values of request ``i`` are either *ragged* (``k[kv_indptr[i]:kv_indptr[i+1]]``, token
  offsets) or *paged* (pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` of a paged cache, the last
  one holding ``last_page_len[i]`` tokens), or, for ``xqa_decode``, ``block_tables[i]`` /
  ``seq_lens[i]``;
* the mask (``BatchMeta.mask``) is causal (bottom-right), none, or a packed custom mask (request
  ``i``'s ``[qo_len_i, kv_len_i]`` bits, row-major, LSB-first, starting at byte ``mask_indptr[i]``),
  always ANDed with the sliding window (``BatchMeta.params.window_left``).

The batch is built by ``BatchMeta.ragged()``, ``BatchMeta.paged()`` or
``BatchMeta.from_block_tables()`` (the API in ``plan()``, and ``attncore.testing``), which validate
the index tensors and fill every field a backend relies on (``BatchMeta``'s docstring lists them):
a backend may assume shapes, dtypes and index ranges are consistent with the problem, and reads
kv lengths and the mask from the batch instead of deriving them.  See
``docs/writing-a-backend.md``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from attncore.core import checks as _checks
from attncore.core import current
from attncore.core import uploads
from attncore.core.page_table import _check_seq_lens, _host_ints, _paged_kv_lens, _read_page_table, _seq_lens_int32
from attncore.core.capabilities import Capabilities, Reason, check
from attncore.core.problem import AttentionProblem


MASKS = ("none", "causal", "custom")


@dataclass(frozen=True, init=False)
class AttnParams:
    """Scalar options fixed at plan time, each checked by its rule in ``attncore.core.params``.

    sm_scale: QK scale before any fp8 scales (the API multiplies in q_scale/k_scale at run time
    through ``RunArgs``).  logits_soft_cap: 0 when off.  window_left: -1 when off; this is the one
    home of the sliding window that backends read (``AttentionProblem.window_left`` is the selection
    key, derived from it by the API).

    The mask is not here: a backend applies ``BatchMeta.mask``.  ``causal=`` is still accepted (in its
    old position) for a ``BatchMeta`` built by hand (tests, benchmarks), whose ``mask`` it fills when
    none is given; nothing else reads it, and ``params.causal`` raises.
    """

    sm_scale: float
    logits_soft_cap: float
    window_left: int
    pos_encoding_mode: str
    rope_scale: float
    rope_theta: float

    def __init__(self, sm_scale: float, causal: Optional[bool] = None, logits_soft_cap: float = 0.0,
                 window_left: int = -1, pos_encoding_mode: str = "NONE", rope_scale: float = 1.0,
                 rope_theta: float = 1e4) -> None:
        setattr_ = object.__setattr__  # frozen
        setattr_(self, "sm_scale", sm_scale)
        setattr_(self, "logits_soft_cap", logits_soft_cap)
        setattr_(self, "window_left", window_left)
        setattr_(self, "pos_encoding_mode", pos_encoding_mode)
        setattr_(self, "rope_scale", rope_scale)
        setattr_(self, "rope_theta", rope_theta)
        if causal is not None:
            setattr_(self, "_by_hand_causal", bool(causal))

    @property
    def causal(self):
        raise AttributeError("AttnParams has no 'causal': the mask a backend applies is BatchMeta.mask "
                             "('none', 'causal' or 'custom', resolved from the problem's mask)")




@dataclass
class BatchMeta:
    """One batch as every backend's ``plan()`` receives it (see the module docstring).

    Built by the API in ``plan()``, and by ``attncore.testing``, through the constructors
    ``BatchMeta.ragged()``, ``BatchMeta.paged()`` and ``BatchMeta.from_block_tables()``, which
    validate what they read and always fill:

    * ``kv_lens`` (int32 ``[B]`` on ``device``) and ``kv_lens_host`` (Python ints): each request's KV
      length.  One exception: block tables planned inside CUDA-graph capture, where ``seq_lens``
      cannot be read back, or by the one-call xqa API, which reads them just before its launch (so that
      its plan overlaps earlier kernels); ``kv_lens_host`` is None there, ``max_seq_len`` bounds every
      length and ``host_kv_lens()`` reads and checks them (a device sync);
    * ``mask``: what the kernels apply, ``"none"``, ``"causal"`` (bottom-right) or ``"custom"`` (then
      ``packed_mask``, ``mask_indptr`` and ``mask_indptr_host`` are set), resolved once from the
      problem's mask kind by ``resolve_mask`` (a custom mask wins over causal; decode with no mask
      is causal);
    * ``params``: the plan-time scalars, the sliding window among them (``params.window_left``);
    * the index tensors of the batch's form, int32, contiguous, on ``device`` (an indexed device):
      ``qo_indptr`` (+ host list) always; ``kv_indptr`` (+ host list, token offsets) when ragged;
      ``kv_indptr`` (+ host list, page offsets), ``kv_indices``, ``kv_last_page_len``, ``page_size``
      and ``max_page_id`` when paged; ``block_tables``, ``seq_lens`` (as given), ``max_seq_len`` and
      ``page_size`` for xqa's block tables.

    ``*_host`` lists are Python ints: ``plan()`` may read them, ``run()`` must not depend on new host
    data.  A BatchMeta built directly (tests, benchmarks) is completed the same way in
    ``__post_init__`` from what it was given.
    """

    batch_size: int
    qo_indptr: torch.Tensor  # int32 [B+1]
    qo_indptr_host: List[int]
    kv_indptr: Optional[torch.Tensor] = None  # int32 [B+1]: token offsets (ragged) or page offsets (paged)
    kv_indptr_host: Optional[List[int]] = None
    kv_indices: Optional[torch.Tensor] = None  # int32 [nnz_pages] (paged)
    kv_last_page_len: Optional[torch.Tensor] = None  # int32 [B] (paged)
    kv_lens: Optional[torch.Tensor] = None  # int32 [B] on device, kv length of each request
    kv_lens_host: Optional[List[int]] = None
    page_size: Optional[int] = None
    packed_mask: Optional[torch.Tensor] = None  # uint8, custom mask bits
    mask_indptr: Optional[torch.Tensor] = None  # int32 [B+1], byte offsets into packed_mask
    mask_indptr_host: Optional[List[int]] = None
    block_tables: Optional[torch.Tensor] = None  # xqa: int32 [B, max_pages]
    seq_lens: Optional[torch.Tensor] = None  # xqa: int32/uint32 [B]
    max_seq_len: Optional[int] = None
    params: AttnParams = field(default_factory=lambda: AttnParams(sm_scale=1.0))
    q_len_per_req: int = 1
    max_page_id: int = -1  # largest page id referenced (the API checks it against the cache)
    fixed_split_size: Optional[int] = None  # decode: user's split-KV hint (pages per split)
    disable_split_kv: bool = False
    # The caller's workspaces (uint8), carved with attncore.core.workspace.WorkspaceLayout, never
    # allocated around (issue 15).  ``workspace`` (the float workspace) is run-scoped scratch: split-KV
    # partials, gathered K/V; several wrappers may share it, as their runs are sequential on one stream.
    # ``int_workspace`` is plan-scoped and the wrapper's own: work tables, counters, schedules that
    # run() reads (the constructors put the batch's index tensors at its end and pass on the rest).  None: the backend was driven directly (tests, benchmarks) and allocates.  In CUDA-graph
    # mode their addresses are what a captured graph keeps using across plans.
    workspace: Optional[torch.Tensor] = None
    int_workspace: Optional[torch.Tensor] = None
    # The caller's memo (a wrapper's own dict, emptied when its workspaces change; None: nothing kept): views
    # of its workspaces by address and layout (WorkspaceLayout.carve, uploads.index_tables), so a re-plan of
    # the same shapes makes no new tensors there (host time).  Keys say everything a value depends on.
    memo: Optional[dict] = field(default=None, repr=False, compare=False)
    # The batch's index tables while they are still on the host (attncore.core.uploads.Staged): sent with the
    # backend's own tables in one copy, else around its plan() (Backend.__init_subclass__).
    staged: Optional[Any] = field(default=None, repr=False, compare=False)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mask: Optional[str] = None  # "none" | "causal" | "custom": what the kernels apply (resolve_mask)

    def __post_init__(self) -> None:
        if self.mask is None or self.kv_lens is None or (self.kv_lens_host is None and self.block_tables is None):
            self._complete()

    @property
    def qo_lens_host(self) -> List[int]:
        """Each request's query rows (read-only: made once per ``qo_indptr_host`` list, host time: plan() reads
        it several times)."""
        p = self.qo_indptr_host
        hit = self.__dict__.get("_qo_lens")
        if hit is not None and hit[0] is p and len(hit[1]) == self.batch_size:
            return hit[1]
        lens = list(map(operator.sub, p[1:self.batch_size + 1], p[:self.batch_size]))
        self.__dict__["_qo_lens"] = (p, lens)
        return lens

    def host_kv_lens(self, at: Optional[list] = None) -> List[int]:
        """Each request's KV length as Python ints.  Filled at construction, except for block tables built
        without reading ``seq_lens`` (inside CUDA-graph capture; the one-call xqa function): read here then (a
        device sync; with ``at``, a ``current.mark``, behind that mark: ``current.read_at``) and checked."""
        if self.kv_lens_host is None:
            host = self.seq_lens.tolist() if at is None else current.read_at(at, self.seq_lens)
            self.kv_lens_host = _check_seq_lens(host, self.q_len_per_req, self.max_seq_len,
                                                self.block_tables.shape[1], self.page_size)
        return self.kv_lens_host

    @staticmethod
    def resolve_mask(mask: str, *, decode: bool) -> str:
        """The mask the kernels apply for a problem's mask kind (``none``, ``causal``, ``custom``):
        decode with no mask is causal, bottom-right within each request (with one row per request
        that keeps every key).  The one home of that rule: the constructors apply it, backends read
        ``BatchMeta.mask``."""
        if mask not in MASKS:
            raise ValueError(f"mask: got {mask!r}, expected one of {list(MASKS)}")
        return "causal" if decode and mask == "none" else mask

    # ------------------------------------------------------------------ constructors
    @classmethod
    def ragged(cls, qo_indptr: Optional[torch.Tensor] = None, kv_indptr: Optional[torch.Tensor] = None, *,
               qo_indptr_host: Optional[List[int]] = None, kv_indptr_host: Optional[List[int]] = None,
               device, params: AttnParams, causal: bool = False, custom_mask: Optional[torch.Tensor] = None,
               packed_custom_mask: Optional[torch.Tensor] = None, buffers: Optional[dict] = None,
               workspace: Optional[torch.Tensor] = None, int_workspace: Optional[torch.Tensor] = None,
               memo: Optional[dict] = None) -> "BatchMeta":
        """Request ``i`` has the query rows ``qo_indptr[i]:qo_indptr[i+1]`` and the keys
        ``kv_indptr[i]:kv_indptr[i+1]`` of ragged K/V (single prefill is a batch of one).

        Each indptr comes as an int32 tensor (validated, read to the host), as a host list the caller
        built or validated (uploaded once, cached by value), or both.  The mask is custom when
        ``custom_mask`` (bool, the requests' ``[qo_i, kv_i]`` masks flattened) or
        ``packed_custom_mask`` (uint8, LSB-first, each request from a byte boundary) is given, else
        causal when ``causal``.  ``buffers``: the caller's CUDA-graph buffers the index tensors are
        copied into (``qo_indptr``, ``kv_indptr``, ``kv_lens``, ``custom_mask``, ``qk_indptr``;
        allocated on first use).  A caller reading both indptrs in one copy wraps this in
        ``_checks.read_together``."""
        device = _checks.norm_device(device)
        if qo_indptr_host is None:
            qo_indptr_host = _checks.check_indptr("qo_indptr", qo_indptr)
        if kv_indptr_host is None:
            kv_indptr_host = _checks.check_indptr("kv_indptr", kv_indptr, length=len(qo_indptr_host))
        elif len(kv_indptr_host) != len(qo_indptr_host):
            raise ValueError(f"kv_indptr: got {len(kv_indptr_host)} entries, expected {len(qo_indptr_host)} "
                             f"(batch_size + 1)")
        b = len(qo_indptr_host) - 1
        kv_lens = [kv_indptr_host[i + 1] - kv_indptr_host[i] for i in range(b)]
        if int_workspace is not None and buffers is None:  # the wrapper's int workspace: no allocation
            (qo_t, kv_t, kv_lens_t), int_workspace, staged = uploads.index_tables(
                int_workspace, device, [qo_indptr_host if qo_indptr is None else qo_indptr,
                                        kv_indptr_host if kv_indptr is None else kv_indptr, kv_lens], memo=memo)
        else:
            staged = None
            qo_t = (uploads.small_index(qo_indptr_host, device) if qo_indptr is None
                    else uploads.to_device_int32(qo_indptr, device))
            kv_t = (uploads.small_index(kv_indptr_host, device) if kv_indptr is None
                    else uploads.to_device_int32(kv_indptr, device))
            kv_lens_t = uploads.small_index(kv_lens, device)
        if buffers is not None:
            qo_t = uploads.into(buffers, "qo_indptr", qo_t, "qo_indptr_buf")
            kv_t = uploads.into(buffers, "kv_indptr", kv_t, "kv_indptr_buf")
            kv_lens_t = uploads.into(buffers, "kv_lens", kv_lens_t, "kv_lens")
        mask, packed, mask_indptr, mask_host = _mask_fields(causal, custom_mask, packed_custom_mask, qo_indptr_host,
                                                            kv_lens, device, buffers, decode=False)
        return cls(batch_size=b, qo_indptr=qo_t, qo_indptr_host=qo_indptr_host, kv_indptr=kv_t,
                   kv_indptr_host=kv_indptr_host, kv_lens=kv_lens_t, kv_lens_host=kv_lens, packed_mask=packed,
                   mask_indptr=mask_indptr, mask_indptr_host=mask_host, params=params, workspace=workspace,
                   int_workspace=int_workspace, memo=memo, staged=staged,
                   device=device, mask=mask)

    @classmethod
    def paged(cls, qo_indptr_host: List[int], kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
              kv_last_page_len: torch.Tensor, page_size: int, *, device, params: AttnParams, causal: bool = False,
              custom_mask: Optional[torch.Tensor] = None, packed_custom_mask: Optional[torch.Tensor] = None,
              decode: bool = False, q_len_per_req: int = 1,
              names: Tuple[str, str, str] = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
              non_blocking: bool = False, buffers: Optional[dict] = None, workspace: Optional[torch.Tensor] = None,
              int_workspace: Optional[torch.Tensor] = None,
              fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
              memo: Optional[dict] = None, reads: Optional[tuple] = None) -> "BatchMeta":
        """Request ``i`` reads the pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` of a paged cache,
        the last one holding ``kv_last_page_len[i]`` tokens (``1 <= last <= page_size``; any value in
        ``[0, page_size]`` for a request with no pages).  The page table is validated (its entries
        named by ``names`` in errors) and read to the host once.

        The mask is custom when a custom mask is given (as in ``ragged``), else causal when
        ``causal``, or always with ``decode`` (``q_len_per_req`` rows per request, which must already
        be in the cache: a non-empty request holds at least that many tokens).  ``buffers``: the
        caller's CUDA-graph buffers (``qo_indptr``, ``indptr``, ``indices``, ``last_page_len``,
        ``kv_lens``, ``custom_mask``, ``qk_indptr``) the index tensors are copied into.
        ``fixed_split_size``, ``disable_split_kv``: the caller's split-KV hints, kept as given.  ``reads``:
        the page table already read with the caller's qo_indptr (``prefetch_paged``)."""
        n_indptr, n_indices, n_last = names
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size: got {page_size!r}, expected a positive int")
        device = _checks.norm_device(device)
        b = len(qo_indptr_host) - 1
        # every shape and dtype first, then the values in one read (no device sync for host tensors, one
        # copy to pinned memory for device ones: _read_page_table)
        _checks.check_tensor(n_indptr, kv_indptr, ndim=1, dtype=torch.int32)
        _checks.check_tensor(n_indices, kv_indices, ndim=1, dtype=torch.int32)
        _checks.check_tensor(n_last, kv_last_page_len, ndim=1, dtype=torch.int32, shape=[b])
        if kv_indptr.numel() != b + 1:
            _checks.check_indptr(n_indptr, kv_indptr, length=b + 1)  # raises (before any read)
        indptr_h, last_h, used, (lo, hi) = reads or _read_page_table(kv_indptr, kv_indices, kv_last_page_len)[:4]
        kv_host = _checks.check_indptr(n_indptr, kv_indptr, length=b + 1, host=indptr_h, checked=True)
        if kv_indices.numel() < kv_host[-1]:
            raise ValueError(f"{n_indices}: got {kv_indices.numel()} entries, expected at least {n_indptr}[-1] = "
                             f"{kv_host[-1]}")
        kv_lens = _paged_kv_lens(kv_host, last_h, page_size, n_last)
        max_page = hi if kv_host[-1] else -1
        if kv_host[-1] and lo < 0:
            raise ValueError(f"{n_indices}: got a negative page id {lo}, expected ids >= 0")
        if int_workspace is not None and buffers is None:  # the wrapper's int workspace: no allocation
            (qo_dev, dev_indptr, dev_indices, dev_last, dev_kv_lens), int_workspace, staged = uploads.index_tables(
                int_workspace, device, [qo_indptr_host, kv_host, used, last_h, kv_lens], non_blocking,
                memo=memo)
        else:
            staged = None
            dev_indptr = uploads.to_device_int32(kv_indptr, device, non_blocking)
            dev_indices = uploads.to_device_int32(kv_indices, device, non_blocking)
            dev_last = uploads.to_device_int32(kv_last_page_len, device, non_blocking)
            dev_kv_lens = uploads.host_int32(kv_lens, device, non_blocking)
            qo_dev = uploads.host_int32(qo_indptr_host, device, non_blocking)
        if buffers is not None:
            dev_indptr = uploads.into(buffers, "indptr", dev_indptr, n_indptr)
            dev_indices = uploads.into(buffers, "indices", dev_indices, n_indices)
            dev_last = uploads.into(buffers, "last_page_len", dev_last, n_last)
            dev_kv_lens = uploads.into(buffers, "kv_lens", dev_kv_lens, "kv_lens")
            # always: a captured launch keeps this pointer too (a per-plan tensor would be freed and its
            # memory reused while the graph still reads it: FlashInfer's graph decode test saw wrong outputs)
            qo_dev = uploads.into(buffers, "qo_indptr", qo_dev, "qo_indptr")
        if decode and q_len_per_req > 1:
            for i, n in enumerate(kv_lens):
                if 0 < n < q_len_per_req:
                    raise ValueError(f"{n_last}: request {i} holds {n} tokens, fewer than q_len_per_req "
                                     f"({q_len_per_req}); the draft tokens must already be in the cache")
        mask, packed, mask_indptr, mask_host = _mask_fields(causal, custom_mask, packed_custom_mask, qo_indptr_host,
                                                            kv_lens, device, buffers, decode=decode)
        return cls(batch_size=b, qo_indptr=qo_dev, qo_indptr_host=qo_indptr_host, kv_indptr=dev_indptr,
                   kv_indptr_host=kv_host, kv_indices=dev_indices, kv_last_page_len=dev_last, kv_lens=dev_kv_lens,
                   kv_lens_host=kv_lens, page_size=page_size, packed_mask=packed, mask_indptr=mask_indptr,
                   mask_indptr_host=mask_host, params=params, q_len_per_req=q_len_per_req, max_page_id=max_page,
                   fixed_split_size=fixed_split_size, disable_split_kv=bool(disable_split_kv), workspace=workspace,
                   int_workspace=int_workspace, memo=memo, staged=staged,
                   device=device, mask=mask)

    @classmethod
    def from_block_tables(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, page_size: int,
                          *, device, params: AttnParams, q_len_per_req: int = 1,
                          custom_mask: Optional[torch.Tensor] = None, packed_custom_mask: Optional[torch.Tensor] = None,
                          workspace: Optional[torch.Tensor] = None, int_workspace: Optional[torch.Tensor] = None,
                          read_seq_lens: Optional[bool] = None
                          ) -> "BatchMeta":
        """xqa's form: request ``i`` reads the pages ``block_tables[i]`` (int32 ``[B, max_pages]``) and
        holds ``seq_lens[i]`` tokens (int32 or uint32 ``[B]``, the draft tokens included), with
        ``q_len_per_req`` query rows.  The mask is causal (decode; xqa's speculative mask comes at run
        time, in ``RunArgs.spec_mask``), or custom when a custom mask is given (as in ``ragged``; the
        xqa API never gives one, the conformance suite does).  The caller checked the shapes,
        ``max_seq_len`` and that ``max_pages * page_size >= max_seq_len``.

        ``seq_lens`` is read to the host and checked (``q_len_per_req <= seq_lens[i] <= max_seq_len``)
        unless ``read_seq_lens`` is False, or None (the default) while the stream captures a CUDA
        graph, where nothing can be read back: ``kv_lens_host`` stays None then (``host_kv_lens()``
        reads and checks it later, a device sync), and ``max_seq_len`` bounds every length.  A custom
        mask is laid out by those lengths, so it always reads them."""
        device = _checks.norm_device(device)
        b = block_tables.shape[0]
        custom = custom_mask is not None or packed_custom_mask is not None
        if read_seq_lens is None:
            read_seq_lens = seq_lens.device.type == "cpu" or not torch.cuda.is_current_stream_capturing()
        host = (_check_seq_lens(seq_lens.tolist(), q_len_per_req, max_seq_len, block_tables.shape[1], page_size)
                if read_seq_lens or custom else None)
        qo_host = [i * q_len_per_req for i in range(b + 1)]
        mask, packed, mask_indptr, mask_host = _mask_fields(False, custom_mask, packed_custom_mask, qo_host, host,
                                                            device, None, decode=True)
        return cls(batch_size=b, qo_indptr=uploads.small_index(qo_host, device), qo_indptr_host=qo_host,
                   block_tables=block_tables, seq_lens=seq_lens, kv_lens=_seq_lens_int32(seq_lens), kv_lens_host=host,
                   max_seq_len=max_seq_len, page_size=page_size, packed_mask=packed, mask_indptr=mask_indptr,
                   mask_indptr_host=mask_host, params=params, q_len_per_req=q_len_per_req, workspace=workspace,
                   int_workspace=int_workspace,
                   device=device, mask=mask)

    def _complete(self) -> None:
        """Fill, in a BatchMeta built directly (tests, benchmarks), what the constructors guarantee."""
        dev = self.device if isinstance(self.device, torch.device) else torch.device(self.device)
        if dev.type == "cpu" and self.qo_indptr.device.type != "cpu":
            dev = self.qo_indptr.device  # device left at its default, tensors elsewhere
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "mask_indptr"):
            t = getattr(self, name)
            if t is not None:  # int32, contiguous, on the batch's device (no copy when it already is)
                setattr(self, name, t.to(device=dev, dtype=torch.int32).contiguous())
        if self.kv_indptr is not None and self.kv_indptr_host is None:
            self.kv_indptr_host = _host_ints(self.kv_indptr)
        if self.block_tables is not None:
            if self.kv_lens is None:
                self.kv_lens = _seq_lens_int32(self.seq_lens)
            if self.max_seq_len is None:
                self.kv_lens_host = _host_ints(self.seq_lens)
                self.max_seq_len = max(self.kv_lens_host, default=0)
        elif self.kv_lens_host is None:
            if self.kv_lens is not None:
                self.kv_lens_host = _host_ints(self.kv_lens)
            elif self.kv_indices is not None:
                self.kv_lens_host = _paged_kv_lens(self.kv_indptr_host, _host_ints(self.kv_last_page_len),
                                                   self.page_size, "kv_last_page_len")
            elif self.kv_indptr_host is not None:
                p = self.kv_indptr_host
                self.kv_lens_host = [p[i + 1] - p[i] for i in range(self.batch_size)]
            else:
                raise ValueError("BatchMeta: no KV lengths; give kv_lens, kv_indptr (ragged), kv_indptr, kv_indices, "
                                 "kv_last_page_len and page_size (paged) or block_tables and seq_lens, or build it "
                                 "with BatchMeta.ragged(), BatchMeta.paged() or BatchMeta.from_block_tables()")
        if self.kv_lens is None:
            self.kv_lens = torch.tensor(self.kv_lens_host, dtype=torch.int32).to(dev)
        if self.mask is None:
            kind = ("custom" if self.packed_mask is not None
                    else "causal" if getattr(self.params, "_by_hand_causal", False) else "none")
            self.mask = self.resolve_mask(kind, decode=self.block_tables is not None or self.q_len_per_req > 1)


def _mask_fields(causal: bool, custom_mask, packed_custom_mask, qo_host: List[int], kv_lens: List[int], device,
                 buffers: Optional[dict], *, decode: bool) -> tuple:
    """(mask, packed_mask, mask_indptr, mask_indptr_host) of a batch: a custom mask packed (into the
    CUDA-graph buffers ``custom_mask`` / ``qk_indptr`` when given), or the resolved mask kind."""
    if custom_mask is None and packed_custom_mask is None:
        return BatchMeta.resolve_mask("causal" if causal else "none", decode=decode), None, None, None
    qo_lens = [qo_host[i + 1] - qo_host[i] for i in range(len(qo_host) - 1)]
    packed, indptr, offsets = _api.pack_batch_mask(custom_mask, packed_custom_mask, qo_lens, kv_lens, device)
    if buffers is not None:
        packed = uploads.into(buffers, "custom_mask", packed, "custom_mask_buf")
        indptr = uploads.into(buffers, "qk_indptr", indptr, "qk_indptr_buf")
    return "custom", packed, indptr, offsets


@dataclass
class RunArgs:
    """Tensors of one ``run()``.

    q: ``[nnz_q, Hq, D]``.  k, v: ragged ``[nnz_kv, Hkv, D]`` (NHD) / ``[Hkv, nnz_kv, D]`` (HND), or
    paged caches ``[pages, page_size, Hkv, D]`` (NHD) / ``[pages, Hkv, page_size, D]`` (HND); the
    last dim is contiguous, other strides are arbitrary.  out: ``[nnz_q, Hq, Dv]`` (written by the
    backend).  lse: ``[nnz_q, Hq]`` float32 base-2, or None.  sinks: ``[Hq]`` float32 or None.

    Scales: the logit is ``qk * sm_scale * q_scale * k_scale`` (then soft cap, then ALiBi); the
    output is ``softmax @ v * v_scale / o_scale``.  xqa: ``sm_scale = bmm1_scale`` with
    ``q_scale = k_scale = 1`` and ``v_scale = bmm2_scale``.
    spec_mask: xqa's uint16 ``[B, q_len, ceil(q_len/32)*2]`` draft mask or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    q_scale: float = 1.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    o_scale: float = 1.0
    spec_mask: Optional[torch.Tensor] = None
    enable_pdl: bool = False

    @property
    def fp8_scales(self) -> bool:
        """Whether a scale is not 1 (the problem's ``fp8_scales`` feature serves this run)."""
        return self.q_scale != 1.0 or self.k_scale != 1.0 or self.v_scale != 1.0 or self.o_scale != 1.0


def cuda_device(device, who: str) -> torch.device:
    """``device`` as an indexed CUDA device (no index: the current one); ``who`` names the caller in
    the error for any other device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"{who}: device {dev} is not a CUDA device")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Backend:
    """Base class of every backend (built-in or plugin).

    Subclasses set ``name`` and ``capabilities`` and implement ``plan`` and ``run``; they may
    override ``available``, ``extra_reasons`` and ``priority``.
    """

    name: str = "unnamed"
    aliases: Tuple[str, ...] = ()
    description: str = ""
    capabilities: Sequence[Capabilities] = ()
    # Conformance cases known to fail, {case-id substring: reason}; shown as xfail by the suite.
    known_failures: dict = {}
    origin: str = "built-in"  # set by the registry
    # True: plan() sends the batch's staged index tables (BatchMeta.staged) with its own tables in one copy
    # (attncore.core.uploads); else they are sent before plan() runs.
    sends_index_tables: bool = False
    # True: its xqa_decode kernels read nothing outside the block table and the K/V caches whatever ``seq_lens`` and
    # the table hold, so the one-call xqa function may launch before it has read and checked the lengths (the GPU
    # then need not wait for that check); else it checks, then launches.
    bounds_seq_lens: bool = False

    def __init_subclass__(cls, **kw) -> None:
        """Every backend's ``plan()`` runs with the batch's index tables sent (before it, or after it when the
        backend sends them itself: ``sends_index_tables``), whatever the caller (attncore.core.uploads)."""
        super().__init_subclass__(**kw)
        fn = cls.__dict__.get("plan")
        if fn is not None and not getattr(fn, "_sends_staged", False):
            cls.plan = uploads.sending_staged(fn)

    def available(self) -> List[Reason]:
        """Reasons the backend cannot run at all here (missing toolchain, no GPU...)."""
        return []

    def extra_reasons(self, problem: AttentionProblem) -> List[Reason]:
        """Refusals the capability schema cannot express."""
        return []

    def reasons(self, problem: AttentionProblem) -> List[Reason]:
        return check(self.capabilities, problem) + self.extra_reasons(problem)

    def supports(self, problem: AttentionProblem) -> bool:
        return not self.reasons(problem)

    def priority(self, problem: AttentionProblem) -> int:
        """Higher wins in ``auto``.  The reference backend is 0."""
        return 10

    def plan(self, problem: AttentionProblem, meta: BatchMeta) -> Any:
        """Host work (may sync): split decisions, schedules, buffers.  Returns an opaque plan."""
        return meta

    def run(self, plan: Any, args: RunArgs) -> None:
        """Launch only: write ``args.out`` (and ``args.lse`` when given)."""
        raise NotImplementedError

    def relaunch(self, plan: Any, args: RunArgs) -> Optional[Callable]:
        """Optional (host time of the one-call functions and of the wrappers' repeated run()):
        ``go(q, k, v, out, lse, sinks)``, which runs ``plan``
        again, without run()'s checks, on tensors laid out as ``args``'s (shapes, strides, dtypes, devices; a
        single decode drops q's and out's unit first dim), with ``args``'s scales and no spec mask.  The caller
        guarantees the match: its cache key holds all of it.  None (the default): the caller calls
        ``run()``."""
        return None

    def plan_for_sms(self, plan: Any, sms: int) -> Optional[Any]:
        """Optional: a plan of ``plan``'s problem for a run on ``sms`` of the device's SMs (POD's SM split gives
        the decode part a share of them), right by the tolerance rule (bit for bit only where the summation order
        is ``plan``'s), its tables in an int workspace of its own (``plan``'s stay valid).  None (the default):
        ``plan`` serves there as well (docs/writing-a-backend.md)."""
        return None

    def split_launches(self, plan: Any, sms: int, tail_sms: int) -> Optional[Tuple[Callable, Callable]]:
        """Optional: ``(first, tail)``, two functions of ``RunArgs`` that together do what ``run(plan, args)``
        does: ``first`` on ``sms`` of the device's SMs, ``tail`` queued later on the other part's ``tail_sms`` SMs,
        after that part (POD's SM split: the prefill's work left when the decode is done is taken over on the
        decode's SMs).  Both are launched once per run, in either order; whatever ``tail`` finds left, it does.
        None (the default): ``run()`` alone."""
        return None

    def jit_specs(self, arch: str) -> list:
        """CUDA kernel specializations (``attncore.build.jit.Spec``) that ``attncore build`` prebuilds by
        default for ``arch`` ("90", "80"...).  Backends that build kernels with ``attncore.build.jit``
        override this and ``parse_jit_spec``; the others offer none."""
        return []

    def parse_jit_spec(self, uri: str):
        """The ``attncore.build.jit.Spec`` a URI names (with or without ``_sm<arch>``); ``ValueError`` if
        unknown.  Default: looked up among ``jit_specs`` of the current arch."""
        from attncore.build import jit

        arch = jit.default_arch()
        for s in self.jit_specs(arch):
            if uri in (s.uri, s.uri_for(arch)):
                return s
        raise ValueError(f"unknown specialization {uri!r} for backend {self.name!r}")

    def __repr__(self) -> str:
        return f"<attncore backend {self.name} ({self.origin})>"


Backend.plan = uploads.sending_staged(Backend.plan)  # the default plan (it returns the batch) too


# The constructors' index helpers (pack_batch_mask...) live in _api,
# which imports this module: bound here, once both exist, rather than imported on every call (host time).
from attncore.core import _api  # noqa: E402
