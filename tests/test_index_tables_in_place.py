"""Index tables too large for the int workspace (FlashInfer's 8 MiB: a page table of 2M ids) are read in place
when the caller's tensor already is int32 and contiguous on the device, as FlashInfer reads it; anything else
still has to fit, and the error names the bytes and both remedies."""

import re

import pytest
import torch

import attncore
from attncore.core import uploads
from attncore.core.workspace import WorkspaceTooSmall

from tests.test_uploads import D, H, HKV, PAGE, _check_golden


def test_a_table_that_does_not_fit_is_read_in_place_and_the_rest_carved():
    iw = torch.empty(256, dtype=torch.uint8)  # 64 ints
    big = torch.arange(1000, dtype=torch.int32)
    views, rest, staged = uploads.index_tables(iw, torch.device("cpu"), [[0, 5], big, [7, 8, 9]])
    assert views[1] is big
    assert views[0].tolist() == [0, 5] and views[2].tolist() == [7, 8, 9]
    assert views[0].data_ptr() >= iw.data_ptr() and views[2].data_ptr() < iw.data_ptr() + iw.numel()
    assert rest.numel() <= iw.numel() - 20 and staged is not None


@pytest.mark.parametrize("part, says", [
    (list(range(1000)), "4020 bytes (without the ones read in place: 4020), the buffer has 256"),
    (torch.arange(1000, dtype=torch.int64), "the page table as an int32 tensor on cpu (read in place)"),
    (torch.arange(2000, dtype=torch.int32)[::2], "pass a larger int_workspace_buffer"),
])
def test_what_cannot_be_read_in_place_must_fit(part, says):
    iw = torch.empty(256, dtype=torch.uint8)
    with pytest.raises(WorkspaceTooSmall, match=r"^int_workspace_buffer: the batch's index tables need .*" + re.escape(says)):
        uploads.index_tables(iw, torch.device("cpu"), [[0, 5], part, [7, 8, 9]])


def test_decode_with_a_page_table_larger_than_the_int_workspace_matches_the_golden():
    g = torch.Generator().manual_seed(7)
    b, pages = 3, 40  # 120 page ids: 480 bytes, the int workspace holds 256
    indptr = torch.arange(b + 1, dtype=torch.int32) * pages
    indices = torch.randperm(b * pages, generator=g).to(torch.int32)
    last = torch.randint(1, PAGE + 1, (b,), generator=g, dtype=torch.int32)
    cache = torch.randn(b * pages, 2, PAGE, HKV, D, generator=g, dtype=torch.float16)
    q = torch.randn(b, H, D, generator=g, dtype=torch.float16)
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="reference")
    w.reset_workspace_buffer(torch.empty(1 << 20, dtype=torch.uint8), torch.empty(256, dtype=torch.uint8))
    w.plan(indptr, indices, last, H, HKV, D, PAGE, q_data_type=torch.float16)
    out = w.run(q, cache)
    kv_lens = [(pages - 1) * PAGE + int(x) for x in last]
    _check_golden(out, q, cache, indptr.tolist(), indices, kv_lens, 1)
    strided = torch.stack([indices, indices], 1)[:, 0]  # the same ids, not contiguous: copied, so they must fit
    with pytest.raises(WorkspaceTooSmall, match="read in place"):
        w.plan(indptr, strided, last, H, HKV, D, PAGE, q_data_type=torch.float16)
