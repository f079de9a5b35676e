"""The lifecycle of loaded topics and owned bundles: unload, delete, detach.

These are broker-core operations, called by the front doors (the admin API through
:mod:`pigeon.broker._admin_ops`), by the service itself (a fenced ledger, a topic loaded
without its bundle) and by the load manager (an unload request).  Errors are
:mod:`pigeon.core.errors` classes; nothing here knows a wire protocol.

Clients are detached from a topic the way Pulsar does it: the broker forgets the producer
or consumer and pushes ``closedByBroker``; the client then looks the topic up again and
re-attaches (a consumer also drops the messages it had prefetched).  While a topic is
being unloaded or deleted, opening it waits (the service's ``_opening`` event), so a
re-attaching client never sees a half-closed topic.

In builds without ownership a broker owns every namespace as one bundle covering the
whole hash range (:data:`FULL_BUNDLE`), and unloading it closes that namespace's loaded
topics on this broker.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._ledger_state import SegmentInfo
from pigeon.broker._policies import split_namespace
from pigeon.broker._singleflight import claimed
from pigeon.core import TopicName
from pigeon.core.errors import (
    NoSuchNode,
    NotOwner,
    NotSupported,
    PigeonError,
    SubscriptionBusy,
    TopicNotFound,
)
from pigeon.core.paths import (
    OWNERSHIP_PATH,
    cursors_path,
    dedup_path,
    ledger_path,
    partitioned_topic_path,
    producer_epoch_path,
    segment_path,
)

if TYPE_CHECKING:
    from pigeon.broker._service import BrokerService

__all__ = [
    "FULL_BUNDLE",
    "active",
    "broker_id",
    "bundle_of",
    "bundle_owner",
    "bundle_ranges",
    "close_all_topics",
    "delete_topic",
    "drop_all_topics",
    "disconnect",
    "exclusive",
    "ignore_missing",
    "open_existing_topic",
    "namespace_bundles",
    "ownership_of",
    "require_namespace",
    "subscription_names",
    "topic_targets",
    "topic_exists",
    "unload_bundle",
    "unload_topic",
]

log = logging.getLogger(__name__)
#: how long a topic deletion waits for a compaction of the topic to stop
_COMPACTION_STOP_S = 10.0

FULL_RANGE = 1 << 32
#: The one bundle of a namespace when the broker has no ownership (single-broker builds).
FULL_BUNDLE = "0x00000000_0x100000000"
#: Time limit of one bookie call made while deleting a topic (the bookie GC is the backstop).
BOOKIE_CALL_TIMEOUT = 5.0


async def require_namespace(service: BrokerService, namespace: str) -> None:
    if not await service.policies.exists(namespace):
        raise NoSuchNode(f"namespace {namespace!r} does not exist")


async def topic_exists(service: BrokerService, name: TopicName) -> bool:
    """Whether a topic (plain, partitioned, or a partition of a partitioned one) exists."""
    if name.full in service.topics or await service.partitions_of(name):
        return True
    if name.partition_index >= 0 and await service.partitions_of(name.base) > name.partition_index:
        return True
    return name.persistent and bool(await service.store.exists(ledger_path(name)))


async def open_existing_topic(service: BrokerService, name: TopicName) -> Any:
    """A non-partitioned topic (or one partition) that exists, loaded on this broker."""
    if not await topic_exists(service, name):
        raise TopicNotFound(f"topic {name} does not exist")
    return await service.get_topic(name)


async def subscription_names(service: BrokerService, name: TopicName) -> set[str]:
    """The subscriptions of a topic or partition: those loaded here and the stored cursors."""
    found: set[str] = set()
    topic = service.topics.get(name.full)
    if topic is not None:
        found.update(topic.subscriptions)
    if name.persistent:
        found.update(await service.store.children(cursors_path(name)))
    return found


async def topic_targets(service: BrokerService, name: TopicName) -> list[TopicName]:
    """The partitions of a partitioned topic, or the topic itself; TopicNotFound if none."""
    n = await service.partitions_of(name)
    if n:
        return [name.partition(i) for i in range(n)]
    if not await topic_exists(service, name):
        raise TopicNotFound(f"topic {name} does not exist")
    return [name]


def exclusive(service: BrokerService, key: str) -> AbstractAsyncContextManager[None]:
    """Keep ``get_topic(key)`` waiting while we unload or delete the topic."""
    return claimed(service._opening, key)


def disconnect(service: BrokerService, topic: Any, reason: str, *, subscription: Any = None) -> int:
    """Detach the producers and consumers of ``topic`` (only the consumers of
    ``subscription``, given one) through the front doors that attached them; they
    reconnect on their own (see :meth:`pigeon.broker._native.NativeProtocol.detach`)."""
    return sum(
        door.detach(topic, reason, subscription=subscription) for door in service.front_doors
    )


def active(topic: Any) -> bool:
    return bool(topic.producers) or any(s.consumers for s in topic.subscriptions.values())


async def ignore_missing(coro: Any) -> None:
    try:
        await coro
    except NoSuchNode:
        pass


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
                if t is not None and active(t):
                    raise SubscriptionBusy(
                        f"topic {name} has connected producers or consumers; use force"
                    )
        for p in parts:
            await _delete_one(service, p, force=True)
        await ignore_missing(service.store.delete(partitioned_topic_path(name)))
        log.info("partitioned topic deleted topic=%s partitions=%s", name, n)
        return
    if not await topic_exists(service, name):
        raise TopicNotFound(f"topic {name} does not exist")
    if name.partition_index >= 0 and await service.partitions_of(name.base) > name.partition_index:
        raise NotSupported(f"{name} is a partition of {name.base}: delete the partitioned topic")
    await _delete_one(service, name, force=force)
    log.info("topic deleted topic=%s", name)


async def _delete_one(service: BrokerService, name: TopicName, *, force: bool) -> None:
    async with exclusive(service, name.full):
        topic = service.topics.get(name.full)
        if topic is not None:
            if active(topic) and not force:
                raise SubscriptionBusy(
                    f"topic {name} has connected producers or consumers; use force"
                )
            del service.topics[name.full]
            topic.unloaded = True
            disconnect(service, topic, "topic deleted")
            await topic.close_subscriptions()
            await topic.close()
            await _compaction_stopped(topic)
        if name.persistent:
            await _delete_data(service, name)


async def _compaction_stopped(topic: Any) -> None:
    """Wait (bounded) for a compaction of the closed ``topic`` to stop: it records or
    deletes its compacted ledger before the deletion reads what to delete."""
    ledger = getattr(topic, "ledger", None)
    if ledger is not None:
        with trio.move_on_after(_COMPACTION_STOP_S):
            await ledger.compaction_stopped()


async def _delete_data(service: BrokerService, name: TopicName) -> None:
    store = service.store
    stat = await store.get(ledger_path(name))
    doc = json.loads(stat.value) if stat else {}
    segments = [SegmentInfo.from_doc(s) for s in doc.get("segments", [])]
    await ignore_missing(store.delete(cursors_path(name), recursive=True))
    await ignore_missing(store.delete(dedup_path(name)))
    await ignore_missing(store.delete(producer_epoch_path(name)))
    for seg in segments:
        await ignore_missing(store.delete(segment_path(seg.id)))
    # the compacted ledger and one written and not recorded: their nodes go, the
    # bookies' GC removes their copies
    compacted = (doc.get("compacted") or {}).get("id")
    for ledger_id in (compacted, doc.get("compaction_pending")):
        if ledger_id is not None:
            await ignore_missing(store.delete(segment_path(int(ledger_id))))
    # the offloaded objects before the ledger (a crash in between leaves none behind)...
    # (with those of segments removed before whose deletion did not finish)
    await _delete_offloaded(
        service,
        [loc for seg in segments for loc in seg.offloaded_objects()]
        + [dict(loc) for loc in doc.get("offload_deleting", [])],
    )
    if stat is not None:
        await ignore_missing(store.delete(ledger_path(name)))
    # ...and the keys of uploads not recorded once more after it: an upload still running
    # either finished before this, or finds its segment gone and deletes what it wrote
    await _delete_offloaded(
        service, [seg.offload_pending for seg in segments if seg.offload_pending is not None]
    )
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


async def _delete_offloaded(service: BrokerService, locations: list[dict[str, Any]]) -> None:
    for location in locations:
        if service.offloader is None:
            log.warning("offloaded segment kept: no offloader location=%s", location)
            continue
        try:
            await service.offloader.delete(location)
        except PigeonError as exc:
            log.warning("offloaded delete failed location=%s error=%s", location, exc)


async def unload_topic(service: BrokerService, name: TopicName) -> list[str]:
    """Close the topic (or each loaded partition) on this broker; clients re-attach."""
    targets = await topic_targets(service, name)
    unloaded = []
    for t in targets:
        if await _unload_one(service, t):
            unloaded.append(t.full)
    return unloaded


async def _unload_one(service: BrokerService, name: TopicName) -> bool:
    async with exclusive(service, name.full):
        topic = service.topics.pop(name.full, None)
        if topic is None:
            return False
        topic.unloaded = True
        disconnect(service, topic, "topic unloaded")
        await topic.close_subscriptions()
        await topic.close()
        await topic.snapshot_dedup()
    log.info("topic unloaded topic=%s", name)
    return True


def broker_id(service: BrokerService) -> str:
    if service.address is None:
        return f"{service.config.host}:{service.config.port}"
    return f"{service.address[0]}:{service.address[1]}"


def ownership_of(service: BrokerService) -> Any:
    """The service's bundle ownership (None before it runs, or in builds without it)."""
    return getattr(service, "ownership", None)


def bundle_ranges(count: int) -> list[str]:
    """The bundles of a namespace split in ``count`` (``Ownership.bundle_of``'s ranges)."""
    size = FULL_RANGE // count
    out = []
    for i in range(count):
        start = i * size
        end = FULL_RANGE if i == count - 1 else start + size
        out.append(f"0x{start:08x}_0x{end:08x}")
    return out


def namespace_bundles(service: BrokerService) -> list[str]:
    ownership = ownership_of(service)
    return bundle_ranges(ownership.bundles) if ownership is not None else [FULL_BUNDLE]


def bundle_of(service: BrokerService, name: TopicName) -> str:
    ownership = ownership_of(service)
    return str(ownership.bundle_of(name)) if ownership is not None else FULL_BUNDLE


async def bundle_owner(service: BrokerService, namespace: str, bundle: str) -> str | None:
    if ownership_of(service) is None:
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


async def unload_bundle(service: BrokerService, namespace: str, bundle: str) -> list[str]:
    """Close the bundle's loaded topics here and give the bundle up; clients look the
    topics up again (and the least-loaded broker takes the bundle)."""
    split_namespace(namespace)
    await require_namespace(service, namespace)
    if bundle not in namespace_bundles(service):
        raise NoSuchNode(
            f"namespace {namespace} has no bundle {bundle!r} "
            f"(it has {', '.join(namespace_bundles(service))})"
        )
    owner = await bundle_owner(service, namespace, bundle)
    if owner is not None and owner != broker_id(service):
        raise NotOwner(f"bundle {namespace}/{bundle} is owned by {owner}: ask that broker")
    unloaded = []
    ownership = ownership_of(service)
    path = f"{OWNERSHIP_PATH}/{namespace}/{bundle}"
    async with ownership.release(path) if ownership is not None else contextlib.nullcontext():
        for key, topic in sorted(service.topics.items()):
            if topic.name.namespace_name != namespace or bundle_of(service, topic.name) != bundle:
                continue
            if await _unload_one(service, topic.name):
                unloaded.append(key)
    log.info("bundle unloaded namespace=%s bundle=%s topics=%s", namespace, bundle, len(unloaded))
    return unloaded


# ---------------------------------------------------------------------- every topic


async def drop_all_topics(service: BrokerService) -> None:
    """The metadata session expired: another broker may own our bundles now."""
    for door in service.front_doors:
        door.close_all()  # clients reconnect through a new lookup
    topics, service.topics = service.topics, {}
    # at once, and 5 s for all: the new session waits for this (it took 5 s per
    # topic one after the other, so a broker with a few topics stayed away ~20 s)
    with trio.move_on_after(5):
        async with trio.open_nursery() as nursery:
            for topic in topics.values():
                nursery.start_soon(topic.close)


async def close_all_topics(service: BrokerService) -> None:
    """Shutdown: every topic at once, each within 20 s."""

    async def close(topic: Any) -> None:
        async with trio.open_nursery() as nursery:
            for sub in list(topic.subscriptions.values()):
                nursery.start_soon(_bounded, 5, sub.persist)
        await _bounded(10, topic.close)
        await _bounded(5, topic.snapshot_dedup)

    async with trio.open_nursery() as nursery:
        for topic in list(service.topics.values()):
            nursery.start_soon(close, topic)


async def _bounded(seconds: float, fn: Callable[[], Awaitable[Any]]) -> None:
    with trio.move_on_after(seconds):
        await fn()
