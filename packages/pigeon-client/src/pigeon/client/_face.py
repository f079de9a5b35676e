"""What the faces share: the Client's engine, plugins and codecs (all three faces), and
the Consumer and Reader methods of the two async faces (trio and asyncio).

A face's Client adds its calling convention (a blocking call into the engine's thread, an
awaited asyncio bridge, or a plain ``await`` in the caller's trio run); its
``create_producer`` / ``subscribe`` / ``create_reader`` take their options' signatures
(:func:`pigeon.client._options.takes_options`) and open through one engine-side function,
:func:`pigeon.client.trio.open_face`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Self

from pigeon.client._consumer_handle import ConsumerFace, ConsumerHandle
from pigeon.client._core import arrow_module, message_id_of
from pigeon.client._engine import ClientEngine
from pigeon.client._handles import codecs_of
from pigeon.client._message import Message, MessageId
from pigeon.core import PluginManager
from pigeon.core.auth import ClientAuthentication
from pigeon.core.errors import AlreadyClosed, InvalidArgument, Timeout

__all__ = ["AsyncConsumer", "AsyncReader", "AsyncReceiving", "ClientBase"]

log = logging.getLogger(__name__)


class ClientBase:
    """The engine (not connected yet), the plugins and the codecs they registered.

    ``service_url``: ``pigeon://host:port[,host:port...]``, or ``pigeon+ssl://...`` for
    TLS.  With Pulsar's names: ``authentication`` (``AuthenticationToken(token)``, a
    callable or ``"file:///path"`` read again for each new connection, or
    ``AuthenticationTLS(cert, key)``) is presented on every connection;
    ``tls_trust_certs_file_path`` holds the CAs that sign the brokers' certificates (the
    system's without it); ``tls_validate_hostname`` (on by default, unlike Pulsar) checks
    that a broker's certificate names the host dialled; ``tls_allow_insecure_connection``
    accepts any certificate (tests only).  A refused certificate (``TlsError``) or
    credentials (``AuthenticationError``, ``AuthorizationError``) fail at once: no retry
    can fix them.  ``message_listener_threads`` (Pulsar's name) sizes the sync face's pool
    of threads that run message listeners; the trio and asyncio faces run each consumer's
    listener as a task and take it only for a common signature.
    """

    def __init__(
        self,
        service_url: str,
        *,
        authentication: ClientAuthentication | None = None,
        tls_trust_certs_file_path: str | None = None,
        tls_validate_hostname: bool = True,
        tls_allow_insecure_connection: bool = False,
        operation_timeout: float = 30.0,
        message_listener_threads: int = 1,
        plugins: PluginManager | None = None,
    ) -> None:
        if (
            not isinstance(message_listener_threads, int)
            or isinstance(message_listener_threads, bool)
            or message_listener_threads < 1
        ):
            raise InvalidArgument(
                f"message_listener_threads must be an int >= 1, got {message_listener_threads!r}"
            )
        self.message_listener_threads = message_listener_threads
        self.engine = ClientEngine(
            service_url,
            operation_timeout=operation_timeout,
            authentication=authentication,
            tls_trust_certs_file_path=tls_trust_certs_file_path,
            tls_validate_hostname=tls_validate_hostname,
            tls_allow_insecure_connection=tls_allow_insecure_connection,
        )
        self.plugins = plugins or PluginManager()
        self.codecs = codecs_of(self.plugins)
        self._start()

    def _start(self) -> None:
        """The face's own start, once the engine exists (the sync and asyncio faces start
        the engine's thread here)."""


class AsyncReceiving:
    """The receiving half of the trio and asyncio faces' Consumer and Reader.

    The face supplies, in a class before this one, how it reaches the engine
    (``_engine``, ``_soon``, ``_close_handle``), its clocks (``_now``: the engine's, for
    ack timeouts and nacks; ``_clock``: the one receive deadlines are on) and how it
    waits for messages (``_arm`` before looking, ``_wait_until`` a deadline); its
    ``_notify`` sets ``_arrived``.
    """

    _handle: ConsumerHandle
    _arrived: Any  # a trio.Event or an asyncio.Event
    #: with a message listener: set by close before anything else (no message is handed
    #: to the listener after it), and the call running now (its task, and an event set
    #: when it returns)
    _listener_stopped = False
    _listener_task: Any = None
    _listener_idle: Any = None

    async def _engine(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        raise NotImplementedError

    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        raise NotImplementedError

    async def _close_handle(self) -> None:
        raise NotImplementedError

    def _now(self) -> float:
        raise NotImplementedError

    def _clock(self) -> float:
        raise NotImplementedError

    def _arm(self) -> None:
        raise NotImplementedError

    async def _wait_until(self, deadline: float) -> None:
        raise NotImplementedError

    def _current_task(self) -> Any:
        raise NotImplementedError

    def _new_event(self) -> Any:
        raise NotImplementedError

    async def _run_listener(self) -> None:
        """The listener's task: hand each message to the listener, one at a time, in order.

        Nothing awaits between the stop check and the listener's call, so once ``close``
        set ``_listener_stopped`` no further message is handed over.
        """
        h = self._handle
        fn = h.listener
        self._listener_task = self._current_task()
        try:
            while True:
                self._arm()  # before looking, so no wake-up is lost
                if self._listener_stopped or h.closed:
                    return
                if not h.paused:
                    msgs, grants = h.receive_nowait(1, self._now())
                    for engine, permits in grants:
                        with contextlib.suppress(AlreadyClosed):
                            self._soon(engine.flow, permits)
                    if msgs:
                        await self._listen(fn, msgs[0])
                        continue
                    if h.failure is not None:
                        log.error(
                            "message listener stops sub=%s error=%s", h.subscription, h.failure
                        )
                        return
                await self._wait_until(math.inf)
        except Exception:
            log.exception("message listener task failed sub=%s", h.subscription)

    async def _listen(self, fn: Any, msg: Message) -> None:
        h = self._handle
        self._listener_idle = self._new_event()
        try:
            h.listener_taken(msg)
            result = fn(self, msg)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            h.listener_failed(msg, exc, self._now())
        finally:
            idle, self._listener_idle = self._listener_idle, None
            idle.set()

    async def _stop_listener(self) -> None:
        """No message goes to the listener from now on; wait for the running call to
        return (unless this is the listener itself, closing its consumer)."""
        self._listener_stopped = True
        self._arrived.set()
        idle = self._listener_idle
        if idle is not None and self._current_task() is not self._listener_task:
            await idle.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def batch_receive(
        self,
        max_messages: int = 1000,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> list[Message]:
        """Up to ``max_messages`` messages, at least one; raises Timeout after ``timeout`` s."""
        msgs: list[Message] = await self._receive(
            self._handle.receive_nowait, max_messages, timeout
        )
        return msgs

    async def receive(self, timeout: float | None = None) -> Message:  # noqa: ASYNC109
        """The next message; raises pigeon.client.Timeout after ``timeout`` seconds."""
        msgs: list[Message] = await self._receive(self._handle.receive_nowait, 1, timeout)
        return msgs[0]

    async def receive_arrow(
        self,
        max_rows: int = 10_000,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """Up to ``max_rows`` messages as a ``pyarrow.RecordBatch`` whose value and key
        columns are views of one received entry (see the sync face's ``receive_arrow``)."""
        return await self._receive(self._handle.receive_arrow_nowait, max_rows, timeout)

    async def _receive(
        self,
        take: Callable[[int, float], tuple[Any, list[tuple[Any, int]]]],
        n: int,
        timeout: float | None,  # noqa: ASYNC109
    ) -> Any:
        """What ``take(n, now)`` returns first that is not empty (a non-empty list of
        messages or a record batch); raises Timeout after ``timeout`` seconds."""
        h = self._handle
        if h.listener is not None:
            h.refuse_receive()
        deadline = self._clock() + (timeout if timeout is not None else math.inf)
        while True:
            self._arm()  # before looking, so no wake-up is lost
            if h.closed:
                raise AlreadyClosed("consumer is closed")
            got, grants = take(n, self._now())
            for engine, permits in grants:
                with contextlib.suppress(AlreadyClosed):
                    self._soon(engine.flow, permits)
            if got:  # a record batch has at least one row
                return got
            if h.failure is not None:
                raise h.failure
            if self._clock() >= deadline:
                raise Timeout(f"no message within {timeout}s")
            await self._wait_until(deadline)

    async def seek(
        self,
        target: MessageId | None = None,
        *,
        offset: int | None = None,
        timestamp: int | None = None,
    ) -> None:
        """Move to a MessageId, a partition offset, or a publish time (ms since the epoch)."""
        await self._engine(self._handle.seek, target, offset, timestamp)

    async def close(self) -> None:
        if self._handle.closed:
            return
        if self._handle.listener is not None:
            await self._stop_listener()
        try:
            await self._close_handle()
        finally:
            self._mark_closed()

    def _mark_closed(self) -> None:
        self._handle.closed = True
        self._arrived.set()


class AsyncConsumer(ConsumerFace, AsyncReceiving):
    """What the trio and asyncio faces' Consumers offer (see :class:`AsyncReceiving`)."""

    async def acknowledge(self, message: Message | MessageId) -> None:
        """Acknowledge one message (sent to the broker in groups, every 100 ms; with
        ``ack_receipt_enabled``, returns once the broker stored it)."""
        mid = message_id_of(message)
        if self._handle.ack_receipts:
            await self._engine(self._handle.acknowledge_with_receipt, mid, False)
        elif self._handle.acknowledge(mid):
            self._soon(self._handle.flush_acks_nowait)

    async def acknowledge_cumulative(self, message: Message | MessageId) -> None:
        """Acknowledge this message and every earlier one of its partition."""
        mid = message_id_of(message)
        if self._handle.ack_receipts:
            self._handle.check_cumulative()
            await self._engine(self._handle.acknowledge_with_receipt, mid, True)
        else:
            self._handle.acknowledge_cumulative(mid)

    async def acknowledge_arrow(self, batch: Any) -> None:
        """Acknowledge every row of a record batch from :meth:`receive_arrow` (one
        acknowledgement per run of consecutive rows of an entry, not one per row)."""
        runs = arrow_module().ack_runs(batch)
        if self._handle.ack_receipts:
            await self._engine(self._handle.acknowledge_runs_with_receipt, runs)
        elif self._handle.acknowledge_runs(runs):
            self._soon(self._handle.flush_acks_nowait)

    async def negative_acknowledge(self, message: Message) -> None:
        """Ask for this message again after ``negative_ack_redelivery_delay`` seconds."""
        self._handle.negative_acknowledge(message, self._now())

    async def reconsume_later(self, message: Message, delay: float) -> None:
        """Republish to the retry topic, delivered after ``delay`` seconds; acknowledge."""
        await self._engine(self._handle.reconsume_later, message, delay)

    async def redeliver_unacknowledged_messages(self) -> None:
        """Have the broker send again every message received but not acknowledged."""
        await self._engine(self._handle.redeliver_unacknowledged)

    async def unsubscribe(self) -> None:
        try:
            await self._engine(self._handle.unsubscribe)
        finally:
            self._arrived.set()


class AsyncReader(AsyncReceiving):
    """What the trio and asyncio faces' Readers offer (see :class:`AsyncReceiving`)."""

    async def read_next(self, timeout: float | None = None) -> Message:  # noqa: ASYNC109
        msg = await self.receive(timeout)
        self._handle.acknowledge_cumulative(msg.message_id)
        return msg

    async def read_arrow(
        self,
        max_rows: int = 10_000,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """The next rows as a ``pyarrow.RecordBatch`` (see ``receive_arrow``); the reader
        moves past them."""
        rb = await self.receive_arrow(max_rows, timeout)
        last = rb.column("message_id")[rb.num_rows - 1].as_py()
        self._handle.acknowledge_cumulative(MessageId.deserialize(last))
        return rb

    async def has_message_available(self) -> bool:
        result: bool = await self._engine(self._handle.has_message_available)
        return result
