"""The client's protocol engine, on trio.

One :class:`ClientEngine` per client: a pool of broker connections, topic lookup, and the
trio-side halves of producers and consumers.  The public faces (trio, sync, asyncio) sit on
top of it; the sync and asyncio faces run it in one background thread and hand work over
per *batch*, never per message.

The trio halves of producers (:mod:`pigeon.client._producer_engine`) and consumers
(:mod:`pigeon.client._consumer_engine`) share the re-attach loop of :class:`Reconnecting`.

Producer pipeline (as aiokafka splits it): the face's accumulator builds batches; the
:class:`~pigeon.client._producer_engine.ProducerEngine` keeps every sent-but-unacknowledged
batch in sequence order, sends it on the current connection (many in flight), and after a
reconnect sends them all again under the same producer name so the broker drops the ones it
already stored.
"""

from __future__ import annotations

import functools
import itertools
import logging
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from pigeon.client._timer import PreciseTimers
from pigeon.core.auth import AuthenticationTLS, ClientAuthentication
from pigeon.core.errors import (
    AlreadyClosed,
    AuthenticationError,
    AuthorizationError,
    CodecError,
    ConnectionClosed,
    IncompatibleSchema,
    InvalidArgument,
    NotOwner,
    PigeonError,
    ProducerFenced,
    ProtocolError,
    ServiceUnavailable,
    SubscriptionBusy,
    Timeout,
    TlsError,
    TopicNotFound,
)
from pigeon.core.rpc import BrokerFrame, Connection, Request, connect_tcp, split_address
from pigeon.core.runtime import WallClock
from pigeon.core.tls import client_context

if TYPE_CHECKING:
    from pigeon.client._consumer_engine import ConsumerEngine
    from pigeon.client._producer_engine import ProducerEngine

__all__ = ["ClientEngine", "PendingBatch", "ReceivedEntry", "Reconnecting"]

log = logging.getLogger(__name__)

BatchCallback = Callable[[Any, BaseException | None], None]


_SCHEMES = {"pigeon://": False, "pigeon+ssl://": True}


def service_url_tls(url: str) -> bool:
    """Does ``url`` (``pigeon://`` or ``pigeon+ssl://``) ask for TLS?"""
    for scheme, tls in _SCHEMES.items():
        if url.startswith(scheme):
            return tls
    raise InvalidArgument(
        f"service URL must look like pigeon://host:port or pigeon+ssl://host:port, got {url!r}"
    )


def parse_service_urls(url: str) -> list[tuple[str, int]]:
    """``pigeon[+ssl]://host:port[,host:port...]`` → addresses (any broker answers lookups)."""
    tls = service_url_tls(url)
    out = []
    for part in url.split("://", 1)[1].rstrip("/").split(","):
        part = part.strip()
        try:  # the port in 1..65535 and an IPv6 host in balanced brackets, as urllib says
            parsed = urllib.parse.urlsplit("//" + part)
            port = parsed.port
        except ValueError:
            raise InvalidArgument(
                f"bad host:port {part!r} in service URL {url!r} (a port is 1 to 65535)"
            ) from None
        if port == 0 or parsed.path or parsed.query or parsed.fragment or parsed.username:
            raise InvalidArgument(
                f"bad host:port {part!r} in service URL {url!r} (a port is 1 to 65535)"
            )
        if port is None:
            if part.endswith(":"):
                raise InvalidArgument(f"bad host:port {part!r} in service URL {url!r}: no port")
            out.append((parsed.hostname or "127.0.0.1", 6651 if tls else 6650))
            continue
        out.append(split_address(part))
    return out


def parse_service_url(url: str) -> tuple[str, int]:
    return parse_service_urls(url)[0]


def check_authentication(
    authentication: ClientAuthentication | None,
) -> ClientAuthentication | None:
    """``authentication`` if it is one (``AuthenticationToken``, ``AuthenticationTLS`` or
    anything with ``auth_method`` and ``auth_data()``); a clear error otherwise."""
    if authentication is not None and not isinstance(authentication, ClientAuthentication):
        raise InvalidArgument(
            "authentication must be AuthenticationToken(...) or AuthenticationTLS(...),"
            f" got {type(authentication).__name__}"
        )
    return authentication


def tls_context(
    authentication: ClientAuthentication | None,
    *,
    trust_certs_file: str | None,
    validate_hostname: bool,
    allow_insecure: bool,
    what: str = "client TLS",
) -> ssl.SSLContext:
    """The client's TLS context: trusted CAs (the system's without a file), hostname
    verification, and the client certificate of an :class:`AuthenticationTLS`
    (``what``: the words its errors start with)."""
    cert = key = ""
    if isinstance(authentication, AuthenticationTLS):
        cert, key = authentication.certificate_path, authentication.private_key_path
    return client_context(
        trust_certs_file=trust_certs_file or "",
        certificate_file=cert,
        key_file=key,
        verify_hostname=validate_hostname,
        allow_insecure=allow_insecure,
        what=what,
    )


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
    #: batch indexes below this one were handed out already (receive_arrow took part of
    #: the entry; the rest stays queued)
    taken: int = 0


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
        authentication: ClientAuthentication | None = None,
        tls_trust_certs_file_path: str | None = None,
        tls_validate_hostname: bool = True,
        tls_allow_insecure_connection: bool = False,
    ) -> None:
        self.service_url = service_url
        self.addresses = parse_service_urls(service_url)
        self.address = self.addresses[0]
        self.authentication = check_authentication(authentication)
        self.use_tls = service_url_tls(service_url)
        if isinstance(authentication, AuthenticationTLS) and not self.use_tls:
            raise InvalidArgument(
                "AuthenticationTLS presents its certificate in the TLS handshake: use a"
                " pigeon+ssl:// service URL"
            )
        self._tls_settings = functools.partial(
            tls_context,
            authentication,
            trust_certs_file=tls_trust_certs_file_path,
            validate_hostname=tls_validate_hostname,
            allow_insecure=tls_allow_insecure_connection,
        )
        self._tls_context: ssl.SSLContext | None = None
        if self.use_tls or tls_trust_certs_file_path:
            self.tls_context()  # a missing or bad file is an error now, not at connect
        #: addresses known to take TLS (or not): the service URL's, then the lookups'
        self._tls_of: dict[tuple[str, int], bool] = dict.fromkeys(self.addresses, self.use_tls)
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
        #: how the batching timers sleep until a deadline: ``trio.sleep_until``, or a
        #: sleep to the microsecond where the engine thread has one (:mod:`._timer`)
        self.sleep_until: Callable[[float], Awaitable[None]] = trio.sleep_until

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.clock_offset = trio.current_time() - time.perf_counter()
        # on trio's default clock the batching timers sleep on timerfds (to the
        # microsecond, not to the next whole millisecond); on a test's MockClock they keep
        # trio's sleep, which the mock clock drives
        timers = PreciseTimers.open() if self.sleep_until is trio.sleep_until else None
        if timers is not None:
            self.sleep_until = timers.sleep_until
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            if timers is not None:
                self.sleep_until = trio.sleep_until
                timers.close()

    def next_id(self) -> int:
        return next(self._ids)

    def tls_context(self) -> ssl.SSLContext:
        """The context of every TLS connection (lookups and owners alike), built once."""
        if self._tls_context is None:
            self._tls_context = self._tls_settings()
        return self._tls_context

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
            tls = self._tls_of.get(address, self.use_tls)
            if self.use_tls and not tls:
                # never downgrade: the credentials would cross the network in clear
                raise TlsError(
                    f"{address[0]}:{address[1]}: the service answered a plaintext pigeon:// broker"
                    " URL to a pigeon+ssl:// client (advertise the brokers' TLS port)"
                )
            conn, _info = await connect_tcp(
                address[0],
                address[1],
                BrokerFrame,
                self.nursery,
                handler=_ConnHandler(self),
                client_name=self.client_name,
                connect_timeout=self.connect_timeout,
                tls=self.tls_context() if tls else None,
                authentication=self.authentication,
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
        url = result["brokerUrl"]
        address = parse_service_url(url)
        self._tls_of[address] = service_url_tls(url)
        return address, result["topic"], result["partitions"]

    async def attach(self, attach: Callable[[], Any], *, limit: float | None = None) -> None:
        """Run ``attach`` (lookup + connect + create) until the owning broker accepts it.

        A broker that no longer owns the topic (``NotOwner``) or a broker that went away
        is retried with a fresh lookup, within ``limit`` seconds (``operation_timeout`` unless
        given: a wait_for_exclusive producer waits as long as it takes).
        """
        delay = 0.05
        last: BaseException | None = None
        limit = self.operation_timeout if limit is None else limit
        with trio.move_on_after(limit):
            while True:
                try:
                    await attach()
                    return
                except (NotOwner, ConnectionClosed, ServiceUnavailable) as exc:
                    last = exc
                    log.info("attach retry error=%s", exc)
                    await trio.sleep(delay)
                    delay = min(delay * 2, 1.0)
        raise Timeout(f"no broker accepted within {limit}s: {last}")

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
    AuthenticationError,
    AuthorizationError,
    CodecError,
    IncompatibleSchema,
    InvalidArgument,
    ProducerFenced,
    ProtocolError,  # TlsError among them
    SubscriptionBusy,
    TopicNotFound,
)
_BACKOFF_MIN = 0.05
_BACKOFF_MAX = 2.0
#: An attachment that lasted less than this is followed by a backoff before the next one
#: (a broker that accepts the attach but refuses every send must not be hammered).
_STABLE_AFTER = 1.0


class Reconnecting:
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
