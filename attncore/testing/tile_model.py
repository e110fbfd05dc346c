"""Issue 13's tile slip, modelled: which KV tiles each row tile of a request visits in the Triton
backend's prefill kernel (a Python mirror of ``_attn_fwd``'s "KV range of this item" code), with and
without the old last-token formula, and requests that the slip got wrong.

With a GQA group G, packed row p is token p // G, so a row tile ending at packed row ``end`` has its
last token at ``(end - 1) // G``; the kernel took ``end // G - 1`` (one short when G does not divide
``end``) and cut the causal / window KV range of the tile's last token (groups 3, 5, 7: wrong
output, no error).  Used by tests/test_triton_backend.py and backends/triton/scripts/gpu_triton_issue13.py to pick
lengths the slip broke.
"""

from __future__ import annotations

from typing import Iterable, List, Tuple


def triton_kv_tiles(qo: int, kv: int, G: int, bm: int, bn: int, causal: bool, window: int,
                    old: bool = False) -> List[List[Tuple[int, int]]]:
    """Per row tile (``bm`` packed rows) of one request: the KV tiles (start, masked) it visits with
    ``bn``-key tiles; ``old``: with the last-token slip."""
    tdiv = lambda a, b: a // b if a >= 0 else -(-a // b)  # noqa: E731  (Triton truncates)
    out = []
    for row0 in range(0, qo * G, bm):
        end = min(row0 + bm, qo * G)
        q_first = row0 // G
        q_last = max(end // G - 1 if old else (end - 1) // G, q_first)
        off = kv - qo
        lo, hi, f_lo, f_hi = 0, kv, 0, kv // bn * bn
        if causal:
            hi = min(hi, q_last + off + 1)
            f_hi = min(f_hi, tdiv(q_first + off + 1, bn) * bn)
        if window >= 0:
            lo = max(lo, max(q_first + off - window, 0) // bn * bn)
            f_lo = max(lo, (max(q_last + off - window, 0) + bn - 1) // bn * bn)
        hi = max(hi, lo)
        f_lo = min(max(f_lo, lo), (hi + bn - 1) // bn * bn)
        f_hi = max(f_hi, f_lo)
        out.append([(a, m) for a, b, m in ((lo, f_lo, 1), (f_lo, f_hi, 0), (f_hi, hi, 1)) for a in range(a, b, bn)])
    return out


def slips(qo: int, kv: int, G: int, bm: int, bn: int, causal: bool = True, window: int = -1) -> bool:
    """Whether the old last-token formula planned other KV tiles for this request (a tile cut off
    under causal, or a tile run unmasked past the last row's window)."""
    return triton_kv_tiles(qo, kv, G, bm, bn, causal, window) != triton_kv_tiles(qo, kv, G, bm, bn, causal, window,
                                                                                 old=True)


def slip_requests(G: int, bm: int, bn: int, qo_range: Iterable[int] = range(2, 64), *, longer_kv: bool = True,
                  causal: bool = True, window: int = -1, n: int = 1) -> List[Tuple[int, int]]:
    """Up to ``n`` (qo, kv) requests the slip got wrong (most shapes are not), one per qo of
    ``qo_range``: kv > qo (up to qo + 2 bn) with ``longer_kv``, else kv < qo."""
    found = []
    for qo in qo_range:
        for kv in (range(qo + 1, qo + 2 * bn + 1) if longer_kv else range(1, qo)):
            if slips(qo, kv, G, bm, bn, causal, window):
                found.append((qo, kv))
                break
        if len(found) == n:
            break
    return found


def slip_request(G: int, bm: int, bn: int, longer_kv: bool, causal: bool = True, window: int = -1) -> Tuple[int, int]:
    """The first (qo, kv), qo < 64, that the slip got wrong."""
    found = slip_requests(G, bm, bn, longer_kv=longer_kv, causal=causal, window=window)
    if not found:
        raise AssertionError(f"no request of G={G}, {bm}x{bn} tiles that the slip gets wrong")
    return found[0]
