"""Bit packing of boolean masks (FlashInfer-compatible ``flashinfer.quantization``).

``packbits`` is bit-exact with ``numpy.packbits(x.ravel(), bitorder=...)``.
``segment_packbits`` packs each segment of a 1-D array separately so that every segment starts on a
byte boundary; this is how a batch custom mask is packed (attncore reads packed masks with
``bitorder="little"``, see ``docs/semantics.md``).

Both functions use plain torch ops and run on the device of their inputs.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["packbits", "segment_packbits"]

_BITORDERS = ("big", "little")
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_bitorder(bitorder: str) -> None:
    if not isinstance(bitorder, str) or bitorder not in _BITORDERS:
        raise ValueError(f"bitorder: got {bitorder!r}; accepted: 'big' or 'little'")


def _check_binary_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: got {type(x).__name__}; accepted: a torch.Tensor")
    if x.dtype.is_floating_point or x.dtype.is_complex:
        raise TypeError(
            f"{name}: got dtype {x.dtype}; accepted: torch.bool or an integer dtype "
            "(nonzero counts as 1)"
        )


def _bit_weights(bitorder: str, device: torch.device) -> torch.Tensor:
    """Value of bit k (k = 0..7 is the position of the element inside its byte)."""
    shifts = torch.arange(8, dtype=torch.int32, device=device)
    if bitorder == "big":
        shifts = 7 - shifts
    return torch.ones((), dtype=torch.int32, device=device) << shifts


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """Pack the elements of a binary-valued tensor into bits of a uint8 tensor.

    Same result as ``numpy.packbits(x.ravel(), bitorder=bitorder)``: the input is flattened
    row-major, every 8 consecutive elements form one byte, and the last byte is padded with zeros.

    Parameters
    ----------
    x : torch.Tensor
        Any shape (flattened row-major), dtype ``torch.bool`` or an integer dtype; a nonzero element
        is a 1 bit.
    bitorder : str
        ``"big"`` (default, like numpy): element 0 of each group of 8 goes to the most significant
        bit. ``"little"``: element 0 goes to the least significant bit (the order attncore's packed
        custom masks use).

    Returns
    -------
    torch.Tensor
        1-D, dtype ``torch.uint8``, shape ``[ceil(x.numel() / 8)]``, on ``x.device``.

    Raises
    ------
    TypeError
        ``x`` is not a tensor or has a floating/complex dtype.
    ValueError
        ``bitorder`` is not ``"big"`` or ``"little"``.
    """
    _check_binary_tensor(x, "x")
    _check_bitorder(bitorder)
    flat = x.reshape(-1) != 0
    n = flat.numel()
    nbytes = (n + 7) // 8
    bits = torch.zeros(nbytes * 8, dtype=torch.int32, device=x.device)
    bits[:n] = flat.to(torch.int32)
    packed = (bits.view(nbytes, 8) * _bit_weights(bitorder, x.device)).sum(dim=1)
    return packed.to(torch.uint8)


def segment_packbits(
    x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` into its own run of bytes.

    Segment ``i`` is packed like ``packbits(x[indptr[i]:indptr[i+1]], bitorder)`` (last byte padded
    with zeros) and the results are concatenated, so every segment starts on a byte boundary.

    Parameters
    ----------
    x : torch.Tensor
        1-D, dtype ``torch.bool`` or an integer dtype (nonzero is a 1 bit), shape ``[n]``.
    indptr : torch.Tensor
        1-D, ``torch.int32`` or ``torch.int64``, shape ``[num_segments + 1]``, on ``x.device``;
        non-decreasing, ``indptr[0] >= 0`` and ``indptr[-1] <= n``.
    bitorder : str
        ``"big"`` (default) or ``"little"``, as in :func:`packbits`.

    Returns
    -------
    packed : torch.Tensor
        1-D ``torch.uint8``, shape ``[new_indptr[-1]]``.
    new_indptr : torch.Tensor
        1-D ``torch.int32``, shape ``[num_segments + 1]``: byte offsets of the segments in
        ``packed`` (``new_indptr[0] = 0``, segment ``i`` takes ``ceil(len_i / 8)`` bytes).

    Raises
    ------
    TypeError
        ``x`` or ``indptr`` is not a tensor or has a wrong dtype.
    ValueError
        Wrong ``ndim``, device mismatch, ``indptr`` empty, decreasing or out of ``[0, n]``, or a bad
        ``bitorder``.

    Notes
    -----
    Reads ``indptr[-1]`` / ``new_indptr[-1]`` on the host (one device sync on CUDA).
    """
    _check_binary_tensor(x, "x")
    _check_bitorder(bitorder)
    if x.dim() != 1:
        raise ValueError(f"x: got shape {tuple(x.shape)}; accepted: a 1-D tensor [n]")
    if not isinstance(indptr, torch.Tensor):
        raise TypeError(f"indptr: got {type(indptr).__name__}; accepted: a torch.Tensor")
    if indptr.dtype not in _INDEX_DTYPES:
        raise TypeError(f"indptr: got dtype {indptr.dtype}; accepted: torch.int32 or torch.int64")
    if indptr.dim() != 1 or indptr.numel() < 1:
        raise ValueError(
            f"indptr: got shape {tuple(indptr.shape)}; accepted: a 1-D tensor [num_segments + 1] "
            "with at least one element"
        )
    if indptr.device != x.device:
        raise ValueError(f"indptr: got device {indptr.device}; accepted: x's device {x.device}")

    ip = indptr.to(torch.int64)
    n = x.numel()
    first, last = torch.stack([ip[0], ip[-1]]).tolist()
    if first < 0 or last > n:
        raise ValueError(
            f"indptr: got indptr[0]={first}, indptr[-1]={last}; accepted: "
            f"0 <= indptr[0] and indptr[-1] <= x.numel() = {n}"
        )
    seglen = ip[1:] - ip[:-1]
    if seglen.numel() and bool((seglen < 0).any()):
        bad = int(torch.nonzero(seglen < 0)[0, 0])
        raise ValueError(
            f"indptr: got a decreasing step at {bad} ({int(ip[bad])} -> {int(ip[bad + 1])}); "
            "accepted: a non-decreasing tensor"
        )

    nbytes = (seglen + 7) // 8
    new_indptr = torch.zeros_like(ip)
    new_indptr[1:] = torch.cumsum(nbytes, dim=0)
    total_bytes = int(new_indptr[-1])

    # Element j of segment s goes to byte new_indptr[s] + (j - indptr[s]) // 8, bit (j - indptr[s]) % 8.
    num_seg = seglen.numel()
    seg = torch.repeat_interleave(torch.arange(num_seg, device=x.device), seglen)
    start = ip[0] if num_seg else ip.new_zeros(())
    pos = torch.arange(seg.numel(), device=x.device) + start  # index into x
    local = pos - ip[seg]
    byte = new_indptr[seg] + local // 8
    weight = _bit_weights(bitorder, x.device).to(torch.int64)[local % 8]
    values = (x[pos] != 0).to(torch.int64) * weight
    acc = torch.zeros(total_bytes, dtype=torch.int64, device=x.device)
    acc.index_add_(0, byte, values)
    return acc.to(torch.uint8), new_indptr.to(torch.int32)
