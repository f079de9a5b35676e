"""The trio face of the PigeonMQ client: the same API as :mod:`pigeon.client`, awaited.

async with pigeon.client.trio.Client("pigeon://127.0.0.1:6650") as client:
    async with await client.create_producer("events") as producer:
        msg_id = await producer.send(b"payload", key="k")
    async with await client.subscribe("events", "sub-1", initial_position="earliest") as consumer:
        msg = await consumer.receive(timeout=5)
        await consumer.acknowledge(msg)
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import trio

from pigeon.client._consumer_handle import open_consumer, open_reader
from pigeon.client._core import arrow_module
from pigeon.client._engine import ClientEngine
from pigeon.client._face import AsyncConsumer, AsyncReader, AsyncReceiving, ClientBase
from pigeon.client._handles import NOLOCK, ProducerFace, ProducerHandle, deliver_time, open_producer
from pigeon.client._message import EntryReceipt, MessageId
from pigeon.client._options import (
    ArrowSendOptions,
    ConsumerOptions,
    ProducerOptions,
    ReaderOptions,
    SendOptions,
    takes_options,
)
from pigeon.client._options import DeadLetterPolicy as DeadLetterPolicy  # re-exported
from pigeon.client._options import (  # re-exported
    MultiplierRedeliveryBackoff as MultiplierRedeliveryBackoff,
)
from pigeon.client._table_view import TableViewBase, TableViewCore, TableViewOptions, call_here
from pigeon.core.auth import AuthenticationTLS as AuthenticationTLS  # re-exported
from pigeon.core.auth import AuthenticationToken as AuthenticationToken  # re-exported
from pigeon.core.codecs import CodecSet
from pigeon.core.errors import AlreadyClosed

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


class Client(ClientBase):
    """A connection to a PigeonMQ cluster; a trio async context manager."""

    _nursery_cm: Any = None
    _listening: list[_Receiving] | None = None

    async def __aenter__(self) -> Client:
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        await nursery.start(self.engine.run)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            with trio.CancelScope(shield=True):
                for receiver in self._listening or ():
                    await receiver._stop_listener()  # the running call finishes first
                await self.engine.aclose()
        finally:
            await self._nursery_cm.__aexit__(None, None, None)

    async def create_topic(self, topic: str, partitions: int = 0) -> None:
        """Create a topic (``partitions > 0``: a partitioned topic)."""
        await self.engine.create_topic(topic, partitions)

    async def list_topics(self, namespace: str = "public/default") -> list[str]:
        return await self.engine.list_topics(namespace)

    @takes_options(ProducerOptions)
    async def create_producer(self, options: ProducerOptions) -> Producer:
        return await open_face(Producer(options), self.engine, self.codecs, options)

    @takes_options(ConsumerOptions)
    async def subscribe(self, options: ConsumerOptions) -> Consumer:
        """Subscribe; with ``message_listener=fn``, ``fn(consumer, msg)`` (a function or a
        coroutine function) is called for each message by a task of the client."""
        return self._listen(await open_face(Consumer(), self.engine, self.codecs, options))

    @takes_options(ReaderOptions)
    async def create_reader(self, options: ReaderOptions) -> Reader:
        return self._listen(await open_face(Reader(), self.engine, self.codecs, options))

    def _listen(self, receiver: _R) -> _R:
        """Start the listener task of a consumer or reader that has a listener."""
        if receiver._handle.listener is not None:
            if self._listening is None:
                self._listening = []
            self._listening = [r for r in self._listening if not r._handle.closed]
            self._listening.append(receiver)
            self.engine.nursery.start_soon(receiver._run_listener)
        return receiver

    @takes_options(TableViewOptions)
    async def create_table_view(self, options: TableViewOptions) -> TableView:
        """A live dict of the latest value of every key of ``topic`` (see TableView)."""
        view = TableView()
        await view._core.open(self.engine, self.codecs, options)
        return view


_Face = TypeVar("_Face", bound="ProducerFace | _Receiving")
_R = TypeVar("_R", bound="_Receiving")


async def open_face(face: _Face, engine: ClientEngine, codecs: CodecSet, options: Any) -> _Face:
    """*engine*: open what ``options`` describe (producer, consumer or reader options) as
    ``face``'s handle; ``face`` is a Producer, Consumer or Reader of any face, whose lock and
    hooks (``_notify`` for consumers and readers) the handle takes.  Consumers publish dead
    letters and retries through trio-face producers."""
    f: Any = face
    if isinstance(options, ProducerOptions):
        f._handle = await open_producer(engine, options, codecs=codecs, face=f)
    elif isinstance(options, ReaderOptions):
        f._handle = await open_reader(engine, options, codecs=codecs, face=f)
    else:
        dead_letters = functools.partial(_open_default_producer, engine, codecs)
        f._handle = await open_consumer(
            engine, options, codecs=codecs, face=f, producer_factory=dead_letters
        )
    return face


async def _open_default_producer(engine: ClientEngine, codecs: CodecSet, topic: str) -> Producer:
    """*engine*: a producer for a consumer's dead letters and retries: one message at a
    time (each send awaits its receipt), chunked when larger than an entry (a chunked
    message comes whole)."""
    options = ProducerOptions(topic, batching_enabled=False, chunking_enabled=True)
    return await open_face(Producer(options), engine, codecs, options)


class Producer(ProducerFace):
    """Sends messages to a topic (all partitions of a partitioned topic)."""

    _handle: ProducerHandle

    def __init__(self, options: ProducerOptions) -> None:
        self._max_pending = options.max_pending_messages
        self._space = trio.Event()

    def _space_freed(self) -> None:
        self._space.set()

    async def _wait_for_space(self) -> None:
        """Wait while ``max_pending_messages`` messages are pending; AlreadyClosed if the
        producer is closed."""
        h = self._handle
        if h.closed:
            raise AlreadyClosed("producer is closed")
        while h.outstanding >= self._max_pending:
            self._space = trio.Event()
            await self._space.wait()

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @takes_options(SendOptions)
    async def send(self, message: SendOptions) -> MessageId:
        """Send and wait for the broker's receipt."""
        receipt = _Receipt()
        await self.send_async(message.value, **message.send_async_keywords(), callback=receipt)
        return await receipt.wait()

    async def send_async(
        self,
        value: Any,
        *,
        key: str | bytes | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int = 0,
        deliver_at: int | None = None,
        deliver_after: float | None = None,
        callback: Callable[[MessageId | None, BaseException | None], None] | None = None,
    ) -> None:
        """Queue a message; ``callback(message_id, error)`` runs on its receipt."""
        h = self._handle
        if h.closed or h.outstanding >= self._max_pending:
            await self._wait_for_space()
        when = (
            0
            if deliver_at is None and deliver_after is None
            else deliver_time(deliver_at, deliver_after, h.client.clock.now_ms())
        )
        h.logic.add(value, key, properties, event_time, when, callback)
        h.outstanding += 1

    @takes_options(ArrowSendOptions)
    async def send_arrow(self, arrow: ArrowSendOptions) -> list[EntryReceipt]:
        """Send the rows of a ``pyarrow.Table`` or ``RecordBatch`` (one message per row,
        built straight from its buffers) and wait for the broker's receipts: one
        :class:`EntryReceipt` per entry, in order. Every entry of the call is in flight at
        once; run calls in several tasks to overlap them. Columns as the sync face's
        ``send_arrow``."""
        arrow_module()
        h = self._handle
        if h.closed or h.outstanding >= self._max_pending:
            await self._wait_for_space()
        receipts = _EntryReceipts(h.batch_done)
        rows = getattr(arrow.data, "num_rows", 0)
        h.outstanding += rows  # before any receipt can free it
        try:
            h.logic.add_arrow(arrow, receipts.make)
        except BaseException:
            h.outstanding -= rows
            raise
        return await receipts.wait()

    async def flush(self) -> None:
        self._handle.logic.seal_all()
        await self._handle.flush()

    async def close(self) -> None:
        h = self._handle
        if h.closed:
            return
        h.logic.seal_all()
        h.closed = True
        await h.close()


class _Receipt:
    """The send callback that ``Producer.send`` waits on."""

    __slots__ = ("done", "error", "message_id")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.message_id: MessageId | None = None
        self.error: BaseException | None = None

    def __call__(self, message_id: MessageId | None, error: BaseException | None) -> None:
        self.message_id = message_id
        self.error = error
        self.done.set()

    async def wait(self) -> MessageId:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.message_id is not None
        return self.message_id


class _EntryReceipts:
    """The receipts of one ``send_arrow`` call's entries (trio face; all on the engine's
    thread)."""

    def __init__(self, done: Callable[[int], None]) -> None:
        self.done = done
        self.results: list[EntryReceipt | None] = []
        self.error: BaseException | None = None
        self.pending = 0
        self.finished = trio.Event()

    def make(self, partition: int, num_rows: int) -> Callable[[Any, BaseException | None], None]:
        index = len(self.results)
        self.results.append(None)
        self.pending += 1

        def callback(receipt: Any, error: BaseException | None) -> None:
            if error is None:
                self.results[index] = EntryReceipt.of(receipt, num_rows, partition)
            elif self.error is None:
                self.error = error
            self.pending -= 1
            self.done(num_rows)
            if not self.pending:
                self.finished.set()

        return callback

    async def wait(self) -> list[EntryReceipt]:
        if self.pending:
            await self.finished.wait()
        if self.error is not None:
            raise self.error
        return [r for r in self.results if r is not None]


class _Receiving(AsyncReceiving):
    """How a trio-face consumer or reader reaches the engine and waits: directly, in the
    caller's trio run."""

    _lock = NOLOCK

    def __init__(self) -> None:
        self._arrived = trio.Event()

    def _notify(self) -> None:
        self._arrived.set()

    async def _engine(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return await afn(*args)

    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    async def _close_handle(self) -> None:
        await self._handle.close()

    def _now(self) -> float:
        return trio.current_time()

    _clock = _now

    def _arm(self) -> None:
        self._arrived = trio.Event()

    async def _wait_until(self, deadline: float) -> None:
        with trio.move_on_at(deadline):
            await self._arrived.wait()

    def _current_task(self) -> Any:
        return trio.lowlevel.current_task()

    def _new_event(self) -> trio.Event:
        return trio.Event()


class Consumer(_Receiving, AsyncConsumer):
    """Receives the messages of one subscription (on one or more topics)."""


class Reader(_Receiving, AsyncReader):
    """Reads a topic from a position without a durable subscription."""


class TableView(TableViewBase):
    """The latest value of every key of a topic, kept up to date; listeners run in the
    client's trio run."""

    def __init__(self) -> None:
        self._core = TableViewCore(call_here)

    async def __aenter__(self) -> TableView:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._core.close()
