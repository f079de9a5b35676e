"""Byte layouts of the ``journal`` ledger storage's files, and the scanner that reads
journal records back.

Nothing here opens a file: the scanner reads through a ``read(pos, n) -> bytes``
callable (``os.pread`` on a journal file, or a slice of ``bytes`` in the tests).

Journal file ``<journal dir>/<seq as 16 hex digits>.txn`` and entry log
``<ledger dir>/<log id as 16 hex digits>.log``, all integers little-endian::

    offset 0   8s  magic  b"PGNJRNL\\x01" (journal) or b"PGNELOG\\x01" (entry log)
    offset 8   u64 sequence number of the journal file, or id of the entry log
    offset 16  records, back to back
    then       zero bytes, up to the end of the file (journal files only: the part
               preallocated and not yet written, :mod:`pigeon.bookie._journal_file`)

Record (a 40-byte header, then the payload; an entry record is byte for byte the
record of a segment file, :mod:`pigeon.bookie._segment`)::

    +0   4s   magic        b"\\xd7PGR" entry, b"\\xd7PGF" fence, b"\\xd7PGD" delete
    +4   u32  payload length (0 for fence and delete)
    +8   u64  segment id
    +16  u64  entry id      (0 for fence and delete)
    +24  i64  lac           last-add-confirmed the writer piggybacked (-1: none)
    +32  u32  payload crc   CRC32C (Castagnoli) of the payload bytes
    +36  u32  header crc    CRC32C of header bytes +0 .. +36
    +40  payload

The journal holds every record in the order the store accepted them (entries of all
segments interleaved, fences, deletions); entry logs hold entry records only, of many
segments, and are read at the positions the index gives.  An entry record written
again (a repair from a good copy, or the replay of a journal) simply supersedes the
older copy: the index points at the newest.

A journal file's records end where a record does not parse: its **logical end**.  When
every byte from there to the end of the file is zero, that is a clean end (the file's
preallocated, never written part, :func:`all_zeros`); anything else there is a torn
record.  No record starts with a zero byte (each magic starts with ``0xd7``), so a
record header read back as zeros is never taken for a record.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Final, NamedTuple

from pigeon.bookie._segment import (
    RECORD_HEADER_SIZE,
    RECORD_MAGIC,
    Buffer,
    crc32c,
    encode_record_header,
)

__all__ = [
    "DELETE",
    "ENTRY",
    "FENCE",
    "FILE_HEADER_SIZE",
    "JOURNAL_MAGIC",
    "LOG_MAGIC",
    "MAX_FILE_ID",
    "RECORD_HEADER_SIZE",
    "ZEROS",
    "JournalRecord",
    "all_zeros",
    "decode_entry",
    "encode_control",
    "encode_entry_header",
    "encode_file_header",
    "parse_file_header",
    "parse_header",
    "scan_journal",
]

JOURNAL_MAGIC: Final = b"PGNJRNL\x01"
LOG_MAGIC: Final = b"PGNELOG\x01"
_FILE_HEADER: Final = struct.Struct("<8sQ")
FILE_HEADER_SIZE: Final = _FILE_HEADER.size  # 16
#: the highest journal sequence number or entry log id a store uses (files named
#: above it are not its own)
MAX_FILE_ID: Final = (1 << 63) - 1

#: a MiB of zeros: what a journal file is preallocated with, a piece at a time
ZEROS: Final = bytes(1 << 20)

#: record kinds
ENTRY: Final = 0
FENCE: Final = 1
DELETE: Final = 2
_MAGICS: Final = {RECORD_MAGIC: ENTRY, b"\xd7PGF": FENCE, b"\xd7PGD": DELETE}
_KIND_MAGIC: Final = {kind: magic for magic, kind in _MAGICS.items()}

_HEAD: Final = struct.Struct("<4sIQQqI")  # the part covered by the header crc
_RECORD: Final = struct.Struct("<4sIQQqII")
_HCRC: Final = struct.Struct("<I")
_HEAD_SIZE: Final = _HEAD.size  # 36

#: ``read(pos, n)`` returns up to ``n`` bytes of the file starting at ``pos``.
ReadFn = Callable[[int, int], bytes]

#: the 40-byte header of an entry record (the same as a segment file's)
encode_entry_header: Final = encode_record_header


class JournalRecord(NamedTuple):
    """A record read back from a journal: ``pos`` is where it starts, ``size`` its
    length with the header; ``payload`` is b"" for fence and delete records."""

    kind: int
    segment_id: int
    entry_id: int
    lac: int
    pos: int
    size: int
    payload: bytes


def encode_file_header(magic: bytes, number: int) -> bytes:
    return _FILE_HEADER.pack(magic, number)


def parse_file_header(buf: bytes, magic: bytes) -> int | None:
    """The number in an intact file header of kind ``magic``, else None."""
    if len(buf) < FILE_HEADER_SIZE:
        return None
    got, number = _FILE_HEADER.unpack_from(buf)
    return number if got == magic else None


def encode_control(kind: int, segment_id: int, lac: int = -1) -> bytes:
    """A fence or delete record (a header alone)."""
    head = _HEAD.pack(_KIND_MAGIC[kind], 0, segment_id, 0, lac, 0)
    return head + _HCRC.pack(crc32c(head))


def parse_header(buf: Buffer, off: int) -> tuple[int, int, int, int, int, int] | None:
    """``(kind, payload_length, segment_id, entry_id, lac, payload_crc)`` of the header
    at ``buf[off:off + 40]``, or None if it is short, of no known kind, or its crc is
    wrong."""
    if len(buf) - off < RECORD_HEADER_SIZE:
        return None
    magic, length, segment_id, entry_id, lac, pcrc, hcrc = _RECORD.unpack_from(buf, off)
    kind = _MAGICS.get(bytes(magic))
    if kind is None or crc32c(buf[off : off + _HEAD_SIZE]) != hcrc:
        return None
    return kind, length, segment_id, entry_id, lac, pcrc


def decode_entry(buf: Buffer, segment_id: int, entry_id: int) -> bytes | None:
    """The payload of ``buf`` (one whole entry record, as the index locates it) if its
    header is intact and names this entry and its payload matches its crc; else None
    (the entry is damaged).  ``buf`` may be a memoryview of a larger read: the payload
    is then copied once, into the ``bytes`` returned (a ``bytes`` record: its slice)."""
    h = parse_header(buf, 0)
    if h is None:
        return None
    kind, length, sid, eid, _lac, pcrc = h
    if kind != ENTRY or sid != segment_id or eid != entry_id:
        return None
    if len(buf) != RECORD_HEADER_SIZE + length:
        return None
    data = buf[RECORD_HEADER_SIZE:]
    return bytes(data) if crc32c(data) == pcrc else None


def scan_journal(
    read: ReadFn, start: int, end: int, *, chunk: int = 4 << 20
) -> Iterator[JournalRecord | int]:
    """The intact records of ``[start, end)`` in order, then the position where they
    stop (an ``int``, always the last item): ``end``, or the start of the first record
    that is torn (short, or its header or payload fails its crc).  Nothing after a torn
    record is trusted: a journal is only ever appended to, so damage in it means the
    writer died there."""
    buf = b""
    base = start  # file position of buf[0]
    pos = start
    while True:
        if pos + RECORD_HEADER_SIZE > end:
            yield pos if pos != end else end
            return
        off = pos - base
        if len(buf) - off < RECORD_HEADER_SIZE:
            buf, base, off = read(pos, min(chunk, end - pos)), pos, 0
        h = parse_header(buf, off)
        if h is None:
            yield pos
            return
        kind, length, sid, eid, lac, pcrc = h
        size = RECORD_HEADER_SIZE + length
        if pos + size > end:
            yield pos
            return
        if len(buf) - off < size:
            buf, base, off = read(pos, max(size, min(chunk, end - pos))), pos, 0
            if len(buf) < size:
                yield pos
                return
        payload = buf[off + RECORD_HEADER_SIZE : off + size] if length else b""
        if kind == ENTRY and crc32c(payload) != pcrc:
            yield pos
            return
        yield JournalRecord(kind, sid, eid, lac, pos, size, payload)
        pos += size


def all_zeros(read: ReadFn, start: int, end: int, *, chunk: int = 1 << 20) -> bool:
    """Are the bytes of ``[start, end)`` all zero (a journal file's preallocated, never
    written part: a clean end, not a torn record)?  A short read ends the check (the
    file is shorter than ``end``: nothing more there)."""
    pos = start
    while pos < end:
        buf = read(pos, min(chunk, end - pos))
        if not buf:
            return True
        if buf.count(0) != len(buf):
            return False
        pos += len(buf)
    return True
