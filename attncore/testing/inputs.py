"""Conformance inputs: the shapes of a case, its tensors (outputs poisoned inside guard rows), the
fp64 golden it is checked against, and snapshots of its inputs (bit-identical after ``run()``).
``attncore.testing.runner`` drives a backend over them and checks the result."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from attncore.core.backend import AttnParams, BatchMeta, RunArgs
from attncore.core.mask import pack_spec_mask
from attncore.core.problem import DECODE_OPS, PAGED_OPS, AttentionProblem
from attncore.quantization import packbits
from attncore.testing.golden import golden_and_baseline, visible

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
