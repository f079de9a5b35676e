"""The asyncio face of the PigeonMQ client: the sync face's API, awaited from asyncio.

    import asyncio
    from pigeon.client.asyncio import Client

    async def main() -> None:
        async with Client("pigeon://127.0.0.1:6650") as client:
            async with await client.create_producer("events") as producer:
                await producer.send(b"payload", key="k")
            async with await client.subscribe("events", "sub-1", initial_position="earliest") as c:
                msg = await c.receive(timeout=5)
                await c.acknowledge(msg)

    asyncio.run(main())

The trio engine runs in one background thread, the same
:class:`~pigeon.client._thread.EngineThread` the sync face runs it in; the asyncio program
needs no trio of its own and its event loop never blocks on the engine:

* an engine operation (lookup, subscribe, seek, flush, close, ...) is a task started in the
  engine's nursery and awaited through an asyncio future
  (:mod:`pigeon.client._asyncio_bridge`); a producer or consumer opened for a task that is
  no longer waiting is closed again.
* a producer accumulates messages in the loop's thread (the batching timer is a timerfd
  the loop watches, :class:`~pigeon.client._timer.LoopTimers`, where it can, else a
  ``loop.call_at``) and hands each sealed batch over with one ``run_sync_soon``; the
  receipt of a batch comes back with one ``call_soon_threadsafe`` that resolves the asyncio
  futures of all its messages.
* a consumer's queue is filled by the engine, which wakes the loop (at most one
  ``call_soon_threadsafe`` in flight per consumer); the loop's thread splits entries into
  messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from pigeon.client._asyncio_bridge import run_on_engine, spawn_on_engine
from pigeon.client._core import arrow_module, settle_entry
from pigeon.client._face import AsyncConsumer, AsyncReader, AsyncReceiving, ClientBase
from pigeon.client._handles import ProducerFace, ProducerHandle, deliver_time
from pigeon.client._message import EntryReceipt, Message, MessageId, receipt_message_ids
from pigeon.client._options import (
    ArrowSendOptions,
    ConsumerOptions,
    QueueingProducerOptions,
    ReaderOptions,
    TimedSendOptions,
    takes_options,
)
from pigeon.client._options import DeadLetterPolicy as DeadLetterPolicy  # re-exported
from pigeon.client._options import (  # re-exported
    MultiplierRedeliveryBackoff as MultiplierRedeliveryBackoff,
)
from pigeon.client._table_view import TableViewBase, TableViewCore, TableViewOptions, call_here
from pigeon.client._thread import EngineThread
from pigeon.client._timer import LoopTimers
from pigeon.client.trio import open_face
from pigeon.core.auth import AuthenticationTLS as AuthenticationTLS  # re-exported
from pigeon.core.auth import AuthenticationToken as AuthenticationToken  # re-exported
from pigeon.core.errors import AlreadyClosed, ProducerQueueFull, Timeout

__all__ = [
    "AuthenticationTLS",
    "AuthenticationToken",
    "Client",
    "Consumer",
    "DeadLetterPolicy",
    "MultiplierRedeliveryBackoff",
    "Producer",
    "Reader",
    "TableView",
]


_Face = TypeVar("_Face", bound="Producer | _Receiving")


class Client(ClientBase):
    """A PigeonMQ client for asyncio programs; an async context manager.

    Constructing it starts the engine thread (no network I/O yet).  Every object it makes
    belongs to the event loop it was made in.
    """

    def _start(self) -> None:
        self.engine_thread = EngineThread(self.engine)
        self._closed = False
        self._producers: weakref.WeakSet[Producer] = weakref.WeakSet()
        self._receivers: weakref.WeakSet[_Receiving] = weakref.WeakSet()

    # ------------------------------------------------------------------ bridging

    async def _run(
        self,
        afn: Callable[..., Awaitable[Any]],
        *args: Any,
        shield: bool = False,
        orphan: Callable[[Any], None] | None = None,
    ) -> Any:
        """Await ``afn(*args)`` run as a task of the engine's nursery.

        ``shield``: the engine task runs to completion even if the awaiting task is
        cancelled.  ``orphan(result)`` disposes of a result nobody waits for any more.
        """
        if self._closed:
            raise AlreadyClosed("client is closed")
        return await run_on_engine(self.engine_thread, afn, args, shield=shield, orphan=orphan)

    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the engine's thread soon (never blocks)."""
        self.engine_thread.soon(fn, *args)

    def _spawn(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Fire and forget: run ``afn(*args)`` in the engine's nursery, errors logged."""

        spawn_on_engine(self.engine_thread, afn, *args)

    # ------------------------------------------------------------------ public

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every producer and consumer, the connections, and stop the engine thread."""
        if self._closed:
            return
        for receiver in list(self._receivers):
            if receiver._handle.listener is not None:
                await receiver._stop_listener()  # the running call finishes first
        for producer in list(self._producers):
            producer._seal_and_close()  # batched messages go out before the engine closes
        try:
            await self._run(self.engine.aclose, shield=True)
        except AlreadyClosed:
            pass
        finally:
            self._closed = True
            self.engine_thread.closed = True
            for receiver in list(self._receivers):
                receiver._mark_closed()
        await asyncio.to_thread(self.engine_thread.join, 30)

    async def create_topic(self, topic: str, partitions: int = 0) -> None:
        """Create a topic (``partitions > 0``: a partitioned topic)."""
        await self._run(self.engine.create_topic, topic, partitions)

    async def list_topics(self, namespace: str = "public/default") -> list[str]:
        result: list[str] = await self._run(self.engine.list_topics, namespace)
        return result

    @takes_options(QueueingProducerOptions)
    async def create_producer(self, options: QueueingProducerOptions) -> Producer:
        producer = await self._open(Producer(self, options), options)
        self._producers.add(producer)
        return producer

    @takes_options(ConsumerOptions)
    async def subscribe(self, options: ConsumerOptions) -> Consumer:
        """Subscribe to a topic, a list of topics, or a ``re.Pattern`` of topic names.

        With ``message_listener=fn``, ``fn(consumer, msg)`` (a function or a coroutine
        function) is called for each message by a task on this event loop."""
        consumer = await self._open(Consumer(self), options)
        self._receivers.add(consumer)
        consumer._start_listener()
        return consumer

    @takes_options(ReaderOptions)
    async def create_reader(self, options: ReaderOptions) -> Reader:
        """A reader from ``"earliest"``, ``"latest"`` or after a MessageId."""
        reader = await self._open(Reader(self), options)
        self._receivers.add(reader)
        reader._start_listener()
        return reader

    @takes_options(TableViewOptions)
    async def create_table_view(self, options: TableViewOptions) -> TableView:
        """A live dict of the latest value of every key of ``topic``; returns once it
        holds everything up to the topic's last message."""
        view = TableView(self)
        await self._run(view._core.open, self.engine, self.codecs, options, shield=True)
        return view

    async def _open(self, face: _Face, options: Any) -> _Face:
        opened: _Face = await self._run(
            open_face, face, self.engine, self.codecs, options, shield=True, orphan=self._orphan
        )
        return opened

    def _orphan(self, face: Producer | _Receiving) -> None:
        """A producer or consumer opened for a task that stopped waiting: close it again."""
        face._handle.closed = True
        self._spawn(face._handle.close)


class Producer(ProducerFace):
    """Sends messages to a topic (every partition of a partitioned topic).

    Messages are batched on the event loop's thread; the futures of a batch's messages are
    resolved together when its receipt arrives.
    """

    _handle: ProducerHandle

    def __init__(self, client: Client, options: QueueingProducerOptions) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._max_pending = options.max_pending_messages
        self._block = options.block_if_queue_full
        self._send_timeout = options.send_timeout
        self._lock = threading.Lock()
        self._space = asyncio.Event()
        # asyncio's own loop: its clock and futures without a Python frame per message
        # (a loop that overrides them, such as uvloop's, keeps its own)
        loop = self._loop
        base = asyncio.BaseEventLoop
        self._clock = time.monotonic if type(loop).time is base.time else loop.time
        self._new_future: Callable[[], asyncio.Future[Any]] = (
            functools.partial(asyncio.Future, loop=loop)
            if type(loop).create_future is base.create_future
            else loop.create_future
        )
        #: the batching timers: timerfds the loop watches (woken to the microsecond),
        #: or None where there are none, and ``loop.call_at`` (woken at the next whole
        #: millisecond, as the selector rounds its timeout up) keeps them
        self._timers = LoopTimers.open(loop, self._timer_fired)

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- hooks of ProducerLogic, called on the loop's thread with the lock held ------------

    def _submit(self, engine: Any, batch: Any) -> None:
        try:
            self._client._soon(engine.submit, batch)
        except AlreadyClosed as exc:
            batch.callback(None, exc)

    def _start_timer(self, index: int, generation: int) -> None:
        logic = self._handle.logic
        if logic.linger:  # no delay: sealed on the loop's next pass, with what came meanwhile
            self._loop.call_soon(self._timer_fired, index, generation)
        else:
            due = logic.cores[index].due
            timers = self._timers
            if timers is None or not timers.start(index, generation, due):
                self._loop.call_at(due, self._timer_fired, index, generation)

    def _timer_fired(self, index: int, generation: int) -> None:
        with self._lock:
            self._handle.logic.timer_fired(index, generation)

    def _engine_idle(self, index: int) -> None:  # engine thread
        # always hop: whether the loop holds a batch is the loop's to say
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to seal
            self._loop.call_soon_threadsafe(self._release_held, index)

    def _release_held(self, index: int) -> None:
        with self._lock:
            self._handle.logic.engine_idle(index)

    def _callback_for(
        self, futures: list[asyncio.Future[MessageId]], state: Any, partition: int
    ) -> _BatchCompletion:
        return _BatchCompletion(self, futures, partition)

    def _batch_done(self, count: int) -> None:
        h = self._handle
        h.outstanding -= count
        if h.outstanding < self._max_pending:
            self._space.set()

    # -- public ------------------------------------------------------------------------

    @takes_options(TimedSendOptions)
    async def send(self, message: TimedSendOptions) -> MessageId:
        """Send one message and wait for the broker's receipt.

        If the pending queue is full and ``block_if_queue_full`` is set, wait for space
        (at most ``send_timeout``).  Cancelling the wait does not take the message back.
        """
        if self._block:
            await self._wait_for_space()
        fut = self.send_async(message.value, **message.send_async_keywords())
        try:
            async with asyncio.timeout(message.timeout):
                return await fut
        except TimeoutError:
            raise Timeout(f"no receipt within {message.timeout}s") from None

    async def _wait_for_space(self) -> None:
        h = self._handle
        if h.outstanding < self._max_pending:
            return
        try:
            async with asyncio.timeout(self._send_timeout):
                while h.outstanding >= self._max_pending and not h.closed:
                    self._space.clear()
                    await self._space.wait()
        except TimeoutError:
            raise Timeout("producer queue stayed full") from None

    def send_async(
        self,
        value: Any,
        *,
        key: str | bytes | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int = 0,
        deliver_at: int | None = None,
        deliver_after: float | None = None,
        callback: Callable[[asyncio.Future[MessageId]], None] | None = None,
    ) -> asyncio.Future[MessageId]:
        """Queue one message; the returned future resolves to its MessageId.

        Never waits: with ``max_pending_messages`` already pending it raises
        ``ProducerQueueFull`` (``await send(...)`` waits for space instead).
        ``deliver_at`` (ms since the epoch) or ``deliver_after`` (seconds) hold the message
        back on shared subscriptions until then.  Cancelling the future only stops waiting
        for the receipt; the message is still sent.
        """
        h = self._handle
        when = (
            0
            if deliver_at is None and deliver_after is None
            else deliver_time(deliver_at, deliver_after)
        )
        if h.closed:
            raise AlreadyClosed("producer is closed")
        if h.outstanding >= self._max_pending:
            raise ProducerQueueFull(
                f"{h.outstanding} messages pending (max_pending_messages={self._max_pending})"
            )
        fut: asyncio.Future[MessageId] = self._new_future()
        with self._lock:
            h.logic.add(value, key, properties, event_time, when, fut)
        h.outstanding += 1
        if callback is not None:
            fut.add_done_callback(callback)
        return fut

    @takes_options(ArrowSendOptions)
    async def send_arrow(self, arrow: ArrowSendOptions) -> list[EntryReceipt]:
        """Send the rows of a ``pyarrow.Table`` or ``RecordBatch`` (one message per row,
        built straight from its buffers) and wait for the broker's receipts: one
        :class:`EntryReceipt` per entry, in order. Every entry of the call is in flight at
        once; ``asyncio.gather`` several calls to overlap them. Columns as the sync
        face's ``send_arrow``. With ``max_pending_messages`` rows pending it waits for
        space (``block_if_queue_full``) or raises ProducerQueueFull."""
        arrow_module()
        h = self._handle
        if h.closed:
            raise AlreadyClosed("producer is closed")
        if self._block:
            await self._wait_for_space()
        elif h.outstanding >= self._max_pending:
            raise ProducerQueueFull(
                f"{h.outstanding} messages pending (max_pending_messages={self._max_pending})"
            )
        futures: list[asyncio.Future[EntryReceipt]] = []

        def make(partition: int, num_rows: int) -> _EntryCompletion:
            fut: asyncio.Future[EntryReceipt] = self._loop.create_future()
            futures.append(fut)
            return _EntryCompletion(self, fut, partition, num_rows)

        with self._lock:
            h.logic.add_arrow(arrow, make)
        h.outstanding += getattr(arrow.data, "num_rows", 0)
        return list(await asyncio.gather(*futures))

    def _seal_and_close(self) -> None:
        """The client is closing: hand over what is batched; accept no more messages."""
        with self._lock:
            self._handle.logic.seal_all()
            self._handle.closed = True
        self._close_timers()
        self._space.set()

    def _close_timers(self) -> None:
        if self._timers is not None:
            self._timers.close()

    async def flush(self) -> None:
        """Send what is batched and wait until every pending message is acknowledged.

        When it returns, the futures of all messages sent before are resolved.
        """
        with self._lock:
            self._handle.logic.seal_all()
        await self._client._run(self._handle.flush)

    async def close(self) -> None:
        """Refuse new messages (AlreadyClosed), flush, then detach from the broker."""
        h = self._handle
        if h.closed:
            return
        if self._client._closed:  # the client's close already closed every producer
            h.closed = True
            self._close_timers()
            return
        with self._lock:
            # closed first: a send from here on raises AlreadyClosed (one let in while the
            # flush waited went into a batch nothing would seal)
            h.closed = True
        self._space.set()
        try:
            await self.flush()
        finally:
            self._close_timers()
            await self._client._run(h.close, shield=True)


class _BatchCompletion:
    """The receipt handler of one sealed batch: called on the engine's thread, it resolves
    the asyncio futures of the batch's messages on the loop's thread, with one
    ``call_soon_threadsafe`` per batch."""

    __slots__ = ("futures", "partition", "producer")

    def __init__(
        self, producer: Producer, futures: list[asyncio.Future[MessageId]], partition: int
    ) -> None:
        self.producer = producer
        self.futures = futures
        self.partition = partition

    def __call__(self, receipt: Any, error: BaseException | None) -> None:  # engine thread
        loop = self.producer._loop
        with contextlib.suppress(RuntimeError):  # the event loop is closed
            if error is None:
                loop.call_soon_threadsafe(self.handle_response, receipt)
            else:
                loop.call_soon_threadsafe(self.handle_error, error)

    def handle_response(self, receipt: tuple[int, int, int, bool]) -> None:  # loop thread
        futures = self.futures
        ids = receipt_message_ids(receipt, len(futures), self.partition)
        for f, mid in zip(futures, ids, strict=True):
            if not f.done():
                f.set_result(mid)
        self.producer._batch_done(len(self.futures))

    def handle_error(self, error: BaseException) -> None:  # loop thread
        for f in self.futures:
            if not f.done():
                f.set_exception(error)
        self.producer._batch_done(len(self.futures))


class _EntryCompletion:
    """The receipt handler of one entry sent by ``send_arrow``: resolves its asyncio
    future on the loop's thread."""

    __slots__ = ("future", "num_rows", "partition", "producer")

    def __init__(
        self,
        producer: Producer,
        future: asyncio.Future[EntryReceipt],
        partition: int,
        num_rows: int,
    ) -> None:
        self.producer = producer
        self.future = future
        self.partition = partition
        self.num_rows = num_rows

    def __call__(self, receipt: Any, error: BaseException | None) -> None:  # engine thread
        with contextlib.suppress(RuntimeError):  # the event loop is closed
            self.producer._loop.call_soon_threadsafe(self._resolve, receipt, error)

    def _resolve(self, receipt: Any, error: BaseException | None) -> None:  # loop thread
        settle_entry(self.future, receipt, error, self.num_rows, self.partition)
        self.producer._batch_done(self.num_rows)


class _Receiving(AsyncReceiving):
    """How an asyncio-face consumer or reader reaches the engine (through the client's
    bridge) and waits: the engine queues entries and wakes the loop (``_notify``); the
    loop's thread splits them into messages."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._arrived = asyncio.Event()
        self._wake_pending = False
        self._listener_runner: asyncio.Task[None] | None = None

    def _notify(self) -> None:
        """Engine thread: entries were queued (or the consumer closed): wake receivers."""
        if self._wake_pending:
            return  # a wake-up is already on its way; it will see these entries too
        self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the event loop is closed: nobody receives any more
            self._wake_pending = False

    def _wake(self) -> None:
        self._wake_pending = False
        self._arrived.set()

    async def _engine(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return await self._client._run(afn, *args)

    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self._client._soon(fn, *args)

    async def _close_handle(self) -> None:
        if not self._client._closed:
            await self._client._run(self._handle.close, shield=True)

    def _now(self) -> float:
        return self._client.engine_thread.now()

    def _clock(self) -> float:
        return self._loop.time()

    def _arm(self) -> None:
        self._arrived.clear()

    async def _wait_until(self, deadline: float) -> None:
        left = deadline - self._loop.time()
        with contextlib.suppress(TimeoutError):  # look once more, then raise Timeout
            async with asyncio.timeout(None if math.isinf(left) else left):
                await self._arrived.wait()

    def _current_task(self) -> Any:
        return asyncio.current_task()

    def _new_event(self) -> asyncio.Event:
        return asyncio.Event()

    def _start_listener(self) -> None:
        """With a listener: its task on this loop (held here: the loop keeps only a weak
        reference)."""
        if self._handle.listener is not None:
            self._listener_runner = self._loop.create_task(self._run_listener())


class Consumer(_Receiving, AsyncConsumer):
    """Receives the messages of one subscription (on one or more topics).

    ``async for msg in consumer:`` receives forever.
    """

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        return await self.receive()


class Reader(_Receiving, AsyncReader):
    """Reads a topic from a position, without a durable subscription."""


class TableView(TableViewBase):
    """The latest value of every key of a topic, kept up to date; listeners run on the
    event loop."""

    def __init__(self, client: Client) -> None:
        self._client = client
        loop = asyncio.get_running_loop()

        def call(fn: Any, key: str, value: bytes | None) -> None:
            loop.call_soon_threadsafe(call_here, fn, key, value)

        self._core = TableViewCore(call)

    async def __aenter__(self) -> TableView:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if not self._core.closed and not self._client._closed:
            await self._client._run(self._core.close, shield=True)
