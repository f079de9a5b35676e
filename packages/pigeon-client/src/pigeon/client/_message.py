"""Messages and message ids as the application sees them, and splitting entries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pigeon.core._batch import decode_batch
from pigeon.core._entry import ENTRY_HEADER_SIZE, unpack_entry_header

__all__ = ["Message", "MessageId", "split_entry"]


@dataclass(frozen=True, slots=True, order=True)
class MessageId:
    """Where a message is stored: ``(segment_id, entry_id, batch_index, partition)``.

    ``offset`` (the continuous per-partition offset) rides along but is not part of
    equality or ordering.
    """

    segment_id: int
    entry_id: int
    batch_index: int = 0
    partition: int = -1
    offset: int = field(default=-1, compare=False)

    def __str__(self) -> str:
        return f"{self.segment_id}:{self.entry_id}:{self.batch_index}:{self.partition}"

    def serialize(self) -> bytes:
        return f"{self}:{self.offset}".encode()

    @classmethod
    def deserialize(cls, data: bytes | str) -> MessageId:
        text = data.decode() if isinstance(data, bytes) else data
        parts = [int(p) for p in text.split(":")]
        return cls(*parts)


class Message:
    """One received message."""

    __slots__ = (
        "event_time",
        "key",
        "message_id",
        "offset",
        "properties",
        "publish_time",
        "redelivery_count",
        "topic",
        "value",
    )

    def __init__(
        self,
        value: bytes,
        key: str | None,
        properties: dict[str, str],
        event_time: int,
        publish_time: int,
        message_id: MessageId,
        offset: int,
        redelivery_count: int,
        topic: str,
    ) -> None:
        self.value = value
        self.key = key
        self.properties = properties
        self.event_time = event_time
        self.publish_time = publish_time
        self.message_id = message_id
        self.offset = offset
        self.redelivery_count = redelivery_count
        self.topic = topic

    def data(self) -> bytes:
        return self.value

    def __repr__(self) -> str:
        return (
            f"Message(topic={self.topic!r}, id={self.message_id}, offset={self.offset}, "
            f"key={self.key!r}, value={self.value[:32]!r})"
        )


def split_entry(
    data: bytes | memoryview,
    *,
    segment_id: int,
    entry_id: int,
    partition: int,
    topic: str,
    redelivery_count: int,
    acked_indexes: Any,
    codecs: Any,
) -> list[Message]:
    """All messages of one stored entry, minus the batch indexes already acknowledged."""
    header = unpack_entry_header(data)
    batch = decode_batch(memoryview(data)[ENTRY_HEADER_SIZE:], codecs)
    n = batch.num_messages
    first = header.first_offset
    publish = header.publish_time
    values = batch.values()
    has_keys = batch.has_keys
    has_props = batch.has_properties
    has_times = batch.has_event_times
    skip = set(acked_indexes) if acked_indexes else None
    out: list[Message] = []
    append = out.append
    for i in range(n):
        if skip is not None and i in skip:
            continue
        key = batch.key(i) if has_keys else None
        append(
            Message(
                values[i],
                key.decode("utf-8", "surrogateescape") if key is not None else None,
                batch.properties(i) if has_props else {},
                batch.event_time(i) if has_times else 0,
                publish,
                MessageId(segment_id, entry_id, i, partition, first + i),
                first + i,
                redelivery_count,
                topic,
            )
        )
    return out
