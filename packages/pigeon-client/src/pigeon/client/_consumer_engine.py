"""The trio half of a consumer: subscription, permits, pushed entries, acknowledgements.

It re-subscribes after a lost connection (or a close by the broker) through the shared
re-attach loop of :class:`~pigeon.client._engine.Reconnecting`; ``on_reconnect`` lets the
consumer's queue drop what the broker will push again (a reader goes on after the last
message the application took).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from pigeon.client._engine import ClientEngine, ReceivedEntry, Reconnecting
from pigeon.core import TopicName
from pigeon.core.errors import ConnectionClosed, InvalidArgument, PigeonError
from pigeon.core.rpc import Connection

__all__ = ["ConsumerEngine", "SubscribeOptions"]

log = logging.getLogger(__name__)


@dataclass
class SubscribeOptions:
    topic: str
    subscription: str
    subscription_type: str = "exclusive"
    initial_position: str = "latest"
    consumer_name: str = ""
    priority: int = 0
    durable: bool = True
    start_offset: int = -1
    receiver_queue_size: int = 10_000
    read_compacted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    #: the consumer's schema as the wire carries it (None: bytes)
    schema: dict[str, str] | None = None


_SUB_TYPE_WIRE = {
    "exclusive": "exclusive",
    "shared": "shared",
    "failover": "failover",
    "key_shared": "keyShared",
}


class ConsumerEngine(Reconnecting):
    """Trio half of a consumer: subscription, permits, pushes into ``sink``, acks."""

    def __init__(
        self,
        engine: ClientEngine,
        options: SubscribeOptions,
        sink: Callable[[list[ReceivedEntry]], None],
        *,
        on_reconnect: Callable[[ConsumerEngine], None] | None = None,
        on_fatal: Callable[[PigeonError], None] | None = None,
    ) -> None:
        self.validate(options)
        self.engine = engine
        self.options = options
        self.topic = options.topic
        self.sink = sink
        self.on_reconnect = on_reconnect
        self.on_fatal = on_fatal
        self.consumer_id = engine.next_id()
        self.conn: Connection | None = None  # set once a subscribe succeeded on it
        self.attached = False
        self.closed = False
        self.generation = 0
        #: paused: no permits are sent; ``withheld`` of them go out on resume (*engine*)
        self.paused = False
        self.withheld = 0
        self._reconnect = trio.Event()
        self.partition = TopicName.parse(options.topic).partition_index

    @staticmethod
    def validate(options: SubscribeOptions) -> None:
        if options.subscription_type not in _SUB_TYPE_WIRE:
            raise InvalidArgument(
                f"subscription_type must be one of {', '.join(_SUB_TYPE_WIRE)}, "
                f"got {options.subscription_type!r}"
            )
        if options.initial_position not in ("earliest", "latest"):
            raise InvalidArgument(
                f"initial_position must be 'earliest' or 'latest', got {options.initial_position!r}"
            )

    async def start(self) -> None:
        self.engine.consumers[self.consumer_id] = self
        try:
            await self.engine.attach(self._attach)
        except BaseException:
            self.engine.consumers.pop(self.consumer_id, None)
            raise
        self.engine.nursery.start_soon(self._keep_connected)

    def describe(self) -> str:
        o = self.options
        return (
            f"topic={self.topic} sub={o.subscription} "
            f"consumer={o.consumer_name or self.consumer_id}"
        )

    def _is_attached(self) -> bool:
        conn = self.conn
        return self.attached and conn is not None and not conn.closed

    def _leave(self) -> None:
        self.attached = False

    def _fatal(self, exc: PigeonError) -> None:
        """A re-subscribe failed for good (credentials refused, the topic deleted): the
        application's receive raises ``exc`` once what was queued is taken."""
        super()._fatal(exc)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def closed_by_broker(self, conn: Connection) -> None:
        if conn is self.conn and self.attached:
            log.info("consumer closed by broker %s", self.describe())
            self.attached = False
            self.reconnect_soon()

    async def _attach(self) -> None:
        """Subscribe; ``conn`` and ``attached`` are set only once the broker said yes."""
        o = self.options
        self.attached = False
        address, full, _n = await self.engine.lookup(o.topic)
        self.topic = full
        conn = await self.engine.connection(address)
        if self.generation > 0 and self.on_reconnect is not None:
            # the queue is dropped before the generation moves on: whoever reads the new
            # generation finds only what the new attachment delivers
            self.on_reconnect(self)
        self.generation += 1
        fields: dict[str, Any] = {
            "consumerId": self.consumer_id,
            "topic": full,
            "subscription": o.subscription,
            "subType": _SUB_TYPE_WIRE[o.subscription_type],
            "initialPosition": o.initial_position,
            "consumerName": o.consumer_name,
            "priority": o.priority,
            "durable": o.durable,
            "startOffset": o.start_offset,
            "readCompacted": o.read_compacted,
        }
        if o.schema is not None:
            fields["schemaInfo"] = o.schema
        try:
            await self.engine.request(conn, "subscribe", fields, expect="subscribed")
        except BaseException:
            # The subscribe may still take effect on the broker (a timeout): leave no
            # consumer behind there, or the next subscribe of an exclusive subscription
            # would find it busy.
            if not conn.closed:
                with contextlib.suppress(ConnectionClosed):
                    conn.send_nowait("closeConsumer", {"consumerId": self.consumer_id})
            raise
        self.conn = conn
        self.attached = True
        if self.generation > 1:
            log.info("consumer attached %s broker=%s:%s", self.describe(), *address)
        # a new attachment starts with no permits at the broker: what was withheld from
        # the old one is replaced by a whole queue's worth
        self.withheld = 0
        self.flow(o.receiver_queue_size)

    def flow(self, permits: int) -> None:
        if self.paused:
            self.withheld += permits
            return
        conn = self.conn
        if permits > 0 and conn is not None and not conn.closed:
            try:
                conn.send_nowait("flow", {"consumerId": self.consumer_id, "permits": permits})
            except ConnectionClosed:
                pass

    def resume(self) -> None:
        """*engine*: send the permits withheld while paused (``paused`` was cleared)."""
        permits, self.withheld = self.withheld, 0
        self.flow(permits)

    def _ack_fields(self, positions: list[tuple[int, ...]], cumulative: bool) -> dict[str, Any]:
        return {
            "consumerId": self.consumer_id,
            "ackType": "cumulative" if cumulative else "individual",
            "positions": [
                {"segmentId": p[0], "entryId": p[1], "batchIndex": p[2], "offset": p[3]}
                if len(p) == 4
                else {
                    "segmentId": p[0],
                    "entryId": p[1],
                    "batchIndex": p[2],
                    "offset": p[3],
                    "count": p[4],
                }
                for p in positions
            ],
        }

    def ack_nowait(self, positions: list[tuple[int, ...]], cumulative: bool) -> None:
        """``positions``: (segment_id, entry_id, batch_index, offset) tuples, or with a
        fifth item, a count: a run of that many consecutive messages of the entry."""
        conn = self.conn
        if not positions or conn is None or conn.closed:
            return
        try:
            conn.send_nowait("ack", self._ack_fields(positions, cumulative))
        except ConnectionClosed:
            pass  # unacked messages are redelivered after the reconnect

    async def ack(self, positions: list[tuple[int, ...]], cumulative: bool) -> None:
        conn = self.conn
        if not positions:
            return
        if conn is None or conn.closed:
            raise ConnectionClosed("consumer is not connected; acknowledgement not sent")
        await self.engine.request(conn, "ack", self._ack_fields(positions, cumulative))

    async def redeliver_unacknowledged(self) -> None:
        conn = self.conn
        if conn is not None and not conn.closed:
            await self.engine.request(
                conn, "redeliverUnacked", {"consumerId": self.consumer_id, "positions": []}
            )

    async def redeliver(self, positions: list[tuple[int, int]]) -> None:
        """Ask the broker to redeliver these entries (nack / ack timeout)."""
        conn = self.conn
        if conn is None or conn.closed or not positions:
            return
        await self.engine.request(
            conn,
            "redeliverUnacked",
            {
                "consumerId": self.consumer_id,
                "positions": [
                    {"segmentId": s, "entryId": e, "batchIndex": -1} for s, e in positions
                ],
            },
        )

    async def seek(self, on_done: Callable[[], None] | None = None, **target: Any) -> None:
        """Seek; ``on_done`` runs in the connection's reader as the answer arrives.

        The broker answers before it pushes anything from the new position, so clearing
        the local queue in ``on_done`` drops exactly the entries from before the seek.
        """
        conn = self.conn
        if conn is None or conn.closed:
            raise ConnectionClosed("consumer is not connected")

        def answered(body: Any, payload: memoryview) -> None:
            if on_done is not None:
                on_done()

        await self.engine.request(
            conn, "seek", {"consumerId": self.consumer_id, **target}, extract=answered
        )

    async def get_schema(self, version: int) -> str:
        """The definition of version ``version`` of the topic's schema."""
        conn = self.conn
        if conn is None or conn.closed:
            raise ConnectionClosed("consumer is not connected")
        result = await self.engine.request(
            conn,
            "getSchema",
            {"topic": self.topic, "version": version},
            expect="schemaResponse",
        )
        return str(result["schemaInfo"]["definition"])

    async def last_message_id(self) -> dict[str, Any]:
        conn = self.conn
        if conn is None or conn.closed:
            raise ConnectionClosed("consumer is not connected")
        result: dict[str, Any] = await self.engine.request(
            conn, "getLastMessageId", {"consumerId": self.consumer_id}, expect="lastMessageId"
        )
        return result

    async def unsubscribe(self) -> None:
        conn = self.conn
        if conn is None or conn.closed:
            raise ConnectionClosed("consumer is not connected")
        await self.engine.request(conn, "unsubscribe", {"consumerId": self.consumer_id})
        await self._detach()

    async def _detach(self) -> None:
        self.closed = True
        self.attached = False
        self._reconnect.set()
        self.engine.consumers.pop(self.consumer_id, None)

    async def close(self) -> None:
        if self.closed:
            return
        conn = self.conn
        await self._detach()
        if conn is not None and not conn.closed:
            try:
                await self.engine.request(conn, "closeConsumer", {"consumerId": self.consumer_id})
            except PigeonError:
                pass
