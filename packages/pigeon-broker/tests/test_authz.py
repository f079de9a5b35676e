"""Authorization rules (pigeon.broker._authz) on a real embedded metadata store: who may
produce, consume, look up and administer, and the grants that change it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pigeon.broker._authz import Authorization, check_actions
from pigeon.broker._policies import NamespacePolicies, PolicyStore, TenantInfo
from pigeon.core import TopicName
from pigeon.core.errors import AuthorizationError, InvalidArgument, NoSuchNode
from pigeon.core.metadata import EmbeddedMetadataStore
from pigeon.core.paths import TENANTS_PATH
from pigeon.core.testing import running_store

T_A = TopicName.parse("persistent://acme/orders/t")
T_B = TopicName.parse("persistent://globex/ledger/t")


@pytest.fixture
async def authz(tmp_path: Path) -> AsyncIterator[Authorization]:
    async with running_store(EmbeddedMetadataStore(tmp_path / "meta")) as store:
        policies = PolicyStore(store)
        await policies.create_tenant("acme", TenantInfo(admin_roles=["acme-admin"]))
        await policies.create_tenant("globex", TenantInfo(admin_roles=["globex-admin"]))
        await policies.create_namespace("acme/orders", NamespacePolicies())
        await policies.create_namespace("globex/ledger", NamespacePolicies())
        yield Authorization(policies, enabled=True, superuser_roles=["root"])


async def denied(coro: Any, *words: str) -> str:
    with pytest.raises(AuthorizationError) as info:
        await coro
    message = str(info.value)
    for word in words:
        assert word in message
    return message


async def test_a_role_without_grants_may_do_nothing(authz: Authorization) -> None:
    await denied(authz.check_produce("app", T_A), "'app'", "produce", "acme/orders/t")
    await denied(authz.check_consume("app", T_A, "sub"), "'app'", "consume")
    await denied(authz.check_lookup("app", T_A), "look up")
    await denied(authz.check_tenant_admin("app", "acme", "delete namespaces"), "tenant 'acme'")
    with pytest.raises(AuthorizationError, match="superuser"):
        authz.check_superuser("app", "create tenants")
    await denied(authz.check_produce(None, T_A), "unauthenticated")


async def test_a_superuser_may_do_everything(authz: Authorization) -> None:
    for topic in (T_A, T_B):
        await authz.check_produce("root", topic)
        await authz.check_consume("root", topic, "any")
        await authz.check_tenant_admin("root", topic.tenant, "anything")
    authz.check_superuser("root", "create tenants")


async def test_tenant_admins_rule_their_tenant_only(authz: Authorization) -> None:
    await authz.check_tenant_admin("acme-admin", "acme", "create namespaces")
    await authz.check_produce("acme-admin", T_A)
    await authz.check_consume("acme-admin", T_A, "s")
    # tenant A's role against tenant B's topic
    await denied(authz.check_produce("acme-admin", T_B), "'acme-admin'", "globex/ledger/t")
    await denied(authz.check_tenant_admin("acme-admin", "globex", "delete topics"), "globex")
    with pytest.raises(AuthorizationError):
        authz.check_superuser("acme-admin", "create tenants")


async def test_namespace_grants_and_revokes(authz: Authorization) -> None:
    await authz.grant("acme/orders", "app", ["produce"])
    await authz.check_produce("app", T_A)
    await authz.check_lookup("app", T_A)
    await denied(authz.check_consume("app", T_A, "s"), "consume")
    # a grant replaces what the role had (Pulsar's grant-permission)
    assert await authz.grant("acme/orders", "app", ["consume", "produce"]) == {
        "app": ["consume", "produce"]
    }
    await authz.check_consume("app", T_A, "s")
    # partitions are covered by the grant of their topic's namespace
    await authz.check_produce("app", T_A.partition(3))
    await authz.revoke("acme/orders", "app")
    await denied(authz.check_produce("app", T_A), "produce")
    with pytest.raises(NoSuchNode):
        await authz.revoke("acme/orders", "app")


async def test_topic_grants_cover_the_topic_and_its_partitions_only(
    authz: Authorization,
) -> None:
    await authz.grant_topic(T_A, "reader", ["consume"])
    await authz.check_consume("reader", T_A, "s")
    await authz.check_consume("reader", T_A.partition(0), "s")
    other = TopicName.parse("persistent://acme/orders/other")
    await denied(authz.check_consume("reader", other, "s"), "acme/orders/other")
    await authz.revoke_topic(T_A, "reader")
    await denied(authz.check_consume("reader", T_A, "s"))
    with pytest.raises(NoSuchNode):
        await authz.revoke_topic(T_A, "reader")


async def test_a_topic_grant_is_no_grant_on_the_other_domains_topic_of_that_name(
    authz: Authorization,
) -> None:
    volatile = TopicName.parse("non-persistent://acme/orders/t")
    await authz.grant_topic(T_A, "reader", ["consume"])
    await denied(authz.check_consume("reader", volatile, "s"), "non-persistent://acme/orders/t")
    await authz.grant_topic(volatile, "pusher", ["produce"])
    await authz.check_produce("pusher", volatile.partition(1))
    await denied(authz.check_produce("pusher", T_A), "persistent://acme/orders/t")
    await authz.revoke_topic(volatile, "pusher")
    await denied(authz.check_produce("pusher", volatile))
    await authz.check_consume("reader", T_A, "s")


async def test_subscription_prefix_mode(authz: Authorization) -> None:
    await authz.grant("acme/orders", "billing", ["consume"])
    await authz.check_consume("billing", T_A, "anything")
    await authz.policies.set("acme/orders", {"subscription_auth_mode": "prefix"})
    await authz.check_consume("billing", T_A, "billing-invoices")
    await denied(authz.check_consume("billing", T_A, "audit"), "'billing'", "'audit'", "prefix")
    # tenant admins are not bound by the prefix
    await authz.check_consume("acme-admin", T_A, "audit")


async def test_disabled_authorization_allows_everything(tmp_path: Path) -> None:
    async with running_store(EmbeddedMetadataStore(tmp_path / "m")) as store:
        authz = Authorization(PolicyStore(store), enabled=False)
        await authz.check_produce(None, T_A)
        await authz.check_consume("x", T_B, "s")
        await authz.check_tenant_admin(None, "nobody", "x")
        authz.check_superuser(None, "x")


async def test_tenant_admin_changes_are_seen_after_forget(authz: Authorization) -> None:
    await denied(authz.check_tenant_admin("newcomer", "acme", "x"))
    store = authz.policies.store
    await store.set(
        f"{TENANTS_PATH}/acme", b'{"admin_roles": ["newcomer"], "allowed_clusters": []}'
    )
    authz.forget_tenant("acme")
    await authz.check_tenant_admin("newcomer", "acme", "x")


def test_actions_are_checked() -> None:
    assert check_actions(["consume", " produce", "consume"]) == ["consume", "produce"]
    with pytest.raises(InvalidArgument, match="'fly'"):
        check_actions(["fly"])
    with pytest.raises(InvalidArgument, match="at least one"):
        check_actions([" "])


async def test_bad_roles_are_refused(authz: Authorization) -> None:
    with pytest.raises(InvalidArgument, match="bad role"):
        await authz.grant("acme/orders", "has space", ["produce"])
    with pytest.raises(InvalidArgument):
        await authz.grant("acme/orders", "", ["produce"])


def test_bad_permission_policies_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="permissions"):
        NamespacePolicies.from_dict({"permissions": {"app": "produce"}})
    with pytest.raises(InvalidArgument, match="subscription_auth_mode"):
        NamespacePolicies.from_dict({"subscription_auth_mode": "suffix"})
