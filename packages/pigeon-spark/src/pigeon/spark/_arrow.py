"""Stored entries to Arrow record batches, column by column. No I/O, no Spark.

A stored entry is the 32-byte broker header (:mod:`pigeon.core._entry`) followed by the
producer's columnar batch (:mod:`pigeon.core._batch`). Each batch column is already an
Arrow buffer: values and keys are ``binary`` arrays (int32 offsets from 0 + data, keys
with a validity bitmap), event times an int64 column, properties a
``map<string, string>`` (per-message pair offsets, key and value string arrays). So an
entry becomes Arrow arrays with :meth:`pyarrow.Array.from_buffers` over views of the
entry — no Python work per message — and a record batch is the concatenation of the
entries' arrays. The columns a batch does not carry are built per entry with bytes
repetition (``pack(x) * n``) and per record batch with Arrow compute kernels
(``offset = first + arange``, ``message_id`` = the joined decimal fields). Finally the
batch is sliced to the requested offsets (entries may start before / end after them).

Column types are exactly what PySpark expects for the Spark schema
(:data:`SOURCE_COLUMNS`): binary, string, int32, int64, ``timestamp[us, tz=UTC]`` and
``map<string, string>``.

With a ``decode`` function (AVRO and JSON schema topics, :mod:`pigeon.spark._avro`),
``value`` is the decoded struct and the raw bytes move to a last column, ``data``. The
batch header's schema version of every row (an int32 column built like the publish
times) goes with the values to ``decode``, once per record batch and only for the rows
left after slicing.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from pigeon.core.batch import (
    ENTRY_HEADER_SIZE,
    DecodedBatch,
    EntryHeader,
    decode_batch,
    unpack_entry_header,
)
from pigeon.core.codecs import CodecSet

__all__ = [
    "SOURCE_COLUMNS",
    "DATA_COLUMN",
    "EntryLike",
    "arrow_schema",
    "record_batches",
]

#: (name, Spark SQL type) of the source's columns; ``properties`` only when asked for.
SOURCE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("key", "binary"),
    ("value", "binary"),
    ("topic", "string"),
    ("partition", "int"),
    ("offset", "bigint"),
    ("message_id", "binary"),
    ("publish_time", "timestamp"),
    ("event_time", "timestamp"),
    ("properties", "map<string,string>"),
)

#: The raw value bytes when ``value`` is decoded (always the last column).
DATA_COLUMN = ("data", "binary")

TIMESTAMP = pa.timestamp("us", tz="UTC")
PROPERTIES = pa.map_(pa.string(), pa.string())
_ARROW_TYPES = {
    "binary": pa.binary(),
    "string": pa.string(),
    "int": pa.int32(),
    "bigint": pa.int64(),
    "timestamp": TIMESTAMP,
    "map<string,string>": PROPERTIES,
}
_Q = struct.Struct("<q")
_I = struct.Struct("<i")
_EMPTY = pa.py_buffer(b"")

#: Rows per record batch (Spark's ``spark.sql.execution.arrow.maxRecordsPerBatch``).
MAX_ROWS = 10_000
#: Value + key bytes per record batch.
MAX_BYTES = 16 * 1024 * 1024


class EntryLike(Protocol):
    segment_id: int
    entry_id: int
    data: Any  # bytes-like: broker header + batch


#: ``decode(values, schema_versions)``: the decoded ``value`` column of a record batch.
Decode = Callable[[pa.Array, pa.Array], pa.Array]


def arrow_schema(include_properties: bool, value_type: pa.DataType | None = None) -> pa.Schema:
    """The record batches' schema; with ``value_type`` (a decoded value) ``value`` has
    that type and the raw bytes are the last column, ``data``."""
    cols = SOURCE_COLUMNS if include_properties else SOURCE_COLUMNS[:-1]
    fields = [pa.field(name, _ARROW_TYPES[kind]) for name, kind in cols]
    if value_type is not None:
        fields[1] = pa.field("value", value_type)
        fields.append(pa.field(DATA_COLUMN[0], _ARROW_TYPES[DATA_COLUMN[1]]))
    return pa.schema(fields)


class _Decoded:
    __slots__ = ("batch", "entry_id", "header", "segment_id")

    def __init__(self, segment_id: int, entry_id: int, header: EntryHeader, batch: DecodedBatch):
        self.segment_id = segment_id
        self.entry_id = entry_id
        self.header = header
        self.batch = batch


def _decode(entry: EntryLike, codecs: CodecSet) -> _Decoded:
    data = memoryview(entry.data)
    header = unpack_entry_header(data)
    batch = decode_batch(data[ENTRY_HEADER_SIZE:], codecs)
    return _Decoded(entry.segment_id, entry.entry_id, header, batch)


def _binary(n: int, validity: Any, offsets: Any, data: Any) -> pa.Array:
    return pa.Array.from_buffers(
        pa.binary(),
        n,
        [
            None if validity is None else pa.py_buffer(validity),
            pa.py_buffer(offsets),
            pa.py_buffer(data) if len(data) else _EMPTY,
        ],
    )


def _int64(n: int, buf: Any) -> pa.Array:
    return pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(buf)])


def _arange(first: int, n: int) -> array[int]:
    """int64 ``first .. first + n - 1`` (the array constructor runs the range in C)."""
    return array("q", range(first, first + n))


def _concat(arrays: list[pa.Array]) -> pa.Array:
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


def _properties(b: DecodedBatch, n: int) -> pa.Array:
    if not b.has_properties:
        zeros = pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(bytes(4 * (n + 1)))])
        empty = pa.array([], pa.string())
        return pa.MapArray.from_arrays(zeros, empty, empty)
    m = b.header.property_entries
    keys = pa.Array.from_buffers(
        pa.string(),
        m,
        [None, pa.py_buffer(b.property_keys_offsets), pa.py_buffer(b.property_keys_data)],
    )
    values = pa.Array.from_buffers(
        pa.string(),
        m,
        [None, pa.py_buffer(b.property_values_offsets), pa.py_buffer(b.property_values_data)],
    )
    offsets = pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(b.properties_offsets)])
    return pa.MapArray.from_arrays(offsets, keys, values)


def _build(
    group: list[_Decoded],
    *,
    topic: str,
    partition: int,
    start: int,
    end: int,
    schema: pa.Schema,
    include_properties: bool,
    versions: bool,
) -> pa.RecordBatch | None:
    """The rows of ``group`` in ``[start, end)``; with ``versions`` a last int32 column
    holds each row's batch-header schema version."""
    values: list[pa.Array] = []
    keys: list[pa.Array] = []
    event_parts: list[Any] = []
    props: list[pa.Array] = []
    publish_parts: list[bytes] = []
    first_parts: list[bytes] = []
    segment_parts: list[bytes] = []
    entry_parts: list[bytes] = []
    version_parts: list[bytes] = []
    has_events = False
    contiguous = True
    first = group[0].header.first_offset
    total = 0
    for d in group:
        b, h = d.batch, d.header
        n = b.num_messages
        if h.first_offset != first + total:
            contiguous = False
        values.append(_binary(n, None, b.values_offsets, b.values_data))
        if b.has_keys:
            keys.append(_binary(n, b.keys_validity, b.keys_offsets, b.keys_data))
        else:
            keys.append(pa.nulls(n, pa.binary()))
        if b.event_times is not None:
            has_events = True
            event_parts.append(b.event_times)
        else:
            event_parts.append(bytes(8 * n))
        if include_properties:
            props.append(_properties(b, n))
        publish_parts.append(_Q.pack(h.publish_time * 1000) * n)
        first_parts.append(_Q.pack(h.first_offset) * n)
        segment_parts.append(_Q.pack(d.segment_id) * n)
        entry_parts.append(_Q.pack(d.entry_id) * n)
        if versions:
            version_parts.append(_I.pack(b.header.schema_version) * n)
        total += n

    if contiguous:
        offsets = _int64(total, _arange(first, total))
    else:  # entries of one partition are contiguous; this only guards the slicing below
        offsets = pa.concat_arrays(
            [
                _int64(d.batch.num_messages, _arange(d.header.first_offset, d.batch.num_messages))
                for d in group
            ]
        )
    firsts = _int64(total, b"".join(first_parts))
    batch_index = pc.subtract(offsets, firsts)
    message_id = pc.cast(
        pc.binary_join_element_wise(
            pc.cast(_int64(total, b"".join(segment_parts)), pa.string()),
            pc.cast(_int64(total, b"".join(entry_parts)), pa.string()),
            pc.cast(batch_index, pa.string()),
            str(partition),
            pc.cast(offsets, pa.string()),
            ":",
        ),
        pa.binary(),
    )
    publish = pa.Array.from_buffers(TIMESTAMP, total, [None, pa.py_buffer(b"".join(publish_parts))])
    if has_events:
        raw = _int64(total, b"".join(event_parts))
        event = pc.if_else(
            pc.equal(raw, 0), pa.scalar(None, TIMESTAMP), pc.multiply(raw, 1000).cast(TIMESTAMP)
        )
    else:
        event = pa.nulls(total, TIMESTAMP)
    columns = [
        _concat(keys),
        _concat(values),
        pa.repeat(pa.scalar(topic, pa.string()), total),
        pa.repeat(pa.scalar(partition, pa.int32()), total),
        offsets,
        message_id,
        publish,
        event,
    ]
    if include_properties:
        columns.append(_concat(props))
    if versions:
        columns.append(
            pa.Array.from_buffers(pa.int32(), total, [None, pa.py_buffer(b"".join(version_parts))])
        )
    rb = pa.RecordBatch.from_arrays(columns, schema=schema)
    if not contiguous:
        rb = rb.filter(pc.and_(pc.greater_equal(offsets, start), pc.less(offsets, end)))
        return rb if rb.num_rows else None
    lo = max(0, start - first)
    hi = min(total, end - first)
    if hi <= lo:
        return None
    return rb if (lo, hi) == (0, total) else rb.slice(lo, hi - lo)


def record_batches(
    entries: Iterable[EntryLike],
    *,
    topic: str,
    partition: int,
    start: int,
    end: int,
    codecs: CodecSet,
    include_properties: bool,
    decode: Decode | None = None,
    value_type: pa.DataType | None = None,
    max_rows: int = MAX_ROWS,
    max_bytes: int = MAX_BYTES,
) -> Iterator[pa.RecordBatch]:
    """Record batches of the messages with offsets in ``[start, end)`` of ``entries``.

    ``entries`` are stored entries of one partition in offset order (as a range read
    yields them); ``topic`` and ``partition`` fill the columns of the same names. With
    ``decode`` (and the ``value_type`` it returns), ``value`` is decoded and ``data``
    holds the raw bytes.
    """
    raw_schema = arrow_schema(include_properties)
    if decode is not None:
        assert value_type is not None
        raw_schema = raw_schema.append(pa.field("schema_version", pa.int32()))
        out_schema = arrow_schema(include_properties, value_type)

    def build(group: list[_Decoded]) -> pa.RecordBatch | None:
        rb = _build(
            group,
            topic=topic,
            partition=partition,
            start=start,
            end=end,
            schema=raw_schema,
            include_properties=include_properties,
            versions=decode is not None,
        )
        if rb is None or decode is None:
            return rb
        columns = rb.columns
        raw = columns[1]
        decoded = decode(raw, columns[-1])
        return pa.RecordBatch.from_arrays(
            [columns[0], decoded, *columns[2:-1], raw], schema=out_schema
        )

    group: list[_Decoded] = []
    rows = size = 0
    for entry in entries:
        d = _decode(entry, codecs)
        group.append(d)
        rows += d.batch.num_messages
        size += d.batch.header.values_length + d.batch.header.keys_length
        if rows >= max_rows or size >= max_bytes:
            if (rb := build(group)) is not None:
                yield rb
            group, rows, size = [], 0, 0
    if group and (rb := build(group)) is not None:
        yield rb
