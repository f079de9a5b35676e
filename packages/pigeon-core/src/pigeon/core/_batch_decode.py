"""Decode a batch: check and decompress an entry (:func:`decode_batch`) and split it
into messages lazily (:class:`DecodedBatch`). No I/O.

Reads the byte layout documented in :mod:`pigeon.core._batch`. Columns come back as
zero-copy ``memoryview`` slices of the (decompressed) body; values and keys are split
with one slice per message, never a loop over bytes.

A Kafka-format entry (``formatVersion`` 2: a Kafka RecordBatch v2 stored as it came, see
:mod:`pigeon.core._kafka_records`) decodes to the same columns: its records are
decompressed, parsed (one Python step per record: the cross-protocol path) and laid out
as a native body, and ``header`` describes those columns. Its property strings are
decoded with ``surrogateescape`` (Kafka header values are bytes) instead of being
checked to be UTF-8.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import replace
from itertools import accumulate, islice, repeat
from operator import add
from typing import Literal

from pigeon.core._batch import FORMAT_KAFKA, BatchHeader, _as_bytes_view, _read_header
from pigeon.core._batch_encode import _encode_keys, _lay_out, _offsets
from pigeon.core._codecs import CodecSet
from pigeon.core._kafka_records import (
    BATCH_HEADER_SIZE,
    DEFAULT_MAX_RECORDS_SIZE,
    parse_records,
    read_batch_info,
)
from pigeon.core._kafka_records_codecs import decompress_records
from pigeon.core.errors import (
    CodecError,
    CorruptFrame,
    CorruptRecordBatch,
    MessageTooLarge,
    PigeonError,
)

__all__ = ["DecodedBatch", "decode_batch"]


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
    ``property_values_data``. Absent columns are ``None``; ``has_keys``,
    ``has_event_times`` and ``has_properties`` (the header's flags) say which are there.

    With codec ``none`` these views (and the batch) refer to the buffer given to
    :func:`decode_batch`; with a compressing codec, to the decompressed body. Offsets are
    checked when the batch is made; property strings are checked to be UTF-8 when
    :meth:`properties` / :meth:`all_properties` first read them (a Kafka-format batch
    decodes them with ``surrogateescape`` instead: any bytes give a string).

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
        "_text_errors",
        "_vbase",
        "_voff",
        "_voff_abs",
        "event_times",
        "has_event_times",
        "has_keys",
        "has_properties",
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

    def __init__(
        self,
        header: BatchHeader,
        buf: bytes | memoryview,
        body_start: int,
        *,
        text_errors: str = "strict",
    ) -> None:
        """Build from ``buf`` holding the uncompressed body at ``body_start`` (checked);
        ``text_errors`` is how undecodable property strings are handled."""
        self.header = header
        self._text_errors = text_errors
        n = self.num_messages = header.num_messages
        self.has_keys = header.has_keys
        self.has_event_times = header.has_event_times
        self.has_properties = header.has_properties
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
                _split_text(self.property_keys_data, self._pk, self._text_errors),
                _split_text(self.property_values_data, self._pv, self._text_errors),
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


def _split_text(data: memoryview, offsets: list[int], errors: str = "strict") -> list[str]:
    """UTF-8 strings of a string column; CorruptFrame if one is not UTF-8 (with
    ``errors="strict"``)."""
    raw = data.tobytes()
    try:
        if raw.isascii():
            text = raw.decode("ascii")  # one decode; then a character is a byte
            return [text[a:b] for a, b in zip(offsets, islice(offsets, 1, None), strict=False)]
        return [
            str(raw[a:b], "utf-8", errors)
            for a, b in zip(offsets, islice(offsets, 1, None), strict=False)
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

    A Kafka-format entry (``formatVersion`` 2) has its CRC-32C checked, its records
    decompressed (at most ``max_uncompressed_size`` bytes, else
    ``DEFAULT_MAX_RECORDS_SIZE``) and parsed; it raises
    :class:`~pigeon.core.errors.CorruptRecordBatch` (a CorruptFrame) when they do not
    decode, :class:`~pigeon.core.errors.UnsupportedRecordFormat` for a batch the front
    door would not have accepted, MessageTooLarge over the limit.
    """
    mv = _as_bytes_view(data)
    header = _read_header(mv)
    if header.format_version == FORMAT_KAFKA:
        return _decode_kafka(header, mv[header.body_offset :], max_uncompressed_size)
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


def _decode_kafka(
    header: BatchHeader, body: memoryview, max_uncompressed_size: int | None
) -> DecodedBatch:
    """The columns of a format-2 entry's RecordBatch (``body``), laid out as a native
    body (see :mod:`pigeon.core._batch`)."""
    info = read_batch_info(body)
    n = info.record_count
    if n != header.num_messages:
        raise CorruptRecordBatch(
            f"entry header counts {header.num_messages} messages, its record batch {n}"
        )
    limit = DEFAULT_MAX_RECORDS_SIZE if max_uncompressed_size is None else max_uncompressed_size
    records = decompress_records(info.compression, body[BATCH_HEADER_SIZE:], limit)
    values, keys, times, hoff, hkeys, hvals = parse_records(records, n, info.first_timestamp)

    et = b""
    if -1 in times:  # Kafka's "no timestamp"
        times = [0 if t == -1 else t for t in times]
    if any(times):
        try:
            et = struct.pack(f"<{n}q", *times)
        except struct.error:
            raise CorruptRecordBatch("record timestamp outside int64") from None
    vdata = b"".join(values)
    voff = _offsets(list(accumulate(map(len, values), initial=0)))
    koff = kvalid = kdata = b""
    if keys.count(None) != n:
        koff, kvalid, kdata = _encode_keys(keys, n)
    poff = pkoff = pvoff = pkdata = pvdata = b""
    m = len(hkeys)
    if m:
        hv = [b"" if v is None else v for v in hvals] if None in hvals else hvals
        poff = _offsets(hoff)
        pkoff = _offsets(list(accumulate(map(len, hkeys), initial=0)))
        pvoff = _offsets(list(accumulate(map(len, hv), initial=0)))  # type: ignore[arg-type]
        pkdata = b"".join(hkeys)
        pvdata = b"".join(hv)  # type: ignore[arg-type]

    columns = (et, voff, koff, kvalid, poff, pkoff, pvoff, vdata, kdata, pkdata, pvdata)
    parts: list[bytes] = []
    pos = _lay_out(((len(col), (col,)) for col in columns), parts)
    columns_header = replace(
        header,
        uncompressed_size=pos,
        has_keys=bool(koff),
        has_event_times=bool(et),
        has_properties=bool(poff),
        values_length=len(vdata),
        keys_length=len(kdata),
        property_entries=m,
        property_keys_length=len(pkdata),
        property_values_length=len(pvdata),
    )
    return DecodedBatch(columns_header, b"".join(parts), 0, text_errors="surrogateescape")
