"""Byte layout of a segment's files, and the scanner that reads records back.

Nothing here opens a file: the scanner reads through a ``read(pos, n) -> bytes``
callable (``os.pread`` on a data file, or a slice of ``bytes`` in the tests), so the
framing, the checksums and the resynchronisation after damage are tested without disk.

Data file ``<segment id as 16 hex digits>.log``, all integers little-endian::

    offset 0   8s  magic  b"PGNLOG\\x00\\x01"  (format version 1)
    offset 8   u64 segment id
    offset 16  records, back to back, in increasing entry id order; ids may skip
               (a bookie of a striped ensemble stores only some entries of a segment, a
               replacement bookie starts mid-segment)

Record (a 40-byte header, then the payload)::

    +0   4s   magic        b"\\xd7PGR"
    +4   u32  payload length
    +8   u64  segment id
    +16  u64  entry id
    +24  i64  lac          last-add-confirmed the writer piggybacked on this add (-1: none)
    +32  u32  payload crc  CRC32C (Castagnoli) of the payload bytes
    +36  u32  header crc   CRC32C of header bytes +0 .. +36
    +40  payload (payload length bytes, opaque)

Meta file ``<id>.meta`` (32 bytes, replaced atomically: write ``.meta.tmp``, fsync,
rename, fsync the directory)::

    +0  8s   magic  b"PGNMETA\\x01"
    +8  u64  segment id
    +16 u32  flags  (bit 0: fenced)
    +20 i64  lac
    +28 u32  CRC32C of bytes +0 .. +28

The sparse index file is described in :mod:`pigeon.bookie._index`.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final

import google_crc32c

__all__ = [
    "FILE_HEADER_SIZE",
    "IdRanges",
    "MAX_PAYLOAD",
    "META_SIZE",
    "RECORD_HEADER_SIZE",
    "REC",
    "TAIL",
    "ReadFn",
    "ScanEvent",
    "TailScan",
    "collect_entries",
    "crc32c",
    "decode_meta",
    "encode_file_header",
    "encode_meta",
    "encode_record_header",
    "parse_record_header",
    "scan_records",
    "scan_tail",
]

#: CRC32C of a ``bytes`` object.  ``google_crc32c`` only accepts ``bytes`` (not
#: memoryview/bytearray), which is why payloads travel as ``bytes`` in this package.
crc32c: Final[Callable[[bytes], int]] = google_crc32c.value

FILE_MAGIC: Final = b"PGNLOG\x00\x01"
_FILE_HEADER: Final = struct.Struct("<8sQ")
FILE_HEADER_SIZE: Final = _FILE_HEADER.size  # 16

RECORD_MAGIC: Final = b"\xd7PGR"
_HEAD: Final = struct.Struct("<4sIQQqI")  # the part covered by the header crc
_RECORD: Final = struct.Struct("<4sIQQqII")
_HCRC: Final = struct.Struct("<I")
RECORD_HEADER_SIZE: Final = _RECORD.size  # 40
_HEAD_SIZE: Final = _HEAD.size  # 36
MAX_PAYLOAD: Final = 0xFFFF_FFFF

META_MAGIC: Final = b"PGNMETA\x01"
_META: Final = struct.Struct("<8sQIq")
_META_FULL: Final = struct.Struct("<8sQIqI")
META_SIZE: Final = _META_FULL.size  # 32
_FLAG_FENCED: Final = 1

#: ``read(pos, n)`` returns up to ``n`` bytes of the file starting at ``pos``.
ReadFn = Callable[[int, int], bytes]

# Scan event kinds.
REC: Final = 0
TAIL: Final = 1

#: ``(kind, entry_id, pos, record_size, lac, payload, ok)``.  ``REC``: a record with a
#: valid header at ``pos``; ``payload`` is None when not verified (entry id below
#: ``verify_from``), ``ok`` tells whether the payload matched its crc.  ``TAIL``: from
#: ``pos`` on nothing trustworthy follows (torn or garbage tail); always the last event.
ScanEvent = tuple[int, int, int, int, int, bytes | None, bool]


def encode_file_header(segment_id: int) -> bytes:
    return _FILE_HEADER.pack(FILE_MAGIC, segment_id)


def encode_record_header(segment_id: int, entry_id: int, lac: int, payload: bytes) -> bytes:
    """The 40-byte header written in front of ``payload``."""
    head = _HEAD.pack(RECORD_MAGIC, len(payload), segment_id, entry_id, lac, crc32c(payload))
    return head + _HCRC.pack(crc32c(head))


def parse_record_header(buf: bytes, off: int) -> tuple[int, int, int, int, int] | None:
    """``(payload_length, segment_id, entry_id, lac, payload_crc)`` of the header at
    ``buf[off:off + 40]``, or None if its magic or header crc is wrong."""
    if len(buf) - off < RECORD_HEADER_SIZE:
        return None
    magic, length, segment_id, entry_id, lac, pcrc, hcrc = _RECORD.unpack_from(buf, off)
    if magic != RECORD_MAGIC or crc32c(buf[off : off + _HEAD_SIZE]) != hcrc:
        return None
    return length, segment_id, entry_id, lac, pcrc


def encode_meta(segment_id: int, *, fenced: bool, lac: int) -> bytes:
    head = _META.pack(META_MAGIC, segment_id, _FLAG_FENCED if fenced else 0, lac)
    return head + _HCRC.pack(crc32c(head))


def decode_meta(buf: bytes, segment_id: int) -> tuple[bool, int] | None:
    """``(fenced, lac)``, or None if ``buf`` is not an intact meta file of the segment."""
    if len(buf) != META_SIZE:
        return None
    magic, sid, flags, lac, crc = _META_FULL.unpack(buf)
    if magic != META_MAGIC or sid != segment_id or crc != crc32c(buf[: _META.size]):
        return None
    return bool(flags & _FLAG_FENCED), lac


class _Window:
    """A read-ahead buffer over ``read`` limited to ``[0, end)``."""

    __slots__ = ("_buf", "_chunk", "_read", "_start", "end")

    def __init__(self, read: ReadFn, end: int, chunk: int) -> None:
        self._read = read
        self.end = end
        self._chunk = max(chunk, RECORD_HEADER_SIZE)
        self._buf = b""
        self._start = 0

    def _fetch(self, pos: int, n: int) -> bytes | None:
        data = self._read(pos, n)
        if len(data) < n:  # the file is shorter than we were told
            self.end = pos + len(data)
            return None
        return data

    def view(self, pos: int, n: int) -> tuple[bytes, int] | None:
        """``(buf, off)`` such that ``buf[off:off + n]`` are the bytes at ``pos``."""
        if pos + n > self.end:
            return None
        start = self._start
        if start <= pos and pos + n <= start + len(self._buf):
            return self._buf, pos - start
        size = min(max(n, self._chunk), self.end - pos)
        data = self._fetch(pos, size)
        if data is None:
            return None
        self._buf, self._start = data, pos
        return data, 0

    def exact(self, pos: int, n: int) -> bytes | None:
        """The ``n`` bytes at ``pos`` as their own ``bytes`` object (no copy when large)."""
        if pos + n > self.end:
            return None
        start, buf = self._start, self._buf
        if start <= pos and pos + n <= start + len(buf):
            off = pos - start
            return buf if off == 0 and n == len(buf) else buf[off : off + n]
        if n >= self._chunk // 2:
            return self._fetch(pos, n)
        got = self.view(pos, n)
        if got is None:
            return None
        buf, off = got
        return buf[off : off + n]

    def find(self, needle: bytes, pos: int) -> int:
        """Absolute position of the first ``needle`` at or after ``pos``, or -1."""
        k = len(needle)
        while pos + k <= self.end:
            got = self.view(pos, min(self._chunk, self.end - pos))
            if got is None:
                return -1
            buf, off = got
            i = buf.find(needle, off)
            if i >= 0:
                return self._start + i
            pos = max(pos + 1, self._start + len(buf) - (k - 1))
        return -1


def _header_at(w: _Window, pos: int) -> tuple[int, int, int, int, int] | None:
    got = w.view(pos, RECORD_HEADER_SIZE)
    return None if got is None else parse_record_header(*got)


def _resync(w: _Window, segment_id: int, bad: int, expect: int) -> int:
    """Position of the first trustworthy record after the damage at ``bad``, or -1.

    A candidate must carry the magic, a valid header crc, this segment's id, an entry id
    ``>= expect`` and plausible for the bytes skipped (every record takes at least 40
    bytes), and must end inside the file.
    """
    pos = bad + 1
    while True:
        c = w.find(RECORD_MAGIC, pos)
        if c < 0:
            return -1
        h = _header_at(w, c)
        if (
            h is not None
            and h[1] == segment_id
            and expect <= h[2] <= expect + (c - bad) // RECORD_HEADER_SIZE + 1
            and c + RECORD_HEADER_SIZE + h[0] <= w.end
        ):
            return c
        pos = c + 1


def scan_records(
    read: ReadFn,
    segment_id: int,
    start: int,
    end: int,
    expect: int,
    *,
    verify_from: int = 0,
    chunk: int = 128 << 10,
) -> Iterator[ScanEvent]:
    """Walk the records of ``[start, end)``; the record at ``start`` should be ``expect``.

    Records follow each other with consecutive entry ids.  Where the framing breaks (a
    header with a bad magic or crc, or not the expected entry id) the scanner searches
    forward for the next trustworthy header (:func:`_resync`): entries in between are
    skipped (the consumer sees an entry id jump).  A record that would run past ``end``,
    or damage with nothing trustworthy after it, ends the scan with a ``TAIL`` event.
    Payloads of entries ``>= verify_from`` are read and checked against their crc.
    """
    w = _Window(read, end, chunk)
    pos = start
    hsize = RECORD_HEADER_SIZE
    while pos < w.end:
        h = _header_at(w, pos)
        if h is not None and h[1] == segment_id and h[2] == expect:
            length, _, entry_id, lac, pcrc = h
            size = hsize + length
            if pos + size > w.end:
                yield (TAIL, entry_id, pos, size, lac, None, False)
                return
            if entry_id >= verify_from:
                payload = w.exact(pos + hsize, length)
                if payload is None:
                    yield (TAIL, entry_id, pos, size, lac, None, False)
                    return
                yield (REC, entry_id, pos, size, lac, payload, crc32c(payload) == pcrc)
            else:
                yield (REC, entry_id, pos, size, lac, None, True)
            pos += size
            expect = entry_id + 1
            continue
        nxt = _resync(w, segment_id, pos, expect)
        if nxt < 0:
            yield (TAIL, -1, pos, 0, -1, None, False)
            return
        h = _header_at(w, nxt)
        assert h is not None
        expect = h[2]
        pos = nxt


@dataclass
class TailScan:
    """What recovery learnt from scanning a data file from a checkpoint to its end."""

    base: int  #: entry id of ``starts[0]``
    next_id: int  #: one past the last entry kept
    end: int  #: end of the last verified record: the file is truncated here
    lac: int  #: max lac of the verified records (-1 if none)
    starts: array[int] = field(default_factory=lambda: array("q"))
    #: entries kept that cannot be returned: bad payload crc, or lost with a damaged header
    corrupt: set[int] = field(default_factory=set)
    #: checkpoints ``(entry_id, pos)`` found after the starting one
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    damaged_at: int = -1  #: where the scan stopped trusting the file (-1: at its end)


def scan_tail(
    read: ReadFn,
    segment_id: int,
    start: int,
    start_id: int,
    file_end: int,
    *,
    interval: int,
    last_checkpoint: int,
) -> TailScan:
    """Recovery scan: every record of ``[start, file_end)`` is verified.

    Everything after the last record whose payload verifies is a torn tail (writes that
    never completed) and is dropped.  A damaged record *followed by* verified ones is
    kept as a corrupt entry (bit rot): its successors remain readable and are never
    truncated.  ``starts`` has one position per kept entry id; an entry lost with its
    header gets the position of the next record (zero length) and is in ``corrupt``.
    A new checkpoint is taken at each record starting ``interval`` bytes or more after
    the previous one, exactly as the append path does.
    """
    starts: array[int] = array("q")
    corrupt: set[int] = set()
    checkpoints: list[tuple[int, int]] = []
    next_id = start_id
    ok_next, ok_end, lac = start_id, start, -1
    damaged_at = -1
    for kind, entry_id, pos, size, rlac, _payload, ok in scan_records(
        read, segment_id, start, file_end, start_id
    ):
        if kind == TAIL:
            damaged_at = pos
            break
        for lost in range(next_id, entry_id):
            starts.append(pos)
            corrupt.add(lost)
        starts.append(pos)
        next_id = entry_id + 1
        if pos - last_checkpoint >= interval:
            checkpoints.append((entry_id, pos))
            last_checkpoint = pos
        if ok:
            ok_next, ok_end = next_id, pos + size
            lac = max(lac, rlac)
        else:
            corrupt.add(entry_id)
    del starts[ok_next - start_id :]
    return TailScan(
        base=start_id,
        next_id=ok_next,
        end=ok_end,
        lac=lac,
        starts=starts,
        corrupt={c for c in corrupt if c < ok_next},
        checkpoints=[c for c in checkpoints if c[0] < ok_next],
        damaged_at=damaged_at,
    )


def collect_entries(
    read: ReadFn,
    segment_id: int,
    start: int,
    start_id: int,
    end: int,
    first: int,
    last: int,
    *,
    max_bytes: int,
    max_count: int,
    chunk: int = 128 << 10,
    exact_start: bool = True,
) -> tuple[list[tuple[int, bytes]], int, bool]:
    """Read entries ``first..last`` scanning from the record ``start_id`` at ``start``.

    Returns ``(entries, corrupt_id, start_ok)``: the consecutive verified entries from
    ``first`` on (stopping before ``max_bytes`` of payload would be exceeded, but
    always at least one, at ``max_count``, after ``last``, or before a damaged entry),
    the id of the damaged entry that stopped the read when nothing could be returned
    (else -1), and whether a valid record ``start_id`` was found at ``start`` (False
    means the caller's position was wrong; nothing else is then returned).  With
    ``exact_start=False`` a damaged record at ``start`` is skipped like any other.
    """
    out: list[tuple[int, bytes]] = []
    nbytes = 0
    want = first
    started = False
    for kind, entry_id, pos, _size, _lac, payload, ok in scan_records(
        read, segment_id, start, end, start_id, verify_from=first, chunk=chunk
    ):
        if not started:
            if exact_start and (kind != REC or pos != start):
                return [], -1, False
            started = True
        if kind == TAIL:
            break
        if entry_id < want:
            continue
        if entry_id != want or not ok or payload is None:
            break
        if out and nbytes + len(payload) > max_bytes:
            return out, -1, True
        out.append((entry_id, payload))
        nbytes += len(payload)
        want += 1
        if want > last or len(out) >= max_count or nbytes >= max_bytes:
            return out, -1, True
    if not started and exact_start:  # nothing at all at ``start``
        return [], -1, False
    return out, (-1 if out or want > last else want), True
