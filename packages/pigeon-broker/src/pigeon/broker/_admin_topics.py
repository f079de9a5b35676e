"""Admin operations on tenants, namespaces and topics, and topic statistics.

Part of the admin API's operations (see :mod:`pigeon.broker._admin_ops`): they raise
:mod:`pigeon.core.errors` classes for every expected failure and return plain JSON-ready
dicts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from typing import TYPE_CHECKING, Any

from pigeon.broker._lifecycle import (
    delete_topic,
    open_existing_topic,
    require_namespace,
    topic_exists,
    topic_targets,
)
from pigeon.broker._policies import NamespacePolicies, TenantInfo, split_namespace
from pigeon.broker._service import BrokerService
from pigeon.core import TopicName
from pigeon.core.errors import (
    InvalidArgument,
    InvalidTopicName,
    NodeExists,
    NoSuchNode,
    NotConfigured,
    NotEmpty,
    NotSupported,
    TopicExists,
    TopicNotFound,
)
from pigeon.core.paths import TENANTS_PATH

if TYPE_CHECKING:
    from pigeon.broker._metrics import BrokerMonitor

__all__ = [
    "check_subscription_name",
    "compact_topic",
    "compaction_status",
    "create_namespace",
    "create_tenant",
    "update_tenant",
    "create_topic",
    "delete_namespace",
    "delete_tenant",
    "internal_stats",
    "list_namespaces",
    "list_topics",
    "offload_status",
    "offload_topic",
    "loaded_topics_stats",
    "parse_message_id",
    "tenant_info",
    "topic_metadata",
    "topic_name",
    "topic_stats",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- names & checks


def topic_name(domain: str, tenant: str, namespace: str, topic: str) -> TopicName:
    """The topic a ``/topics/{domain}/{tenant}/{namespace}/{topic}`` URL names."""
    if domain not in ("persistent", "non-persistent"):
        raise InvalidTopicName(f"domain must be persistent or non-persistent, got {domain!r}")
    return TopicName.parse(f"{domain}://{tenant}/{namespace}/{topic}")


def check_subscription_name(name: str) -> None:
    """A name that may name a stored subscription: lenient, so one created before names
    were checked (``pigeon.core.check_subscription_name``) can still be looked up and
    deleted; new subscriptions are checked by that rule."""
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


async def update_tenant(
    service: BrokerService, tenant: str, info: dict[str, Any]
) -> dict[str, Any]:
    """Replace a tenant's admin roles and clusters (NoSuchNode if it does not exist;
    BadVersion if another change won the race)."""
    path = f"{TENANTS_PATH}/{tenant}"
    stat = await service.policies.store.get(path)
    if stat is None:
        raise NoSuchNode(f"tenant {tenant!r} does not exist")
    value = json.dumps(dataclasses.asdict(TenantInfo(**info))).encode()
    await service.policies.store.set(path, value, version=stat.version)
    log.info("tenant updated tenant=%s admin_roles=%s", tenant, ",".join(info["admin_roles"]))
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
    return {
        "name": sub.name,
        "type": sub.type,
        "durable": bool(sub.durable),
        "consumers": len(sub.consumers),
        "backlog": sub.backlog(),
        "msgs_out": sub.msgs_out,
        "bytes_out": sub.bytes_out,
        "msg_rate_out": round(rates.msg_rate_out, 3) if rates else 0.0,
        "msg_throughput_out": round(rates.msg_throughput_out, 3) if rates else 0.0,
        "consumer_names": [c.name for c in sub.consumers],
        **sub.storage_stats(),
    }


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
        **topic.storage_stats(),
        "backlog": max((s["backlog"] for s in subs.values()), default=0),
        "backlog_bytes": topic.backlog_bytes(),
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
        await topic.load_subscriptions()
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


async def offload_topic(
    service: BrokerService, name: TopicName, size_threshold: int
) -> dict[str, Any]:
    """Start offloading the topic's oldest closed segments until at most
    ``size_threshold`` bytes are only on bookies (Pulsar's ``topics offload``)."""
    topic = await _offloadable(service, name, start=True)
    ledger = topic.ledger
    # by hand, damaged segments are retried at once (an operator may have repaired them)
    if not ledger.offloading and ledger.offload_candidates(size_threshold, retry_damaged=True):
        ledger.offload_status = {"status": "RUNNING", "last_error": ""}
        service.nursery.start_soon(
            functools.partial(topic.offload_in_background, size_threshold, retry_damaged=True)
        )
    return offload_status_of(topic)


async def offload_status(service: BrokerService, name: TopicName) -> dict[str, Any]:
    """Where the topic's segments live and how the last offload went."""
    return offload_status_of(await _offloadable(service, name, start=False))


async def compact_topic(service: BrokerService, name: TopicName) -> dict[str, Any]:
    """Start compacting the topic in the background (Pulsar's ``topics compact``)."""
    if await service.partitions_of(name):
        raise NotSupported(f"{name} is partitioned: ask for one partition ({name}-partition-<i>)")
    topic = await open_existing_topic(service, name)
    if not topic.persistent:
        raise NotConfigured(f"{name} is not persistent: nothing to compact")
    topic.start_compaction()
    return compaction_status_of(topic)


async def compaction_status(service: BrokerService, name: TopicName) -> dict[str, Any]:
    """How the topic's last compaction went (Pulsar's ``topics compaction-status``)."""
    if await service.partitions_of(name):
        raise NotSupported(f"{name} is partitioned: ask for one partition ({name}-partition-<i>)")
    return compaction_status_of(await open_existing_topic(service, name))


def compaction_status_of(topic: Any) -> dict[str, Any]:
    ledger = getattr(topic, "ledger", None)
    if ledger is None:
        return {"status": "NOT_RUN", "last_error": ""}
    c = ledger.compacted
    return {
        **ledger.compaction_status,
        "compacted_ledger": c.id if c is not None else None,
        "horizon": c.horizon if c is not None else None,
    }


async def _offloadable(service: BrokerService, name: TopicName, *, start: bool) -> Any:
    """The loaded topic (404 if it does not exist); with ``start``, checks that it can be
    offloaded here (409 when this broker has no offloader)."""
    if await service.partitions_of(name):
        raise NotSupported(f"{name} is partitioned: ask for one partition ({name}-partition-<i>)")
    topic = await open_existing_topic(service, name)
    if start and not topic.persistent:
        raise NotConfigured(f"{name} is not persistent: nothing to offload")
    if start and service.offloader is None:
        raise NotConfigured(
            "this broker has no offloader: set managed_ledger_offload_driver in [broker]"
        )
    return topic


def offload_status_of(topic: Any) -> dict[str, Any]:
    ledger = getattr(topic, "ledger", None)
    if ledger is None:  # non-persistent: nothing stored, nothing offloaded
        return {
            "status": "NOT_RUN",
            "offloaded_segments": 0,
            "offloaded_bytes": 0,
            "bookie_only_bytes": 0,
            "damaged_segments": [],
        }
    offloaded = [s for s in ledger.segments if s.offload is not None]
    first = next((s for s in ledger.segments if s.offload is None), None)
    return {
        "status": ledger.offload_status.get("status", "NOT_RUN"),
        "last_error": ledger.offload_status.get("last_error", ""),
        "offloaded_segments": len(offloaded),
        "offloaded_bytes": sum(s.size for s in offloaded),
        "bookie_only_bytes": sum(s.size for s in ledger.segments if s.offload is None),
        "first_unoffloaded_message_id": f"{first.id}:0" if first is not None else None,
        "damaged_segments": ledger.offload_damage(),
    }


async def internal_stats(service: BrokerService, name: TopicName) -> dict[str, Any]:
    """The managed ledger's segments and each cursor's state (one topic or partition)."""
    if await service.partitions_of(name):
        raise NotSupported(f"{name} is partitioned: ask for one partition ({name}-partition-<i>)")
    topic = await open_existing_topic(service, name)
    await topic.load_subscriptions()
    return {"topic": name.full, "persistent": topic.persistent, **topic.internal_stats()}


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
