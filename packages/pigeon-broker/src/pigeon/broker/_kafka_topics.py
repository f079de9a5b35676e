"""Kafka topic requests: Metadata, CreateTopics, DeleteTopics and CreatePartitions, over
the broker core's partitioned topics (the topic configs are ``_kafka_configs``').

Metadata names, for each partition, the broker that owns its bundle as the partition's
leader (an unowned bundle: the broker a lookup would hand it to), so clients send each
partition's requests to the broker that serves it; when that broker dies the next
Metadata names the new owner.  Broker node ids are derived from the Kafka listener's
address (stable across restarts, the same on every broker).

Two things Metadata leaves out, because clients act on them in ways that stall a
consumer here:

* **Leader epochs** (KIP-320): every partition's is -1, "unknown", as a broker without
  KIP-320 answers.  An epoch tells a client to validate its fetch position with
  OffsetForLeaderEpoch whenever the epoch it knows goes up (librdkafka: from -1 after it
  forgets a leader), and holds the partition in ``validate-epoch-wait`` meanwhile; we
  serve no OffsetForLeaderEpoch and keep no epochs that could tell a truncated log.
* **Brokers whose registration lapsed a moment**: a broker whose metadata session
  expired re-registers a fraction of a second later, serving the same partitions.  A
  client given a broker list without it decommissions its connection (librdkafka 2.x:
  the partitions go back to no leader, their epochs and the group coordinator are
  forgotten).  :class:`KnownBrokers` keeps listing every broker registered within
  :data:`BROKER_LINGER_S`.  (The nemesis found the stall: embedded + quorum + journal,
  seed 777, a consumer that got nothing more after its partitions' broker was paused
  past its session.)
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import uuid
import zlib
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from kio.schema.errors import ErrorCode

from pigeon.broker._kafka_wire import (
    NO_LEADER_EPOCH,
    ZERO,
    build,
    error_code,
    part,
    response_type,
)
from pigeon.broker._lifecycle import delete_topic
from pigeon.broker._service import MAX_PARTITIONS
from pigeon.broker._topic_configs import check_config
from pigeon.core.errors import (
    AuthorizationError,
    InvalidArgument,
    PigeonError,
    TopicExists,
    TopicNotFound,
)
from pigeon.core.paths import partitioned_topic_path

if TYPE_CHECKING:
    from pigeon.broker._kafka import KafkaConnection, KafkaFrontDoor

__all__ = [
    "BROKER_LINGER_S",
    "HANDLERS",
    "KnownBrokers",
    "ensure_topic",
    "kafka_topic_names",
    "node_id",
]

log = logging.getLogger(__name__)

CLUSTER_ID = "pigeonmq"
ZERO_UUID = uuid.UUID(int=0)
#: seconds a broker stays in Metadata's broker list after its registration vanished
#: (its metadata session expired; it registers again at once if it is alive)
BROKER_LINGER_S = 30.0


class KnownBrokers:
    """The Kafka listeners of the brokers registered within :data:`BROKER_LINGER_S`
    (address -> registration), for Metadata's broker list.  No I/O: :meth:`update` is
    given what is registered now and the time."""

    def __init__(self, linger: float = BROKER_LINGER_S) -> None:
        self.linger = linger
        #: Kafka address -> (when last seen registered, its registration)
        self._seen: dict[str, tuple[float, dict[str, Any]]] = {}

    def update(self, registered: Mapping[str, dict[str, Any]], now: float) -> dict[str, Any]:
        """Record the brokers ``registered`` now (registration path -> record); every
        broker with a Kafka listener seen within the linger time, by its address."""
        for record in registered.values():
            address = record.get("kafka")
            if address:
                self._seen[address] = (now, record)
        for address, (seen, _) in list(self._seen.items()):
            if now - seen > self.linger:
                del self._seen[address]
        return {address: record for address, (_, record) in self._seen.items()}


def known_brokers(door: KafkaFrontDoor) -> KnownBrokers:
    found: KnownBrokers | None = door.state.get("brokers")
    if found is None:
        found = door.state["brokers"] = KnownBrokers()
    return found


def topic_id(full_name: str) -> uuid.UUID:
    """A topic's Kafka topic id: stable, derived from its name (Metadata v10+)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, full_name)


def node_id(address: str) -> int:
    """A broker's Kafka node id: a stable positive int32 from its Kafka address."""
    return zlib.crc32(address.encode()) & 0x7FFFFFFF


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


async def ensure_topic(door: KafkaFrontDoor, kafka_topic: str, *, create: bool) -> int:
    """Partitions of the Kafka topic; created with the default count when ``create``
    and auto-creation are on (TopicNotFound otherwise)."""
    name = door.topic_name(kafka_topic)
    core = door.core
    partitions = await core.partitions_of(name)
    if partitions:
        return partitions
    if not (create and door.config.auto_create_topics):
        raise TopicNotFound(f"topic {kafka_topic!r} does not exist")
    try:
        await core.create_topic(name, door.config.default_partitions)
        log.info("kafka topic created topic=%s partitions=%d", name, door.config.default_partitions)
    except TopicExists:
        pass  # created meanwhile, or a plain (unpartitioned) topic of that name
    partitions = await core.partitions_of(name)
    if not partitions:
        raise InvalidArgument(
            f"{name} is not a partitioned topic: Kafka clients can use partitioned topics only"
        )
    return partitions


async def kafka_topic_names(door: KafkaFrontDoor) -> list[str]:
    prefix = f"persistent://{door.config.namespace}/"
    found = []
    for full in await door.core.list_topics(door.config.namespace):
        if full.startswith(prefix) and "-partition-" not in full:
            local = full[len(prefix) :]
            if await door.core.partitions_of(door.topic_name(local)):
                found.append(local)
    return found


async def metadata(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    cls = response_type(request)
    create = bool(getattr(request, "allow_auto_topic_creation", True))
    if request.topics is None:  # every topic the role may look up (Kafka's way)
        names = []
        for kafka_topic in await kafka_topic_names(door):
            with contextlib.suppress(AuthorizationError):
                await conn.authorize("lookup", kafka_topic, quiet=True)
                names.append(kafka_topic)
    else:
        names = [t.name for t in request.topics if t.name is not None]
    own = door.advertised_address
    registered = await door.core.ownership.brokers()
    brokers = known_brokers(door).update(registered, trio.current_time())
    brokers.setdefault(own, {})
    topics = []
    for kafka_topic in names:
        try:
            await conn.authorize("lookup", kafka_topic)
            count = await ensure_topic(
                door, kafka_topic, create=create and await _may_create(conn, kafka_topic)
            )
        except PigeonError as exc:
            topics.append(
                part(
                    cls,
                    "MetadataResponseTopic",
                    error_code=error_code(exc),
                    name=kafka_topic,
                    topic_id=ZERO_UUID,
                    is_internal=False,
                    partitions=(),
                    topic_authorized_operations=-2147483648,
                )
            )
            continue
        parts = []
        # a topic's partitions share one bundle (ownership hashes the base name)
        record = await door.core.ownership.lookup_record(door.topic_name(kafka_topic))
        for index in range(count):
            leader = record.get("kafka", own)
            brokers.setdefault(leader, record)
            nid = node_id(leader)
            parts.append(
                part(
                    cls,
                    "MetadataResponsePartition",
                    error_code=ErrorCode.none,
                    partition_index=index,
                    leader_id=nid,
                    leader_epoch=NO_LEADER_EPOCH,
                    replica_nodes=(nid,),
                    isr_nodes=(nid,),
                    offline_replicas=(),
                )
            )
        topics.append(
            part(
                cls,
                "MetadataResponseTopic",
                error_code=ErrorCode.none,
                name=kafka_topic,
                topic_id=topic_id(door.topic_name(kafka_topic).full),
                is_internal=False,
                partitions=tuple(parts),
                topic_authorized_operations=-2147483648,
            )
        )
    broker_parts = tuple(
        part(
            cls,
            "MetadataResponseBroker",
            node_id=node_id(a),
            host=_split(a)[0],
            port=_split(a)[1],
            rack=None,
        )
        for a in sorted(brokers)
    )
    return build(
        cls,
        throttle_time=ZERO,
        brokers=broker_parts,
        cluster_id=CLUSTER_ID,
        controller_id=node_id(own),
        topics=tuple(topics),
        cluster_authorized_operations=-2147483648,
    )


async def _topic_result(
    cls: type[Any],
    entity: str,
    kafka_topic: str,
    action: Awaitable[tuple[ErrorCode, str] | None],
    **fields: object,
) -> Any:
    """One topic's result entity (``entity`` of the response ``cls``): the error code and
    message ``action`` refused with, or of the PigeonError it raised, or none."""
    try:
        refused = await action
    except PigeonError as exc:
        refused = error_code(exc), str(exc)
    code, message = refused or (ErrorCode.none, None)
    return part(cls, entity, name=kafka_topic, error_code=code, error_message=message, **fields)


_R = TypeVar("_R")


async def _may_create(conn: KafkaConnection, kafka_topic: str) -> bool:
    """May a Metadata request create ``kafka_topic`` (auto-creation needs the produce
    right, as producing to it would)?"""
    try:
        await conn.authorize("produce", kafka_topic)
    except AuthorizationError:
        return False
    return True


async def _admin(conn: KafkaConnection, kafka_topic: str, action: Awaitable[_R]) -> _R:
    """``action`` if the role administers the Kafka namespace's tenant (creating,
    deleting and growing topics); AuthorizationError otherwise."""
    try:
        await conn.authorize("admin", kafka_topic)
    except AuthorizationError:
        if inspect.iscoroutine(action):
            action.close()  # never started
        raise
    return await action


async def _create_topic(
    door: KafkaFrontDoor,
    kafka_topic: str,
    count: int,
    configs: tuple[Any, ...],
    validate_only: bool,
) -> tuple[ErrorCode, str] | None:
    name = door.topic_name(kafka_topic)
    try:
        config = topic_config_of(configs)
    except InvalidArgument as exc:
        return ErrorCode.invalid_config, exc.message
    if not validate_only:
        await door.core.create_topic(name, count, config=config)
        if config:
            log.info("kafka topic configs topic=%s %s", name, config)
    elif await door.core.partitions_of(name):
        raise TopicExists(f"topic {kafka_topic!r} already exists")
    return None


async def create_topics(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    cls = response_type(request)
    results = []
    for t in request.topics:
        count = t.num_partitions if t.num_partitions > 0 else door.config.default_partitions
        action = _admin(
            conn, t.name, _create_topic(door, t.name, count, t.configs, request.validate_only)
        )
        results.append(
            await _topic_result(
                cls,
                "CreatableTopicResult",
                t.name,
                action,
                num_partitions=count,
                replication_factor=1,
                configs=(),
            )
        )
    return build(cls, throttle_time=ZERO, topics=tuple(results))


def topic_config_of(configs: tuple[Any, ...]) -> dict[str, str]:
    """The configs to store of a CreateTopics topic's ``configs`` (name, value pairs;
    those without a meaning here are accepted and left out: see ``_topic_configs``).

    :raises InvalidArgument: an unknown name or a bad value (Kafka: INVALID_CONFIG).
    """
    stored = {}
    for c in configs:
        value = check_config(c.name, c.value)
        if value is not None:
            stored[c.name] = value
    return stored


async def _delete_topic(door: KafkaFrontDoor, kafka_topic: str) -> None:
    name = door.topic_name(kafka_topic)
    if not await door.core.partitions_of(name):
        raise TopicNotFound(f"topic {kafka_topic!r} does not exist")
    await delete_topic(door.core, name, force=True)


async def delete_topics(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    cls = response_type(request)
    names = getattr(request, "topic_names", None) or [
        t.name for t in getattr(request, "topics", ())
    ]
    results = [
        await _topic_result(cls, "DeletableTopicResult", n, _admin(conn, n, _delete_topic(door, n)))
        for n in names
    ]
    return build(cls, throttle_time=ZERO, responses=tuple(results))


async def _add_partitions(
    door: KafkaFrontDoor, kafka_topic: str, count: int, validate_only: bool
) -> tuple[ErrorCode, str] | None:
    name = door.topic_name(kafka_topic)
    current = await door.core.partitions_of(name)
    if not current:
        raise TopicNotFound(f"topic {kafka_topic!r} does not exist")
    if count <= current:
        return ErrorCode.invalid_partitions, (
            f"topic {kafka_topic!r} has {current} partitions; ask for more"
        )
    if count > MAX_PARTITIONS:
        return ErrorCode.invalid_partitions, f"a topic has at most {MAX_PARTITIONS} partitions"
    if not validate_only:
        # the node's other fields (the topic's configs) stay; a concurrent change of
        # it fails this one (BadVersion: the client retries)
        path = partitioned_topic_path(name)
        stat = await door.core.store.get(path)
        if stat is None:
            raise TopicNotFound(f"topic {kafka_topic!r} does not exist")
        doc = {**json.loads(stat.value), "partitions": count}
        await door.core.store.set(path, json.dumps(doc).encode(), version=stat.version)
        log.info("kafka topic partitions added topic=%s %d -> %d", name, current, count)
    return None


async def create_partitions(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    cls = response_type(request)
    results = [
        await _topic_result(
            cls,
            "CreatePartitionsTopicResult",
            t.name,
            _admin(conn, t.name, _add_partitions(door, t.name, t.count, request.validate_only)),
        )
        for t in request.topics
    ]
    return build(cls, throttle_time=ZERO, results=tuple(results))


HANDLERS = {
    3: metadata,
    19: create_topics,
    20: delete_topics,
    37: create_partitions,
}
