"""Batches built by hand through the backend contract (``BatchMeta`` / ``RunArgs``), checked by the
conformance suite's own checker.

``inputs.build`` draws the conformance suite's cases from a problem; the per-backend tests and GPU
scripts need cases the suite does not draw (a backend object with forced tiles or kernels, chosen
lengths, K and V with different strides, NaN in chosen query rows, other requests' rows NaN).  They
build them here, and check them the one way (``runner.check_result``: fp64 golden, the tolerance
rule of ``golden.tolerance``, NaN and empty-row rules):

* ``offsets`` / ``page_table``: CSR offsets; a shuffled page pool with spare pages (the page ids of each request);
* ``check_batch`` / ``assert_batch``: per-request golden, yardstick and the rule on any batch;
* ``run_case``: build a batch, run a backend twice (clean, then with NaN where the contract says
  it must not matter), compare the runs bit for bit and check the clean one (and the NaN rows).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from attncore.core.backend import AttnParams, BatchMeta, RunArgs
from attncore.core.mask import pack_spec_mask
from attncore.core.problem import AttentionProblem
from attncore.quantization import packbits
from attncore.testing import inputs, runner


# ---------------------------------------------------------------------------------------------
# Index arrays and page tables
# ---------------------------------------------------------------------------------------------
def offsets(lens: Sequence[int]) -> List[int]:
    """CSR offsets of ``lens``: ``[0, l0, l0 + l1, ...]`` (qo_indptr, a ragged kv_indptr)."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@dataclass
class PageTable:
    """A pool of ``total`` pages, shuffled: request i holds ``pages[i]``; ``spare`` pages are in no
    request's table.  CSR form: ``indptr`` / ``indices`` / ``last_page_len``."""

    page_size: int
    total: int
    pages: List[List[int]]
    spare: List[int]
    indptr: List[int]
    indices: List[int]
    last_page_len: List[int]

    def slots(self, i: int, t0: int = 0, t1: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) long tensors of keys ``t0 <= t < t1`` of request i."""
        n = self.indptr[i + 1] - self.indptr[i]
        kv = (n - 1) * self.page_size + self.last_page_len[i] if n else 0
        t = torch.arange(t0, kv if t1 is None else min(t1, kv))
        return torch.tensor(self.pages[i] or [0], dtype=torch.long)[t // self.page_size], t % self.page_size


def page_table(kv_lens: Sequence[int], page_size: int, spare: int = 3,
               generator: Optional[torch.Generator] = None) -> PageTable:
    """Pages for requests of ``kv_lens`` keys from one ``torch.randperm`` draw of the pool (``generator``
    None: torch's global generator), handed out in request order; ``spare`` pages left over."""
    npages = [-(-n // page_size) for n in kv_lens]
    total = sum(npages) + spare
    perm = torch.randperm(total, generator=generator).tolist()
    pages, indptr = [], [0]
    for n in npages:
        pages.append(perm[indptr[-1]:indptr[-1] + n])
        indptr.append(indptr[-1] + n)
    last = [n - (len(pg) - 1) * page_size if pg else 0 for n, pg in zip(kv_lens, pages)]
    return PageTable(page_size, total, pages, perm[indptr[-1]:], indptr, perm[:indptr[-1]], last)


# ---------------------------------------------------------------------------------------------
# Checking any batch
# ---------------------------------------------------------------------------------------------
def check_batch(reqs: Sequence[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]], out: torch.Tensor,
                lse: Optional[torch.Tensor] = None, *, masks: Optional[Sequence[Optional[torch.Tensor]]] = None,
                causal: bool = False, q_dtype: Optional[torch.dtype] = None, device=None, what: str = "",
                **golden_kwargs) -> List[str]:
    """``runner.check_result`` on a batch not built by ``inputs.build``; failure messages (empty: pass).

    ``reqs``: per request (q [qo, Hq, D], k [kv, Hkv, D], v [kv, Hkv, Dv]), NHD, the values the
    backend saw (fp8 K/V as they are); ``out`` [sum qo, Hq, Dv] and ``lse`` [sum qo, Hq] (None: not
    checked), the backend's results in request order; ``masks``: per request bool [qo, kv] or None
    (a mask replaces ``causal``); ``golden_kwargs``: ``golden_attention``'s (window_left, sm_scale,
    logits_soft_cap, pos_encoding_mode, rope_scale, rope_theta, sinks, q/k/v/o scales).  The yardstick
    runs in ``q_dtype`` (default: q's) rounded to out's dtype; golden and yardstick run on ``device``
    (default: out's)."""
    q_dtype = q_dtype or (reqs[0][0].dtype if reqs else out.dtype)
    p = AttentionProblem(op="single_prefill", q_dtype=q_dtype, out_dtype=out.dtype,
                         mask="causal" if causal else "none",
                         pos_encoding=golden_kwargs.get("pos_encoding_mode", "NONE"), return_lse=lse is not None)
    dev = torch.device(device) if device is not None else out.device
    b = inputs.Built(p, None, None, [r[0].shape[0] for r in reqs], [r[1].shape[0] for r in reqs], list(reqs),
                     list(masks) if masks is not None else [None] * len(reqs), dict(golden_kwargs),
                     torch.empty(0, device=dev), None)
    none = torch.empty(0)
    return runner.check_result(b, inputs.expected(b), out, lse, out_buf=none, lse_buf=none, what=what)


def assert_batch(*args, **kw) -> None:
    """``check_batch``, raising AssertionError with the messages."""
    errs = check_batch(*args, **kw)
    shown = errs[:8] + ([f"... and {len(errs) - 8} more"] if len(errs) > 8 else [])
    assert not errs, "\n  ".join(["tolerance rule / golden check failed:"] + shown)


# ---------------------------------------------------------------------------------------------
# One case through the backend contract, run twice
# ---------------------------------------------------------------------------------------------
def _strided(shape, dt, device, noncontig, fill=None):
    """A tensor of ``shape``, optionally a non-contiguous view (padded middle/leading dims; the
    padding holds NaN, which a kernel must never read)."""
    if not noncontig:
        t = torch.empty(shape, dtype=dt, device=device)
    else:
        big = [s + (1 if i < len(shape) - 1 else 0) for i, s in enumerate(shape)]
        big[-1] = shape[-1] + 16
        t = torch.full(big, float("nan"), dtype=dt, device=device)[tuple(slice(0, s) for s in shape)]
    if fill is not None:
        t.fill_(fill)
    return t


def run_case(op, *, backend, qo_lens, kv_lens, hq=4, hkv=2, d=32, dtype=torch.float16, kv_dtype=None,
             page_size=None, layout="NHD", causal=False, custom=False, window_left=-1, soft_cap=0.0,
             pos="NONE", sinks=False, scales=(1.0, 1.0, 1.0, 1.0), return_lse=True, noncontig=False,
             spec=False, device="cpu", seed=0, sm_scale=None, check=True, kv_views="same",
             nan_q=(), nan_window=False, nan_reqs=()):
    """Build a batch, run ``backend`` twice (the second run of the plan takes a cached launch path
    where a backend has one) and check against the fp64 golden (``check_batch``); returns the plan.

    Every K/V slot and padding element no request may read holds NaN (docs/semantics.md,
    "Non-finite inputs", rule 1): slots past kv_len, spare pages, view padding (``noncontig``),
    block-table padding (xqa_decode: it names a spare page).
    ``kv_views`` (paged): "same" K and V alike, "split" V strides other than K's, "padded" a page
    stride no multiple of the token stride.  Non-finite inputs of the second run (rules 2-4):
    ``nan_q`` lists (request, token, head) query rows that get a NaN; ``nan_window`` puts NaN in the
    K and V of every key left of the window of all rows of its request; ``nan_reqs`` lists requests
    whose K/V rows are all NaN (give them no query rows: they are "other requests' rows").  The
    second run must give the first's bits outside the ``nan_q`` rows; those are checked too (NaN out
    and LSE where the row sees a key, else exactly 0 and -inf)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    kv_dtype = kv_dtype or dtype
    fp8 = kv_dtype.itemsize == 1
    B = len(qo_lens)
    q_scale, k_scale, v_scale, o_scale = scales
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    decode = op in ("batch_decode", "xqa_decode")
    qlen = qo_lens[0] if decode else 1
    qs = [rnd(n, hq, d).to(dtype) for n in qo_lens]
    ks = [(rnd(n, hkv, d) * (4 if fp8 else 1)).to(kv_dtype) for n in kv_lens]
    vs = [(rnd(n, hkv, d) * (4 if fp8 else 1)).to(kv_dtype) for n in kv_lens]
    masks = None
    if custom:
        masks = [torch.rand(qo, kv, generator=g) > 0.4 for qo, kv in zip(qo_lens, kv_lens)]
        if len(masks) and masks[0].numel():
            masks[0][0, :] = False  # a fully masked row
    spec_mask = None
    if spec:
        spec_bits = [torch.tril(torch.ones(qlen, qlen, dtype=torch.bool)) & (torch.rand(qlen, qlen, generator=g) > 0.3)
                     | torch.eye(qlen, dtype=torch.bool) for _ in range(B)]
        spec_mask = pack_spec_mask(torch.stack(spec_bits))
        masks = [torch.cat([torch.ones(qlen, kv_lens[b] - qlen, dtype=torch.bool), spec_bits[b]], dim=1)
                 for b in range(B)]
    sinks_t = (rnd(hq) * 2).float() if sinks else None

    # ---- q / out / lse (concatenated rows)
    nnz = sum(qo_lens)
    qo_indptr_h = offsets(qo_lens)
    q = _strided((nnz, hq, d), dtype, device, noncontig)
    q.copy_(torch.cat(qs).to(device) if nnz else torch.empty(0, hq, d, dtype=dtype))
    out = _strided((nnz, hq, d), dtype, device, noncontig, fill=float("nan"))
    lse = torch.full((nnz, hq), float("nan"), device=device) if return_lse else None

    i32 = dict(dtype=torch.int32, device=device)
    if page_size is None:
        kv_indptr_h = offsets(kv_lens)
        nkv = kv_indptr_h[-1]
        shape = (nkv, hkv, d) if layout == "NHD" else (hkv, nkv, d)
        k = _strided(shape, kv_dtype, device, noncontig)
        v = _strided(shape, kv_dtype, device, noncontig)
        kc, vc = torch.cat(ks), torch.cat(vs)
        if layout == "HND":
            kc, vc = kc.transpose(0, 1), vc.transpose(0, 1)
        k.copy_(kc.to(device))
        v.copy_(vc.to(device))

        def kv_slot(b, t):  # index of key t of request b in k / v
            r = kv_indptr_h[b] + t
            return (r,) if layout == "NHD" else (slice(None), r)
        meta_kw = dict(kv_indptr=torch.tensor(kv_indptr_h, **i32), kv_indptr_host=kv_indptr_h,
                       kv_lens=torch.tensor(kv_lens, **i32), kv_lens_host=list(kv_lens))
    else:
        pt = page_table(kv_lens, page_size, generator=g)
        total = pt.total
        shape = (total, page_size, hkv, d) if layout == "NHD" else (total, hkv, page_size, d)
        if kv_views == "padded":  # page stride no multiple of the token stride (element addressing)
            n = math.prod(shape[1:])
            k, v = (torch.empty(total, n + 8, dtype=kv_dtype, device=device)[:, :n].unflatten(1, shape[1:])
                    for _ in range(2))
        else:  # "split": V strides differ from K's
            k = _strided(shape, kv_dtype, device, noncontig)
            v = _strided(shape, kv_dtype, device, noncontig != (kv_views == "split"))
        k.fill_(float("nan"))
        v.fill_(float("nan"))  # unused slots are NaN: reading one poisons the output

        def kv_slot(b, t):
            pg, sl = pt.pages[b][t // page_size], t % page_size
            return (pg, sl) if layout == "NHD" else (pg, slice(None), sl)
        for b in range(B):
            for t in range(kv_lens[b]):
                k[kv_slot(b, t)] = ks[b][t].to(device)
                v[kv_slot(b, t)] = vs[b][t].to(device)
        if op == "xqa_decode":  # two columns past the longest request; padding points at a spare (NaN) page
            bt = torch.full((B, max([len(pg) for pg in pt.pages] + [1]) + 2), pt.spare[0], dtype=torch.int32)
            for b, pg in enumerate(pt.pages):
                bt[b, :len(pg)] = torch.tensor(pg, dtype=torch.int32)
            meta_kw = dict(block_tables=bt.to(device), seq_lens=torch.tensor(kv_lens, **i32),
                           max_seq_len=max(kv_lens))
        else:
            meta_kw = dict(kv_indptr=torch.tensor(pt.indptr, **i32), kv_indptr_host=pt.indptr,
                           kv_indices=torch.tensor(pt.indices or [0], **i32)[: len(pt.indices)],
                           kv_last_page_len=torch.tensor(pt.last_page_len, **i32),
                           kv_lens=torch.tensor(kv_lens, **i32), kv_lens_host=list(kv_lens))
    if custom:
        segs, mind = [], [0]
        for m in masks:
            segs.append(packbits(m.reshape(-1), bitorder="little"))
            mind.append(mind[-1] + segs[-1].numel())
        meta_kw.update(packed_mask=torch.cat(segs).to(device) if segs else torch.zeros(0, dtype=torch.uint8),
                       mask_indptr=torch.tensor(mind, **i32), mask_indptr_host=mind)
    params = AttnParams(sm_scale=sm_scale, causal=causal, logits_soft_cap=soft_cap,
                        window_left=window_left, pos_encoding_mode=pos)
    meta = BatchMeta(batch_size=B, qo_indptr=torch.tensor(qo_indptr_h, **i32), qo_indptr_host=qo_indptr_h,
                     page_size=page_size, params=params, q_len_per_req=qlen if decode else 1,
                     device=torch.device(device), **meta_kw)
    dev_type = torch.device(device).type
    problem = AttentionProblem(
        op=op, device_type=dev_type,
        compute_capability=tuple(torch.cuda.get_device_capability()) if dev_type == "cuda" else None,
        q_dtype=dtype, kv_dtype=kv_dtype, out_dtype=dtype, num_qo_heads=hq, num_kv_heads=hkv,
        head_dim_qk=d, head_dim_vo=d, page_size=page_size, kv_layout=layout,
        mask="custom" if custom else ("causal" if causal else "none"), window_left=window_left,
        soft_cap=soft_cap > 0, pos_encoding=pos, sinks=sinks,
        fp8_scales=scales != (1.0, 1.0, 1.0, 1.0), return_lse=return_lse,
        q_len_per_req=qlen if decode else 1, spec_mask=spec)
    reasons = backend.reasons(problem)
    assert not reasons, [str(r) for r in reasons]
    plan = backend.plan(problem, meta)
    args = RunArgs(q=q, k=k, v=v, out=out, lse=lse, sinks=sinks_t.to(device) if sinks else None,
                   q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=o_scale,
                   spec_mask=spec_mask.to(device) if spec else None)
    backend.run(plan, args)
    # non-finite inputs for the second run (rules 1-3): keys left of every row's window, other
    # requests' rows, one element of some query rows
    for b in range(B):
        hidden = kv_lens[b] - qo_lens[b] - window_left if nan_window and window_left >= 0 else 0
        for t in range(kv_lens[b] if b in nan_reqs else max(0, min(hidden, kv_lens[b]))):
            k[kv_slot(b, t)] = float("nan")
            v[kv_slot(b, t)] = float("nan")
    bad = torch.zeros(nnz, hq, dtype=torch.bool)  # rows whose query holds a NaN
    qs_nan = [x.clone() for x in qs]
    for b, t, h in nan_q:
        q[qo_indptr_h[b] + t, h, (t + h) % d] = float("nan")
        qs_nan[b][t, h, (t + h) % d] = float("nan")
        bad[qo_indptr_h[b] + t, h] = True
    # a second run of the same plan (cached launch path) into fresh poisoned buffers: same result
    out2 = torch.full_like(out, float("nan"))
    lse2 = torch.full_like(lse, float("nan")) if lse is not None else None
    backend.run(plan, dataclasses.replace(args, out=out2, lse=lse2))
    good = ~bad.to(out.device)
    assert torch.equal(out2[good].isnan(), out[good].isnan())
    assert torch.equal(out2[good].nan_to_num(), out[good].nan_to_num()), "poisoned keys changed the output"
    if lse is not None:
        assert torch.equal(lse2[good].nan_to_num(), lse[good].nan_to_num()), "poisoned keys changed the LSE"
    if not check:
        return plan
    kw = dict(masks=masks, causal=causal or (decode and not spec and qlen > 1), device=device,
              window_left=window_left, sm_scale=sm_scale, logits_soft_cap=soft_cap, pos_encoding_mode=pos,
              sinks=sinks_t, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=o_scale)
    errs = check_batch(list(zip(qs, ks, vs)), out, lse, **kw)
    if nan_q:  # rules 3-4 on the second run: NaN rows that see a key NaN, the others 0 / -inf
        errs += check_batch(list(zip(qs_nan, ks, vs)), out2, lse2, what="second run, NaN query rows: ", **kw)
    shown = errs[:8] + ([f"... and {len(errs) - 8} more"] if len(errs) > 8 else [])
    assert not errs, "\n  ".join([f"{problem.describe()} qo_lens={list(qo_lens)} kv_lens={list(kv_lens)}"] + shown)
    return plan
