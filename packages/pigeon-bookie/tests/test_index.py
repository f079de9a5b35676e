"""The sparse index (pigeon.bookie._index): checkpoint encoding, lookups, damage."""

from __future__ import annotations

import itertools
from array import array

from hypothesis import given
from hypothesis import strategies as st

from pigeon.bookie._index import (
    SparseIndex,
    decode_checkpoints,
    encode_checkpoints,
    encode_index_header,
)
from pigeon.bookie._segment import FILE_HEADER_SIZE


def test_checkpoint_encoding() -> None:
    points = [(5, 1000), (9, 70000), (2**40, 2**50)]
    raw = encode_checkpoints(points)
    assert len(raw) == 48
    assert raw[:16] == (5).to_bytes(8, "little") + (1000).to_bytes(8, "little")
    ids, pos = decode_checkpoints(raw + b"\x01\x02")  # partial record ignored
    assert list(zip(ids, pos, strict=True)) == points
    assert encode_index_header(3) == b"PGNIDX\x00\x01" + (3).to_bytes(8, "little")


def test_sparse_index_lookup_and_damage() -> None:
    idx = SparseIndex(array("q", [10, 20, 30]), array("q", [100, 200, 300]))
    assert idx.lookup(0) == (0, FILE_HEADER_SIZE)
    assert idx.lookup(9) == (0, FILE_HEADER_SIZE)
    assert idx.lookup(10) == (10, 100)
    assert idx.lookup(25) == (20, 200)
    assert idx.lookup(10**9) == (30, 300)
    idx.discard(20)
    assert idx.lookup(25) == (10, 100)
    idx.discard(0)  # the implicit first checkpoint stays
    assert idx.lookup(5) == (0, FILE_HEADER_SIZE)
    idx.append(40, 400)
    idx.append(35, 500)  # not increasing: ignored
    assert idx.lookup(45) == (40, 400)
    # a damaged (non increasing) list keeps its increasing subsequence
    bad = SparseIndex(array("q", [10, 5, 20, 30]), array("q", [100, 900, 200, 150]))
    assert list(bad.ids) == [0, 10, 20]
    assert list(bad.positions) == [FILE_HEADER_SIZE, 100, 200]


@given(st.lists(st.tuples(st.integers(17, 40), st.integers(1, 12)), max_size=9))
def test_damaged_index_keeps_the_longest_consistent_run(points: list[tuple[int, int]]) -> None:
    pairs = sorted(set(points))
    idx = SparseIndex(array("q", [i for _, i in points]), array("q", [p for p, _ in points]))
    kept = list(zip(idx.ids[1:], idx.positions[1:], strict=True))
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in itertools.pairwise(kept))
    assert set((p, i) for i, p in kept) <= set(pairs)
    best = 0
    for mask in range(1 << len(pairs)):
        chosen = [pairs[k] for k in range(len(pairs)) if mask >> k & 1]
        if all(a[0] < b[0] and a[1] < b[1] for a, b in itertools.pairwise(chosen)):
            best = max(best, len(chosen))
    assert len(kept) == best
