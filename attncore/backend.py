"""The backend contract: capabilities as data, ``plan()`` on the host, ``run()`` launch-only.

Every op reaches a backend in one canonical form, a *batch of requests*:

* query rows ``q[qo_indptr[i]:qo_indptr[i+1]]`` belong to request ``i`` (single prefill is a
  batch of one; batch decode has ``q_len_per_req`` rows per request);
* the keys/values of request ``i`` are either *ragged* (``k[kv_indptr[i]:kv_indptr[i+1]]``, token
  offsets) or *paged* (pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` of a paged cache, the last
  one holding ``last_page_len[i]`` tokens), or, for ``xqa_decode``, ``block_tables[i]`` /
  ``seq_lens[i]``;
* the mask is causal (bottom-right), none, or a packed custom mask (request ``i``'s
  ``[qo_len_i, kv_len_i]`` bits, row-major, LSB-first, starting at byte ``mask_indptr[i]``),
  always ANDed with the sliding window.

The API validates everything before a backend sees it: a backend may assume shapes, dtypes and
index ranges are consistent with the problem.  See ``docs/writing-a-backend.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .capabilities import Capabilities, Reason, check
from .problem import AttentionProblem


@dataclass(frozen=True)
class AttnParams:
    """Scalar options fixed at plan time.

    sm_scale: QK scale before any fp8 scales (the API multiplies in q_scale/k_scale at run time
    through ``RunArgs``).  logits_soft_cap: 0 when off.  window_left: -1 when off.
    """

    sm_scale: float
    causal: bool = False
    logits_soft_cap: float = 0.0
    window_left: int = -1
    pos_encoding_mode: str = "NONE"
    rope_scale: float = 1.0
    rope_theta: float = 1e4


@dataclass
class BatchMeta:
    """Host-validated batch description built by the API in ``plan()``.

    Device tensors live on the problem's device; ``*_host`` lists are Python ints (plan may read
    them; ``run()`` must not depend on new host data).  For ``xqa_decode`` only ``block_tables``,
    ``seq_lens`` and ``max_seq_len`` are set by the API; ``kv_lens_host`` is filled lazily by
    ``host_kv_lens()`` (a device sync).
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
    # The caller's float workspace buffer (uint8), or None.  Backends should carve split-KV partials
    # from it: in CUDA-graph mode its address is what a captured graph keeps using across plans.
    workspace: Optional[torch.Tensor] = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def qo_lens_host(self) -> List[int]:
        p = self.qo_indptr_host
        return [p[i + 1] - p[i] for i in range(self.batch_size)]

    def host_kv_lens(self) -> List[int]:
        if self.kv_lens_host is None:
            src = self.kv_lens if self.kv_lens is not None else self.seq_lens
            self.kv_lens_host = [int(x) for x in src.to(torch.int64).cpu().tolist()]
        return self.kv_lens_host


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

    def jit_specs(self, arch: str) -> list:
        """CUDA kernel specializations (``attncore.jit.Spec``) that ``attncore build`` prebuilds by
        default for ``arch`` ("90", "80"...).  Backends that build kernels with ``attncore.jit``
        override this and ``parse_jit_spec``; the others offer none."""
        return []

    def parse_jit_spec(self, uri: str):
        """The ``attncore.jit.Spec`` a URI names (with or without ``_sm<arch>``); ``ValueError`` if
        unknown.  Default: looked up among ``jit_specs`` of the current arch."""
        from . import jit

        arch = jit.default_arch()
        for s in self.jit_specs(arch):
            if uri in (s.uri, s.uri_for(arch)):
                return s
        raise ValueError(f"unknown specialization {uri!r} for backend {self.name!r}")

    def __repr__(self) -> str:
        return f"<attncore backend {self.name} ({self.origin})>"
