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

from pigeon.client._chunks import ChunkAssembler
from pigeon.client._consumer_engine import ConsumerEngine, SubscribeOptions
from pigeon.client._core import ConsumerCore, arrow_module
from pigeon.client._engine import ClientEngine, ReceivedEntry
from pigeon.client._logic import (
    DELAY_TIME,
    REAL_TOPIC,
    RECONSUME_TIMES,
    ConsumerLogic,
    dead_letter_properties,
)
from pigeon.client._message import (
    ChunkedMessage,
    ChunkMessageId,
    Message,
    MessageId,
    SchemaDecoders,
)
from pigeon.client._options import ConsumerOptions, ReaderOptions
from pigeon.core import TopicName
from pigeon.core.batch import ENTRY_HEADER_SIZE, read_header
from pigeon.core.errors import AckNotPersisted, InvalidArgument, NotSupported, PigeonError

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
        self.core = ConsumerCore(
            codecs=codecs,
            receiver_queue_size=options.receiver_queue_size,
            chunks=ChunkAssembler(
                max_pending=consumer.max_pending_chunked_message,
                expire_time=consumer.expire_time_of_incomplete_chunked_message,
                auto_ack_oldest=consumer.auto_ack_oldest_chunked_message_on_queue_full,
            ),
        )
        schema = consumer.schema
        if schema is not None and schema.schema_type != "BYTES":
            self.core.decoders = SchemaDecoders(schema)
        #: entries waiting for the schema versions they were written with (in order)
        self._held: list[ReceivedEntry] = []
        self.logic = ConsumerLogic(
            self.core,
            subscription=consumer.subscription,
            dead_letter=consumer.dead_letter_policy,
            ack_timeout=consumer.ack_timeout,
            negative_ack_delay=consumer.negative_ack_redelivery_delay,
            negative_ack_backoff=consumer.negative_ack_redelivery_backoff,
            ack_timeout_backoff=consumer.ack_timeout_redelivery_backoff,
        )
        #: ``fn(face, message)`` called for each message instead of ``receive``
        self.listener = consumer.message_listener
        #: a reader's (non-durable) handle: its listener acknowledges cumulatively and
        #: never negatively
        self.is_reader = not options.durable
        #: no permits are granted while paused; a listener is handed no message
        self.paused = False
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
        #: ack_receipt_enabled: acks wait for the broker to store them
        self.ack_receipts = consumer.ack_receipt_enabled
        self._receipts: dict[ConsumerEngine, _ReceiptBatch] = {}
        self._previous_receipt: dict[ConsumerEngine, _ReceiptBatch] = {}

    @property
    def subscription(self) -> str:
        return self.options.subscription

    # -- engine side -----------------------------------------------------------------

    def _sink(self, entries: list[ReceivedEntry]) -> None:
        decoders = self.core.decoders
        if decoders is not None and (self._held or self._unknown_versions(decoders, entries)):
            # Written with a schema version this consumer does not know yet: fetch it
            # first (entries stay in order behind it).
            if not self._held:
                self.client.nursery.start_soon(self._fetch_schemas)
            self._held.extend(entries)
            return
        with self.lock:
            self.core.push(entries)
        self.notify()

    @staticmethod
    def _unknown_versions(
        decoders: SchemaDecoders, entries: list[ReceivedEntry]
    ) -> set[tuple[Any, int]]:
        """(engine, header version) of the entries not decodable yet (versions are
        numbered per topic)."""
        if not decoders.schema.needs_writer_schema:
            return set()
        versions = {
            (e.source, read_header(memoryview(e.data)[ENTRY_HEADER_SIZE:]).schema_version)
            for e in entries
        }
        return {(s, v) for s, v in versions if not decoders.known(s, v)}

    async def _fetch_schemas(self) -> None:
        """*engine*: learn the schema versions the held entries were written with (each
        from the topic it came from), then queue them."""
        decoders = self.core.decoders
        assert decoders is not None
        while missing := self._unknown_versions(decoders, self._held):
            for source, version in sorted(missing, key=lambda m: (m[0].consumer_id, m[1])):
                try:
                    definition: str | None = await source.get_schema(version - 1)
                except PigeonError as exc:
                    log.warning(
                        "schema version %d of %s not found, decoding with the consumer's: %s",
                        version - 1,
                        source.topic,
                        exc,
                    )
                    definition = None
                decoders.learn(source, version, definition)
        held, self._held = self._held, []
        live = [e for e in held if e.source.generation == e.generation]
        with self.lock:
            self.core.push(live)
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
            engine.paused = self.paused  # a topic found while paused starts paused
            await engine.start()
            self.engines.append(engine)
            engine.paused = self.paused

    async def housekeeping(self) -> None:
        """*engine*: flush grouped acks, redeliver nacked/timed-out messages, dead-letter."""
        next_scan = trio.current_time() + self.pattern_period
        while not self.closed:
            await trio.sleep(_HOUSEKEEPING_INTERVAL)
            try:
                self.expire_chunks(trio.current_time())
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
        """*engine*: send the grouped acks now (before a close, seek or redelivery: the
        broker applies them in the order of the connection's frames)."""
        self.flush_acks_nowait()
        await trio.lowlevel.checkpoint()

    async def acknowledge_with_receipt(self, mid: MessageId, cumulative: bool) -> None:
        """*engine*: ``ack_receipt_enabled``: send the ack and return once the broker
        stored it in the cursor; AckNotPersisted if it cannot say so.

        Acks made while one is on its way join the next request of their engine (one
        request, and one cursor write, per engine and round trip)."""
        with self.lock:
            if not cumulative:
                self.logic.acked(mid.segment_id, mid.entry_id, mid.batch_index)
            owner = self.core.owners.get(mid.segment_id)
        if owner is None:
            raise AckNotPersisted(
                "acknowledgement not sent: the message's subscription re-attached since it"
                " was received (it is delivered again)"
            )
        batch = self._receipts.get(owner)
        if batch is None:
            batch = self._receipts[owner] = _ReceiptBatch()
            self.client.nursery.start_soon(self._send_with_receipt, owner, batch)
        pos = (mid.segment_id, mid.entry_id, mid.batch_index, mid.offset)
        if not cumulative:
            if isinstance(mid, ChunkMessageId):  # every chunk of the message
                batch.acks.extend(
                    (c.segment_id, c.entry_id, c.batch_index, c.offset) for c in mid.chunk_ids
                )
            else:
                batch.acks.append(pos)
        elif batch.cumulative is None or pos[3] > batch.cumulative[3]:
            batch.cumulative = pos
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error

    async def _send_with_receipt(self, engine: ConsumerEngine, batch: _ReceiptBatch) -> None:
        """*engine*: one ack request (two with a cumulative ack) for what ``batch`` holds."""
        # until the broker said ok (a cancelled send, the client closing, is no receipt)
        batch.error = AckNotPersisted("acknowledgement not confirmed: the consumer closed")
        try:
            previous = self._previous_receipt.get(engine)
            if previous is not None:
                await previous.done.wait()  # one request at a time per engine: in order
            self._previous_receipt[engine] = batch
            if self._receipts.get(engine) is batch:
                del self._receipts[engine]
            if batch.acks:
                await engine.ack(batch.acks, False)
            if batch.cumulative is not None:
                await engine.ack([batch.cumulative], True)
            batch.error = None
        except AckNotPersisted as exc:
            batch.error = exc
        except PigeonError as exc:
            batch.error = AckNotPersisted(f"acknowledgement not confirmed: {exc}")
        finally:
            if self._receipts.get(engine) is batch:
                del self._receipts[engine]
            if self._previous_receipt.get(engine) is batch:
                del self._previous_receipt[engine]
            batch.done.set()

    async def _redeliver_due(self) -> None:
        now = trio.current_time()
        with self.lock:
            due = self.logic.due_redeliveries(now)
        by_engine: dict[Any, list[tuple[int, int]]] = {}
        for m in due:
            # a reassembled message comes again as all of its chunks
            ids = m.chunk_ids if isinstance(m, ChunkedMessage) else (m.message_id,)
            for c in ids:
                owner = self.core.owners.get(c.segment_id)
                if owner is not None:
                    by_engine.setdefault(owner, []).append((c.segment_id, c.entry_id))
        for engine, positions in by_engine.items():
            await engine.redeliver(sorted(set(positions)))

    async def redeliver_unacknowledged(self) -> None:
        await self.flush_acks()  # what was acknowledged must not come back
        for engine in self.engines:
            await engine.redeliver_unacknowledged()

    async def _dead_letter(self) -> None:
        with self.lock:
            dead, self.logic.dead = self.logic.dead, []
        for i, m in enumerate(dead):
            topic = self.logic.dead_letter_topic(_origin_topic(m))
            try:
                await self.publish(topic, m, dead_letter_properties(m), 0)
            except PigeonError as exc:
                if exc.retriable:
                    with self.lock:  # tried again by the next round (not dropped unacked)
                        self.logic.dead[:0] = dead[i:]
                raise
            self._ack_whole(m.message_id)

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
            m.data,  # the bytes as written (``value`` is decoded with a consumer schema)
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
        self._ack_whole(m.message_id)

    def _ack_whole(self, mid: MessageId) -> None:
        """Acknowledge a message (every chunk of a chunked one) with the grouped acks."""
        with self.lock:
            for c in mid.chunk_ids if isinstance(mid, ChunkMessageId) else (mid,):
                self.core.add_ack(c)

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
            if isinstance(target, ChunkMessageId):
                target = target.first_chunk_message_id  # the whole message again
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

        The caller hands each ``(engine, permits)`` to ``engine.flow`` on the engine, also
        when there is no message: the chunks of a message not complete yet take permits
        (a message may have more chunks than the receiver queue holds).
        """
        with self.lock:
            msgs = self.take_messages(max_messages, now)
            if not msgs:
                return msgs, self.core.count_consumed(msgs)
            self.record_received(msgs)
            return msgs, self.core.count_consumed(msgs)

    def receive_one_nowait(self) -> tuple[Message, list[tuple[Any, int]]] | None:
        """:meth:`receive_nowait` of one message, when one is split off its entry already
        and the consumer gives messages no per-message care (no dead-letter policy, no
        ack timeout, no dropped chunks to settle); None: call :meth:`receive_nowait`.
        Call with the lock held: the hot path of ``receive()``, one frame."""
        core = self.core
        messages = core.messages
        logic = self.logic
        if not messages or logic.dead_letter is not None or logic.ack_timeout > 0:
            return None
        if core.chunks.dropped:
            return None
        m = messages.popleft()
        owner = core.owners.get(m._segment)
        if owner is not None and m.offset > self.last_received.get(owner, -1):
            self.last_received[owner] = m.offset
        grants = core._grants
        if grants:
            core._grants = []
        return m, grants

    def receive_arrow_nowait(self, max_rows: int, now: float) -> tuple[Any, list[tuple[Any, int]]]:
        """Up to ``max_rows`` rows as a ``pyarrow.RecordBatch`` (None if nothing is
        queued) and the permits to grant (see :meth:`receive_nowait`).

        The rows come from one entry, its buffers wrapped (zero copy). A consumer whose
        messages need per-message care (dead-letter policy, ack timeout, a schema) and
        messages already split by ``receive`` go through the per-message path and are
        converted (copied)."""
        arrow = arrow_module()
        if not isinstance(max_rows, int) or max_rows < 1:
            raise InvalidArgument(f"max_rows must be an int >= 1, got {max_rows!r}")
        with self.lock:
            core = self.core
            logic = self.logic
            if (
                core.messages
                or core.decoders is not None
                or logic.dead_letter is not None
                or logic.ack_timeout > 0
            ):
                msgs = self.take_messages(max_rows, now)
                if not msgs:
                    return None, core.count_consumed(msgs)
                self.record_received(msgs)
                return arrow.messages_batch(msgs), core.count_consumed(msgs)
            rb, src = core.take_arrow(max_rows)
            if rb is not None:
                last = core.split_next[src] - 1
                if last > self.last_received.get(src, -1):
                    self.last_received[src] = last
            return rb, core.count_consumed([])

    def take_messages(self, max_messages: int, now: float) -> list[Message]:
        """Messages ready for the application; [] if none queued. Call with the lock held."""
        core = self.core
        while True:
            # Everything already received, up to max_messages, across entries.
            while len(core.messages) < max_messages and core.expand_next():
                pass
            if core.chunks.dropped:
                self._chunks_dropped(now)
            if not core.messages:
                return []
            msgs = self.logic.next_messages(max_messages, now)
            if msgs:
                return msgs

    def expire_chunks(self, now: float) -> None:
        """*engine*: drop the chunked messages incomplete for too long (acking their
        chunks).

        While paused or entries wait in the queue the clock of every incomplete message
        starts again: the missing chunks may be withheld (no permits asked for) or queued
        behind the application's next receive, and once they are asked for they take a
        round trip; such a message is late through no fault of its producer."""
        with self.lock:
            chunks = self.core.chunks
            chunks.now = now  # messages begun before the next tick are dated now
            if chunks.pending:
                if self.paused or self.core.entries:
                    chunks.hold(now)
                else:
                    chunks.expire(now)
            if chunks.dropped:
                self._chunks_dropped(now)

    def _chunks_dropped(self, now: float) -> None:
        """Acknowledge or nack the chunks of dropped incomplete messages (lock held)."""
        for chunks, ack in self.core.chunks.take_dropped():
            for c in chunks:
                if ack:
                    self.core.add_ack(c.message_id)
                else:
                    self.logic.negative_acknowledge(c, now)

    def acknowledge(self, mid: MessageId) -> bool:
        """True when enough acknowledgements wait to be sent now (flush_acks_nowait)."""
        with self.lock:
            self.logic.acked(mid.segment_id, mid.entry_id, mid.batch_index)
            if isinstance(mid, ChunkMessageId):
                flush = False
                for c in mid.chunk_ids:
                    flush = self.core.add_ack(c) or flush
                return flush
            return self.core.add_ack(mid)

    def acknowledge_runs(self, runs: list[tuple[int, int, int, int, int]]) -> bool:
        """Acknowledge runs of consecutive messages (acknowledge_arrow); True when
        enough acknowledgements wait to be sent now (flush_acks_nowait)."""
        with self.lock:
            if self.logic.unacked:
                for s, e, b, _o, count in runs:
                    for i in range(count):
                        self.logic.acked(s, e, b + i)
            return self.core.add_ack_runs(runs)

    async def acknowledge_runs_with_receipt(
        self, runs: list[tuple[int, int, int, int, int]]
    ) -> None:
        """*engine*: ``ack_receipt_enabled``: acknowledge the runs (one position each),
        returning once the broker stored them (see :meth:`acknowledge_with_receipt`)."""
        with self.lock:
            if self.logic.unacked:
                for s, e, b, _o, count in runs:
                    for i in range(count):
                        self.logic.acked(s, e, b + i)
            found = [self.core.owners.get(run[0]) for run in runs]
        owners: list[ConsumerEngine] = [o for o in found if o is not None]
        if len(owners) != len(runs):
            raise AckNotPersisted(
                "acknowledgement not sent: the message's subscription re-attached since it"
                " was received (it is delivered again)"
            )
        waits = []
        for owner, run in zip(owners, runs, strict=True):
            batch = self._receipts.get(owner)
            if batch is None:
                batch = self._receipts[owner] = _ReceiptBatch()
                self.client.nursery.start_soon(self._send_with_receipt, owner, batch)
            batch.acks.append(run)
            if batch not in waits:
                waits.append(batch)
        for batch in waits:
            await batch.done.wait()
            if batch.error is not None:
                raise batch.error

    def check_cumulative(self) -> None:
        if self.options.subscription_type in ("shared", "key_shared"):
            raise NotSupported(
                "cumulative acknowledgement is not allowed on a "
                f"{self.options.subscription_type} subscription"
            )

    def acknowledge_cumulative(self, mid: MessageId) -> None:
        self.check_cumulative()
        with self.lock:
            self.core.add_cumulative_ack(mid)

    def negative_acknowledge(self, message: Message, now: float) -> None:
        with self.lock:
            self.logic.negative_acknowledge(message, now)

    def pause(self) -> None:
        """Stop granting permits (a grant not sent yet is withheld until resume)."""
        self.paused = True
        for e in self.engines:
            e.paused = True

    def resume(self) -> list[ConsumerEngine]:
        """Grant permits again: the caller runs each returned engine's ``resume`` (which
        sends what was withheld) on the engine's thread."""
        self.paused = False
        for e in self.engines:
            e.paused = False
        return list(self.engines)

    # -- message listener (any thread) ------------------------------------------------

    def listener_taken(self, msg: Message) -> None:
        """``msg`` is about to be handed to the listener (a reader moves past it)."""
        if self.is_reader:
            self.acknowledge_cumulative(msg.message_id)

    def listener_failed(self, msg: Message, exc: Exception, now: float) -> None:
        """The listener raised ``exc`` for ``msg``: log it, redeliver the message later."""
        log.warning(
            "message listener failed sub=%s message_id=%s error=%r",
            self.subscription,
            msg.message_id,
            exc,
        )
        if not self.is_reader:
            self.negative_acknowledge(msg, now)

    def refuse_receive(self) -> None:
        """A consumer with a listener has no ``receive`` (as in Pulsar)."""
        name = "reader_listener" if self.is_reader else "message_listener"
        raise NotSupported(f"receive is not allowed on a consumer with a {name}")


class _ReceiptBatch:
    """Acks of one engine that wait for one answer of the broker."""

    __slots__ = ("acks", "cumulative", "done", "error")

    def __init__(self) -> None:
        self.acks: list[tuple[int, ...]] = []
        self.cumulative: tuple[int, int, int, int] | None = None
        self.done = trio.Event()
        self.error: PigeonError | None = None


class ConsumerFace:
    """What a Consumer of every face offers the same way (its ``_handle`` set on open).

    ``pause`` and ``resume`` never wait, so they are plain methods on every face."""

    _handle: ConsumerHandle

    @property
    def topic(self) -> str:
        return self._handle.engines[0].topic if self._handle.engines else ""

    @property
    def subscription(self) -> str:
        return self._handle.subscription

    def pause(self) -> None:
        """Stop asking the broker for messages; what is buffered can still be received.

        With a message listener, no message is handed to it until :meth:`resume`.  A
        paused consumer stays paused across reconnects."""
        self._handle.pause()

    def resume(self) -> None:
        """Ask the broker for messages again (and hand them to the listener, if any)."""
        face: Any = self  # every face's Consumer has ``_soon`` (to the engine) and ``_notify``
        for engine in self._handle.resume():
            face._soon(engine.resume)
        face._notify()

    @property
    def paused(self) -> bool:
        return self._handle.paused


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
        schema=(
            o.schema.schema_info()
            if o.schema is not None and o.schema.schema_type != "BYTES"
            else None
        ),
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
            message_listener=options.reader_listener,
            max_pending_chunked_message=options.max_pending_chunked_message,
            auto_ack_oldest_chunked_message_on_queue_full=(
                options.auto_ack_oldest_chunked_message_on_queue_full
            ),
            expire_time_of_incomplete_chunked_message=(
                options.expire_time_of_incomplete_chunked_message
            ),
            schema=options.schema,
            read_compacted=options.read_compacted,
        ),
        codecs=codecs,
        face=face,
        durable=False,
        start_offset=offset,
    )


def reader_subscription() -> str:
    return f"reader-{secrets.token_hex(5)}"
