"""Messages and message ids as the application sees them, and splitting entries."""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pigeon.core.batch import ENTRY_HEADER_SIZE, BatchHeader, decode_batch, unpack_entry_header
from pigeon.core.errors import SchemaSerializationError

if TYPE_CHECKING:
    from pigeon.client._engine import ReceivedEntry

__all__ = [
    "ChunkMessageId",
    "ChunkedMessage",
    "EntryReceipt",
    "BINARY_ID",
    "Message",
    "MessageId",
    "SchemaDecoders",
    "pack_binary_id",
    "receipt_message_id",
    "split_entry",
]

log = logging.getLogger(__name__)

#: The binary form of a message id: the ``message_id`` column of the Arrow API
#: (``receive_arrow``, ``read_arrow``, the Spark source), built with one compute kernel
#: per record batch rather than formatted per row. 40 bytes, five little-endian words:
#:
#: ====== ===== =============================================================
#: offset size  field
#: ====== ===== =============================================================
#: 0      1     0x00: marks the binary form (a text id never starts with NUL)
#: 1      1     layout version, 1
#: 2      2     zero
#: 4      4     partition (int32, -1: not partitioned)
#: 8      8     segment id (int64)
#: 16     8     entry id (int64)
#: 24     8     batch index (int64)
#: 32     8     offset (int64)
#: ====== ===== =============================================================
#:
#: :meth:`MessageId.deserialize` reads it as well as the text form.
BINARY_ID = struct.Struct("<BBxxiqqqq")
BINARY_ID_VERSION = 1


def pack_binary_id(
    segment_id: int, entry_id: int, index: int, partition: int, offset: int
) -> bytes:
    """One id in the :data:`BINARY_ID` layout."""
    return BINARY_ID.pack(0, BINARY_ID_VERSION, partition, segment_id, entry_id, index, offset)


def receipt_message_id(
    receipt: tuple[int, int, int, bool], index: int, partition: int
) -> MessageId:
    """The MessageId of message ``index`` of a batch the broker acknowledged with ``receipt``.

    ``receipt`` is ``(segment_id, entry_id, first_offset, duplicate)``; a first offset
    below 0 (the broker does not know it) leaves every offset unknown.  The receipt of a
    chunked message's last chunk carries the first chunk's receipt as a fifth item: its
    id is then a :class:`ChunkMessageId`.
    """
    offset = receipt[2]
    offset = offset + index if offset >= 0 else -1
    mid = _message_id(receipt[0], receipt[1], index, partition, offset)
    if len(receipt) > 4:
        first = receipt_message_id(receipt[4], 0, partition)
        return ChunkMessageId(first, mid)
    return mid


class MessageId:
    """Where a message is stored: ``(segment_id, entry_id, batch_index, partition)``.

    ``offset`` (the continuous per-partition offset) rides along but is not part of
    equality, hashing or ordering.  Immutable.
    """

    __slots__ = ("batch_index", "entry_id", "offset", "partition", "segment_id")

    segment_id: int
    entry_id: int
    batch_index: int
    partition: int
    offset: int

    def __init__(
        self,
        segment_id: int,
        entry_id: int,
        batch_index: int = 0,
        partition: int = -1,
        offset: int = -1,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "segment_id", segment_id)
        set_(self, "entry_id", entry_id)
        set_(self, "batch_index", batch_index)
        set_(self, "partition", partition)
        set_(self, "offset", offset)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("MessageId is immutable")

    def _key(self) -> tuple[int, int, int, int]:
        return (self.segment_id, self.entry_id, self.batch_index, self.partition)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MessageId):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __lt__(self, other: MessageId) -> bool:
        return self._key() < other._key()

    def __le__(self, other: MessageId) -> bool:
        return self._key() <= other._key()

    def __gt__(self, other: MessageId) -> bool:
        return self._key() > other._key()

    def __ge__(self, other: MessageId) -> bool:
        return self._key() >= other._key()

    def __repr__(self) -> str:
        return (
            f"MessageId(segment_id={self.segment_id}, entry_id={self.entry_id}, "
            f"batch_index={self.batch_index}, partition={self.partition}, offset={self.offset})"
        )

    def __str__(self) -> str:
        return f"{self.segment_id}:{self.entry_id}:{self.batch_index}:{self.partition}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            MessageId,
            (self.segment_id, self.entry_id, self.batch_index, self.partition, self.offset),
        )

    def serialize(self) -> bytes:
        return f"{self}:{self.offset}".encode()

    @classmethod
    def deserialize(cls, data: bytes | bytearray | memoryview | str) -> MessageId:
        """The id written by :meth:`serialize` (text) or in the :data:`BINARY_ID`
        layout (the Arrow API's ``message_id`` column)."""
        if isinstance(data, bytearray | memoryview):
            data = bytes(data)  # a Spark Row's binary cell, a buffer view
        if isinstance(data, bytes) and len(data) == BINARY_ID.size and data[:1] == b"\0":
            _, version, partition, segment, entry, index, offset = BINARY_ID.unpack(data)
            if version != BINARY_ID_VERSION:
                raise ValueError(f"binary message id of unknown layout version {version}")
            return MessageId(segment, entry, index, partition, offset)
        text = data.decode() if isinstance(data, bytes) else data
        if ";" in text:
            last, first = text.split(";", 1)
            return ChunkMessageId(MessageId.deserialize(first), MessageId.deserialize(last))
        parts = [int(p) for p in text.split(":")]
        return MessageId(*parts)


_new = object.__new__
_SET_SEGMENT = MessageId.__dict__["segment_id"].__set__
_SET_ENTRY = MessageId.__dict__["entry_id"].__set__
_SET_INDEX = MessageId.__dict__["batch_index"].__set__
_SET_PARTITION = MessageId.__dict__["partition"].__set__
_SET_OFFSET = MessageId.__dict__["offset"].__set__


def _message_id(segment: int, entry: int, index: int, partition: int, offset: int) -> MessageId:
    """``MessageId(...)`` of checked ints, at half the cost (no ``__init__`` frame and its
    ``object.__setattr__`` calls): made per message by receipts and received messages."""
    mid: MessageId = _new(MessageId)
    _SET_SEGMENT(mid, segment)
    _SET_ENTRY(mid, entry)
    _SET_INDEX(mid, index)
    _SET_PARTITION(mid, partition)
    _SET_OFFSET(mid, offset)
    return mid


def receipt_message_ids(
    receipt: tuple[int, int, int, bool], count: int, partition: int
) -> list[MessageId]:
    """:func:`receipt_message_id` of the ``count`` messages of a batch, in order."""
    if len(receipt) > 4:
        return [receipt_message_id(receipt, i, partition) for i in range(count)]
    segment, entry, offset = receipt[0], receipt[1], receipt[2]
    if offset < 0:
        return [_message_id(segment, entry, i, partition, -1) for i in range(count)]
    return [_message_id(segment, entry, i, partition, offset + i) for i in range(count)]


class EntryReceipt:
    """The broker's receipt of one entry sent by ``send_arrow``: where its ``num_rows``
    rows are stored (row ``i`` is :meth:`message_id` ``(i)``; offsets
    ``first.offset .. first.offset + num_rows - 1``). ``duplicate``: the broker had
    stored this entry already (a resend); immutable."""

    __slots__ = ("duplicate", "first", "num_rows")

    first: MessageId
    num_rows: int
    duplicate: bool

    def __init__(self, first: MessageId, num_rows: int, duplicate: bool = False) -> None:
        object.__setattr__(self, "first", first)
        object.__setattr__(self, "num_rows", num_rows)
        object.__setattr__(self, "duplicate", duplicate)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("EntryReceipt is immutable")

    @classmethod
    def of(cls, receipt: tuple[int, int, int, bool], num_rows: int, partition: int) -> EntryReceipt:
        return cls(receipt_message_id(receipt, 0, partition), num_rows, bool(receipt[3]))

    def message_id(self, row: int) -> MessageId:
        """The MessageId of row ``row`` of the entry."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} of an entry of {self.num_rows} rows")
        f = self.first
        offset = f.offset + row if f.offset >= 0 else -1
        return MessageId(f.segment_id, f.entry_id, row, f.partition, offset)

    @property
    def last(self) -> MessageId:
        """The MessageId of the entry's last row (for ``acknowledge_cumulative``, seek)."""
        return self.message_id(self.num_rows - 1)

    @property
    def offsets(self) -> range:
        """The partition offsets of the rows (empty if the broker did not say)."""
        first = self.first.offset
        return range(first, first + self.num_rows) if first >= 0 else range(0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EntryReceipt):
            return NotImplemented
        return (self.first, self.num_rows) == (other.first, other.num_rows)

    def __hash__(self) -> int:
        return hash((self.first, self.num_rows))

    def __repr__(self) -> str:
        return f"EntryReceipt(first={self.first!r}, num_rows={self.num_rows})"


class ChunkMessageId(MessageId):
    """The id of a chunked message (Pulsar's ChunkMessageId): the position of its last
    chunk, with ``first_chunk_message_id`` the position of its first.

    Equality, hashing and ordering are those of the last chunk.  A received message's id
    also knows every chunk (``chunk_ids``), so acknowledging it acknowledges them all; an
    id rebuilt by :meth:`MessageId.deserialize` knows only the first and the last.
    """

    __slots__ = ("chunk_ids", "first_chunk_message_id")

    first_chunk_message_id: MessageId
    chunk_ids: tuple[MessageId, ...]

    def __init__(
        self, first: MessageId, last: MessageId, chunk_ids: tuple[MessageId, ...] = ()
    ) -> None:
        super().__init__(
            last.segment_id, last.entry_id, last.batch_index, last.partition, last.offset
        )
        object.__setattr__(self, "first_chunk_message_id", first)
        object.__setattr__(self, "chunk_ids", chunk_ids or (first, self.last_chunk_message_id))

    @property
    def last_chunk_message_id(self) -> MessageId:
        return MessageId(
            self.segment_id, self.entry_id, self.batch_index, self.partition, self.offset
        )

    def __repr__(self) -> str:
        return (
            f"ChunkMessageId(first={self.first_chunk_message_id!r}, "
            f"last={self.last_chunk_message_id!r}, chunks={len(self.chunk_ids)})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            ChunkMessageId,
            (self.first_chunk_message_id, self.last_chunk_message_id, self.chunk_ids),
        )

    def serialize(self) -> bytes:
        """``<last>;<first>``, each as :meth:`MessageId.serialize` writes one."""
        return MessageId.serialize(self) + b";" + self.first_chunk_message_id.serialize()


@dataclass(slots=True, eq=False, repr=False)
class Message:
    """One received message. ``message_id`` is built on first use.

    ``data`` is the value's bytes as sent; ``value`` is the same bytes, or with a
    consumer ``schema`` the decoded value (a Record, a str), None if it did not decode.
    """

    value: Any
    key: str | None
    properties: dict[str, str]
    event_time: int
    publish_time: int
    _segment: int
    _entry: int
    _index: int
    _partition: int
    offset: int
    redelivery_count: int
    topic: str
    data: bytes

    @property
    def message_id(self) -> MessageId:
        return _message_id(self._segment, self._entry, self._index, self._partition, self.offset)

    @property
    def segment_id(self) -> int:
        return self._segment

    def __repr__(self) -> str:
        value = self.value[:32] if isinstance(self.value, bytes) else self.value
        return (
            f"Message(topic={self.topic!r}, id={self.message_id}, offset={self.offset}, "
            f"key={self.key!r}, value={value!r})"
        )


@dataclass(slots=True, eq=False, repr=False)
class ChunkedMessage(Message):
    """A message reassembled from its chunks: its id is a :class:`ChunkMessageId`."""

    chunk_ids: tuple[MessageId, ...] = ()

    @property
    def message_id(self) -> MessageId:
        ids = self.chunk_ids
        return ChunkMessageId(ids[0], ids[-1], ids)


class ChunkSink(Protocol):
    def add(self, chunk: Message, header: BatchHeader, source: Any) -> Message | None: ...


def split_entry(
    entry: ReceivedEntry,
    partition: int,
    topic: str,
    codecs: Any,
    chunks: ChunkSink | None = None,
    decoders: SchemaDecoders | None = None,
) -> list[Message] | None:
    """All messages of one received entry (of ``topic``, partition ``partition``), minus
    the batch indexes already acknowledged; with ``decoders`` (a consumer's schema) each
    value decoded with the schema version the batch header names.

    A chunk (an entry whose header has ``numChunks``) goes to ``chunks`` when given:
    the result is then the whole message if that chunk completed it (decoded whole),
    else None.
    """
    data = entry.data
    header = unpack_entry_header(data)
    batch = decode_batch(memoryview(data)[ENTRY_HEADER_SIZE:], codecs)
    first, publish = header.first_offset, header.publish_time
    if batch.header.num_chunks and chunks is not None:
        (chunk,) = _split(entry, batch, first, publish, partition, topic, None)
        whole = chunks.add(chunk, batch.header, entry.source)
        if whole is None:
            return None
        if decoders is not None:
            version = batch.header.schema_version
            whole.value = decoders.decode_all(entry.source, version, [whole.data], range(1))[0]
        return [whole]
    return _split(entry, batch, first, publish, partition, topic, decoders)


def _split(
    entry: ReceivedEntry,
    batch: Any,
    first: int,
    publish: int,
    partition: int,
    topic: str,
    decoders: SchemaDecoders | None,
) -> list[Message]:
    n = batch.num_messages
    values = batch.values()
    keys = batch.keys() if batch.has_keys else None
    props = batch.all_properties() if batch.has_properties else None
    times = batch.event_times if batch.has_event_times else None
    empty: dict[str, str] = {}
    if entry.acked_indexes:
        skip = set(entry.acked_indexes)
        indexes: Any = [i for i in range(entry.taken, n) if i not in skip]
    else:
        indexes = range(entry.taken, n)
    # what ``msg.value`` shows: the bytes, or with a schema the decoded values by index
    shown: Any = (
        values
        if decoders is None
        else decoders.decode_all(entry.source, batch.header.schema_version, values, indexes)
    )
    if keys is None and props is None and times is None and decoders is None:
        # values alone (the common case): nothing to choose per message
        seg, ent, red = entry.segment_id, entry.entry_id, entry.redelivery_count
        return [
            Message(v, None, empty, 0, publish, seg, ent, i, partition, first + i, red, topic, v)
            for i, v in zip(indexes, map(values.__getitem__, indexes), strict=True)
        ]
    return [
        Message(
            shown[i],
            None if keys is None or keys[i] is None else keys[i].decode("utf-8", "surrogateescape"),
            props[i] if props is not None else empty,
            times[i] if times is not None else 0,
            publish,
            entry.segment_id,
            entry.entry_id,
            i,
            partition,
            first + i,
            entry.redelivery_count,
            topic,
            values[i],
        )
        for i in indexes
    ]


class SchemaDecoders:
    """A consumer schema's decoders, by the engine an entry came through (versions are
    numbered per topic) and the batch header's schema version (the registry version + 1;
    0: written without a schema).

    A version not known yet is fetched from the broker before its entries are queued
    (see :class:`pigeon.client._consumer_handle.ConsumerHandle`); a value that does not
    decode becomes None (its bytes stay in ``msg.data``), logged once per batch.
    """

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        #: (engine, header version) -> decoder of one value
        self.by_version: dict[tuple[Any, int], Any] = {}
        self.own = schema.decoder_for(None)

    def known(self, source: Any, header_version: int) -> bool:
        return (
            header_version == 0
            or (source, header_version) in self.by_version
            or not self.schema.needs_writer_schema
        )

    def learn(self, source: Any, header_version: int, definition: str | None) -> None:
        self.by_version[source, header_version] = self.schema.decoder_for(definition)

    def decode_all(
        self, source: Any, header_version: int, values: Any, indexes: Any
    ) -> dict[int, Any]:
        decode = self.by_version.get((source, header_version), self.own)
        out: dict[int, Any] = {}
        failed = None
        for i in indexes:
            try:
                out[i] = decode(values[i])
            except SchemaSerializationError as exc:
                out[i] = None
                failed = exc
        if failed is not None:
            log.warning(
                "message values did not decode schema_version=%d error=%s",
                header_version - 1,
                failed,
            )
        return out
