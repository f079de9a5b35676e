"""The synchronous face: the trio engine runs in one background thread.

Work crosses threads per *batch*: a producer accumulates messages in the caller's thread
and hands a sealed batch over with one ``run_sync_soon``; the engine hands received
entries (batches) to a consumer's queue, which the caller's thread splits into messages.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import trio

from pigeon.client._core import ConsumerCore, ProducerCore, message_id_of, resolve_completions
from pigeon.client._engine import (
    ClientEngine,
    ConsumerEngine,
    ProducerEngine,
    ReceivedEntry,
    SubscribeOptions,
)
from pigeon.client._future import BatchState, MessageFuture
from pigeon.client._message import Message, MessageId
from pigeon.client.trio import _codecs, _seek_fields
from pigeon.core import PluginManager
from pigeon.core.errors import (
    AlreadyClosed,
    NotSupported,
    ProducerQueueFull,
    Timeout,
)

__all__ = ["Client", "Consumer", "Producer"]

_ACK_GROUP_TIME = 0.1


class Client:
    """A PigeonMQ client whose calls block the calling thread.

    >>> with Client("pigeon://127.0.0.1:6650") as client:  # doctest: +SKIP
    ...     with client.create_producer("events") as producer:
    ...         producer.send(b"hello")
    """

    def __init__(
        self,
        service_url: str,
        *,
        operation_timeout: float = 30.0,
        plugins: PluginManager | None = None,
    ) -> None:
        self.engine = ClientEngine(service_url, operation_timeout=operation_timeout)
        self.plugins = plugins or PluginManager()
        self.codecs = _codecs(self.plugins)
        self._token: trio.lowlevel.TrioToken | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="pigeon-client", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                await nursery.start(self.engine.run)
                self._started.set()

        try:
            trio.run(main)
        except BaseException as exc:  # reported to the constructor or logged
            self._error = exc
        finally:
            self._started.set()

    # ------------------------------------------------------------------ bridging

    def _call(self, afn: Callable[..., Any], *args: Any) -> Any:
        if self._closed:
            raise AlreadyClosed("client is closed")
        return trio.from_thread.run(afn, *args, trio_token=self._token)

    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._token is not None
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise AlreadyClosed("client is closed") from None

    # ------------------------------------------------------------------ public

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._call(self.engine.aclose)
        except Exception:
            pass
        self._closed = True
        self._thread.join(timeout=30)

    def create_producer(
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
        block_if_queue_full: bool = True,
    ) -> Producer:
        codec = self.codecs.by_name(compression)
        engine = ProducerEngine(self.engine, topic, producer_name=producer_name, send_timeout=send_timeout)
        self._call(engine.start)
        core = ProducerCore(
            producer_name=engine.producer_name,
            codec=codec,
            partition=-1,
            max_messages=batching_max_messages,
            max_bytes=batching_max_bytes,
            max_message_size=engine.max_message_size,
            first_sequence_id=engine.last_sequence_id + 1,
        )
        return Producer(
            self, engine, core, batching_max_delay_ms / 1000, max_pending_messages, block_if_queue_full
        )

    def subscribe(
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
        consumer._start()
        return consumer


class Producer:
    """Sends messages to one topic. Thread-safe."""

    def __init__(
        self,
        client: Client,
        engine: ProducerEngine,
        core: ProducerCore,
        max_delay: float,
        max_pending: int,
        block_if_queue_full: bool,
    ) -> None:
        self._client = client
        self._engine = engine
        self._core = core
        self._max_delay = max_delay
        self._max_pending = max_pending
        self._block = block_if_queue_full
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._outstanding = 0
        self._closed = False

    @property
    def topic(self) -> str:
        return self._engine.topic

    @property
    def producer_name(self) -> str:
        return self._engine.producer_name

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(
        self,
        value: bytes,
        *,
        key: str | bytes | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int = 0,
        timeout: float | None = None,
    ) -> MessageId:
        """Send one message and wait for the broker's receipt."""
        fut = self.send_async(value, key=key, properties=properties, event_time=event_time)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise Timeout(f"no receipt within {timeout}s") from None

    def send_async(
        self,
        value: bytes,
        *,
        key: str | bytes | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int = 0,
        callback: Callable[[concurrent.futures.Future[MessageId]], None] | None = None,
    ) -> concurrent.futures.Future[MessageId]:
        """Queue one message; the future resolves to its MessageId."""
        batch = None
        start_timer = 0
        with self._lock:
            if self._closed:
                raise AlreadyClosed("producer is closed")
            if self._outstanding >= self._max_pending:
                if not self._block:
                    raise ProducerQueueFull(
                        f"{self._outstanding} messages pending (max_pending_messages={self._max_pending})"
                    )
                deadline = time.monotonic() + self._engine.send_timeout
                while self._outstanding >= self._max_pending:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        raise Timeout("producer queue stayed full")
                    self._space.wait(left)
            core = self._core
            fut = MessageFuture(core.batch_state(), len(core))
            full = core.add(value, key, properties, event_time, None)
            self._outstanding += 1
            if full or self._max_delay <= 0:
                batch = self._core.seal(self._callback_for)
            elif len(self._core) == 1:
                start_timer = self._core.generation
        if batch is not None:
            self._client._soon(self._engine.submit, batch)
        elif start_timer:
            self._client._soon(self._start_timer, start_timer)
        if callback is not None:
            fut.add_done_callback(callback)
        return fut

    # -- engine thread ---------------------------------------------------------------

    def _start_timer(self, generation: int) -> None:
        self._client.engine.nursery.start_soon(self._timer, generation)

    async def _timer(self, generation: int) -> None:
        await trio.sleep(self._max_delay)
        with self._lock:
            if self._core.generation != generation:
                return
            batch = self._core.seal(self._callback_for)
        if batch is not None:
            self._engine.submit(batch)

    def _callback_for(self, completions: list[Any], state: BatchState | None) -> Any:
        partition = self._core.partition

        def on_done(result: Any, error: BaseException | None) -> None:
            resolve_completions(completions, state, result, error, partition)
            with self._lock:
                self._outstanding -= len(completions)
                self._space.notify_all()

        return on_done

    # -- caller thread ---------------------------------------------------------------

    def flush(self) -> None:
        """Send what is batched and wait until every pending message is acknowledged."""
        with self._lock:
            batch = self._core.seal(self._callback_for)
        if batch is not None:
            self._client._soon(self._engine.submit, batch)
        self._client._call(self._engine.flush)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._lock:
                self._closed = True
            self._client._call(self._engine.close)


class Consumer:
    """Receives messages of one subscription. Thread-safe."""

    def __init__(self, client: Client, options: SubscribeOptions) -> None:
        self._client = client
        self._options = options
        self._cond = threading.Condition()
        self._core = ConsumerCore(
            topic=options.topic,
            partition=-1,
            codecs=client.codecs,
            receiver_queue_size=options.receiver_queue_size,
        )
        self._engine = ConsumerEngine(client.engine, options, self._sink, on_reconnect=self._on_reconnect)
        self._core.partition = self._engine.partition
        self._closed = False

    def _start(self) -> None:
        self._client._call(self._engine.start)
        self._core.topic = self._engine.topic
        self._client._soon(self._start_flusher)

    # -- engine thread ---------------------------------------------------------------

    def _sink(self, entries: list[ReceivedEntry]) -> None:
        with self._cond:
            self._core.push(entries)
            self._cond.notify()

    def _on_reconnect(self) -> None:
        with self._cond:
            self._core.reset()

    def _start_flusher(self) -> None:
        self._client.engine.nursery.start_soon(self._ack_flusher)

    async def _ack_flusher(self) -> None:
        while not self._closed:
            await trio.sleep(_ACK_GROUP_TIME)
            self._send_acks()

    def _send_acks(self) -> None:
        with self._cond:
            acks, cumulative = self._core.take_acks()
        if acks:
            self._engine.ack_nowait(acks, False)
        if cumulative is not None:
            self._engine.ack_nowait([cumulative], True)

    # -- caller thread ---------------------------------------------------------------

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def topic(self) -> str:
        return self._engine.topic

    def receive(self, timeout: float | None = None) -> Message:
        """The next message; raises pigeon.client.Timeout after ``timeout`` seconds."""
        return self.batch_receive(1, timeout)[0]

    def batch_receive(self, max_messages: int = 1000, timeout: float | None = None) -> list[Message]:
        core = self._core
        deadline = time.monotonic() + (timeout if timeout is not None else math.inf)
        with self._cond:
            while not core.messages:
                if core.expand_next():
                    break
                if self._closed:
                    raise AlreadyClosed("consumer is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"no message within {timeout}s")
                self._cond.wait(None if math.isinf(left) else left)
            out = core.take(max_messages)
            permits = core.count_consumed(len(out))
        if permits:
            self._client._soon(self._engine.flow, permits)
        return out

    def __iter__(self) -> Any:
        while True:
            yield self.receive()

    def acknowledge(self, message: Message | MessageId) -> None:
        """Acknowledge one message (sent to the broker in groups, every 100 ms)."""
        mid = message_id_of(message)
        with self._cond:
            full = self._core.add_ack(mid)
        if full:
            self._client._soon(self._send_acks)

    def acknowledge_cumulative(self, message: Message | MessageId) -> None:
        """Acknowledge this message and every earlier one of the partition."""
        if self._options.subscription_type in ("shared", "key_shared"):
            raise NotSupported(
                "cumulative acknowledgement is not allowed on a "
                f"{self._options.subscription_type} subscription"
            )
        mid = message_id_of(message)
        with self._cond:
            self._core.add_cumulative_ack(mid)

    def redeliver_unacknowledged_messages(self) -> None:
        self._client._call(self._engine.redeliver_unacknowledged)

    def seek(self, target: MessageId | None = None, *, offset: int | None = None, timestamp: int | None = None) -> None:
        fields = _seek_fields(target, offset, timestamp)
        self._client._call(lambda: self._engine.seek(**fields))
        with self._cond:
            self._core.reset()
            self._core.messages.clear()

    def unsubscribe(self) -> None:
        self._client._call(self._engine.unsubscribe)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self) -> None:
        """Send pending acknowledgements, then leave the subscription."""
        if self._closed:
            return
        with self._cond:
            acks, cumulative = self._core.take_acks()

        async def close() -> None:
            try:
                if acks:
                    await self._engine.ack(acks, False)
                if cumulative is not None:
                    await self._engine.ack([cumulative], True)
            finally:
                await self._engine.close()

        try:
            self._client._call(close)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
