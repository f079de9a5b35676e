"""Authorization: may this role do this here?  Checked once per attach or admin call.

Who may do what, as in Pulsar:

* **superusers** (``superuser_roles`` in the broker's configuration) may do everything;
* **tenant admins** (``admin_roles`` of a tenant) administer the tenant's namespaces and
  topics (policies, permissions, topics, subscriptions) and may produce and consume there;
* other roles get **permissions** per namespace (``permissions`` policy: role → actions)
  or per topic (``topic_permissions``: topic → role → actions); the actions are
  ``produce`` and ``consume`` (``functions``, ``sources``, ``sinks``, ``packages`` are
  accepted and kept for later use).  A grant on a partitioned topic covers its
  partitions;
* with the namespace policy ``subscription_auth_mode = "prefix"`` a role may only use
  subscriptions whose names start with the role's name.

A denial is an :class:`AuthorizationError` naming the role and the action; nothing here
runs per message.  Permissions live in the namespace policies (the metadata store), so
a grant made through any broker applies on every broker once its policy watch sees it.
Tenants are read through a short-lived cache (:data:`TENANT_CACHE_S`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Final

import trio

from pigeon.broker._policies import NamespacePolicies, PolicyStore, TenantInfo
from pigeon.core import TopicName
from pigeon.core.errors import AuthorizationError, InvalidArgument, NoSuchNode

__all__ = ["ACTIONS", "Authorization", "check_actions", "topic_key"]

log = logging.getLogger(__name__)

#: actions a namespace or topic permission may hold (Pulsar's AuthAction names)
ACTIONS: Final = ("produce", "consume", "functions", "sources", "sinks", "packages")
#: how long a tenant's admin roles are taken from the cache before being read again
TENANT_CACHE_S: Final = 2.0


def topic_key(topic: TopicName) -> str:
    """The key of ``topic``'s grants in its namespace's ``topic_permissions``: the local
    name of the (partitioned) topic, ``non-persistent://`` before it for a non-persistent
    one (a grant on one is no grant on the persistent topic of the same name)."""
    local = topic.base.local
    return local if topic.persistent else f"non-persistent://{local}"


def check_actions(actions: Iterable[str]) -> list[str]:
    """The actions, sorted and without repeats; :class:`InvalidArgument` for an unknown one."""
    out = sorted({a.strip().lower() for a in actions if a.strip()})
    unknown = [a for a in out if a not in ACTIONS]
    if unknown:
        raise InvalidArgument(
            f"unknown action {', '.join(map(repr, unknown))} (actions: {', '.join(ACTIONS)})"
        )
    if not out:
        raise InvalidArgument(f"name at least one action ({', '.join(ACTIONS)})")
    return out


class Authorization:
    """The broker's authorization checks (a no-op when ``authorization_enabled`` is off)."""

    def __init__(
        self,
        policies: PolicyStore,
        *,
        enabled: bool,
        superuser_roles: Iterable[str] = (),
    ) -> None:
        self.policies = policies
        self.enabled = enabled
        self.superuser_roles = frozenset(superuser_roles)
        self._tenants: dict[str, tuple[float, TenantInfo | None]] = {}

    # -- who ---------------------------------------------------------------------------

    def is_superuser(self, role: str | None) -> bool:
        return role is not None and role in self.superuser_roles

    async def tenant(self, tenant: str) -> TenantInfo | None:
        now = trio.current_time()
        cached = self._tenants.get(tenant)
        if cached is not None and now - cached[0] < TENANT_CACHE_S:
            return cached[1]
        try:
            info: TenantInfo | None = await self.policies.get_tenant(tenant)
        except NoSuchNode:
            info = None
        self._tenants[tenant] = (now, info)
        return info

    def forget_tenant(self, tenant: str) -> None:
        """A tenant changed through this broker: read it again on the next check."""
        self._tenants.pop(tenant, None)

    async def is_tenant_admin(self, role: str | None, tenant: str) -> bool:
        if role is None:
            return False
        if self.is_superuser(role):
            return True
        info = await self.tenant(tenant)
        return info is not None and role in info.admin_roles

    async def actions_of(self, role: str, topic: TopicName) -> set[str]:
        """What ``role`` was granted on ``topic`` (namespace and topic grants together)."""
        policies = await self._policies(topic.namespace_name)
        granted = set(policies.permissions.get(role, ()))
        granted.update(policies.topic_permissions.get(topic_key(topic), {}).get(role, ()))
        return granted

    async def _policies(self, namespace: str) -> NamespacePolicies:
        try:
            return await self.policies.get(namespace)
        except NoSuchNode:
            return NamespacePolicies()

    # -- checks (raise AuthorizationError) ----------------------------------------------

    def _deny(self, role: str | None, action: str, what: str) -> AuthorizationError:
        who = f"role {role!r}" if role is not None else "an unauthenticated client"
        return AuthorizationError(f"{who} may not {action} {what}")

    async def check_topic(self, role: str | None, action: str, topic: TopicName) -> None:
        """``action`` (``produce`` or ``consume``) on ``topic``."""
        if not self.enabled or await self.is_tenant_admin(role, topic.tenant):
            return
        if role is None or action not in await self.actions_of(role, topic):
            raise self._deny(role, action, f"on {topic.base.full}")

    async def check_produce(self, role: str | None, topic: TopicName) -> None:
        await self.check_topic(role, "produce", topic)

    async def check_consume(self, role: str | None, topic: TopicName, subscription: str) -> None:
        """Consume from ``topic`` through ``subscription`` (its name may have to start
        with the role's: ``subscription_auth_mode = "prefix"``)."""
        await self.check_topic(role, "consume", topic)
        if not self.enabled or await self.is_tenant_admin(role, topic.tenant):
            return
        policies = await self._policies(topic.namespace_name)
        if policies.subscription_auth_mode == "prefix" and not subscription.startswith(
            role or "\0"
        ):
            raise AuthorizationError(
                f"role {role!r} may only use subscriptions whose names start with {role!r}"
                f" in {topic.namespace_name} (subscription_auth_mode prefix), not"
                f" {subscription!r}"
            )

    async def check_lookup(self, role: str | None, topic: TopicName) -> None:
        """Find or describe ``topic``: produce or consume rights (or admin) suffice."""
        if not self.enabled or await self.is_tenant_admin(role, topic.tenant):
            return
        if role is None or not ({"produce", "consume"} & await self.actions_of(role, topic)):
            raise self._deny(role, "look up", f"{topic.base.full} (it needs produce or consume)")

    async def check_tenant_admin(self, role: str | None, tenant: str, action: str) -> None:
        """An administrative ``action`` (words, for the message) on ``tenant``'s things."""
        if not self.enabled or await self.is_tenant_admin(role, tenant):
            return
        raise self._deny(role, action, f"(it needs an admin role of tenant {tenant!r})")

    def check_superuser(self, role: str | None, action: str) -> None:
        """A cluster-wide ``action`` (create a tenant, unload a broker's bundles, ...)."""
        if not self.enabled or self.is_superuser(role):
            return
        raise self._deny(role, action, "(it needs a superuser role)")

    # -- grants ---------------------------------------------------------------------------

    async def grant(self, namespace: str, role: str, actions: Iterable[str]) -> dict[str, Any]:
        """Give ``role`` these actions on every topic of ``namespace`` (replacing what it
        had there, as Pulsar's grant-permission does)."""
        acts = check_actions(actions)
        policies = await self.policies.get(namespace)
        permissions = {**policies.permissions, _role(role): acts}
        await self.policies.set(namespace, {"permissions": permissions})
        return permissions

    async def revoke(self, namespace: str, role: str) -> dict[str, Any]:
        policies = await self.policies.get(namespace)
        if role not in policies.permissions:
            raise NoSuchNode(f"role {role!r} has no permissions on {namespace}")
        permissions = {k: v for k, v in policies.permissions.items() if k != role}
        await self.policies.set(namespace, {"permissions": permissions})
        return permissions

    async def grant_topic(
        self, topic: TopicName, role: str, actions: Iterable[str]
    ) -> dict[str, Any]:
        acts = check_actions(actions)
        namespace, base = topic.namespace_name, topic_key(topic)
        policies = await self.policies.get(namespace)
        grants = dict(policies.topic_permissions)
        grants[base] = {**grants.get(base, {}), _role(role): acts}
        await self.policies.set(namespace, {"topic_permissions": grants})
        return grants[base]

    async def revoke_topic(self, topic: TopicName, role: str) -> dict[str, Any]:
        namespace, base = topic.namespace_name, topic_key(topic)
        policies = await self.policies.get(namespace)
        grants = dict(policies.topic_permissions)
        if role not in grants.get(base, {}):
            raise NoSuchNode(f"role {role!r} has no permissions on {topic.base.full}")
        remaining = {k: v for k, v in grants[base].items() if k != role}
        if remaining:
            grants[base] = remaining
        else:
            del grants[base]
        await self.policies.set(namespace, {"topic_permissions": grants})
        return remaining


def _role(role: str) -> str:
    role = role.strip()
    if not role or len(role) > 256 or any(c.isspace() for c in role):
        raise InvalidArgument(f"bad role {role!r}: 1-256 characters, no spaces")
    return role
