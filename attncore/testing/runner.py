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
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from attncore.core.backend import AttnParams, BatchMeta, RunArgs
from attncore.core.capabilities import Reason
from attncore.core.problem import DECODE_OPS, PAGED_OPS, AttentionProblem
from attncore.core.mask import pack_spec_mask
from attncore.quantization import packbits
from attncore.testing.golden import TOL_FACTOR, golden_and_baseline, tolerance_terms, visible
from attncore.testing.golden import dtype_attention, golden_attention  # noqa: F401  (runner.dtype_attention: docs)

LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------
# The "same torch math in the backend's dtype" baseline that sets the error budget.
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------
def case_shapes(p: AttentionProblem, tag: str, rng: random.Random) -> Tuple[List[int], List[int]]:
    """(qo_lens, kv_lens) of a case.  Small on purpose: the suite must run on 2 CPU cores."""
    causal = p.mask == "causal"
    page = p.page_size or 16
    if tag == "tiles":
        return tile_shapes(p, rng)
    if tag == "nf":  # many keys, so that a small window hides whole tiles
        if p.op in DECODE_OPS:
            b = rng.randint(1, 3)
            return [p.q_len_per_req] * b, [rng.randint(70, 200) for _ in range(b)]
        b = 1 if p.op == "single_prefill" else rng.randint(1, 3)
        return [rng.randint(1, 9) for _ in range(b)], [rng.randint(70, 200) for _ in range(b)]
    if p.op == "single_prefill":
        if tag == "tok1":
            return [1], [1]
        if tag == "edge":  # a few queries over many keys (chunked prefill / append)
            qo = rng.randint(1, 3)
            return [qo], [rng.randint(20, 40)]
        if tag == "strided":
            n = rng.randint(5, 16)
            return [n], [n]
        qo = rng.randint(1, 12)
        kv = rng.randint(qo if causal else 1, 40)
        return [qo], [kv]
    if p.op in ("batch_prefill_ragged", "batch_prefill_paged"):
        if tag == "tok1":
            return [1], [1]
        if tag == "edge":
            # kv_len 0, an empty request, qo_len > kv_len, one token, last page full.
            full = 2 * page if p.op == "batch_prefill_paged" else 17
            return [3, 0, 6, 1, 4], [0, 5, 2, 1, full]
        b = rng.randint(1, 4)
        qo = [rng.randint(1, 9) for _ in range(b)]
        kv = [rng.randint(0, 40) for _ in range(b)]
        if causal and rng.random() < 0.7:
            kv = [max(a, x) for a, x in zip(qo, kv)]
        return qo, kv
    ql = p.q_len_per_req
    if tag == "tok1":
        return [ql], [ql]
    if tag == "edge":  # one token, last page full, one token on the last page, several pages, empty
        kv = [1, page, page + 1, 2 * page + 3, 29]
        if p.op == "batch_decode" and ql == 1:
            kv.append(0)
        kv = [max(ql, x) if x else 0 for x in kv]
        return [ql] * len(kv), kv
    b = rng.randint(1, 5)
    kv = [rng.randint(ql, 48) for _ in range(b)]
    return [ql] * b, kv


# Lengths at multiples of the common tile sizes and one off (plus the issue-13 reproduction's 21/76).
TILE_LENS = (1, 15, 16, 17, 21, 31, 32, 33, 63, 64, 65, 76, 127, 128, 129)


def tile_shapes(p: AttentionProblem, rng: random.Random) -> Tuple[List[int], List[int]]:
    """Lengths from ``TILE_LENS``: qo < kv and, where the op allows it, qo > kv.  The qo < kv request
    has at least 21 rows, so that with any group of 3 or more its packed rows cross a 64-row tile."""
    causal = p.mask == "causal"
    big = [n for n in TILE_LENS if n >= 21]

    def below_above():  # (qo, kv) with 21 <= qo <= kv
        qo = rng.choice(big)
        if rng.random() < 0.5:
            return qo, rng.choice([n for n in TILE_LENS if n >= qo])
        # Or a kv that puts, for some row tile (bm rows) ending at packed row r, the key just past its
        # last token's causal bound on a key-tile (bn) boundary: a tile range one token short (issue
        # 13's slip) then misses a whole key tile instead of being rescued by the masked tail tile.
        g = p.group_size
        bm, bn = rng.choice((16, 32, 64, 128)), rng.choice((32, 64, 128))
        ends = [r for r in range(bm, qo * g, bm) if r % g]
        if not ends:
            return qo, rng.choice([n for n in TILE_LENS if n >= qo])
        r = rng.choice(ends)
        return qo, qo + (-(r // g)) % bn + bn * rng.randint(0, 1)

    if p.op in DECODE_OPS:
        b = rng.randint(1, 3)
        return [p.q_len_per_req] * b, [max(p.q_len_per_req, rng.choice(TILE_LENS)) for _ in range(b)]
    qo, kv = below_above()
    if p.op == "single_prefill":
        return ([qo], [kv]) if causal or rng.random() < 0.7 else ([kv], [qo])
    qo2, kv2 = below_above()
    qos, kvs = [qo, kv2], [kv, qo2 - rng.randint(1, qo2)]  # the second: qo > kv, early rows see nothing
    if rng.random() < 0.5:
        qos.append(rng.choice(TILE_LENS))
        kvs.append(rng.choice(TILE_LENS))
    return qos, kvs


# ---------------------------------------------------------------------------------------------
# Building a batch
# ---------------------------------------------------------------------------------------------
@dataclass
class Built:
    problem: AttentionProblem
    meta: BatchMeta
    args: RunArgs
    qo_lens: List[int]
    kv_lens: List[int]
    reqs: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per request (q, k, v) on the CPU, NHD
    masks: List[Optional[torch.Tensor]]  # per request bool [qo, kv] (custom / spec) or None
    golden_kwargs: dict
    out_buf: torch.Tensor
    lse_buf: Optional[torch.Tensor]
    storages: List[torch.Tensor] = field(default_factory=list)  # device buffers holding q / k / v
    strided: bool = False
    paged_5d: bool = False
    pool: int = 0
    bt_width: int = 0


_WORKSPACES: dict = {}


def _workspace(dev: torch.device) -> torch.Tensor:
    """A zeroed 32 MiB float workspace per device, like the caller's ``float_workspace_buffer``."""
    key = str(dev)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.zeros(32 << 20, dtype=torch.uint8, device=dev)
    return _WORKSPACES[key]


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _poison(*shape):
    """Storage no request may read (padding rows and heads, spare pages, slots past a request's
    last key): NaN, so a backend that lets any of it into a result fails (docs/semantics.md,
    "Non-finite inputs", rule 1)."""
    return torch.full(shape, float("nan"))


def build(p: AttentionProblem, tag: str, seed: int, device: str, *, data_seed: Optional[int] = None,
          reqs: Optional[List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = None,
          shapes: Optional[Tuple[List[int], List[int]]] = None, views: Optional[Tuple[bool, bool]] = None,
          min_pages: int = 0, min_bt_width: int = 0, nonfinite: bool = False) -> Built:
    """Inputs of one case.  Shapes, page tables and masks come from ``seed``; tensor values from
    ``data_seed`` (so a second "layer" can reuse one plan), or ``reqs`` when given.

    ``shapes`` (qo_lens, kv_lens), ``views`` (strided, 5-D paged cache), ``min_pages`` (page pool
    size) and ``min_bt_width`` (xqa block-table width) pin what the CUDA-graph family keeps fixed.
    ``nonfinite``: NaN in one query row and in every key left of the window of all rows
    (docs/semantics.md, "Non-finite inputs", rules 2-3; the golden follows the same rules)."""
    rng = random.Random(seed)
    mgen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator().manual_seed(seed + 7919 if data_seed is None else data_seed)
    dev = torch.device(device)
    hq, hkv, d, dv = p.num_qo_heads, p.num_kv_heads, p.head_dim_qk, p.head_dim_vo
    if shapes is not None:
        qo_lens, kv_lens = list(shapes[0]), list(shapes[1])
    elif reqs is None:
        qo_lens, kv_lens = case_shapes(p, tag, rng)
    else:
        qo_lens = [r[0].shape[0] for r in reqs]
        kv_lens = [r[1].shape[0] for r in reqs]
    bsz = len(qo_lens)
    strided = tag == "strided" or (tag.startswith("r") and rng.random() < 0.3)
    paged_5d = p.op in PAGED_OPS and d == dv and (strided or rng.random() < 0.5)
    if views is not None:
        strided, paged_5d = views[0], views[1] and p.op in PAGED_OPS and d == dv
    xqa = p.op == "xqa_decode"

    # Scalars.
    sm_scale = 1.0 / math.sqrt(d)
    cap = 2.0 if p.soft_cap else 0.0
    q_scale = k_scale = v_scale = o_scale = 1.0
    if p.fp8_scales:
        if xqa:  # bmm1_scale folds every QK scale into sm_scale; bmm2_scale is v_scale
            sm_scale *= 1.25 * 0.75
            v_scale = 1.5
        else:
            q_scale, k_scale, v_scale = 1.25, 0.75, 1.5
    params = AttnParams(sm_scale=sm_scale, logits_soft_cap=cap, window_left=p.window_left,
                        pos_encoding_mode=p.pos_encoding)

    # Per-request values (CPU, in the problem's dtypes).
    if reqs is None:
        reqs = []
        for qo, kv in zip(qo_lens, kv_lens):
            reqs.append((_randn(dgen, qo, hq, d).to(p.q_dtype), _randn(dgen, kv, hkv, d).to(p.kv_dtype),
                         _randn(dgen, kv, hkv, dv).to(p.kv_dtype)))
    sinks = (_randn(dgen, hq) + 1.0).float() if p.sinks else None
    if nonfinite:
        reqs = _poison_request_values(reqs, p.window_left, rng)

    # Masks (meta: drawn from the shape seed).
    masks: List[Optional[torch.Tensor]] = [None] * bsz
    packed = None  # the requests' masks packed LSB-first, each from a byte boundary (the batch lays them out)
    spec = None
    if p.mask == "custom":
        chunks = []
        for i, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
            m = torch.rand(qo, kv, generator=mgen) < 0.7
            if qo > 1 and kv > 0:
                m[rng.randrange(qo)] = False  # a fully masked row
            masks[i] = m
            chunks.append(packbits(m.reshape(-1), bitorder="little"))
        packed = torch.cat(chunks).to(dev) if chunks else torch.zeros(0, dtype=torch.uint8, device=dev)
    elif p.spec_mask:
        ql = p.q_len_per_req
        bits = torch.rand(bsz, ql, ql, generator=mgen) < 0.6
        bits &= torch.ones(ql, ql, dtype=torch.bool).tril()
        bits |= torch.eye(ql, dtype=torch.bool)
        spec = pack_spec_mask(bits).to(dev)
        for i, kv in enumerate(kv_lens):
            prefix = torch.ones(ql, kv - ql, dtype=torch.bool)
            masks[i] = torch.cat([prefix, bits[i]], dim=1)

    # q (optionally a head-slice of a fused buffer, like q of a qkv projection).
    storages = []
    q_all = torch.cat([r[0] for r in reqs]) if reqs else torch.zeros(0, hq, d, dtype=p.q_dtype)
    nnz = q_all.shape[0]
    if strided:
        qbuf = _poison(nnz, hq + 3, d).to(p.q_dtype).to(dev)
        q = qbuf[:, 1:1 + hq]
        q.copy_(q_all.to(dev))
        storages.append(qbuf)
    else:
        q = q_all.to(dev)
        storages.append(q)

    # The batch: built by BatchMeta's constructors, as the API builds it (kv lengths, the resolved mask)
    batch = dict(device=dev, params=params, causal=p.mask == "causal", packed_custom_mask=packed,
                 workspace=_workspace(dev))
    qo_ptr = [0]
    for n in qo_lens:
        qo_ptr.append(qo_ptr[-1] + n)

    if p.op in ("single_prefill", "batch_prefill_ragged"):
        kv_ptr = [0]
        for n in kv_lens:
            kv_ptr.append(kv_ptr[-1] + n)
        n = kv_ptr[-1]
        k_all = torch.cat([r[1] for r in reqs]).float()
        v_all = torch.cat([r[2] for r in reqs]).float()
        kv_tensors = []
        for x, dd in ((k_all, d), (v_all, dv)):
            extra_h = 2 if strided else 0
            if p.kv_layout == "NHD":
                stage = _poison(n + 2, hkv + extra_h, dd)
                stage[:n, extra_h // 2: extra_h // 2 + hkv] = x
                buf = stage.to(p.kv_dtype).to(dev)
                view = buf[:n, extra_h // 2: extra_h // 2 + hkv]
            else:
                stage = _poison(hkv + extra_h // 2, n + 2 + (3 if strided else 0), dd)
                off = 3 if strided else 0
                stage[extra_h // 2:, off:off + n] = x.transpose(0, 1)
                buf = stage.to(p.kv_dtype).to(dev)
                view = buf[extra_h // 2:, off:off + n]
            kv_tensors.append(view)
            storages.append(buf)
        k, v = kv_tensors
        meta = BatchMeta.ragged(qo_indptr_host=qo_ptr, kv_indptr_host=kv_ptr, **batch)
    else:
        page = p.page_size
        npages = [-(-n // page) for n in kv_lens]
        total = sum(npages)
        pool = max(total + 3, min_pages)
        perm = list(range(pool))
        rng.shuffle(perm)
        used, spare = perm[:total], perm[total:]
        page_ids, s = [], 0
        for n in npages:
            page_ids.append(used[s:s + n])
            s += n
        hnd = p.kv_layout == "HND"
        tok_shape = (hkv, page) if hnd else (page, hkv)
        if paged_5d:
            stage = _poison(pool, 2, *tok_shape, d)
            ks, vs = stage[:, 0], stage[:, 1]
        else:
            ks = _poison(pool, *tok_shape, d)
            vs = _poison(pool, *tok_shape, dv)
        for (qi, ki, vi), ids, n in zip(reqs, page_ids, kv_lens):
            if n == 0:
                continue
            pid = torch.tensor(ids, dtype=torch.long).repeat_interleave(page)[:n]
            slot = torch.arange(n) % page
            if hnd:
                ks[pid, :, slot] = ki.float()
                vs[pid, :, slot] = vi.float()
            else:
                ks[pid, slot] = ki.float()
                vs[pid, slot] = vi.float()
        if paged_5d:
            buf = stage.to(p.kv_dtype).to(dev)
            k, v = buf[:, 0], buf[:, 1]
            storages.append(buf)
        else:
            k = ks.to(p.kv_dtype).to(dev)
            v = vs.to(p.kv_dtype).to(dev)
            storages += [k, v]
        if xqa:
            width = max(max(npages) + 1 if npages else 1, min_bt_width)
            bt = torch.tensor([[rng.choice(spare) for _ in range(width)] for _ in range(bsz)], dtype=torch.int32)
            for i, ids in enumerate(page_ids):
                if ids:
                    bt[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            # seq_lens not read back (read_seq_lens=False): the API's CUDA-graph-capture path, planned for
            # max_seq_len (a custom mask reads them: it is laid out by them)
            meta = BatchMeta.from_block_tables(
                bt.to(dev), torch.tensor(kv_lens, dtype=torch.int32, device=dev), max(kv_lens) if kv_lens else 0,
                page, q_len_per_req=p.q_len_per_req, read_seq_lens=False, device=dev, params=params,
                packed_custom_mask=packed, workspace=batch["workspace"])
        else:
            kv_ptr = [0]
            for n in npages:
                kv_ptr.append(kv_ptr[-1] + n)
            flat = [x for ids in page_ids for x in ids]
            last = [((n - 1) % page) + 1 if n else 0 for n in kv_lens]
            i32 = dict(dtype=torch.int32, device=dev)
            meta = BatchMeta.paged(qo_ptr, torch.tensor(kv_ptr, **i32), torch.tensor(flat, **i32),
                                   torch.tensor(last, **i32), page, decode=p.op in DECODE_OPS,
                                   q_len_per_req=p.q_len_per_req, **batch)

    # Outputs: NaN-poisoned, with a guard row on each side.
    out_buf = torch.full((nnz + 2, hq, dv), float("nan"), dtype=p.out_dtype, device=dev)
    lse_buf = torch.full((nnz + 2, hq), float("nan"), dtype=torch.float32, device=dev) if p.return_lse else None
    args = RunArgs(q=q, k=k, v=v, out=out_buf[1:nnz + 1], lse=None if lse_buf is None else lse_buf[1:nnz + 1],
                   sinks=None if sinks is None else sinks.to(dev), q_scale=q_scale, k_scale=k_scale,
                   v_scale=v_scale, o_scale=o_scale, spec_mask=spec)
    golden_kwargs = dict(window_left=p.window_left, sm_scale=sm_scale, logits_soft_cap=cap,
                         pos_encoding_mode=p.pos_encoding, sinks=sinks, q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, o_scale=o_scale)
    return Built(p, meta, args, qo_lens, kv_lens, reqs, masks, golden_kwargs, out_buf, lse_buf, storages,
                 strided=strided, paged_5d=paged_5d, pool=pool if p.op in PAGED_OPS else 0,
                 bt_width=int(meta.block_tables.shape[1]) if meta.block_tables is not None else 0)


def _poison_request_values(reqs, window_left: int, rng: random.Random):
    """Copies of ``reqs`` with NaN in one query (row, head) of one request and in the keys and
    values left of the window of every row of each request."""
    reqs = [(q.clone(), k.clone(), v.clone()) for q, k, v in reqs]
    with_q = [i for i, (q, k, _) in enumerate(reqs) if q.shape[0] and k.shape[0]]
    if with_q:
        q = reqs[rng.choice(with_q)][0]
        q[rng.randrange(q.shape[0]), rng.randrange(q.shape[1])] = float("nan")
    if window_left >= 0:
        for q, k, v in reqs:
            if q.shape[0]:  # the keys the window hides from every row (golden.visible: one window rule),
                # a prefix: sliced, since fp8 tensors take no masked writes
                hidden = int((~visible(q.shape[0], k.shape[0], window_left=window_left).any(dim=0)).sum())
                k[:hidden] = float("nan")
                v[:hidden] = float("nan")
    return reqs


def expected(b: Built):
    """Per request: (golden out, golden lse, baseline out, baseline lse), float64 on the CPU."""
    res = []
    p = b.problem
    dev = b.out_buf.device  # the golden runs where the backend did (fp64 on a GPU is fast)
    causal = p.mask == "causal"
    for (q, k, v), m in zip(b.reqs, b.masks):  # golden.golden_and_baseline: the yardstick, RoPE rule included
        kw = dict(b.golden_kwargs, causal=causal and m is None, mask=m)
        res.append(golden_and_baseline(q, k, v, dtype=p.q_dtype, out_dtype=p.out_dtype, device=dev, **kw))
    return res


# ---------------------------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------------------------
def snapshot(b: Built):
    ts = list(b.storages)
    m = b.meta
    for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len, m.kv_lens, m.packed_mask, m.mask_indptr,
              m.block_tables, m.seq_lens, b.args.sinks, b.args.spec_mask):
        if t is not None:
            ts.append(t)
    return [(t, t.detach().clone()) for t in ts]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.is_floating_point() else t


def check_inputs_unchanged(snap) -> List[str]:
    bad = []
    for t, before in snap:
        if not torch.equal(_bits(t), _bits(before)):
            bad.append(f"an input tensor of shape {tuple(t.shape)} ({t.dtype}) was modified by run()")
    return bad


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
    single_prefill: plan A replayed on new values."""
    import pytest

    if not case.device.startswith("cuda") or not torch.cuda.is_available():
        pytest.skip("CUDA-graph replay needs a CUDA device")
    with torch.cuda.device(torch.device(case.device)):  # a graph is captured on its tensors' device
        _graph_case(case)


def _graph_case(case) -> None:
    import pytest

    be, p = case.backend, case.problem
    paged = p.op in PAGED_OPS
    replan = paged or p.op == "batch_prefill_ragged"
    pool = width = 0
    if replan:
        qo_a, kv_a = case_shapes(p, case.tag, random.Random(case.seed))
        if paged:
            kv_b = _second_shapes(p, qo_a, case.seed + 5)
            pages = lambda kv: [-(-n // p.page_size) for n in kv]  # noqa: E731
            pool = max(sum(pages(kv_a)), sum(pages(kv_b))) + 3
            width = max(pages(kv_a) + pages(kv_b)) + 1
        else:
            kv_b = _recompose(sum(kv_a), len(kv_a), case.seed + 5)
        a = build(p, case.tag, case.seed, case.device, shapes=(qo_a, kv_a), min_pages=pool, min_bt_width=width)
    else:
        a = build(p, case.tag, case.seed, case.device)
    bases: dict = {}
    _into_fixed(a.meta, bases)
    plan_a = be.plan(p, a.meta)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.run(plan_a, a.args)  # warm-up (JIT, autotune) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.run(plan_a, a.args)
    torch.cuda.synchronize()
    if replan:
        b = build(p, case.tag, case.seed + 1, case.device, data_seed=case.seed + 31337, shapes=(qo_a, kv_b),
                  views=(a.strided, a.paged_5d), min_pages=pool, min_bt_width=width)
        if paged and (b.pool != a.pool or (p.op == "xqa_decode" and b.bt_width != a.bt_width)):
            pytest.fail(f"internal: second batch does not fit the first's buffers ({b.pool} vs {a.pool} pages)")
        what = f"graph captured at kv_lens={a.kv_lens}, re-planned to kv_lens={b.kv_lens}, replayed: "
    else:
        b = build(p, case.tag, case.seed, case.device, data_seed=case.seed + 31337)
        what = "graph replayed on new values: "
    meta_b = _into_fixed(b.meta, bases)
    plan_b = be.plan(p, meta_b) if replan else plan_a
    for dst, src in zip(a.storages, b.storages):
        dst.copy_(src)
    if a.args.sinks is not None and b.args.sinks is not None:
        a.args.sinks.copy_(b.args.sinks)
    if a.args.spec_mask is not None and b.args.spec_mask is not None:
        a.args.spec_mask.copy_(b.args.spec_mask)
    a.out_buf.fill_(float("nan"))
    if a.lse_buf is not None:
        a.lse_buf.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    replay_out = a.out_buf.clone()
    replay_lse = None if a.lse_buf is None else a.lse_buf.clone()
    errs = check_result(b, expected(b), out_buf=replay_out, lse_buf=replay_lse, what=what)
    a.out_buf.fill_(float("nan"))
    if a.lse_buf is not None:
        a.lse_buf.fill_(float("nan"))
    be.run(plan_b, a.args)
    torch.cuda.synchronize()
    if not torch.equal(_bits(replay_out), _bits(a.out_buf)):
        diff = (replay_out.double() - a.out_buf.double()).abs().nan_to_num(float("inf")).max()
        errs.append("graph replay differs from an eager run() of the same plan and inputs "
                    f"(max |diff| = {float(diff):.3g})")
    if replay_lse is not None and not torch.equal(_bits(replay_lse), _bits(a.lse_buf)):
        errs.append("graph replay LSE differs from an eager run() of the same plan and inputs")
    del g
    _fail(case, errs, b)


FAMILIES = {"numerics": run_numerics, "nonfinite": run_nonfinite, "refusal": run_refusal, "merge": run_merge, "cuda_graph": run_cuda_graph}
