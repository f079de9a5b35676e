"""The native front door: the PigeonMQ Cap'n Proto protocol (port 6650) over the broker
core.

Each ``on_<request>`` handler only translates: it reads the request, calls the core
(:class:`~pigeon.broker._service.BrokerService`) and turns the result or the error into
the answer.  What a connection attached (producers and consumers by their client ids)
is kept here, per connection.

Request handlers are synchronous (see :mod:`pigeon.core._rpc`); anything that waits —
opening a topic, persisting a cursor — runs as a task in the connection's nursery.
Produce requests never wait in a task: ``on_send`` hands the batch to the core at once,
so the order of requests on a connection is the order in the log.

**Security.**  The port is served twice when ``broker_service_port_tls`` is set: in
plaintext and over TLS, both with the broker's authenticator (a token sent over the
plaintext port can be read on the network, as with Pulsar: put it behind TLS where that
matters).  Authorization (:mod:`pigeon.broker._authz`) is checked once per request that
attaches or names a topic, at the start of its task, never per message:

* ``createProducer``: ``produce`` on the topic; ``createTopic``: ``produce`` (a tenant
  admin has it on every topic of the tenant);
* ``subscribe`` (readers too): ``consume`` with the subscription
  (``subscription_auth_mode``); ``unsubscribe``, ``seek`` and ``getLastMessageId``:
  ``consume`` again (a permission revoked since the attach counts);
* ``lookup`` (which answers partition metadata too) and ``getSchema``: ``produce`` or
  ``consume``;
* ``listTopics`` of a namespace: a tenant admin, or a role with any permission in the
  namespace (namespace-wide or on one of its topics) — it sees the names it could find
  by lookup anyway (a role with topic grants only: those topics), and nothing of other
  namespaces.

A denial answers the request with :class:`AuthorizationError` (naming role and action)
and is logged once per connection; the connection stays up.  A connection authenticated
with an expiring token is closed once the token has expired (checked by the broker's
maintenance loop, :meth:`NativeProtocol.close_expired`): its producers and consumers are
told ``closedByBroker`` first, and the client reconnects with a fresh token.  Lookups
answer a client on the TLS port with the owner's ``pigeon+ssl://`` URL.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._access import wire_access_mode
from pigeon.broker._authz import topic_key
from pigeon.broker._schema_compat import SchemaData
from pigeon.broker._subscription import Consumer
from pigeon.broker._topic import Producer
from pigeon.broker._topic_protocol import SeekTarget
from pigeon.core import TopicName
from pigeon.core.errors import (
    AckNotPersisted,
    AuthenticationError,
    AuthorizationError,
    InternalError,
    InvalidArgument,
    NoSuchNode,
    PigeonError,
    ServiceUnavailable,
)
from pigeon.core.rpc import Connection, Request

if TYPE_CHECKING:
    from pigeon.broker._service import BrokerService

__all__ = ["NativeProtocol"]

log = logging.getLogger(__name__)

#: distinct denials logged per connection (a client probing many topics floods no log)
MAX_LOGGED_DENIALS = 32

_SUB_TYPES = {
    "exclusive": "exclusive",
    "shared": "shared",
    "failover": "failover",
    "keyShared": "keyShared",
}


def schema_of(info: Any) -> SchemaData | None:
    """The schema of a CreateProducer or Subscribe (None: none, the values are bytes)."""
    kind = str(info.type)
    if not kind:
        return None
    return SchemaData(kind, str(info.definition))


@dataclass(eq=False)
class _ConnState:
    producers: dict[int, Producer] = field(default_factory=dict)
    consumers: dict[int, tuple[Consumer, Any, Any]] = field(default_factory=dict)
    #: request ids of createProducer / subscribe still in progress, by (kind, id)
    opening: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    #: of those, the ones whose producer or consumer the client closed meanwhile (it
    #: gave up waiting): they must not add it when they finish
    abandoned: set[int] = field(default_factory=set)
    #: the denials already logged for this connection (each once, however often asked)
    denials: set[str] = field(default_factory=set)

    @contextlib.contextmanager
    def open_request(self, kind: str, ident: int, request_id: int) -> Iterator[None]:
        requests = self.opening.setdefault((kind, ident), set())
        requests.add(request_id)
        try:
            yield
        finally:
            requests.discard(request_id)
            if not requests:
                del self.opening[(kind, ident)]
            self.abandoned.discard(request_id)

    def abandon(self, kind: str, ident: int) -> None:
        """The client closed ``ident``: opens of it still in progress add nothing."""
        self.abandoned.update(self.opening.get((kind, ident), ()))

    def check_open(self, kind: str, ident: int, request_id: int) -> None:
        if request_id in self.abandoned:
            raise ServiceUnavailable(f"{kind} {ident} was closed by the client while opening")


class NativeProtocol:
    """The handler :func:`pigeon.core.rpc.serve_tcp` calls for each request."""

    def __init__(self, core: BrokerService) -> None:
        self.core = core
        self.conns: dict[Connection, _ConnState] = {}

    # ------------------------------------------------------------------ connections

    def connection_opened(self, conn: Connection) -> None:
        self.conns[conn] = _ConnState()

    def connection_closed(self, conn: Connection) -> None:
        state = self.conns.pop(conn, None)
        if state is None:
            return
        for producer in state.producers.values():
            self.core.close_producer(producer)
        for consumer, sub, topic in state.consumers.values():
            self.core.detach_consumer(topic, sub, consumer)

    @property
    def connections(self) -> int:
        return len(self.conns)

    def close_all(self) -> None:
        """Close every connection (clients reconnect through a new lookup)."""
        for conn in list(self.conns):
            conn.close()

    def detach(self, topic: Any, reason: str, *, subscription: Any = None) -> int:
        """Detach the producers and consumers of ``topic`` (only the consumers of
        ``subscription``, given one) and push ``closedByBroker``; they reconnect on their
        own.

        A detached producer stays registered on its connection, still pointing at the
        old topic: the client sends on until it has re-attached, and those sends must
        fail with a retriable error (the old topic's ledger is closed:
        ServiceUnavailable) so the client resends them after re-attaching, not with
        "unknown producer id".  Re-attaching replaces the registration.
        """
        count = 0
        for conn, state in list(self.conns.items()):
            if subscription is None:
                for pid, producer in list(state.producers.items()):
                    if producer.topic is not topic:
                        continue
                    self.core.close_producer(producer)
                    count += 1
                    with contextlib.suppress(PigeonError):
                        conn.send_nowait(
                            "closedByBroker",
                            {"producerId": pid, "isProducer": True, "reason": reason},
                        )
            for cid, (consumer, sub, t) in list(state.consumers.items()):
                if t is not topic or (subscription is not None and sub is not subscription):
                    continue
                del state.consumers[cid]
                sub.remove_consumer(consumer)
                count += 1
                with contextlib.suppress(PigeonError):
                    conn.send_nowait(
                        "closedByBroker",
                        {"consumerId": cid, "isProducer": False, "reason": reason},
                    )
        return count

    def close_expired(self, now: float) -> int:
        """Close every connection whose credentials expired by ``now`` (Unix seconds),
        after telling its producers and consumers ``closedByBroker`` (their clients
        reconnect, presenting fresh credentials); returns how many were closed."""
        closed = 0
        for conn, state in list(self.conns.items()):
            expires = getattr(conn, "auth_expires", None)
            if expires is None or expires > now or conn.closed:
                continue
            reason = "authentication expired: reconnect with fresh credentials"
            for pid in state.producers:
                with contextlib.suppress(PigeonError):
                    conn.send_nowait(
                        "closedByBroker", {"producerId": pid, "isProducer": True, "reason": reason}
                    )
            for cid in state.consumers:
                with contextlib.suppress(PigeonError):
                    conn.send_nowait(
                        "closedByBroker",
                        {"consumerId": cid, "isProducer": False, "reason": reason},
                    )
            log.info(
                "closing connection: credentials expired conn=%s role=%s", conn.name, conn.role
            )
            conn.close(AuthenticationError(f"the credentials of role {conn.role!r} expired"))
            closed += 1
        return closed

    # ------------------------------------------------------------------ authorization

    async def _authorize(self, conn: Connection, check: Awaitable[None]) -> None:
        """Await an authorization ``check``; a denial is logged once per connection."""
        try:
            await check
        except AuthorizationError as exc:
            state = self.conns.get(conn)
            if state is None or exc.message in state.denials:
                raise
            if len(state.denials) < MAX_LOGGED_DENIALS:
                state.denials.add(exc.message)
                log.warning(
                    "authorization denied conn=%s role=%s error=%s",
                    conn.name,
                    conn.role,
                    exc.message,
                )
                if len(state.denials) == MAX_LOGGED_DENIALS:
                    log.warning(
                        "authorization denied %d times conn=%s: further denials on this"
                        " connection are answered but not logged",
                        MAX_LOGGED_DENIALS,
                        conn.name,
                    )
            raise

    def _checked(
        self, conn: Connection, req: Request, check: Callable[[], Awaitable[None]], then: Any
    ) -> None:
        """Run ``then()`` (synchronous; it answers the request) once ``check()`` passed;
        without authorization at once."""
        if not self.core.authorization.enabled:
            then()
            return

        async def checked() -> None:
            await self._authorize(conn, check())
            then()

        self._spawn(conn, req.request_id, checked)

    async def _check_list(self, role: str | None, namespace: str) -> frozenset[str] | None:
        """``listTopics`` of ``namespace``: a tenant admin, or any permission in it.
        Returns the topics (local names) a role with only topic grants may see; None:
        every topic."""
        authz = self.core.authorization
        tenant = namespace.partition("/")[0]
        if not authz.enabled or await authz.is_tenant_admin(role, tenant):
            return None
        if role is not None:
            try:
                policies = await self.core.policies.get(namespace)
            except NoSuchNode:
                policies = None
            if policies is not None and role in policies.permissions:
                return None
            granted = frozenset(
                topic
                for topic, grants in (policies.topic_permissions if policies else {}).items()
                if role in grants
            )
            if granted:
                return granted
        who = f"role {role!r}" if role is not None else "an unauthenticated client"
        raise AuthorizationError(
            f"{who} may not list the topics of {namespace} (it needs a permission there or"
            f" an admin role of tenant {tenant!r})"
        )

    def _state(self, conn: Connection) -> _ConnState:
        state = self.conns.get(conn)
        if state is None:
            raise ServiceUnavailable("connection is closing")
        return state

    def _spawn(self, conn: Connection, request_id: int, fn: Any, *args: Any) -> None:
        """Run ``fn`` in a task; its PigeonError becomes the request's error answer."""

        async def runner() -> None:
            try:
                await fn(*args)
            except PigeonError as exc:
                conn.respond_error(request_id, exc)
            except Exception as exc:
                log.exception("request failed conn=%s", conn.name)
                conn.respond_error(
                    request_id, InternalError(f"internal error: {type(exc).__name__}: {exc}")
                )

        nursery = conn.nursery or self.core.nursery
        nursery.start_soon(runner)

    def _spawn_ok(self, conn: Connection, request_id: int, fn: Any, *args: Any) -> None:
        """:meth:`_spawn` ``fn``, answering ``ok`` once it returned."""

        async def then_ok() -> None:
            await fn(*args)
            conn.respond(request_id, "ok")

        self._spawn(conn, request_id, then_ok)

    # ------------------------------------------------------------------ topics

    def on_lookup(self, conn: Connection, req: Request) -> None:
        name = TopicName.parse(str(req.body.topic))

        async def lookup() -> None:
            await self._authorize(conn, self.core.authorization.check_lookup(conn.role, name))
            tls = isinstance(conn.stream, trio.SSLStream)
            url, partitions = await self.core.lookup(name, tls=tls)
            conn.respond(
                req.request_id,
                "lookupResult",
                {"brokerUrl": url, "partitions": partitions, "topic": name.full},
            )

        self._spawn(conn, req.request_id, lookup)

    def on_createTopic(self, conn: Connection, req: Request) -> None:
        name = TopicName.parse(str(req.body.topic))
        partitions = req.body.partitions

        async def create() -> None:
            await self._authorize(conn, self.core.authorization.check_produce(conn.role, name))
            await self.core.create_topic(name, partitions)

        self._spawn_ok(conn, req.request_id, create)

    def on_listTopics(self, conn: Connection, req: Request) -> None:
        namespace = str(req.body.namespace)

        async def list_() -> None:
            visible: frozenset[str] | None = None

            async def check() -> None:
                nonlocal visible
                visible = await self._check_list(conn.role, namespace)

            await self._authorize(conn, check())
            topics = await self.core.list_topics(namespace)
            if visible is not None:
                topics = [t for t in topics if topic_key(TopicName.parse(t)) in visible]
            conn.respond(req.request_id, "topicList", {"topics": topics})

        self._spawn(conn, req.request_id, list_)

    # ------------------------------------------------------------------ schemas

    def on_getSchema(self, conn: Connection, req: Request) -> None:
        name = TopicName.parse(str(req.body.topic))
        version = req.body.version

        async def get() -> None:
            await self._authorize(conn, self.core.authorization.check_lookup(conn.role, name))
            found, schema = await self.core.schemas.get(name, version if version >= 0 else None)
            conn.respond(
                req.request_id,
                "schemaResponse",
                {
                    "version": found,
                    "schemaInfo": {"type": schema.type, "definition": schema.definition},
                },
            )

        self._spawn(conn, req.request_id, get)

    # ------------------------------------------------------------------ producers

    def on_createProducer(self, conn: Connection, req: Request) -> None:
        name = TopicName.parse(str(req.body.topic))
        producer_id = req.body.producerId
        producer_name = str(req.body.producerName)
        schema = schema_of(req.body.schemaInfo)
        access_mode = wire_access_mode(str(req.body.accessMode))
        epoch = req.body.topicEpoch
        state = self._state(conn)
        self._spawn(
            conn,
            req.request_id,
            self._create_producer,
            conn,
            req.request_id,
            state,
            name,
            producer_id,
            producer_name,
            schema,
            access_mode,
            epoch,
        )

    async def _create_producer(
        self,
        conn: Connection,
        request_id: int,
        state: _ConnState,
        name: TopicName,
        producer_id: int,
        producer_name: str,
        schema: SchemaData | None,
        access_mode: str,
        epoch: int,
    ) -> None:
        with state.open_request("producer", producer_id, request_id):
            await self._authorize(conn, self.core.authorization.check_produce(conn.role, name))
            schema_version = await self.core.schemas.attach_producer(name, schema)
            producer = await self.core.create_producer(
                name,
                producer_name,
                client=conn,
                producer_id=producer_id,
                still_wanted=lambda: state.check_open("producer", producer_id, request_id),
                access_mode=access_mode,
                epoch=epoch,
                on_fenced=self._fenced,
            )
            state.producers[producer_id] = producer
            conn.respond(
                request_id,
                "producerCreated",
                {
                    "producerName": producer.name,
                    "lastSequenceId": producer.topic.dedup.pushed_sequence(producer.name),
                    "maxMessageSize": self.core.max_message_size(name),
                    "topic": name.full,
                    "schemaVersion": schema_version,
                    "topicEpoch": producer.epoch,
                },
            )

    def _fenced(self, producer: Producer, error: PigeonError) -> None:
        """An exclusive_with_fencing producer removed ``producer``: its client is told
        (``closedByBroker``; its re-attach is refused with ProducerFenced)."""
        if producer.conn in self.conns:
            self._fence_producer(producer.conn, producer, error)
        else:
            self.core.fence_producer(producer, error)

    def on_send(self, conn: Connection, req: Request) -> None:
        producer = self._state(conn).producers.get(req.body.producerId)
        if producer is None:
            raise InvalidArgument(f"unknown producer id {req.body.producerId}")
        body = req.body
        request_id = req.request_id
        producer_id = body.producerId
        sequence_id = body.sequenceId

        def reply(receipt: Any, error: BaseException | None, duplicate: bool) -> None:
            if error is not None:
                conn.respond_error(
                    request_id,
                    error if isinstance(error, PigeonError) else ServiceUnavailable(str(error)),
                )
                return
            segment_id, entry_id, offset = receipt if receipt is not None else (-1, -1, -1)
            fields = {
                "producerId": producer_id,
                "sequenceId": sequence_id,
                "segmentId": segment_id,
                "entryId": entry_id,
                "firstOffset": offset,
            }
            if duplicate:
                fields["duplicate"] = True
            conn.respond(request_id, "sendReceipt", fields)

        try:
            self.core.send(
                producer,
                req.payload,
                num_messages=body.numMessages,
                sequence_id=sequence_id,
                reply=reply,
                fence=lambda error: self._fence_producer(conn, producer, error),
                spawn=lambda fn: self._spawn(conn, request_id, fn),
            )
        except PigeonError as exc:
            # Refused here (too large, malformed, quota, ...): no later send of this
            # producer may be stored before it re-attached, or a resend of this one
            # (its answer lost with the connection) would be taken for a duplicate.
            # The answer goes first, then the closedByBroker push.
            conn.respond_error(request_id, exc)
            self._fence_producer(conn, producer, exc)
        except Exception as exc:
            self._fence_producer(conn, producer, exc)
            raise

    def _fence_producer(self, conn: Connection, producer: Producer, error: BaseException) -> None:
        """A send of ``producer`` was not stored: the core refuses its later sends until
        it re-attaches; tell the client so (``closedByBroker``)."""
        if not self.core.fence_producer(producer, error):
            return
        if not conn.closed:
            with contextlib.suppress(PigeonError):
                conn.send_nowait(
                    "closedByBroker",
                    {
                        "producerId": producer.producer_id,
                        "isProducer": True,
                        "reason": f"send not stored: {error}",
                    },
                )

    def on_closeProducer(self, conn: Connection, req: Request) -> None:
        state = self._state(conn)
        state.abandon("producer", req.body.producerId)
        producer = state.producers.pop(req.body.producerId, None)
        if producer is not None:
            self.core.close_producer(producer)
        conn.respond(req.request_id, "ok")

    # ------------------------------------------------------------------ consumers

    def on_subscribe(self, conn: Connection, req: Request) -> None:
        b = req.body
        name = TopicName.parse(str(b.topic))
        sub_name = str(b.subscription)
        if not sub_name:
            raise InvalidArgument("subscription name must not be empty")
        args = (
            conn,
            req.request_id,
            self._state(conn),
            name,
            sub_name,
            _SUB_TYPES[str(b.subType)],
            str(b.initialPosition),
            b.consumerId,
            str(b.consumerName),
            b.priority,
            b.durable,
            b.startOffset,
            schema_of(b.schemaInfo),
            b.readCompacted,
        )
        self._spawn(conn, req.request_id, self._subscribe, *args)

    async def _subscribe(
        self,
        conn: Connection,
        request_id: int,
        state: _ConnState,
        name: TopicName,
        sub_name: str,
        sub_type: str,
        initial_position: str,
        consumer_id: int,
        consumer_name: str,
        priority: int,
        durable: bool,
        start_offset: int,
        schema: SchemaData | None,
        read_compacted: bool = False,
    ) -> None:
        with state.open_request("consumer", consumer_id, request_id):
            await self._authorize(
                conn, self.core.authorization.check_consume(conn.role, name, sub_name)
            )
            await self.core.schemas.attach_consumer(name, schema)
            consumer, sub, topic = await self.core.subscribe(
                name,
                sub_name,
                sub_type,
                initial_position,
                durable=durable,
                start_offset=start_offset,
                read_compacted=read_compacted,
                still_wanted=lambda: state.check_open("consumer", consumer_id, request_id),
                consumer=lambda: Consumer(
                    conn, consumer_id, consumer_name or f"consumer-{consumer_id}", priority
                ),
            )
            earlier = state.consumers.get(consumer_id)
            if earlier is not None:  # subscribed again under the same id: the old one goes
                earlier[1].remove_consumer(earlier[0])
            state.consumers[consumer_id] = (consumer, sub, topic)
            conn.respond(request_id, "subscribed", {"topic": name.full})

    def _consumer(self, conn: Connection, consumer_id: int) -> tuple[Consumer, Any, Any]:
        found = self._state(conn).consumers.get(consumer_id)
        if found is None:
            raise InvalidArgument(f"unknown consumer id {consumer_id}")
        return found

    def on_flow(self, conn: Connection, req: Request) -> None:
        consumer, sub, _ = self._consumer(conn, req.body.consumerId)
        sub.flow(consumer, req.body.permits)

    def on_ack(self, conn: Connection, req: Request) -> None:
        """Grouped acks come with requestId 0 and get no answer; an ack with a request
        id (``ack_receipt_enabled``) is answered once the cursor holding it is stored."""
        b = req.body
        request_id = req.request_id
        found = self._state(conn).consumers.get(b.consumerId)
        if found is None:
            if request_id:
                raise AckNotPersisted(
                    f"consumer {b.consumerId} is not attached here (closed, or its topic"
                    " moved): acknowledgement not stored"
                )
            raise InvalidArgument(f"unknown consumer id {b.consumerId}")
        consumer, sub, _ = found
        self.core.ack(
            sub,
            consumer,
            [(p.segmentId, p.entryId, p.offset, p.batchIndex, p.count) for p in b.positions],
            cumulative=str(b.ackType) == "cumulative",
        )
        if request_id:
            self._spawn_ok(conn, request_id, sub.persist_acks)

    def on_redeliverUnacked(self, conn: Connection, req: Request) -> None:
        b = req.body
        consumer, sub, _ = self._consumer(conn, b.consumerId)
        self.core.redeliver(sub, consumer, [(p.segmentId, p.entryId) for p in b.positions])
        conn.respond(req.request_id, "ok")

    def on_closeConsumer(self, conn: Connection, req: Request) -> None:
        state = self._state(conn)
        state.abandon("consumer", req.body.consumerId)
        found = state.consumers.pop(req.body.consumerId, None)
        if found is None:
            conn.respond(req.request_id, "ok")
            return
        consumer, sub, topic = found
        sub.remove_consumer(consumer)
        self._spawn_ok(conn, req.request_id, self.core.close_consumer, topic, sub)

    def _check_consume(self, conn: Connection, topic: Any, sub: Any) -> Awaitable[None]:
        return self.core.authorization.check_consume(conn.role, topic.name, sub.name)

    def on_unsubscribe(self, conn: Connection, req: Request) -> None:
        consumer_id = req.body.consumerId
        _consumer, sub, topic = self._consumer(conn, consumer_id)

        def unsubscribe() -> None:
            consumer, sub, topic = self._consumer(conn, consumer_id)
            self.core.check_unsubscribe(sub, consumer)
            self._state(conn).consumers.pop(consumer_id, None)
            sub.remove_consumer(consumer)
            self._spawn_ok(conn, req.request_id, self.core.unsubscribe, topic, sub)

        self._checked(conn, req, lambda: self._check_consume(conn, topic, sub), unsubscribe)

    def on_seek(self, conn: Connection, req: Request) -> None:
        # the request's body is only valid during this call: read it before any task
        b = req.body
        consumer_id = b.consumerId
        _consumer, sub, topic = self._consumer(conn, consumer_id)
        which = b.which()
        if which == "offset":
            target = SeekTarget(offset=b.offset)
        elif which == "timestamp":
            target = SeekTarget(timestamp=b.timestamp)
        else:
            p = b.position
            target = SeekTarget(position=((p.segmentId, p.entryId), p.batchIndex))
        self._checked(
            conn,
            req,
            lambda: self._check_consume(conn, topic, sub),
            lambda: self._seek(conn, req.request_id, consumer_id, target),
        )

    def _seek(
        self, conn: Connection, request_id: int, consumer_id: int, target: SeekTarget
    ) -> None:
        _consumer, sub, topic = self._consumer(conn, consumer_id)
        coro = self.core.seek(topic, sub, target)

        async def seek() -> None:
            await coro
            # Answer before anything from the new position can be pushed (no checkpoint
            # in between): the client drops what it queued from before the seek.
            conn.respond(request_id, "ok")
            await sub.flush()

        self._spawn(conn, request_id, seek)

    def on_getLastMessageId(self, conn: Connection, req: Request) -> None:
        consumer_id = req.body.consumerId
        _consumer, sub, topic = self._consumer(conn, consumer_id)
        self._checked(
            conn,
            req,
            lambda: self._check_consume(conn, topic, sub),
            lambda: self._last_message_id(conn, req.request_id, consumer_id),
        )

    def _last_message_id(self, conn: Connection, request_id: int, consumer_id: int) -> None:
        _consumer, sub, topic = self._consumer(conn, consumer_id)
        (seg_id, entry_id), last_offset, mark_delete = self.core.last_message_id(topic, sub)
        conn.respond(
            request_id,
            "lastMessageId",
            {
                "position": {"segmentId": seg_id, "entryId": entry_id, "batchIndex": -1},
                "offset": last_offset,
                "markDeleteOffset": mark_delete,
            },
        )
