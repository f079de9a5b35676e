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
    """Checkpoints of one segment in memory, sorted; ``(0, 16)`` is always the first."""

    __slots__ = ("ids", "positions")

    def __init__(self, ids: array[int], positions: array[int]) -> None:
        self.ids = array("q", [0])
        self.positions = array("q", [FILE_HEADER_SIZE])
        if (
            len(ids)
            and list(ids) == sorted(set(ids))
            and list(positions) == sorted(set(positions))
            and ids[0] > 0
            and positions[0] > FILE_HEADER_SIZE
        ):
            self.ids.extend(ids)
            self.positions.extend(positions)
            return
        # Damaged (not strictly increasing): keep the increasing subsequence.
        last_id, last_pos = 0, FILE_HEADER_SIZE
        for i, p in zip(ids, positions, strict=True):
            if i > last_id and p > last_pos:
                self.ids.append(i)
                self.positions.append(p)
                last_id, last_pos = i, p

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
