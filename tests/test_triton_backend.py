"""Triton backend against the fp64 golden, through the backend contract (BatchMeta / RunArgs).

CPU cases run through Triton's interpreter on small shapes (fp16 / fp32; the interpreter's bf16 is
broken); ``@pytest.mark.gpu`` cases run on CUDA (bf16, fp16, fp8 KV) and skip without it.
Tolerance rule: ``attncore.testing.golden.tolerance`` (max error vs the fp64 golden <= 2 x the error
of the same dense torch math done in the backend dtype + a small atol).  Outputs are poisoned with
NaN before every run, and so is every K/V slot and padding element a kernel must not read
(docs/semantics.md, "Non-finite inputs", rule 1); ``run_case(nan_q=..., nan_window=...)`` also
poisons query rows and keys left of the window (rules 2-4).
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from attncore.backend import AttnParams, BatchMeta, RunArgs  # noqa: E402
from attncore.problem import AttentionProblem  # noqa: E402
from attncore.testing.golden import dtype_attention, golden_attention, tolerance  # noqa: E402
from attncore.backends.triton.backend import TritonBackend  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (CPU interpreter)")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERP, reason="needs a CUDA GPU (and no TRITON_INTERPRET)")


# ----------------------------------------------------------------------------- dense dtype math
# ----------------------------------------------------------------------------- case builder
def _pack_lsb(bits: torch.Tensor) -> torch.Tensor:
    """bool [n] -> uint8 [ceil(n/8)], LSB-first."""
    n = bits.numel()
    pad = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8)
    pad[:n] = bits.to(torch.uint8)
    w = (2 ** torch.arange(8, dtype=torch.int32))
    return (pad.view(-1, 8).to(torch.int32) * w).sum(1).to(torch.uint8)


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


def run_case(op, *, qo_lens, kv_lens, hq=4, hkv=2, d=32, dtype=torch.float16, kv_dtype=None,
             page_size=None, layout="NHD", causal=False, custom=False, window_left=-1, soft_cap=0.0,
             pos="NONE", sinks=False, scales=(1.0, 1.0, 1.0, 1.0), return_lse=True, noncontig=False,
             spec=False, device="cpu", seed=0, backend=None, sm_scale=None, check=True, kv_views="same",
             nan_q=(), nan_window=False, nan_reqs=()):
    """Build a batch, run the backend twice (the second run takes the cached launch path) and
    check against the fp64 golden.  Non-finite inputs (docs/semantics.md): ``nan_q`` lists
    (request, token, head) query rows that get a NaN; ``nan_window`` puts NaN in the K and V of
    every key left of the window of all rows of its request; ``nan_reqs`` lists requests whose
    K/V rows are all NaN (give them no query rows: they are "other requests' rows").  With any
    of these, the first run gets clean inputs and the second the poisoned ones, which must give
    the same bits except in the ``nan_q`` rows: NaN out and LSE where the row sees a key, else
    exactly 0 and -inf."""
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
    spec_bits = None
    if spec:
        w16 = (qlen + 31) // 32 * 2
        spec_bits = [torch.tril(torch.ones(qlen, qlen, dtype=torch.bool)) & (torch.rand(qlen, qlen, generator=g) > 0.3)
                     | torch.eye(qlen, dtype=torch.bool) for _ in range(B)]
        sm16 = torch.zeros(B, qlen, w16 * 2, dtype=torch.uint8)
        for b in range(B):
            for i in range(qlen):
                sm16[b, i, : (qlen + 7) // 8] = _pack_lsb(spec_bits[b][i])
        spec_mask = sm16.view(torch.uint16).reshape(B, qlen, w16)
        masks = []
        for b in range(B):
            m = torch.ones(qlen, kv_lens[b], dtype=torch.bool)
            m[:, kv_lens[b] - qlen:] = spec_bits[b]
            masks.append(m)
    sinks_t = (rnd(hq) * 2).float() if sinks else None

    # ---- q / out / lse (concatenated rows)
    nnz = sum(qo_lens)
    qo_indptr_h = [0]
    for n in qo_lens:
        qo_indptr_h.append(qo_indptr_h[-1] + n)
    q = _strided((nnz, hq, d), dtype, device, noncontig)
    q.copy_(torch.cat(qs).to(device) if nnz else torch.empty(0, hq, d, dtype=dtype))
    out_dtype = dtype
    out = _strided((nnz, hq, d), out_dtype, device, noncontig, fill=float("nan"))
    lse = torch.full((nnz, hq), float("nan"), device=device) if return_lse else None

    i32 = dict(dtype=torch.int32, device=device)
    paged = page_size is not None
    meta_kw = {}
    if not paged:
        kv_indptr_h = [0]
        for n in kv_lens:
            kv_indptr_h.append(kv_indptr_h[-1] + n)
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
        npages = [(n + page_size - 1) // page_size for n in kv_lens]
        total = sum(npages) + 3
        perm = torch.randperm(total, generator=g).tolist()
        shape = (total, page_size, hkv, d) if layout == "NHD" else (total, hkv, page_size, d)
        if kv_views == "padded":  # page stride no multiple of the token stride (element addressing)
            n = math.prod(shape[1:])
            k, v = (torch.empty(total, n + 8, dtype=kv_dtype, device=device)[:, :n].unflatten(1, shape[1:])
                    for _ in range(2))
        else:  # "split": V strides differ from K's
            k = _strided(shape, kv_dtype, device, noncontig)
            v = _strided(shape, kv_dtype, device, noncontig != (kv_views == "split"))
        nanv = float("nan")
        k.fill_(nanv)
        v.fill_(nanv)  # unused slots are NaN: reading one poisons the output
        indices, indptr_h, last = [], [0], []
        for b in range(B):
            pages = perm[indptr_h[-1]: indptr_h[-1] + npages[b]]
            indices += pages
            indptr_h.append(indptr_h[-1] + npages[b])
            last.append(kv_lens[b] - (npages[b] - 1) * page_size if npages[b] else 0)
            for t in range(kv_lens[b]):
                pg, sl = pages[t // page_size], t % page_size
                if layout == "NHD":
                    k[pg, sl] = ks[b][t].to(device)
                    v[pg, sl] = vs[b][t].to(device)
                else:
                    k[pg, :, sl] = ks[b][t].to(device)
                    v[pg, :, sl] = vs[b][t].to(device)

        def kv_slot(b, t):
            pg, sl = indices[indptr_h[b] + t // page_size], t % page_size
            return (pg, sl) if layout == "NHD" else (pg, slice(None), sl)
        if op == "xqa_decode":
            maxp = max(npages + [1])
            bt = torch.zeros(B, maxp, dtype=torch.int32)
            for b in range(B):
                bt[b, : npages[b]] = torch.tensor(indices[indptr_h[b]: indptr_h[b + 1]], dtype=torch.int32)
            meta_kw = dict(block_tables=bt.to(device), seq_lens=torch.tensor(kv_lens, **i32),
                           max_seq_len=max(kv_lens))
        else:
            meta_kw = dict(kv_indptr=torch.tensor(indptr_h, **i32), kv_indptr_host=indptr_h,
                           kv_indices=torch.tensor(indices or [0], **i32)[: len(indices)],
                           kv_last_page_len=torch.tensor(last, **i32),
                           kv_lens=torch.tensor(kv_lens, **i32), kv_lens_host=list(kv_lens))
    mask_kw = {}
    if custom:
        segs, mind = [], [0]
        for m in masks:
            seg = _pack_lsb(m.reshape(-1))
            segs.append(seg)
            mind.append(mind[-1] + seg.numel())
        mask_kw = dict(packed_mask=torch.cat(segs).to(device) if segs else torch.zeros(0, dtype=torch.uint8),
                       mask_indptr=torch.tensor(mind, **i32), mask_indptr_host=mind)
    params = AttnParams(sm_scale=sm_scale, causal=causal, logits_soft_cap=soft_cap,
                        window_left=window_left, pos_encoding_mode=pos)
    meta = BatchMeta(batch_size=B, qo_indptr=torch.tensor(qo_indptr_h, **i32), qo_indptr_host=qo_indptr_h,
                     page_size=page_size, params=params, q_len_per_req=qlen if decode else 1,
                     device=torch.device(device), **meta_kw, **mask_kw)
    dev_type = torch.device(device).type
    problem = AttentionProblem(
        op=op, device_type=dev_type,
        compute_capability=tuple(torch.cuda.get_device_capability()) if dev_type == "cuda" else None,
        q_dtype=dtype, kv_dtype=kv_dtype, out_dtype=out_dtype, num_qo_heads=hq, num_kv_heads=hkv,
        head_dim_qk=d, head_dim_vo=d, page_size=page_size, kv_layout=layout,
        mask="custom" if custom else ("causal" if causal else "none"), window_left=window_left,
        soft_cap=soft_cap > 0, pos_encoding=pos, sinks=sinks,
        fp8_scales=scales != (1.0, 1.0, 1.0, 1.0), return_lse=return_lse,
        q_len_per_req=qlen if decode else 1, spec_mask=spec)
    be = backend or TritonBackend()
    reasons = be.reasons(problem)
    assert not reasons, [str(r) for r in reasons]
    plan = be.plan(problem, meta)
    args = RunArgs(q=q, k=k, v=v, out=out, lse=lse, sinks=sinks_t.to(device) if sinks else None,
                   q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=o_scale,
                   spec_mask=spec_mask.to(device) if spec else None)
    be.run(plan, args)
    # non-finite inputs for the second run (rules 1-3): keys left of every row's window, other
    # requests' rows, one element of some query rows
    for b in range(B):
        hidden = kv_lens[b] - qo_lens[b] - window_left if nan_window else 0  # left of row 0's window
        for t in range(kv_lens[b] if b in nan_reqs else max(0, min(hidden, kv_lens[b]))):
            k[kv_slot(b, t)] = float("nan")
            v[kv_slot(b, t)] = float("nan")
    bad = torch.zeros(nnz, hq, dtype=torch.bool)  # rows whose query holds a NaN
    for b, t, h in nan_q:
        q[qo_indptr_h[b] + t, h, (t + h) % d] = float("nan")
        bad[qo_indptr_h[b] + t, h] = True
    # a second run of the same plan (cached launch path) into fresh poisoned buffers: same result
    out2 = torch.full_like(out, float("nan"))
    lse2 = torch.full_like(lse, float("nan")) if lse is not None else None
    be.run(plan, dataclasses.replace(args, out=out2, lse=lse2))
    good = ~bad.to(out.device)
    assert torch.equal(out2[good].isnan(), out[good].isnan())
    assert torch.equal(out2[good].nan_to_num(), out[good].nan_to_num()), "poisoned keys changed the output"
    if lse is not None:
        assert torch.equal(lse2[good].nan_to_num(), lse[good].nan_to_num()), "poisoned keys changed the LSE"
    if not check:
        return plan
    out_c, lse_c = out.cpu(), (lse.cpu() if lse is not None else None)
    dt_ref = dtype
    atol = {torch.float16: 2e-3, torch.bfloat16: 4e-3, torch.float32: 2e-5}[dtype]
    o2, l2 = out2.cpu().double(), (lse2.cpu().double() if lse2 is not None else None)
    for b in range(B):
        r0, r1 = qo_indptr_h[b], qo_indptr_h[b + 1]
        kw = dict(causal=causal or (decode and not spec and qlen > 1),
                  mask=masks[b] if masks is not None else None, window_left=window_left,
                  sm_scale=sm_scale, logits_soft_cap=soft_cap, pos_encoding_mode=pos,
                  sinks=sinks_t, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=o_scale)
        kf, vf = ks[b].double(), vs[b].double()
        go, gl = golden_attention(qs[b], kf, vf, **kw)
        ro, rl = dtype_attention(qs[b], kf, vf, dtype=dt_ref, softmax_dtype=dt_ref, **kw)
        o = out_c[r0:r1].double()
        assert not torch.isnan(o).any(), f"request {b}: NaN in output (unwritten or masked-row NaN)"
        err = (o - go).abs().max().item() if o.numel() else 0.0
        tol = tolerance(ro, go, out_dtype) if o.numel() else 0.0
        assert err <= tol, f"request {b}: out err {err:.3g} > tolerance {tol:.3g}"
        for t, h in bad[r0:r1].nonzero().tolist():  # NaN query rows (rules 3-4), second run
            if torch.isfinite(gl[t, h]):  # sees a key
                assert o2[r0 + t, h].isnan().all(), f"request {b} row {t} head {h}: NaN query, non-NaN out"
                assert l2 is None or l2[r0 + t, h].isnan(), f"request {b} row {t} head {h}: LSE not NaN"
            else:  # sees no key: exactly 0 and -inf, whatever the query holds
                assert (o2[r0 + t, h] == 0).all(), f"request {b} row {t} head {h}: unseen row not 0"
                assert l2 is None or l2[r0 + t, h] == float("-inf"), f"request {b} row {t} head {h}: LSE"
        if lse_c is not None:
            l = lse_c[r0:r1].double()
            assert not torch.isnan(l).any(), f"request {b}: NaN in lse"
            assert torch.equal(torch.isinf(l), torch.isinf(gl)), f"request {b}: -inf pattern of lse"
            fin = torch.isfinite(gl)
            if fin.any():
                lerr = (l[fin] - gl[fin]).abs().max().item()
                lref = (rl[fin] - gl[fin]).abs().max().item()
                assert lerr <= 2 * lref + 10 * atol, f"request {b}: lse err {lerr:.3g} vs {lref:.3g}"
    return plan


# ----------------------------------------------------------------------------- contract tests
def test_capabilities_and_priority():
    be = TritonBackend()
    assert be.name == "triton"
    base = AttentionProblem(op="batch_decode", device_type="cpu", page_size=16)
    assert be.priority(base) < 0  # auto on CPU keeps the reference backend (priority 0)
    cuda = base.replace(device_type="cuda", compute_capability=(9, 0), q_dtype=torch.bfloat16,
                        kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    assert be.priority(cuda) == 50
    dense = cuda.replace(op="single_prefill", page_size=None, mask="causal")
    assert be.priority(dense) == 53  # the Hopper dense kernel, measured above cuda_fa2 (52)
    assert be.priority(dense.replace(compute_capability=(8, 0))) == 50
    assert be.priority(dense.replace(soft_cap=True)) == 50  # the dense kernel does not serve it
    if INTERP:
        assert be.available() == []
        assert be.supports(base)
    bad = [
        base.replace(head_dim_qk=72, head_dim_vo=72),
        base.replace(head_dim_qk=512, head_dim_vo=512),
        base.replace(op="pod"),
        base.replace(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16),
        base.replace(cuda_graph=True),
        base.replace(head_dim_vo=64),
        base.replace(op="xqa_decode", out_dtype=torch.float8_e4m3fn),
        base.replace(device_type="cuda", compute_capability=(7, 5)),
        base.replace(spec_mask=True),
    ]
    for p in bad:
        rs = be.reasons(p)
        assert rs and all(str(r) for r in rs), p.describe()
    cuda_xqa = AttentionProblem(op="xqa_decode", device_type="cuda", compute_capability=(9, 0),
                                q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                                out_dtype=torch.bfloat16, page_size=16, spec_mask=True, sinks=True,
                                q_len_per_req=4)
    assert [r for r in be.reasons(cuda_xqa) if r.axis != "device"] == []
    # fp8 output and fp32 q: implemented, not yet validated on a GPU -> refused there
    assert not be.supports(cuda_xqa.replace(out_dtype=torch.float8_e4m3fn))
    assert not be.supports(cuda_xqa.replace(q_dtype=torch.float32, kv_dtype=torch.float32,
                                            out_dtype=torch.float32))
    assert any(r.axis == "kv_dtype" for r in be.reasons(cuda_xqa.replace(compute_capability=(8, 0))))


def test_plugin_registers():
    from attncore.backends.triton import plugin

    bes = plugin.attncore_backends()
    assert len(bes) == 1 and bes[0].name == "triton"


# ----------------------------------------------------------------------------- CPU (interpreter)
@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_single_prefill(dtype, causal):
    run_case("single_prefill", qo_lens=[37], kv_lens=[53], dtype=dtype, causal=causal, seed=1)


@cpu_only
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_prefill_layout_noncontig(layout):
    run_case("single_prefill", qo_lens=[20], kv_lens=[20], layout=layout, causal=True, noncontig=True,
             hq=6, hkv=2, seed=2)


@cpu_only
@pytest.mark.parametrize("causal,layout,one_loop,branch", [
    (True, "NHD", False, False), (False, "HND", False, False), (True, "HND", True, False),
    (False, "NHD", True, False), (True, "NHD", True, True), (False, "HND", True, True)])
def test_dense_kernel_interpreted(causal, layout, one_loop, branch):
    # the Hopper dense kernel's logic (descriptors, tails, qo > kv, empty KV, sinks, LSE), forced
    # with small tiles and no warp specialization so that the interpreter runs it
    be = TritonBackend(dense=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False,
                                  one_loop=one_loop, branch=branch))
    plan = run_case("batch_prefill_ragged", qo_lens=[40, 5, 0, 33, 16], kv_lens=[30, 70, 7, 33, 0],
                    causal=causal, layout=layout, sinks=True, hq=4, hkv=2, d=64, backend=be, seed=33)
    assert plan.dense and "dense_failed" not in plan.stats, plan.stats


def test_heads_first_rule():
    from attncore.backends.triton.backend import _heads_first
    causal_p1 = [64 * (i + 1) for i in range(64)]  # P1 causal, 64-row tiles
    assert _heads_first(causal_p1, 32, 132)
    assert not _heads_first([2048] * 64, 8, 132)  # equal costs (decode): no tail to fix
    p3 = [32 * (i + 1) for i in range(64)] * 8  # many requests: one SM's share dwarfs the spread
    assert not _heads_first(p3, 8, 132)
    assert not _heads_first([], 8, 132)


@cpu_only
@pytest.mark.parametrize("heads_first", [True, False])
def test_launch_orders(monkeypatch, heads_first):
    # both program orders of both kernels (the plan picks one by _heads_first)
    from attncore.backends.triton import backend as tb
    monkeypatch.setattr(tb, "_heads_first", lambda *a: heads_first)
    plan = run_case("batch_prefill_paged", qo_lens=[7, 40, 3], kv_lens=[19, 50, 3], page_size=4,
                    causal=True, hq=6, hkv=3, seed=5)
    assert plan.heads_first == heads_first
    be = TritonBackend(dense=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False,
                                  one_loop=True, branch=True))
    plan = run_case("batch_prefill_ragged", qo_lens=[40, 5, 33], kv_lens=[30, 70, 33], causal=True,
                    hq=4, hkv=2, d=64, backend=be, seed=6)
    assert plan.dense and plan.stats["heads_first"] == heads_first, plan.stats


@cpu_only
@pytest.mark.parametrize("page_size,layout,causal", [(16, "NHD", True), (1, "HND", True), (5, "NHD", False)])
def test_paged_gather_dense(page_size, layout, causal):
    # paged prefill through the dense kernel: pages copied into contiguous K/V first (shuffled
    # pages, a partial last page, qo > kv, an empty request, sinks, LSE)
    be = TritonBackend(dense=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False,
                                  one_loop=True, branch=True), gather=True)
    plan = run_case("batch_prefill_paged", qo_lens=[40, 5, 0, 20], kv_lens=[37, 3, 7, 33], page_size=page_size,
                    layout=layout, causal=causal, sinks=True, hq=4, hkv=2, d=64, backend=be, seed=35)
    assert plan.dense and plan.gather is not None and "dense_failed" not in plan.stats, plan.stats


def test_gather_decision():
    # auto gathers only where the FLOPs per gathered byte pay for the copy, within the cap
    from types import SimpleNamespace
    from attncore.backends.triton.backend import TritonPlan
    p = AttentionProblem(op="batch_prefill_paged", page_size=16, mask="causal", num_qo_heads=32, num_kv_heads=8)

    def decide(qo, kv, **kw):
        npg = (kv + 15) // 16
        meta = SimpleNamespace(kv_indptr_host=[0, npg])
        plan = TritonPlan(problem=p, meta=meta, device=torch.device("cpu"), nnz_q=qo, mask_mode=1, cfg=None,
                          work=None, num_items=0, qo_indptr=None, kv_indptr=torch.tensor([0, npg]),
                          kv_indices=torch.arange(npg, dtype=torch.int32), kv_lens=None, slopes=None)
        return TritonBackend(**kw)._plan_gather(plan, [qo], [kv], True), plan

    ok, plan = decide(2048, 2048)  # P3-like: ~4000 FLOPs per byte
    assert ok and plan.gather["k"].shape == (128, 16, 8, 128) and plan.stats["gather_mb"] == 8.0
    assert not decide(64, 8192)[0]  # append-like: too few FLOPs per byte
    assert not decide(2048, 2048, gather_cap_mb=4)[0]  # over the cap
    assert not decide(2048, 2048, gather=False)[0]
    assert decide(64, 8192, gather=True)[0]


def test_gather_cap_from_environment(monkeypatch):
    monkeypatch.setenv("ATTNCORE_TRITON_GATHER_MB", "0")
    assert TritonBackend()._gather_cap == 0
    monkeypatch.setenv("ATTNCORE_TRITON_GATHER_MB", "lots")
    r = TritonBackend().available()  # unavailable with the reason, not dropped from the registry
    assert len(r) == 1 and "ATTNCORE_TRITON_GATHER_MB" in str(r[0]) and "'lots'" in str(r[0])
    monkeypatch.delenv("ATTNCORE_TRITON_GATHER_MB")
    assert TritonBackend()._gather_cap == 512 << 20


@cpu_only
def test_batch_prefill_ragged_edges():
    # kv 0, qo > kv (rows that see nothing under causal), 1 token, longer
    run_case("batch_prefill_ragged", qo_lens=[5, 9, 1, 30, 0], kv_lens=[0, 4, 1, 70, 3], causal=True,
             hq=8, hkv=2, seed=3)


@cpu_only
@pytest.mark.parametrize("page_size,layout", [(1, "NHD"), (16, "HND"), (5, "NHD")])
def test_batch_prefill_paged(page_size, layout):
    # kv 32 with page 16: last page full
    run_case("batch_prefill_paged", qo_lens=[7, 16, 3], kv_lens=[19, 32, 3], page_size=page_size,
             layout=layout, causal=True, hq=4, hkv=1, seed=4)


@cpu_only
@pytest.mark.parametrize("kv_views,mode", [("same", 2), ("split", 1), ("padded", 0)])
def test_paged_row_addressing(kv_views, mode):
    """_kv_rows' three ways to address paged rows (token-row units shared by K and V, per tensor,
    element strides) give the same attention."""
    from attncore.backends.triton.kernels.attention import _kv_addr

    shape = (9, 5, 2, 32)
    ks = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3])
    vs = (ks[0] + 128, ks[1], ks[2]) if mode == 1 else ks
    if mode == 0:
        ks = vs = (ks[0] + 8, ks[1], ks[2])
    t = torch.empty(shape)
    assert _kv_addr(t, t, 5, ks, vs) == mode
    run_case("batch_prefill_paged", qo_lens=[7, 3], kv_lens=[19, 11], page_size=5, causal=True, hq=4, hkv=2,
             seed=5, kv_views=kv_views)


@cpu_only
def test_custom_mask_and_window():
    run_case("batch_prefill_paged", qo_lens=[9, 12], kv_lens=[21, 40], page_size=4, custom=True,
             window_left=10, seed=5)


@cpu_only
@pytest.mark.parametrize("window", [0, 7])
def test_window_causal(window):
    run_case("batch_prefill_ragged", qo_lens=[40, 6], kv_lens=[70, 6], causal=True, window_left=window,
             seed=6)


@cpu_only
def test_softcap_alibi_sinks():
    run_case("batch_prefill_ragged", qo_lens=[10, 17], kv_lens=[30, 17], causal=True, soft_cap=5.0,
             pos="ALIBI", sinks=True, hq=6, hkv=3, seed=7)


@cpu_only
@pytest.mark.parametrize("d", [32, 48])
def test_rope(d):
    run_case("batch_prefill_paged", qo_lens=[6, 11], kv_lens=[25, 11], page_size=8, causal=True,
             pos="ROPE_LLAMA", d=d, seed=8)


@cpu_only
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_scales(kv_dtype):
    run_case("batch_decode", qo_lens=[1] * 3, kv_lens=[40, 1, 17], page_size=8, kv_dtype=kv_dtype,
             scales=(1.0, 0.5, 0.25, 2.0), hq=8, hkv=2, seed=9)


@cpu_only
def test_decode_split_kv_gqa():
    be = TritonBackend(kv_chunk=32)
    plan = run_case("batch_decode", qo_lens=[1] * 4, kv_lens=[100, 0, 1, 64], page_size=16, hq=12,
                    hkv=2, sinks=True, backend=be, seed=10)
    assert plan.max_splits == 4 and plan.num_merge_rows > 0


@cpu_only
def test_split_hints_from_meta():
    # BatchMeta.fixed_split_size (pages per split) and disable_split_kv are honoured
    be = TritonBackend()
    p = run_case("batch_decode", qo_lens=[1] * 2, kv_lens=[70, 20], page_size=4, hq=4, hkv=2,
                 backend=be, seed=18, check=False)
    meta = dataclasses.replace(p.meta, fixed_split_size=4)
    # 4 pages x 4 = 16 keys, rounded up to whole KV tiles (block_n 32 here): 70 keys -> 3 splits
    assert be.plan(p.problem, meta).max_splits == 3
    meta = dataclasses.replace(p.meta, disable_split_kv=True)
    assert be.plan(p.problem, meta).max_splits == 1


@cpu_only
def test_decode_qlen_gt1_split():
    # q_len_per_req 3: causal within the draft; split partitions on top
    run_case("batch_decode", qo_lens=[3] * 3, kv_lens=[50, 3, 20], page_size=4, hq=4, hkv=1,
             backend=TritonBackend(kv_chunk=32), window_left=20, seed=11)


@cpu_only
def test_decode_fully_masked_window0_alibi():
    run_case("batch_decode", qo_lens=[1] * 2, kv_lens=[33, 7], page_size=1, window_left=0,
             pos="ALIBI", soft_cap=3.0, seed=12)


@cpu_only
def test_xqa_spec_sinks():
    # planned for max_seq_len without reading seq_lens back (no sync): splits past a request's end
    # merge as empty
    be = TritonBackend(kv_chunk=32)
    plan = run_case("xqa_decode", qo_lens=[4] * 3, kv_lens=[70, 4, 33], page_size=16, hq=8, hkv=2,
                    sinks=True, spec=True, sm_scale=0.3, scales=(1.0, 1.0, 0.7, 1.0), backend=be, seed=13)
    assert plan.meta.kv_lens_host is None and plan.max_splits == 3


@cpu_only
def test_xqa_plain_fp8():
    run_case("xqa_decode", qo_lens=[1] * 3, kv_lens=[25, 9, 1], page_size=8, hq=4, hkv=4,
             kv_dtype=torch.float8_e4m3fn, sm_scale=0.2, scales=(1.0, 1.0, 1.3, 1.0), window_left=8,
             seed=14)


@cpu_only
@pytest.mark.parametrize("causal,window,custom", [(True, 9, False), (False, 20, False), (False, -1, True)])
def test_small_tiles_three_ranges(causal, window, custom):
    # block 16 x 16: many KV tiles, so the masked-head / body / masked-tail loops all run
    be = TritonBackend(config=dict(block_m=16, block_n=16, num_warps=1, num_stages=1,
                                   prefetch=causal))
    run_case("batch_prefill_paged", qo_lens=[40, 3, 25], kv_lens=[90, 50, 25], page_size=3,
             causal=causal, window_left=window, custom=custom, hq=4, hkv=2, backend=be, seed=16)


@cpu_only
def test_large_group():
    run_case("batch_decode", qo_lens=[2] * 2, kv_lens=[40, 9], page_size=16, hq=48, hkv=1,
             backend=TritonBackend(config=dict(block_m=16, block_n=16, num_warps=1, num_stages=1,
                                               prefetch=True)), seed=17)


@cpu_only
def test_head_dim_64_no_lse():
    run_case("single_prefill", qo_lens=[17], kv_lens=[33], d=64, return_lse=False, causal=True, seed=15)


@cpu_only
def test_run_rejects_other_dtype():
    plan = run_case("single_prefill", qo_lens=[4], kv_lens=[4], check=False)
    be = TritonBackend()
    q = torch.randn(4, 4, 32, dtype=torch.float32)
    with pytest.raises(TypeError):
        be.run(plan, RunArgs(q=q, k=q[:, :2], v=q[:, :2], out=torch.empty_like(q)))
    # after runs that cached a launch, other shapes still get checked (the cache key covers them)
    q = torch.randn(4, 4, 32, dtype=torch.float16)
    good = RunArgs(q=q, k=q[:, :2], v=q[:, :2], out=torch.empty_like(q), lse=torch.empty(4, 4))
    be.run(plan, good)
    be.run(plan, good)
    with pytest.raises(ValueError, match="planned"):
        be.run(plan, dataclasses.replace(good, out=torch.empty(4, 4, 16, dtype=torch.float16)))
    with pytest.raises(ValueError, match="lse must be float32"):
        be.run(plan, dataclasses.replace(good, lse=torch.empty(4, 3)))


# ----------------------------------------------------------------------------- issue 13
# GQA groups that do not divide the tile: packed row p is token p // G, so a tile's last token is
# (end - 1) // G; the kernel took end // G - 1 (one short when G does not divide end) and cut the
# causal / window KV range of the tile's last token (groups 3, 5, 7: wrong output, no error).
ODD_GROUPS = [3, 5, 6, 7, 12]
TILES16 = dict(block_m=16, block_n=16, num_warps=1, num_stages=1, prefetch=True)
DENSE16 = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False, one_loop=True,
               branch=True)


def _tiles(qo, kv, G, bm, bn, causal, window, old=False):
    """The KV tiles (start, masked) each row tile of a request visits: a Python mirror of
    _attn_fwd's range code ("KV range of this item"); ``old``: with the last-token slip."""
    tdiv = lambda a, b: a // b if a >= 0 else -(-a // b)  # noqa: E731  (Triton truncates)
    out = []
    for row0 in range(0, qo * G, bm):
        end = min(row0 + bm, qo * G)
        q_first = row0 // G
        q_last = max(end // G - 1 if old else (end - 1) // G, q_first)
        off = kv - qo
        lo, hi, f_lo = 0, kv, 0
        f_hi = kv // bn * bn
        if causal:
            hi = min(hi, q_last + off + 1)
            f_hi = min(f_hi, tdiv(q_first + off + 1, bn) * bn)
        if window >= 0:
            lo = max(lo, max(q_first + off - window, 0) // bn * bn)
            f_lo = max(lo, (max(q_last + off - window, 0) + bn - 1) // bn * bn)
        hi = max(hi, lo)
        f_lo = min(max(f_lo, lo), (hi + bn - 1) // bn * bn)
        f_hi = max(f_hi, f_lo)
        out.append([(a, m) for a, b, m in ((lo, f_lo, 1), (f_lo, f_hi, 0), (f_hi, hi, 1))
                    for a in range(a, b, bn)])
    return out


def _slips(qo, kv, G, bm, bn, causal=True, window=-1):
    """Whether the old last-token formula planned other KV tiles for this request (a tile cut off
    under causal, or a tile run unmasked past the last row's window)."""
    return _tiles(qo, kv, G, bm, bn, causal, window) != _tiles(qo, kv, G, bm, bn, causal, window, old=True)


def _slip_request(G, bm, bn, longer_kv, causal=True, window=-1):
    """A (qo, kv) request, kv > qo or kv < qo, that the slip got wrong (most shapes do not)."""
    for qo in range(2, 64):
        for kv in (range(qo + 1, qo + 2 * bn + 1) if longer_kv else range(1, qo)):
            if _slips(qo, kv, G, bm, bn, causal, window):
                return qo, kv
    raise AssertionError("no shape")


@cpu_only
def test_issue13_repro_public_api():
    import attncore
    from attncore.testing.golden import max_error
    g = torch.Generator().manual_seed(13)
    q, k, v = torch.randn(21, 7, 16, generator=g), torch.randn(76, 1, 16, generator=g), torch.randn(76, 1, 16, generator=g)
    out = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="triton")
    go, _ = golden_attention(q, k, v, causal=True)
    ro, _ = dtype_attention(q, k, v, dtype=torch.float32, causal=True)
    assert max_error(out, go) <= tolerance(ro, go, torch.float32)


@cpu_only
@pytest.mark.parametrize("group", ODD_GROUPS)
@pytest.mark.parametrize("longer_kv", [True, False])
@pytest.mark.parametrize("op,layout,page_size", [
    ("single_prefill", "NHD", None), ("batch_prefill_ragged", "NHD", None),
    ("batch_prefill_ragged", "HND", None), ("batch_prefill_paged", "NHD", 5),
    ("batch_prefill_paged", "HND", 16)])
def test_odd_groups_causal(group, longer_kv, op, layout, page_size):
    # the interpreter's config: 64-row x 32-key tiles once a request has 64+ packed rows.  Lengths
    # at multiples of 16 / 32 / 64 and one off, qo < kv or qo > kv (top rows see no key), plus a
    # request the slip got wrong (a row tile's last token needs one more KV tile, or key 0)
    hkv = 1 if group >= 7 else 2
    slip = _slip_request(group, 64, 32, longer_kv)
    if op == "single_prefill":
        qo_lens, kv_lens = [slip[0]], [slip[1]]
    elif longer_kv:
        qo_lens, kv_lens = [16, 33, 1, slip[0]], [31, 65, 128, slip[1]]
    else:
        qo_lens, kv_lens = [17, 64, 5, slip[0]], [16, 63, 0, slip[1]]
    plan = run_case(op, qo_lens=qo_lens, kv_lens=kv_lens, page_size=page_size, layout=layout, causal=True,
                    hq=group * hkv, hkv=hkv, d=16, seed=group * 7 + len(qo_lens))
    assert (plan.cfg.block_m, plan.cfg.block_n) == (64, 32), plan.cfg  # what _slip_request assumed


@cpu_only
@pytest.mark.parametrize("group", ODD_GROUPS)
@pytest.mark.parametrize("causal,window", [(True, -1), (True, 20), (False, 6)])
def test_odd_groups_small_tiles(group, causal, window):
    # 16 x 16 tiles: a group straddles most tile ends.  With a window the unmasked range starts at
    # the last token's window bound, so the slip ran a tile unmasked that the last row sees part of
    qo_lens, kv_lens = [17, 32, 3, 9], [48, 32, 64, 4]
    for longer in (True, False):
        qo, kv = _slip_request(group, 16, 16, longer, causal, window)
        qo_lens, kv_lens = qo_lens + [qo], kv_lens + [kv]
    run_case("batch_prefill_paged", qo_lens=qo_lens, kv_lens=kv_lens, page_size=16, causal=causal,
             window_left=window, hq=group, hkv=1, d=16, backend=TritonBackend(config=TILES16), seed=group)


@cpu_only
@pytest.mark.parametrize("group", [3, 5, 7, 12])
def test_odd_groups_decode_split(group):
    # q_len 3 decode (causal within the draft) on 16-row tiles, split KV and the merge.  Groups 7
    # and 12 pack 21 / 36 rows: row tiles end inside a group, and kv 65 (kv 17 for 12) was hit
    be = TritonBackend(config=TILES16, kv_chunk=32)
    kv_lens = [65, 3, 127, 17]
    plan = run_case("batch_decode", qo_lens=[3] * 4, kv_lens=kv_lens, page_size=16, hq=group * 2, hkv=2,
                    backend=be, sinks=True, seed=group)
    assert plan.max_splits > 1
    assert (group * 3 <= 16) or any(_slips(3, kv, group, 16, 16) for kv in kv_lens)


@cpu_only
@pytest.mark.parametrize("group", [3, 7, 12])
@pytest.mark.parametrize("qo_lens,kv_lens", [([15, 17, 33], [64, 16, 31]), ([32, 1], [31, 33])])
def test_odd_groups_dense_kernel(group, qo_lens, kv_lens):
    # the Hopper dense kernel (one program per query head, no packing) with the same shapes
    be = TritonBackend(dense=DENSE16)
    plan = run_case("batch_prefill_ragged", qo_lens=qo_lens, kv_lens=kv_lens, causal=True, hq=group,
                    hkv=1, d=64, backend=be, seed=group)
    assert plan.dense and "dense_failed" not in plan.stats, plan.stats


# Non-finite inputs (docs/semantics.md): every run_case poisons K/V slots past kv_len, spare
# pages and view padding with NaN (rule 1); these add keys left of the window (rule 2), query rows
# with a NaN (rules 3-4) and NaN rows of other requests.  The interpreter warns on NaN math.
nan_ok = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning",
                                    "ignore:invalid value encountered:RuntimeWarning")


@cpu_only
@nan_ok
@pytest.mark.parametrize("op,kw", [
    ("batch_prefill_paged", dict(page_size=16, causal=True, backend=TritonBackend(config=TILES16))),
    ("batch_prefill_paged", dict(page_size=7, causal=False)),
    ("batch_prefill_ragged", dict(causal=True, layout="HND", noncontig=True)),
    ("batch_prefill_ragged", dict(causal=False, backend=TritonBackend(config=TILES16))),
])
@pytest.mark.parametrize("window", [2, 19])
def test_nan_left_of_window_prefill(op, kw, window):
    # request 0 (kv 90, qo 5): window 2 hides whole 16- and 32-key tiles (never visited) and part of
    # the first tile visited; 19 only keys 0-65, so part of the tile at 64
    run_case(op, qo_lens=[5, 20, 0, 3], kv_lens=[90, 40, 12, 3], window_left=window, hq=6, hkv=2,
             nan_window=True, seed=window, **kw)


@cpu_only
@nan_ok
@pytest.mark.parametrize("kv_chunk", [None, 32])
@pytest.mark.parametrize("qlen,window", [(1, 0), (1, 9), (4, 5)])
def test_nan_left_of_window_decode(kv_chunk, qlen, window):
    # split partitions wholly left of the window merge as empty; the NaN never reaches P.V
    be = TritonBackend(kv_chunk=kv_chunk) if kv_chunk else TritonBackend()
    run_case("batch_decode", qo_lens=[qlen] * 3, kv_lens=[100, 33, qlen], page_size=8, hq=6, hkv=2,
             window_left=window, nan_window=True, sinks=True, backend=be, seed=qlen + window)
    run_case("xqa_decode", qo_lens=[qlen] * 2, kv_lens=[70, 9], page_size=16, hq=4, hkv=1,
             window_left=window, nan_window=True, backend=be, seed=3)


@cpu_only
@nan_ok
@pytest.mark.parametrize("op,kw,dense", [
    ("batch_prefill_paged", dict(page_size=16), False),  # unused slots of the last pages, spare pages
    ("batch_prefill_paged", dict(page_size=16, backend=TritonBackend(config=TILES16), layout="HND"), False),
    # the gather copies whole pages (NaN slots too): the dense kernel must read none past kv_len
    ("batch_prefill_paged", dict(page_size=16, d=64, backend=TritonBackend(dense=DENSE16, gather=True)), True),
    ("batch_prefill_ragged", dict(noncontig=True), False),  # request 1's rows NaN, view padding NaN
    ("batch_prefill_ragged", dict(d=64, backend=TritonBackend(dense=DENSE16)), True),  # TMA tiles past kv_len
])
def test_nan_outside_kv_range_prefill(op, kw, dense):
    # request 1 has no query rows and NaN K/V: "other requests' rows" right after request 0's
    plan = run_case(op, qo_lens=[17, 0, 33, 5], kv_lens=[33, 31, 48, 1], causal=True, hq=6, hkv=2,
                    nan_reqs=[1], seed=21, **kw)
    assert bool(plan.dense) == dense and "dense_failed" not in plan.stats, plan.stats


@cpu_only
@nan_ok
@pytest.mark.parametrize("op,kw", [
    ("batch_decode", dict(page_size=16, backend=TritonBackend(kv_chunk=32))),
    ("batch_decode", dict(page_size=3)),
    ("xqa_decode", dict(page_size=16, backend=TritonBackend(kv_chunk=32))),
])
def test_nan_outside_kv_range_decode(op, kw):
    # last pages 1/16 and 15/16 used (NaN in the rest), spare pages NaN, a split past a short request
    run_case(op, qo_lens=[1] * 4, kv_lens=[33, 1, 47, 64], hq=8, hkv=2, sinks=True, seed=22, **kw)


@cpu_only
@nan_ok
@pytest.mark.parametrize("op,kw", [
    ("batch_prefill_ragged", dict(causal=True)),
    ("batch_prefill_ragged", dict(causal=True, backend=TritonBackend(config=TILES16), sinks=True)),
    ("batch_prefill_ragged", dict(causal=True, d=64, sinks=True, backend=TritonBackend(dense=DENSE16))),
    ("batch_prefill_paged", dict(page_size=4, window_left=3, causal=True, pos="ROPE_LLAMA")),
    ("batch_prefill_paged", dict(page_size=4, custom=True, soft_cap=4.0, pos="ALIBI")),
])
def test_nan_query_row_prefill(op, kw):
    # request 0: qo > kv, so rows 0-4 see no key (causal): a NaN there gives 0 / -inf; row 9 sees
    # keys: NaN out and LSE, and only there (other heads of the token, other tokens exact).
    # Custom mask: request 0 row 0 is fully masked.  Request 2: kv 0.
    nan_q = [(0, 0, 1), (0, 9, 2), (0, 15, 5), (1, 0, 0), (1, 20, 3), (2, 1, 4)]
    run_case(op, qo_lens=[16, 21, 2], kv_lens=[11, 40, 0], hq=6, hkv=2, nan_q=nan_q, seed=23, **kw)


@cpu_only
@nan_ok
@pytest.mark.parametrize("kv_chunk", [None, 16])
@pytest.mark.parametrize("sinks", [False, True])
def test_nan_query_row_decode(kv_chunk, sinks):
    # split: every partial of the NaN row is NaN (or -inf where the window hides the split);
    # the merge must keep NaN, and give 0 / -inf to a row that saw nothing (request 2: kv 0)
    be = TritonBackend(kv_chunk=kv_chunk) if kv_chunk else TritonBackend()
    nan_q = [(0, 0, 1), (1, 0, 0), (1, 0, 5), (2, 0, 2)]
    run_case("batch_decode", qo_lens=[1] * 3, kv_lens=[70, 40, 0], page_size=8, hq=6, hkv=2,
             window_left=20, sinks=sinks, nan_q=nan_q, backend=be, seed=24)
    run_case("xqa_decode", qo_lens=[2] * 2, kv_lens=[50, 2], page_size=16, hq=6, hkv=3, sinks=sinks,
             spec=True, nan_q=[(0, 1, 4), (1, 0, 0)], backend=be, seed=25)


# ----------------------------------------------------------------------------- GPU
GPU_DTYPES = [torch.bfloat16, torch.float16]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_single_prefill(dtype, causal, d):
    run_case("single_prefill", qo_lens=[300], kv_lens=[517], hq=8, hkv=2, d=d, dtype=dtype,
             causal=causal, device="cuda", seed=d)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal,layout,noncontig", [(True, "NHD", False), (False, "HND", True),
                                                     (True, "HND", True), (False, "NHD", False)])
def test_gpu_dense_prefill(dtype, causal, layout, noncontig):
    # the Hopper dense kernel (TMA + warp specialization): ragged tails, qo > kv under causal,
    # an empty KV, GQA, sinks and LSE; elsewhere the same case runs the generic kernel
    d = 128 if causal else 64
    be = TritonBackend(kv_chunk=0)  # no split-KV: this small batch would be split (generic kernel)
    plan = run_case("batch_prefill_ragged", qo_lens=[200, 5, 0, 129, 64], kv_lens=[150, 300, 7, 129, 0],
                    causal=causal, layout=layout, noncontig=noncontig, sinks=True, hq=8, hkv=2, d=d,
                    dtype=dtype, device="cuda", seed=31, backend=be)
    if torch.cuda.get_device_capability()[0] == 9:
        assert plan.dense and "dense_skipped" not in plan.stats, plan.stats
    else:
        assert not plan.dense


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_dense_configs(causal):
    # every default dense config, each forced: exact where it compiles
    from attncore.backends.triton import config as tcfg
    p = AttentionProblem(op="batch_prefill_ragged", mask="causal" if causal else "none")
    for c in tcfg.dense_candidates(p, causal):
        be = TritonBackend(dense=c.as_dict(), kv_chunk=0)
        plan = run_case("batch_prefill_ragged", qo_lens=[300, 70], kv_lens=[517, 70], causal=causal, hq=8,
                        hkv=2, d=128, dtype=torch.bfloat16, device="cuda", seed=32, backend=be)
        assert plan.dense and "dense_failed" not in plan.stats, plan.stats


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_dense_repeatable(causal):
    # the warp-specialized default must be race-free: eager runs and a CUDA-graph replay give the
    # same bits, LSE included (ragged tails, qo > kv, sinks)
    qo, kv = [300, 70, 1, 129, 40], [517, 70, 5, 129, 20]
    dev = torch.device("cuda")
    i32 = dict(device=dev, dtype=torch.int32)
    qi, ki = [0], [0]
    for a, b in zip(qo, kv):
        qi.append(qi[-1] + a)
        ki.append(ki[-1] + b)
    g = torch.Generator(device=dev).manual_seed(34)
    q = torch.randn(qi[-1], 8, 128, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(ki[-1], 2, 128, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(ki[-1], 2, 128, device=dev, generator=g).to(torch.bfloat16)
    meta = BatchMeta(batch_size=len(qo), qo_indptr=torch.tensor(qi, **i32), qo_indptr_host=qi,
                     kv_indptr=torch.tensor(ki, **i32), kv_indptr_host=ki, kv_lens=torch.tensor(kv, **i32),
                     kv_lens_host=kv, params=AttnParams(sm_scale=128 ** -0.5, causal=causal), device=dev)
    p = AttentionProblem(op="batch_prefill_ragged", device_type="cuda",
                         compute_capability=torch.cuda.get_device_capability(), q_dtype=torch.bfloat16,
                         kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_qo_heads=8, num_kv_heads=2,
                         mask="causal" if causal else "none", sinks=True, return_lse=True)
    args = RunArgs(q=q, k=k, v=v, out=torch.empty_like(q), lse=torch.empty(qi[-1], 8, device=dev),
                   sinks=torch.randn(8, device=dev, generator=g))
    be = TritonBackend(kv_chunk=0)
    plan = be.plan(p, meta)
    be.run(plan, args)
    torch.cuda.synchronize()
    first = (args.out.clone(), args.lse.clone())
    for _ in range(30):
        args.out.fill_(float("nan"))
        args.lse.fill_(float("nan"))
        be.run(plan, args)
        torch.cuda.synchronize()
        assert torch.equal(args.out, first[0]) and torch.equal(args.lse, first[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.run(plan, args)
    for _ in range(10):
        args.out.fill_(float("nan"))
        args.lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(args.out, first[0]) and torch.equal(args.lse, first[1])
    if torch.cuda.get_device_capability()[0] == 9:  # the default config ran (not a fallback)
        from attncore.backends.triton import config as tcfg
        assert plan.stats["dense"] == tcfg.dense_candidates(p, causal)[0].as_dict(), plan.stats


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("page_size,layout", [(1, "NHD"), (16, "NHD"), (16, "HND")])
def test_gpu_batch_prefill_paged(dtype, page_size, layout):
    run_case("batch_prefill_paged", qo_lens=[100, 1, 0, 64, 200], kv_lens=[300, 1, 5, 64, 150],
             page_size=page_size, layout=layout, causal=True, hq=8, hkv=2, d=128, dtype=dtype,
             device="cuda", seed=21)


@gpu
@needs_cuda
def test_gpu_relaunch_fast_path():
    # relaunches of a plan skip Triton's argument binding (kernels/launch.py); a Triton whose
    # compiled-kernel interface changed would silently fall back to the slow path: caught here
    plan = run_case("batch_decode", qo_lens=[1] * 3, kv_lens=[100, 7, 300], page_size=16, hq=8, hkv=2, d=128,
                    dtype=torch.bfloat16, device="cuda", seed=37)
    (fwd, _), = plan.launch_cache.values()
    assert fwd.launcher.fast_calls >= 1  # run_case's second run (same strides, new buffers)


@gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_paged_gather(layout):
    # paged prefill through the gather + the default dense config (warp-specialized on sm_90)
    plan = run_case("batch_prefill_paged", qo_lens=[300, 70, 0, 129], kv_lens=[517, 70, 9, 100], page_size=16,
                    layout=layout, causal=True, sinks=True, hq=8, hkv=2, d=128, dtype=torch.bfloat16,
                    device="cuda", seed=36, backend=TritonBackend(gather=True, kv_chunk=0))
    if torch.cuda.get_device_capability()[0] == 9:
        assert plan.dense and plan.gather is not None and "dense_failed" not in plan.stats, plan.stats


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_features(dtype):
    run_case("batch_prefill_ragged", qo_lens=[70, 130], kv_lens=[200, 130], causal=True, soft_cap=30.0,
             pos="ALIBI", sinks=True, window_left=64, hq=8, hkv=4, d=128, dtype=dtype, device="cuda",
             noncontig=True, seed=22)
    run_case("batch_prefill_paged", qo_lens=[33, 80], kv_lens=[90, 200], custom=True, page_size=16,
             hq=4, hkv=4, d=64, dtype=dtype, device="cuda", seed=23)
    run_case("batch_prefill_paged", qo_lens=[33, 80], kv_lens=[90, 200], causal=True, page_size=16,
             pos="ROPE_LLAMA", hq=8, hkv=2, d=128, dtype=dtype, device="cuda", seed=24)


@gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_decode(dtype, kv_dtype):
    kv = [1000, 1, 0, 4096, 77]
    run_case("batch_decode", qo_lens=[1] * 5, kv_lens=kv, page_size=16, hq=32, hkv=8, d=128,
             dtype=dtype, kv_dtype=kv_dtype, scales=(1.0, 0.5, 0.25, 1.0), device="cuda", seed=25)
    run_case("batch_decode", qo_lens=[2] * 5, kv_lens=[k + 2 for k in kv], page_size=1, hq=32, hkv=8,
             d=128, dtype=dtype, kv_dtype=kv_dtype, device="cuda", sinks=True, seed=26)


@gpu
@needs_cuda
@pytest.mark.parametrize("qlen", [1, 2, 4])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_gpu_xqa(qlen, kv_dtype):
    run_case("xqa_decode", qo_lens=[qlen] * 6, kv_lens=[3000, qlen, 600, 40, 8192, 17], page_size=16,
             hq=64, hkv=8, d=128, dtype=torch.bfloat16, kv_dtype=kv_dtype, sinks=True, spec=qlen > 1,
             sm_scale=0.088, scales=(1.0, 1.0, 0.8, 1.0), window_left=1000 if qlen == 2 else -1,
             device="cuda", seed=27)


def test_fast_launcher_relaunches_compiled_kernel(monkeypatch):
    # the relaunch path hands the arguments (constexprs appended in parameter order) to the compiled
    # kernel's launcher; a tensor with other alignment goes back through Triton
    from attncore.backends.triton.kernels import launch
    from attncore.backends.triton.kernels.launch import FastLauncher

    monkeypatch.setattr(launch, "_current_stream", lambda: 0)

    calls = []

    class Kernel:
        function, packed_metadata = "fn", "meta"

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *a):
            calls.append(("fast", a))

    class Fn:
        arg_names = ["X", "n", "BLOCK"]

        def __getitem__(self, grid):
            def plain(*args, **kw):
                calls.append(("plain", args, kw))
                return Kernel()
            return plain

    fl = FastLauncher(Fn(), (4,), dict(BLOCK=32, num_warps=4))
    x = torch.empty(64, dtype=torch.float16)
    fl(x, 7)
    assert calls[-1] == ("plain", (x, 7), dict(BLOCK=32, num_warps=4)) and fl.fast_calls == 0
    fl(x, 7)
    kind, a = calls[-1]
    assert kind == "fast" and a[:4] == (4, 1, 1, 0) and a[-3:] == (x, 7, 32) and fl.fast_calls == 1
    fl(x[1:], 7)  # 2-byte offset: not 16-byte aligned
    assert calls[-1][0] == "plain" and fl.fast_calls == 1


def test_unavailable_hint_names_the_missing_module(monkeypatch):
    """Triton's interpreter imports numpy: without it the hint must say numpy, not triton."""
    import builtins
    import sys

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "triton":
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
        return real(name, *a, **k)

    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake)
    reasons = TritonBackend().available()
    assert [r.hint for r in reasons] == ["pip install numpy"], reasons
    assert "No module named 'numpy'" in str(reasons[0])
