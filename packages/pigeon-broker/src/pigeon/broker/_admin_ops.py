"""Operations on a running broker that the admin API needs.

Everything here works on a :class:`~pigeon.broker._service.BrokerService` in its own trio
run and raises :mod:`pigeon.core.errors` classes for every expected failure (missing
object, conflict, bad value); the HTTP layer (:mod:`pigeon.broker._admin`) only maps them
to status codes.  Results are plain JSON-ready dicts.

The lifecycle operations (unload a topic or a bundle, delete a topic, detach clients)
are the broker core's, in :mod:`pigeon.broker._lifecycle`; they are re-exported here for
the admin API.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import resource
import time
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._lifecycle import (
    FULL_BUNDLE,
    broker_id,
    bundle_of,
    bundle_owner,
    delete_topic,
    disconnect,
    ignore_missing,
    namespace_bundles,
    ownership_of,
    require_namespace,
    topic_exists,
    topic_targets,
    unload_bundle,
    unload_topic,
)
from pigeon.broker._policies import NamespacePolicies, TenantInfo, split_namespace
from pigeon.broker._service import BrokerService
from pigeon.broker._topic import Topic
from pigeon.core import TopicName
from pigeon.core.batch import ENTRY_HEADER_SIZE, decode_batch
from pigeon.core.errors import (
    EntryNotFound,
    InvalidArgument,
    InvalidTopicName,
    NodeExists,
    NoSuchNode,
    NotEmpty,
    NotSupported,
    PigeonError,
    SubscriptionBusy,
    SubscriptionNotFound,
    TopicExists,
    TopicNotFound,
)
from pigeon.core.paths import (
    ROOT,
    cursor_path,
    cursors_path,
)

if TYPE_CHECKING:
    from pigeon.broker._metrics import BrokerMonitor

__all__ = [
    "FULL_BUNDLE",
    "bookie",
    "bookies",
    "broker_id",
    "broker_load",
    "brokers",
    "bundles",
    "owned_bundles",
    "clear_backlog",
    "cluster_health",
    "create_namespace",
    "create_subscription",
    "create_tenant",
    "create_topic",
    "delete_namespace",
    "delete_subscription",
    "delete_tenant",
    "delete_topic",
    "internal_stats",
    "list_namespaces",
    "list_subscriptions",
    "list_topics",
    "loaded_topics_stats",
    "parse_message_id",
    "peek",
    "reset_cursor",
    "skip",
    "subscription_stats",
    "topic_metadata",
    "topic_name",
    "topic_stats",
    "unload_bundle",
    "unload_topic",
]

log = logging.getLogger(__name__)

MAX_PEEK = 1000
POSITIONS = ("earliest", "latest")


# ---------------------------------------------------------------------- names & checks


def topic_name(domain: str, tenant: str, namespace: str, topic: str) -> TopicName:
    """The topic a ``/topics/{domain}/{tenant}/{namespace}/{topic}`` URL names."""
    if domain not in ("persistent", "non-persistent"):
        raise InvalidTopicName(f"domain must be persistent or non-persistent, got {domain!r}")
    return TopicName.parse(f"{domain}://{tenant}/{namespace}/{topic}")


def _check_subscription_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or any(ord(c) < 32 for c in name):
        raise InvalidArgument(f"invalid subscription name {name!r}")


def parse_message_id(text: str) -> tuple[int, int, int]:
    """``segment:entry`` or ``segment:entry:batch_index`` (as ``peek`` shows them)."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        seg, entry = int(parts[0]), int(parts[1])
        index = int(parts[2]) if len(parts) == 3 else 0
    except ValueError:
        raise InvalidArgument(
            f"message id must look like segment:entry[:index], got {text!r}"
        ) from None
    if seg < 0 or entry < 0 or index < 0:
        raise InvalidArgument(f"message id {text!r} has a negative part")
    return seg, entry, index


async def _partitions(service: BrokerService, name: TopicName) -> int:
    return await service.partitions_of(name)


async def _open(service: BrokerService, name: TopicName) -> Any:
    """A non-partitioned topic (or one partition) that exists, loaded on this broker."""
    if not await topic_exists(service, name):
        raise TopicNotFound(f"topic {name} does not exist")
    return await service.get_topic(name)


# ---------------------------------------------------------------------- clients


# ---------------------------------------------------------------------- tenants, namespaces


async def create_tenant(
    service: BrokerService, tenant: str, info: dict[str, Any]
) -> dict[str, Any]:
    try:
        await service.policies.create_tenant(tenant, TenantInfo(**info))
    except NodeExists:
        raise NodeExists(f"tenant {tenant!r} already exists") from None
    return {"tenant": tenant, **info}


async def delete_tenant(service: BrokerService, tenant: str) -> None:
    await service.policies.delete_tenant(tenant)


async def list_namespaces(service: BrokerService, tenant: str) -> list[str]:
    await service.policies.get_tenant(tenant)  # NoSuchNode when missing
    return sorted(await service.policies.namespaces(tenant))


async def create_namespace(
    service: BrokerService, namespace: str, policies: dict[str, Any]
) -> NamespacePolicies:
    split_namespace(namespace)
    created = NamespacePolicies.from_dict(policies)
    try:
        await service.policies.create_namespace(namespace, created)
    except NodeExists:
        raise NodeExists(f"namespace {namespace!r} already exists") from None
    return created


async def list_topics(service: BrokerService, namespace: str) -> list[str]:
    split_namespace(namespace)
    await require_namespace(service, namespace)
    return await service.list_topics(namespace)


async def delete_namespace(service: BrokerService, namespace: str, *, force: bool) -> list[str]:
    """Delete a namespace; with ``force`` its topics first (else NotEmpty if it has any)."""
    split_namespace(namespace)
    await require_namespace(service, namespace)
    topics = await service.list_topics(namespace)
    if topics and not force:
        raise NotEmpty(
            f"namespace {namespace!r} still has {len(topics)} topic(s); delete them or use force"
        )
    for t in topics:
        with contextlib.suppress(TopicNotFound):
            await delete_topic(service, TopicName.parse(t), force=True)
    await service.policies.delete_namespace(namespace)
    log.info("namespace deleted namespace=%s topics=%s", namespace, len(topics))
    return topics


async def tenant_info(service: BrokerService, tenant: str) -> dict[str, Any]:
    info = await service.policies.get_tenant(tenant)
    return {
        "tenant": tenant,
        "admin_roles": info.admin_roles,
        "allowed_clusters": info.allowed_clusters,
    }


# ---------------------------------------------------------------------- topics


async def create_topic(service: BrokerService, name: TopicName, partitions: int) -> dict[str, Any]:
    await require_namespace(service, name.namespace_name)
    if await topic_exists(service, name):
        raise TopicExists(f"topic {name} already exists")
    await service.create_topic(name, partitions)
    log.info("topic created topic=%s partitions=%s", name, partitions)
    return await topic_metadata(service, name)


async def topic_metadata(service: BrokerService, name: TopicName) -> dict[str, Any]:
    n = await service.partitions_of(name)
    if not n and not await topic_exists(service, name):
        raise TopicNotFound(f"topic {name} does not exist")
    names = [name.partition(i).full for i in range(n)] if n else [name.full]
    return {
        "topic": name.full,
        "persistent": name.persistent,
        "partitions": n,
        "loaded": sum(1 for t in names if t in service.topics),
    }


# ---------------------------------------------------------------------- stats


def _sub_stats(monitor: BrokerMonitor | None, topic: Any, sub: Any) -> dict[str, Any]:
    rates = monitor.rates_of_subscription(topic.name.full, sub.name) if monitor else None
    persistent = topic.persistent
    return {
        "name": sub.name,
        "type": sub.type,
        "durable": bool(sub.durable),
        "consumers": len(sub.consumers),
        "backlog": sub.backlog(),
        "backlog_bytes": topic.ledger.bytes_after(sub.cursor.mark_delete) if persistent else 0,
        "mark_delete_offset": sub.cursor.mark_delete if persistent else None,
        "msgs_out": sub.msgs_out,
        "bytes_out": sub.bytes_out,
        "msg_rate_out": round(rates.msg_rate_out, 3) if rates else 0.0,
        "msg_throughput_out": round(rates.msg_throughput_out, 3) if rates else 0.0,
        "delayed": sub.delayed_count if persistent else 0,
        "dropped": 0 if persistent else sub.dropped,
        "consumer_names": [c.name for c in sub.consumers],
        "lost_messages": sub.lost_messages if persistent else 0,
        "read_error": sub.read_error if persistent else None,
    }


async def _load_durable_subscriptions(service: BrokerService, topic: Any) -> None:
    """Load the cursors of subscriptions no consumer attached to since the topic loaded."""
    if not topic.persistent:
        return
    for sub_name in await service.store.children(cursors_path(topic.name)):
        if sub_name not in topic.subscriptions:
            await topic.subscription(sub_name, "exclusive", "latest", durable=True, start_offset=-1)


def _one_topic_stats(monitor: BrokerMonitor | None, topic: Any) -> dict[str, Any]:
    rates = monitor.rates_of(topic.name.full) if monitor else None
    persistent = topic.persistent
    subs = {
        name: _sub_stats(monitor, topic, sub) for name, sub in sorted(topic.subscriptions.items())
    }
    return {
        "topic": topic.name.full,
        "persistent": persistent,
        "partitions": 0,
        "msgs_in": topic.msgs_in,
        "bytes_in": topic.bytes_in,
        "msgs_out": sum(s["msgs_out"] for s in subs.values()),
        "bytes_out": sum(s["bytes_out"] for s in subs.values()),
        "msg_rate_in": round(rates.msg_rate_in, 3) if rates else 0.0,
        "msg_throughput_in": round(rates.msg_throughput_in, 3) if rates else 0.0,
        "msg_rate_out": round(rates.msg_rate_out, 3) if rates else 0.0,
        "msg_throughput_out": round(rates.msg_throughput_out, 3) if rates else 0.0,
        "producers": len(topic.producers),
        "producer_names": sorted(topic.producers),
        "next_offset": topic.next_offset,
        "first_offset": topic.ledger.first_offset if persistent else topic.next_offset,
        "storage_size": sum(s.size for s in topic.ledger.segments) if persistent else 0,
        "segments": len(topic.ledger.segments) if persistent else 0,
        "backlog": max((s["backlog"] for s in subs.values()), default=0),
        "backlog_bytes": topic.backlog_bytes(),
        "corrupt_entries": topic.ledger.corrupt_entries if persistent else 0,
        "subscriptions": subs,
    }


_SUMMED = (
    "msgs_in",
    "bytes_in",
    "msgs_out",
    "bytes_out",
    "msg_rate_in",
    "msg_throughput_in",
    "msg_rate_out",
    "msg_throughput_out",
    "producers",
    "storage_size",
    "segments",
    "backlog_bytes",
    "corrupt_entries",
)
_SUB_SUMMED = (
    "consumers",
    "backlog",
    "backlog_bytes",
    "msgs_out",
    "bytes_out",
    "msg_rate_out",
    "msg_throughput_out",
    "delayed",
    "dropped",
    "lost_messages",
)


async def topic_stats(
    service: BrokerService, monitor: BrokerMonitor | None, name: TopicName
) -> dict[str, Any]:
    """Rates, counters, storage and per-subscription backlog (partitions summed up)."""
    n = await service.partitions_of(name)
    targets = await topic_targets(service, name)
    per: dict[str, dict[str, Any]] = {}
    for t in targets:
        topic = await service.get_topic(t)
        await _load_durable_subscriptions(service, topic)
        per[t.full] = _one_topic_stats(monitor, topic)
    if not n:
        return per[name.full]
    total: dict[str, Any] = {"topic": name.full, "persistent": name.persistent, "partitions": n}
    for key in _SUMMED:
        total[key] = sum(p[key] for p in per.values())
    total["producer_names"] = sorted({x for p in per.values() for x in p["producer_names"]})
    total["next_offset"] = total["first_offset"] = None
    subs: dict[str, dict[str, Any]] = {}
    for p in per.values():
        for sname, s in p["subscriptions"].items():
            agg = subs.get(sname)
            if agg is None:
                subs[sname] = {
                    **s,
                    "mark_delete_offset": None,
                    "consumer_names": list(s["consumer_names"]),
                }
                continue
            for key in _SUB_SUMMED:
                agg[key] += s[key]
            agg["consumer_names"] += s["consumer_names"]
    total["subscriptions"] = dict(sorted(subs.items()))
    total["backlog"] = max((s["backlog"] for s in subs.values()), default=0)
    total["partition_stats"] = per
    return total


async def internal_stats(service: BrokerService, name: TopicName) -> dict[str, Any]:
    """The managed ledger's segments and each cursor's state (one topic or partition)."""
    if await service.partitions_of(name):
        raise NotSupported(f"{name} is partitioned: ask for one partition ({name}-partition-<i>)")
    topic = await _open(service, name)
    if not topic.persistent:
        return {
            "topic": name.full,
            "persistent": False,
            "next_offset": topic.next_offset,
            "segments": [],
            "cursors": {},
            "cache": None,
        }
    await _load_durable_subscriptions(service, topic)
    ledger = topic.ledger
    cursors = {}
    for sname, sub in sorted(topic.subscriptions.items()):
        cursors[sname] = {
            "mark_delete_offset": sub.cursor.mark_delete,
            "acked_ranges": [list(r) for r in sub.cursor.acked.ranges()],
            "read_position": list(sub.read_position) if sub.read_position else None,
            "pending_entries": len(sub.pending),
            "durable": bool(sub.durable),
        }
    return {
        "topic": name.full,
        "persistent": True,
        "next_offset": ledger.next_offset,
        "first_offset": ledger.first_offset,
        "last_position": list(ledger.last_position),
        "segments": [
            {
                "id": s.id,
                "first_offset": s.first_offset,
                "entries": s.entries,
                "last_entry_id": s.last_entry_id,
                "size": s.size,
                "state": s.state,
                "ensemble": list(s.ensemble),
                "ctime": s.ctime,
                "last_publish_time": s.last_publish_time,
            }
            for s in ledger.segments
        ],
        "cursors": cursors,
        "cache": {
            "hits": ledger.cache.hits,
            "misses": ledger.cache.misses,
            "bytes": ledger.cache.bytes,
        },
    }


def loaded_topics_stats(
    service: BrokerService, monitor: BrokerMonitor | None
) -> list[dict[str, Any]]:
    """Summary of every topic loaded on this broker (for the dashboard): no I/O."""
    out = []
    for _name, topic in sorted(service.topics.items()):
        s = _one_topic_stats(monitor, topic)
        s["subscription_count"] = len(s.pop("subscriptions"))
        out.append(s)
    return out


# ---------------------------------------------------------------------- subscriptions


async def _persistent_topic(service: BrokerService, name: TopicName) -> Topic:
    topic = await _open(service, name)
    if not topic.persistent:
        raise NotSupported(f"{name} is non-persistent: its subscriptions have no cursor")
    assert isinstance(topic, Topic)
    return topic


async def _subscription(service: BrokerService, topic: Any, sub_name: str) -> Any:
    """The named subscription of a loaded topic (loading a durable cursor if need be)."""
    _check_subscription_name(sub_name)
    sub = topic.subscriptions.get(sub_name)
    if sub is not None:
        return sub
    if topic.persistent and await service.store.exists(cursor_path(topic.name, sub_name)):
        return await topic.subscription(
            sub_name, "exclusive", "latest", durable=True, start_offset=-1
        )
    raise SubscriptionNotFound(f"subscription {sub_name!r} does not exist on {topic.name}")


async def list_subscriptions(service: BrokerService, name: TopicName) -> list[str]:
    found: set[str] = set()
    for t in await topic_targets(service, name):
        topic = service.topics.get(t.full)
        if topic is not None:
            found.update(topic.subscriptions)
        if t.persistent:
            found.update(await service.store.children(cursors_path(t)))
    return sorted(found)


async def subscription_stats(
    service: BrokerService, monitor: BrokerMonitor | None, name: TopicName, sub_name: str
) -> dict[str, Any]:
    stats = await topic_stats(service, monitor, name)
    _check_subscription_name(sub_name)
    sub = stats["subscriptions"].get(sub_name)
    if sub is None:
        raise SubscriptionNotFound(f"subscription {sub_name!r} does not exist on {name}")
    return {"topic": name.full, **sub}


async def _start_offset(topic: Topic, position: str) -> tuple[str, int]:
    """(initial position, start offset) for a new subscription."""
    if position in POSITIONS:
        return position, -1
    ledger = topic.ledger
    if ":" in position:
        seg, entry, index = parse_message_id(position)
        if ledger.index_of_segment(seg) is None:
            raise EntryNotFound(f"no message {position} in {topic.name}")
        try:
            found = await ledger.read_one((seg, entry))
        except EntryNotFound:
            raise EntryNotFound(f"no message {position} in {topic.name}") from None
        return "latest", min(
            found.first_offset + min(index, found.num_messages - 1), ledger.next_offset
        )
    try:
        offset = int(position)
    except ValueError:
        raise InvalidArgument(
            f"position must be earliest, latest, an offset or a message id, got {position!r}"
        ) from None
    if offset < 0:
        raise InvalidArgument(f"offset must not be negative, got {offset}")
    return "latest", min(max(offset, ledger.first_offset), ledger.next_offset)


async def create_subscription(
    service: BrokerService, name: TopicName, sub_name: str, position: str
) -> dict[str, Any]:
    """A durable subscription at ``position``: earliest, latest, an offset or a message id."""
    _check_subscription_name(sub_name)
    targets = await topic_targets(service, name)
    if len(targets) > 1 and position not in POSITIONS:
        raise InvalidArgument(
            "a partitioned topic's subscription starts at earliest or latest; "
            "reset each partition afterwards for offsets or message ids"
        )
    topics = [await _persistent_topic(service, t) for t in targets]
    for topic in topics:
        if sub_name in topic.subscriptions or await service.store.exists(
            cursor_path(topic.name, sub_name)
        ):
            raise NodeExists(f"subscription {sub_name!r} already exists on {topic.name}")
    for topic in topics:
        initial, start = await _start_offset(topic, position)
        await topic.subscription(sub_name, "exclusive", initial, durable=True, start_offset=start)
    log.info("subscription created topic=%s sub=%s position=%s", name, sub_name, position)
    return await subscription_stats(service, None, name, sub_name)


async def delete_subscription(
    service: BrokerService, name: TopicName, sub_name: str, *, force: bool
) -> None:
    _check_subscription_name(sub_name)
    found = []
    for t in await topic_targets(service, name):
        topic = await service.get_topic(t)
        try:
            found.append((topic, await _subscription(service, topic, sub_name)))
        except SubscriptionNotFound:
            continue
    if not found:
        raise SubscriptionNotFound(f"subscription {sub_name!r} does not exist on {name}")
    if not force and any(sub.consumers for _t, sub in found):
        raise SubscriptionBusy(f"subscription {sub_name!r} has connected consumers; use force")
    for topic, sub in found:
        # Stop the subscription from persisting before its node goes, so nothing re-creates
        # the cursor; a consumer that re-attaches before the node is gone joins the closed
        # subscription and is detached once more below, then subscribes afresh.
        sub.closed = True
        if topic.persistent:
            sub.store = None
            sub.wake()
        disconnect(service, topic, "subscription deleted", producers=False, only=sub)
        if topic.persistent:
            await ignore_missing(service.store.delete(cursor_path(topic.name, sub_name)))
        if topic.subscriptions.get(sub_name) is sub:
            del topic.subscriptions[sub_name]
        disconnect(service, topic, "subscription deleted", producers=False, only=sub)
    log.info("subscription deleted topic=%s sub=%s", name, sub_name)


async def _cursor_state(topic: Topic, sub: Any) -> dict[str, Any]:
    return {
        "topic": topic.name.full,
        "subscription": sub.name,
        "mark_delete_offset": sub.cursor.mark_delete,
        "backlog": sub.backlog(),
    }


async def reset_cursor(
    service: BrokerService,
    name: TopicName,
    sub_name: str,
    *,
    offset: int | None = None,
    message_id: str | None = None,
    timestamp: int | None = None,
) -> list[dict[str, Any]]:
    """Move the cursor; its consumers are detached so they drop what they prefetched."""
    given = [v for v in (offset, message_id, timestamp) if v is not None]
    if len(given) != 1:
        raise InvalidArgument("give exactly one of offset, message_id, timestamp")
    targets = await topic_targets(service, name)
    if len(targets) > 1 and timestamp is None:
        raise InvalidArgument(
            "reset a partitioned topic by timestamp, or reset one partition by offset or message id"
        )
    subs = []
    for t in targets:
        topic = await _persistent_topic(service, t)
        subs.append((topic, await _subscription(service, topic, sub_name)))
    position = None
    if message_id is not None:
        seg, entry, index = parse_message_id(message_id)
        ledger = subs[0][0].ledger
        if ledger.index_of_segment(seg) is None:
            raise EntryNotFound(f"no message {message_id} in {name}: no such segment (any more)")
        try:
            await ledger.read_one((seg, entry))
        except EntryNotFound:
            raise EntryNotFound(f"no message {message_id} in {name}") from None
        position = ((seg, entry), index)
    out = []
    for topic, sub in subs:
        if offset is not None:
            ledger = topic.ledger
            await sub.seek_offset(min(max(offset, ledger.first_offset), ledger.next_offset))
        elif position is not None:
            await sub.seek_position(*position)
        else:
            assert timestamp is not None
            await sub.seek_time(timestamp)
        # Right after the seek (no checkpoint in between): the consumers drop what they
        # prefetched from the old position when they re-attach.
        disconnect(service, topic, "cursor reset", producers=False, only=sub)
        await sub.flush()
        out.append(await _cursor_state(topic, sub))
    log.info(
        "cursor reset topic=%s sub=%s offset=%s message_id=%s timestamp=%s",
        name,
        sub_name,
        offset,
        message_id,
        timestamp,
    )
    return out


def _skip_target(sub: Any, count: int) -> int:
    """The offset below which exactly ``count`` more unacknowledged messages lie."""
    cursor = sub.cursor
    end: int = sub.ledger.next_offset
    o: int = cursor.mark_delete
    remaining = count
    for start, stop in cursor.acked:
        gap = max(0, min(start, end) - o)
        if gap >= remaining:
            return o + remaining
        remaining -= gap
        o = max(o, stop)
    return min(o + remaining, end)


async def skip(
    service: BrokerService, name: TopicName, sub_name: str, count: int | None
) -> dict[str, Any]:
    """Acknowledge the next ``count`` unacknowledged messages (all with None)."""
    if count is not None and count < 0:
        raise InvalidArgument("count must not be negative")
    skipped = 0
    for t in await topic_targets(service, name):
        topic = await _persistent_topic(service, t)
        sub = await _subscription(service, topic, sub_name)
        before = sub.backlog()
        target = topic.ledger.next_offset if count is None else _skip_target(sub, count)
        if target > sub.cursor.mark_delete:
            sub.expire_before(target)
            await sub.flush()
        skipped += before - sub.backlog()
    log.info("messages skipped topic=%s sub=%s count=%s skipped=%s", name, sub_name, count, skipped)
    return {"topic": name.full, "subscription": sub_name, "skipped": skipped}


async def clear_backlog(service: BrokerService, name: TopicName, sub_name: str) -> dict[str, Any]:
    return await skip(service, name, sub_name, None)


def _text_or_base64(data: bytes | None) -> tuple[str | None, str]:
    if data is None:
        return None, "utf-8"
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


async def peek(
    service: BrokerService, name: TopicName, sub_name: str, count: int
) -> list[dict[str, Any]]:
    """The next ``count`` unacknowledged messages of a subscription, without consuming."""
    if not 1 <= count <= MAX_PEEK:
        raise InvalidArgument(f"count must be between 1 and {MAX_PEEK}")
    out: list[dict[str, Any]] = []
    for t in await topic_targets(service, name):
        topic = await _persistent_topic(service, t)
        sub = await _subscription(service, topic, sub_name)
        await _peek_one(service, topic, sub, count - len(out), out)
        if len(out) >= count:
            break
    return out


async def _peek_one(
    service: BrokerService, topic: Topic, sub: Any, count: int, out: list[dict[str, Any]]
) -> None:
    ledger = topic.ledger
    cursor = sub.cursor
    pos: tuple[int, int] | None = await ledger.position_for_offset(cursor.mark_delete)
    taken = 0
    while pos is not None and taken < count:
        entries = await ledger.read(pos, max_entries=64)
        if not entries:
            return
        for entry in entries:
            first, n = entry.first_offset, entry.num_messages
            if cursor.all_acked(first, n):
                continue
            batch = decode_batch(memoryview(entry.data)[ENTRY_HEADER_SIZE:], service.codecs)
            header = batch.header
            for i in range(n):
                offset = first + i
                if cursor.is_acked(offset):
                    continue
                raw = batch.value(i)
                value, value_encoding = _text_or_base64(raw)
                key, key_encoding = _text_or_base64(batch.key(i))
                out.append(
                    {
                        "topic": topic.name.full,
                        "message_id": f"{entry.segment_id}:{entry.entry_id}:{i}",
                        "offset": offset,
                        "publish_time": entry.publish_time,
                        "event_time": batch.event_time(i) or None,
                        "producer_name": header.producer_name,
                        "sequence_id": batch.sequence_id(i),
                        "key": key,
                        "key_encoding": key_encoding,
                        "properties": batch.properties(i),
                        "value": value,
                        "value_encoding": value_encoding,
                        "size": len(raw),
                        "redelivery_count": sub.redeliveries.get(entry.position, 0),
                    }
                )
                taken += 1
                if taken >= count:
                    return
        pos = ledger.next_position(entries[-1].position)


# ---------------------------------------------------------------------- brokers, bundles


async def _registered_brokers(service: BrokerService) -> dict[str, dict[str, Any]]:
    ownership = ownership_of(service)
    found: dict[str, dict[str, Any]] = {}
    if ownership is not None:
        found = dict(await ownership.brokers())
    me = broker_id(service)
    found.setdefault(me, {"url": service.service_url if service.address else None})
    return found


async def brokers(service: BrokerService, http_url: str | None) -> list[dict[str, Any]]:
    """Brokers registered in the metadata store (this one first)."""
    me = broker_id(service)
    out = []
    for broker, info in sorted(
        (await _registered_brokers(service)).items(), key=lambda kv: kv[0] != me
    ):
        mine = broker == me
        out.append(
            {
                "broker": broker,
                "service_url": info.get("url"),
                "http_url": http_url if mine else info.get("http_url"),
                "cluster": service.config.cluster_name,
                "pid": os.getpid() if mine else None,
            }
        )
    return out


async def broker_load(
    service: BrokerService, monitor: BrokerMonitor | None, broker: str
) -> dict[str, Any]:
    """This broker's live load; another broker's last load report."""
    registered = await _registered_brokers(service)
    if broker not in registered:
        raise NoSuchNode(f"broker {broker!r} is not registered")
    if broker != broker_id(service):
        report = registered[broker]
        return {
            "broker": broker,
            "topics": report.get("topics"),
            "connections": report.get("connections"),
            "msgs_in": report.get("msgs_in"),
        }
    topics: list[Any] = list(service.topics.values())
    rates = monitor.broker_rates if monitor else None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "broker": broker,
        "topics": len(topics),
        "connections": service.connections,
        "producers": sum(len(t.producers) for t in topics),
        "subscriptions": sum(len(t.subscriptions) for t in topics),
        "consumers": sum(len(s.consumers) for t in topics for s in t.subscriptions.values()),
        "msgs_in": sum(t.msgs_in for t in topics),
        "msg_rate_in": round(rates.msg_rate_in, 3) if rates else 0.0,
        "msg_throughput_in": round(rates.msg_throughput_in, 3) if rates else 0.0,
        "msg_rate_out": round(rates.msg_rate_out, 3) if rates else 0.0,
        "msg_throughput_out": round(rates.msg_throughput_out, 3) if rates else 0.0,
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
        "max_rss_bytes": usage.ru_maxrss * 1024,
        "bundles": len(await owned_bundles(service, broker)),
    }


async def bundles(service: BrokerService, namespace: str) -> list[dict[str, Any]]:
    """The bundles of a namespace, each with its owner (None: unowned, assigned on lookup)."""
    split_namespace(namespace)
    await require_namespace(service, namespace)
    loaded: dict[str, int] = {}
    for t in service.topics.values():
        if t.name.namespace_name == namespace:
            b = bundle_of(service, t.name)
            loaded[b] = loaded.get(b, 0) + 1
    return [
        {
            "namespace": namespace,
            "bundle": b,
            "owner": await bundle_owner(service, namespace, b),
            "loaded_topics": loaded.get(b, 0),
        }
        for b in namespace_bundles(service)
    ]


async def owned_bundles(service: BrokerService, broker: str) -> list[dict[str, Any]]:
    """Bundles a broker owns (this one: from memory; others: from the metadata store)."""
    registered = await _registered_brokers(service)
    if broker not in registered:
        raise NoSuchNode(f"broker {broker!r} is not registered")
    out = []
    for tenant in await service.policies.tenants():
        for namespace in await service.policies.namespaces(tenant):
            for b in await bundles(service, namespace):
                if b["owner"] == broker:
                    out.append(b)
    return out


# ---------------------------------------------------------------------- bookies, health


def _bookie_view(address: str, info: dict[str, Any]) -> dict[str, Any]:
    return {
        "address": address,
        "read_only": bool(info.get("read_only")),
        "read_only_reason": info.get("read_only_reason"),
        "free_disk_bytes": info.get("free_disk_bytes"),
        "total_disk_bytes": info.get("total_disk_bytes"),
        "disk_used_bytes": info.get("disk_used_bytes"),
        "write_bytes_per_s": info.get("write_bytes_per_s"),
        "read_bytes_per_s": info.get("read_bytes_per_s"),
        "segments": info.get("segments"),
        "reported_at": info.get("time"),
    }


def bookies(service: BrokerService) -> list[dict[str, Any]]:
    registered: dict[str, dict[str, Any]] = getattr(service.bookies, "_bookies", {})
    return [_bookie_view(a, info) for a, info in sorted(registered.items())]


def bookie(service: BrokerService, address: str) -> dict[str, Any]:
    registered: dict[str, dict[str, Any]] = getattr(service.bookies, "_bookies", {})
    info = registered.get(address)
    if info is None:
        raise NoSuchNode(f"bookie {address!r} is not registered")
    return _bookie_view(address, info)


async def cluster_health(service: BrokerService, http_url: str | None) -> dict[str, Any]:
    """``ok``; ``degraded`` (some bookies read-only, or fewer than the ensemble size
    beyond it); ``unhealthy`` (metadata unreachable or too few writable bookies)."""
    checks: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    try:
        with trio.fail_after(2.0):
            await service.store.exists(ROOT)
        checks["metadata"] = {
            "ok": True,
            "latency_ms": round((time.monotonic() - started) * 1000, 2),
        }
    except (PigeonError, trio.TooSlowError, OSError) as exc:
        checks["metadata"] = {"ok": False, "error": str(exc) or type(exc).__name__}
    listed = bookies(service)
    writable = [b for b in listed if not b["read_only"]]
    need = service.config.ensemble_size
    checks["bookies"] = {
        "ok": len(writable) >= need,
        "total": len(listed),
        "writable": len(writable),
        "read_only": len(listed) - len(writable),
        "ensemble_size": need,
    }
    checks["broker"] = {"ok": service.address is not None, "broker": broker_id(service)}
    if not all(c["ok"] for c in checks.values()):
        status = "unhealthy"
    elif checks["bookies"]["read_only"]:
        status = "degraded"
    else:
        status = "ok"
    return {
        "status": status,
        "cluster": service.config.cluster_name,
        "brokers": await brokers(service, http_url),
        "checks": checks,
        "topics": len(service.topics),
        "connections": service.connections,
        "time": int(time.time() * 1000),
    }
