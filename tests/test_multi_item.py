"""Multi-item scoring (``prefix_len_ptr``, ``token_pos_in_items_ptr``, ``token_pos_in_items_len``,
``max_item_len_ptr``) through the batch prefill wrappers, against an fp64 golden.

The golden's mask is written from the item semantics (docs/semantics.md, "Multi-item scoring"), one
token at a time: each token after the prefix is tagged with its item by walking the delimiters, and a
query sees the prefix and the earlier tokens of its own item (never a delimiter); nothing is shared
with ``attncore.core.multi_item``, which derives the mask arithmetically as FlashInfer's kernel does.
"""

import random

import pytest
import torch

import attncore
from attncore.testing.golden import golden_and_baseline, max_error, tolerance

D, HQ, HKV = 64, 4, 2
DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- the golden
def positions_in_items(item_lens, trailing_delimiter=True):
    """FlashInfer's layout of one request after its prefix: a delimiter (0), then 1..L for each item,
    and a closing delimiter."""
    out = []
    for n in item_lens:
        out += list(range(n + 1))
    return out + ([0] if trailing_delimiter else [])


def golden_visible(qo, kv, prefix, tpos):
    """bool [qo, kv] from the item semantics, token by token."""
    item_of, delim = {}, set()
    item = -1
    for off, t in enumerate(tpos):
        p = prefix + off
        if t == 0:
            item += 1
            delim.add(p)
        item_of[p] = item
    keep = torch.zeros(qo, kv, dtype=torch.bool)
    for row in range(qo):
        pos = kv - qo + row
        for j in range(kv):
            if j > pos:
                continue
            if pos < prefix:  # a prefix token: plain causal
                keep[row, j] = True
            elif j < prefix:  # every item token sees the whole prefix
                keep[row, j] = True
            elif pos not in delim and j not in delim and item_of[j] == item_of[pos]:
                keep[row, j] = True
    return keep


def make_batch(seed, n_req, *, prefix_range=(0, 9), items_range=(1, 4), item_len_range=(1, 6), pad=3,
               append=False):
    """Random requests: (qo_lens, kv_lens, prefixes, per-request positions, stride)."""
    rng = random.Random(seed)
    qo_lens, kv_lens, prefixes, tps = [], [], [], []
    for _ in range(n_req):
        prefix = rng.randint(*prefix_range)
        items = [rng.randint(*item_len_range) for _ in range(rng.randint(*items_range))]
        tp = positions_in_items(items, trailing_delimiter=rng.random() < 0.7)
        kv = prefix + len(tp)
        # the queries: every token after the prefix (scoring), or fewer (an append), or some prefix too
        if append:
            qo = rng.randint(1, len(tp))
        else:
            qo = min(kv, len(tp) + rng.choice([0, 0, 2]))
        qo_lens.append(qo)
        kv_lens.append(kv)
        prefixes.append(prefix)
        tps.append(tp)
    stride = max(len(t) for t in tps) + pad
    return qo_lens, kv_lens, prefixes, tps, stride


def flat_positions(tps, stride, dtype=torch.uint16):
    """FlashInfer's token_pos_in_items_ptr: each request's positions zero-padded to ``stride``."""
    flat = []
    for t in tps:
        flat += t + [0] * (stride - len(t))
    return torch.tensor(flat, dtype=torch.int64).to(dtype)


def indptr(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def build_inputs(qo_lens, kv_lens, dtype, device, seed=0, hq=HQ, hkv=HKV, d=D):
    g = torch.Generator().manual_seed(seed)
    nq, nk = sum(qo_lens), sum(kv_lens)
    q = torch.randn(nq, hq, d, generator=g).to(device, dtype)
    k = torch.randn(nk, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(nk, hkv, d, generator=g).to(device, dtype)
    return q, k, v


def to_paged(k, v, kv_lens, page_size):
    """Scatter ragged K/V into a paged NHD cache with shuffled pages."""
    n_pages = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(n_pages)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(1))
    cache = torch.zeros(total, 2, page_size, *k.shape[1:], dtype=k.dtype, device=k.device)
    kvp, off, p = [0], 0, 0
    indices, last = [], []
    for n, npg in zip(kv_lens, n_pages):
        for pg in range(npg):
            pid = int(perm[p])
            p += 1
            indices.append(pid)
            lo, hi = off + pg * page_size, min(off + (pg + 1) * page_size, off + n)
            cache[pid, 0, :hi - lo] = k[lo:hi]
            cache[pid, 1, :hi - lo] = v[lo:hi]
        kvp.append(kvp[-1] + npg)
        last.append(0 if n == 0 else (n - 1) % page_size + 1)
        off += n
    i32 = dict(dtype=torch.int32, device=k.device)
    return cache, torch.tensor(kvp, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32)


def run_wrapper(kind, backend, q, k, v, qo_lens, kv_lens, mi, *, page_size=4, return_lse=True, **plan_kw):
    """Plan and run a paged or ragged wrapper with the multi-item arguments ``mi`` (a dict)."""
    device, (hq, hkv, d) = q.device, (q.shape[1], *k.shape[1:])
    qo = torch.tensor(indptr(qo_lens), dtype=torch.int32, device=device)
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    dt = q.dtype
    if kind == "paged":
        cache, kvp, idx, last = to_paged(k, v, kv_lens, page_size)
        w = attncore.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(qo, kvp, idx, last, hq, hkv, d, page_size, causal=True, q_data_type=dt, **mi, **plan_kw)
        return w, w.run(q, cache, return_lse=return_lse)
    kvi = torch.tensor(indptr(kv_lens), dtype=torch.int32, device=device)
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(qo, kvi, hq, hkv, d, causal=True, q_data_type=dt, **mi, **plan_kw)
    return w, w.run(q, k, v, return_lse=return_lse)


def mi_args(prefixes, tps, stride, device, *, max_item=True, stride_as_tensor=False):
    d = dict(prefix_len_ptr=torch.tensor(prefixes, dtype=torch.int64).to(torch.uint32).to(device),
             token_pos_in_items_ptr=flat_positions(tps, stride).to(device),
             token_pos_in_items_len=torch.tensor(stride, dtype=torch.uint32) if stride_as_tensor else stride)
    if max_item:
        d["max_item_len_ptr"] = torch.tensor([max(t) if t else 0 for t in tps]).to(torch.uint16).to(device)
    return d


def check_against_golden(out, lse, q, k, v, qo_lens, kv_lens, prefixes, tps, dtype, *, window_left=-1,
                         logits_soft_cap=0.0, pos_encoding_mode="NONE"):
    qi, ki = indptr(qo_lens), indptr(kv_lens)
    for i in range(len(qo_lens)):
        qs, ks = slice(qi[i], qi[i + 1]), slice(ki[i], ki[i + 1])
        keep = golden_visible(qo_lens[i], kv_lens[i], prefixes[i], tps[i])
        go, gl, bo, bl = golden_and_baseline(q[qs].cpu(), k[ks].cpu(), v[ks].cpu(), dtype=dtype, mask=keep,
                                             window_left=window_left, logits_soft_cap=logits_soft_cap,
                                             pos_encoding_mode=pos_encoding_mode)
        err = max_error(out[qs], go)
        assert err <= tolerance(bo, go, dtype), (i, err, tolerance(bo, go, dtype))
        if lse is not None:
            lerr = max_error(lse[qs], gl)
            assert lerr <= tolerance(bl, gl, dtype, kind="lse"), (i, lerr)
            seen = keep.any(dim=1)
            if window_left < 0:  # a row that sees nothing (a delimiter with no prefix): out 0, LSE -inf
                assert torch.isneginf(lse[qs][~seen].cpu()).all()
                assert (out[qs][~seen].cpu() == 0).all()


# ----------------------------------------------------------------------------- CPU: reference and triton
CPU_BACKENDS = ["reference", "triton"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_random_batches(backend, kind, dtype):
    qo_lens, kv_lens, prefixes, tps, stride = make_batch(11 + (kind == "paged"), 4)
    q, k, v = build_inputs(qo_lens, kv_lens, dtype, "cpu", seed=3)
    mi = mi_args(prefixes, tps, stride, "cpu")
    w, (out, lse) = run_wrapper(kind, backend, q, k, v, qo_lens, kv_lens, mi, page_size=3)
    assert w.backend == backend and w.problem.mask == "custom"
    check_against_golden(out, lse, q, k, v, qo_lens, kv_lens, prefixes, tps, dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", ["no_prefix", "one_item", "one_token_items", "append", "prefix_rows"])
def test_edge_cases(backend, case):
    kw = dict(no_prefix=dict(prefix_range=(0, 0)),
              one_item=dict(items_range=(1, 1), item_len_range=(3, 9)),
              one_token_items=dict(item_len_range=(1, 1), items_range=(2, 6)),
              append=dict(append=True),
              prefix_rows=dict(prefix_range=(3, 6)))[case]
    qo_lens, kv_lens, prefixes, tps, stride = make_batch(sum(map(ord, case)), 3, **kw)
    if case == "prefix_rows":  # queries start inside the prefix: those rows are plain causal
        qo_lens = [min(kv, len(t) + 3) for kv, t in zip(kv_lens, tps)]
    dtype = torch.float32
    q, k, v = build_inputs(qo_lens, kv_lens, dtype, "cpu", seed=5)
    for kind in ("paged", "ragged"):
        _, (out, lse) = run_wrapper(kind, backend, q, k, v, qo_lens, kv_lens, mi_args(prefixes, tps, stride, "cpu"))
        check_against_golden(out, lse, q, k, v, qo_lens, kv_lens, prefixes, tps, dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_window_softcap_rope_no_lse(backend):
    """The window ANDs with the multi-item mask (as FlashInfer's kernel does); soft cap and RoPE are
    orthogonal; return_lse=False gives the output alone."""
    qo_lens, kv_lens, prefixes, tps, stride = make_batch(7, 2, prefix_range=(4, 8), item_len_range=(3, 6))
    dtype = torch.float16
    q, k, v = build_inputs(qo_lens, kv_lens, dtype, "cpu", seed=9)
    mi = mi_args(prefixes, tps, stride, "cpu", max_item=False, stride_as_tensor=True)
    _, out = run_wrapper("paged", backend, q, k, v, qo_lens, kv_lens, mi, return_lse=False, window_left=5,
                         logits_soft_cap=8.0, pos_encoding_mode="ROPE_LLAMA")
    assert isinstance(out, torch.Tensor)
    check_against_golden(out, None, q, k, v, qo_lens, kv_lens, prefixes, tps, dtype, window_left=5,
                         logits_soft_cap=8.0, pos_encoding_mode="ROPE_LLAMA")


def test_flashinfer_test_layout():
    """FlashInfer 0.2.14's own test's arguments (batch of one, a 0-D prefix length, positions shorter
    than token_pos_in_items_len, which is a uint32 tensor; uint16 positions and max item length)."""
    prefix, tp = 17, list(range(17)) + list(range(19)) + [0]
    qo_len, kv_len = 37, 54
    q, k, v = build_inputs([qo_len], [kv_len], torch.float16, "cpu", seed=2)
    mi = dict(prefix_len_ptr=torch.tensor(prefix).to(torch.uint32),  # 0-D, as FlashInfer's test passes it
              token_pos_in_items_ptr=torch.tensor(tp).to(torch.uint16),
              token_pos_in_items_len=torch.tensor(100).to(torch.uint32),
              max_item_len_ptr=torch.tensor([18]).to(torch.uint16))
    _, (out, lse) = run_wrapper("paged", "reference", q, k, v, [qo_len], [kv_len], mi, page_size=5)
    check_against_golden(out, lse, q, k, v, [qo_len], [kv_len], [prefix], [tp], torch.float16)
    # its reference is single prefill with the dense mask flattened (FlashInfer reads view(-1))
    flat = golden_visible(qo_len, kv_len, prefix, tp).reshape(-1)
    single = attncore.single_prefill_with_kv_cache(q, k, v, custom_mask=flat, causal=True, backend="reference")
    assert torch.equal(single, attncore.single_prefill_with_kv_cache(q, k, v, custom_mask=flat.view(qo_len, kv_len),
                                                                     backend="reference"))
    assert max_error(single, out.double()) <= 1e-3
    with pytest.raises(ValueError, match=r"custom_mask: got shape \[1997\], expected \[1998\]"):
        attncore.single_prefill_with_kv_cache(q, k, v, custom_mask=flat[1:], backend="reference")


def test_mask_matches_flashinfer_rule_and_plan_is_replayed():
    """The planned mask equals the golden's; a legacy forward() (which plans again) keeps the items;
    a plan without them is an ordinary causal plan again."""
    from attncore.core.mask import unpack_bits

    qo_lens, kv_lens, prefixes, tps, stride = make_batch(3, 3)
    q, k, v = build_inputs(qo_lens, kv_lens, torch.float32, "cpu")
    w, (out, _) = run_wrapper("ragged", "reference", q, k, v, qo_lens, kv_lens, mi_args(prefixes, tps, stride, "cpu"))
    meta = w._planned.meta
    for i in range(3):
        bits = unpack_bits(meta.packed_mask, meta.mask_indptr_host[i], qo_lens[i] * kv_lens[i])
        assert torch.equal(bits.reshape(qo_lens[i], kv_lens[i]), golden_visible(qo_lens[i], kv_lens[i], prefixes[i],
                                                                                   tps[i]))
    again = w.forward(q, k, v, causal=True, logits_soft_cap=0.0)
    assert torch.equal(again, out)
    qo = torch.tensor(indptr(qo_lens), dtype=torch.int32)
    w.plan(qo, torch.tensor(indptr(kv_lens), dtype=torch.int32), HQ, HKV, D, causal=True, q_data_type=torch.float32)
    assert w._planned.meta.mask == "causal"


def test_backend_without_custom_masks_is_refused(clean_registry):
    from attncore.core.capabilities import Capabilities
    from attncore.reference.backend import ReferenceBackend

    class NoCustom(ReferenceBackend):
        name = "nocustom"
        capabilities = (Capabilities(ops=frozenset({"batch_prefill_paged", "batch_prefill_ragged"}),
                                     devices=frozenset({"cpu"}), q_dtypes=frozenset({torch.float32}),
                                     kv_dtypes=frozenset({torch.float32}), masks=frozenset({"none", "causal"})),)

    clean_registry.register_backend(NoCustom())
    qo_lens, kv_lens, prefixes, tps, stride = make_batch(5, 2)
    q, k, v = build_inputs(qo_lens, kv_lens, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"backend 'nocustom' cannot run batch_prefill_ragged .*: "
                                         r"mask: got custom, supported \{causal, none\}$"):
        run_wrapper("ragged", "nocustom", q, k, v, qo_lens, kv_lens, mi_args(prefixes, tps, stride, "cpu"))


def relayout(kv, qo, seed):
    """Another prefix and item layout of a request of the same lengths (a truncated last item is
    still well formed: its positions count up from its delimiter)."""
    rng = random.Random(seed)
    prefix = rng.randint(0, kv - qo)
    tp = []
    while len(tp) < kv - prefix:
        tp += list(range(rng.randint(1, 5) + 1))
    return prefix, tp[:kv - prefix]


def _graph_wrapper(device, b, mask_bytes):
    i32 = dict(dtype=torch.int32, device=device)
    return attncore.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(8 << 20, dtype=torch.uint8, device=device), "NHD", True, torch.zeros(b + 1, **i32),
        torch.zeros(b + 1, **i32), torch.zeros(mask_bytes, dtype=torch.uint8, device=device),
        torch.zeros(b + 1, **i32), backend="reference" if device == "cpu" else "auto")


def test_cuda_graph_buffers():
    """In CUDA-graph mode the mask goes into custom_mask_buf / mask_indptr_buf, and a buffer too small
    for it is an error naming custom_mask_buf."""
    qo_lens, kv_lens, prefixes, tps, stride = make_batch(3, 3)
    q, k, v = build_inputs(qo_lens, kv_lens, torch.float32, "cpu")
    w = _graph_wrapper("cpu", 3, 4096)
    i32 = dict(dtype=torch.int32)
    plan_args = (torch.tensor(indptr(qo_lens), **i32), torch.tensor(indptr(kv_lens), **i32), HQ, HKV, D)
    w.plan(*plan_args, causal=True, q_data_type=torch.float32, **mi_args(prefixes, tps, stride, "cpu"))
    assert w._planned.meta.packed_mask.data_ptr() == w._graph_buffers["custom_mask"].data_ptr()
    out, lse = w.run(q, k, v, return_lse=True)
    check_against_golden(out, lse, q, k, v, qo_lens, kv_lens, prefixes, tps, torch.float32)
    with pytest.raises(ValueError, match=r"custom_mask_buf: needs \d+ entries but the CUDA-graph buffer holds 4"):
        _graph_wrapper("cpu", 3, 4).plan(*plan_args, causal=True, q_data_type=torch.float32,
                                         **mi_args(prefixes, tps, stride, "cpu"))


# ----------------------------------------------------------------------------- bad input
def _plan_ragged(qo_lens, kv_lens, **kw):
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="reference")
    kw.setdefault("causal", True)
    w.plan(torch.tensor(indptr(qo_lens), dtype=torch.int32), torch.tensor(indptr(kv_lens), dtype=torch.int32),
           HQ, HKV, D, q_data_type=torch.float32, **kw)
    return w


def _plan_paged(qo_lens, kv_lens, page_size=4, **kw):
    w = attncore.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="reference")
    n_pages = [(n + page_size - 1) // page_size for n in kv_lens]
    last = [0 if n == 0 else (n - 1) % page_size + 1 for n in kv_lens]
    w.plan(torch.tensor(indptr(qo_lens), dtype=torch.int32), torch.tensor(indptr(n_pages), dtype=torch.int32),
           torch.arange(sum(n_pages), dtype=torch.int32), torch.tensor(last, dtype=torch.int32), HQ, HKV, D,
           page_size, causal=kw.pop("causal", True), q_data_type=torch.float32, **kw)
    return w


U16, U32 = torch.uint16, torch.uint32


def _t(x, dtype=torch.int32):
    return torch.tensor(x, dtype=torch.int64).to(dtype)


# two requests: prefix 2 then items [0,1,2,0,1] (kv 7), prefix 1 then [0,1,0] (kv 4); stride 6
GOOD = dict(prefix_len_ptr=_t([2, 1], U32), token_pos_in_items_ptr=_t([0, 1, 2, 0, 1, 0, 0, 1, 0, 0, 0, 0], U16),
            token_pos_in_items_len=6, max_item_len_ptr=_t([2, 1], U16))
QO, KV = [5, 3], [7, 4]

BAD = [
    (dict(prefix_len_ptr=None), ValueError,
     r"token_pos_in_items_ptr, max_item_len_ptr, token_pos_in_items_len: given without prefix_len_ptr"),
    (dict(token_pos_in_items_ptr=None), ValueError, r"token_pos_in_items_ptr: missing"),
    (dict(causal=False), ValueError, r"causal: got False with multi-item scoring .*pass causal=True"),
    (dict(custom_mask=torch.ones(5 * 7 + 3 * 4, dtype=torch.bool)), ValueError,
     r"custom_mask: cannot be combined with multi-item scoring"),
    (dict(prefix_len_ptr=_t([2.0, 1.0], torch.float32)), TypeError, r"prefix_len_ptr: got dtype fp32, expected u8"),
    (dict(prefix_len_ptr=_t([2])), ValueError, r"prefix_len_ptr: got 1 entries, expected batch_size = 2"),
    (dict(prefix_len_ptr=torch.tensor(2, dtype=torch.int32)), ValueError,
     r"prefix_len_ptr: got 1 entries, expected batch_size = 2"),  # 0-D: one request's only
    (dict(prefix_len_ptr=_t([2, -1])), ValueError, r"prefix_len_ptr: got a negative entry -1"),
    (dict(prefix_len_ptr=_t([8, 1])), ValueError, r"prefix_len_ptr\[0\]: got 8, more than request 0's kv_len 7"),
    (dict(token_pos_in_items_ptr=_t([[0, 1]])), ValueError, r"token_pos_in_items_ptr: got a 2-D tensor"),
    (dict(token_pos_in_items_ptr=_t([0, 1, 2, 0, 1, 0, 0, 1])), ValueError,
     r"token_pos_in_items_ptr: got 8 entries, but request 1 reads \[6, 9\)"),
    (dict(token_pos_in_items_len=4), ValueError,
     r"token_pos_in_items_len: got 4, but request 0 has kv_len - prefix_len = 5 tokens"),
    (dict(token_pos_in_items_len=6.0), TypeError, r"token_pos_in_items_len: got 6.0, expected an int"),
    (dict(token_pos_in_items_len=True), TypeError, r"token_pos_in_items_len: got True, expected an int"),
    (dict(token_pos_in_items_len=-1), ValueError, r"token_pos_in_items_len: got -1, expected an int >= 0"),
    (dict(token_pos_in_items_len=torch.tensor([6, 6])), TypeError,
     r"token_pos_in_items_len: got a tensor of shape \[2\]"),
    (dict(max_item_len_ptr=_t([1, 1], U16)), ValueError,
     r"max_item_len_ptr\[0\]: got 1, but request 0 has a token at position 2"),
    (dict(max_item_len_ptr=_t([2, 1, 1], U16)), ValueError, r"max_item_len_ptr: got 3 entries"),
]


@pytest.mark.parametrize("plan", [_plan_ragged, _plan_paged])
@pytest.mark.parametrize("change,exc,msg", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(plan, change, exc, msg):
    where = "Paged" if plan is _plan_paged else "Ragged"
    with pytest.raises(exc, match=rf"BatchPrefillWith{where}KVCacheWrapper\.plan: {msg}"):
        plan(QO, KV, **{**GOOD, **change})


def test_good_input_plans_and_qo_longer_than_kv_is_refused():
    _plan_ragged(QO, KV, **GOOD)
    _plan_paged(QO, KV, **GOOD)
    with pytest.raises(ValueError, match=r"request 1 has qo_len 5 > kv_len 4"):
        _plan_ragged([5, 5], KV, **GOOD)
    # a batch of one reads its positions from offset 0: token_pos_in_items_len may be 0 then
    _plan_ragged([5], [7], prefix_len_ptr=_t([2]), token_pos_in_items_ptr=_t([0, 1, 2, 0, 1], U16))


# ----------------------------------------------------------------------------- GPU (the task-giver's H100)
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_fa2", "triton", "auto"])
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_gpu(backend, kind):
    """Scoring-sized requests (a long prefix, many short items) on the GPU backends, in bf16 (fp16: the
    FlashInfer-shaped case below)."""
    dtype = torch.bfloat16
    qo_lens, kv_lens, prefixes, tps, stride = make_batch(
        21, 3, prefix_range=(0, 200), items_range=(1, 16), item_len_range=(1, 16), pad=17)
    q, k, v = build_inputs(qo_lens, kv_lens, dtype, "cuda", seed=4)
    w, (out, lse) = run_wrapper(kind, backend, q, k, v, qo_lens, kv_lens, mi_args(prefixes, tps, stride, "cuda"),
                                page_size=16)
    torch.cuda.synchronize()
    assert w.problem.mask == "custom"
    check_against_golden(out, lse, q, k, v, qo_lens, kv_lens, prefixes, tps, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_fa2", "triton"])
def test_gpu_flashinfer_case_rope_softcap(backend):
    """FlashInfer 0.2.14's multi-item test shape (kv 97, qo 81, prefix 16, 80-token item, Hq 32 / Hkv 4,
    head_dim 128, ROPE_LLAMA, soft cap 30) in fp16."""
    prefix, tp = 16, list(range(80)) + [0]
    q, k, v = build_inputs([81], [97], torch.float16, "cuda", seed=8, hq=32, hkv=4, d=128)
    mi = dict(prefix_len_ptr=_t([prefix], U32).cuda(), token_pos_in_items_ptr=_t(tp, U16).cuda(),
              token_pos_in_items_len=torch.tensor(97).to(U32).cuda(), max_item_len_ptr=_t([79], U16).cuda())
    _, (out, lse) = run_wrapper("paged", backend, q, k, v, [81], [97], mi, page_size=5,
                                pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=30.0)
    check_against_golden(out, lse, q, k, v, [81], [97], [prefix], [tp], torch.float16,
                         logits_soft_cap=30.0, pos_encoding_mode="ROPE_LLAMA")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_fa2", "triton"])
def test_gpu_graph_replay_follows_new_items(backend):
    """A captured run replays the items of the latest plan (same lengths, another layout)."""
    qo_lens, kv_lens, prefixes, tps, stride = make_batch(31, 4, prefix_range=(0, 64), items_range=(1, 12))
    dtype, dev = torch.bfloat16, "cuda"
    q, k, v = build_inputs(qo_lens, kv_lens, dtype, dev, seed=6)
    w = attncore.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device=dev), "NHD", True,
        *(torch.zeros(5, dtype=torch.int32, device=dev) for _ in range(2)),
        torch.zeros(1 << 16, dtype=torch.uint8, device=dev), torch.zeros(5, dtype=torch.int32, device=dev),
        backend=backend)
    i32 = dict(dtype=torch.int32, device=dev)
    plan_args = (torch.tensor(indptr(qo_lens), **i32), torch.tensor(indptr(kv_lens), **i32), HQ, HKV, D)
    w.plan(*plan_args, causal=True, q_data_type=dtype, return_lse=True, **mi_args(prefixes, tps, stride, dev))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
    w.run(q, k, v, out=out, lse=lse, return_lse=True)  # warm-up compiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, k, v, out=out, lse=lse, return_lse=True)
    layouts = [relayout(kv, qo, 100 + i) for i, (kv, qo) in enumerate(zip(kv_lens, qo_lens))]
    prefixes2, tps2 = [p for p, _ in layouts], [t for _, t in layouts]
    stride2 = max(len(t) for t in tps2)
    w.plan(*plan_args, causal=True, q_data_type=dtype, return_lse=True, **mi_args(prefixes2, tps2, stride2, dev))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    check_against_golden(out, lse, q, k, v, qo_lens, kv_lens, prefixes2, tps2, dtype)
