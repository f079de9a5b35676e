"""Kafka RecordBatches in and out of stored entries. No I/O.

In: :func:`wrap_record_batch` puts a producer's RecordBatch, unchanged, behind a native
``BatchHeader`` of ``formatVersion`` 2 (see :mod:`pigeon.core._batch`): per batch work
only, the records are not looked at. Out: :func:`kafka_batch_of_entry` turns a stored
entry into the RecordBatch a Kafka consumer fetches, with baseOffset = the entry's first
offset: a format-2 entry only gets its first 8 bytes replaced (baseOffset is outside the
CRC), a native (format 1) entry is encoded record by record as one uncompressed batch.
The field mapping is in :mod:`pigeon.core._kafka_records`.
"""

from __future__ import annotations

from itertools import islice

from pigeon.core._batch import (
    _INT64_MAX,
    _INT64_MIN,
    _U32,
    _UINT64_MAX,
    FORMAT_KAFKA,
    _as_bytes_view,
    _check_int,
    _check_producer_name,
    _read_header,
)
from pigeon.core._batch_decode import DecodedBatch, decode_batch
from pigeon.core._batch_encode import _new_header
from pigeon.core._codecs import CodecSet
from pigeon.core._entry import ENTRY_HEADER_SIZE, unpack_entry_header
from pigeon.core._kafka_records import RecordBatchInfo, _encode_batch, patch_base_offset
from pigeon.core.errors import CorruptRecordBatch

__all__ = ["kafka_batch_of_entry", "wrap_record_batch"]


def wrap_record_batch(
    batch: bytes | memoryview,
    info: RecordBatchInfo,
    *,
    producer_name: str,
    sequence_id: int,
    publish_time: int,
) -> list[bytes | memoryview]:
    """The native batch holding ``batch`` (checked by :func:`read_batch_info`, which gave
    ``info``): ``[length prefix + BatchHeader, batch]``, unjoined, for ``sendmsg`` /
    ``pwritev``. ``read_header`` of the joined buffers gives ``formatVersion`` 2 and
    ``num_messages = info.record_count``."""
    _check_producer_name(producer_name)
    _check_int("sequence_id", sequence_id, 0, _UINT64_MAX - info.record_count + 1)
    _check_int("publish_time", publish_time, _INT64_MIN, _INT64_MAX)
    size = len(batch)
    if size != info.size:
        raise CorruptRecordBatch(f"record batch is {size} bytes but its header says {info.size}")
    h = _new_header(
        FORMAT_KAFKA, producer_name, sequence_id, info.record_count, size, size, publish_time
    )
    raw = h.to_bytes()
    return [_U32.pack(len(raw)) + raw, batch]


def kafka_batch_of_entry(
    stored_entry: bytes | bytearray | memoryview, codecs: CodecSet
) -> list[bytes | memoryview]:
    """The RecordBatch v2 of a stored entry (``entry header | batch``) for a Kafka
    consumer, baseOffset = the entry's first offset, as buffers to send in order.

    A format-2 entry costs one 8-byte buffer and a view of the rest (no copy, no CRC
    computed); a native entry is decoded (``codecs``) and encoded uncompressed.

    :raises CorruptFrame: (or a subclass, :class:`CorruptEntry`, :class:`CodecError`) the
        stored entry does not decode.
    """
    mv = _as_bytes_view(stored_entry)
    entry = unpack_entry_header(mv)
    batch = mv[ENTRY_HEADER_SIZE:]
    header = _read_header(batch)
    if header.format_version == FORMAT_KAFKA:
        return patch_base_offset(batch[header.body_offset :], entry.first_offset)
    out: list[bytes | memoryview] = []
    out += _native_to_kafka(decode_batch(batch, codecs), entry.first_offset, entry.publish_time)
    return out


def _slices(data: memoryview | None, offsets: list[int]) -> list[bytes]:
    raw = b"" if data is None else data.tobytes()
    return [raw[a:b] for a, b in zip(offsets, islice(offsets, 1, None), strict=False)]


def _native_to_kafka(b: DecodedBatch, first_offset: int, publish_time: int) -> list[bytes]:
    n = b.num_messages
    if b.event_times is not None:
        times = b.event_times.tolist()
        if 0 in times:
            times = [t or publish_time for t in times]
    else:
        times = [publish_time] * n
    hoff: list[int] | None = None
    hkeys: list[bytes] = []
    hvals: list[bytes] = []
    if b._poff is not None:
        hoff = b._poff
        hkeys = _slices(b.property_keys_data, b._pk)
        hvals = _slices(b.property_values_data, b._pv)
    return _encode_batch(
        n, b.values(), b.keys(), times, hoff, hkeys, hvals, base_offset=first_offset
    )
