"""Non-persistent topics: in-memory fan-out, never on disk.

A batch published to ``non-persistent://tenant/ns/topic`` is pushed at once to every
subscription's consumer that has permits and whose connection is keeping up; when none
can take it the batch is dropped for that subscription and counted (as Pulsar does).
Nothing is stored, acknowledged or redelivered; offsets still count every message, so
consumers can see gaps where messages were dropped.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pigeon.broker._dedup import Deduplication
from pigeon.broker._dispatch import joined_type
from pigeon.core import TopicName
from pigeon.core.batch import pack_entry_header
from pigeon.core.errors import (
    NotSupported,
    PigeonError,
    SubscriptionNotFound,
)

if TYPE_CHECKING:
    from pigeon.broker._dedup import Receipt
    from pigeon.broker._ledger_state import Position
    from pigeon.broker._policies import NamespacePolicies
    from pigeon.broker._subscription import Consumer
    from pigeon.broker._topic import Topic
    from pigeon.broker._topic_protocol import SeekTarget
    from pigeon.core.runtime import WallClock

__all__ = ["NonPersistentSubscription", "NonPersistentTopic"]

log = logging.getLogger(__name__)

#: what a subscription without a cursor reports of one (see storage_stats)
_NO_CURSOR: dict[str, Any] = {
    "backlog_bytes": 0,
    "mark_delete_offset": None,
    "delayed": 0,
    "lost_messages": 0,
    "read_error": None,
}

#: A consumer whose connection has more than this many unsent bytes is "not keeping up".
SLOW_CONSUMER_BYTES = 4 * 1024 * 1024


class NonPersistentSubscription:
    durable = False

    def __init__(self, name: str, sub_type: str, topic: NonPersistentTopic) -> None:
        self.name = name
        self.type = sub_type
        self.topic = topic
        self.consumers: list[Consumer] = []
        self._rr = 0
        self.closed = False
        self.msgs_out = 0
        self.bytes_out = 0
        self.dropped = 0
        #: entries handed out and not acknowledged: none, nothing is acknowledged here
        self.pending: dict[Any, Any] = {}

    def add_consumer(self, consumer: Consumer, sub_type: str) -> None:
        self.type = joined_type(self.name, self.type, sub_type, self.consumers)
        self.consumers.append(consumer)
        self.consumers.sort(key=lambda c: (-c.priority, c.name, c.consumer_id))

    def remove_consumer(self, consumer: Consumer) -> None:
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        if not self.consumers:
            self.topic.subscriptions.pop(self.name, None)

    def flow(self, consumer: Consumer, permits: int) -> None:
        consumer.permits += permits

    def _ready(self, c: Consumer) -> bool:
        return c.permits > 0 and not c.conn.closed and c.conn.outgoing_bytes < SLOW_CONSUMER_BYTES

    def _pick(self) -> Consumer | None:
        if not self.consumers:
            return None
        if self.type in ("exclusive", "failover"):
            c = self.consumers[0]
            return c if self._ready(c) else None
        n = len(self.consumers)
        for i in range(n):
            c = self.consumers[(self._rr + i) % n]
            if self._ready(c):
                self._rr = (self._rr + i + 1) % n
                return c
        return None

    def dispatch(self, header: bytes, batch: bytes | memoryview, n: int, entry_id: int) -> None:
        """Push one entry: its header and the published batch, sent unjoined."""
        consumer = self._pick()
        if consumer is None:
            self.dropped += n
            return
        consumer.permits -= n
        size = len(header) + len(batch)
        try:
            consumer.conn.send_nowait(
                "message",
                {
                    "consumerId": consumer.consumer_id,
                    "entries": [
                        {
                            "segmentId": -1,
                            "entryId": entry_id,
                            "size": size,
                            "redeliveryCount": 0,
                        }
                    ],
                },
                (header, batch),
            )
        except PigeonError:
            self.dropped += n
            return
        consumer.msgs_out += n
        consumer.bytes_out += size
        self.msgs_out += n
        self.bytes_out += size

    # Acknowledgements and redeliveries mean nothing without storage.
    def ack(self, consumer: Any, positions: Any, cumulative: bool, runs: Any = ()) -> None:
        return None

    def redeliver_unacked(self, consumer: Any, positions: Any) -> None:
        return None

    async def flush(self) -> None:
        return None

    async def persist(self) -> None:
        return None

    async def persist_acks(self) -> None:
        return None  # an ack receipt confirms at once: nothing is stored

    async def delete(self) -> None:
        self.closed = True

    def backlog(self) -> int:
        return 0

    def storage_stats(self) -> dict[str, Any]:
        """No cursor, nothing stored: only what was dropped."""
        return {**_NO_CURSOR, "dropped": self.dropped}


@dataclass(eq=False)
class NonPersistentTopic:
    persistent = False

    name: TopicName
    clock: WallClock
    unloaded: bool = field(default=False, init=False)
    producers: dict[str, Any] = field(default_factory=dict, init=False)
    subscriptions: dict[str, NonPersistentSubscription] = field(default_factory=dict, init=False)
    dedup: Deduplication = field(default_factory=Deduplication, init=False)
    next_offset: int = field(default=0, init=False)
    msgs_in: int = field(default=0, init=False)
    bytes_in: int = field(default=0, init=False)
    _entry_ids: Iterator[int] = field(default_factory=itertools.count, init=False)

    def append(
        self, payload: bytes | memoryview, n: int, callback: Any, *, deliver_at: int = 0
    ) -> None:
        offset = self.next_offset
        self.next_offset += n
        entry_id = next(self._entry_ids)
        header = pack_entry_header(n, offset, self.clock.now_ms(), 0)
        self.msgs_in += n
        self.bytes_in += len(header) + len(payload)
        for sub in list(self.subscriptions.values()):
            sub.dispatch(header, payload, n, entry_id)
        callback((-1, entry_id, offset), None)

    def confirm_sequence(self, segment_id: int, entry_id: int) -> None:
        return None

    # Nothing is stored: no backlog to hold sends for, no log to search or maintain.
    @property
    def holding(self) -> bool:
        return False

    def backlog_bytes(self) -> int:
        return 0

    def hold(self, send: Any) -> None:
        send()

    def may_find_original(self, name: str, first: int) -> bool:
        return False

    async def original_receipt(self, name: str, first: int, count: int) -> Receipt | None:
        return None

    async def maintain(self, policies: NamespacePolicies) -> None:
        return None

    async def snapshot_dedup(self) -> None:
        return None

    async def close(self) -> None:
        return None

    # Nothing stored: no cursors to load or persist, no storage to report.
    def as_persistent(self) -> Topic:
        raise NotSupported(f"{self.name} is non-persistent: its subscriptions have no cursor")

    async def find_subscription(self, name: str) -> NonPersistentSubscription:
        sub = self.subscriptions.get(name)
        if sub is None:
            raise SubscriptionNotFound(f"subscription {name!r} does not exist on {self.name}")
        return sub

    async def load_subscriptions(self) -> None:
        return None

    async def close_subscriptions(self, names: list[str] | None = None) -> None:
        for name, sub in list(self.subscriptions.items()):
            if names is None or name in names:
                sub.closed = True
                del self.subscriptions[name]

    def internal_stats(self) -> dict[str, Any]:
        return {"next_offset": self.next_offset, "segments": [], "cursors": {}, "cache": None}

    async def delete_subscription(
        self, sub: NonPersistentSubscription, detach: Callable[[], object]
    ) -> None:
        sub.closed = True
        detach()
        if self.subscriptions.get(sub.name) is sub:
            del self.subscriptions[sub.name]
        detach()

    def storage_stats(self) -> dict[str, int]:
        return {
            "first_offset": self.next_offset,
            "storage_size": 0,
            "segments": 0,
            "corrupt_entries": 0,
        }

    def seek(self, sub: Any, target: SeekTarget) -> Awaitable[None]:
        raise NotSupported("seek is not supported on non-persistent topics")

    def last_message_id(self, sub: Any) -> tuple[Position, int, int]:
        """No position (nothing is stored); the last offset, and everything before the
        next one counts as consumed."""
        return (-1, -1), self.next_offset - 1, self.next_offset

    async def subscription(
        self, name: str, sub_type: str, initial_position: str, *, durable: bool, start_offset: int
    ) -> NonPersistentSubscription:
        if sub_type == "keyShared":
            raise NotSupported(
                "key_shared subscriptions are not supported on non-persistent topics"
            )
        sub = self.subscriptions.get(name)
        if sub is None:
            sub = self.subscriptions[name] = NonPersistentSubscription(name, sub_type, self)
        return sub

    def stats(self) -> dict[str, Any]:
        return {
            "topic": self.name.full,
            "msgs_in": self.msgs_in,
            "bytes_in": self.bytes_in,
            "next_offset": self.next_offset,
            "producers": len(self.producers),
            "subscriptions": {
                name: {
                    "type": sub.type,
                    "consumers": len(sub.consumers),
                    "msgs_out": sub.msgs_out,
                    "bytes_out": sub.bytes_out,
                    "dropped": sub.dropped,
                }
                for name, sub in self.subscriptions.items()
            },
        }
