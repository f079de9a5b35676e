"""Batches (entries): build them on the producer, split them on the consumer. No I/O.

A batch is what a producer sends as one request, what a bookie stores as one entry and
what a consumer splits back into messages. Brokers and bookies never look inside the body;
they only read the header (:func:`read_header`). The format is columnar, so that building
and splitting are ``b"".join`` / ``struct`` / ``memoryview`` operations rather than
Python loops over bytes, and so that every column maps zero-copy onto an Arrow array.

Byte layout (all integers little-endian)::

    offset 0    u32 header_len
    offset 4    BatchHeader: Cap'n Proto message, standard unpacked encoding, one segment
                (schema/entry.capnp), header_len bytes (a multiple of 8)
    4+header_len  body: body_length bytes, the columns below compressed by ``codec``
                  as a whole (codec 0 = ``none``: the columns as they are)

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

import functools
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, islice, repeat
from operator import add, is_not, methodcaller
from pathlib import Path
from typing import Any, Final, Literal

import capnp

from pigeon.core._codecs import Codec, CodecSet
from pigeon.core.errors import (
    CodecError,
    CorruptFrame,
    InvalidArgument,
    MessageTooLarge,
    PigeonError,
)

__all__ = [
    "FORMAT_VERSION",
    "BatchBuilder",
    "BatchHeader",
    "DecodedBatch",
    "decode_batch",
    "encode_batch",
    "message_body_size",
    "read_header",
]

#: Version of the body layout, written to and checked in ``BatchHeader.formatVersion``.
FORMAT_VERSION: Final = 1

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
_ZEROS: Final = tuple(b"\0" * i for i in range(8))
_EMPTY_PROPS: Final[Mapping[str, str]] = {}
_values_of: Final = methodcaller("values")
_items_of: Final = methodcaller("items")
_BIT_CHARS: Final = bytes.maketrans(b"\0\1", b"01")

if sys.byteorder == "little":

    def _column(mv: memoryview, fmt: Literal["i", "q"]) -> memoryview:
        """A little-endian int column as a zero-copy typed view."""
        return mv.cast(fmt)

else:  # pragma: no cover - big-endian hosts pay one copy per column

    def _column(mv: memoryview, fmt: Literal["i", "q"]) -> memoryview:
        a = array(fmt)
        a.frombytes(mv)
        a.byteswap()
        return memoryview(a)


def _align8(x: int) -> int:
    return (x + 7) & ~7


def _layout(
    n: int,
    *,
    has_event_times: bool,
    has_keys: bool,
    has_properties: bool,
    property_entries: int,
    values_length: int,
    keys_length: int,
    property_keys_length: int,
    property_values_length: int,
) -> tuple[list[int], int]:
    """Start of every column in the uncompressed body (absent ones have size 0) and the
    body size. Order: event times, value offsets, key offsets, key validity, property
    offsets, property key offsets, property value offsets, values, keys, property keys,
    property values."""
    m1 = property_entries + 1
    sizes = (
        8 * n if has_event_times else 0,
        4 * (n + 1),
        4 * (n + 1) if has_keys else 0,
        (n + 7) >> 3 if has_keys else 0,
        4 * (n + 1) if has_properties else 0,
        4 * m1 if has_properties else 0,
        4 * m1 if has_properties else 0,
        values_length,
        keys_length,
        property_keys_length,
        property_values_length,
    )
    starts = []
    pos = 0
    for size in sizes:
        if size:
            pos = _align8(pos)
        starts.append(pos)
        pos += size
    return starts, pos


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
        return _layout(
            self.num_messages,
            has_event_times=self.has_event_times,
            has_keys=self.has_keys,
            has_properties=self.has_properties,
            property_entries=self.property_entries,
            values_length=self.values_length,
            keys_length=self.keys_length,
            property_keys_length=self.property_keys_length,
            property_values_length=self.property_values_length,
        )


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
    # Copy the ~100 header bytes: Cap'n Proto needs word-aligned data and the header sits
    # at offset 4 of the entry.
    raw = mv[4 : 4 + header_len].tobytes()
    try:
        with _BatchHeaderSchema.from_bytes(
            raw, traversal_limit_in_words=header_len // 8 + 8, nesting_limit=4
        ) as h:
            header = BatchHeader(
                header_len,
                h.formatVersion,
                h.producerName,
                h.sequenceId,
                h.numMessages,
                h.codec,
                h.uncompressedSize,
                h.bodyLength,
                h.publishTime,
                h.deliverAtTime,
                h.schemaVersion,
                h.hasKeys,
                h.hasEventTimes,
                h.hasProperties,
                h.valuesLength,
                h.keysLength,
                h.propertyEntries,
                h.propertyKeysLength,
                h.propertyValuesLength,
            )
    except (capnp.KjException, UnicodeDecodeError, ValueError, OverflowError) as exc:
        raise CorruptFrame(f"undecodable entry header: {exc}".split("\nstack:")[0]) from None
    _check_header(header, size)
    return header


def _check_header(h: BatchHeader, size: int) -> None:
    if h.format_version != FORMAT_VERSION:
        raise CorruptFrame(
            f"entry format version {h.format_version} is not supported (only {FORMAT_VERSION})"
        )
    if h.entry_length != size:
        raise CorruptFrame(
            f"entry is {size} bytes but its header says {h.entry_length} "
            f"(header {h.header_len} + body {h.body_length})"
        )
    if h.num_messages < 1:
        raise CorruptFrame("entry holds no message")
    if not h.has_keys and h.keys_length:
        raise CorruptFrame("entry has key bytes but no key column")
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


# -- encoding ----------------------------------------------------------------------------


def _check_int(name: str, value: int, lo: int, hi: int) -> None:
    if not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


def _check_producer_name(name: str) -> None:
    if not isinstance(name, str) or len(name) > _MAX_PRODUCER_NAME:
        raise InvalidArgument(
            f"producer_name must be a str of at most {_MAX_PRODUCER_NAME} characters"
        )


def _offsets(ends: Sequence[int]) -> bytes:
    """``ends`` (n+1 non-decreasing ints from 0) as int32 little-endian."""
    return struct.pack(f"<{len(ends)}i", *ends)


def _encode_texts(texts: list[str], what: str) -> tuple[bytes, list[int]]:
    """UTF-8 data and end offsets (n+1, from 0) of a list of str."""
    try:
        joined = "".join(texts)
        if joined.isascii():  # O(1) in CPython; then characters are bytes
            return joined.encode("ascii"), list(accumulate(map(len, texts), initial=0))
        encoded = list(map(str.encode, texts))
    except TypeError:
        raise InvalidArgument(f"{what} must be str") from None
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not encodable as UTF-8: {exc}") from None
    return b"".join(encoded), list(accumulate(map(len, encoded), initial=0))


def _key_bytes(key: str | bytes | None) -> bytes:
    if key is None:
        return b""
    if isinstance(key, str):
        return key.encode()
    return key


def _encode_keys(keys: Sequence[str | bytes | None], n: int) -> tuple[bytes, bytes, bytes]:
    """Key offsets, validity bitmap and data of ``n`` keys (at least one not None)."""
    nulls = keys.count(None)
    ends: list[int] | None = None
    try:
        if nulls == 0:
            full, rest = divmod(n, 8)
            validity = b"\xff" * full + (bytes(((1 << rest) - 1,)) if rest else b"")
            try:
                data = b"".join(keys)  # type: ignore[arg-type]  # all bytes-like?
            except TypeError:
                try:
                    data, ends = _encode_texts(keys, "keys")  # type: ignore[arg-type]
                except InvalidArgument:  # str mixed with bytes
                    keys = list(map(_key_bytes, keys))
                    data = b"".join(keys)  # type: ignore[arg-type]
        else:
            # One '0'/'1' char per message, message 0 last: int(.., 2) puts message i at
            # bit i, and to_bytes(.., "little") gives Arrow's LSB-first bitmap.
            bits = bytes(map(is_not, keys, repeat(None))).translate(_BIT_CHARS)[::-1]
            validity = int(bits, 2).to_bytes((n + 7) >> 3, "little")
            keys = list(map(_key_bytes, keys))
            data = b"".join(keys)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument("keys must be str, bytes or None") from None
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"key is not encodable as UTF-8: {exc}") from None
    if len(data) > _INT32_MAX:
        raise MessageTooLarge(f"keys of the batch total {len(data)} bytes (max {_INT32_MAX})")
    if ends is None:
        ends = list(accumulate(map(len, keys), initial=0))  # type: ignore[arg-type]
    if ends[-1] != len(data):
        raise InvalidArgument("keys must be str, bytes or None")
    return _offsets(ends), validity, data


def _encode_properties(
    props: Sequence[Mapping[str, str]],
) -> tuple[bytes, bytes, bytes, bytes, bytes, int]:
    """Offsets (n+1), key offsets (m+1), value offsets (m+1), key data, value data, m."""
    try:
        counts = list(accumulate(map(len, props), initial=0))
        names = list(chain.from_iterable(props))
        texts = list(chain.from_iterable(map(_values_of, props)))
    except (TypeError, AttributeError):
        raise InvalidArgument("properties must be mappings of str to str (or None)") from None
    m = counts[-1]
    if len(names) != m or len(texts) != m:
        raise InvalidArgument("properties changed while the batch was built")
    kdata, kends = _encode_texts(names, "property names")
    vdata, vends = _encode_texts(texts, "property values")
    if max(len(kdata), len(vdata), m) > _INT32_MAX:
        raise MessageTooLarge("properties of the batch exceed int32 offsets")
    return _offsets(counts), _offsets(kends), _offsets(vends), kdata, vdata, m


def _encode(
    values: Sequence[bytes],
    value_ends: Sequence[int] | None,
    keys: Sequence[str | bytes | None] | None,
    properties: Sequence[Mapping[str, str]] | None,
    event_times: Sequence[int] | None,
    *,
    producer_name: str,
    sequence_id: int,
    publish_time: int,
    deliver_at: int,
    schema_version: int,
    codec: Codec,
) -> bytes:
    n = len(values)
    if n == 0:
        raise InvalidArgument("a batch needs at least one message")
    _check_int("sequence_id", sequence_id, 0, _UINT64_MAX - n + 1)
    _check_int("publish_time", publish_time, _INT64_MIN, _INT64_MAX)
    _check_int("deliver_at", deliver_at, _INT64_MIN, _INT64_MAX)
    _check_int("schema_version", schema_version, 0, _UINT32_MAX)
    if not isinstance(codec, Codec):
        raise InvalidArgument(f"codec must be a Codec, got {codec!r}")

    if value_ends is None:
        try:
            value_ends = list(accumulate(map(len, values), initial=0))
        except TypeError:
            raise InvalidArgument("message values must be bytes-like") from None
    values_length = value_ends[-1]
    if values_length > _INT32_MAX:
        raise MessageTooLarge(f"values of the batch total {values_length} bytes (max {_INT32_MAX})")
    voff = _offsets(value_ends)

    et = b""
    if event_times is not None and any(event_times):
        try:
            et = struct.pack(f"<{n}q", *event_times)
        except struct.error:
            raise InvalidArgument("event times must be ints (ms since the epoch)") from None

    koff = kvalid = kdata = b""
    if keys is not None and keys.count(None) != n:
        koff, kvalid, kdata = _encode_keys(keys, n)

    poff = pkoff = pvoff = pkdata = pvdata = b""
    m = 0
    if properties is not None and any(properties):
        poff, pkoff, pvoff, pkdata, pvdata, m = _encode_properties(properties)

    # The values are joined straight into the entry (codec none) or the body: one copy.
    columns: tuple[tuple[int, Sequence[bytes]], ...] = (
        (len(et), (et,)),
        (len(voff), (voff,)),
        (len(koff), (koff,)),
        (len(kvalid), (kvalid,)),
        (len(poff), (poff,)),
        (len(pkoff), (pkoff,)),
        (len(pvoff), (pvoff,)),
        (values_length, values),
        (len(kdata), (kdata,)),
        (len(pkdata), (pkdata,)),
        (len(pvdata), (pvdata,)),
    )
    parts: list[bytes] = [b"", b""]  # slots for the length prefix and the header
    pos = 0
    for size, chunks in columns:
        if size:
            pad = -pos & 7
            if pad:
                parts.append(_ZEROS[pad])
                pos += pad
            parts.extend(chunks)
            pos += size
    if pos > _UINT32_MAX:
        raise MessageTooLarge(f"batch body of {pos} bytes is over 4 GiB")

    body_length = pos
    if codec.id != 0:
        body = _join(parts, pos)
        parts = [b"", b"", codec.compress(body)]
        del body
        body_length = len(parts[2])
        if body_length > _UINT32_MAX:
            raise MessageTooLarge(f"compressed batch body of {body_length} bytes is over 4 GiB")

    h = _BatchHeaderSchema.new_message()
    h.formatVersion = FORMAT_VERSION
    h.producerName = producer_name
    h.sequenceId = sequence_id
    h.numMessages = n
    h.codec = codec.id
    h.uncompressedSize = pos
    h.bodyLength = body_length
    h.publishTime = publish_time
    h.deliverAtTime = deliver_at
    h.schemaVersion = schema_version
    h.valuesLength = values_length
    if koff:
        h.hasKeys = True
        h.keysLength = len(kdata)
    if et:
        h.hasEventTimes = True
    if poff:
        h.hasProperties = True
        h.propertyEntries = m
        h.propertyKeysLength = len(pkdata)
        h.propertyValuesLength = len(pvdata)
    raw = h.to_bytes()
    parts[0] = _U32.pack(len(raw))
    parts[1] = raw
    return _join(parts, 4 + len(raw) + body_length)


def _join(parts: list[bytes], expected: int) -> bytes:
    try:
        out = b"".join(parts)
    except TypeError:
        raise InvalidArgument("message values must be bytes-like") from None
    if len(out) != expected:  # e.g. a memoryview whose items are not bytes
        raise InvalidArgument("message values must be bytes, bytearray or byte memoryviews")
    return out


def encode_batch(
    values: Sequence[bytes],
    *,
    keys: Sequence[str | bytes | None] | None = None,
    properties: Sequence[Mapping[str, str] | None] | None = None,
    event_times: Sequence[int] | None = None,
    producer_name: str,
    sequence_id: int,
    publish_time: int,
    codec: Codec,
    deliver_at: int = 0,
    schema_version: int = 0,
) -> bytes:
    """Encode one batch (the functional form of :class:`BatchBuilder`).

    ``keys``, ``properties`` and ``event_times``, when given, have one item per value
    (``None`` / ``None`` / ``0`` for "not set"). Raises :class:`InvalidArgument` for bad
    input and :class:`MessageTooLarge` when a column outgrows the format's int32 offsets.
    """
    n = len(values)
    _check_producer_name(producer_name)
    for name, col in (("keys", keys), ("properties", properties), ("event_times", event_times)):
        if col is not None and len(col) != n:
            raise InvalidArgument(f"{name} has {len(col)} items for {n} values")
    props: Sequence[Mapping[str, str]] | None = None
    if properties is not None:
        props = [_EMPTY_PROPS if p is None else p for p in properties]
    if keys is not None and not isinstance(keys, list):
        keys = list(keys)
    return _encode(
        values,
        None,
        keys,
        props,
        event_times,
        producer_name=producer_name,
        sequence_id=sequence_id,
        publish_time=publish_time,
        deliver_at=deliver_at,
        schema_version=schema_version,
        codec=codec,
    )


class BatchBuilder:
    """Accumulates messages for one producer partition and encodes them as one batch.

    :meth:`add` is the producer's per-message hot path: it appends the value and the
    running value offset and nothing else when the message has no key, properties or
    event time. Key, property and event-time columns start the first time a message has
    one. All encoding and compression happens in :meth:`build`, which resets the builder
    (also when it raises: the caller fails the messages it had added).

    ``max_messages`` / ``max_bytes`` only decide when :meth:`add` reports "full"; the
    builder accepts more messages after that. :attr:`nbytes` counts value bytes plus key
    and property lengths (``len`` of the str or bytes; no per-message overhead).
    """

    __slots__ = (
        "_end",
        "_ends",
        "_event_times",
        "_extra_bytes",
        "_extras",
        "_keys",
        "_properties",
        "_values",
        "codec",
        "max_bytes",
        "max_messages",
        "producer_name",
        "schema_version",
    )

    def __init__(
        self,
        *,
        producer_name: str,
        codec: Codec,
        max_messages: int = 1000,
        max_bytes: int = 128 * 1024,
        schema_version: int = 0,
    ) -> None:
        _check_producer_name(producer_name)
        if not isinstance(codec, Codec):
            raise InvalidArgument(f"codec must be a Codec, got {codec!r}")
        _check_int("max_messages", max_messages, 1, _INT32_MAX)
        _check_int("max_bytes", max_bytes, 1, _INT32_MAX)
        _check_int("schema_version", schema_version, 0, _UINT32_MAX)
        self.producer_name = producer_name
        self.codec = codec
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.schema_version = schema_version
        self._reset()

    def _reset(self) -> None:
        self._values: list[bytes] = []
        self._ends: list[int] = [0]
        self._end = 0
        self._extra_bytes = 0
        self._extras = False
        self._keys: list[str | bytes | None] | None = None
        self._properties: list[Mapping[str, str]] | None = None
        self._event_times: list[int] | None = None

    def add(
        self,
        value: bytes,
        key: str | bytes | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int = 0,
    ) -> bool:
        """Add one message; return True when the batch is now full.

        ``value`` is bytes-like (a byte ``memoryview`` is kept as a reference, not
        copied, until :meth:`build`); ``key`` is str (stored UTF-8), bytes or None.
        Raises :class:`InvalidArgument` (and adds nothing) for a value without a length,
        or a key, properties or event time of the wrong type; anything subtler (a str
        value, a non-str property) is found by :meth:`build`.
        """
        try:
            size = len(value)
        except TypeError:
            raise InvalidArgument(
                f"message value must be bytes-like, not {type(value).__name__}"
            ) from None
        values = self._values
        if key is not None or properties or event_time or self._extras:
            self._add_extras(len(values), key, properties, event_time)
        values.append(value)
        end = self._end = self._end + size
        self._ends.append(end)
        return len(values) >= self.max_messages or end + self._extra_bytes >= self.max_bytes

    def _add_extras(
        self,
        index: int,
        key: str | bytes | None,
        properties: Mapping[str, str] | None,
        event_time: int,
    ) -> None:
        # Check everything before changing anything.
        extra = 0
        if key is not None:
            if not isinstance(key, str | bytes | bytearray | memoryview):
                raise InvalidArgument(f"message key must be str or bytes, not {type(key).__name__}")
            extra = len(key)
        if properties:
            try:
                for name, text in properties.items():  # faster than map/chain on small dicts
                    extra += len(name) + len(text)
            except (AttributeError, TypeError, ValueError):
                raise InvalidArgument("message properties must be a mapping of str to str")
        if not isinstance(event_time, int):
            raise InvalidArgument(f"event_time must be an int, not {type(event_time).__name__}")
        self._extras = True
        self._extra_bytes += extra
        if self._keys is not None:
            self._keys.append(key)
        elif key is not None:
            self._keys = [None] * index
            self._keys.append(key)
        if self._properties is not None:
            self._properties.append(properties or _EMPTY_PROPS)
        elif properties:
            self._properties = [_EMPTY_PROPS] * index
            self._properties.append(properties)
        if self._event_times is not None:
            self._event_times.append(event_time)
        elif event_time:
            self._event_times = [0] * index
            self._event_times.append(event_time)

    def add_many(
        self,
        values: Sequence[bytes],
        keys: Sequence[str | bytes | None] | None = None,
        properties: Sequence[Mapping[str, str] | None] | None = None,
        event_times: Sequence[int] | None = None,
    ) -> bool:
        """Add several messages at once (all of them, even past the limits); return True
        when the batch is now full. Optional columns have one item per value."""
        n = len(values)
        for name, col in (("keys", keys), ("properties", properties), ("event_times", event_times)):
            if col is not None and len(col) != n:
                raise InvalidArgument(f"{name} has {len(col)} items for {n} values")
        if n == 0:
            return self.is_full
        index = len(self._values)
        self._values.extend(values)
        ends = list(accumulate(map(len, values), initial=self._end))
        self._end = ends[-1]
        self._ends.extend(islice(ends, 1, None))
        if keys is not None and keys.count(None) != n:
            if self._keys is None:
                self._keys = [None] * index
            self._keys.extend(keys)
            self._extra_bytes += sum(map(len, filter(None, keys)))
            self._extras = True
        elif self._keys is not None:
            self._keys.extend(repeat(None, n))
        if properties is not None and any(properties):
            if self._properties is None:
                self._properties = [_EMPTY_PROPS] * index
            self._properties.extend(p or _EMPTY_PROPS for p in properties)
            self._extra_bytes += sum(
                map(
                    len,
                    chain.from_iterable(
                        chain.from_iterable(map(_items_of, filter(None, properties)))
                    ),
                )
            )
            self._extras = True
        elif self._properties is not None:
            self._properties.extend(repeat(_EMPTY_PROPS, n))
        if event_times is not None and any(event_times):
            if self._event_times is None:
                self._event_times = [0] * index
            self._event_times.extend(event_times)
            self._extras = True
        elif self._event_times is not None:
            self._event_times.extend(repeat(0, n))
        return self.is_full

    def check(
        self,
        value: Any,
        key: Any = None,
        properties: Any = None,
        event_time: Any = 0,
    ) -> int:
        """Check one message exactly as :meth:`build` will encode it; add nothing.

        Returns the size in bytes of an uncompressed entry holding only this message
        (length prefix and header included); see :func:`message_body_size`.
        """
        body = message_body_size(value, key, properties, event_time)
        return 4 + _header_length(self.producer_name) + body

    def __len__(self) -> int:
        return len(self._values)

    @property
    def nbytes(self) -> int:
        """Uncompressed payload bytes added so far (values, keys, property strings)."""
        return self._end + self._extra_bytes

    @property
    def is_full(self) -> bool:
        return len(self._values) >= self.max_messages or self.nbytes >= self.max_bytes

    def build(self, *, sequence_id: int, publish_time: int, deliver_at: int = 0) -> bytes:
        """Encode and compress the messages added so far into one entry; reset.

        Message ``i`` gets sequence id ``sequence_id + i``. Raises
        :class:`InvalidArgument` on an empty builder or bad input, and
        :class:`MessageTooLarge` when the batch outgrows the format.
        """
        try:
            return _encode(
                self._values,
                self._ends,
                self._keys,
                self._properties,
                self._event_times,
                producer_name=self.producer_name,
                sequence_id=sequence_id,
                publish_time=publish_time,
                deliver_at=deliver_at,
                schema_version=self.schema_version,
                codec=self.codec,
            )
        finally:
            self._reset()


def message_body_size(
    value: Any, key: Any = None, properties: Any = None, event_time: Any = 0
) -> int:
    """Check one message exactly as :meth:`BatchBuilder.build` will encode it.

    Returns the size of the body of an uncompressed entry holding only this message (the
    entry adds a 4-byte length prefix and the header). Raises :class:`InvalidArgument` for
    a value that is not bytes, bytearray or a byte memoryview, a key that is not str or
    bytes, properties that are not a mapping of str to str, a str that is not encodable as
    UTF-8 (a lone surrogate such as ``"\\ud800"``) or an event time that is not an int64.
    """
    vlen = len(value) if type(value) is bytes else _byte_length(value, "message value")
    if type(event_time) is not int and not isinstance(event_time, int):
        raise InvalidArgument(f"event_time must be an int (ms), not {type(event_time).__name__}")
    # The column layout of _layout() for one message, unrolled: this runs once per message.
    pos = 8  # value offsets
    if event_time:
        if not _INT64_MIN <= event_time <= _INT64_MAX:
            raise InvalidArgument(f"event_time must be an int64 (ms), got {event_time}")
        pos = 16  # event times
    klen = 0
    if key is not None:
        if type(key) is str:
            klen = len(key) if key.isascii() else _utf8_length(key, "message key")
        elif type(key) is bytes:
            klen = len(key)
        elif isinstance(key, str):
            klen = _utf8_length(key, "message key")
        else:
            klen = _byte_length(key, "message key (str or bytes)")
        pos += 9  # key offsets, key validity
    names = texts = 0
    if properties:
        try:
            names = _utf8_length("".join(properties), "property name")
            texts = _utf8_length("".join(properties.values()), "property value")
        except (TypeError, AttributeError):
            raise InvalidArgument(
                "message properties must be a mapping of str to str, "
                f"got {type(properties).__name__}"
            ) from None
        m1 = len(properties) + 1
        pos = ((pos + 7) & ~7) + 8 + 4 * m1  # property offsets, property key offsets
        pos = ((pos + 7) & ~7) + 4 * m1  # property value offsets
    if vlen:
        pos = ((pos + 7) & ~7) + vlen
    if klen:
        pos = ((pos + 7) & ~7) + klen
    if names:
        pos = ((pos + 7) & ~7) + names
    if texts:
        pos = ((pos + 7) & ~7) + texts
    return pos


def _byte_length(data: Any, what: str) -> int:
    """Length of bytes, bytearray or a one-dimensional byte memoryview; else InvalidArgument."""
    if isinstance(data, bytes | bytearray):
        return len(data)
    if isinstance(data, memoryview) and data.ndim == 1 and data.format in ("B", "b", "c"):
        return len(data)
    raise InvalidArgument(
        f"{what} must be bytes, bytearray or a byte memoryview, not {type(data).__name__}"
    )


def _utf8_length(text: str, what: str) -> int:
    """UTF-8 length of ``text``; InvalidArgument if it holds a lone surrogate."""
    if text.isascii():  # O(1) in CPython
        return len(text)
    try:
        return len(text.encode())
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not encodable as UTF-8: {exc}") from None


@functools.lru_cache(maxsize=256)
def _header_length(producer_name: str) -> int:
    """Size of the Cap'n Proto ``BatchHeader`` of this producer (no field changes it)."""
    h = _BatchHeaderSchema.new_message()
    h.producerName = producer_name
    return len(h.to_bytes())


# -- decoding ----------------------------------------------------------------------------


def _offsets_list(col: memoryview, end: int, what: str) -> list[int]:
    """Check an offsets column (starts at 0, never decreases, ends at ``end``)."""
    offsets: list[int] = col.tolist()
    if offsets[0] != 0 or offsets[-1] != end:
        raise CorruptFrame(
            f"{what} offsets run from {offsets[0]} to {offsets[-1]}, expected 0 to {end}"
        )
    # sorted() of an already sorted list is one C-level pass (timsort finds one run).
    if sorted(offsets) != offsets:
        raise CorruptFrame(f"{what} offsets decrease")
    return offsets


class DecodedBatch:
    """The messages of one entry, split lazily.

    The column attributes are zero-copy views of the (decompressed) body, ready to be
    wrapped as Arrow buffers: ``values_offsets`` / ``keys_offsets`` /
    ``properties_offsets`` / ``property_keys_offsets`` / ``property_values_offsets``
    (``memoryview`` of format ``'i'``), ``event_times`` (format ``'q'``), and the byte
    views ``values_data``, ``keys_validity``, ``keys_data``, ``property_keys_data``,
    ``property_values_data``. Absent columns are ``None``.

    With codec ``none`` these views (and the batch) refer to the buffer given to
    :func:`decode_batch`; with a compressing codec, to the decompressed body. Offsets are
    checked when the batch is made; property strings are checked to be UTF-8 when
    :meth:`properties` / :meth:`all_properties` first read them.

    Splitting: :meth:`values` / :meth:`keys` / :meth:`all_properties` return one item per
    message; :meth:`value`, :meth:`key`, :meth:`properties`, :meth:`event_time` and
    :meth:`sequence_id` read message ``i`` (``IndexError`` outside ``0 <= i < n``).
    Values and keys come back as ``bytes``; slicing a ``bytes`` entry is fastest (a
    ``memoryview`` entry costs one extra small object per value).
    """

    __slots__ = (
        "_buf",
        "_kbase",
        "_koff",
        "_pk",
        "_poff",
        "_ptexts",
        "_pv",
        "_vbase",
        "_voff",
        "_voff_abs",
        "event_times",
        "header",
        "keys_data",
        "keys_offsets",
        "keys_validity",
        "num_messages",
        "properties_offsets",
        "property_keys_data",
        "property_keys_offsets",
        "property_values_data",
        "property_values_offsets",
        "values_data",
        "values_offsets",
    )

    def __init__(self, header: BatchHeader, buf: bytes | memoryview, body_start: int) -> None:
        """Build from ``buf`` holding the uncompressed body at ``body_start`` (checked)."""
        self.header = header
        n = self.num_messages = header.num_messages
        self._buf = buf
        starts, total = header.layout()
        body = memoryview(buf)[body_start : body_start + total]
        (s_et, s_voff, s_koff, s_kval, s_poff, s_pkoff, s_pvoff, s_v, s_k, s_pk, s_pv) = starts
        n1 = 4 * (n + 1)

        self.values_offsets = _column(body[s_voff : s_voff + n1], "i")
        self.values_data = body[s_v : s_v + header.values_length]
        self._voff = _offsets_list(self.values_offsets, header.values_length, "value")
        self._vbase = body_start + s_v
        self._voff_abs: list[int] | None = None

        self.event_times: memoryview | None = None
        if header.has_event_times:
            self.event_times = _column(body[s_et : s_et + 8 * n], "q")

        self.keys_offsets: memoryview | None = None
        self.keys_validity: memoryview | None = None
        self.keys_data: memoryview | None = None
        self._koff: list[int] | None = None
        self._kbase = body_start + s_k
        if header.has_keys:
            self.keys_offsets = _column(body[s_koff : s_koff + n1], "i")
            self.keys_validity = body[s_kval : s_kval + ((n + 7) >> 3)]
            self.keys_data = body[s_k : s_k + header.keys_length]
            self._koff = _offsets_list(self.keys_offsets, header.keys_length, "key")

        self.properties_offsets: memoryview | None = None
        self.property_keys_offsets: memoryview | None = None
        self.property_values_offsets: memoryview | None = None
        self.property_keys_data: memoryview | None = None
        self.property_values_data: memoryview | None = None
        self._poff: list[int] | None = None
        self._pk: list[int] = []
        self._pv: list[int] = []
        self._ptexts: tuple[list[str], list[str]] | None = None
        if header.has_properties:
            m1 = 4 * (header.property_entries + 1)
            self.properties_offsets = _column(body[s_poff : s_poff + n1], "i")
            self.property_keys_offsets = _column(body[s_pkoff : s_pkoff + m1], "i")
            self.property_values_offsets = _column(body[s_pvoff : s_pvoff + m1], "i")
            self.property_keys_data = body[s_pk : s_pk + header.property_keys_length]
            self.property_values_data = body[s_pv : s_pv + header.property_values_length]
            self._poff = _offsets_list(self.properties_offsets, header.property_entries, "property")
            self._pk = _offsets_list(
                self.property_keys_offsets, header.property_keys_length, "property name"
            )
            self._pv = _offsets_list(
                self.property_values_offsets, header.property_values_length, "property value"
            )

    def __len__(self) -> int:
        return self.num_messages

    @property
    def has_keys(self) -> bool:
        return self.header.has_keys

    @property
    def has_event_times(self) -> bool:
        return self.header.has_event_times

    @property
    def has_properties(self) -> bool:
        return self.header.has_properties

    def __repr__(self) -> str:
        h = self.header
        return (
            f"<DecodedBatch producer={h.producer_name!r} sequence_id={h.sequence_id} "
            f"messages={self.num_messages}>"
        )

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.num_messages:
            raise IndexError(f"message index {i} out of range for {self.num_messages} messages")

    def sequence_id(self, i: int) -> int:
        self._check_index(i)
        return self.header.sequence_id + i

    def value(self, i: int) -> bytes:
        self._check_index(i)
        base = self._vbase
        return bytes(self._buf[base + self._voff[i] : base + self._voff[i + 1]])

    def values(self) -> list[bytes]:
        """All values as ``bytes`` (one slice per message, no per-byte work)."""
        offsets = self._voff_abs
        if offsets is None:
            offsets = self._voff_abs = _shift(self._voff, self._vbase)
        return _split(self._buf, offsets)

    def key(self, i: int) -> bytes | None:
        self._check_index(i)
        if self._koff is None or self.keys_validity is None:
            return None
        if not (self.keys_validity[i >> 3] >> (i & 7)) & 1:
            return None
        base = self._kbase
        return bytes(self._buf[base + self._koff[i] : base + self._koff[i + 1]])

    def keys(self) -> list[bytes | None]:
        """All keys (``None`` where a message has none)."""
        n = self.num_messages
        if self._koff is None or self.keys_validity is None:
            return [None] * n
        keys: list[bytes | None] = list(_split(self._buf, _shift(self._koff, self._kbase)))
        mask = (1 << n) - 1
        bits = int.from_bytes(self.keys_validity, "little") & mask
        if bits != mask:
            # One char per message, message 0 first; only the null keys are rewritten.
            flags = format(bits, f"0{n}b")[::-1]
            i = flags.find("0")
            while i != -1:
                keys[i] = None
                i = flags.find("0", i + 1)
        return keys

    def event_time(self, i: int) -> int:
        self._check_index(i)
        if self.event_times is None:
            return 0
        return int(self.event_times[i])

    def _property_texts(self) -> tuple[list[str], list[str]]:
        texts = self._ptexts
        if texts is None:
            assert self.property_keys_data is not None
            assert self.property_values_data is not None
            texts = self._ptexts = (
                _split_text(self.property_keys_data, self._pk),
                _split_text(self.property_values_data, self._pv),
            )
        return texts

    def properties(self, i: int) -> dict[str, str]:
        """Properties of message ``i`` (the first call decodes all property strings).

        :raises CorruptFrame: a property string is not UTF-8.
        """
        self._check_index(i)
        if self._poff is None:
            return {}
        a, b = self._poff[i], self._poff[i + 1]
        if a == b:
            return {}
        names, texts = self._property_texts()
        return dict(zip(names[a:b], texts[a:b], strict=True))

    def all_properties(self) -> list[dict[str, str]]:
        """Properties of every message (``{}`` where a message has none)."""
        offsets = self._poff
        if offsets is None:
            return [{} for _ in range(self.num_messages)]
        names, texts = self._property_texts()
        return [
            dict(zip(names[a:b], texts[a:b], strict=True))
            for a, b in zip(offsets, islice(offsets, 1, None), strict=False)
        ]


def _shift(offsets: list[int], base: int) -> list[int]:
    return list(map(add, offsets, repeat(base))) if base else offsets


def _split(buf: bytes | memoryview, offsets: list[int]) -> list[bytes]:
    """``buf[offsets[i]:offsets[i+1]]`` for every i, as bytes."""
    ends = islice(offsets, 1, None)
    if isinstance(buf, bytes):  # slicing bytes gives bytes: one copy per item
        return [buf[a:b] for a, b in zip(offsets, ends, strict=False)]
    return [bytes(buf[a:b]) for a, b in zip(offsets, ends, strict=False)]


def _split_text(data: memoryview, offsets: list[int]) -> list[str]:
    """UTF-8 strings of a string column; CorruptFrame if one is not UTF-8."""
    raw = data.tobytes()
    try:
        if raw.isascii():
            text = raw.decode("ascii")  # one decode; then a character is a byte
            return [text[a:b] for a, b in zip(offsets, islice(offsets, 1, None), strict=False)]
        return [
            str(raw[a:b], "utf-8") for a, b in zip(offsets, islice(offsets, 1, None), strict=False)
        ]
    except UnicodeDecodeError as exc:
        raise CorruptFrame(f"property string is not UTF-8: {exc}") from None


def decode_batch(
    data: bytes | bytearray | memoryview,
    codecs: CodecSet,
    *,
    max_uncompressed_size: int | None = None,
) -> DecodedBatch:
    """Check and decompress an entry; the result splits it into messages lazily.

    With codec ``none`` the result refers to ``data`` without copying it: do not modify a
    mutable buffer while the batch is in use.

    :raises CorruptFrame: the entry is malformed (see :func:`read_header`) or an offsets
        column is out of order or out of bounds.
    :raises UnknownCodec: the entry's codec is not in ``codecs`` (the message names it).
    :raises CodecError: the body does not decompress to ``uncompressed_size`` bytes.
    :raises MessageTooLarge: ``uncompressed_size`` is over ``max_uncompressed_size``.
    """
    mv = _as_bytes_view(data)
    header = _read_header(mv)
    if max_uncompressed_size is not None and header.uncompressed_size > max_uncompressed_size:
        raise MessageTooLarge(
            f"entry decompresses to {header.uncompressed_size} bytes "
            f"(limit {max_uncompressed_size})"
        )
    codec = codecs.by_id(header.codec)
    start = header.body_offset
    if codec.id == 0:
        return DecodedBatch(header, data if isinstance(data, bytes) else mv, start)
    try:
        body = codec.decompress(mv[start:], header.uncompressed_size)
    except PigeonError:
        raise
    except Exception as exc:  # a third-party codec must not leak its own errors
        raise CodecError(f"codec {codec.name!r} failed: {exc!r}") from exc
    if not isinstance(body, bytes):
        raise CodecError(f"codec {codec.name!r} returned {type(body).__name__}, not bytes")
    if len(body) != header.uncompressed_size:
        raise CodecError(
            f"codec {codec.name!r} returned {len(body)} bytes, expected {header.uncompressed_size}"
        )
    return DecodedBatch(header, body, 0)
