"""The Kafka front door: the Kafka wire protocol (port 9092) over the broker core.

A Kafka topic ``orders`` is the partitioned topic ``persistent://<namespace>/orders``
(namespace ``[kafka] namespace``, default ``public/default``), Kafka partition N its
partition N, and the Kafka offset the continuous offset.  A consumer group is a
subscription of each partition it commits (see :mod:`pigeon.broker._kafka_offsets`).

Each connection reads requests in order and answers them in order, as a Kafka broker
does: a request's handler runs at once in the reading task (so produce requests reach
the log in the order they were sent), and whatever it must wait for (storage, a
long-poll fetch, a group rebalance) it returns as a :class:`Later` that a writer task
awaits in turn.  The handlers are in ``_kafka_produce``, ``_kafka_fetch``,
``_kafka_topics``, ``_kafka_offsets`` and ``_kafka_group_api``; the framing and message
types in ``_kafka_wire``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._config import KafkaConfig
from pigeon.broker._kafka_wire import (
    API_VERSIONS,
    API_VERSIONS_KEY,
    ZERO,
    Encoded,
    Later,
    UnsupportedApi,
    build,
    decode_request,
    encode_response,
    foreign_client,
    part,
)
from pigeon.core import TopicName
from pigeon.core.errors import InvalidTopicName, MalformedRequest, PigeonError
from pigeon.core.rpc import listen_tcp

if TYPE_CHECKING:
    from pigeon.broker._service import BrokerService
    from pigeon.broker._topic import Producer

__all__ = ["KafkaFrontDoor"]

log = logging.getLogger(__name__)

_I32 = struct.Struct(">i")
#: requests read ahead of their answers on one connection (librdkafka sends up to 5)
MAX_IN_FLIGHT = 64
#: a request larger than this is a client on the wrong port or garbage
MAX_REQUEST_SIZE = 100 * 1024 * 1024
#: how much of a connection's first bytes are looked at to tell another protocol
SNIFF_BYTES = 64 * 1024
#: a request that stops arriving part way for this long closes its connection (a client
#: holding a half-sent request ties up its buffer: Kafka's request timeout is 30 s)
PARTIAL_REQUEST_TIMEOUT_S = 60.0


Handler = Callable[["KafkaConnection", Any], Awaitable[Any]]


@dataclass(eq=False)
class KafkaConnection:
    """One client connection: its stream, and the producers it attached per partition."""

    door: KafkaFrontDoor
    stream: trio.SocketStream
    name: str
    client_id: str = ""
    nursery: trio.Nursery = None  # type: ignore[assignment]
    #: (partition topic, producer key) -> attached producer
    producers: dict[tuple[str, str], Producer] = field(default_factory=dict)
    closed: bool = False
    ident: int = 0
    #: sequence ids of the non-idempotent producers' batches (no de-duplication)
    sequence: int = 0

    def close(self) -> None:
        self.closed = True
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    def spawn(self, fn: Callable[[], Awaitable[Any]]) -> Later[Any]:
        """Run ``fn`` in a task of this connection; its result is the answer."""
        later: Later[Any] = Later()

        async def run() -> None:
            try:
                later.set(await fn())
            except BaseException:
                later.set(None)
                raise

        self.nursery.start_soon(run)
        return later


class KafkaFrontDoor:
    """Serves the Kafka protocol for one broker (a :class:`~pigeon.broker._service.FrontDoor`)."""

    def __init__(self, core: BrokerService, config: KafkaConfig) -> None:
        from pigeon.broker import _kafka_fetch, _kafka_offsets, _kafka_produce, _kafka_topics
        from pigeon.broker._kafka_group import GroupCoordinator
        from pigeon.broker._kafka_group_api import GROUP_HANDLERS

        self.core = core
        self.config = config
        self.conns: set[KafkaConnection] = set()
        self.address: tuple[str, int] | None = None
        self._listeners: list[trio.SocketListener] = []
        self.groups = GroupCoordinator(
            group_initial_rebalance_delay_ms=config.group_initial_rebalance_delay_ms
        )
        self._ids = itertools.count(1)
        self.handlers: dict[int, Handler] = {API_VERSIONS_KEY: self._api_versions}
        for module in (_kafka_produce, _kafka_fetch, _kafka_topics, _kafka_offsets):
            self.handlers.update(module.HANDLERS)
        for key, (_lo, _hi, handler) in GROUP_HANDLERS.items():
            self.handlers[key] = self._group_handler(handler)
        missing = set(API_VERSIONS) - set(self.handlers)
        assert not missing, f"Kafka APIs without a handler: {missing}"
        #: per-door state the handler modules keep (producer epochs, fetch positions)
        self.state: dict[str, Any] = {}

    # ------------------------------------------------------------------ FrontDoor

    @property
    def connections(self) -> int:
        return len(self.conns)

    def close_all(self) -> None:
        for conn in list(self.conns):
            conn.close()

    def detach(self, topic: Any, reason: str, *, subscription: Any = None) -> int:
        """Drop the producers attached to ``topic``: the next produce attaches again (and
        is told NOT_LEADER_OR_FOLLOWER if the topic moved).  Kafka consumers attach
        nothing: a fetch reads the topic wherever it is served."""
        if subscription is not None:
            return 0
        count = 0
        for conn in self.conns:
            for key, producer in list(conn.producers.items()):
                if producer.topic is topic:
                    del conn.producers[key]
                    self.core.close_producer(producer)
                    count += 1
        return count

    # ------------------------------------------------------------------ names

    @property
    def advertised(self) -> tuple[str, int]:
        assert self.address is not None
        return (
            self.config.advertised_host or self.address[0],
            self.config.advertised_port or self.address[1],
        )

    @property
    def advertised_address(self) -> str:
        """``host:port`` Kafka clients are told to connect to."""
        host, port = self.advertised
        return f"{host}:{port}"

    def topic_name(self, kafka_topic: str) -> TopicName:
        """The partitioned topic a Kafka topic is; InvalidTopicName for a bad name."""
        if not kafka_topic or "/" in kafka_topic or kafka_topic in (".", ".."):
            raise InvalidTopicName(f"{kafka_topic!r} is not a valid Kafka topic name")
        name = TopicName.parse(f"persistent://{self.config.namespace}/{kafka_topic}")
        if name.partition_index >= 0:
            raise InvalidTopicName(
                f"{kafka_topic!r} names a partition of {name.base.local!r}: a Kafka topic"
                " name may not end in -partition-<n>"
            )
        return name

    def partition_name(self, kafka_topic: str, partition: int) -> TopicName:
        return self.topic_name(kafka_topic).partition(partition)

    # ------------------------------------------------------------------ serving

    async def listen(self) -> tuple[str, int]:
        """Bind the listener (connections wait in its backlog until :meth:`serve`)."""
        host = self.config.host or self.core.config.host
        self._listeners = await listen_tcp(self.config.port, host, "the Kafka listener")
        sockname = self._listeners[0].socket.getsockname()
        self.address = (sockname[0], sockname[1])
        return self.address

    async def serve(self, *, task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        """Accept and serve connections (after :meth:`listen`) until cancelled."""
        assert self.address is not None, "listen() first"
        async with trio.open_nursery() as nursery:
            await nursery.start(self.groups.run)
            await nursery.start(trio.serve_listeners, self._handle, self._listeners)
            log.info("kafka serving address=%s:%s", *self.address)
            task_status.started(self.address)

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()
            name = f"{peer[0]}:{peer[1]}"
        except OSError:
            name = "unknown"
        conn = KafkaConnection(self, stream, name, ident=next(self._ids))
        self.conns.add(conn)
        try:
            async with trio.open_nursery() as nursery:
                conn.nursery = nursery
                await self._serve(conn)
                nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away (the nursery wraps it in an ExceptionGroup)
        except* Exception:
            # a bug answering one client must not take the listener (and the broker) down
            log.exception("kafka connection failed conn=%s client=%s", conn.name, conn.client_id)
        finally:
            conn.closed = True
            self.conns.discard(conn)
            for producer in conn.producers.values():
                self.core.close_producer(producer)
            conn.producers.clear()
            with contextlib.suppress(Exception):
                await trio.aclose_forcefully(stream)

    async def _serve(self, conn: KafkaConnection) -> None:
        send, receive = trio.open_memory_channel[tuple[int, Any]](MAX_IN_FLIGHT)
        conn.nursery.start_soon(self._write, conn, receive)
        async with send:
            try:
                async for frame in _frames(conn):
                    if not await self._request(conn, frame, send):
                        return
            except MalformedRequest as exc:
                log.warning("kafka connection closed conn=%s: %s", conn.name, exc)

    async def _request(self, conn: KafkaConnection, frame: bytearray, send: Any) -> bool:
        """Handle one request; False when the connection must close."""
        try:
            header, request = decode_request(frame)
        except UnsupportedApi as exc:
            if exc.api_key != API_VERSIONS_KEY:
                log.warning("kafka request refused conn=%s: %s", conn.name, exc)
                return False
            await send.send((exc.correlation_id, self._versions_refusal()))
            return True
        conn.client_id = header.client_id or conn.client_id
        try:
            answer = await self.handlers[header.request_api_key](conn, request)
        except PigeonError as exc:
            log.warning(
                "kafka request failed conn=%s api=%d: %s", conn.name, header.request_api_key, exc
            )
            return False
        if answer is not None:
            await send.send((header.correlation_id, answer))
        return True

    async def _write(self, conn: KafkaConnection, receive: Any) -> None:
        sock = conn.stream.socket
        async with receive:
            async for correlation_id, answer in receive:
                if isinstance(answer, Later):
                    answer = await answer.wait()
                if answer is None:  # acks=0 produce, or a task that failed
                    continue
                if isinstance(answer, Encoded):
                    await _send(sock, answer.buffers(correlation_id))
                else:
                    await _send(sock, [encode_response(correlation_id, answer)])

    # ------------------------------------------------------------------ ApiVersions

    async def _api_versions(self, conn: KafkaConnection, request: Any) -> Any:
        return self._versions_answer(type(request), error=0)

    def _versions_refusal(self) -> Any:
        from kio.schema.api_versions.v0.request import ApiVersionsRequest

        return self._versions_answer(ApiVersionsRequest, error=35)  # UNSUPPORTED_VERSION

    @staticmethod
    def _versions_answer(request_type: type, *, error: int) -> Any:
        from kio.index import load_response_from_request
        from kio.schema.errors import ErrorCode

        cls = load_response_from_request(request_type)
        keys = tuple(
            part(cls, "ApiVersion", api_key=k, min_version=lo, max_version=hi)
            for k, (lo, hi) in sorted(API_VERSIONS.items())
        )
        return build(cls, error_code=ErrorCode(error), api_keys=keys, throttle_time=ZERO)

    def _group_handler(self, handler: Any) -> Handler:
        from pigeon.broker._kafka_offsets import coordinates

        async def run(conn: KafkaConnection, request: Any) -> Any:
            group = getattr(request, "group_id", None)
            if group is not None and not await coordinates(self, group):
                # another broker holds the group's bundle: the client asks FindCoordinator
                return _not_coordinator(request)
            host = conn.name.rpartition(":")[0]
            return conn.spawn(
                lambda: handler(self.groups, request, client_id=conn.client_id, client_host=host)
            )

        return run


#: the fields of a group answer besides its error code, by API key
_GROUP_REFUSAL: dict[int, dict[str, Any]] = {
    11: {
        "generation_id": -1,
        "protocol_type": None,
        "protocol_name": "",
        "leader": "",
        "skip_assignment": False,
        "member_id": "",
        "members": (),
    },
    12: {},
    13: {"members": ()},
    14: {"protocol_type": None, "protocol_name": None, "assignment": b""},
}


def _not_coordinator(request: Any) -> Any:
    from kio.schema.errors import ErrorCode

    from pigeon.broker._kafka_wire import response_type

    cls: Any = response_type(request)
    fields = _GROUP_REFUSAL[cls.__api_key__]
    return build(cls, throttle_time=ZERO, error_code=ErrorCode.not_coordinator, **fields)


#: bytes asked of the socket at a time for small requests and the size prefixes
_READ = 65536


async def _frames(conn: KafkaConnection) -> Any:
    """The request frames of a connection (without their size prefix), until it ends.

    Small requests are cut from a read buffer; a request larger than it is received
    straight into a buffer of its own size (``recv_into``), so a produce request's
    records are copied once from the kernel and never again here.

    :raises MalformedRequest: a size no Kafka request has (another protocol: an HTTP or
        PigeonMQ client is told so in its own protocol first), the peer closed in the
        middle of a request, or sent none of the rest of one for
        :data:`PARTIAL_REQUEST_TIMEOUT_S`.
    """
    sock = conn.stream.socket
    buf = bytearray(_READ)
    view = memoryview(buf)
    start = end = 0  # buf[start:end] is received and not yet framed
    first = True
    while True:
        if end - start >= 4:
            (size,) = _I32.unpack_from(buf, start)
            wrong = size < 0 or size > MAX_REQUEST_SIZE
            if wrong or (first and end - start < 4 + size):
                # a PigeonMQ frame's little-endian size can read as a plausible one
                head = bytes(buf[start : start + SNIFF_BYTES])
                what, reply = foreign_client(head) if first else ("garbage", b"")
                if wrong or reply:
                    if reply:
                        with contextlib.suppress(
                            trio.BrokenResourceError, trio.ClosedResourceError
                        ):
                            await conn.stream.send_all(reply)
                    raise MalformedRequest(
                        f"a request of {size} bytes is {what}, not the Kafka protocol"
                        f" (first bytes {head[:16]!r})"
                    )
            if end - start >= 4 + size:
                first = False
                yield buf[start + 4 : start + 4 + size]
                start += 4 + size
                continue
            if 4 + size > _READ:
                # a large request: into its own buffer, past what is already here
                frame = bytearray(size)
                have = end - start - 4
                frame[:have] = view[start + 4 : end]
                start = end = 0
                fview = memoryview(frame)
                while have < size:
                    n = await _recv_partial(sock, fview[have:], have + 4)
                    have += n
                del fview
                first = False
                yield frame
                continue
        if start:  # move the partial request to the front
            buf[: end - start] = buf[start:end]
            end -= start
            start = 0
        if end:
            end += await _recv_partial(sock, view[end:], end)
        else:
            n = await _recv_into(sock, view)
            if not n:
                return
            end = n


async def _recv_partial(sock: Any, into: memoryview, have: int) -> int:
    """More bytes of a request ``have`` bytes into it: neither an end of the stream nor a
    pause of :data:`PARTIAL_REQUEST_TIMEOUT_S` is allowed there."""
    with trio.move_on_after(PARTIAL_REQUEST_TIMEOUT_S):
        n = await _recv_into(sock, into)
        if not n:
            raise MalformedRequest(f"the client closed the connection {have} bytes into a request")
        return n
    raise MalformedRequest(
        f"no more of a request came for {PARTIAL_REQUEST_TIMEOUT_S:.0f} s ({have} bytes in)"
    )


#: buffers per vectored write (IOV_MAX is 1024 on Linux)
_MAX_IOV = 512


async def _send(sock: Any, buffers: list[Any]) -> None:
    """Write ``buffers`` in order with vectored writes (no join, no copy)."""
    try:
        while buffers:
            chunk = buffers[:_MAX_IOV]
            sent = await sock.sendmsg(chunk)
            while chunk and sent >= len(chunk[0]):
                sent -= len(chunk.pop(0))
            if sent:  # the rest of a partly written buffer: a view, not a copy
                chunk[0] = memoryview(chunk[0])[sent:]
            buffers = chunk + buffers[_MAX_IOV:]
    except OSError as exc:
        raise trio.BrokenResourceError(f"Kafka client connection lost: {exc}") from exc


async def _recv_into(sock: Any, into: memoryview) -> int:
    """Bytes received into ``into``; 0 at the end of the stream, or when the peer
    reset it (as ``SocketStream.receive_some`` would say)."""
    try:
        return int(await sock.recv_into(into))
    except OSError:
        return 0


def ms(value: Any) -> float:
    """A kio millisecond duration (timedelta or int) as seconds."""
    seconds = value.total_seconds() if hasattr(value, "total_seconds") else value / 1000
    return max(0.0, float(seconds)) if math.isfinite(seconds) else 0.0
