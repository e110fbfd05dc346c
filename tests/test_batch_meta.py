"""BatchMeta's constructors (ragged, paged, from_block_tables): the one place a batch is built, by the
API and by attncore.testing.  What they guarantee a backend: kv lengths on the host and the device (and
that the two agree), the resolved mask, the window (in ``params``), int32 contiguous index tensors on
the batch's device; and errors naming the argument on bad input."""

import dataclasses

import pytest
import torch

import attncore
from attncore.core.backend import MASKS, AttnParams, BatchMeta
from attncore.core.problem import AttentionProblem

I32 = dict(dtype=torch.int32)
PARAMS = AttnParams(sm_scale=0.125, window_left=5)


def _i32(values):
    return torch.tensor(values, **I32)


def _agree(meta: BatchMeta):
    """kv_lens on the device and on the host say the same, and the index tensors are as promised."""
    assert meta.kv_lens.dtype == torch.int32 and meta.kv_lens.is_contiguous()
    assert meta.kv_lens.tolist() == meta.kv_lens_host
    assert len(meta.kv_lens_host) == meta.batch_size
    assert meta.qo_indptr.tolist() == meta.qo_indptr_host
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "mask_indptr"):
        t = getattr(meta, name)
        if t is not None:
            assert t.dtype == torch.int32 and t.is_contiguous() and t.device == meta.device, name
    assert meta.mask in MASKS
    assert (meta.mask == "custom") == (meta.packed_mask is not None) == (meta.mask_indptr is not None)


# ----------------------------------------------------------------------------- resolve_mask
@pytest.mark.parametrize("mask,decode,want", [
    ("none", False, "none"), ("causal", False, "causal"), ("custom", False, "custom"),
    ("none", True, "causal"), ("causal", True, "causal"), ("custom", True, "custom"),
])
def test_resolve_mask(mask, decode, want):
    assert BatchMeta.resolve_mask(mask, decode=decode) == want


def test_resolve_mask_rejects_unknown_kind():
    with pytest.raises(ValueError, match=r"mask: got 'top_left', expected one of \['none', 'causal', 'custom'\]"):
        BatchMeta.resolve_mask("top_left", decode=False)


# ----------------------------------------------------------------------------- ragged
def test_ragged_from_tensors():
    meta = BatchMeta.ragged(_i32([0, 3, 3, 8]), _i32([0, 4, 10, 10]), device="cpu", params=PARAMS, causal=True)
    _agree(meta)
    assert meta.kv_lens_host == [4, 6, 0] and meta.kv_indptr_host == [0, 4, 10, 10]
    assert meta.qo_lens_host == [3, 0, 5] and meta.batch_size == 3
    assert meta.mask == "causal" and meta.params.window_left == 5 and meta.device == torch.device("cpu")
    assert meta.kv_indices is None and meta.block_tables is None


def test_ragged_from_host_lists_and_single_prefill_shape():
    meta = BatchMeta.ragged(qo_indptr_host=[0, 2], kv_indptr_host=[0, 9], device="cpu", params=PARAMS)
    _agree(meta)
    assert meta.kv_lens_host == [9] and meta.kv_indptr.tolist() == [0, 9] and meta.mask == "none"


def test_ragged_custom_mask_wins_over_causal():
    qo, kv = [0, 2, 5], [0, 3, 7]
    bits = torch.rand(2 * 3 + 3 * 4) < 0.5
    meta = BatchMeta.ragged(_i32(qo), _i32(kv), device="cpu", params=PARAMS, causal=True, custom_mask=bits)
    _agree(meta)
    assert meta.mask == "custom"
    assert meta.mask_indptr_host == [0, 1, 3]  # ceil(6 / 8), ceil(12 / 8) bytes, each request byte-aligned
    from attncore.quantization import packbits

    first = packbits(bits[:6], bitorder="little")
    assert torch.equal(meta.packed_mask[:1], first)
    again = BatchMeta.ragged(_i32(qo), _i32(kv), device="cpu", params=PARAMS, packed_custom_mask=meta.packed_mask)
    assert torch.equal(again.packed_mask, meta.packed_mask) and again.mask_indptr_host == [0, 1, 3]


def test_ragged_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"kv_indptr: not non-decreasing: kv_indptr\[1\] = 4 > kv_indptr\[2\] = 2"):
        BatchMeta.ragged(_i32([0, 1, 2]), _i32([0, 4, 2]), device="cpu", params=PARAMS)
    with pytest.raises(ValueError, match=r"kv_indptr: got kv_indptr\[0\] = 4, expected 0"):
        BatchMeta.ragged(_i32([0, 1, 2]), _i32([4, 5, 6]), device="cpu", params=PARAMS)
    with pytest.raises(ValueError, match=r"kv_indptr: got 2 entries, expected 3 \(batch_size \+ 1\)"):
        BatchMeta.ragged(_i32([0, 1, 2]), _i32([0, 2]), device="cpu", params=PARAMS)
    with pytest.raises(ValueError, match=r"kv_indptr: got 2 entries, expected 3 \(batch_size \+ 1\)"):
        BatchMeta.ragged(qo_indptr_host=[0, 1, 2], kv_indptr_host=[0, 2], device="cpu", params=PARAMS)
    with pytest.raises(TypeError, match=r"qo_indptr: got dtype int64, expected int32"):
        BatchMeta.ragged(torch.tensor([0, 1]), _i32([0, 1]), device="cpu", params=PARAMS)
    with pytest.raises(ValueError, match=r"custom_mask: got 5 elements, expected 6"):
        BatchMeta.ragged(_i32([0, 2]), _i32([0, 3]), device="cpu", params=PARAMS,
                         custom_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"packed_custom_mask: got 2 bytes, expected 1"):
        BatchMeta.ragged(_i32([0, 2]), _i32([0, 3]), device="cpu", params=PARAMS,
                         packed_custom_mask=torch.zeros(2, dtype=torch.uint8))


def test_ragged_into_cuda_graph_buffers():
    bufs = {"qo_indptr": torch.zeros(4, **I32), "kv_indptr": torch.zeros(4, **I32)}
    meta = BatchMeta.ragged(_i32([0, 1, 3]), _i32([0, 5, 6]), device="cpu", params=PARAMS,
                            custom_mask=torch.ones(5 + 2, dtype=torch.bool), buffers=bufs)
    _agree(meta)
    assert meta.qo_indptr.data_ptr() == bufs["qo_indptr"].data_ptr()
    assert meta.kv_indptr.data_ptr() == bufs["kv_indptr"].data_ptr()
    assert meta.kv_lens.data_ptr() == bufs["kv_lens"].data_ptr()  # allocated on first use
    assert meta.packed_mask.data_ptr() == bufs["custom_mask"].data_ptr()
    assert meta.mask_indptr.data_ptr() == bufs["qk_indptr"].data_ptr()
    with pytest.raises(ValueError, match=r"qo_indptr_buf: needs 5 entries but the CUDA-graph buffer holds 4"):
        BatchMeta.ragged(_i32([0, 1, 2, 3, 4]), _i32([0, 1, 2, 3, 4]), device="cpu", params=PARAMS, buffers=bufs)


# ----------------------------------------------------------------------------- paged
def _page_table():
    # request 0: 2 pages, 3 tokens on the last (19); request 1: none; request 2: 1 full page (16)
    return _i32([0, 2, 2, 3]), _i32([7, 1, 4, 99]), _i32([3, 0, 16])


def test_paged_fields():
    indptr, indices, last = _page_table()
    meta = BatchMeta.paged([0, 4, 4, 5], indptr, indices, last, 16, device="cpu", params=PARAMS, causal=True)
    _agree(meta)
    assert meta.kv_lens_host == [19, 0, 16] and meta.kv_indptr_host == [0, 2, 2, 3]
    assert meta.page_size == 16 and meta.max_page_id == 7 and meta.mask == "causal"
    assert meta.kv_last_page_len.tolist() == [3, 0, 16] and meta.kv_indices.tolist() == [7, 1, 4, 99]
    assert meta.q_len_per_req == 1 and meta.fixed_split_size is None and not meta.disable_split_kv


def test_paged_decode_is_causal_and_keeps_hints():
    indptr, indices, last = _page_table()
    meta = BatchMeta.paged([0, 2, 4, 6], indptr, indices, last, 16, device="cpu", params=PARAMS, decode=True,
                           q_len_per_req=2, fixed_split_size=8, disable_split_kv=1)
    _agree(meta)
    assert meta.mask == "causal" and meta.q_len_per_req == 2
    assert meta.fixed_split_size == 8 and meta.disable_split_kv is True
    custom = BatchMeta.paged([0, 1, 2, 3], indptr, indices, last, 16, device="cpu", params=PARAMS, decode=True,
                             custom_mask=torch.ones(19 + 0 + 16, dtype=torch.bool))
    assert custom.mask == "custom" and custom.mask_indptr_host == [0, 3, 3, 5]


def test_paged_bad_input_names_the_argument():
    indptr, indices, last = _page_table()
    kw = dict(device="cpu", params=PARAMS)
    with pytest.raises(ValueError, match=r"page_size: got 0, expected a positive int"):
        BatchMeta.paged([0, 1, 2, 3], indptr, indices, last, 0, **kw)
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len: got paged_kv_last_page_len\[0\] = 17, expected "
                                         r"1 <= last_page_len <= page_size \(16\)"):
        BatchMeta.paged([0, 1, 2, 3], indptr, indices, _i32([17, 0, 1]), 16, **kw)
    with pytest.raises(ValueError, match=r"last_page_len: got last_page_len\[1\] = 20 for an empty request"):
        BatchMeta.paged([0, 1, 2, 3], indptr, indices, _i32([1, 20, 1]), 16,
                        names=("indptr", "indices", "last_page_len"), **kw)
    with pytest.raises(ValueError, match=r"paged_kv_indices: got 2 entries, expected at least paged_kv_indptr\[-1\] = 3"):
        BatchMeta.paged([0, 1, 2, 3], indptr, indices[:2], last, 16, **kw)
    with pytest.raises(ValueError, match=r"paged_kv_indices: got a negative page id -1"):
        BatchMeta.paged([0, 1, 2, 3], indptr, _i32([0, -1, 2]), last, 16, **kw)
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len: got shape \[2\], expected \[3\]"):
        BatchMeta.paged([0, 1, 2, 3], indptr, indices, last[:2], 16, **kw)
    with pytest.raises(ValueError, match=r"last_page_len: request 2 holds 1 tokens, fewer than q_len_per_req \(2\)"):
        BatchMeta.paged([0, 2, 4, 6], indptr, indices, _i32([3, 0, 1]), 16, decode=True, q_len_per_req=2,
                        names=("indptr", "indices", "last_page_len"), **kw)


# ----------------------------------------------------------------------------- block tables (xqa)
def test_block_tables_reads_and_checks_seq_lens():
    bt = _i32([[0, 1, 2], [3, 4, 5]])
    seq = torch.tensor([9, 4], dtype=torch.uint32)
    meta = BatchMeta.from_block_tables(bt, seq, 9, 4, device="cpu", params=PARAMS, q_len_per_req=2)
    _agree(meta)
    assert meta.kv_lens_host == [9, 4] and meta.mask == "causal" and meta.qo_indptr_host == [0, 2, 4]
    assert meta.kv_lens.data_ptr() == seq.data_ptr()  # a view of the caller's tensor: graph replays follow it
    assert meta.block_tables is bt and meta.seq_lens is seq and meta.max_seq_len == 9 and meta.page_size == 4
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[1\] = 1 \(request 1\), expected q_len_per_req "
                                         r"\(2\) <= seq_len <= max_seq_len \(9\); each block_tables row holds 12 tokens"):
        BatchMeta.from_block_tables(bt, _i32([9, 1]), 9, 4, device="cpu", params=PARAMS, q_len_per_req=2)


def test_block_tables_without_reading_seq_lens():
    """As inside CUDA-graph capture: nothing read back; host_kv_lens() reads and checks later."""
    bt = _i32([[0, 1, 2], [3, 4, 5]])
    seq = _i32([13, 5])
    meta = BatchMeta.from_block_tables(bt, seq, 9, 4, device="cpu", params=PARAMS, read_seq_lens=False)
    assert meta.kv_lens_host is None and meta.kv_lens.tolist() == [13, 5] and meta.mask == "causal"
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[0\] = 13 \(request 0\)"):
        meta.host_kv_lens()
    seq[0] = 9
    assert meta.host_kv_lens() == [9, 5] == meta.kv_lens_host
    # a custom mask is laid out by the lengths: they are read then
    custom = BatchMeta.from_block_tables(bt, seq, 9, 4, device="cpu", params=PARAMS, read_seq_lens=False,
                                         custom_mask=torch.ones(14, dtype=torch.bool))
    assert custom.kv_lens_host == [9, 5] and custom.mask == "custom" and custom.mask_indptr_host == [0, 2, 3]


# ----------------------------------------------------------------------------- the window and the mask: one home each
def test_params_have_no_causal():
    p = AttnParams(sm_scale=1.0, causal=True)
    assert "causal" not in {f.name for f in dataclasses.fields(AttnParams)}
    with pytest.raises(AttributeError, match="BatchMeta.mask"):
        p.causal  # noqa: B018
    assert AttnParams(0.5, True, 0.0, 3) == AttnParams(sm_scale=0.5, window_left=3)  # the old positional order


def test_api_problem_mask_and_window_come_from_the_batch():
    ws = torch.empty(1 << 16, dtype=torch.uint8)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, backend="reference")
    w.plan(_i32([0, 1, 2]), _i32([0, 1]), _i32([3, 5]), 4, 2, 16, 8, window_left=2, q_data_type=torch.float16)
    meta, problem = w._planned.meta, w.problem
    assert meta.mask == problem.mask == "causal" and meta.params.window_left == problem.window_left == 2
    r = attncore.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="reference")
    r.plan(_i32([0, 2]), _i32([0, 3]), 4, 2, 16, causal=True, custom_mask=torch.ones(6, dtype=torch.bool))
    assert r._planned.meta.mask == r.problem.mask == "custom"
    r.plan(_i32([0, 2]), _i32([0, 3]), 4, 2, 16, causal=True)
    assert r._planned.meta.mask == r.problem.mask == "causal" and r._planned.meta.params.window_left == -1


# ----------------------------------------------------------------------------- built by hand (tests, benchmarks)
def test_by_hand_batch_is_completed():
    """A BatchMeta built directly gets what the constructors guarantee."""
    ragged = BatchMeta(batch_size=2, qo_indptr=torch.tensor([0, 1, 3]), qo_indptr_host=[0, 1, 3],
                       kv_indptr=_i32([0, 4, 6]), params=AttnParams(sm_scale=1.0, causal=True))
    _agree(ragged)
    assert ragged.kv_lens_host == [4, 2] and ragged.kv_indptr_host == [0, 4, 6] and ragged.mask == "causal"
    paged = BatchMeta(batch_size=2, qo_indptr=_i32([0, 3, 6]), qo_indptr_host=[0, 3, 6], kv_indptr=_i32([0, 2, 3]),
                      kv_indptr_host=[0, 2, 3], kv_indices=_i32([5, 6, 7]), kv_last_page_len=_i32([1, 8]), page_size=8,
                      q_len_per_req=3)
    _agree(paged)
    assert paged.kv_lens_host == [9, 8] and paged.mask == "causal"  # q_len_per_req > 1: decode, causal
    from_tensor = BatchMeta(batch_size=1, qo_indptr=_i32([0, 1]), qo_indptr_host=[0, 1], kv_lens=_i32([7]),
                            packed_mask=torch.zeros(1, dtype=torch.uint8), mask_indptr=_i32([0, 1]))
    assert from_tensor.kv_lens_host == [7] and from_tensor.mask == "custom"
    blocks = BatchMeta(batch_size=1, qo_indptr=_i32([0, 1]), qo_indptr_host=[0, 1], block_tables=_i32([[0, 1]]),
                       seq_lens=_i32([5]), page_size=4)
    assert blocks.kv_lens.tolist() == [5] and blocks.max_seq_len == 5 and blocks.mask == "causal"
    with pytest.raises(ValueError, match=r"BatchMeta: no KV lengths"):
        BatchMeta(batch_size=1, qo_indptr=_i32([0, 1]), qo_indptr_host=[0, 1])


def test_by_hand_batch_plans_like_a_constructed_one():
    """The reference backend gives the same bits for a batch built by hand and by the constructor."""
    be = attncore.core.registry.get_entry("reference").backend
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 16, generator=g).half()
    k = torch.randn(9, 2, 16, generator=g).half()
    p = AttentionProblem(op="batch_prefill_ragged", num_qo_heads=4, num_kv_heads=2, head_dim_qk=16, head_dim_vo=16,
                         mask="causal", window_left=2)
    params = AttnParams(sm_scale=0.25, window_left=2)
    built = BatchMeta.ragged(_i32([0, 2, 5]), _i32([0, 4, 9]), device="cpu", params=params, causal=True)
    by_hand = BatchMeta(batch_size=2, qo_indptr=_i32([0, 2, 5]), qo_indptr_host=[0, 2, 5], kv_indptr=_i32([0, 4, 9]),
                        params=AttnParams(sm_scale=0.25, causal=True, window_left=2))
    outs = []
    for meta in (built, by_hand):
        out = torch.empty_like(q)
        be.run(be.plan(p, meta), attncore.core.backend.RunArgs(q=q, k=k, v=k, out=out))
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
