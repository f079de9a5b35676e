"""Admin views of the cluster: brokers, their load, bundles, bookies and health.

Part of the admin API's operations (see :mod:`pigeon.broker._admin_ops`).
"""

from __future__ import annotations

import os
import resource
import time
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._lifecycle import (
    broker_id,
    bundle_of,
    bundle_owner,
    namespace_bundles,
    ownership_of,
    require_namespace,
)
from pigeon.broker._policies import split_namespace
from pigeon.broker._service import BrokerService
from pigeon.core.errors import NoSuchNode, PigeonError
from pigeon.core.paths import ROOT

if TYPE_CHECKING:
    from pigeon.broker._metrics import BrokerMonitor

__all__ = [
    "bookie",
    "bookies",
    "broker_load",
    "brokers",
    "bundles",
    "cluster_health",
    "owned_bundles",
]


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


def anonymous_health(health: dict[str, Any]) -> dict[str, Any]:
    """``health`` as a caller without credentials sees it: the status and whether each
    check passed; no broker addresses, process ids, errors, topic or client counts."""
    return {
        **health,
        "brokers": [],
        "checks": {name: {"ok": check["ok"]} for name, check in health["checks"].items()},
        "topics": None,
        "connections": None,
    }


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
