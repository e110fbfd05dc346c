"""attncore.page: page-table utilities, converters, append and gather."""

import pytest
import torch

from attncore.page import (
    append_paged_kv_cache,
    block_tables_to_indptr,
    gather_paged_kv,
    get_batch_indices_positions,
    get_seq_lens,
    indptr_to_block_tables,
    unpack_paged_kv_cache,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
I32 = torch.int32


def _t(values, device="cpu", dtype=I32):
    return torch.tensor(values, dtype=dtype, device=device)


def random_page_table(seed, batch, page_size, max_len=40, spare_pages=3):
    """Random lengths (incl. 0, exactly full pages), pages a random permutation of the pool."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    for _ in range(batch):
        kind = int(torch.randint(0, 4, (1,), generator=g))
        if kind == 0:
            lens.append(0)
        elif kind == 1:
            lens.append(page_size * int(torch.randint(1, 4, (1,), generator=g)))  # last page full
        else:
            lens.append(int(torch.randint(1, max_len + 1, (1,), generator=g)))
    npages = [(n + page_size - 1) // page_size for n in lens]
    total = sum(npages) + spare_pages
    perm = torch.randperm(total, generator=g)
    indptr = [0]
    for n in npages:
        indptr.append(indptr[-1] + n)
    indices = perm[: indptr[-1]].tolist()
    last = [0 if n == 0 else n - (p - 1) * page_size for n, p in zip(lens, npages)]
    return lens, indptr, indices, last, total


def make_cache(num_pages, page_size, heads, dim, layout, form, dtype, device):
    shape = [num_pages, page_size, heads, dim] if layout == "NHD" else [num_pages, heads, page_size, dim]
    if form == "5d":
        return torch.zeros([shape[0], 2] + shape[1:], dtype=dtype, device=device)
    return (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


# ------------------------------------------------------------------------------------------------
# get_seq_lens
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_get_seq_lens_known(device):
    indptr = _t([0, 2, 2, 5, 6], device)
    last = _t([3, 0, 4, 1], device)
    out = get_seq_lens(indptr, last, 4)
    assert out.dtype == torch.int32 and out.device.type == device
    assert out.tolist() == [7, 0, 12, 1]
    # an empty request's last_page_len is ignored
    assert get_seq_lens(_t([0, 0, 1], device), _t([4, 2], device), 4).tolist() == [0, 2]
    assert get_seq_lens(_t([0], device), _t([], device), 4).tolist() == []


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("seed", range(4))
def test_get_seq_lens_random(seed, page_size):
    lens, indptr, _, last, _ = random_page_table(seed, 9, page_size)
    assert get_seq_lens(_t(indptr), _t(last), page_size).tolist() == lens
    assert get_seq_lens(_t(indptr, dtype=torch.int64), _t(last, dtype=torch.int64), page_size).tolist() == lens


# ------------------------------------------------------------------------------------------------
# converters
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(6))
def test_block_tables_round_trip(seed, page_size, device):
    lens, indptr, indices, last, _ = random_page_table(seed, 1 + seed, page_size)
    bt, seq_lens = indptr_to_block_tables(_t(indptr, device), _t(indices, device), _t(last, device), page_size)
    npages = [b - a for a, b in zip(indptr[:-1], indptr[1:])]
    assert bt.dtype == torch.int32 and seq_lens.dtype == torch.int32 and bt.device.type == device
    assert bt.shape == (len(lens), max(npages))
    assert seq_lens.tolist() == lens
    for i, n in enumerate(npages):
        assert bt[i, :n].tolist() == indices[indptr[i] : indptr[i + 1]]
        assert (bt[i, n:] == 0).all()
    ip2, idx2, last2 = block_tables_to_indptr(bt, seq_lens, page_size)
    assert ip2.dtype == idx2.dtype == last2.dtype == torch.int32
    assert ip2.tolist() == indptr and idx2.tolist() == indices and last2.tolist() == last
    assert all((1 <= l <= page_size) if n else l == 0 for l, n in zip(last2.tolist(), npages))
    # uint32 seq_lens (xqa form), wider table with a pad value
    bt3, _ = indptr_to_block_tables(
        _t(indptr, device), _t(indices, device), _t(last, device), page_size, max_pages=max(npages) + 2, pad_value=-1
    )
    assert bt3.shape[1] == max(npages) + 2 and torch.equal(bt3[:, : max(npages)][bt != 0], bt[bt != 0])
    assert all((bt3[i, n:] == -1).all() for i, n in enumerate(npages))
    ip4, idx4, last4 = block_tables_to_indptr(bt3, seq_lens.to(torch.uint32), page_size)
    assert ip4.tolist() == indptr and idx4.tolist() == indices and last4.tolist() == last


def test_block_tables_to_indptr_known():
    bt = _t([[7, 3, 9], [5, 0, 0], [2, 4, 0], [8, 8, 8]])
    ip, idx, last = block_tables_to_indptr(bt, _t([9, 4, 5, 0]), 4)
    assert ip.tolist() == [0, 3, 4, 6, 6]
    assert idx.tolist() == [7, 3, 9, 5, 2, 4]
    assert last.tolist() == [1, 4, 1, 0]
    # page_size 1: every page holds one token, last page always full
    ip, idx, last = block_tables_to_indptr(bt, _t([3, 1, 2, 0]), 1)
    assert ip.tolist() == [0, 3, 4, 6, 6] and last.tolist() == [1, 1, 1, 0]
    # all requests empty
    bt0, sl0 = indptr_to_block_tables(_t([0, 0, 0]), _t([]), _t([0, 0]), 8)
    assert bt0.shape == (2, 0) and sl0.tolist() == [0, 0]


# ------------------------------------------------------------------------------------------------
# get_batch_indices_positions
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_get_batch_indices_positions_known(device):
    append_indptr = _t([0, 1, 1, 4, 6], device)
    seq_lens = _t([5, 2, 3, 10], device)  # lengths after the append
    b, p = get_batch_indices_positions(append_indptr, seq_lens, 6)
    assert b.dtype == p.dtype == torch.int32 and b.device.type == device
    assert b.tolist() == [0, 2, 2, 2, 3, 3]
    assert p.tolist() == [4, 0, 1, 2, 8, 9]
    b, p = get_batch_indices_positions(_t([0, 0], device), _t([3], device), 0)
    assert b.numel() == 0 and p.numel() == 0


# ------------------------------------------------------------------------------------------------
# append + gather
# ------------------------------------------------------------------------------------------------


def _reference_gather(k_cache, indptr, indices, lens, page_size, layout):
    rows = []
    for i, n in enumerate(lens):
        for t in range(n):
            page = indices[indptr[i] + t // page_size]
            rows.append(k_cache[page, t % page_size] if layout == "NHD" else k_cache[page, :, t % page_size])
    return torch.stack(rows) if rows else None


@pytest.fixture(params=["torch", "kernel"])
def append_path(request, monkeypatch):
    """How append_paged_kv_cache writes: the torch composition, or the Triton kernel (a GPU's path; on the CPU
    through Triton's interpreter)."""
    from attncore.kernels import interpreting
    from attncore.page import cache

    if request.param == "torch":
        monkeypatch.setattr(cache, "_use_kernel", lambda *a: False)
    elif not torch.cuda.is_available():
        if not interpreting():
            pytest.skip("the append kernel on the CPU runs through Triton's interpreter (TRITON_INTERPRET unset)")
        monkeypatch.setattr(cache, "_use_kernel", lambda *a: True)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["5d", "tuple"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("seed", range(3))
def test_append_then_gather(seed, page_size, layout, form, device, append_path):
    heads, dim = 2, 8
    lens, indptr, indices, last, num_pages = random_page_table(1000 + seed, 6, page_size)
    g = torch.Generator().manual_seed(seed)
    nnz_kv = sum(lens)
    k_all = torch.randn(nnz_kv, heads, dim, generator=g).to(torch.float16)
    v_all = torch.randn(nnz_kv, heads, dim, generator=g).to(torch.float16)
    cache = make_cache(num_pages, page_size, heads, dim, layout, form, torch.float16, device)
    args = (_t(indices, device), _t(indptr, device), _t(last, device))

    # two appends: a prefix of each request (prefill), then the rest (decode/extend)
    splits = [int(torch.randint(0, n + 1, (1,), generator=g)) for n in lens]
    tok_off = [0]
    for n in lens:
        tok_off.append(tok_off[-1] + n)
    for phase in range(2):
        rows, counts, after = [], [], []
        for i, n in enumerate(lens):
            lo, hi = (0, splits[i]) if phase == 0 else (splits[i], n)
            rows += list(range(tok_off[i] + lo, tok_off[i] + hi))
            counts.append(hi - lo)
            after.append(hi)
        append_indptr = [0]
        for c in counts:
            append_indptr.append(append_indptr[-1] + c)
        b, p = get_batch_indices_positions(_t(append_indptr, device), _t(after, device), len(rows))
        rows_t = torch.tensor(rows, dtype=torch.int64)
        # the page table already holds the full sequences: positions < kv_len is all that's required
        append_paged_kv_cache(
            k_all[rows_t].to(device), v_all[rows_t].to(device), b, p, cache, *args, kv_layout=layout
        )

    k, v, tok_indptr = gather_paged_kv(cache, _t(indptr, device), _t(indices, device), _t(last, device), layout)
    assert tok_indptr.dtype == torch.int32 and tok_indptr.tolist() == tok_off
    assert k.shape == (nnz_kv, heads, dim) and k.dtype == torch.float16 and k.device.type == device
    assert torch.equal(k.cpu(), k_all) and torch.equal(v.cpu(), v_all)
    # the 4-D views of the cache hold the tokens where the page-table rules say
    k_cache, v_cache = unpack_paged_kv_cache(cache, layout)
    if nnz_kv:
        ref = _reference_gather(k_cache.cpu(), indptr, indices, lens, page_size, layout)
        assert torch.equal(ref, k_all)
        ref = _reference_gather(v_cache.cpu(), indptr, indices, lens, page_size, layout)
        assert torch.equal(ref, v_all)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_append_gather_dtypes(dtype, device, append_path):
    page_size, heads, dim = 4, 3, 4
    indptr, indices, last = [0, 2, 3], [3, 0, 1], [1, 4]
    cache = torch.zeros(4, 2, page_size, heads, dim, dtype=dtype, device=device)
    b, p = get_batch_indices_positions(_t([0, 5, 9], device), _t([5, 4], device), 9)
    k_new = torch.randn(9, heads, dim).to(dtype).to(device)
    v_new = torch.randn(9, heads, dim).to(dtype).to(device)
    append_paged_kv_cache(k_new, v_new, b, p, cache, _t(indices, device), _t(indptr, device), _t(last, device))
    k, v, ti = gather_paged_kv(cache, _t(indptr, device), _t(indices, device), _t(last, device))
    assert k.dtype == dtype and ti.tolist() == [0, 5, 9]
    assert torch.equal(k.float(), k_new.float()) and torch.equal(v.float(), v_new.float())
    assert torch.equal(cache[3, 0, 0].float(), k_new[0].float())  # token 0 of request 0 -> page 3 slot 0
    assert torch.equal(cache[1, 1, 3].float(), v_new[8].float())  # token 3 of request 1 -> page 1 slot 3
    assert (cache[2] == 0).all()  # an unused page is untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads, dk, dv, idx_dtype", [(3, 8, 8, I32), (40, 128, 64, torch.int64), (1, 1, 5, I32)])
def test_append_kernel_matches_the_torch_composition(heads, dk, dv, idx_dtype, layout, device, monkeypatch):
    """The kernel (a GPU's path; Triton's interpreter on the CPU) writes what the torch composition writes:
    K and V of other head dims, rows with a larger stride (k and v sliced from one projection), int64
    index tensors, more heads than one program takes (grid axis 1), and no other slot touched."""
    from attncore.kernels import interpreting
    from attncore.page import cache as cache_mod

    if device == "cpu" and not interpreting():
        pytest.skip("the append kernel on the CPU runs through Triton's interpreter (TRITON_INTERPRET unset)")
    page_size = 5
    lens, indptr, indices, last, num_pages = random_page_table(77 + heads, 5, page_size)
    nnz = sum(lens)
    g = torch.Generator().manual_seed(heads)
    proj = torch.randn(nnz, heads * (dk + dv) + 3, generator=g).to(torch.float16).to(device)
    k = proj[:, :heads * dk].view(nnz, heads, dk)  # row stride heads*(dk+dv)+3, not heads*dk
    v = proj[:, heads * dk:heads * (dk + dv)].view(nnz, heads, dv)
    shape = (num_pages, page_size, heads) if layout == "NHD" else (num_pages, heads, page_size)
    b, p = get_batch_indices_positions(_t([0] + torch.tensor(lens).cumsum(0).tolist(), device), _t(lens, device), nnz)
    tables = (_t(indices, device, idx_dtype), _t(indptr, device, idx_dtype), _t(last, device, idx_dtype))
    out = {}
    for path in ("torch", "kernel"):
        monkeypatch.setattr(cache_mod, "_use_kernel", lambda *a, _k=path == "kernel": _k)
        caches = tuple(torch.full(shape + (d,), -7.0, dtype=torch.float16, device=device) for d in (dk, dv))
        append_paged_kv_cache(k, v, b.to(idx_dtype), p.to(idx_dtype), caches, *tables, kv_layout=layout)
        out[path] = caches
    assert nnz and all(torch.equal(a, b) for a, b in zip(out["torch"], out["kernel"]))
    assert (out["kernel"][0] == -7).any()  # spare pages untouched


@pytest.mark.parametrize("device", DEVICES)
def test_append_kernel_skips_tokens_outside_the_tables_when_unchecked(device, monkeypatch):
    """Under CUDA-graph capture nothing is read back, so the values go unchecked: a token whose request, page
    slot or page id falls outside the tables is then not written (never out of bounds); the others are."""
    from attncore.kernels import interpreting
    from attncore.page import cache as cache_mod

    if device == "cpu" and not interpreting():
        pytest.skip("the append kernel on the CPU runs through Triton's interpreter (TRITON_INTERPRET unset)")
    monkeypatch.setattr(cache_mod, "_use_kernel", lambda *a: True)
    monkeypatch.setattr(cache_mod, "_check_values", lambda: False)
    cache = torch.zeros(3, 2, 2, 1, 4, device=device)
    # request 1's second page id (7) is outside the 3 pages; tokens: ok, bad request, page slot past the
    # table (position 6 of request 0), bad page id, negative position
    b, p = _t([0, 2, 0, 1, 0], device), _t([1, 0, 6, 2, -1], device)
    new = torch.arange(1, 6, dtype=torch.float32, device=device)[:, None, None].expand(5, 1, 4).contiguous()
    append_paged_kv_cache(new, new, b, p, cache, _t([2, 0, 7], device), _t([0, 1, 3], device), _t([2, 2], device))
    assert cache[2, :, 1].flatten().tolist() == [1.0] * 8  # token 0: page 2, slot 1 (K and V)
    assert int((cache != 0).sum()) == 8


def test_unpack_paged_kv_cache_views():
    cache = torch.randn(3, 2, 4, 2, 8)
    k, v = unpack_paged_kv_cache(cache, "NHD")
    assert k.shape == (3, 4, 2, 8) and k.data_ptr() == cache.data_ptr()
    assert torch.equal(v, cache[:, 1])
    pair = (torch.zeros(3, 2, 4, 8), torch.ones(3, 2, 4, 8))
    k, v = unpack_paged_kv_cache(pair, "HND")
    assert k is pair[0] and v is pair[1]
    k, v = unpack_paged_kv_cache(list(pair), "HND")
    assert k is pair[0]


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


def test_unpack_bad_input():
    with pytest.raises(ValueError, match=r"kv_layout: got 'NDH'.*'NHD' or 'HND'"):
        unpack_paged_kv_cache(torch.zeros(1, 2, 1, 1, 1), "NDH")
    with pytest.raises(ValueError, match=r"paged_kv_cache: got a tensor of shape \(1, 2, 1, 1\).*5-D"):
        unpack_paged_kv_cache(torch.zeros(1, 2, 1, 1), "NHD")
    with pytest.raises(ValueError, match=r"paged_kv_cache: got a tensor of shape \(1, 3, 1, 1, 1\)"):
        unpack_paged_kv_cache(torch.zeros(1, 3, 1, 1, 1), "NHD")
    with pytest.raises(ValueError, match=r"k_cache shape \(1, 2, 1, 1\) and v_cache shape \(1, 3, 1, 1\)"):
        unpack_paged_kv_cache((torch.zeros(1, 2, 1, 1), torch.zeros(1, 3, 1, 1)), "NHD")
    with pytest.raises(ValueError, match=r"\(v_cache\): got shape \(1, 2, 1\).*4-D"):
        unpack_paged_kv_cache((torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1)), "NHD")
    with pytest.raises(TypeError, match=r"k_cache dtype torch.float32 and v_cache dtype torch.float16"):
        unpack_paged_kv_cache((torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1).half()), "NHD")
    with pytest.raises(TypeError, match=r"paged_kv_cache: got a tuple of \['Tensor'\]"):
        unpack_paged_kv_cache((torch.zeros(1, 2, 1, 1),), "NHD")
    with pytest.raises(TypeError, match=r"paged_kv_cache: got NoneType"):
        unpack_paged_kv_cache(None, "NHD")


def test_page_table_bad_input():
    ip, last = _t([0, 2, 3]), _t([3, 1])
    with pytest.raises(ValueError, match=r"page_size: got 0; accepted: an int >= 1"):
        get_seq_lens(ip, last, 0)
    with pytest.raises(TypeError, match=r"page_size: got float"):
        get_seq_lens(ip, last, 4.0)
    with pytest.raises(TypeError, match=r"kv_indptr: got dtype torch.float32"):
        get_seq_lens(ip.float(), last, 4)
    with pytest.raises(ValueError, match=r"kv_indptr: got kv_indptr\[0\] = 1; accepted: kv_indptr\[0\] == 0"):
        get_seq_lens(_t([1, 2, 3]), last, 4)
    with pytest.raises(ValueError, match=r"kv_indptr: got a decreasing step at 0 \(0 -> -1\)"):
        get_seq_lens(_t([0, -1, 3]), last, 4)
    with pytest.raises(ValueError, match=r"kv_last_page_len: got shape \(3,\); accepted: \[2\]"):
        get_seq_lens(ip, _t([1, 1, 1]), 4)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\] = 5 .*1 <= kv_last_page_len <= page_size = 4"):
        get_seq_lens(ip, _t([5, 1]), 4)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\] = 0 for a request with 1 pages"):
        get_seq_lens(ip, _t([1, 0]), 4)
    with pytest.raises(ValueError, match=r"kv_indptr: got kv_indptr\[-1\] = 3; accepted: at most kv_indices.numel\(\) = 2"):
        indptr_to_block_tables(ip, _t([0, 1]), last, 4)
    with pytest.raises(ValueError, match=r"max_pages: got 1; accepted: None or an int >= 2"):
        indptr_to_block_tables(ip, _t([0, 1, 2]), last, 4, max_pages=1)
    with pytest.raises(ValueError, match=r"seq_lens: got a length needing 3 pages of 4 tokens.*block_tables.shape\[1\] = 2"):
        block_tables_to_indptr(_t([[0, 1], [2, 3]]), _t([9, 1]), 4)
    with pytest.raises(ValueError, match=r"seq_lens: got a negative length -1"):
        block_tables_to_indptr(_t([[0, 1], [2, 3]]), _t([-1, 1]), 4)
    with pytest.raises(ValueError, match=r"seq_lens: got shape \(3,\); accepted: \[2\]"):
        block_tables_to_indptr(_t([[0, 1], [2, 3]]), _t([1, 1, 1]), 4)
    with pytest.raises(ValueError, match=r"block_tables: got shape \(4,\)"):
        block_tables_to_indptr(_t([0, 1, 2, 3]), _t([1, 1]), 4)
    with pytest.raises(ValueError, match=r"nnz: got 5; accepted: append_indptr\[-1\] = 6"):
        get_batch_indices_positions(_t([0, 2, 6]), _t([3, 4]), 5)
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[0\] = 1 for a request appending 2 tokens"):
        get_batch_indices_positions(_t([0, 2, 6]), _t([1, 4]), 6)


def test_append_bad_input():
    cache = torch.zeros(4, 2, 4, 2, 8)
    indices, indptr, last = _t([0, 1, 2]), _t([0, 2, 3]), _t([3, 2])
    k = torch.randn(3, 2, 8)
    b, p = _t([0, 0, 1]), _t([5, 6, 1])
    append_paged_kv_cache(k, k, b, p, cache, indices, indptr, last)  # valid
    with pytest.raises(TypeError, match=r"append_key: got dtype torch.float16; accepted: the cache dtype torch.float32"):
        append_paged_kv_cache(k.half(), k, b, p, cache, indices, indptr, last)
    with pytest.raises(ValueError, match=r"append_value: got shape \(3, 2, 4\); accepted: \[nnz, 2, 8\]"):
        append_paged_kv_cache(k, k[..., :4], b, p, cache, indices, indptr, last)
    with pytest.raises(ValueError, match=r"append_value: got shape \(2, 2, 8\); accepted: \[3, 2, 8\]"):
        append_paged_kv_cache(k, k[:2], b, p, cache, indices, indptr, last)
    with pytest.raises(ValueError, match=r"positions: got shape \(2,\); accepted: \[3\]"):
        append_paged_kv_cache(k, k, b, p[:2], cache, indices, indptr, last)
    with pytest.raises(ValueError, match=r"positions: got positions\[1\] = 7 for request 0 of kv length 7"):
        append_paged_kv_cache(k, k, b, _t([5, 7, 1]), cache, indices, indptr, last)
    with pytest.raises(ValueError, match=r"batch_indices: got values in \[0, 2\]; accepted: \[0, 2\)"):
        append_paged_kv_cache(k, k, _t([0, 0, 2]), p, cache, indices, indptr, last)
    with pytest.raises(ValueError, match=r"same cache slot"):
        append_paged_kv_cache(k, k, b, _t([5, 5, 1]), cache, indices, indptr, last)
    with pytest.raises(ValueError, match=r"kv_indices: got page ids in \[0, 4\]; accepted: page ids in \[0, 4\)"):
        append_paged_kv_cache(k, k, b, p, cache, _t([0, 1, 4]), indptr, last)
    with pytest.raises(TypeError, match=r"batch_indices: got dtype torch.float32"):
        append_paged_kv_cache(k, k, b.float(), p, cache, indices, indptr, last)
    with pytest.raises(ValueError, match=r"kv_layout: got 'nhd'"):
        append_paged_kv_cache(k, k, b, p, cache, indices, indptr, last, kv_layout="nhd")
    with pytest.raises(ValueError, match=r"kv_indices: got page ids in \[0, 9\]"):
        gather_paged_kv(cache, indptr, _t([0, 1, 9]), last)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("verdict", ["torch", "kernel"])
def test_append_one_read_verdict_matches_the_full_checks(device, verdict):
    """append_paged_kv_cache reads every value rule in one device read (``_append_values_ok``; on a GPU the
    check kernel, ``_append_values_ok_kernel``) and runs the naming checks only when that says no: the verdict
    must be False exactly when a check raises, over random valid page tables and tokens and each of them
    corrupted one way."""
    from attncore.kernels import interpreting
    from attncore.page.cache import _append_values_ok, _append_values_ok_kernel, _check_append_values
    from attncore.page.checks import _check_page_table

    if verdict == "kernel" and device == "cpu" and not interpreting():
        pytest.skip("the check kernel on the CPU runs through Triton's interpreter (TRITON_INTERPRET unset)")
    ok_fn = _append_values_ok_kernel if verdict == "kernel" else _append_values_ok

    g = torch.Generator().manual_seed(5)
    rnd = lambda n: int(torch.randint(n, (1,), generator=g))  # noqa: E731
    seen = {True: 0, False: 0}
    for case in range(300):
        page_size, num_pages, batch = 1 + rnd(5), 12 + rnd(8), 1 + rnd(3)
        perm = torch.randperm(num_pages, generator=g)
        npages = [rnd(4) for _ in range(batch)]
        indptr = [0]
        for n in npages:
            indptr.append(indptr[-1] + n)
        indices = perm[: indptr[-1]].tolist() + [rnd(num_pages) for _ in range(rnd(3))]  # slack past the end
        last = [1 + rnd(page_size) if n else 0 for n in npages]
        lens = [max(n - 1, 0) * page_size + l for n, l in zip(npages, last)]
        toks = [(r, q) for r in range(batch) for q in range(lens[r]) if rnd(3) == 0]
        if not toks:
            toks = [(0, 0)]  # out of range when request 0 is empty: a case for the checks
        b, p = [t[0] for t in toks], [t[1] for t in toks]
        indices = indices or [rnd(num_pages)]
        how = case % 16  # 0 and 9-15: left valid (unless request 0 is empty), 1-8: one corruption each
        if how == 1:
            indices[rnd(max(indptr[-1], 1))] = num_pages + rnd(3)
        elif how == 2:
            indices[0] = -1
        elif how == 3:
            last[rnd(batch)] = page_size + 1
        elif how == 4:
            b[rnd(len(b))] = batch
        elif how == 5:
            p[rnd(len(p))] = -1
        elif how == 6:
            b.append(b[0]), p.append(p[0])  # the same slot twice
        elif how == 7:
            indptr[-1] = len(indices) + 1
        elif how == 8 and batch > 1:
            indptr[1] = indptr[2] + 1  # a decreasing step
        t = lambda x: _t(x, device)  # noqa: E731
        args = (t(indptr), t(indices), t(last), page_size)
        try:
            _check_page_table(*args, num_pages)
            _check_append_values(*args, t(b), t(p), len(b))
            valid = True
        except ValueError:
            valid = False
        assert ok_fn(*args, num_pages, t(b), t(p)) == valid, (case, indptr, indices, last, b, p)
        seen[valid] += 1
    assert min(seen.values()) > 50, seen  # both verdicts exercised


@pytest.mark.parametrize("device", DEVICES)
def test_append_check_kernel_finds_a_shared_slot_across_blocks(device):
    """The check kernel compares every pair of tokens block by block: a slot written twice by tokens in
    different blocks (of 128) is found; the same tokens without it pass."""
    from attncore.kernels import interpreting
    from attncore.page.cache import _append_values_ok_kernel

    if device == "cpu" and not interpreting():
        pytest.skip("the check kernel on the CPU runs through Triton's interpreter (TRITON_INTERPRET unset)")
    page_size, n = 4, 300
    indptr, indices, last = _t([0, 75], device), _t(list(range(74, -1, -1)), device), _t([4], device)
    b, p = torch.zeros(n, dtype=I32), torch.randperm(n, generator=torch.Generator().manual_seed(3)).to(I32)
    args = (indptr, indices, last, page_size, 80)
    assert _append_values_ok_kernel(*args, b.to(device), p.to(device))
    p[290] = p[5]
    assert not _append_values_ok_kernel(*args, b.to(device), p.to(device))
    # a page table far longer than the tokens (programs without tokens): the pair is still found
    args = (_t([0, 600], device), _t(list(range(600)), device), _t([4], device), page_size, 700)
    assert _append_values_ok_kernel(*args, _t([0, 0], device), _t([2396, 7], device))
    assert not _append_values_ok_kernel(*args, _t([0, 0], device), _t([2396, 2396], device))


@pytest.mark.parametrize("device", DEVICES)
def test_append_reads_the_device_once_per_new_or_changed_index_tensors(device, monkeypatch):
    """A model appends on every layer with the same index tensors: only the first append reads their values;
    a new tensor (equal values or not), an in-place change, or inference tensors are checked again, and
    the tokens always land where the tensors' current values put them."""
    import attncore.page.cache as cache_mod

    reads = []
    for name in ("_append_values_ok", "_append_values_ok_kernel"):  # the torch composition's, the kernel's
        real = getattr(cache_mod, name)
        monkeypatch.setattr(cache_mod, name, lambda *a, _real=real: reads.append(1) or _real(*a))
    indices, indptr, last = _t([0, 1, 2], device), _t([0, 2, 3], device), _t([3, 2], device)
    b, p = _t([0, 0, 1], device), _t([5, 6, 1], device)
    g = torch.Generator().manual_seed(11)
    layers = [torch.zeros(4, 2, 4, 2, 8, device=device) for _ in range(3)]
    ks = [torch.randn(3, 2, 8, generator=g).to(device) for _ in layers]
    for cache, k in zip(layers, ks):
        append_paged_kv_cache(k, -k, b, p, cache, indices, indptr, last)
    assert len(reads) == 1
    for cache, k in zip(layers, ks):  # page 1 slots 1 and 2 (positions 5, 6), page 2 slot 1
        assert torch.equal(cache[1, 0, 1:3], k[:2]) and torch.equal(cache[2, 0, 1], k[2])
        assert torch.equal(cache[1, 1, 1:3], -k[:2])
    append_paged_kv_cache(ks[0], ks[0], b.clone(), p, layers[0], indices, indptr, last)  # a new, equal tensor
    assert len(reads) == 2
    p[1] = 7  # in place: past request 0's kv length 7
    with pytest.raises(ValueError, match=r"positions: got positions\[1\] = 7 for request 0 of kv length 7"):
        append_paged_kv_cache(ks[0], ks[0], b, p, layers[0], indices, indptr, last)
    p[1] = 4
    append_paged_kv_cache(ks[1], ks[1], b, p, layers[0], indices, indptr, last)
    assert torch.equal(layers[0][1, 0, 0], ks[1][1])  # position 4: page 1, slot 0
    n = len(reads)
    if device == "cpu":  # a write the version counter does not see: not checked again, but its values are used
        p.numpy()[1] = 3
        append_paged_kv_cache(ks[2], ks[2], b, p, layers[0], indices, indptr, last)
        assert len(reads) == n and torch.equal(layers[0][0, 0, 3], ks[2][1])  # position 3: page 0, slot 3
    with torch.inference_mode():
        bi, pi = _t([0, 0, 1], device), _t([5, 6, 1], device)
        for _ in range(2):
            append_paged_kv_cache(ks[0], ks[0], bi, pi, layers[0], indices, indptr, last)
    assert len(reads) == n + 2
