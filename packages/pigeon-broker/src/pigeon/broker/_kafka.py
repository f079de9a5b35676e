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
``_kafka_topics``, ``_kafka_configs``, ``_kafka_offsets`` and ``_kafka_group_api``; the
framing and message types in ``_kafka_wire``.

Security (``[kafka] security_protocol``): over ``SSL``/``SASL_SSL`` a connection is a
:class:`trio.SSLStream` with the broker's certificate (``service.server_tls``, reloaded
on SIGHUP); SASL (``_kafka_sasl``) establishes the role of a ``SASL_*`` connection,
a verified client certificate's common name that of an ``SSL`` one.  Authorization
decisions are kept per connection for :data:`AUTHZ_RECHECK_S` (a revoked grant applies
within that time; a denial is logged once per connection, topic and action).  A SASL
connection's token expiry is kept (``auth_expires``, from ``authenticator.expires_at``):
SaslAuthenticate tells the client the session's lifetime so it re-authenticates in time
(KIP-368), and a connection still on expired credentials is closed at its next request
(or by the sweep every ``maintenance_interval_s``), with one log line.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import logging
import math
import struct
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._config import KafkaConfig
from pigeon.broker._kafka_sasl import (
    SASL_AUTHENTICATE_KEY,
    SASL_HANDSHAKE_KEY,
    SASL_VERSIONS,
    SaslFailure,
    SaslSession,
    session_lifetime_ms,
)
from pigeon.broker._kafka_wire import (
    API_VERSIONS,
    API_VERSIONS_KEY,
    ZERO,
    Encoded,
    Later,
    RawFrame,
    UnsupportedApi,
    build,
    decode_request,
    encode_response,
    foreign_client,
    part,
)
from pigeon.core import TopicName
from pigeon.core.auth import AuthData, certificate_common_name
from pigeon.core.errors import (
    AuthenticationError,
    AuthorizationError,
    ConnectionClosed,
    InvalidTopicName,
    MalformedRequest,
    NoSuchNode,
    PigeonError,
    TlsError,
)
from pigeon.core.rpc import listen_tcp
from pigeon.core.tls import accept_tls

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
#: the largest request of a client that has not authenticated yet (Kafka's
#: ``sasl.server.max.receive.size``): an unauthenticated peer ties up no large buffers
MAX_UNAUTHENTICATED_REQUEST_SIZE = 512 * 1024
#: a connection that has not authenticated this long after it was accepted (and its
#: TLS handshake) is closed: an unauthenticated peer holds no socket for long
AUTHENTICATION_DEADLINE_S = 30.0
#: how much of a connection's first bytes are looked at to tell another protocol
SNIFF_BYTES = 64 * 1024
#: a request that stops arriving part way for this long closes its connection (a client
#: holding a half-sent request ties up its buffer: Kafka's request timeout is 30 s)
PARTIAL_REQUEST_TIMEOUT_S = 60.0
#: how long a connection keeps an authorization decision before asking again (a grant
#: or revocation reaches open connections within this time)
AUTHZ_RECHECK_S = 30.0
#: authorization decisions one connection keeps (a client naming endless topics starts
#: over rather than growing the table)
AUTHZ_MAX_ENTRIES = 10_000
#: how long the last answer (a failed authentication's) may take to go out before close
FLUSH_ON_CLOSE_S = 5.0


Handler = Callable[["KafkaConnection", Any], Awaitable[Any]]


@dataclass(eq=False)
class KafkaConnection:
    """One client connection: its stream, and the producers it attached per partition."""

    door: KafkaFrontDoor
    stream: trio.SocketStream | trio.SSLStream[Any]
    name: str
    client_id: str = ""
    nursery: trio.Nursery = None  # type: ignore[assignment]
    #: (partition topic, producer key) -> attached producer
    producers: dict[tuple[str, str], Producer] = field(default_factory=dict)
    closed: bool = False
    ident: int = 0
    #: sequence ids of the non-idempotent producers' batches (no de-duplication)
    sequence: int = 0
    #: the role the client authenticated as (None: authentication is off, or not yet)
    role: str | None = None
    #: the SASL exchange of a SASL_* listener's connection (None: no SASL)
    sasl: SaslSession | None = None
    #: authentication is on but this connection cannot authenticate (no SASL, no
    #: client certificate): nothing but ApiVersions is answered
    unauthenticated: bool = False
    #: the verified TLS client certificate (``getpeercert()``), if any
    peer_certificate: Any = None
    #: the answers already queued go out before the connection closes
    flush_on_close: bool = False
    #: when the credentials expire (Unix seconds; None: never, or no credentials)
    auth_expires: float | None = None
    #: (action, kafka topic, subscription) -> (when decided, allowed)
    grants: dict[tuple[str, str, str], tuple[float, bool]] = field(default_factory=dict)
    #: denials already logged
    denied: set[tuple[str, str, str]] = field(default_factory=set)
    #: (kafka topic, partition) -> (error code, fetches) of the partitions whose fetches
    #: answer an error or nothing (logged once: ``_kafka_fetch.note_answers``)
    fetch_notes: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    @property
    def authenticated(self) -> bool:
        """Has the client authenticated (or need it not)?  Until then its requests are
        small (:data:`MAX_UNAUTHENTICATED_REQUEST_SIZE`)."""
        return not self.unauthenticated and (self.sasl is None or self.sasl.authenticated)

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

    async def authorize(
        self, action: str, kafka_topic: str, subscription: str = "", *, quiet: bool = False
    ) -> None:
        """May this connection's role do ``action`` on ``kafka_topic``?

        ``action``: ``produce``, ``consume`` (through ``subscription`` when given),
        ``lookup``, ``admin`` (create, delete or grow topics: a tenant admin) or
        ``group`` (use the consumer group whose subscription is ``subscription``).  A
        decision is kept for :data:`AUTHZ_RECHECK_S`; a denial is logged once per
        connection, topic and action (not at all when ``quiet``: a topic left out of a
        listing).

        :raises AuthorizationError: denied (Kafka: TOPIC_AUTHORIZATION_FAILED).
        """
        authz = self.door.core.authorization
        if not authz.enabled:
            return
        key = (action, kafka_topic, subscription)
        now = trio.current_time()
        decided = self.grants.get(key)
        if decided is None or now - decided[0] >= AUTHZ_RECHECK_S:
            try:
                await self.door.check(self.role, action, kafka_topic, subscription)
                allowed = True
            except AuthorizationError as exc:
                allowed = False
                if not quiet and key not in self.denied:
                    self.denied.add(key)
                    log.warning(
                        "kafka request denied conn=%s role=%s action=%s topic=%s: %s",
                        self.name,
                        self.role,
                        action,
                        kafka_topic or "-",
                        exc.message,
                    )
            if len(self.grants) >= AUTHZ_MAX_ENTRIES:
                self.grants.clear()
            self.grants[key] = decided = (now, allowed)
        if not decided[1]:
            who = f"role {self.role!r}" if self.role is not None else "an unauthenticated client"
            what = f"topic {kafka_topic!r}" if kafka_topic else "this group"
            raise AuthorizationError(f"{who} may not {action} {what}")


class KafkaFrontDoor:
    """Serves the Kafka protocol for one broker (a :class:`~pigeon.broker._service.FrontDoor`)."""

    def __init__(self, core: BrokerService, config: KafkaConfig) -> None:
        from pigeon.broker import (
            _kafka_configs,
            _kafka_fetch,
            _kafka_offsets,
            _kafka_produce,
            _kafka_topics,
        )
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
        #: groups last answered NOT_COORDINATOR (for the log)
        self._refused_groups: set[str] = set()
        self.handlers: dict[int, Handler] = {API_VERSIONS_KEY: self._api_versions}
        for module in (_kafka_produce, _kafka_fetch, _kafka_topics, _kafka_configs, _kafka_offsets):
            self.handlers.update(module.HANDLERS)
        for key, (_lo, _hi, handler) in GROUP_HANDLERS.items():
            self.handlers[key] = self._group_handler(handler)
        missing = set(API_VERSIONS) - set(self.handlers)
        assert not missing, f"Kafka APIs without a handler: {missing}"
        config.validate_security(core.config)
        #: the TLS of an SSL/SASL_SSL listener (the broker's certificate, shared)
        self.tls = core.server_tls if config.tls else None
        #: APIs served besides API_VERSIONS (SASL's on a SASL listener)
        self.extra_versions: dict[int, tuple[int, int]] = {}
        if config.sasl:
            self.extra_versions = dict(SASL_VERSIONS)
            self.handlers[SASL_HANDSHAKE_KEY] = self._sasl_handshake
            self.handlers[SASL_AUTHENTICATE_KEY] = self._sasl_authenticate
        tls_roles = config.tls and core.config.tls_require_trusted_client_cert
        if core.authenticator is not None and not config.sasl and not tls_roles:
            log.warning(
                "kafka listener cannot authenticate clients (security_protocol=%s): with"
                " authentication_enabled its clients are refused; use SASL_SSL or"
                " SASL_PLAINTEXT (or SSL with tls_require_trusted_client_cert)",
                config.security_protocol,
            )
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
            if self.core.authenticator is not None:
                nursery.start_soon(self._sweep_expired)
            log.info("kafka serving address=%s:%s", *self.address)
            task_status.started(self.address)

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()
            name = f"{peer[0]}:{peer[1]}"
        except OSError:
            name = "unknown"
        conn_stream: trio.SocketStream | trio.SSLStream[Any] = stream
        if self.tls is not None:
            try:
                # a Kafka client cannot be told in words: no certificate, no handshake
                conn_stream = await accept_tls(stream, self.tls, strict=True)
            except (TlsError, ConnectionClosed) as exc:
                log.warning("kafka TLS handshake failed conn=%s: %s", name, exc.message)
                return
        conn = KafkaConnection(self, conn_stream, name, ident=next(self._ids))
        if not self._identify(conn):
            with contextlib.suppress(Exception):
                await trio.aclose_forcefully(conn_stream)
            return
        self.conns.add(conn)
        try:
            async with trio.open_nursery() as nursery:
                conn.nursery = nursery
                if not conn.authenticated:
                    nursery.start_soon(_authentication_deadline, conn, nursery.cancel_scope)
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
                await trio.aclose_forcefully(conn_stream)

    def now(self) -> float:
        """The time credentials expire against (Unix seconds, the broker's clock)."""
        return float(self.core.clock.now_ms()) / 1000

    def expired(self, conn: KafkaConnection, now: float) -> bool:
        """Are ``conn``'s credentials expired by ``now``?  The first time, says so in one
        log line and marks the connection to close."""
        if conn.auth_expires is None or conn.auth_expires > now:
            return False
        if not conn.closed:
            log.info(
                "kafka connection closed: credentials expired conn=%s role=%s (re-authenticate"
                " before session_lifetime_ms ends, or reconnect with a fresh token)",
                conn.name,
                conn.role,
            )
            conn.close()
        return True

    def close_expired(self, now: float) -> int:
        """Close every connection whose credentials expired by ``now``; how many."""
        return sum(self.expired(conn, now) for conn in list(self.conns) if not conn.closed)

    async def _sweep_expired(self) -> None:
        """Close idle connections on expired credentials too (a busy one is closed at its
        next request)."""
        while True:
            await trio.sleep(max(0.05, float(self.core.config.maintenance_interval_s)))
            self.close_expired(self.now())

    def _identify(self, conn: KafkaConnection) -> bool:
        """Set up how ``conn`` authenticates (SASL to come, its TLS certificate, or
        not at all); False when its certificate names no role that authenticates."""
        cert = None
        if isinstance(conn.stream, trio.SSLStream):
            with contextlib.suppress(ValueError, AttributeError):
                cert = conn.stream.getpeercert() or None
        conn.peer_certificate = cert
        authenticator = self.core.authenticator
        if self.config.sasl:
            conn.sasl = SaslSession(self.config.sasl_enabled_mechanisms)
            return True
        if cert is None:
            conn.unauthenticated = authenticator is not None
            return True
        if authenticator is None or "tls" not in authenticator.providers:
            conn.role = certificate_common_name(cert)  # mTLS: the certificate's CN
            conn.unauthenticated = authenticator is not None and conn.role is None
            return True
        try:
            conn.role = authenticator.authenticate(
                AuthData("tls", peer_certificate=cert, peer_address=conn.name)
            )
        except AuthenticationError as exc:
            log.warning("kafka authentication failed conn=%s method=tls: %s", conn.name, exc)
            return False
        return True

    async def _serve(self, conn: KafkaConnection) -> None:
        send, receive = trio.open_memory_channel[tuple[int, Any]](MAX_IN_FLIGHT)
        written = trio.Event()
        conn.nursery.start_soon(self._write, conn, receive, written)
        async with send:
            try:
                async for frame in _frames(conn):
                    if not await self._request(conn, frame, send):
                        break
            except MalformedRequest as exc:
                log.warning("kafka connection closed conn=%s: %s", conn.name, exc)
        if conn.flush_on_close:  # the writer sends what is queued, then ends
            with trio.move_on_after(FLUSH_ON_CLOSE_S):
                await written.wait()

    async def _request(self, conn: KafkaConnection, frame: bytearray, send: Any) -> bool:
        """Handle one request; False when the connection must close."""
        sasl = conn.sasl
        if sasl is not None and sasl.expects_raw:  # Kafka 0.10 SASL: a bare token
            return await self._sasl_raw(conn, bytes(frame), send)
        try:
            header, request = decode_request(frame, self.extra_versions)
        except UnsupportedApi as exc:
            if exc.api_key != API_VERSIONS_KEY:
                log.warning("kafka request refused conn=%s: %s", conn.name, exc)
                return False
            await send.send((exc.correlation_id, self._versions_refusal()))
            return True
        conn.client_id = header.client_id or conn.client_id
        api_key = header.request_api_key
        if (
            conn.auth_expires is not None
            and api_key not in (SASL_HANDSHAKE_KEY, SASL_AUTHENTICATE_KEY)
            and self.expired(conn, self.now())
        ):
            return False
        if (sasl is not None and not sasl.allows(api_key)) or (
            conn.unauthenticated and api_key != API_VERSIONS_KEY
        ):
            log.warning(
                "kafka request before authentication conn=%s api=%d: connection closed (%s)",
                conn.name,
                api_key,
                "authenticate with SASL first"
                if sasl is not None
                else f"security_protocol {self.config.security_protocol} cannot authenticate"
                " clients: use SASL_SSL or SASL_PLAINTEXT",
            )
            return False
        try:
            answer = await self.handlers[header.request_api_key](conn, request)
        except PigeonError as exc:
            log.warning(
                "kafka request failed conn=%s api=%d: %s", conn.name, header.request_api_key, exc
            )
            return False
        if answer is not None:
            await send.send((header.correlation_id, answer))
        return not conn.flush_on_close  # a refused SASL step: answered, then closed

    async def _write(self, conn: KafkaConnection, receive: Any, written: trio.Event) -> None:
        stream = conn.stream
        if isinstance(stream, trio.SSLStream):
            send: Callable[[list[Any]], Awaitable[None]] = functools.partial(_send_tls, stream)
        else:
            send = functools.partial(_send, stream.socket)
        async with receive:
            async for correlation_id, answer in receive:
                if isinstance(answer, Later):
                    answer = await answer.wait()
                if answer is None:  # acks=0 produce, or a task that failed
                    continue
                if isinstance(answer, Encoded):
                    await send(answer.buffers(correlation_id))
                else:
                    await send([encode_response(correlation_id, answer)])
        written.set()

    # ------------------------------------------------------------------ SASL

    async def _sasl_handshake(self, conn: KafkaConnection, request: Any) -> Any:
        from kio.schema.errors import ErrorCode

        assert conn.sasl is not None
        code = conn.sasl.handshake(request.mechanism, type(request).__version__)
        if code:
            log.warning(
                "kafka SASL handshake refused conn=%s mechanism=%r (enabled: %s)",
                conn.name,
                request.mechanism[:64],
                ", ".join(conn.sasl.mechanisms),
            )
            conn.flush_on_close = True
        cls = _response_of(request)
        return build(cls, error_code=ErrorCode(code), mechanisms=conn.sasl.mechanisms)

    def _sasl_check(self, conn: KafkaConnection, auth_bytes: bytes, *, raw: bool) -> int:
        """Authenticate (or re-authenticate) ``conn`` with the credentials: the session's
        lifetime in milliseconds (0: they never expire).

        :raises SaslFailure: they do not (one WARNING line naming why, never them).
        """
        sasl = conn.sasl
        authenticator = self.core.authenticator
        assert sasl is not None and authenticator is not None
        again = sasl.reauthenticating
        try:
            token = sasl.token(auth_bytes, raw=raw)
            auth = AuthData(
                "token",
                token.encode(),
                peer_certificate=conn.peer_certificate,
                peer_address=conn.name,
            )
            role = authenticator.authenticate(auth)
            sasl.succeeded(role, raw=raw)
        except AuthenticationError as exc:
            failure = SaslFailure(f"authentication failed: {exc.message}")
        except SaslFailure as exc:
            failure = exc
        else:
            conn.role = role
            now = self.now()
            conn.auth_expires = authenticator.expires_at(auth)
            lifetime = session_lifetime_ms(conn.auth_expires, now)
            log.info(
                "kafka client %s conn=%s mechanism=%s role=%s session_lifetime_ms=%d",
                "re-authenticated" if again else "authenticated",
                conn.name,
                sasl.mechanism,
                role,
                lifetime,
            )
            return lifetime
        log.warning(
            "kafka SASL %s failed conn=%s mechanism=%s: %s",
            "re-authentication" if again else "authentication",
            conn.name,
            sasl.mechanism,
            failure.message,
        )
        raise failure

    async def _sasl_authenticate(self, conn: KafkaConnection, request: Any) -> Any:
        from kio.schema.errors import ErrorCode

        cls = _response_of(request)
        try:
            lifetime = self._sasl_check(conn, request.auth_bytes, raw=False)
        except SaslFailure as exc:
            conn.flush_on_close = True  # answered, then closed (as Kafka does)
            return build(
                cls,
                error_code=ErrorCode(exc.code),
                error_message=exc.message,
                auth_bytes=b"",
                session_lifetime=ZERO,
            )
        return build(
            cls,
            error_code=ErrorCode.none,
            error_message=None,
            auth_bytes=b"",
            session_lifetime=datetime.timedelta(milliseconds=lifetime),
        )

    async def _sasl_raw(self, conn: KafkaConnection, token: bytes, send: Any) -> bool:
        """A Kafka 0.10 client's bare token (after SaslHandshake v0): an empty bare frame
        when it authenticates; otherwise the connection closes (that layout has no
        error answer)."""
        try:
            self._sasl_check(conn, token, raw=True)
        except SaslFailure:
            return False
        await send.send((0, RawFrame()))
        return True

    # ------------------------------------------------------------------ authorization

    async def check(
        self, role: str | None, action: str, kafka_topic: str, subscription: str
    ) -> None:
        """One authorization decision (see :meth:`KafkaConnection.authorize`).

        :raises AuthorizationError: denied.
        """
        authz = self.core.authorization
        if action == "group":
            await self._check_group(role, subscription)
            return
        if action == "idempotent":
            await self._check_anywhere(role, "produce", "get a producer id")
            return
        if action == "admin":
            await authz.check_tenant_admin(
                role, self.config.namespace.partition("/")[0], "create or delete Kafka topics"
            )
            return
        try:
            name = self.topic_name(kafka_topic)
        except InvalidTopicName:
            return  # the handler answers INVALID_TOPIC_EXCEPTION
        if action == "produce":
            await authz.check_produce(role, name)
        elif action == "consume" and subscription:
            await authz.check_consume(role, name, subscription)
        elif action == "consume":
            await authz.check_topic(role, "consume", name)
        elif action == "lookup":
            await authz.check_lookup(role, name)
        else:
            raise AssertionError(f"unknown Kafka authorization action {action!r}")

    async def _check_anywhere(self, role: str | None, action: str, what: str) -> Any:
        """``role`` may ``action`` (produce or consume) on some topic of the Kafka
        namespace (or is a tenant admin there), so may ``what`` (words); the namespace's
        policies (None: a tenant admin, or none stored)."""
        authz = self.core.authorization
        tenant = self.config.namespace.partition("/")[0]
        if not authz.enabled or await authz.is_tenant_admin(role, tenant):
            return None
        if role is None:
            raise AuthorizationError(f"an unauthenticated client may not {what}")
        try:
            policies = await authz.policies.get(self.config.namespace)
        except NoSuchNode:
            policies = None
        granted = policies is not None and (
            action in policies.permissions.get(role, ())
            or any(action in roles.get(role, ()) for roles in policies.topic_permissions.values())
        )
        if not granted:
            raise AuthorizationError(
                f"role {role!r} may not {action} in {self.config.namespace}, so may not {what}"
                " there"
            )
        return policies

    async def _check_group(self, role: str | None, subscription: str) -> None:
        """Use a consumer group: an authenticated role that may consume in the Kafka
        namespace (somewhere), whose name prefixes the group's subscription under
        ``subscription_auth_mode = "prefix"``."""
        policies = await self._check_anywhere(role, "consume", "use consumer groups")
        if (
            role is not None
            and policies is not None
            and policies.subscription_auth_mode == "prefix"
            and not subscription.startswith(role)
        ):
            raise AuthorizationError(
                f"role {role!r} may only use groups whose names start with {role!r} in"
                f" {self.config.namespace} (subscription_auth_mode prefix)"
            )

    # ------------------------------------------------------------------ ApiVersions

    async def _api_versions(self, conn: KafkaConnection, request: Any) -> Any:
        return self._versions_answer(type(request), error=0)

    def _versions_refusal(self) -> Any:
        from kio.schema.api_versions.v0.request import ApiVersionsRequest

        return self._versions_answer(ApiVersionsRequest, error=35)  # UNSUPPORTED_VERSION

    def _versions_answer(self, request_type: type, *, error: int) -> Any:
        from kio.index import load_response_from_request
        from kio.schema.errors import ErrorCode

        cls = load_response_from_request(request_type)
        served = {**API_VERSIONS, **self.extra_versions}
        keys = tuple(
            part(cls, "ApiVersion", api_key=k, min_version=lo, max_version=hi)
            for k, (lo, hi) in sorted(served.items())
        )
        return build(cls, error_code=ErrorCode(error), api_keys=keys, throttle_time=ZERO)

    def _group_handler(self, handler: Any) -> Handler:
        from pigeon.broker._kafka_offsets import coordinates

        async def run(conn: KafkaConnection, request: Any) -> Any:
            group = getattr(request, "group_id", None)
            if group is not None:
                if not await coordinates(self, group):
                    # another broker holds the group's bundle: the client asks
                    # FindCoordinator (logged once per group until it is ours again)
                    if group not in self._refused_groups:
                        self._refused_groups.add(group)
                        log.info("kafka group not coordinated here group=%s", group)
                    return _not_coordinator(request)
                self._refused_groups.discard(group)
            extra: dict[str, frozenset[str]] = {}
            if self.core.authorization.enabled:
                if group is not None:
                    refused = await self._group_refused(conn, request, str(group))
                    if refused is not None:
                        return refused
                elif type(request).__api_key__ == 15:  # DescribeGroups
                    extra["hidden"] = await self._denied_groups(conn, map(str, request.groups))
                else:  # ListGroups
                    listed = (snap.group_id for snap in self.groups.groups())
                    extra["hidden"] = await self._denied_groups(conn, listed)
            host = conn.name.rpartition(":")[0]
            return conn.spawn(
                lambda: handler(
                    self.groups, request, client_id=conn.client_id, client_host=host, **extra
                )
            )

        return run

    async def _denied_groups(self, conn: KafkaConnection, groups: Iterable[str]) -> frozenset[str]:
        """Of ``groups``, those the connection's role may not use: DescribeGroups answers
        them GROUP_AUTHORIZATION_FAILED, ListGroups leaves them out (as Kafka does
        without the DESCRIBE right on a group)."""
        from pigeon.broker._kafka_offsets import subscription_of

        denied = set()
        for group in groups:
            try:
                await conn.authorize("group", "", subscription_of(group), quiet=True)
            except AuthorizationError:
                denied.add(group)
        return frozenset(denied)

    async def _group_refused(self, conn: KafkaConnection, request: Any, group: str) -> Any:
        """GROUP_AUTHORIZATION_FAILED for a JoinGroup, SyncGroup, Heartbeat or LeaveGroup
        the role may not make (a JoinGroup also names the topics its members subscribe
        to: each needs the consume right through the group's subscription; a LeaveGroup
        or Heartbeat naming another role's member must not remove or keep it); None when
        allowed."""
        from kio.schema.errors import ErrorCode

        from pigeon.broker._kafka_offsets import subscription_of

        key = type(request).__api_key__
        subscription = subscription_of(group)
        try:
            await conn.authorize("group", "", subscription)
            if key == 11 and request.protocol_type == "consumer":
                for topic in _subscribed_topics(request):
                    await conn.authorize("consume", topic, subscription)
        except AuthorizationError:
            return _group_refusal(request, ErrorCode.group_authorization_failed)
        return None


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

    return _group_refusal(request, ErrorCode.not_coordinator)


def _group_refusal(request: Any, code: Any) -> Any:
    cls: Any = _response_of(request)
    fields = _GROUP_REFUSAL[cls.__api_key__]
    return build(cls, throttle_time=ZERO, error_code=code, **fields)


def _response_of(request: Any) -> Any:
    from pigeon.broker._kafka_wire import response_type

    return response_type(request)


def _subscribed_topics(request: Any) -> list[str]:
    """The topics of a consumer JoinGroup's protocols (the consumer protocol's
    Subscription: ``int16 version | int32 count | count x (int16 length | UTF-8)``,
    then fields this does not need); those that do not parse are left out."""
    topics: list[str] = []
    for protocol in request.protocols:
        data = bytes(protocol.metadata)
        try:
            (count,) = _I32.unpack_from(data, 2)
            at = 6
            for _ in range(min(count, 10_000)):
                (length,) = struct.unpack_from(">h", data, at)
                name = data[at + 2 : at + 2 + length].decode()
                at += 2 + length
                if name not in topics:
                    topics.append(name)
        except (struct.error, UnicodeDecodeError):
            continue
    return topics


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
    stream = conn.stream
    if isinstance(stream, trio.SSLStream):
        recv: Callable[[memoryview], Awaitable[int]] = functools.partial(_recv_tls, stream)
    else:
        recv = functools.partial(_recv_into, stream.socket)
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
            if size > MAX_UNAUTHENTICATED_REQUEST_SIZE and not conn.authenticated:
                raise MalformedRequest(
                    f"a request of {size} bytes before the client authenticated (at most"
                    f" {MAX_UNAUTHENTICATED_REQUEST_SIZE})"
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
                    n = await _recv_partial(recv, fview[have:], have + 4)
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
            end += await _recv_partial(recv, view[end:], end)
        else:
            n = await recv(view)
            if not n:
                return
            end = n


async def _authentication_deadline(conn: KafkaConnection, scope: trio.CancelScope) -> None:
    """Close ``conn`` (cancel ``scope``) unless it authenticated within
    :data:`AUTHENTICATION_DEADLINE_S`."""
    await trio.sleep(AUTHENTICATION_DEADLINE_S)
    if not conn.authenticated:
        log.warning(
            "kafka connection closed conn=%s: not authenticated within %gs",
            conn.name,
            AUTHENTICATION_DEADLINE_S,
        )
        scope.cancel()


async def _recv_partial(
    recv: Callable[[memoryview], Awaitable[int]], into: memoryview, have: int
) -> int:
    """More bytes of a request ``have`` bytes into it: neither an end of the stream nor a
    pause of :data:`PARTIAL_REQUEST_TIMEOUT_S` is allowed there."""
    with trio.move_on_after(PARTIAL_REQUEST_TIMEOUT_S):
        n = await recv(into)
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


async def _send_tls(stream: trio.SSLStream[Any], buffers: list[Any]) -> None:
    """Write ``buffers`` over TLS (joined: one TLS record run instead of one per buffer)."""
    await stream.send_all(buffers[0] if len(buffers) == 1 else b"".join(buffers))


async def _recv_tls(stream: trio.SSLStream[Any], into: memoryview) -> int:
    """Bytes received over TLS into ``into``; 0 at the end of the stream."""
    try:
        data = await stream.receive_some(len(into))
    except (trio.BrokenResourceError, OSError):
        return 0
    n = len(data)
    into[:n] = data
    return n


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
