"""Batches (entries): the byte layout, and the header every component reads. No I/O.

A batch is what a producer sends as one request, what a bookie stores as one entry and
what a consumer splits back into messages. Brokers and bookies never look inside the body;
they only read the header (:func:`read_header`, here). The format is columnar, so that
building and splitting are ``b"".join`` / ``struct`` / ``memoryview`` operations rather
than Python loops over bytes, and so that every column maps zero-copy onto an Arrow array.
The producer builds batches with :mod:`pigeon.core._batch_builder` (which encodes with
:mod:`pigeon.core._batch_encode`); the consumer splits them with
:mod:`pigeon.core._batch_decode`.

Byte layout (all integers little-endian)::

    offset 0    u32 header_len
    offset 4    BatchHeader: Cap'n Proto message, standard unpacked encoding, one segment
                (schema/entry.capnp), header_len bytes (a multiple of 8)
    4+header_len  body: body_length bytes, the columns below compressed by ``codec``
                  as a whole (codec 0 = ``none``: the columns as they are)

``formatVersion`` 2 (:data:`FORMAT_KAFKA`) is a Kafka producer's RecordBatch v2 stored as
it came: the body is that RecordBatch unchanged (its own compression inside), with codec
0, ``body_length = uncompressed_size`` = the RecordBatch's size, ``num_messages`` its
record count and every column flag and length 0 (see :mod:`pigeon.core._kafka_records`).
:func:`read_header` checks only those lengths; ``decode_batch`` parses the records.

The entry is exactly ``4 + header_len + body_length`` bytes. The uncompressed body is
``uncompressed_size`` bytes and holds these columns in this order; each starts at a
multiple of 8 from the start of the body (zero padding in between), and an absent column
takes no bytes (``n`` = messages, ``m`` = property pairs in the whole batch):

================================  ==============================  ==================
column                            content                         present if
================================  ==============================  ==================
event times                       int64[n], ms since epoch, 0=unset  has_event_times
value offsets                     int32[n+1]: 0 .. values_length  always
key offsets                       int32[n+1]: 0 .. keys_length    has_keys
key validity                      ceil(n/8) bytes, Arrow bitmap   has_keys
property offsets                  int32[n+1]: 0 .. m              has_properties
property key offsets              int32[m+1]                      has_properties
property value offsets            int32[m+1]                      has_properties
values                            values_length bytes             always
keys                              keys_length bytes               has_keys
property keys                     UTF-8, property_keys_length     has_properties
property values                   UTF-8, property_values_length   has_properties
================================  ==============================  ==================

Value ``i`` is ``values[off[i]:off[i+1]]`` (Arrow ``binary``). Keys are an Arrow
``binary`` array with a validity bitmap (LSB bit order: message ``i`` is bit ``i % 8`` of
byte ``i // 8``; a clear bit = no key, its range is empty; a ``str`` key is stored UTF-8).
Properties are an Arrow ``map<string, string>``: message ``i`` owns pairs
``poff[i] .. poff[i+1]``, pair ``j`` is ``(keys[pk[j]:pk[j+1]], values[pv[j]:pv[j+1]])``,
in the mapping's iteration order. Event time 0 means "not set".

Checks on decode: the header lengths must add up (``uncompressed_size`` = sum of the
columns with padding, entry length = ``4 + header_len + body_length``); every offsets
column must start at 0, never decrease and end at its data length. Anything else is a
:class:`~pigeon.core.errors.CorruptFrame`; a body the codec cannot decode is a
:class:`~pigeon.core.errors.CodecError`. The batch carries no checksum of its own: bookies
checksum every stored entry and TCP protects the wire, so a bit flip inside a value (with
codec ``none``) is not detected here.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, Final

import capnp

from pigeon.core._capnp_fast import DECODE_ERRORS, StructCodec, struct_codec
from pigeon.core.errors import CorruptFrame, InvalidArgument

__all__ = ["FORMAT_KAFKA", "FORMAT_VERSION", "BatchHeader", "ChunkInfo", "read_header"]

#: The chunk fields of a batch header: ``(chunk_uuid, chunk_id, num_chunks,
#: total_chunk_size)`` (see ``schema/entry.capnp``).
ChunkInfo = tuple[str, int, int, int]

#: Version of the body layout, written to and checked in ``BatchHeader.formatVersion``.
FORMAT_VERSION: Final = 1
#: ``formatVersion`` of an entry whose body is a Kafka RecordBatch v2, stored unchanged.
FORMAT_KAFKA: Final = 2
#: Size of a Kafka RecordBatch v2 header: the least body a format-2 entry can have.
_KAFKA_BATCH_HEADER_SIZE: Final = 61

_INT32_MAX: Final = 2**31 - 1
_UINT32_MAX: Final = 2**32 - 1
_UINT64_MAX: Final = 2**64 - 1
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
#: A header above this size is garbage (a real one is ~100 bytes plus the producer name).
_MAX_HEADER_LEN: Final = 64 * 1024
_MAX_PRODUCER_NAME: Final = 4096

_schema: Any = capnp.load(str(Path(__file__).parent / "schema" / "entry.capnp"))
_BatchHeaderSchema: Any = _schema.BatchHeader

_U32: Final = struct.Struct("<I")
#: The Cap'n Proto fields of a header, in the order of :class:`BatchHeader`'s fields
#: after ``header_len``.
_HEADER_FIELDS: Final = (
    "formatVersion",
    "producerName",
    "sequenceId",
    "numMessages",
    "codec",
    "uncompressedSize",
    "bodyLength",
    "publishTime",
    "deliverAtTime",
    "schemaVersion",
    "hasKeys",
    "hasEventTimes",
    "hasProperties",
    "valuesLength",
    "keysLength",
    "propertyEntries",
    "propertyKeysLength",
    "propertyValuesLength",
    "chunkUuid",
    "chunkId",
    "numChunks",
    "totalChunkSize",
)
_header_fields: Final = attrgetter(*_HEADER_FIELDS)


def _align8(x: int) -> int:
    return (x + 7) & ~7


# -- header ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The decoded ``BatchHeader`` of an entry (see ``schema/entry.capnp``).

    ``header_len`` is the size of the Cap'n Proto header; the body starts at
    ``4 + header_len``. Times are milliseconds since the Unix epoch.
    """

    header_len: int
    format_version: int
    producer_name: str
    sequence_id: int
    num_messages: int
    codec: int
    uncompressed_size: int
    body_length: int
    publish_time: int
    deliver_at: int
    schema_version: int
    has_keys: bool
    has_event_times: bool
    has_properties: bool
    values_length: int
    keys_length: int
    property_entries: int
    property_keys_length: int
    property_values_length: int
    #: chunking (``numChunks`` 0: not a chunk); see ``schema/entry.capnp``
    chunk_uuid: str = ""
    chunk_id: int = 0
    num_chunks: int = 0
    total_chunk_size: int = 0

    @property
    def body_offset(self) -> int:
        return 4 + self.header_len

    @property
    def entry_length(self) -> int:
        """Size of the whole entry: ``4 + header_len + body_length``."""
        return 4 + self.header_len + self.body_length

    @property
    def last_sequence_id(self) -> int:
        return self.sequence_id + self.num_messages - 1

    def layout(self) -> tuple[list[int], int]:
        """Start of every column in the uncompressed body (absent ones have size 0) and
        the body size. Order: event times, value offsets, key offsets, key validity,
        property offsets, property key offsets, property value offsets, values, keys,
        property keys, property values."""
        n = self.num_messages
        m1 = self.property_entries + 1
        sizes = (
            8 * n if self.has_event_times else 0,
            4 * (n + 1),
            4 * (n + 1) if self.has_keys else 0,
            (n + 7) >> 3 if self.has_keys else 0,
            4 * (n + 1) if self.has_properties else 0,
            4 * m1 if self.has_properties else 0,
            4 * m1 if self.has_properties else 0,
            self.values_length,
            self.keys_length,
            self.property_keys_length,
            self.property_values_length,
        )
        starts = []
        pos = 0
        for size in sizes:
            if size:
                pos = _align8(pos)
            starts.append(pos)
            pos += size
        return starts, pos


#: The header decoded at fixed offsets (:mod:`pigeon.core._capnp_fast`): its fields in
#: code order are those of :data:`_HEADER_FIELDS` (else pycapnp decodes every header).
_header_codec = struct_codec(_BatchHeaderSchema.schema)
_fast_header: StructCodec | None = (
    _header_codec if _header_codec.field_names == _HEADER_FIELDS else None
)


def _header_maker() -> Callable[[int, Sequence[Any]], BatchHeader]:
    """``make(header_len, fields)``: a :class:`BatchHeader` built by setting its slots
    directly (what its frozen ``__init__`` does through ``object.__setattr__``, twice
    as slow: a header is built per entry on the hot paths)."""
    names = [f.name for f in dataclasses.fields(BatchHeader)]
    env: dict[str, Any] = {"_new": object.__new__, "_cls": BatchHeader}
    lines = ["def make(header_len, t):", "    h = _new(_cls)", "    _s0(h, header_len)"]
    for i, name in enumerate(names):
        env[f"_s{i}"] = BatchHeader.__dict__[name].__set__
        if i:
            lines.append(f"    _s{i}(h, t[{i - 1}])")
    lines.append("    return h")
    exec("\n".join(lines) + "\n", env)
    make: Callable[[int, Sequence[Any]], BatchHeader] = env["make"]
    return make


_make_header = _header_maker()


def _as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise InvalidArgument("entry must be a contiguous byte buffer")
    if mv.format != "B" or mv.ndim != 1:
        try:
            mv = mv.cast("B")
        except TypeError as exc:
            raise InvalidArgument(f"entry must be a contiguous byte buffer ({exc})") from None
    return mv


def read_header(data: bytes | bytearray | memoryview) -> BatchHeader:
    """Decode and check the header of an entry without touching its body.

    ``data`` must be exactly one entry. Raises :class:`CorruptFrame` if the entry is
    truncated, has trailing bytes, an undecodable header, an unknown format version or
    lengths that do not add up.
    """
    return _read_header(_as_bytes_view(data))


def _read_header(mv: memoryview) -> BatchHeader:
    size = len(mv)
    if size < 4:
        raise CorruptFrame(f"entry of {size} bytes is shorter than its 4-byte length prefix")
    header_len = _U32.unpack_from(mv)[0]
    if header_len < 16 or header_len % 8 or header_len > _MAX_HEADER_LEN:
        raise CorruptFrame(f"entry header length {header_len} is invalid")
    if 4 + header_len > size:
        raise CorruptFrame(
            f"entry of {size} bytes is truncated inside its {header_len}-byte header"
        )
    if _fast_header is not None:
        try:
            fields = _fast_header.decode_message(mv[4 : 4 + header_len])
        except DECODE_ERRORS:
            pass  # pycapnp decides, and says why it refuses it
        else:
            header = _make_header(header_len, fields)
            _check_header(header, size)
            return header
    # Copy the ~100 header bytes: Cap'n Proto needs word-aligned data and the header sits
    # at offset 4 of the entry.
    raw = mv[4 : 4 + header_len].tobytes()
    try:
        with _BatchHeaderSchema.from_bytes(
            raw, traversal_limit_in_words=header_len // 8 + 8, nesting_limit=4
        ) as h:
            header = BatchHeader(header_len, *_header_fields(h))
    except (capnp.KjException, UnicodeDecodeError, ValueError, OverflowError) as exc:
        raise CorruptFrame(f"undecodable entry header: {exc}".split("\nstack:")[0]) from None
    _check_header(header, size)
    return header


def _check_header(h: BatchHeader, size: int) -> None:
    if h.format_version not in (FORMAT_VERSION, FORMAT_KAFKA):
        raise CorruptFrame(
            f"entry format version {h.format_version} is not supported "
            f"(only {FORMAT_VERSION} and {FORMAT_KAFKA})"
        )
    if h.entry_length != size:
        raise CorruptFrame(
            f"entry is {size} bytes but its header says {h.entry_length} "
            f"(header {h.header_len} + body {h.body_length})"
        )
    if h.num_messages < 1:
        raise CorruptFrame("entry holds no message")
    if h.format_version == FORMAT_KAFKA:
        _check_kafka_header(h)
        return
    if not h.has_keys and h.keys_length:
        raise CorruptFrame("entry has key bytes but no key column")
    if h.num_chunks and (
        h.num_messages != 1
        or h.chunk_id >= h.num_chunks
        or h.values_length > h.total_chunk_size
        or not h.chunk_uuid
    ):
        raise CorruptFrame(
            f"chunk {h.chunk_id} of {h.num_chunks} (uuid {h.chunk_uuid!r}, "
            f"{h.num_messages} messages, {h.values_length} of {h.total_chunk_size} bytes) "
            "is inconsistent"
        )
    if not h.has_properties and (
        h.property_entries or h.property_keys_length or h.property_values_length
    ):
        raise CorruptFrame("entry has property bytes but no property columns")
    if (
        max(
            h.values_length,
            h.keys_length,
            h.property_keys_length,
            h.property_values_length,
            h.property_entries,
        )
        > _INT32_MAX
    ):
        raise CorruptFrame("entry column longer than int32 offsets allow")
    _, total = h.layout()
    if total != h.uncompressed_size:
        raise CorruptFrame(
            f"entry columns add up to {total} bytes but the header says "
            f"uncompressed_size={h.uncompressed_size}"
        )
    if h.codec == 0 and h.body_length != h.uncompressed_size:
        raise CorruptFrame(
            f"uncompressed entry body is {h.body_length} bytes, header says {h.uncompressed_size}"
        )


def _check_kafka_header(h: BatchHeader) -> None:
    """A format-2 entry: the body is one Kafka RecordBatch, uncompressed at our level."""
    if h.codec != 0 or h.body_length != h.uncompressed_size:
        raise CorruptFrame(
            f"Kafka-format entry must have codec 0 and body_length = uncompressed_size, "
            f"got codec {h.codec}, {h.body_length} and {h.uncompressed_size}"
        )
    if h.body_length < _KAFKA_BATCH_HEADER_SIZE:
        raise CorruptFrame(
            f"Kafka-format entry body of {h.body_length} bytes is shorter than a "
            f"RecordBatch header ({_KAFKA_BATCH_HEADER_SIZE})"
        )
    if (
        h.has_keys
        or h.has_event_times
        or h.has_properties
        or h.values_length
        or h.keys_length
        or h.property_entries
        or h.property_keys_length
        or h.property_values_length
    ):
        raise CorruptFrame("Kafka-format entry header describes columns")


def _check_int(name: str, value: int, lo: int, hi: int) -> None:
    if not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


def _check_producer_name(name: str) -> None:
    if not isinstance(name, str) or len(name) > _MAX_PRODUCER_NAME:
        raise InvalidArgument(
            f"producer_name must be a str of at most {_MAX_PRODUCER_NAME} characters"
        )


@functools.lru_cache(maxsize=256)
def _header_length(producer_name: str) -> int:
    """Size of the Cap'n Proto ``BatchHeader`` of this producer (no field changes it)."""
    h = _BatchHeaderSchema.new_message()
    h.producerName = producer_name
    return len(h.to_bytes())
