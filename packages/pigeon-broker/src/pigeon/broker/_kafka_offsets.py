"""Kafka consumer groups' coordinator lookup and committed offsets.

**A Kafka consumer group is a PigeonMQ subscription.**  Group ``g`` committing offset
``o`` on partition ``p`` moves the cursor of subscription ``g`` of partition ``p`` to
``o`` (everything below is acknowledged): ``pigeon admin topics stats`` shows it as the
subscription's mark-delete offset and backlog, retention keeps what it has not read,
and a native consumer of subscription ``g`` goes on from there (and the other way
round).  The cursor is written where the partition is served when that is this broker
(a compare-and-set at the version the subscription took over, like every cursor write of
the serving broker); otherwise its cursor node is written directly, which the serving
broker reads when it opens the subscription (it never overwrites a cursor it did not
change: its compare-and-set fails and it loads the cursor again).  A direct write is made
only while the metadata session this broker checked coordination under is alive
(``multi([check(session marker), write])``): a coordinator paused past its session, whose
group moved on and committed later offsets at the next coordinator, cannot put its older
commit back on top of them when it resumes (it answers NOT_COORDINATOR).

The group coordinator is the broker that owns the bundle of the group's name (a name in
the Kafka namespace, ``__kafka_group_<group>``): FindCoordinator names it, and a broker
asked to coordinate a group whose bundle another broker owns answers NOT_COORDINATOR.
Membership lives in the coordinator's memory; when it dies, members find the next
coordinator and join again, and their committed offsets are where they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import string
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode

from pigeon.broker._cursor import CursorState
from pigeon.broker._kafka_topics import node_id
from pigeon.broker._kafka_wire import ZERO, build, error_code, part, response_type
from pigeon.core import TopicName
from pigeon.core.errors import (
    AuthorizationError,
    BadVersion,
    MetadataError,
    NodeExists,
    NoSuchNode,
    NotOwner,
    PigeonError,
    TopicNotFound,
)
from pigeon.core.metadata import Op
from pigeon.core.paths import BROKER_SESSIONS_PATH, cursor_path

if TYPE_CHECKING:
    from pigeon.broker._kafka import KafkaConnection, KafkaFrontDoor

__all__ = ["HANDLERS", "coordinates"]

log = logging.getLogger(__name__)


def _group_topic(door: KafkaFrontDoor, group: str) -> TopicName:
    """The name whose bundle's owner coordinates ``group`` (any string is a group id:
    the name holds a digest of it)."""
    digest = hashlib.sha1(group.encode("utf-8", "surrogatepass")).hexdigest()[:20]
    return TopicName.parse(f"persistent://{door.config.namespace}/__kafka_group_{digest}")


def subscription_of(group: str) -> str:
    """The subscription a Kafka consumer group is: the group id itself, each character
    outside the subscription name alphabet (``pigeon.core.check_subscription_name``:
    ASCII letters, digits, ``_ . - = :``) and ``%`` itself percent-encoded as its UTF-8
    bytes (``my group`` is ``my%20group``), and ``.``/``..`` as ``%2E``/``%2E%2E``.
    (A group id encoded past 255 characters is used all the same: Kafka allows it.)"""
    if group in (".", ".."):
        return group.replace(".", "%2E")
    return "".join(
        c if c in _PLAIN else "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
        for c in group
    )


def legacy_subscription_of(group: str) -> str:
    """The subscription name a group had before :func:`subscription_of` encoded every
    character outside the name alphabet (only ``%``, ``/`` and control characters were):
    its committed offsets are read from there while the new name has none."""
    if group in (".", ".."):
        return group.replace(".", "%2E")
    return "".join(
        f"%{ord(c):02X}" if c in "%/" or ord(c) < 32 or ord(c) == 127 else c for c in group
    )


#: the characters of a group id used as they are in its subscription's name
_PLAIN = frozenset(string.ascii_letters + string.digits + "_.-=:")


async def coordinates(door: KafkaFrontDoor, group: str) -> bool:
    """Whether this broker coordinates ``group`` (claiming its bundle if nobody holds it)."""
    try:
        await door.core.ownership.acquire(_group_topic(door, group))
    except NotOwner:
        return False
    return True


async def find_coordinator(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    cls = response_type(request)
    key = getattr(request, "key", "")
    if getattr(request, "key_type", 0) != 0:
        return build(
            cls,
            throttle_time=ZERO,
            error_code=ErrorCode.coordinator_not_available,
            error_message="transactions are not supported",
            node_id=-1,
            host="",
            port=-1,
        )
    record = await door.core.ownership.lookup_record(_group_topic(door, key))
    address = record.get("kafka") or door.advertised_address
    host, _, port = address.rpartition(":")
    return build(
        cls,
        throttle_time=ZERO,
        error_code=ErrorCode.none,
        error_message=None,
        node_id=node_id(address),
        host=host,
        port=int(port),
    )


async def _loaded_subscription(door: KafkaFrontDoor, name: TopicName, group: str) -> Any:
    """The group's subscription of a partition served here, opened if need be; None if
    the partition is not served here."""
    topic = door.core.topics.get(name.full)
    if topic is None or not door.core.ownership.owns(name):
        return None
    return await topic.as_persistent().subscription(
        group, "exclusive", "earliest", durable=True, start_offset=-1
    )


async def commit_offset(
    door: KafkaFrontDoor, name: TopicName, group: str, offset: int, *, session: str | None = None
) -> None:
    """Move the group's cursor of partition ``name`` to ``offset``; past the stored end
    it stops at the end (a cursor beyond the log would count messages not yet written as
    read, for native consumers and retention alike).  The group's cursor under its former
    name (:func:`legacy_subscription_of`) is deleted once this one is stored, so it does
    not hold retention back.

    ``session``: the ownership token (metadata session) this broker held when it found
    it coordinates the group (default: the current one); a cursor node written directly
    is written only while that session is alive, else NotOwner."""
    if session is None:
        session = door.core.ownership.token
    legacy = legacy_subscription_of(group)
    group = subscription_of(group)
    await _commit(door, name, group, offset, session)
    if legacy != group:
        await _forget_former_cursor(door, name, legacy)


#: attempts to write a cursor node directly while the serving broker keeps changing it
_DIRECT_WRITE_ROUNDS = 5


async def _commit(
    door: KafkaFrontDoor, name: TopicName, group: str, offset: int, session: str
) -> None:
    sub = await _loaded_subscription(door, name, group)
    if sub is not None:
        await sub.seek_offset(min(offset, sub.ledger.stored_offset))
        await sub.persist_acks()  # a commit answered ok is stored
        return
    await _write_cursor_node(door.core.store, cursor_path(name, group), offset, session)


async def _write_cursor_node(store: Any, path: str, offset: int, session: str) -> None:
    """Store ``offset`` as the cursor at ``path`` (of a partition not served here), in one
    transaction with a check that the metadata session ``session`` is alive; at the
    version read, keeping the stored subscription type.  NotOwner once the session is
    gone (its marker node went with it)."""
    marker = f"{BROKER_SESSIONS_PATH}/{session}"
    for _ in range(_DIRECT_WRITE_ROUNDS):
        stat = await store.get(path)
        if stat is None:
            write = Op.create(path, CursorState(offset).to_json())
        else:
            sub_type = CursorState.from_json(stat.value).sub_type
            data = CursorState(offset, sub_type=sub_type).to_json()
            write = Op.set(path, data, version=stat.version)
        try:
            await store.multi([Op.check(marker), write])
        except (BadVersion, NodeExists):
            continue  # the serving broker wrote (or created) it meanwhile: read it again
        except NoSuchNode:
            if not await store.exists(marker):
                raise NotOwner(
                    "this broker's metadata session ended since it took the commit (the"
                    " group may have moved on); find the coordinator and commit again"
                ) from None
            continue  # the cursor was deleted meanwhile
        return
    raise MetadataError(f"the cursor at {path} kept changing while it was committed; try again")


async def _forget_former_cursor(door: KafkaFrontDoor, name: TopicName, legacy: str) -> None:
    topic = door.core.topics.get(name.full)
    if topic is not None and legacy in topic.as_persistent().subscriptions:
        return  # loaded (a native consumer uses that name): left alone
    with contextlib.suppress(NoSuchNode):
        await door.core.store.delete(cursor_path(name, legacy))


async def committed_offset(door: KafkaFrontDoor, name: TopicName, group: str) -> int:
    """The group's committed offset of a partition, -1 if it has none (one committed
    under the group's former subscription name counts: :func:`legacy_subscription_of`)."""
    legacy = legacy_subscription_of(group)
    group = subscription_of(group)
    stat = await door.core.store.get(cursor_path(name, group))
    topic = door.core.topics.get(name.full)
    if topic is not None:
        sub = topic.as_persistent().subscriptions.get(group)
        if sub is not None and stat is not None and stat.version == sub.cursor_version:
            # the stored cursor is this subscription's (it may be ahead of it: acks of
            # native consumers not stored yet); another version was written by another
            # broker (the group's coordinator for a while): the subscription is stale
            return int(sub.cursor.mark_delete)
    if stat is None and legacy != group:
        stat = await door.core.store.get(cursor_path(name, legacy))
    if stat is None:
        return -1
    return CursorState.from_json(stat.value).mark_delete


async def offset_commit(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    cls = response_type(request)
    group = request.group_id
    generation = getattr(
        request, "generation_id_or_member_epoch", getattr(request, "generation_id", -1)
    )
    member = getattr(request, "member_id", "")
    # the session coordination is checked under: a commit outliving it is not stored
    session = door.core.ownership.token
    refused = door.groups.check_commit(group, member, generation)
    if refused == ErrorCode.none and not await coordinates(door, group):
        refused = ErrorCode.not_coordinator
    if refused == ErrorCode.none and not await _may_use(conn, group):
        refused = ErrorCode.group_authorization_failed
    topics = []
    for t in request.topics:
        parts = []
        for p in t.partitions:
            code = refused
            if code == ErrorCode.none:
                try:
                    await conn.authorize("consume", t.name, subscription_of(group))
                    partitions = await door.core.partitions_of(door.topic_name(t.name))
                    if not 0 <= p.partition_index < partitions:
                        raise TopicNotFound(
                            f"topic {t.name!r} has no partition {p.partition_index}"
                        )
                    await commit_offset(
                        door,
                        door.partition_name(t.name, p.partition_index),
                        group,
                        p.committed_offset,
                        session=session,
                    )
                except PigeonError as exc:
                    # NotOwner: this broker's session ended or the partition was unloaded
                    # meanwhile; the client finds the coordinator again and commits again
                    code = (
                        ErrorCode.not_coordinator if isinstance(exc, NotOwner) else error_code(exc)
                    )
                    log.info("kafka commit failed group=%s topic=%s: %s", group, t.name, exc)
            parts.append(
                part(
                    cls,
                    "OffsetCommitResponsePartition",
                    partition_index=p.partition_index,
                    error_code=code,
                )
            )
        topics.append(part(cls, "OffsetCommitResponseTopic", name=t.name, partitions=tuple(parts)))
    return build(cls, throttle_time=ZERO, topics=tuple(topics))


async def offset_fetch(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    cls = response_type(request)
    group = request.group_id
    if not await coordinates(door, group):
        return build(cls, throttle_time=ZERO, error_code=ErrorCode.not_coordinator, topics=())
    if not await _may_use(conn, group):
        return build(
            cls, throttle_time=ZERO, error_code=ErrorCode.group_authorization_failed, topics=()
        )
    wanted = request.topics
    if wanted is None:  # every partition the group committed, of topics the role may read
        names = []
        for kafka_topic, indexes in await _committed_topics(door, group):
            with contextlib.suppress(AuthorizationError):
                await conn.authorize("consume", kafka_topic, subscription_of(group), quiet=True)
                names.append((kafka_topic, indexes))
    else:
        names = [(t.name, list(t.partition_indexes)) for t in wanted]
    topics = []
    for kafka_topic, indexes in names:
        parts = []
        for index in indexes:
            code, offset = ErrorCode.none, -1
            try:
                await conn.authorize("consume", kafka_topic, subscription_of(group))
                offset = await committed_offset(
                    door, door.partition_name(kafka_topic, index), group
                )
            except PigeonError as exc:
                code = error_code(exc)
            parts.append(
                part(
                    cls,
                    "OffsetFetchResponsePartition",
                    partition_index=index,
                    committed_offset=offset,
                    committed_leader_epoch=-1,
                    metadata="",
                    error_code=code,
                )
            )
        topics.append(
            part(cls, "OffsetFetchResponseTopic", name=kafka_topic, partitions=tuple(parts))
        )
    return build(cls, throttle_time=ZERO, error_code=ErrorCode.none, topics=tuple(topics))


async def _may_use(conn: KafkaConnection, group: str) -> bool:
    """May the connection's role use consumer group ``group``?"""
    try:
        await conn.authorize("group", "", subscription_of(group))
    except AuthorizationError:
        return False
    return True


async def _committed_topics(door: KafkaFrontDoor, group: str) -> list[tuple[str, list[int]]]:
    from pigeon.broker._kafka_topics import kafka_topic_names

    found = []
    for kafka_topic in await kafka_topic_names(door):
        count = await door.core.partitions_of(door.topic_name(kafka_topic))
        indexes = [
            i
            for i in range(count)
            if await door.core.store.exists(
                cursor_path(door.partition_name(kafka_topic, i), subscription_of(group))
            )
        ]
        if indexes:
            found.append((kafka_topic, indexes))
    return found


HANDLERS = {8: offset_commit, 9: offset_fetch, 10: find_coordinator}
