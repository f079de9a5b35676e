"""The broker header that prefixes every stored entry.

A stored entry is ``broker header | batch`` where the batch is exactly what the producer
sent (see :mod:`pigeon.core._batch`); the broker never re-encodes it.  Byte layout of the
32-byte header, little-endian::

    offset 0   u16  version        currently 1
    offset 2   u16  flags          reserved, 0
    offset 4   u32  num_messages   messages in the batch
    offset 8   u64  first_offset   partition offset of the batch's first message
    offset 16  i64  publish_time   broker publish time, ms since the epoch (monotonic per topic)
    offset 24  i64  deliver_at     ms since the epoch before which shared subscriptions hold
                                   the entry back (0: deliver at once); copied from the batch

Message ``i`` of the entry has offset ``first_offset + i``.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from pigeon.core.errors import CorruptEntry

__all__ = ["ENTRY_HEADER_SIZE", "EntryHeader", "pack_entry_header", "unpack_entry_header"]

_HEADER = struct.Struct("<HHIQqq")
ENTRY_HEADER_SIZE = _HEADER.size
ENTRY_VERSION = 1


class EntryHeader(NamedTuple):
    num_messages: int
    first_offset: int
    publish_time: int
    deliver_at: int


def pack_entry_header(
    num_messages: int, first_offset: int, publish_time: int, deliver_at: int = 0
) -> bytes:
    return _HEADER.pack(ENTRY_VERSION, 0, num_messages, first_offset, publish_time, deliver_at)


def unpack_entry_header(data: bytes | memoryview) -> EntryHeader:
    if len(data) < ENTRY_HEADER_SIZE:
        raise CorruptEntry(f"stored entry of {len(data)} bytes is shorter than its header")
    version, _flags, n, first, publish, deliver_at = _HEADER.unpack_from(data, 0)
    if version != ENTRY_VERSION:
        raise CorruptEntry(f"stored entry has unknown header version {version}")
    return EntryHeader(n, first, publish, deliver_at)
