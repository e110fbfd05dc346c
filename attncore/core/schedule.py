"""The split-KV work schedule that the Triton and cuda_fa2 kernels run from (one home: issue 14 item 3).

A batch's query rows are *packed* per KV head: row ``r`` of request ``i`` is query token ``r // G`` of
query head ``h * G + r % G`` (``G`` = group size), so one tile of ``block_rows`` packed rows shares one
K/V stream.  The schedule is a list of *work items*, each one row tile over one KV range; a launch
runs every item for every KV head.

* ``row_tiles``: the row tiles of a batch and the keys each must visit (bottom-right causal bound,
  sliding window), from host lengths.
* ``choose_chunk``: flash-decoding's split-KV decision: when the unsplit items do not fill the
  machine, the smallest KV chunk (a multiple of the kernel's KV tile) whose items still fit in
  ``slots`` programs.
* ``build``: the items, longest first (better tails on causal and ragged batches), and where split
  items write their partial outputs: split ``s`` of request ``i`` writes partial rows
  ``part_off[i] + s * qo_len[i] + t`` for its query tokens ``t``; items of an unsplit request write
  ``out``/``lse`` directly (``part_row == -1``).  ``merge_table`` lists, per query row whose request was
  split, where its partials are, for the merge launch.

Kernels may clamp an item's KV range further (per-row causal and window masks still apply inside a
tile); they must not visit keys outside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, repeat
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np


class RowTile(NamedTuple):  # a tuple: built per tile in every plan (host time)
    req: int
    row0: int  # first packed row of the tile
    kv_lo: int  # keys [kv_lo, kv_hi) are the only ones a row of the tile can see
    kv_hi: int


def row_tiles(qo_lens: Sequence[int], kv_lens: Sequence[int], group: int, block_rows: int, *,
              causal: bool, window_left: int = -1) -> List[RowTile]:
    """Every row tile of the batch with the KV range its rows can see.  Query token ``t`` of a request
    with ``qo`` tokens and ``kv`` keys sees keys ``<= t + kv - qo`` when causal (bottom-right) and
    ``>= t + kv - qo - window_left`` when a window is set (semantics.md); an empty range is (lo, lo)."""
    if qo_lens and 0 < min(qo_lens) and max(qo_lens) * group <= block_rows:
        return _one_tile_each(qo_lens, kv_lens, window_left)
    return _tiles_by_loop(qo_lens, kv_lens, group, block_rows, causal, window_left)


def _tiles_by_loop(qo_lens, kv_lens, group: int, block_rows: int, causal: bool, window_left: int) -> List[RowTile]:
    """row_tiles in general: every tile of every request."""
    tiles = []
    for i, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        rows = qo * group
        delta = kv - qo
        for r0 in range(0, rows, block_rows):
            tok_lo, tok_hi = r0 // group, (min(r0 + block_rows, rows) - 1) // group  # first and last token
            hi = max(0, min(kv, tok_hi + delta + 1)) if causal else kv
            lo = max(0, tok_lo + delta - window_left) if window_left >= 0 else 0
            tiles.append(RowTile(i, r0, min(lo, hi), hi))
    return tiles


def _one_tile_each(qo_lens: Sequence[int], kv_lens: Sequence[int], window_left: int) -> List[RowTile]:
    """row_tiles where every request has query rows and they fit one tile (decode, short prefill): the tile
    holds the request's last token, which sees every key (causal or not), so it spans ``[lo, kv)``, ``lo``
    the window's bound of its first token.  Host time: no loop in Python, tuples made by ``tuple.__new__``
    (a NamedTuple's own constructor is a Python function)."""
    n = len(qo_lens)
    if window_left >= 0:
        los = [min(max(0, kv - qo - window_left), kv) for qo, kv in zip(qo_lens, kv_lens)]
    else:
        los = repeat(0, n)
    return list(map(tuple.__new__, repeat(RowTile, n), zip(range(n), repeat(0, n), los, kv_lens)))


def caller_chunk(meta, page_size: Optional[int]) -> Optional[int]:
    """The split-KV chunk, in tokens, that the caller's hints on ``meta`` (a ``BatchMeta``) ask for: 0 with
    ``disable_split_kv`` (no split), ``fixed_split_size`` pages (tokens for ragged KV, ``page_size`` None) as
    tokens; None without a hint (the backend chooses).  Backends round it up to their K/V tile."""
    if meta.disable_split_kv:
        return 0
    if meta.fixed_split_size:
        return int(meta.fixed_split_size) * (page_size or 1)
    return None


def choose_chunk(extents: Sequence[int], heads: int, *, slots: int, kv_tile: int,
                 min_chunk: int = 0) -> Optional[int]:
    """The KV chunk to split by, or None.  None when the unsplit items (``len(extents) * heads``) already
    fill ``slots`` programs or no tile is longer than one chunk; else the smallest multiple of
    ``kv_tile`` (at least ``min_chunk``) whose items (``sum(ceil(e / chunk)) * heads``) fit in ``slots``
    (at least one item per tile: the largest extent always fits)."""
    base = len(extents) * heads
    if base == 0 or base >= slots:
        return None

    def items(ch: int) -> int:
        return sum(max(1, -(-e // ch)) for e in extents) * heads

    def up(n: int) -> int:
        return -(-n // kv_tile) * kv_tile

    lo = up(max(min_chunk, kv_tile))
    longest = max(extents)
    if longest <= lo:  # no tile longer than the smallest chunk: nothing to split (host time: no items() pass)
        return None
    hi = up(max(longest, lo))
    if items(lo) <= slots:
        chunk = lo
    else:
        while hi - lo > kv_tile:  # items() does not increase with the chunk
            mid = (lo + hi) // 2 // kv_tile * kv_tile
            if items(mid) <= slots:
                hi = mid
            else:
                lo = mid
        chunk = hi
    return chunk if any(e > chunk for e in extents) else None


NO_PART = -1  # an item's part_row when it writes out/lse itself (no split partial): the kernels test >= 0
_NO_PART = (NO_PART,)


@dataclass
class Schedule:
    """``items``: (req, row0, kv_lo, kv_hi, part_row) longest first; ``part_row`` ``NO_PART`` writes out/lse, else
    the first partial row of the item's split.  ``num_splits``, ``part_off``: per request.  ``part_rows``:
    partial rows in all (each ``[heads, head_dim]`` of output and ``[heads]`` of LSE).  ``costs``: each
    item's KV extent (the sort key)."""

    items: List[Tuple[int, int, int, int, int]]
    costs: List[int]
    num_splits: List[int]
    part_off: List[int]
    part_rows: int
    chunk: Optional[int]

    @property
    def num_items(self) -> int:
        return len(self.items)

    @property
    def max_splits(self) -> int:
        return max(self.num_splits, default=1)

    def write_work(self, table) -> None:
        """The items into the rows of ``table`` (a host ``[capacity >= max(num_items, 1), 5]`` view); with
        none, row 0 gets an inert item (request 0, an empty KV range, no partial): the table is never empty."""
        if self.items:
            n = len(self.items)
            flags = getattr(table, "flags", None)
            if flags is not None and flags.c_contiguous:  # numpy: one flat list converts faster (host time)
                table.reshape(-1)[:n * len(self.items[0])] = list(chain.from_iterable(self.items))
            else:
                table[:n] = self.items
        else:
            table[0] = (0, 0, 0, 0, NO_PART)

    def merge_table(self, qo_indptr_host: Sequence[int]) -> np.ndarray:
        """``[rows, 4]`` int32: (out_row, first partial row, partial row stride, splits) of every query token
        whose request was split: its split ``s`` is partial row ``first + s * stride`` (numpy: a 512-row
        chunk's rows built per element took ~150 us of a serving step's plan)."""
        split = [i for i, ns in enumerate(self.num_splits) if ns > 1]
        if not split:
            return np.zeros((0, 4), dtype=np.int32)
        blocks = []
        for i in split:
            qo = qo_indptr_host[i + 1] - qo_indptr_host[i]
            b = np.empty((qo, 4), dtype=np.int32)
            t = np.arange(qo, dtype=np.int32)
            b[:, 0] = qo_indptr_host[i] + t
            b[:, 1] = self.part_off[i] + t
            b[:, 2] = qo
            b[:, 3] = self.num_splits[i]
            blocks.append(b)
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


def build(tiles: Sequence[RowTile], qo_lens: Sequence[int], *, chunk: Optional[int], sort: bool = True) -> Schedule:
    """The work items of ``tiles`` with requests split by ``chunk`` (None: no split).  A request is split
    into as many chunks as its longest tile needs; each of its tiles gets that many items (a split past
    a tile's range is an empty item whose partial merges as empty)."""
    B = len(qo_lens)
    num_splits = [1] * B
    if not chunk:  # no split (host time: no per-tile Python loop beyond the comprehensions)
        items = [t + _NO_PART for t in tiles]  # a RowTile is a tuple: + is one C call
        costs = [t[3] - t[2] for t in tiles]
        if sort:  # longest first, ties in tile order (a stable sort, as below)
            order = sorted(range(len(costs)), key=costs.__getitem__, reverse=True)
            items, costs = [items[i] for i in order], [costs[i] for i in order]
        return Schedule(items=items, costs=costs, num_splits=num_splits, part_off=[0] * B, part_rows=0, chunk=chunk)
    for t in tiles:
        ext = t.kv_hi - t.kv_lo
        num_splits[t.req] = max(num_splits[t.req], -(-ext // chunk) if ext > 0 else 1)
    part_off, rows = [0] * B, 0
    for i in range(B):
        if num_splits[i] > 1:
            part_off[i] = rows
            rows += num_splits[i] * qo_lens[i]
    work = []
    for t in tiles:
        ns = num_splits[t.req]
        if ns == 1:
            work.append((t.kv_hi - t.kv_lo, (t.req, t.row0, t.kv_lo, t.kv_hi, NO_PART)))
            continue
        for s in range(ns):
            b = min(t.kv_lo + s * chunk, t.kv_hi)
            e = t.kv_hi if s == ns - 1 else min(t.kv_lo + (s + 1) * chunk, t.kv_hi)
            work.append((e - b, (t.req, t.row0, b, e, part_off[t.req] + s * qo_lens[t.req])))
    if sort:
        work.sort(key=lambda w: -w[0])
    return Schedule(items=[w[1] for w in work], costs=[w[0] for w in work], num_splits=num_splits,
                    part_off=part_off, part_rows=rows, chunk=chunk)


def check_capacity(who: str, what: str, need: int, cap: int, batch_size: int, nnz_q: int) -> None:
    """CUDA-graph mode: a re-plan needing more ``what`` than the capacity ``cap`` fixed at the caller's
    first graph-mode plan (for ``batch_size`` requests and ``nnz_q`` query rows) is an error naming it."""
    if need > cap:
        raise ValueError(
            f"{who}: this CUDA-graph plan needs {need} {what}, more than the capacity {cap} fixed at the first "
            f"graph-mode plan (batch_size {batch_size}, {nnz_q} query rows); a captured graph cannot grow: "
            f"plan with at most that many query rows, or make a new wrapper (and capture again)")
