"""Operations on a running broker that the admin API needs.

Everything here works on a :class:`~pigeon.broker._service.BrokerService` in its own trio
run and raises :mod:`pigeon.core.errors` classes for every expected failure (missing
object, conflict, bad value); the HTTP layer (:mod:`pigeon.broker._admin`) only maps them
to status codes.  Results are plain JSON-ready dicts.

Clients are detached from a topic the way Pulsar does it: the broker forgets the producer
or consumer and pushes ``closedByBroker``; the client then looks the topic up again and
re-attaches (a consumer also drops the messages it had prefetched).  While a topic is
being unloaded or deleted, opening it waits (the service's ``_opening`` event), so a
re-attaching client never sees a half-closed topic.

Ownership of namespaces by bundles and brokers is not built yet: a broker owns every
namespace as one bundle covering the whole hash range (:data:`FULL_BUNDLE`), and
unloading it closes that namespace's loaded topics on this broker.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import resource
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._ledger import SegmentInfo
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
    NotOwner,
    NotSupported,
    PigeonError,
    SubscriptionBusy,
    SubscriptionNotFound,
    TopicExists,
    TopicNotFound,
)
from pigeon.core.paths import (
    OWNERSHIP_PATH,
    ROOT,
    cursor_path,
    cursors_path,
    dedup_path,
    ledger_path,
    partitioned_topic_path,
    segment_path,
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

FULL_RANGE = 1 << 32
#: The one bundle of a namespace when the broker has no ownership (single-broker builds).
FULL_BUNDLE = "0x00000000_0x100000000"
#: How long closing a subscription may take before we go on regardless.
CLOSE_TIMEOUT = 5.0
#: Time limit of one bookie call made while deleting a topic (the bookie GC is the backstop).
BOOKIE_CALL_TIMEOUT = 5.0
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


async def _require_namespace(service: BrokerService, namespace: str) -> None:
    if not await service.policies.exists(namespace):
        raise NoSuchNode(f"namespace {namespace!r} does not exist")


async def _partitions(service: BrokerService, name: TopicName) -> int:
    return await service.partitions_of(name)


async def _exists(service: BrokerService, name: TopicName) -> bool:
    """Whether a topic (plain, partitioned, or a partition of a partitioned one) exists."""
    if name.full in service.topics or await service.partitions_of(name):
        return True
    if name.partition_index >= 0 and await service.partitions_of(name.base) > name.partition_index:
        return True
    return name.persistent and bool(await service.store.exists(ledger_path(name)))


async def _open(service: BrokerService, name: TopicName) -> Any:
    """A non-partitioned topic (or one partition) that exists, loaded on this broker."""
    if not await _exists(service, name):
        raise TopicNotFound(f"topic {name} does not exist")
    return await service.get_topic(name)


async def _targets(service: BrokerService, name: TopicName) -> list[TopicName]:
    """The partitions of a partitioned topic, or the topic itself; TopicNotFound if none."""
    n = await service.partitions_of(name)
    if n:
        return [name.partition(i) for i in range(n)]
    if not await _exists(service, name):
        raise TopicNotFound(f"topic {name} does not exist")
    return [name]


@contextlib.asynccontextmanager
async def _exclusive(service: BrokerService, key: str) -> AsyncIterator[None]:
    """Keep ``get_topic(key)`` waiting while we unload or delete the topic."""
    while True:
        opening = service._opening.get(key)
        if opening is None:
            break
        await opening.wait()
    ev = service._opening[key] = trio.Event()
    try:
        yield
    finally:
        if service._opening.get(key) is ev:
            del service._opening[key]
        ev.set()


# ---------------------------------------------------------------------- clients


def _disconnect(
    service: BrokerService,
    topic: Any,
    reason: str,
    *,
    producers: bool = True,
    subscription: str | None = None,
    only: Any = None,
) -> int:
    """Detach producers and/or consumers of ``topic`` (of one subscription by name, or of
    the subscription object ``only``); they reconnect on their own.

    A detached producer stays registered on its connection, still pointing at the old
    topic: the client sends on until it has re-attached, and those sends must fail with
    a retriable error (the old topic's ledger is closed: ServiceUnavailable) so the client
    resends them after re-attaching, not with "unknown producer id".  Re-attaching
    replaces the registration.
    """
    count = 0
    for conn, state in list(service._conns.items()):
        if producers:
            for pid, producer in list(state.producers.items()):
                if producer.topic is not topic:
                    continue
                if topic.producers.get(producer.name) is producer:
                    del topic.producers[producer.name]
                count += 1
                with contextlib.suppress(PigeonError):
                    conn.send_nowait(
                        "closedByBroker",
                        {"producerId": pid, "isProducer": True, "reason": reason},
                    )
        for cid, (consumer, sub, t) in list(state.consumers.items()):
            if t is not topic or (subscription is not None and sub.name != subscription):
                continue
            if only is not None and sub is not only:
                continue
            del state.consumers[cid]
            sub.remove_consumer(consumer)
            count += 1
            with contextlib.suppress(PigeonError):
                conn.send_nowait(
                    "closedByBroker", {"consumerId": cid, "isProducer": False, "reason": reason}
                )
    return count


def _active(topic: Any) -> bool:
    return bool(topic.producers) or any(s.consumers for s in topic.subscriptions.values())


async def _close_subscriptions(topic: Any, names: list[str] | None = None) -> None:
    """Stop dispatch of the named (or all) subscriptions and wait until they persisted."""
    subs = [s for n, s in list(topic.subscriptions.items()) if names is None or n in names]
    for sub in subs:
        sub.closed = True
        if topic.persistent:
            sub.wake()
    if not topic.persistent:
        for sub in subs:
            topic.subscriptions.pop(sub.name, None)
        return
    with trio.move_on_after(CLOSE_TIMEOUT) as scope:
        # A subscription's dispatch task leaves topic.subscriptions when it has stopped
        # and persisted its cursor; there is no event to wait on.
        while any(topic.subscriptions.get(s.name) is s for s in subs):  # noqa: ASYNC110
            await trio.sleep(0.01)
    if scope.cancelled_caught:
        log.warning("subscriptions did not stop in time topic=%s", topic.name)
    for sub in subs:
        if topic.subscriptions.get(sub.name) is sub:
            del topic.subscriptions[sub.name]


async def _ignore_missing(coro: Any) -> None:
    try:
        await coro
    except NoSuchNode:
        pass


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
    await _require_namespace(service, namespace)
    return await service.list_topics(namespace)


async def delete_namespace(service: BrokerService, namespace: str, *, force: bool) -> list[str]:
    """Delete a namespace; with ``force`` its topics first (else NotEmpty if it has any)."""
    split_namespace(namespace)
    await _require_namespace(service, namespace)
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
    await _require_namespace(service, name.namespace_name)
    if await _exists(service, name):
        raise TopicExists(f"topic {name} already exists")
    await service.create_topic(name, partitions)
    log.info("topic created topic=%s partitions=%s", name, partitions)
    return await topic_metadata(service, name)


async def topic_metadata(service: BrokerService, name: TopicName) -> dict[str, Any]:
    n = await service.partitions_of(name)
    if not n and not await _exists(service, name):
        raise TopicNotFound(f"topic {name} does not exist")
    names = [name.partition(i).full for i in range(n)] if n else [name.full]
    return {
        "topic": name.full,
        "persistent": name.persistent,
        "partitions": n,
        "loaded": sum(1 for t in names if t in service.topics),
    }


async def delete_topic(service: BrokerService, name: TopicName, *, force: bool) -> None:
    """Delete a topic and its data (segments on the bookies, cursors, dedup state).

    Refused (SubscriptionBusy) while producers or consumers are attached, unless
    ``force``: then they are detached first.  A client that re-attaches afterwards
    creates the topic anew (topics are created on first use).
    """
    n = await service.partitions_of(name)
    if n:
        parts = [name.partition(i) for i in range(n)]
        if not force:
            for p in parts:
                t = service.topics.get(p.full)
                if t is not None and _active(t):
                    raise SubscriptionBusy(
                        f"topic {name} has connected producers or consumers; use force"
                    )
        for p in parts:
            await _delete_one(service, p, force=True)
        await _ignore_missing(service.store.delete(partitioned_topic_path(name)))
        log.info("partitioned topic deleted topic=%s partitions=%s", name, n)
        return
    if not await _exists(service, name):
        raise TopicNotFound(f"topic {name} does not exist")
    if name.partition_index >= 0 and await service.partitions_of(name.base) > name.partition_index:
        raise NotSupported(f"{name} is a partition of {name.base}: delete the partitioned topic")
    await _delete_one(service, name, force=force)
    log.info("topic deleted topic=%s", name)


async def _delete_one(service: BrokerService, name: TopicName, *, force: bool) -> None:
    async with _exclusive(service, name.full):
        topic = service.topics.get(name.full)
        if topic is not None:
            if _active(topic) and not force:
                raise SubscriptionBusy(
                    f"topic {name} has connected producers or consumers; use force"
                )
            del service.topics[name.full]
            topic.unloaded = True
            _disconnect(service, topic, "topic deleted")
            await _close_subscriptions(topic)
            if topic.persistent:
                await topic.ledger.close()
        if name.persistent:
            await _delete_data(service, name)


async def _delete_data(service: BrokerService, name: TopicName) -> None:
    store = service.store
    stat = await store.get(ledger_path(name))
    segments = (
        [SegmentInfo(**s) for s in json.loads(stat.value).get("segments", [])] if stat else []
    )
    await _ignore_missing(store.delete(cursors_path(name), recursive=True))
    await _ignore_missing(store.delete(dedup_path(name)))
    for seg in segments:
        await _ignore_missing(store.delete(segment_path(seg.id)))
    if stat is not None:
        await _ignore_missing(store.delete(ledger_path(name)))
    client = service.policy.client
    for seg in segments:
        for address in seg.ensemble:
            try:
                with trio.fail_after(BOOKIE_CALL_TIMEOUT):
                    await client.delete_segment(address, seg.id)
            except (PigeonError, OSError, trio.TooSlowError) as exc:
                log.info(
                    "bookie delete deferred to GC segment=%s bookie=%s error=%s",
                    seg.id,
                    address,
                    exc,
                )


async def unload_topic(service: BrokerService, name: TopicName) -> list[str]:
    """Close the topic (or each loaded partition) on this broker; clients re-attach."""
    targets = await _targets(service, name)
    unloaded = []
    for t in targets:
        if await _unload_one(service, t):
            unloaded.append(t.full)
    return unloaded


async def _unload_one(service: BrokerService, name: TopicName) -> bool:
    async with _exclusive(service, name.full):
        topic = service.topics.pop(name.full, None)
        if topic is None:
            return False
        topic.unloaded = True
        _disconnect(service, topic, "topic unloaded")
        await _close_subscriptions(topic)
        if topic.persistent:
            await topic.ledger.close()
            await topic.snapshot_dedup()
    log.info("topic unloaded topic=%s", name)
    return True


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
    source = topic.ledger if persistent else topic
    subs = {
        name: _sub_stats(monitor, topic, sub) for name, sub in sorted(topic.subscriptions.items())
    }
    return {
        "topic": topic.name.full,
        "persistent": persistent,
        "partitions": 0,
        "msgs_in": source.msgs_in,
        "bytes_in": source.bytes_in,
        "msgs_out": sum(s["msgs_out"] for s in subs.values()),
        "bytes_out": sum(s["bytes_out"] for s in subs.values()),
        "msg_rate_in": round(rates.msg_rate_in, 3) if rates else 0.0,
        "msg_throughput_in": round(rates.msg_throughput_in, 3) if rates else 0.0,
        "msg_rate_out": round(rates.msg_rate_out, 3) if rates else 0.0,
        "msg_throughput_out": round(rates.msg_throughput_out, 3) if rates else 0.0,
        "producers": len(topic.producers),
        "producer_names": sorted(topic.producers),
        "next_offset": topic.ledger.next_offset if persistent else topic.next_offset,
        "first_offset": topic.ledger.first_offset if persistent else topic.next_offset,
        "storage_size": sum(s.size for s in topic.ledger.segments) if persistent else 0,
        "segments": len(topic.ledger.segments) if persistent else 0,
        "backlog": max((s["backlog"] for s in subs.values()), default=0),
        "backlog_bytes": topic.backlog_bytes() if persistent else 0,
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
    targets = await _targets(service, name)
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
    for t in await _targets(service, name):
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
    targets = await _targets(service, name)
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
    for t in await _targets(service, name):
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
        _disconnect(service, topic, "subscription deleted", producers=False, only=sub)
        if topic.persistent:
            await _ignore_missing(service.store.delete(cursor_path(topic.name, sub_name)))
        if topic.subscriptions.get(sub_name) is sub:
            del topic.subscriptions[sub_name]
        _disconnect(service, topic, "subscription deleted", producers=False, only=sub)
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
    targets = await _targets(service, name)
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
        _disconnect(service, topic, "cursor reset", producers=False, only=sub)
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
    for t in await _targets(service, name):
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
    for t in await _targets(service, name):
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


def broker_id(service: BrokerService) -> str:
    if service.address is None:
        return f"{service.config.host}:{service.config.port}"
    return f"{service.address[0]}:{service.address[1]}"


def _ownership(service: BrokerService) -> Any:
    """The service's bundle ownership (None before it runs, or in builds without it)."""
    return getattr(service, "ownership", None)


def _bundle_ranges(count: int) -> list[str]:
    """The bundles of a namespace split in ``count`` (``Ownership.bundle_of``'s ranges)."""
    size = FULL_RANGE // count
    out = []
    for i in range(count):
        start = i * size
        end = FULL_RANGE if i == count - 1 else start + size
        out.append(f"0x{start:08x}_0x{end:08x}")
    return out


def _namespace_bundles(service: BrokerService) -> list[str]:
    ownership = _ownership(service)
    return _bundle_ranges(ownership.bundles) if ownership is not None else [FULL_BUNDLE]


def _bundle_of(service: BrokerService, name: TopicName) -> str:
    ownership = _ownership(service)
    return str(ownership.bundle_of(name)) if ownership is not None else FULL_BUNDLE


async def _registered_brokers(service: BrokerService) -> dict[str, dict[str, Any]]:
    ownership = _ownership(service)
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
        "connections": len(service._conns),
        "producers": sum(len(t.producers) for t in topics),
        "subscriptions": sum(len(t.subscriptions) for t in topics),
        "consumers": sum(len(s.consumers) for t in topics for s in t.subscriptions.values()),
        "msgs_in": sum(t.ledger.msgs_in if t.persistent else t.msgs_in for t in topics),
        "msg_rate_in": round(rates.msg_rate_in, 3) if rates else 0.0,
        "msg_throughput_in": round(rates.msg_throughput_in, 3) if rates else 0.0,
        "msg_rate_out": round(rates.msg_rate_out, 3) if rates else 0.0,
        "msg_throughput_out": round(rates.msg_throughput_out, 3) if rates else 0.0,
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
        "max_rss_bytes": usage.ru_maxrss * 1024,
        "bundles": len(await owned_bundles(service, broker)),
    }


async def _bundle_owner(service: BrokerService, namespace: str, bundle: str) -> str | None:
    if _ownership(service) is None:
        return broker_id(service)
    stat = await service.store.get(f"{OWNERSHIP_PATH}/{namespace}/{bundle}")
    if stat is None:
        return None
    try:
        doc = json.loads(stat.value)
    except ValueError:
        return None
    address = doc.get("address") if isinstance(doc, dict) else None
    return str(address) if address else None


async def bundles(service: BrokerService, namespace: str) -> list[dict[str, Any]]:
    """The bundles of a namespace, each with its owner (None: unowned, assigned on lookup)."""
    split_namespace(namespace)
    await _require_namespace(service, namespace)
    loaded: dict[str, int] = {}
    for t in service.topics.values():
        if t.name.namespace_name == namespace:
            b = _bundle_of(service, t.name)
            loaded[b] = loaded.get(b, 0) + 1
    return [
        {
            "namespace": namespace,
            "bundle": b,
            "owner": await _bundle_owner(service, namespace, b),
            "loaded_topics": loaded.get(b, 0),
        }
        for b in _namespace_bundles(service)
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


async def unload_bundle(service: BrokerService, namespace: str, bundle: str) -> list[str]:
    """Close the bundle's loaded topics here and give the bundle up; clients look the
    topics up again (and the least-loaded broker takes the bundle)."""
    split_namespace(namespace)
    await _require_namespace(service, namespace)
    if bundle not in _namespace_bundles(service):
        raise NoSuchNode(
            f"namespace {namespace} has no bundle {bundle!r} "
            f"(it has {', '.join(_namespace_bundles(service))})"
        )
    owner = await _bundle_owner(service, namespace, bundle)
    if owner is not None and owner != broker_id(service):
        raise NotOwner(f"bundle {namespace}/{bundle} is owned by {owner}: ask that broker")
    unloaded = []
    ownership = _ownership(service)
    path = f"{OWNERSHIP_PATH}/{namespace}/{bundle}"
    if ownership is not None:
        ownership.releasing.add(path)
    try:
        for key, topic in sorted(service.topics.items()):
            if topic.name.namespace_name != namespace or _bundle_of(service, topic.name) != bundle:
                continue
            if await _unload_one(service, topic.name):
                unloaded.append(key)
        if ownership is not None and path in ownership.owned:
            ownership.owned.discard(path)
            await _ignore_missing(service.store.delete(path))
    finally:
        if ownership is not None:
            ownership.releasing.discard(path)
    log.info("bundle unloaded namespace=%s bundle=%s topics=%s", namespace, bundle, len(unloaded))
    return unloaded


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
        "connections": len(service._conns),
        "time": int(time.time() * 1000),
    }
