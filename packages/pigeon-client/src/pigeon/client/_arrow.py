"""Arrow record batches to entries and entries to Arrow record batches. No I/O.

Our entry format is Arrow-shaped (see :mod:`pigeon.core._batch`): values are an Arrow
``binary`` array (int32 offsets from 0 + data), keys a ``binary`` array with a validity
bitmap, properties a ``map<string, string>``, event times an int64 column. So both
directions move whole buffers and never build a Python object per row:

*Producing* (:func:`plan_rows`, :func:`split_points`, :func:`encode_entry`): the rows of a
record batch are split into entries at ``batching_max_messages`` /
``batching_max_bytes`` by binary search over the running byte count (one search per
entry); each entry's offsets are the input's offsets minus their first value (one
compute kernel per column) and its data the input's data buffer sliced; the columns are
joined (or compressed) into the entry by :func:`pigeon.core.batch.encode_columns`.

*Consuming* (:func:`entry_rows`, :func:`record_batches`): an entry's columns become
arrays with :meth:`pyarrow.Array.from_buffers` over views of the received entry (the
``value`` and ``key`` data buffers point into it: zero copy); the columns a batch does
not carry (topic, partition, offset, message id, publish time) are built with compute
kernels, per entry. The columns are those of the Spark source (:data:`SOURCE_COLUMNS`).

Importing this module needs pyarrow (``pip install 'pigeon-client[arrow]'``); the faces
import it only when an Arrow method is called (:func:`pigeon.client._core.arrow_module`).
"""

from __future__ import annotations

import struct
import time
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from pigeon.client._message import BINARY_ID, BINARY_ID_VERSION, pack_binary_id
from pigeon.core.batch import (
    ENTRY_HEADER_SIZE,
    DecodedBatch,
    EntryHeader,
    decode_batch,
    encode_columns,
    unpack_entry_header,
)
from pigeon.core.codecs import CodecSet
from pigeon.core.errors import InvalidArgument, MessageTooLarge

__all__ = [
    "DATA_COLUMN",
    "PROPERTIES",
    "SOURCE_COLUMNS",
    "TIMESTAMP",
    "EntryLike",
    "Rows",
    "arrow_schema",
    "encode_entry",
    "entry_rows",
    "key_partitions",
    "messages_batch",
    "plan_rows",
    "record_batches",
    "split_points",
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


def arrow_schema(include_properties: bool, value_type: pa.DataType | None = None) -> pa.Schema:
    """The record batches' schema; with ``value_type`` (a decoded value) ``value`` has
    that type and the raw bytes are the last column, ``data``."""
    cols = SOURCE_COLUMNS if include_properties else SOURCE_COLUMNS[:-1]
    fields = [pa.field(name, _ARROW_TYPES[kind]) for name, kind in cols]
    if value_type is not None:
        fields[1] = pa.field("value", value_type)
        fields.append(pa.field(DATA_COLUMN[0], _ARROW_TYPES[DATA_COLUMN[1]]))
    return pa.schema(fields)


#: What ``receive_arrow`` / ``read_arrow`` return.
RECEIVE_SCHEMA = arrow_schema(True)


# -- producing ---------------------------------------------------------------------------

_BINARY_TYPES = (pa.binary(), pa.large_binary(), pa.string(), pa.large_string())
#: per-message slack of an entry's size estimate (as the per-message path's)
_SLACK_PER_MESSAGE = 24


@dataclass(eq=False)
class Rows:
    """The columns of one record batch checked for sending (see :func:`plan_rows`)."""

    n: int
    values: pa.Array
    keys: pa.Array | None
    properties: pa.Array | None
    #: int64 ms since the epoch, 0 = not set (None: no event times)
    event_times: pa.Array | None
    #: n + 1 running payload bytes (values, keys, property strings), from 0
    cum: memoryview
    #: n + 1 running estimated entry bytes (payload plus per-message slack), from 0
    est: memoryview


def _column(rb: pa.RecordBatch, name: str | None, what: str) -> pa.Array | None:
    if name is None:
        return None
    if not isinstance(name, str):
        raise InvalidArgument(f"send_arrow: {what} must be a column name, got {name!r}")
    index = rb.schema.get_field_index(name)
    if index < 0:
        names = ", ".join(rb.schema.names)
        raise InvalidArgument(f"send_arrow: no {what} column {name!r} (columns: {names})")
    column: pa.Array = rb.column(index)
    return column


def _event_ms(col: pa.Array) -> pa.Array:
    """int64 milliseconds since the epoch (0 for null) of a timestamp or int64 column."""
    t = col.type
    if pa.types.is_timestamp(t):
        raw = col.cast(pa.int64())
        factor = {"s": -1000, "ms": 1, "us": 1000, "ns": 1_000_000}[t.unit]
        if factor < 0:
            raw = pc.multiply(raw, -factor)
        elif factor > 1:
            raw = pc.divide(raw, factor)
    elif t == pa.int64():
        raw = col
    else:
        raise InvalidArgument(f"send_arrow: event_time must be a timestamp or int64 (ms), not {t}")
    return pc.fill_null(raw, 0) if raw.null_count else raw


def _prefix(sizes: pa.Array) -> memoryview:
    """The running sum of ``sizes`` from 0 (n + 1 int64), as a memoryview for bisect."""
    cum = pc.cumulative_sum(sizes.cast(pa.int64()))
    buf = cum.buffers()[1]
    raw = b"\0" * 8 + memoryview(buf)[cum.offset * 8 : (cum.offset + len(cum)) * 8].tobytes()
    return memoryview(raw).cast("q")


def plan_rows(
    rb: pa.RecordBatch,
    *,
    value: str,
    key: str | None,
    properties: str | None,
    event_time: str | None,
) -> Rows:
    """Check the named columns of ``rb`` and measure its rows (vectorised)."""
    values = _column(rb, value, "value")
    assert values is not None
    if values.type not in _BINARY_TYPES:
        raise InvalidArgument(
            f"send_arrow: value column {value!r} must be binary or string, not {values.type}"
        )
    if values.null_count:
        raise InvalidArgument(f"send_arrow: value column {value!r} has {values.null_count} nulls")
    values.validate(full=True)
    sizes = pc.binary_length(values).cast(pa.int64())
    keys = _column(rb, key, "key")
    if keys is not None:
        if keys.type not in _BINARY_TYPES:
            raise InvalidArgument(
                f"send_arrow: key column {key!r} must be binary or string, not {keys.type}"
            )
        keys.validate(full=True)
        if keys.null_count == len(keys):
            keys = None
        else:
            sizes = pc.add(sizes, pc.fill_null(pc.binary_length(keys).cast(pa.int64()), 0))
    props = _column(rb, properties, "properties")
    if props is not None:
        t = props.type
        if not (
            pa.types.is_map(t)
            and t.key_type in _BINARY_TYPES[2:]
            and t.item_type in _BINARY_TYPES[2:]
        ):
            raise InvalidArgument(
                f"send_arrow: properties column {properties!r} must be map<string, string>, not {t}"
            )
        props.validate(full=True)
        if props.items.null_count:
            raise InvalidArgument(f"send_arrow: properties column {properties!r} has null values")
        offsets = props.offsets
        if offsets[0].as_py() == offsets[-1].as_py():
            props = None
        else:
            pair = pc.add(
                pc.binary_length(props.keys).cast(pa.int64()),
                pc.binary_length(props.items).cast(pa.int64()),
            )
            run = pa.array(_prefix(pair), pa.int64())
            starts = pc.take(run, offsets.slice(0, len(offsets) - 1))
            ends = pc.take(run, offsets.slice(1))
            sizes = pc.add(sizes, pc.subtract(ends, starts))
    times = _column(rb, event_time, "event_time")
    event_ms = _event_ms(times) if times is not None else None
    if event_ms is not None and not pc.any(pc.not_equal(event_ms, 0)).as_py():
        event_ms = None
    return Rows(
        len(values),
        values,
        keys,
        props,
        event_ms,
        _prefix(sizes),
        _prefix(pc.add(sizes, _SLACK_PER_MESSAGE)),
    )


def split_points(
    rows: Rows, *, max_messages: int, max_bytes: int, max_entry: int
) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each entry, in order: an entry is full as the per-message path
    fills a batch (``max_messages`` rows, or the row that takes its payload to
    ``max_bytes``) and never over ``max_entry`` estimated bytes (MessageTooLarge for a
    row over it alone: send_arrow does not chunk). One binary search per entry."""
    n, cum, est = rows.n, rows.cum, rows.est
    start = 0
    while start < n:
        hi = min(n, start + max_messages)
        end = bisect_left(cum, cum[start] + max_bytes, start + 1, hi + 1)
        end = min(end, hi)
        fit = bisect_right(est, est[start] + max_entry, start + 1, end + 1) - 1
        if fit <= start:
            raise MessageTooLarge(
                f"send_arrow: row {start} ({est[start + 1] - est[start]} bytes) does not fit "
                f"in max_message_size (send_arrow does not chunk; send it with send)"
            )
        end = min(end, fit)
        yield start, end
        start = end


def _rebased(arr: pa.Array, start: int, count: int) -> tuple[Any, Any]:
    """int32 offsets from 0 and the data of rows ``[start, start + count)`` of a binary or
    string array (any nulls have empty ranges): the offsets by one compute kernel, the
    data a slice of the array's buffer."""
    large = arr.type in (pa.large_binary(), pa.large_string())
    buffers = arr.buffers()
    offsets = pa.Array.from_buffers(
        pa.int64() if large else pa.int32(), len(arr) + 1, [None, buffers[1]], offset=arr.offset
    ).slice(start, count + 1)
    first = offsets[0].as_py()
    last = offsets[-1].as_py()
    if first == 0 and not large:
        width = 4 * (count + 1)
        out = buffers[1].slice(4 * (arr.offset + start), width)
    else:
        rebased = pc.subtract(offsets, pa.scalar(first, offsets.type))
        if large:
            rebased = rebased.cast(pa.int32())
        out = rebased.buffers()[1].slice(4 * rebased.offset, 4 * (count + 1))
    data = buffers[2].slice(first, last - first) if last > first else b""
    return out, data


def _all_set(count: int) -> bytes:
    full, rest = divmod(count, 8)
    return b"\xff" * full + (bytes(((1 << rest) - 1,)) if rest else b"")


def _fixed(arr: pa.Array, start: int, count: int, width: int) -> Any:
    part = arr.slice(start, count)
    return part.buffers()[1].slice(width * part.offset, width * count)


def encode_entry(
    rows: Rows,
    start: int,
    end: int,
    *,
    producer_name: str,
    sequence_id: int,
    codec: Any,
    schema_version: int = 0,
) -> bytes:
    """Rows ``[start, end)`` of ``rows`` as one entry (sequence ids from ``sequence_id``)."""
    count = end - start
    voff, vdata = _rebased(rows.values, start, count)
    fields: dict[str, Any] = {}
    if rows.keys is not None:
        keys = rows.keys.slice(start, count)
        nulls = keys.null_count
        if nulls != count:
            if nulls:
                validity_arr = pc.is_valid(keys)
                validity = validity_arr.buffers()[1].slice(0, (count + 7) >> 3)
                keys = pc.fill_null(keys, pa.scalar(b"" if keys.type in _BINARY_TYPES[:2] else ""))
                koff, kdata = _rebased(keys, 0, count)
            else:
                validity = _all_set(count)
                koff, kdata = _rebased(rows.keys, start, count)
            fields.update(key_offsets=koff, key_validity=validity, keys=kdata)
    if rows.properties is not None:
        part = rows.properties.slice(start, count)
        offsets = part.offsets
        p0, p1 = offsets[0].as_py(), offsets[-1].as_py()
        if p1 > p0:
            poff = pc.subtract(offsets, pa.scalar(p0, pa.int32()))
            pkoff, pkdata = _rebased(rows.properties.keys, p0, p1 - p0)
            pvoff, pvdata = _rebased(rows.properties.items, p0, p1 - p0)
            fields.update(
                property_offsets=poff.buffers()[1].slice(4 * poff.offset, 4 * (count + 1)),
                property_key_offsets=pkoff,
                property_value_offsets=pvoff,
                property_keys=pkdata,
                property_values=pvdata,
            )
    if rows.event_times is not None:
        part = rows.event_times.slice(start, count)
        if pc.any(pc.not_equal(part, 0)).as_py():
            fields["event_times"] = _fixed(rows.event_times, start, count, 8)
    return encode_columns(
        count,
        voff,
        vdata,
        producer_name=producer_name,
        sequence_id=sequence_id,
        publish_time=int(time.time() * 1000),
        codec=codec,
        schema_version=schema_version,
        **fields,
    )


def _crc_table() -> pa.Array:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table.append(c)
    return pa.array(table, pa.int64())


_CRC_TABLE: pa.Array | None = None


def key_partitions(keys: pa.Array, partitions: int) -> pa.Array:
    """``crc32(key) % partitions`` of every row (null for a null key), as the per-message
    path's :func:`~pigeon.client._core.key_hash` routes: the table-driven CRC-32 run over
    all keys at once, one round of compute kernels per byte of the longest key."""
    global _CRC_TABLE
    if _CRC_TABLE is None:
        _CRC_TABLE = _crc_table()
    table = _CRC_TABLE
    keys = keys.cast(pa.large_binary()) if keys.type != pa.large_binary() else keys
    lengths = pc.fill_null(pc.binary_length(keys), 0)
    longest = pc.max(lengths).as_py() or 0
    buffers = keys.buffers()
    offsets = pa.Array.from_buffers(
        pa.int64(), len(keys) + 1, [None, buffers[1]], offset=keys.offset
    ).slice(0, len(keys))
    data = buffers[2] if buffers[2] is not None else _EMPTY
    octets = pa.Array.from_buffers(pa.uint8(), data.size, [None, data]).cast(pa.int64())
    crc = pa.repeat(pa.scalar(0xFFFFFFFF, pa.int64()), len(keys))
    for j in range(longest):
        active = pc.greater(lengths, j)
        at = pc.if_else(active, pc.add(offsets, j), 0)
        byte = pc.take(octets, at)
        step = pc.bit_wise_xor(
            pc.take(table, pc.bit_wise_and(pc.bit_wise_xor(crc, byte), 0xFF)),
            pc.shift_right(crc, 8),
        )
        crc = pc.if_else(active, step, crc)
    crc = pc.bit_wise_xor(crc, 0xFFFFFFFF)
    # crc % partitions (integer division truncates; crc is not negative)
    rest = pc.subtract(crc, pc.multiply(pc.divide(crc, partitions), partitions))
    out = rest.cast(pa.int32())
    return pc.if_else(pc.is_valid(keys), out, pa.scalar(None, pa.int32()))


# -- consuming ---------------------------------------------------------------------------


class EntryLike(Protocol):
    segment_id: int
    entry_id: int
    data: Any  # bytes-like: broker header + batch


#: ``decode(values, schema_versions)``: the decoded ``value`` column of a record batch.
Decode = Callable[[pa.Array, pa.Array], pa.Array]


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


def _event_column(raw: pa.Array) -> pa.Array:
    """Event times (int64 ms, 0 = not set) as nullable UTC timestamps."""
    return pc.if_else(
        pc.equal(raw, 0), pa.scalar(None, TIMESTAMP), pc.multiply(raw, 1000).cast(TIMESTAMP)
    )


#: batch indexes 0 .. n - 1 (int64), grown as entries grow and sliced (no copy) for each
#: received entry
_INDEXES: pa.Array = pa.array([], pa.int64())
#: rows 0 .. n - 1 of message ids in the BINARY_ID layout with every field zero but the
#: batch index and the offset, both the row number: five int64 words per row
_ID_RAMP: pa.Array = pa.array([], pa.int64())
#: 0, 40, 80, ...: the offsets of a binary array of BINARY_ID-sized values
_ID_OFFSETS: pa.Array = pa.array([0], pa.int32())
_ID_WORDS = BINARY_ID.size // 8


def _indexes(n: int) -> pa.Array:
    global _INDEXES
    if len(_INDEXES) < n:
        size = max(n, 2 * len(_INDEXES), 1024)
        _INDEXES = _int64(size, _arange(0, size))
    return _INDEXES


def _id_words(partition: int, segment_id: int, entry_id: int, index: int, offset: int) -> bytes:
    """The BINARY_ID of row 0 of a run whose row ``i`` has batch index ``index + i`` and
    offset ``offset + i`` (added by :func:`_binary_ids`)."""
    return BINARY_ID.pack(0, BINARY_ID_VERSION, partition, segment_id, entry_id, index, offset)


def _binary_ids(base: bytes, row: int, n: int) -> pa.Array:
    """The ``message_id`` column of ``n`` rows: ``base`` holds each row's id with its batch
    index and offset less ``row + i`` (the i-th row), as :func:`_id_words` packs them; one
    add kernel over the five words of every row puts the ramp in. No per-row Python."""
    global _ID_RAMP, _ID_OFFSETS
    if len(_ID_RAMP) < _ID_WORDS * (row + n):
        size = max(row + n, 2 * (len(_ID_RAMP) // _ID_WORDS), 1024)
        ramp = array("q", bytes(BINARY_ID.size * size))
        numbers = array("q", range(size))
        ramp[_ID_WORDS - 2 :: _ID_WORDS] = numbers  # batch index
        ramp[_ID_WORDS - 1 :: _ID_WORDS] = numbers  # offset
        _ID_RAMP = _int64(_ID_WORDS * size, ramp)
        _ID_OFFSETS = pa.Array.from_buffers(
            pa.int32(),
            size + 1,
            [None, pa.py_buffer(array("i", range(0, BINARY_ID.size * (size + 1), BINARY_ID.size)))],
        )
    words = pc.add(_int64(_ID_WORDS * n, base), _ID_RAMP.slice(_ID_WORDS * row, _ID_WORDS * n))
    return pa.Array.from_buffers(
        pa.binary(),
        n,
        [None, _ID_OFFSETS.buffers()[1].slice(0, 4 * (n + 1)), words.buffers()[1]],
    )


def _id_fields(ids: pa.Array) -> tuple[pa.Array, ...] | None:
    """(segment id, entry id, batch index, offset) int64 columns of a ``message_id``
    column in the BINARY_ID layout (a view of its data and one ``take`` per field); None
    when a row is not in that layout (a chunked message's text id, or a null)."""
    n = len(ids)
    size = BINARY_ID.size
    if ids.null_count or not pc.all(pc.equal(pc.binary_length(ids), size)).as_py():
        return None
    if ids.type != pa.binary():
        return None
    offsets, data = ids.buffers()[1:]
    (start,) = _I.unpack_from(offsets, 4 * ids.offset)
    data = data.slice(start, size * n)
    words = _int64(_ID_WORDS * n, data)
    head = pc.take(words, pc.multiply(_indexes(n).slice(0, n), _ID_WORDS))
    # word 0 holds the marker byte (0) and the layout version in its low 16 bits
    if not pc.all(pc.equal(pc.bit_wise_and(head, 0xFFFF), BINARY_ID_VERSION << 8)).as_py():
        return None
    return tuple(
        pc.take(words, pc.add(pc.multiply(_indexes(n).slice(0, n), _ID_WORDS), w))
        for w in (1, 2, 3, 4)
    )


def entry_rows(
    entry: EntryLike,
    *,
    topic: str,
    partition: int,
    codecs: CodecSet,
    start: int = 0,
    max_rows: int | None = None,
    skip: Iterable[int] = (),
) -> tuple[pa.RecordBatch | None, int, int]:
    """Rows of one received entry from batch index ``start`` (at most ``max_rows``,
    leaving out the batch indexes in ``skip``: acknowledged ones) as a record batch of
    :data:`RECEIVE_SCHEMA`, the batch index after the last row taken and the entry's
    number of rows.

    The ``value`` and ``key`` columns are views of the entry (with codec ``none``) or of
    its decompressed body; an entry with skipped indexes among the rows taken is the one
    case that copies (the rows are gathered with ``take``). None when no row is left.
    """
    d = _decode(entry, codecs)
    b, h = d.batch, d.header
    n = b.num_messages
    limit = n if max_rows is None else min(n, start + max_rows)
    skipped = {i for i in skip if i >= start}
    take: list[int] | None = None
    if skipped:
        take = []
        i = start
        want = limit - start
        while i < n and len(take) < want:
            if i not in skipped:
                take.append(i)
            i += 1
        if not take:
            return None, n, n
        lo, hi = take[0], take[-1] + 1
        if hi - lo == len(take):  # no gap among the rows taken: a slice after all
            take = None
    else:
        lo, hi = start, limit
        if hi <= lo:
            return None, n, n
    k = hi - lo
    index = _indexes(hi).slice(lo, k)
    values = _binary(n, None, b.values_offsets, b.values_data).slice(lo, k)
    if b.has_keys:
        keys = _binary(n, b.keys_validity, b.keys_offsets, b.keys_data).slice(lo, k)
    else:
        keys = pa.nulls(k, pa.binary())
    offsets = pc.add(index, pa.scalar(h.first_offset, pa.int64()))
    message_id = _binary_ids(
        _id_words(partition, d.segment_id, d.entry_id, 0, h.first_offset) * k, lo, k
    )
    if b.event_times is not None:
        event = _event_column(_int64(n, b.event_times).slice(lo, k))
    else:
        event = pa.nulls(k, TIMESTAMP)
    columns = [
        keys,
        values,
        pa.repeat(pa.scalar(topic, pa.string()), k),
        pa.repeat(pa.scalar(partition, pa.int32()), k),
        offsets,
        message_id,
        pa.repeat(pa.scalar(h.publish_time * 1000, TIMESTAMP), k),
        event,
        _properties(b, n).slice(lo, k),
    ]
    rb = pa.RecordBatch.from_arrays(columns, schema=RECEIVE_SCHEMA)
    if take is not None:
        rb = rb.take(pa.array([i - lo for i in take], pa.int64()))
    return rb, hi, n


def _message_id_bytes(m: Any) -> bytes:
    """A message's ``message_id`` cell: the BINARY_ID layout, or the text form of a
    chunked message's id (it names two entries)."""
    mid = m.message_id
    if type(mid).__name__ == "ChunkMessageId":
        return mid.serialize()  # type: ignore[no-any-return]
    return pack_binary_id(mid.segment_id, mid.entry_id, mid.batch_index, mid.partition, mid.offset)


def messages_batch(msgs: list[Any]) -> pa.RecordBatch:
    """Messages already split (the per-message path: dead letters, ack timeouts, schema
    consumers) as a record batch of :data:`RECEIVE_SCHEMA` (one Python object per row:
    this path copies)."""
    ts = [m.publish_time * 1000 for m in msgs]
    return pa.RecordBatch.from_arrays(
        [
            pa.array(
                [None if m.key is None else m.key.encode("utf-8", "surrogateescape") for m in msgs],
                pa.binary(),
            ),
            pa.array([m.data for m in msgs], pa.binary()),
            pa.array([m.topic for m in msgs], pa.string()),
            pa.array([m._partition for m in msgs], pa.int32()),
            pa.array([m.offset for m in msgs], pa.int64()),
            pa.array([_message_id_bytes(m) for m in msgs], pa.binary()),
            pa.array(ts, TIMESTAMP),
            pa.array([m.event_time * 1000 if m.event_time else None for m in msgs], TIMESTAMP),
            pa.array([list(m.properties.items()) for m in msgs], PROPERTIES),
        ],
        schema=RECEIVE_SCHEMA,
    )


def ack_runs(batch: pa.RecordBatch) -> list[tuple[int, int, int, int, int]]:
    """``(segment_id, entry_id, first batch index, first offset, count)`` of each run of
    consecutive rows of one entry in a received record batch (its ``message_id`` column
    parsed with compute kernels; one tuple per run, not per row)."""
    if batch.num_rows == 0:
        return []
    ids = batch.column("message_id")
    fields = _id_fields(ids)
    if fields is None:
        if pc.any(pc.match_substring(ids.cast(pa.string()), ";")).as_py():
            raise InvalidArgument(
                "acknowledge_arrow: a chunked message's row: acknowledge it by id"
            )
        raise InvalidArgument(
            "acknowledge_arrow: the message_id column is not the one receive_arrow returned"
        )
    seg, ent, idx, off = fields
    n = batch.num_rows
    if n > 1:
        head, tail = slice(0, n - 1), slice(1, n)

        def cut(col: pa.Array) -> tuple[pa.Array, pa.Array]:
            return col.slice(head.start, head.stop - head.start), col.slice(tail.start)

        s0, s1 = cut(seg)
        e0, e1 = cut(ent)
        i0, i1 = cut(idx)
        o0, o1 = cut(off)
        breaks = pc.or_(
            pc.or_(pc.not_equal(s0, s1), pc.not_equal(e0, e1)),
            pc.or_(pc.not_equal(pc.add(i0, 1), i1), pc.not_equal(pc.add(o0, 1), o1)),
        )
        starts = [0, *(i + 1 for i in pc.indices_nonzero(breaks).to_pylist())]
    else:
        starts = [0]
    ends = [*starts[1:], n]
    out = []
    for s, e in zip(starts, ends, strict=True):
        out.append((seg[s].as_py(), ent[s].as_py(), idx[s].as_py(), off[s].as_py(), e - s))
    return out


# -- Spark source: record batches of stored entries --------------------------------------


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
    id_parts: list[bytes] = []
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
        # row ``total + i`` of the group is batch index i, offset first_offset + i
        id_parts.append(
            _id_words(partition, d.segment_id, d.entry_id, -total, h.first_offset - total) * n
        )
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
    message_id = _binary_ids(b"".join(id_parts), 0, total)
    publish = pa.Array.from_buffers(TIMESTAMP, total, [None, pa.py_buffer(b"".join(publish_parts))])
    if has_events:
        event = _event_column(_int64(total, b"".join(event_parts)))
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
    holds the raw bytes. Several entries go to one record batch (concatenated: a copy).
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
