"""The trio face of the PigeonMQ client.

    async with pigeon.client.trio.Client("pigeon://127.0.0.1:6650") as client:
        async with await client.create_producer("events") as producer:
            msg_id = await producer.send(b"payload", key="k")
        async with await client.subscribe("events", "sub-1", initial_position="earliest") as consumer:
            msg = await consumer.receive(timeout=5)
            await consumer.acknowledge(msg)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import trio

from pigeon.client._core import ConsumerCore, ProducerCore, message_id_of, resolve_completions
from pigeon.client._engine import ClientEngine, ConsumerEngine, ProducerEngine, SubscribeOptions
from pigeon.client._message import Message, MessageId
from pigeon.core import PluginManager
from pigeon.core._codecs import CodecSet
from pigeon.core.errors import AlreadyClosed, Timeout

__all__ = ["Client", "Consumer", "Producer"]

_ACK_GROUP_TIME = 0.1


def _codecs(pm: PluginManager) -> CodecSet:
    return CodecSet(codec for _name, codec in pm.codecs.items())


class Client:
    """A connection to a PigeonMQ cluster; a trio async context manager."""

    def __init__(self, service_url: str, *, operation_timeout: float = 30.0, plugins: PluginManager | None = None):
        self.engine = ClientEngine(service_url, operation_timeout=operation_timeout)
        self.plugins = plugins or PluginManager()
        self.codecs = _codecs(self.plugins)
        self._nursery_cm: Any = None

    async def __aenter__(self) -> Client:
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        await nursery.start(self.engine.run)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.engine.aclose()
        finally:
            await self._nursery_cm.__aexit__(None, None, None)

    async def create_producer(
        self,
        topic: str,
        *,
        producer_name: str = "",
        batching_max_messages: int = 1000,
        batching_max_bytes: int = 128 * 1024,
        batching_max_delay_ms: float = 5.0,
        compression: str = "none",
        send_timeout: float = 30.0,
        max_pending_messages: int = 100_000,
    ) -> Producer:
        codec = self.codecs.by_name(compression)
        engine = ProducerEngine(self.engine, topic, producer_name=producer_name, send_timeout=send_timeout)
        await engine.start()
        core = ProducerCore(
            producer_name=engine.producer_name,
            codec=codec,
            partition=-1,
            max_messages=batching_max_messages,
            max_bytes=batching_max_bytes,
            max_message_size=engine.max_message_size,
            first_sequence_id=engine.last_sequence_id + 1,
        )
        return Producer(engine, core, batching_max_delay_ms / 1000, max_pending_messages)

    async def subscribe(
        self,
        topic: str,
        subscription: str,
        *,
        subscription_type: str = "exclusive",
        initial_position: str = "latest",
        consumer_name: str = "",
        priority: int = 0,
        receiver_queue_size: int = 10_000,
    ) -> Consumer:
        options = SubscribeOptions(
            topic,
            subscription,
            subscription_type,
            initial_position,
            consumer_name,
            priority,
            receiver_queue_size=receiver_queue_size,
        )
        consumer = Consumer(self, options)
        await consumer._start()
        return consumer


class Producer:
    def __init__(self, engine: ProducerEngine, core: ProducerCore, max_delay: float, max_pending: int):
        self._engine = engine
        self._core = core
        self._max_delay = max_delay
        self._max_pending = max_pending
        self._outstanding = 0
        self._space = trio.Event()
        self._timer_generation = -1

    @property
    def topic(self) -> str:
        return self._engine.topic

    @property
    def producer_name(self) -> str:
        return self._engine.producer_name

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(
        self,
        value: bytes,
        *,
        key: str | bytes | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int = 0,
    ) -> MessageId:
        """Send and wait for the broker's receipt."""
        done = trio.Event()
        box: list[Any] = []

        def complete(mid: MessageId | None, err: BaseException | None) -> None:
            box.append((mid, err))
            done.set()

        await self.send_async(value, key=key, properties=properties, event_time=event_time, callback=complete)
        await done.wait()
        mid, err = box[0]
        if err is not None:
            raise err
        return mid  # type: ignore[no-any-return]

    async def send_async(
        self,
        value: bytes,
        *,
        key: str | bytes | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int = 0,
        callback: Any = None,
    ) -> None:
        """Queue a message; ``callback(message_id, error)`` runs on its receipt."""
        if self._engine.closed:
            raise AlreadyClosed("producer is closed")
        while self._outstanding >= self._max_pending:
            self._space = trio.Event()
            await self._space.wait()
        full = self._core.add(value, key, properties, event_time, callback)
        self._outstanding += 1
        if full:
            self._seal()
        elif len(self._core) == 1:
            generation = self._core.generation
            if self._max_delay <= 0:
                self._seal()
            else:
                self._engine.engine.nursery.start_soon(self._timer, generation)

    async def _timer(self, generation: int) -> None:
        await trio.sleep(self._max_delay)
        if self._core.generation == generation and len(self._core):
            self._seal()

    def _seal(self) -> None:
        batch = self._core.seal(self._callback_for)
        if batch is not None:
            self._engine.submit(batch)

    def _callback_for(self, completions: list[Any], state: Any) -> Any:
        partition = self._core.partition

        def on_done(result: Any, error: BaseException | None) -> None:
            resolve_completions(completions, state, result, error, partition)
            self._outstanding -= len(completions)
            self._space.set()

        return on_done

    async def flush(self) -> None:
        self._seal()
        await self._engine.flush()

    async def close(self) -> None:
        if self._engine.closed:
            return
        self._seal()
        await self._engine.close()


class Consumer:
    def __init__(self, client: Client, options: SubscribeOptions) -> None:
        self._client = client
        self._options = options
        self._core: ConsumerCore | None = None
        self._arrived = trio.Event()
        self._engine = ConsumerEngine(client.engine, options, self._sink, on_reconnect=self._on_reconnect)
        self._closed = False

    async def _start(self) -> None:
        self._core = ConsumerCore(
            topic=self._options.topic,
            partition=self._engine.partition,
            codecs=self._client.codecs,
            receiver_queue_size=self._options.receiver_queue_size,
        )
        await self._engine.start()
        self._core.topic = self._engine.topic
        self._client.engine.nursery.start_soon(self._ack_flusher)

    def _sink(self, entries: list[Any]) -> None:
        assert self._core is not None
        self._core.push(entries)
        self._arrived.set()

    def _on_reconnect(self) -> None:
        assert self._core is not None
        self._core.reset()

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def topic(self) -> str:
        return self._engine.topic

    async def receive(self, timeout: float | None = None) -> Message:
        msgs = await self.batch_receive(max_messages=1, timeout=timeout)
        return msgs[0]

    async def batch_receive(self, max_messages: int = 1000, timeout: float | None = None) -> list[Message]:
        core = self._core
        assert core is not None
        deadline = trio.current_time() + (timeout if timeout is not None else math.inf)
        while not core.messages:
            if self._closed:
                raise AlreadyClosed("consumer is closed")
            if core.expand_next():
                break
            self._arrived = trio.Event()
            with trio.move_on_at(deadline):
                await self._arrived.wait()
            if trio.current_time() >= deadline and not core.entries:
                raise Timeout(f"no message within {timeout}s")
        out = core.take(max_messages)
        permits = core.count_consumed(len(out))
        if permits:
            self._engine.flow(permits)
        return out

    async def acknowledge(self, message: Message | MessageId) -> None:
        assert self._core is not None
        if self._core.add_ack(message_id_of(message)):
            self._flush_acks()

    async def acknowledge_cumulative(self, message: Message | MessageId) -> None:
        assert self._core is not None
        if self._options.subscription_type in ("shared", "key_shared"):
            from pigeon.core.errors import NotSupported

            raise NotSupported(
                f"cumulative acknowledgement is not allowed on a {self._options.subscription_type} subscription"
            )
        self._core.add_cumulative_ack(message_id_of(message))

    def _flush_acks(self) -> None:
        assert self._core is not None
        acks, cumulative = self._core.take_acks()
        if acks:
            self._engine.ack_nowait(acks, False)
        if cumulative is not None:
            self._engine.ack_nowait([cumulative], True)

    async def _ack_flusher(self) -> None:
        while not self._closed:
            await trio.sleep(_ACK_GROUP_TIME)
            self._flush_acks()

    async def redeliver_unacknowledged_messages(self) -> None:
        await self._engine.redeliver_unacknowledged()

    async def seek(self, target: MessageId | int | None = None, *, offset: int | None = None, timestamp: int | None = None) -> None:
        await self._engine.seek(**_seek_fields(target, offset, timestamp))
        assert self._core is not None
        self._core.reset()
        self._core.messages.clear()

    async def unsubscribe(self) -> None:
        self._closed = True
        await self._engine.unsubscribe()

    async def close(self) -> None:
        if self._closed and self._engine.closed:
            return
        assert self._core is not None
        acks, cumulative = self._core.take_acks()
        try:
            if acks:
                await self._engine.ack(acks, False)
            if cumulative is not None:
                await self._engine.ack([cumulative], True)
        finally:
            self._closed = True
            self._arrived.set()
            await self._engine.close()


def _seek_fields(target: Any, offset: int | None, timestamp: int | None) -> dict[str, Any]:
    chosen = [x for x in (target, offset, timestamp) if x is not None]
    if len(chosen) != 1:
        from pigeon.core.errors import InvalidArgument

        raise InvalidArgument("seek takes exactly one of a MessageId, offset= or timestamp=")
    if isinstance(target, MessageId):
        return {
            "position": {
                "segmentId": target.segment_id,
                "entryId": target.entry_id,
                "batchIndex": target.batch_index,
                "offset": target.offset,
            }
        }
    if offset is not None:
        return {"offset": int(offset)}
    if timestamp is not None:
        return {"timestamp": int(timestamp)}
    from pigeon.core.errors import InvalidArgument

    raise InvalidArgument(f"cannot seek to {target!r}")


_ = TracebackType
