"""Consumer state shared by the faces, with engine-side housekeeping.

A :class:`ConsumerHandle` owns the engines of one consumer or reader (one per partition or
topic), its queue and the face-independent logic.  Every method that touches shared state
takes ``self.lock`` (see :mod:`pigeon.client._handles`).  Methods marked *engine* run on the
engine's trio thread; the others may be called from any thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from pigeon.client._consumer_engine import ConsumerEngine, SubscribeOptions
from pigeon.client._core import ConsumerCore
from pigeon.client._engine import ClientEngine, ReceivedEntry
from pigeon.client._logic import (
    DELAY_TIME,
    REAL_TOPIC,
    RECONSUME_TIMES,
    ConsumerLogic,
    dead_letter_properties,
)
from pigeon.client._message import Message, MessageId
from pigeon.client._options import ConsumerOptions, ReaderOptions
from pigeon.core import TopicName
from pigeon.core.errors import InvalidArgument, NotSupported, PigeonError

__all__ = [
    "ConsumerFace",
    "ConsumerHandle",
    "open_consumer",
    "open_reader",
    "reader_subscription",
]

log = logging.getLogger(__name__)

_HOUSEKEEPING_INTERVAL = 0.1


class ConsumerHandle:
    """Engines, queue and logic of one consumer (or reader)."""

    def __init__(
        self,
        client: ClientEngine,
        consumer: ConsumerOptions,
        options: SubscribeOptions,
        *,
        codecs: Any,
        face: Any,
        producer_factory: Callable[[str], Any] | None = None,
    ) -> None:
        """``consumer``: what the application asked for; ``options``: the subscription of
        each engine (its topic replaced by the engine's own); ``face``: the Consumer or
        Reader of any face, whose ``_lock`` the handle takes and whose ``_notify()`` it
        calls on the engine's thread whenever entries were queued."""
        self.client = client
        self.options = options
        self.lock = face._lock
        self.notify: Callable[[], None] = face._notify
        self.core = ConsumerCore(codecs=codecs, receiver_queue_size=options.receiver_queue_size)
        self.logic = ConsumerLogic(
            self.core,
            subscription=consumer.subscription,
            dead_letter=consumer.dead_letter_policy,
            ack_timeout=consumer.ack_timeout,
            negative_ack_delay=consumer.negative_ack_redelivery_delay,
        )
        self.engines: list[ConsumerEngine] = []
        topic = consumer.topic
        self.pattern = topic if isinstance(topic, re.Pattern) else None
        self.pattern_period = consumer.pattern_auto_discovery_period
        self.closed = False
        #: why a subscription stopped for good (receive raises it once the queue is empty)
        self.failure: PigeonError | None = None
        self._producers: dict[str, Any] = {}
        self._producer_factory = producer_factory
        self.last_received: dict[Any, int] = {}

    @property
    def subscription(self) -> str:
        return self.options.subscription

    # -- engine side -----------------------------------------------------------------

    def _sink(self, entries: list[ReceivedEntry]) -> None:
        with self.lock:
            self.core.push(entries)
        self.notify()

    def _on_reconnect(self, engine: ConsumerEngine) -> None:
        with self.lock:
            resume = self.core.reset(engine)
        if resume is not None and not engine.options.durable:
            # a reader (non-durable cursor) goes on after what the application took,
            # as Pulsar's does; a durable subscription goes on from its cursor
            engine.options.start_offset = resume

    def _on_fatal(self, exc: PigeonError) -> None:
        with self.lock:
            self.failure = exc
        self.notify()

    async def attach(self, topic: str) -> None:
        """*engine*: subscribe one more topic (all its partitions)."""
        for name in await self.client.partitioned_names(topic):
            if any(e.options.topic == name or e.topic == name for e in self.engines):
                continue
            opts = SubscribeOptions(**{**self.options.__dict__, "topic": name})
            engine = ConsumerEngine(
                self.client,
                opts,
                self._sink,
                on_reconnect=self._on_reconnect,
                on_fatal=self._on_fatal,
            )
            await engine.start()
            self.engines.append(engine)

    async def housekeeping(self) -> None:
        """*engine*: flush grouped acks, redeliver nacked/timed-out messages, dead-letter."""
        next_scan = trio.current_time() + self.pattern_period
        while not self.closed:
            await trio.sleep(_HOUSEKEEPING_INTERVAL)
            try:
                self.flush_acks_nowait()
                await self._redeliver_due()
                await self._dead_letter()
                if self.pattern is not None and trio.current_time() >= next_scan:
                    next_scan = trio.current_time() + self.pattern_period
                    await self.discover()
            except PigeonError as exc:
                log.warning("consumer housekeeping failed sub=%s error=%s", self.subscription, exc)

    def flush_acks_nowait(self) -> None:
        with self.lock:
            groups = self.core.take_acks()
        for engine, acks, cumulative in groups:
            if acks:
                engine.ack_nowait(acks, False)
            if cumulative is not None:
                engine.ack_nowait([cumulative], True)

    async def flush_acks(self) -> None:
        with self.lock:
            groups = self.core.take_acks()
        for engine, acks, cumulative in groups:
            if acks:
                await engine.ack(acks, False)
            if cumulative is not None:
                await engine.ack([cumulative], True)

    async def _redeliver_due(self) -> None:
        now = trio.current_time()
        with self.lock:
            due = self.logic.due_redeliveries(now)
        by_engine: dict[Any, list[tuple[int, int]]] = {}
        for m in due:
            owner = self.core.owners.get(m._segment)
            if owner is not None:
                by_engine.setdefault(owner, []).append((m._segment, m._entry))
        for engine, positions in by_engine.items():
            await engine.redeliver(sorted(set(positions)))

    async def redeliver_unacknowledged(self) -> None:
        await self.flush_acks()  # what was acknowledged must not come back
        for engine in self.engines:
            await engine.redeliver_unacknowledged()

    async def _dead_letter(self) -> None:
        with self.lock:
            dead, self.logic.dead = self.logic.dead, []
        for m in dead:
            topic = self.logic.dead_letter_topic(_origin_topic(m))
            await self.publish(topic, m, dead_letter_properties(m), 0)
            with self.lock:
                self.core.add_ack(m.message_id)

    async def publish(
        self, topic: str, m: Message, properties: Mapping[str, str], deliver_at: int
    ) -> None:
        """*engine*: send a copy of ``m`` to ``topic`` and wait for the receipt."""
        producer = self._producers.get(topic)
        if producer is None:
            if self._producer_factory is None:
                raise NotSupported("this consumer cannot publish")
            producer = self._producers[topic] = await self._producer_factory(topic)
        await producer.send(
            m.value,
            key=m.key,
            properties=dict(properties),
            event_time=m.event_time,
            deliver_at=deliver_at or None,
        )

    async def reconsume_later(self, m: Message, delay: float) -> None:
        """*engine*: republish to the retry topic with a delay, then acknowledge."""
        policy = self.logic.dead_letter
        if policy is None or not policy.enable_retry:
            raise NotSupported("reconsume_later needs dead_letter_policy with enable_retry=True")
        base = _origin_topic(m)
        props = dead_letter_properties(m)
        times = int(m.properties.get(RECONSUME_TIMES, "0")) + 1
        props[RECONSUME_TIMES] = str(times)
        props[DELAY_TIME] = str(int(delay * 1000))
        if times > policy.max_redeliver_count:
            await self.publish(self.logic.dead_letter_topic(base), m, props, 0)
        else:
            await self.publish(
                self.logic.retry_topic(base),
                m,
                props,
                self.client.clock.now_ms() + int(delay * 1000),
            )
        with self.lock:
            self.core.add_ack(m.message_id)

    async def discover(self) -> None:
        """*engine*: subscribe topics that newly match the pattern."""
        assert self.pattern is not None
        namespace = _pattern_namespace(self.pattern)
        for name in await self.client.list_topics(namespace):
            if self.pattern.fullmatch(name) and not self.closed:
                await self.attach(name)

    async def seek(
        self, target: MessageId | None, offset: int | None, timestamp: int | None
    ) -> None:
        chosen = [x for x in (target, offset, timestamp) if x is not None]
        if len(chosen) != 1:
            raise InvalidArgument("seek takes exactly one of a MessageId, offset= or timestamp=")
        if target is not None:
            if not isinstance(target, MessageId):
                raise InvalidArgument(f"cannot seek to {target!r}")
            owner = self.core.owners.get(target.segment_id)
            engines = [owner] if owner is not None else self.engines
            if len(engines) != 1:
                raise InvalidArgument("seek by MessageId needs a message this consumer received")
            fields: dict[str, Any] = {
                "position": {
                    "segmentId": target.segment_id,
                    "entryId": target.entry_id,
                    "batchIndex": target.batch_index,
                    "offset": target.offset,
                }
            }
        elif offset is not None:
            engines, fields = self.engines, {"offset": int(offset)}
        else:
            engines, fields = self.engines, {"timestamp": int(timestamp)}  # type: ignore[arg-type]
        await self.flush_acks()  # an ack sent after the seek could undo it
        for engine in engines:
            await engine.seek(functools.partial(self._reset_locked, engine), **fields)
            if not engine.options.durable and timestamp is None:
                # a reader re-attaching before it took anything goes on from here
                engine.options.start_offset = int(offset) if offset is not None else target.offset  # type: ignore[union-attr]

    def _reset_locked(self, engine: Any) -> None:
        with self.lock:
            self.core.reset(engine)
        with self.lock:
            self.last_received.pop(engine, None)

    async def has_message_available(self) -> bool:
        with self.lock:
            if self.core.messages or self.core.entries:
                return True
        for engine in self.engines:
            info = await engine.last_message_id()
            last = max(self.last_received.get(engine, -1), info["markDeleteOffset"] - 1)
            if info["offset"] > last:
                return True
        return False

    def record_received(self, msgs: list[Message]) -> None:
        owners = self.core.owners
        for m in msgs[-1:] if len(self.engines) == 1 else msgs:
            owner = owners.get(m._segment)
            if owner is not None and m.offset > self.last_received.get(owner, -1):
                self.last_received[owner] = m.offset

    async def close(self) -> None:
        """*engine*"""
        try:
            await self.flush_acks()
        finally:
            await self._detach(ConsumerEngine.close)

    async def unsubscribe(self) -> None:
        await self._detach(ConsumerEngine.unsubscribe)

    async def _detach(self, how: Callable[[ConsumerEngine], Awaitable[None]]) -> None:
        """*engine*: close or unsubscribe every engine, then close the dead-letter and retry
        producers."""
        self.closed = True
        for e in self.engines:
            await how(e)
        for p in self._producers.values():
            with contextlib.suppress(PigeonError):
                await p.close()

    # -- face side (any thread; each takes the lock) ----------------------------------

    def receive_nowait(
        self, max_messages: int, now: float
    ) -> tuple[list[Message], list[tuple[Any, int]]]:
        """Messages ready for the application ([] if none) and the permits to grant.

        The caller hands each ``(engine, permits)`` to ``engine.flow`` on the engine.
        """
        with self.lock:
            msgs = self.take_messages(max_messages, now)
            if not msgs:
                return msgs, []
            self.record_received(msgs)
            return msgs, self.core.count_consumed(msgs)

    def take_messages(self, max_messages: int, now: float) -> list[Message]:
        """Messages ready for the application; [] if none queued. Call with the lock held."""
        core = self.core
        while True:
            # Everything already received, up to max_messages, across entries.
            while len(core.messages) < max_messages and core.expand_next():
                pass
            if not core.messages:
                return []
            msgs = self.logic.next_messages(max_messages, now)
            if msgs:
                return msgs

    def acknowledge(self, mid: MessageId) -> bool:
        """True when enough acknowledgements wait to be sent now (flush_acks_nowait)."""
        with self.lock:
            self.logic.acked(mid.segment_id, mid.entry_id, mid.batch_index)
            return self.core.add_ack(mid)

    def acknowledge_cumulative(self, mid: MessageId) -> None:
        if self.options.subscription_type in ("shared", "key_shared"):
            raise NotSupported(
                "cumulative acknowledgement is not allowed on a "
                f"{self.options.subscription_type} subscription"
            )
        with self.lock:
            self.core.add_cumulative_ack(mid)

    def negative_acknowledge(self, message: Message, now: float) -> None:
        with self.lock:
            self.logic.negative_acknowledge(message, now)


class ConsumerFace:
    """What a Consumer of every face offers the same way (its ``_handle`` set on open)."""

    _handle: ConsumerHandle

    @property
    def topic(self) -> str:
        return self._handle.engines[0].topic if self._handle.engines else ""

    @property
    def subscription(self) -> str:
        return self._handle.subscription


def _origin_topic(m: Message) -> str:
    """The topic a message was first published to (retry copies carry it)."""
    return TopicName.parse(m.properties.get(REAL_TOPIC) or m.topic).base.full


def _pattern_namespace(pattern: re.Pattern[str]) -> str:
    text = pattern.pattern
    m = re.match(r"^(?:persistent|non-persistent)://([^/]+)/([^/]+)/", text)
    if not m:
        raise InvalidArgument(
            f"a topic pattern must start with persistent://tenant/namespace/ (got {text!r})"
        )
    return f"{m.group(1)}/{m.group(2)}"


async def open_consumer(
    client: ClientEngine,
    options: ConsumerOptions,
    *,
    codecs: Any,
    face: Any,
    producer_factory: Callable[[str], Any] | None = None,
    durable: bool = True,
    start_offset: int = -1,
) -> ConsumerHandle:
    """*engine*: subscribe to a topic, a list of topics, or a regex pattern of topics.

    ``face`` gives the handle its lock and wake-up (see :class:`ConsumerHandle`);
    ``producer_factory(topic)`` opens the producers of dead-lettering and retries.
    """
    o = options
    if not o.subscription:
        raise InvalidArgument("subscription name must not be empty")
    topic = o.topic
    topics: list[str] = (
        [topic] if isinstance(topic, str) else [] if isinstance(topic, re.Pattern) else list(topic)
    )
    if not isinstance(topic, re.Pattern) and not topics:
        raise InvalidArgument("subscribe needs at least one topic")
    subscribe = SubscribeOptions(
        topics[0] if topics else "",
        o.subscription,
        o.subscription_type,
        o.initial_position,
        o.consumer_name,
        o.priority,
        durable=durable,
        start_offset=start_offset,
        receiver_queue_size=o.receiver_queue_size,
        read_compacted=o.read_compacted,
    )
    # validate the type/position before touching the network
    ConsumerEngine.validate(subscribe)
    handle = ConsumerHandle(
        client,
        o,
        subscribe,
        codecs=codecs,
        face=face,
        producer_factory=producer_factory,
    )
    try:
        for t in topics:
            await handle.attach(t)
        if o.dead_letter_policy is not None and o.dead_letter_policy.enable_retry:
            for t in topics:
                base = TopicName.parse(t).full
                await handle.attach(handle.logic.retry_topic(base))
        if handle.pattern is not None:
            await handle.discover()
    except BaseException:
        with trio.CancelScope(shield=True):
            for e in handle.engines:
                with contextlib.suppress(Exception):
                    await e.close()
        raise
    client.nursery.start_soon(handle.housekeeping)
    return handle


async def open_reader(
    client: ClientEngine, options: ReaderOptions, *, codecs: Any, face: Any
) -> ConsumerHandle:
    """*engine*: a consumer on a non-durable subscription of its own."""
    initial, offset = options.start_position()
    return await open_consumer(
        client,
        ConsumerOptions(
            options.topic,
            reader_subscription(),
            initial_position=initial,
            receiver_queue_size=options.receiver_queue_size,
            read_compacted=options.read_compacted,
        ),
        codecs=codecs,
        face=face,
        durable=False,
        start_offset=offset,
    )


def reader_subscription() -> str:
    return f"reader-{secrets.token_hex(5)}"
