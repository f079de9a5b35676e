"""The sparse index of a segment: where some entries start in the data file.

Index file ``<segment id as 16 hex digits>.idx``, little-endian::

    offset 0   8s  magic  b"PGNIDX\\x00\\x01"  (format version 1)
    offset 8   u64 segment id
    offset 16  checkpoints, 16 bytes each: u64 entry id, u64 position of its record

A checkpoint is taken at each record that starts ``index_interval_bytes`` or more after
the previous checkpoint (the first record, entry 0 at offset 16, is an implicit
checkpoint and is not stored).  The index is derived data: it is written without
fsync, and every checkpoint is checked against the data file (a valid record header
with the same entry id at that position) before it is trusted.  A bad checkpoint is
dropped; a missing or unreadable index is rebuilt from the data file.
"""

from __future__ import annotations

import bisect
import itertools
import struct
import sys
from array import array
from typing import Final

from pigeon.bookie._segment import FILE_HEADER_SIZE

__all__ = [
    "INDEX_HEADER_SIZE",
    "INDEX_RECORD_SIZE",
    "SparseIndex",
    "decode_checkpoints",
    "encode_checkpoints",
    "encode_index_header",
]

INDEX_MAGIC: Final = b"PGNIDX\x00\x01"
_HEADER: Final = struct.Struct("<8sQ")
INDEX_HEADER_SIZE: Final = _HEADER.size  # 16
INDEX_RECORD_SIZE: Final = 16
_LITTLE: Final = sys.byteorder == "little"


def encode_index_header(segment_id: int) -> bytes:
    return _HEADER.pack(INDEX_MAGIC, segment_id)


def encode_checkpoints(points: list[tuple[int, int]]) -> bytes:
    flat = array("q", [v for point in points for v in point])
    if not _LITTLE:
        flat.byteswap()
    return flat.tobytes()


def decode_checkpoints(buf: bytes) -> tuple[array[int], array[int]]:
    """``(entry_ids, positions)`` of whole 16-byte records in ``buf`` (a partial trailing
    record is ignored)."""
    flat = array("q")
    flat.frombytes(buf[: len(buf) - len(buf) % INDEX_RECORD_SIZE])
    if not _LITTLE:
        flat.byteswap()
    return flat[0::2], flat[1::2]


class SparseIndex:
    """Checkpoints of one segment in memory, sorted; ``(0, 16)`` is always the first.

    Checkpoints read from a file are filtered: outside ``[1, next_id)`` x ``[16, end)``
    they cannot be right, and when damage made the list non-increasing, the longest
    run of checkpoints increasing in both entry id and position is kept.
    """

    __slots__ = ("ids", "positions")

    def __init__(
        self,
        ids: array[int],
        positions: array[int],
        *,
        next_id: int = 1 << 63,
        end: int = 1 << 63,
    ) -> None:
        self.ids = array("q", [0])
        self.positions = array("q", [FILE_HEADER_SIZE])
        if not len(ids):
            return
        if (
            ids[0] > 0
            and ids[-1] < next_id
            and positions[0] > FILE_HEADER_SIZE
            and positions[-1] < end
            and _increasing(ids)
            and _increasing(positions)
        ):
            self.ids.extend(ids)
            self.positions.extend(positions)
            return
        points = [
            (p, i)
            for i, p in zip(ids, positions, strict=True)
            if 0 < i < next_id and FILE_HEADER_SIZE < p < end
        ]
        for p, i in _longest_increasing(points):
            self.ids.append(i)
            self.positions.append(p)

    def __len__(self) -> int:
        return len(self.ids)

    def lookup(self, entry_id: int) -> tuple[int, int]:
        """The last checkpoint ``(entry_id, pos)`` at or before ``entry_id``."""
        i = bisect.bisect_right(self.ids, entry_id) - 1
        return self.ids[i], self.positions[i]

    def append(self, entry_id: int, pos: int) -> None:
        if entry_id > self.ids[-1] and pos > self.positions[-1]:
            self.ids.append(entry_id)
            self.positions.append(pos)

    def discard(self, entry_id: int) -> None:
        """Forget a checkpoint found not to match the data (never the implicit first)."""
        i = bisect.bisect_left(self.ids, entry_id)
        if 0 < i < len(self.ids) and self.ids[i] == entry_id:
            del self.ids[i]
            del self.positions[i]


def _increasing(values: array[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(values))  # per checkpoint, not per byte


def _longest_increasing(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Longest subsequence of ``(pos, entry_id)`` pairs increasing strictly in both
    (patience sorting, O(n log n))."""
    # Equal positions in descending id order: a strictly increasing run of ids then
    # takes at most one of them.
    points = sorted(points, key=lambda point: (point[0], -point[1]))
    tails: list[int] = []  # tails[k]: smallest entry id ending a run of length k + 1
    tail_at: list[int] = []  # index in points of that tail
    back: list[int] = []  # predecessor of each point in its best run
    for n, (_pos, entry_id) in enumerate(points):
        k = bisect.bisect_left(tails, entry_id)
        if k == len(tails):
            tails.append(entry_id)
            tail_at.append(n)
        else:
            tails[k] = entry_id
            tail_at[k] = n
        back.append(tail_at[k - 1] if k else -1)
    run = []
    n = tail_at[-1] if tail_at else -1
    while n >= 0:
        run.append(points[n])
        n = back[n]
    return run[::-1]
