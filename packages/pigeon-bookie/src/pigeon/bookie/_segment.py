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

The sparse index file is described in :mod:`pigeon.bookie._index`; what the store
makes of the records scanned (recovery, reads, repair) is in
:mod:`pigeon.bookie._segment_scan`.
"""

from __future__ import annotations

import struct
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from typing import Final

import crc32c as _crc32c

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
    "crc32c",
    "decode_meta",
    "encode_file_header",
    "encode_meta",
    "encode_record_header",
    "parse_record_header",
    "scan_records",
]

#: A payload as the store takes it: a received frame's bytes are written to the data
#: file as memoryviews of the frame, never copied into a ``bytes`` of their own.
Buffer = bytes | bytearray | memoryview

#: CRC32C (Castagnoli) of any contiguous buffer, hardware-accelerated where the CPU has
#: it (the crc32c package reads the buffer in place: a memoryview of a received frame is
#: checksummed without being copied)
crc32c: Final[Callable[[Buffer], int]] = _crc32c.crc32c


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


def encode_record_header(segment_id: int, entry_id: int, lac: int, payload: Buffer) -> bytes:
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

    A candidate must carry the magic, a valid header crc (CRC32C over the header: a
    random match is a 2**-32 event on top of the magic), this segment's id and an entry
    id ``>= expect``, and must end inside the file.  Ids only grow in a data file but may
    skip any number of ids, so nothing bounds them from above.
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
            and h[2] >= expect
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
    """Walk the records of ``[start, end)``; the record at ``start`` should have entry id
    ``expect`` or a higher one.

    Records follow each other with increasing entry ids, which may skip (an entry this
    bookie does not store).  Where the framing breaks (a header with a bad magic or crc,
    or an entry id not above the previous one) the scanner searches forward for the
    next trustworthy header (:func:`_resync`): the consumer sees a record that does not
    start where the previous one ended, and the ids in between may have been lost with
    the damage.  A record that would run past ``end``, or damage with nothing
    trustworthy after it, ends the scan with a ``TAIL`` event.  Payloads of entries
    ``>= verify_from`` are read and checked against their crc.
    """
    w = _Window(read, end, chunk)
    pos = start
    hsize = RECORD_HEADER_SIZE
    while pos < w.end:
        h = _header_at(w, pos)
        if h is not None and h[1] == segment_id and h[2] >= expect:
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
        pos = nxt


class IdRanges:
    """A set of entry ids kept as sorted, disjoint, inclusive ranges.

    The ids an entry-id jump over damaged bytes may have lost are a range that can be
    huge when ids skip (a replacement bookie starting at entry 10**6): a plain ``set``
    would hold each of them.  Compares equal to a ``set`` of the same ids.
    """

    __slots__ = ("_hi", "_lo")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        for i in ids:
            self.add(i)

    def add(self, entry_id: int) -> None:
        self.add_range(entry_id, entry_id)

    def add_range(self, lo: int, hi: int) -> None:
        """Add ``lo..hi`` (inclusive); nothing if ``hi < lo``."""
        if hi < lo:
            return
        # ranges touching or overlapping [lo, hi] are merged into it
        i = bisect_left(self._hi, lo - 1)
        j = bisect_right(self._lo, hi + 1)
        if i < j:
            lo = min(lo, self._lo[i])
            hi = max(hi, self._hi[j - 1])
        self._lo[i:j] = [lo]
        self._hi[i:j] = [hi]

    def discard(self, entry_id: int) -> None:
        """Remove ``entry_id`` (nothing if absent)."""
        k = bisect_right(self._lo, entry_id) - 1
        if k < 0 or entry_id > self._hi[k]:
            return
        lo, hi = self._lo[k], self._hi[k]
        parts = [(a, b) for a, b in ((lo, entry_id - 1), (entry_id + 1, hi)) if a <= b]
        self._lo[k : k + 1] = [a for a, _ in parts]
        self._hi[k : k + 1] = [b for _, b in parts]

    def __contains__(self, entry_id: object) -> bool:
        if not isinstance(entry_id, int):
            return False
        k = bisect_right(self._lo, entry_id) - 1
        return k >= 0 and entry_id <= self._hi[k]

    def __len__(self) -> int:
        return sum(h - lo + 1 for lo, h in zip(self._lo, self._hi, strict=True))

    def __bool__(self) -> bool:
        return bool(self._lo)

    def __iter__(self) -> Iterator[int]:
        for lo, hi in zip(self._lo, self._hi, strict=True):
            yield from range(lo, hi + 1)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._lo, self._hi, strict=True))

    def below(self, limit: int) -> IdRanges:
        """The ids ``< limit``."""
        out = IdRanges()
        for lo, hi in zip(self._lo, self._hi, strict=True):
            if lo >= limit:
                break
            out._lo.append(lo)
            out._hi.append(min(hi, limit - 1))
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdRanges):
            return self._lo == other._lo and self._hi == other._hi
        if isinstance(other, set | frozenset):
            return len(self) == len(other) and all(i in self for i in other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        parts = [str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in self.ranges()]
        return f"IdRanges({', '.join(parts)})"

    def __str__(self) -> str:
        """The ranges for a log line (the first 20 of them)."""
        ranges = self.ranges()
        parts = [str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in ranges[:20]]
        if len(ranges) > 20:
            parts.append(f"... ({len(ranges) - 20} more ranges)")
        return ",".join(parts) or "none"
