"""The Triton backend: paged/ragged attention, GQA-packed, split-KV decode, on sm80+ or Triton's
CPU interpreter (``TRITON_INTERPRET=1``).

``plan()`` turns the batch into a table of work items (request, packed-row block, KV partition)
on the device, decides the KV split and the launch config, and allocates the split buffers;
``run()`` only checks the tensors against the plan and launches (no host sync, no decision).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from attncore.core.backend import Backend, BatchMeta, RunArgs
from attncore.core.capabilities import Capabilities, Reason
from attncore.core.mask import alibi_slopes
from attncore.core.problem import FP8_DTYPES, AttentionProblem, dtype_name

LOG2E = 1.4426950408889634
_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FEATURES = frozenset({"window", "soft_cap", "alibi", "rope", "sinks", "fp8_scales", "return_lse"})
_OPS = frozenset({"single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode"})

CAPABILITIES = (
    # CUDA, every op but xqa: out dtype = q dtype.  fp32 q and fp8 output are implemented in the
    # kernels but not yet validated on a GPU, so they are refused there for now.
    Capabilities(
        ops=_OPS, devices=frozenset({"cuda"}), min_compute_capability=(8, 0),
        q_dtypes=frozenset({_F16, _BF16}), kv_dtypes=frozenset({_F16, _BF16, _E4M3, _E5M2}),
        kv_dtype_must_match_q=True, head_dim_multiple=16, max_head_dim=256,
        layouts=frozenset({"NHD", "HND"}), masks=frozenset({"none", "causal", "custom"}),
        features=_FEATURES,
    ),
    # CUDA xqa decode: same kernels; spec-decode mask.
    Capabilities(
        ops=frozenset({"xqa_decode"}), devices=frozenset({"cuda"}), min_compute_capability=(8, 0),
        q_dtypes=frozenset({_F16, _BF16}), kv_dtypes=frozenset({_F16, _BF16, _E4M3, _E5M2}),
        kv_dtype_must_match_q=True, head_dim_multiple=16, max_head_dim=256,
        layouts=frozenset({"NHD", "HND"}), masks=frozenset({"none", "causal", "custom"}),
        features=_FEATURES | {"spec_mask"},
    ),
    # CPU through Triton's interpreter: no bf16 (the interpreter rounds bf16 stores wrongly),
    # no fp8 output (same); fp8 KV is read correctly.
    Capabilities(
        ops=_OPS | {"xqa_decode"}, devices=frozenset({"cpu"}),
        q_dtypes=frozenset({_F16, _F32}), kv_dtypes=frozenset({_F16, _F32, _E4M3, _E5M2}),
        kv_dtype_must_match_q=True, head_dim_multiple=16, max_head_dim=256,
        layouts=frozenset({"NHD", "HND"}), masks=frozenset({"none", "causal", "custom"}),
        features=_FEATURES | {"spec_mask"},
    ),
)

MASK_NONE, MASK_CAUSAL, MASK_CUSTOM, MASK_SPEC = 0, 1, 2, 3


def _work_table(items: list, width: int, device) -> tuple:
    """Work items (cost, field, ...) sorted heaviest first, for tail balance, and uploaded as an
    int32 [n, width] table without the cost; returns (table, n).  An empty list uploads one
    zero row so that the kernel always gets a valid pointer."""
    items.sort(key=lambda t: -t[0])
    flat = [x for t in items for x in t[1:]] or [0] * width
    return torch.tensor(flat, dtype=torch.int32).to(device), len(items)


def _heads_first(costs: list, num_heads: int, num_sms: int) -> bool:
    """Launch order of the programs (see kernels): heads first when the spread of item costs is
    over a tenth of one SM's share of the work.  Items first launches each head's list heaviest
    first in turn, so the last head's heaviest items start near the end and leave a tail (P1
    causal on an H100: 424 -> 448 TFLOP/s heads first); where each SM's share dwarfs the spread,
    items first wins by keeping one head's K/V in L2 (P3 paged: 336 items first, 307 heads first)."""
    if not costs:
        return False
    return (max(costs) - min(costs)) * num_sms * 10 > sum(costs) * num_heads


GATHER_FLOP_PER_BYTE = 1500  # auto gathers paged prefill above this (break-even ~1000 on an H100)


def _page_gather(g: dict, layout: str):
    """The copy of _plan_gather: pages of the caches, in kv_indices order, into g's [pages,
    page_size, Hkv, D] buffers (HND caches are read through a transposed view)."""
    pages = g["pages"]

    def gather(k, v):
        if layout != "NHD":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        torch.index_select(k, 0, pages, out=g["k"])
        torch.index_select(v, 0, pages, out=g["v"])
    return gather


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@dataclass
class TritonPlan:
    problem: AttentionProblem
    meta: BatchMeta
    device: torch.device
    nnz_q: int
    mask_mode: int
    cfg: Any
    work: torch.Tensor
    num_items: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: Optional[torch.Tensor]
    kv_lens: torch.Tensor
    slopes: Optional[torch.Tensor]
    max_splits: int = 1
    tmp_o: Optional[torch.Tensor] = None
    tmp_lse: Optional[torch.Tensor] = None
    merge_rows: Optional[torch.Tensor] = None
    merge_splits: Optional[torch.Tensor] = None
    num_merge_rows: int = 0
    stats: dict = field(default_factory=dict)
    launch_cache: dict = field(default_factory=dict)  # run() key -> prepared launchers
    dense: list = field(default_factory=list)  # Hopper dense-prefill configs to try, in order
    dense_work: dict = field(default_factory=dict)  # block_m -> (work [n, 2] int32, n, heads_first)
    heads_first: bool = False  # program ids run over the heads first (_heads_first)
    gather: Optional[dict] = None  # paged prefill via the dense kernel: buffers and indices


class TritonBackend(Backend):
    """Triton kernels for prefill (ragged/paged), batch decode (split-KV) and xqa decode.

    Parameters
    ----------
    config : dict, optional
        Force a launch config (block_m, block_n, num_warps, num_stages) for every plan (tuning, tests).
    kv_chunk : int, optional
        Force split-KV with partitions of this many keys (rounded up to block_n) for requests
        longer than it (tests); 0 disables splitting.  Default: decided per plan from the SM count.
    dense : bool or dict, default True
        Use the Hopper dense-prefill kernel (TMA + warp specialization, kernels/dense.py) where it
        applies; a dict forces one of its configs (tuning).  False: always the generic kernel.
    gather : bool, optional
        Paged prefill through the dense kernel: copy the batch's pages into contiguous K/V
        buffers allocated by plan(), then run the dense kernel on them.  None (default): where
        it pays (enough FLOPs per gathered byte, see ``GATHER_FLOP_PER_BYTE``) and the buffers fit
        in ``gather_cap_mb``; True: wherever the dense kernel serves the problem (tests); False:
        never.
    gather_cap_mb : int, optional
        Largest pair of gather buffers plan() may allocate, in MiB; default: the environment
        variable ``ATTNCORE_TRITON_GATHER_MB``, else 512 (0 turns the gather off).
    """

    name = "triton"
    description = "Triton kernels: GQA-packed paged/ragged attention, split-KV decode, fp8 KV"
    capabilities = CAPABILITIES

    def __init__(self, *, config: Optional[dict] = None, kv_chunk: Optional[int] = None,
                 dense: Any = True, gather: Optional[bool] = None, gather_cap_mb: Optional[int] = None):
        self._config = config
        self._kv_chunk = kv_chunk
        self._dense = dense
        self._gather = gather
        self._env_error: Optional[Reason] = None
        if gather_cap_mb is None:
            env = os.environ.get("ATTNCORE_TRITON_GATHER_MB", "").strip()
            try:
                gather_cap_mb = int(env) if env else 512
            except ValueError:  # reported by available(): the registry must not lose the backend
                gather_cap_mb = 0
                self._env_error = Reason("ATTNCORE_TRITON_GATHER_MB", repr(env), "an integer (MiB)",
                                         "fix or unset the variable")
        self._gather_cap = int(gather_cap_mb) << 20

    # ------------------------------------------------------------------ availability
    def available(self) -> List[Reason]:
        if self._env_error is not None:
            return [self._env_error]
        try:
            import triton  # noqa: F401
        except Exception as e:  # ImportError, or a broken install
            # name the module that is really missing (numpy, which Triton's interpreter imports, say)
            missing = getattr(e, "name", None) if isinstance(e, ImportError) else None
            return [Reason("import", f"triton not importable ({type(e).__name__}: {e})",
                           "triton >= 3.0", f"pip install {missing or 'triton'}")]
        if _interpreting():
            return []
        try:
            has_cuda = torch.cuda.is_available()
        except Exception:
            has_cuda = False
        if not has_cuda:
            return [Reason("device", "no CUDA GPU and TRITON_INTERPRET unset",
                           "a CUDA GPU sm80+, or the CPU through TRITON_INTERPRET=1",
                           "set TRITON_INTERPRET=1 before importing attncore to run on the CPU (slow)")]
        ccs = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        if not any(cc >= (8, 0) for cc in ccs):
            return [Reason("compute_capability", ",".join("sm%d%d" % c for c in ccs), ">= sm80")]
        return []

    def extra_reasons(self, p: AttentionProblem) -> List[Reason]:
        r: List[Reason] = []
        interp = _interpreting()
        if p.device_type == "cpu" and not interp:
            r.append(Reason("device", "cpu without TRITON_INTERPRET=1",
                            "cuda; cpu only through Triton's interpreter",
                            "set TRITON_INTERPRET=1 before importing attncore"))
        if p.device_type == "cuda" and interp:
            r.append(Reason("device", "cuda while TRITON_INTERPRET=1", "cpu under the interpreter",
                            "unset TRITON_INTERPRET to compile for the GPU"))
        if (p.device_type == "cuda" and p.kv_dtype in FP8_DTYPES and p.compute_capability is not None
                and tuple(p.compute_capability) < (8, 9)):
            r.append(Reason("kv_dtype", dtype_name(p.kv_dtype), "fp8 KV on sm89+ (Triton's fp8 conversions)"))
        if p.spec_mask and p.op != "xqa_decode":
            r.append(Reason("feature:spec_mask", p.op, "xqa_decode only"))
        if p.op == "single_prefill" and p.page_size is not None:
            r.append(Reason("page_size", str(p.page_size), "None for single_prefill (ragged KV)"))
        if p.pos_encoding not in ("NONE", "ROPE_LLAMA", "ALIBI"):
            r.append(Reason("pos_encoding", p.pos_encoding, "{NONE, ROPE_LLAMA, ALIBI}"))
        if p.num_kv_heads <= 0 or p.num_qo_heads % p.num_kv_heads:
            r.append(Reason("num_qo_heads", f"{p.num_qo_heads}/{p.num_kv_heads}", "a multiple of num_kv_heads"))
        return r

    # ------------------------------------------------------------------ plan
    def plan(self, problem: AttentionProblem, meta: BatchMeta) -> TritonPlan:
        from attncore.backends.triton import config as _cfg

        device = meta.device
        B = meta.batch_size
        G = problem.group_size
        interp = _interpreting()
        qo_host = meta.qo_indptr_host
        qo_lens = meta.qo_lens_host
        nnz_q = qo_host[-1]
        i32 = dict(dtype=torch.int32, device=device)
        paged = problem.page_size is not None

        # ---- KV addressing: kv_indptr (token or page offsets), kv_indices, kv_lens (all from the batch)
        kv_lens, kv_host = meta.kv_lens, meta.kv_lens_host
        if problem.op == "xqa_decode":
            bt = meta.block_tables
            if bt.dtype != torch.int32 or bt.stride(-1) != 1:
                bt = bt.to(torch.int32).contiguous()
            kv_indices = bt.reshape(-1) if bt.is_contiguous() else bt.contiguous().reshape(-1)
            kv_indptr = torch.arange(B + 1, **i32) * bt.shape[1]
            if kv_host is None:
                # seq_lens not read on the host (planned inside CUDA-graph capture, where the xqa API reads
                # nothing back): plan for max_seq_len, no device sync; the kernel clamps each request's
                # range to its seq_len and a split past it merges as empty
                kv_host = [meta.max_seq_len] * B
        else:
            kv_indptr = meta.kv_indptr
            kv_indices = meta.kv_indices if paged else None
        if kv_indices is not None and kv_indices.numel() == 0:
            kv_indices = torch.zeros(1, **i32)

        # ---- mask mode (the batch's mask is resolved: decode with no mask is causal)
        if problem.spec_mask:
            mask_mode = MASK_SPEC
        elif meta.mask == "custom":
            mask_mode = MASK_CUSTOM
        elif meta.mask == "causal":
            mask_mode = MASK_CAUSAL
        else:
            mask_mode = MASK_NONE

        # ---- launch config
        rows_max = max([q * G for q in qo_lens] + [1])
        cc = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
        if self._config is not None:
            cfg = _cfg.LaunchConfig(**self._config)
        else:
            cfg = _cfg.pick(problem, rows_max, device, interpret=interp, cc=cc)
        BM, BN = cfg.block_m, cfg.block_n

        # ---- split-KV decision (flash-decoding) and the work table
        nblocks = [(q * G + BM - 1) // BM for q in qo_lens]
        tiles = sum(nblocks) * problem.num_kv_heads
        if device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            num_sms = 4
        chunk = 0
        max_kv = max(kv_host + [0])
        fixed = meta.fixed_split_size
        if self._kv_chunk is not None:
            chunk = self._kv_chunk
        elif meta.disable_split_kv:
            chunk = 0
        elif fixed:  # the user's hint, in pages (tokens for ragged KV), rounded up to whole tiles
            chunk = int(fixed) * (problem.page_size or 1)
        elif tiles < num_sms and max_kv > 4 * BN:
            want = (2 * num_sms + tiles - 1) // max(tiles, 1)  # ~2 programs per SM
            chunk = max(4 * BN, (max_kv + want - 1) // want)
        if chunk:
            chunk = (chunk + BN - 1) // BN * BN
        items = []
        merge_rows: List[int] = []
        merge_splits: List[int] = []
        max_splits = 1
        causal = mask_mode == MASK_CAUSAL
        for i in range(B):
            qo, kv = qo_lens[i], kv_host[i]
            if qo == 0:
                continue
            ns = (kv + chunk - 1) // chunk if (chunk and kv > chunk) else 1
            if ns > 1:
                max_splits = max(max_splits, ns)
                merge_rows.extend(range(qo_host[i], qo_host[i + 1]))
                merge_splits.extend([ns] * qo)
            for b in range(nblocks[i]):
                r0 = b * BM
                last_tok = (min(r0 + BM, qo * G) - 1) // G  # token of the block's last row
                if ns == 1:
                    cost = min(kv, last_tok + kv - qo + 1) if causal else kv
                    items.append((cost, i, r0, 0, kv, -1))
                else:
                    for s in range(ns):
                        lo, hi = s * chunk, min(kv, (s + 1) * chunk)
                        items.append((hi - lo, i, r0, lo, hi, s))
        heads_first = _heads_first([t[0] for t in items], problem.num_kv_heads, num_sms)
        work, num_items = _work_table(items, 5, device)
        plan = TritonPlan(
            problem=problem, meta=meta, device=device, nnz_q=nnz_q, mask_mode=mask_mode, cfg=cfg,
            work=work, num_items=num_items, qo_indptr=meta.qo_indptr,
            kv_indptr=kv_indptr, kv_indices=kv_indices, kv_lens=kv_lens, slopes=None,
            max_splits=max_splits, heads_first=heads_first,
        )
        if problem.pos_encoding == "ALIBI":
            plan.slopes = torch.tensor([s * LOG2E for s in alibi_slopes(problem.num_qo_heads).tolist()],
                                       dtype=torch.float32, device=device)
        if merge_rows:
            plan.tmp_o = torch.empty(max_splits, nnz_q, problem.num_qo_heads, problem.head_dim_vo,
                                     dtype=torch.float32, device=device)
            plan.tmp_lse = torch.empty(max_splits, nnz_q, problem.num_qo_heads, dtype=torch.float32,
                                       device=device)
            plan.merge_rows = torch.tensor(merge_rows, dtype=torch.int32).to(device)
            plan.merge_splits = torch.tensor(merge_splits, dtype=torch.int32).to(device)
            plan.num_merge_rows = len(merge_rows)
        plan.stats = dict(items=num_items, tiles=tiles, chunk=chunk, max_splits=max_splits,
                          config=cfg.as_dict(), heads_first=heads_first)
        forced = isinstance(self._dense, dict)  # a forced config also runs where auto would not
        if (self._dense and self._config is None and not merge_rows
                and (forced or (not interp and cc is not None and cc[0] == 9 and rows_max > 64))
                and self._dense_serves(problem)
                and (not paged or self._plan_gather(plan, qo_lens, kv_host, causal))):
            self._plan_dense(plan, qo_lens, kv_host, causal, num_sms)
        return plan

    @staticmethod
    def _dense_serves(p: AttentionProblem) -> bool:
        """The dense kernel serves plain prefill over ragged KV (see kernels/dense.py), and over
        paged KV once gathered (_plan_gather); auto uses it on Hopper for prefill-shaped batches
        (more than 64 packed rows in some request)."""
        return (p.op in ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged")
                and p.mask in ("none", "causal") and not p.spec_mask
                and p.q_dtype in (_F16, _BF16) and p.kv_dtype == p.q_dtype and p.out_dtype == p.q_dtype
                and p.head_dim_qk == p.head_dim_vo and p.head_dim_qk in (64, 128)
                and p.pos_encoding == "NONE" and not p.soft_cap and p.window_left < 0)

    def _plan_gather(self, plan: TritonPlan, qo_lens, kv_host, causal: bool) -> bool:
        """Whether paged prefill goes through the dense kernel: pages copied to contiguous K/V.
        The copy reads and writes every page once (about 2 x bytes / 2.7 TB/s on an H100) and
        saves the generic kernel's pointer gathers (P3 333 -> 397, P4 382 -> 414 TFLOP/s with the
        copy included, backends/triton/bench/triton.md session 4), so auto requires enough FLOPs per byte."""
        if self._gather is False:
            return False
        p, meta = plan.problem, plan.meta
        n_pages, page = meta.kv_indptr_host[-1], p.page_size
        nbytes = 2 * n_pages * page * p.num_kv_heads * p.head_dim_qk * p.kv_dtype.itemsize
        if n_pages == 0 or nbytes > self._gather_cap:
            return False
        pairs = sum((qo * kv - qo * (qo - 1) // 2 if qo <= kv else kv * (kv + 1) // 2) if causal
                    else qo * kv for qo, kv in zip(qo_lens, kv_host))  # bottom-right causal
        flops = 4 * pairs * p.num_qo_heads * p.head_dim_qk
        if self._gather is None and flops < GATHER_FLOP_PER_BYTE * nbytes:
            return False
        dev = plan.kv_indices.device
        shape = (n_pages, page, p.num_kv_heads, p.head_dim_qk)
        plan.gather = dict(k=torch.empty(shape, dtype=p.kv_dtype, device=dev),
                           v=torch.empty(shape, dtype=p.kv_dtype, device=dev),
                           pages=plan.kv_indices[:n_pages],
                           kv_start=(plan.kv_indptr[:-1] * page).to(torch.int32).contiguous())
        plan.stats["gather_mb"] = nbytes / 2 ** 20
        return True

    def _plan_dense(self, plan: TritonPlan, qo_lens, kv_host, causal: bool, num_sms: int) -> None:
        from attncore.backends.triton import config as _cfg

        cands = ([_cfg.DenseConfig(**self._dense)] if isinstance(self._dense, dict)
                 else _cfg.dense_candidates(plan.problem, causal))
        for bm in sorted({c.block_m for c in cands}):
            items = []
            for i, (qo, kv) in enumerate(zip(qo_lens, kv_host)):
                for m0 in range(0, qo, bm):
                    cost = max(0, min(kv, m0 + bm + kv - qo)) if causal else kv
                    items.append((cost, i, m0))
            first = _heads_first([t[0] for t in items], plan.problem.num_qo_heads, num_sms)
            plan.dense_work[bm] = (*_work_table(items, 2, plan.device), first)
        plan.dense = cands
        plan.stats["dense"] = cands[0].as_dict()

    # ------------------------------------------------------------------ run
    def run(self, plan: TritonPlan, args: RunArgs) -> None:
        p = plan.problem
        q, k, v, out = args.q, args.k, args.v, args.out
        lse, sinks, spec = args.lse, args.sinks, args.spec_mask
        # everything _check looks at, so that a cached key needs no further check (host time)
        key = (q.shape, q.stride(), q.dtype, q.device, k.stride(), k.dtype, k.device, v.stride(), v.dtype,
               v.device, out.shape, out.stride(), out.dtype, out.device,
               None if lse is None else (lse.shape, lse.stride(), lse.dtype),
               None if sinks is None else (sinks.dtype, sinks.numel()), args.q_scale, args.k_scale,
               args.v_scale, args.o_scale, None if spec is None else (spec.shape, spec.stride(), spec.dtype))
        fast = plan.launch_cache.get(key)
        if fast is not None:  # same strides and scales as an earlier run: launch only
            if plan.mask_mode == MASK_SPEC:
                mb = (spec if spec.is_contiguous() else spec.contiguous()).view(torch.uint8)
            else:
                mb = plan.meta.packed_mask if plan.mask_mode == MASK_CUSTOM else None
            if q.is_cuda and q.device.index != torch.cuda.current_device():
                with torch.cuda.device(q.device):
                    fast[0](q, k, v, out, lse, mb, sinks)
                    fast[1](out, lse, sinks)
            else:
                fast[0](q, k, v, out, lse, mb, sinks)
                fast[1](out, lse, sinks)
            return
        self._check(plan, args)
        plan.launch_cache[key] = self._first_run(plan, args)

    def _first_run(self, plan: TritonPlan, args: RunArgs):
        from attncore.backends.triton.kernels.attention import _attn_fwd

        p = plan.problem
        q, k, v, out = args.q, args.k, args.v, args.out
        interpreted = type(_attn_fwd).__name__ == "InterpretedFunction"
        if interpreted != (q.device.type == "cpu"):
            raise RuntimeError(
                f"triton backend: kernels were {'interpreted' if interpreted else 'compiled'} at import "
                f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} then) but the tensors are on "
                f"{q.device}; set TRITON_INTERPRET before attncore's triton kernels are first imported")
        paged = p.page_size is not None
        # element strides (page, slot/token, head) of K and V
        if paged:
            if p.kv_layout == "NHD":  # [pages, page_size, Hkv, D]
                ks = (k.stride(0), k.stride(1), k.stride(2))
                vs = (v.stride(0), v.stride(1), v.stride(2))
            else:  # [pages, Hkv, page_size, D]
                ks = (k.stride(0), k.stride(2), k.stride(1))
                vs = (v.stride(0), v.stride(2), v.stride(1))
        else:
            if p.kv_layout == "NHD":  # [n, Hkv, D]
                ks = (0, k.stride(0), k.stride(1))
                vs = (0, v.stride(0), v.stride(1))
            else:  # [Hkv, n, D]
                ks = (0, k.stride(1), k.stride(0))
                vs = (0, v.stride(1), v.stride(0))
        meta = plan.meta
        prm = meta.params
        sm = prm.sm_scale * args.q_scale * args.k_scale
        cap = prm.logits_soft_cap or 0.0
        out_scale = args.v_scale / args.o_scale
        mask_bytes = mask_indptr = None
        spec_q_len = spec_row_bytes = 0
        if plan.mask_mode == MASK_CUSTOM:
            mask_bytes, mask_indptr = meta.packed_mask, meta.mask_indptr
        elif plan.mask_mode == MASK_SPEC:
            sm_t = args.spec_mask
            if not sm_t.is_contiguous():
                sm_t = sm_t.contiguous()
            mask_bytes = sm_t.view(torch.uint8)
            spec_q_len = sm_t.shape[1]
            spec_row_bytes = sm_t.shape[2] * 2
        if q.shape[0] == 0:
            return (lambda *a: None, lambda *a: None)
        if q.is_cuda and q.device.index != torch.cuda.current_device():
            with torch.cuda.device(q.device):  # launch on the tensors' device (cuda:1 works)
                return self._launch(plan, args, ks, vs, sm, cap, out_scale, mask_bytes, mask_indptr,
                                    spec_q_len, spec_row_bytes)
        return self._launch(plan, args, ks, vs, sm, cap, out_scale, mask_bytes, mask_indptr,
                            spec_q_len, spec_row_bytes)

    @staticmethod
    def _launch(plan, args, ks, vs, sm, cap, out_scale, mask_bytes, mask_indptr, spec_q_len,
                spec_row_bytes):
        from attncore.backends.triton.kernels.attention import attention_fwd
        from attncore.backends.triton.kernels.merge import merge_splits

        p, prm, c = plan.problem, plan.meta.params, plan.cfg
        q, k, v, out = args.q, args.k, args.v, args.out
        split = plan.num_merge_rows > 0
        if plan.dense:
            fwd = TritonBackend._launch_dense(plan, args, ks, vs, sm * LOG2E, out_scale)
            if fwd is not None:
                return fwd, (lambda *a: None)
        fwd = attention_fwd(
            q, k, v, out, args.lse, plan.tmp_o, plan.tmp_lse, plan.work, plan.num_items,
            plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_lens, mask_bytes, mask_indptr,
            args.sinks, plan.slopes, num_kv_heads=p.num_kv_heads, group_size=p.group_size,
            head_dim=p.head_dim_qk, page_size=p.page_size, kv_strides=ks, v_strides=vs,
            mask_mode=plan.mask_mode, window_left=prm.window_left, soft_cap=cap > 0,
            alibi=prm.pos_encoding_mode == "ALIBI", rope=prm.pos_encoding_mode == "ROPE_LLAMA",
            rope_theta=prm.rope_theta, rope_scale=prm.rope_scale,
            qk_scale=sm * LOG2E, cap_inv=(sm / cap) if cap > 0 else 0.0,
            cap_l2=cap * LOG2E, out_scale=out_scale, spec_q_len=spec_q_len,
            spec_row_bytes=spec_row_bytes, split=split, block_m=c.block_m, block_n=c.block_n,
            num_warps=c.num_warps, num_stages=c.num_stages, prefetch=c.prefetch, dot_f16=c.dot_f16,
            heads_first=plan.heads_first,
        )
        merge = lambda *a: None  # noqa: E731
        if split:
            merge = merge_splits(plan.tmp_o, plan.tmp_lse, out, args.lse, plan.merge_rows, plan.merge_splits,
                         args.sinks, num_rows=plan.num_merge_rows, head_dim=p.head_dim_vo,
                         out_scale=out_scale, max_splits=plan.max_splits)
        return fwd, merge

    @staticmethod
    def _launch_dense(plan, args, ks, vs, qk_scale, out_scale):
        """Launch the dense kernel with the first config that compiles; None: not applicable to
        these tensors (alignment, scale sign) or no config compiled -> the generic kernel."""
        from attncore.backends.triton.kernels.dense import dense_fwd, tma_ready

        q, k, v, out = args.q, args.k, args.v, args.out
        g = plan.gather
        if g is None and plan.problem.page_size is not None:
            return None  # paged KV without the gather (dropped below): the generic kernel
        if g is not None:  # paged: the dense kernel reads the gathered copies
            hkv, d = plan.problem.num_kv_heads, plan.problem.head_dim_qk
            gather = _page_gather(g, plan.problem.kv_layout)
            k, v = g["k"].view(-1, hkv, d), g["v"].view(-1, hkv, d)
            ks = vs = (0, k.stride(0), k.stride(1))
            kv_start = g["kv_start"]
        else:
            kv_start = plan.kv_indptr
        if qk_scale <= 0 or not tma_ready(q, k, v, out):
            plan.stats["dense_skipped"] = "unaligned tensors or sm_scale <= 0"
            plan.gather = None  # the generic kernel reads the pages itself
            return None
        if g is not None:
            gather(args.k, args.v)  # before the first dense launch below
        while plan.dense:
            c = plan.dense[0]
            work, n, heads_first = plan.dense_work[c.block_m]
            try:
                fwd = dense_fwd(q, k, v, out, args.lse, args.sinks, work, n, plan.qo_indptr,
                                kv_start, plan.kv_lens, group_size=plan.problem.group_size,
                                head_dim=plan.problem.head_dim_qk, kv_strides=ks[1:], v_strides=vs[1:],
                                causal=plan.mask_mode == MASK_CAUSAL, qk_scale=qk_scale,
                                out_scale=out_scale, heads_first=heads_first, **c.as_dict())
            except Exception as e:  # a config Triton cannot compile here: try the next one
                plan.stats.setdefault("dense_failed", []).append(f"{c.as_dict()}: {type(e).__name__}: {str(e)[:200]}")
                plan.dense = plan.dense[1:]
                continue
            plan.stats["dense"] = c.as_dict()
            plan.stats["heads_first"] = heads_first
            if g is None:
                return fwd
            kg, vg = k, v

            def gather_fwd(q, k, v, out, lse, mask_bytes, sinks):
                gather(k, v)
                fwd(q, kg, vg, out, lse, mask_bytes, sinks)
            return gather_fwd
        if g is not None:
            plan.gather = None  # the generic kernel reads the pages itself
        return None

    @staticmethod
    def _check(plan: TritonPlan, args: RunArgs) -> None:
        """Cheap attribute checks: run() with other dtypes, shapes or devices than planned raises."""
        p = plan.problem
        q, k, v, out = args.q, args.k, args.v, args.out
        if q.dtype != p.q_dtype or k.dtype != p.kv_dtype or v.dtype != p.kv_dtype:
            raise TypeError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} differ from the plan's "
                            f"{p.q_dtype}/{p.kv_dtype}")
        if out.dtype != p.out_dtype:
            raise TypeError(f"out dtype {out.dtype} differs from the plan's {p.out_dtype}")
        want = (plan.nnz_q, p.num_qo_heads, p.head_dim_qk)
        if tuple(q.shape) != want or tuple(out.shape) != (plan.nnz_q, p.num_qo_heads, p.head_dim_vo):
            raise ValueError(f"q {tuple(q.shape)} / out {tuple(out.shape)}: planned {want}")
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t.device.type != plan.device.type or (t.device.type == "cuda" and t.device.index != plan.device.index):
                raise ValueError(f"{name} is on {t.device}, planned for {plan.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: last dim must be contiguous (stride {t.stride()})")
        if args.lse is not None:
            if args.lse.dtype != torch.float32 or tuple(args.lse.shape) != (plan.nnz_q, p.num_qo_heads):
                raise ValueError(f"lse must be float32 [{plan.nnz_q}, {p.num_qo_heads}], got "
                                 f"{args.lse.dtype} {tuple(args.lse.shape)}")
        if p.sinks != (args.sinks is not None):
            raise ValueError(f"sinks: planned {'with' if p.sinks else 'without'} sinks, got "
                             f"{'none' if args.sinks is None else 'a tensor'}")
        if args.sinks is not None and (args.sinks.dtype != torch.float32 or args.sinks.numel() != p.num_qo_heads):
            raise ValueError(f"sinks must be float32 [{p.num_qo_heads}], got {args.sinks.dtype} "
                             f"{tuple(args.sinks.shape)}")
        if plan.mask_mode == MASK_SPEC:
            m = args.spec_mask
            B = plan.meta.batch_size
            qlen = p.q_len_per_req
            if m is None or m.dtype != torch.uint16 or tuple(m.shape) != (B, qlen, (qlen + 31) // 32 * 2):
                raise ValueError(f"spec_mask must be uint16 [{B}, {qlen}, {(qlen + 31) // 32 * 2}], got "
                                 f"{None if m is None else (m.dtype, tuple(m.shape))}")
