"""Kafka RecordBatch v2 (message format "magic 2"): the byte layout, checks, and record
parsing and encoding. No I/O. The records section is (de)compressed by
:mod:`pigeon.core._kafka_records_codecs`.

A Kafka producer's RecordBatch is stored as it came, inside our own batch framing
(``formatVersion`` 2, see :mod:`pigeon.core._batch` and
:mod:`pigeon.core._kafka_records_convert`); a native consumer reads it through
``decode_batch``, which parses the records with :func:`parse_records`. A native (format 1)
entry fetched by a Kafka consumer is encoded with :func:`encode_record_batch`.

RecordBatch v2, all integers big-endian (Kafka's ``DefaultRecordBatch``)::

    offset 0   i64  baseOffset             offset of the first record (the log sets it)
    offset 8   i32  batchLength            bytes after this field: size - 12
    offset 12  i32  partitionLeaderEpoch
    offset 16  i8   magic                  2 (0 and 1 are the old message sets)
    offset 17  u32  crc                    CRC-32C of offset 21 .. end
    offset 21  i16  attributes             bits 0-2 compression (0 none, 1 gzip, 2 snappy,
                                           3 lz4, 4 zstd), bit 3 timestamp type (0
                                           CreateTime, 1 LogAppendTime), bit 4
                                           transactional, bit 5 control
    offset 23  i32  lastOffsetDelta        record_count - 1 in a produced batch
    offset 27  i64  firstTimestamp         timestamp of the first record, ms
    offset 35  i64  maxTimestamp
    offset 43  i64  producerId             -1: none (idempotent producers set it)
    offset 51  i16  producerEpoch
    offset 53  i32  baseSequence
    offset 57  i32  recordCount
    offset 61  records, compressed as a whole by the codec of ``attributes``

Each record (``varint`` = zigzag LEB128, as protobuf's ``sint``)::

    varint length (of the rest of the record) | i8 attributes (unused, 0) |
    varlong timestampDelta (from firstTimestamp) | varint offsetDelta (= its index) |
    varint keyLength (-1 = null) | key | varint valueLength (-1 = null) | value |
    varint headerCount | headers: varint keyLength | key (UTF-8) |
                                  varint valueLength (-1 = null) | value

How a Kafka record appears to PigeonMQ consumers, and a PigeonMQ message to Kafka ones:

=========================  ==================================================================
Kafka record               PigeonMQ message
=========================  ==================================================================
offset                     offset (the entry's first offset + the record's index)
key (bytes or null)        key: the bytes, or no key for null (the client decodes keys as
                           UTF-8 with ``surrogateescape``, so any bytes round-trip)
value (bytes or null)      value: the bytes; a null value (a tombstone) reads as ``b""``,
                           and ``b""`` goes back to Kafka as an empty value, not null
timestamp                  event time (firstTimestamp + delta; -1 "none" reads as 0 =
                           unset); back to Kafka: the event time, or the entry's publish
                           time when unset, as CreateTime
headers (ordered list)     properties: name = header key (UTF-8), value = the header's
                           bytes as a string: UTF-8 text as is, other bytes through
                           ``surrogateescape`` (``value.encode("utf-8", "surrogateescape")``
                           gives the header bytes back); a null header value reads as
                           ``""``. The property map keeps the last of duplicate keys
                           (the columns keep them all). Back to Kafka: key and value UTF-8.
producerId/epoch/sequence  not shown (the broker's own de-duplication uses the producer
                           name and sequence id of the native header)
=========================  ==================================================================
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import crc32c as _crc32c

from pigeon.core._kafka_records_codecs import compress_records, decompress_records
from pigeon.core.errors import CorruptRecordBatch, MessageTooLarge, UnsupportedRecordFormat

__all__ = [
    "BATCH_HEADER_SIZE",
    "DEFAULT_MAX_RECORDS_SIZE",
    "RecordBatchInfo",
    "encode_record_batch",
    "parse_records",
    "patch_base_offset",
    "read_batch_info",
    "split_record_batches",
]

BATCH_HEADER_SIZE: Final = 61
#: Decompressed records above this size are refused when the caller gives no limit.
DEFAULT_MAX_RECORDS_SIZE: Final = 128 * 1024 * 1024

_HEADER: Final = struct.Struct(">qiibIhiqqqhii")
_TAIL: Final = struct.Struct(">hiqqqhii")  # attributes .. recordCount (the CRC's start)
_PREFIX: Final = struct.Struct(">qiib")  # baseOffset, batchLength, leaderEpoch, magic
_BASE_OFFSET: Final = struct.Struct(">q")
_CRC_START: Final = 21
_CRC_OFFSET: Final = 17
_INT32_MAX: Final = 2**31 - 1
#: length, attributes, timestamp delta, offset delta, key length, value length, header
#: count: one byte each at least
_MIN_RECORD_SIZE: Final = 7

crc32c: Final[Callable[..., int]] = _crc32c.crc32c


@dataclass(frozen=True, slots=True)
class RecordBatchInfo:
    """The 61-byte header of a RecordBatch v2 (field order as on the wire)."""

    base_offset: int
    batch_length: int
    partition_leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    first_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    record_count: int

    @property
    def compression(self) -> int:
        """0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd."""
        return self.attributes & 7

    @property
    def timestamp_type(self) -> int:
        """0 CreateTime, 1 LogAppendTime."""
        return (self.attributes >> 3) & 1

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & 0x10)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & 0x20)

    @property
    def size(self) -> int:
        """Size of the whole batch: ``batch_length + 12``."""
        return self.batch_length + 12


def _old_format(magic: int) -> UnsupportedRecordFormat:
    return UnsupportedRecordFormat(
        f"Kafka message format v{magic} (magic {magic}) is not supported: "
        "only RecordBatch v2 (Kafka >= 0.11 clients)"
    )


def split_record_batches(records: bytes | bytearray | memoryview) -> list[memoryview]:
    """The RecordBatches of a Produce request's ``records`` field (one or more back to
    back), as views of it. Raises :class:`CorruptRecordBatch` when a size does not add up
    and :class:`UnsupportedRecordFormat` for a v0/v1 message set."""
    mv = memoryview(records).cast("B")
    size = len(mv)
    if size == 0:
        raise CorruptRecordBatch("empty record set")
    out = []
    pos = 0
    unpack = _PREFIX.unpack_from
    while pos < size:
        if size - pos < 17:
            raise CorruptRecordBatch(
                f"record set truncated: {size - pos} bytes left at {pos}, less than a header"
            )
        _, length, _, magic = unpack(mv, pos)
        if magic != 2:
            raise (
                _old_format(magic)
                if magic in (0, 1)
                else CorruptRecordBatch(f"record batch magic {magic} (expected 2)")
            )
        if length < BATCH_HEADER_SIZE - 12:
            raise CorruptRecordBatch(f"record batch length {length} is under the header size")
        end = pos + 12 + length
        if end > size:
            raise CorruptRecordBatch(
                f"record batch of {length + 12} bytes at {pos} overruns the {size}-byte set"
            )
        out.append(mv[pos:end])
        pos = end
    return out


def read_batch_info(
    batch: bytes | bytearray | memoryview, *, verify_crc: bool = True
) -> RecordBatchInfo:
    """Read and check the header of exactly one RecordBatch v2.

    :raises CorruptRecordBatch: wrong size, bad CRC-32C, record count below 1, not
        matching ``lastOffsetDelta`` or (uncompressed) more than the records could hold.
        The records of a compressed batch are not looked at: only parsing them
        (``decode_batch``) shows that ``record_count`` is true.
    :raises UnsupportedRecordFormat: magic 0/1, transactional or control batch, unknown
        compression codec.
    """
    size = len(batch)
    if size < BATCH_HEADER_SIZE:
        raise CorruptRecordBatch(f"record batch of {size} bytes is shorter than its header")
    try:
        info = RecordBatchInfo(*_HEADER.unpack_from(batch))
    except (TypeError, ValueError) as exc:  # a non-byte buffer
        raise CorruptRecordBatch(f"record batch is not a byte buffer: {exc}") from None
    if info.magic != 2:
        if info.magic in (0, 1):
            raise _old_format(info.magic)
        raise CorruptRecordBatch(f"record batch magic {info.magic} (expected 2)")
    if info.size != size:
        raise CorruptRecordBatch(
            f"record batch is {size} bytes but its batchLength says {info.size}"
        )
    if verify_crc:
        crc = crc32c(memoryview(batch)[_CRC_START:])
        if crc != info.crc:
            raise CorruptRecordBatch(
                f"record batch CRC-32C mismatch (computed {crc:#010x}, header {info.crc:#010x})"
            )
    if info.record_count < 1 or info.last_offset_delta != info.record_count - 1:
        raise CorruptRecordBatch(
            f"record batch counts {info.record_count} records with lastOffsetDelta "
            f"{info.last_offset_delta} (expected record_count >= 1, delta = count - 1)"
        )
    if info.compression == 0 and info.record_count * _MIN_RECORD_SIZE > size - BATCH_HEADER_SIZE:
        raise CorruptRecordBatch(
            f"record batch of {size} bytes cannot hold {info.record_count} records"
        )
    if info.is_control or info.is_transactional:
        raise UnsupportedRecordFormat(
            "transactional and control record batches are not supported "
            "(PigeonMQ's Kafka front door has no transactions)"
        )
    if info.compression > 4:
        raise UnsupportedRecordFormat(f"record batch compression id {info.compression} unknown")
    return info


def count_records(batch: bytes | memoryview, info: RecordBatchInfo, limit: int) -> int:
    """Check that the batch holds exactly ``info.record_count`` records, by walking their
    length prefixes (decompressing a compressed batch first, to at most ``limit`` bytes):
    the count decides how many offsets the batch takes, so it must be true before the
    batch is stored.  Cheap: one varint per record, no field is decoded.

    :raises CorruptRecordBatch: the records do not add up to the count.
    :raises MessageTooLarge: the records decompress to more than ``limit`` bytes.
    """
    body = memoryview(batch)[BATCH_HEADER_SIZE:]
    data = (
        bytes(body) if info.compression == 0 else decompress_records(info.compression, body, limit)
    )
    end = len(data)
    pos = 0
    n = 0
    try:
        while pos < end:
            raw, pos = _uvarint(data, pos)
            length = (raw >> 1) ^ -(raw & 1)
            if length < 0:
                raise CorruptRecordBatch(f"record {n} has a negative length {length}")
            pos += length
            n += 1
    except IndexError:
        raise CorruptRecordBatch(f"record {n} is cut short") from None
    if pos != end or n != info.record_count:
        raise CorruptRecordBatch(
            f"record batch says {info.record_count} records, holds {n}"
            + ("" if pos == end else f" and {pos - end} bytes are missing")
        )
    return n


# -- records ------------------------------------------------------------------------------


def _uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 at ``pos`` (at most 10 bytes) and the position after it."""
    result = 0
    shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CorruptRecordBatch(f"varint longer than 10 bytes at {pos}")


#: parse_records' result: values, keys, timestamps, header offsets (n+1 into the flat
#: header lists), header keys, header values.
Records = tuple[
    list[bytes], list[bytes | None], list[int], list[int], list[bytes], list[bytes | None]
]


def parse_records(buf: bytes, count: int, first_timestamp: int) -> Records:
    """Parse the ``count`` records of an uncompressed records section (every record
    checked to end where its length says, offset deltas 0, 1, ...; nothing left over).

    Null values come back as ``b""``, null keys and header values as ``None``; timestamps
    are absolute (``first_timestamp`` + delta).

    :raises CorruptRecordBatch: anything that does not add up.
    """
    try:
        return _parse(buf, count, first_timestamp)
    except IndexError:
        raise CorruptRecordBatch("record runs past the end of its batch") from None


def _parse(buf: bytes, count: int, first_ts: int) -> Records:
    values: list[bytes] = []
    keys: list[bytes | None] = []
    times: list[int] = []
    hoff: list[int] = [0]
    hkeys: list[bytes] = []
    hvals: list[bytes | None] = []
    add_v, add_k, add_t, add_ho = values.append, keys.append, times.append, hoff.append
    uv = _uvarint
    end = len(buf)
    pos = 0
    nh = 0
    for i in range(count):
        v = buf[pos]  # record length
        if v < 0x80:
            pos += 1
        elif buf[pos + 1] < 0x80:
            v = (v & 0x7F) | (buf[pos + 1] << 7)
            pos += 2
        else:
            v, pos = uv(buf, pos)
        rec_end = pos + ((v >> 1) ^ -(v & 1))
        if rec_end > end or rec_end < pos + 6:
            raise CorruptRecordBatch(f"record {i} length does not fit its batch")
        v = buf[pos + 1]  # skip attributes; timestamp delta
        if v < 0x80:
            pos += 2
        else:
            v, pos = uv(buf, pos + 1)
        add_t(first_ts + ((v >> 1) ^ -(v & 1)))
        v = buf[pos]  # offset delta
        if v < 0x80:
            pos += 1
        elif buf[pos + 1] < 0x80:
            v = (v & 0x7F) | (buf[pos + 1] << 7)
            pos += 2
        else:
            v, pos = uv(buf, pos)
        if v != i << 1:  # zigzag of offset delta i
            raise CorruptRecordBatch(f"record {i} has offset delta {(v >> 1) ^ -(v & 1)}")
        v = buf[pos]  # key length
        if v < 0x80:
            pos += 1
        elif buf[pos + 1] < 0x80:
            v = (v & 0x7F) | (buf[pos + 1] << 7)
            pos += 2
        else:
            v, pos = uv(buf, pos)
        n = (v >> 1) ^ -(v & 1)
        if n >= 0:
            add_k(buf[pos : pos + n])
            pos += n
        elif n == -1:
            add_k(None)
        else:
            raise CorruptRecordBatch(f"record {i} has key length {n}")
        v = buf[pos]  # value length
        if v < 0x80:
            pos += 1
        elif buf[pos + 1] < 0x80:
            v = (v & 0x7F) | (buf[pos + 1] << 7)
            pos += 2
        else:
            v, pos = uv(buf, pos)
        n = (v >> 1) ^ -(v & 1)
        if n >= 0:
            add_v(buf[pos : pos + n])
            pos += n
        elif n == -1:
            add_v(b"")
        else:
            raise CorruptRecordBatch(f"record {i} has value length {n}")
        v = buf[pos]  # header count
        if v < 0x80:
            pos += 1
        elif buf[pos + 1] < 0x80:
            v = (v & 0x7F) | (buf[pos + 1] << 7)
            pos += 2
        else:
            v, pos = uv(buf, pos)
        h = (v >> 1) ^ -(v & 1)
        if h:
            if h < 0 or h > rec_end - pos:
                raise CorruptRecordBatch(f"record {i} has {h} headers")
            for _ in range(h):
                v, pos = uv(buf, pos)
                n = (v >> 1) ^ -(v & 1)
                if n < 0:
                    raise CorruptRecordBatch(f"record {i} has a header key of length {n}")
                hkeys.append(buf[pos : pos + n])
                pos += n
                v, pos = uv(buf, pos)
                n = (v >> 1) ^ -(v & 1)
                if n >= 0:
                    hvals.append(buf[pos : pos + n])
                    pos += n
                elif n == -1:
                    hvals.append(None)
                else:
                    raise CorruptRecordBatch(f"record {i} has a header value of length {n}")
            nh += h
        add_ho(nh)
        if pos != rec_end:
            raise CorruptRecordBatch(f"record {i} does not end where its length says")
    if pos != end:
        raise CorruptRecordBatch(f"{end - pos} bytes after the last record of the batch")
    return values, keys, times, hoff, hkeys, hvals


def _zigzag_slow(n: int) -> bytes:
    u = (n << 1) ^ (n >> 63)
    out = bytearray()
    while u >= 0x80:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    out.append(u)
    return bytes(out)


_SMALL: Final = 8192
#: zigzag varints of -8192 .. 8191 (one or two bytes), indexed by n + 8192
_VARINTS: Final = tuple(_zigzag_slow(n) for n in range(-_SMALL, _SMALL))


def _varint(n: int) -> bytes:
    if -_SMALL <= n < _SMALL:
        return _VARINTS[n + _SMALL]
    return _zigzag_slow(n)


def _encode_headers(hkeys: Sequence[bytes], hvals: Sequence[bytes | None]) -> list[bytes]:
    """Each header as on the wire: key length, key, value length, value."""
    vi = _varint
    null = vi(-1)
    return [
        vi(len(hk)) + hk + (null if hv is None else vi(len(hv)) + hv)
        for hk, hv in zip(hkeys, hvals, strict=True)
    ]


def encode_record_batch(
    values: Sequence[bytes],
    keys: Sequence[bytes | None],
    timestamps: Sequence[int],
    headers: Sequence[Sequence[tuple[bytes, bytes | None]]] | None = None,
    *,
    base_offset: int = 0,
    compression: int = 0,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
) -> list[bytes]:
    """A RecordBatch v2 (CreateTime) of these records, as ``[header, records]``: one item
    per record in ``values``, ``keys`` and ``timestamps`` (ms) and, when given,
    ``headers`` (``(key, value)`` pairs, key UTF-8 bytes, value ``None`` for null)."""
    n = len(values)
    hoff: list[int] | None = None
    hkeys: list[bytes] = []
    hvals: list[bytes | None] = []
    if headers is not None:
        hoff = [0]
        for pairs in headers:
            for k, v in pairs:
                hkeys.append(k)
                hvals.append(v)
            hoff.append(len(hkeys))
    return _encode_batch(
        n,
        values,
        keys,
        timestamps,
        hoff,
        hkeys,
        hvals,
        base_offset=base_offset,
        compression=compression,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=base_sequence,
    )


def _encode_batch(
    n: int,
    values: Sequence[bytes],
    keys: Sequence[bytes | None],
    times: Sequence[int],
    hoff: Sequence[int] | None,
    hkeys: Sequence[bytes],
    hvals: Sequence[bytes | None],
    *,
    base_offset: int,
    compression: int = 0,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    deltas: Sequence[int] | None = None,
    last_delta: int | None = None,
) -> list[bytes]:
    """The batch of ``n`` records (headers of record ``i``: ``hkeys/hvals[hoff[i]:hoff[i+1]]``).

    Record ``i`` has offset delta ``i``, or ``deltas[i]`` (ascending: a compacted batch's
    records keep their offsets, with gaps); lastOffsetDelta is ``n - 1``, or
    ``last_delta`` (a compacted batch keeps its original last offset, as Kafka's cleaner
    does, so a consumer goes on after the whole original batch)."""
    if n < 1 or len(values) != n or len(keys) != n or len(times) != n:
        raise ValueError("a record batch needs n >= 1 records with n keys and timestamps")
    if deltas is not None and (len(deltas) != n or last_delta is None or deltas[-1] > last_delta):
        raise ValueError("offset deltas need one per record and a last delta past them")
    first = times[0]
    parts: list[bytes] = []
    vi = _varint
    table = _VARINTS
    small = _SMALL
    null = table[small - 1]  # varint -1
    empty_headers = table[small]  # varint 0
    pairs: list[bytes] = []  # each header encoded: key length, key, value length, value
    if hoff is not None and hoff[-1]:
        pairs = _encode_headers(hkeys, hvals)
    offset_deltas = range(n) if deltas is None else deltas
    for i, o, value, key, t in zip(range(n), offset_deltas, values, keys, times, strict=True):
        d = t - first
        tsd = table[d + small] if -small <= d < small else vi(d)
        od = table[o + small] if o < small else vi(o)
        vlen = len(value)
        vl = table[vlen + small] if vlen < small else vi(vlen)
        if key is None:
            kl = null
            klen = 0
            key = b""
        else:
            klen = len(key)
            kl = table[klen + small] if klen < small else vi(klen)
        hblob = empty_headers
        if pairs:
            a, b = hoff[i], hoff[i + 1]  # type: ignore[index]
            if a != b:
                hblob = vi(b - a) + b"".join(pairs[a:b])
        length = 1 + len(tsd) + len(od) + len(kl) + klen + len(vl) + vlen + len(hblob)
        parts += (
            table[length + small] if length < small else vi(length),
            b"\0",
            tsd,
            od,
            kl,
            key,
            vl,
            value,
            hblob,
        )
    records = b"".join(parts)
    if compression:
        records = compress_records(compression, records)
    if len(records) + BATCH_HEADER_SIZE - 12 > _INT32_MAX:
        raise MessageTooLarge(f"record batch of {len(records)} bytes is over 2 GiB")
    head = bytearray(BATCH_HEADER_SIZE)
    _TAIL.pack_into(
        head,
        _CRC_START,
        compression,
        n - 1 if last_delta is None else last_delta,
        first,
        max(times),
        producer_id,
        producer_epoch,
        base_sequence,
        n,
    )
    crc = crc32c(records, crc32c(memoryview(head)[_CRC_START:]))
    _PREFIX.pack_into(head, 0, base_offset, len(records) + BATCH_HEADER_SIZE - 12, -1, 2)
    struct.pack_into(">I", head, _CRC_OFFSET, crc)
    return [bytes(head), records]


def patch_base_offset(batch: bytes | memoryview, base_offset: int) -> list[bytes | memoryview]:
    """``batch`` with a new baseOffset (outside the CRC), as ``[8 bytes, rest view]``."""
    return [_BASE_OFFSET.pack(base_offset), memoryview(batch)[8:]]
