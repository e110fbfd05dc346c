"""attncore.quantization: packbits / segment_packbits, bit-exact against numpy.packbits."""

import numpy as np
import pytest
import torch

from attncore.quantization import packbits, segment_packbits

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BITORDERS = ["big", "little"]
LENGTHS = [0, 1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 1001]


def _np_pack(x: torch.Tensor, bitorder: str) -> np.ndarray:
    return np.packbits(x.cpu().numpy().ravel(), bitorder=bitorder)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bitorder", BITORDERS)
@pytest.mark.parametrize("n", LENGTHS)
def test_packbits_matches_numpy(n, bitorder, device):
    g = torch.Generator().manual_seed(n)
    x = (torch.rand(n, generator=g) < 0.5).to(device)
    y = packbits(x, bitorder=bitorder)
    assert y.dtype == torch.uint8 and y.device.type == device
    assert y.shape == ((n + 7) // 8,)
    np.testing.assert_array_equal(y.cpu().numpy(), _np_pack(x, bitorder))


def test_packbits_default_is_big_and_known_bytes():
    x = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert packbits(x).tolist() == [128, 192]
    assert packbits(x, bitorder="little").tolist() == [1, 3]
    assert packbits(torch.ones(8, dtype=torch.bool), "little").tolist() == [255]


@pytest.mark.parametrize("bitorder", BITORDERS)
def test_packbits_multidim_and_integer_input(bitorder):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 3, (5, 3, 7), generator=g, dtype=torch.int64)  # 0/1/2: nonzero is 1
    expected = np.packbits((x.numpy() != 0).ravel(), bitorder=bitorder)
    np.testing.assert_array_equal(packbits(x, bitorder).numpy(), expected)
    xb = x != 0
    np.testing.assert_array_equal(packbits(xb, bitorder).numpy(), _np_pack(xb, bitorder))
    # non-contiguous input is flattened in logical (row-major) order
    xt = xb.transpose(0, 2)
    np.testing.assert_array_equal(packbits(xt, bitorder).numpy(), _np_pack(xt, bitorder))


def _segment_expected(x: torch.Tensor, indptr, bitorder):
    chunks, new = [], [0]
    for a, b in zip(indptr[:-1], indptr[1:]):
        p = _np_pack(x[a:b], bitorder)
        chunks.append(p)
        new.append(new[-1] + p.size)
    packed = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return packed, np.array(new, dtype=np.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bitorder", BITORDERS)
@pytest.mark.parametrize("seed", range(8))
def test_segment_packbits_random(seed, bitorder, device):
    g = torch.Generator().manual_seed(100 + seed)
    nseg = int(torch.randint(0, 9, (1,), generator=g))
    choices = torch.tensor([0, 0, 1, 7, 8, 9, 16, 17, 30])
    lens = choices[torch.randint(0, len(choices), (nseg,), generator=g)].tolist()
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32).tolist()
    x = torch.rand(indptr[-1], generator=g) < 0.5
    y, new_indptr = segment_packbits(
        x.to(device), torch.tensor(indptr, dtype=torch.int32, device=device), bitorder=bitorder
    )
    exp_y, exp_indptr = _segment_expected(x, indptr, bitorder)
    assert y.dtype == torch.uint8 and new_indptr.dtype == torch.int32
    assert y.device.type == device and new_indptr.device.type == device
    np.testing.assert_array_equal(y.cpu().numpy(), exp_y)
    np.testing.assert_array_equal(new_indptr.cpu().numpy(), exp_indptr)


def test_segment_packbits_edge_cases():
    x = torch.tensor([1, 1, 0, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    # a single segment equals packbits
    y, ip = segment_packbits(x, torch.tensor([0, 9], dtype=torch.int32), "little")
    assert torch.equal(y, packbits(x, "little")) and ip.tolist() == [0, 2]
    # every segment starts on a byte boundary
    y, ip = segment_packbits(x, torch.tensor([0, 3, 3, 9], dtype=torch.int64), "little")
    assert y.tolist() == [0b011, 0b100001] and ip.tolist() == [0, 1, 1, 2]
    # no segments / empty input
    y, ip = segment_packbits(torch.zeros(0, dtype=torch.bool), torch.tensor([0], dtype=torch.int32))
    assert y.numel() == 0 and ip.tolist() == [0]
    y, ip = segment_packbits(x, torch.tensor([0, 0, 0], dtype=torch.int32))
    assert y.numel() == 0 and ip.tolist() == [0, 0, 0]
    # segments need not start at 0 nor cover x entirely
    y, ip = segment_packbits(x, torch.tensor([1, 4], dtype=torch.int32), "big")
    np.testing.assert_array_equal(y.numpy(), np.packbits(x.numpy()[1:4]))
    assert ip.tolist() == [0, 1]


def test_packbits_bad_input():
    x = torch.ones(9, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"bitorder.*'middle'.*'big' or 'little'"):
        packbits(x, bitorder="middle")
    with pytest.raises(TypeError, match=r"x: got dtype torch.float32.*bool"):
        packbits(torch.ones(3))
    with pytest.raises(TypeError, match=r"x: got list"):
        packbits([1, 0, 1])


def test_segment_packbits_bad_input():
    x = torch.ones(9, dtype=torch.bool)
    ip = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"x: got shape \(3, 3\).*1-D"):
        segment_packbits(x.view(3, 3), ip)
    with pytest.raises(TypeError, match=r"indptr: got dtype torch.float32.*int32"):
        segment_packbits(x, ip.float())
    with pytest.raises(TypeError, match=r"indptr: got list"):
        segment_packbits(x, [0, 9])
    with pytest.raises(ValueError, match=r"indptr: got shape \(0,\)"):
        segment_packbits(x, torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"indptr: got a decreasing step at 1 \(5 -> 4\)"):
        segment_packbits(x, torch.tensor([0, 5, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"indptr\[-1\]=10.*x.numel\(\) = 9"):
        segment_packbits(x, torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"indptr\[0\]=-1"):
        segment_packbits(x, torch.tensor([-1, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"bitorder"):
        segment_packbits(x, ip, bitorder="LITTLE")
