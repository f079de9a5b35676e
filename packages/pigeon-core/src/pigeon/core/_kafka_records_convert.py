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

from collections.abc import Sequence
from itertools import islice, pairwise

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
from pigeon.core._kafka_records import (
    BATCH_HEADER_SIZE,
    DEFAULT_MAX_RECORDS_SIZE,
    RecordBatchInfo,
    _encode_batch,
    parse_records,
    patch_base_offset,
    read_batch_info,
)
from pigeon.core._kafka_records_codecs import decompress_records
from pigeon.core.errors import CorruptRecordBatch

__all__ = ["kafka_batch_of_entry", "kafka_batch_of_kept", "wrap_record_batch"]


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


def kafka_batch_of_kept(
    stored_entry: bytes | bytearray | memoryview, kept: Sequence[int], codecs: CodecSet
) -> list[bytes | memoryview]:
    """The RecordBatch v2 of the messages at batch indexes ``kept`` (ascending) of a
    stored entry, as Kafka's log cleaner leaves a batch: baseOffset the entry's first
    offset, each record its own offset delta (offsets with gaps), lastOffsetDelta the
    entry's last, uncompressed.  All of them kept: :func:`kafka_batch_of_entry`.

    :raises CorruptFrame: (or a subclass) the stored entry does not decode.
    :raises ValueError: ``kept`` is empty, not ascending, or out of the entry.
    """
    mv = _as_bytes_view(stored_entry)
    entry = unpack_entry_header(mv)
    n = entry.num_messages
    if not kept or any(b <= a for a, b in pairwise(kept)) or kept[0] < 0 or kept[-1] >= n:
        raise ValueError(f"kept indexes {list(kept)[:8]} do not fit an entry of {n} messages")
    if len(kept) == n:
        return kafka_batch_of_entry(stored_entry, codecs)
    batch = mv[ENTRY_HEADER_SIZE:]
    header = _read_header(batch)
    if header.format_version == FORMAT_KAFKA:
        body = batch[header.body_offset :]
        info = read_batch_info(body)
        section = body[BATCH_HEADER_SIZE:]
        records = (
            bytes(section)
            if info.compression == 0
            else decompress_records(info.compression, section, DEFAULT_MAX_RECORDS_SIZE)
        )
        values, keys, times, hoff, hkeys, hvals = parse_records(
            records, info.record_count, info.first_timestamp
        )
        times = [entry.publish_time if t == -1 else t for t in times]
    else:
        b = decode_batch(batch, codecs)
        values, keys = b.values(), b.keys()
        times = _times(b, entry.publish_time)
        if b._poff is not None:
            hoff = b._poff
            hkeys = _slices(b.property_keys_data, b._pk)
            hvals = list(_slices(b.property_values_data, b._pv))
        else:
            hoff, hkeys, hvals = [0] * (n + 1), [], []
    k_hoff = [0]
    k_hkeys: list[bytes] = []
    k_hvals: list[bytes | None] = []
    for i in kept:
        k_hkeys += hkeys[hoff[i] : hoff[i + 1]]
        k_hvals += hvals[hoff[i] : hoff[i + 1]]
        k_hoff.append(len(k_hkeys))
    out: list[bytes | memoryview] = []
    out += _encode_batch(
        len(kept),
        [values[i] for i in kept],
        [keys[i] for i in kept],
        [times[i] for i in kept],
        k_hoff,
        k_hkeys,
        k_hvals,
        base_offset=entry.first_offset,
        deltas=kept,
        last_delta=n - 1,
    )
    return out


def _times(b: DecodedBatch, publish_time: int) -> list[int]:
    """A native batch's Kafka timestamps: event times, the publish time where none."""
    if b.event_times is None:
        return [publish_time] * b.num_messages
    times: list[int] = b.event_times.tolist()
    return [t or publish_time for t in times] if 0 in times else times


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
