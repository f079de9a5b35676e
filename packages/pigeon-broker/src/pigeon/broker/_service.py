"""The broker: serves producers and consumers over the PigeonMQ protocol.

Request handlers are synchronous (see :mod:`pigeon.core._rpc`); anything that waits —
opening a topic, persisting a cursor — runs as a task in the connection's nursery.
Produce requests never wait in a task: ``on_send`` appends to the managed ledger at once,
so the order of requests on a connection is the order in the log.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import trio

from pigeon.broker._auditor import Auditor
from pigeon.broker._config import BrokerConfig
from pigeon.broker._dedup import Decision
from pigeon.broker._ledger import LedgerConfig, ManagedLedger
from pigeon.broker._lifecycle import close_all_topics, drop_all_topics, unload_topic
from pigeon.broker._loadmanager import LoadManager
from pigeon.broker._nonpersistent import NonPersistentSubscription, NonPersistentTopic
from pigeon.broker._ownership import Ownership
from pigeon.broker._policies import PolicyStore
from pigeon.broker._subscription import Consumer, Subscription
from pigeon.broker._topic import Producer, Topic, drop_reader
from pigeon.core import TopicName
from pigeon.core.batch import read_header
from pigeon.core.codecs import GZIP, NONE, CodecSet
from pigeon.core.errors import (
    InternalError,
    InvalidArgument,
    MessageTooLarge,
    NoSuchNode,
    NotOwner,
    NotSupported,
    PigeonError,
    ProducerBlocked,
    ProducerBusy,
    ServiceUnavailable,
    TopicExists,
    TopicNotFound,
)
from pigeon.core.paths import (
    LEDGERS_PATH,
    PARTITIONED_TOPICS_PATH,
    ledger_path,
    partitioned_topic_path,
)
from pigeon.core.rpc import BrokerFrame, Connection, Request, serve_tcp
from pigeon.core.runtime import WallClock

__all__ = ["BrokerService"]

log = logging.getLogger(__name__)

#: how long a duplicate's answer waits for its original to be named: the client
#: completes its sends in order, so every later send of the producer waits too
DEDUP_LOOKUP_WAIT_S = 2.0
MAX_PARTITIONS = 4096

_SUB_TYPES = {
    "exclusive": "exclusive",
    "shared": "shared",
    "failover": "failover",
    "keyShared": "keyShared",
}


@dataclass(eq=False)
class _ConnState:
    producers: dict[int, Producer] = field(default_factory=dict)
    consumers: dict[int, tuple[Consumer, Subscription, Topic]] = field(default_factory=dict)
    #: request ids of createProducer / subscribe still in progress, by (kind, id)
    opening: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    #: of those, the ones whose producer or consumer the client closed meanwhile (it
    #: gave up waiting): they must not add it when they finish
    abandoned: set[int] = field(default_factory=set)

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


class BrokerService:
    """Owns topics; handles the client protocol."""

    def __init__(
        self,
        config: BrokerConfig,
        *,
        store: Any,
        policy: Any,
        bookies: Any,
        codecs: Any = None,
    ) -> None:
        self.config = config
        self.codecs = codecs if codecs is not None else CodecSet([NONE, GZIP])
        self.store = store
        self.policy = policy
        self.bookies = bookies
        #: Topic or NonPersistentTopic, branched on ``persistent``
        self.topics: dict[str, Any] = {}
        self._opening: dict[str, trio.Event] = {}
        self._conns: dict[Connection, _ConnState] = {}
        self.nursery: trio.Nursery = None  # type: ignore[assignment]
        self.address: tuple[str, int] | None = None
        self._names = itertools.count()
        self.clock = WallClock()
        self.policies = PolicyStore(store)
        #: callables returning Prometheus text appended to /metrics (in-process nodes)
        self.extra_metrics: list[Any] = []
        self.ownership: Ownership = None  # type: ignore[assignment]  # set by run()
        self.auditor: Auditor | None = None
        self.load_manager: LoadManager | None = None

    @property
    def service_url(self) -> str:
        assert self.address is not None
        return f"pigeon://{self.address[0]}:{self.address[1]}"

    async def run(
        self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            try:
                await self.policies.ensure_defaults()
                await nursery.start(self.policies.watch)
                nursery.start_soon(self._maintenance)
                self.address = await nursery.start(
                    lambda task_status: serve_tcp(
                        self,
                        BrokerFrame,
                        host=self.config.host,
                        port=self.config.port,
                        server_name="pigeon-broker",
                        max_frame_size=self.config.max_frame_size,
                        max_message_size=self.config.max_message_size,
                        task_status=task_status,
                    )
                )
                log.info("broker serving address=%s:%s", *self.address)
                self.ownership = Ownership(
                    self.store,
                    self.service_url,
                    f"{self.address[0]}:{self.address[1]}",
                    bundles_per_namespace=self.config.bundles_per_namespace,
                    load=self.load_report,
                )
                await nursery.start(self.ownership.run, self._ownership_lost)
                self.auditor = Auditor(
                    self,
                    grace_period_s=self.config.auditor_grace_period_s,
                    interval_s=self.config.auditor_interval_s,
                )
                await nursery.start(self.auditor.run)
                self.load_manager = LoadManager(
                    self, interval_s=self.config.load_manager_interval_s
                )
                await nursery.start(self.load_manager.run)
                task_status.started(self.address)
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await self._close_topics()

    def load_report(self) -> dict[str, Any]:
        return {
            "topics": len(self.topics),
            "connections": len(self._conns),
            "msgs_in": sum(
                t.ledger.msgs_in if t.persistent else t.msgs_in for t in self.topics.values()
            ),
        }

    async def _ownership_lost(self) -> None:
        """The metadata session expired: another broker may own our bundles now."""
        await drop_all_topics(self)

    async def _maintenance(self) -> None:
        """Message TTL, backlog-quota eviction and retention, every maintenance interval."""
        while True:
            await trio.sleep(self.config.maintenance_interval_s)
            await self.maintain_once()

    async def maintain_once(self) -> None:
        for topic in list(self.topics.values()):
            if self._orphaned(topic):
                # loaded here while its bundle went elsewhere: its clients would wait
                # on it forever; unloading sends them to the owner
                log.warning("topic loaded without its bundle: unloading topic=%s", topic.name)
                with contextlib.suppress(PigeonError):
                    await unload_topic(self, topic.name)
                continue
            if not topic.persistent:
                continue
            try:
                await topic.maintain(self.policies.cached(topic.name.namespace_name))
            except PigeonError as exc:
                log.warning("topic maintenance failed topic=%s error=%s", topic.name, exc)

    def _orphaned(self, topic: Any) -> bool:
        ownership = self.ownership
        name: TopicName = topic.name
        if ownership is None or self.topics.get(name.full) is not topic:
            return False
        if ownership.owns(name):
            return False
        return ownership.path_of(name) not in ownership.releasing

    async def _close_topics(self) -> None:
        """Shutdown: every topic at once, each within 20 s."""
        await close_all_topics(self)

    # ------------------------------------------------------------------ topics

    async def get_topic(self, name: TopicName, *, create: bool = True) -> Any:
        key = name.full
        if not name.persistent:
            await self.ownership.acquire(name)
            np_topic = self.topics.get(key)
            if np_topic is None:
                np_topic = self.topics[key] = NonPersistentTopic(name, self.clock)
            return np_topic
        while True:
            topic = self.topics.get(key)
            if topic is not None:
                if not self.ownership.owns(name):
                    raise NotOwner(f"{name} is no longer served by this broker")
                return topic
            opening = self._opening.get(key)
            if opening is None:
                break
            await opening.wait()
        ev = self._opening[key] = trio.Event()
        try:
            if await self.partitions_of(name):
                raise InvalidArgument(
                    f"{name} is a partitioned topic: use its partitions ({name}-partition-<i>)"
                )
            try:
                await self.policies.get(name.namespace_name)
            except NoSuchNode:
                raise TopicNotFound(
                    f"namespace {name.namespace_name} of topic {name} does not exist"
                ) from None
            if not create and await self.store.get(ledger_path(name)) is None:
                raise TopicNotFound(f"topic {name} does not exist")
            await self.ownership.acquire(name)
            ledger = ManagedLedger(
                name,
                store=self.store,
                policy=self.policy,
                bookies=self.bookies,
                nursery=self.nursery,
                config=LedgerConfig(
                    max_entries_per_segment=self.config.segment_max_entries,
                    max_segment_bytes=self.config.segment_max_bytes,
                    max_segment_age_s=self.config.segment_max_age_s,
                    cache_max_bytes=self.config.cache_max_bytes,
                ),
                quorum=lambda: self._quorum_of(name),
                clock=self.clock,
            )
            await ledger.open()
            topic = Topic(name, ledger, self)
            ledger.on_fenced = lambda: self.nursery.start_soon(self._drop_fenced, topic)
            await topic.recover_dedup()
            self.topics[key] = topic
            return topic
        finally:
            del self._opening[key]
            ev.set()

    async def _drop_fenced(self, topic: Topic) -> None:
        """The topic's ledger was taken over by another broker: unload it here, so its
        clients look it up again and find the new owner."""
        if self.topics.get(topic.name.full) is topic:
            with contextlib.suppress(PigeonError):
                await unload_topic(self, topic.name)

    def max_message_size(self, name: TopicName) -> int:
        """The broker's limit, lowered by the namespace policy if it sets one."""
        policy = self.policies.cached(name.namespace_name).max_message_size
        return min(self.config.max_message_size, policy or self.config.max_message_size)

    def _quorum_of(self, name: TopicName) -> tuple[int, int, int] | None:
        """Replication of new segments from the namespace policy (None: broker config)."""
        p = self.policies.cached(name.namespace_name)
        if p.ensemble_size is None or p.write_quorum is None or p.ack_quorum is None:
            return None
        return (p.ensemble_size, p.write_quorum, p.ack_quorum)

    # ------------------------------------------------------------------ connections

    def connection_opened(self, conn: Connection) -> None:
        self._conns[conn] = _ConnState()

    def connection_closed(self, conn: Connection) -> None:
        state = self._conns.pop(conn, None)
        if state is None:
            return
        for producer in state.producers.values():
            if producer.topic.producers.get(producer.name) is producer:
                del producer.topic.producers[producer.name]
        for consumer, sub, topic in state.consumers.values():
            sub.remove_consumer(consumer)
            drop_reader(topic, sub)

    def _state(self, conn: Connection) -> _ConnState:
        state = self._conns.get(conn)
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

        nursery = conn.nursery or self.nursery
        nursery.start_soon(runner)

    # ------------------------------------------------------------------ lookup

    async def partitions_of(self, name: TopicName) -> int:
        """Partition count of a partitioned topic; 0 for a plain topic or a partition."""
        if name.partition_index >= 0:
            return 0
        stat = await self.store.get(partitioned_topic_path(name))
        if stat is None:
            return 0
        return int(json.loads(stat.value)["partitions"])

    def on_lookup(self, conn: Connection, req: Request) -> None:
        name = TopicName.parse(str(req.body.topic))

        async def lookup() -> None:
            partitions = await self.partitions_of(name)
            url = self.service_url if partitions else await self.ownership.lookup(name)
            conn.respond(
                req.request_id,
                "lookupResult",
                {"brokerUrl": url, "partitions": partitions, "topic": name.full},
            )

        self._spawn(conn, req.request_id, lookup)

    async def create_topic(self, name: TopicName, partitions: int) -> None:
        """Create a topic; ``partitions > 0`` makes a partitioned one."""
        if partitions < 0 or partitions > MAX_PARTITIONS:
            raise InvalidArgument(f"partitions must be between 0 and {MAX_PARTITIONS}")
        if name.partition_index >= 0 and partitions:
            raise InvalidArgument(f"{name} is a partition; it cannot be partitioned again")
        if await self.partitions_of(name) or await self.store.exists(ledger_path(name)):
            raise TopicExists(f"topic {name} already exists")
        if partitions:
            await self.store.create(
                partitioned_topic_path(name), json.dumps({"partitions": partitions}).encode()
            )
        else:
            await self.get_topic(name)

    def on_createTopic(self, conn: Connection, req: Request) -> None:
        name = TopicName.parse(str(req.body.topic))
        partitions = req.body.partitions

        async def create() -> None:
            await self.create_topic(name, partitions)
            conn.respond(req.request_id, "ok")

        self._spawn(conn, req.request_id, create)

    async def list_topics(self, namespace: str) -> list[str]:
        tenant, _, ns = namespace.partition("/")
        if not tenant or not ns or "/" in ns:
            raise InvalidArgument(f"namespace must look like tenant/namespace, got {namespace!r}")
        found: set[str] = set()
        for domain in ("persistent", "non-persistent"):
            for root in (LEDGERS_PATH, PARTITIONED_TOPICS_PATH):
                for local in await self.store.children(f"{root}/{domain}/{tenant}/{ns}"):
                    found.add(f"{domain}://{tenant}/{ns}/{local}")
        for name in self.topics:
            t = TopicName.parse(name)
            if t.namespace_name == namespace:
                found.add(name)
        partitioned = {t for t in found if await self.partitions_of(TopicName.parse(t))}
        return sorted(
            t
            for t in found
            if TopicName.parse(t).partition_index < 0
            or TopicName.parse(t).base.full not in partitioned
        )

    def on_listTopics(self, conn: Connection, req: Request) -> None:
        namespace = str(req.body.namespace)

        async def list_() -> None:
            conn.respond(req.request_id, "topicList", {"topics": await self.list_topics(namespace)})

        self._spawn(conn, req.request_id, list_)

    # ------------------------------------------------------------------ producers

    def on_createProducer(self, conn: Connection, req: Request) -> None:
        name = TopicName.parse(str(req.body.topic))
        producer_id = req.body.producerId
        producer_name = str(req.body.producerName)
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
        )

    async def _create_producer(
        self,
        conn: Connection,
        request_id: int,
        state: _ConnState,
        name: TopicName,
        producer_id: int,
        producer_name: str,
    ) -> None:
        with state.open_request("producer", producer_id, request_id):
            await self._open_producer(conn, request_id, state, name, producer_id, producer_name)

    async def _open_producer(
        self,
        conn: Connection,
        request_id: int,
        state: _ConnState,
        name: TopicName,
        producer_id: int,
        producer_name: str,
    ) -> None:
        topic = await self.get_topic(name)
        state.check_open("producer", producer_id, request_id)
        if not producer_name:
            port = self.address[1] if self.address else 0
            producer_name = (
                f"{self.config.cluster_name}-{port}-{next(self._names)}-{id(conn) & 0xFFFF:x}"
            )
        existing = topic.producers.get(producer_name)
        if existing is not None and not existing.conn.closed and existing.conn is not conn:
            raise ProducerBusy(f"producer {producer_name!r} is already connected to {name}")
        producer = Producer(conn, producer_id, producer_name, topic)
        topic.producers[producer_name] = producer
        state.producers[producer_id] = producer
        conn.respond(
            request_id,
            "producerCreated",
            {
                "producerName": producer_name,
                "lastSequenceId": topic.dedup.pushed_sequence(producer_name),
                "maxMessageSize": self.max_message_size(name),
                "topic": name.full,
            },
        )

    def on_send(self, conn: Connection, req: Request) -> None:
        producer = self._state(conn).producers.get(req.body.producerId)
        if producer is None:
            raise InvalidArgument(f"unknown producer id {req.body.producerId}")
        try:
            self._send(conn, req, producer)
        except PigeonError as exc:
            # Refused here (too large, malformed, quota, ...): no later send of this
            # producer may be stored before it re-attached, or a resend of this one
            # (its answer lost with the connection) would be taken for a duplicate.
            # The answer goes first, then the closedByBroker push.
            conn.respond_error(req.request_id, exc)
            self._fence_producer(conn, producer, exc)
        except Exception as exc:
            self._fence_producer(conn, producer, exc)
            raise

    def _send(self, conn: Connection, req: Request, producer: Producer) -> None:
        body = req.body
        payload = req.payload
        policies = self.policies.cached(producer.topic.name.namespace_name)
        limit = self.max_message_size(producer.topic.name)
        if len(payload) > limit:
            raise MessageTooLarge(f"batch of {len(payload)} bytes exceeds max_message_size {limit}")
        header = read_header(payload)
        n = body.numMessages
        if header.num_messages != n or n == 0:
            raise InvalidArgument(
                f"send says {n} messages but its batch holds {header.num_messages}"
            )
        sequence_id = body.sequenceId
        topic = producer.topic
        if producer.fenced:
            raise ServiceUnavailable(
                f"producer {producer.name} lost a send and must re-attach before sending on"
            )
        dedup = topic.dedup
        name = producer.name
        request_id = req.request_id
        producer_id = body.producerId

        def answer(
            receipt: Any, error: BaseException | None, duplicate: bool, why: str = ""
        ) -> None:
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
                if receipt is None:
                    log.info(
                        "duplicate answered without its position topic=%s producer=%s"
                        " sequence=%d count=%d why=%s",
                        topic.name,
                        name,
                        sequence_id,
                        n,
                        why or "original not remembered",
                    )
            conn.respond(request_id, "sendReceipt", fields)

        decision = dedup.check(name, sequence_id, n) if policies.deduplication else Decision.NEW
        if decision is Decision.DUPLICATE:
            receipt = dedup.receipt(name, sequence_id, n)
            if receipt is None and topic.persistent and topic.may_find_original(name, sequence_id):
                # stored before the state this broker recovered from: look it up (the
                # client completes its sends in order whatever order answers come in)
                async def look_up() -> None:
                    found, why = None, "original not found in the log"
                    try:
                        with trio.move_on_after(DEDUP_LOOKUP_WAIT_S) as scope:
                            found = await topic.original_receipt(name, sequence_id, n)
                        if scope.cancelled_caught:
                            why = f"original not found within {DEDUP_LOOKUP_WAIT_S}s"
                    except PigeonError as exc:
                        why = f"reading the log failed: {exc}"
                    answer(found, None, True, why)

                self._spawn(conn, request_id, look_up)
                return
            answer(receipt, None, True, "original not remembered, log not searched")
            return
        if decision is Decision.IN_FLIGHT:

            def resent(receipt: Any, error: BaseException | None) -> None:
                answer(receipt, error, True, "in-flight original batched differently")
                if error is not None:
                    # the original (sent on an earlier attachment) was not stored: this
                    # attachment's later sends must not be stored before its resend
                    self._fence_producer(conn, producer, error)

            dedup.wait(name, sequence_id, n, resent)
            return
        if (
            topic.persistent
            and policies.backlog_quota_bytes >= 0
            and policies.backlog_quota_policy == "producer_exception"
            and topic.backlog_bytes() > policies.backlog_quota_bytes
        ):
            raise ProducerBlocked(
                f"backlog of {topic.name} exceeds its quota of {policies.backlog_quota_bytes} bytes"
            )

        def done(result: Any, error: BaseException | None) -> None:
            if error is not None:
                dedup.failed(name, sequence_id, n, error, flight)
                answer(None, error, False)
                self._fence_producer(conn, producer, error)
                return
            dedup.persisted(name, sequence_id, n, result)
            topic.confirm_sequence(result[0], result[1])
            answer(result, None, False)

        flight = dedup.pushed(name, sequence_id, n)
        deliver_at = header.deliver_at
        if topic.persistent and (
            topic._held  # sends held earlier go first (a producer's order is the log's)
            or (
                policies.backlog_quota_bytes >= 0
                and policies.backlog_quota_policy == "producer_request_hold"
                and topic.backlog_bytes() > policies.backlog_quota_bytes
            )
        ):
            payload_copy = bytes(payload)

            def release() -> None:
                if producer.fenced:
                    # an earlier send of this producer failed meanwhile: storing this one
                    # would make that one's resend look like a duplicate
                    done(None, ServiceUnavailable(f"producer {name} must resend from a lost send"))
                    return
                self._append(topic, payload_copy, n, done, deliver_at)

            topic.hold(release)
            return
        self._append(topic, payload, n, done, deliver_at)

    @staticmethod
    def _append(topic: Any, payload: Any, n: int, done: Any, deliver_at: int) -> None:
        """Append, turning a refusal (closed or unwritable ledger) into ``done``'s error."""
        try:
            topic.append(payload, n, done, deliver_at=deliver_at)
        except PigeonError as exc:
            done(None, exc)

    def _fence_producer(self, conn: Connection, producer: Producer, error: BaseException) -> None:
        """A send of ``producer`` was not stored: refuse its later sends until it
        re-attaches, so that it resends from the lost one on, in order."""
        if producer.fenced:
            return
        producer.fenced = True
        log.info(
            "producer must re-attach topic=%s producer=%s error=%s",
            producer.topic.name,
            producer.name,
            error,
        )
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
        if producer is not None and producer.topic.producers.get(producer.name) is producer:
            del producer.topic.producers[producer.name]
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
    ) -> None:
        with state.open_request("consumer", consumer_id, request_id):
            await self._open_consumer(
                conn,
                request_id,
                state,
                name,
                sub_name,
                sub_type,
                initial_position,
                consumer_id,
                consumer_name,
                priority,
                durable,
                start_offset,
            )

    async def _open_consumer(
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
    ) -> None:
        topic = await self.get_topic(name)
        sub = await topic.subscription(
            sub_name, sub_type, initial_position, durable=durable, start_offset=start_offset
        )
        if topic.unloaded or sub.closed:
            # unloaded (or the subscription stopped) while this subscribe waited: a
            # consumer added now would hang on a topic nobody serves
            raise NotOwner(f"{name} was unloaded here while subscribing; look it up again")
        state.check_open("consumer", consumer_id, request_id)
        consumer = Consumer(conn, consumer_id, consumer_name or f"consumer-{consumer_id}", priority)
        sub.add_consumer(consumer, sub_type)
        earlier = state.consumers.get(consumer_id)
        if earlier is not None:  # subscribed again under the same id: the old one goes
            earlier[1].remove_consumer(earlier[0])
        state.consumers[consumer_id] = (consumer, sub, topic)
        conn.respond(request_id, "subscribed", {"topic": name.full})

    def _consumer(self, conn: Connection, consumer_id: int) -> tuple[Consumer, Subscription, Any]:
        found = self._state(conn).consumers.get(consumer_id)
        if found is None:
            raise InvalidArgument(f"unknown consumer id {consumer_id}")
        return found

    def on_flow(self, conn: Connection, req: Request) -> None:
        consumer, sub, _ = self._consumer(conn, req.body.consumerId)
        sub.flow(consumer, req.body.permits)

    def on_ack(self, conn: Connection, req: Request) -> None:
        b = req.body
        consumer, sub, _ = self._consumer(conn, b.consumerId)
        if isinstance(sub, NonPersistentSubscription):
            conn.respond(req.request_id, "ok")
            return
        positions = []
        for p in b.positions:
            offset = p.offset
            if offset < 0:
                pending = sub.pending.get((p.segmentId, p.entryId))
                if pending is None:
                    continue  # unknown message: nothing to acknowledge
                offset = pending.first_offset + max(p.batchIndex, 0)
            positions.append(((p.segmentId, p.entryId), offset))
        if positions:
            sub.ack(consumer, positions, str(b.ackType) == "cumulative")
        conn.respond(req.request_id, "ok")

    def on_redeliverUnacked(self, conn: Connection, req: Request) -> None:
        b = req.body
        consumer, sub, _ = self._consumer(conn, b.consumerId)
        if isinstance(sub, NonPersistentSubscription):
            conn.respond(req.request_id, "ok")
            return
        positions = [(p.segmentId, p.entryId) for p in b.positions]
        sub.redeliver_unacked(consumer, positions or None)
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

        async def close() -> None:
            await sub.flush()
            drop_reader(topic, sub)
            conn.respond(req.request_id, "ok")

        self._spawn(conn, req.request_id, close)

    def on_unsubscribe(self, conn: Connection, req: Request) -> None:
        consumer, sub, topic = self._consumer(conn, req.body.consumerId)
        if any(c is not consumer for c in sub.consumers):
            raise InvalidArgument(f"subscription {sub.name!r} has other consumers")
        self._state(conn).consumers.pop(req.body.consumerId, None)
        sub.remove_consumer(consumer)

        async def unsubscribe() -> None:
            await sub.delete()
            topic.subscriptions.pop(sub.name, None)
            conn.respond(req.request_id, "ok")

        self._spawn(conn, req.request_id, unsubscribe)

    def on_seek(self, conn: Connection, req: Request) -> None:
        b = req.body
        _consumer, sub, _ = self._consumer(conn, b.consumerId)
        if isinstance(sub, NonPersistentSubscription):
            raise NotSupported("seek is not supported on non-persistent topics")
        which = b.which()
        if which == "offset":
            coro: Any = sub.seek_offset(b.offset)
        elif which == "timestamp":
            coro = sub.seek_time(b.timestamp)
        else:
            if sub.ledger.index_of_segment(b.position.segmentId) is None:
                raise InvalidArgument(
                    f"segment {b.position.segmentId} is not (or no longer) part of this topic"
                )
            coro = sub.seek_position(
                (b.position.segmentId, b.position.entryId), b.position.batchIndex
            )

        async def seek() -> None:
            await coro
            # Answer before anything from the new position can be pushed (no checkpoint
            # in between): the client drops what it queued from before the seek.
            conn.respond(req.request_id, "ok")
            await sub.flush()

        self._spawn(conn, req.request_id, seek)

    def on_getLastMessageId(self, conn: Connection, req: Request) -> None:
        _consumer, sub, topic = self._consumer(conn, req.body.consumerId)
        if isinstance(sub, NonPersistentSubscription):
            conn.respond(
                req.request_id,
                "lastMessageId",
                {
                    "position": {"segmentId": -1, "entryId": -1, "batchIndex": -1},
                    "offset": topic.next_offset - 1,
                    "markDeleteOffset": topic.next_offset,
                },
            )
            return
        ledger = sub.ledger
        seg_id, entry_id = ledger.last_position
        conn.respond(
            req.request_id,
            "lastMessageId",
            {
                "position": {"segmentId": seg_id, "entryId": entry_id, "batchIndex": -1},
                "offset": ledger.next_offset - 1,
                "markDeleteOffset": sub.cursor.mark_delete,
            },
        )

    def stats(self) -> dict[str, Any]:
        return {
            "under_replicated_fragments": self.auditor.under_replicated if self.auditor else 0,
            "connections": len(self._conns),
            "topics": {name: t.stats() for name, t in self.topics.items()},
        }
