"""attncore.core.schedule: the split-KV work schedule shared by the Triton and cuda_fa2 kernels."""

import random

import numpy as np
import pytest

from attncore.core.schedule import NO_PART, build, choose_chunk, row_tiles


def _visible(t, qo, kv, causal, wl):
    """Keys query token t can see (semantics.md: bottom-right causal, window)."""
    hi = min(kv, t + kv - qo + 1) if causal else kv
    lo = max(0, t + kv - qo - wl) if wl >= 0 else 0
    return set(range(lo, max(lo, hi)))


@pytest.mark.parametrize("seed", range(40))
def test_items_cover_exactly_what_each_row_can_see(seed):
    rng = random.Random(seed)
    B = rng.randint(1, 5)
    qo = [rng.choice([0, 1, 2, 7, 33]) for _ in range(B)]
    kv = [rng.choice([0, 1, 5, 64, 200, 513]) for _ in range(B)]
    G, BM = rng.choice([1, 3, 4, 8]), rng.choice([16, 64, 128])
    causal, wl = rng.random() < 0.5, rng.choice([-1, 0, 5, 100])
    heads, tile = rng.choice([1, 8]), rng.choice([16, 64])
    tiles = row_tiles(qo, kv, G, BM, causal=causal, window_left=wl)
    chunk = choose_chunk([t.kv_hi - t.kv_lo for t in tiles], heads, slots=rng.choice([4, 132, 1000]), kv_tile=tile,
                         min_chunk=rng.choice([0, 64]))
    assert chunk is None or chunk % tile == 0
    s = build(tiles, qo, chunk=chunk)
    assert s.costs == sorted(s.costs, reverse=True)
    # every visible key of every row is in exactly one item of the row's tile (per split slot)
    per_tile = {}
    for (req, r0, lo, hi, part) in s.items:
        assert 0 <= lo <= hi <= kv[req]
        per_tile.setdefault((req, r0), []).append((lo, hi, part))
    for t in tiles:
        got = per_tile[(t.req, t.row0)]
        assert len(got) == s.num_splits[t.req]
        keys = [k for lo, hi, _ in got for k in range(lo, hi)]
        assert len(keys) == len(set(keys))
        for r in range(t.row0, min(t.row0 + BM, qo[t.req] * G)):
            assert _visible(r // G, qo[t.req], kv[t.req], causal, wl) <= set(keys)
        parts = sorted(p for _, _, p in got)
        if s.num_splits[t.req] == 1:
            assert parts == [-1]
        else:
            assert parts == [s.part_off[t.req] + k * qo[t.req] for k in range(s.num_splits[t.req])]
    # the merge table: each row of a split request once, partials inside part_rows
    qo_ptr = [0]
    for n in qo:
        qo_ptr.append(qo_ptr[-1] + n)
    table = s.merge_table(qo_ptr)
    assert len({r[0] for r in table}) == len(table) == sum(qo[i] for i in range(B) if s.num_splits[i] > 1)
    for out_row, first, stride, ns in table:
        assert first + (ns - 1) * stride < s.part_rows


def test_no_split_when_the_machine_is_full_or_ranges_are_short():
    assert choose_chunk([4096] * 200, 8, slots=132, kv_tile=64) is None  # 1600 items fill 132 slots
    assert choose_chunk([64, 32], 1, slots=132, kv_tile=64) is None  # nothing longer than one tile
    assert choose_chunk([], 8, slots=132, kv_tile=64) is None


def test_long_single_request_splits_to_fill_the_slots():
    chunk = choose_chunk([32768], 8, slots=132, kv_tile=64)
    n = -(-32768 // chunk) * 8
    assert n <= 132 and -(-32768 // (chunk - 64)) * 8 > 132  # the smallest chunk that fits
    s = build(row_tiles([1], [32768], 4, 16, causal=True), [1], chunk=chunk)
    assert s.num_splits == [-(-32768 // chunk)] and s.part_rows == s.num_splits[0]


def test_write_work_fills_the_items_or_one_inert_item():
    """The work table both kernels read: the items in order; with none, row 0 is an empty item that
    writes no split partial (the kernels test part_row >= 0), and the rest of the table is untouched."""
    qo, kv = [3, 0], [200, 5]
    s = build(row_tiles(qo, kv, 1, 16, causal=True), qo, chunk=64)
    table = np.full((s.num_items + 2, 5), 7, dtype=np.int32)
    s.write_work(table)
    assert table[:s.num_items].tolist() == [list(i) for i in s.items] and (table[s.num_items:] == 7).all()
    assert any(i[4] >= 0 for i in s.items) and all(i[4] == NO_PART for i in build(row_tiles(qo, kv, 1, 16, causal=True),
                                                                                   qo, chunk=None).items)
    empty = build([], [], chunk=None)
    table = np.full((2, 5), 7, dtype=np.int32)
    empty.write_work(table)
    assert table.tolist() == [[0, 0, 0, 0, NO_PART], [7] * 5]


@pytest.mark.parametrize("seed", range(30))
def test_one_tile_per_request_path_equals_the_general_loop(seed):
    """row_tiles' fast path (every request's rows in one tile: decode, short prefill) gives the same tiles,
    as RowTiles, as the per-tile loop; and build() without a chunk the same schedule as the split path's rules
    (items longest first, ties in tile order)."""
    from attncore.core.schedule import RowTile, _tiles_by_loop

    rng = random.Random(seed)
    B = rng.randint(1, 70)
    G, BM = rng.choice([1, 4, 8]), rng.choice([16, 64])
    qo = [rng.randint(1, BM // G) for _ in range(B)]
    kv = [rng.choice([0, 1, 5, 64, 200]) for _ in range(B)]
    causal, wl = rng.random() < 0.5, rng.choice([-1, 0, 3, 100])
    fast = row_tiles(qo, kv, G, BM, causal=causal, window_left=wl)
    assert fast == _tiles_by_loop(qo, kv, G, BM, causal, wl)
    assert all(type(t) is RowTile for t in fast) and fast[-1].kv_hi == kv[-1]
    s = build(fast, qo, chunk=None)
    work = sorted(((t.kv_hi - t.kv_lo, (*t, NO_PART)) for t in fast), key=lambda w: -w[0])
    assert s.items == [w[1] for w in work] and s.costs == [w[0] for w in work]
    assert s.num_splits == [1] * B and s.part_off == [0] * B and s.part_rows == 0 and s.chunk is None
