"""The synchronous face: the trio engine runs in one background thread.

Work crosses threads per *batch*: a producer accumulates messages in the caller's thread
and hands a sealed batch over with one ``run_sync_soon``; the engine hands received
entries (batches) to a consumer's queue, which the caller's thread splits into messages.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from pigeon.client._consumer_handle import ConsumerFace, ConsumerHandle
from pigeon.client._core import EntryCompletion, ProducerCore, arrow_module, message_id_of
from pigeon.client._face import ClientBase
from pigeon.client._fast import speed_up
from pigeon.client._future import MessageFuture
from pigeon.client._handles import ProducerFace, ProducerHandle, deliver_time
from pigeon.client._message import EntryReceipt, Message, MessageId
from pigeon.client._options import (
    ArrowSendOptions,
    ConsumerOptions,
    QueueingProducerOptions,
    ReaderOptions,
    SequencedSendOptions,
    takes_options,
)
from pigeon.client._table_view import TableViewBase, TableViewCore, TableViewOptions, call_here
from pigeon.client._thread import EngineThread
from pigeon.client.trio import open_face
from pigeon.core.errors import AlreadyClosed, ProducerQueueFull, Timeout

__all__ = ["Client", "Consumer", "Producer", "Reader", "TableView"]

log = logging.getLogger(__name__)

_Face = TypeVar("_Face")
_R = TypeVar("_R", bound="_Receiving")

#: messages a listener thread hands to one consumer's listener before it lets the
#: consumers queued behind it have their turn
_LISTENER_TURN = 64


class Client(ClientBase):
    """A PigeonMQ client whose calls block the calling thread. Thread-safe.

    >>> with Client("pigeon://127.0.0.1:6650") as client:  # doctest: +SKIP
    ...     with client.create_producer("events") as producer:
    ...         producer.send(b"hello")
    """

    def _start(self) -> None:
        self.engine_thread = EngineThread(self.engine)
        self._producers: weakref.WeakSet[Producer] = weakref.WeakSet()
        self._listening: weakref.WeakSet[_Receiving] = weakref.WeakSet()
        #: the message listeners' threads, started with the first listener
        self._listener_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        thread = self.engine_thread
        if thread.closed:
            return
        for receiver in list(self._listening):
            receiver._stop_listener()  # the running call finishes first
        for producer in list(self._producers):
            with contextlib.suppress(Exception):
                producer.close()
        try:
            thread.call(self.engine.aclose)
        except Exception:
            pass
        thread.closed = True
        thread.join(30)
        pool = self._listener_pool
        if pool is not None:
            # not waiting from a listener's own thread (a listener closing the client)
            pool.shutdown(wait=not threading.current_thread().name.startswith("pigeon-listener"))

    def create_topic(self, topic: str, partitions: int = 0) -> None:
        """Create a topic (``partitions > 0``: a partitioned topic)."""
        self.engine_thread.call(self.engine.create_topic, topic, partitions)

    def list_topics(self, namespace: str = "public/default") -> list[str]:
        result: list[str] = self.engine_thread.call(self.engine.list_topics, namespace)
        return result

    @takes_options(QueueingProducerOptions)
    def create_producer(self, options: QueueingProducerOptions) -> Producer:
        producer = self._open(Producer(self.engine_thread, options), options)
        try:
            speed_up(producer)  # send_async's hot path in C, where it is built
        except BaseException:
            producer.close()  # attached: do not leave it behind
            raise
        self._producers.add(producer)
        return producer

    @takes_options(ConsumerOptions)
    def subscribe(self, options: ConsumerOptions) -> Consumer:
        """Subscribe to a topic, a list of topics, or a ``re.Pattern`` of topic names.

        With ``message_listener=fn``, ``fn(consumer, msg)`` is called for each message on
        the client's listener threads (``message_listener_threads``): one message at a
        time per consumer, in order; different consumers' listeners run in parallel."""
        return self._listen(self._open(Consumer(self.engine_thread), options))

    @takes_options(ReaderOptions)
    def create_reader(self, options: ReaderOptions) -> Reader:
        """A reader from ``"earliest"``, ``"latest"`` or after a MessageId."""
        return self._listen(self._open(Reader(self.engine_thread), options))

    def _listen(self, receiver: _R) -> _R:
        """Hand a consumer or reader that has a listener to the listener threads."""
        if receiver._handle.listener is not None:
            with self._pool_lock:
                if self._listener_pool is None:
                    self._listener_pool = concurrent.futures.ThreadPoolExecutor(
                        self.message_listener_threads, thread_name_prefix="pigeon-listener"
                    )
            self._listening.add(receiver)
            receiver._start_listener(self._listener_pool)
        return receiver

    @takes_options(TableViewOptions)
    def create_table_view(self, options: TableViewOptions) -> TableView:
        """A live dict of the latest value of every key of ``topic``; returns once it
        holds everything up to the topic's last message."""
        view = TableView(self.engine_thread)
        self.engine_thread.call(view._core.open, self.engine, self.codecs, options)
        return view

    def _open(self, face: _Face, options: Any) -> _Face:
        opened: _Face = self.engine_thread.call(open_face, face, self.engine, self.codecs, options)
        return opened


class Producer(ProducerFace):
    """Sends messages to a topic (every partition of a partitioned topic). Thread-safe."""

    _handle: ProducerHandle

    def __init__(self, thread: EngineThread, options: QueueingProducerOptions) -> None:
        self._thread = thread
        self._max_pending = options.max_pending_messages
        self._block = options.block_if_queue_full
        self._send_timeout = options.send_timeout
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._clock = time.perf_counter
        #: sealed batches not yet handed to their engines, in the order sealed
        self._sealed: list[tuple[Any, Any]] = []

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # called with the lock held (from ProducerLogic), any thread
    def _submit(self, engine: Any, batch: Any) -> None:
        sealed = self._sealed
        sealed.append((engine, batch))
        # sealed by the batching timer: it hands the batch over itself, at once (no
        # run_sync_soon from the engine's thread to itself: a wake-up write and a pass)
        if len(sealed) == 1 and not self._handle.timer_sealing:
            try:
                self._thread.soon(self._submit_sealed)
            except AlreadyClosed:
                sealed.clear()
                raise

    def _submit_sealed(self) -> None:
        """*engine*: hand the sealed batches to their engines, in the order sealed.

        Run soon after a batch was sealed; the batching timer runs it at once (it seals
        on the engine's thread: no need to wait for the next pass of the scheduler)."""
        with self._lock:
            sealed, self._sealed = self._sealed, []
        for engine, batch in sealed:
            engine.submit(batch)

    _timer_sealed = _submit_sealed

    def _start_timer(self, index: int, generation: int) -> None:
        # due on the engine's clock (trio's: perf_counter plus the run's offset), so the
        # hop to the engine's thread does not delay the batch; none while the partition's
        # timer task runs (it finds this batch when it wakes): a steady producer's batches
        # cross no thread for their timers
        h = self._handle
        if h.logic.linger and not h.timer_armed[index]:
            # no delay: sealed when the engine's thread gets to it, with what came meanwhile
            self._thread.soon(h.seal_now, index)
            h.timer_armed[index] = True
        elif not h.timer_armed[index]:
            h.due_offset = offset = self._thread.engine.clock_offset
            due = h.logic.cores[index].due + offset
            self._thread.soon(h.start_timer, index, generation, due)
            h.timer_armed[index] = True

    def _space_freed(self) -> None:
        with self._lock:
            self._space.notify_all()

    @takes_options(SequencedSendOptions)
    def send(self, message: SequencedSendOptions) -> MessageId:
        """Send one message and wait for the broker's receipt."""
        fut = self.send_async(message.value, **message.send_async_keywords())
        try:
            return fut.result(message.timeout)
        except concurrent.futures.TimeoutError:
            raise Timeout(f"no receipt within {message.timeout}s") from None

    def send_async(
        self,
        value: Any,
        *,
        key: str | bytes | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int = 0,
        deliver_at: int | None = None,
        deliver_after: float | None = None,
        callback: Callable[[concurrent.futures.Future[MessageId]], None] | None = None,
        sequence_id: int | None = None,
    ) -> concurrent.futures.Future[MessageId]:
        """Queue one message; the future resolves to its MessageId.

        ``deliver_at`` (ms since the epoch) or ``deliver_after`` (seconds) hold the message
        back on shared subscriptions until then.
        """
        h = self._handle
        fut: MessageFuture
        if deliver_at is None and deliver_after is None and sequence_id is None:
            with self._lock:
                if h.closed or h.outstanding >= self._max_pending:
                    self._wait_for_space()
                    fut = h.logic.add(value, key, properties, event_time, 0, None, _make_future)
                else:
                    fut = h.logic.add_plain(value, key, properties, event_time)
                h.outstanding += 1
        else:
            when = deliver_time(deliver_at, deliver_after)
            with self._lock:
                self._wait_for_space()
                fut = h.logic.add(
                    value, key, properties, event_time, when, None, _make_future, sequence_id
                )
                h.outstanding += 1
        if callback is not None:
            fut.add_done_callback(callback)
        return fut

    @takes_options(ArrowSendOptions)
    def send_arrow(self, arrow: ArrowSendOptions) -> list[concurrent.futures.Future[EntryReceipt]]:
        """Queue the rows of a ``pyarrow.Table`` or ``RecordBatch``, one message per row,
        built straight from its buffers; returns one future per entry (a batch of rows,
        split as ``batching_max_messages`` / ``batching_max_bytes`` split single
        messages), each resolving to the entry's :class:`EntryReceipt`.

        Column names: ``value`` (binary or string, no nulls), ``key`` (binary or string,
        nulls: no key), ``properties`` (map<string, string>), ``event_time`` (a timestamp,
        or int64 ms since the epoch; null or 0: not set). Like ``send_async`` it returns
        once the rows are queued (waiting while ``max_pending_messages`` rows are
        pending); ``flush()`` or ``concurrent.futures.wait`` waits for the receipts.
        """
        arrow_module()
        h = self._handle
        with self._lock:
            self._wait_for_space()
            completions = h.logic.add_arrow(
                arrow,
                lambda partition, count: EntryCompletion(partition, count, h.batch_done),
            )
            h.outstanding += sum(c.num_rows for c in completions)
        return [c.future for c in completions]

    def _wait_for_space(self) -> None:
        """Under the lock: wait for queue space, or fail (closed, full and not blocking,
        or still full after ``send_timeout``)."""
        h = self._handle
        if h.closed:
            raise AlreadyClosed("producer is closed")
        if h.outstanding >= self._max_pending:
            if not self._block:
                raise ProducerQueueFull(
                    f"{h.outstanding} messages pending (max_pending_messages={self._max_pending})"
                )
            deadline = time.monotonic() + self._send_timeout
            while h.outstanding >= self._max_pending:
                left = deadline - time.monotonic()
                if left <= 0 or h.closed:
                    raise Timeout("producer queue stayed full")
                self._space.wait(left)

    def flush(self) -> None:
        """Send what is batched and wait until every pending message is acknowledged."""
        with self._lock:
            self._handle.logic.seal_all()
        self._thread.call(self._handle.flush)

    def close(self) -> None:
        """Refuse new messages (AlreadyClosed, also to senders waiting for queue space),
        send what is batched, wait for every pending receipt, then detach."""
        h = self._handle
        with self._lock:
            if h.closed:
                return
            # closed first: a send from another thread from here on raises AlreadyClosed
            # (one let in after the flush went into a batch nothing would seal)
            h.closed = True
            self._space.notify_all()
        try:
            self.flush()
        finally:
            self._thread.call(h.close)


def _last_id(rb: Any) -> MessageId:
    """The MessageId of a received record batch's last row."""
    return MessageId.deserialize(rb.column("message_id")[rb.num_rows - 1].as_py())


def _make_future(core: ProducerCore) -> MessageFuture:
    return MessageFuture(core.batch_state(), len(core))


class _Receiving:
    _handle: ConsumerHandle

    def __init__(self, thread: EngineThread) -> None:
        self._thread = thread
        #: the handle takes this lock too; ``receive()`` takes the RLock alone (in C)
        self._rlock = threading.RLock()
        self._lock = threading.Condition(self._rlock)
        #: with a listener: the threads it runs on, whether a turn of this consumer is
        #: queued or running there, whether close stopped it, and the thread calling it now
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._scheduled = False
        self._listener_stopped = False
        self._listener_thread: int | None = None

    def _notify(self) -> None:
        with self._lock:
            self._lock.notify_all()
            if self._pool is not None:
                self._schedule()

    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self._thread.soon(fn, *args)

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- message listener ---------------------------------------------------------------

    def _start_listener(self, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        with self._lock:
            self._pool = pool
            self._schedule()

    def _schedule(self) -> None:
        """Under the lock: queue a turn of this consumer's listener, unless one is queued
        or running (one message at a time per consumer), it is stopped or paused."""
        if self._scheduled or self._listener_stopped or self._handle.paused:
            return
        assert self._pool is not None
        self._scheduled = True
        try:
            self._pool.submit(self._listener_turn)
        except RuntimeError:  # the pool is shut down: the client is closing
            self._scheduled = False

    def _listener_turn(self) -> None:
        """A listener thread: hand up to ``_LISTENER_TURN`` messages to the listener."""
        h = self._handle
        fn = h.listener
        for _ in range(_LISTENER_TURN):
            with self._lock:
                if self._listener_stopped or h.closed or h.paused:
                    self._scheduled = False
                    return
                msgs, grants = h.receive_nowait(1, self._thread.now())
                if msgs:
                    self._listener_thread = threading.get_ident()
                else:
                    self._scheduled = False
            # also with no message: the chunks of one not complete yet took permits
            for engine, permits in grants:
                with contextlib.suppress(AlreadyClosed):
                    self._thread.soon(engine.flow, permits)
            if not msgs:
                return
            msg = msgs[0]
            try:
                h.listener_taken(msg)
                fn(self, msg)  # type: ignore[misc]
            except Exception as exc:
                h.listener_failed(msg, exc, self._thread.now())
            finally:
                with self._lock:
                    self._listener_thread = None
                    self._lock.notify_all()
        with self._lock:  # more to do: behind the other consumers' turns
            self._scheduled = False
            self._schedule()

    def _stop_listener(self) -> None:
        """No message goes to the listener from now on; wait for the running call to
        return (unless this is the listener itself, closing its consumer)."""
        with self._lock:
            self._listener_stopped = True
            me = threading.get_ident()
            while self._listener_thread is not None and self._listener_thread != me:
                self._lock.wait()

    def batch_receive(
        self, max_messages: int = 1000, timeout: float | None = None
    ) -> list[Message]:
        msgs: list[Message] = self._receive(self._handle.receive_nowait, max_messages, timeout)
        return msgs

    def receive(self, timeout: float | None = None) -> Message:
        """The next message; raises pigeon.client.Timeout after ``timeout`` seconds."""
        h = self._handle
        if h.listener is None and not h.closed:
            with self._rlock:  # a message split off its entry already: no clock, no wait
                got = h.receive_one_nowait()
            if got is not None:
                msg, grants = got
                for engine, permits in grants:
                    self._thread.soon(engine.flow, permits)
                return msg
        msgs: list[Message] = self._receive(h.receive_nowait, 1, timeout)
        return msgs[0]

    def receive_arrow(self, max_rows: int = 10_000, timeout: float | None = None) -> Any:
        """Up to ``max_rows`` messages as a ``pyarrow.RecordBatch`` (at least one row;
        Timeout after ``timeout`` seconds) with the Spark source's columns: key, value,
        topic, partition, offset, message_id, publish_time, event_time, properties.

        The rows come from one received entry and the ``value`` and ``key`` columns are
        views of it (no copy); gather several calls with ``pyarrow.Table.from_batches``.
        Acknowledge with :meth:`acknowledge_arrow` or ``acknowledge_cumulative`` of the
        last row's id (``MessageId.deserialize(batch["message_id"][-1].as_py())``)."""
        return self._receive(self._handle.receive_arrow_nowait, max_rows, timeout)

    def _receive(
        self,
        take: Callable[[int, float], tuple[Any, list[tuple[Any, int]]]],
        n: int,
        timeout: float | None,
    ) -> Any:
        """What ``take(n, now)`` returns first that is not empty (a non-empty list of
        messages or a record batch); raises Timeout after ``timeout`` seconds."""
        h = self._handle
        if h.listener is not None:
            h.refuse_receive()
        deadline = time.monotonic() + (timeout if timeout is not None else math.inf)
        with self._lock:
            while True:
                if h.closed:
                    raise AlreadyClosed("consumer is closed")
                got, grants = take(n, self._thread.now())
                for engine, permits in grants:
                    self._thread.soon(engine.flow, permits)
                if got:  # a record batch has at least one row
                    return got
                if h.failure is not None:
                    raise h.failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"no message within {timeout}s")
                self._lock.wait(None if math.isinf(left) else min(left, 1.0))

    def seek(
        self,
        target: MessageId | None = None,
        *,
        offset: int | None = None,
        timestamp: int | None = None,
    ) -> None:
        """Move to a MessageId, a partition offset, or a publish time (ms since the epoch)."""
        self._thread.call(self._handle.seek, target, offset, timestamp)

    def close(self) -> None:
        h = self._handle
        if h.closed:
            return
        if h.listener is not None:
            self._stop_listener()
        try:
            self._thread.call(h.close)
        finally:
            h.closed = True
            self._notify()


class Consumer(ConsumerFace, _Receiving):
    """Receives messages of one subscription. Thread-safe."""

    def __enter__(self) -> Consumer:
        return self

    def __iter__(self) -> Iterator[Message]:
        while True:
            yield self.receive()

    def acknowledge(self, message: Message | MessageId) -> None:
        """Acknowledge one message (sent to the broker in groups, every 100 ms; with
        ``ack_receipt_enabled``, returns once the broker stored it)."""
        mid = message_id_of(message)
        if self._handle.ack_receipts:
            self._thread.call(self._handle.acknowledge_with_receipt, mid, False)
        elif self._handle.acknowledge(mid):
            self._thread.soon(self._handle.flush_acks_nowait)

    def acknowledge_cumulative(self, message: Message | MessageId) -> None:
        """Acknowledge this message and every earlier one of its partition."""
        mid = message_id_of(message)
        if self._handle.ack_receipts:
            self._handle.check_cumulative()
            self._thread.call(self._handle.acknowledge_with_receipt, mid, True)
        else:
            self._handle.acknowledge_cumulative(mid)

    def acknowledge_arrow(self, batch: Any) -> None:
        """Acknowledge every row of a record batch from :meth:`receive_arrow` (one
        acknowledgement per run of consecutive rows of an entry, not one per row)."""
        runs = arrow_module().ack_runs(batch)
        if self._handle.ack_receipts:
            self._thread.call(self._handle.acknowledge_runs_with_receipt, runs)
        elif self._handle.acknowledge_runs(runs):
            self._thread.soon(self._handle.flush_acks_nowait)

    def negative_acknowledge(self, message: Message) -> None:
        """Ask for this message again after ``negative_ack_redelivery_delay`` seconds."""
        self._handle.negative_acknowledge(message, self._thread.now())

    def reconsume_later(self, message: Message, delay: float) -> None:
        """Republish to the retry topic, delivered after ``delay`` seconds; acknowledge."""
        self._thread.call(self._handle.reconsume_later, message, delay)

    def redeliver_unacknowledged_messages(self) -> None:
        self._thread.call(self._handle.redeliver_unacknowledged)

    def unsubscribe(self) -> None:
        self._thread.call(self._handle.unsubscribe)
        self._notify()


class Reader(_Receiving):
    """Reads a topic from a position, without a durable subscription."""

    def __enter__(self) -> Reader:
        return self

    def read_next(self, timeout: float | None = None) -> Message:
        msg = self.receive(timeout)
        self._handle.acknowledge_cumulative(msg.message_id)
        return msg

    def read_arrow(self, max_rows: int = 10_000, timeout: float | None = None) -> Any:
        """The next rows as a ``pyarrow.RecordBatch`` (see ``Consumer.receive_arrow``);
        the reader moves past them."""
        rb = self.receive_arrow(max_rows, timeout)
        self._handle.acknowledge_cumulative(_last_id(rb))
        return rb

    def has_message_available(self) -> bool:
        result: bool = self._thread.call(self._handle.has_message_available)
        return result


class TableView(TableViewBase):
    """The latest value of every key of a topic, kept up to date.  Thread-safe;
    listeners run on the client's engine thread (keep them short)."""

    def __init__(self, thread: EngineThread) -> None:
        self._thread = thread
        self._core = TableViewCore(call_here)

    def __enter__(self) -> TableView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._core.closed and not self._thread.closed:
            self._thread.call(self._core.close)
