"""The client's protocol engine, on trio.

One :class:`ClientEngine` per client: a pool of broker connections, topic lookup, and the
trio-side halves of producers and consumers.  The public faces (trio, sync, asyncio) sit on
top of it; the sync and asyncio faces run it in one background thread and hand work over
per *batch*, never per message.

Producer pipeline (as aiokafka splits it): the face's accumulator builds batches; the
:class:`ProducerEngine` keeps every sent-but-unacknowledged batch in sequence order, sends
it on the current connection (many in flight), and after a reconnect sends them all again
under the same producer name so the broker drops the ones it already stored.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from pigeon.client._link import LinkState, ProducerLink
from pigeon.core import TopicName
from pigeon.core.errors import (
    AlreadyClosed,
    CodecError,
    ConnectionClosed,
    InvalidArgument,
    MessageTooLarge,
    NotOwner,
    PigeonError,
    ProtocolError,
    ServiceUnavailable,
    SubscriptionBusy,
    Timeout,
    TopicNotFound,
)
from pigeon.core.rpc import BrokerFrame, Connection, Request, connect_tcp, split_address
from pigeon.core.runtime import WallClock

__all__ = ["ClientEngine", "ConsumerEngine", "PendingBatch", "ProducerEngine", "ReceivedEntry"]

log = logging.getLogger(__name__)

BatchCallback = Callable[[Any, BaseException | None], None]


def parse_service_urls(url: str) -> list[tuple[str, int]]:
    """``pigeon://host:port[,host:port...]`` → addresses (any broker answers lookups)."""
    if not url.startswith("pigeon://"):
        raise InvalidArgument(f"service URL must look like pigeon://host:port, got {url!r}")
    out = []
    for part in url[len("pigeon://") :].rstrip("/").split(","):
        part = part.strip()
        if ":" not in part:
            out.append((part or "127.0.0.1", 6650))
            continue
        try:
            out.append(split_address(part))
        except ValueError:
            raise InvalidArgument(f"bad port in service URL {url!r}") from None
    return out


def parse_service_url(url: str) -> tuple[str, int]:
    return parse_service_urls(url)[0]


@dataclass(slots=True)
class PendingBatch:
    """A sealed batch waiting for its receipt. ``callback((seg, entry, offset, dup), err)``.

    ``error``: the batch could not be built; it fails with this error instead of being
    sent.  ``order`` and ``outcome`` belong to the producer's :class:`ProducerLink`.
    """

    sequence_id: int
    num_messages: int
    payload: bytes
    callback: BatchCallback
    created: float = 0.0
    error: BaseException | None = None
    order: int = -1
    outcome: tuple[Any, BaseException | None] | None = None


@dataclass(slots=True)
class ReceivedEntry:
    segment_id: int
    entry_id: int
    data: memoryview
    redelivery_count: int
    acked_indexes: list[int]
    generation: int
    source: Any = None  # the ConsumerEngine it came through


class _ConnHandler:
    """Routes server pushes on one broker connection to consumers/producers."""

    def __init__(self, engine: ClientEngine) -> None:
        self.engine = engine

    def on_message(self, conn: Connection, req: Request) -> None:
        consumer = self.engine.consumers.get(req.body.consumerId)
        if consumer is None or consumer.conn is not conn or not consumer.attached:
            return  # a push of an attachment left (the new one starts from where it was)
        payload = req.payload
        pos = 0
        entries = []
        gen = consumer.generation
        for meta in req.body.entries:
            size = meta.size
            entries.append(
                ReceivedEntry(
                    meta.segmentId,
                    meta.entryId,
                    payload[pos : pos + size],
                    meta.redeliveryCount,
                    list(meta.ackedIndexes),
                    gen,
                    consumer,
                )
            )
            pos += size
        consumer.sink(entries)

    def on_closedByBroker(self, conn: Connection, req: Request) -> None:
        b = req.body
        target: Any = (
            self.engine.producers.get(b.producerId)
            if b.isProducer
            else self.engine.consumers.get(b.consumerId)
        )
        if target is not None:
            target.closed_by_broker(conn)


class ClientEngine:
    """Connections, lookups, and the trio halves of producers and consumers."""

    def __init__(
        self,
        service_url: str,
        *,
        operation_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        client_name: str = "pigeon-client",
    ) -> None:
        self.service_url = service_url
        self.addresses = parse_service_urls(service_url)
        self.address = self.addresses[0]
        self.operation_timeout = operation_timeout
        self.connect_timeout = connect_timeout
        self.client_name = client_name
        self.nursery: trio.Nursery = None  # type: ignore[assignment]
        self._conns: dict[tuple[str, int], Connection] = {}
        self._conn_locks: dict[tuple[str, int], trio.Lock] = {}
        self._ids = itertools.count(1)
        self.producers: dict[int, ProducerEngine] = {}
        self.consumers: dict[int, ConsumerEngine] = {}
        self.closed = False
        self.clock_offset = 0.0
        self.clock = WallClock()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.clock_offset = trio.current_time() - time.perf_counter()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def next_id(self) -> int:
        return next(self._ids)

    async def connection(self, address: tuple[str, int] | None = None) -> Connection:
        address = address or self.address
        conn = self._conns.get(address)
        if conn is not None and not conn.closed:
            return conn
        lock = self._conn_locks.setdefault(address, trio.Lock())
        async with lock:
            conn = self._conns.get(address)
            if conn is not None and not conn.closed:
                return conn
            conn, _info = await connect_tcp(
                address[0],
                address[1],
                BrokerFrame,
                self.nursery,
                handler=_ConnHandler(self),
                client_name=self.client_name,
                connect_timeout=self.connect_timeout,
            )
            self._conns[address] = conn
            return conn

    async def lookup_connection(self) -> Connection:
        """A connection to any broker of the service URL (the first that answers)."""
        errors: list[BaseException] = []
        for _ in range(len(self.addresses)):
            try:
                return await self.connection(self.address)
            except (ConnectionClosed, OSError) as exc:
                errors.append(exc)
                i = self.addresses.index(self.address)
                self.address = self.addresses[(i + 1) % len(self.addresses)]
        raise errors[-1]

    async def lookup(self, topic: str) -> tuple[tuple[str, int], str, int]:
        """(owning broker address, full topic name, partition count) of ``topic``."""
        conn = await self.lookup_connection()
        result = await self.request(conn, "lookup", {"topic": topic}, expect="lookupResult")
        return parse_service_url(result["brokerUrl"]), result["topic"], result["partitions"]

    async def attach(self, attach: Callable[[], Any]) -> None:
        """Run ``attach`` (lookup + connect + create) until the owning broker accepts it.

        A broker that no longer owns the topic (``NotOwner``) or a broker that went away
        is retried with a fresh lookup, within ``operation_timeout``.
        """
        delay = 0.05
        last: BaseException | None = None
        with trio.move_on_after(self.operation_timeout):
            while True:
                try:
                    await attach()
                    return
                except (NotOwner, ConnectionClosed, ServiceUnavailable) as exc:
                    last = exc
                    log.info("attach retry error=%s", exc)
                    await trio.sleep(delay)
                    delay = min(delay * 2, 1.0)
        raise Timeout(f"no broker accepted within {self.operation_timeout}s: {last}")

    async def partitioned_names(self, topic: str) -> list[str]:
        """The topics to attach to: the partitions of a partitioned topic, or the topic.

        A broker that went away or is not ready yet is retried like an attach."""
        found: list[tuple[tuple[str, int], str, int]] = []

        async def look() -> None:
            found.append(await self.lookup(topic))

        await self.attach(look)
        _address, full, partitions = found[-1]
        if partitions:
            return [f"{full}-partition-{i}" for i in range(partitions)]
        return [full]

    async def create_topic(self, topic: str, partitions: int = 0) -> None:
        conn = await self.lookup_connection()
        await self.request(conn, "createTopic", {"topic": topic, "partitions": partitions})

    async def list_topics(self, namespace: str) -> list[str]:
        conn = await self.lookup_connection()
        result = await self.request(
            conn,
            "listTopics",
            {"namespace": namespace},
            expect="topicList",
            extract=lambda body, payload: [str(t) for t in body.topics],
        )
        return list(result)

    async def request(self, conn: Connection, kind: str, fields: dict[str, Any], **kw: Any) -> Any:
        try:
            with trio.fail_after(self.operation_timeout):
                return await conn.request(kind, fields, **kw)
        except trio.TooSlowError:
            raise Timeout(f"{kind} timed out after {self.operation_timeout}s") from None

    async def aclose(self) -> None:
        self.closed = True
        for p in list(self.producers.values()):
            with trio.move_on_after(self.operation_timeout):
                await p.close()
        for c in list(self.consumers.values()):
            with trio.move_on_after(self.operation_timeout):
                await c.close()
        for conn in self._conns.values():
            conn.close()
        self.nursery.cancel_scope.cancel()


#: Errors after which a re-attach cannot succeed: the producer/consumer gives up.  Anything
#: else (a broker restarting, a bookie missing, a metadata race, a lost connection, even an
#: unexpected internal error of a broker) is retried with backoff while it is open.
_PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    AlreadyClosed,
    CodecError,
    InvalidArgument,
    ProtocolError,
    SubscriptionBusy,
    TopicNotFound,
)
_BACKOFF_MIN = 0.05
_BACKOFF_MAX = 2.0
#: An attachment that lasted less than this is followed by a backoff before the next one
#: (a broker that accepts the attach but refuses every send must not be hammered).
_STABLE_AFTER = 1.0


class _Reconnecting:
    """Shared re-attach loop of producers and consumers.

    While open, the owner is either attached or re-attaching: every failure of an attach
    is retried with exponential backoff, except the few errors no retry can fix
    (``_PERMANENT_ERRORS``), which end it through ``_fatal``.
    """

    engine: ClientEngine
    conn: Connection | None
    closed: bool
    _reconnect: trio.Event
    topic: str

    async def _attach(self) -> None:
        raise NotImplementedError  # pragma: no cover - abstract

    def _is_attached(self) -> bool:
        raise NotImplementedError  # pragma: no cover - abstract

    def _leave(self) -> None:
        """The current attachment is given up (the loop re-attaches next)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def reconnect_soon(self) -> None:
        self._reconnect.set()

    def describe(self) -> str:
        """``key=value`` words naming this producer or consumer in log lines."""
        return f"topic={self.topic}"

    async def _keep_connected(self) -> None:
        backoff = _BACKOFF_MIN
        attached_at: float | None = None
        while not self.closed:
            if self._is_attached():
                conn = self.conn
                assert conn is not None
                self._reconnect = trio.Event()
                async with trio.open_nursery() as nursery:

                    async def wait(ev: trio.Event) -> None:
                        await ev.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(wait, conn.closed_event)
                    nursery.start_soon(wait, self._reconnect)
                if self.closed:
                    return
                log.info("reconnecting %s", self.describe())
            self._leave()
            if attached_at is not None:
                if trio.current_time() - attached_at < _STABLE_AFTER:
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX)
                else:
                    backoff = _BACKOFF_MIN
                attached_at = None
                if self.closed:
                    return
            try:
                await self._attach()
            except Exception as exc:
                if isinstance(exc, _PERMANENT_ERRORS) and isinstance(exc, PigeonError):
                    self._fatal(exc)
                    return
                if isinstance(exc, PigeonError | OSError):
                    log.info("reconnect failed %s error=%s", self.describe(), exc)
                else:
                    log.warning("reconnect failed %s", self.describe(), exc_info=True)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
            else:
                attached_at = trio.current_time()

    def _fatal(self, exc: PigeonError) -> None:
        log.error("giving up %s error=%s", self.describe(), exc)


class ProducerEngine(_Reconnecting):
    """Trio half of a producer: moves batches as its :class:`ProducerLink` decides."""

    def __init__(
        self,
        engine: ClientEngine,
        topic: str,
        *,
        producer_name: str = "",
        send_timeout: float = 30.0,
    ) -> None:
        self.engine = engine
        self.topic = topic
        self.producer_name = producer_name
        self.send_timeout = send_timeout
        self.producer_id = engine.next_id()
        self.conn: Connection | None = None
        self.closed = False
        self.last_sequence_id = -1
        self.link = ProducerLink()
        self._reconnect = trio.Event()
        self._no_pending = trio.Event()
        self._no_pending.set()
        self.failure: PigeonError | None = None
        self.max_message_size = 5 * 1024 * 1024

    async def start(self) -> None:
        try:
            await self.engine.attach(self._attach)
        except BaseException:
            conn = self.conn or self.engine._conns.get(self.engine.address)
            if conn is not None and not conn.closed:
                with contextlib.suppress(ConnectionClosed):
                    conn.send_nowait("closeProducer", {"producerId": self.producer_id})
            raise
        self.engine.producers[self.producer_id] = self
        self.engine.nursery.start_soon(self._keep_connected)
        if math.isfinite(self.send_timeout) and self.send_timeout > 0:
            self.engine.nursery.start_soon(self._expire_loop)

    def describe(self) -> str:
        return f"topic={self.topic} producer={self.producer_name or self.producer_id}"

    def _is_attached(self) -> bool:
        conn = self.conn
        return self.link.state is LinkState.ATTACHED and conn is not None and not conn.closed

    def _leave(self) -> None:
        self.link.detach(self.link.epoch)

    async def _attach(self) -> None:
        epoch = self.link.begin_attach()
        try:
            address, full, _n = await self.engine.lookup(self.topic)
            self.topic = full
            conn = await self.engine.connection(address)
            result = await self.engine.request(
                conn,
                "createProducer",
                {
                    "producerId": self.producer_id,
                    "topic": full,
                    "producerName": self.producer_name,
                },
                expect="producerCreated",
            )
        except BaseException:
            self.link.attach_failed(epoch)
            raise
        self.producer_name = result["producerName"]
        self.max_message_size = result["maxMessageSize"]
        if self.last_sequence_id < 0:
            self.last_sequence_id = result["lastSequenceId"]
        self.conn = conn
        batches = self.link.attach_succeeded(epoch)
        if batches:
            log.info(
                "producer attached topic=%s producer=%s resending=%d",
                self.topic,
                self.producer_name,
                len(batches),
            )
        for batch in batches or ():
            if not self._send(batch, epoch):
                break

    def _fatal(self, exc: PigeonError) -> None:
        super()._fatal(exc)
        self.failure = exc
        self.link.fail_all(exc)
        self._check_empty()

    def closed_by_broker(self, conn: Connection) -> None:
        """The broker closed this producer on ``conn``: re-attach (resending what waits)."""
        if conn is self.conn and self.link.detach(self.link.epoch):
            log.info("producer closed by broker %s", self.describe())
            self.reconnect_soon()

    def submit(self, batch: PendingBatch) -> None:
        """Send a sealed batch (engine thread). Its callback runs on the receipt."""
        if self.closed or self.failure is not None:
            batch.callback(None, self.failure or AlreadyClosed("producer is closed"))
            return
        refused = batch.error
        if refused is None and len(batch.payload) > self.max_message_size:
            refused = MessageTooLarge(
                f"batch of {len(batch.payload)} bytes exceeds max_message_size "
                f"{self.max_message_size}"
            )
        batch.created = trio.current_time()
        if self._no_pending.is_set():
            self._no_pending = trio.Event()
        if self.link.submit(batch, refused):
            self._send(batch, self.link.epoch)
        self._check_empty()

    def _send(self, batch: PendingBatch, epoch: int) -> bool:
        """Send ``batch`` on attachment ``epoch``; False if the connection is gone."""
        conn = self.conn
        assert conn is not None and self.link.can_send(epoch)
        request = SendRequest(self, batch, epoch)
        try:
            conn.request_nowait(
                "send",
                request.create_request(),
                request,
                payload=batch.payload,
                expect="sendReceipt",
                extract=_extract_receipt,
            )
        except ConnectionClosed:
            if self.link.detach(epoch):
                self.reconnect_soon()
            return False
        return True

    def _check_empty(self) -> None:
        if not self.link.pending:
            self._no_pending.set()

    async def _expire_loop(self) -> None:
        while not self.closed:
            await trio.sleep(min(1.0, self.send_timeout / 4))
            if self.link.expire(trio.current_time() - self.send_timeout, self.send_timeout):
                self._check_empty()

    async def flush(self) -> None:
        await self._no_pending.wait()

    async def close(self) -> None:
        if self.closed:
            return
        with trio.move_on_after(self.send_timeout if math.isfinite(self.send_timeout) else 30):
            await self.flush()
        self.closed = True
        self._reconnect.set()
        self.engine.producers.pop(self.producer_id, None)
        self.link.fail_all(AlreadyClosed("producer closed before the message was acknowledged"))
        self._check_empty()
        conn = self.conn
        if conn is not None and not conn.closed:
            try:
                await self.engine.request(conn, "closeProducer", {"producerId": self.producer_id})
            except PigeonError:
                pass


class SendRequest:
    """One ``send`` of a batch on one attachment (``epoch``) of its producer.

    The connection calls it with the broker's answer; the producer's :class:`ProducerLink`
    decides what the answer means (the batch is done, or the attachment is given up and the
    batch waits to be resent after the re-attach).
    """

    __slots__ = ("batch", "epoch", "producer")

    def __init__(self, producer: ProducerEngine, batch: PendingBatch, epoch: int) -> None:
        self.producer = producer
        self.batch = batch
        self.epoch = epoch

    def create_request(self) -> dict[str, Any]:
        batch = self.batch
        return {
            "producerId": self.producer.producer_id,
            "sequenceId": batch.sequence_id,
            "numMessages": batch.num_messages,
        }

    def __call__(self, receipt: Any, error: BaseException | None) -> None:
        if error is None:
            self.handle_response(receipt)
        else:
            self.handle_error(error)

    def handle_response(self, receipt: tuple[int, int, int, bool]) -> None:
        self._outcome(receipt, None)

    def handle_error(self, error: BaseException) -> None:
        self._outcome(None, error)

    def _outcome(self, receipt: Any, error: BaseException | None) -> None:
        producer = self.producer
        if producer.link.on_result(self.epoch, self.batch, receipt, error):
            log.info(
                "producer detached topic=%s sequence=%d error=%s",
                producer.topic,
                self.batch.sequence_id,
                error,
            )
            producer.reconnect_soon()
        producer._check_empty()


def _extract_receipt(body: Any, payload: memoryview) -> tuple[int, int, int, bool]:
    return (body.segmentId, body.entryId, body.firstOffset, body.duplicate)


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
    extra: dict[str, Any] = field(default_factory=dict)


_SUB_TYPE_WIRE = {
    "exclusive": "exclusive",
    "shared": "shared",
    "failover": "failover",
    "key_shared": "keyShared",
}


class ConsumerEngine(_Reconnecting):
    """Trio half of a consumer: subscription, permits, pushes into ``sink``, acks."""

    def __init__(
        self,
        engine: ClientEngine,
        options: SubscribeOptions,
        sink: Callable[[list[ReceivedEntry]], None],
        *,
        on_reconnect: Callable[[ConsumerEngine], None] | None = None,
    ) -> None:
        self.validate(options)
        self.engine = engine
        self.options = options
        self.topic = options.topic
        self.sink = sink
        self.on_reconnect = on_reconnect
        self.consumer_id = engine.next_id()
        self.conn: Connection | None = None  # set once a subscribe succeeded on it
        self.attached = False
        self.closed = False
        self.generation = 0
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
        self.generation += 1
        if self.generation > 1 and self.on_reconnect is not None:
            self.on_reconnect(self)
        try:
            await self.engine.request(
                conn,
                "subscribe",
                {
                    "consumerId": self.consumer_id,
                    "topic": full,
                    "subscription": o.subscription,
                    "subType": _SUB_TYPE_WIRE[o.subscription_type],
                    "initialPosition": o.initial_position,
                    "consumerName": o.consumer_name,
                    "priority": o.priority,
                    "durable": o.durable,
                    "startOffset": o.start_offset,
                },
                expect="subscribed",
            )
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
        self.flow(o.receiver_queue_size)

    def flow(self, permits: int) -> None:
        conn = self.conn
        if permits > 0 and conn is not None and not conn.closed:
            try:
                conn.send_nowait("flow", {"consumerId": self.consumer_id, "permits": permits})
            except ConnectionClosed:
                pass

    def ack_nowait(self, positions: list[tuple[int, int, int, int]], cumulative: bool) -> None:
        """``positions``: (segment_id, entry_id, batch_index, offset) tuples."""
        conn = self.conn
        if not positions or conn is None or conn.closed:
            return
        try:
            conn.send_nowait(
                "ack",
                {
                    "consumerId": self.consumer_id,
                    "ackType": "cumulative" if cumulative else "individual",
                    "positions": [
                        {"segmentId": s, "entryId": e, "batchIndex": b, "offset": o}
                        for s, e, b, o in positions
                    ],
                },
            )
        except ConnectionClosed:
            pass  # unacked messages are redelivered after the reconnect

    async def ack(self, positions: list[tuple[int, int, int, int]], cumulative: bool) -> None:
        conn = self.conn
        if not positions:
            return
        if conn is None or conn.closed:
            raise ConnectionClosed("consumer is not connected; acknowledgement not sent")
        await self.engine.request(
            conn,
            "ack",
            {
                "consumerId": self.consumer_id,
                "ackType": "cumulative" if cumulative else "individual",
                "positions": [
                    {"segmentId": s, "entryId": e, "batchIndex": b, "offset": o}
                    for s, e, b, o in positions
                ],
            },
        )

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
