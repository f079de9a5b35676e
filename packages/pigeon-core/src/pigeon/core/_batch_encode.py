"""Encode a batch (:func:`encode_batch`, and the encoder behind :class:`BatchBuilder`).

Writes the byte layout documented in :mod:`pigeon.core._batch`: the columns are packed
with ``struct`` and joined with ``b"".join`` (the values straight into the entry, one
copy), then compressed as a whole by the codec. No I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate, chain, repeat
from operator import is_not, methodcaller
from typing import Any, Final

from pigeon.core._batch import (
    _INT32_MAX,
    _INT64_MAX,
    _INT64_MIN,
    _U32,
    _UINT32_MAX,
    _UINT64_MAX,
    FORMAT_VERSION,
    ChunkInfo,
    _BatchHeaderSchema,
    _check_int,
    _check_producer_name,
)
from pigeon.core._codecs import Codec
from pigeon.core.errors import InvalidArgument, MessageTooLarge

__all__ = ["encode_batch", "encode_columns"]

_ZEROS: Final = tuple(b"\0" * i for i in range(8))
_EMPTY_PROPS: Final[Mapping[str, str]] = {}
_values_of: Final = methodcaller("values")
_BIT_CHARS: Final = bytes.maketrans(b"\0\1", b"01")


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
    chunk: ChunkInfo | None = None,
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
    h = _new_header(FORMAT_VERSION, producer_name, sequence_id, n, 0, 0, publish_time)
    h.deliverAtTime = deliver_at
    h.schemaVersion = schema_version
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
    if chunk is not None:
        uuid, chunk_id, num_chunks, total = chunk
        if n != 1 or not uuid or not 0 <= chunk_id < num_chunks or total > _UINT32_MAX:
            raise InvalidArgument(f"bad chunk {chunk!r} of a batch of {n} messages")
        h.chunkUuid = uuid
        h.chunkId = chunk_id
        h.numChunks = num_chunks
        h.totalChunkSize = total
    return _finish(h, columns, values_length, codec)


def _finish(
    h: Any,
    columns: Iterable[tuple[int, Iterable[Any]]],
    values_length: int,
    codec: Codec,
) -> bytes:
    """Lay the ``columns`` out, compress them and prefix the header ``h`` (its fields
    but the sizes and the codec set by the caller): the entry."""
    parts: list[Any] = [b"", b""]  # slots for the length prefix and the header
    pos = _lay_out(columns, parts)
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

    h.uncompressedSize = pos
    h.bodyLength = body_length
    h.codec = codec.id
    h.valuesLength = values_length
    raw = h.to_bytes()
    parts[0] = _U32.pack(len(raw))
    parts[1] = raw
    return _join(parts, 4 + len(raw) + body_length)


def _lay_out(columns: Iterable[tuple[int, Iterable[Any]]], parts: list[Any]) -> int:
    """Append the non-empty ``(size, chunks)`` columns to ``parts``, each padded with zeros
    to start 8-byte aligned; the length of the whole (the entry body)."""
    pos = 0
    for size, chunks in columns:
        if size:
            pad = -pos & 7
            if pad:
                parts.append(_ZEROS[pad])
                pos += pad
            parts.extend(chunks)
            pos += size
    return pos


def _new_header(
    format_version: int,
    producer_name: str,
    sequence_id: int,
    num_messages: int,
    uncompressed_size: int,
    body_length: int,
    publish_time: int,
) -> Any:
    """A batch header message with the fields every format sets (codec 0 unless set)."""
    h = _BatchHeaderSchema.new_message()
    h.formatVersion = format_version
    h.producerName = producer_name
    h.sequenceId = sequence_id
    h.numMessages = num_messages
    h.uncompressedSize = uncompressed_size
    h.bodyLength = body_length
    h.publishTime = publish_time
    return h


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
    chunk: ChunkInfo | None = None,
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
        chunk=chunk,
    )


def _nbytes(column: Any, what: str) -> int:
    try:
        return memoryview(column).nbytes
    except TypeError:
        raise InvalidArgument(f"{what} must be a bytes-like buffer") from None


def _check_offsets(column: Any, count: int, end: int, what: str) -> None:
    """``column`` holds ``count`` int32 offsets from 0 to ``end`` (only the ends are
    checked here: the buffers come from validated Arrow arrays; the decoder checks all)."""
    size = _nbytes(column, what)
    if size != 4 * count:
        raise InvalidArgument(f"{what} has {size} bytes, expected {4 * count}")
    mv = memoryview(column).cast("B")
    first = struct.unpack_from("<i", mv, 0)[0]
    last = struct.unpack_from("<i", mv, size - 4)[0]
    if first != 0 or last != end:
        raise InvalidArgument(f"{what} run from {first} to {last}, expected 0 to {end}")


def encode_columns(
    num_messages: int,
    value_offsets: Any,
    values: Any,
    *,
    event_times: Any = None,
    key_offsets: Any = None,
    key_validity: Any = None,
    keys: Any = None,
    property_offsets: Any = None,
    property_key_offsets: Any = None,
    property_value_offsets: Any = None,
    property_keys: Any = None,
    property_values: Any = None,
    producer_name: str,
    sequence_id: int,
    publish_time: int,
    codec: Codec,
    deliver_at: int = 0,
    schema_version: int = 0,
) -> bytes:
    """Encode one batch from columns already laid out (the Arrow producer's path).

    Every column is a bytes-like buffer (``bytes``, a ``memoryview``, a
    ``pyarrow.Buffer``) in the layout of :mod:`pigeon.core._batch`: int32 offsets from 0
    (``n + 1`` of them; ``m + 1`` for the property key and value offsets), int64 event
    times (``n``), an LSB-first validity bitmap (``ceil(n / 8)`` bytes). The key columns
    come together or not at all, as do the five property columns; ``event_times`` may be
    None. The buffers are joined into the entry (one copy) or compressed as a whole by
    ``codec``; nothing is done per message. Raises :class:`InvalidArgument` when the
    sizes do not agree (the offsets' first and last values are checked, not each one).
    """
    n = num_messages
    _check_int("num_messages", n, 1, _UINT32_MAX)
    _check_producer_name(producer_name)
    _check_int("sequence_id", sequence_id, 0, _UINT64_MAX - n + 1)
    _check_int("publish_time", publish_time, _INT64_MIN, _INT64_MAX)
    _check_int("deliver_at", deliver_at, _INT64_MIN, _INT64_MAX)
    _check_int("schema_version", schema_version, 0, _UINT32_MAX)
    if not isinstance(codec, Codec):
        raise InvalidArgument(f"codec must be a Codec, got {codec!r}")
    values_length = _nbytes(values, "values")
    if values_length > _INT32_MAX:
        raise MessageTooLarge(f"values of the batch total {values_length} bytes (max {_INT32_MAX})")
    _check_offsets(value_offsets, n + 1, values_length, "value offsets")
    h = _new_header(FORMAT_VERSION, producer_name, sequence_id, n, 0, 0, publish_time)
    h.deliverAtTime = deliver_at
    h.schemaVersion = schema_version
    et_len = 0
    if event_times is not None:
        et_len = _nbytes(event_times, "event times")
        if et_len != 8 * n:
            raise InvalidArgument(f"event times have {et_len} bytes, expected {8 * n}")
        h.hasEventTimes = True
    key_cols = (key_offsets, key_validity, keys)
    klen = kv_len = 0
    if any(c is not None for c in key_cols):
        if any(c is None for c in key_cols):
            raise InvalidArgument("key offsets, key validity and keys come together")
        klen = _nbytes(keys, "keys")
        if klen > _INT32_MAX:
            raise MessageTooLarge(f"keys of the batch total {klen} bytes (max {_INT32_MAX})")
        _check_offsets(key_offsets, n + 1, klen, "key offsets")
        kv_len = _nbytes(key_validity, "key validity")
        if kv_len != (n + 7) >> 3:
            raise InvalidArgument(f"key validity has {kv_len} bytes, expected {(n + 7) >> 3}")
        h.hasKeys = True
        h.keysLength = klen
    prop_cols = (
        property_offsets,
        property_key_offsets,
        property_value_offsets,
        property_keys,
        property_values,
    )
    m = pk_len = pv_len = 0
    if any(c is not None for c in prop_cols):
        if any(c is None for c in prop_cols):
            raise InvalidArgument("the five property columns come together")
        m = _nbytes(property_key_offsets, "property key offsets") // 4 - 1
        if m < 0:
            raise InvalidArgument("property key offsets are empty")
        _check_offsets(property_offsets, n + 1, m, "property offsets")
        pk_len = _nbytes(property_keys, "property keys")
        pv_len = _nbytes(property_values, "property values")
        if max(pk_len, pv_len) > _INT32_MAX:
            raise MessageTooLarge("properties of the batch exceed int32 offsets")
        _check_offsets(property_key_offsets, m + 1, pk_len, "property key offsets")
        _check_offsets(property_value_offsets, m + 1, pv_len, "property value offsets")
        h.hasProperties = True
        h.propertyEntries = m
        h.propertyKeysLength = pk_len
        h.propertyValuesLength = pv_len
    has_props = h.hasProperties
    columns = (
        (et_len, (event_times,)),
        (4 * (n + 1), (value_offsets,)),
        (4 * (n + 1) if klen or key_offsets is not None else 0, (key_offsets,)),
        (kv_len, (key_validity,)),
        (4 * (n + 1) if has_props else 0, (property_offsets,)),
        (4 * (m + 1) if has_props else 0, (property_key_offsets,)),
        (4 * (m + 1) if has_props else 0, (property_value_offsets,)),
        (values_length, (values,)),
        (klen, (keys,)),
        (pk_len, (property_keys,)),
        (pv_len, (property_values,)),
    )
    return _finish(h, columns, values_length, codec)
