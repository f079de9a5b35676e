"""The producer's per-partition batch accumulator (:class:`BatchBuilder`) and the
one-message check it offers the client before a message is queued
(:func:`message_body_size`). No I/O; encoding is :mod:`pigeon.core._batch_encode`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain, repeat
from operator import methodcaller
from typing import Any, Final

from pigeon.core._batch import (
    _INT32_MAX,
    _INT64_MAX,
    _INT64_MIN,
    _UINT32_MAX,
    ChunkInfo,
    _check_int,
    _check_producer_name,
    _header_length,
)
from pigeon.core._batch_encode import _EMPTY_PROPS, _encode
from pigeon.core._codecs import Codec
from pigeon.core.errors import InvalidArgument

__all__ = ["BatchBuilder", "message_body_size"]

_items_of: Final = methodcaller("items")


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
        return len(values) >= self.max_messages or end + self._extra_bytes >= self.max_bytes

    def add_value(self, value: bytes) -> bool:
        """:meth:`add` of a ``bytes`` value alone (no key, properties or event time): the
        producer's hot path, for a caller that checked the value's type. Returns True
        when the batch is now full."""
        if self._extras:
            return self.add(value)
        values = self._values
        values.append(value)
        end = self._end = self._end + len(value)
        return len(values) >= self.max_messages or end >= self.max_bytes

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
        self._end += sum(map(len, values))
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

    def build(
        self,
        *,
        sequence_id: int,
        publish_time: int,
        deliver_at: int = 0,
        chunk: ChunkInfo | None = None,
    ) -> bytes:
        """Encode and compress the messages added so far into one entry; reset.

        Message ``i`` gets sequence id ``sequence_id + i``. Raises
        :class:`InvalidArgument` on an empty builder or bad input, and
        :class:`MessageTooLarge` when the batch outgrows the format.
        """
        try:
            # the value offsets are summed here, once per batch (None: from the values)
            return _encode(
                self._values,
                None,
                self._keys,
                self._properties,
                self._event_times,
                producer_name=self.producer_name,
                sequence_id=sequence_id,
                publish_time=publish_time,
                deliver_at=deliver_at,
                schema_version=self.schema_version,
                codec=self.codec,
                chunk=chunk,
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
    # BatchHeader.layout() for one message, unrolled: this runs once per message.
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
