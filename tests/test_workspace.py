"""attncore.core.workspace: plans carve their scratch from the caller's workspace (issue 15 item 2)."""

import pytest
import torch

from attncore.core.workspace import ALIGN, WorkspaceLayout, WorkspaceTooSmall


def _layout():
    lay = WorkspaceLayout("demo")
    lay.add("o_part", (3, 5, 7), torch.float32)
    lay.add("work", (11, 5), torch.int32)
    lay.add("flag", (1,), torch.uint8)
    return lay


def test_regions_are_aligned_disjoint_views_of_the_buffer():
    lay = _layout()
    buf = torch.zeros(lay.nbytes + ALIGN, dtype=torch.uint8)
    views = lay.carve(buf)
    assert views["o_part"].shape == (3, 5, 7) and views["o_part"].dtype == torch.float32
    assert views["work"].shape == (11, 5) and views["work"].dtype == torch.int32
    spans = []
    for v in views.values():
        assert v.data_ptr() % ALIGN == 0
        assert buf.data_ptr() <= v.data_ptr() < buf.data_ptr() + buf.numel()
        spans.append((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    views["work"].fill_(7)  # writes land in the caller's buffer
    assert int((buf == 7).sum()) == 11 * 5


def test_same_layout_same_addresses():
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    a, b = _layout().carve(buf), _layout().carve(buf)
    assert all(a[k].data_ptr() == b[k].data_ptr() for k in a)


def test_too_small_names_the_bytes_and_regions():
    lay = _layout()
    with pytest.raises(WorkspaceTooSmall, match=r"float_workspace_buffer: demo needs \d+ bytes .*o_part \[3, 5, 7\]"):
        lay.carve(torch.zeros(64, dtype=torch.uint8))


def test_no_buffer_allocates_exactly_the_layout():
    views = _layout().carve(None, device=torch.device("cpu"))
    assert set(views) == {"o_part", "work", "flag"}
    with pytest.raises(ValueError, match="needs a device"):
        _layout().carve(None)


def test_region_named_twice_is_an_error():
    lay = WorkspaceLayout("demo")
    lay.add("x", (1,), torch.float32)
    with pytest.raises(ValueError, match="'x' added twice"):
        lay.add("x", (2,), torch.float32)
