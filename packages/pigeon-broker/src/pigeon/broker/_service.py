"""The broker core: the topic registry, lookups and the API the front doors call.

:class:`BrokerService` owns the loaded topics and knows no wire protocol: the native
protocol's front door (:mod:`pigeon.broker._native`) and the admin API
(:mod:`pigeon.broker._admin`) translate requests into its calls — create a producer,
send, subscribe, ack, redeliver, seek, unsubscribe, close, lookup, stats.  Lifecycle
operations (unload, delete, detach) are in :mod:`pigeon.broker._lifecycle`, publishing in
:mod:`pigeon.broker._publish`, a topic's own state in :mod:`pigeon.broker._topic`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from pigeon.broker._access import Admission
from pigeon.broker._auditor import Auditor
from pigeon.broker._authz import Authorization
from pigeon.broker._config import BrokerConfig
from pigeon.broker._ledger import ManagedLedger
from pigeon.broker._ledger_state import LedgerConfig, Position
from pigeon.broker._lifecycle import close_all_topics, drop_all_topics, unload_topic
from pigeon.broker._loadmanager import LoadManager
from pigeon.broker._native import NativeProtocol
from pigeon.broker._nonpersistent import NonPersistentTopic
from pigeon.broker._offload_sweeper import OffloadSweeper
from pigeon.broker._ownership import Ownership
from pigeon.broker._policies import PolicyStore
from pigeon.broker._producer_access import AccessControl
from pigeon.broker._publish import fence_producer, publish
from pigeon.broker._schema_registry import SchemaRegistry
from pigeon.broker._singleflight import open_once
from pigeon.broker._subscription import Consumer
from pigeon.broker._topic import Producer, Topic, drop_reader
from pigeon.broker._topic_configs import TopicConfigs
from pigeon.broker._topic_protocol import SeekTarget, TopicProtocol
from pigeon.core import TopicName, check_subscription_name
from pigeon.core.auth import Authenticator
from pigeon.core.codecs import GZIP, NONE, CodecSet
from pigeon.core.errors import (
    ConfigError,
    InvalidArgument,
    NoSuchNode,
    NotOwner,
    PigeonError,
    ProducerBusy,
    TlsError,
    TopicExists,
    TopicNotFound,
)
from pigeon.core.paths import (
    LEDGERS_PATH,
    PARTITIONED_TOPICS_PATH,
    ledger_path,
    partitioned_topic_path,
)
from pigeon.core.rpc import BrokerFrame, serve_tcp
from pigeon.core.runtime import WallClock
from pigeon.core.tls import ServerTls, reload_on_sighup

__all__ = ["BrokerService", "FrontDoor"]

log = logging.getLogger(__name__)

MAX_PARTITIONS = 4096


class FrontDoor(Protocol):
    """What the core asks of a front door (the native protocol; Kafka's, later)."""

    def detach(self, topic: Any, reason: str, *, subscription: Any) -> int:
        """Detach the producers and consumers it attached to ``topic`` (only the consumers
        of ``subscription``, given one) and tell their clients to re-attach; returns how
        many."""
        ...

    def close_all(self) -> None:
        """Close every connection (clients reconnect through a new lookup)."""
        ...

    @property
    def connections(self) -> int:
        """Open client connections."""
        ...


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
        authenticator: Authenticator | None = None,
        offloader: Any = None,
    ) -> None:
        self.config = config
        #: where closed segments are offloaded (``managed_ledger_offload_driver``); None: off
        self.offloader = offloader
        #: checks the credentials of every connection (every front door); None: off
        self.authenticator = authenticator
        #: the certificate of every TLS listener (native, admin, Kafka); None: no TLS
        self.server_tls: ServerTls | None = config.server_tls("broker")
        self.codecs = codecs if codecs is not None else CodecSet([NONE, GZIP])
        self.store = store
        self.policy = policy
        self.bookies = bookies
        #: Topic or NonPersistentTopic (see TopicProtocol)
        self.topics: dict[str, TopicProtocol] = {}
        self._opening: dict[str, trio.Event] = {}
        #: the native protocol's front door (port 6650)
        self.native = NativeProtocol(self)
        #: every front door: the core detaches clients and closes connections through
        #: these, never naming one
        self.front_doors: list[FrontDoor] = [self.native]
        self.nursery: trio.Nursery = None  # type: ignore[assignment]
        self.address: tuple[str, int] | None = None
        #: the TLS listener's address (``broker_service_port_tls``), when it runs
        self.address_tls: tuple[str, int] | None = None
        self._names = itertools.count()
        #: producer access modes (exclusive producers, fencing, the topic epoch)
        self.access = AccessControl(store)
        self.clock = WallClock()
        self.policies = PolicyStore(store)
        #: topics' schemas and what may attach with which (see _schema_registry)
        self.schemas = SchemaRegistry(store, self.policies)
        #: partitioned topics' topic-level configs (Kafka's cleanup.policy, ...)
        self.topic_configs = TopicConfigs(store)
        #: may this role do this here (checked once per attach and admin call)
        self.authorization = Authorization(
            self.policies,
            enabled=config.authorization_enabled,
            superuser_roles=config.superuser_roles,
        )
        #: callables returning Prometheus text appended to /metrics (in-process nodes)
        self.extra_metrics: list[Any] = []
        self.ownership: Ownership = None  # type: ignore[assignment]  # set by run()
        self.auditor: Auditor | None = None
        self.offload_sweeper: OffloadSweeper | None = None
        self.load_manager: LoadManager | None = None
        #: the Kafka front door (port 9092), when ``[kafka] port`` is set
        self.kafka: Any = None

    @property
    def connections(self) -> int:
        """Open client connections (of every front door)."""
        return sum(door.connections for door in self.front_doors)

    @property
    def service_url(self) -> str:
        assert self.address is not None
        return f"pigeon://{self.address[0]}:{self.address[1]}"

    @property
    def service_url_tls(self) -> str | None:
        """``pigeon+ssl://host:port`` of the TLS listener; None when there is none."""
        if self.address_tls is None:
            return None
        return f"pigeon+ssl://{self.address_tls[0]}:{self.address_tls[1]}"

    async def _serve_tls(self, nursery: trio.Nursery) -> None:
        """The native protocol over TLS on ``broker_service_port_tls``, next to the
        plaintext port."""
        tls = self.server_tls
        if tls is None:
            raise ConfigError(
                "'broker_service_port_tls' needs 'tls_certificate_file' and 'tls_key_file'"
                " (the broker's certificate)"
            )
        self.address_tls = await nursery.start(
            lambda task_status: serve_tcp(
                self.native,
                BrokerFrame,
                host=self.config.host,
                port=self.config.broker_service_port_tls,
                server_name="pigeon-broker",
                max_frame_size=self.config.max_frame_size,
                max_message_size=self.config.max_message_size,
                tls=tls,
                authenticator=self.authenticator,
                task_status=task_status,
            )
        )
        log.info("broker serving TLS address=%s:%s", *self.address_tls)

    async def run(
        self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            try:
                if self.server_tls is not None:
                    # every TLS listener (native, admin, Kafka) shares this certificate:
                    # SIGHUP reloads it for new connections, open ones stay up
                    await nursery.start(reload_on_sighup, self.server_tls)
                await self.policies.ensure_defaults()
                await nursery.start(self.policies.watch)
                nursery.start_soon(self._maintenance)
                advertised = {}
                if self.config.kafka.port >= 0:
                    from pigeon.broker._kafka import KafkaFrontDoor

                    # bound before the native port opens, so that a client that saw the
                    # broker ready never finds the Kafka port closed; served below
                    self.kafka = KafkaFrontDoor(self, self.config.kafka)
                    self.front_doors.append(self.kafka)
                    await self.kafka.listen()
                    advertised["kafka"] = self.kafka.advertised_address
                if self.config.broker_service_port_tls >= 0:
                    # like Kafka's: open before the plaintext port says the broker is up
                    await self._serve_tls(nursery)
                self.address = await nursery.start(
                    lambda task_status: serve_tcp(
                        self.native,
                        BrokerFrame,
                        host=self.config.host,
                        port=self.config.port,
                        server_name="pigeon-broker",
                        max_frame_size=self.config.max_frame_size,
                        max_message_size=self.config.max_message_size,
                        authenticator=self.authenticator,
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
                    advertised=advertised,
                    service_url_tls=self.service_url_tls,
                )
                await nursery.start(self.ownership.run, self._ownership_lost)
                self.auditor = Auditor(
                    self,
                    grace_period_s=self.config.auditor_grace_period_s,
                    interval_s=self.config.auditor_interval_s,
                )
                await nursery.start(self.auditor.run)
                self.offload_sweeper = OffloadSweeper(
                    self,
                    interval_s=self.config.managed_ledger_offload_sweep_interval_s,
                    grace_s=self.config.managed_ledger_offload_orphan_grace_s,
                    max_objects=self.config.managed_ledger_offload_sweep_max_objects,
                )
                await nursery.start(self.offload_sweeper.run)
                self.load_manager = LoadManager(
                    self, interval_s=self.config.load_manager_interval_s
                )
                await nursery.start(self.load_manager.run)
                if self.kafka is not None:
                    await nursery.start(self.kafka.serve)
                task_status.started(self.address)
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await self._close_topics()

    def load_report(self) -> dict[str, Any]:
        return {
            "topics": len(self.topics),
            "connections": self.connections,
            "msgs_in": sum(t.msgs_in for t in self.topics.values()),
        }

    async def _ownership_lost(self) -> None:
        """The metadata session expired: another broker may own our bundles now."""
        await drop_all_topics(self)

    async def _maintenance(self) -> None:
        """Message TTL, backlog-quota eviction, retention and expired credentials, every
        maintenance interval."""
        while True:
            await trio.sleep(self.config.maintenance_interval_s)
            await self.maintain_once()

    async def maintain_once(self) -> None:
        # connections whose token expired: closed, their clients reconnect with a new one
        self.native.close_expired(self.clock.now_ms() / 1000)
        for topic in list(self.topics.values()):
            if self._orphaned(topic):
                # loaded here while its bundle went elsewhere: its clients would wait
                # on it forever; unloading sends them to the owner
                log.warning("topic loaded without its bundle: unloading topic=%s", topic.name)
                with contextlib.suppress(PigeonError):
                    await unload_topic(self, topic.name)
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

        def loaded() -> TopicProtocol | None:
            topic = self.topics.get(key)
            if topic is not None and not self.ownership.owns(name):
                raise NotOwner(f"{name} is no longer served by this broker")
            return topic

        open_ = functools.partial(self._load_topic, name, create=create)
        return await open_once(self._opening, key, loaded, open_)

    async def _load_topic(self, name: TopicName, *, create: bool) -> Topic:
        """Open the persistent topic ``name`` here (single-flight: see get_topic)."""
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
        ledger.offloader = self.offloader
        await ledger.open()
        topic = Topic(name, ledger, self)
        ledger.on_fenced = lambda: self.nursery.start_soon(self._drop_fenced, topic)
        await topic.recover_dedup()
        self.topics[name.full] = topic
        return topic

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

    # ------------------------------------------------------------------ topics: the core API

    async def partitions_of(self, name: TopicName) -> int:
        """Partition count of a partitioned topic; 0 for a plain topic or a partition."""
        if name.partition_index >= 0:
            return 0
        stat = await self.store.get(partitioned_topic_path(name))
        if stat is None:
            return 0
        return int(json.loads(stat.value)["partitions"])

    async def lookup(self, name: TopicName, *, tls: bool = False) -> tuple[str, int]:
        """(service URL of the broker that serves ``name``, its partition count); with
        ``tls`` (a client that came over TLS) its ``pigeon+ssl://`` URL."""
        partitions = await self.partitions_of(name)
        if not partitions:
            return await self.ownership.lookup(name, tls=tls), partitions
        if not tls:
            return self.service_url, partitions
        if self.service_url_tls is None:  # pragma: no cover - a TLS client came over TLS
            raise TlsError("this broker has no TLS listener (broker_service_port_tls)")
        return self.service_url_tls, partitions

    async def create_topic(
        self, name: TopicName, partitions: int, *, config: dict[str, str] | None = None
    ) -> None:
        """Create a topic; ``partitions > 0`` makes a partitioned one, with the
        topic-level ``config`` (see ``_topic_configs``; checked by the caller)."""
        if partitions < 0 or partitions > MAX_PARTITIONS:
            raise InvalidArgument(f"partitions must be between 0 and {MAX_PARTITIONS}")
        if name.partition_index >= 0 and partitions:
            raise InvalidArgument(f"{name} is a partition; it cannot be partitioned again")
        if await self.partitions_of(name) or await self.store.exists(ledger_path(name)):
            raise TopicExists(f"topic {name} already exists")
        if config and not partitions:
            raise InvalidArgument("topic configs are kept for partitioned topics only")
        if partitions:
            doc: dict[str, Any] = {"partitions": partitions}
            if config:
                doc["config"] = dict(sorted(config.items()))
            await self.store.create(partitioned_topic_path(name), json.dumps(doc).encode())
            self.topic_configs.forget(name)
        else:
            await self.get_topic(name)

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

    # ------------------------------------------------------------------ producers: the core API

    async def create_producer(
        self,
        name: TopicName,
        producer_name: str,
        *,
        client: Any,
        producer_id: int,
        still_wanted: Callable[[], None],
        access_mode: str = "shared",
        epoch: int = -1,
        on_fenced: Callable[[Producer, PigeonError], None] | None = None,
    ) -> Producer:
        """Attach a producer (named here when ``producer_name`` is empty) to the topic.

        ``client`` is the front door's handle of the producer's client (a connection):
        a name attached by another live client is ProducerBusy.  ``still_wanted`` is
        called once the topic is open and raises if the client gave up meanwhile.
        ``access_mode`` and ``epoch`` (the one a re-attaching producer was given, -1 for
        a new one) are checked by :class:`pigeon.broker._producer_access.AccessControl`;
        the producers an ``exclusive_with_fencing`` one removes are handed to
        ``on_fenced`` (the front door tells their clients).  The producer's ``epoch``
        is set.
        """
        topic = await self.get_topic(name)
        still_wanted()
        if not producer_name:
            port = self.address[1] if self.address else 0
            producer_name = (
                f"{self.config.cluster_name}-{port}-{next(self._names)}-{id(client) & 0xFFFF:x}"
            )
        existing = topic.producers.get(producer_name)
        if existing is not None and not existing.conn.closed and existing.conn is not client:
            raise ProducerBusy(f"producer {producer_name!r} is already connected to {name}")
        admission = Admission(0)
        if access_mode != "shared" or self.access.in_use(topic):
            admission = await self.access.admit(
                topic, producer_name, access_mode, epoch, still_wanted
            )
            try:
                if topic.unloaded:
                    raise NotOwner(f"{name} was unloaded here while attaching; look it up again")
                still_wanted()
            except BaseException:
                self.access.released(topic, producer_name)
                raise
        for fenced_name in admission.fence:
            fenced = topic.producers.pop(fenced_name, None)
            if fenced is None:
                continue
            error = self.access.fenced_error(topic, fenced_name)
            fenced.fenced_error = error
            log.info("producer fenced topic=%s producer=%s", name.full, fenced_name)
            if on_fenced is not None:
                on_fenced(fenced, error)
            else:
                fence_producer(fenced, error)
        producer = Producer(client, producer_id, producer_name, topic)
        producer.epoch = admission.epoch
        topic.producers[producer_name] = producer
        return producer

    #: ``send(producer, payload, *, num_messages, sequence_id, reply, fence, spawn)``:
    #: store a batch, or answer it as a duplicate (:func:`pigeon.broker._publish.publish`)
    send = publish

    @staticmethod
    def fence_producer(producer: Producer, error: BaseException) -> bool:
        """Refuse the producer's sends until it re-attaches; False if it already was."""
        return fence_producer(producer, error)

    def close_producer(self, producer: Producer) -> None:
        """Detach the producer from its topic (unless it re-attached meanwhile)."""
        topic = producer.topic
        if topic.producers.get(producer.name) is producer:
            del topic.producers[producer.name]
            if self.access.in_use(topic):
                self.access.released(topic, producer.name)

    # ------------------------------------------------------------------ consumers: the core API

    async def subscribe(
        self,
        name: TopicName,
        sub_name: str,
        sub_type: str,
        initial_position: str,
        *,
        durable: bool,
        start_offset: int,
        still_wanted: Callable[[], None],
        consumer: Callable[[], Consumer],
        read_compacted: bool = False,
    ) -> tuple[Consumer, Any, Any]:
        """Attach a consumer (built by ``consumer()``) to the subscription, opened on first
        use; returns (consumer, subscription, topic).  ``read_compacted``: the consumer
        reads the compacted view first (exclusive and failover subscriptions and readers
        of persistent topics only, as Pulsar).  InvalidSubscriptionName for a name outside
        the rule (:func:`pigeon.core.check_subscription_name`)."""
        check_subscription_name(sub_name)
        if read_compacted and sub_type in ("shared", "key_shared"):
            raise InvalidArgument(
                f"read_compacted is only allowed on exclusive and failover subscriptions"
                f" (and readers), not {sub_type}"
            )
        topic = await self.get_topic(name)
        if read_compacted and not topic.persistent:
            raise InvalidArgument(f"read_compacted needs a persistent topic, {name} is not")
        sub = await topic.subscription(
            sub_name, sub_type, initial_position, durable=durable, start_offset=start_offset
        )
        if topic.unloaded or sub.closed:
            # unloaded (or the subscription stopped) while this subscribe waited: a
            # consumer added now would hang on a topic nobody serves
            raise NotOwner(f"{name} was unloaded here while subscribing; look it up again")
        still_wanted()
        attached = consumer()
        if read_compacted:
            sub.enable_read_compacted()
        sub.add_consumer(attached, sub_type)
        return attached, sub, topic

    @staticmethod
    def ack(
        sub: Any,
        consumer: Consumer,
        positions: list[tuple[int, int, int, int, int]],
        *,
        cumulative: bool,
    ) -> None:
        """Acknowledge (segment id, entry id, offset, batch index, count) positions; an
        offset below 0 names a message by its entry and batch index; a count above 1 (an
        individual ack) names that many consecutive messages of the entry (a run)."""
        acked = []
        runs = []
        for segment_id, entry_id, offset, batch_index, count in positions:
            if offset < 0:
                pending = sub.pending.get((segment_id, entry_id))
                if pending is None:
                    continue  # unknown message: nothing to acknowledge
                offset = pending.first_offset + max(batch_index, 0)
            if count > 1 and not cumulative:
                runs.append(((segment_id, entry_id), offset, count))
            else:
                acked.append(((segment_id, entry_id), offset))
        if runs:
            sub.ack(consumer, acked, cumulative, runs)
        elif acked:
            sub.ack(consumer, acked, cumulative)

    @staticmethod
    def redeliver(sub: Any, consumer: Consumer, positions: list[tuple[int, int]]) -> None:
        """Redeliver the consumer's unacknowledged entries (all of them for ``[]``)."""
        sub.redeliver_unacked(consumer, positions or None)

    @staticmethod
    def detach_consumer(topic: Any, sub: Any, consumer: Consumer) -> None:
        """The consumer's client went away."""
        sub.remove_consumer(consumer)
        drop_reader(topic, sub)

    @staticmethod
    async def close_consumer(topic: Any, sub: Any) -> None:
        """After a consumer left: persist the cursor; a reader's cursor goes with its last
        consumer."""
        await sub.flush()
        drop_reader(topic, sub)

    @staticmethod
    def check_unsubscribe(sub: Any, consumer: Consumer) -> None:
        if any(c is not consumer for c in sub.consumers):
            raise InvalidArgument(f"subscription {sub.name!r} has other consumers")

    @staticmethod
    async def unsubscribe(topic: Any, sub: Any) -> None:
        """Delete the subscription (its last consumer has left)."""
        await sub.delete()
        topic.subscriptions.pop(sub.name, None)

    @staticmethod
    def seek(topic: TopicProtocol, sub: Any, target: SeekTarget) -> Awaitable[None]:
        """Check a seek at once; returns what moves the cursor when awaited."""
        return topic.seek(sub, target)

    @staticmethod
    def last_message_id(topic: TopicProtocol, sub: Any) -> tuple[Position, int, int]:
        """(position of the last entry, last offset, the subscription's mark-delete offset)."""
        return topic.last_message_id(sub)

    def stats(self) -> dict[str, Any]:
        return {
            "under_replicated_fragments": self.auditor.under_replicated if self.auditor else 0,
            "connections": self.connections,
            "topics": {name: t.stats() for name, t in self.topics.items()},
        }
