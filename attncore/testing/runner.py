"""Running conformance cases: build inputs, drive a backend through plan()/run(), check the result.

The suite talks to backends directly through the ``Backend`` contract (``BatchMeta`` +
``RunArgs``), never through the public API, so a plugin can be checked on its own.

Checks of every computed case:

* outputs (and LSE) are poisoned with NaN before ``run()``, inside a buffer with one guard row on
  each side: an unwritten element, or a write outside ``out``, fails;
* inputs (q, k, v, index tensors, mask, sinks) must be bit-identical after ``run()``;
* tolerance rule (``docs/writing-a-backend.md``): per request, ``max|out - golden|`` must be at
  most ``2 x`` the error of the same torch math done in the backend's dtype (fp64 golden,
  :func:`dtype_attention`), plus one rounding unit of the output dtype; the same for the base-2
  LSE (atol 1e-3 relative to its magnitude);
* rows that see no key: output exactly 0 and LSE exactly ``-inf``.
"""

from __future__ import annotations

import math
import random
from typing import List, Optional, Sequence

import torch

from attncore.core.backend import BatchMeta
from attncore.core.capabilities import Reason
from attncore.core.problem import (DECODE_OPS, PAGED_OPS, POD_OPS, AttentionProblem, PODBatch, PODDeclined, PODRunArgs,
                                   pod_parts)
from attncore.testing.golden import TOL_FACTOR, tolerance_terms
from attncore.testing.inputs import Built, _bits, build, case_shapes, check_inputs_unchanged, expected, snapshot

LN2 = math.log(2.0)


def check_result(b: Built, exp, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                 *, out_buf: Optional[torch.Tensor] = None, lse_buf: Optional[torch.Tensor] = None,
                 atol_scale: float = 1.0, what: str = "") -> List[str]:
    """Failure messages (empty: pass)."""
    p = b.problem
    errs: List[str] = []
    out_buf = b.out_buf if out_buf is None else out_buf
    lse_buf = b.lse_buf if lse_buf is None else lse_buf
    out = out_buf[1:-1] if out is None else out
    o_all = out.detach().cpu().double()
    if out_buf is not None and out_buf.shape[0] >= 2:
        g = out_buf.detach().cpu().double()
        if not (torch.isnan(g[0]).all() and torch.isnan(g[-1]).all()):
            errs.append("run() wrote outside `out` (the guard rows around it were overwritten)")
    l_all = None
    if p.return_lse:
        lse = lse_buf[1:-1] if lse is None else lse
        l_all = lse.detach().cpu().double()
        guards_ok = lse_buf is None or lse_buf.shape[0] < 2 or bool(
            torch.isnan(lse_buf[0]).all() and torch.isnan(lse_buf[-1]).all())
        if not guards_ok:
            errs.append("run() wrote outside `lse` (the guard rows around it were overwritten)")
    gold_nan = torch.cat([go for go, _, _, _ in exp]).isnan() if exp else torch.zeros_like(o_all, dtype=torch.bool)
    nan = torch.isnan(o_all) & ~gold_nan
    if nan.any():
        rows = torch.nonzero(nan.any(dim=2).any(dim=1)).flatten().tolist()
        errs.append(f"{int(nan.sum())} elements of out are NaN (left unwritten, or computed NaN), rows {rows[:12]}")
    row0 = 0
    for i, ((go, gl, bo, bl), qo, kv) in enumerate(zip(exp, b.qo_lens, b.kv_lens)):
        o = o_all[row0:row0 + qo]
        where = f"{what}request {i} (qo_len={qo}, kv_len={kv}, rows {row0}..{row0 + qo - 1})"
        # Rows whose query holds NaN and that see a key must give NaN out and LSE (semantics rule 3);
        # they are left out of the error measure.
        nan_rows = torch.isnan(gl)  # [qo, Hq]
        if nan_rows.any() and not torch.isnan(o[nan_rows]).all():
            errs.append(f"{where}: a row whose query holds NaN and that sees keys must give NaN output, "
                        f"got finite values in {int((~torch.isnan(o[nan_rows])).any(-1).sum())} of "
                        f"{int(nan_rows.sum())} such (row, head) pairs")
        unseen = torch.isneginf(gl)  # [qo, Hq]: rows that see no key
        if qo and unseen.any():
            z = o[unseen]
            if z.numel() and not torch.nan_to_num(z, nan=1.0).eq(0).all():
                errs.append(f"{where}: rows that see no key must give exactly 0, got max |out| = "
                            f"{float(torch.nan_to_num(z, nan=float('inf')).abs().max()):.3g}")
        ok_rows = ~nan_rows
        if qo and ok_rows.any() and not torch.isnan(o[ok_rows]).any():
            oc, gc, bc = o[ok_rows], go[ok_rows], bo[ok_rows]  # [n, Dv]
            err = float((oc - gc).abs().max()) if oc.numel() else 0.0
            berr, atol = tolerance_terms(bc, gc, p.out_dtype, atol_scale=atol_scale)  # the rule: golden.tolerance
            if not err <= TOL_FACTOR * berr + atol:
                diff = (o - go).abs().masked_fill(nan_rows[..., None], 0.0)
                idx = torch.nonzero(diff == err)[0].tolist()
                errs.append(f"{where}: max |out - golden| = {err:.3g} at [row {idx[0]}, head {idx[1]}, dim {idx[2]}] "
                            f"> {TOL_FACTOR:g} x {berr:.3g} (error of the same torch math in "
                            f"{str(p.q_dtype).replace('torch.', '')}) + atol {atol:.3g}")
        if l_all is not None and qo:
            l = l_all[row0:row0 + qo]
            if nan_rows.any() and not torch.isnan(l[nan_rows]).all():
                errs.append(f"{where}: LSE of a row whose query holds NaN and that sees keys must be NaN, got "
                            f"{l[nan_rows & ~torch.isnan(l)][:4].tolist()}")
            if torch.isnan(l[ok_rows]).any():
                errs.append(f"{where}: {int(torch.isnan(l[ok_rows]).sum())} LSE elements are NaN (unwritten?)")
            else:
                if unseen.any() and not torch.isneginf(l[unseen]).all():
                    errs.append(f"{where}: LSE of rows that see no key must be -inf, got {l[unseen][:4].tolist()}")
                seen = ok_rows & ~unseen
                if seen.any():
                    ls, gs, bs = l[seen], gl[seen], bl[seen]
                    if not torch.isfinite(ls).all():
                        errs.append(f"{where}: LSE is not finite on rows that see keys")
                    else:
                        err = float((ls - gs).abs().max())
                        berr, atol = tolerance_terms(bs, gs, p.out_dtype, kind="lse", atol_scale=atol_scale)
                        if not err <= TOL_FACTOR * berr + atol:
                            ratio = float((ls / gs)[(gs.abs() > 1)].median()) if (gs.abs() > 1).any() else float("nan")
                            hint = " (looks like natural log: LSE must be base 2)" if abs(ratio - LN2) < 0.02 else ""
                            errs.append(f"{where}: max |lse - golden| = {err:.3g} > {TOL_FACTOR:g} x {berr:.3g} "
                                        f"+ atol {atol:.3g}{hint}")
        row0 += qo
    return errs


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _fail(case, errs: Sequence[str], b: Optional[Built] = None) -> None:
    if not errs:
        return
    head = f"{case.id}: {case.problem.describe() if case.problem else ''}"
    if b is not None:
        head += f"\n  shapes: qo_lens={b.qo_lens} kv_lens={b.kv_lens}"
    shown = list(errs[:8]) + ([f"... and {len(errs) - 8} more"] if len(errs) > 8 else [])
    raise AssertionError(head + "\n  " + "\n  ".join(shown))


# ---------------------------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------------------------
def run_numerics(case) -> None:
    be, p = case.backend, case.problem
    b = build(p, case.tag, case.seed, case.device)
    exp = expected(b)
    snap = snapshot(b)
    plan = be.plan(p, b.meta)
    be.run(plan, b.args)
    sync(case.device)
    errs = check_inputs_unchanged(snap) + check_result(b, exp)
    _fail(case, errs, b)
    if case.tag == "edge":  # a second "layer": same plan, new tensors
        b2 = build(p, case.tag, case.seed, case.device, data_seed=case.seed + 104729)
        be.run(plan, b2.args)
        sync(case.device)
        _fail(case, check_result(b2, expected(b2), what="second run() with the same plan: "), b2)


def run_pod(case) -> None:
    """A fused POD op: each part built as its own op's case (its shapes, NaN in every slot no request may read,
    poisoned outputs), both planned and run in one ``plan()`` / ``run()``, each part checked as its op is.  A
    backend may decline a batch (``PODDeclined``: the API then composes the parts): the case says why and skips."""
    import pytest

    be, p = case.backend, case.problem
    pp, pd = pod_parts(p)
    bp = build(pp, case.tag, case.seed, case.device)
    bd = build(pd, case.tag, case.seed + 1, case.device)
    snaps = snapshot(bp) + snapshot(bd)
    try:
        plan = be.plan(p, PODBatch(prefill=bp.meta, decode=bd.meta))
    except PODDeclined as e:
        if not str(e):
            _fail(case, [f"{be.name} declined a {p.op} batch with an empty PODDeclined message"])
        pytest.skip(f"{be.name} declined this batch (the API composes it): {e}")
    be.run(plan, PODRunArgs(prefill=bp.args, decode=bd.args))
    sync(case.device)
    errs = check_inputs_unchanged(snaps) + check_result(bp, expected(bp), what="prefill part: ") + \
        check_result(bd, expected(bd), what="decode part: ")
    _fail(case, errs, bp)


def run_nonfinite(case) -> None:
    """NaN in one query row and in keys no row may see must stay where the contract puts it."""
    be, p = case.backend, case.problem
    b = build(p, case.tag, case.seed, case.device, nonfinite=True)
    plan = be.plan(p, b.meta)
    be.run(plan, b.args)
    sync(case.device)
    _fail(case, check_result(b, expected(b), what="with NaN in a query row and left of the window: "), b)


def run_refusal(case) -> None:
    be, p = case.backend, case.problem
    rs = be.reasons(p)
    errs = []
    if not isinstance(rs, (list, tuple)) or not rs:
        errs.append(f"{be.name}.reasons() returned {rs!r} for a problem outside its claim ({case.note})")
    else:
        for r in rs:
            if not isinstance(r, Reason) or not r.axis:
                errs.append(f"reasons() must return attncore.core.capabilities.Reason objects with an axis, got {r!r}")
            else:
                str(r)
    if be.supports(p):
        errs.append(f"{be.name}.supports() is True but reasons() gives {[str(r) for r in rs]}")
    try:
        from attncore.core import registry
        from attncore.core import selector
    except ImportError:
        selector = None
    if selector is not None and not errs:
        try:
            entry = registry.get_entry(be.name)
        except Exception:
            entry = None
        if entry is not None and entry.backend is be and not entry.unavailable_reasons():
            try:
                selector.select(p, backend=be.name)
            except ValueError:
                pass
            else:
                errs.append(f"the selector accepted backend={be.name!r} for a refused problem")
    if not errs and p.op == "single_prefill" and p.device_type == torch.device(case.device).type:
        errs += _api_refuses(case)
    _fail(case, errs)


def _api_refuses(case) -> List[str]:
    """The public API, forced to this backend, must raise on a refused single-prefill problem
    (a ``ValueError``/``TypeError`` naming what is wrong), never compute it."""
    try:
        import attncore
        from attncore.core import registry
    except ImportError:
        return []
    be, p = case.backend, case.problem
    try:
        entry = registry.get_entry(be.name)
    except Exception:
        return []
    if entry.backend is not be or entry.unavailable_reasons():
        return []
    if p.out_dtype != p.q_dtype or p.head_dim_vo != p.head_dim_qk:
        return []  # not expressible through single_prefill_with_kv_cache
    dev = torch.device(case.device)
    g = torch.Generator().manual_seed(case.seed)
    qo, kv = 3, 7
    q = torch.randn(qo, p.num_qo_heads, p.head_dim_qk, generator=g).to(p.q_dtype).to(dev)
    shape = (kv, p.num_kv_heads, p.head_dim_qk) if p.kv_layout == "NHD" else (p.num_kv_heads, kv, p.head_dim_qk)
    k = torch.randn(*shape, generator=g).to(p.kv_dtype).to(dev)
    v = torch.randn(*shape, generator=g).to(p.kv_dtype).to(dev)
    kw = dict(causal=p.mask == "causal", kv_layout=p.kv_layout, pos_encoding_mode=p.pos_encoding,
              window_left=p.window_left, logits_soft_cap=2.0 if p.soft_cap else None, return_lse=p.return_lse,
              backend=be.name)
    if p.mask == "custom":
        kw["custom_mask"] = torch.rand(qo, kv, generator=g).lt(0.7).to(dev)
    if p.sinks:
        kw["sinks"] = torch.randn(p.num_qo_heads, generator=g).float().to(dev)
    if p.fp8_scales:
        kw.update(k_scale=0.75, v_scale=1.5)
    try:
        attncore.single_prefill_with_kv_cache(q, k, v, **kw)
    except (ValueError, TypeError) as e:
        if not str(e):
            return [f"the API refused {p.describe()} with an empty {type(e).__name__} message"]
        return []
    return [f"attncore.single_prefill_with_kv_cache(..., backend={be.name!r}) computed a problem "
            f"{be.name} refuses ({case.note}): it must raise ValueError with the reasons"]


def run_merge(case) -> None:
    """Split every request's keys in two, run both halves with LSE, merge, compare with the full golden."""
    be, p = case.backend, case.problem
    full = build(p, "", case.seed, case.device)
    exp = expected(full)
    rng = random.Random(case.seed + 1)
    splits = [rng.randint(0, kv) for kv in full.kv_lens]
    parts = []
    for lo in (True, False):
        reqs = [(q, k[:s] if lo else k[s:], v[:s] if lo else v[s:]) for (q, k, v), s in zip(full.reqs, splits)]
        b = build(p, "", case.seed + (11 if lo else 13), case.device, reqs=reqs)
        plan = be.plan(p, b.meta)
        be.run(plan, b.args)
        sync(case.device)
        parts.append(b)
    a, c = parts
    try:
        from attncore.cascade import merge_state
    except ImportError:  # pragma: no cover - the core always ships it
        merge_state = None
    oa, la, ob, lb = a.args.out, a.args.lse, c.args.out, c.args.lse
    if merge_state is not None:
        o, l = merge_state(oa, la, ob, lb)
    else:
        m = torch.maximum(la, lb)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        wa, wb = torch.exp2(la - m), torch.exp2(lb - m)
        tot = wa + wb
        o = ((oa.float() * wa[..., None] + ob.float() * wb[..., None]) / tot.clamp_min(1e-30)[..., None]).to(oa.dtype)
        l = m + torch.log2(tot)
    errs = check_result(full, exp, o, l, out_buf=torch.empty(0), lse_buf=torch.empty(0), atol_scale=2.0,
                        what=f"merged halves (splits {splits}): ")
    _fail(case, errs, full)


_INDEX_FIELDS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "packed_mask",
                 "mask_indptr", "seq_lens")


def _into_fixed(meta: BatchMeta, bases: dict) -> BatchMeta:
    """Put meta's index tensors into fixed device buffers (allocated on first use), the way the API
    does in CUDA-graph mode: every plan() of a wrapper sees the same addresses."""
    for name in _INDEX_FIELDS:
        t = getattr(meta, name)
        if t is None:
            continue
        if name not in bases:
            bases[name] = torch.zeros(max(4096, t.numel()), dtype=t.dtype, device=t.device)
        view = bases[name][:t.numel()]
        view.copy_(t.reshape(-1))
        setattr(meta, name, view.view(t.shape))
    if meta.block_tables is not None:
        if "block_tables" not in bases:
            bases["block_tables"] = meta.block_tables.clone()
        bases["block_tables"].copy_(meta.block_tables)
        meta.block_tables = bases["block_tables"]
    return meta


def _second_shapes(p: AttentionProblem, qo_lens: List[int], seed: int) -> List[int]:
    """New kv lengths for the same batch size and query rows (what changes between decode steps)."""
    rng = random.Random(seed)
    lo = p.q_len_per_req if p.op in DECODE_OPS else 1
    return [rng.randint(lo, 48) for _ in qo_lens]


def _recompose(total: int, parts: int, seed: int) -> List[int]:
    """``parts`` non-negative lengths summing to ``total``."""
    rng = random.Random(seed)
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def run_cuda_graph(case) -> None:
    """Capture run() after plan A, re-plan B into the same index buffers, write B's inputs into the
    captured tensors, replay: must pass the golden check and equal an eager run() of plan B.

    Paged ops: B has new kv lengths (same batch size, query rows and page pool).  Ragged batch: the
    same total of keys split differently among the requests (the API fixes K/V shapes).
    single_prefill: plan A replayed on new values.  Fused POD ops: both parts so (``pod_graph_errors``)."""
    import pytest

    if not case.device.startswith("cuda") or not torch.cuda.is_available():
        pytest.skip("CUDA-graph replay needs a CUDA device")
    with torch.cuda.device(torch.device(case.device)):  # a graph is captured on its tensors' device
        if case.problem.op in POD_OPS:
            _fail(case, pod_graph_errors(case.backend, case.problem, case.tag, case.seed, case.device, capture_run))
        else:
            _graph_case(case)


def capture_run(be, plan, args):
    """Warm up (JIT, autotune) off the default stream, capture ``be.run(plan, args)``; returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.run(plan, args)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.run(plan, args)
    torch.cuda.synchronize()
    return g.replay


def _graph_pair(p: AttentionProblem, tag: str, seed: int, device: str):
    """(A, B, whether B is planned anew, what the replay is) of a graph case (see ``run_cuda_graph``); B is
    built to fit A's buffers (page pool, block-table width, strided views)."""
    import pytest

    paged = p.op in PAGED_OPS
    replan = paged or p.op == "batch_prefill_ragged"
    if not replan:
        return (build(p, tag, seed, device), build(p, tag, seed, device, data_seed=seed + 31337), False,
                "graph replayed on new values: ")
    pool = width = 0
    qo_a, kv_a = case_shapes(p, tag, random.Random(seed))
    if paged:
        kv_b = _second_shapes(p, qo_a, seed + 5)
        pages = lambda kv: [-(-n // p.page_size) for n in kv]  # noqa: E731
        pool = max(sum(pages(kv_a)), sum(pages(kv_b))) + 3
        width = max(pages(kv_a) + pages(kv_b)) + 1
    else:
        kv_b = _recompose(sum(kv_a), len(kv_a), seed + 5)
    a = build(p, tag, seed, device, shapes=(qo_a, kv_a), min_pages=pool, min_bt_width=width)
    b = build(p, tag, seed + 1, device, data_seed=seed + 31337, shapes=(qo_a, kv_b),
              views=(a.strided, a.paged_5d), min_pages=pool, min_bt_width=width)
    if paged and (b.pool != a.pool or (p.op == "xqa_decode" and b.bt_width != a.bt_width)):
        pytest.fail(f"internal: second batch does not fit the first's buffers ({b.pool} vs {a.pool} pages)")
    return a, b, True, f"graph captured at kv_lens={a.kv_lens}, re-planned to kv_lens={b.kv_lens}, replayed: "


def _load(a, b) -> None:
    """Write B's inputs into A's captured tensors and poison A's outputs."""
    for dst, src in zip(a.storages, b.storages):
        dst.copy_(src)
    if a.args.sinks is not None and b.args.sinks is not None:
        a.args.sinks.copy_(b.args.sinks)
    if a.args.spec_mask is not None and b.args.spec_mask is not None:
        a.args.spec_mask.copy_(b.args.spec_mask)
    _poison(a)


def _poison(a) -> None:
    a.out_buf.fill_(float("nan"))
    if a.lse_buf is not None:
        a.lse_buf.fill_(float("nan"))


def _outputs(a) -> tuple:
    return a.out_buf.clone(), None if a.lse_buf is None else a.lse_buf.clone()


def _same_as_eager(a, replayed: tuple, what: str = "") -> List[str]:
    """Failures where the replay's outputs differ from those of an eager run into A's buffers."""
    errs = []
    out, lse = replayed
    if not torch.equal(_bits(out), _bits(a.out_buf)):
        diff = (out.double() - a.out_buf.double()).abs().nan_to_num(float("inf")).max()
        errs.append(f"{what}graph replay differs from an eager run() of the same plan and inputs "
                    f"(max |diff| = {float(diff):.3g})")
    if lse is not None and not torch.equal(_bits(lse), _bits(a.lse_buf)):
        errs.append(f"{what}graph replay LSE differs from an eager run() of the same plan and inputs")
    return errs


def _graph_case(case) -> None:
    be, p = case.backend, case.problem
    a, b, replan, what = _graph_pair(p, case.tag, case.seed, case.device)
    bases: dict = {}
    _into_fixed(a.meta, bases)
    plan_a = be.plan(p, a.meta)
    replay = capture_run(be, plan_a, a.args)
    plan_b = be.plan(p, _into_fixed(b.meta, bases)) if replan else plan_a
    _load(a, b)
    replay()
    sync(case.device)
    replayed = _outputs(a)
    errs = check_result(b, expected(b), out_buf=replayed[0], lse_buf=replayed[1], what=what)
    _poison(a)
    be.run(plan_b, a.args)
    sync(case.device)
    _fail(case, errs + _same_as_eager(a, replayed), b)


def pod_graph_errors(be, p: AttentionProblem, tag: str, seed: int, device: str, capture) -> List[str]:
    """A fused POD op in CUDA-graph mode: each part built as its graph case is (``_graph_pair``: the decode part
    with new kv lengths, the prefill part re-planned or given new values), plan A of both parts, ``capture(be,
    plan, args)`` (returns the replay), B's index tables written into A's fixed buffers and B's inputs into A's
    tensors.  Replayed twice: before the fused op is planned again (the POD wrapper's plan() re-plans only its
    parts) and after plan B; each part must pass the golden check of B both times and equal an eager run() of
    plan B.  A backend may decline the batch (the API composes it): skipped, saying why."""
    import pytest

    pp, pd = pod_parts(p)
    ap, bp, _, _ = _graph_pair(pp, tag, seed, device)
    ad, bd, _, what = _graph_pair(pd, tag, seed + 1, device)
    fixed_p: dict = {}
    fixed_d: dict = {}
    _into_fixed(ap.meta, fixed_p)
    _into_fixed(ad.meta, fixed_d)
    try:
        plan_a = be.plan(p, PODBatch(prefill=ap.meta, decode=ad.meta))
    except PODDeclined as e:
        pytest.skip(f"{be.name} declined this batch (the API composes it): {e}")
    args = PODRunArgs(prefill=ap.args, decode=ad.args)
    replay = capture(be, plan_a, args)
    batch_b = PODBatch(prefill=_into_fixed(bp.meta, fixed_p), decode=_into_fixed(bd.meta, fixed_d))
    _load(ap, bp)
    _load(ad, bd)
    errs: List[str] = []
    exps = (expected(bp), expected(bd))

    def replayed(when: str) -> tuple:
        replay()
        sync(device)
        got = (_outputs(ap), _outputs(ad))
        for b, exp, out, part in zip((bp, bd), exps, got, ("prefill part: ", "decode part: ")):
            errs.extend(check_result(b, exp, out_buf=out[0], lse_buf=out[1], what=part + what + when))
        _poison(ap)
        _poison(ad)
        return got

    replayed("before the fused op is planned again: ")
    plan_b = be.plan(p, batch_b)
    got = replayed("after plan B: ")
    be.run(plan_b, args)
    sync(device)
    for a, out, part in zip((ap, ad), got, ("prefill part: ", "decode part: ")):
        errs += _same_as_eager(a, out, part)
    return errs


FAMILIES = {"numerics": run_numerics, "nonfinite": run_nonfinite, "refusal": run_refusal, "merge": run_merge, "cuda_graph": run_cuda_graph}
