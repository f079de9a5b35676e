"""Tenants, namespaces and namespace policies, kept in the metadata store.

* ``/pigeon/tenants/<tenant>`` — JSON ``{"admin_roles": [...], "allowed_clusters": [...]}``
* ``/pigeon/namespaces/<tenant>/<namespace>`` — JSON of :class:`NamespacePolicies`

``public`` / ``public/default`` exist from the first broker start.  Brokers cache policies
and refresh them from a watch, so a change made through any broker (or the admin API)
applies everywhere within moments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import trio

from pigeon.broker._schema_compat import COMPATIBILITY_STRATEGIES, DEFAULT_STRATEGY
from pigeon.broker._watch import watch_forever
from pigeon.core.errors import (
    InvalidArgument,
    NodeExists,
    NoSuchNode,
    NotEmpty,
    PigeonError,
)
from pigeon.core.paths import NAMESPACES_PATH, TENANTS_PATH

__all__ = ["BACKLOG_POLICIES", "NamespacePolicies", "PolicyStore", "TenantInfo"]

log = logging.getLogger(__name__)

BACKLOG_POLICIES = ("producer_request_hold", "producer_exception", "consumer_backlog_eviction")
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.=:")


@dataclass
class TenantInfo:
    admin_roles: list[str] = field(default_factory=list)
    allowed_clusters: list[str] = field(default_factory=list)


@dataclass
class NamespacePolicies:
    """Policies of one namespace. ``None``/-1 mean "broker default"/"unlimited" as noted."""

    #: keep acknowledged data this long (seconds); 0: delete once every subscription has
    #: consumed it (a topic without subscriptions keeps its data); -1: forever
    retention_time_s: float = 0.0
    #: keep at most this much acknowledged data (MiB); 0: none; -1: no size limit
    retention_size_mb: float = 0.0
    #: messages older than this (seconds) are acknowledged for every subscription; 0: off
    message_ttl_s: float = 0.0
    #: backlog (unacknowledged bytes of the slowest subscription) limit; -1: none
    backlog_quota_bytes: int = -1
    backlog_quota_policy: Literal[
        "producer_request_hold", "producer_exception", "consumer_backlog_eviction"
    ] = "producer_request_hold"
    #: drop batches whose (producer name, sequence id) was stored already
    deduplication: bool = True
    #: replication of new segments; None: the broker's configuration
    ensemble_size: int | None = None
    write_quorum: int | None = None
    ack_quorum: int | None = None
    #: largest accepted batch in bytes; None: the broker's max_message_size
    max_message_size: int | None = None
    #: at an entry no replica holds intact: "skip" past it or "fail" (delivery stops
    #: there); None: the broker's corrupt_entry_policy
    corrupt_entry_policy: Literal["skip", "fail"] | None = None
    #: tiered storage: when a topic's closed segments not yet offloaded hold more than
    #: this many bytes, the oldest are offloaded (the broker's offload driver); -1: off
    offload_threshold_bytes: int = -1
    #: bookie copies of an offloaded segment are deleted this long after its offload
    offload_deletion_lag_s: float = 4 * 3600.0
    #: topic compaction: compact when more than this many bytes were stored since the
    #: last compaction (checked periodically); 0: off (Pulsar's ``compaction_threshold``)
    compaction_threshold: int = 0
    #: role -> actions on every topic of the namespace (``grant-permission``)
    permissions: dict[str, list[str]] = field(default_factory=dict)
    #: topic (local name, partitioned topics by their base name) -> role -> actions
    topic_permissions: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    #: "prefix": a role may only use subscriptions whose names start with the role
    subscription_auth_mode: Literal["none", "prefix"] = "none"
    #: how a new schema version must relate to the stored ones (Pulsar's
    #: SchemaCompatibilityStrategy in snake_case; Pulsar's broker default is FULL)
    schema_compatibility_strategy: str = DEFAULT_STRATEGY
    #: a producer with a compatible schema not yet registered adds it as a new version
    is_allow_auto_update_schema: bool = True
    #: a producer without a schema is refused on a topic that has one
    schema_validation_enforced: bool = False

    def validate(self) -> None:
        if self.backlog_quota_policy not in BACKLOG_POLICIES:
            raise InvalidArgument(
                f"backlog_quota_policy must be one of {', '.join(BACKLOG_POLICIES)}, "
                f"got {self.backlog_quota_policy!r}"
            )
        if self.retention_time_s < -1 or self.retention_size_mb < -1:
            raise InvalidArgument("retention values must be -1 (unlimited), 0 or positive")
        if self.offload_threshold_bytes < -1:
            raise InvalidArgument("offload_threshold_bytes must be -1 (off) or >= 0")
        if self.offload_deletion_lag_s < 0:
            raise InvalidArgument("offload_deletion_lag_s must be >= 0")
        if self.compaction_threshold < 0:
            raise InvalidArgument("compaction_threshold must be 0 (off) or positive")
        if self.message_ttl_s < 0:
            raise InvalidArgument("message_ttl_s must be 0 (off) or positive")
        q = (self.ensemble_size, self.write_quorum, self.ack_quorum)
        if any(v is not None for v in q):
            if any(v is None for v in q):
                raise InvalidArgument("set ensemble_size, write_quorum and ack_quorum together")
            e, w, a = (int(v or 0) for v in q)
            if not e >= w >= a >= 1:
                raise InvalidArgument(
                    "replication needs ensemble_size >= write_quorum >= ack_quorum >= 1"
                )
        if self.max_message_size is not None and self.max_message_size <= 0:
            raise InvalidArgument("max_message_size must be positive")
        if self.corrupt_entry_policy not in (None, "skip", "fail"):
            raise InvalidArgument("corrupt_entry_policy must be 'skip', 'fail' or null")
        if self.schema_compatibility_strategy not in COMPATIBILITY_STRATEGIES:
            raise InvalidArgument(
                "schema_compatibility_strategy must be one of "
                f"{', '.join(COMPATIBILITY_STRATEGIES)}, got {self.schema_compatibility_strategy!r}"
            )
        if self.subscription_auth_mode not in ("none", "prefix"):
            raise InvalidArgument("subscription_auth_mode must be 'none' or 'prefix'")
        if not _is_grants(self.permissions) or not (
            isinstance(self.topic_permissions, dict)
            and all(isinstance(k, str) and _is_grants(v) for k, v in self.topic_permissions.items())
        ):
            raise InvalidArgument(
                "permissions must map roles to lists of actions (topic_permissions: topics"
                " to such maps)"
            )

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> NamespacePolicies:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise InvalidArgument(f"unknown namespace policy {', '.join(map(repr, unknown))}")
        policies = cls(**doc)
        policies.validate()
        return policies

    def updated(self, changes: dict[str, Any]) -> NamespacePolicies:
        return NamespacePolicies.from_dict({**dataclasses.asdict(self), **changes})


def _is_grants(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(role, str)
        and isinstance(actions, list)
        and all(isinstance(a, str) for a in actions)
        for role, actions in value.items()
    )


def _check_name(kind: str, name: str) -> None:
    if not name or not set(name) <= _NAME_OK:
        raise InvalidArgument(f"invalid {kind} name {name!r}")


def split_namespace(namespace: str) -> tuple[str, str]:
    tenant, _, ns = namespace.partition("/")
    if "/" in ns:
        raise InvalidArgument(f"namespace must look like tenant/namespace, got {namespace!r}")
    _check_name("tenant", tenant)
    _check_name("namespace", ns)
    return tenant, ns


class PolicyStore:
    """Reads and writes tenants and namespaces; caches policies for the hot path."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._cache: dict[str, NamespacePolicies] = {}

    async def ensure_defaults(self) -> None:
        for coro in (
            self.create_tenant("public", TenantInfo()),
            self.create_namespace("public/default", NamespacePolicies()),
        ):
            try:
                await coro
            except NodeExists:
                pass

    # -- tenants ----------------------------------------------------------------------

    async def create_tenant(self, tenant: str, info: TenantInfo) -> None:
        _check_name("tenant", tenant)
        await self.store.create(
            f"{TENANTS_PATH}/{tenant}", json.dumps(dataclasses.asdict(info)).encode()
        )

    async def tenants(self) -> list[str]:
        result: list[str] = await self.store.children(TENANTS_PATH)
        return result

    async def get_tenant(self, tenant: str) -> TenantInfo:
        stat = await self.store.get(f"{TENANTS_PATH}/{tenant}")
        if stat is None:
            raise NoSuchNode(f"tenant {tenant!r} does not exist")
        return TenantInfo(**json.loads(stat.value))

    async def delete_tenant(self, tenant: str) -> None:
        if await self.namespaces(tenant):
            raise NotEmpty(f"tenant {tenant!r} still has namespaces")
        try:
            await self.store.delete(f"{TENANTS_PATH}/{tenant}")
        except NoSuchNode:
            raise NoSuchNode(f"tenant {tenant!r} does not exist") from None

    # -- namespaces -------------------------------------------------------------------

    async def create_namespace(
        self, namespace: str, policies: NamespacePolicies | None = None
    ) -> None:
        tenant, ns = split_namespace(namespace)
        if await self.store.get(f"{TENANTS_PATH}/{tenant}") is None:
            raise NoSuchNode(f"tenant {tenant!r} does not exist")
        policies = policies or NamespacePolicies()
        policies.validate()
        await self.store.create(f"{NAMESPACES_PATH}/{tenant}/{ns}", policies.to_json())
        self._cache[namespace] = policies

    async def namespaces(self, tenant: str) -> list[str]:
        return [f"{tenant}/{ns}" for ns in await self.store.children(f"{NAMESPACES_PATH}/{tenant}")]

    async def exists(self, namespace: str) -> bool:
        tenant, ns = split_namespace(namespace)
        return bool(await self.store.exists(f"{NAMESPACES_PATH}/{tenant}/{ns}"))

    async def delete_namespace(self, namespace: str) -> None:
        tenant, ns = split_namespace(namespace)
        try:
            await self.store.delete(f"{NAMESPACES_PATH}/{tenant}/{ns}")
        except NoSuchNode:
            raise NoSuchNode(f"namespace {namespace!r} does not exist") from None
        self._cache.pop(namespace, None)

    async def get(self, namespace: str) -> NamespacePolicies:
        """Policies of ``namespace`` (read through the cache)."""
        cached = self._cache.get(namespace)
        if cached is not None:
            return cached
        return await self.load(namespace)

    async def load(self, namespace: str) -> NamespacePolicies:
        tenant, ns = split_namespace(namespace)
        stat = await self.store.get(f"{NAMESPACES_PATH}/{tenant}/{ns}")
        if stat is None:
            raise NoSuchNode(f"namespace {namespace!r} does not exist")
        policies = NamespacePolicies.from_dict(json.loads(stat.value))
        self._cache[namespace] = policies
        return policies

    def cached(self, namespace: str) -> NamespacePolicies:
        """Policies from the cache, or the defaults when not loaded (hot path, no I/O)."""
        return self._cache.get(namespace) or NamespacePolicies()

    async def set(self, namespace: str, changes: dict[str, Any]) -> NamespacePolicies:
        """Change some policies of a namespace (compare-and-set against concurrent edits)."""
        tenant, ns = split_namespace(namespace)
        path = f"{NAMESPACES_PATH}/{tenant}/{ns}"
        for _attempt in range(10):
            stat = await self.store.get(path)
            if stat is None:
                raise NoSuchNode(f"namespace {namespace!r} does not exist")
            policies = NamespacePolicies.from_dict(json.loads(stat.value)).updated(changes)
            try:
                await self.store.set(path, policies.to_json(), version=stat.version)
            except PigeonError as exc:
                if type(exc).__name__ == "BadVersion":
                    continue
                raise
            self._cache[namespace] = policies
            return policies
        raise InvalidArgument(f"namespace {namespace!r} is being changed concurrently; try again")

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the cache current with changes made elsewhere; a metadata server that is
        away is waited for (with backoff), keeping the cached policies meanwhile."""

        async def watching(first: bool) -> None:
            if not first:
                for namespace in list(self._cache):  # changes may have been missed
                    with contextlib.suppress(PigeonError):
                        await self.load(namespace)

        async def event(event: Any) -> None:
            self._apply(event)

        await watch_forever(
            self.store,
            NAMESPACES_PATH,
            what="policies watch",
            on_watching=watching,
            on_event=event,
            task_status=task_status,
        )

    def _apply(self, event: Any) -> None:
        parts = event.path[len(NAMESPACES_PATH) + 1 :].split("/")
        if len(parts) != 2:
            return
        namespace = "/".join(parts)
        if event.value is None:
            self._cache.pop(namespace, None)
        else:
            try:
                self._cache[namespace] = NamespacePolicies.from_dict(json.loads(event.value))
            except (ValueError, PigeonError) as exc:
                log.warning("bad policies namespace=%s error=%s", namespace, exc)
